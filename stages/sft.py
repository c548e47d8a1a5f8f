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

import dataclasses
import logging
from functools import partial

import numpy as np
import pyarrow.compute as pc
import torch

from schemas.configs import SFTConfig
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, seed_everything
from stages.math.supervised import IGNORE
from stages.modeling import logprobs, models, prefix_sharing
from stages.rewards.answers import gold_completion
from stages.runtime import distributed
from stages.training.loop import (
    CheckpointPublisher,
    Loop,
    StepResult,
    autocast,
    curve_tail,
    policy_output,
    save_policy,
    step_micro_batches,
)
from stages.training.optim import load_trainable, resolve_precision
from stages.training.sequences import collate, pack, tokenize_conversation

log = logging.getLogger(__name__)

VERSION = "2"  # history: CHANGELOG.md
CONFIG = SFTConfig
INPUTS = {"model": "model", "data": "sft|prompts"}
OUTPUTS = {"model": "model"}


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


# ---------------------------------------------------------------------------- tokens


@dataclasses.dataclass
class Examples:
    """The tokenized (and packed) training examples and what collating them needs."""

    examples: list  # sequences.Example, packed into max_length blocks with packing
    targets: list[int]  # the tokens each example trains (assistant tokens that a position predicts)
    blocked: bool  # packed examples keep attention inside themselves (a block mask)
    pad_id: int


def tokenize_examples(conversations: list[list[dict]], tokenizer, model, cfg: SFTConfig, label: str) -> Examples:
    """Tokenize with the prompt masked, drop examples left without assistant tokens, pack if asked."""
    examples = [tokenize_conversation(tokenizer, c, cfg.max_length) for c in conversations]
    examples = [e for e in examples if any(lab != IGNORE for lab in e.labels[1:])]
    if not examples:
        raise SchemaError(f"{label}: every example lost its assistant tokens to max_length={cfg.max_length}")
    blocked = cfg.packing and prefix_sharing.can_pack_prefix(model)  # before sharding: can the model take a 4D mask
    if cfg.packing:
        examples = pack(examples, cfg.max_length)
        if not blocked:
            log.warning("sft: %s does not take a block attention mask (prefix_sharing.can_pack_prefix): packed examples "
                        "attend to the examples before them in their block", type(model).__name__)
    targets = [sum(lab != IGNORE for lab in e.labels[1:]) for e in examples]  # tokens each example trains
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Examples(examples, targets, blocked, pad_id)


# ---------------------------------------------------------------------------- the training loop


@dataclasses.dataclass
class Session:
    """What every step reads and what the run accumulates: config, data, loop, precision, the loss curve."""

    cfg: SFTConfig
    ctx: StageContext
    data: Examples
    loop: Loop
    autocast_dtype: torch.dtype | None
    history: list[float] = dataclasses.field(default_factory=list)  # the loss of every step so far
    tokens_seen: int = 0  # this process's, trained since the run (re)started


def open_session(cfg: SFTConfig, ctx: StageContext, dist: distributed.Dist, model, data: Examples) -> Session:
    """Shard the model, build the optimizer, log the run's parameters."""
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    loop = Loop.open(cfg, ctx, dist, model)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"examples": len(data.examples), "trainable_parameters": counts["trainable"],
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})
    return Session(cfg, ctx, data, loop, autocast_dtype)


def resume_session(s: Session) -> int:
    """Load the newest checkpoint and re-log its curve (MLflow then shows the interrupted run whole); the step."""
    state = s.loop.resume("sft")
    s.history = state.get("history", [])
    for i, loss in enumerate(s.history):
        s.ctx.log_metrics({"train/loss": loss}, step=i + 1)
    return state["step"]


