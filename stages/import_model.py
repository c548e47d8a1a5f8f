"""`import_model` stage: turn a model reference into a content-addressed model artifact.

Builtin names are converted once into a cached HF directory (stages.modeling.models); local directories
and that cache are linked into the artifact (hard links where possible, bytes unchanged, so the
fingerprint is stable); hub names are loaded with `from_pretrained` and saved as safetensors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from schemas.configs import ModelConfig
from schemas.errors import ConfigError
from stages.base import Output, StageContext, model_output_dir
from stages.modeling import models

VERSION = "1"  # history: CHANGELOG.md
CONFIG = ModelConfig
INPUTS: dict[str, str] = {}
OUTPUTS = {"model": "model"}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _looks_local(ref: str) -> bool:
    """A path, not a hub name (`org/name`): it starts like one, exists, its first folder exists here, or it is
    deeper than org/name. (A relative path once passed for a hub name and failed only after the run started.)"""
    p = Path(ref).expanduser()
    return (ref.startswith((".", "/", "~")) or p.exists() or len(p.parts) > 2
            or (len(p.parts) == 2 and Path(p.parts[0]).is_dir()))


def check(cfg: ModelConfig) -> None:
    """A local model directory is checked before the pipeline starts: it exists, it is a Hugging Face model or
    adapter folder, and it holds weights. Hub names are resolved (offline: from the cache) when the stage runs."""
    ref = cfg.ref
    if ref in models.BUILTIN_MODELS or not _looks_local(ref):
        return
    p = Path(ref).expanduser()
    where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
    if not p.is_dir():
        raise ConfigError(f"import_model.ref: {ref} is not a directory{where}")
    if not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
        raise ConfigError(f"import_model.ref: {ref}{where} holds neither config.json nor adapter_config.json: "
                          "not a Hugging Face model or adapter folder")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ConfigError(f"import_model.ref: {ref}{where} holds no weights (*.safetensors or *.bin)")


def cache_salt(cfg: ModelConfig) -> str:
    """A local directory can change under the same path: its file names, sizes and mtimes count."""
    p = Path(cfg.ref).expanduser()
    if cfg.ref in models.BUILTIN_MODELS or not p.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(p.rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _link_tree(src: Path, dst: Path) -> None:
    for f in sorted(src.rglob("*")):
        if not f.is_file() or f.name.startswith("."):
            continue
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def run(cfg: ModelConfig, inputs: dict, ctx: StageContext) -> dict[str, Output]:
    import torch

    out, model_dir = model_output_dir(ctx, "model")
    resolved = models.resolve_model_dir(
        cfg.ref, ctx.cache_dir, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )
    dtype = getattr(torch, _DTYPES[cfg.dtype])
    if isinstance(resolved, Path) and cfg.dtype == "float32":
        _link_tree(resolved, model_dir)
        model, _ = models.load_model(model_dir, dtype=dtype)
    else:
        model, tokenizer = models.load_model(
            resolved, dtype=dtype, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
        )
        models.save_model(model, tokenizer, model_dir)
    counts = models.count_parameters(model)
    ctx.log.info("import_model: %s -> %s parameters", cfg.ref, f"{counts['total']:,}")
    metrics = {"parameters": float(counts["total"])}
    ctx.log_metrics(metrics)
    return {"model": Output("model", "model", out, metrics=metrics, extra={"ref": cfg.ref})}
