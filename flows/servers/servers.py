"""Local Prefect and MLflow servers for a team on one machine (`r1flow up` / `r1flow down`).

Both servers bind 127.0.0.1 by default. `r1flow up --host ADDRESS` binds them elsewhere on purpose, for the
machines of a cluster (issue 43): neither server has authentication, so anyone who can reach the address can
read and write runs, artifacts and flow runs (`widened` decides when to say so). The URLs recorded and printed
use an address other machines can use (`advertised_host`): the bind address itself, or for a wildcard bind
(0.0.0.0, ::) this machine's hostname, or `--advertise ADDRESS`. MLflow 3 refuses requests whose Host header is
not localhost or a private IP (DNS rebinding protection): an advertised name outside those is added to its
allowed hosts (MLFLOW_SERVER_ALLOWED_HOSTS, unless already set); Prefect has no such setting, so its server runs
behind the same check (flows/servers/prefect_server.py). Both keep their state under `<home>/servers/` (their own sqlite
databases, 0600 in a 0700 home: both create an `alembic_version` table), run in their own sessions (a Ctrl-C in the
terminal does not reach them; `stop` signals their process groups) and are recorded in
`<home>/servers/servers.json`. Runners/workers that serve deployments against these servers
register their pids here so that `stop` ends them first: they pause schedules through the API
and hang if it is gone (docs/design.md §6).

Ports are the home's: chosen once and kept in `<home>/servers/ports.json` (which `stop` keeps), so the links
in earlier reports (MLflow runs, plot images) still open after `down` and `up`; a port that is taken is an
error naming it and, when this user can see it, the process that holds it. `r1flow ui` serves the store of
`up` on the same port once the servers are down.

Standard library only: `r1flow up` must not pay for importing Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from flows.servers.prefect_server import CORS_ORIGINS_ENV, own_origins
from flows.servers.processes import (
    STOP_GRACE_S,
    console_script,
    group_alive,
    healthy,
    log_tail,
    pid_exists,
    pid_start_ticks,
    port_taken_message,
    running,
    terminate,
)
from schemas.errors import R1FlowError

HOST = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")
MLFLOW_UI_QUERY = "?workflowType=machine_learning"  # MLflow 3's UI: open experiments on the runs table (flows/track/tracking.py)
MLFLOW_UI_PORT = 5000  # `r1flow ui`'s first choice for a home's local store: MLflow's usual port


@dataclass
class Server:
    name: str
    pid: int
    pgid: int
    port: int
    url: str  # the UI
    health_url: str
    log: str
    start_ticks: int | None = None  # process start time (Linux /proc), guards against pid reuse
    startup_s: float | None = None  # seconds from spawn to a healthy answer
    bind: str = HOST  # the address it listens on (url names the advertised one)


@dataclass
class ServerInfo:
    home: str
    started_at: str
    prefect: Server
    mlflow: Server
    runners: list[dict] = field(default_factory=list)
    stopping: str | None = None  # set by `stop` before it signals anything: a clean stop, not a crash

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect.url}/api"

    @property
    def mlflow_tracking_uri(self) -> str:
        return self.mlflow.url

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefect_api_url"] = self.prefect_api_url
        d["mlflow_tracking_uri"] = self.mlflow_tracking_uri
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ServerInfo:
        return cls(home=d["home"], started_at=d["started_at"], prefect=Server(**d["prefect"]),
                   mlflow=Server(**d["mlflow"]), runners=list(d.get("runners", [])), stopping=d.get("stopping"))


def servers_dir(home: str | Path) -> Path:
    return Path(home).expanduser().resolve() / "servers"


def info_path(home: str | Path) -> Path:
    return servers_dir(home) / "servers.json"


def ports_path(home: str | Path) -> Path:
    return servers_dir(home) / "ports.json"


def store_db(home: str | Path) -> Path:
    """The sqlite database of `r1flow up`'s MLflow server (kept after `down`; `r1flow ui` serves it then)."""
    return servers_dir(home) / "mlflow.db"


