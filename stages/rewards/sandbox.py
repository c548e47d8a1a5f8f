"""Run untrusted, model-written Python programs in a sandboxed subprocess (code-task rewards).

A run costs at most its `SandboxLimits`: a fork bomb, an infinite loop, a 10 GB allocation, an
output flood or a network attempt ends that run with a status, never the pipeline.

Each run gets a fresh directory and a launcher (`python -I -S`, started in a new session, its code
and configuration read from a memfd, so that its command line, pid 1's in the sandbox, names no
host path) that sets the sandbox up, forks the program and reports how it ended over a status pipe.
No `preexec_fn`: Python code between fork and exec is unsafe in a threaded parent, and the
reward workers are threads. Two isolation modes; `isolation()` picks one per process:

"namespaces" (Linux, euid 0 with CAP_SYS_ADMIN; the mode in the r1flow dev container):
  - network namespace whose only interface is a loopback that is down: connect, bind and DNS
    fail at once with ENETUNREACH (no resolver timeout), servers on the host's 127.0.0.1 included;
  - pid namespace with its own /proc. Its pid 1 is a small root init forked from the launcher
    (the program must not be pid 1, which ignores SIGXCPU); the program is pid 2 and sees only
    its own processes. When the program exits, init reports and exits, and the kernel kills
    whatever is left in the namespace, setsid() escapees and daemons included. No process
    outlives a run;
  - mount namespace with a root of its own: the launcher builds a minimal tree on a fresh tmpfs
    and pivot_roots into it, then detaches the host's tree, so the rest of the machine is not
    merely read-only but absent (pivot_root's syscall number is known for x86_64, aarch64,
    riscv64, ppc64 and s390x; elsewhere the probe fails and the fallback applies). The program
    sees exactly (`_root_plan`):
      /usr, read-only bind (nosuid, nodev); /bin, /sbin, /lib, /lib64 (/lib32, /libx32) as the
        symlinks into /usr that a merged-/usr host has, or read-only binds where they are real
        directories. Binds are not recursive: a host mount below /usr stays out;
      /dev with null, zero, random and urandom (read-only binds of the host's nodes) and the
        fd, stdin, stdout, stderr links into /proc/self/fd; /proc, the pid namespace's own;
      /tmp, read-only and empty (but for the path to the run's directory when $TMPDIR is /tmp);
      the run's directory at its host path (RUN = $TMPDIR/r1flow-sandbox-*): RUN/prog.py
        (read-only), RUN/python (the interpreter's prefix, read-only: it may live under a 0700
        home such as pyenv in /root, which is why it is bound and found through
        LD_LIBRARY_PATH), RUN/work (the working directory, a private tmpfs of 32 MiB and 4096
        inodes owned by the run's uid; HOME and TMPDIR point to it).
    Should R1FLOW_HOME, PREFECT_HOME, the checkout, the working directory, the user's home or the
    virtual environment lie inside one of these binds (a checkout in /usr/src/app), an empty
    read-only tmpfs masks it (`_hidden_paths`; only two or more levels down, and never a folder
    that holds the interpreter, so a cwd of /usr/lib cannot take the C library away). Nothing
    else: no /etc (Python `-S` needs none of it: UTC time, no passwd entries, the
    dynamic linker's default paths), no /home, /root, /sys, /var, R1FLOW_HOME or checkout, so
    neither stored prompts with their expected outputs nor any other host file can be read.
    Host unix sockets (/dev/log, X11, docker, world-writable sockets in /tmp) have no path in
    this tree, and abstract unix sockets belong to the network namespace. The root tmpfs is
    remounted read-only; only RUN/work is writable. Same paths inside and out keep tracebacks and
    /proc/PID/cmdline as they were. We build this ourselves rather than with bubblewrap: as
    root, bwrap uses the same kernel primitives (namespaces, bind mounts, pivot_root), so it
    would add a system dependency without adding strength, and its own pid 1 and uid handling
    would replace the launcher's init, uid slots and RLIMIT_NPROC accounting below. Cost,
    measured on a loaded 2-core machine: the launcher's namespace and mount setup takes 1.5 ms
    instead of 0.7 ms (median of 100) for the read-only host tree it replaced; a whole run of
    print(1) stays at ~40 ms at best (50 runs took 2.3 to 5.5 s before, 2.5 to 4.9 s after:
    the spread is the machine's load, not the sandbox);
  - ipc and uts namespaces;
  - credentials: setgroups([]), then setresgid/setresuid to a uid of the run's own (UID_BASE +
    slot), then no_new_privs. Slots are flock'ed (files in $TMPDIR/r1flow-sandbox-uids), so
    concurrent runs in threads or other processes never share a uid. RLIMIT_NPROC counts the
    tasks of a uid (threads included), and root is exempt from it, so it is the uid change that
    makes it bite: the program gets 1 + max_processes tasks, and a fork bomb stops there.
"audit-hook" (fallback when not root, or when the kernel refuses the namespaces):
  - same rlimits, kill and reaping; no uid change, no RLIMIT_NPROC;
  - an audit hook (sys.addaudithook), installed before the program runs, refuses sockets, DNS,
    ctypes, fork/exec/spawn/subprocess/os.system and os.kill. Audit hooks are not a security
    boundary (PEP 578): they stop accidents and model slop, not a determined adversary (a
    direct `_posixsubprocess.fork_exec` raises no audit event: it reaches the network and leaves
    a process behind). The file system is protected only by the caller's own permissions;
  - so it runs programs only where the host opted in with the environment variable
    R1FLOW_SANDBOX_ALLOW_WEAK=1 (a property of the host, deliberately not a config field, so no
    cache key depends on it), and logs a warning once per process. Without it every run raises
    SandboxSetupError, saying why and how to opt in.

Both modes install a seccomp filter just before the program's exec (`seccomp_filter`: no new
namespaces, no mounts, no bpf, perf events, userfaultfd, io_uring or keyrings; PermissionError),
inherited by all it starts. The namespaces mode requires it: on an architecture the filter does
not know (not x86_64, aarch64 or riscv64) the probe falls back to the audit-hook mode, which then
runs without it. Cost, on the 2-core machine under a load of 8-10: the prctl that installs it takes
0.09 ms (median of 300); from Popen to the program's execve took 69.2 ms before the filter and the
memfd configuration, 69.7 ms after (medians of 100 interleaved runs of `pass`), whole runs 122 and
119 ms: within the machine's noise.
Both modes apply RLIMIT_CPU (SIGXCPU, then SIGKILL one second later), RLIMIT_AS (memory_mb),
RLIMIT_FSIZE (MAX_FILE_BYTES), RLIMIT_CORE=0 and RLIMIT_NOFILE, and start from a fresh
environment (PATH, LANG, HOME, PYTHONHASHSEED=0). The program runs as `python -S -s -P`: no site,
no user site, no script directory on sys.path, so only the stdlib can be imported (no numpy).
We depart from `-I` because its `-E` would ignore PYTHONHASHSEED. A fixed seed keeps set order,
and so the output, reproducible, and since the environment is ours, `-E` would add nothing.
`exit`/`quit`, which `site` would define, are provided. Stdin comes from an unlinked temp file
(mode 0444, so that the program may reopen it as /dev/stdin).
Stdout and stderr are read incrementally, and the run is killed as soon as together they exceed
max_output_bytes. On a wall timeout or output overflow, the parent asks the launcher (SIGUSR1) to
SIGKILL its child (init, or the program in audit-hook mode) through a pidfd, so pid reuse cannot
misdirect the kill. Then it SIGKILLs the launcher's process group before reaping the launcher.
The launcher dies with the parent (PR_SET_PDEATHSIG), and so do init and the program. It also
backs up the wall limit with alarm().
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import pwd
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from schemas.configs import SandboxLimits

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: largest file the program may write
WORKDIR_BYTES = 32 * 2**20  # size of the tmpfs working directory (namespaces mode)
WORKDIR_INODES = 4096
MAX_OPEN_FILES = 256
UID_BASE = 2_000_000_000  # sandbox uids are UID_BASE + slot (namespaces mode)
UID_SLOTS = 64  # concurrent runs per machine; more wait for a free slot
KILL_GRACE_S = 2.0  # how long the launcher gets to kill the program before its group is SIGKILLed
# The sandbox's own root (namespaces mode): read-only binds of these host directories, or
# symlinks where the host has symlinks; these devices; nothing of /etc, /home, /root, /tmp.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
ROOT_TMPFS_OPTIONS = "size=1m,nr_inodes=1024,mode=0755"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
PIVOT_ROOT_SYSCALLS = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
# Syscalls the program may not make (a seccomp filter, both modes), by architecture: the audit
# arch of seccomp_data and the numbers (x86_64: asm/unistd_64.h; aarch64 and riscv64 share
# asm-generic/unistd.h; those from 424 on are the same everywhere). Why these, see `seccomp_filter`.
_SECCOMP_NEW = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
                "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
                "clone3": 435, "mount_setattr": 442, "open_tree_attr": 467}
_SECCOMP_GENERIC = {"unshare": 97, "setns": 268, "clone": 220, "mount": 40, "umount2": 39, "pivot_root": 41,
                    "chroot": 51, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219,
                    "add_key": 217, "request_key": 218, **_SECCOMP_NEW}
SECCOMP_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {"unshare": 272, "setns": 308, "clone": 56, "mount": 165, "umount2": 166,
                            "pivot_root": 155, "chroot": 161, "bpf": 321, "perf_event_open": 298,
                            "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, **_SECCOMP_NEW}),
    "aarch64": (0xC00000B7, _SECCOMP_GENERIC),
    "riscv64": (0xC00000F3, _SECCOMP_GENERIC),
}
# clone() flags that make a namespace (CLONE_NEWTIME, 0x80, is not one for clone(): there the low
# byte is the exit signal).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
WEAK_ENV = "R1FLOW_SANDBOX_ALLOW_WEAK"  # =1: the host accepts the audit-hook mode for code rewards
_MEMORY_ERROR = re.compile(r"^MemoryError\b|Cannot allocate memory", re.MULTILINE)


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended.

    status: "ok" (exit 0) | "error" (nonzero exit) | "timeout" (wall or CPU limit) | "memory"
    (MemoryError at the RLIMIT_AS limit) | "output_limit" (stdout+stderr over max_output_bytes) |
    "killed" (any other signal). returncode: the program's exit code, -signal when a signal ended
    it, None when the sandbox killed it. stdout and stderr together hold at most
    max_output_bytes (decoded as UTF-8 with replacement).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


class SandboxSetupError(RuntimeError):
    """The sandbox itself could not be set up (not a failure of the program)."""


# The launcher's command line, `python3.x -I -S -c _LOADER r1flow-sandbox-XXXX` (the name of the
# run's directory, which the program sees anyway, so that `ps` tells the runs apart), is pid 1's
# inside the sandbox, where the program can read it (/proc/1/cmdline): so it holds no path and no
# configuration. The loader reads the launcher's code and configuration (host paths, the root
# plan, the masks) from a memfd and closes it before anything is forked.
_LOADER = """import json, os
with open({fd}, "rb") as f:
    d = json.load(f)
