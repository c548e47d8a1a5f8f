"""Decontamination: held-out prompts against the texts a model was trained on (pure; no torch).

Three checks, each on normalised word sequences (`words`):

- **exact**: a training question (the user turns of a training row) is the held-out question.
- **n-gram overlap** (`NGRAM`, 13 words, as GPT-3's and most decontamination scripts use): a held-out prompt of at
  least 13 words is flagged when at least `MIN_COVERAGE` (0.8) of its words lie inside 13-word windows that also
  occur in some training text (question or completion). The share, not a single shared window, follows Llama 2's
  contamination study (Touvron et al. 2023, appendix A.6, "dirty" above 80%): templated prompts share long
  openings ("state the final answer to the following arithmetic problem : ..." is 9 words of template), and one
  13-word window would make every prompt of such a task collide with its neighbours.
- **answer leakage**: the held-out answer appears (as a contiguous word sequence) in a training completion whose
  question is the held-out question (a prompts row's own `answer` counts as its completion).

Short prompts. A prompt under 13 words counts only by exact match (and leakage): no shorter window is safe for
arithmetic, where "calculate 3 + 4" is a word-for-word part of "calculate 3 + 4 + 5", a different problem. Numbers
are single words, so "what is 3 + 4?" and "what is 3 + 5?" never match.

Normalisation (`words`): Unicode NFKC (full-width digits, ligatures), U+2212 MINUS SIGN as "-", case folded; the
words are numbers (digits with an optional decimal part: "3.5" is one word), runs of letters/digits/underscore,
and every other non-space character alone. Punctuation is dropped except the characters that change a math
problem (`KEPT_PUNCTUATION`: - * / % ( ) [ ]); symbols (+ = < > ^ ...) are kept. So "Calculate 5 - 3." and
"calculate 5-3" are the same question, "2 - -1" and "2 - 1" are not.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

NGRAM = 13
MIN_COVERAGE = 0.8
MAX_EXAMPLES = 5
TEXT_KINDS = ("prompts", "sft", "samples", "preferences", "unpaired", "steps")  # dataset kinds with training text
KEPT_PUNCTUATION = frozenset("-*/%()[]")
_WORD = re.compile(r"\d+(?:\.\d+)?|\w+|\S")


def words(text: str) -> tuple[str, ...]:
    """The normalised words of `text` (see the module docstring)."""
    text = unicodedata.normalize("NFKC", text).replace("\u2212", "-").casefold()
    return tuple(w for w in _WORD.findall(text)
                 if not (len(w) == 1 and unicodedata.category(w).startswith("P") and w not in KEPT_PUNCTUATION))


def contains(haystack: tuple[str, ...], needle: tuple[str, ...]) -> bool:
    """Whether `needle` occurs in `haystack` as a contiguous run of words (an empty needle never does)."""
    n = len(needle)
    return n > 0 and any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


@dataclass(frozen=True)
class TrainingRow:
    """One training row's texts: the question (its user turns) and what answered it (completions, assistant turns,
    chosen and rejected, steps; a prompts row's gold answer)."""

    question: str
    completions: tuple[str, ...] = ()
    source: str = ""  # where the row is, for examples: "<dataset> row <n>"


@dataclass(frozen=True)
class HeldOut:
    id: str
    question: str
    answer: str | None = None


@dataclass
class Finding:
    """What one held-out prompt matched: the kinds of match and the first training row of each."""

    prompt: HeldOut
    kinds: dict[str, str] = field(default_factory=dict)  # "exact" | "ngram" | "answer_leak" -> source


def user_text(messages: list[dict]) -> str:
    """The user turns of a conversation, joined: the question (a shared system prompt is not part of it)."""
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def assistant_texts(messages: list[dict]) -> tuple[str, ...]:
    return tuple(m["content"] for m in messages if m["role"] == "assistant")


