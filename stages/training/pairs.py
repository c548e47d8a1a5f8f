"""Preference data for training: held-out splits, preference examples (chosen/rejected or
unpaired desirable/undesirable rows, with KTO's KL pairs) and their tokenization."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.errors import ArtifactError, ModelError, SchemaError
from stages.base import Input

_SPLIT_STREAM = 1  # RNG stream of the held-out split, apart from the data order's


def split_pairs(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a seeded permutation, the first round(f·n) held out
    (at least one whenever f > 0)."""
    perm = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n).tolist()
    n_eval = max(1, round(eval_fraction * n)) if eval_fraction > 0 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


DESIRABLE = ("chosen", "desirable")


@dataclass(frozen=True)
class Example:
    """One completion to score: a pair side, an unpaired row, or a KTO mismatched (kl) row."""

    id: str
    role: str  # chosen | rejected | desirable | undesirable | kl (KTO reads pairs as chosen = desirable)
    messages: list
    completion: str


def examples_from(data: Input, include_kl: bool = False) -> list[Example]:
    """Every completion of a preferences or unpaired dataset, in row order, checked before any model loads.

    include_kl adds, for row i, the completion of the next row with another prompt (wrapping around)
    under row i's prompt: the mismatched pairs KTO estimates its reference point on. Not simply row
    i+1: unpaired rows made from pairs alternate one prompt's chosen and rejected answers, so half of
    those pairs would be matched ones (so would pairs_per_prompt > 1 pairs).
    """
    kind = data.manifest.schema_name
    if kind not in ("preferences", "unpaired"):
        raise ArtifactError(f"{data.label}: expected a preferences or unpaired dataset, got {kind!r}")
    rows = data.table(kind).to_pylist()
    if not rows:
        raise SchemaError(f"{data.label}: no rows to optimise preferences on")
    out: list[Example] = []
    if kind == "preferences":
        for r in rows:
            out += [Example(r["id"], "chosen", r["messages"], r["chosen"]),
                    Example(r["id"], "rejected", r["messages"], r["rejected"])]
        completions = [r["chosen"] for r in rows]
    else:
        out = [Example(r["id"], "desirable" if r["label"] else "undesirable", r["messages"], r["completion"])
               for r in rows]
        completions = [r["completion"] for r in rows]
    if include_kl:
        other = next_other_prompt([r["messages"] for r in rows])
        out += [Example(r["id"], "kl", r["messages"], completions[j]) for r, j in zip(rows, other, strict=True)]
    return out


def next_other_prompt(prompts: list) -> list[int]:
    """For each row, the index of the next row (wrapping around) whose prompt differs; the next row when
    every row has the same prompt. One backward pass over the rows laid out twice."""
    n = len(prompts)
    out, nearest = [0] * n, None
    for k in range(2 * n - 2, -1, -1):
        if prompts[(k + 1) % n] != prompts[k % n]:
            nearest = (k + 1) % n
        if k < n:
            out[k] = nearest if nearest is not None else (k + 1) % n
    return out


def tokenize(tokenizer, messages: list[dict], completion: str, max_length: int) -> tuple[list[int], int]:
    """(token ids of prompt + completion + EOS, number of completion tokens), at most max_length.

    Too long: the prompt loses its start first; a completion longer than max_length - 1 keeps its
    first max_length - 1 tokens after one prompt token (something must predict its first token).
    """
    if tokenizer.eos_token_id is None:
        raise ModelError("preference_optimization: the tokenizer has no EOS token to close completions with")
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(c) >= max_length:
        c = c[: max_length - 1]
    p = p[-(max_length - len(c)) :]
    return p + c, len(c)