exec(d["code"], dict(__name__="__main__", cfg=d["cfg"]))"""

# Runs in a new session, started by _LOADER with `cfg` set. It has to be root for the
# namespaces, so it stays outside of them and does not count against the sandbox uid's NPROC.
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys

status_fd = cfg["status_fd"]
child_fd = None
stop_requested = False


def say(**msg):
    os.write(status_fd, json.dumps(msg).encode() + b"\n")


def stop(signum, frame):
    global stop_requested
    stop_requested = True
    if child_fd is not None:
        try:
            signal.pidfd_send_signal(child_fd, signal.SIGKILL)
        except ProcessLookupError:
            pass


signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGALRM, stop)
signal.alarm(cfg["backstop_s"])
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} on {target}")


def setup_namespaces():
    # Build the sandbox's whole file tree on a fresh tmpfs (cfg["root_plan"], see _root_plan) and
    # pivot_root into it: the host's tree is detached from the namespace, not just read-only.
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    root = cfg["root_mount"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, cfg["root_options"])
    for kind, path, *args in cfg["root_plan"]:
        target = root + path
        if kind == "dir":
            os.makedirs(target, 0o755, exist_ok=True)
        elif kind == "symlink":
            os.symlink(args[0], target)
        elif kind == "tmpfs":
            os.makedirs(target, 0o755, exist_ok=True)
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, args[0])
        elif kind == "mask":  # an empty read-only folder over a host folder inside a bind
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=16,mode=0555")
        else:  # "bind": source onto path, not recursive, then remounted with flags (read-only)
            source, flags = args
            if os.path.isdir(source):
                os.makedirs(target, 0o755, exist_ok=True)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            mount(source, target, None, MS_BIND)
            mount(None, target, None, MS_REMOUNT | MS_BIND | flags)
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(cfg["sys_pivot_root"]), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount2 of the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return True


def seccomp_program(hex_insns):
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;} as two longs: the
    # architectures seccomp_filter knows are little-endian and 64-bit. Built before any fork
    # (a Structure subclass made in the freshly forked child cost ~0.3 ms).
    if hex_insns is None:
        return None
    data = bytes.fromhex(hex_insns)
    insns = ctypes.create_string_buffer(data, len(data))
    return (ctypes.c_ulong * 2)(len(data) // 8, ctypes.addressof(insns)), insns


def forked(main):  # the child runs main() and never returns
    pid = os.fork()
    if pid == 0:
        try:
            main()
        except BaseException as exc:
            say(error=f"{main.__name__}: {exc!r}")
        os._exit(125)
    return pid


def exec_program():
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if seccomp is not None:  # see seccomp_filter; needs no_new_privs, and holds across execve
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, seccomp[0], 0, 0), "prctl(SECCOMP)")
    os.chdir(cfg["workdir"])
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    os.set_inheritable(status_fd, False)  # a successful exec closes it: no message means success
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def init_main():
    # pid 1 of the new pid namespace. The program must not be pid 1: init ignores every signal
    # it has no handler for (SIGXCPU included). This init reaps orphans, reports the program's
    # end and exits with it, upon which the kernel kills whatever is left in the namespace.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    program = forked(exec_program)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            say(status=status, cpu_s=usage.ru_utime + usage.ru_stime)
            os._exit(0)


try:
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != cfg["parent_pid"]:
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    seccomp = seccomp_program(cfg["seccomp"])
    ro_root = setup_namespaces() if cfg["namespaces"] else False
    pid = forked(init_main if cfg["namespaces"] else exec_program)
except BaseException as exc:
    say(error=f"launcher: {exc!r}")
    os._exit(125)
child_fd = os.pidfd_open(pid)
if stop_requested:
    stop(None, None)
for fd in (0, 1, 2):  # only the program may hold the pipes: their EOF means it is gone
    os.dup2(devnull, fd)
_, status, usage = os.wait4(pid, 0)
if not cfg["namespaces"]:
    say(status=status, cpu_s=usage.ru_utime + usage.ru_stime)
say(ro_root=ro_root)
"""

