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
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from schemas.configs import SandboxLimits
from stages.rewards import sandbox
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
    """Live processes (not zombies) whose command line or cwd lies in one run's directory."""
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
        if state != "Z" and (base in cmdline or cwd.startswith(base)):
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
    monkeypatch.setattr(sandbox, "_hidden_paths", lambda: [subfolders(hidden)[0], hidden, "/usr/lib", "/usr"])
    result = run(f"import os\nprint(os.listdir({hidden!r}), len(os.listdir('/usr/lib')) > 0)")
    assert (result.status, result.stdout) == ("ok", "[] True\n"), result.stderr
    monkeypatch.undo()
    monkeypatch.setenv("R1FLOW_HOME", os.path.dirname(fake_home))
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert {os.path.realpath(checkout), os.path.realpath(os.path.dirname(fake_home))} <= set(sandbox._hidden_paths())


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
