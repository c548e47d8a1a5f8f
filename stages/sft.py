"""`sft` stage: supervised fine-tuning on chat conversations, loss on assistant tokens only.

Reads like a training script: tokenize (mask the prompt), order the data from the seed, then a
plain loop of micro-batches → optimizer steps with checkpoints. Departures from common trainers:
- the loss is a token mean over the whole optimizer step (all micro-batches), so batch 1 ×
  accumulation 8 equals batch 8 × accumulation 1 (TRL's invariant tests check the same);
- the data order is a pure function of (seed, step), so a resumed run sees exactly the batches the
  uninterrupted run would have, and a checkpoint at the last step publishes instead of retraining;
- on N processes (`resources.num_processes`) every process takes 1/N of each global micro-batch and
  divides its summed loss by the step's global token count (known to every rank: the step's
  indices are a pure function too), and the gradients are summed, so the update is the
  single-process one (`stages.runtime.distributed`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from schemas.configs import SFTConfig
from schemas.errors import ArtifactError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.modeling import logprobs, models
from stages.rewards.verifiers import gold_completion
from stages.runtime import distributed

log = logging.getLogger(__name__)

VERSION = "2"  # 2: packing keeps attention inside each packed example (block mask, positions restarted)
CONFIG = SFTConfig
INPUTS = {"model": "model", "data": "sft|prompts"}
OUTPUTS = {"model": "model"}

IGNORE = -100


# ---------------------------------------------------------------------------- pure pieces


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over positions whose label is not IGNORE, and their count.

    logits: (B, T, V); labels: (B, T) aligned with input_ids (shifted here).
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, int((shift_labels != IGNORE).sum())


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak LR at 0-based `step`: linear warmup, then cosine/linear/constant."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW for every training stage: fused (one kernel over all parameters instead of a Python loop
    over tensors; CPU, CUDA and MPS) where the parameters allow it, the same update otherwise."""
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda", "mps") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients' global norm to max_norm; the norm before clipping (over every shard under fsdp)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def set_lr(optimizer, lr: float) -> float:
    """Set every parameter group's learning rate (the schedule is ours, not a torch scheduler's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def micro_batch_indices(n: int, batch_size: int, seed: int, micro_step: int) -> list[int]:
    """Example indices of global micro-batch `micro_step`: epochs are seeded permutations."""
    per_epoch = math.ceil(n / batch_size)
    epoch, within = divmod(micro_step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[within * batch_size : (within + 1) * batch_size].tolist()


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, of the same length, their labels (IGNORE where no loss)."""

    input_ids: list[int]
    labels: list[int]
    segments: tuple[int, ...] = ()  # a packed block (`pack`): the lengths of the examples in it, in order

    @cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and labels as int64 tensors, made once: `collate` runs every step, and a
        tensor from a Python list is most of its cost."""
        return torch.tensor(self.input_ids, dtype=torch.long), torch.tensor(self.labels, dtype=torch.long)


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Example:
    """Chat-template the conversation; label only the final assistant turn."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise SchemaError("sft: the chat template renders the prompt differently with and without the answer; "
                          "cannot mask prompt tokens reliably")
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    ids = (p_ids + c_ids)[:max_length]
    labels = ([IGNORE] * len(p_ids) + c_ids)[:max_length]
    return Example(ids, labels)


def pack(examples: list[Example], max_length: int) -> list[Example]:
    """Greedily concatenate examples into blocks of at most max_length tokens.

    Each block records its examples' lengths (`segments`): `collate(blocked=True)` then keeps
    attention inside each example and restarts its positions, so a block trains as its examples
    would one by one, without the padding. The first token of every example but the first is
    never a target (alone, nothing predicts it). Labels stay as they were otherwise (only the
    assistant tokens are trained).
    """
    blocks, ids, labels, lengths = [], [], [], []
    for ex in examples:
        if ids and len(ids) + len(ex.input_ids) > max_length:
            blocks.append(Example(ids, labels, tuple(lengths)))
            ids, labels, lengths = [], [], []
        if ids:
            labels.append(IGNORE)
            labels += ex.labels[1:]
        else:
            labels = list(ex.labels)
        ids = ids + ex.input_ids
        lengths.append(len(ex.input_ids))
    if ids:
        blocks.append(Example(ids, labels, tuple(lengths)))
    return blocks


