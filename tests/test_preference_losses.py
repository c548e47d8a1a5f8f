"""Preference-loss math (stages/math/preference.py) against hand-worked numbers: sequence
log-probs with padding, DPO/cDPO/IPO/SimPO/KTO/ORPO values and gradient signs, the registry and
the reward metrics.

Notation: σ(x) = 1 / (1 + e^-x), and −log σ(x) = log(1 + e^-x)."""

import inspect
import math

import pytest
import torch
from torch.testing import assert_close

from stages.math import preference as pl

F64 = torch.float64


def _t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _leaf(*values) -> torch.Tensor:
    return _t(*values).requires_grad_()


def _grad(loss: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss.sum(), xs)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------- sequence log-probs


def test_sequence_logprobs_sum_and_mean_with_minus_inf_and_nan_padding():
    """Row 0: tokens (-1, -2) count, the third is -inf padding → sum -3, mean -1.5.
    Row 1: all three tokens (-0.5 each) count → sum -1.5, mean -0.5.
    Row 2: nothing counts (-inf, -inf and NaN garbage) → sum 0, mean 0 (not 0/0).
    d sum / d token = mask; d mean / d token = mask / n: row 0 (.5, .5, 0), row 1 (1/3, 1/3, 1/3)."""
    inf, nan = float("inf"), float("nan")
    logps = torch.tensor([[-1.0, -2.0, -inf], [-0.5, -0.5, -0.5], [-inf, -inf, nan]], dtype=F64,
                         requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    total = pl.sequence_logprobs(logps, mask)
    mean = pl.sequence_logprobs(logps, mask, average=True)
    assert_close(total.detach(), _t(-3.0, -1.5, 0.0))
    assert_close(mean.detach(), _t(-1.5, -0.5, 0.0))
    (g_sum,) = _grad(total, logps)
    (g_mean,) = _grad(mean, logps)
    assert_close(g_sum, mask.to(F64))
    assert_close(g_mean, torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 0.0]], dtype=F64))


def test_sequence_logprobs_bool_mask_and_bf16_is_summed_in_float32():
    """300 tokens of log-prob -0.3 sum to -90. In bf16 (8 mantissa bits) a running sum near -90
    has a spacing of 0.5 and -0.3 itself rounds to -0.30078; summing in float32 gives
    300 * -0.30078125 = -90.234375, the exact sum of the rounded inputs."""
    logps = torch.full((1, 300), -0.3, dtype=torch.bfloat16)
    out = pl.sequence_logprobs(logps, torch.ones(1, 300, dtype=torch.bool))
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([-90.234375]))


def test_sequence_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must both be"):
        pl.sequence_logprobs(torch.zeros(2, 3), torch.ones(2, 4))


# ---------------------------------------------------------------------------- DPO and cDPO


def test_dpo_worked_example():
    """β = 0.1, pc = -1, pr = -2, rc = rr = -1.5.
    Log-ratios: chosen -1 - (-1.5) = 0.5, rejected -2 - (-1.5) = -0.5; Δ = 0.5 - (-0.5) = 1.
    loss = -log σ(βΔ) = log(1 + e^-0.1) = log 1.904837 = 0.644397.
    rewards: β·0.5 = 0.05 and β·(-0.5) = -0.05.
    d loss / d pc = -β·σ(-βΔ) = -0.1 · 0.475021 = -0.0475021; d loss / d pr = +0.0475021."""
    pc, pr = _leaf(-1.0), _leaf(-2.0)
    out = pl.dpo_loss(pc, pr, _t(-1.5), _t(-1.5), beta=0.1)
    assert_close(out.losses.detach(), _t(0.6443966600735709))
    assert_close(out.chosen_rewards, _t(0.05))
    assert_close(out.rejected_rewards, _t(-0.05))
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    g_pc, g_pr = _grad(out.losses, pc, pr)
    assert_close(g_pc, _t(-0.047502081252106004))
    assert_close(g_pr, -g_pc)


