"""What a run killed with kill -9 leaves behind (issue 28): its staging and incoming folders, set-aside copies of
damaged artifacts, and its Prefect flow/task runs and MLflow runs left RUNNING. The next run cleans what a provably
dead process owned, keeps the newest few set-aside copies, and never touches what a live run on the same home uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flows.store.artifacts import ArtifactStore, host_id, parse_owner, process_owner

ROOT = Path(__file__).resolve().parents[1]


def _dead_process() -> tuple[int, int]:
    """(pid, start ticks) of a process that was killed with kill -9 (and reaped)."""
    from flows.servers.processes import proc_stat

    proc = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"])
    ticks = proc_stat(proc.pid)[2]
    proc.kill()
    proc.wait()
    return proc.pid, ticks


@pytest.fixture()
def live_process():
    """(pid, start ticks) of another process that is running (a concurrent run on the same home)."""
    from flows.servers.processes import proc_stat

    proc = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid, proc_stat(proc.pid)[2]
    finally:
        proc.kill()
        proc.wait()


def _folder(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * 10)
    return path


def test_sweep_removes_only_the_folders_of_dead_owners(tmp_path, live_process):
    store = ArtifactStore(tmp_path / "store", home=tmp_path / "home")
    tmp, artifacts = tmp_path / "home" / "tmp", tmp_path / "store" / "artifacts"
    mine = store.new_staging_dir()  # this (live) process's own staging folder
    assert parse_owner(mine.name) == (os.getpid(), int(process_owner().split("-")[1]), host_id())
    (mine / "x").write_text("in use")
    dead_pid, dead_ticks = _dead_process()
    live_pid, live_ticks = live_process
    dead = f"{dead_pid}-{dead_ticks}-{host_id()}"
    dead_staging = _folder(tmp, f"{dead}-{uuid.uuid4().hex}")
    dead_incoming = _folder(artifacts, f".incoming-{dead}-{uuid.uuid4().hex}")
    reused = _folder(tmp, f"{os.getpid()}-{int(process_owner().split('-')[1]) + 1}-{host_id()}-{uuid.uuid4().hex}")
    live = f"{live_pid}-{live_ticks}-{host_id()}"
    kept = [mine,
            _folder(tmp, f"{live}-{uuid.uuid4().hex}"),  # a concurrent run's
            _folder(artifacts, f".incoming-{live}-{uuid.uuid4().hex}"),
            _folder(tmp, f"{dead_pid}-{dead_ticks}-{'0' * 8 if host_id() != '0' * 8 else '1' * 8}-{uuid.uuid4().hex}"),
            _folder(tmp, uuid.uuid4().hex),  # named before folders named their owner: not provably abandoned
            _folder(artifacts, f".incoming-{uuid.uuid4().hex}")]

    assert store.sweep() == {"staging": 2, "incoming": 1, "corrupt": 0}
    assert not dead_staging.exists() and not dead_incoming.exists()
    assert not reused.exists()  # this pid, another start time: the pid was reused, its owner is gone
    assert all(p.exists() for p in kept)
    assert (mine / "x").read_text() == "in use"


def test_a_failed_publish_leaves_no_incoming_folder(tmp_path, monkeypatch):
    from schemas.artifacts import Producer
    from schemas.errors import ArtifactError

    store = ArtifactStore(tmp_path / "store", home=tmp_path / "home")
    staged = _folder(store.new_staging_dir(), "data")

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(ArtifactError, match="no space left on device writing .*incoming"):  # one line, test_store
        store.publish(staged, kind="dataset", schema="prompts", producer=Producer(stage="t", stage_version="1",
                                                                                config_hash=""), parents=[])
    assert not [p for p in (tmp_path / "store" / "artifacts").iterdir() if p.name.startswith(".incoming-")]


def test_set_aside_copies_beyond_the_cap_are_removed_newest_kept(tmp_path):
    from flows.store.artifacts import KEEP_CORRUPT
    from schemas.artifacts import Producer

    store = ArtifactStore(tmp_path / "store", home=tmp_path / "home")
    artifacts = tmp_path / "store" / "artifacts"
    older = _folder(artifacts, ".corrupt-aaaaaaaaaaaa-0123ab")  # set aside before names carried a time

    def publish():
        staged = store.new_staging_dir()
        (staged / "data.txt").write_text("the same bytes")
        return store.publish(staged, kind="dataset", schema="prompts", parents=[],
                             producer=Producer(stage="t", stage_version="1", config_hash=""))

    final = artifacts / publish().fingerprint / "data.txt"
    order = []  # set-aside copies, oldest first
    for i in range(KEEP_CORRUPT + 2):
        final.write_text(f"damaged {i}")  # the next publish of the same bytes sets it aside
        before = {p.name for p in artifacts.glob(".corrupt-*")}
        publish()
        order += sorted({p.name for p in artifacts.glob(".corrupt-*")} - before)
        assert len(list(artifacts.glob(".corrupt-*"))) <= KEEP_CORRUPT
    assert len(order) == KEEP_CORRUPT + 2 and final.read_text() == "the same bytes"
    left = {p.name for p in artifacts.glob(".corrupt-*")}
    assert left == set(order[-KEEP_CORRUPT:]) and not older.exists()
    assert sorted((artifacts / n / "data.txt").read_text() for n in left) == [
        f"damaged {i}" for i in range(2, KEEP_CORRUPT + 2)]
    assert store.sweep(keep_corrupt=1) == {"staging": 0, "incoming": 0, "corrupt": KEEP_CORRUPT - 1}
    assert [p.name for p in artifacts.glob(".corrupt-*")] == order[-1:]


def test_the_next_run_closes_a_killed_runs_prefect_and_mlflow_runs_and_folders(tmp_path, live_process):
    """A process that owned a RUNNING Prefect flow run (with a RUNNING task run), RUNNING MLflow runs and a staging
    folder is killed with kill -9; the next pipeline run marks them Crashed / KILLED and removes the folder, and
    leaves alone a live process's runs, another host's, and runs that name no owner."""
    from mlflow.tracking import MlflowClient
    from prefect import flow, get_client, task
    from prefect.client.schemas import filters as f
    from prefect.states import Running

    from flows.run.pipeline import pipeline
    from flows.run.reclaim import PREFECT_HOST_LABEL, PREFECT_PROCESS_LABEL
    from flows.servers.processes import proc_stat
    from flows.servers.settings import Settings
    from flows.track.tracking import Tracker
    from schemas.errors import ConfigError
    from tests.conftest import harness_home

    home = tmp_path / "home"
    s = Settings(str(home), str(home), f"sqlite:///{home}/mlflow.db")
    dead_pid, dead_ticks = _dead_process()
    live_pid, live_ticks = live_process
    other_host = "0" * 8 if host_id() != "0" * 8 else "1" * 8
    dead_staging = _folder(home / "tmp", f"{dead_pid}-{dead_ticks}-{host_id()}-{uuid.uuid4().hex}")
    live_staging = _folder(home / "tmp", f"{live_pid}-{live_ticks}-{host_id()}-{uuid.uuid4().hex}")

    def owner(pid: int, ticks: int, host: str = host_id()) -> dict[str, str]:
        return {PREFECT_HOST_LABEL: host, PREFECT_PROCESS_LABEL: f"{pid}:{ticks}"}

    tracker = Tracker(s.tracking_uri, "r1flow/sft-eval")
    assert tracker.client.get_run(tracker.start_run("mine", {})).data.tags["r1flow.process"] == \
        f"{os.getpid()}:{proc_stat(os.getpid())[2]}"  # runs name the process that made them

    def mlflow_run(pid: int, ticks: int, host: str = host_id()) -> str:
        tags = {"r1flow.host": host, "r1flow.process": f"{pid}:{ticks}"}
        return tracker.client.create_run(tracker.experiment_id, run_name="r", tags=tags).info.run_id

    dead_mlflow = [mlflow_run(dead_pid, dead_ticks), mlflow_run(dead_pid, dead_ticks)]
    live_mlflow = [mlflow_run(live_pid, live_ticks), mlflow_run(dead_pid, dead_ticks, other_host)]

    @flow(name="fabricated")
    def fabricated():  # pragma: no cover - never run: it names the runs created below
        pass

    @task(name="stage")
    def stage():  # pragma: no cover
        pass

    with harness_home(home), get_client(sync_client=True) as client:
        def flow_run(labels: dict[str, str]):
            run = client.create_flow_run(fabricated, state=Running())
            client.update_flow_run_labels(run.id, labels)
            return run

        killed = flow_run(owner(dead_pid, dead_ticks))
        killed_task = client.create_task_run(stage, killed.id, "0", state=Running())
        untouched = [flow_run(labels) for labels in (
            owner(live_pid, live_ticks),  # a concurrent run on this home
            owner(dead_pid, dead_ticks, other_host),  # another machine's: its pids mean nothing here
            {})]  # made before runs named their owner
        untouched_task = client.create_task_run(stage, untouched[0].id, "0", state=Running())
        # a run whose Prefect server died before its labels were written: only the owner file on disk names it
        unlabelled = client.create_flow_run(fabricated, state=Running())
        owners = home / "flow-runs"
        owners.mkdir(parents=True)
        (owners / str(unlabelled.id)).write_text(json.dumps(owner(dead_pid, dead_ticks)))
        (owners / str(uuid.uuid4())).write_text(json.dumps(owner(dead_pid, dead_ticks)))  # a finished run's: removed

        # The next run (its only stage's upstream is not cached: it stops with a ConfigError once started).
        with pytest.raises(ConfigError, match="no valid cached outputs"):
            pipeline(recipe="sft-eval", profile="tiny", only=["eval_sft"], settings=s.to_dict())

        crashed = client.read_flow_run(killed.id).state
        assert crashed.type.value == "CRASHED" and f"abandoned: process {dead_pid} on" in crashed.message
        assert client.read_task_run(killed_task.id).state.type.value == "CRASHED"
        assert client.read_flow_run(unlabelled.id).state.type.value == "CRASHED"
        assert [client.read_flow_run(r.id).state.type.value for r in untouched] == ["RUNNING"] * 3
        assert client.read_task_run(untouched_task.id).state.type.value == "RUNNING"
        me = [r for r in client.read_flow_runs(flow_run_filter=f.FlowRunFilter())
              if owner(os.getpid(), proc_stat(os.getpid())[2]).items() <= r.labels.items()]
        assert [r.state.type.value for r in me] == ["FAILED"]  # the next run named its own process
        # on disk too, first; the finished run's file is gone (the next scan removes the next run's and the crashed)
        assert {p.name for p in owners.iterdir()} == {str(unlabelled.id), str(me[0].id)}
        assert not [t for r in me for t in r.tags if t.startswith("r1flow.")]  # in labels, not in the UI's tags
    mlflow = MlflowClient(s.tracking_uri)
    assert [mlflow.get_run(r).info.status for r in dead_mlflow] == ["KILLED", "KILLED"]
    assert [mlflow.get_run(r).info.status for r in live_mlflow] == ["RUNNING", "RUNNING"]
    assert not dead_staging.exists() and live_staging.exists()


_SANDBOXED = """
from schemas.specs import SandboxLimits
from stages.rewards.sandbox import run_program
print(run_program("import time; time.sleep(120)", limits=SandboxLimits(wall_timeout_s=120, cpu_time_s=120)))
"""


def test_a_sandbox_run_directory_names_its_owner_as_the_store_does():
    """The sweep judges a sandbox directory by the owner in its name, in flows/store/artifacts.py's format."""
    from stages.rewards.sandbox import run_owner

    assert run_owner() == process_owner()