def recorded_ports(home: str | Path) -> dict[str, int]:
    """The home's ports by name (prefect, mlflow: `r1flow up`; ui: `r1flow ui` on the home's local store)."""
    try:
        d = json.loads(ports_path(home).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, int) and 0 < v < 65536}


def record_ports(home: str | Path, **ports: int) -> None:
    """Keep these ports for the home (callers hold `locked(home)`)."""
    path = ports_path(home)
    merged = {**recorded_ports(home), **ports}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def ui_port(home: str | Path) -> int:
    """The port `r1flow ui` serves the home's local store on (what `r1flow run` prints for it)."""
    return recorded_ports(home).get("ui", MLFLOW_UI_PORT)


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) readable by this user only; an existing one loses group and other
    access: it holds the databases, models and runs."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


def private_file(path: Path) -> None:
    """Create `path` empty (an empty file is an empty sqlite database) or tighten it to 0600, before a server
    opens it: sqlite gives its -wal, -shm and journal files the database's mode."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    for side in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{side}", 0o600)


def env_for(info: ServerInfo) -> dict[str, str]:
    """The environment a client (r1flow run, a runner, a notebook) needs to use these servers."""
    return {"PREFECT_API_URL": info.prefect_api_url, "MLFLOW_TRACKING_URI": info.mlflow_tracking_uri}


# ---------------------------------------------------------------------------------------------
# addresses


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name localhost: only this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve to anything


def widened(host: str) -> bool:
    """Does binding `host` let other machines connect (so `r1flow up` must warn)? Everything but loopback."""
    return not is_loopback(host)


def exposure_warning(host: str) -> str | None:
    """The warning `r1flow up --host HOST` prints, or None when only this machine can connect."""
    if not widened(host):
        return None
    return (f"warning: the Prefect and MLflow servers will listen on {host or '0.0.0.0'} and accept connections from "
            "other machines WITHOUT authentication: anyone who can reach this address can read and change runs, "
            "artifacts and flow runs; bind a private network's address or firewall the ports")


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The address written into the recorded URLs: --advertise, else the bind address, else for a wildcard bind
    (0.0.0.0, ::) this machine's hostname (the name other machines most likely know it by)."""
    if advertise:
        return advertise
    return socket.gethostname() if host in WILDCARDS else host


def _connect_host(host: str) -> str:
    """Where this machine itself reaches a server bound to `host` (health checks while starting)."""
    if host in WILDCARDS:
        return "::1" if host == "::" else HOST
    return host


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def mlflow_allowed_hosts(advertise: str) -> str | None:
    """MLFLOW_SERVER_ALLOWED_HOSTS for an advertised address that MLflow's defaults (localhost, 127.0.0.1 and the
    private IPv4 ranges) would refuse; None when the defaults accept it."""
    private = ("10.", "192.168.", *(f"172.{i}." for i in range(16, 32)))
    if advertise in ("localhost", "127.0.0.1", "0.0.0.0") or advertise.startswith(private):
        return None
    name = f"[{advertise}]" if ":" in advertise else advertise
    escaped = name.replace("[", "[[]", 1)  # MLflow matches patterns with fnmatch
    return ",".join(["localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*", "10.*", "192.168.*",
                     *(f"172.{i}.*" for i in range(16, 32)), name, f"{escaped}:*"])


def free_ports(n: int, host: str = HOST) -> list[int]:
    """n distinct free ports on host (the sockets stay open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(_family(host), socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def bind_error(port: int, host: str = HOST) -> OSError | None:
    """Why a server could not listen on host:port now, or None when it could. SO_REUSEADDR as the servers set it
    (uvicorn): connections of a stopped server in TIME-WAIT (a minute on Linux) do not count, a listener does."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def _check_port_free(port: int, what: str, host: str = HOST, whose: str | None = None) -> None:
    e = bind_error(port, host)
    if e is not None:
        raise R1FlowError(f"cannot start the {what} server: "
                          + port_taken_message(port, host, e, whose or f"--{what}-port")
                          + f"; stop what holds it, or pick another with --{what}-port (this home keeps it)")


