"""`prm` stage: a process reward model — a classifier head on a causal LM, read at the last token of
every reasoning step and trained with binary cross-entropy on step labels — and its held-out
step accuracy, AUROC and first-error-step accuracy.

Lightman et al. 2023 (https://arxiv.org/abs/2305.20050) train a PRM to predict each step's label
at the step's last token; Math-Shepherd (https://arxiv.org/abs/2312.08935) trains on its automatic
labels with BCE, hard or soft. Here one sequence per solution, chat_template(prompt) + the steps
joined by the delimiter's separator, and one forward pass scores every step of it.

Choices, as in the `reward_model` stage: the model is a `*ForSequenceClassification(num_labels=1)`
with the input LM's backbone and a fresh `score` head (`reward_model_from_causal_lm`; a PRM artifact
as input is trained further, head kept); LoRA on the backbone with the head fully trained; saved
as merged full weights with `prm.json` (delimiter, max_length) beside them, which `StepScorer`
reads so a completion is cut into steps as in training. Labels come from the `steps` input
(e.g. step_labels) and/or user step files (`files`). The held-out share is split by prompt (no
held-out solution shares a prompt with a trained one). The loss of an optimizer step is the mean
over all its steps (all micro-batches), so batch 4 x accumulation 1 equals batch 2 x accumulation 2.
One process only (the config refuses more).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas.configs import PRMConfig
from schemas.datasets import read_steps_jsonl
from schemas.errors import ConfigError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.steps import (
    auroc,
    first_error_accuracy,
    hard_labels,
    join_steps,
    majority_baseline,
    prm_loss,
    split_by_group,
    step_accuracy,
)
from stages.modeling import models
from stages.modeling.heads import (
    PRM_SCHEMA,
    StepScorer,
    apply_reward_lora,
    batched_step_logits,
    collate,
    encode_steps,
    load_reward_model,
    pad_positions,
    save_prm_settings,
    step_logits,
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

VERSION = "1"
CONFIG = PRMConfig
INPUTS = {"model": "model", "steps": "steps?"}
OUTPUTS = {"model": "model"}


def check(cfg: PRMConfig, node: str = "prm") -> None:
    """Fail before any compute on a missing or bad step file (one error naming file, line and field)."""
    for f in cfg.files:
        if not Path(f).exists():
            raise ConfigError(f"{node}.files: {f} does not exist")
        read_steps_jsonl(f, cfg.neutral)


def cache_salt(cfg: PRMConfig) -> str:
    """User step files are inputs too: their content is part of the cache key."""
    files = cfg.files
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest() if files else ""


def load_rows(data: Input | None, cfg: PRMConfig) -> list[dict]:
    """The step-labelled solutions of the steps input and the files, validated before any model loads."""
    rows = data.table("steps").to_pylist() if data is not None else []
    for f in cfg.files:
        rows += read_steps_jsonl(f, cfg.neutral).to_pylist()
    if not rows:
        raise SchemaError("prm: no step-labelled solutions (wire a steps input or give files)")
    return rows


def encode(rows: list[dict], tokenizer, cfg: PRMConfig) -> list[dict]:
    """Per solution: token ids, step-end positions and the labels of the steps that fit in max_length."""
    out = []
    for r in rows:
        text, ends = join_steps(r["steps"], cfg.delimiter)
        ids, pos = encode_steps(tokenizer, r["messages"], text, ends, cfg.max_length)
        labels = torch.tensor(r["labels"][: len(pos)], dtype=torch.float32)
        out.append({"ids": ids, "pos": pos, "labels": hard_labels(labels) if cfg.targets == "hard" else labels,
                    "dropped": len(ends) - len(pos)})
    return out


def pad_labels(labels: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(labels), width))
    for i, lab in enumerate(labels):
        out[i, : len(lab)] = lab
    return out


def held_out_metrics(model, examples: list[dict], pad_id: int, batch_size: int, device: str) -> dict[str, float]:
    """Step accuracy (with the held-out labels' majority class as its baseline), AUROC, first-error-step
    accuracy and BCE of the held-out solutions, labels thresholded at 0.5 where a metric needs classes."""
    logits = batched_step_logits(model, [e["ids"] for e in examples], [e["pos"] for e in examples], pad_id,
                                 batch_size, device)
    flat_logits, flat_labels = torch.cat(logits), torch.cat([e["labels"] for e in examples])
    width = max(len(lg) for lg in logits)
    mask = pad_labels([torch.ones(len(lg)) for lg in logits], width)
    probs = pad_labels([torch.sigmoid(lg) for lg in logits], width)
    return {
        "eval_solutions": float(len(examples)),
        "eval_steps": float(flat_labels.numel()),
        "eval_loss": float(prm_loss(flat_logits, flat_labels)),
        "eval_step_accuracy": step_accuracy(torch.sigmoid(flat_logits), flat_labels),
        "eval_majority_baseline": majority_baseline(flat_labels),
        "eval_auroc": auroc(flat_logits, flat_labels),
        "eval_first_error_accuracy": first_error_accuracy(probs, pad_labels([e["labels"] for e in examples], width),
                                                          mask),
    }


def run(cfg: PRMConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    rows = load_rows(inputs.get("steps"), cfg)  # validates before loading the model
    train_idx, eval_idx = split_by_group([json.dumps(r["messages"], sort_keys=True) for r in rows],
                                         cfg.eval_fraction, ctx.seed)
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    source = inputs["model"]
    if source.manifest.schema_name == PRM_SCHEMA:  # train a PRM further, head kept
        scorer = StepScorer.from_input(source, ctx.device)
        model, tokenizer, pad_id = scorer.model, scorer.tokenizer, scorer.pad_id
    else:
        model, tokenizer, pad_id = load_reward_model(source, ctx.device)
    model = apply_reward_lora(model, cfg.lora)
    examples = encode(rows, tokenizer, cfg)
    dropped_steps = sum(e["dropped"] for e in examples)
    train = [examples[i] for i in train_idx if examples[i]["pos"]]
    held_out = [examples[i] for i in eval_idx if examples[i]["pos"]]
    if not train:
        raise SchemaError(f"prm: none of {len(train_idx)} training solution(s) has a step within "
                          f"max_length={cfg.max_length} tokens")

    counts = models.count_parameters(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"solutions_train": len(train), "solutions_eval": len(held_out),
                    "steps_train": sum(len(e["pos"]) for e in train), "steps_dropped_by_max_length": dropped_steps,
                    "trainable_parameters": counts["trainable"], "total_parameters": counts["total"],
                    "precision": str(autocast_dtype or "fp32")})

    state = resume(ctx, model, optimizer, "prm", cfg.max_steps)
    start, losses, accuracies = state["step"], state.get("losses", []), state.get("accuracies", [])
    for i, (loss, acc) in enumerate(zip(losses, accuracies, strict=True)):  # the whole curve in MLflow
        ctx.log_metrics({"train/loss": loss, "train/step_accuracy": acc}, step=i + 1)

    model.train()
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="prm", unit="step")
    for step in range(start, cfg.max_steps):
        lr = set_lr(optimizer, cfg.learning_rate * lr_factor(step, cfg.max_steps, warmup, cfg.lr_scheduler))
        micro = [[train[i] for i in micro_batch_indices(len(train), cfg.batch_size, ctx.seed, step * cfg.grad_accum + a)]
                 for a in range(cfg.grad_accum)]
        n_steps = sum(len(e["pos"]) for mb in micro for e in mb)  # the optimizer step's reasoning steps
        step_loss, step_correct = 0.0, 0
        for mb in micro:
            ids, mask = collate([e["ids"] for e in mb], pad_id)  # (B, T)
            pos, pmask = pad_positions([e["pos"] for e in mb])  # (B, S)
            labels = pad_labels([e["labels"] for e in mb], pos.size(1))  # (B, S)
            with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                logits = step_logits(model, ids.to(ctx.device), mask.to(ctx.device), pos.to(ctx.device))  # (B, S)
            real = int(pmask.sum())
            loss = prm_loss(logits, labels.to(ctx.device), pmask.to(ctx.device)) * (real / n_steps)
            loss.backward()
            step_loss += loss.item()
            on = pmask.bool()
            step_correct += int(((logits.detach().cpu()[on] >= 0) == (labels[on] >= 0.5)).sum())
        grad_norm = clip_grad_norm(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        accuracies.append(step_correct / n_steps)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            save_checkpoint(ctx.checkpoint_dir, done, model, optimizer,
                            {"step": done, "losses": losses, "accuracies": accuracies}, cfg.keep_checkpoints, dist)
        ctx.log_metrics({"train/loss": step_loss, "train/step_accuracy": accuracies[-1], "train/lr": lr,
                         "train/grad_norm": grad_norm}, step=done)
        bar.set_postfix(loss=f"{step_loss:.4f}", acc=f"{accuracies[-1]:.2f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t0

    tail = max(1, min(10, len(losses) // 5))
    metrics = {
        "train_loss_final": float(np.mean(losses[-tail:])),
        "train_step_accuracy_final": float(np.mean(accuracies[-tail:])),
        "solutions_train": float(len(train)),
        "steps_train": float(sum(len(e["pos"]) for e in train)),
        "steps_dropped_by_max_length": float(dropped_steps),
        "trained_steps": float(cfg.max_steps - start),
        "resumed_from_step": float(start),
        "seconds_per_step": elapsed / max(1, cfg.max_steps - start),
    }
    if held_out:
        metrics |= held_out_metrics(model, held_out, pad_id, cfg.batch_size, ctx.device)
    ctx.log_metrics(metrics)
    if held_out:
        ctx.log.info("prm: held-out step accuracy %.3f (majority baseline %.3f), AUROC %.3f, first-error accuracy %.3f",
                     metrics["eval_step_accuracy"], metrics["eval_majority_baseline"], metrics["eval_auroc"],
                     metrics["eval_first_error_accuracy"])

    out, model_dir = model_output_dir(ctx, "model")
    models.save_model(model, tokenizer, model_dir, merge=True)
    save_prm_settings(model_dir, cfg.delimiter, cfg.max_length)
    return {"model": Output("model", PRM_SCHEMA, out, metrics=metrics)}
