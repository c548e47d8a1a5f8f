"""Nothing a run starts outlives it (issue 28 items 5 and 7): the sentinel, SIGTERM, the ranks lock,
launch work directories; end to end, kill -9 and SIGTERM of `r1flow run` with SFT on two processes,
and after kill -9 the same command at once resumes from the last checkpoint and trains exactly the
remaining steps (the in-process tests in test_sft.py check the loss at every crash position)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from schemas.errors import StageError
from stages.runtime import lifetime
from stages.training import launch

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, **kw)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if lifetime.alive(p, None)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_the_sentinel_ends_every_process_of_a_run_killed_with_sigkill():
    """Grandchildren in their own session, one ignoring SIGTERM, one re-parented to init: all end."""
    run = _python("""
        import subprocess, sys, time
        from stages.runtime import lifetime
        lifetime.adopt()
        sleeper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        a = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
        b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        c = subprocess.Popen([sys.executable, "-c",  # double fork: its child is re-parented to init at once
                              "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(600)'], start_new_session=True).pid)"],
                             stdout=subprocess.PIPE, text=True)
        orphan = int(c.stdout.readline())
        print(a.pid, b.pid, orphan, flush=True)
        time.sleep(600)
    """, start_new_session=True)
    pids = [int(p) for p in run.stdout.readline().split()]
    assert all(lifetime.alive(p, None) for p in pids)
    run.kill()
    run.wait()
    try:
        assert _wait_gone(pids, lifetime.SENTINEL_GRACE_S + 5) == []
    finally:
        for p in pids:
            if lifetime.alive(p, None):
                os.kill(p, signal.SIGKILL)


def test_sigterm_stops_a_process_whose_worker_thread_never_returns():
    """A generation in a task thread kept the interpreter alive for 11 minutes after SIGTERM."""
    run = _python("""
        import threading, time
        from stages.runtime import lifetime
        lifetime.EXIT_GRACE_S = 1.0
        lifetime.terminate_on_signals("stopping ({name})")
        worker = threading.Thread(target=lambda: time.sleep(600))  # not a daemon: blocks interpreter exit
        worker.start()
        print("ready", flush=True)
        worker.join()
    """, stderr=subprocess.PIPE)
    assert run.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    run.send_signal(signal.SIGTERM)
    try:
        code = run.wait(timeout=15)
    finally:
        run.kill()
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 5
    assert "stopping (SIGTERM)" in run.stderr.read()


def test_a_launch_waits_for_the_ranks_of_an_earlier_run(tmp_path):
    ckpt = tmp_path / "checkpoints" / "key"
    lock = launch.ranks_lock_path(ckpt)
    lock.parent.mkdir(parents=True)
    rank = _python(f"""
        import fcntl, time
        f = open({str(lock)!r}, "a")
        fcntl.flock(f, fcntl.LOCK_SH)
        print("holding", flush=True)
        time.sleep(600)
    """)
    assert rank.stdout.readline().strip() == "holding"
    log = logging.getLogger("test")
    try:
        with pytest.raises(StageError, match="earlier run still hold"):
            launch.wait_for_earlier_ranks(ckpt, "sft", log, timeout=0.5)
        threading_kill = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {rank.pid}"])
        t0 = time.monotonic()
        launch.wait_for_earlier_ranks(ckpt, "sft", log, timeout=30)  # returns once the rank is gone
        assert 0.5 < time.monotonic() - t0 < 10
        threading_kill.wait()
    finally:
        rank.kill()
        rank.wait()


def test_launch_work_directories_of_dead_runners_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    me = os.getpid()
    (tmp_path / f"{launch.WORK_PREFIX}sft-{dead_pid}-123-abc").mkdir()
    (tmp_path / f"{launch.WORK_PREFIX}sft-{me}-{lifetime.start_ticks(me)}-abc").mkdir()
    (tmp_path / f"{launch.WORK_PREFIX}sft-oldstyle").mkdir()  # not ours to judge: kept
    assert launch.sweep_work_dirs(tmp_path) == 1
    assert {p.name.split("-")[3] for p in tmp_path.iterdir()} == {"oldstyle", str(me)}


# ---------------------------------------------------------------------------- end to end

MAX_STEPS, EVERY = 60, 20  # killed after the first checkpoint; the re-run trains the rest
ARGS = ["-m", "flows.cli", "run", "--recipe", "sft-eval", "--profile", "tiny",
        "--set", f"sft.max_steps={MAX_STEPS}", "--set", f"sft.checkpoint_every={EVERY}"]
TWO_RANKS = ["--set", "sft.resources.num_processes=2"]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, R1FLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), PYTHONPATH=str(ROOT))
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", lifetime.TOKEN_VAR, lifetime.PARENT_VAR):
        env.pop(key, None)
    return env


def _start_and_wait_for_a_checkpoint(home: Path, tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen, list[int]]:
    # The CLI in a session of its own, signalled alone (not its group): as `kill PID` or `timeout` would.
    cli = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=_env(home), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(home.glob("checkpoints/*/step-*/state.json")):
        assert cli.poll() is None, cli.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)
    return cli, lifetime.processes_started_by(cli.pid)


@pytest.mark.slow
def test_sigkill_of_a_run_on_two_processes_leaves_no_process_and_a_rerun_resumes(tmp_path):
    """Item 5: kill -9 of the CLI alone left accelerate's launcher and both ranks training outside the stage lock,
    and an immediate re-run trained into the same checkpoint folder beside them."""
    home = tmp_path / "home"
    cli, procs = _start_and_wait_for_a_checkpoint(home, tmp_path, [*ARGS, *TWO_RANKS])
    try:
        assert len(procs) >= 4  # Prefect's temporary server, accelerate's launcher, two ranks
        cli.send_signal(signal.SIGKILL)
        assert cli.wait(timeout=30) == -signal.SIGKILL
        left = _wait_gone(procs, lifetime.SENTINEL_GRACE_S + 10)
    finally:
        for p in lifetime.processes_started_by(cli.pid):
            os.kill(p, signal.SIGKILL)
    assert left == [], f"still running after the run ended: {left}"
    assert not any(json.loads(p.read_text())["node"] == "sft" for p in home.glob("cache/*.json"))  # never published
    # At once, the same command: it resumes in the same checkpoint folder, never beside a live rank.
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, *ARGS, *TWO_RANKS, "--only", "sft", "--json", str(out)], cwd=tmp_path,
                          env=_env(home), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sft = next(s for s in json.loads(out.read_text())["stages"] if s["node"] == "sft")
    resumed = int(sft["metrics"]["resumed_from_step"])
    assert sft["status"] == "run" and resumed >= EVERY and resumed % EVERY == 0  # the last complete checkpoint
    assert int(sft["metrics"]["trained_steps"]) == MAX_STEPS - resumed
    assert not any(home.glob("checkpoints/*/step-*"))  # spent checkpoints are removed once the model is published
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{launch.WORK_PREFIX}sft-{cli.pid}-*"))


@contextlib.contextmanager
def cpu_load():
    """Three busy processes per core (the soak's load: runs training side by side)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


SIGTERM_WITHIN_S = 10.0  # docs/limits.md: SIGTERM ends a run within 10 s, under load too


@pytest.mark.slow
def test_sigterm_stops_a_run_and_its_prefect_server_within_seconds_under_load(tmp_path):
    """Item 7 of issue 28: SIGTERM (as `timeout` sends it) exited 143 but left Prefect's temporary server listening
    for minutes. Issue 44 item 13: under load it took 17-23 s (the backstop counted from when the handler got to
    run, and the interpreter's exit, Prefect's 5 s wait for its server included, came after it). One process here
    (the SIGKILL test covers launched ranks; the sentinel is the same)."""
    home = tmp_path / "home"
    cli, procs = _start_and_wait_for_a_checkpoint(home, tmp_path, ARGS)
    try:
        assert procs  # Prefect's temporary server at least
        with cpu_load():
            t0 = time.monotonic()
            cli.send_signal(signal.SIGTERM)
            code = cli.wait(timeout=60)
            stopped_s = time.monotonic() - t0
        left = _wait_gone(procs, lifetime.SENTINEL_GRACE_S + 10)
    finally:
        for p in lifetime.processes_started_by(cli.pid):
            os.kill(p, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM and stopped_s < SIGTERM_WITHIN_S, (code, stopped_s)
    assert left == [], f"still running after the run ended: {left}"
    assert "stopping (SIGTERM)" in cli.stderr.read()


def test_a_process_exits_without_collecting_what_is_still_alive():
    """exit_without_final_collection: objects alive at exit (here a reference cycle whose finaliser would print)
    are not collected in the interpreter's final pass, which costs seconds with torch and Prefect loaded; exit
    handlers registered later still run first. Where triton is loaded (vLLM's), the final pass runs: its nanobind
    bindings print a "leaked" line for every object a frozen heap keeps."""
    code = ("import atexit, sys, types; from stages.runtime.lifetime import exit_without_final_collection\n"
            "class Cycle:\n    def __del__(self): print('collected', flush=True)\n"
            "c = Cycle(); c.me = c; del c\n"
            "if sys.argv[1] != 'collect': exit_without_final_collection()\n"
            "if sys.argv[1] == 'triton': sys.modules['triton'] = types.ModuleType('triton')\n"
            "atexit.register(lambda: print('handler', flush=True))\n")
    outputs = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                                    cwd=Path(__file__).resolve().parents[1]).stdout.split()
               for mode in ("collect", "skip", "triton")}
    assert outputs == {"collect": ["handler", "collected"], "skip": ["handler"], "triton": ["handler", "collected"]}