# ---------------------------------------------------------------------------------------------
# commands


def _prefect_command(port: int) -> list[str]:
    # `prefect server start` behind a Host-header check (flows/servers/prefect_server.py)
    return [sys.executable, "-m", "flows.servers.prefect_server", "server", "start", "--host", HOST, "--port", str(port)]


def _with_host(cmd: list[str], host: str) -> list[str]:
    """The command with the value after --host replaced (commands are built for 127.0.0.1)."""
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            out[i + 1] = host
    return out


def _prefect_env(home: Path, port: int, host: str = HOST, advertise: str = HOST) -> dict[str, str]:
    api = f"{_url(advertise, port)}/api"
    # names a browser may use besides IP literals and localhost (flows/servers/prefect_server.py): the advertised one,
    # the hostname for a wildcard bind, and any the user exported
    names = list(dict.fromkeys([advertise] + ([socket.gethostname()] if host in WILDCARDS else [])
                               + [n for n in os.environ.get("R1FLOW_PREFECT_ALLOWED_HOSTS", "").split(",") if n.strip()]))
    return {
        "PREFECT_HOME": str(home / "prefect-server"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{servers_dir(home) / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        # the UI runs in the browser and calls this URL; without it, an inherited PREFECT_API_URL
        # (another server) would be served to it
        "PREFECT_UI_API_URL": api,
        "PREFECT_API_URL": api,
        "R1FLOW_PREFECT_ALLOWED_HOSTS": ",".join(names),
        # the web origins allowed to call the API from a browser: the UI's own, not Prefect's default `*`
        CORS_ORIGINS_ENV: ",".join(own_origins(port, {n.strip().lower() for n in names})),
    }


def _mlflow_command(home: Path, port: int) -> list[str]:
    d = servers_dir(home)
    return console_script("mlflow") + [
        "server", "--host", HOST, "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
        "--artifacts-destination", str(d / "mlartifacts"), "--serve-artifacts",
    ]


def _mlflow_env(home: Path, port: int, advertise: str = HOST) -> dict[str, str]:
    # the job executor adds a consumer pool: 15 processes and ~80 s to start (docs/design.md §6)
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    allowed = mlflow_allowed_hosts(advertise)
    if allowed and not os.environ.get("MLFLOW_SERVER_ALLOWED_HOSTS"):
        env["MLFLOW_SERVER_ALLOWED_HOSTS"] = allowed
    return env


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    full_env = {**os.environ, **env}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


# ---------------------------------------------------------------------------------------------
# servers.json


@contextlib.contextmanager
def locked(home: str | Path):
    """Serialise read-modify-write of servers.json between r1flow processes."""
    d = servers_dir(home)
    private_dir(d)
    with open(d / "servers.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(home: str | Path) -> ServerInfo | None:
    path = info_path(home)
    try:
        return ServerInfo.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise R1FlowError(f"{path} is unreadable ({e}); stop the processes it names by hand and delete it") from None


def _write(home: str | Path, info: ServerInfo) -> None:
    path = info_path(home)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)


def _live_servers(info: ServerInfo) -> list[Server]:
    return [s for s in (info.prefect, info.mlflow) if running(s.pid, s.start_ticks)]


# ---------------------------------------------------------------------------------------------
# public API


def status(home: str | Path) -> ServerInfo | None:
    """The recorded servers if at least one of them is still running, else None."""
    info = _read(home)
    return info if info and _live_servers(info) else None


def dead(info: ServerInfo) -> list[Server]:
    """The recorded servers that are no longer running."""
    return [s for s in (info.prefect, info.mlflow) if not running(s.pid, s.start_ticks)]


def _refuses(host: str, port: int) -> bool:
    """Does nothing listen on host:port (a refused connection; a slow answer is a busy server, not a dead one)?"""
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def broken(info: ServerInfo) -> list[Server]:
    """The recorded servers that are gone: the process has exited, or its port refuses connections (a killed
    uvicorn child under a live `prefect server start`)."""
    return [s for s in (info.prefect, info.mlflow)
            if not running(s.pid, s.start_ticks) or _refuses(_connect_host(s.bind), s.port)]


def start(home: str | Path, prefect_port: int | None = None, mlflow_port: int | None = None,
          timeout: float = 120, host: str = HOST, advertise: str | None = None) -> ServerInfo:
    """Start both servers bound to `host` (127.0.0.1 unless asked), wait until both answer their health check on
    this machine, record them with URLs on `advertised_host(host, advertise)`."""
    home = Path(home).expanduser().resolve()
    adv = advertised_host(host, advertise)
    local = _connect_host(host)
    d = servers_dir(home)
    private_dir(home)
    private_dir(d)
    private_dir(home / "prefect-server")
    with locked(home):
        old = _read(home)
        if old is not None:
            live = _live_servers(old)
            if live and not broken(old):
                names = ", ".join(f"{s.name} (pid {s.pid}, {s.url})" for s in live)
                raise R1FlowError(f"servers for {home} are already running: {names}; "
                                  f"use them, or stop them with `R1FLOW_HOME={home} r1flow down`")
            # a stale record, or a home whose servers died in part: stop what is left (children, runners, the
            # survivor), start both afresh on the home's ports
            _stop_locked(home, old, grace=STOP_GRACE_S)
        kept = recorded_ports(home)
        whose = {}
        for name, asked in (("prefect", prefect_port), ("mlflow", mlflow_port)):
            whose[name] = f"--{name}-port" if asked else f"this home's {name} port, kept in {ports_path(home)}"
        prefect_port = prefect_port or kept.get("prefect")
        mlflow_port = mlflow_port or kept.get("mlflow")
        if prefect_port is not None and prefect_port == mlflow_port:
            raise R1FlowError(f"the prefect and mlflow servers would both listen on port {prefect_port}; "
                              "pick others with --prefect-port and --mlflow-port")
        if prefect_port is not None:
            _check_port_free(prefect_port, "prefect", host, whose["prefect"])
        if mlflow_port is not None:
            _check_port_free(mlflow_port, "mlflow", host, whose["mlflow"])
        free = [p for p in free_ports(3, host) if p not in (prefect_port, mlflow_port)]
        prefect_port = prefect_port or free.pop()
        mlflow_port = mlflow_port or free.pop()
        for db in ("prefect.db", "mlflow.db"):
            private_file(d / db)

        specs = {
            "prefect": (_with_host(_prefect_command(prefect_port), host), _prefect_env(home, prefect_port, host, adv),
                        prefect_port, _url(adv, prefect_port), "/api/health"),
            "mlflow": (_with_host(_mlflow_command(home, mlflow_port), host), _mlflow_env(home, mlflow_port, adv),
                       mlflow_port, _url(adv, mlflow_port), "/health"),
        }
        procs: dict[str, subprocess.Popen] = {}
        started: dict[str, float] = {}
        servers: dict[str, Server] = {}
        try:
            checks: dict[str, str] = {}
            for name, (cmd, env, port, url, health) in specs.items():
                log = d / f"{name}.log"
                started[name] = time.monotonic()
                p = _spawn(cmd, env, log, cwd=d)
                procs[name] = p
                # start_new_session: the server leads its own session and process group
                servers[name] = Server(name=name, pid=p.pid, pgid=p.pid, port=port, url=url,
                                       health_url=url + health, log=str(log), start_ticks=pid_start_ticks(p.pid),
                                       bind=host)
                checks[name] = _url(local, port) + health
            _wait_healthy(procs, servers, started, timeout, checks)
        except BaseException:
            for name, p in procs.items():
                terminate(p.pid, servers[name].pgid if name in servers else None, grace=5)
                with contextlib.suppress(Exception):
                    p.wait(timeout=1)
            raise
        info = ServerInfo(home=str(home), started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                          prefect=servers["prefect"], mlflow=servers["mlflow"])
        _write(home, info)
        record_ports(home, prefect=prefect_port, mlflow=mlflow_port)
        return info


def _wait_healthy(procs: dict[str, subprocess.Popen], servers: dict[str, Server], started: dict[str, float],
                  timeout: float, checks: dict[str, str] | None = None) -> None:
    """Wait until each answers its health check at `checks[name]` (this machine's address for it; default: the
    recorded health_url)."""
    pending = set(procs)
    deadline = time.monotonic() + timeout
    checks = checks or {}
    while pending:
        for name in sorted(pending):
            s = servers[name]
            check = checks.get(name, s.health_url)
            code = procs[name].poll()
            if code is not None:
                raise R1FlowError(f"the {name} server exited with code {code} before answering {check}; "
                                  f"last lines of {s.log}:\n{log_tail(Path(s.log))}")
            if healthy(check) and procs[name].poll() is None:  # our process, not a port thief
                s.startup_s = round(time.monotonic() - started[name], 2)
                pending.discard(name)
        if pending and time.monotonic() > deadline:
            name = sorted(pending)[0]
            s = servers[name]
            raise R1FlowError(f"the {name} server did not answer {checks.get(name, s.health_url)} within "
                              f"{timeout:.0f} s; "
                              f"last lines of {s.log}:\n{log_tail(Path(s.log))}")
        if pending:
            time.sleep(0.25)


def stop(home: str | Path, grace: float = STOP_GRACE_S) -> list[str]:
    """Stop registered runners first, then the servers; remove servers.json. Returns what it stopped."""
    if not info_path(home).exists():
        return []  # nothing recorded (and no servers/ directory to create)
    with locked(home):
        info = _read(home)
        return [] if info is None else _stop_locked(home, info, grace)


def _stop_locked(home: str | Path, info: ServerInfo, grace: float) -> list[str]:
    stopped: list[str] = []
    info.stopping = datetime.now(UTC).isoformat(timespec="seconds")
    _write(home, info)  # a foreground `r1flow up` watching these servers exits quietly
    for r in info.runners:
        pid, pgid = int(r["pid"]), r.get("pgid")
        if running(pid, r.get("start_ticks")):
            # the group only when the runner leads one of its own (never the user's shell's group)
            how = terminate(pid, pgid if pgid == pid else None, grace=grace)
            stopped.append(f"runner pid {pid} ({how})")
    for s in (info.prefect, info.mlflow):
        # a leader that is gone may leave children in its group (mlflow's uvicorn); a pid that now
        # names another process (different start time) is not ours, nor is its group
        orphans = s.pgid == s.pid and not pid_exists(s.pid) and group_alive(s.pgid)
        if running(s.pid, s.start_ticks) or orphans:
            how = terminate(s.pid, s.pgid, grace=grace)
            stopped.append(f"{s.name} server pid {s.pid} on {s.url} ({how})")
    info_path(home).unlink(missing_ok=True)
    return stopped


def register_runner(home: str | Path, pid: int | None = None, name: str = "runner") -> bool:
    """Record a runner/worker pid so that `stop` ends it before the servers.

    Returns False (records nothing) when no servers started by `r1flow up` are running for home.
    """
    pid = os.getpid() if pid is None else pid
    if not info_path(home).exists():
        return False
    with locked(home):
        info = _read(home)
        if info is None or not _live_servers(info):
            return False
        info.runners = [r for r in info.runners if int(r["pid"]) != pid]
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return False
        info.runners.append({"pid": pid, "pgid": pgid, "name": name, "start_ticks": pid_start_ticks(pid),
                             "registered_at": datetime.now(UTC).isoformat(timespec="seconds")})
        _write(home, info)
        return True


def unregister_runner(home: str | Path, pid: int | None = None) -> None:
    pid = os.getpid() if pid is None else pid
    if not info_path(home).exists():
        return
    with locked(home):
        info = _read(home)
        if info is None:
            return
        kept = [r for r in info.runners if int(r["pid"]) != pid]
        if len(kept) != len(info.runners):
            info.runners = kept
            _write(home, info)
