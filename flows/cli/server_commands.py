"""`r1flow up`, `down`, `status` and `ui`: the servers of a home (flows/servers/servers.py) from the command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from flows.cli.output import text_table
from flows.servers import processes, servers
from flows.servers.servers import (
    HOST,
    MLFLOW_UI_PORT,  # `r1flow ui`'s first choice; a home keeps the one it got
    MLFLOW_UI_QUERY,
    env_for,
)
from schemas.errors import ConfigError


def _servers_home() -> str:
    # lazy: start-up (`r1flow --help` loads none of these)
    from flows.servers.settings import Settings

    return Settings.from_env().home


def mlflow_ui_links(url: str) -> list[str]:
    """Where to open MLflow's UI: each r1flow experiment's runs table (`<name>: <url>`). Not the experiments list:
    MLflow 3 opens an experiment clicked there on its GenAI overview (the list's links drop `workflowType`), so
    the list is given only while the server has no r1flow experiment (or cannot be asked)."""
    base = url.rstrip("/")
    query = urllib.parse.urlencode({"filter": "name LIKE 'r1flow/%'", "max_results": 100})
    try:
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/search?{query}", timeout=10) as r:
            experiments = json.load(r).get("experiments", [])
    except (OSError, ValueError):
        experiments = []
    links = [f"{e['name']}: {base}/#/experiments/{e['experiment_id']}/runs{MLFLOW_UI_QUERY}"
             for e in sorted(experiments, key=lambda e: e["name"])]
    return links or [f"{base}/#/experiments{MLFLOW_UI_QUERY}"]


def _print_servers(info) -> None:
    for s, what in ((info.prefect, "Prefect UI"), (info.mlflow, "MLflow UI ")):
        took = f", up in {s.startup_s:.1f} s" if s.startup_s is not None else ""
        print(f"{what}  {s.url}   (pid {s.pid}{took}; log {s.log})")
    for link in mlflow_ui_links(info.mlflow.url):
        print(f"  {link}")
    print(f"r1flow commands with R1FLOW_HOME={info.home} use them without exports; for notebooks and the plain "
          "prefect/mlflow CLIs:")
    print("export " + " ".join(f"{k}={v}" for k, v in env_for(info).items()), flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    home = _servers_home()
    warning = servers.exposure_warning(args.host)
    if warning:
        print(f"r1flow: {warning}", file=sys.stderr, flush=True)
    advertised = servers.advertised_host(args.host, args.advertise)
    where = args.host if advertised == args.host else f"{args.host} (advertised as {advertised})"
    recorded = servers.status(home)
    gone = servers.broken(recorded) if recorded else []
    if gone:  # start() stops what is left of them and starts both afresh
        print(f"r1flow: the recorded {' and '.join(f'{s.name} server (pid {s.pid}, {s.url})' for s in gone)} "
              f"{'is' if len(gone) == 1 else 'are'} gone; stopping what is left and starting fresh", flush=True)
    print(f"r1flow: starting Prefect and MLflow servers on {where} for {home} ...", flush=True)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C, also while starting: nothing is left behind
        signal.signal(sig, _interrupt)
    try:
        info = servers.start(home, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                             timeout=args.timeout, host=args.host, advertise=args.advertise)
    except KeyboardInterrupt:  # start() has stopped whatever it had spawned
        print("r1flow: interrupted while starting; nothing is left running", file=sys.stderr)
        return 130
    code = 0
    try:
        _print_servers(info)
        if args.detach:
            print(f"stop them with: R1FLOW_HOME={home} r1flow down")
            return 0
        print("serving in the foreground; Ctrl-C or SIGTERM stops them (or `r1flow down` from another shell)",
              flush=True)
        while True:
            time.sleep(1)
            now = servers.status(home)
            if now is None or now.stopping:
                print("r1flow: the servers are being stopped elsewhere (r1flow down)", flush=True)
                return 0
            dead = servers.dead(now)
            if dead:
                for s in dead:
                    print(f"r1flow: error: the {s.name} server (pid {s.pid}) exited; see {s.log}", file=sys.stderr)
                code = 1
                break
    except KeyboardInterrupt:
        pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave half-stopped servers
    for line in servers.stop(home):
        print(f"stopped {line}")
    return code


def cmd_down(args: argparse.Namespace) -> int:
    home = _servers_home()
    stopped = servers.stop(home)
    for line in stopped:
        print(f"stopped {line}")
    if not stopped:
        print(f"r1flow: no running servers recorded for {home}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Exit code 1 when something a user relies on is missing: no servers, one of the two dead, or a scheduled
    deployment that nothing polls (its runs would go Late)."""
    # lazy: start-up (`r1flow --help` loads none of these: the stages' runtime)
    from flows.run.placement import cluster_address

    home = _servers_home()
    info = servers.status(home)
    address = cluster_address(args.cluster)
    if address:
        _print_cluster(address)
    if info is None:
        print(f"r1flow: no servers running for {home} (start them with `r1flow up`)")
        return 0 if address else 1  # the cluster was what was asked for
    _print_servers(info)
    gone = servers.broken(info)
    for s in gone:
        print(f"warning: the {s.name} server (pid {s.pid}, {s.url}) is not running; see {s.log}; "
              f"`R1FLOW_HOME={home} r1flow up` starts both afresh")
    for r in info.runners:
        print(f"runner pid {r['pid']} ({r.get('name', 'runner')}, registered {r.get('registered_at', '?')})")
    unserved = [] if info.prefect in gone else unserved_schedules(info.prefect_api_url, _started(info.started_at))
    for line in unserved:
        print(f"warning: {line}")
    return 1 if gone or unserved else 0


# Prefect's own thresholds: a worker or `serve` runner asks for its deployments' runs every 10 s
# (PREFECT_WORKER_QUERY_SECONDS, PREFECT_RUNNER_POLL_FREQUENCY), and the server calls a deployment not ready when
# nothing has asked for 60 s (PREFECT_API_SERVICES_FOREMAN_DEPLOYMENT_LAST_POLLED_TIMEOUT_SECONDS).
POLLED_WITHIN_S = 60
RECONNECT_GRACE_S = 30  # after a server (re)start: three polls' time for workers that outlived it to ask again


def _started(text: str):
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None


def _prefect_post(api_url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{api_url.rstrip('/')}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _schedule_text(schedules: list[dict]) -> str:
    texts = []
    for s in schedules:
        spec = s.get("schedule") or {}
        texts.append(f"cron {spec['cron']}" if "cron" in spec else f"every {spec['interval']:g} s"
                     if "interval" in spec else "rrule")
    return ", ".join(texts)


def unserved_schedules(api_url: str, server_started=None) -> list[str]:
    """A line for each deployment with an active schedule that no worker or `r1flow serve` runner has asked for runs
    within POLLED_WITHIN_S (nor since the server started): Prefect will mark its runs Late. Within RECONNECT_GRACE_S
    of the server's start, such a deployment is looked at again once the grace is over (a worker that outlived a
    restart asks again by then). Plain HTTP, not Prefect's client: `r1flow status` stays quick."""
    lines = _unserved(api_url, server_started)
    wait = 0.0 if server_started is None else \
        RECONNECT_GRACE_S - (datetime.now(UTC) - server_started).total_seconds()
    if lines and wait > 0:
        print(f"r1flow: the Prefect server started {RECONNECT_GRACE_S - wait:.0f} s ago; waiting {wait:.0f} s for "
              "workers to poll it", flush=True)
        time.sleep(wait)
        lines = _unserved(api_url, server_started)
    return lines


def _unserved(api_url: str, server_started) -> list[str]:
    try:
        deployments = _prefect_post(api_url, "deployments/filter", {})
        scheduled = [d for d in deployments if not d.get("paused") and any(s.get("active") for s in d["schedules"])]
        flows = {f["id"]: f["name"] for f in _prefect_post(api_url, "flows/filter", {
            "flows": {"id": {"any_": sorted({d["flow_id"] for d in scheduled})}}})} if scheduled else {}
    except (OSError, ValueError, KeyError) as e:
        return [f"could not list the deployments on {api_url}: {type(e).__name__}: {e}"]
    now = datetime.now(UTC)
    lines = []
    for d in scheduled:
        polled = _started(d.get("last_polled") or "")
        if polled is not None and (now - polled).total_seconds() <= POLLED_WITHIN_S and (
                server_started is None or polled >= server_started):
            continue
        name = f"{flows.get(d['flow_id'], '?')}/{d['name']}"
        when = "never" if polled is None else f"last at {polled:%Y-%m-%d %H:%M:%S} UTC"
        what = _schedule_text([s for s in d["schedules"] if s.get("active")])
        pool = d.get("work_pool_name")
        if pool:
            lines.append(f"deployment {name} is scheduled ({what}) but no worker polls its work pool {pool!r} (polled "
                         f"{when}): its runs will go Late; start one with `r1flow worker --pool {pool}`")
        else:
            lines.append(f"deployment {name} is scheduled ({what}) but the `r1flow serve` that served it is gone "
                         f"(polled {when}): its runs will go Late; start `r1flow serve` again")
    return lines


def _print_cluster(address: str) -> None:
    # lazy: start-up (`r1flow --help` loads none of these: the stages' runtime)
    from flows.run.placement import cluster_nodes

    nodes = cluster_nodes(address)
    alive = [n for n in nodes if n["alive"]]
    print(f"Ray cluster {address}: {len(alive)} of {len(nodes)} nodes alive")
    rows = [[n["id"][:12], n["address"], "alive" if n["alive"] else "dead",
             ", ".join(f"{k}={v / 2**30:.1f} GiB" if k == "memory" else f"{k}={v:g}"
                       for k, v in sorted(n["resources"].items()) if k != "object_store_memory")]
            for n in nodes]
    for line in text_table(["node", "address", "state", "resources"], rows):
        print(line)


def _ui_store(home) -> tuple[str, object, object, int | None]:
    """What `r1flow ui` serves when tracking goes to no server: (tracking URI, artifacts folder, the database
    when it is a local sqlite file, the port it belongs on when the home has one). MLFLOW_TRACKING_URI when set;
    else `r1flow up`'s store once the servers are down (`<home>/servers/mlflow.db`, on up's MLflow port, so
    the links of its runs open), else the home's own (`<home>/mlflow.db`, on the home's ui port)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        return uri, home / "mlartifacts", db, None
    up_db, own_db = servers.store_db(home), home / "mlflow.db"
    if up_db.exists() and (not own_db.exists() or up_db.stat().st_mtime >= own_db.stat().st_mtime):
        if own_db.exists():
            print(f"r1flow: also here, older: {own_db} (runs without `r1flow up`); open it with "
                  f"MLFLOW_TRACKING_URI=sqlite:///{own_db} r1flow ui", flush=True)
        return f"sqlite:///{up_db}", servers.servers_dir(home) / "mlartifacts", up_db, \
            servers.recorded_ports(home).get("mlflow")
    if up_db.exists():
        print(f"r1flow: also here, older: {up_db} (runs with `r1flow up`); `r1flow up` serves it", flush=True)
    return f"sqlite:///{own_db}", home / "mlartifacts", own_db, None


def _ui_port(home, asked: int | None, kept: int | None) -> int:
    """--port, else the store's kept port (taken: an error naming what holds it), else the home's ui port
    (MLflow's usual 5000 the first time; when that is taken, a free one, said loudly, kept for next time)."""
    host = servers.HOST
    if asked is not None:
        e = servers.bind_error(asked, host)
        if e is not None:
            raise ConfigError(processes.port_taken_message(asked, host, e, "--port") + "; pick another with --port")
        return asked
    if kept is not None:
        e = servers.bind_error(kept, host)
        if e is not None:
            raise ConfigError(processes.port_taken_message(kept, host, e, f"this home's, in {servers.ports_path(home)}")
                              + "; stop what holds it, or pick another with --port")
        return kept
    with servers.locked(home):
        recorded = servers.recorded_ports(home).get("ui")
        port = recorded or servers.MLFLOW_UI_PORT
        e = servers.bind_error(port, host)
        if e is not None:
            if recorded:
                raise ConfigError(processes.port_taken_message(port, host, e, f"this home's, in {servers.ports_path(home)}")
                                  + "; stop what holds it, or pick another with --port")
            moved = servers.free_ports(1)[0]
            print(f"r1flow: WARNING: {processes.port_taken_message(port, host, e, 'MLflow UI default')}; serving on "
                  f"{host}:{moved} instead, from now on for this home: links to :{port} printed before do not open "
                  "here", file=sys.stderr, flush=True)
            port = moved
        if not recorded:
            servers.record_ports(home, ui=port)
    return port


def cmd_ui(args: argparse.Namespace) -> int:
    """MLflow's UI on 127.0.0.1 for this home's tracking store, in the foreground until Ctrl-C; or,
    when tracking goes to a server (MLFLOW_TRACKING_URI, `r1flow up`), that server's URL."""
    # lazy: start-up (`r1flow --help` loads none of these)
    from flows.servers.settings import Settings

    settings = Settings.from_env()
    uri, home = settings.tracking_uri, Path(settings.home)
    prefect = os.environ.get("PREFECT_API_URL", "")
    if uri.startswith(("http://", "https://")):
        up = servers.status(home)
        source = (f"the `r1flow up` server of {home}" if up is not None and up.mlflow.url.rstrip("/") == uri.rstrip("/")
                  else "MLFLOW_TRACKING_URI")
        print(f"r1flow: MLflow tracking goes to {source}; its UI:")
        print("\n".join(mlflow_ui_links(uri)))
        if prefect:
            print("Prefect UI:")
            print(prefect.rstrip("/").removesuffix("/api"))
        return 0
    uri, artifacts, db, kept = _ui_store(home)
    if db is not None and not db.exists():
        raise ConfigError(f"no MLflow store at {db} yet: nothing has run with R1FLOW_HOME={home} "
                          "(run `r1flow run` first, or set R1FLOW_HOME to the home of your runs)")
    port = _ui_port(home, args.port, kept)
    log = home / "logs" / f"mlflow-ui-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*processes.console_script("mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1",
           "--backend-store-uri", uri, "--artifacts-destination", str(artifacts)]
    url = f"http://{HOST}:{port}"

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell that starts a command in the background without job control (`cmd &` in a script, CI)
    # hands it SIGINT ignored, and then Ctrl-C or `kill -INT` would not stop the UI
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: the server is stopped, not left behind
        signal.signal(sig, _interrupt)
    print(f"r1flow: starting MLflow's UI on {HOST}:{port} for {uri} (log {log}) ...", flush=True)
    with open(log, "wb") as out:  # its own session: we stop its whole group (uvicorn's worker included)
        proc = subprocess.Popen(cmd, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    code = 0
    try:
        t0 = time.monotonic()
        while not processes.healthy(f"{url}/health"):
            if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
                why = "exited" if proc.poll() is not None else f"did not answer in {args.timeout:.0f} s"
                print(f"r1flow: error: MLflow's UI {why}; the end of {log}:\n{processes.log_tail(log)}",
                      file=sys.stderr)
                return 1
            time.sleep(0.3)
        print(f"MLflow UI for {home} (up in {time.monotonic() - t0:.1f} s), open:")
        print("\n".join(mlflow_ui_links(url)))
        if prefect:
            print("Prefect UI:")
            print(prefect.rstrip("/").removesuffix("/api"))
        print("serving in the foreground; Ctrl-C stops it", flush=True)
        while proc.poll() is None:
            time.sleep(0.5)
        print(f"r1flow: error: MLflow's UI exited ({proc.returncode}); the end of {log}:\n{processes.log_tail(log)}",
              file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave the server running
        if proc.poll() is None or processes.group_alive(proc.pid):
            processes.terminate(proc.pid, proc.pid)
            print("r1flow: MLflow UI stopped", flush=True)
    return code


def add_server_commands(sub) -> None:
    up = sub.add_parser("up", help="start Prefect and MLflow servers (on 127.0.0.1 unless --host) for this "
                        "R1FLOW_HOME")
    up.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                    help="address both servers bind (default 127.0.0.1: this machine only). Another address lets "
                    "the machines of a cluster connect, without authentication (a warning says so): prefer a "
                    "private network's address; 0.0.0.0 binds every interface")
    up.add_argument("--advertise", metavar="ADDRESS",
                    help="address written into the recorded URLs (servers.json, PREFECT_API_URL, "
                    "MLFLOW_TRACKING_URI) for other machines to use; default: the --host address, or this "
                    "machine's hostname when --host is 0.0.0.0 or ::")
    up.add_argument("--prefect-port", type=int, help="default: a free port")
    up.add_argument("--mlflow-port", type=int, help="default: a free port")
    up.add_argument("--detach", action="store_true", help="return once both answer; stop them with `r1flow down`")
    up.add_argument("--timeout", type=float, default=120, help="seconds to wait for both to answer (default 120)")
    up.set_defaults(func=cmd_up)
    ui = sub.add_parser("ui", help="MLflow's UI on 127.0.0.1 for this R1FLOW_HOME's runs (foreground, Ctrl-C "
                        "stops it); with a tracking server, its URL")
    ui.add_argument("--port", type=int, help=f"default: the home's (the first time {MLFLOW_UI_PORT}, or a free "
                    "port when that is taken; after `r1flow up`, up's MLflow port)")
    ui.add_argument("--timeout", type=float, default=120, help="seconds to wait for it to answer (default 120)")
    ui.set_defaults(func=cmd_ui)
    sub.add_parser("down", help="stop registered runners, then the servers started by `r1flow up`"
                   ).set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="show the servers started by `r1flow up` and the Ray cluster's nodes and "
                            "resources when one is configured; exit code 1 if no server runs, one of them is dead, or "
                            "a scheduled deployment has no worker (its runs would go Late)")
    status.add_argument("--cluster", metavar="ADDRESS", help="a Ray cluster to show (default: RAY_ADDRESS when set)")
    status.set_defaults(func=cmd_status)
