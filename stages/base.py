"""The stage API: what a stage declares, what it receives, what it returns.

A stage is a module `stages/<name>.py` with `VERSION`, `CONFIG` (a class from schemas.configs),
`INPUTS` and `OUTPUTS` (name -> kind; `a|b` accepts either kind, a trailing `?` marks an optional
input that `inputs` lacks when the recipe does not wire it) and `run(cfg, inputs, ctx) -> dict[str, Output]`. Stages
never import Prefect or MLflow: they talk to a `StageContext`, so a stage runs the same way in a
unit test, by hand, or under a Prefect task.
"""

from __future__ import annotations

import json
import logging
import math
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.artifacts import DATA_FILE, MANIFEST_FILE, MODEL_DIR, Manifest
from schemas.datasets import validate
from schemas.errors import ArtifactError, SchemaError, StageError

LINEAGE_INPUT_PREFIX = "lineage."
"""A stage with `LINEAGE_OF = "<input>"` also gets, as inputs named `lineage.<fingerprint[:12]>`, every dataset among
the ancestors of that input's artifact (its manifests' `parents`, transitively): the runner adds them
(`flows/store/lineage.py`), so they are in the node's cache key. The eval's decontamination reads them."""


@dataclass(frozen=True)
class Input:
    """A resolved input artifact: a local directory and its manifest (and, for a LoRA adapter,
    the resolved base model artifact it was trained on)."""

    path: Path
    manifest: Manifest
    base: Input | None = None

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def label(self) -> str:
        return f"artifact {self.manifest.fingerprint[:12]} ({self.manifest.schema_name})"

    def table(self, kind: str | None = None) -> pa.Table:
        """The dataset, validated against `kind` (default: the manifest's) before any compute."""
        if self.manifest.kind != "dataset":
            raise ArtifactError(f"{self.label}: expected a dataset, got a {self.manifest.kind}")
        file = self.path / DATA_FILE
        if not file.exists():
            raise ArtifactError(f"{self.label}: {file} is missing")
        return validate(pq.read_table(file), kind or self.manifest.schema_name, where=f"{self.label} {file}")

    @property
    def model_dir(self) -> Path:
        if self.manifest.kind != "model":
            raise ArtifactError(f"{self.label}: expected a model, got a {self.manifest.kind}")
        return self.path / MODEL_DIR

    def load_model(self, **kwargs):
        """(model, tokenizer) of a model artifact; an adapter is attached to its resolved base."""
        from stages.modeling import models

        base = self.base.model_dir if self.base is not None else None
        return models.load_model(self.model_dir, base=base, **kwargs)

    @classmethod
    def from_dir(cls, path: Path) -> Input:
        manifest_path = Path(path) / MANIFEST_FILE
        if not manifest_path.exists():
            raise ArtifactError(f"{path}: no {MANIFEST_FILE}; not a (complete) artifact")
        return cls(Path(path), Manifest.model_validate_json(manifest_path.read_text()))


@dataclass
class Output:
    """What a stage produced, staged in a directory the context gave it; the context publishes it."""

    kind: str  # "dataset" | "model"
    schema: str  # dataset kind, or "model" / "adapter"
    path: Path
    rows: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class StageContext(Protocol):
    """What a stage may ask of its runner. A runner that starts the stage on several processes
    (`stages.training.launch`) also gives each a `dist` (`stages.runtime.distributed.Dist`); stages read it with
    `distributed.of(ctx)`, which is the single-process identity for contexts without one."""

    seed: int
    device: str
    cache_dir: Path  # shared cache (builtin model conversions, downloads)
    checkpoint_dir: Path  # survives a crash; same config + inputs → same directory
    log: logging.Logger

    def output_dir(self, name: str) -> Path: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_file(self, path: Path, subdir: str = "") -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...  # on the stage's run (MLflow tags inside a pipeline)
    # A runner that evaluates published checkpoints also has `publish_checkpoint(step, output)`: `output` (a model
    # staged in `output_dir`) is the model after `step`; the runner publishes and evaluates it beside the training
    # (`stages.training.loop.CheckpointPublisher` calls it; docs/guides/checkpoint-evals.md).


def check_finite_losses(metrics: dict[str, float], step: int | None) -> None:
    """A NaN or infinite loss means training diverged: stop the stage (nothing is published) with the step and
    the metric, instead of training on and publishing a broken model. Every context's log_metrics calls it."""
    bad = {k: v for k, v in metrics.items()
           if "loss" in k and isinstance(v, int | float) and not math.isfinite(float(v))}
    if bad:
        where = f"step {step}" if step is not None else "the last step"
        raise StageError(f"training diverged at {where}: " + ", ".join(f"{k} = {float(v)}" for k, v in bad.items())
                         + "; nothing was published (a lower learning_rate or max_grad_norm usually helps)")


JSON_BLOCK_BYTES = 1 << 20  # pyarrow's default JSON block


def read_json_lines(path: Path) -> pa.Table:
    """A user's JSON-lines file as a table. pyarrow reads JSON in blocks and refuses an object that
    straddles two block boundaries ("straddling object ... try to increase block size?"): with its
    default 1 MB block a prompt line of a few MB could not be read at all. The block is made larger
    than the file's longest line, so a long row reads and the caller's own checks (its length
    against `max_prompt_chars`) can name it. Raises OSError and pyarrow's errors as read_json does."""
    import pyarrow.json as pajson

    with open(path, "rb") as f:
        longest = max(map(len, f), default=0)
    block = min(max(JSON_BLOCK_BYTES, longest + 1), 2**31 - 1)  # block_size is an int32
    return pajson.read_json(path, read_options=pajson.ReadOptions(block_size=block))


