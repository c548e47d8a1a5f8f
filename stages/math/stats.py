"""Confidence intervals for eval accuracies: percentile bootstrap of a mean, of a paired difference, and of a
comparison of two training methods over training seeds and prompts.

Pure numpy, no torch. The percentile bootstrap (Efron & Tibshirani, *An Introduction to the
Bootstrap*, 1993, ch. 13): resample the n values with replacement B times, take the mean of each
resample, and report the alpha/2 and 1 - alpha/2 quantiles of those B means.

Where it departs from the textbook, or where a reader should be careful:

- For 0/1 values every resample of all-equal data has the same mean, so all-correct or all-wrong
  evals get a zero-width interval ((1, 1) or (0, 0)): the bootstrap cannot see variation the sample
  does not have. With small n read such an interval with n next to it (the run report shows both).
- `paired_bootstrap_diff` resamples the *same* prompt indices for both models (a[i] and b[i] are
  one prompt scored by two models), which is the bootstrap of the per-prompt difference b - a.
  Prompt difficulty is shared, so the interval is much narrower than that of two independent
  resamples whenever the two models agree on most prompts.
- `seed_prompt_means` (and `seed_prompt_diff`, `compare_gains` on top of it) resamples training seeds and prompts
  together, one prompt draw shared by every seed (the prompts are crossed with the seeds, not nested in them). A
  ratio of two gains gets an interval only when the denominator's interval stays above 0 (`ratio_interval`).
- `compare_time_to_accuracy` reads two sides' learning curves (held-out accuracy at fixed points of training) and
  asks when the second first reaches the first's final accuracy (`time_to_reach`: linear between the two points
  around the first crossing). Its interval resamples seeds and prompts as `seed_prompt_means` does, the target
  recomputed in every replicate; a replicate whose b never gets there counts as speed-up 0, one whose b starts there
  as +inf, and the quantiles are order statistics (no interpolation toward an infinite value).
- Resamples are drawn in chunks of at most `CHUNK_ELEMENTS` indices, so memory stays bounded for
  any n; the numbers do not depend on the chunk size (one generator, drawn in order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK_ELEMENTS = 1 << 21  # resample indices held at once (int64: 16 MiB)


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of values, got shape {x.shape}")
    return x


def _check(confidence: float, resamples: int) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")


def bootstrap_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Means of `resamples` resamples with replacement of the 1-D array `values` (n,) -> (resamples,)."""
    n = len(values)
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, CHUNK_ELEMENTS // max(n, 1)))
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(start + chunk, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))  # (chunk, n)
        means[start:stop] = values[idx].mean(axis=1)
    return means