# Runs as `python -S -s -P -c _BOOTSTRAP HOOKS PROGRAM`; leaves no names behind in __main__.
_BOOTSTRAP = r"""
def _boot():
    import builtins, sys

    def exit(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = exit
    if sys.argv[1] == "1":
        blocked = frozenset({
            "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "subprocess.Popen", "os.system",
            "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
        })
        prefixes = ("os.exec", "os.spawn", "os.posix_spawn")

        def hook(event, args):
            if event in blocked or event.startswith(prefixes):
                raise PermissionError(f"{event} is blocked by the r1flow sandbox")

        sys.addaudithook(hook)
    sys.argv[:] = sys.argv[2:]
    main = sys.modules["__main__"].__dict__
    main["__file__"] = sys.argv[0]
    del main["_boot"]
    with open(sys.argv[0], "rb") as f:
        return compile(f.read(), sys.argv[0], "exec")


exec(_boot())
"""

_ISOLATION: dict[str, Any] | None = None
_ISOLATION_LOCK = threading.Lock()


def isolation() -> dict[str, Any]:
    """The isolation mode of this process, probed once: {"mode": "namespaces" | "audit-hook",
    "read_only_root": bool (True in namespaces mode: the program's own root is read-only apart
    from its working directory), "reason": str}."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            _ISOLATION = _probe()
            log.info("sandbox isolation: %s", _ISOLATION)
        return dict(_ISOLATION)


def _probe() -> dict[str, Any]:
    if not sys.platform.startswith("linux"):
        raise SandboxSetupError(f"the sandbox needs Linux, not {sys.platform}")
    if os.geteuid() != 0:
        return {"mode": "audit-hook", "read_only_root": False, "reason": "not root: no namespaces"}
    try:
        result, report = _run("pass", "", SandboxLimits(wall_timeout_s=10.0), namespaces=True)
    except SandboxSetupError as exc:
        log.warning("sandbox namespaces unavailable, falling back to audit hooks: %s", exc)
        return {"mode": "audit-hook", "read_only_root": False, "reason": str(exc)}
    if result.status != "ok":
        raise SandboxSetupError(f"an empty program failed in the sandbox: {result}")
    return {"mode": "namespaces", "read_only_root": bool(report.get("ro_root")), "reason": "root"}


_WEAK_WARNED = False
_WEAK_LOCK = threading.Lock()


def _require_weak_opt_in() -> None:
    """The audit-hook mode runs only where the host opted in (R1FLOW_SANDBOX_ALLOW_WEAK=1).

    A host property, not a config field: it must not change any cache key. Warns once per process.
    """
    global _WEAK_WARNED
    reason = (_ISOLATION or {}).get("reason", "namespaces not used")
    if os.environ.get(WEAK_ENV) != "1":
        raise SandboxSetupError(
            f"refusing to run a program: the sandbox has only its audit-hook mode here ({reason}), "
            "which a program can bypass (a direct _posixsubprocess.fork_exec reaches the network and "
            "leaves processes behind; every file this user can read is readable). Run as root with "
            f"CAP_SYS_ADMIN for the namespaces sandbox, or set {WEAK_ENV}=1 to accept the weaker mode "
            "on this host")
    with _WEAK_LOCK:
        if not _WEAK_WARNED:
            _WEAK_WARNED = True
            log.warning("%s=1: running model-written programs in the sandbox's audit-hook mode (%s), "
                        "which a determined program can escape (network, processes, readable files)",
                        WEAK_ENV, reason)


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in the sandbox, feeding it `stdin`.

    Raises SandboxSetupError in audit-hook mode unless R1FLOW_SANDBOX_ALLOW_WEAK=1."""
    namespaces = isolation()["mode"] == "namespaces"
    return _run(code, stdin, limits, namespaces=namespaces)[0]