def micro_batch_loss(s: Session, batch: dict[str, torch.Tensor], real: bool, n_tokens: int) -> float:
    """Backward of a micro-batch's summed token NLL over the step's token count; that loss."""
    ctx = s.ctx
    batch = {k: v.to(ctx.device) for k, v in batch.items()}
    with autocast(ctx.device, s.autocast_dtype):
        labels = batch["labels"][:, 1:]  # the logits exist cfg.logprob_chunk positions at a time
        logp, _ = logprobs.token_logprobs(s.loop.model, batch["input_ids"],
                                          batch.get("block_mask", batch["attention_mask"]),
                                          chunk_tokens=s.cfg.logprob_chunk, targets=labels.clamp(min=0),
                                          positions=labels != IGNORE, position_ids=batch.get("position_ids"))
    loss_sum = -(logp * (labels != IGNORE)).sum() * real  # = masked_token_loss on the full logits
    (loss_sum / n_tokens).backward()
    s.tokens_seen += int(batch["attention_mask"].sum()) * real
    return loss_sum.item() / n_tokens


def train_step(s: Session, step: int, lr: float) -> StepResult:
    """One optimizer step: the step's micro-batches (this process's parts), summed gradients, the update."""
    cfg, dist, data = s.cfg, s.loop.dist, s.data
    step_indices = step_micro_batches(len(data.examples), cfg, s.ctx.seed, step)
    n_tokens = sum(data.targets[i] for idx in step_indices for i in idx)  # the global step's, on every rank
    # an epoch's last micro-batch may be short: parts, a weight-0 filler where fsdp needs one
    mine = [dist.part_or_filler(idx) for idx in step_indices]
    micro = [(collate([data.examples[i] for i in m], data.pad_id, data.blocked), real) for m, real in mine if m]
    step_loss = 0.0
    for batch, real in micro:
        step_loss += micro_batch_loss(s, batch, real, n_tokens)
    dist.sync_gradients(s.loop.trainable)
    (step_loss,) = dist.sum([step_loss])
    grad_norm = s.loop.update()
    s.history.append(step_loss)
    return StepResult({"train/loss": step_loss, "train/lr": lr, "train/grad_norm": grad_norm},
                      {"history": s.history}, {"loss": f"{step_loss:.4f}"})


def summarize(s: Session, start: int, elapsed: float, tokens_seen: int) -> dict[str, float]:
    """The run's loss at its start and end, its length and its throughput."""
    cfg = s.cfg
    trained_steps = cfg.max_steps - start
    return {
        "final_loss": float(np.mean(curve_tail(s.history))),
        "first_loss": float(s.history[0]),
        "steps": float(cfg.max_steps),
        "trained_steps": float(trained_steps),
        "resumed_from_step": float(start),
        "examples": float(len(s.data.examples)),
        "tokens_per_s": tokens_seen / elapsed if elapsed and trained_steps else 0.0,
    }


# ---------------------------------------------------------------------------- the stage


def run(cfg: SFTConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    conversations = conversations_from(inputs["data"], cfg)  # validates before loading the model
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    data = tokenize_examples(conversations, tokenizer, model, cfg, inputs["data"].label)
    s = open_session(cfg, ctx, dist, model, data)
    start = resume_session(s)
    publish = CheckpointPublisher(ctx, dist, cfg.publish_checkpoints_every, cfg.max_steps,
                                  lambda: dist.full_model(s.loop.model, ctx.device), tokenizer, cfg.lora, merged_input,
                                  inputs["model"])
    elapsed = s.loop.train(start, "sft", partial(train_step, s), publish)
    (tokens_seen,) = dist.sum([s.tokens_seen])
    plain = dist.full_model(s.loop.model, ctx.device)  # fsdp: gathered, rank 0 only
    out, is_adapter = save_policy(ctx, dist, plain, tokenizer, cfg.lora, merged_input)
    metrics = summarize(s, start, elapsed, tokens_seen)
    ctx.log_metrics({k: v for k, v in metrics.items() if k != "steps"})
    return {"model": policy_output(out, is_adapter, inputs["model"], metrics)}
