"""Pure math of RL post-training: advantages, clipped policy losses, loss aggregation, KL, entropy.

Small functions, tensors in and out, no trainer state; `stages/grpo.py` composes them as
rollout → score → `group_advantages` → `policy_loss` (+ beta * KL) → `aggregate` → step. PPO with
a critic: `kl_penalized_rewards` → `gae` → `whiten` → the same `policy_loss`, plus `value_loss`.
Every variant lives in a registry (`ADVANTAGES`, `POLICY_LOSSES`, `AGGREGATIONS`,
`KL_ESTIMATORS`) picked by name from the config.

Shapes: B sequences (or B groups for rewards), G completions per group, T completion tokens,
S reasoning steps, V vocabulary. `mask` is (B, T), 1 on completion tokens that count, bool or 0/1
float.

Papers:
- GRPO / DeepSeekMath (outcome and process supervision, k3 KL): https://arxiv.org/abs/2402.03300
- Dr. GRPO (no std normalisation, constant normaliser): https://arxiv.org/abs/2503.20783
- RLOO (leave-one-out baseline), Ahmadian et al. 2024: https://arxiv.org/abs/2402.14740
- REINFORCE++ (batch-level scaling): https://arxiv.org/abs/2501.03262
- PPO clipped objective: https://arxiv.org/abs/1707.06347
- GAE: https://arxiv.org/abs/1506.02438; per-token KL-penalised rewards (InstructGPT):
  https://arxiv.org/abs/2203.02155
- DAPO (clip-higher, token-mean aggregation): https://arxiv.org/abs/2503.14476
- GSPO (sequence-level ratio, GSPO-token): https://arxiv.org/abs/2507.18071
- CISPO / MiniMax-M1 (clipped, stop-gradient IS weights): https://arxiv.org/abs/2506.13585
- KL estimators k1/k2/k3: John Schulman, http://joschu.net/blog/kl-approx.html
- Truncated importance sampling for sampler/trainer mismatch (Yao et al. 2025):
  https://fengyao.notion.site/off-policy-rl

Departures from the papers, on purpose:
- A group whose rewards are all equal gets advantage exactly 0 for every kind (the papers divide
  0 by eps or by 0); such groups carry no learning signal and must not produce NaN or noise.
- Padding positions (mask 0) are replaced by 0 log-ratio / 0 log-prob *before* any exp, so
  -inf or garbage log-probs there can't leak NaN into the loss or its gradient.
- "seq_mean" divides by B including fully masked sequences (which add 0), as TRL does, so the
  normaliser depends only on the batch shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from schemas.configs import DEFAULT_EPSILON_LOW

# ---------------------------------------------------------------------------- advantages


def _centered(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """r - mean over each group, and which groups are constant.

    rewards: (B, G) → centered (B, G), constant (B, 1) bool. Constant groups are set to exactly 0
    (a float mean of equal values can be off by one ulp, which / (0 + eps) would amplify).
    """
    constant = (rewards == rewards[:, :1]).all(dim=-1, keepdim=True)
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centered), centered), constant


def grpo_advantages(rewards: Tensor, unbiased: bool = False, eps: float = 1e-4) -> Tensor:
    """(r - mean_g) / (std_g + eps) per group (DeepSeekMath §4.1.2 outcome supervision). (B, G) → (B, G)."""
    centered, constant = _centered(rewards)
    if unbiased and rewards.shape[-1] < 2:  # sample std of one number is NaN; centered is 0 anyway
        return centered
    scaled = centered / (rewards.std(dim=-1, keepdim=True, correction=int(unbiased)) + eps)
    return torch.where(constant, torch.zeros_like(scaled), scaled)  # 0 / 0 when eps = 0


def dr_grpo_advantages(rewards: Tensor, unbiased: bool = False, eps: float = 1e-4) -> Tensor:
    """r - mean_g (Dr. GRPO: dividing by the std up-weights easy and hard prompts). (B, G) → (B, G).

    `unbiased` and `eps` are unused; they keep the registry's signature uniform.
    """
    return _centered(rewards)[0]


def rloo_advantages(rewards: Tensor, unbiased: bool = False, eps: float = 1e-4) -> Tensor:
    """r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g) (RLOO). (B, G) → (B, G).

    The leave-one-out baseline is undefined for G = 1; such a group has no peer and gets 0.
    """
    g = rewards.shape[-1]
    return _centered(rewards)[0] * (g / max(g - 1, 1))


def batch_advantages(rewards: Tensor, unbiased: bool = False, eps: float = 1e-4) -> Tensor:
    """(r - mean_g) / (std of all B*G rewards + eps) (REINFORCE++-style batch scaling). (B, G) → (B, G).

    The baseline stays per group; only the scale is shared, so a group with low variance is not
    blown up to unit scale as in "grpo".
    """
    centered, constant = _centered(rewards)
    if unbiased and rewards.numel() < 2:  # sample std of one number is NaN; centered is 0 anyway
        return centered
    scaled = centered / (rewards.std(correction=int(unbiased)) + eps)
    return torch.where(constant, torch.zeros_like(scaled), scaled)  # 0 / 0 when eps = 0


AdvantageFn = Callable[..., Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "batch": batch_advantages,
}
_STD = {"population": False, "sample": True}


def group_advantages(rewards: Tensor, kind: str = "grpo", std: str = "population", eps: float = 1e-4) -> Tensor:
    """Per-completion advantages from rewards of B groups of G completions of the same prompt.

    rewards: (B, G) float → (B, G). kind: one of ADVANTAGES; std: "population" (divide by G) or
    "sample" (divide by G-1), used by "grpo" and "batch". A group of equal rewards gives 0.
    """
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage kind {kind!r}; expected one of {sorted(ADVANTAGES)}")
    if std not in _STD:
        raise ValueError(f"unknown std {std!r}; expected one of {sorted(_STD)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, G), got shape {tuple(rewards.shape)}")
    return ADVANTAGES[kind](rewards, unbiased=_STD[std], eps=eps)


def step_advantages(step_rewards: Tensor, step_ends: Tensor, token_mask: Tensor) -> Tensor:
    """Process supervision: token t gets the sum of the rewards of every step ending at or after t.

    DeepSeekMath §4.1.3: A_t = sum_{index(j) >= t} r_j, with r already normalised over the group.
    step_rewards: (B, S) float; step_ends: (B, S) long, inclusive token index where step s ends,
    -1 for absent steps (padding); token_mask: (B, T). Returns (B, T), zero where the mask is 0
    and on tokens after the last step.
    """
    if step_rewards.shape != step_ends.shape:
        raise ValueError(f"step_rewards {tuple(step_rewards.shape)} and step_ends {tuple(step_ends.shape)} differ")
    t = torch.arange(token_mask.shape[-1], device=step_ends.device)  # (T,)
    # covers[b, s, t]: step s is present and ends at or after token t
    covers = (step_ends[:, :, None] >= t) & (step_ends[:, :, None] >= 0)  # (B, S, T)
    adv = (step_rewards[:, :, None] * covers.to(step_rewards.dtype)).sum(dim=1)  # (B, T)
    return adv * token_mask.to(adv.dtype)


def normalize_step_rewards(step_rewards: Tensor, present: Tensor, eps: float = 1e-4) -> Tensor:
    """Process supervision's normalisation: (r - mean) / (std + eps) over every present step of the group.

    DeepSeekMath §4.1.3 normalises all step rewards of the G outputs of one prompt together.
    step_rewards, present: (G, S) for one group (present: bool, False for padding steps).
    Returns (G, S), 0 on absent steps; a group whose present rewards are all equal gives 0.
    """
    present = present.bool()
    vals = step_rewards[present]
    if vals.numel() == 0 or bool((vals == vals[0]).all()):
        return torch.zeros_like(step_rewards)
    normed = (step_rewards - vals.mean()) / (vals.std(correction=0) + eps)
    return torch.where(present, normed, torch.zeros_like(normed))


# ---------------------------------------------------------------------------- policy losses


class Surrogate(NamedTuple):
    """What a policy-loss variant returns; `policy_loss` turns the last three into stats.

    loss: (B, T) per-token loss, not yet masked; ratio: (B, T) the ratio the objective used
    (the sequence ratio broadcast over tokens for GSPO); clipped_low / clipped_high: (B, T) bool,
    where the clip changed the objective.
    """

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


def _ppo_clip(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Surrogate:
    """-min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A). All (B, T).

    The clip binds (zero gradient) only when it lowers the objective: ratio > 1+eps_high with
    A > 0, or ratio < 1-eps_low with A < 0. The other side keeps its gradient -A*ratio.
    """
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    r = ratio.detach()
    return Surrogate(loss, r, (r < 1 - eps_low) & (advantages < 0), (r > 1 + eps_high) & (advantages > 0))


def token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
               eps_low: float, eps_high: float) -> Surrogate:
    """PPO/GRPO per-token clipped objective; DAPO clip-higher when eps_high > eps_low. All (B, T)."""
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    return _ppo_clip(torch.exp(log_ratio), advantages, eps_low, eps_high)


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
              eps_low: float, eps_high: float) -> Surrogate:
    """GSPO-token: s = exp(mean_t (logp - old_logp)) per sequence, clipped per sequence. All (B, T).

    s_token = sg(s) * exp(logp - sg(logp)) has the value of s on every token and
    d s_token / d logp_t = s, so with "seq_mean" aggregation the gradient is exactly GSPO's
    s * A * (1/|y|) * sum_t grad logp_t. GSPO's paper uses eps around 3e-4 / 4e-4, far below PPO's.
    """
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(log_ratio.sum(dim=-1, keepdim=True) / n).detach()  # (B, 1)
    safe_logp = torch.where(mask, logp, torch.zeros_like(logp))
    s_token = seq_ratio * torch.exp(safe_logp - safe_logp.detach())  # (B, T), value s
    return _ppo_clip(s_token, advantages, eps_low, eps_high)


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
               eps_low: float | None, eps_high: float) -> Surrogate:
    """CISPO: -sg(clip(ratio, 1-eps_low, 1+eps_high)) * A * logp. All (B, T).

    Unlike PPO no token is dropped from the gradient: d loss / d logp = -clip(ratio) * A. The
    weight is clipped whatever the sign of A, so the clip stats count every out-of-range token.
    MiniMax-M1 (https://arxiv.org/abs/2506.13585, eq. 4-5) clips the IS weight from above only:
    eps_low=None (CISPO's default, `DEFAULT_EPSILON_LOW`) sets no lower bound; a number restores one.
    """
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio).detach()
    low = None if eps_low is None else 1 - eps_low
    weight = ratio.clamp(min=low, max=1 + eps_high)
    safe_logp = torch.where(mask, logp, torch.zeros_like(logp))
    loss = -weight * advantages * safe_logp
    clipped_low = torch.zeros_like(ratio, dtype=torch.bool) if low is None else ratio < low
    return Surrogate(loss, ratio, clipped_low, ratio > 1 + eps_high)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, float | None, float], Surrogate]
POLICY_LOSSES: dict[str, PolicyLossFn] = {"token": token_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, kind: str = "token",
                eps_low: float | None = None, eps_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped policy-gradient loss and clipping stats.

    logp, old_logp, mask: (B, T); advantages: (B,) per sequence (broadcast over tokens) or (B, T).
    eps_low None is the kind's `DEFAULT_EPSILON_LOW` (0.2 for token and gspo; no lower bound for
    cispo, which alone accepts None).
    Returns loss (B, T), 0 where mask is 0 (reduce it with `aggregate`), and detached scalar stats:
    clip_low / clip_high, the fraction of masked tokens where the lower / upper clip changed the
    objective, and ratio_mean, the mean over masked tokens of the ratio the objective used.
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss kind {kind!r}; expected one of {sorted(POLICY_LOSSES)}")
    if eps_low is None:
        eps_low = DEFAULT_EPSILON_LOW[kind]
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.detach().to(logp.dtype).expand_as(logp)
    m = mask.bool()
    out = POLICY_LOSSES[kind](logp, old_logp.detach(), advantages, m, eps_low, eps_high)
    loss = torch.where(m, out.loss, torch.zeros_like(out.loss))
    mf = m.to(logp.dtype)
    n = mf.sum().clamp(min=1)
    stats = {
        "clip_low": (out.clipped_low.to(mf.dtype) * mf).sum() / n,
        "clip_high": (out.clipped_high.to(mf.dtype) * mf).sum() / n,
        "ratio_mean": (out.ratio * mf).sum() / n,
    }
    return loss, {k: v.detach() for k, v in stats.items()}


# ---------------------------------------------------------------------------- sampler/trainer mismatch


def tis_weights(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor,
                cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: w = min(pi_trainer / pi_sampler, cap) per token.

    When completions come from a sampler whose numerics differ from the trainer's (vLLM kernels,
    bf16 KV-cached decode), the samples are slightly off-policy for the trainer; multiplying each
    token's loss by w corrects that, and the cap bounds the variance (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training", TIS).
    trainer_logp, sampler_logp, mask: (B, T). Returns w (B, T) detached, 0 where mask is 0, and
    stats over masked tokens: mismatch_kl = k3 estimate of KL(sampler || trainer) on the sampler's
    tokens, weight_mean, clipped (fraction at the cap). How far the log-probs are apart: `logprob_drift`.
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    m = mask.bool()
    diff = torch.where(m, trainer_logp.detach() - sampler_logp.detach(), torch.zeros_like(trainer_logp))
    raw = torch.exp(diff)
    w = torch.where(m, raw.clamp(max=cap), torch.zeros_like(raw))
    mf = m.to(trainer_logp.dtype)
    n = mf.sum().clamp(min=1)
    stats = {
        "mismatch_kl": (kl_k3(torch.zeros_like(diff), diff) * mf).sum() / n,  # k3(p=sampler, q=trainer), shifted
        "weight_mean": (w * mf).sum() / n,
        "clipped": ((raw > cap).to(mf.dtype) * mf).sum() / n,
    }
    return w, stats


def logprob_drift(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor,
                  threshold: float = 0.1) -> dict[str, Tensor]:
    """How far the sampler's log-probs of its own tokens are from the trainer's recomputation of the same tokens.

    |delta| = |trainer - sampler| per masked token, in float64 (the difference of two fp32 numbers is then exact).
    Returns scalars: mean, p99, max of |delta|, and share_above, the fraction of masked tokens with |delta| >
    threshold (strictly). p99 is the linear interpolation between order statistics (numpy's and torch.quantile's
    default, Hyndman-Fan type 7): the sorted values at position 0.99 * (n - 1). trainer_logp, sampler_logp,
    mask: (B, T). A token the sampler gave -inf has |delta| inf. No masked token: every stat 0.
    """
    m = mask.bool()
    delta = (trainer_logp.detach().double() - sampler_logp.detach().double())[m].abs()  # (n,)
    n = delta.numel()
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return {"mean": zero, "p99": zero, "max": zero, "share_above": zero}
    ordered = delta.sort().values
    pos = 0.99 * (n - 1)
    lo = int(pos)  # torch.quantile refuses more than 2^24 values: a step can have more tokens
    hi, frac = min(lo + 1, n - 1), pos - lo
    # no interpolation where none is needed: with inf among the values it would give inf - inf or 0 * inf = nan
    p99 = ordered[lo] if frac == 0 or ordered[hi] == ordered[lo] else ordered[lo] + frac * (ordered[hi] - ordered[lo])
    return {"mean": delta.mean(), "p99": p99, "max": ordered[-1],
            "share_above": (delta > threshold).double().mean()}


# ---------------------------------------------------------------------------- aggregation


def seq_mean(per_token_loss: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Mean over each sequence's tokens, then over the B sequences (GRPO). (B, T) → ()."""
    per_seq = per_token_loss.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
    return per_seq.mean()


def token_mean(per_token_loss: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Sum over all tokens / number of tokens in the batch (DAPO: long answers weigh more). (B, T) → ()."""
    return per_token_loss.sum() / mask.sum().clamp(min=1)


def constant_norm(per_token_loss: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Sum / (B * max_tokens) (Dr. GRPO: no length-dependent normaliser). (B, T) → ()."""
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"aggregation 'constant' needs a positive max_tokens, got {max_tokens!r}")
    return per_token_loss.sum() / (per_token_loss.shape[0] * max_tokens)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "seq_mean": seq_mean,
    "token_mean": token_mean,
    "constant": constant_norm,
}


def minibatch_share(kind: str, rows: int, tokens: float, step_rows: float, step_tokens: float) -> float:
    """The weight of one mini-batch's `aggregate`d loss in its step's loss: accumulated over the step's
    mini-batches, the weighted losses (and gradients) equal the whole step's aggregated at once. token_mean
    divides by the batch's tokens, so a mini-batch weighs its share of the step's tokens; seq_mean and constant
    average over sequences, so it weighs its share of the step's sequences. rows, tokens: the mini-batch's
    sequences and completion tokens; step_rows, step_tokens: the step's (every process's)."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {kind!r}; expected one of {sorted(AGGREGATIONS)}")
    return tokens / step_tokens if kind == "token_mean" else rows / step_rows


def aggregate(per_token_loss: Tensor, mask: Tensor, kind: str = "seq_mean", max_tokens: int | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar; masked tokens count for nothing, empty rows add 0."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {kind!r}; expected one of {sorted(AGGREGATIONS)}")
    m = mask.bool()
    masked = torch.where(m, per_token_loss, torch.zeros_like(per_token_loss))
    return AGGREGATIONS[kind](masked, m.to(per_token_loss.dtype), max_tokens=max_tokens)


# ---------------------------------------------------------------------------- KL and entropy


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log p/q on samples from p: unbiased for KL(p||q), high variance, can be < 0. (B, T) → (B, T)."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log p/q)^2 / 2: biased, low variance, >= 0. (B, T) → (B, T)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = q/p - log(q/p) - 1: unbiased for KL(p||q) and >= 0 (GRPO's estimator). (B, T) → (B, T).

    expm1 keeps the small-difference case accurate (exp(d) - 1 - d cancels badly near d = 0).
    """
    d = ref_logp - logp
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. (..., V) → (...); fp16/bf16 are upcast to fp32.

    -inf logits (masked vocabulary) contribute 0 instead of 0 * -inf = NaN, in value and gradient.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * logp).sum(dim=-1)


