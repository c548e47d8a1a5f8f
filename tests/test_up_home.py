"""A home's servers over time, as a team meets them (issue 44): `r1flow up` keeps its ports, so the links of a
report still open after `down` and `up`; a taken port is one line naming it; `r1flow ui` after `down` serves
the store `up` used, on its port; the Prefect API refuses foreign Host headers as MLflow does; results are
JSON; the databases and the home are private.

One `r1flow up --detach` for the module (a fresh home), one tiny eval run; the tests run in file order and
each leaves the servers up for the next (or says why not)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from flows.servers import servers
from tests.conftest import clean_env, read_until, status_with_host

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
R1FLOW = [sys.executable, "-m", "flows.cli"]


def _r1flow(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*R1FLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _up(env) -> servers.ServerInfo:
    out = _r1flow(["up", "--detach"], env, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    info = servers.status(env["R1FLOW_HOME"])
    assert info is not None
    return info


def _down(env) -> None:
    out = _r1flow(["down"], env, timeout=120)
    assert out.returncode == 0 and "stopped" in out.stdout, out.stdout + out.stderr


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture(scope="module")
def up_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("up-home") / "home"  # r1flow creates it
    env = clean_env(home)
    state = {"env": env, "home": home, "info": _up(env)}
    try:
        yield state
    finally:
        servers.stop(home)


def test_up_makes_the_home_and_its_databases_private(up_home):
    home = up_home["home"]
    assert _mode(home) == 0o700 and _mode(home / "servers") == 0o700
    for db in ("mlflow.db", "prefect.db"):
        assert _mode(home / "servers" / db) == 0o600, db


def test_prefect_api_refuses_a_foreign_host_header_as_mlflow_does(up_home):
    """DNS rebinding: a page on rebind.example, its name re-pointed at 127.0.0.1, sends `Host: rebind.example`."""
    info = up_home["info"]
    for s, path in ((info.prefect, "/api/health"), (info.mlflow, "/api/2.0/mlflow/experiments/search?max_results=1")):
        assert status_with_host(s.port, path, f"rebind.example:{s.port}") == 403, s.name
        for ok in (f"127.0.0.1:{s.port}", f"localhost:{s.port}"):
            assert status_with_host(s.port, path, ok) == 200, (s.name, ok)
    assert status_with_host(info.prefect.port, "/api/flows/filter", "rebind.example") == 403


def test_report_links_survive_down_and_up(up_home):
    """`up; run; down; up`: the same ports, and every link of the run's report (the MLflow parent run, each
    stage's run, the plot images) answers again. Results on disk are JSON, not pickle."""
    from mlflow.tracking import MlflowClient

    env, home, info = up_home["env"], up_home["home"], up_home["info"]
    out = _r1flow(["run", "--recipe", "eval", "--profile", "tiny", "--set", "eval_base.max_prompts=4",
                   "--json", str(home / "run.json")], env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run = json.loads((home / "run.json").read_text())
    up_home["parent_run_id"] = run["parent_run_id"]
    report = Path(MlflowClient(info.mlflow_tracking_uri).download_artifacts(
        run["parent_run_id"], "report/report.md", str(home))).read_text()
    links = re.findall(r"\]\((http://[^)\s]+)\)", report)
    images = [u for u in links if "get-artifact" in u]
    runs = [u for u in links if "/#/experiments/" in u]
    assert images and len(runs) >= 2, report
    assert all(u.startswith(info.mlflow.url) for u in links), (info.mlflow.url, links)
    up_home["image"] = images[0]

    # every persisted result, the flow's and the stages': JSON (a pickle is base64 text, which does not parse);
    # a record with its metadata inline names its serializer
    for f in (home / "prefect" / "storage").iterdir():
        data = json.loads(f.read_text())
        assert "metadata" not in data or data["metadata"]["serializer"]["type"] == "json", f.name

    _down(env)
    again = _up(env)
    up_home["info"] = again
    assert (again.prefect.port, again.mlflow.port) == (info.prefect.port, info.mlflow.port)
    for url in images:
        status, body = _get(url)
        assert status == 200 and body.startswith(b"\x89PNG"), url
    for url in runs:
        run_id = re.search(r"/runs/([0-9a-f]{32})", url).group(1)
        status, body = _get(f"{info.mlflow.url}/api/2.0/mlflow/runs/get?run_id={run_id}")
        assert status == 200 and json.loads(body)["run"]["info"]["run_id"] == run_id
        assert _get(url.split("#", 1)[0])[0] == 200  # the UI's page itself


def test_up_on_a_taken_port_fails_in_one_line_naming_it(up_home):
    env, home, info = up_home["env"], up_home["home"], up_home["info"]
    _down(env)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", info.prefect.port))
        squatter.listen()
        out = _r1flow(["up", "--detach"], env, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("r1flow: error: "), out.stderr
    assert f"127.0.0.1:{info.prefect.port}" in lines[0] and f"pid {os.getpid()}" in lines[0], lines[0]
    assert servers.status(home) is None  # nothing started, the mlflow server neither
    assert servers.recorded_ports(home) == {"prefect": info.prefect.port, "mlflow": info.mlflow.port}


def _listening(proc: subprocess.Popen, timeout: float = 180) -> tuple[str, list[str]]:
    """The UI's URL `r1flow ui` prints once it answers, and every line up to it."""
    seen = read_until(proc, lambda line: "#/experiments" in line and "http://127.0.0.1:" in line, timeout,
                      "r1flow ui's URL")
    return next(w for w in seen[-1].split() if w.startswith("http://127.0.0.1:")), seen


@contextlib.contextmanager
def _ui(env, *args: str):
    proc = subprocess.Popen([*R1FLOW, "ui", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _time_wait_on(port: int) -> bool:
    """A connection on this local port in TIME-WAIT (/proc/net/tcp state 06)?"""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "06" and int(f[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def test_ui_after_down_serves_ups_store_on_its_port_and_restarts_at_once(up_home):
    """After `down` (the previous test left the servers down), `r1flow ui` opens the runs `up`'s server
    recorded, on its MLflow port: the report's links open. Stopped and started again within the minute
    (connections of the first in TIME-WAIT), `ui --port` that same port starts."""
    env, home, info = up_home["env"], up_home["home"], up_home["info"]
    assert servers.status(home) is None
    port = info.mlflow.port
    with _ui(env) as proc:
        url, _ = _listening(proc)
        assert url.startswith(f"http://127.0.0.1:{port}/"), url
        run_id = up_home["parent_run_id"]
        status, body = _get(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={run_id}")
        assert status == 200 and json.loads(body)["run"]["info"]["run_id"] == run_id
        status, body = _get(up_home["image"])
        assert status == 200 and body.startswith(b"\x89PNG")
    assert proc.returncode == 0 and _time_wait_on(port), "the test needs the first UI's connections in TIME-WAIT"
    with _ui(env, "--port", str(port)) as proc:
        url, seen = _listening(proc)
        assert url.startswith(f"http://127.0.0.1:{port}/"), "\n".join(seen)


def test_ui_says_loudly_when_it_moves_and_keeps_the_port_it_got(tmp_path):
    """A home's local store (no `r1flow up`) with MLflow's usual port taken: `r1flow ui` warns that it serves
    elsewhere, and the next `r1flow ui` (the port free again) stays on the port it moved to."""
    from flows.track.tracking import mlflow_client

    home = tmp_path / "home"
    mlflow_client(f"sqlite:///{home}/mlflow.db").create_experiment("e")
    env = clean_env(home)
    with contextlib.ExitStack() as stack:
        if servers.bind_error(servers.MLFLOW_UI_PORT) is None:  # else someone holds it already
            squatter = stack.enter_context(socket.socket())
            squatter.bind(("127.0.0.1", servers.MLFLOW_UI_PORT))
            squatter.listen()
        with _ui(env) as proc:
            url, seen = _listening(proc)
    moved = int(re.match(r"http://127.0.0.1:(\d+)/", url).group(1))
    assert moved != servers.MLFLOW_UI_PORT
    warning = [line for line in seen if "WARNING" in line]
    assert len(warning) == 1 and f":{servers.MLFLOW_UI_PORT}" in warning[0] and f":{moved}" in warning[0], seen
    assert servers.ui_port(home) == moved  # the port `r1flow run` now prints in its link to this home's UI
    with _ui(env) as proc:
        url, seen = _listening(proc)
    assert url.startswith(f"http://127.0.0.1:{moved}/") and not [line for line in seen if "WARNING" in line], seen
