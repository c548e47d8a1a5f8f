"""Where things live. Read from the environment once, passed explicitly everywhere after."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.servers import servers
from flows.servers.prefect_server import temporary_server
from flows.servers.servers import private_dir, private_file
from schemas.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    home: str  # local working directory: staging, checkpoints, model cache, default store and MLflow db
    store: str  # artifact store root: a local path or any fsspec URI (s3://..., gs://...)
    tracking_uri: str  # MLflow tracking URI

    @classmethod
    def from_env(cls) -> Settings:
        home = Path(os.environ.get("R1FLOW_HOME", ".r1flow")).expanduser().resolve()
        store = os.environ.get("R1FLOW_STORE") or str(home)
        tracking = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home}/mlflow.db"
        return cls(str(home), store, tracking)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def mlflow_artifact_location(self) -> str | None:
        """Local runs keep MLflow's artifacts under home (MLflow would use ./mlruns of the cwd)."""
        return None if self.tracking_uri.startswith(("http://", "https://")) else f"{Path(self.home) / 'mlartifacts'}"


# What Prefect keeps under PREFECT_HOME, named explicitly by prepare_environment (a shell that sets PREFECT_HOME
# alone must not carry these from another home)
PREFECT_HOME_FILES = {"PREFECT_RESULTS_LOCAL_STORAGE_PATH": "storage", "PREFECT_SERVER_MEMO_STORE_PATH": "memo_store.toml"}


def prepare_environment(home: str | None = None) -> str:
    """Decide the servers and Prefect's home, before Prefect or MLflow is imported. Returns where the
    servers came from (for messages).

    The one place every command goes through (flows/cli/app.py calls it before dispatching): Prefect fixes
    its settings when it is imported, so a command that imported it first would talk to a temporary
    server of its own. PREFECT_API_URL and MLFLOW_TRACKING_URI, each when not exported, are taken from
    the servers `r1flow up` started for this R1FLOW_HOME; Prefect's state and results go under
    R1FLOW_HOME (PREFECT_HOME), and R1FLOW_HOME itself is exported as an absolute path so that workers,
    runners and their flow-run subprocesses share it whatever their working directory.
    """
    home_path = Path(home or os.environ.get("R1FLOW_HOME", ".r1flow")).expanduser().resolve()  # not created here:
    os.environ["R1FLOW_HOME"] = str(home_path)  # a command that fails validation writes nothing
    os.environ.setdefault("PREFECT_HOME", str(home_path / "prefect"))
    # Prefect derives these from PREFECT_HOME, except where the derivation does not see it (3.7 put results, and a
    # server its memo store, under ~/.prefect): named, so nothing of a run lands outside its home.
    prefect_home = Path(os.environ["PREFECT_HOME"])
    for var, name in PREFECT_HOME_FILES.items():
        os.environ.setdefault(var, str(prefect_home / name))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for its ephemeral server; on a busy 2-core machine it has taken longer (seen in the
    # test suite: "Timed out while attempting to connect to ephemeral Prefect API server").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # MLflow retries a request 7 times with backoff up to 120 s and waits 120 s for an answer: a lost tracking
    # server hung a run for over 7 minutes. About 30 s of retries here; the run's watchdog (flows/run/watchdog.py)
    # says a server is gone after 15 s of silence, before these give up and print their tracebacks.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "4")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    source = "environment"
    if not (os.environ.get("PREFECT_API_URL") and os.environ.get("MLFLOW_TRACKING_URI")):
        info = servers.status(home_path)  # `r1flow up` servers for this home: use them
        if info is not None:
            for key, value in servers.env_for(info).items():
                if not os.environ.get(key):
                    os.environ[key] = value
                    source = f"r1flow up servers of {home_path}"
            _check_prefect_not_fixed()
    if not os.environ.get("PREFECT_API_URL"):
        source = "none: a temporary Prefect server for this command"
    return source


def make_home() -> None:
    """Create R1FLOW_HOME and PREFECT_HOME, readable by this user only (Prefect's temporary server cannot create
    its database's folder). Commands call it once their input is validated: a command that fails validation
    writes nothing."""
    for key in ("R1FLOW_HOME", "PREFECT_HOME"):
        if os.environ.get(key):
            private_dir(Path(os.environ[key]))


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """An exclusive lock on `path` (created, with its folder) across processes, released on exit."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_temporary_prefect() -> None:
    """Without a Prefect server (no PREFECT_API_URL), start this command's temporary one now, one process at a
    time per database: each runs Prefect's migrations on `$PREFECT_HOME/prefect.db` as it starts, and commands
    started together on a new home ran them at once (`duplicate column name: last_polled`, issue 44), as they
    did MLflow's (flows/track/tracking.py: `sqlite_lock`). The lock is `<db>.lock`, like MLflow's; the database is
    created 0600 first. Prefect then uses this server (one per process) for the command's flow. It refuses requests
    with a foreign Host header (DNS rebinding), as `r1flow up`'s does (flows/servers/prefect_server.py)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    # lazy: order (Prefect fixes its settings when imported: after prepare_environment)
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    if not url.startswith("sqlite+aiosqlite:///") or ":memory:" in url:
        temporary_server().start()
        return
    db = Path(url.removeprefix("sqlite+aiosqlite:///").split("?", 1)[0])
    with file_lock(f"{db}.lock"):
        private_file(db)
        temporary_server().start()


def _check_prefect_not_fixed() -> None:
    """An internal error if Prefect was imported before the servers were decided with other settings."""
    if "prefect.settings" not in sys.modules:
        return
    # lazy: order (Prefect fixes its settings when imported: after prepare_environment)
    from prefect.settings import get_current_settings

    current = get_current_settings().api.url
    if current != os.environ["PREFECT_API_URL"]:
        raise RuntimeError(f"internal error: Prefect was imported before r1flow chose its servers (it uses "
                           f"{current or 'a temporary server'}, r1flow up's is {os.environ['PREFECT_API_URL']})")


def require_prefect_server(command: str, what: str) -> str:
    """The Prefect API URL a command that registers or schedules something will use; a ConfigError
    (before anything is registered) when it would go to a temporary server that exits with the command."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        home = os.environ.get("R1FLOW_HOME", ".r1flow")
        raise ConfigError(f"r1flow {command} {what} with a Prefect server, and none is running for R1FLOW_HOME={home}: "
                          "start one with `r1flow up` (same R1FLOW_HOME), or set PREFECT_API_URL to a team server. "
                          "Without one it would go to a temporary server that exits with this command.")
    # lazy: order (Prefect fixes its settings when imported: after prepare_environment)
    import prefect.settings  # noqa: F401  (now: the check below compares what it fixed at import)

    _check_prefect_not_fixed()
    return url