def run_tests(code: str, tests: list[dict], limits: SandboxLimits = SandboxLimits()) -> float:
    """Fraction of stdin/stdout cases `[{"input": str, "output": str}, ...]` that `code` passes.

    A case passes when the program exits 0 and its stdout equals the expected output after
    trailing whitespace is stripped from every line and blank lines from both ends. A case that
    times out, crashes or floods its output fails.
    """
    if not tests:
        raise ValueError("run_tests needs at least one test case")
    for i, case in enumerate(tests):
        if not isinstance(case.get("input"), str) or not isinstance(case.get("output"), str):
            raise ValueError(f"test case {i} needs string 'input' and 'output', got {case!r}")
    passed = 0
    for case in tests:
        result = run_program(code, case["input"], limits)
        passed += result.status == "ok" and normalise_output(result.stdout) == normalise_output(case["output"])
    return passed / len(tests)


def normalise_output(text: str) -> str:
    """Strip trailing whitespace from every line and blank lines from both ends."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


# ---------------------------------------------------------------------------- one run


def _run(code: str, stdin: str, limits: SandboxLimits, *, namespaces: bool) -> tuple[SandboxResult, dict]:
    if not namespaces:
        _require_weak_opt_in()
    base = tempfile.mkdtemp(prefix="r1flow-sandbox-")
    try:
        with _uid_slot() if namespaces else contextlib.nullcontext(None) as uid:
            return _run_in(base, code, stdin, limits, namespaces=namespaces, uid=uid)
    finally:
        _remove_tree(base)


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # the program took the permissions off parts of its directory
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        log.warning("could not remove the sandbox directory %s", path)


def _run_in(base: str, code: str, stdin: str, limits: SandboxLimits, *, namespaces: bool,
            uid: int | None) -> tuple[SandboxResult, dict]:
    # base stays 0700 on the host. In namespaces mode the program sees base/prog.py, base/python
    # and base/work at the same paths in its own root (_root_plan); base/root is that root's mount
    # point. In audit-hook mode it runs in base/work on the host.
    program = os.path.join(base, "prog.py")
    with open(program, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(program, 0o644)
    workdir = os.path.join(base, "work")
    exe, prefix, env = _interpreter(base, workdir, namespaces)
    cpu = limits.cpu_time_s
    seccomp = _seccomp_program()
    if namespaces and seccomp is None:  # the namespaces mode promises the filter: fall back instead
        raise SandboxSetupError(f"the sandbox has no seccomp filter for {os.uname().machine}")
    cfg = {
        "namespaces": namespaces,
        "seccomp": seccomp.hex() if seccomp else None,
        "uid": uid,
        "parent_pid": os.getpid(),
        "backstop_s": int(limits.wall_timeout_s) + 5,
        "workdir": workdir,
        "rlimits": {
            "RLIMIT_CPU": [cpu, cpu + 1],  # SIGXCPU, then SIGKILL if the program ignores it
            "RLIMIT_AS": [limits.memory_mb * 2**20] * 2,
            "RLIMIT_FSIZE": [MAX_FILE_BYTES] * 2,
            "RLIMIT_CORE": [0, 0],
            "RLIMIT_NOFILE": [MAX_OPEN_FILES] * 2,
            # RLIMIT_NPROC is per uid: only meaningful when the program has a uid of its own.
            **({"RLIMIT_NPROC": [1 + limits.max_processes] * 2} if uid is not None else {}),
        },
        "argv": [exe, "-S", "-s", "-P", "-c", _BOOTSTRAP, "0" if namespaces else "1", program],
        "env": env,
    }
    if namespaces:
        os.mkdir(os.path.join(base, "root"), 0o700)
        cfg["root_mount"] = os.path.join(base, "root")
        cfg["root_options"] = ROOT_TMPFS_OPTIONS
        cfg["root_plan"] = _root_plan(base, program, workdir, prefix, uid)
        cfg["sys_pivot_root"] = _pivot_root_syscall()
    else:
        os.mkdir(workdir, 0o700)

    status_r, status_w = os.pipe()
    config_fd = -1
    try:
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            os.fchmod(stdin_file.fileno(), 0o444)  # the program may reopen it as /dev/stdin
            cfg["status_fd"] = status_w
            config_fd = os.memfd_create("r1flow-sandbox-launcher", os.MFD_CLOEXEC)
            os.write(config_fd, json.dumps({"code": _LAUNCHER, "cfg": cfg}).encode())
            os.lseek(config_fd, 0, os.SEEK_SET)
            # argv[0] is the interpreter's bare name, found on PATH (so that a relocatable
            # interpreter still finds its standard library): no host path in /proc/1/cmdline.
            launcher = os.path.realpath(sys.executable)
            start = time.monotonic()
            proc = subprocess.Popen(
                [os.path.basename(launcher), "-I", "-S", "-c", _LOADER.format(fd=config_fd), os.path.basename(base)],
                executable=launcher, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=base, env={"PATH": os.path.dirname(launcher)}, close_fds=True,
                pass_fds=(status_w, config_fd), start_new_session=True,
            )
        os.close(status_w)
        status_w = -1
        os.close(config_fd)
        config_fd = -1
        try:
            stdout, stderr, killed_for = _supervise(proc, start + limits.wall_timeout_s, limits.max_output_bytes)
        finally:
            _reap(proc)
        wall_s = time.monotonic() - start
        report = _read_reports(status_r)
    finally:
        os.close(status_r)
        for fd in (status_w, config_fd):
            if fd >= 0:
                os.close(fd)
    if "error" in report:
        raise SandboxSetupError(report["error"])
    out = stdout.decode("utf-8", errors="replace")
    err = stderr.decode("utf-8", errors="replace")
    status, returncode = _classify(killed_for, report, err, cpu)
    return SandboxResult(status, returncode, out, err, wall_s), report


def _interpreter(base: str, workdir: str, namespaces: bool) -> tuple[str, str | None, dict[str, str]]:
    """(program interpreter path, prefix to bind-mount at base/python or None, environment)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    rel = os.path.relpath(exe, prefix)
    if not namespaces:
        return exe, None, env
    if rel.startswith(os.pardir):
        raise SandboxSetupError(f"the interpreter {exe} lies outside its prefix {prefix}: cannot mount it in the sandbox")
    mounted = os.path.join(base, "python")
    if os.path.isdir(os.path.join(prefix, "lib")):
        # A shared libpython is found through an absolute RUNPATH under the original prefix.
        env["LD_LIBRARY_PATH"] = os.path.join(mounted, "lib")
    return os.path.join(mounted, rel), prefix, env


