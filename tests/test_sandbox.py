"""The code sandbox: scoring, and containment of hostile programs (loops, fork bombs, memory,
output floods, network, host unix sockets, host files, big files, secrets in the environment),
sequentially and in threads.

Limits are small (wall 2 s, CPU 1 s, 256 MiB) so that the whole file runs in well under a minute.
Tests of a namespace-only guarantee skip when `isolation()` fell back to audit hooks; the
audit-hook mode has tests of its own that run everywhere. The audit-hook mode refuses to run
without R1FLOW_SANDBOX_ALLOW_WEAK=1: where it is the mode of this machine, every test opts in
(the `weak_opt_in` fixture), and the tests that force it opt in themselves.
"""

from __future__ import annotations

import ast
import errno
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from schemas.configs import SandboxLimits
from stages.rewards import sandbox, sandbox_root, seccomp
from stages.rewards.sandbox import (
    SandboxResult,
    SandboxSetupError,
    isolation,
    normalise_output,
    run_program,
    run_tests,
)

LIMITS = SandboxLimits(wall_timeout_s=2.0, cpu_time_s=1, memory_mb=256, max_output_bytes=4096, max_processes=1)
# Wall time a killed run may take beyond its limit: kill, namespace teardown, reaping, rmtree.
SLACK_S = 1.5

NAMESPACES = isolation()["mode"] == "namespaces"
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="sandbox fell back to audit hooks here")


@pytest.fixture(autouse=True)
def weak_opt_in(monkeypatch):
    """Where this machine only has the audit-hook mode, opt in to it (explicitly, per test)."""
    if not NAMESPACES:
        monkeypatch.setenv(sandbox.WEAK_ENV, "1")


def run(code: str, stdin: str = "", limits: SandboxLimits = LIMITS) -> SandboxResult:
    return run_program(textwrap.dedent(code), stdin, limits)


