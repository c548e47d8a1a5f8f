"""RL math (stages/math/rl.py) against hand-worked numbers: advantages, clipped losses and their
gradients, aggregation, KL estimators (exact and Monte Carlo), entropy."""

import math

import pytest
import torch
from torch.testing import assert_close

from schemas.configs import GRPOConfig
from stages.math import rl

LN2 = math.log(2.0)


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss.sum(), x)
    return g


def _logp(ratios, old=0.0):
    """logp such that exp(logp - old) = ratios, as a leaf that requires grad; plus old_logp."""
    r = torch.tensor(ratios, dtype=torch.float64)
    old_logp = torch.full_like(r, old)
    return (old_logp + r.log()).requires_grad_(), old_logp


# ---------------------------------------------------------------------------- advantages


def test_grpo_population_std_worked_example():
    """rewards (1, 1, 1, 0): mean 0.75, deviations (.25, .25, .25, -.75);
    population var = (3 * .0625 + .5625) / 4 = .1875, std = .4330;
    A = .25 / .4330 = +0.577 (= 1/sqrt 3), -.75 / .4330 = -1.732 (= -sqrt 3)."""
    adv = rl.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), kind="grpo", std="population")
    assert_close(adv, torch.tensor([[0.577, 0.577, 0.577, -1.732]]), atol=1e-3, rtol=0)


def test_zero_one_group_rloo_sample_std_and_dr_grpo():
    """rewards (0, 0, 1, 0): mean .25, deviations (-.25, -.25, .75, -.25).
    - Dr. GRPO is the deviations themselves: (-0.25, -0.25, 0.75, -0.25).
    - RLOO: a 0 sees others (0, 1, 0) with mean 1/3 → -1/3; the 1 sees (0, 0, 0) → 1.
      Same as G/(G-1) * deviation = 4/3 * (-.25, .75) = (-1/3, 1).
    - GRPO, sample std: sum of squares .75 / (G-1 = 3) = .25, std .5 → (-0.5, -0.5, 1.5, -0.5)
      (eps 1e-4 moves 1.5 to 1.4997, inside atol)."""
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert_close(rl.group_advantages(r, kind="dr_grpo"), torch.tensor([[-0.25, -0.25, 0.75, -0.25]]))
    assert_close(rl.group_advantages(r, kind="rloo"), torch.tensor([[-1 / 3, -1 / 3, 1.0, -1 / 3]]))
    assert_close(rl.group_advantages(r, kind="grpo", std="sample"), torch.tensor([[-0.5, -0.5, 1.5, -0.5]]),
                 atol=1e-3, rtol=0)
    # with eps = 0 the sample-std numbers are exact
    assert_close(rl.group_advantages(r, kind="grpo", std="sample", eps=0.0), torch.tensor([[-0.5, -0.5, 1.5, -0.5]]))


def test_rloo_is_reward_minus_mean_of_the_others():
    torch.manual_seed(0)
    r = torch.rand(3, 5, dtype=torch.float64)
    expected = torch.stack([
        torch.stack([r[b, i] - torch.cat([r[b, :i], r[b, i + 1:]]).mean() for i in range(5)]) for b in range(3)
    ])
    assert_close(rl.group_advantages(r, kind="rloo"), expected)


def test_batch_kind_scales_group_deviations_by_the_batch_std():
    """Groups (1,1,1,0) and (0,0,1,0): the 8 rewards have mean .5 and population std .5.
    Baselines stay per group (.75 and .25), so A = deviation / .5:
    (.5, .5, .5, -1.5) and (-.5, -.5, 1.5, -.5)."""
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    expected = torch.tensor([[0.5, 0.5, 0.5, -1.5], [-0.5, -0.5, 1.5, -0.5]])
    assert_close(rl.group_advantages(r, kind="batch"), expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", sorted(rl.ADVANTAGES))
@pytest.mark.parametrize("std", ["population", "sample"])
@pytest.mark.parametrize("rewards", [
    [[1.0, 1.0, 1.0, 1.0]],
    [[0.0, 0.0, 0.0]],
    [[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]],  # 0.1 * 3 / 3 is not exactly 0.1 in floating point
    [[0.3]],  # G = 1: sample std and the leave-one-out baseline are undefined
])
def test_equal_rewards_give_exact_zero_and_no_nan(kind, std, rewards):
    for eps in (1e-4, 0.0):
        adv = rl.group_advantages(torch.tensor(rewards), kind=kind, std=std, eps=eps)
        assert not torch.isnan(adv).any()
        assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_several_groups_are_handled_per_group(kind):
    """Stacking groups changes nothing: each row equals the row alone, and the constant group is 0."""
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [3.0, -1.0, 0.5, 0.0]])
    adv = rl.group_advantages(r, kind=kind)
    for b in range(r.shape[0]):
        assert_close(adv[b:b + 1], rl.group_advantages(r[b:b + 1], kind=kind))
    assert torch.equal(adv[2], torch.zeros(4))
    assert_close(adv[1], torch.tensor({"grpo": [-0.577, -0.577, 1.732, -0.577],
                                       "dr_grpo": [-0.25, -0.25, 0.75, -0.25],
                                       "rloo": [-1 / 3, -1 / 3, 1.0, -1 / 3]}[kind]), atol=1e-3, rtol=0)


