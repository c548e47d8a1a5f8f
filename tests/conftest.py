"""Test session setup: every test session gets its own R1FLOW_HOME and PREFECT_HOME (set before
Prefect is imported; prefect_test_harness does not isolate result storage, DESIGN.md §6)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_SESSION = Path(tempfile.mkdtemp(prefix="r1flow-tests-"))
os.environ["R1FLOW_HOME"] = str(_SESSION / "home")
os.environ["PREFECT_HOME"] = str(_SESSION / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("R1FLOW_STORE", None)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from stages.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from stages.models import build_tiny_model

    return build_tiny_model(tiny_tokenizer, seed=0)


def fake_input(path: Path, kind: str, schema: str, rows: int | None = None):
    """An Input for a directory laid out like an artifact, without a store."""
    from schemas.artifacts import Manifest, Producer
    from stages.base import Input

    fp = hashlib.sha256(str(path).encode()).hexdigest()
    return Input(Path(path), Manifest(kind=kind, schema=schema, fingerprint=fp, files={}, rows=rows,
                                      producer=Producer(stage="test", stage_version="0", config_hash="")))


@pytest.fixture(scope="session")
def tiny_model_input(session_dir, tiny_tokenizer):
    """A saved tiny model laid out like an import_model artifact (`<dir>/model/`)."""
    from schemas.artifacts import MODEL_DIR
    from stages.models import build_tiny_model, save_model

    path = session_dir / "tiny-model-artifact"
    if not path.exists():
        save_model(build_tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer, path / MODEL_DIR)
    return fake_input(path, "model", "model")