# ---------------------------------------------------------------------------- PPO with a critic


def last_masked_index(mask: Tensor) -> Tensor:
    """(B,) index of each row's last masked-in token (0 for an empty row). mask (B, T)."""
    t = mask.shape[-1]
    return (t - 1 - mask.bool().flip(-1).to(torch.long).argmax(-1)).clamp(min=0)


def kl_penalized_rewards(scores: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float,
                         kl: str = "k1") -> tuple[Tensor, Tensor]:
    """InstructGPT's per-token rewards: -beta * KL_t on every completion token, plus the completion's score
    (reward model or verifier) on its last token. scores (B,); logp, ref_logp, mask (B, T).

    Returns (rewards, kl) both (B, T), 0 at padding; a row with no token gets nothing.
    """
    m = mask.bool()
    kl_t = torch.where(m, KL_ESTIMATORS[kl](logp.detach(), ref_logp.detach()), torch.zeros_like(logp))
    rewards = -beta * kl_t
    rows = torch.arange(mask.shape[0], device=mask.device)
    has = m.any(-1)
    score = scores.to(rewards.dtype)
    rewards[rows, last_masked_index(m)] += torch.where(has, score, torch.zeros_like(score))
    return rewards, kl_t


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438).

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 after a completion's last token (the episode
    ends) and at padding; A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t (the value
    targets). rewards, values, mask (B, T), the mask contiguous from the first completion token
    (right padding). Returns (advantages, returns), 0 at padding, no gradient.
    """
    m = mask.to(values.dtype)
    r, v = rewards.detach() * m, values.detach() * m
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv[:, t] = (delta + gamma * lam * next_adv) * m[:, t]
        next_value, next_adv = v[:, t], adv[:, t]  # 0 at padding: a padded position ends the episode
    return adv, (adv + v) * m


def masked_mean_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Mean and variance of x over the masked-in entries (Bessel's correction when unbiased and n > 1)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1 if unbiased else n).clamp(min=1)
    return mean, var


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked-in tokens of the whole batch (PPO's advantage whitening; unbiased
    variance, as TRL and OpenRLHF); shift_mean=False only rescales. 0 at padding."""
    mean, var = masked_mean_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_eps: float | None = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss per token: max((V - R)^2, (clip(V, V_old +- eps) - R)^2) / 2 (B, T), 0 at
    padding; clip_eps None is the plain squared error / 2. Stats: value_clipfrac, the share of tokens where the
    clipped term is the larger (the clip took the gradient away)."""
    returns, old_values = returns.detach(), old_values.detach()
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        loss, clipped_more = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_v = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_v - returns) ** 2
        loss, clipped_more = torch.maximum(unclipped, clipped), clipped.detach() > unclipped.detach()
    m = mask.bool()
    n = m.sum().clamp(min=1)
    stats = {"value_clipfrac": (clipped_more & m).sum() / n}
    return torch.where(m, 0.5 * loss, torch.zeros_like(loss)), {k: v.detach() for k, v in stats.items()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over masked-in tokens: 1 a perfect critic, 0 no better than a constant, < 0 worse."""
    _, var_r = masked_mean_var(returns.detach(), mask)
    _, var_d = masked_mean_var((returns - values).detach(), mask)
    return 1 - var_d / var_r.clamp(min=1e-12)


