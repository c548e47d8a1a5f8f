"""`r1flow up` / `r1flow down`: local Prefect and MLflow servers (flows/servers/servers.py).

Real servers start twice in this file: the session fixture `live_servers` (conftest.py) and the
CLI test. The other tests are fast: they fake the server commands or the recorded pids.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from flows.servers import processes, servers
from schemas.errors import R1FlowError


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def _gone(pid: int, timeout: float = 10) -> bool:
    """os.kill(pid, 0) raises ProcessLookupError (the process is dead and reaped) within timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = processes.proc_stat(int(entry.name))
            if st and st[1] == pgid:
                members.append(int(entry.name))
    return members


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on this port, from /proc/net/tcp and tcp6."""
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            if v6:
                found.add("v6:" + addr_hex)
            else:
                found.add(socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]))
    return found


# ---------------------------------------------------------------------------------------------
# against the session's live servers


@pytest.mark.slow
def test_health_endpoints_answer(live_servers):
    status, body = _get(live_servers.prefect.health_url)
    assert status == 200 and body.strip() == "true"
    status, body = _get(live_servers.mlflow.health_url)
    assert status == 200 and body.strip() == "OK"
    assert live_servers.prefect.startup_s is not None and live_servers.mlflow.startup_s is not None
    print(f"start-up: prefect {live_servers.prefect.startup_s} s, mlflow {live_servers.mlflow.startup_s} s")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_ports_bound_on_loopback_only(live_servers):
    for s in (live_servers.prefect, live_servers.mlflow):
        assert _listen_addresses(s.port) == {"127.0.0.1"}, s.name
        # 127.0.0.2 is loopback too: a socket bound to 0.0.0.0 would accept it, one on 127.0.0.1 refuses
        with socket.socket() as c, pytest.raises(ConnectionRefusedError):
            c.settimeout(3)
            c.connect(("127.0.0.2", s.port))
        with socket.create_connection(("127.0.0.1", s.port), timeout=3):
            pass


@pytest.mark.slow
def test_mlflow_client_logs_through_server(live_servers):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=servers.env_for(live_servers)["MLFLOW_TRACKING_URI"])
    exp = client.create_experiment(f"servers-test-{uuid.uuid4().hex[:8]}")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    client.log_text(run.info.run_id, "hello", "notes/hello.txt")
    client.set_terminated(run.info.run_id)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5]
    # the server's own stores, under <home>/servers/
    home = Path(live_servers.home)
    assert (home / "servers" / "mlflow.db").exists()
    assert list((home / "servers" / "mlartifacts").rglob("hello.txt")), "artifact not proxied to --artifacts-destination"


@pytest.mark.slow
def test_prefect_client_reads_api(live_servers):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = f"servers-test-{uuid.uuid4().hex[:8]}"
    with temporary_settings(updates={PREFECT_API_URL: servers.env_for(live_servers)["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            assert client.api_healthcheck() is None
            flow_id = client.create_flow_from_name(name)
            assert client.read_flow_by_name(name).id == flow_id
    assert (Path(live_servers.home) / "servers" / "prefect.db").exists()


@pytest.mark.slow
def test_status_env_and_second_start_refused(live_servers):
    home = live_servers.home
    info = servers.status(home)
    assert info is not None and (info.prefect.pid, info.mlflow.pid) == (live_servers.prefect.pid,
                                                                        live_servers.mlflow.pid)
    env = servers.env_for(info)
    assert env == {"PREFECT_API_URL": f"http://127.0.0.1:{info.prefect.port}/api",
                   "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{info.mlflow.port}"}
    before = servers.info_path(home).read_text()
    with pytest.raises(R1FlowError, match=r"already running.*r1flow down"):
        servers.start(home)
    assert servers.info_path(home).read_text() == before
    assert _get(live_servers.prefect.health_url)[0] == 200


@pytest.mark.slow
def test_register_and_unregister_runner(live_servers):
    home = live_servers.home
    assert servers.register_runner(home, os.getpid(), name="pytest")
    recorded = json.loads(servers.info_path(home).read_text())["runners"]
    assert [r["pid"] for r in recorded] == [os.getpid()]
    servers.unregister_runner(home, os.getpid())
    assert json.loads(servers.info_path(home).read_text())["runners"] == []


# ---------------------------------------------------------------------------------------------
# fast: no real servers


def _fake_info(home: Path, pids: list[int]) -> None:
    servers.servers_dir(home).mkdir(parents=True)
    fake = [servers.Server(name=n, pid=p, pgid=p, port=1, url="http://127.0.0.1:1", health_url="", log="")
            for n, p in zip(("prefect", "mlflow"), pids, strict=True)]
    servers._write(home, servers.ServerInfo(home=str(home), started_at="", prefect=fake[0], mlflow=fake[1]))


def test_stale_record_is_tolerated(tmp_path):
    dead = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for p in dead:
        p.wait()
    _fake_info(tmp_path, [p.pid for p in dead])
    assert servers.status(tmp_path) is None
    assert servers.register_runner(tmp_path, os.getpid()) is False
    assert servers.stop(tmp_path) == []
    assert not servers.info_path(tmp_path).exists()
    assert servers.stop(tmp_path) == []  # nothing recorded: nothing to do


def test_failed_start_stops_the_other_and_quotes_the_log(tmp_path, monkeypatch):
    spawned = []
    real_spawn = servers._spawn

    def spawn(cmd, env, log, cwd):
        p = real_spawn(cmd, env, log, cwd)
        spawned.append(p)
        return p

    monkeypatch.setattr(servers, "_spawn", spawn)
    monkeypatch.setattr(servers, "_prefect_command",
                        lambda port: [sys.executable, "-c", "print('boom: no database'); raise SystemExit(3)"])
    monkeypatch.setattr(servers, "_mlflow_command",
                        lambda home, port: [sys.executable, "-c", "import time; time.sleep(120)"])
    with pytest.raises(R1FlowError, match=r"(?s)prefect server exited with code 3.*boom: no database"):
        servers.start(tmp_path, timeout=30)
    assert len(spawned) == 2
    for p in spawned:
        p.wait(timeout=5)
        assert _gone(p.pid)
    assert not servers.info_path(tmp_path).exists()


def test_port_in_use_is_refused_before_spawning(tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "_spawn", lambda *a, **k: pytest.fail("spawned despite a busy port"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(R1FlowError, match="in use"):
            servers.start(tmp_path, prefect_port=busy.getsockname()[1])


def test_the_guarded_prefect_server_is_found_from_its_app_dir():
    """uvicorn imports the guarded app's factory from --app-dir (ROOT), whatever is installed."""
    from flows.servers.prefect_server import GUARDED_FACTORY, ROOT

    module = GUARDED_FACTORY.split(":")[0]
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), (ROOT, module)