def _root_plan(base: str, program: str, workdir: str, prefix: str | None, uid: int | None) -> list[list]:
    """The sandbox's file tree, built by the launcher on an empty tmpfs, in order:
    ["dir", path] | ["symlink", path, target] | ["bind", path, source, remount flags] |
    ["tmpfs", path, options] | ["mask", path]. Everything is read-only except the working
    directory, and `_hidden_paths` that lie inside a bound folder are masked by empty ones."""
    ro = MS_RDONLY | MS_NOSUID | MS_NODEV
    plan: list[list] = []
    binds: list[tuple[str, str]] = []  # (host folder, path in the sandbox)
    for name in SYSTEM_DIRS:  # on merged-/usr systems all but /usr are symlinks into it
        path = "/" + name
        if os.path.islink(path):
            plan.append(["symlink", path, os.readlink(path)])
        elif os.path.isdir(path):
            plan.append(["bind", path, path, ro])
            binds.append((os.path.realpath(path), path))
    plan += [["dir", "/proc"], ["dir", "/tmp"], ["dir", "/dev"]]
    for name in DEVICES:
        plan.append(["bind", f"/dev/{name}", f"/dev/{name}", MS_RDONLY | MS_NOSUID | MS_NOEXEC])
    plan.append(["symlink", "/dev/fd", "/proc/self/fd"])
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        plan.append(["symlink", f"/dev/{name}", f"/proc/self/fd/{fd}"])
    plan += [["dir", base], ["bind", program, program, ro | MS_NOEXEC]]
    if prefix:
        plan.append(["bind", os.path.join(base, "python"), prefix, ro])
        binds.append((prefix, os.path.join(base, "python")))
    options = f"size={WORKDIR_BYTES},nr_inodes={WORKDIR_INODES},mode=0700,uid={uid},gid={uid}"
    plan.append(["tmpfs", workdir, options])
    exe = os.path.realpath(sys.executable)
    masked: list[str] = []
    for hidden in sorted(_hidden_paths()):  # e.g. a checkout in /usr/src/app; parents first
        if any(not os.path.relpath(hidden, m).startswith(os.pardir) for m in masked):
            continue  # inside a folder masked already (a venv in the checkout)
        for source, inside in binds:
            rel = os.path.relpath(hidden, source)
            # Two levels down at least: never /usr/lib or /usr/bin, nor what holds the interpreter.
            if (os.sep in rel and not rel.startswith(os.pardir) and os.path.isdir(hidden)
                    and os.path.relpath(exe, hidden).startswith(os.pardir)):
                plan.append(["mask", os.path.join(inside, rel)])
                masked.append(hidden)
    return plan


