"""`reward_model` stage: a Bradley-Terry reward model — a scalar head on a causal LM, trained on
preference pairs — and `RewardScorer`, which loads the result and scores completions.

Reads like a training script: split the pairs (a seeded held-out share is never trained on),
tokenize, then a plain loop of micro-batches → optimizer steps with checkpoints, then pairwise
accuracy on the held-out pairs. Loss: Bradley & Terry (1952) as used for RLHF reward models by
InstructGPT (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155, eq. 1), optionally with
Llama 2's margin (Touvron et al. 2023, https://arxiv.org/abs/2307.09288, §3.2.2, eq. 2).

Choices and departures from common trainers (TRL's RewardTrainer):
- the model is `AutoModelForSequenceClassification(num_labels=1)` built from the input causal
  LM's config, with the LM's backbone weights copied in and a fresh `score` head. An adapter
  input is merged into its base first (`Input.load_model()` attaches it, `merge_and_unload()`
  folds it), so no temporary directory is written;
- the reward is read at the last *real* token, located from the attention mask. transformers'
  own pooling looks for the last token that is not `pad_token_id`, which is wrong when the pad
  token equals EOS (SmolLM2: both `<|im_end|>`, which also closes every chat turn), so we run the
  backbone and the `score` head ourselves (`pooled_rewards`);
- a sequence is chat_template(prompt, add_generation_prompt=True) + completion + EOS, shared by
  training and scoring (`format_sequence`); too long → cut from the left, keeping the end where
  the reward is read;
- chosen and rejected go through one concatenated forward pass per micro-batch;
- the loss is a mean over all pairs of the optimizer step (all micro-batches), so batch 4 ×
  accumulation 1 equals batch 2 × accumulation 2, and N processes (each 1/N of every micro-batch,
  gradients summed: `stages.runtime.distributed`) equal one;
- the result is always saved as merged full weights (`lora.merge=False` is ignored, and logged):
  a reward-model adapter could not be loaded by `Input.load_model()`, which attaches adapters to
  causal LMs only. A reward-model artifact as input is trained further with its head kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from schemas.configs import RewardModelConfig
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.supervised import bt_loss, pairwise_accuracy
from stages.modeling import models
from stages.modeling.heads import (
    REWARD_MODEL_SCHEMA,
    apply_reward_lora,
    format_sequence,
    load_reward_model,
    pooled_rewards,
    score_sequences,
)
from stages.modeling.logprobs import right_padded
from stages.runtime import distributed
from stages.training.loop import Curves, Loop, StepResult, autocast, curve_tail, step_micro_batches
from stages.training.optim import resolve_precision
from stages.training.pairs import split_pairs

VERSION = "1"  # history: CHANGELOG.md
CONFIG = RewardModelConfig
INPUTS = {"model": "model", "preferences": "preferences"}
OUTPUTS = {"model": "model"}

OUTPUT_SCHEMA = REWARD_MODEL_SCHEMA  # manifest `schema` of the model artifact this stage writes


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Pair:
    chosen: list[int]
    rejected: list[int]
    margin: float  # 0.0 unless cfg.margin and both scores are known


def load_preferences(data: Input, cfg: RewardModelConfig, seed: int) -> tuple[list[dict], list[int], list[int]]:
    """(rows, train indices, held-out indices), checked before any model is loaded."""
    rows = data.table("preferences").to_pylist()
    if not rows:
        raise SchemaError(f"{data.label}: no preference pairs to train a reward model on")
    train_idx, eval_idx = split_pairs(len(rows), cfg.eval_fraction, seed)
    if not train_idx:
        raise SchemaError(f"{data.label}: {len(rows)} preference pair(s) are too few to hold out "
                          f"eval_fraction={cfg.eval_fraction} and still train on some")
    return rows, train_idx, eval_idx


def tokenize_pairs(rows: list[dict], tokenizer, cfg: RewardModelConfig) -> list[Pair]:
    pairs = []
    for r in rows:
        known = cfg.margin and r["chosen_score"] is not None and r["rejected_score"] is not None
        pairs.append(Pair(format_sequence(tokenizer, r["messages"], r["chosen"], cfg.max_length),
                          format_sequence(tokenizer, r["messages"], r["rejected"], cfg.max_length),
                          float(r["chosen_score"] - r["rejected_score"]) if known else 0.0))
    return pairs


@dataclass(frozen=True)
class Split:
    """The tokenized pairs, split: the held-out share is never trained on."""

    train: list[Pair]
    held_out: list[Pair]
    truncated: int  # pairs with a side cut to max_length (or exactly that long)


def split_tokenized(rows: list[dict], train_idx: list[int], eval_idx: list[int], tokenizer, cfg: RewardModelConfig,
                    ctx: StageContext) -> Split:
    """Tokenize every pair, then split them; warns when margin=True finds no margin to use."""
    pairs = tokenize_pairs(rows, tokenizer, cfg)
    train = [pairs[i] for i in train_idx]
    held_out = [pairs[i] for i in eval_idx]
    truncated = sum(max(len(p.chosen), len(p.rejected)) == cfg.max_length for p in pairs)  # cut (or exactly that long)
    if cfg.margin and not any(p.margin for p in train):
        ctx.log.warning("reward_model: margin=True but no training pair has both scores (or they are equal); plain BT loss")
    return Split(train, held_out, truncated)


# ---------------------------------------------------------------------------- the training loop


@dataclass
class Session:
    """What every step reads and what the run accumulates: config, pairs, loop, precision, the curves."""

    cfg: RewardModelConfig
    ctx: StageContext
    pairs: Split
    pad_id: int
    loop: Loop
    autocast_dtype: torch.dtype | None
    curves: Curves = field(default_factory=lambda: Curves("train/accuracy"))  # every step's loss and accuracy so far
    pairs_seen: int = 0  # trained since the run (re)started, every process's


def open_session(cfg: RewardModelConfig, ctx: StageContext, dist: distributed.Dist, model, pairs: Split,
                 pad_id: int) -> Session:
    """Shard the model, build the optimizer, log the run's parameters."""
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    loop = Loop.open(cfg, ctx, dist, model)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"pairs_train": len(pairs.train), "pairs_eval": len(pairs.held_out),
                    "pairs_truncated": pairs.truncated, "trainable_parameters": counts["trainable"],
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})
    return Session(cfg, ctx, pairs, pad_id, loop, autocast_dtype)


