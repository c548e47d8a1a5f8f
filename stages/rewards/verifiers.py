"""Rewards: verifiers, the weighted score of a completion, and pass@k.

Small deterministic checkers in the spirit of open-r1's `rewards.py`: a completion and a
`prompts` row in, a `Verdict` out. `None` always means "could not score" (no reference answer,
verifier "none", a reference math-verify cannot read, math-verify failing or running past its
deadline, a code task without tests) and is never folded into 0: a wrong answer is 0, an
unscoreable one is a null in the `correct` and `reward` columns.

R1 paper §2.2.1: an accuracy reward from a rule-based verifier plus a format reward. `score` adds
the shaping terms later recipes use (`shaping`; R1's language-consistency reward §2.3.2,
`answers.language_consistency`; a reward model's score) and weighs them with `RewardSpec.weights`.
Departures from the paper: the weights are ours (`RewardSpec`), and reasoning-gym's partial credit
is kept as its own component rather than used as the reward.

Answer extraction and the format check: `answers`; the math verifier's process pool: `math_verifier`.
Code rows (verifier "code") judge a program (`extract_program`) by the fraction of the row's
stdin/stdout tests it passes in `stages.rewards.sandbox`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from schemas.configs import RewardSpec
from stages.rewards.answers import (
    Extractor,
    extract_answer,
    extract_answer_lenient,
    extract_answer_strict,
    extract_program,
    format_ok,
    language_consistency,
    tag_count_reward,
)
from stages.rewards.math_verifier import verify_math
from stages.rewards.shaping import cosine_scaled, overlong_penalty, repetition_penalty

_CHOICE = re.compile(r"\(?([a-z])[).]?")

# (extracted answer or None, prompts row, reward spec) -> score in [0, 1], or None when it cannot be scored.
Verifier = Callable[[str | None, Mapping[str, Any], RewardSpec], float | None]



def _metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's metadata as a dict (the Arrow column stores JSON text)."""
    meta = row.get("metadata")
    if meta is None:
        return {}
    return json.loads(meta) if isinstance(meta, str) else dict(meta)


