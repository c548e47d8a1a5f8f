"""Best-of-N at test time: which of N sampled completions of a prompt to answer with.

- `majority_pick`: self-consistency, the completion whose extracted answer is the most frequent
  (answers compared after whitespace is stripped; unanswered completions never vote; a tie goes to
  the answer seen first, so the pick is a pure function of the samples' order);
- `best_pick`: the completion with the highest score (an outcome reward model's reward, or a process
  reward model's step scores aggregated by `stages.math.steps.aggregate_step_scores`); a tie goes to the first,
  and a NaN score (a completion without steps) never wins over a number;
- `rerank_accuracy`: the share of prompts whose picked completion is correct.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def majority_pick(answers: Sequence[str | None]) -> int:
    """Index of the first completion carrying the most frequent answer; 0 when none has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None or not str(a).strip():
            continue
        key = str(a).strip()
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return 0
    best = max(counts.values())
    return min(first[k] for k, c in counts.items() if c == best)


def best_pick(scores: Sequence[float]) -> int:
    """Index of the highest score (the first on a tie); NaN scores rank below every number."""
    if not scores:
        raise ValueError("best_pick: no scores")
    keyed = [(-math.inf if s is None or math.isnan(s) else float(s)) for s in scores]
    return max(range(len(keyed)), key=lambda i: (keyed[i], -i))


def rerank_accuracy(correct: Sequence[Sequence[bool | None]], picks: Sequence[int]) -> float:
    """Share of prompts whose picked completion is correct (an unscored completion counts as wrong)."""
    if len(correct) != len(picks):
        raise ValueError(f"rerank_accuracy: {len(correct)} prompts but {len(picks)} picks")
    if not correct:
        return math.nan
    return sum(bool(c[p]) for c, p in zip(correct, picks, strict=True)) / len(correct)