def resume_session(s: Session) -> int:
    """Load the newest checkpoint and re-log its curves (the whole curve in MLflow); the step."""
    state = s.loop.resume("reward_model")
    s.curves.restore(state, s.ctx)
    return state["step"]


def micro_batch_loss(s: Session, mb: list[Pair], real: bool, n_pairs: int) -> tuple[float, int]:
    """Backward of a micro-batch's BT loss, weighted as its share of the step's pairs; (that loss, pairs ranked
    right)."""
    device = s.ctx.device
    ids, mask = right_padded([p.chosen for p in mb] + [p.rejected for p in mb], s.pad_id)  # (2B, T)
    margin = torch.tensor([p.margin for p in mb], device=device)
    with autocast(device, s.autocast_dtype):
        rewards = pooled_rewards(s.loop.model, ids.to(device), mask.to(device))  # (2B,)
    r_chosen, r_rejected = rewards[: len(mb)], rewards[len(mb) :]
    loss = bt_loss(r_chosen, r_rejected, margin) * (len(mb) / n_pairs * real)  # mean over the step's pairs
    loss.backward()
    return loss.item(), int((r_chosen > r_rejected).sum()) * real


def train_step(s: Session, step: int, lr: float) -> StepResult:
    """One optimizer step: the step's micro-batches (this process's parts), summed gradients, the update."""
    cfg, dist, train = s.cfg, s.loop.dist, s.pairs.train
    step_indices = step_micro_batches(len(train), cfg, s.ctx.seed, step)
    n_pairs = sum(len(idx) for idx in step_indices)  # the global step's
    s.pairs_seen += n_pairs
    # this process's parts (under fsdp a weight-0 filler where a part is empty)
    micro = [([train[i] for i in m], real) for m, real in map(dist.part_or_filler, step_indices) if m]
    step_loss, step_correct = 0.0, 0
    for mb, real in micro:
        loss, correct = micro_batch_loss(s, mb, real, n_pairs)
        step_loss += loss
        step_correct += correct
    dist.sync_gradients(s.loop.trainable)
    step_loss, step_correct = dist.sum([step_loss, step_correct])
    grad_norm = s.loop.update()
    return s.curves.step(step_loss, step_correct / n_pairs, lr, grad_norm)


