"""Rewards: answer extraction, the R1 format check, verifiers and pass@k.

Small deterministic checkers in the spirit of open-r1's `rewards.py`: a completion and a
`prompts` row in, a `Verdict` out. `None` always means "could not score" (no reference answer,
verifier "none", a reference math-verify cannot read, or math-verify failing on the input) and
is never folded into 0: a wrong answer is 0, an unscoreable one is a null in the `correct`
and `reward` columns.

Completions follow the DeepSeek-R1 format `<think>…</think><answer>…</answer>` (R1 paper §2.2.1:
an accuracy reward from a rule-based verifier plus a format reward). Departures from the paper:
the format reward is computed but weighted 0 by default (`DEFAULT_WEIGHTS`), and
reasoning-gym's partial credit is kept as its own component rather than used as the reward.

math-verify and threads (DESIGN.md §6): math-verify's own time limit uses `signal.alarm`, which
raises in any thread but the main one. It is called here with `parsing_timeout=None` and
`timeout_seconds=None` so that scoring works in Prefect's worker threads. The time limit must
therefore come from the caller (e.g. score in a process pool with a deadline): a pathological
answer such as `10^{10^{10}}` can make sympy run for a long time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

log = logging.getLogger(__name__)

R1_FORMAT_EXAMPLE = "<think> 7 * 6 = 42 </think> <answer>42</answer>"
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant. First think step by step inside <think> </think> tags, "
    "then give only the final answer inside <answer> </answer> tags. "
    f"Example: {R1_FORMAT_EXAMPLE}"
)

# (extracted answer or None, prompts row) -> score in [0, 1], or None when it cannot be scored.
Verifier = Callable[[str | None, Mapping[str, Any]], float | None]

DEFAULT_WEIGHTS: Mapping[str, float] = MappingProxyType({"accuracy": 1.0, "format": 0.0})

_THINK_TAG = re.compile(r"</?think>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
_R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_R1_FORMAT = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
_CHOICE = re.compile(r"\(?([a-z])[).]?")


# --------------------------------------------------------------------------- extraction


def _outside_think(completion: str) -> str:
    """The completion with every thinking span removed.

    Thinking is `<think>…</think>`; an unclosed `<think>` runs to the end; a `</think>` with no
    opening tag before it (chat templates that open `<think>` in the prompt) makes everything
    before it thinking.
    """
    visible: list[str] = []
    pos, thinking = 0, False
    for tag in _THINK_TAG.finditer(completion):
        if tag.group() == "<think>":
            if not thinking:
                visible.append(completion[pos : tag.start()])
                thinking = True
        elif thinking:
            thinking, pos = False, tag.end()
        else:  # stray </think>: what came before was thinking
            visible, pos = [], tag.end()
    if not thinking:
        visible.append(completion[pos:])
    return "\n".join(visible)


def _last_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{…}` with balanced braces (`\\{`, `\\}` are literal)."""
    found: str | None = None
    start = text.find(_BOXED)
    while start != -1:
        depth, i, end = 1, start + len(_BOXED), None
        while i < len(text):
            ch = text[i]
            if ch == "\\":
                i += 2  # an escaped character, e.g. \{ in a set
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            i += 1
        if end is None:  # unbalanced: nothing later can close either
            break
        found = text[start + len(_BOXED) : end]
        start = text.find(_BOXED, end + 1)  # skip boxes nested inside this one
    return found


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion, or None if it gives none.

    The content of the last `<answer>…</answer>` block; else the last `\\boxed{…}`. Both are
    looked for only outside the thinking part (see `_outside_think`). A `\\boxed{x}` inside the
    answer block yields x. Whitespace is stripped; an empty answer is None.

    >>> extract_answer("<think>maybe <answer>1</answer></think><answer> 2 </answer>")
    '2'
    >>> extract_answer("so \\\\boxed{\\\\frac{63}{400}}")
    '\\\\frac{63}{400}'
    >>> extract_answer("<think>\\\\boxed{5}") is None
    True
    """
    visible = _outside_think(completion)
    blocks = _ANSWER_BLOCK.findall(visible)
    if blocks:
        answer = blocks[-1]
        boxed = _last_boxed(answer)
        answer = boxed if boxed is not None else answer
    else:
        answer = _last_boxed(visible)
    if answer is None:
        return None
    return answer.strip() or None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_answer_lenient(completion: str) -> str | None:
    """`extract_answer`, else the last number outside the thinking part.

    For evaluation only: it measures what a model knows before it has learnt the answer format
    (a base model that writes "2 + 3 = 5" gets credit). Rewards never use it — an RL policy
    would learn to spray numbers.

    >>> extract_answer_lenient("2 + 3 = 5")
    '5'
    >>> extract_answer_lenient("<think>7</think> no idea") is None
    True
    """
    strict = extract_answer(completion)
    if strict is not None:
        return strict
    numbers = _NUMBER.findall(_outside_think(completion))
    return numbers[-1] if numbers else None


# --------------------------------------------------------------------------- format


def format_ok(completion: str) -> bool:
    """Whether the completion is exactly `<think>…</think><answer>…</answer>`.

    Each tag appears exactly once, in that order; only whitespace before `<think>`, between
    `</think>` and `<answer>`, and after `</answer>`; the answer is not blank. The think part
    may be empty: the format asks where reasoning goes, not that there is any (R1-Zero style
    short answers stay well formed; the accuracy reward judges them).

    >>> format_ok("<think></think><answer>42</answer>")
    True
    >>> format_ok("<answer>42</answer>")
    False
    """
    if any(completion.count(tag) != 1 for tag in _R1_TAGS):
        return False
    match = _R1_FORMAT.fullmatch(completion)
    return match is not None and match.group(2).strip() != ""


def format_reward(completion: str) -> float:
    """1.0 if `format_ok(completion)` else 0.0."""
    return 1.0 if format_ok(completion) else 0.0


def gold_completion(answer: str, think: str) -> str:
    """A well-formed R1 completion for a known answer (SFT targets built from gold answers).

    Raises ValueError if the result would not pass `format_ok` (blank answer, or tags in it).

    >>> gold_completion("42", "6 * 7 = 42")
    '<think>\\n6 * 7 = 42\\n</think>\\n<answer>42</answer>'
    """
    completion = f"<think>\n{think}\n</think>\n<answer>{answer}</answer>"
    if not format_ok(completion):
        raise ValueError(f"gold_completion: answer {answer!r} / think {think[:80]!r} do not make a well-formed R1 completion")
    return completion


# --------------------------------------------------------------------------- verifiers


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


def verify_reasoning_gym(extracted: str | None, row: Mapping[str, Any]) -> float | None:
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


def _mv_parse(text: str) -> list[Any]:
    # An extracted answer is one expression: reading it as LaTeX math ($…$) keeps "2x" as 2*x and
    # "1,2" as a set, where bare parsing finds "2" and 1.2. Bare parsing is the fallback.
    # timeouts off: see the module docstring; raise_on_error so failures are not scored False.
    for candidate in (f"${text}$", text):
        parsed = mv_parse(candidate, parsing_timeout=None, raise_on_error=True)
        if parsed:
            return parsed
    return []


def verify_math(extracted: str | None, row: Mapping[str, Any]) -> float | None:
    """math-verify equivalence of the answer and row["answer"]: 1.0 or 0.0.

    1/2 = 0.5 = \\frac{1}{2}. None if there is no reference, the reference parses to nothing,
    or math-verify raises (e.g. a reference of 1/0, which math-verify's default mode would
    silently score False). No answer, or one with no math in it, is 0.0. No time limit: the
    caller must impose one (module docstring).
    """
    reference = row.get("answer")
    if reference is None:
        return None
    try:
        gold = _mv_parse(reference)
        if not gold:
            log.warning("math verifier: reference %r of row %r does not parse", reference, row.get("id"))
            return None
        if extracted is None:
            return 0.0
        pred = _mv_parse(extracted)
        if not pred:
            return 0.0
        same = mv_verify(gold, pred, timeout_seconds=None, raise_on_error=True)
    except Exception as e:  # math-verify/sympy failure: could not score, never "wrong"
        log.warning("math verifier failed on row %r (%s: %s); scored None", row.get("id"), type(e).__name__, e)
        return None
    return 1.0 if same else 0.0


def _normalize(text: str) -> str:
    """strip, casefold, collapse whitespace; a lone choice letter "(B)", "B)", "B." -> "b"."""
    text = " ".join(text.split()).casefold()
    choice = _CHOICE.fullmatch(text)
    return choice.group(1) if choice else text


def verify_exact(extracted: str | None, row: Mapping[str, Any]) -> float | None:
    """1.0 if the normalized answer equals the normalized row["answer"], else 0.0; None without a reference.

    >>> verify_exact("(B)", {"answer": " b"})
    1.0
    """
    reference = row.get("answer")
    if reference is None:
        return None
    if extracted is None:
        return 0.0
    return 1.0 if _normalize(extracted) == _normalize(reference) else 0.0


def verify_none(extracted: str | None, row: Mapping[str, Any]) -> float | None:
    """Rows nobody can check (e.g. open-ended chat prompts): always None."""
    return None


VERIFIERS: Mapping[str, Verifier] = MappingProxyType({
    "reasoning_gym": verify_reasoning_gym,
    "math": verify_math,
    "exact": verify_exact,
    "none": verify_none,
})


def get_verifier(name: str) -> Verifier:
    """The verifier registered as `name`; ValueError naming it and the known ones otherwise."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(VERIFIERS)}") from None


