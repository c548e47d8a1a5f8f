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

import logging
import time

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from schemas.configs import SFTConfig
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.supervised import IGNORE
from stages.modeling import logprobs, models
from stages.rewards.verifiers import gold_completion
from stages.runtime import distributed
from stages.training.checkpoints import resume, save_checkpoint
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    micro_batch_indices,
    resolve_precision,
    set_lr,
)
from stages.training.sequences import collate, pack, tokenize_conversation

log = logging.getLogger(__name__)

VERSION = "2"  # 2: packing keeps attention inside each packed example (block mask, positions restarted)
CONFIG = SFTConfig
INPUTS = {"model": "model", "data": "sft|prompts"}
OUTPUTS = {"model": "model"}



# ---------------------------------------------------------------------------- pure pieces


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



# ---------------------------------------------------------------------------- the stage


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