# ---------------------------------------------------------------------------- results


def summarize(s: Session, start: int, elapsed: float) -> dict[str, float]:
    """The run's loss and accuracy at its end, its data, its length and its throughput."""
    cfg = s.cfg
    return {
        "train_loss_final": float(np.mean(curve_tail(s.curves.losses))),
        "train_accuracy_final": float(np.mean(curve_tail(s.curves.accuracies))),
        "pairs_train": float(len(s.pairs.train)),
        "pairs_eval": float(len(s.pairs.held_out)),
        "pairs_truncated": float(s.pairs.truncated),
        "steps": float(cfg.max_steps),
        "trained_steps": float(cfg.max_steps - start),
        "resumed_from_step": float(start),
        "pairs_per_s": s.pairs_seen / elapsed if elapsed and s.pairs_seen else 0.0,
    }


def held_out_pair_metrics(plain, held_out: list[Pair], pad_id: int, batch_size: int, device: str) -> dict[str, float]:
    """Pairwise accuracy, margin, BT loss and the rewards' spread on the held-out pairs."""
    bs = 2 * batch_size
    r_chosen = score_sequences(plain, [p.chosen for p in held_out], pad_id, bs, device)
    r_rejected = score_sequences(plain, [p.rejected for p in held_out], pad_id, bs, device)
    both = torch.cat([r_chosen, r_rejected])
    return {
        "eval_accuracy": pairwise_accuracy(r_chosen, r_rejected),
        "eval_margin": float((r_chosen - r_rejected).mean()),
        "eval_loss": float(bt_loss(r_chosen, r_rejected)),
        "reward_mean": float(both.mean()),
        "reward_std": float(both.std()) if both.numel() > 1 else 0.0,
    }


# ---------------------------------------------------------------------------- the stage


def run(cfg: RewardModelConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    rows, train_idx, eval_idx = load_preferences(inputs["preferences"], cfg, ctx.seed)  # validates before the model
    dist = distributed.of(ctx)  # N processes: each takes 1/N of every micro-batch; gradients are summed
    if cfg.lora.r > 0 and not cfg.lora.merge:
        ctx.log.info("reward_model: lora.merge=False ignored; reward models are saved as merged full weights")
    seed_everything(ctx.seed)
    model, tokenizer, pad_id = load_reward_model(inputs["model"], dist.load_device(ctx.device))
    model = apply_reward_lora(model, cfg.lora)
    pairs = split_tokenized(rows, train_idx, eval_idx, tokenizer, cfg, ctx)
    s = open_session(cfg, ctx, dist, model, pairs, pad_id)
    start = resume_session(s)
    elapsed = s.loop.train(start, "reward_model", partial(train_step, s))
    metrics = summarize(s, start, elapsed)
    plain = dist.full_model(s.loop.model, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    if pairs.held_out and dist.is_main:
        metrics |= held_out_pair_metrics(plain, pairs.held_out, pad_id, cfg.batch_size, ctx.device)
    ctx.log_metrics({k: v for k, v in metrics.items() if k != "steps"})

    out, model_dir = model_output_dir(ctx, "model")
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=True)
    return {"model": Output("model", OUTPUT_SCHEMA, out, metrics=metrics)}