# ---------------------------------------------------------------------------- groups spread over processes


def sharded_group_advantages(rewards_by_rank: list[Tensor], rank: int, kind: str = "grpo", std: str = "population",
                             eps: float = 1e-4) -> Tensor:
    """Advantages of one rank's groups when a step's B groups are spread over processes.

    rewards_by_rank[r]: (B_r, G) rewards of the whole groups rank r rolled out (B_r may differ, or
    be 0, after dynamic sampling); a group never straddles ranks. Returns rank's rows of
    `group_advantages` of the concatenation (B, G), i.e. exactly the single-process advantages of
    the same rollouts: per-group kinds need only their own group, but "batch" scales by the std
    of all B*G rewards, so every rank computes on the gathered matrix.
    """
    if not 0 <= rank < len(rewards_by_rank):
        raise ValueError(f"rank {rank} outside the {len(rewards_by_rank)} gathered reward matrices")
    start = sum(r.shape[0] for r in rewards_by_rank[:rank])
    own = rewards_by_rank[rank].shape[0]
    if own == 0:
        return rewards_by_rank[rank].new_zeros(rewards_by_rank[rank].shape)
    full = torch.cat([r for r in rewards_by_rank if r.shape[0]])  # (B, G)
    return group_advantages(full, kind, std, eps)[start : start + own]