# ---------------------------------------------------------------------------- users' files
# Every message about a user's file names where the problem is as an editor counts, from 1: `FILE: line N` in a
# JSON-lines file (its own line, blank lines counted), `FILE: row N` in a parquet file or a dataset (row 1 first).


def read_user_table(path: Path) -> pa.Table:
    """A user's parquet or JSON-lines file as a table, read by pyarrow, every string checked as UTF-8. What cannot
    be read is one SchemaError naming the file and, in a JSON-lines file, the line (`json_lines_problem`: pyarrow's
    own words name a byte position or a 0-based row of its block), in a parquet file the row."""
    parquet = path.suffix == ".parquet"
    try:
        table = pq.read_table(path) if parquet else read_json_lines(path)
    except (pa.ArrowException, OSError) as e:
        raise SchemaError((None if parquet else json_lines_problem(path))
                          or f"{path}: cannot read ({type(e).__name__}: {e})") from None
    try:
        table.validate(full=True)  # pyarrow keeps the bytes as given: decoding them later would fail far from here
    except pa.ArrowInvalid as e:
        raise SchemaError((_parquet_problem(path, table) if parquet else json_lines_problem(path))
                          or f"{path}: cannot read ({type(e).__name__}: {e})") from None
    return table


def _parquet_problem(path: Path, table: pa.Table) -> str | None:
    for i in range(table.num_rows):  # only after a failed check: find the row
        try:
            table.slice(i, 1).to_pylist()
        except UnicodeDecodeError as e:
            return f"{path}: row {i + 1}: not UTF-8 text ({e.reason} at byte {e.start + 1} of a value)"
    return None


def json_type_name(value: Any) -> str:
    """How a user's file calls a value's type: text, a number, true/false, a list, an object."""
    return {bool: "true/false", int: "a number", float: "a number", str: "text", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def json_lines_problem(path: Path) -> str | None:
    """'FILE: line N: ...' for the first line of a JSON-lines file that is not UTF-8, not JSON, not an object, or
    gives a field another type than an earlier line did (which pyarrow refuses); None when it finds none."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return None
    first: dict[str, tuple[str, int]] = {}  # field -> (its type, the line that gave it)
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            return f"{path}: line {n}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)"
        except json.JSONDecodeError as e:
            return f"{path}: line {n}: not valid JSON ({e.msg} at character {e.colno})"
        if not isinstance(rec, dict):
            return f"{path}: line {n}: expected a JSON object, got {json_type_name(rec)}"
        for key, value in rec.items():
            if value is None:
                continue
            kind, line = first.setdefault(key, (json_type_name(value), n))
            if kind != json_type_name(value):
                return (f"{path}: line {n}: column {key!r} is {json_type_name(value)} ({repr(value)[:40]}) where line "
                        f"{line} has {kind}: every line must give it the same type")
    return None


def record_where(path: Path | str, i: int, n_records: int) -> str:
    """Where record `i` (0-based, as read) of a user's file is: 'FILE: line N' for a JSON-lines file with one
    object per line (pyarrow skips blank lines; N counts them), else 'FILE: row N' (N = i + 1)."""
    if not str(path).endswith(".parquet"):
        try:
            lines = [n for n, text in enumerate(Path(path).read_bytes().split(b"\n"), 1) if text.strip()]
        except OSError:
            lines = []
        if len(lines) == n_records:
            return f"{path}: line {lines[i]}"
    return f"{path}: row {i + 1}"


def write_dataset(ctx: StageContext, name: str, table: pa.Table, kind: str, metrics: dict | None = None) -> Output:
    """Validate `table` as `kind` and stage it as output `name`."""
    table = validate(table, kind, where=f"output {name!r}")
    out = ctx.output_dir(name)
    pq.write_table(table, out / DATA_FILE)
    return Output("dataset", kind, out, rows=table.num_rows, metrics=dict(metrics or {}))


def model_output_dir(ctx: StageContext, name: str) -> tuple[Path, Path]:
    """(artifact staging dir, the `model/` directory inside it to save_pretrained into)."""
    out = ctx.output_dir(name)
    return out, out / MODEL_DIR


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class LocalContext:
    """A StageContext for running a stage by hand or in a unit test: plain directories, metrics in a list."""

    def __init__(self, root: Path | None = None, seed: int = 0, device: str = "cpu", cache_dir: Path | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="r1flow-local-"))
        self.seed = seed
        self.device = device
        self.cache_dir = Path(cache_dir or self.root / "cache")
        self.checkpoint_dir = self.root / "checkpoints"
        self.log = logging.getLogger("r1flow.stage")
        self.params: dict[str, Any] = {}
        self.metrics: list[tuple[int | None, dict[str, float]]] = []
        self.files: list[Path] = []
        self.tags: dict[str, str] = {}
        self.checkpoints: list[tuple[int, Output]] = []  # publish_checkpoint's, in order

    def output_dir(self, name: str) -> Path:
        path = self.root / "outputs" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        check_finite_losses(metrics, step)
        self.metrics.append((step, dict(metrics)))

    def log_file(self, path: Path, subdir: str = "") -> None:
        self.files.append(Path(path))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def publish_checkpoint(self, step: int, output: Output) -> None:
        self.checkpoints.append((step, output))


def declared_kinds(spec: str) -> set[str]:
    """The kinds a declared input or output (`INPUTS`, `OUTPUTS`) takes: "preferences|unpaired" -> {preferences,
    unpaired}; a trailing `?` (optional) is not part of a kind."""
    return set(spec.rstrip("?").split("|"))