def training_rows(kind: str, rows: list[dict], label: str, held_out_split: str) -> list[TrainingRow]:
    """The texts of a dataset of `kind` as training rows. A `prompts` dataset contributes only its rows outside the
    held-out split (the split column says which rows no stage trains on); `eval` and `ref_logprobs` datasets nothing
    (an evaluation's own answers, and numbers)."""
    out = []
    for i, r in enumerate(rows, 1):
        where = f"{label} row {i}"
        if kind == "prompts":
            if r["split"] != held_out_split:
                out.append(TrainingRow(user_text(r["messages"]), (r["answer"],) if r["answer"] else (), where))
        elif kind == "sft":
            out.append(TrainingRow(user_text(r["messages"]), assistant_texts(r["messages"]), where))
        elif kind in ("samples", "unpaired"):
            out.append(TrainingRow(user_text(r["messages"]), (*assistant_texts(r["messages"]), r["completion"]), where))
        elif kind == "preferences":
            out.append(TrainingRow(user_text(r["messages"]), (r["chosen"], r["rejected"]), where))
        elif kind == "steps":
            out.append(TrainingRow(user_text(r["messages"]), ("\n".join(r["steps"]),), where))
    return out


def find_contamination(held_out: list[HeldOut], training: Iterable[TrainingRow], n: int = NGRAM,
                       min_coverage: float = MIN_COVERAGE) -> list[Finding]:
    """One Finding per held-out prompt (in order) with the checks it failed (empty `kinds`: clean). Memory is that
    of the held-out prompts' n-grams; the training rows are streamed once."""
    prompts = [words(p.question) for p in held_out]
    answers = [words(p.answer) if p.answer else () for p in held_out]
    findings = [Finding(p) for p in held_out]
    by_question: dict[tuple[str, ...], list[int]] = {}
    windows: dict[tuple[str, ...], list[tuple[int, int]]] = {}  # n-gram -> (prompt, position) of long prompts
    for j, w in enumerate(prompts):
        by_question.setdefault(w, []).append(j)
        if len(w) >= n:
            for i in range(len(w) - n + 1):
                windows.setdefault(w[i:i + n], []).append((j, i))
    covered = [[False] * len(w) for w in prompts]
    covered_by: dict[int, str] = {}
    for row in training:
        question = words(row.question)
        completions = [words(c) for c in row.completions]
        for j in by_question.get(question, ()):
            findings[j].kinds.setdefault("exact", row.source)
            if any(contains(c, answers[j]) for c in completions):
                findings[j].kinds.setdefault("answer_leak", row.source)
        if windows:
            for text in (question, *completions):
                for i in range(len(text) - n + 1):
                    for j, at in windows.get(text[i:i + n], ()):
                        covered[j][at:at + n] = [True] * n
                        covered_by.setdefault(j, row.source)
    for j, w in enumerate(prompts):
        if len(w) >= n and sum(covered[j]) >= min_coverage * len(w):
            findings[j].kinds["ngram"] = covered_by[j]
    return findings


def contamination_metrics(findings: list[Finding], datasets: int) -> dict[str, float]:
    """`contamination/*`: prompts flagged by any check (count and share of the held-out prompts), by each check, and
    the number of datasets checked."""
    total = len(findings)
    flagged = sum(bool(f.kinds) for f in findings)
    out = {"contamination/prompts": float(flagged), "contamination/share": flagged / total if total else 0.0,
           "contamination/datasets": float(datasets)}
    for kind in ("exact", "ngram", "answer_leak"):
        out[f"contamination/{kind}"] = float(sum(kind in f.kinds for f in findings))
    return out


def examples(findings: list[Finding], limit: int = MAX_EXAMPLES) -> list[dict]:
    """Up to `limit` flagged prompts: id, question, and for each check the training row that matched first."""
    return [{"prompt_id": f.prompt.id, "question": f.prompt.question, "matches": dict(sorted(f.kinds.items()))}
            for f in findings if f.kinds][:limit]


def report_json(findings: list[Finding], datasets: list[str]) -> str:
    """The check's record (the eval's MLflow run keeps it as a file): settings, datasets, counts and examples."""
    return json.dumps({"ngram": NGRAM, "min_coverage": MIN_COVERAGE, "datasets": datasets,
                       **contamination_metrics(findings, len(datasets)), "examples": examples(findings)}, indent=2)
