"""stages.math.stats: bootstrap intervals on literal and seeded data, against hand-worked numbers and the
normal approximation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.math import stats
from stages.math.stats import bootstrap_ci, paired_bootstrap_diff


def coin(n: int, p: float = 0.5, seed: int = 1) -> np.ndarray:
    """n 0/1 values with exactly round(p * n) ones, shuffled."""
    x = np.zeros(n)
    x[: round(p * n)] = 1.0
    return np.random.default_rng(seed).permutation(x)


def test_all_equal_values_give_a_zero_width_interval():
    assert bootstrap_ci([1] * 50) == (1.0, 1.0)
    assert bootstrap_ci([0] * 50) == (0.0, 0.0)
    assert bootstrap_ci([0.25] * 7) == (0.25, 0.25)


def test_two_values_hand_worked():
    """n=2, values [0, 1]: a resample's mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4, so the
    2.5% quantile of 10,000 resampled means is 0 and the 97.5% quantile is 1."""
    assert bootstrap_ci([0, 1]) == (0.0, 1.0)
    assert bootstrap_ci([0, 1], confidence=0.4) == (0.5, 0.5)  # 30% and 70% quantiles: both inside the 0.5 mass


def test_half_width_matches_the_normal_approximation():
    """p = 0.5, n = 400: standard error sqrt(0.25 / 400) = 0.025, so a 95% interval is about
    0.5 ± 1.96 * 0.025 = 0.5 ± 0.049."""
    x = coin(400)
    low, high = bootstrap_ci(x)
    assert low < x.mean() < high
    assert (high - low) / 2 == pytest.approx(1.96 * math.sqrt(0.25 / 400), abs=0.01)
    assert (high - low) / 2 == pytest.approx(0.049, abs=0.01)
    low90, high90 = bootstrap_ci(x, confidence=0.90)
    assert low < low90 < high90 < high  # a lower confidence is a narrower interval


def test_interval_contains_the_mean_and_is_deterministic():
    x = coin(137, p=0.3, seed=5)
    low, high = bootstrap_ci(x, seed=3)
    assert low <= x.mean() <= high
    assert bootstrap_ci(x, seed=3) == (low, high)
    assert bootstrap_ci(list(x), seed=3) == (low, high)  # a list like an array
    # another seed, other resamples (the quantiles of 0/1 means sit on the grid k/137, so they may agree)
    assert not np.array_equal(stats.bootstrap_means(x, 100, seed=4), stats.bootstrap_means(x, 100, seed=3))


def test_result_does_not_depend_on_the_chunk_size(monkeypatch):
    x = coin(300, p=0.4)
    whole = stats.bootstrap_means(x, 1000, seed=7)
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 300 * 64 + 5)  # chunks of 64 resamples, the last one shorter
    assert np.array_equal(stats.bootstrap_means(x, 1000, seed=7), whole)


def test_empty_and_invalid_input():
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    assert all(math.isnan(v) for v in paired_bootstrap_diff([], []))
    with pytest.raises(ValueError, match="1-D"):
        bootstrap_ci([[0, 1], [1, 1]])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([0, 1], confidence=95)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ci([0, 1], resamples=0)


def test_paired_diff_of_identical_and_of_opposite_arrays():
    a = coin(200, p=0.35)
    assert paired_bootstrap_diff(a, a) == (0.0, 0.0, 0.0)
    assert paired_bootstrap_diff([0] * 64, [1] * 64) == (1.0, 1.0, 1.0)
    assert paired_bootstrap_diff([1] * 64, [0] * 64) == (-1.0, -1.0, -1.0)


def test_pairing_narrows_the_interval_when_models_agree_on_most_prompts():
    """b is a with 12 of the 400 wrong answers made right: gain 12/400 = 0.03. Per-prompt
    differences are 12 ones and 388 zeros, so the paired half-width is about
    1.96 * sqrt(0.03 * 0.97 / 400) = 0.017, while two independent estimates would give about
    1.96 * sqrt(var(a)/400 + var(b)/400) = 0.069."""
    a = coin(400, p=0.5)
    b = a.copy()
    b[np.flatnonzero(a == 0)[:12]] = 1.0
    gain, low, high = paired_bootstrap_diff(a, b)
    assert gain == pytest.approx(0.03)
    assert low < gain < high and low > 0  # the gain is clearly positive when paired
    unpaired_half = 1.96 * math.sqrt(a.var() / 400 + b.var() / 400)
    assert unpaired_half == pytest.approx(0.069, abs=0.002)
    assert (high - low) / 2 == pytest.approx(1.96 * math.sqrt(0.03 * 0.97 / 400), abs=0.005)
    assert (high - low) / 2 < 0.35 * unpaired_half
    # the same interval as bootstrapping the per-prompt difference
    assert (low, high) == bootstrap_ci(b - a)


def test_paired_diff_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"a has 3 values and b has 2"):
        paired_bootstrap_diff([0, 1, 1], [1, 1])


def test_cluster_bootstrap_ratio_hand_worked():
    """Group a: 1 of 2 (as two units, 1 of 1 and 0 of 1), group b: 0 of 1. The ratio is 1/3. A resample of two
    groups is aa (2/4 = 0.5, probability 1/4), ab or ba (1/3, 1/2) or bb (0, 1/4): the 95% interval is [0, 0.5].
    The units of a group move together: a's two units are never split."""
    ratio, low, high = stats.cluster_bootstrap_ratio([1, 0, 0], [1, 1, 1], ["a", "a", "b"], resamples=4000, seed=3)
    assert ratio == pytest.approx(1 / 3) and (low, high) == (0.0, 0.5)
    assert stats.cluster_bootstrap_ratio([1, 0], [1, 1], ["a", "a"]) == (0.5, 0.5, 0.5)  # one group: no spread
    # as three groups of one unit each: three draws of the right unit (3/3) have probability 1/27 = 3.7% > 2.5%,
    # so the interval reaches 1, where keeping a's units together never gives more than 0.5
    _, _, high3 = stats.cluster_bootstrap_ratio([1, 0, 0], [1, 1, 1], ["a", "c", "b"], resamples=4000, seed=3)
    assert high3 == 1.0
    assert all(math.isnan(v) for v in stats.cluster_bootstrap_ratio([], [], []))
    with pytest.raises(ValueError, match="2 num, 2 den and 1 groups"):
        stats.cluster_bootstrap_ratio([1, 0], [1, 1], ["a"])
