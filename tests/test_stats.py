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


# ---------------------------------------------------------------------------- training seeds x prompts


def interval_of(values, confidence=0.95, seed=0):
    """The percentile interval of one (S, P) array's replicate means."""
    reps = stats.seed_prompt_means(np.asarray(values, dtype=float)[None], resamples=4000, seed=seed)[:, 0]
    return stats.percentile_interval(reps, confidence)


def test_seeds_are_resampled_and_so_are_prompts():
    """Two seeds scoring 0 and 1 on one prompt: a replicate draws the seeds (0,0), (0,1) or (1,0), or (1,1), so its
    mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4; the 95% interval is [0, 1] and the 40% one (30% and 70%
    quantiles) sits inside the 0.5 mass. One seed on two prompts scored 0 and 1: the same, from the prompts."""
    assert interval_of([[0], [1]]) == (0.0, 1.0)
    assert interval_of([[0], [1]], confidence=0.4) == (0.5, 0.5)
    assert interval_of([[0, 1]]) == (0.0, 1.0)
    assert interval_of([[0, 1]], confidence=0.4) == (0.5, 0.5)


def test_one_prompt_draw_is_shared_by_all_seeds():
    """Two seeds, both right on prompt 1 and wrong on prompt 2. The seeds agree, so only the prompt draw matters:
    (1,1) -> 1, (1,2) or (2,1) -> 0.5, (2,2) -> 0, probabilities 1/4, 1/2, 1/4, and the 80% interval (10% and 90%
    quantiles) is [0, 1]. Drawing prompts afresh under each seed would average two independent draws: 0, 0.25,
    0.5, 0.75, 1 with probabilities 1/16, 4/16, 6/16, 4/16, 1/16, an 80% interval of [0.25, 0.75], too narrow
    for prompts that are the same for every seed."""
    assert interval_of([[1, 0], [1, 0]], confidence=0.8) == (0.0, 1.0)


def test_seed_spread_widens_the_interval():
    """r1flow beats TRL on all 100 prompts with seed 0 and ties with seed 1. Pooling the 200 per-prompt differences
    as if they were one run gives 0.5 +- 1.96 * sqrt(0.25 / 200) = 0.5 +- 0.07; resampling the seeds gives a
    replicate mean of 1, 0.5 or 0 (seed draws (0,0), mixed, (1,1)), so the 95% interval is [0, 1]."""
    a = np.zeros((2, 100))
    b = np.stack([np.ones(100), np.zeros(100)])
    assert stats.seed_prompt_diff(a, b, resamples=4000) == (0.5, 0.0, 1.0)
    _, low, high = paired_bootstrap_diff(a.ravel(), b.ravel())
    assert (high - low) / 2 == pytest.approx(1.96 * math.sqrt(0.25 / 200), abs=0.01)


def test_seed_prompt_draws_are_paired_across_arrays_and_deterministic():
    x = coin(60, p=0.4).reshape(3, 20)
    reps = stats.seed_prompt_means(np.stack([x, x, 1 - x]), resamples=500, seed=2)
    assert np.array_equal(reps[:, 0], reps[:, 1])  # the same draw for every array
    assert np.allclose(reps[:, 0] + reps[:, 2], 1.0)
    assert np.array_equal(stats.seed_prompt_means(x[None], 500, seed=2)[:, 0], reps[:, 0])
    assert stats.seed_prompt_diff(x, x) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"a is \(3, 20\) and b is \(2, 20\)"):
        stats.seed_prompt_diff(x, x[:2])
    with pytest.raises(ValueError, match="seeds, prompts"):
        stats.seed_prompt_diff([0, 1], [1, 1])


def test_seed_prompt_means_do_not_depend_on_the_chunk_size(monkeypatch):
    x = coin(60, p=0.4).reshape(3, 20)[None]
    whole = stats.seed_prompt_means(x, 1000, seed=7)
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 23 * 64 + 5)  # chunks of 64 resamples, the last one shorter
    assert np.allclose(stats.seed_prompt_means(x, 1000, seed=7), whole)


