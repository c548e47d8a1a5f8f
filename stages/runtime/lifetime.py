"""Process lifetimes: nothing a run starts outlives it, whatever ends it (kill -9 included).

A run's processes are the CLI process and what it starts: Prefect's temporary API server,
`accelerate launch` and its ranks (own sessions), reward sandboxes. A terminal's Ctrl-C reaches
only its process group, `timeout` and `kill` only one pid, and kill -9 runs no cleanup at all,
so the CLI cannot be the one that cleans up. Three mechanisms, standard library only:

- **A run token.** `adopt()` puts `R1FLOW_RUN_TOKEN=<uuid>` in the CLI's environment before it
  starts anything; every child inherits it (Prefect's server and accelerate copy os.environ),
  and the kernel keeps each process's initial environment in /proc/<pid>/environ, whatever
  session or parent it has since moved to.
- **A sentinel.** `adopt()` also starts `python -S lifetime.py sentinel PID TICKS TOKEN` in a
  session of its own (no token in its environment). It waits on a pidfd of the CLI process
  (no polling); when that process is gone, by any means, it finds every process whose initial
  environment holds the token, sends SIGTERM, and SIGKILL to those left after
  `SENTINEL_GRACE_S`. It then exits. The sandbox starts programs with a fresh environment; it
  has its own guarantees (PR_SET_PDEATHSIG, a pid namespace).
- **A parent watch** (`watch_parent`) in processes that must stop at once when the CLI dies and
  would otherwise go on writing: accelerate's ranks kill themselves (they write checkpoints,
  which a re-run must never share with a live writer; see also `stages.training.launch`'s rank lock).

`terminate_on_signals()` makes SIGTERM and SIGHUP end the CLI within seconds: a handler raises
SystemExit(143) in the main thread (finally blocks close MLflow runs and stop launcher groups),
and a timer forces `os._exit` after `EXIT_GRACE_S` if a worker thread holds the interpreter
(a generation in a task thread ignored SIGTERM for 11 minutes before). The sentinel then ends the
children. Prefect installs its own SIGTERM bridge during a flow run; the flow body re-installs
this one (flows/run/pipeline.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

TOKEN_VAR = "R1FLOW_RUN_TOKEN"
PARENT_VAR = "R1FLOW_RUN_PROCESS"  # "pid:start_ticks" of the CLI process, for watch_parent
SENTINEL_GRACE_S = 3.0
EXIT_GRACE_S = 8.0  # from the signal's arrival; docs/limits.md: a run ends within 10 s of SIGTERM


def exit_without_final_collection() -> None:
    """Skip the garbage collection Python runs over every object at interpreter exit: with torch, transformers,
    Prefect and MLflow loaded that pass costs a process seconds after its work is done (2-8 s here, idle core to
    busy one). Registered early, so it runs late, after the exit handlers registered since have flushed (Prefect's
    log and event workers, MLflow, the temporary server's stop); objects still alive are then frozen, which exempts
    them from that pass. Their memory goes back to the system with the process, as after os._exit."""
    import atexit

    atexit.register(_freeze)


def _freeze() -> None:
    """gc.freeze, unless triton is loaded (vLLM brings it): its nanobind bindings check at exit that every object
    was collected, and a frozen heap makes them print hundreds of "nanobind: leaked ..." lines."""
    import gc

    if "triton" not in sys.modules:
        gc.freeze()


def start_ticks(pid: int) -> int | None:
    """Process start time in clock ticks since boot (field 22 of /proc/<pid>/stat); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def alive(pid: int, ticks: int | None) -> bool:
    """Is pid the same process that had `ticks` (not a reused pid), and not a zombie?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != b"Z" and (ticks is None or int(fields[19]) == ticks)


def wait_for_exit(pid: int, ticks: int | None, poll_s: float = 0.5) -> None:
    """Block until the process (pid, ticks) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or no pidfds (Linux < 5.3): poll
        fd = None
    try:
        if fd is not None and alive(pid, ticks):  # the pidfd names the process that had ticks
            while select.select([fd], [], [], 5.0)[0] == [] and alive(pid, ticks):
                pass  # readable when it exits; the timeout only guards a zombie parent nobody reaps
            return
        while alive(pid, ticks):
            time.sleep(poll_s)
    finally:
        if fd is not None:
            os.close(fd)


def processes_with_token(token: str) -> list[tuple[int, int | None]]:
    """(pid, start ticks) of every process whose initial environment holds R1FLOW_RUN_TOKEN=token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if needle in env:
            found.append((int(entry), start_ticks(int(entry))))
    return found


def processes_started_by(pid: int) -> list[int]:
    """Live processes started by the run whose CLI is `pid` (their environment holds R1FLOW_RUN_PROCESS=<pid>:...),
    for checks that nothing was left (tests, benchmarks/soak.py)."""
    needle = f"{PARENT_VAR}={pid}:".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(needle) for e in env) and alive(int(entry), None):
            found.append(int(entry))
    return found


def end_processes(procs: list[tuple[int, int | None]], grace: float = SENTINEL_GRACE_S) -> list[int]:
    """SIGTERM each, SIGKILL those still alive after `grace` seconds; the pids that needed SIGKILL."""
    for pid, _ in procs:
        with _ignore_gone():
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p, t) for p, t in procs):
        time.sleep(0.1)
    killed = []
    for pid, ticks in procs:
        if alive(pid, ticks):
            with _ignore_gone():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


class _ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, (ProcessLookupError, PermissionError))


def sentinel(pid: int, ticks: int | None, token: str) -> None:
    """Wait for the process to end, then end everything that carries its token (repeated once: a
    child may have started one more process while dying)."""
    wait_for_exit(pid, ticks)
    for _ in range(2):
        procs = processes_with_token(token)
        if not procs:
            return
        end_processes(procs)


def adopt() -> str:
    """Give this process a run token and start its sentinel; returns the token. Idempotent."""
    if os.environ.get(TOKEN_VAR) and os.environ.get(PARENT_VAR, "").startswith(f"{os.getpid()}:"):
        return os.environ[TOKEN_VAR]
    token = uuid.uuid4().hex
    ticks = start_ticks(os.getpid())
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_VAR, PARENT_VAR)}
    if Path("/proc/self/environ").exists():
        subprocess.Popen([sys.executable, "-S", str(Path(__file__).resolve()), "sentinel", str(os.getpid()),
                          str(ticks), token], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    os.environ[TOKEN_VAR] = token
    os.environ[PARENT_VAR] = f"{os.getpid()}:{ticks}"
    return token


def watch_parent(on_exit: Callable[[], None] | None = None) -> bool:
    """In a child of a run: when the run's CLI process (R1FLOW_RUN_PROCESS) is gone, call on_exit
    (default: SIGKILL this process) from a daemon thread. False when there is nothing to watch."""
    spec = os.environ.get(PARENT_VAR, "")
    if ":" not in spec:
        return False
    pid, ticks = spec.split(":", 1)
    ticks_value = int(ticks) if ticks.isdigit() else None

    def watch():
        wait_for_exit(int(pid), ticks_value)
        (on_exit or (lambda: os.kill(os.getpid(), signal.SIGKILL)))()

    threading.Thread(target=watch, name="r1flow-parent-watch", daemon=True).start()
    return True


def terminate_on_signals(message: str = "r1flow: stopping ({name})") -> None:
    """SIGTERM/SIGHUP: SystemExit(128+signum) in the main thread now, os._exit EXIT_GRACE_S after the signal
    arrived. Call from the main thread."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    global _MESSAGE, _INSTALLED
    _MESSAGE, _INSTALLED = message, True
    _watch_arrivals()


_arrival_pipe: tuple[int, int] | None = None


def _watch_arrivals() -> None:
    """Arm the backstop when SIGTERM/SIGHUP arrives, not when the main thread gets to run its handler: Python runs
    a handler between bytecodes only, and a main thread inside one long C call (a training step on a loaded
    machine) ran it seconds late; the backstop counted from there and SIGTERM took 17-23 s (issue 44 item 13).
    The interpreter's C-level handler writes the signal number to the wakeup fd at once; a thread reads it.
    Another wakeup fd already set (an asyncio loop's) is left in place."""
    global _arrival_pipe
    if _arrival_pipe is None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        _arrival_pipe = (r, w)
        threading.Thread(target=_arrivals, args=(r,), name="r1flow-signal-arrivals", daemon=True).start()
    old = signal.set_wakeup_fd(_arrival_pipe[1], warn_on_full_buffer=False)
    if old not in (-1, _arrival_pipe[1]):
        signal.set_wakeup_fd(old)


def _arrivals(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGHUP):
                exit_soon(128 + signum)  # no-op when stop() or the handler armed it already


def reinstall() -> None:
    """Put the SIGTERM/SIGHUP handler back where a library replaced it: Prefect's flow engine installs its own
    SIGTERM bridge for a flow's duration, and a run whose task catches the TerminationSignal it raises went on
    (seen in CI: still running 30 s after SIGTERM). No-op unless terminate_on_signals ran in this process, and
    off the main thread. Prefect restores this handler when the flow ends."""
    if _INSTALLED and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGHUP, _terminate)
        _watch_arrivals()


