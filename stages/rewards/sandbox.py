"""Run untrusted, model-written Python programs in a sandboxed subprocess (code-task rewards).

A run costs at most its `SandboxLimits`: a fork bomb, an infinite loop, a 10 GB allocation, an
output flood or a network attempt ends that run with a status, never the pipeline.

Each run gets a fresh directory and a launcher (`sandbox_launcher`: `python -I -S` in a new session,
its code and configuration read from a memfd, so that its command line, pid 1's in the sandbox,
names no host path) that sets the sandbox up, forks the program and reports how it ended over a
status pipe. No `preexec_fn`: Python code between fork and exec is unsafe in a threaded parent, and
the reward workers are threads. Two isolation modes; `isolation()` picks one per process:

"namespaces" (Linux, euid 0 with CAP_SYS_ADMIN):
  - network namespace whose only interface is a loopback that is down: connect, bind and DNS
    fail at once with ENETUNREACH, servers on the host's 127.0.0.1 included;
  - pid namespace with its own /proc. Its pid 1 is a small root init forked from the launcher
    (the program must not be pid 1, which ignores SIGXCPU); the program is pid 2 and sees only
    its own processes. When the program exits, init exits, and the kernel kills whatever is left
    in the namespace (setsid() escapees and daemons included): no process outlives a run;
  - mount namespace with a root of its own: the launcher builds a minimal tree on a fresh tmpfs
    and pivot_roots into it, then detaches the host's tree, so the rest of the machine is absent,
    not merely read-only. The program sees exactly (`sandbox_root.root_plan`):
      /usr, read-only bind (nosuid, nodev, not recursive); /bin, /sbin, /lib, /lib64 (/lib32,
        /libx32) as the symlinks a merged-/usr host has, or read-only binds;
      /dev with null, zero, random, urandom and the fd, stdin, stdout, stderr links into
        /proc/self/fd; /proc, the pid namespace's own; /tmp, read-only and empty;
      the run's directory at its host path (RUN = $TMPDIR/r1flow-sandbox-<owner>-*): RUN/prog.py
        (read-only), RUN/python (the interpreter's prefix, read-only, an overlay whose layers are
        named by descriptor so that /proc/self/mountinfo does not show its host path; it may live
        under a 0700 home such as pyenv's, hence bound and found through LD_LIBRARY_PATH), RUN/work
        (the working directory, a private tmpfs of 32 MiB and 4096 inodes owned by the run's uid;
        HOME and TMPDIR point to it).
    R1FLOW_HOME, PREFECT_HOME, the checkout, the working directory, the user's home or the
    virtual environment, where they lie inside one of these binds (a checkout in /usr/src/app),
    are masked: the bound folder becomes an overlay in which they are empty, opaque folders
    (`sandbox_root.hidden_paths`; two or more levels down only, never a folder that holds the
    interpreter). Overlays keep host paths out of /proc/self/mountinfo; without overlayfs they are
    binds, and masks are empty read-only tmpfs mounts. No /etc (`-S` needs none), /home, /root, /sys or /var, so
    no stored prompt with its expected output nor any other host file can be read. Host unix
    sockets have no path in this tree, and abstract ones belong to the network namespace. Same
    paths inside and out keep tracebacks as they were. Not bubblewrap: as root it uses the same
    kernel primitives, and its own pid 1 and uid handling would replace init, the uid slots and
    the RLIMIT_NPROC accounting below;
  - ipc and uts namespaces;
  - credentials: setgroups([]), then setresgid/setresuid to a uid of the run's own (UID_BASE +
    slot), then no_new_privs. Slots are flock'ed (files in /tmp/r1flow-sandbox-uids, whatever TMPDIR says), so
    concurrent runs in threads or other processes never share a uid. RLIMIT_NPROC counts the
    tasks of a uid and root is exempt from it: the uid change makes it bite, so the program gets
    1 + max_processes tasks and a fork bomb stops there.
"audit-hook" (fallback when not root, or when the kernel refuses the namespaces):
  - same rlimits, kill and reaping; no uid change, no RLIMIT_NPROC;
  - an audit hook refuses sockets, DNS, ctypes, fork/exec/spawn/subprocess/os.system and os.kill.
    Audit hooks are not a security boundary (PEP 578; a direct `_posixsubprocess.fork_exec`
    raises no event), and files are protected only by the caller's own permissions;
  - so it runs programs only where the host opted in with R1FLOW_SANDBOX_ALLOW_WEAK=1 (a host
    property, not a config field, so no cache key depends on it), with a warning once per process;
    otherwise every run raises SandboxSetupError, saying why and how to opt in.

Both modes install a seccomp filter just before the program's exec (`seccomp.seccomp_filter`),
inherited by all it starts; the namespaces mode requires it (elsewhere the probe falls back to the
audit-hook mode). Both apply RLIMIT_CPU (SIGXCPU, then SIGKILL a second later), RLIMIT_AS
(memory_mb), RLIMIT_FSIZE (MAX_FILE_BYTES), RLIMIT_CORE=0 and RLIMIT_NOFILE, and start from a fresh
environment (PATH, LANG, HOME, PYTHONHASHSEED=0). The program runs as `python -S -s -P` (only the
stdlib can be imported), not `-I`, whose `-E` would ignore PYTHONHASHSEED: a fixed seed keeps set
order, and so the output, reproducible. `exit`/`quit` are provided. Stdin comes from an unlinked
temp file (mode 0444, so that the program may reopen it as /dev/stdin).
Stdout and stderr are read incrementally; the run is killed as soon as together they exceed
max_output_bytes. On a wall timeout or output overflow the parent asks the launcher (SIGUSR1) to
SIGKILL its child through a pidfd (pid reuse cannot misdirect it), then SIGKILLs the launcher's
process group before reaping it. The launcher, init and the program die with the parent
(PR_SET_PDEATHSIG); the launcher backs up the wall limit with alarm().
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from schemas.configs import SandboxLimits
from stages.rewards.sandbox_launcher import BOOTSTRAP, LAUNCHER, LOADER
from stages.rewards.sandbox_root import ROOT_TMPFS_OPTIONS, root_plan
from stages.rewards.seccomp import seccomp_filter

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: largest file the program may write
MAX_OPEN_FILES = 256
UID_BASE = 2_000_000_000  # sandbox uids are UID_BASE + slot (namespaces mode)
UID_SLOTS = 64  # concurrent runs per machine; more wait for a free slot
# The slots are the machine's, so their locks are in one place whatever a process's TMPDIR: two runs with other
# TMPDIRs would otherwise hold the same uid at once and share its process limit (RLIMIT_NPROC counts per uid).
UID_LOCK_DIR = "/tmp/r1flow-sandbox-uids"
KILL_GRACE_S = 2.0  # how long the launcher gets to kill the program before its group is SIGKILLed
PIVOT_ROOT_SYSCALLS = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
WEAK_ENV = "R1FLOW_SANDBOX_ALLOW_WEAK"  # =1: the host accepts the audit-hook mode for code rewards
_MEMORY_ERROR = re.compile(r"^MemoryError\b|Cannot allocate memory", re.MULTILINE)
# A run's directory names the process that runs the program: `<pid>-<start ticks>-<host id>`, the owner format of
# flows/store/artifacts.py (`process_owner`; a test keeps the two equal). A process killed with kill -9 mid-run leaves its
# directory (model-written code) behind; `sweep_run_dirs` removes those whose owner is gone.
RUN_DIR_PREFIX = "r1flow-sandbox-"
_RUN_DIR_OWNER = re.compile(rf"^{RUN_DIR_PREFIX}(\d+)-(\d+)-([0-9a-f]{{8}})-")


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
    base = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{run_owner()}-")
    try:
        with _uid_slot() if namespaces else contextlib.nullcontext(None) as uid:
            return _run_in(base, code, stdin, limits, namespaces=namespaces, uid=uid)
    finally:
        _remove_tree(base)


def run_owner() -> str:
    """`<pid>-<start ticks>-<host id>` of this process: ticks from /proc/<pid>/stat (field 22), so that a reused
    pid is not taken for the owner; the host id (8 hex characters of the host name and pid namespace) keeps a
    temporary directory shared with another host or pid namespace from being judged here."""
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        ns = os.readlink("/proc/self/ns/pid")
    except (OSError, IndexError, ValueError):
        ticks, ns = 0, ""
    host = hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]
    return f"{pid}-{ticks}-{host}"


def sweep_run_dirs(gone, root: str | None = None) -> int:
    """Remove the run directories in `root` (the temporary directory) whose owner is gone: `gone(pid, ticks, host)`
    judges (flows/store/artifacts.py's `owner_gone`: only provably gone, on this host). Directories named before they named
    their owner, and the uid slots' lock directory, are left. Returns how many were removed."""
    removed = 0
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return 0
    for entry in entries:
        m = _RUN_DIR_OWNER.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False) and gone(int(m[1]), int(m[2]), m[3]):
            _remove_tree(entry.path)
            removed += not os.path.exists(entry.path)
    return removed


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
    # and base/work at the same paths in its own root (sandbox_root.root_plan); base/root is that root's mount
    # point. In audit-hook mode it runs in base/work on the host.
    program = os.path.join(base, "prog.py")
    with open(program, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(program, 0o644)
    cfg = _launch_config(base, program, limits, namespaces=namespaces, uid=uid)
    status_r, status_w = os.pipe()
    try:
        cfg["status_fd"] = status_w
        try:
            proc, start = _start_launcher(base, cfg, stdin)
        finally:
            os.close(status_w)
        try:
            stdout, stderr, killed_for = _supervise(proc, start + limits.wall_timeout_s, limits.max_output_bytes)
        finally:
            _reap(proc)
        wall_s = time.monotonic() - start
        report = _read_reports(status_r)
    finally:
        os.close(status_r)
    if "error" in report:
        raise SandboxSetupError(report["error"])
    out = stdout.decode("utf-8", errors="replace")
    err = stderr.decode("utf-8", errors="replace")
    status, returncode = _classify(killed_for, report, err, limits.cpu_time_s)
    return SandboxResult(status, returncode, out, err, wall_s), report


def _launch_config(base: str, program: str, limits: SandboxLimits, *, namespaces: bool, uid: int | None) -> dict:
    """The launcher's `cfg` (LAUNCHER reads it), but for the status pipe's fd; makes base/work (audit-hook
    mode) or base/root (namespaces mode, the new root's mount point)."""
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
        "argv": [exe, "-S", "-s", "-P", "-c", BOOTSTRAP, "0" if namespaces else "1", program],
        "env": env,
    }
    if namespaces:
        os.mkdir(os.path.join(base, "root"), 0o700)
        cfg["root_mount"] = os.path.join(base, "root")
        cfg["root_options"] = ROOT_TMPFS_OPTIONS
        cfg["root_plan"] = root_plan(base, program, workdir, prefix, uid)
        cfg["layers"] = os.path.join(base, "layers")  # the overlays' upper layers (sandbox_launcher.overlay)
        os.mkdir(cfg["layers"], 0o700)
        cfg["sys_pivot_root"] = _pivot_root_syscall()
    else:
        os.mkdir(workdir, 0o700)
    return cfg