def _hidden_paths() -> list[str]:
    """Host folders the program must not see even where they lie inside a folder the sandbox
    binds (/usr, the interpreter's prefix): R1FLOW_HOME, PREFECT_HOME, the checkout, the working
    directory, the user's home and the virtual environment."""
    paths = [os.environ.get("R1FLOW_HOME", ".r1flow"), os.environ.get("PREFECT_HOME"),
             os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), os.path.expanduser("~"), sys.prefix]
    with contextlib.suppress(OSError):
        paths.append(os.getcwd())
    return sorted({os.path.realpath(p) for p in paths if p})


_SECCOMP_PROGRAM: list[bytes | None] = []


def _seccomp_program() -> bytes | None:
    """This machine's seccomp_filter, built once per process."""
    if not _SECCOMP_PROGRAM:
        _SECCOMP_PROGRAM.append(seccomp_filter(os.uname().machine))
    return _SECCOMP_PROGRAM[0]


def _pivot_root_syscall() -> int:
    """pivot_root has no libc wrapper; its number depends on the architecture."""
    import platform

    machine = platform.machine()
    if machine not in PIVOT_ROOT_SYSCALLS:
        raise SandboxSetupError(f"pivot_root's syscall number on {machine} is not known to the sandbox")
    return PIVOT_ROOT_SYSCALLS[machine]