_MESSAGE = "r1flow: stopping ({name})"
_INSTALLED = False
_stopping = threading.Event()


_backstop = threading.Lock()
_backstop_armed = False


def exit_soon(code: int, grace: float | None = None) -> None:
    """os._exit(code) in `grace` (default EXIT_GRACE_S) seconds unless the process has exited by then. Once per
    process: the first call's code and time stand."""
    global _backstop_armed
    with _backstop:
        if _backstop_armed:
            return
        _backstop_armed = True

    def force():
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_S if grace is None else grace, force)
    timer.daemon = True
    timer.start()


_stop_code: int | None = None  # set by stop(): the code the main thread exits with


def stopping() -> bool:
    """Is this process on its way out (a signal, or stop_run())? Retries and clean-ups then give up at once."""
    return _stopping.is_set()


def stop_run(message: str, code: int = 1, grace: float | None = None) -> bool:
    """From any thread: end the run as SIGTERM would, with one line of our own. Writes `message` to stderr on a line
    of its own, then points stderr at /dev/null (what a dying run's libraries print next, retries of the server that
    is gone, would only bury the line), arms the os._exit backstop and raises SystemExit(code) in the main thread (a
    SIGTERM sent to it: a sleep or a blocking call there is interrupted). False when already stopping.
    Needs terminate_on_signals (the handler that raises); without it, the backstop alone ends the process."""
    global _stop_code
    if _stopping.is_set():
        return False
    _stopping.set()
    _stop_code = code
    # on a line of its own: a progress bar (tqdm ends its updates with \r, not \n) may hold the current one
    sys.stderr.write("\n" + message + "\n")
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    exit_soon(code, grace)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    return True


def _terminate(signum, frame):
    global _stop_code
    if _stop_code is not None and threading.current_thread() is threading.main_thread():
        code, _stop_code = _stop_code, None  # stop()'s: raised once, its line already written
        raise SystemExit(code)
    code = 128 + signum
    if _stopping.is_set():
        return  # already on its way out
    _stopping.set()
    sys.stderr.write(_MESSAGE.format(name=signal.Signals(signum).name) + "\n")  # not print(): inside a flow
    sys.stderr.flush()  # Prefect's log_prints turns print() into a log record that may never be written
    exit_soon(code)
    raise SystemExit(code)


if __name__ == "__main__":  # python -S lifetime.py sentinel PID TICKS TOKEN
    if len(sys.argv) == 5 and sys.argv[1] == "sentinel":
        sentinel(int(sys.argv[2]), None if sys.argv[3] == "None" else int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("usage: lifetime.py sentinel PID TICKS TOKEN")