def _start_launcher(base: str, cfg: dict, stdin: str) -> tuple[subprocess.Popen, float]:
    """The launcher started (its code and `cfg` in a memfd it reads), and when (time.monotonic)."""
    config_fd = os.memfd_create("r1flow-sandbox-launcher", os.MFD_CLOEXEC)
    try:
        os.write(config_fd, json.dumps({"code": LAUNCHER, "cfg": cfg}).encode())
        os.lseek(config_fd, 0, os.SEEK_SET)
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            os.fchmod(stdin_file.fileno(), 0o444)  # the program may reopen it as /dev/stdin
            # argv[0] is the interpreter's bare name, found on PATH (so that a relocatable
            # interpreter still finds its standard library): no host path in /proc/1/cmdline.
            launcher = os.path.realpath(sys.executable)
            start = time.monotonic()
            proc = subprocess.Popen(
                [os.path.basename(launcher), "-I", "-S", "-c", LOADER.format(fd=config_fd), os.path.basename(base)],
                executable=launcher, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=base, env={"PATH": os.path.dirname(launcher)}, close_fds=True,
                pass_fds=(cfg["status_fd"], config_fd), start_new_session=True,
            )
    finally:
        os.close(config_fd)
    return proc, start


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
    lock_dir = UID_LOCK_DIR
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