def bootstrap_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95, resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval (low, high) of the mean of `values` (1-D, e.g. 0/1 correctness
    per prompt). Empty input: (nan, nan). Deterministic for a given seed."""
    _check(confidence, resamples)
    x = _as_1d(values, "values")
    if len(x) == 0:
        return float("nan"), float("nan")
    means = bootstrap_means(x, resamples, seed)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def paired_bootstrap_diff(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                          confidence: float = 0.95, resamples: int = 10_000,
                          seed: int = 0) -> tuple[float, float, float]:
    """(mean(b) - mean(a), low, high): the gain of b over a and its percentile bootstrap interval,
    resampling the same indices for both (a[i], b[i]: one prompt evaluated by two models).

    Resampling index i for both is resampling the per-prompt difference b[i] - a[i], so this is
    `bootstrap_ci(b - a)`. Empty input: (nan, nan, nan). Raises ValueError when the lengths differ.
    """
    _check(confidence, resamples)
    x, y = _as_1d(a, "a"), _as_1d(b, "b")
    if len(x) != len(y):
        raise ValueError(f"paired_bootstrap_diff: a has {len(x)} values and b has {len(y)}; "
                         "a paired difference needs one value per prompt in each")
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    d = y - x
    low, high = bootstrap_ci(d, confidence, resamples, seed)
    return float(d.mean()), low, high


def cluster_bootstrap_ratio(num: Sequence[float] | np.ndarray, den: Sequence[float] | np.ndarray,
                            groups: Sequence, confidence: float = 0.95, resamples: int = 10_000,
                            seed: int = 0) -> tuple[float, float, float]:
    """(sum(num) / sum(den), low, high): a ratio of sums and its percentile bootstrap interval, resampling whole
    groups (e.g. the held-out steps of one prompt, which share its difficulty) rather than single values.

    num[i], den[i], groups[i]: one unit (e.g. a solution: its steps scored right, its steps) and its group. The
    units of a group are summed first; each resample draws as many groups as there are, with replacement, and
    takes the ratio of their sums. Empty input: (nan, nan, nan). den must sum to more than 0 in every group.
    """
    _check(confidence, resamples)
    x, y = _as_1d(num, "num"), _as_1d(den, "den")
    if not len(x) == len(y) == len(groups):
        raise ValueError(f"cluster_bootstrap_ratio: {len(x)} num, {len(y)} den and {len(groups)} groups (one each)")
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    keys = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    index = np.array([keys[g] for g in groups])
    gn, gd = np.bincount(index, x, len(keys)), np.bincount(index, y, len(keys))
    if (gd <= 0).any():
        raise ValueError("cluster_bootstrap_ratio: every group needs den > 0")
    n = len(keys)
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, CHUNK_ELEMENTS // n))
    ratios = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(start + chunk, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        ratios[start:stop] = gn[idx].sum(axis=1) / gd[idx].sum(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return float(gn.sum() / gd.sum()), float(low), float(high)


# ---------------------------------------------------------------------------- training seeds x prompts


def _seeds_by_prompts(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"{name}: expected a non-empty (seeds, prompts) array, got shape {x.shape}")
    return x


def seed_prompt_means(values, resamples: int = 10_000, seed: int = 0) -> np.ndarray:
    """(K, S, P) -> (resamples, K): K arrays of per-prompt scores (e.g. two sides' correctness) of S training seeds
    on P prompts, each replicate's K means over one resample of the seeds and one of the prompts.

    The prompts are crossed with the seeds (every seed's model is scored on the same P prompts), so each replicate
    draws S seeds and P prompts with replacement once and takes the mean over all (seed, prompt) pairs drawn: the
    pigeonhole bootstrap of a crossed design (Owen 2007, https://doi.org/10.1214/07-AOAS122; mildly conservative:
    it tends to overstate the variance). Drawing the prompts
    afresh under each drawn seed (a nested bootstrap) would average a prompt's difficulty away over the seeds and
    give too narrow an interval. The same draw serves all K arrays, so seed i of one and seed i of another are
    paired (seed i: the same training seed, e.g. the same prompt order) and so are their prompts.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 3 or 0 in x.shape:
        raise ValueError(f"seed_prompt_means: expected a non-empty (K, seeds, prompts) array, got shape {x.shape}")
    _, s, p = x.shape
    # one stream for the seed draws and one for the prompt draws: the numbers do not depend on the chunk size
    rng_seed, rng_prompt = (np.random.default_rng(c) for c in np.random.SeedSequence(seed).spawn(2))
    chunk = max(1, min(resamples, CHUNK_ELEMENTS // (s + p)))
    out = np.empty((resamples, x.shape[0]), dtype=np.float64)
    for start in range(0, resamples, chunk):
        m = min(start + chunk, resamples) - start
        n_seed = rng_seed.multinomial(s, np.full(s, 1.0 / s), size=m).astype(np.float64)  # (m, S): times each was drawn
        n_prompt = rng_prompt.multinomial(p, np.full(p, 1.0 / p), size=m).astype(np.float64)  # (m, P)
        # integer counts, one division at the end: 0/1 scores sum exactly
        out[start:start + m] = np.einsum("ms,ksp,mp->mk", n_seed, x, n_prompt, optimize=True) / (s * p)
    return out


def percentile_interval(replicates, confidence: float = 0.95) -> tuple[float, float]:
    """(low, high): the alpha/2 and 1 - alpha/2 quantiles of bootstrap replicates (1-D)."""
    _check(confidence, 1)
    alpha = 1.0 - confidence
    low, high = np.quantile(np.asarray(replicates, dtype=np.float64), [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def seed_prompt_diff(a, b, confidence: float = 0.95, resamples: int = 10_000,
                     seed: int = 0) -> tuple[float, float, float]:
    """(mean(b) - mean(a), low, high) for two (S, P) score arrays, seed i and prompt j of one paired with seed i and
    prompt j of the other, the interval resampling seeds and prompts (`seed_prompt_means`). S = 1 is
    `paired_bootstrap_diff` but for the draws. Raises ValueError when the shapes differ."""
    _check(confidence, resamples)
    x, y = _seeds_by_prompts(a, "a"), _seeds_by_prompts(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"seed_prompt_diff: a is {x.shape} and b is {y.shape} (seeds, prompts); a paired difference "
                         "needs the same seeds and prompts in each")
    d = y - x
    low, high = percentile_interval(seed_prompt_means(d[None], resamples, seed)[:, 0], confidence)
    return float(d.mean()), low, high


def ratio_interval(numerators, denominators, confidence: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of num/den over paired bootstrap replicates (1-D each), or None when it is unbounded:
    when the denominators' own interval reaches 0 (as Fieller's interval for a ratio is then unbounded), a
    denominator near 0 makes the ratio as large as you like, and no finite interval would be honest.

    Otherwise at most alpha/2 of the replicates have den <= 0; those count as +inf when num > 0 and -inf otherwise,
    and the quantiles are order statistics (no interpolation toward an infinite value)."""
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1 or len(num) == 0:
        raise ValueError(f"ratio_interval: {num.shape} numerators and {den.shape} denominators (one each, 1-D)")
    if percentile_interval(den, confidence)[0] <= 0:
        return None
    positive = den > 0
    ratios = np.where(positive, num / np.where(positive, den, 1.0), np.where(num > 0, np.inf, -np.inf))
    alpha = 1.0 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return float(low), float(high)


def two_sided(low: float, high: float) -> str:
    """A difference's verdict from its interval: "higher" or "lower" when the interval excludes 0, else "same"."""
    return "higher" if low > 0 else "lower" if high < 0 else "same"


@dataclass(frozen=True)
class GainComparison:
    """Two sides' gains over one start model and how they compare; every interval over seeds and prompts."""

    gain_a: float
    gain_a_ci: tuple[float, float]
    gain_b: float
    gain_b_ci: tuple[float, float]
    diff: float  # gain_b - gain_a
    diff_ci: tuple[float, float]
    ratio: float | None  # gain_b / gain_a; None when gain_a <= 0
    ratio_ci: tuple[float, float] | None  # None: unbounded, gain_a's interval reaches 0


def compare_gains(start, a, b, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0) -> GainComparison:
    """Side b's gain over the start against side a's: start (P,) the start model's per-prompt scores, a and b (S, P)
    the end models' (seed i of a paired with seed i of b, prompt j the same prompt everywhere). Every replicate draws
    one seed resample and one prompt resample for all three (`seed_prompt_means`), so the start's score cancels from
    the difference: diff's interval is `seed_prompt_diff(a, b)`'s. The ratio's interval comes from the same
    replicates (`ratio_interval`: None when a's gain interval reaches 0)."""
    _check(confidence, resamples)
    x, y = _seeds_by_prompts(a, "a"), _seeds_by_prompts(b, "b")
    s0 = np.asarray(start, dtype=np.float64)
    if x.shape != y.shape or s0.shape != x.shape[1:]:
        raise ValueError(f"compare_gains: start {s0.shape}, a {x.shape} and b {y.shape}: expected (P,), (S, P), (S, P)")
    gains = np.stack([x - s0, y - s0, y - x])  # (3, S, P)
    reps = seed_prompt_means(gains, resamples, seed)  # (resamples, 3)
    g_a, g_b, d = (float(v) for v in gains.mean(axis=(1, 2)))
    return GainComparison(gain_a=g_a, gain_a_ci=percentile_interval(reps[:, 0], confidence),
                          gain_b=g_b, gain_b_ci=percentile_interval(reps[:, 1], confidence),
                          diff=d, diff_ci=percentile_interval(reps[:, 2], confidence),
                          ratio=g_b / g_a if g_a > 0 else None,
                          ratio_ci=ratio_interval(reps[:, 1], reps[:, 0], confidence))


# ---------------------------------------------------------------------------- time to accuracy


def time_to_reach(times, accuracies, target: float) -> float | None:
    """When a learning curve (accuracies[i] at times[i], times non-decreasing) first reaches `target`: 0.0 when its
    first point is already at or above it; else linear between the two points around the first crossing,
    t[i-1] + (target - acc[i-1]) / (acc[i] - acc[i-1]) * (t[i] - t[i-1]); None when it never gets there."""
    t, acc = _as_1d(times, "times"), _as_1d(accuracies, "accuracies")
    if len(t) != len(acc) or len(t) == 0:
        raise ValueError(f"time_to_reach: {len(t)} times and {len(acc)} accuracies (one each, at least one point)")
    if acc[0] >= target:
        return 0.0
    for i in range(1, len(t)):
        if acc[i] >= target:  # acc[i - 1] < target <= acc[i]: the denominator is above 0
            return float(t[i - 1] + (target - acc[i - 1]) / (acc[i] - acc[i - 1]) * (t[i] - t[i - 1]))
    return None


def _speedup(t_a: float, t_b: float | None) -> float:
    """t_a / t_b; 0.0 when b never reached the target, +inf when it started at or above it."""
    if t_b is None:
        return 0.0
    return math.inf if t_b == 0 else t_a / t_b


@dataclass(frozen=True)
class TimeToAccuracy:
    """How much sooner side b reaches side a's final accuracy than a does; the interval over seeds and prompts."""

    target: float  # a's final accuracy: the mean over seeds and prompts at its last point
    t_a: float  # when a's seed-mean curve first reaches the target (at its last point at the latest)
    t_b: float | None  # the same for b; None: never
    speedup: float  # t_a / t_b: 0.0 when b never reaches the target, +inf when b starts at or above it
    ci: tuple[float, float]
    never_reached_share: float  # the share of replicates in which b never reached the target
    seeds: int
    prompts: int


def compare_time_to_accuracy(a, times_a, b, times_b, confidence: float = 0.95, resamples: int = 10_000,
                             seed: int = 0) -> TimeToAccuracy:
    """Side b's time to reach side a's final accuracy against a's own time. a (S, T_a, P) and b (S, T_b, P): each
    seed's per-prompt correctness at each point of its curve (the start, snapshots, the end; the same P prompts
    everywhere), times_a (S, T_a) and times_b (S, T_b) the seconds of training at those points. A side's curve is the
    mean over seeds and prompts at each point, at the mean of its seeds' times there.

    The interval draws the seeds (seed k of a with seed k of b) and the prompts (one draw for every seed, both sides
    and every point) with replacement, as `seed_prompt_means` does, and recomputes the target, t_a, t_b and t_a / t_b
    in each replicate; its bounds are order statistics (numpy's "inverted_cdf"), so an infinite replicate is never
    averaged into a finite bound."""
    _check(confidence, resamples)
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ta, tb = np.asarray(times_a, dtype=np.float64), np.asarray(times_b, dtype=np.float64)
    if (x.ndim != 3 or y.ndim != 3 or 0 in x.shape or 0 in y.shape or x.shape[0] != y.shape[0]
            or x.shape[2] != y.shape[2] or ta.shape != x.shape[:2] or tb.shape != y.shape[:2]):
        raise ValueError(f"compare_time_to_accuracy: a {x.shape}, b {y.shape}, times_a {ta.shape}, times_b "
                         f"{tb.shape}: expected (S, T_a, P), (S, T_b, P), (S, T_a), (S, T_b), the same S and P")
    s, n_a, p = x.shape
    # every point's scores and its times as (S, P) arrays of one draw: a time is the same for each prompt, so its
    # replicate is the drawn seeds' mean time
    stacked = np.concatenate([x.transpose(1, 0, 2), y.transpose(1, 0, 2),
                              np.repeat(ta.T[:, :, None], p, axis=2), np.repeat(tb.T[:, :, None], p, axis=2)])
    reps = seed_prompt_means(stacked, resamples, seed)  # (resamples, 2 * (T_a + T_b))
    n_ab = n_a + y.shape[1]

    def measure(curve_a, curve_b, clock_a, clock_b) -> tuple[float, float, float | None]:
        target = curve_a[-1]
        t_a = time_to_reach(clock_a, curve_a, target)  # never None: a's last point is the target
        return target, t_a, time_to_reach(clock_b, curve_b, target)

    ratios, never = np.empty(resamples), 0
    for r, row in enumerate(reps):
        _, t_a, t_b = measure(row[:n_a], row[n_a:n_ab], row[n_ab:n_ab + n_a], row[n_ab + n_a:])
        ratios[r] = _speedup(t_a, t_b)
        never += t_b is None
    target, t_a, t_b = measure(x.mean(axis=(0, 2)), y.mean(axis=(0, 2)), ta.mean(axis=0), tb.mean(axis=0))
    alpha = 1.0 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return TimeToAccuracy(target=float(target), t_a=t_a, t_b=t_b, speedup=_speedup(t_a, t_b),
                          ci=(float(low), float(high)), never_reached_share=never / resamples, seeds=s, prompts=p)
