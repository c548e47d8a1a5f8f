"""`r1flow status` against real servers (issue 59 item 8): it exits 1 and says so when a scheduled deployment has
no worker (after `r1flow down; r1flow up` the worker is gone and its runs would go Late) and when one of the two
servers is dead; with a worker polling and both servers up it exits 0 without a warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.servers import processes, servers
from tests.conftest import clean_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
R1FLOW = [sys.executable, "-m", "flows.cli"]


def _r1flow(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*R1FLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(args: list[str], env: dict[str, str]) -> str:
    out = _r1flow(args, env)
    assert out.returncode == 0, f"r1flow {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout


def _warnings(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stdout.splitlines() if line.startswith("warning:")]


def test_status_fails_for_a_scheduled_deployment_without_worker_and_for_a_dead_server(tmp_path):
    home = tmp_path / "home"
    env = clean_env(home)
    worker = None
    try:
        _ok(["up", "--detach"], env)
        _ok(["deploy", "--recipe", "eval", "--profile", "tiny", "--cron", "0 2 * * *"], env)
        worker = subprocess.Popen([*R1FLOW, "worker", "--pool", "r1flow-process"], cwd=ROOT, env=env,
                                  stdout=(tmp_path / "worker.log").open("w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        api = servers.status(home).prefect_api_url
        deadline = time.monotonic() + 120
        while not (_polled_by_worker(api) and worker.pid in {r["pid"] for r in servers.status(home).runners}):
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(1)
        status = _r1flow(["status"], env)
        assert status.returncode == 0 and _warnings(status) == [], status.stdout + status.stderr

        _ok(["down"], env)  # stops the registered worker first
        assert worker.wait(30) is not None
        _ok(["up", "--detach"], env)
        status = _r1flow(["status"], env)
        assert status.returncode == 1, status.stdout + status.stderr
        assert _warnings(status) == [
            "warning: deployment r1flow-pipeline/eval is scheduled (cron 0 2 * * *) but no worker polls its work pool "
            f"'r1flow-process' (polled {_polled(status.stdout)}): its runs will go Late; start one with "
            "`r1flow worker --pool r1flow-process`"], status.stdout

        info = servers.status(home)
        os.killpg(info.mlflow.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while processes.running(info.mlflow.pid, info.mlflow.start_ticks):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status = _r1flow(["status"], env)
        assert status.returncode == 1, status.stdout + status.stderr
        assert any(w.startswith(f"warning: the mlflow server (pid {info.mlflow.pid}, {info.mlflow.url}) is not "
                                "running") for w in _warnings(status)), status.stdout
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        servers.stop(home)


def _polled_by_worker(api: str) -> bool:
    """Has a worker asked the server for the deployment's runs (Prefect records when, as `last_polled`)?"""
    req = urllib.request.Request(f"{api}/deployments/filter", data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return any(d.get("last_polled") for d in json.load(r))


def _polled(stdout: str) -> str:
    """The `polled ...` part of the line (when the old worker last asked: a time that the test cannot know)."""
    return stdout.split("(polled ", 1)[1].split(")", 1)[0] if "(polled " in stdout else "?"