def block_attention(batch: list[Example], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, 1, width, width) bool attention mask and (B, width) position ids for packed rows: each token
    sees the tokens of its own example up to itself (causal inside the example, nothing across), and
    positions count from 0 in each example. Padding columns form one more segment of their own."""
    seg = torch.full((len(batch), width), -1, dtype=torch.long)
    pos = torch.zeros((len(batch), width), dtype=torch.long)
    for r, ex in enumerate(batch):
        lengths = torch.tensor(ex.segments or (len(ex.input_ids),), dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        seg[r, : len(ids)] = ids
        pos[r, : len(ids)] = torch.arange(len(ids)) - starts[ids]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    return mask[:, None], pos


def collate(batch: list[Example], pad_id: int, blocked: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch (training needs no left padding). With `blocked` and a packed block in the
    batch, also `block_mask` and `position_ids` (`block_attention`), for the decoder in place of the
    2D `attention_mask` (kept: it counts the real tokens)."""
    ids, labels = zip(*(e.tensors for e in batch), strict=True)
    lengths = torch.tensor([len(t) for t in ids])
    width = int(lengths.max())
    out = {"input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id),
           "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE),
           "attention_mask": (torch.arange(width)[None, :] < lengths[:, None]).long()}
    if blocked and any(len(e.segments) > 1 for e in batch):
        out["block_mask"], out["position_ids"] = block_attention(batch, width)
    return out


# ---------------------------------------------------------------------------- data


def conversations_from(data: Input, cfg: SFTConfig) -> list[list[dict]]:
    """SFT conversations from an `sft` dataset, or gold-answer R1 targets from `prompts` (train split)."""
    kind = data.manifest.schema_name
    if kind == "sft":
        return data.table("sft").column("messages").to_pylist()
    if kind == "prompts":
        table = data.table("prompts")
        table = table.filter(pc.and_(pc.equal(table["split"], "train"), pc.is_valid(table["answer"])))
        if table.num_rows == 0:
            raise SchemaError(f"{data.label}: no train-split prompts with an 'answer' to build SFT targets from")
        return [
            msgs + [{"role": "assistant", "content": gold_completion(ans, cfg.gold_think)}]
            for msgs, ans in zip(table["messages"].to_pylist(), table["answer"].to_pylist(), strict=True)
        ]
    raise SchemaError(f"{data.label}: sft needs an 'sft' or 'prompts' dataset, got {kind!r}")


# ---------------------------------------------------------------------------- checkpoints

_STEP_DIR = re.compile(r"^step-(\d+)$")
CHECKPOINT_FILES = ("trainable.safetensors", "optimizer.pt")
KEEP_CORRUPT = 2  # set-aside damaged checkpoints kept per stage, for a post-mortem; older ones are deleted


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """step-N folders whose state.json (written last) exists, newest first."""
    done = [p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and (p / "state.json").exists()]
    return sorted(done, key=_step_of, reverse=True)


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[0] if done else None


def _write_synced(path: Path, write) -> None:
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


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
        trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        optim = {"optimizer": optimizer.state_dict()}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    _write_synced(tmp / "trainable.safetensors", lambda p: save_file(trainable, p))
    _write_synced(tmp / "optimizer.pt", lambda p: torch.save({**optim, "rng": torch.get_rng_state()}, p))
    sizes = {name: (tmp / name).stat().st_size for name in CHECKPOINT_FILES}
    _write_synced(tmp / "state.json", lambda p: p.write_text(json.dumps({**state, "_file_sizes": sizes})))
    final = root / f"step-{step:06d}"
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    steps = sorted((p for p in root.glob("step-*") if _STEP_DIR.match(p.name)), key=lambda p: p.name)
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # a writer killed mid-write (the stage lock says none is alive now)
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
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


# ---------------------------------------------------------------------------- the stage


