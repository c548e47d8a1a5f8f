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

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas.configs import RewardModelConfig
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.supervised import bt_loss, pairwise_accuracy
from stages.modeling import models
from stages.modeling.heads import (
    REWARD_MODEL_SCHEMA,
    apply_reward_lora,
    collate,
    format_sequence,
    load_reward_model,
    pooled_rewards,
    score_sequences,
)
from stages.runtime import distributed
from stages.training.checkpoints import resume, save_checkpoint
from stages.training.optim import (
    clip_grad_norm,
    lr_factor,
    make_optimizer,
    micro_batch_indices,
    resolve_precision,
    set_lr,
)
from stages.training.pairs import split_pairs

VERSION = "1"
CONFIG = RewardModelConfig
INPUTS = {"model": "model", "preferences": "preferences"}
OUTPUTS = {"model": "model"}

OUTPUT_SCHEMA = REWARD_MODEL_SCHEMA  # manifest `schema` of the model artifact this stage writes


# ---------------------------------------------------------------------------- pure pieces


# ---------------------------------------------------------------------------- text → tokens


# ---------------------------------------------------------------------------- the model


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


# ---------------------------------------------------------------------------- the stage


def run(cfg: RewardModelConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    data = inputs["preferences"]
    rows, train_idx, eval_idx = load_preferences(data, cfg, ctx.seed)  # validates before loading the model
    dist = distributed.of(ctx)  # N processes: each takes 1/N of every micro-batch; gradients are summed
    if cfg.lora.r > 0 and not cfg.lora.merge:
        ctx.log.info("reward_model: lora.merge=False ignored; reward models are saved as merged full weights")
    seed_everything(ctx.seed)
    model, tokenizer, pad_id = load_reward_model(inputs["model"], dist.load_device(ctx.device))
    model = apply_reward_lora(model, cfg.lora)
    pairs = tokenize_pairs(rows, tokenizer, cfg)
    train = [pairs[i] for i in train_idx]
    held_out = [pairs[i] for i in eval_idx]
    truncated = sum(max(len(p.chosen), len(p.rejected)) == cfg.max_length for p in pairs)  # cut (or exactly that long)
    if cfg.margin and not any(p.margin for p in train):
        ctx.log.warning("reward_model: margin=True but no training pair has both scores (or they are equal); plain BT loss")

    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"pairs_train": len(train), "pairs_eval": len(held_out), "pairs_truncated": truncated,
                    "trainable_parameters": counts["trainable"], "total_parameters": counts["total"],
                    "precision": str(autocast_dtype or "fp32")})

    state = resume(ctx, model, optimizer, "reward_model", cfg.max_steps)
    start, losses, accuracies = state["step"], state.get("losses", []), state.get("accuracies", [])
    for i, (loss, acc) in enumerate(zip(losses, accuracies, strict=True)):  # the whole curve in MLflow
        ctx.log_metrics({"train/loss": loss, "train/accuracy": acc}, step=i + 1)

    model.train()
    pairs_seen, t0 = 0, time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="reward_model", unit="step", disable=not dist.is_main)
    for step in range(start, cfg.max_steps):
        lr = set_lr(optimizer, cfg.learning_rate * lr_factor(step, cfg.max_steps, warmup, cfg.lr_scheduler))
        step_indices = [micro_batch_indices(len(train), cfg.batch_size, ctx.seed, step * cfg.grad_accum + a)
                        for a in range(cfg.grad_accum)]
        n_pairs = sum(len(idx) for idx in step_indices)  # the global step's
        pairs_seen += n_pairs
        # this process's parts (under fsdp a weight-0 filler where a part is empty)
        micro = [([train[i] for i in m], real) for m, real in map(dist.part_or_filler, step_indices) if m]
        step_loss, step_correct = 0.0, 0
        for mb, real in micro:
            ids, mask = collate([p.chosen for p in mb] + [p.rejected for p in mb], pad_id)  # (2B, T)
            margin = torch.tensor([p.margin for p in mb], device=ctx.device)
            with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                rewards = pooled_rewards(model, ids.to(ctx.device), mask.to(ctx.device))  # (2B,)
            r_chosen, r_rejected = rewards[: len(mb)], rewards[len(mb) :]
            loss = bt_loss(r_chosen, r_rejected, margin) * (len(mb) / n_pairs * real)  # mean over the step's pairs
            loss.backward()
            step_loss += loss.item()
            step_correct += int((r_chosen > r_rejected).sum()) * real
        dist.sync_gradients(trainable)
        step_loss, step_correct = dist.sum([step_loss, step_correct])
        grad_norm = clip_grad_norm(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        accuracies.append(step_correct / n_pairs)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            save_checkpoint(ctx.checkpoint_dir, done, model, optimizer,
                                {"step": done, "losses": losses, "accuracies": accuracies}, cfg.keep_checkpoints, dist)
        ctx.log_metrics({"train/loss": step_loss, "train/accuracy": accuracies[-1], "train/lr": lr,
                         "train/grad_norm": grad_norm}, step=done)
        bar.set_postfix(loss=f"{step_loss:.4f}", acc=f"{accuracies[-1]:.2f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t0
    trained_steps = cfg.max_steps - start

    tail = max(1, min(10, len(losses) // 5))
    metrics = {
        "train_loss_final": float(np.mean(losses[-tail:])),
        "train_accuracy_final": float(np.mean(accuracies[-tail:])),
        "pairs_train": float(len(train)),
        "pairs_eval": float(len(held_out)),
        "pairs_truncated": float(truncated),
        "steps": float(cfg.max_steps),
        "trained_steps": float(trained_steps),
        "resumed_from_step": float(start),
        "pairs_per_s": pairs_seen / elapsed if elapsed and pairs_seen else 0.0,
    }
    plain = dist.full_model(model, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    if held_out and dist.is_main:
        bs = 2 * cfg.batch_size
        r_chosen = score_sequences(plain, [p.chosen for p in held_out], pad_id, bs, ctx.device)
        r_rejected = score_sequences(plain, [p.rejected for p in held_out], pad_id, bs, ctx.device)
        both = torch.cat([r_chosen, r_rejected])
        metrics |= {
            "eval_accuracy": pairwise_accuracy(r_chosen, r_rejected),
            "eval_margin": float((r_chosen - r_rejected).mean()),
            "eval_loss": float(bt_loss(r_chosen, r_rejected)),
            "reward_mean": float(both.mean()),
            "reward_std": float(both.std()) if both.numel() > 1 else 0.0,
        }
    ctx.log_metrics({k: v for k, v in metrics.items() if k != "steps"})

    out, model_dir = model_output_dir(ctx, "model")
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=True)
    return {"model": Output("model", OUTPUT_SCHEMA, out, metrics=metrics)}
