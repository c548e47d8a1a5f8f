"""Confidence intervals for eval accuracies: percentile bootstrap of a mean, and of a paired difference.

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
- Resamples are drawn in chunks of at most `CHUNK_ELEMENTS` indices, so memory stays bounded for
  any n; the numbers do not depend on the chunk size (one generator, drawn in order).
"""

from __future__ import annotations

from collections.abc import Sequence

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