def resolve_precision(precision: str, device: str) -> torch.dtype | None:
    """Autocast dtype, or None for plain fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def load_trainable(source: Input, cfg: SFTConfig, device: str):
    model_dir = source.model_dir
    model, tokenizer = source.load_model()
    merged_input = hasattr(model, "merge_and_unload")
    if merged_input:  # an adapter artifact: fold it in, then train a fresh adapter (or all weights)
        model = model.merge_and_unload()
    if getattr(cfg, "gradient_checkpointing", False):  # non-reentrant: no input grads needed under LoRA
        models.enable_activation_checkpointing(model, use_reentrant=False)
    model = models.apply_lora(model.to(device), cfg.lora)
    if cfg.lora.r > 0 and not merged_input:
        for pc in model.peft_config.values():
            pc.base_model_name_or_path = str(model_dir)
    model.config.use_cache = False
    return model, tokenizer, merged_input


def run(cfg: SFTConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    conversations = conversations_from(inputs["data"], cfg)  # validates before loading the model
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    examples = [tokenize_conversation(tokenizer, c, cfg.max_length) for c in conversations]
    examples = [e for e in examples if any(lab != IGNORE for lab in e.labels[1:])]
    if not examples:
        raise SchemaError(f"{inputs['data'].label}: every example lost its assistant tokens to max_length={cfg.max_length}")
    blocked = cfg.packing and logprobs.can_pack_prefix(model)  # before sharding: can the model take a 4D mask
    if cfg.packing:
        examples = pack(examples, cfg.max_length)
        if not blocked:
            log.warning("sft: %s does not take a block attention mask (logprobs.can_pack_prefix): packed examples "
                        "attend to the examples before them in their block", type(model).__name__)
    targets = [sum(lab != IGNORE for lab in e.labels[1:]) for e in examples]  # tokens each example trains
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"examples": len(examples), "trainable_parameters": counts["trainable"],
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})

    state = resume(ctx, model, optimizer, "sft", cfg.max_steps)
    start, history = state["step"], state.get("history", [])
    for i, loss in enumerate(history):  # the curve of the interrupted run, so MLflow shows it whole
        ctx.log_metrics({"train/loss": loss}, step=i + 1)

    model.train()
    tokens_seen, t0 = 0, time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="sft", unit="step", disable=not dist.is_main)
    for step in range(start, cfg.max_steps):
        lr = set_lr(optimizer, cfg.learning_rate * lr_factor(step, cfg.max_steps, warmup, cfg.lr_scheduler))
        step_indices = [micro_batch_indices(len(examples), cfg.batch_size, ctx.seed, step * cfg.grad_accum + a)
                        for a in range(cfg.grad_accum)]
        n_tokens = sum(targets[i] for idx in step_indices for i in idx)  # the global step's, on every rank
        # an epoch's last micro-batch may be short: parts, a weight-0 filler where fsdp needs one
        mine = [dist.part_or_filler(idx) for idx in step_indices]
        micro = [(collate([examples[i] for i in m], pad_id, blocked), real) for m, real in mine if m]
        step_loss = 0.0
        for batch, real in micro:
            batch = {k: v.to(ctx.device) for k, v in batch.items()}
            with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                labels = batch["labels"][:, 1:]  # the logits exist cfg.logprob_chunk positions at a time
                logp, _ = logprobs.token_logprobs(model, batch["input_ids"],
                                                  batch.get("block_mask", batch["attention_mask"]),
                                                  chunk_tokens=cfg.logprob_chunk, targets=labels.clamp(min=0),
                                                  positions=labels != IGNORE, position_ids=batch.get("position_ids"))
            loss_sum = -(logp * (labels != IGNORE)).sum() * real  # = masked_token_loss on the full logits
            (loss_sum / n_tokens).backward()
            step_loss += loss_sum.item() / n_tokens
            tokens_seen += int(batch["attention_mask"].sum()) * real
        dist.sync_gradients(trainable)
        (step_loss,) = dist.sum([step_loss])
        grad_norm = clip_grad_norm(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(step_loss)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            save_checkpoint(ctx.checkpoint_dir, done, model, optimizer, {"step": done, "history": history},
                            cfg.keep_checkpoints, dist)
        ctx.log_metrics({"train/loss": step_loss, "train/lr": lr, "train/grad_norm": grad_norm}, step=done)
        bar.set_postfix(loss=f"{step_loss:.4f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t0
    (tokens_seen,) = dist.sum([tokens_seen])
    trained_steps = cfg.max_steps - start

    out, model_dir = model_output_dir(ctx, "model")
    merge = cfg.lora.merge or merged_input
    plain = dist.full_model(model, ctx.device)  # fsdp: gathered, rank 0 only
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=merge)
    is_adapter = cfg.lora.r > 0 and not merge
    tail = history[-max(1, min(10, len(history) // 5)) :]
    metrics = {
        "final_loss": float(np.mean(tail)),
        "first_loss": float(history[0]),
        "steps": float(cfg.max_steps),
        "trained_steps": float(trained_steps),
        "resumed_from_step": float(start),
        "examples": float(len(examples)),
        "tokens_per_s": tokens_seen / elapsed if elapsed and trained_steps else 0.0,
    }
    ctx.log_metrics({k: v for k, v in metrics.items() if k != "steps"})
    extra = {"base_fingerprint": inputs["model"].fingerprint} if is_adapter else {}
    return {"model": Output("model", "adapter" if is_adapter else "model", out, metrics=metrics, extra=extra)}
