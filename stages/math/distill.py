"""Knowledge-distillation losses: token-level divergences between the teacher's and the student's
next-token distributions. Tensors in, a scalar out; no model, config or trainer state.

- `kd_loss`: Hinton, Vinyals & Dean 2015 (https://arxiv.org/abs/1503.02531): both distributions
  are softmaxes at temperature T, and the divergence is multiplied by T² because the gradient of
  the softened KL shrinks as 1/T² (§2 of the paper), so changing T does not change the effective
  learning rate. `forward` is KL(p_T ‖ q_S), the classic word-level KD (mean-seeking: the student
  covers every teacher mode); `reverse` is KL(q_S ‖ p_T) (mode-seeking; MiniLLM, Gu et al. 2023).
- `generalized_jsd`: GKD (Agarwal et al. 2023, https://arxiv.org/abs/2306.13649, §3):
  JSD(β)(P ‖ Q) = β·KL(P ‖ M) + (1 − β)·KL(Q ‖ M), M = β·P + (1 − β)·Q, with P the teacher and Q
  the student. As β → 0 it behaves like β·KL(P ‖ Q) (forward), as β → 1 like (1 − β)·KL(Q ‖ P)
  (reverse). The paper applies no temperature to the divergence; we accept the same T and T² as
  `kd_loss` so that `temperature` means one thing (T = 1 is the paper's loss).

Shapes: logits (B, T, V) where position t holds the distribution over token t+1, mask (B, T),
true where that next token is a completion token (the assistant turn). Masked-out positions are
selected away *before* the softmax, so padding rows with garbage (even NaN) logits contribute
nothing to the value or the gradient, and [B, T, V] probabilities are only formed for the
positions that count. Teacher logits are detached: the gradient flows only to the student.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

DIRECTIONS = ("forward", "reverse")


def _select(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The (N, V) student and (N, V) detached teacher logits at the N positions where mask is true."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must both be (B, T, V)")
    if tuple(mask.shape) != tuple(student_logits.shape[:2]):
        raise ValueError(f"mask {tuple(mask.shape)} must be (B, T) = {tuple(student_logits.shape[:2])}")
    m = mask.bool()
    return student_logits[m].float(), teacher_logits.detach()[m].float()


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(P ‖ Q) = Σ_v p_v (log p_v − log q_v) per row: (N, V) log-probs → (N,)."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _reduce(per_token: Tensor, temperature: float, reduction: str) -> Tensor:
    """T² · (mean or sum) over the selected tokens; an empty selection gives 0 (with a graph)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    total = per_token.sum() * temperature**2
    if reduction == "sum":
        return total
    return total / max(1, per_token.numel())


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, temperature: float = 1.0,
            direction: str = "forward", reduction: str = "mean") -> Tensor:
    """T² · mean over masked tokens of KL(p_T ‖ q_S) (forward) or KL(q_S ‖ p_T) (reverse).

    student_logits, teacher_logits: (B, T, V); mask: (B, T). p_T = softmax(teacher / T),
    q_S = softmax(student / T). `reduction="sum"` gives T² · the sum instead (for a loss normalised
    over several micro-batches by the caller). Zero exactly when the two distributions agree at
    every masked position.
    """
    _positive("temperature", temperature)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    s, t = _select(student_logits, teacher_logits, mask)
    log_q = F.log_softmax(s / temperature, dim=-1)  # (N, V) student
    log_p = F.log_softmax(t / temperature, dim=-1)  # (N, V) teacher
    per_token = _kl(log_p, log_q) if direction == "forward" else _kl(log_q, log_p)
    return _reduce(per_token, temperature, reduction)


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, beta: float = 0.5,
                    temperature: float = 1.0, reduction: str = "mean") -> Tensor:
    """GKD's JSD(β): T² · mean over masked tokens of β·KL(P ‖ M) + (1 − β)·KL(Q ‖ M).

    P = softmax(teacher / T), Q = softmax(student / T), M = β·P + (1 − β)·Q, β in (0, 1); shapes as
    `kd_loss`. log M is computed as a log-sum-exp of the two weighted log-probs (no underflow).
    """
    _positive("temperature", temperature)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta!r} (use kd_loss for the forward/reverse limits)")
    s, t = _select(student_logits, teacher_logits, mask)
    log_q = F.log_softmax(s / temperature, dim=-1)
    log_p = F.log_softmax(t / temperature, dim=-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    per_token = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    return _reduce(per_token, temperature, reduction)


# ---------------------------------------------------------------------------- registry

# divergence name -> loss(student_logits, teacher_logits, mask, temperature, beta, reduction)
Divergence = Callable[[Tensor, Tensor, Tensor, float, float, str], Tensor]
DIVERGENCES: dict[str, Divergence] = {
    "forward": lambda s, t, m, temp, beta, red: kd_loss(s, t, m, temp, "forward", red),
    "reverse": lambda s, t, m, temp, beta, red: kd_loss(s, t, m, temp, "reverse", red),
    "jsd": lambda s, t, m, temp, beta, red: generalized_jsd(s, t, m, beta, temp, red),
}


def distill_loss(kind: str, student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, temperature: float = 1.0,
                 beta: float = 0.5, reduction: str = "mean") -> Tensor:
    """Look up `kind` (forward | reverse | jsd) in DIVERGENCES and apply it; `beta` is used by jsd only."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {sorted(DIVERGENCES)}")
    return DIVERGENCES[kind](student_logits, teacher_logits, mask, temperature, beta, reduction)
