"""Pure math of offline preference optimisation: sequence log-probs and the DPO family of losses.

Small functions, tensors in and out, no model or config; a preference stage composes them as
forward (policy, and the frozen reference where `NEEDS_REFERENCE`) → `sequence_logprobs` per
completion → `preference_loss(kind, ...)` → `losses.mean()` → step, logging `reward_metrics`.
Every variant is a row of `LOSSES`, picked by name from the config.

Shapes: B pairs (or B unpaired examples for KTO), T completion tokens. `mask` is (B, T), 1 on
completion tokens (prompt and padding 0), bool or 0/1 float. A "sequence log-prob" is (B,): the
sum (or, with `average=True`, the mean) of a completion's token log-probs.

Papers:
- DPO, Rafailov et al. 2023, eq. 7: https://arxiv.org/abs/2305.18290
- cDPO (conservative DPO, labels flipped with probability ε), Mitchell 2023:
  https://ericmitchell.ai/cdpo.pdf
- IPO, Azar et al. 2023, eq. 17: https://arxiv.org/abs/2310.12036
- SimPO, Meng et al. 2024: https://arxiv.org/abs/2405.14734
- KTO, Ethayarajh et al. 2024: https://arxiv.org/abs/2402.01306
- ORPO, Hong et al. 2024: https://arxiv.org/abs/2403.07691

Conventions and departures from the papers, on purpose:
- Every loss returns per-example `losses` (B,) with gradient; the stage reduces them (a mean over
  all examples of an optimizer step keeps batch × accumulation invariant). Rewards and extras
  are detached: they are for metrics only.
- Reference log-probs are detached inside the losses: the reference is frozen by definition, so a
  forgotten `torch.no_grad()` in the stage costs memory, never a wrong gradient.
- `sequence_logprobs` sums in at least float32: a bf16 sum of a few hundred token log-probs is
  off by whole nats, far more than the margins these losses look at.
- Implicit rewards, for metrics: β·(log π − log π_ref) for DPO, cDPO, IPO and KTO (IPO has no
  reward of its own; this keeps its metrics comparable with DPO's); β·(average log π) for
  SimPO; the log-odds of ORPO (its margin is then the log odds ratio the loss acts on).
- KTO is unpaired: its `chosen_rewards` are those of the desirable examples (D,) and its
  `rejected_rewards` those of the undesirable ones (U,), D + U = B, and `paired` is False, so
  `reward_metrics` reports their means and margin but no pairwise accuracy.
- IPO length-averages the log-probs (as its authors' code and TRL do), not the sums of DPO.
  Defaults per loss (`LOSSES[kind].average`): summed for DPO, cDPO and KTO, averaged per token for
  IPO, SimPO and ORPO; the stage's `logprob_reduction: sum|mean` overrides them.
- ORPO's log odds x − log(1 − eˣ) have the slope 1/(1 − eˣ), unbounded as an average log-prob x
  nears 0 (a rejected answer the model is sure of: ~1e9 at x = −1e-9, +inf at 0, possible in bf16).
  Above the probability `ORPO_MAX_PROB` (x > log 0.999) they continue along their tangent, so the
  slope, and the odds-ratio term's gradient, stay at most 1/(1 − 0.999) = 1000 and the loss stays
  finite and increasing; below it they are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------- sequence log-probs


def sequence_logprobs(token_logps: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """log π(y|x) = Σ_t mask_t · log π(y_t | x, y_<t), or its mean over the completion tokens.

    token_logps: (B, T) log-probs of the completion tokens (garbage or -inf where mask is 0);
    mask: (B, T) → (B,) in at least float32. `average=True` divides by the number of completion
    tokens (SimPO, ORPO; some libraries also average for IPO); an empty row gives 0. Masked
    positions are replaced by 0 before the sum, so they leak no NaN into the value or gradient.
    """
    if token_logps.shape != mask.shape or token_logps.dim() != 2:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and mask {tuple(mask.shape)} must both be (B, T)")
    x = token_logps.to(torch.promote_types(token_logps.dtype, torch.float32))
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum(dim=-1)  # (B,)
    if not average:
        return total
    return total / m.sum(dim=-1).clamp(min=1).to(total.dtype)


# ---------------------------------------------------------------------------- return type


class PreferenceLoss(NamedTuple):
    """What every loss returns.

    losses: (B,) per example, with gradient. chosen_rewards / rejected_rewards: detached implicit
    rewards, (B,) each for paired losses; for KTO (paired False) the desirable examples' (D,) and
    the undesirable ones' (U,). extras: detached per-example (B,) or scalar terms worth logging
    (ORPO's odds-ratio term, KTO's reference point).
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    extras: dict[str, Tensor]
    paired: bool = True