# --------------------------------------------------------------------------- score


@dataclass(frozen=True)
class Verdict:
    """The scoring of one completion against one prompts row.

    correct: the verifier's score >= 1.0 (so reasoning-gym partial credit is not correct);
        None when the row cannot be scored.
    extracted: `extract_answer(completion)`.
    correct_lenient: like `correct`, but an answer missing from the answer block falls back to
        the last number outside the thinking part (evaluation only; see extract_answer_lenient).
    format_ok: `format_ok(completion)`.
    reward: sum of weight * component over the weights; None when a component with a non-zero
        weight is absent (with the default weights: whenever correct is None).
    components: "format" (1/0) always; "accuracy" (1/0) and the verifier's raw score under its
        own name (e.g. "reasoning_gym": 0.5) when the row could be scored.
    """

    correct: bool | None
    extracted: str | None
    format_ok: bool
    reward: float | None
    components: dict[str, float]
    correct_lenient: bool | None = None


def score(row: Mapping[str, Any], completion: str, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> Verdict:
    """Score `completion` against a `prompts` row, routed by row["verifier"] through `VERIFIERS`.

    `weights` maps component names ("accuracy", "format", or a verifier name for its raw
    score) to weights; an unknown name raises ValueError rather than silently weighing nothing.
    """
    known = {"accuracy", "format", *VERIFIERS}
    unknown = set(weights) - known
    if unknown:
        raise ValueError(f"unknown reward weight(s) {sorted(unknown)}; known components: {sorted(known)}")
    name = row["verifier"]
    verifier = get_verifier(name)
    extracted = extract_answer(completion)
    well_formed = format_ok(completion)
    raw = verifier(extracted, row)
    components = {"format": 1.0 if well_formed else 0.0}
    correct: bool | None = None
    if raw is not None:
        correct = raw >= 1.0
        components[name] = raw
        components["accuracy"] = 1.0 if correct else 0.0
    reward: float | None = None
    if all(k in components for k, w in weights.items() if w != 0):
        reward = sum(w * components[k] for k, w in weights.items() if w != 0)
    correct_lenient = correct
    if extracted is None and correct is not None:
        lenient = extract_answer_lenient(completion)
        raw_lenient = verifier(lenient, row) if lenient is not None else None
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