def test_batch_kind_zeroes_a_constant_group_among_others():
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    adv = rl.group_advantages(r, kind="batch")
    assert torch.equal(adv[1], torch.zeros(4))
    assert_close(adv.sum(dim=-1), torch.zeros(2), atol=1e-6, rtol=0)


def test_unknown_advantage_kind_or_std_raises_listing_choices():
    with pytest.raises(ValueError, match="dr_grpo.*grpo.*rloo"):
        rl.group_advantages(torch.zeros(1, 4), kind="ppo")
    with pytest.raises(ValueError, match="population"):
        rl.group_advantages(torch.zeros(1, 4), std="biased")


def test_step_advantages_hand_computed():
    """Row 0: T = 7, steps end at tokens 1 and 4 (r = .5, -1); a third step slot is absent (-1,
    its reward 7 must be ignored). Tokens 0-1 lie before both ends: .5 + -1 = -.5; tokens 2-4
    only before the second: -1; token 5 is after every step: 0; token 6 is masked: 0.
    Row 1: one step ending at 2 (r = 2) and one at 6 (r = .25): tokens 0-2 → 2.25, 3-6 → .25;
    mask keeps tokens 0-5."""
    step_rewards = torch.tensor([[0.5, -1.0, 7.0], [2.0, 0.25, 0.0]])
    step_ends = torch.tensor([[1, 4, -1], [2, 6, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]])
    expected = torch.tensor([[-0.5, -0.5, -1.0, -1.0, -1.0, 0.0, 0.0],
                             [2.25, 2.25, 2.25, 0.25, 0.25, 0.25, 0.0]])
    assert_close(rl.step_advantages(step_rewards, step_ends, mask), expected)


# ---------------------------------------------------------------------------- PPO token loss


def test_token_clipping_values_gradients_and_stats():
    """eps = .2 both sides; old_logp = 0 so ratio = exp(logp). Per token (ratio, A):
    0 (1.5,  1): clipped high, loss -1.2 * 1 = -1.2, grad 0
    1 (0.5, -1): clipped low, -min(-.5, -.8) = .8, grad 0
    2 (1.5, -1): unclipped side, -min(-1.5, -1.2) = 1.5, grad -A*ratio = 1.5
    3 (0.5,  1): unclipped side, -min(.5, .8) = -.5, grad -.5
    4 (1.1,  2): inside the range, loss -2.2, grad -2.2
    5 (3.0,  1): masked → loss 0, grad 0, not counted in the stats.
    Stats over the 5 masked tokens: clip_high 1/5, clip_low 1/5,
    ratio_mean (1.5 + .5 + 1.5 + .5 + 1.1) / 5 = 1.02."""
    logp, old = _logp([[1.5, 0.5, 1.5, 0.5, 1.1, 3.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, stats = rl.policy_loss(logp, old, adv, mask, kind="token", eps_low=0.2, eps_high=0.2)
    assert_close(loss.detach(), torch.tensor([[-1.2, 0.8, 1.5, -0.5, -2.2, 0.0]], dtype=torch.float64))
    assert_close(_grad(loss, logp), torch.tensor([[0.0, 0.0, 1.5, -0.5, -2.2, 0.0]], dtype=torch.float64))
    assert_close(stats["clip_high"], torch.tensor(0.2, dtype=torch.float64))
    assert_close(stats["clip_low"], torch.tensor(0.2, dtype=torch.float64))
    assert_close(stats["ratio_mean"], torch.tensor(1.02, dtype=torch.float64))
    assert not any(v.requires_grad for v in stats.values())


def test_on_policy_gradient_is_minus_advantage():
    """logp == old_logp → ratio 1, nothing clipped, loss -A and d loss / d logp = -A."""
    logp = torch.tensor([[-0.3, -2.0, -1.0]], requires_grad=True)
    adv = torch.tensor([0.7])
    loss, stats = rl.policy_loss(logp, logp.detach(), adv, torch.ones(1, 3))
    assert_close(loss.detach(), torch.full((1, 3), -0.7))
    assert_close(_grad(loss, logp), torch.full((1, 3), -0.7))
    assert stats["clip_low"] == 0 and stats["clip_high"] == 0 and stats["ratio_mean"] == 1


def test_clip_higher_asymmetric():
    """eps_low .2. Tokens (ratio, A): (1.25, 1), (1.3, 1), (0.7, -1).
    eps_high .2:  losses (-1.2, -1.2, .8), grads (0, 0, 0), clip_high 2/3, clip_low 1/3.
    eps_high .28 (DAPO): 1.25 < 1.28 is no longer clipped → loss -1.25, grad -1.25;
    1.3 still clipped at 1.28 → loss -1.28, grad 0; clip_high 1/3, clip_low 1/3."""
    mask = torch.ones(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    for eps_high, losses, grads, high in [
        (0.2, [-1.2, -1.2, 0.8], [0.0, 0.0, 0.0], 2 / 3),
        (0.28, [-1.25, -1.28, 0.8], [-1.25, 0.0, 0.0], 1 / 3),
    ]:
        logp, old = _logp([[1.25, 1.3, 0.7]])
        loss, stats = rl.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=eps_high)
        assert_close(loss.detach(), torch.tensor([losses], dtype=torch.float64))
        assert_close(_grad(loss, logp), torch.tensor([grads], dtype=torch.float64))
        assert_close(stats["clip_high"], torch.tensor(high, dtype=torch.float64))
        assert_close(stats["clip_low"], torch.tensor(1 / 3, dtype=torch.float64))


def test_sequence_advantages_broadcast_over_tokens():
    torch.manual_seed(0)
    logp, old = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([1.5, -0.5])
    for kind in rl.POLICY_LOSSES:
        a, sa = rl.policy_loss(logp, old, adv, mask, kind=kind)
        b, sb = rl.policy_loss(logp, old, adv[:, None].expand(2, 4), mask, kind=kind)
        assert_close(a, b)
        assert sa == sb


@pytest.mark.parametrize("kind", sorted(rl.POLICY_LOSSES))
def test_padding_with_minus_inf_logps_gives_no_nan(kind):
    logp = torch.tensor([[-0.5, -1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.6, -0.9, float("-inf")]])
    loss, stats = rl.policy_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), kind=kind)
    assert torch.isfinite(loss).all() and loss[0, 2] == 0
    g = _grad(loss, logp)
    assert torch.isfinite(g).all() and g[0, 2] == 0
    assert all(torch.isfinite(v) for v in stats.values())


def test_unknown_policy_loss_raises():
    with pytest.raises(ValueError, match="cispo.*gspo.*token"):
        rl.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), kind="ppo2")


