"""Checkpoints and exact resume for every training stage.

`step-N/` holds the trainable weights and the optimizer, fsync'ed, with `state.json` written last
(it records the files' sizes). On resume a truncated or unreadable checkpoint is set aside as
`.corrupt-step-N-*` with a warning and the previous one is tried, down to a fresh start; at most
`KEEP_CORRUPT` set-aside copies are kept."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from schemas.errors import ArtifactError
from stages.base import StageContext
from stages.runtime import distributed

_STEP_DIR = re.compile(r"^step-(\d+)$")


CHECKPOINT_FILES = ("trainable.safetensors", "optimizer.pt")


KEEP_CORRUPT = 2  # set-aside damaged checkpoints kept per stage, for a post-mortem; older ones are deleted


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """step-N folders whose state.json (written last) exists, newest first."""
    done = [p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and (p / "state.json").exists()]
    return sorted(done, key=_step_of, reverse=True)


def publish_due(every: int, done: int, total: int) -> bool:
    """Whether the model after step `done` of `total` is published for a checkpoint eval (`publish_checkpoints_every`:
    every `every` steps, 0 never; not after the last step, whose model is the stage's output and has its own eval)."""
    return every > 0 and done % every == 0 and done < total


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[0] if done else None


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The model's trainable parameters by name, as contiguous CPU tensors (what a checkpoint saves)."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def write_synced(path: Path, write) -> None:
    """`write(path)`, then fsync the file: on disk before anything that refers to it is written."""
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def replace_synced(path: Path, write) -> None:
    """Write `path` whole or not at all: `write(tmp)` to a temporary name beside it, fsync, rename over `path`,
    fsync the folder (a kill leaves the old file or the new one, never part of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_synced(tmp, write)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_checkpoint(root: Path, step: int, model, optimizer, state: dict, keep: int,
                    dist: distributed.Dist = distributed.SINGLE) -> Path | None:
    """Write step-N atomically and durably, and prune old ones.

    The files go to a temp dir and are fsync'ed, state.json (with the other files' sizes) comes
    last, then one rename: a kill or a power cut leaves either the whole checkpoint or none.
    Every rank calls it: rank 0 writes (the path back), the others return None. Sharded (FSDP) the
    full trainable weights and optimizer state are gathered first, a collective."""
    if dist.sharded:
        gathered = dist.checkpoint_state(model, optimizer)
        if gathered is None:
            return None
        trainable, optim = gathered[0], {"optimizer_full": gathered[1]}
    elif not dist.is_main:
        return None
    else:
        trainable = trainable_state(model)
        optim = {"optimizer": optimizer.state_dict()}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    write_synced(tmp / "trainable.safetensors", lambda p: save_file(trainable, p))
    write_synced(tmp / "optimizer.pt", lambda p: torch.save({**optim, "rng": torch.get_rng_state()}, p))
    sizes = {name: (tmp / name).stat().st_size for name in CHECKPOINT_FILES}
    write_synced(tmp / "state.json", lambda p: p.write_text(json.dumps({**state, "_file_sizes": sizes})))
    final = root / f"step-{step:06d}"
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(root)
    steps = sorted((p for p in root.glob("step-*") if _STEP_DIR.match(p.name)), key=lambda p: p.name)
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # a writer killed mid-write (the stage lock says none is alive now)
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def fsync_dir(path: Path) -> None:
    """fsync a directory: the renames and deletions in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CorruptCheckpoint(ArtifactError):
    """A checkpoint's files are damaged (truncated, unreadable): not a mismatch with the model."""


def load_checkpoint(path: Path, model, optimizer, dist: distributed.Dist = distributed.SINGLE) -> dict:
    """Load a checkpoint into model and optimizer; its state.

    Raises CorruptCheckpoint when its files are damaged (checked before anything is copied into
    the model, so a failed load leaves model and optimizer untouched), ArtifactError when it does
    not fit the model being trained."""
    try:
        state = json.loads((path / "state.json").read_text())
        sizes = state.pop("_file_sizes", {})
        for name, size in sizes.items():
            actual = (path / name).stat().st_size
            if actual != size:
                raise CorruptCheckpoint(f"checkpoint {path}: {name} has {actual} bytes, {size} were written")
        tensors = load_file(path / "trainable.safetensors")
        blob = torch.load(path / "optimizer.pt", weights_only=True)
    except CorruptCheckpoint:
        raise
    except Exception as e:  # safetensors' SafetensorError, torch's unpickling/zip errors, OSError, JSON errors
        raise CorruptCheckpoint(f"checkpoint {path}: unreadable ({type(e).__name__}: {e})") from e
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in tensors]
    if missing or set(tensors) - set(params):
        raise ArtifactError(f"checkpoint {path}: parameters do not match the model being trained")
    if ("optimizer_full" in blob) != dist.sharded:
        raise ArtifactError(f"checkpoint {path}: written {'with' if 'optimizer_full' in blob else 'without'} fsdp, "
                            f"resumed {'with' if dist.sharded else 'without'} it")
    if dist.sharded:
        dist.load_checkpoint_state(model, optimizer, tensors, blob["optimizer_full"])
    else:
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"])
    return state


def set_aside(path: Path, keep: int = KEEP_CORRUPT) -> Path:
    """Rename a damaged checkpoint to .corrupt-step-N-<id> (never resumed from again); keep the newest few."""
    aside = path.with_name(f".corrupt-{path.name}-{uuid.uuid4().hex[:6]}")
    os.replace(path, aside)
    kept = sorted(path.parent.glob(".corrupt-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in kept[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return aside


def resume(ctx: StageContext, model, optimizer, stage: str, total_steps: int) -> dict:
    """Load the newest good checkpoint into model and optimizer; its state, or {"step": 0}.

    A damaged checkpoint (truncated by a full disk, a kill during an unsynced write on another
    filesystem, a bad copy) is set aside with a warning and the previous one is tried, down to a
    fresh start. Every rank reads the same files and so makes the same choice; only rank 0 moves
    them. Shared by every training stage; each re-logs its own history from the returned state.
    """
    dist = distributed.of(ctx)
    for ckpt in complete_checkpoints(ctx.checkpoint_dir):
        try:
            state = load_checkpoint(ckpt, model, optimizer, dist)
        except CorruptCheckpoint as e:
            if dist.is_main:
                aside = set_aside(ckpt)
                ctx.log.warning("%s: %s; set aside as %s, trying the previous checkpoint", stage, e, aside.name)
            else:
                ctx.log.warning("%s: %s; trying the previous checkpoint", stage, e)
            continue
        ctx.log.info("%s: resuming from %s (step %d of %d)", stage, ckpt.name, state["step"], total_steps)
        return state
    return {"step": 0}
