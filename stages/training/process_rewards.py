"""Process supervision for on-policy RL: per-token advantages from step scores (DeepSeekMath §4.1.3,
arXiv 2402.03300: each token gets the sum of the normalised rewards of the steps ending at or after it).

A completion's text is its tokens decoded one by one and joined (so character offsets map to tokens);
steps are cut as `stages.math.steps` cuts them, and a step's score sits on the token that holds its last
character (`steps.token_ends_of`; two steps ending in one token keep the later score). The step scores
come from a process reward model (`prm_process_advantages`: every step of a completion in one pass, at the
PRM's own delimiter) or from an outcome reward model scoring each step prefix (`process_advantages`).

May import: `schemas`, `stages.math`; never a stage module.
"""

from __future__ import annotations

import numpy as np
import torch

from stages.math import rl, steps


def token_pieces(tokenizer, comps: list[list]) -> list[list[list[str]]]:
    """Each completion's tokens decoded one by one, per group."""
    return [[[tokenizer.decode([t], skip_special_tokens=True) for t in c.token_ids] for c in cs] for cs in comps]


def on_tokens(pieces: list[str], char_ends: list[int], scores: list[float]) -> tuple[list[int], list[float]]:
    """(inclusive token ends, scores) of a completion's steps given their exclusive character ends in
    "".join(pieces): where two steps end in one token, the later one's score stands."""
    tok = steps.token_ends_of(pieces, char_ends[: len(scores)])
    keep = [j for j in range(len(tok)) if j + 1 == len(tok) or tok[j + 1] != tok[j]]
    return [tok[j] for j in keep], [scores[j] for j in keep]


def token_advantages(step_scorer, scorer, tokenizer, rows: list[dict], comps: list[list], delimiter: str
                     ) -> tuple[list[list[float]], dict[str, float]]:
    """Per-token step advantages of every completion (B*G lists, in order) and metrics: from the process reward
    model `step_scorer` where there is one, else from the outcome reward model `scorer` at `delimiter`."""
    if step_scorer is not None:
        return prm_process_advantages(step_scorer, tokenizer, rows, comps)
    return process_advantages(scorer, tokenizer, rows, comps, delimiter)


def process_advantages(scorer, tokenizer, rows: list[dict], comps: list[list], delimiter: str
                       ) -> tuple[list[list[float]], dict[str, float]]:
    """Step advantages from an outcome reward model (`scorer.score(conversations, texts)`): it scores the prompt
    with the completion up to the end of each step (`steps.step_spans` at `delimiter`; one pass per prefix).
    One list of per-token advantages per completion (B*G, in order) and metrics (`step_advantages_of`)."""
    pieces = token_pieces(tokenizer, comps)
    char_ends = [[[e for _, e in steps.step_spans("".join(p), delimiter)] for p in ps] for ps in pieces]
    convs, prefixes = [], []
    for r, ps, es in zip(rows, pieces, char_ends, strict=True):
        for p, e in zip(ps, es, strict=True):
            text = "".join(p)
            convs.extend(r["messages"] for _ in e)
            prefixes.extend(text[:end] for end in e)
    flat = iter(scorer.score(convs, prefixes) if prefixes else [])
    ends, scores = [], []
    for ps, es in zip(pieces, char_ends, strict=True):
        placed = [on_tokens(p, e, [next(flat) for _ in e]) for p, e in zip(ps, es, strict=True)]
        ends.append([t for t, _ in placed])
        scores.append([s for _, s in placed])
    return step_advantages_of(comps, ends, scores)


def prm_process_advantages(step_scorer, tokenizer, rows: list[dict], comps: list[list]
                           ) -> tuple[list[list[float]], dict[str, float]]:
    """Step advantages from a process reward model (`heads.StepScorer.score_steps`: each step's probability of
    being right and the step's character end, all steps of a completion in one forward pass, cut at the PRM's own
    delimiter). One list of per-token advantages per completion (B*G, in order) and metrics."""
    pieces = token_pieces(tokenizer, comps)
    convs = [r["messages"] for r, cs in zip(rows, comps, strict=True) for _ in cs]
    texts = ["".join(p) for ps in pieces for p in ps]
    scored = iter(step_scorer.score_steps(convs, texts) if texts else [])
    ends, scores = [], []
    for ps in pieces:
        placed = [on_tokens(p, *next(scored)) for p in ps]
        ends.append([t for t, _ in placed])
        scores.append([s for _, s in placed])
    return step_advantages_of(comps, ends, scores)


def step_advantages_of(comps: list[list], ends: list[list[list[int]]], scores: list[list[list[float]]]
                       ) -> tuple[list[list[float]], dict[str, float]]:
    """Per group: the step scores (each completion's, at its inclusive token ends) normalised together
    (`rl.normalize_step_rewards`), and every token given the sum of the normalised scores of the steps ending
    at or after it (`rl.step_advantages`). One list per completion (B*G, in order) and metrics."""
    out, raw = [], []
    for cs, es, ss in zip(comps, ends, scores, strict=True):
        g, s_max = len(cs), max(1, max(len(e) for e in es))
        t_max = max(1, max(c.num_tokens for c in cs))
        r = torch.zeros(g, s_max)
        e_t = torch.full((g, s_max), -1, dtype=torch.long)
        for i, (e, s) in enumerate(zip(es, ss, strict=True)):
            r[i, : len(e)] = torch.tensor(s, dtype=torch.float32)
            e_t[i, : len(e)] = torch.tensor(e, dtype=torch.long)
            raw.extend(s)
        normed = rl.normalize_step_rewards(r, e_t >= 0)
        mask = torch.arange(t_max)[None, :] < torch.tensor([c.num_tokens for c in cs])[:, None]
        adv = rl.step_advantages(normed, e_t, mask)
        out.extend(adv[i, : c.num_tokens].tolist() for i, c in enumerate(cs))
    n = sum(len(cs) for cs in comps)
    return out, {"reward/process_mean": float(np.mean(raw)) if raw else 0.0,
                 "reward/steps_per_completion": len(raw) / max(1, n)}
