"""Runs that start or finish together on one home's local MLflow store (issue 28): the schema is made by
one process at a time, and moving a registry alias survives a concurrent move."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each process imports MLflow, says so, waits for the word, then opens the (fresh) store; the word goes to all at
# once: without the lock, 4 of 4 failed here (`duplicate column name: step`, `table _alembic_tmp_tags already exists`),
# as in the issue.
OPEN_TOGETHER = """
import sys
from flows.track.tracking import Tracker
print("ready", flush=True)
sys.stdin.readline()
tracker = Tracker(f"sqlite:///{sys.argv[1]}/mlflow.db", "r1flow/together")
run = tracker.start_run("r", {})
tracker.log_metrics(run, {"x": 1.0})
tracker.end(run)
print(run)
"""


@pytest.mark.slow
def test_runs_opening_a_fresh_sqlite_store_together_all_succeed(tmp_path):
    from mlflow.tracking import MlflowClient

    procs = [subprocess.Popen([sys.executable, "-c", OPEN_TOGETHER, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:  # every interpreter has imported MLflow (a fixed 10 s wait did not promise it under load)
        assert p.stdout.readline() == "ready\n", p.communicate(timeout=60)[1][-2000:]
    for p in procs:  # then all open the store at once
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    runs = {out.strip() for out, _ in outs}
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")  # and the database stays usable
    exp = client.get_experiment_by_name("r1flow/together")
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == runs and len(runs) == 4


def test_moving_an_alias_is_retried_when_a_concurrent_run_moved_it():
    from mlflow.exceptions import MlflowException

    from flows.report.registry import _set_alias

    class Client:
        def __init__(self, failures: int, message: str):
            self.failures, self.message, self.calls = failures, message, []

        def set_registered_model_alias(self, name, alias, version):
            self.calls.append((name, alias, version))
            if len(self.calls) <= self.failures:
                raise MlflowException(self.message)

    race = "(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases.name, alias"
    client = Client(2, race)
    _set_alias(client, "r1flow-r1", "final", "3")
    assert client.calls == [("r1flow-r1", "final", "3")] * 3
    with pytest.raises(MlflowException, match="UNIQUE"):
        _set_alias(Client(9, race), "m", "final", "1", attempts=3)
    other = Client(1, "RESOURCE_DOES_NOT_EXIST: no such version")
    with pytest.raises(MlflowException, match="no such version"):  # other errors are not retried
        _set_alias(other, "m", "final", "1")
    assert len(other.calls) == 1


def test_registration_holds_the_store_lock(tmp_path, monkeypatch):
    """Two runs finishing together register one at a time on a local store (one version per fingerprint)."""
    import fcntl

    from flows.report import registry
    from flows.track.tracking import sqlite_lock

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    seen = []

    def probe(*args, **kwargs):
        with open(f"{tmp_path}/mlflow.db.lock", "a") as f:  # another process's attempt to take the lock
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
                fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                seen.append("held")

    monkeypatch.setattr(registry, "_register_models", probe)
    registry.register_models(None, [], type("T", (), {"uri": uri})())
    assert seen == ["held"]
    with sqlite_lock("http://127.0.0.1:5000"):  # a server: nothing to lock
        pass


@pytest.mark.slow
def test_runs_started_together_on_a_fresh_home_all_succeed(tmp_path):
    """Three `r1flow run --only base` on one new home, no servers: each starts a temporary Prefect server on the
    home's (new) Prefect database. Its first migration ran in all of them at once (issue 44, four runs: `duplicate
    column name: last_polled`, a temporary server that timed out, tracebacks); now every run succeeds without a
    traceback.
    The home is 0700 and both databases 0600 (issue 44: they were 0644)."""
    from tests.conftest import clean_env

    env = clean_env(tmp_path / "home")
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--profile", "tiny", "--only", "base"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    for out in outs:
        assert "Traceback" not in out and "OperationalError" not in out, out[-4000:]
    home = tmp_path / "home"  # and the home with both databases is this user's only
    assert [oct(p.stat().st_mode & 0o777) for p in (home, home / "prefect", home / "mlflow.db",
                                                     home / "prefect" / "prefect.db")] == ["0o700"] * 2 + ["0o600"] * 2