def seccomp_filter(machine: str, deny_errno: int = errno.EPERM) -> bytes | None:
    """The seccomp program the launcher installs (prctl PR_SET_SECCOMP) right before it execs the
    program, as struct sock_filter[] in native byte order; None for an architecture that
    SECCOMP_ARCHES does not list.

    Denied with deny_errno (EPERM: PermissionError in Python), for the program and everything it
    starts (filters are inherited and cannot be removed):
      - namespaces: unshare, setns, and clone with any CLONE_NEW* flag. As an unprivileged user a
        program could otherwise make a user namespace, be root in it and reach kernel code that
        is otherwise root-only (mounting filesystems, netfilter, ...), the source of many local
        privilege escalations; a reward program never needs one. clone without these flags (fork,
        vfork, threads) passes. clone3 passes its flags in memory a filter cannot read, so it
        fails with ENOSYS, as in Docker's and systemd's filters: glibc then falls back to clone;
      - mounts: mount, umount2, pivot_root, chroot and the new mount API (open_tree, move_mount,
        fsopen, fsconfig, fsmount, fspick, mount_setattr, open_tree_attr). Without a user
        namespace they need privileges the program lacks; denying them too does not depend on
        that, nor on the uid change;
      - kernel interfaces with a record of privilege escalations that no stdlib program needs and
        that Docker's default profile also refuses: bpf, perf_event_open, userfaultfd, io_uring
        (its operations run without any syscall a filter could see), and the key management
        calls keyctl, add_key and request_key (keyrings are not namespaced: a key stored under a
        sandbox uid would outlive the run and be readable by the next run in that uid slot).
    Everything else passes: the limits and the namespaces do the rest of the work. On x86_64 the
    x32 ABI (syscall numbers from 0x40000000, which would bypass the numbers above) fails with
    ENOSYS, and a syscall of another ABI (i386 through int 0x80) kills the process.

    Built here with a few BPF opcodes, not with libseccomp: the launcher runs `python -I -S`
    without site-packages, and the only pure-Python binding on PyPI (pyseccomp, a ctypes wrapper
    of the system's libseccomp.so, last released in 2021) would add a system library for a
    program of some sixty instructions. tests/test_sandbox.py runs this program through a small
    BPF interpreter for every listed architecture and installs it in a real process.
    """
    if machine not in SECCOMP_ARCHES:
        return None
    arch, numbers = SECCOMP_ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill_process, fail = 0x7FFF0000, 0x80000000, 0x00050000  # SECCOMP_RET_ALLOW, _KILL_PROCESS, _ERRNO
    nr_offset, arch_offset, arg0_offset = 0, 4, 16  # struct seccomp_data; arg0's low half (little-endian)
    insns = [(ld, 0, 0, arch_offset), (jeq, 1, 0, arch), (ret, 0, 0, kill_process), (ld, 0, 0, nr_offset)]
    if machine == "x86_64":
        insns += [(jge, 0, 1, 0x40000000), (ret, 0, 0, fail | errno.ENOSYS)]
    for name, nr in numbers.items():
        if name != "clone":
            insns += [(jeq, 0, 1, nr), (ret, 0, 0, fail | (errno.ENOSYS if name == "clone3" else deny_errno))]
    insns += [(jeq, 0, 3, numbers["clone"]), (ld, 0, 0, arg0_offset), (jset, 0, 1, CLONE_NEW_FLAGS),
              (ret, 0, 0, fail | deny_errno), (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *insn) for insn in insns)