def processes_of_run(base: str) -> list[str]:
    """Live processes (not zombies) whose command line names one run's directory (the launcher
    and init name it without its path) or whose cwd lies in it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        if state != "Z" and (os.path.basename(base) in cmdline or cwd.startswith(base)):
            found.append(f"{pid} [{state}] {cmdline[:80]}")
    return found


def run_base(stdout: str) -> str:
    """The run directory, from a program that printed its cwd (RUN_DIR/work) first."""
    return os.path.dirname(stdout.splitlines()[0])


# ---------------------------------------------------------------------------- scoring

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42"}]


def test_run_tests_scores_correct_partial_and_broken_programs():
    assert run_tests(ADD, CASES, LIMITS) == 1.0
    # Right only when a < 10; trailing spaces and blank lines do not matter.
    partial = "a, b = map(int, input().split())\nprint(a + b if a < 10 else a - b, '  ')\nprint()\n"
    assert run_tests(partial, CASES, LIMITS) == 0.5
    assert run_tests("a, b = map(int, input().split()\nprint(a + b)\n", CASES, LIMITS) == 0.0
    # Right output but nonzero exit: a crash after printing fails the case.
    assert run_tests(ADD + "raise SystemExit(1)\n", CASES, LIMITS) == 0.0
    with pytest.raises(ValueError):
        run_tests(ADD, [], LIMITS)
    with pytest.raises(ValueError):
        run_tests(ADD, [{"input": "1 2"}], LIMITS)


def test_normalise_output():
    assert normalise_output("\n\n 1  \n2\t\n\n") == " 1\n2"
    assert normalise_output("1\n\n2") == "1\n\n2"  # inner blank lines are kept
    assert normalise_output("") == ""


def test_hello_world_is_fast_and_statuses_are_exact():
    walls = []
    for _ in range(3):
        result = run("print('hello')")
        assert (result.status, result.returncode, result.stdout) == ("ok", 0, "hello\n")
        walls.append(result.wall_s)
    assert min(walls) < 0.5, walls
    result = run("import sys\nprint(sys.stdin.read()[::-1])\nexit(3)", stdin="abc")
    assert (result.status, result.returncode, result.stdout) == ("error", 3, "cba\n")
    result = run("raise ValueError('boom')")
    assert result.status == "error" and "ValueError: boom" in result.stderr


# ---------------------------------------------------------------------------- time


def test_infinite_loop_hits_the_cpu_limit():
    start = time.monotonic()
    result = run("while True:\n    pass\n")
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert elapsed < LIMITS.wall_timeout_s + SLACK_S


def test_sleeping_program_hits_the_wall_limit():
    start = time.monotonic()
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    elapsed = time.monotonic() - start
    assert (result.status, result.returncode) == ("timeout", None)
    assert result.stdout == "started\n"  # output before the kill is kept
    assert LIMITS.wall_timeout_s <= elapsed < LIMITS.wall_timeout_s + SLACK_S


# ---------------------------------------------------------------------------- processes


def test_fork_bomb_is_contained():
    result = run("""
        import os
        print(os.getcwd(), flush=True)
        while True:
            os.fork()
    """)
    assert result.status != "ok"
    assert result.wall_s < LIMITS.wall_timeout_s + SLACK_S
    # NPROC (namespaces) or the audit hook (fallback) refused the fork.
    assert "BlockingIOError" in result.stderr or "os.fork is blocked" in result.stderr
    assert processes_of_run(run_base(result.stdout)) == []
    assert not os.path.exists(run_base(result.stdout))
    # The machine still spawns processes.
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout == "42\n"


def test_persistent_fork_bomb_with_sleeping_children_leaves_nothing_behind():
    result = run("""
        import os, time
        print(os.getcwd(), flush=True)
        while True:
            try:
                if os.fork() == 0:
                    os.setsid()  # try to escape the process group
                    time.sleep(600)
            except OSError:
                pass
    """)
    assert result.status in {"timeout", "error"}
    assert result.wall_s < LIMITS.wall_timeout_s + SLACK_S
    assert processes_of_run(run_base(result.stdout)) == []


@needs_namespaces
def test_program_may_start_max_processes_but_not_more():
    code = textwrap.dedent("""
        import subprocess
        print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
        procs = [subprocess.Popen(["sleep", "5"]) for _ in range(2)]
    """)
    result = run(code)
    assert result.stdout == "child\n"  # one extra process is allowed...
    assert result.status == "error" and "BlockingIOError" in result.stderr  # ...two at once are not
    roomier = LIMITS.model_copy(update={"max_processes": 3})
    assert run(code + "print('spawned', len(procs))\n", limits=roomier).stdout == "child\nspawned 2\n"


@needs_namespaces
def test_daemon_left_behind_by_a_finished_program_is_killed():
    result = run("""
        import os, time
        print(os.getcwd(), flush=True)
        if os.fork() == 0:
            os.setsid()
            os.close(1), os.close(2)
            time.sleep(600)
    """)
    assert result.status == "ok"
    assert result.wall_s < 1.0  # the daemon neither holds the pipes open nor delays the run
    assert processes_of_run(run_base(result.stdout)) == []


# ---------------------------------------------------------------------------- memory, output, files


def test_huge_allocation_is_a_memory_failure():
    result = run("b = bytearray(10**10)\nprint('allocated')")
    assert (result.status, result.returncode) == ("memory", 1)
    assert "allocated" not in result.stdout
    grow = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n")
    assert grow.status == "memory"


def test_output_flood_is_cut_at_the_limit():
    result = run("while True:\n    print('x' * 1000)\n")
    assert (result.status, result.returncode) == ("output_limit", None)
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= LIMITS.max_output_bytes
    assert result.stdout.startswith("x" * 1000)
    assert result.wall_s < 1.0  # killed at the limit, not at the timeout
    errors = run("import sys\nwhile True:\n    sys.stderr.write('y' * 1000)\n")
    assert errors.status == "output_limit"
    assert len(errors.stderr) <= LIMITS.max_output_bytes


def test_parent_reads_at_most_max_output_bytes_of_a_flood(monkeypatch):
    flood_read = []
    real_read = os.read

    def spy(fd, n):
        data = real_read(fd, n)
        if data and set(data) == {ord("z")}:
            flood_read.append(len(data))
        return data

    monkeypatch.setattr(sandbox.os, "read", spy)
    result = run("import sys\nsys.stdout.write('z' * 10**6)\n")
    assert result.status == "output_limit"
    assert 0 < sum(flood_read) <= LIMITS.max_output_bytes + 1  # one byte past the limit ends it
    assert len(result.stdout) == LIMITS.max_output_bytes


def test_big_file_is_stopped_by_the_file_size_limit():
    result = run("""
        import os
        try:
            with open("big.bin", "wb") as f:
                for _ in range(64):
                    f.write(bytes(2**20))
        except OSError as e:
            print("stopped", e.errno, os.path.getsize("big.bin"))
    """)
    assert result.stdout == f"stopped 27 {sandbox.MAX_FILE_BYTES}\n"  # EFBIG at RLIMIT_FSIZE


def test_working_directory_is_writable_and_removed_afterwards():
    result = run("""
        import os
        print(os.getcwd())
        os.makedirs("sub")
        with open("sub/data.txt", "w") as f:
            f.write("kept in the run dir")
        print(open("sub/data.txt").read(), sorted(os.listdir(".")))
    """)
    assert result.status == "ok"
    cwd, content = result.stdout.splitlines()
    assert content == "kept in the run dir ['sub']"
    assert not os.path.exists(os.path.dirname(cwd))


@needs_namespaces
def test_rest_of_the_file_system_is_read_only_and_hidden():
    if not isolation()["read_only_root"]:
        pytest.skip("no mount_setattr here: the file tree is not read-only in the sandbox")
    marker = f"/tmp/r1flow-sandbox-escape-{os.getpid()}"
    result = run(f"""
        import os
        for path in ("{marker}", os.path.expanduser("~root/x"), "/etc/r1flow-x"):
            try:
                open(path, "w").close()
                print("wrote", path)
            except OSError as e:
                print("refused", type(e).__name__)
        print(os.getuid() != 0, sorted(p for p in os.listdir("/proc") if p.isdigit()))
    """)
    assert result.stdout.count("refused") == 3 and "wrote" not in result.stdout
    assert result.stdout.splitlines()[-1] == "True ['1', '2']"  # own pid namespace: init + program
    assert not os.path.exists(marker)


# ---------------------------------------------------------------------------- host files and sockets


@pytest.fixture()
def open_host_dir():
    """A world-writable directory outside the sandbox (not pytest's 0700 tmp_path)."""
    path = tempfile.mkdtemp(prefix="r1flow-test-sockets-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def fake_home():
    """An R1FLOW_HOME stand-in that every uid may read: 0755 folders, a 0644 prompts file that
    holds a code task's expected output."""
    path = tempfile.mkdtemp(prefix="r1flow-test-home-")
    os.chmod(path, 0o755)
    folder = os.path.join(path, "home", "prompts")
    os.makedirs(folder)
    for d in (os.path.join(path, "home"), folder):
        os.chmod(d, 0o755)
    prompts = os.path.join(folder, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"tests": [{"input": "1 2\n", "output": "secret-answer-42\n"}]}) + "\n")
    os.chmod(prompts, 0o644)
    yield prompts
    shutil.rmtree(path, ignore_errors=True)