def test_cdpo_worked_example_and_epsilon_zero_is_dpo():
    """Same pair, ε = 0.1: -(0.9)·log σ(0.1) - 0.1·log σ(-0.1).
    Since -log σ(-x) = -log σ(x) + x: loss = -log σ(0.1) + ε·0.1 = 0.644397 + 0.01 = 0.654397.
    d loss / d(βΔ) = σ(βΔ) - (1 - ε) = 0.524979 - 0.9 = -0.375021 → d / d pc = β·that = -0.0375021."""
    pc, pr = _leaf(-1.0), _leaf(-2.0)
    out = pl.cdpo_loss(pc, pr, _t(-1.5), _t(-1.5), beta=0.1, label_smoothing=0.1)
    assert_close(out.losses.detach(), _t(0.6543966600735709))
    g_pc, g_pr = _grad(out.losses, pc, pr)
    assert_close(g_pc, _t(0.1 * (_sig(0.1) - 0.9)))
    assert_close(g_pr, -g_pc)

    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=F64)  # rows: pc, pr, rc, rr of 8 pairs
    assert_close(pl.cdpo_loss(*x, beta=0.3, label_smoothing=0.0).losses, pl.dpo_loss(*x, beta=0.3).losses)


def test_dpo_gradient_vanishes_as_the_margin_grows_but_cdpo_turns_back():
    """DPO, β = 0.1: d loss / d pc = -β·σ(-βΔ). Δ = 1 → -0.0475; Δ = 100 → -0.1·σ(-10) = -4.54e-6:
    always negative, never zero, ever smaller. cDPO (ε = 0.1) has d / d(βΔ) = σ(βΔ) - 0.9, zero at
    βΔ* = log(0.9 / 0.1) = log 9 = 2.197 (Δ* = 21.97): negative below, positive above, so its
    loss is minimised at that finite margin."""
    rc = rr = _t(0.0)
    grads = {}
    for delta in (1.0, 100.0):
        pc = _leaf(delta)
        grads[delta] = _grad(pl.dpo_loss(pc, _t(0.0), rc, rr, beta=0.1).losses, pc)[0]
    assert_close(grads[100.0], _t(-4.53978687024344e-06))
    assert grads[1.0] < 0 and grads[100.0] < 0
    assert abs(grads[100.0]) < abs(grads[1.0]) / 1000

    delta_star = math.log(9.0) / 0.1
    signs = []
    for delta in (delta_star - 1, delta_star, delta_star + 1):
        pc = _leaf(delta)
        signs.append(float(_grad(pl.cdpo_loss(pc, _t(0.0), rc, rr, beta=0.1, label_smoothing=0.1).losses, pc)[0]))
    assert signs[0] < 0 < signs[2]
    assert abs(signs[1]) < 1e-12


def test_label_smoothing_outside_range_raises():
    x = _t(0.0)
    for eps in (-0.1, 0.5):
        with pytest.raises(ValueError, match="label_smoothing"):
            pl.dpo_loss(x, x, x, x, beta=0.1, label_smoothing=eps)


# ---------------------------------------------------------------------------- IPO


def test_ipo_worked_example_below_the_target():
    """β = 0.1 → target 1/(2β) = 5. Same pair as DPO: Δ = 1. loss = (1 - 5)² = 16.
    d loss / d pc = 2(Δ - 5) = -8 (raise the chosen), d / d pr = +8. Rewards as DPO: ±0.05."""
    pc, pr = _leaf(-1.0), _leaf(-2.0)
    out = pl.ipo_loss(pc, pr, _t(-1.5), _t(-1.5), beta=0.1)
    assert_close(out.losses.detach(), _t(16.0))
    assert_close(out.chosen_rewards, _t(0.05))
    assert_close(out.rejected_rewards, _t(-0.05))
    g_pc, g_pr = _grad(out.losses, pc, pr)
    assert_close(g_pc, _t(-8.0))
    assert_close(g_pr, _t(8.0))


