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
- Resamples are drawn in chunks of at most `CHUNK_ELEMENTS` indices, so memory stays bounded for
  any n; the numbers do not depend on the chunk size (one generator, drawn in order).
"""

from __future__ import annotations

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