# ---------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_is_geometric_mean_and_clips_per_sequence():
    """Row 0: token ratios (1.2, .9, 1.0) + a masked token with ratio e^5 that must not count.
    s = (1.2 * .9 * 1.0)^(1/3) = 1.08^(1/3) = 1.025986, inside [.8, 1.2]; A = +1 →
    every valid token has loss -s and gradient -A*s = -1.025986 (GSPO-token: d s_t/d logp_t = s).
    Row 1: ratios (2, 1.5, 1.8) + masked 1.0: s = 5.4^(1/3) = 1.754411 > 1.2 with A = +1 →
    clipped: loss -1.2 on every token, gradient 0.
    Stats over 6 masked tokens: clip_high 3/6, clip_low 0, ratio_mean (3*1.025986 + 3*1.754411)/6."""
    logp, old = _logp([[1.2, 0.9, 1.0, math.exp(5.0)], [2.0, 1.5, 1.8, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, stats = rl.policy_loss(logp, old, adv, mask, kind="gspo")
    ratios = torch.tensor([[1.2, 0.9, 1.0], [2.0, 1.5, 1.8]], dtype=torch.float64)
    geo = ratios.prod(dim=-1) ** (1 / 3)
    assert_close(geo, torch.tensor([1.025986, 1.754411], dtype=torch.float64), atol=1e-6, rtol=0)
    assert_close(-loss[0, :3].detach(), geo[0].expand(3))  # s used on each token is the geometric mean
    assert_close(loss[1].detach(), torch.tensor([-1.2, -1.2, -1.2, 0.0], dtype=torch.float64))
    g = _grad(loss, logp)
    assert_close(g[0], torch.cat([-geo[0].expand(3), torch.zeros(1, dtype=torch.float64)]))
    assert torch.equal(g[1], torch.zeros(4, dtype=torch.float64))
    assert_close(stats["clip_high"], torch.tensor(0.5, dtype=torch.float64))
    assert stats["clip_low"] == 0
    assert_close(stats["ratio_mean"], (3 * geo[0] + 3 * geo[1]) / 6)


def test_gspo_negative_advantage_on_high_ratio_keeps_gradient():
    """s = 1.754411 > 1.2 but A = -1: the clip does not bind, gradient -A*s = +1.754411 per token."""
    logp, old = _logp([[2.0, 1.5, 1.8]])
    loss, stats = rl.policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 3), kind="gspo")
    assert_close(_grad(loss, logp), torch.full((1, 3), 5.4 ** (1 / 3), dtype=torch.float64))
    assert stats["clip_high"] == 0


def test_gspo_token_with_seq_mean_matches_sequence_level_gspo_gradient():
    """Unclipped, GSPO's objective is mean_i A_i * s_i(θ) with s_i = exp(mean_t (logp - old));
    GSPO-token aggregated with seq_mean must give the same gradient, -A_i s_i / (|y_i| B)."""
    torch.manual_seed(1)
    old = torch.randn(3, 5, dtype=torch.float64)
    logp = (old + 0.05 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = torch.tensor([0.8, -1.3, 0.4], dtype=torch.float64)
    loss, stats = rl.policy_loss(logp, old, adv, mask, kind="gspo", eps_low=0.5, eps_high=0.5)
    assert stats["clip_low"] == 0 and stats["clip_high"] == 0
    g_token = _grad(rl.aggregate(loss, mask, "seq_mean"), logp)
    m = mask.to(torch.float64)
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    g_seq = _grad(-(adv * s).mean(), logp)
    assert_close(g_token, g_seq)


# ---------------------------------------------------------------------------- CISPO


def test_cispo_gradient_flows_through_clipped_tokens():
    """old_logp = -1, tokens (ratio, A): (1.5, 1), (.5, -1), (1.1, 2) + one masked; eps .2 both sides
    (a lower bound asked for explicitly: CISPO has none by default).
    Clipped IS weights w = (1.2, .8, 1.1); d loss / d logp = -w * A = (-1.2, .8, -2.2), where
    PPO's token loss gives (0, 0, -2.2). loss = -w * A * logp with logp = -1 + ln ratio:
    -1.2 * (-1 + .405465) = .713442;  .8 * (-1 - .693147) = -1.354518;  -2.2 * (-1 + .095310) = 1.990318.
    Stats: clip_high 1/3, clip_low 1/3, ratio_mean (1.5 + .5 + 1.1) / 3."""
    logp, old = _logp([[1.5, 0.5, 1.1, 2.0]], old=-1.0)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = rl.policy_loss(logp, old, adv, mask, kind="cispo", eps_low=0.2)
    assert_close(_grad(loss, logp), torch.tensor([[-1.2, 0.8, -2.2, 0.0]], dtype=torch.float64))
    assert_close(loss.detach(), torch.tensor([[0.713442, -1.354518, 1.990318, 0.0]], dtype=torch.float64),
                 atol=1e-6, rtol=0)
    assert_close(stats["clip_high"], torch.tensor(1 / 3, dtype=torch.float64))
    assert_close(stats["clip_low"], torch.tensor(1 / 3, dtype=torch.float64))
    assert_close(stats["ratio_mean"], torch.tensor(3.1 / 3, dtype=torch.float64))
    logp2, old2 = _logp([[1.5, 0.5, 1.1, 2.0]], old=-1.0)
    ppo, _ = rl.policy_loss(logp2, old2, adv, mask, kind="token")
    assert_close(_grad(ppo, logp2), torch.tensor([[0.0, 0.0, -2.2, 0.0]], dtype=torch.float64))


def test_cispo_default_has_no_lower_bound():
    """MiniMax-M1 clips CISPO's IS weight from above only. old_logp = -1, tokens (ratio, A): (.5, 1),
    (.5, -1), (1.5, 1); eps_high .2, eps_low unset. w = (.5, .5, 1.2): the .5 ratios keep their weight
    (with eps_low .2 they would be lifted to .8). d loss / d logp = -w * A = (-.5, .5, -1.2);
    loss = -w * A * logp, logp = -1 + ln ratio: -.5 * (-1.693147) = .846574, .5 * (-1.693147) = -.846574,
    -1.2 * (-1 + .405465) = .713442. clip_low 0 (there is no lower clip), clip_high 1/3.
    The grpo config's default for cispo is the same: epsilon_low None, while token keeps 0.2."""
    logp, old = _logp([[0.5, 0.5, 1.5]], old=-1.0)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1]])
    loss, stats = rl.policy_loss(logp, old, adv, mask, kind="cispo", eps_high=0.2)
    assert_close(_grad(loss, logp), torch.tensor([[-0.5, 0.5, -1.2]], dtype=torch.float64))
    assert_close(loss.detach(), torch.tensor([[0.846574, -0.846574, 0.713442]], dtype=torch.float64),
                 atol=1e-6, rtol=0)
    assert float(stats["clip_low"]) == 0.0
    assert_close(stats["clip_high"], torch.tensor(1 / 3, dtype=torch.float64))
    logp2, old2 = _logp([[0.5, 0.5, 1.5]], old=-1.0)
    bounded, _ = rl.policy_loss(logp2, old2, adv, mask, kind="cispo", eps_low=0.2, eps_high=0.2)
    assert_close(_grad(bounded, logp2), torch.tensor([[-0.8, 0.8, -1.2]], dtype=torch.float64))
    assert GRPOConfig(policy_loss="cispo").epsilon_low is None
    assert GRPOConfig(policy_loss="cispo", epsilon_low=0.2).epsilon_low == 0.2
    assert GRPOConfig().epsilon_low == 0.2 and GRPOConfig(policy_loss="gspo").epsilon_low == 0.2