def test_ipo_is_zero_at_the_target_and_pulls_toward_it_from_both_sides():
    """β = 0.5 → target 1. Δ = 1 exactly (pc -1, pr -2, refs -1.5): loss 0, gradient 0.
    Δ = 0.5: loss 0.25, d / d pc = 2(0.5 - 1) = -1 (raise Δ). Δ = 3: loss 4, d / d pc = +4 (lower Δ)."""
    for pc_value, loss, grad in [(-1.0, 0.0, 0.0), (-1.5, 0.25, -1.0), (1.0, 4.0, 4.0)]:
        pc, pr = _leaf(pc_value), _leaf(-2.0)
        out = pl.ipo_loss(pc, pr, _t(-1.5), _t(-1.5), beta=0.5)
        assert_close(out.losses.detach(), _t(loss))
        g_pc, g_pr = _grad(out.losses, pc, pr)
        assert_close(g_pc, _t(grad))
        assert_close(g_pr, -g_pc)


# ---------------------------------------------------------------------------- SimPO


def test_simpo_worked_example():
    """β = 2, γ = 0.5, average log-probs -0.5 (chosen) and -1 (rejected).
    Rewards β·avg: -1 and -2; logit = -1 - (-2) - 0.5 = 0.5; loss = log(1 + e^-0.5) = 0.474077.
    d loss / d pc_avg = -β·σ(-0.5) = -2 · 0.377541 = -0.755081; d / d pr_avg = +0.755081."""
    pc, pr = _leaf(-0.5), _leaf(-1.0)
    out = pl.simpo_loss(pc, pr, beta=2.0, gamma=0.5)
    assert_close(out.losses.detach(), _t(0.4740769841801067))
    assert_close(out.chosen_rewards, _t(-1.0))
    assert_close(out.rejected_rewards, _t(-2.0))
    g_pc, g_pr = _grad(out.losses, pc, pr)
    assert_close(g_pc, _t(-0.7550813375962908))
    assert_close(g_pr, -g_pc)


def test_simpo_shift_invariance():
    """Only the difference of the average log-probs enters: adding c to both changes nothing."""
    torch.manual_seed(0)
    pc, pr = torch.randn(5, dtype=F64), torch.randn(5, dtype=F64)
    for c in (-3.0, 0.7):
        assert_close(pl.simpo_loss(pc + c, pr + c, beta=2.5, gamma=1.0).losses,
                     pl.simpo_loss(pc, pr, beta=2.5, gamma=1.0).losses)


