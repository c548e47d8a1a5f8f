"""Optimizer, learning-rate schedule, gradient clipping, precision and the trainable model of a
stage (LoRA or full, from a model input), shared by every training stage."""

from __future__ import annotations

import math

import numpy as np
import torch

from schemas.configs import SFTConfig
from stages.base import Input
from stages.modeling import models
from stages.sampling.generation import auto_precision


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


def resolve_precision(precision: str, device: str) -> torch.dtype | None:
    """Autocast dtype, or None for plain fp32."""
    if precision == "auto":
        return auto_precision(device)
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