def _supervise(proc: subprocess.Popen, deadline: float, max_output: int) -> tuple[bytes, bytes, str | None]:
    """Collect output until the launcher exits and both pipes close; kill on deadline or overflow.

    Returns (stdout, stderr, killed_for) with killed_for in {None, "timeout", "output_limit"}.
    The launcher is left exited but unreaped, so its pid (= process group id) stays reserved.
    """
    assert proc.stdout is not None and proc.stderr is not None
    pidfd = os.pidfd_open(proc.pid)
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    kept = 0
    killed_for = None
    launcher_done = False
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        try:
            while len(sel.get_map()) > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    killed_for = "timeout"
                    break
                for key, _ in sel.select(remaining):
                    fd = key.fd
                    if fd == pidfd:
                        sel.unregister(pidfd)
                        launcher_done = True
                        # Stragglers still in the launcher's group (audit-hook mode) hold the pipes.
                        _killpg(proc.pid)
                        continue
                    try:
                        chunk = os.read(fd, min(65536, max_output - kept + 1))
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    take = chunk[: max_output - kept]
                    buffers[fd] += take
                    kept += len(take)
                    if len(take) < len(chunk):
                        killed_for = "output_limit"
                        break
                if killed_for:
                    break
            if killed_for and not launcher_done:
                _stop(proc, pidfd)
        finally:
            os.close(pidfd)
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), killed_for


def _stop(proc: subprocess.Popen, pidfd: int) -> None:
    """Have the launcher kill the program (it reaps it and reports); SIGKILL its group if it dawdles."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)  # our unreaped child: the pid cannot have been reused
    with selectors.DefaultSelector() as sel:
        sel.register(pidfd, selectors.EVENT_READ)
        if not sel.select(KILL_GRACE_S):
            _killpg(proc.pid)
            sel.select()


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _reap(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the launcher's process group, then reap the launcher.

    Until it is reaped the launcher's pid, which is the group id, cannot be reused, so the
    killpg cannot hit an unrelated group. Normally the launcher has already exited and the group
    is empty; after an exception in the parent this kills a live launcher, and PR_SET_PDEATHSIG
    takes its namespace down with it.
    """
    _killpg(proc.pid)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _read_reports(fd: int) -> dict:
    """Merge the launcher's JSON lines; every writer has exited, so this reaches EOF."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    report: dict = {}
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            report.update(json.loads(line))
    return report


def _classify(killed_for: str | None, report: dict, stderr: str, cpu_limit: int) -> tuple[str, int | None]:
    if killed_for is not None:
        return killed_for, None
    if "status" not in report:
        return "killed", None  # the launcher died without reporting (killed from outside)
    raw = report["status"]
    returncode = os.waitstatus_to_exitcode(raw)
    if os.WIFSIGNALED(raw):
        sig = os.WTERMSIG(raw)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and report["cpu_s"] >= cpu_limit):
            return "timeout", returncode
        return "killed", returncode
    if returncode == 0:
        return "ok", 0
    if _MEMORY_ERROR.search(stderr):
        return "memory", returncode
    return "error", returncode


# ---------------------------------------------------------------------------- uid slots


@contextlib.contextmanager
def _uid_slot() -> Iterator[int]:
    """Hold a sandbox uid no other run (thread or process) uses meanwhile: flock on a root-only file."""
    lock_dir = os.path.join(tempfile.gettempdir(), "r1flow-sandbox-uids")
    with contextlib.suppress(FileExistsError):
        os.mkdir(lock_dir, 0o700)
    st = os.lstat(lock_dir)
    if not os.path.isdir(lock_dir) or os.path.islink(lock_dir) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxSetupError(f"{lock_dir} must be a directory owned by uid {os.geteuid()} with mode 0700")
    while True:
        for slot in range(UID_SLOTS):
            uid = UID_BASE + slot
            if _has_account(uid):
                continue
            fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                continue
            try:
                yield uid
                return
            finally:
                os.close(fd)  # releases the lock
        time.sleep(0.02)  # every slot busy: runs end within their limits


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True
