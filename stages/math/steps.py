"""Process reward models, the pure pieces: cutting a solution into steps, the token where each step
ends, Monte-Carlo step labels, the PRM loss, its metrics, and aggregating step scores.

References:
- PRM and its labels: Lightman et al. 2023, "Let's Verify Step by Step" (PRM800K),
  https://arxiv.org/abs/2305.20050 — a solution's score is the product of its step scores (§2.6);
  the min is the other common choice (Wang et al. 2024; both are in `AGGREGATIONS`).
- Automatic labels: Wang et al. 2024, "Math-Shepherd", https://arxiv.org/abs/2312.08935, §3.3: from
  each step prefix roll out N completions; hard estimation = 1 if any reaches the right answer,
  soft estimation = the share that do (`mc_labels`).
- First-error-step accuracy follows ProcessBench (Zheng et al. 2024, https://arxiv.org/abs/2412.06559):
  the index of the earliest wrong step, or "none" (-1) when every step is right.

Departure: a step's text is trimmed of surrounding whitespace and blank steps are dropped, so a
blank line between steps (or a run of them) is never a step of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# A delimiter names a regex that matches the *gap* between steps (zero-width for "step_k": the
# marker "Step k:" starts a step and stays in it), and the separator `join_steps` puts back.
DELIMITERS: dict[str, tuple[str, str]] = {
    "blank_line": (r"\n[ \t]*\n\s*", "\n\n"),
    "newline": (r"\n\s*", "\n"),
    "step_k": (r"(?=\bStep \d+\s*:)", "\n"),
}
NO_ERROR = -1  # first_error_index of a solution whose every step is right


def _delimiter(name: str) -> tuple[str, str]:
    try:
        return DELIMITERS[name]
    except KeyError:
        raise ValueError(f"unknown step delimiter {name!r}; known: {', '.join(DELIMITERS)}") from None


def step_spans(text: str, delimiter: str = "blank_line") -> list[tuple[int, int]]:
    """(start, end) character spans, end exclusive, of the steps of `text`, in order.

    Pieces between delimiter matches are trimmed of whitespace; blank pieces are not steps. Text
    without a delimiter is one step; blank text has none. E.g. blank_line on "a\\n\\n\\n\\nb " →
    [(0, 1), (5, 6)].
    """
    gap, _ = _delimiter(delimiter)
    spans, start = [], 0
    for m in [*re.finditer(gap, text), None]:
        stop = m.start() if m is not None else len(text)
        piece = text[start:stop]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            spans.append((start + lead, start + len(piece.rstrip())))
        if m is not None:
            start = m.end()
    return spans


def split_steps(text: str, delimiter: str = "blank_line") -> list[str]:
    """The steps of `text` (see `step_spans`)."""
    return [text[s:e] for s, e in step_spans(text, delimiter)]


def cap_spans(spans: list[tuple[int, int]], max_steps: int) -> list[tuple[int, int]]:
    """At most `max_steps` spans: the steps beyond are folded into the last kept one (the solution's
    end, where its outcome is known, stays a step end)."""
    if max_steps < 1:
        raise ValueError(f"cap_spans: max_steps={max_steps} must be >= 1")
    if len(spans) <= max_steps:
        return list(spans)
    return [*spans[: max_steps - 1], (spans[max_steps - 1][0], spans[-1][1])]


def join_steps(steps: Sequence[str], delimiter: str = "blank_line") -> tuple[str, list[int]]:
    """(text, step ends): the steps joined by the delimiter's separator, and each step's end
    (exclusive character offset) in that text. `step_spans(text)` gives the steps back when no step
    contains the delimiter itself."""
    _, sep = _delimiter(delimiter)
    text, ends = "", []
    for i, step in enumerate(steps):
        text += (sep if i else "") + step
        ends.append(len(text))
    return text, ends


def boundary_positions(offsets: Sequence[tuple[int, int]], char_ends: Sequence[int]) -> list[int]:
    """Token index where each step ends: the token holding the step's last character.

    offsets: (start, end) character span of every token (a fast tokenizer's offset mapping; (0, 0)
    for special tokens, which are never chosen); char_ends: exclusive end of each step, increasing.
    A last character no token covers (a tokenizer that drops some whitespace) falls back to the last
    token that starts before it. Raises ValueError when two steps would end at the same token (a
    token spanning a whole step boundary and the next step) or a step has no token.
    """
    out: list[int] = []
    for end in char_ends:
        last = end - 1
        hit = next((i for i, (s, e) in enumerate(offsets) if e > s and s <= last < e), None)
        if hit is None:
            before = [i for i, (s, e) in enumerate(offsets) if e > s and s <= last]
            hit = before[-1] if before else None
        if hit is None or (out and hit <= out[-1]):
            raise ValueError(f"boundary_positions: the step ending at character {end} has no token of its own")
        out.append(hit)
    return out


def token_ends_of(pieces: Sequence[str], char_ends: Sequence[int]) -> list[int]:
    """The token holding each step's last character, from each token's decoded text: for exclusive character
    ends `char_ends` of the text "".join(pieces), the inclusive token index whose text covers character end - 1
    (two steps may end in one token; `boundary_positions` does this from a tokenizer's offsets and refuses that).
    E.g. pieces ["ab", "c\n", "\nd"] with steps "abc" and "d" (ends 3, 6) -> [1, 2]."""
    out, stop, i = [], 0, -1
    for end in char_ends:
        while stop < end and i + 1 < len(pieces):
            i += 1
            stop += len(pieces[i])
        out.append(max(i, 0))
    return out


# ---------------------------------------------------------------------------- labels


def mc_labels(outcomes: Sequence[Sequence[bool | None]], mode: str = "soft") -> list[float | None]:
    """Math-Shepherd labels of a solution's steps from the outcomes of the rollouts from each step.

    outcomes[i]: the verifier's verdict of each rollout continued from the prefix ending at step i
    (True right, False wrong, None could not be scored, left out). soft: the share right; hard: 1.0
    if any is right, else 0.0. A step with no scored rollout gets None (no label, never a silent 0).
    """
    if mode not in ("soft", "hard"):
        raise ValueError(f"mc_labels: mode {mode!r}; expected soft or hard")
    labels: list[float | None] = []
    for rolls in outcomes:
        scored = [bool(o) for o in rolls if o is not None]
        if not scored:
            labels.append(None)
        elif mode == "soft":
            labels.append(sum(scored) / len(scored))
        else:
            labels.append(1.0 if any(scored) else 0.0)
    return labels


def hard_labels(labels: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Labels as 0./1. floats: 1 where label >= threshold. labels: any shape."""
    return (labels >= threshold).float()


# ---------------------------------------------------------------------------- loss


def prm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy of step logits against labels in [0, 1] (hard or soft), mean over real steps.

    logits, labels: (B, S) or (N,); mask: same shape, 1 at real steps (None: all). A soft label y is
    the target probability: -[y log σ(z) + (1 - y) log(1 - σ(z))], minimal at σ(z) = y.
    """
    per = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if mask is None:
        return per.mean()
    mask = mask.float()
    return (per * mask).sum() / mask.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------- metrics


def step_accuracy(probs: torch.Tensor, labels: torch.Tensor, threshold: float = 0.5) -> float:
    """Share of steps where (prob >= threshold) == (label >= threshold). probs, labels: (N,)."""
    if probs.numel() == 0:
        return float("nan")
    return float(((probs >= threshold) == (labels >= threshold)).float().mean())


def majority_baseline(labels: torch.Tensor, threshold: float = 0.5) -> float:
    """Step accuracy of always predicting the more frequent hard label. labels: (N,)."""
    if labels.numel() == 0:
        return float("nan")
    pos = float((labels >= threshold).float().mean())
    return max(pos, 1.0 - pos)


def auroc(scores: torch.Tensor, labels: torch.Tensor, threshold: float = 0.5) -> float:
    """Area under the ROC curve of `scores` for the hard labels (label >= threshold is positive):
    the probability that a random positive scores above a random negative, ties counting 1/2
    (Mann-Whitney U / (n_pos n_neg)). NaN when either class is absent. scores, labels: (N,)."""
    pos = scores[labels >= threshold].double()
    neg = scores[labels < threshold].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]  # (P, N)
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


def first_error_index(values: torch.Tensor, mask: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """(B,) index of the first real step with value < threshold, or NO_ERROR (-1). values, mask: (B, S)."""
    wrong = (values < threshold) & mask.bool()  # (B, S)
    idx = torch.arange(values.size(-1), device=values.device).expand_as(values)
    first = torch.where(wrong, idx, torch.full_like(idx, values.size(-1))).min(-1).values
    return torch.where(first == values.size(-1), torch.full_like(first, NO_ERROR), first)


def first_error_accuracy(probs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                         threshold: float = 0.5) -> float:
    """Share of solutions whose predicted first wrong step (first prob < threshold, or none) is the
    labelled one (first label < threshold, or none). probs, labels, mask: (B, S)."""
    if probs.size(0) == 0:
        return float("nan")
    return float((first_error_index(probs, mask, threshold) == first_error_index(labels, mask, threshold))
                 .float().mean())


# ---------------------------------------------------------------------------- aggregation


def _masked(fill: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda s, m: torch.where(m, s, torch.full_like(s, fill))


def _last(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    idx = (torch.arange(s.size(-1), device=s.device) * m.long()).argmax(-1)  # (B,) last real step
    return s.gather(-1, idx[:, None]).squeeze(-1)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "min": lambda s, m: _masked(float("inf"))(s, m).min(-1).values,
    "product": lambda s, m: _masked(1.0)(s, m).prod(-1),
    "last": _last,
    "mean": lambda s, m: (s * m).sum(-1) / m.sum(-1),
}


def aggregate_step_scores(scores: torch.Tensor, mask: torch.Tensor, how: str = "min") -> torch.Tensor:
    """(B,) solution scores from step scores (probabilities): min, product, last or mean over the
    real steps. scores, mask: (B, S). A solution without steps scores NaN (cannot be scored)."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown step-score aggregation {how!r}; known: {', '.join(AGGREGATIONS)}")
    mask = mask.bool()
    out = AGGREGATIONS[how](scores.double(), mask)
    return torch.where(mask.any(-1), out, torch.full_like(out, float("nan")))


# ---------------------------------------------------------------------------- data


def split_by_group(groups: Sequence[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of items whose group (their prompt) is wholly on one side, so
    no held-out solution shares a prompt with a trained one: a seeded permutation of the distinct
    groups, the first round(f · n_groups) held out (at least one when f > 0 and there are 2+ groups)."""
    import numpy as np

    distinct = sorted(set(groups))
    n_eval = 0
    if eval_fraction > 0 and len(distinct) > 1:
        n_eval = min(len(distinct) - 1, max(1, round(eval_fraction * len(distinct))))
    held = {distinct[i] for i in np.random.default_rng([seed, 1]).permutation(len(distinct))[:n_eval].tolist()}
    train = [i for i, g in enumerate(groups) if g not in held]
    return train, [i for i, g in enumerate(groups) if g in held]
