"""The distillation losses against hand-worked numbers on a 3-token vocabulary.

Teacher logits log([1, 2, 1]) give p = (1/4, 1/2, 1/4); student logits 0 give q = (1/3, 1/3, 1/3):
    forward KL(p ‖ q) = 2·(1/4)·ln(3/4) + (1/2)·ln(3/2) = (1/2)·ln(9/8) ≈ 0.058892
    reverse KL(q ‖ p) = (1/3)·(2·ln(4/3) + ln(2/3)) = (1/3)·ln(32/27) ≈ 0.056633
At T = 2 the teacher becomes softmax(log([1, 2, 1]) / 2) ∝ (1, √2, 1): p = (a, b, a) with
a = 1/(2 + √2), b = √2/(2 + √2); the student stays uniform, so
    T²·KL(p ‖ q) = 4·(2a·ln(3a) + b·ln(3b)) ≈ 0.056883
"""

from __future__ import annotations

import math

import pytest
import torch

from stages.math.distill import distill_loss, generalized_jsd, kd_loss

TEACHER = torch.log(torch.tensor([[[1.0, 2.0, 1.0]]]))  # (1, 1, 3)
STUDENT = torch.zeros(1, 1, 3)
ONE = torch.ones(1, 1, dtype=torch.bool)


def test_forward_and_reverse_kl_hand_computed():
    torch.testing.assert_close(kd_loss(STUDENT, TEACHER, ONE), torch.tensor(0.5 * math.log(9 / 8)))
    torch.testing.assert_close(kd_loss(STUDENT, TEACHER, ONE, direction="reverse"), torch.tensor(math.log(32 / 27) / 3))


def test_temperature_softens_both_sides_and_scales_by_t_squared():
    a, b = 1 / (2 + math.sqrt(2)), math.sqrt(2) / (2 + math.sqrt(2))
    expected = 4 * (2 * a * math.log(3 * a) + b * math.log(3 * b))
    torch.testing.assert_close(kd_loss(STUDENT, TEACHER, ONE, temperature=2.0), torch.tensor(expected))
    # the T² factor alone: the same softened KL computed by hand at T = 2 without it is 4x smaller
    plain = torch.nn.functional.kl_div(torch.log_softmax(STUDENT / 2, -1), torch.softmax(TEACHER / 2, -1),
                                       reduction="sum")
    torch.testing.assert_close(kd_loss(STUDENT, TEACHER, ONE, temperature=2.0), 4 * plain)


def test_masked_positions_count_for_nothing_not_even_nan():
    """Position 0 is the worked example; position 1 (masked, e.g. a prompt token or padding) holds NaN
    logits. The mean is over the one unmasked token, and the NaN reaches neither value nor gradient."""
    student = torch.cat([STUDENT, torch.full((1, 1, 3), float("nan"))], dim=1).requires_grad_(True)
    teacher = torch.cat([TEACHER, torch.full((1, 1, 3), float("nan"))], dim=1)
    mask = torch.tensor([[True, False]])
    loss = kd_loss(student, teacher, mask)
    torch.testing.assert_close(loss, torch.tensor(0.5 * math.log(9 / 8)))
    loss.backward()
    assert torch.all(student.grad[0, 1] == 0) and torch.all(torch.isfinite(student.grad))
    # sum vs mean over two identical unmasked tokens
    two = torch.ones(1, 2, dtype=torch.bool)
    s2, t2 = STUDENT.expand(1, 2, 3), TEACHER.expand(1, 2, 3)
    torch.testing.assert_close(kd_loss(s2, t2, two, reduction="sum"), 2 * kd_loss(s2, t2, two))
    assert kd_loss(s2, t2, torch.zeros(1, 2, dtype=torch.bool)).item() == 0.0  # nothing to distil


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_zero_when_student_equals_teacher(kind):
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.rand(2, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    torch.testing.assert_close(distill_loss(kind, logits, logits.clone(), mask, temperature=1.5),
                               torch.tensor(0.0), atol=1e-6, rtol=0)


def test_gradient_flows_only_to_the_student():
    student = torch.randn(1, 3, 5, requires_grad=True)
    teacher = torch.randn(1, 3, 5, requires_grad=True)
    for kind in ("forward", "reverse", "jsd"):
        distill_loss(kind, student, teacher, torch.ones(1, 3, dtype=torch.bool)).backward()
    assert teacher.grad is None and student.grad is not None and student.grad.abs().sum() > 0


def test_jsd_hand_computed_and_its_limits():
    """β = 1/2: M = (p + q)/2 = (7/24, 5/12, 7/24); JSD = ½·KL(p ‖ M) + ½·KL(q ‖ M)."""
    p, q = [0.25, 0.5, 0.25], [1 / 3] * 3
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    expected = 0.5 * sum(x * math.log(x / z) for x, z in zip(p, m, strict=True)) + \
        0.5 * sum(y * math.log(y / z) for y, z in zip(q, m, strict=True))
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, ONE, beta=0.5), torch.tensor(expected))
    # β → 0: ≈ β·forward KL; β → 1: ≈ (1 − β)·reverse KL (to first order in β, hence the 1% tolerance)
    eps = 1e-3
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, ONE, beta=eps) / eps,
                               kd_loss(STUDENT, TEACHER, ONE), rtol=1e-2, atol=0)
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, ONE, beta=1 - eps) / eps,
                               kd_loss(STUDENT, TEACHER, ONE, direction="reverse"), rtol=1e-2, atol=0)


def test_bad_arguments_fail_loudly():
    with pytest.raises(ValueError, match=r"must both be \(B, T, V\)"):
        kd_loss(torch.zeros(1, 1, 3), torch.zeros(1, 1, 4), ONE)
    with pytest.raises(ValueError, match="mask"):
        kd_loss(STUDENT, TEACHER, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(STUDENT, TEACHER, ONE, temperature=0)
    with pytest.raises(ValueError, match="direction"):
        kd_loss(STUDENT, TEACHER, ONE, direction="sideways")
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(STUDENT, TEACHER, ONE, beta=1.0)
    with pytest.raises(ValueError, match="unknown divergence"):
        distill_loss("tvd", STUDENT, TEACHER, ONE)