def test_simpo_does_not_favour_a_length_when_fed_averages():
    """Two completions whose every token has log-prob -0.5, of 2 and 6 tokens: sums -1 and -3
    (a sum-based reward would prefer the short one by 2 nats), averages both -0.5. SimPO then
    sees margin 0 whichever is chosen: loss = -log σ(0 - γ) = log(1 + e^0.5) = 0.974077 for γ 0.5."""
    logps = torch.full((2, 6), -0.5, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert_close(pl.sequence_logprobs(logps, mask), _t(-1.0, -3.0))
    short, long = pl.sequence_logprobs(logps, mask, average=True)
    assert_close(short, long)
    for chosen, rejected in [(short, long), (long, short)]:
        out = pl.simpo_loss(chosen[None], rejected[None], beta=2.0, gamma=0.5)
        assert_close(out.losses, _t(0.9740769841801067))


# ---------------------------------------------------------------------------- KTO


def test_kto_worked_example():
    """β = 0.1, λ_D = 1, λ_U = 1.5, kl_ref 0.5 → z0 = 0.5.
    Example 0 desirable: r = -1 - (-2) = 1; loss = 1 - σ(0.1·(1 - 0.5)) = σ(-0.05) = 0.487503.
    Example 1 undesirable: r = -3 - (-2) = -1; loss = 1.5·(1 - σ(0.1·(0.5 + 1))) = 1.5·σ(-0.15)
    = 1.5 · 0.462570 = 0.693855.
    Gradients (σ' = σ(1-σ)): d/d policy_0 = -β·σ'(0.05) = -0.1·0.249844 = -0.0249844 (loss falls
    as r rises); d/d policy_1 = +λ_U·β·σ'(0.15) = 0.15·0.248600 = +0.0372899 (loss rises).
    Rewards β·r: desirable (0.1,), undesirable (-0.1,)."""
    policy = _leaf(-1.0, -3.0)
    out = pl.kto_loss(policy, _t(-2.0, -2.0), torch.tensor([True, False]), torch.tensor(0.5, dtype=F64),
                      beta=0.1, lambda_d=1.0, lambda_u=1.5)
    assert_close(out.losses.detach(), _t(0.4875026035157896, 0.6938552319843757))
    assert not out.paired
    assert_close(out.chosen_rewards, _t(0.1))
    assert_close(out.rejected_rewards, _t(-0.1))
    assert_close(out.extras["kl_ref"], torch.tensor(0.5, dtype=F64))
    (g,) = _grad(out.losses, policy)
    assert_close(g, _t(-0.024984381508111643, 0.03728985100163146))


def test_kto_loss_is_monotone_in_r_the_right_way():
    r = _t(-2.0, -0.5, 0.5, 2.0)
    zero = torch.zeros(4, dtype=F64)
    kl = torch.tensor(0.2, dtype=F64)
    good = pl.kto_loss(r, zero, torch.ones(4, dtype=torch.bool), kl, beta=0.5).losses
    bad = pl.kto_loss(r, zero, torch.zeros(4, dtype=torch.bool), kl, beta=0.5).losses
    assert (good.diff() < 0).all()
    assert (bad.diff() > 0).all()


def test_kto_reference_point_is_clamped_at_zero_and_carries_no_gradient():
    """kl_ref = -0.3 → z0 = 0. Desirable r = 1: 1 - σ(0.1) = σ(-0.1) = 0.475021; undesirable r = -1:
    1 - σ(0.1·(0 + 1)) = 0.475021. Same as kl_ref = 0; no gradient reaches kl_ref."""
    kl = torch.tensor(-0.3, dtype=F64, requires_grad=True)
    policy = _leaf(-1.0, -3.0)
    out = pl.kto_loss(policy, _t(-2.0, -2.0), torch.tensor([True, False]), kl, beta=0.1)
    assert_close(out.losses.detach(), _t(0.47502081252106, 0.47502081252106))
    assert_close(out.extras["kl_ref"], torch.tensor(0.0, dtype=F64))
    g_policy, g_kl = torch.autograd.grad(out.losses.sum(), (policy, kl), allow_unused=True)
    assert g_kl is None and g_policy is not None

    positive = torch.tensor(0.4, dtype=F64, requires_grad=True)
    out = pl.kto_loss(_leaf(-1.0, -3.0), _t(-2.0, -2.0), torch.tensor([True, False]), positive, beta=0.1)
    assert torch.autograd.grad(out.losses.sum(), positive, allow_unused=True)[0] is None


def test_kto_kl_estimate():
    """Mismatched pairs with policy - ref = (0.5, 0.5, 0.3): mean 1.3 / 3 = 0.433333, detached.
    Differences (-0.5, 0.2): mean -0.15 → clamped to 0. No pairs → 0."""
    policy = _leaf(-1.0, -2.0, -3.0)
    est = pl.kto_kl_estimate(policy, _t(-1.5, -2.5, -3.3))
    assert_close(est, torch.tensor(1.3 / 3, dtype=F64))
    assert est.shape == () and not est.requires_grad
    assert_close(pl.kto_kl_estimate(_t(-1.0, -2.0), _t(-0.5, -2.2)), torch.tensor(0.0, dtype=F64))
    assert_close(pl.kto_kl_estimate(_t(), _t()), torch.tensor(0.0, dtype=F64))


# ---------------------------------------------------------------------------- ORPO


def test_orpo_worked_example():
    """Average log-probs log 0.5 (chosen) and log 0.2 (rejected); nll_chosen = -log 0.5 = 0.693147;
    λ = 0.1. log odds = log(p / (1 - p)): log 1 = 0 and log 0.25 = -1.386294; log odds ratio
    = log 4 = 1.386294; L_OR = -log σ(log 4) = log(1 + 1/4) = 0.223144.
    L = 0.693147 + 0.1 · 0.223144 = 0.715462.
    d log odds / d log p = 1 / (1 - p): 2 for chosen, 1.25 for rejected; d L_OR / d ratio
    = -σ(-log 4) = -0.2. With nll passed as its own leaf: d L / d pc = 0.1·(-0.2)·2 = -0.04,
    d L / d pr = 0.1·0.2·1.25 = +0.025 (ORPO is not antisymmetric in log p); d L / d nll = 1."""
    pc, pr, nll = _leaf(math.log(0.5)), _leaf(math.log(0.2)), _leaf(math.log(2.0))
    out = pl.orpo_loss(pc, pr, nll, lam=0.1)
    assert_close(out.losses.detach(), _t(0.7154615356913663))
    assert_close(out.chosen_rewards, _t(0.0))
    assert_close(out.rejected_rewards, _t(math.log(0.25)))
    assert_close(out.extras["log_odds_ratio"], _t(math.log(4.0)))
    assert_close(out.extras["or_loss"], _t(math.log(1.25)))
    assert_close(out.extras["nll"], _t(math.log(2.0)))
    assert not any(v.requires_grad for v in out.extras.values())
    g_pc, g_pr, g_nll = _grad(out.losses, pc, pr, nll)
    assert_close(g_pc, _t(-0.04))
    assert_close(g_pr, _t(0.025))
    assert_close(g_nll, _t(1.0))


def test_orpo_with_lambda_zero_is_the_nll():
    torch.manual_seed(0)
    pc, pr = -torch.rand(4, dtype=F64), -torch.rand(4, dtype=F64)
    out = pl.orpo_loss(pc, pr, -pc, lam=0.0)
    assert_close(out.losses, -pc)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_log_odds_is_exact_below_the_cap_and_linear_above_it(dtype):
    """log odds(x) = x - log(1 - e^x), slope 1 / (1 - e^x).
    Below c = log 0.999 = -1.000500334e-3 exact: x = -0.5: -0.5 - log(1 - e^-0.5) = 0.432752;
    x = -1000: -1000; x = -30: -30 (log(1 - e^-30) ≈ -9.4e-14). The cap itself: lo(c) = c - log 0.001
    = 6.906754779. Above c the tangent, slope 1 / (1 - 0.999) = 1000: x = -1e-9 (where the exact slope
    is ~1e9): 6.906754779 + (c + 1e-9 ... ) -> 6.906754779 + 1000 (1.000500334e-3 - 1e-9) = 7.907254113;
    x = 0: 6.906754779 + 1.000500334 = 7.907255113. Gradients: 1000 above c, 1 / (1 - e^-0.5) =
    2.541494 at -0.5."""
    x = torch.tensor([-1e-9, 0.0, -1000.0, -30.0, -0.5], dtype=dtype, requires_grad=True)
    lo = pl.log_odds(x)
    tol = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-9}
    assert_close(lo.detach(), torch.tensor([7.907254113, 7.907255113, -1000.0, -30.0, 0.432752129],
                                           dtype=dtype), **tol)
    assert_close(_grad(lo.sum(), x)[0], torch.tensor([1000.0, 1000.0, 1.0, 1.0, 2.541494083], dtype=dtype), **tol)