def test_compare_gains_hand_worked_bounded_ratio():
    """One seed, two prompts, both unsolved at the start. TRL ends at 0.5 on each (fractional scores, e.g. pass
    rates), so its gain is 0.5 in every replicate. r1flow ends at 1 and 0.5: its gain is 1, 0.75 or 0.5 as the
    prompt draw is (1,1), mixed or (2,2), probabilities 1/4, 1/2, 1/4. So: TRL's gain 0.5 [0.5, 0.5], r1flow's 0.75
    [0.5, 1], the difference 0.25 [0, 0.5], the ratio 1.5 [1, 2]."""
    c = stats.compare_gains([0, 0], [[0.5, 0.5]], [[1, 0.5]], resamples=4000)
    assert (c.gain_a, c.gain_a_ci) == (0.5, (0.5, 0.5))
    assert (c.gain_b, c.gain_b_ci) == (0.75, (0.5, 1.0))
    assert (c.diff, c.diff_ci) == (0.25, (0.0, 0.5))
    assert (c.ratio, c.ratio_ci) == (1.5, (1.0, 2.0))
    assert c.diff_ci == stats.seed_prompt_diff([[0.5, 0.5]], [[1, 0.5]], resamples=4000)[1:]


def test_compare_gains_when_the_denominator_may_be_zero():
    """TRL right on prompt 1 only (gain 0.5, its replicates 1, 0.5, 0): its interval [0, 1] reaches 0, so the ratio
    (2.0 at the point) has no bounded interval. TRL with no gain at all: no ratio either."""
    c = stats.compare_gains([0, 0], [[1, 0]], [[1, 1]], resamples=4000)
    assert c.gain_a_ci == (0.0, 1.0) and c.ratio == 2.0 and c.ratio_ci is None
    assert (c.diff, c.diff_ci) == (0.5, (0.0, 1.0))
    c = stats.compare_gains([0, 0], [[0, 0]], [[1, 1]], resamples=100)
    assert c.ratio is None and c.ratio_ci is None and c.diff == 1.0
    with pytest.raises(ValueError, match=r"start \(3,\), a \(1, 2\)"):
        stats.compare_gains([0, 0, 0], [[0, 0]], [[1, 1]])


def test_ratio_interval_on_literal_replicates():
    """100 replicates, 98 with ratio 1 / 0.5 = 2 and 2 with denominator -0.1. The denominators' 2.5% quantile (at
    position 0.025 * 99 = 2.475 of the sorted 100) is 0.5 > 0: bounded, and the 2.5% and 97.5% order statistics
    (the 3rd and 98th of 100) are both 2, whatever the two odd replicates count as. With 3 such replicates the
    quantile is -0.1 + 0.475 * 0.6 = 0.185, still > 0; they count as +inf (numerator > 0), so the 98th order
    statistic is +inf, or as -inf (numerator <= 0), and the 3rd is -inf: the interval is honest about them."""
    assert stats.ratio_interval([1.0] * 100, [-0.1] * 2 + [0.5] * 98) == (2.0, 2.0)
    assert stats.ratio_interval([-1.0] * 2 + [1.0] * 98, [-0.1] * 2 + [0.5] * 98) == (2.0, 2.0)
    den = [-0.1] * 3 + [0.5] * 97
    assert stats.percentile_interval(den)[0] == pytest.approx(0.185)
    assert stats.ratio_interval([1.0] * 100, den) == (2.0, math.inf)
    assert stats.ratio_interval([-1.0] * 3 + [1.0] * 97, den) == (-math.inf, 2.0)
    assert stats.ratio_interval([1.0] * 100, [-0.1] * 4 + [0.5] * 96) is None  # 2.5% quantile -0.1: unbounded
    with pytest.raises(ValueError, match="one each"):
        stats.ratio_interval([1.0], [1.0, 2.0])


def test_two_sided_verdicts():
    assert stats.two_sided(0.004, 0.08) == "higher"
    assert stats.two_sided(-0.08, -0.004) == "lower"
    assert stats.two_sided(-0.01, 0.05) == "same"
    assert stats.two_sided(0.0, 0.05) == "same"  # an interval touching 0 does not exclude it


# ---------------------------------------------------------------------------- time to accuracy


def test_time_to_reach_interpolates_the_first_crossing():
    """Curve 0.2, 0.3, 0.5, 0.6 at 0, 60, 120, 180 s. Target 0.4 is crossed between 60 s (0.3) and 120 s (0.5):
    60 + (0.4 - 0.3) / (0.5 - 0.3) * 60 = 90 s. 0.5 is reached at 120 s exactly; 0.2 at the start (0.0); 0.7
    never. A curve that dips (0.2, 0.5, 0.3, 0.6) first crosses 0.45 at 0 + 0.25 / 0.3 * 60 = 50 s, not later."""
    t = [0, 60, 120, 180]
    assert stats.time_to_reach(t, [0.2, 0.3, 0.5, 0.6], 0.4) == pytest.approx(90.0)
    assert stats.time_to_reach(t, [0.2, 0.3, 0.5, 0.6], 0.5) == 120.0
    assert stats.time_to_reach(t, [0.2, 0.3, 0.5, 0.6], 0.2) == 0.0
    assert stats.time_to_reach(t, [0.2, 0.3, 0.5, 0.6], 0.7) is None
    assert stats.time_to_reach(t, [0.2, 0.5, 0.3, 0.6], 0.45) == pytest.approx(50.0)
    assert stats.time_to_reach([30, 90], [0.8, 0.9], 0.5) == 0.0  # at or above it at the first point: 0.0
    with pytest.raises(ValueError, match="3 times and 2 accuracies"):
        stats.time_to_reach([0, 1, 2], [0.1, 0.2], 0.5)