def test_prefect_host_guard_accepts_ip_literals_localhost_and_the_advertised_name():
    from flows.servers.prefect_server import host_allowed

    names = frozenset({"head"})
    for ok in ("127.0.0.1:4200", "localhost:4200", "[::1]:4200", "10.0.0.5", "head:4200", "HEAD", "LocalHost"):
        assert host_allowed(ok, names), ok
    for bad in ("rebind.example:4200", "", "127.0.0.1.nip.io:4200", "headx", "localhost.evil:80", "[::1"):
        assert not host_allowed(bad, names), bad


def test_prefect_origin_guard_accepts_only_the_servers_own_pages():
    from flows.servers.prefect_server import origin_allowed, own_origins

    origins = frozenset(own_origins(4200, {"head"}))
    assert origins == {"http://127.0.0.1:4200", "http://localhost:4200", "http://[::1]:4200", "http://head:4200"}
    for ok, host in (("http://127.0.0.1:4200", "127.0.0.1:4200"), ("http://localhost:4200", "127.0.0.1:4200"),
                     ("http://10.0.0.5:4200", "10.0.0.5:4200"), ("http://head:4200/", "127.0.0.1:4200")):
        assert origin_allowed(ok, host, origins), (ok, host)
    for bad, host in (("http://evil.example", "127.0.0.1:4200"), ("null", "127.0.0.1:4200"),
                      ("http://127.0.0.1:4201", "127.0.0.1:4200"), ("http://10.0.0.5:4200", "127.0.0.1:4200"),
                      ("file://127.0.0.1:4200", "127.0.0.1:4200"), ("http://localhost:8080", "localhost:4200")):
        assert not origin_allowed(bad, host, origins), (bad, host)


def cross_site_post(port: int, origin: str, name: str) -> tuple[int, str | None]:
    """The issue's request: `curl -H 'Origin: ORIGIN' -H 'Content-Type: application/json' -d '{"name": NAME, ...}'
    http://127.0.0.1:PORT/api/variables/`, as a page of ORIGIN makes a browser send it (correct Host). Returns the
    status and the access-control-allow-origin header."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/api/variables/", body=json.dumps({"name": name, "value": "y"}),
                     headers={"Origin": origin, "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("access-control-allow-origin")
    finally:
        conn.close()


def assert_only_own_origins_write(port: int) -> None:
    """Issue 59 item 10: a foreign page's JSON POST was 201 Created with `access-control-allow-origin: *`. It is
    refused and nothing is written; the UI's own origins (127.0.0.1 and localhost on the port) still write."""
    for foreign in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}"):
        name = f"foreign-{uuid.uuid4().hex[:8]}"
        status, allow = cross_site_post(port, foreign, name)
        assert status == 403 and allow is None, (foreign, status, allow)
        assert _status(f"http://127.0.0.1:{port}/api/variables/name/{name}") == 404, foreign  # not written
    for own in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        name = f"own-{uuid.uuid4().hex[:8]}"
        status, allow = cross_site_post(port, own, name)
        assert status == 201 and allow in (None, own), (own, status, allow)
        assert _status(f"http://127.0.0.1:{port}/api/variables/name/{name}") == 200, own