def test_orpo_gradient_is_bounded_when_a_rejected_answer_is_certain():
    """Chosen average log-prob -0.5 (log odds 0.432752), rejected -1e-9 (log odds 7.907254, on the
    tangent). λ = 0.1, nll = 1 (a constant here). L_OR = -log σ(0.432752 - 7.907254) = softplus(7.474502)
    = 7.475069. d loss / d rejected = λ σ(7.474502) · 1000 = 0.1 · 0.999432 · 1000 = 99.9432 (the
    exact log odds would give ~1e8); d / d chosen = -λ σ(7.474502) · 2.541494 = -0.254005."""
    pc, pr = _leaf(-0.5), _leaf(-1e-9)
    out = pl.orpo_loss(pc, pr, _t(1.0), lam=0.1)
    assert_close(out.extras["or_loss"], _t(7.475069), rtol=0, atol=1e-6)
    assert_close(out.losses.detach(), _t(1.0 + 0.1 * 7.475069), rtol=0, atol=1e-6)
    g_pc, g_pr = _grad(out.losses, pc, pr)
    assert_close(g_pr, _t(99.9432), rtol=0, atol=1e-4)
    assert_close(g_pc, _t(-0.254005), rtol=0, atol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):  # finite in low precision too, at x = 0 as well
        x = torch.tensor([-0.5, -1e-9, 0.0], dtype=dtype, requires_grad=True)
        o = pl.orpo_loss(x[[0, 0]], x[1:], -x[[0, 0]], lam=0.1)
        (g,) = _grad(o.losses, x)
        assert torch.isfinite(o.losses).all() and torch.isfinite(g).all()
        assert g.abs().max() <= 0.1 * 1000 * 1.01 + 2.6  # the tangent's slope times λ, plus the NLL and chosen terms


