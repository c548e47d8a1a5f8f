"""Pure math of asynchronous RL: the decoupled PPO objective against a stale behaviour policy, and its diagnostics.

With generation and training overlapped, a group consumed by the learner was sampled by a behaviour policy mu
(the weights a rollout worker held) up to K versions older than the learner's. The decoupled objective
(Hilton et al. 2021, https://arxiv.org/abs/2110.00641; AReaL, Fu et al. 2025, https://arxiv.org/abs/2505.24298,
eq. 5) keeps PPO's trust region around a proximal policy pi_prox (the learner's weights when the group is consumed)
and corrects for mu by an importance weight:

    loss_t = w_t * ppo_loss_t(pi_theta / pi_prox, A_t),   w_t = sg(min(pi_prox_t / mu_t, C))

`ppo_loss_t` is any per-token row of `rl.POLICY_LOSSES` that composes (`ASYNC_POLICY_LOSSES`: token, cispo; gspo's
ratio is one per sequence and is refused by the config), with today's clip settings. A is per token, so GRPO's
group advantages (broadcast over a completion) and PPO's GAE advantages go in alike.

Shapes: B sequences, T completion tokens; `mask` (B, T), 1 on completion tokens that count, bool or 0/1 float.

Departures, on purpose:
- AReaL's optional cap (`behav_imp_weight_cap`) drops tokens whose weight exceeds it; here the weight is truncated to
  C instead (as truncated importance sampling, Yao et al. 2025, `rl.tis_weights`), so no sampled token is wasted.
- With K = 0 the behaviour log-probs are the proximal ones: exp(0) = 1 exactly and x * 1.0 == x in IEEE arithmetic,
  so loss and gradients equal `rl.policy_loss`'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from schemas.configs import ASYNC_POLICY_LOSSES
from stages.math import rl


def importance_weights(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor,
                       cap: float = 2.0) -> tuple[Tensor, Tensor]:
    """The truncated importance weight w = min(pi_prox / mu, cap) per token and the raw ratio pi_prox / mu.

    prox_logp, behaviour_logp, mask: (B, T). Returns (w, raw), both (B, T), detached (the weight is a constant of
    the loss), 0 where mask is 0; padding's log-probs never reach the exp.
    """
    if cap <= 1:
        raise ValueError(f"importance cap must be > 1 (a weight of 1, K = 0, must pass untruncated), got {cap}")
    m = mask.bool()
    diff = torch.where(m, prox_logp.detach() - behaviour_logp.detach(), torch.zeros_like(prox_logp))
    raw = torch.where(m, torch.exp(diff), torch.zeros_like(diff))
    return raw.clamp(max=cap), raw


def decoupled_policy_loss(logp: Tensor, prox_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor,
                          kind: str = "token", eps_low: float | None = None, eps_high: float = 0.2,
                          cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled PPO loss per token: `rl.policy_loss` against pi_prox, times `importance_weights` against mu.

    logp (the policy being trained), prox_logp, behaviour_logp, mask: (B, T); advantages (B,) or (B, T).
    kind, eps_low, eps_high: as `rl.policy_loss` (kind one of ASYNC_POLICY_LOSSES). Returns the loss (B, T), 0
    where mask is 0 (reduce it with `rl.aggregate`), and detached stats: `rl.policy_loss`'s and `weight_stats`'.
    """
    if kind not in ASYNC_POLICY_LOSSES:
        raise ValueError(f"policy loss {kind!r} does not compose with the per-token off-policy weight; expected one "
                         f"of {list(ASYNC_POLICY_LOSSES)}")
    loss, stats = rl.policy_loss(logp, prox_logp, advantages, mask, kind, eps_low, eps_high)
    w, raw = importance_weights(prox_logp, behaviour_logp, mask, cap)
    return loss * w.to(loss.dtype), {**stats, **weight_stats(w, raw, mask, cap)}


# ---------------------------------------------------------------------------- diagnostics
# Sums over a step's tokens in bf16/fp16 lose whole units past 256 tokens: the diagnostics count in fp32 at least.


def _masked(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """x widened to fp32 or more with 0 where mask is 0 (where, not a product: inf * 0 is NaN), and the 0/1 mask."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)), m.to(x.dtype)


def weight_mean(w: Tensor, mask: Tensor) -> Tensor:
    """Mean of the weights over masked-in tokens (0 with none). (B, T) → ()."""
    wm, mf = _masked(w, mask)
    return wm.sum() / mf.sum().clamp(min=1)


def effective_sample_size(w: Tensor, mask: Tensor) -> Tensor:
    """Kish's effective sample size of the weights over the n masked-in tokens, divided by n:
    (sum w)^2 / (n * sum w^2), in (0, 1] for positive weights; 1 when every weight is equal (K = 0 gives 1),
    1/n when one token carries all the weight; 0 with no token. (B, T) → ()."""
    wm, mf = _masked(w, mask)
    return wm.sum() ** 2 / (mf.sum() * (wm * wm).sum()).clamp(min=torch.finfo(wm.dtype).tiny)


def truncated_share(raw: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Share of masked-in tokens whose raw weight pi_prox / mu exceeded the cap (0 with none). (B, T) → ()."""
    over, mf = _masked((raw > cap).to(raw.dtype), mask)
    return over.sum() / mf.sum().clamp(min=1)


def weight_stats(w: Tensor, raw: Tensor, mask: Tensor, cap: float) -> dict[str, Tensor]:
    """The step's off-policy diagnostics (detached): mean and normalised ESS of the truncated weights `w` (what the
    loss applies), and the share of tokens truncated (raw > cap)."""
    stats = {"is_weight_mean": weight_mean(w, mask), "is_weight_ess": effective_sample_size(w, mask),
             "is_truncated": truncated_share(raw, mask, cap)}
    return {k: v.detach() for k, v in stats.items()}


def staleness_histogram(staleness: Sequence[int], max_staleness: int) -> list[int]:
    """Counts of consumed groups by staleness 0, 1, ..., max_staleness (the learner's version when it consumed a
    group minus the version that sampled it). A value outside [0, max_staleness] is a broken bound, so it raises
    rather than being counted in some bin."""
    counts = [0] * (max_staleness + 1)
    for s in staleness:
        if not 0 <= s <= max_staleness:
            raise ValueError(f"a group of staleness {s} was consumed; the bound is 0..{max_staleness}")
        counts[s] += 1
    return counts


def _union(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The intervals clipped to [lo, hi], merged where they overlap, in order."""
    out: list[list[float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_fractions(window: tuple[float, float], generation: Sequence[tuple[float, float]],
                   training: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Shares of a wall-clock window (start, end) in which generation was busy (any worker), training was busy, and
    both were (the overlap), from their busy intervals (seconds, one clock); 0 for an empty window."""
    lo, hi = window
    if hi <= lo:
        return {"generation": 0.0, "training": 0.0, "overlap": 0.0}
    gen, train = _union(generation, lo, hi), _union(training, lo, hi)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in gen for c, d in train)
    span = hi - lo
    return {"generation": sum(b - a for a, b in gen) / span, "training": sum(b - a for a, b in train) / span,
            "overlap": both / span}