def _same_shape(**tensors: Tensor) -> None:
    """Guard against (B,) meeting (B, 1), which would broadcast to a silent (B, B) loss."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1 or any(len(s) != 1 for s in shapes.values()):
        raise ValueError(f"inputs must all be (B,) with the same B, got {shapes}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


# ---------------------------------------------------------------------------- paired, with a reference


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, label_smoothing: float = 0.0) -> PreferenceLoss:
    """DPO: −log σ(r̂_w − r̂_l), r̂ = β·(log π(y|x) − log π_ref(y|x)). All inputs (B,) sequence log-probs.

    DPO eq. 7 (https://arxiv.org/abs/2305.18290). With label_smoothing ε > 0 it is cDPO, the loss
    for labels flipped with probability ε: −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ), where
    Δ = (log π_w − log π_ref,w) − (log π_l − log π_ref,l). Its gradient σ(βΔ) − (1−ε) vanishes at
    βΔ = log((1−ε)/ε), so cDPO stops pushing the margin there; plain DPO never stops.
    The paper uses summed sequence log-probs (`sequence_logprobs(average=False)`).
    """
    _same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    _positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    chosen_logratio = policy_chosen - ref_chosen.detach()  # (B,)
    rejected_logratio = policy_rejected - ref_rejected.detach()
    logits = beta * (chosen_logratio - rejected_logratio)  # βΔ
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return PreferenceLoss(losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach(), {})


def cdpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
              beta: float, label_smoothing: float) -> PreferenceLoss:
    """cDPO (https://ericmitchell.ai/cdpo.pdf): `dpo_loss` with the label-noise rate ε required.

    All inputs (B,). −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ); ε = 0 is DPO.
    """
    return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing)


def ipo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float) -> PreferenceLoss:
    """IPO: (Δ − 1/(2β))², Δ = (log π_w − log π_ref,w) − (log π_l − log π_ref,l). All inputs (B,).

    IPO eq. 17 (https://arxiv.org/abs/2310.12036), where β is the paper's τ. Unlike DPO the loss
    is a regression of Δ onto the target 1/(2β): it is 0 there and pulls Δ back from either side,
    so the margin cannot run away on deterministic preferences.
    Summed or averaged log-probs? The paper writes Δ with sequence log-probs, but its authors'
    implementation, and TRL's `loss_type="ipo"`, average them over the completion's tokens, which
    sets the scale of Δ and hence the meaning of β: averaged, β = 0.1 asks for a margin of 5 nats
    *per token*; summed, 5 nats over the whole completion, which a long answer reaches by a tiny
    per-token change. `LOSSES["ipo"].average` is True (the averaged form, TRL's numbers); the
    caller decides through `sequence_logprobs(average=...)` (the stage's `logprob_reduction: sum`
    gives the summed form). The function itself takes whichever it is given.
    """
    _same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    _positive("beta", beta)
    chosen_logratio = policy_chosen - ref_chosen.detach()
    rejected_logratio = policy_rejected - ref_rejected.detach()
    losses = (chosen_logratio - rejected_logratio - 1 / (2 * beta)) ** 2
    return PreferenceLoss(losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach(), {})


# ---------------------------------------------------------------------------- paired, reference-free


def simpo_loss(policy_chosen_avg: Tensor, policy_rejected_avg: Tensor, beta: float, gamma: float) -> PreferenceLoss:
    """SimPO: −log σ(β·avg log π_w − β·avg log π_l − γ). Inputs (B,) *average* token log-probs.

    SimPO (https://arxiv.org/abs/2405.14734): the reward β·(1/|y|)·log π(y|x) needs no
    reference model, and length normalisation keeps long (or short) answers from being favoured
    just for their length. γ is the target reward margin, in reward units (the paper's recipes
    set γ/β around 0.5 with β around 2). Rewards are β·avg log-prob.
    """
    _same_shape(policy_chosen_avg=policy_chosen_avg, policy_rejected_avg=policy_rejected_avg)
    _positive("beta", beta)
    chosen_rewards = beta * policy_chosen_avg
    rejected_rewards = beta * policy_rejected_avg
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return PreferenceLoss(losses, chosen_rewards.detach(), rejected_rewards.detach(), {})


ORPO_MAX_PROB = 0.999  # above this (geometric-mean token) probability the log odds go on linearly


def log_odds(avg_logp: Tensor) -> Tensor:
    """log odds(y) = log P − log(1 − P) with log P = avg_logp ≤ 0, as in ORPO. (B,) → (B,).

    log(1 − e^x) is log(−expm1(x)) for x > −ln 2 and log1p(−e^x) below (each accurate on its side;
    Mächler 2012, "Accurately computing log(1 − exp(−|a|))"). Exact for P ≤ `ORPO_MAX_PROB`; above
    it, the tangent at c = log ORPO_MAX_PROB: lo(c) + (x − c) / (1 − ORPO_MAX_PROB), so the
    slope (the gradient) is at most 1000 and x = 0 gives a finite value (6.91 + 1.0005).
    """
    c = math.log(ORPO_MAX_PROB)
    x = avg_logp.clamp(max=c)  # the exact branch sees at most c (and passes no gradient above it)
    log1m_exp = torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    exact = x - log1m_exp
    tangent = exact + (avg_logp - c) / (1 - ORPO_MAX_PROB)  # = lo(c) + (x - c) * lo'(c) where avg_logp > c
    return torch.where(avg_logp > c, tangent, exact)


def orpo_loss(policy_chosen_avg: Tensor, policy_rejected_avg: Tensor, nll_chosen: Tensor,
              lam: float) -> PreferenceLoss:
    """ORPO: L_SFT + λ·L_OR, L_OR = −log σ(log odds(y_w) − log odds(y_l)). Inputs (B,).

    ORPO (https://arxiv.org/abs/2403.07691); policy_*_avg are *average* token log-probs
    (the paper's P(y|x) is the geometric mean of the token probabilities), nll_chosen is
    the SFT loss of the chosen answer per example, usually −policy_chosen_avg itself (pass the same
    graph so both terms train the policy). No reference model. Rewards are the log odds, so the
    reward margin is the log odds ratio; extras: "nll", "or_loss" (L_OR, unweighted),
    "log_odds_ratio", all (B,).
    """
    _same_shape(policy_chosen_avg=policy_chosen_avg, policy_rejected_avg=policy_rejected_avg, nll_chosen=nll_chosen)
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam!r}")
    chosen_log_odds = log_odds(policy_chosen_avg)
    rejected_log_odds = log_odds(policy_rejected_avg)
    log_odds_ratio = chosen_log_odds - rejected_log_odds
    or_loss = -F.logsigmoid(log_odds_ratio)
    losses = nll_chosen + lam * or_loss
    extras = {"nll": nll_chosen.detach(), "or_loss": or_loss.detach(), "log_odds_ratio": log_odds_ratio.detach()}
    return PreferenceLoss(losses, chosen_log_odds.detach(), rejected_log_odds.detach(), extras)


# ---------------------------------------------------------------------------- unpaired: KTO


def kto_kl_estimate(policy_logps_mismatched: Tensor, ref_logps_mismatched: Tensor) -> Tensor:
    """KTO's reference point z0 = max(0, mean_i (log π(y'_i|x_i) − log π_ref(y'_i|x_i))), detached.

    Inputs (M,): sequence log-probs of mismatched pairs — prompt x_i with the completion y'_i of
    another example of the batch (e.g. completions shifted by one) — so the mean estimates
    KL(π‖π_ref) over the batch, as the KTO paper does. Returns a scalar; 0 for an empty batch. With several
    devices, average over the global batch before `kto_loss`.
    """
    _same_shape(policy_logps_mismatched=policy_logps_mismatched, ref_logps_mismatched=ref_logps_mismatched)
    diff = (policy_logps_mismatched - ref_logps_mismatched).detach()
    if diff.numel() == 0:
        return diff.new_zeros(())
    return diff.mean().clamp(min=0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, kl_ref: Tensor, beta: float,
             lambda_d: float = 1.0, lambda_u: float = 1.0) -> PreferenceLoss:
    """KTO: λ_y − v(x, y) per example, with r = log π(y|x) − log π_ref(y|x) and z0 = max(0, kl_ref):

        desirable:   λ_D · (1 − σ(β·(r − z0)))
        undesirable: λ_U · (1 − σ(β·(z0 − r)))

    KTO (https://arxiv.org/abs/2402.01306). policy_logps, ref_logps: (B,) summed sequence
    log-probs of unpaired examples; desirable: (B,) bool; kl_ref: () from `kto_kl_estimate`,
    clamped at 0 and detached here too (the paper passes no gradient through z0). The paper
    advises λ_D·n_D / (λ_U·n_U) in [1, 4/3] for n_D desirable and n_U undesirable examples.
    Returns paired=False, chosen_rewards = β·r of the desirable examples (D,), rejected_rewards
    = β·r of the undesirable ones (U,), extras {"kl_ref": z0}.
    """
    _same_shape(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    _positive("beta", beta)
    desirable = desirable.bool()
    z0 = kl_ref.detach().clamp(min=0).to(policy_logps.dtype)
    r = policy_logps - ref_logps.detach()  # (B,)
    losses = torch.where(desirable, lambda_d * (1 - torch.sigmoid(beta * (r - z0))),
                         lambda_u * (1 - torch.sigmoid(beta * (z0 - r))))
    rewards = (beta * r).detach()
    return PreferenceLoss(losses, rewards[desirable], rewards[~desirable], {"kl_ref": z0}, paired=False)


# ---------------------------------------------------------------------------- registry


class LossSpec(NamedTuple):
    """A row of LOSSES.

    fn: the loss; inputs: names of the tensors it takes positionally, in order (keys of the
    `inputs` mapping of `preference_loss`); params: its hyperparameters, by keyword; average:
    whether the paper reduces token log-probs by mean (True) or sum (False) — pass it to
    `sequence_logprobs`.
    """

    fn: Callable[..., PreferenceLoss]
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    average: bool


_PAIR_WITH_REF = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")
LOSSES: dict[str, LossSpec] = {
    "dpo": LossSpec(dpo_loss, _PAIR_WITH_REF, ("beta",), average=False),
    "cdpo": LossSpec(cdpo_loss, _PAIR_WITH_REF, ("beta", "label_smoothing"), average=False),
    "ipo": LossSpec(ipo_loss, _PAIR_WITH_REF, ("beta",), average=True),
    "simpo": LossSpec(simpo_loss, ("policy_chosen", "policy_rejected"), ("beta", "gamma"), average=True),
    "kto": LossSpec(kto_loss, ("policy", "ref", "desirable", "kl_ref"), ("beta", "lambda_d", "lambda_u"),
                    average=False),
    "orpo": LossSpec(orpo_loss, ("policy_chosen", "policy_rejected", "nll_chosen"), ("lam",), average=True),
}
NEEDS_REFERENCE: frozenset[str] = frozenset(k for k, s in LOSSES.items() if any(n.startswith("ref") for n in s.inputs))
PAIRED: frozenset[str] = frozenset(k for k, s in LOSSES.items() if "policy_chosen" in s.inputs)


def preference_loss(kind: str, inputs: Mapping[str, Tensor], **params: float) -> PreferenceLoss:
    """Look up `kind` in LOSSES and call it with the inputs it names (extra inputs are ignored).

    inputs: paired kinds read "policy_chosen", "policy_rejected" (B,) and, as their spec says,
    "ref_chosen", "ref_rejected", "nll_chosen" (B,); "kto" reads "policy", "ref", "desirable"
    (B,) and "kl_ref" (). Each log-prob reduced as `LOSSES[kind].average` says (or deliberately
    not). params: hyperparameters named in `LOSSES[kind].params`; the others keep their defaults.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; expected one of {sorted(LOSSES)}")
    spec = LOSSES[kind]
    missing = [n for n in spec.inputs if n not in inputs]
    if missing:
        raise ValueError(f"preference loss {kind!r} needs inputs {missing}; got {sorted(inputs)}")
    unknown = sorted(set(params) - set(spec.params))
    if unknown:
        raise ValueError(f"preference loss {kind!r} takes no {unknown}; its parameters are {list(spec.params)}")
    return spec.fn(*(inputs[n] for n in spec.inputs), **params)


# ---------------------------------------------------------------------------- metrics


def reward_metrics(outs: Iterable[PreferenceLoss]) -> dict[str, float]:
    """Reward metrics over the outputs of one step's micro-batches (all of one kind).

    "rewards/chosen" and "rewards/rejected" (means), "rewards/margin" (their difference; for
    paired losses the mean per-pair margin) and, for paired losses only, "rewards/accuracy" (share
    of pairs with chosen > rejected; ties count as wrong). A side with no examples (KTO batch
    without undesirable ones) is left out rather than logged as NaN or 0.
    """
    outs = list(outs)
    if not outs:
        return {}
    chosen = torch.cat([o.chosen_rewards.reshape(-1) for o in outs]).double()
    rejected = torch.cat([o.rejected_rewards.reshape(-1) for o in outs]).double()
    metrics: dict[str, float] = {}
    if chosen.numel():
        metrics["rewards/chosen"] = float(chosen.mean())
    if rejected.numel():
        metrics["rewards/rejected"] = float(rejected.mean())
    if chosen.numel() and rejected.numel():
        metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    if all(o.paired for o in outs) and chosen.numel():
        metrics["rewards/accuracy"] = float((chosen > rejected).double().mean())
    return metrics
