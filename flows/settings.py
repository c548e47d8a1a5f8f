"""Where things live. Read from the environment once, passed explicitly everywhere after."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path


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


def prepare_environment(home: str | None = None) -> None:
    """Environment for Prefect, set before it is imported: its state lives under R1FLOW_HOME."""
    home_path = Path(home or os.environ.get("R1FLOW_HOME", ".r1flow")).expanduser().resolve()
    home_path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home_path / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for its ephemeral server; on a busy 2-core machine it has taken longer (seen in the
    # test suite: "Timed out while attempting to connect to ephemeral Prefect API server").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.environ.get("PREFECT_API_URL") and not os.environ.get("MLFLOW_TRACKING_URI"):
        from flows import servers

        info = servers.status(home_path)  # `r1flow up` servers for this home: use them
        if info is not None:
            os.environ.update(servers.env_for(info))