# ---------------------------------------------------------------------------- aggregation


def test_aggregate_hand_computed_with_unequal_lengths_and_an_empty_row():
    """Losses (1, 2, 3 | pad), (4 | pad pad pad), and a fully masked row of 9s (must count as 0).
    seq_mean: row means (6/3 = 2, 4/1 = 4, 0) → (2 + 4 + 0) / 3 = 2.
    token_mean: (1+2+3+4) / 4 tokens = 2.5.
    constant, max_tokens 4: 10 / (B=3 * 4) = 0.8333."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    for kind, expected in [("seq_mean", 2.0), ("token_mean", 2.5), ("constant", 10 / 12)]:
        out = rl.aggregate(loss, mask, kind, max_tokens=4)
        assert_close(out.detach(), torch.tensor(expected))
        g = _grad(out, loss)
        assert torch.isfinite(g).all() and torch.equal(g[2], torch.zeros(4))


@pytest.mark.parametrize("kind", sorted(rl.AGGREGATIONS))
def test_aggregate_all_masked_gives_zero_not_nan(kind):
    out = rl.aggregate(torch.ones(2, 3), torch.zeros(2, 3), kind, max_tokens=3)
    assert torch.equal(out, torch.tensor(0.0))


def test_aggregate_errors():
    with pytest.raises(ValueError, match="max_tokens"):
        rl.aggregate(torch.ones(1, 2), torch.ones(1, 2), "constant")
    with pytest.raises(ValueError, match="constant.*seq_mean.*token_mean"):
        rl.aggregate(torch.ones(1, 2), torch.ones(1, 2), "sum")


# ---------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    """d = logp - ref_logp. p = .5, q = .25 → d = ln 2: k1 = .693147, k2 = (ln 2)^2 / 2 = .240227,
    k3 = q/p - ln(q/p) - 1 = .5 + ln 2 - 1 = .193147. Swapped (d = -ln 2): k1 = -.693147,
    k2 = .240227, k3 = 2 - ln 2 - 1 = .306853. Equal → all 0."""
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3], dtype=torch.float64))
    f64 = torch.float64
    assert_close(rl.kl_k1(logp, ref), torch.tensor([LN2, -LN2, 0.0], dtype=f64))
    assert_close(rl.kl_k2(logp, ref), torch.tensor([LN2**2 / 2, LN2**2 / 2, 0.0], dtype=f64))
    assert_close(rl.kl_k3(logp, ref), torch.tensor([LN2 - 0.5, 1 - LN2, 0.0], dtype=f64))
    assert rl.KL_ESTIMATORS == {"k1": rl.kl_k1, "k2": rl.kl_k2, "k3": rl.kl_k3}


def test_k3_is_nonnegative_and_zero_at_equality():
    torch.manual_seed(0)
    logp, ref = torch.randn(1000) * 3, torch.randn(1000) * 3
    assert (rl.kl_k3(logp, ref) >= 0).all()
    assert (rl.kl_k3(logp, logp) == 0).all()
    tiny = torch.tensor([1e-6, -1e-6])  # exp(d) - 1 - d would cancel to garbage here in float32
    assert (rl.kl_k3(tiny, torch.zeros(2)) >= 0).all()


# KL(p||q) by hand: (.5,.3,.2)||(.2,.3,.5): .5 ln 2.5 + .3 ln 1 + .2 ln .4 = .3 ln 2.5 = .274887;
# (.9,.1)||(.5,.5): .9 ln 1.8 + .1 ln .2 = .529008 - .160944 = .368064.
# E_p[k2] = E_p[(ln p/q)^2] / 2: .5 * .7 * (ln 2.5)^2 = .293856 and .5 * (.9 (ln 1.8)^2 + .1 (ln .2)^2) = .284988.
KL_CASES = [([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 0.274887, 0.293856), ([0.9, 0.1], [0.5, 0.5], 0.368064, 0.284986)]


@pytest.mark.parametrize(("p", "q", "kl", "k2_mean"), KL_CASES)
def test_k1_k3_unbiased_k2_biased_exact_expectation(p, q, kl, k2_mean):
    """Exact expectation over the support: sum_x p(x) k(x)."""
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    lp, lq = p.log(), q.log()
    assert_close((p * rl.kl_k1(lp, lq)).sum(), torch.tensor(kl, dtype=torch.float64), atol=1e-6, rtol=0)
    assert_close((p * rl.kl_k3(lp, lq)).sum(), torch.tensor(kl, dtype=torch.float64), atol=1e-6, rtol=0)
    assert_close((p * rl.kl_k2(lp, lq)).sum(), torch.tensor(k2_mean, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("p", "q", "kl", "k2_mean"), KL_CASES)
def test_k1_and_k3_monte_carlo_estimate_kl(p, q, kl, k2_mean):
    """200k samples from p (seed 0). Std of k1 per sample is ≤ .72, so the standard error is
    ≤ .0016 and a tolerance of .01 is > 6 SE; k2's bias (|.2939 - .2749| = .019, |.2850 - .3681| = .083)
    is larger than the tolerance, so the test tells an unbiased estimator from a biased one."""
    g = torch.Generator().manual_seed(0)
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, ref = p.log()[x], q.log()[x]
    assert abs(rl.kl_k1(logp, ref).mean().item() - kl) < 0.01
    assert abs(rl.kl_k3(logp, ref).mean().item() - kl) < 0.01
    assert abs(rl.kl_k2(logp, ref).mean().item() - kl) > 0.01


# ---------------------------------------------------------------------------- entropy


def test_entropy_uniform_is_ln_v_and_shapes():
    assert_close(rl.entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    # shifting logits changes nothing; huge logits stay finite
    assert_close(rl.entropy_from_logits(torch.full((5,), 1000.0)), torch.tensor(math.log(5)))


def test_entropy_hand_computed_and_near_one_hot():
    """logits (0, ln 3) → p = (.25, .75): H = .25 ln 4 + .75 ln(4/3) = .346574 + .215762 = .562335."""
    assert_close(rl.entropy_from_logits(torch.tensor([0.0, math.log(3.0)])), torch.tensor(0.562335),
                 atol=1e-6, rtol=0)
    assert rl.entropy_from_logits(torch.tensor([50.0, 0.0, 0.0, 0.0])).item() < 1e-6


def test_entropy_with_masked_vocabulary_and_low_precision():
    logits = torch.tensor([0.0, 0.0, float("-inf")], requires_grad=True)
    h = rl.entropy_from_logits(logits)
    assert_close(h.detach(), torch.tensor(LN2))
    assert torch.isfinite(_grad(h, logits)).all()
    hb = rl.entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16))
    assert hb.dtype == torch.float32
    assert_close(hb, torch.tensor(math.log(4.0)))


# ---------------------------------------------------------------------------- process supervision, TIS


def test_normalize_step_rewards_over_all_steps_of_the_group():
    """Present step rewards [1, 0, 0.5]: mean 0.5, population std sqrt(1/6) = 0.408248, so the
    normalised rewards are +1.224745, -1.224745, 0; the padding step stays 0."""
    r = torch.tensor([[1.0, 0.0], [0.5, 7.0]])
    present = torch.tensor([[True, True], [True, False]])
    assert_close(rl.normalize_step_rewards(r, present, eps=0.0),
                 torch.tensor([[1.224745, -1.224745], [0.0, 0.0]]), atol=1e-5, rtol=0)
    flat = rl.normalize_step_rewards(torch.full((2, 2), 0.3), present)
    assert torch.equal(flat, torch.zeros(2, 2))


def test_process_supervision_composes_normalise_then_accumulate():
    """Two outputs, two steps each; step rewards [[1, 0], [0, 0]] normalise (eps 0) to
    mean 0.25, std sqrt(3)/4 = 0.4330: [[1.7321, -0.5774], [-0.5774, -0.5774]]. Output 0's steps end
    at tokens 1 and 3, so tokens 0-1 get 1.7321 - 0.5774 = 1.1547 and tokens 2-3 get -0.5774."""
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    normed = rl.normalize_step_rewards(r, torch.ones(2, 2, dtype=torch.bool), eps=0.0)
    adv = rl.step_advantages(normed, torch.tensor([[1, 3], [0, 3]]), torch.ones(2, 4))
    assert_close(adv, torch.tensor([[1.1547, 1.1547, -0.5774, -0.5774], [-1.1547, -0.5774, -0.5774, -0.5774]]),
                 atol=1e-4, rtol=0)


def test_tis_weights_hand_computed():
    """trainer - sampler log-prob differences 0.2 and -1.0 (third token masked): weights e^0.2 = 1.221403
    and e^-1 = 0.367879; mean |delta| (logprob_drift) = (0.2 + 1.0) / 2 = 0.6; k3 KL(sampler||trainer) per token is
    e^d - 1 - d: 0.021403 and 0.367879, mean 0.194641; nothing reaches the cap 2."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-1.2, -1.0, float("-inf")]])
    mask = torch.tensor([[1, 1, 0]])
    w, stats = rl.tis_weights(trainer, sampler, mask, cap=2.0)
    assert_close(w, torch.tensor([[1.221403, 0.367879, 0.0]]), atol=1e-6, rtol=0)
    assert_close(rl.logprob_drift(trainer, sampler, mask)["mean"], torch.tensor(0.6, dtype=torch.float64), atol=1e-6,
                 rtol=0)
    assert_close(stats["mismatch_kl"], torch.tensor(0.194641), atol=1e-6, rtol=0)
    assert_close(stats["weight_mean"], torch.tensor(0.794641), atol=1e-6, rtol=0)
    assert float(stats["clipped"]) == 0.0