@needs_namespaces
def test_host_unix_sockets_are_unreachable(open_host_dir):
    path = os.path.join(open_host_dir, "x.sock")
    abstract = f"\0r1flow-sandbox-test-{os.getpid()}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen()
        server.settimeout(0.1)
        servers.append(server)
    os.chmod(path, 0o777)
    received = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for server in servers:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(1)
                    received.append(conn.recv(100) or b"(connected)")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        result = run(f"""
            import socket
            for address in ({path!r}, {abstract!r}):
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(1)
                    s.connect(address)
                    s.sendall(b"hello from the sandbox")
                    print("sent")
                except OSError as e:
                    print("refused", type(e).__name__)
        """)
        assert result.status == "ok", result.stderr
        assert [line.split()[0] for line in result.stdout.splitlines()] == ["refused"] * 2, result.stdout
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        for server in servers:
            server.close()
    assert received == []


@needs_namespaces
def test_host_files_are_invisible_and_the_root_is_minimal(fake_home):
    here = os.path.abspath(__file__)
    assert os.stat(here).st_mode & 0o004  # world-readable on the host: only the sandbox hides it
    result = run(f"""
        import os
        for path in ({fake_home!r}, {os.path.dirname(fake_home)!r}, {here!r}, {os.path.dirname(here)!r},
                     "/root", "/home", "/etc/passwd", "/sys", "/var"):
            try:
                print(path, "absent" if not os.path.exists(path) else
                      "listed" if os.path.isdir(path) and os.listdir(path) else "read" if open(path).read() else "empty")
            except OSError as e:
                print(path, "refused", type(e).__name__)
        print(sorted(os.listdir("/")))
        print(sorted(os.listdir("/tmp"))[:5])
    """)
    assert result.status == "ok", result.stderr
    *lines, root, tmp = result.stdout.splitlines()
    assert [line.rsplit(None, 1)[-1] for line in lines] == ["absent"] * 9, lines
    top = tempfile.gettempdir().strip("/").split("/")[0]  # the run's own directory lies under it
    allowed = {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", top}
    assert set(ast.literal_eval(root)) <= allowed, root
    assert len(ast.literal_eval(tmp)) <= 1 and all(name.startswith("r1flow-sandbox-") for name in ast.literal_eval(tmp)), tmp


@needs_namespaces
def test_run_tests_cannot_read_the_expected_output_from_the_prompts_file(fake_home):
    cheat = textwrap.dedent(f"""
        import json
        try:
            with open({fake_home!r}) as f:
                print(json.loads(f.readline())["tests"][0]["output"].strip())
        except OSError:
            print("no access")
    """)
    tests = [{"input": "1 2\n", "output": "secret-answer-42\n"}]
    # The cheat works wherever the file is in view (here, on the host).
    assert subprocess.run([sys.executable, "-c", cheat], capture_output=True, text=True).stdout == "secret-answer-42\n"
    assert run_tests(cheat, tests, LIMITS) == 0.0
    assert run_tests("input()\nprint('secret-answer-42')\n", tests, LIMITS) == 1.0


@needs_namespaces
def test_host_folders_inside_a_bound_folder_are_masked(monkeypatch, fake_home):
    # A checkout in /usr/src/app would be in view through the /usr bind: it is masked, and so are
    # folders inside it (a venv). Stand-in: a folder two levels below /usr that holds a folder;
    # /usr/lib and /usr themselves are never masked.
    def subfolders(path):
        return [os.path.join(path, p) for p in sorted(os.listdir(path))
                if os.path.isdir(os.path.join(path, p)) and not os.path.islink(os.path.join(path, p))]

    hidden = next(p for p in subfolders("/usr/share") if subfolders(p))
    monkeypatch.setattr(sandbox_root, "hidden_paths", lambda: [subfolders(hidden)[0], hidden, "/usr/lib", "/usr"])
    result = run(f"import os\nprint(os.listdir({hidden!r}), len(os.listdir('/usr/lib')) > 0)\n"
                 "print(open('/proc/self/mountinfo').read())", limits=LIMITS.model_copy(update={"max_output_bytes": 2**16}))
    assert result.status == "ok" and result.stdout.startswith("[] True\n"), result.stderr
    if "overlay" in open("/proc/filesystems").read():  # masked as an opaque folder of an overlay, not a mount
        assert hidden not in result.stdout, result.stdout
    monkeypatch.undo()
    monkeypatch.setenv("R1FLOW_HOME", os.path.dirname(fake_home))
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert {os.path.realpath(checkout), os.path.realpath(os.path.dirname(fake_home))} <= set(sandbox_root.hidden_paths())


@needs_namespaces
def test_minimal_root_still_runs_ordinary_programs():
    result = run("""
        import os, sys, json, re, decimal, datetime, hashlib, zlib, bz2, lzma, sqlite3, ctypes, ssl
        import subprocess, fractions, heapq, itertools, collections, math, random, time
        with open("/dev/null", "w") as f:
            f.write("x")
        assert len(os.urandom(8)) == 8 and len(open("/dev/urandom", "rb").read(8)) == 8
        print(open("/dev/stdin").read().strip(), time.strftime("%Z"))
        print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
        print(sqlite3.connect(":memory:").execute("select 6 * 7").fetchone()[0])
    """, stdin="from stdin")
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines() == ["from stdin UTC", "child", "42"]

# ---------------------------------------------------------------------------- namespaces, mounts, the launcher


NAMESPACE_ATTEMPTS = """
    import ctypes, os, threading
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x20000, 0x10000000, 0x40000000, 17

    def attempt(name, ret):
        print(name, "refused" if ret == -1 else "done", os.strerror(ctypes.get_errno()) if ret == -1 else ret)

    attempt("unshare(user|mount)", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
    attempt("mount tmpfs", libc.mount(b"none", os.getcwd().encode(), b"tmpfs", 0, None))
    attempt("unshare(net)", libc.unshare(CLONE_NEWNET))
    attempt("unshare(user)", libc.unshare(CLONE_NEWUSER))
    pid = libc.syscall({clone}, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)  # clone() into a new user namespace
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    attempt("clone(user)", -1 if pid < 0 else 0)
    with open("/proc/self/ns/mnt") as f:
        attempt("setns(mnt)", libc.setns(f.fileno(), 0))
    # What a program needs still works: fork, threads (clone3, refused, falls back to clone), exec.
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results = []
    thread = threading.Thread(target=lambda: results.append("thread ran"))
    thread.start(), thread.join()
    print(status, results[0])
"""


@needs_namespaces
def test_program_cannot_create_namespaces_or_mount():
    # Without the seccomp filter an unprivileged program can unshare a user and a mount namespace
    # and mount in it (root of its own user namespace): kernel surface no reward program needs.
    result = run(NAMESPACE_ATTEMPTS.format(clone=56 if os.uname().machine == "x86_64" else 220))
    assert result.status == "ok", result.stderr
    *attempts, last = result.stdout.splitlines()
    assert attempts == [f"{name} refused Operation not permitted" for name in
                        ("unshare(user|mount)", "mount tmpfs", "unshare(net)", "unshare(user)", "clone(user)", "setns(mnt)")]
    assert last == "7 thread ran"


@needs_namespaces
def test_launcher_configuration_is_not_visible_to_the_program():
    # pid 1 of the sandbox is the launcher's init: its command line must hold neither the launcher's
    # configuration (host paths of the interpreter, the checkout, R1FLOW_HOME masks) nor a path.
    result = run("""
        import os
        print(open("/proc/1/cmdline", "rb").read().replace(b"\\0", b" ").decode())
        fds = []
        for fd in range(3, 256):
            try:
                os.fstat(fd)
                fds.append(fd)
            except OSError:
                pass
        print(fds)
    """, limits=LIMITS.model_copy(update={"max_output_bytes": 2**20}))
    assert result.status == "ok", result.stderr
    *lines, fds = result.stdout.splitlines()
    cmdline = "\n".join(lines)
    assert "/" not in cmdline and "root_plan" not in cmdline and "{" not in cmdline, cmdline
    assert fds == "[]"  # nor an inherited descriptor (the configuration, the status pipe)


@needs_namespaces
@pytest.mark.skipif("overlay" not in open("/proc/filesystems").read(), reason="no overlayfs: the prefix is a bind")
def test_mount_table_and_pid_1_name_no_host_path():
    """The interpreter's prefix is mounted as an overlay whose layers are named by descriptor, so neither the
    mount table (/proc/self/mountinfo, mounts, mountstats), the memory map nor /proc/1/cmdline shows the
    checkout, the interpreter, its prefix, the virtual environment, the home or working directory (the
    system folders the sandbox binds are in view anyway)."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    host = {os.path.realpath(p) for p in (checkout, sys.executable, os.path.dirname(os.path.realpath(sys.executable)),
                                          sys.base_prefix, sys.prefix, os.path.expanduser("~"), os.getcwd())}
    host = {p for p in host if p != "/" and p.split("/")[1] not in sandbox_root.SYSTEM_DIRS}
    assert host  # here: at least the checkout
    result = run("""
        import sys
        for name in ("self/mountinfo", "1/mountinfo", "self/mounts", "self/mountstats", "self/maps", "1/cmdline"):
            print(open(f"/proc/{name}", "rb").read().decode(errors="replace"))
        import json, decimal, sqlite3  # the standard library (compiled modules too) through the overlay
        print(sys.base_prefix == sys.prefix != "")
    """, limits=LIMITS.model_copy(update={"max_output_bytes": 2**20}))
    assert result.status == "ok", result.stderr
    assert result.stdout.endswith("True\n")
    assert not [p for p in host if p in result.stdout], result.stdout


SECCOMP_MACHINES = ["aarch64", "riscv64", "x86_64"]  # the architectures the filter knows
# The errno the filter gives in test_seccomp_filter_in_the_kernel: no syscall returns it by itself.
TEST_ERRNO = 131  # ENOTRECOVERABLE


def bpf_verdict(program: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """Run a classic BPF seccomp program (the few opcodes the sandbox uses) on one seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    insns = [struct.unpack_from("HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")


@pytest.mark.parametrize("machine", SECCOMP_MACHINES)
def test_seccomp_filter_program(machine):
    arch, numbers = seccomp.SECCOMP_ARCHES[machine]
    program = seccomp.seccomp_filter(machine)
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
    for name, nr in numbers.items():
        if name == "clone":
            assert bpf_verdict(program, arch, nr, (17,)) == allow  # fork
            assert bpf_verdict(program, arch, nr, (0x003D0F00,)) == allow  # a thread
            for flag in (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
                assert bpf_verdict(program, arch, nr, (flag | 17,)) == eperm, hex(flag)
        else:
            assert bpf_verdict(program, arch, nr) == (enosys if name == "clone3" else eperm), name
    assert set(numbers) >= {"unshare", "setns", "clone", "clone3", "mount", "umount2", "pivot_root", "chroot",
                            "fsopen", "fsmount", "move_mount", "open_tree", "mount_setattr"}
    denied = set(numbers.values())
    for nr in range(0, 500):  # every other syscall passes, read, write, mmap, execve, ... included
        if nr not in denied:
            assert bpf_verdict(program, arch, nr, (0x10000000,)) == allow, nr
    assert bpf_verdict(program, arch ^ 1, 0) == kill  # another ABI (i386 on x86_64): the process dies
    if machine == "x86_64":  # the x32 ABI numbers syscalls from 0x40000000: refused as unknown
        assert bpf_verdict(program, arch, 0x40000000 | numbers["unshare"]) == enosys
        assert bpf_verdict(program, arch, 0x40000000 | 39) == enosys
    assert seccomp.seccomp_filter("pdp11") is None


SECCOMP_PROBE = """
import ctypes, json, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
program = bytes.fromhex(sys.argv[1])
numbers = json.loads(sys.argv[2])
buf = ctypes.create_string_buffer(program, len(program))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(program) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, os.strerror(ctypes.get_errno())  # SECCOMP_MODE_FILTER
out = {}
for name, nr in numbers.items():
    flags = 0x10000000 | 17 if name == "clone" else 0  # clone into a new user namespace
    ret = libc.syscall(nr, ctypes.c_long(flags), 0, 0, 0, 0, 0)
    if ret == 0 and name == "clone":
        os._exit(0)
    out[name] = ctypes.get_errno() if ret == -1 else "ok"
pid = os.fork()
if pid == 0:
    os._exit(3)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
t = threading.Thread(target=lambda: out.setdefault("thread", "ran"))
t.start(), t.join()
out["pid"] = os.getpid() > 0
print(json.dumps(out))
"""


@pytest.mark.skipif(os.uname().machine not in SECCOMP_MACHINES, reason="no seccomp filter for this architecture")
def test_seccomp_filter_in_the_kernel():
    # The filter this machine's sandbox installs, with a distinctive errno, in a real process:
    # every listed syscall fails with that errno (clone only with CLONE_NEW* flags, clone3 with
    # ENOSYS so that glibc falls back to clone), while fork, threads and the rest work.
    machine = os.uname().machine
    numbers = seccomp.SECCOMP_ARCHES[machine][1]
    program = seccomp.seccomp_filter(machine, deny_errno=TEST_ERRNO)
    proc = subprocess.run([sys.executable, "-c", SECCOMP_PROBE, program.hex(), json.dumps(numbers)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = {name: errno.ENOSYS if name == "clone3" else TEST_ERRNO for name in numbers}
    assert out == {**expected, "fork": 3, "thread": "ran", "pid": True}


# ---------------------------------------------------------------------------- network, environment


@pytest.fixture()
def local_server():
    """A TCP server on 127.0.0.1 that counts accepted connections."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


NETWORK_PROBE = """
    import socket
    for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 80)):
        try:
            socket.create_connection((host, port), timeout=1).close()
            print("connected", host)
        except Exception as e:
            print("blocked", host, type(e).__name__)
    try:
        socket.getaddrinfo("example.com", 80)
        print("resolved")
    except Exception as e:
        print("blocked dns", type(e).__name__)
"""


def test_network_is_blocked_inside_the_sandbox_only(local_server):
    port, accepted = local_server
    socket.create_connection(("127.0.0.1", port), timeout=1).close()  # works from the test process
    deadline = time.monotonic() + 2
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(accepted) == 1

    result = run(NETWORK_PROBE.format(port=port))
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["blocked"] * 3, lines
    assert result.wall_s < 1.0  # refused at once: no connect or DNS timeout
    time.sleep(0.3)
    assert len(accepted) == 1  # the sandbox never reached the server


def test_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("R1FLOW_FAKE_SECRET", "hunter2")
    code = "import os\nprint(sorted(os.environ))\nprint(hash('determinism'))\n"
    first, second = run(code), run(code)
    assert "hunter2" not in first.stdout and "R1FLOW_FAKE_SECRET" not in first.stdout
    assert "'PATH'" in first.stdout
    assert first.stdout == second.stdout  # PYTHONHASHSEED is fixed: str hashes, set order repeat


# ---------------------------------------------------------------------------- threads, fallback


def test_concurrent_runs_from_threads():
    # Each program starts a child: with max_processes=1 this only works if concurrent runs do
    # not share one uid's process budget. One fork bomb runs alongside.
    code = "import subprocess, sys\nn = int(sys.stdin.read())\nsubprocess.run(['true'])\nprint(n * n)\n"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    with ThreadPoolExecutor(max_workers=6) as pool:
        bombed = pool.submit(run, bomb)
        results = list(pool.map(lambda n: run(code, stdin=str(n)), range(10)))
    assert bombed.result().status in {"timeout", "error"}
    if NAMESPACES:
        assert [r.stdout for r in results] == [f"{n * n}\n" for n in range(10)]
    else:  # the audit hook refuses subprocesses altogether
        assert all("subprocess.Popen is blocked" in r.stderr for r in results)


def test_audit_hook_fallback_blocks_network_and_processes(local_server, monkeypatch):
    monkeypatch.setenv(sandbox.WEAK_ENV, "1")
    port, accepted = local_server
    result, _ = sandbox._run(textwrap.dedent(NETWORK_PROBE.format(port=port)), "", LIMITS, namespaces=False)
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["blocked"] * 3
    assert accepted == []
    for code, event in [("import os\nos.fork()", "os.fork"), ("import os\nos.system('true')", "os.system"),
                        ("import ctypes", "ctypes.dlopen")]:
        result, _ = sandbox._run(code, "", LIMITS, namespaces=False)
        assert result.status == "error" and f"{event} is blocked" in result.stderr, result.stderr
    result, _ = sandbox._run("while True:\n    pass\n", "", LIMITS, namespaces=False)
    assert result.status == "timeout"


def test_audit_hook_mode_needs_the_explicit_opt_in(monkeypatch, caplog):
    monkeypatch.delenv(sandbox.WEAK_ENV, raising=False)
    with pytest.raises(SandboxSetupError, match="R1FLOW_SANDBOX_ALLOW_WEAK=1"):
        sandbox._run("print(1)", "", LIMITS, namespaces=False)
    monkeypatch.setattr(sandbox, "_ISOLATION", {"mode": "audit-hook", "read_only_root": False, "reason": "test"})
    with pytest.raises(SandboxSetupError, match="R1FLOW_SANDBOX_ALLOW_WEAK"):
        run_program("print(1)", "", LIMITS)
    with pytest.raises(SandboxSetupError):
        run_tests(ADD, CASES, LIMITS)
    monkeypatch.setenv(sandbox.WEAK_ENV, "0")
    with pytest.raises(SandboxSetupError):
        run_program("print(1)", "", LIMITS)

    monkeypatch.setenv(sandbox.WEAK_ENV, "1")
    monkeypatch.setattr(sandbox, "_WEAK_WARNED", False)
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert run_program("print(1)", "", LIMITS).stdout == "1\n"
        assert run_tests(ADD, CASES, LIMITS) == 1.0
    warnings = [r for r in caplog.records if sandbox.WEAK_ENV in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once per process


def test_isolation_report():
    info = isolation()
    assert info["mode"] in {"namespaces", "audit-hook"}
    if NAMESPACES:
        assert os.geteuid() == 0
    else:
        assert re.search(r"\S", info["reason"])