def curves(*seeds_points):
    """(S, T, P) from per seed, per point lists of 0/1 scores."""
    return np.asarray(seeds_points, dtype=float)


def test_time_to_accuracy_hand_worked_interpolation_and_a_start_above_the_target():
    """One seed, two prompts. a (the reference): 0/2 at 0 s, 1/2 at 100 s, so the target is 0.5 and t_a = 100 s.
    b: 0/2 at 0 s, 2/2 at 20 s: it crosses 0.5 half-way, at 10 s: speed-up 10. The prompt draws: (1, 1) makes the
    target 1, a's curve 0 -> 1 (t_a 100) and b's 0 -> 1 (t_b 20): 5, probability 1/4; a mixed draw is the point
    (10, probability 1/2); (2, 2) makes the target 0, which both start at: +inf, probability 1/4. So the 95%
    interval is [5, inf]; b always gets there."""
    a = curves([[0, 0], [1, 0]])
    b = curves([[0, 0], [1, 1]])
    c = stats.compare_time_to_accuracy(a, [[0, 100]], b, [[0, 20]], resamples=4000)
    assert (c.target, c.t_a, c.t_b, c.speedup) == (0.5, 100.0, 10.0, 10.0)
    assert c.ci == (5.0, math.inf) and c.never_reached_share == 0.0
    assert (c.seeds, c.prompts) == (1, 2)
    # b evaluated at more points than a (its own snapshots): the points of each side are its own
    c = stats.compare_time_to_accuracy(a, [[0, 100]], curves([[0, 0], [1, 0], [1, 1]]), [[0, 5, 20]], resamples=400)
    assert (c.t_b, c.speedup) == (5.0, 20.0)


def test_time_to_accuracy_when_b_never_gets_there():
    """One seed, two prompts. a: 0/2 at 0 s, 2/2 at 60 s (target 1, t_a 60). b: 0/2, then 1/2 at 30 s: it never
    reaches 1, speed-up 0. Draws: (1, 1) gives b 0 -> 1, t_b 30, speed-up 2 (probability 1/4); any other draw leaves
    b short (3/4). So the interval is [0, 2] and about 3/4 of the replicates never got there."""
    a = curves([[0, 0], [1, 1]])
    b = curves([[0, 0], [1, 0]])
    c = stats.compare_time_to_accuracy(a, [[0, 60]], b, [[0, 30]], resamples=4000)
    assert (c.target, c.t_a, c.t_b, c.speedup) == (1.0, 60.0, None, 0.0)
    assert c.ci == (0.0, 2.0) and c.never_reached_share == pytest.approx(0.75, abs=0.03)


def test_time_to_accuracy_pairs_the_seeds_and_averages_their_times():
    """Two seeds, one prompt, every model right at the end. a's seeds end at 100 and 200 s, b's at 30 and 50 s:
    the seed-mean curves reach 1 at 150 and 40 s, speed-up 3.75. A seed draw of (0, 0) gives 100 / 30 = 3.33, (1, 1)
    200 / 50 = 4, a mixed one 3.75: the interval is [3.33, 4]. Drawing a's and b's seeds independently would pair
    100 with 50 (2) and 200 with 30 (6.67) too."""
    a = curves([[0], [1]], [[0], [1]])
    b = curves([[0], [1]], [[0], [1]])
    c = stats.compare_time_to_accuracy(a, [[0, 100], [0, 200]], b, [[0, 30], [0, 50]], resamples=4000)
    assert (c.t_a, c.t_b, c.speedup) == (150.0, 40.0, 3.75)
    assert c.ci == (pytest.approx(100 / 30), 4.0) and (c.seeds, c.prompts) == (2, 1)
    with pytest.raises(ValueError, match=r"a \(2, 2, 1\), b \(1, 2, 1\)"):
        stats.compare_time_to_accuracy(a, [[0, 100], [0, 200]], b[:1], [[0, 30]])