def test_tis_weights_truncate_at_the_cap_and_carry_no_gradient():
    trainer = torch.tensor([[0.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[-1.0, -1.0]])  # ratio e^1 = 2.718 > cap 2 on the first token, 1 on the second
    w, stats = rl.tis_weights(trainer, sampler, torch.ones(1, 2), cap=2.0)
    assert_close(w, torch.tensor([[2.0, 1.0]]))
    assert float(stats["clipped"]) == 0.5
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        rl.tis_weights(trainer, sampler, torch.ones(1, 2), cap=0.0)



def test_logprob_drift_hand_computed():
    """trainer - sampler on the five masked tokens: 0.25, -1.0, 0.0625, 0.0, 0.5 (binary fractions: exact), the
    masked-out 5.0 and -inf padding count for nothing. |delta| sorted: 0, 0.0625, 0.25, 0.5, 1.0; mean 1.8125 / 5
    = 0.3625; p99 at position 0.99 * 4 = 3.96: 0.5 + 0.96 * (1.0 - 0.5) = 0.98; max 1.0; above 0.1: 0.25, 0.5, 1.0,
    3 of 5 = 0.6; strictly above 0.25: 2 of 5 = 0.4."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.25, -2.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.25, -1.0, -0.5625, -3.0], [-0.75, -7.0, float("-inf"), float("-inf")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    d = rl.logprob_drift(trainer, sampler, mask)
    assert {k: float(v) for k, v in d.items()} == pytest.approx(
        {"mean": 0.3625, "p99": 0.98, "max": 1.0, "share_above": 0.6}, abs=1e-12)
    assert float(rl.logprob_drift(trainer, sampler, mask, threshold=0.25)["share_above"]) == pytest.approx(0.4)
    assert all(float(v) == 0.0 for v in rl.logprob_drift(trainer, sampler, torch.zeros(2, 4)).values())


def test_logprob_drift_p99_is_torch_quantile_and_a_sampler_inf_shows():
    """p99 is torch.quantile's linear interpolation on |delta| (random log-probs, a random mask). Tokens the sampler
    gave -inf show as inf, never nan: |delta| 0.5, inf, inf puts p99 between the two infs (position 1.98)."""
    g = torch.Generator().manual_seed(0)
    trainer, sampler = -torch.rand(6, 50, generator=g), -torch.rand(6, 50, generator=g)
    mask = torch.rand(6, 50, generator=g) > 0.3
    delta = (trainer.double() - sampler.double())[mask].abs()
    assert float(rl.logprob_drift(trainer, sampler, mask)["p99"]) == pytest.approx(float(delta.quantile(0.99)), abs=1e-12)
    d = rl.logprob_drift(torch.zeros(1, 3), torch.tensor([[-0.5, float("-inf"), float("-inf")]]), torch.ones(1, 3))
    assert [float(d[k]) for k in ("mean", "p99", "max")] == [float("inf")] * 3
    assert float(d["share_above"]) == 1.0

# ---------------------------------------------------------------------------- PPO with a critic (issue 32)


def test_gae_hand_worked_three_token_completion():
    """rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 1, lambda 0.95:
    delta_2 = 1 + 0 - 0.7 = 0.3                       A_2 = 0.3
    delta_1 = 0 + 0.7 - 0.6 = 0.1                     A_1 = 0.1 + 0.95 * 0.3   = 0.385
    delta_0 = 0 + 0.6 - 0.5 = 0.1                     A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    returns R = A + V = [0.96575, 0.985, 1.0]; a padded 4th position gets 0 and does not leak into A_2."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3, 0.0]]))
    assert_close(ret, torch.tensor([[0.96575, 0.985, 1.0, 0.0]]))


def test_gae_with_discount_and_rows_of_different_lengths():
    """gamma 0.9, lambda 0.5. Row 0 (2 tokens): r [1, 2], V [1, 1]: delta_1 = 2 - 1 = 1, A_1 = 1;
    delta_0 = 1 + 0.9 * 1 - 1 = 0.9, A_0 = 0.9 + 0.45 * 1 = 1.35. Row 1 (1 token): r [3], V [2]: A = 1.
    lambda 1 gives the discounted return minus V (Monte Carlo); lambda 0 the one-step TD error."""
    rewards = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    values = torch.tensor([[1.0, 1.0], [2.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert_close(adv, torch.tensor([[1.35, 1.0], [1.0, 0.0]]))
    mc, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert_close(mc[0, 0], torch.tensor(1 + 0.9 * 2 - 1.0))
    td, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=0.0)
    assert_close(td[0, 0], torch.tensor(0.9))


def test_kl_penalized_rewards_hand_worked():
    """score 1.0 on the last token, -beta * (logp - ref_logp) on every token (k1): logp [-1, -2, -0.5],
    ref [-1.5, -2, -1], beta 0.1: KL [0.5, 0, 0.5] -> rewards [-0.05, 0, -0.05 + 1] = [-0.05, 0, 0.95];
    the padded 4th token gets nothing, an empty row gets nothing."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0, -0.1], [-2.0, -2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    rewards, kl = rl.kl_penalized_rewards(torch.tensor([1.0, 4.0]), logp, ref, mask, beta=0.1)
    assert_close(rewards, torch.tensor([[-0.05, 0.0, 0.95, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert_close(kl, torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_whiten_over_valid_tokens_hand_worked():
    """Valid [2, 4, 6] (the padded 100 is ignored): mean 4, unbiased variance ((-2)^2 + 0 + 2^2) / 2 = 4, std 2
    -> [-1, 0, 1]; without the mean shift the mean is added back: [3, 4, 5]."""
    x = torch.tensor([[2.0, 4.0], [6.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert_close(rl.whiten(x, mask, eps=0.0), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
    assert_close(rl.whiten(x, mask, shift_mean=False, eps=0.0), torch.tensor([[3.0, 4.0], [5.0, 0.0]]))


def test_clipped_value_loss_hand_worked():
    """eps 0.2, R = 2. Token 0: V 1.5, V_old 1.0: (1.5 - 2)^2 = 0.25, clip(V) = 1.2, (1.2 - 2)^2 = 0.64:
    max 0.64 -> loss 0.32, clipped. Token 1: V 0.9, V_old 1.0 (inside the clip): 1.21 -> 0.605, not clipped.
    The gradient at token 0 is zero (the clipped term is constant in V there)."""
    values = torch.tensor([[1.5, 0.9, 4.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = rl.value_loss(values, old, returns, mask, clip_eps=0.2)
    assert_close(loss, torch.tensor([[0.32, 0.605, 0.0]]), rtol=0, atol=1e-6)
    assert_close(stats["value_clipfrac"], torch.tensor(0.5))
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[0.0, 0.9 - 2.0, 0.0]]))
    plain, _ = rl.value_loss(values, old, returns, mask, clip_eps=None)
    assert_close(plain, torch.tensor([[0.125, 0.605, 0.0]]), rtol=0, atol=1e-6)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert_close(rl.explained_variance(returns, returns, mask), torch.tensor(1.0))  # a perfect critic
    assert_close(rl.explained_variance(torch.full_like(returns, 2.0), returns, mask), torch.tensor(0.0))  # a constant
    # V = [3, 2, 1]: R - V = [-2, 0, 2], unbiased variance 4 against Var(R) = 1 -> 1 - 4 = -3
    assert_close(rl.explained_variance(torch.tensor([[3.0, 2.0, 1.0, 9.0]]), returns, mask), torch.tensor(-3.0))


def test_ppo_uses_grpos_clipped_surrogate_with_per_token_advantages():
    """One policy loss for both: per-token GAE advantages (B, T) go through the same `policy_loss`."""
    logp = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.5]])  # ratios 1 and e^0.5 = 1.65 (clipped at 1.2 with A > 0)
    adv = torch.tensor([[0.5, 2.0]])
    loss, stats = rl.policy_loss(logp, old, adv, torch.tensor([[1, 1]]), kind="token", eps_high=0.2)
    assert_close(loss, torch.tensor([[-0.5, -1.2 * 2.0]]))
    assert_close(stats["clip_high"], torch.tensor(0.5))


def test_step_statistics_sum_floats_and_device_tensors_in_float64():
    """rollouts.stat_sum: GRPO keeps a step's mini-batch statistics as 0-d tensors on their device (no host sync per
    mini-batch) and sums them once, in float64, with any plain floats: 0.1 + 0.2 (float32) + 0.3 = 0.6 to float32's
    rounding of 0.2 (5.9604645e-09 above it), and an empty list is 0."""
    import torch

    from stages.training.rollouts import stat_sum

    got = stat_sum([0.1, torch.tensor(0.2, dtype=torch.float32), torch.tensor(0.3, dtype=torch.float64)])
    assert got == pytest.approx(0.1 + float(torch.tensor(0.2, dtype=torch.float32)) + 0.3, abs=1e-15)
    assert abs(got - 0.6) < 1e-8 and stat_sum([]) == 0.0 and isinstance(got, float)
