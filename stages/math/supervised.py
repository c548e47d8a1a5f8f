"""Supervised losses: token cross-entropy on assistant tokens (sft, distillation) and the
Bradley-Terry pairwise loss and accuracy of reward models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a token that carries no loss (prompt, padding)


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


def bt_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley-Terry loss: mean of -log σ(r_c - r_r - m).

    chosen_rewards, rejected_rewards: (B,); margin: (B,) or None (= 0). Bradley & Terry (1952);
    InstructGPT eq. 1 (https://arxiv.org/abs/2203.02155); the margin m (how much better the
    chosen answer was rated) is Llama 2's eq. 2 (https://arxiv.org/abs/2307.09288): pairs rated
    far apart must be separated by at least that much before the loss flattens.
    """
    logits = chosen_rewards.float() - rejected_rewards.float()
    if margin is not None:
        logits = logits - margin.float()
    return -F.logsigmoid(logits).mean()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs with r_c > r_r (ties count as wrong). chosen, rejected: (B,)."""
    return float((chosen > rejected).float().mean()) if chosen.numel() else float("nan")