def _status(url: str) -> int:
    try:
        return _get(url)[0]
    except urllib.error.HTTPError as e:
        return e.code


_TEMPORARY = textwrap.dedent("""
    import sys
    from flows.servers.settings import make_home, prepare_environment, start_temporary_prefect
    prepare_environment()
    make_home()
    start_temporary_prefect()
    from prefect.server.api.server import SubprocessASGIServer
    server = SubprocessASGIServer()  # what Prefect's own clients use
    print("temporary", type(server).__name__, server.port, flush=True)
    sys.stdin.read()  # until the test closes it; the server stops at exit
""")


@pytest.mark.slow
def test_the_temporary_prefect_server_refuses_a_foreign_host_header(tmp_path):
    """A command without `r1flow up` (and no PREFECT_API_URL) starts Prefect's temporary server (flows/servers/settings.py):
    it is behind the same Host check as up's (flows/servers/prefect_server.py), and it is the server Prefect's clients use."""
    from tests.conftest import clean_env, status_with_host

    proc = subprocess.Popen([sys.executable, "-c", _TEMPORARY], cwd=Path(__file__).resolve().parent.parent,
                            env=clean_env(tmp_path / "home"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("temporary "):  # anything Prefect prints first
            line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]  # stdout closed: it exited
        _, kind, port = line.split()
        port = int(port)
        assert kind == "GuardedSubprocessServer"
        assert status_with_host(port, "/api/health", f"rebind.example:{port}") == 403
        assert status_with_host(port, "/api/flows/filter", "rebind.example") == 403
        for ok in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert status_with_host(port, "/api/health", ok) == 200, ok
        assert_only_own_origins_write(port)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_taken_port_names_what_holds_it(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        e = servers.bind_error(port)
        assert e is not None
        message = processes.port_taken_message(port, "127.0.0.1", e, "mine")
        assert message.startswith(f"port 127.0.0.1:{port} (mine) is in use by pid {os.getpid()} ("), message
    assert servers.bind_error(port) is None  # closed: free again


# ---------------------------------------------------------------------------------------------
# the CLI: up --detach, a registered runner, status, down

_RUNNER = textwrap.dedent("""
    import json, signal, sys, time, urllib.request
    out, urls = sys.argv[1], sys.argv[2:]
    def term(*_):
        seen = {}
        for u in urls:
            try:
                seen[u] = urllib.request.urlopen(u, timeout=3).status
            except Exception as e:
                seen[u] = repr(e)
        open(out, "w").write(json.dumps(seen))
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("ready", flush=True)
    while True:
        time.sleep(0.1)
""")


def _r1flow() -> list[str]:
    exe = Path(sys.executable).parent / "r1flow"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]


@pytest.mark.slow
def test_cli_up_detach_then_down_stops_runner_first(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["R1FLOW_HOME"] = str(home)
    up = subprocess.run(_r1flow() + ["up", "--detach"], env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    info = servers.status(home)
    assert info is not None
    assert f"export PREFECT_API_URL={info.prefect_api_url} MLFLOW_TRACKING_URI={info.mlflow_tracking_uri}" in up.stdout
    assert info.prefect.url in up.stdout and info.mlflow.url in up.stdout
    print(f"start-up via CLI: prefect {info.prefect.startup_s} s, mlflow {info.mlflow.startup_s} s")
    assert_only_own_origins_write(info.prefect.port)
    server_pids = {pid for s in (info.prefect, info.mlflow) for pid in _group_members(s.pgid)}
    assert {info.prefect.pid, info.mlflow.pid} <= server_pids  # plus mlflow's uvicorn child

    out = tmp_path / "runner-saw.json"
    runner = subprocess.Popen([sys.executable, "-c", _RUNNER, str(out), info.prefect.health_url,
                               info.mlflow.health_url], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert runner.stdout.readline().strip() == "ready"
        assert servers.register_runner(home, runner.pid, name="fake-runner")

        st = subprocess.run(_r1flow() + ["status"], env=env, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and f"runner pid {runner.pid}" in st.stdout, st.stdout + st.stderr

        down = subprocess.run(_r1flow() + ["down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        lines = [line for line in down.stdout.splitlines() if line.startswith("stopped ")]
        assert [line.split()[1] for line in lines] == ["runner", "prefect", "mlflow"], down.stdout
        runner.wait(timeout=10)
        # when the runner got its SIGTERM, both servers still answered: it was stopped first
        assert json.loads(out.read_text()) == {info.prefect.health_url: 200, info.mlflow.health_url: 200}
    finally:
        if runner.poll() is None:
            runner.kill()
    for pid in server_pids | {runner.pid}:
        assert _gone(pid), f"pid {pid} still exists after r1flow down"
    assert not servers.info_path(home).exists()
    again = subprocess.run(_r1flow() + ["down"], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "no running servers" in again.stdout