@functools.cache
def _rg_scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    # Imported here: reasoning_gym takes ~1 s to import and most callers never score with it.
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def verify_reasoning_gym(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """The task's own reasoning-gym checker: a float in [0, 1] (partial credit allowed).

    The entry is rebuilt from the row: question = metadata["question"] (else the last user
    turn), answer = row["answer"], metadata = the row's metadata. The task is
    metadata["source_dataset"] (right for composite datasets), else row["task"]. A missing
    answer is passed on as None, which reasoning-gym scores 0. A reference answer of None is
    not "unscoreable" here: tasks such as graph_color check the answer against the question.
    Errors from the checker propagate: it is plain Python over our own strings, so an
    exception is a bug to see, not a verdict.
    """
    meta = _metadata(row)
    question = meta.get("question")
    if question is None:
        question = next((m["content"] for m in reversed(row.get("messages") or []) if m["role"] == "user"), "")
    entry = {"question": question, "answer": row.get("answer"), "metadata": meta}
    task = meta.get("source_dataset") or row["task"]
    return float(_rg_scorer(task)(extracted, entry))


# ---- other verifiers


def _normalize(text: str) -> str:
    """strip, casefold, collapse whitespace; a lone choice letter "(B)", "B)", "B." -> "b"."""
    text = " ".join(text.split()).casefold()
    choice = _CHOICE.fullmatch(text)
    return choice.group(1) if choice else text


def verify_exact(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """1.0 if the normalized answer equals the normalized row["answer"], else 0.0; None without a reference.

    >>> verify_exact("(B)", {"answer": " b"}, RewardSpec())
    1.0
    """
    reference = row.get("answer")
    if reference is None:
        return None
    if extracted is None:
        return 0.0
    return 1.0 if _normalize(extracted) == _normalize(reference) else 0.0


def verify_code(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """The fraction of the row's tests the program passes, run in the sandbox (`spec.sandbox`).

    `extracted` is the program (`extract_program`). Tests are metadata["tests"], a list of
    {"input": stdin text, "output": expected stdout}; none -> None (could not score). No program
    is 0.0. Sandbox errors propagate: a sandbox that cannot run is a fault, not a verdict.
    """
    tests = _metadata(row).get("tests")
    if not tests:
        return None
    if not isinstance(tests, list) or not all(isinstance(case, dict) for case in tests):
        raise ValueError(f"code verifier: row {row.get('id')!r}: metadata 'tests' must be a list of "
                         f"{{'input': str, 'output': str}} objects, got {str(tests)[:200]}")
    if extracted is None:
        return 0.0
    # Imported here: only code rows need it.
    from stages.rewards.sandbox import run_tests

    return float(run_tests(extracted, list(tests), spec.sandbox))


def verify_none(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """Rows nobody can check (e.g. open-ended chat prompts): always None."""
    return None


VERIFIERS: Mapping[str, Verifier] = MappingProxyType({
    "reasoning_gym": verify_reasoning_gym,
    "math": verify_math,
    "exact": verify_exact,
    "code": verify_code,
    "none": verify_none,
})

# Verifier name -> (extractor, lenient extractor for evaluation) where the judged answer is not the
# R1 answer; every other verifier judges `extract_answer` (leniently `extract_answer_lenient`).
EXTRACTORS: Mapping[str, tuple[Extractor, Extractor]] = MappingProxyType({
    "code": (extract_program, extract_program),
})
_R1_ANSWER: tuple[Extractor, Extractor] = (extract_answer, extract_answer_lenient)
# RewardSpec.strict_answer: only the strict answer is rewarded; evaluation's lenient measure is unchanged.
_R1_ANSWER_STRICT: tuple[Extractor, Extractor] = (extract_answer_strict, extract_answer_lenient)


def get_verifier(name: str) -> Verifier:
    """The verifier registered as `name`; ValueError naming it and the known ones otherwise."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(VERIFIERS)}") from None



@dataclass(frozen=True)
class Verdict:
    """The scoring of one completion against one prompts row.

    correct: the verifier's score >= 1.0 (so reasoning-gym partial credit and code passing
        some tests are not correct); None when the row cannot be scored.
    extracted: what the verifier judged: `extract_answer(completion)` (`extract_answer_strict` under
        `RewardSpec.strict_answer`), or for code rows the program (`EXTRACTORS`).
    correct_lenient: like `correct`, but an answer missing from the answer block falls back to
        the last number outside the thinking part (evaluation only; see extract_answer_lenient).
    format_ok: `format_ok(completion)`.
    reward: sum of weight * component over `RewardSpec.weights`; None when a component with a
        non-zero weight is absent (with the default weights: whenever correct is None).
    components: see `score`.
    """

    correct: bool | None
    extracted: str | None
    format_ok: bool
    reward: float | None
    components: dict[str, float]
    correct_lenient: bool | None = None


# The components a weight of `RewardSpec.weights` may name besides a verifier's own (the reference page lists them).
COMPONENTS = ("accuracy", "format", "tags", "overlong", "repetition", "cosine", "language", "reward_model")


def score(
    row: Mapping[str, Any],
    completion: str,
    spec: RewardSpec | None = None,
    *,
    num_tokens: int | None = None,
    rm_score: float | None = None,
) -> Verdict:
    """Score `completion` against a `prompts` row, routed by row["verifier"] through `VERIFIERS`.

    `spec` defaults to `RewardSpec()`. Components (`Verdict.components`):
        format        1/0, always;
        accuracy      1/0, and the verifier's raw score under its own name (e.g. "reasoning_gym":
                      0.5, "code": 2/3), when the row could be scored;
        overlong      `overlong_penalty(num_tokens, …)`, when num_tokens is given;
        cosine        `cosine_scaled(correct, num_tokens, spec)`, when num_tokens is given and the
                      row could be scored;
        repetition    `repetition_penalty(completion, …)`, always;
        language      `language_consistency(completion, spec.language_script)`, always;
        reward_model  rm_score, when given.
    With `spec.strict_answer`, answer verifiers (all but code) judge `extract_answer_strict`.
    The reward is the weighted sum over `spec.weights` (None if a non-zero weight names an
    absent component); a weight naming no component raises ValueError.
    """
    spec = spec if spec is not None else RewardSpec()
    known = {*COMPONENTS, *VERIFIERS}
    unknown = set(spec.weights) - known
    if unknown:
        raise ValueError(f"unknown reward weight(s) {sorted(unknown)}; known components: {sorted(known)}")
    name = row["verifier"]
    verifier = get_verifier(name)
    extract, extract_lenient = EXTRACTORS.get(name, _R1_ANSWER_STRICT if spec.strict_answer else _R1_ANSWER)
    extracted = extract(completion)
    well_formed = format_ok(completion)
    raw = verifier(extracted, row, spec)

    components = {"format": 1.0 if well_formed else 0.0, "tags": tag_count_reward(completion)}
    correct: bool | None = None
    if raw is not None:
        correct = raw >= 1.0
        components[name] = raw
        components["accuracy"] = 1.0 if correct else 0.0
    if num_tokens is not None:
        components["overlong"] = overlong_penalty(num_tokens, spec.overlong_max_tokens, spec.overlong_buffer)
        if correct is not None:
            components["cosine"] = cosine_scaled(correct, num_tokens, spec)
    components["repetition"] = repetition_penalty(completion, spec.repetition_ngram, spec.repetition_max_penalty)
    components["language"] = language_consistency(completion, spec.language_script)
    if rm_score is not None:
        components["reward_model"] = float(rm_score)

    weighted = {k: w for k, w in spec.weights.items() if w != 0}
    reward: float | None = None
    if all(k in components for k in weighted):
        reward = sum(w * components[k] for k, w in weighted.items())

    correct_lenient = correct
    if extracted is None and correct is not None:
        lenient = extract_lenient(completion)
        raw_lenient = verifier(lenient, row, spec) if lenient is not None else None
        correct_lenient = raw_lenient >= 1.0 if raw_lenient is not None else False
    return Verdict(correct=correct, extracted=extracted, format_ok=well_formed, reward=reward, components=components,
                   correct_lenient=correct_lenient)




# --------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv:2107.03374).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which
    avoids the huge binomials (the paper's numerically stable form).

    >>> pass_at_k(4, 1, 1)  # 1 - 3/4
    0.25
    >>> pass_at_k(4, 1, 2)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    >>> round(pass_at_k(5, 2, 2), 12)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    0.7
    """
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
