"""flows/run/reach.py: what a cluster node checks before any compute, against real local servers and folders.

A tiny http.server on 127.0.0.1 plays Prefect (/api/health -> true) and MLflow (/health -> OK); a port
that was bound and closed gives "connection refused"; a listening socket that never answers gives a timeout.
"""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from flows.run.reach import check_mlflow, check_reachable, check_store, describe_node, http_health
from flows.servers.settings import Settings
from schemas.errors import ConfigError

WHERE = "cluster node 3f2a9c01 (host test)"


class _Health(http.server.BaseHTTPRequestHandler):
    answers = {"/api/health": (200, "true"), "/health": (200, "OK"), "/busy/health": (503, "busy"),
               "/other/health": (200, "<html>a web page</html>")}

    def do_GET(self):  # noqa: N802
        code, body = self.answers.get(self.path, (404, "not found"))
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith(WHERE + ": ")
    return msg


def test_everything_reachable(health_server, tmp_path):
    settings = Settings(home=str(tmp_path), store=str(tmp_path / "store"), tracking_uri=health_server)
    (tmp_path / "store").mkdir()
    done = check_reachable(settings, f"{health_server}/api", WHERE)
    assert done == [f"store {tmp_path / 'store'}: writable", f"Prefect API {health_server}/api: healthy",
                    f"MLflow server {health_server}: healthy"]
    assert list((tmp_path / "store").iterdir()) == []  # the probe is deleted
    # a dict works as well as Settings; no Prefect URL: not checked; sqlite: its folder exists here
    d = {"home": str(tmp_path), "store": str(tmp_path / "store"), "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    assert check_reachable(d, None, WHERE)[1] == f"MLflow store sqlite:///{tmp_path}/mlflow.db: folder present"
    assert check_store("memory://reach-test/store", WHERE) == "store memory://reach-test/store: writable"
    assert describe_node("3f2a9c01deadbeef") == f"cluster node 3f2a9c01 (host {socket.gethostname()})"


def test_mlflow_server_refused(tmp_path, closed_port):
    uri = f"http://127.0.0.1:{closed_port}"
    settings = {"home": str(tmp_path), "store": str(tmp_path), "tracking_uri": uri}
    with pytest.raises(ConfigError) as e:
        check_reachable(settings, None, WHERE)
    assert _one_line_error(e) == (
        f"{WHERE}: cannot reach the MLflow server {uri} (connection refused): start it with `r1flow up --host "
        "ADDRESS` or set MLFLOW_TRACKING_URI to an address every node can reach")


def test_prefect_refused_busy_or_not_prefect(health_server, tmp_path, closed_port):
    settings = {"home": str(tmp_path), "store": str(tmp_path), "tracking_uri": health_server}
    for url, why in ((f"http://127.0.0.1:{closed_port}/api", "connection refused"),
                     (f"{health_server}/busy", "HTTP 503"),
                     (f"{health_server}/other", "not a health check of this server")):
        with pytest.raises(ConfigError) as e:
            check_reachable(settings, url, WHERE)
        msg = _one_line_error(e)
        assert f"cannot reach the Prefect API {url} (" in msg and why in msg, msg


def test_a_server_that_never_answers_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts into the backlog, never reads or answers
        why = http_health(f"http://127.0.0.1:{s.getsockname()[1]}/health", timeout_s=0.3)
    assert why == "no answer within 0.3 s"


def test_store_or_sqlite_not_on_this_node(tmp_path):
    missing = tmp_path / "not-mounted" / "store"
    with pytest.raises(ConfigError) as e:
        check_reachable({"store": str(missing), "tracking_uri": ""}, None, WHERE)
    assert f"the artifact store {missing} does not exist on this node" in _one_line_error(e)
    uri = f"sqlite:///{tmp_path}/elsewhere/mlflow.db"
    with pytest.raises(ConfigError) as e:
        check_mlflow(uri, WHERE)
    assert f"the MLflow store {uri} is not on this node ({tmp_path}/elsewhere does not exist)" in _one_line_error(e)



# ---------------------------------------------------------------------------------------------
# `r1flow up --host`: servers bound beyond 127.0.0.1 on purpose (flows/servers/servers.py), then checked from "a node"


def test_exposure_warning_and_advertised_address(monkeypatch):
    from flows.servers import servers

    for safe in ("127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"):
        assert servers.exposure_warning(safe) is None, safe
    for wide in ("0.0.0.0", "::", "10.1.2.3", "node7.cluster"):
        msg = servers.exposure_warning(wide)
        assert msg and "WITHOUT authentication" in msg and wide in msg and "\n" not in msg, wide
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    assert servers.advertised_host("0.0.0.0") == "node7" and servers.advertised_host("::") == "node7"
    assert servers.advertised_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"
    assert servers.advertised_host("10.1.2.3") == "10.1.2.3"
    assert servers._url("::1", 80) == "http://[::1]:80"
    # MLflow refuses Host headers outside localhost and private IPs: an advertised name is added
    assert servers.mlflow_allowed_hosts("10.1.2.3") is None and servers.mlflow_allowed_hosts("127.0.0.1") is None
    assert "node7,node7:*" in servers.mlflow_allowed_hosts("node7")
    assert servers._with_host(["prefect", "server", "start", "--host", "127.0.0.1", "--port", "1"], "0.0.0.0")[4] == \
        "0.0.0.0"


@pytest.mark.slow
def test_up_on_127_0_0_2_binds_there_and_a_node_reaches_it(tmp_path):
    """`r1flow up --host 127.0.0.2 --detach` (still loopback: safe, no warning): both servers answer on
    127.0.0.2 and refuse 127.0.0.1; the recorded URLs name 127.0.0.2; MLflow's API accepts that Host; a node's
    check_reachable passes; `r1flow down` stops them (by the recorded pids)."""
    import json
    import os
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from flows.servers import servers

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["R1FLOW_HOME"] = str(home)
    exe = Path(sys.executable).parent / "r1flow"
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    up = subprocess.run(cli + ["up", "--host", "127.0.0.2", "--detach", "--timeout", "150"], env=env,
                        capture_output=True, text=True, timeout=200)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "warning" not in up.stderr.lower() and "starting Prefect and MLflow servers on 127.0.0.2 " in up.stdout
        info = servers.status(home)
        assert info is not None
        recorded = json.loads(servers.info_path(home).read_text())
        assert recorded["prefect_api_url"] == f"http://127.0.0.2:{info.prefect.port}/api"
        assert recorded["mlflow_tracking_uri"] == f"http://127.0.0.2:{info.mlflow.port}"
        assert f"export PREFECT_API_URL={info.prefect_api_url} MLFLOW_TRACKING_URI={info.mlflow_tracking_uri}" \
            in up.stdout
        for s in (info.prefect, info.mlflow):
            assert s.bind == "127.0.0.2" and s.health_url.startswith("http://127.0.0.2:")
            with urllib.request.urlopen(s.health_url, timeout=5) as r:
                assert r.status == 200
            with socket.socket() as c, pytest.raises(ConnectionRefusedError):  # bound to 127.0.0.2 only
                c.settimeout(3)
                c.connect(("127.0.0.1", s.port))
        # an MLflow API call with Host: 127.0.0.2:<port> (its DNS-rebinding guard would answer 403)
        with urllib.request.urlopen(f"{info.mlflow_tracking_uri}/api/2.0/mlflow/experiments/search?max_results=1",
                                    timeout=10) as r:
            assert r.status == 200
        (tmp_path / "store").mkdir()
        settings = {"home": str(tmp_path), "store": str(tmp_path / "store"), "tracking_uri": info.mlflow_tracking_uri}
        assert len(check_reachable(settings, info.prefect_api_url, WHERE)) == 3
    finally:
        down = subprocess.run(cli + ["down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and down.stdout.count("stopped ") == 2, down.stdout + down.stderr
    assert servers.status(home) is None