@pytest.mark.slow
def test_kill_9_during_a_sandboxed_program_leaves_its_folder_and_the_next_run_removes_it(tmp_path, live_process):
    """Issue 59 item 12: kill -9 during a tool stage left `r1flow-sandbox-*` folders (model-written code) in the
    temporary directory, and the next run's clean-up did not remove them. A process runs a program in the sandbox
    (what a tool stage's reward and environment workers do) and is killed with kill -9 mid-program; the next
    `r1flow run` removes its folder, and leaves a live process's, one named before folders named their owner and the
    uid slots' lock folder."""
    import time

    from stages.rewards.sandbox import RUN_DIR_PREFIX, WEAK_ENV
    from tests.conftest import clean_env

    tmpdir, home = tmp_path / "tmpdir", tmp_path / "home"
    tmpdir.mkdir()
    env = {**clean_env(home), "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir), WEAK_ENV: "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SANDBOXED], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    def sleeper(folder: Path) -> bool:  # the test's program (the sandbox's first run is its own probe, "pass")
        try:
            return (folder / "prog.py").read_text().startswith("import time")
        except OSError:  # not written yet, or the probe's folder already removed
            return False

    deadline = time.monotonic() + 120
    while not (running := [p for p in tmpdir.glob(f"{RUN_DIR_PREFIX}*") if sleeper(p)]):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no program started in the sandbox"
        time.sleep(0.2)
    time.sleep(1.0)  # the program runs
    assert proc.poll() is None, proc.communicate()  # still running: the kill lands mid-program
    proc.kill()
    out, err = proc.communicate()
    # what kill -9 leaves behind. (CI twice found a folder without prog.py here: the isolation probe's, which runs
    # "pass" in a folder of its own first and removes it; on a loaded machine the glob caught it before it went)
    (orphan,) = running
    assert sleeper(orphan), f"the sandboxed program's folder went before the kill: {out[-2000:]} {err[-2000:]}"
    live_pid, live_ticks = live_process
    kept = [_folder(tmpdir, f"{RUN_DIR_PREFIX}{live_pid}-{live_ticks}-{host_id()}-abcd1234"),  # a live run's
            _folder(tmpdir, f"{RUN_DIR_PREFIX}k3j2h1g0"),  # named before directories named their owner
            _folder(tmpdir, f"{RUN_DIR_PREFIX}uids")]  # the uid slots' locks (in /tmp whatever TMPDIR says)

    # the next run (its only node's upstream is not cached: it ends with one error line once it has cleaned up)
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--recipe", "sft-eval", "--profile", "tiny",
                          "--only", "eval_sft"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "no valid cached outputs" in run.stderr, run.stderr[-3000:]
    assert "0 incoming and 1 sandbox folders of dead processes" in run.stdout + run.stderr, run.stdout[-3000:]
    assert not orphan.exists()
    assert all(p.exists() for p in kept)