# ---------------------------------------------------------------------------- shared properties


def _random_inputs(b: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    def logps():
        return -3 * torch.rand(b, dtype=F64)
    return {"policy_chosen": logps().requires_grad_(), "policy_rejected": logps().requires_grad_(),
            "ref_chosen": logps(), "ref_rejected": logps(), "nll_chosen": torch.rand(b, dtype=F64),
            "policy": logps().requires_grad_(), "ref": logps(), "desirable": torch.rand(b) > 0.5,
            "kl_ref": torch.tensor(0.1, dtype=F64)}


_PARAMS = {"dpo": {"beta": 0.1}, "cdpo": {"beta": 0.1, "label_smoothing": 0.2}, "ipo": {"beta": 0.05},
           "simpo": {"beta": 2.0, "gamma": 1.0}, "kto": {"beta": 0.1, "lambda_u": 1.2}, "orpo": {"lam": 0.1}}


@pytest.mark.parametrize("kind", sorted(pl.PAIRED))
def test_paired_gradients_raise_chosen_and_lower_rejected(kind):
    """At random log-probs in [-3, 0] (so |Δ| ≤ 6, below IPO's target 1/(2β) = 10) every
    paired loss has d / d policy_chosen < 0 and d / d policy_rejected > 0; the sum-based losses
    of a log-ratio difference (all but ORPO) have exactly opposite gradients."""
    inputs = _random_inputs()
    out = pl.preference_loss(kind, inputs, **_PARAMS[kind])
    g_c, g_r = _grad(out.losses, inputs["policy_chosen"], inputs["policy_rejected"])
    assert (g_c < 0).all() and (g_r > 0).all()
    if kind != "orpo":
        assert_close(g_r, -g_c)


@pytest.mark.parametrize("kind", sorted(pl.PAIRED))
def test_paired_losses_are_per_example(kind):
    """Each pair's loss depends on that pair only: the batch equals its rows one at a time."""
    inputs = _random_inputs()
    whole = pl.preference_loss(kind, inputs, **_PARAMS[kind])
    for i in range(5):
        row = pl.preference_loss(kind, {k: v[i:i + 1] for k, v in inputs.items() if v.dim()}, **_PARAMS[kind])
        assert_close(row.losses, whole.losses[i:i + 1])
        assert_close(row.chosen_rewards, whole.chosen_rewards[i:i + 1])


@pytest.mark.parametrize("kind", sorted(pl.LOSSES))
def test_dispatch_equals_the_direct_call_and_rewards_are_detached(kind):
    inputs = _random_inputs()
    spec = pl.LOSSES[kind]
    direct = spec.fn(*(inputs[n] for n in spec.inputs), **_PARAMS[kind])
    out = pl.preference_loss(kind, inputs, **_PARAMS[kind])
    assert_close(out.losses, direct.losses)
    assert out.losses.shape == (5,) and out.losses.requires_grad
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_registry_reference_needs_and_signatures():
    """NEEDS_REFERENCE is what the papers say; each spec's inputs are fn's leading required
    parameters and its params cover every other required one, so the dispatcher can feed any row.
    ("dpo" deliberately leaves out dpo_loss's label_smoothing: smoothing is asked for as "cdpo".)"""
    assert pl.NEEDS_REFERENCE == {"dpo", "cdpo", "ipo", "kto"}
    assert pl.PAIRED == {"dpo", "cdpo", "ipo", "simpo", "orpo"}
    assert {k for k, s in pl.LOSSES.items() if s.average} == {"ipo", "simpo", "orpo"}  # IPO: as its authors' code and TRL
    for kind, spec in pl.LOSSES.items():
        params = list(inspect.signature(spec.fn).parameters.values())
        rest = params[len(spec.inputs):]
        assert all(p.default is inspect.Parameter.empty for p in params[:len(spec.inputs)]), kind
        assert set(spec.params) <= {p.name for p in rest}, kind
        assert {p.name for p in rest if p.default is inspect.Parameter.empty} <= set(spec.params), kind


def test_dispatch_errors_name_the_problem():
    inputs = _random_inputs()
    with pytest.raises(ValueError, match="cdpo.*dpo.*ipo.*kto.*orpo.*simpo"):
        pl.preference_loss("rso", inputs, beta=0.1)
    with pytest.raises(ValueError, match="ref_chosen"):
        pl.preference_loss("dpo", {"policy_chosen": inputs["policy_chosen"], "policy_rejected": inputs["policy_rejected"]},
                           beta=0.1)
    with pytest.raises(ValueError, match="gamma"):
        pl.preference_loss("dpo", inputs, beta=0.1, gamma=1.0)


def test_shape_mismatch_raises_instead_of_broadcasting():
    """(B,) against (B, 1) would broadcast to a (B, B) loss."""
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same B"):
        pl.dpo_loss(x, x, x[:, None], x, beta=0.1)
    with pytest.raises(ValueError, match="same B"):
        pl.simpo_loss(x, torch.zeros(4), beta=2.0, gamma=0.5)


# ---------------------------------------------------------------------------- metrics


def test_reward_metrics_paired_over_micro_batches():
    """Micro-batches with chosen (1, 0) / rejected (0, 0) and chosen (0.5,) / rejected (-0.5,):
    chosen mean 1.5 / 3 = 0.5, rejected mean -0.5 / 3, margin 0.5 + 1/6 = 2/3; accuracy: pair 2
    is a tie (wrong) → 2 / 3."""
    def out(c, r):
        return pl.PreferenceLoss(torch.zeros(len(c)), torch.tensor(c), torch.tensor(r), {})
    m = pl.reward_metrics([out([1.0, 0.0], [0.0, 0.0]), out([0.5], [-0.5])])
    assert m == pytest.approx({"rewards/chosen": 0.5, "rewards/rejected": -1 / 6, "rewards/margin": 2 / 3,
                               "rewards/accuracy": 2 / 3})


def test_reward_metrics_kto_has_no_accuracy_and_skips_an_empty_side():
    """KTO worked example: desirable reward 0.1, undesirable -0.1 → margin 0.2, no accuracy.
    A batch of desirable examples only reports the chosen mean alone (no NaN)."""
    kl = torch.tensor(0.5, dtype=F64)
    out = pl.kto_loss(_t(-1.0, -3.0), _t(-2.0, -2.0), torch.tensor([True, False]), kl, beta=0.1)
    assert pl.reward_metrics([out]) == pytest.approx({"rewards/chosen": 0.1, "rewards/rejected": -0.1,
                                                      "rewards/margin": 0.2})
    only_good = pl.kto_loss(_t(-1.0), _t(-2.0), torch.tensor([True]), kl, beta=0.1)
    assert pl.reward_metrics([only_good]) == pytest.approx({"rewards/chosen": 0.1})
