"""`step_labels` stage: automatic step labels for process reward models, Math-Shepherd style.

Wang et al. 2024, "Math-Shepherd", https://arxiv.org/abs/2312.08935, §3.3: take sampled solutions,
cut each into steps, roll out K completions with the policy from the prefix that ends at every step,
verify their answers, and label the step by the share that reach a verified answer (soft
estimation) or by whether any does (hard estimation). The labels (`stages.math.steps.mc_labels`)
make a `steps` dataset for the `prm` stage.

Solutions come from the `solutions` input (a `samples` dataset, e.g. rejection_sampling's scored
samples, right and wrong; or an `sft` dataset whose last turn is the solution), else they are
sampled here from the model, `solutions_per_prompt` per prompt. Either way each solution is
re-verified against its prompts row (matched by prompt id, else by its prompt turns).

Departures from the paper, on purpose:
- the last step of a solution that ended on its own (EOS or a stop string) is labelled by the
  solution's own verdict instead of K rollouts (nothing is left to roll out: the answer is there);
- steps beyond `max_steps` are folded into the last kept step (`cap_spans`), so the solution's end,
  where its outcome is known, is always a step end;
- rollouts the verifier cannot score are left out of the share; a step none of whose rollouts
  could be scored ends the solution's labelled steps there (a label is never a silent 0).

Cost: rollouts = K x (steps - 1) per solution at most. Each prefix is one generate call whose
prompt (chat template + prefix) is prefilled once for its K samples; prefixes are not batched
together, since the generation backends take one prefill text per call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from schemas.configs import StepLabelsConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, seed_everything, write_dataset
from stages.math.steps import cap_spans, mc_labels, step_spans
from stages.rewards.verifiers import score
from stages.sampling.generation import make_backend

VERSION = "1"
CONFIG = StepLabelsConfig
INPUTS = {"model": "model", "prompts": "prompts", "solutions": "samples|sft?"}
OUTPUTS = {"steps": "steps"}

_SELECT_STREAM = 7  # RNG stream of the max_solutions subset


@dataclass(frozen=True)
class Solution:
    prompt: dict  # its prompts row (answer, verifier)
    text: str  # the completion, prefill included
    finish_reason: str  # "stop" | "length"
    index: int  # which solution of this prompt


def verdict(prompt: dict, text: str, cfg: StepLabelsConfig) -> bool | None:
    """Whether `text` reaches the verified answer (None: the verifier could not score it)."""
    v = score(prompt, text, cfg.reward)
    return v.correct if cfg.correctness == "strict" else v.correct_lenient


def _prompt_key(messages: list[dict]) -> str:
    return json.dumps([[m["role"], m["content"]] for m in messages])


def solutions_from_input(data: Input, prompts: list[dict]) -> list[Solution]:
    """The solutions of a `samples` or `sft` dataset, each matched to its prompts row."""
    by_id = {p["id"]: p for p in prompts}
    by_turns = {_prompt_key(p["messages"]): p for p in prompts}
    kind = data.manifest.schema_name
    out, seen = [], {}
    for i, row in enumerate(data.table(kind).to_pylist()):
        if kind == "samples":
            turns, text, finish = row["messages"], row["completion"], row["finish_reason"]
            prompt = by_id.get(row["prompt_id"]) or by_turns.get(_prompt_key(turns))
        else:  # sft: the last (assistant) turn is the solution
            turns, text, finish = row["messages"][:-1], row["messages"][-1]["content"], "stop"
            pid = json.loads(row["metadata"]).get("prompt_id")
            prompt = by_id.get(pid) or by_turns.get(_prompt_key(turns))
        if prompt is None:
            raise SchemaError(f"{data.label}: row {i}: its prompt is not in the prompts input (matched by prompt id, "
                              "then by the prompt turns); label solutions of the prompts they were sampled from")
        seen[prompt["id"]] = seen.get(prompt["id"], -1) + 1
        out.append(Solution(prompt, text, finish, seen[prompt["id"]]))
    return out


def select(solutions: list[Solution], max_solutions: int, seed: int) -> list[Solution]:
    """At most `max_solutions`, a seeded subset kept in input order."""
    if len(solutions) <= max_solutions:
        return solutions
    keep = np.random.default_rng([seed, _SELECT_STREAM]).permutation(len(solutions))[:max_solutions]
    return [solutions[i] for i in sorted(keep.tolist())]


def rollout_seed(seed: int, solution: int, step: int) -> int:
    return seed * 1_000_003 + solution * 1_009 + step


def label_solution(sol: Solution, backend, cfg: StepLabelsConfig, seed: int) -> tuple[list[str], list[float], dict]:
    """(steps, labels, details) of one solution; no steps when it has none or its first step has no label.

    Step i < last (or the last of a solution cut by the token limit): K rollouts from the prefix
    text[:end_i], each verified as prefix + continuation. The last step of a finished solution:
    its own verdict.
    """
    spans = cap_spans(step_spans(sol.text, cfg.delimiter), cfg.max_steps) if sol.text.strip() else []
    own = verdict(sol.prompt, sol.text, cfg)
    outcomes: list[list[bool | None]] = []
    rolled: list[int] = []  # rollouts per step (0: labelled by the solution's own verdict)
    for i, (_, end) in enumerate(spans):
        if i == len(spans) - 1 and sol.finish_reason == "stop":
            outcomes.append([own])
            rolled.append(0)
            continue
        spec = cfg.generation.model_copy(update={"prefill": sol.text[:end]})
        comps, _ = backend.generate([sol.prompt["messages"]], spec, n=cfg.rollouts, seed=seed + i, progress=False)
        outcomes.append([verdict(sol.prompt, c.text, cfg) for c in comps[0]])
        rolled.append(len(comps[0]))
    labels = mc_labels(outcomes, cfg.label)
    n = next((i for i, lab in enumerate(labels) if lab is None), len(labels))  # labelled prefix of the steps
    details = {"correct": own, "rollouts": rolled[:n], "rollouts_correct": [sum(x is True for x in o) for o in outcomes[:n]],
               "unlabelled_steps": len(spans) - n, "rollouts_generated": sum(rolled)}
    return [sol.text[s:e] for s, e in spans[:n]], [float(x) for x in labels[:n]], details


def run(cfg: StepLabelsConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    all_prompts = inputs["prompts"].table("prompts").to_pylist()
    data = inputs.get("solutions")
    prompts = [p for p in all_prompts if p["split"] == cfg.split][: cfg.max_prompts]
    solutions = solutions_from_input(data, all_prompts) if data is not None else None  # validated before loading
    if data is None and not prompts:
        raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r} to sample solutions for")
    seed_everything(ctx.seed)
    model, tokenizer = inputs["model"].load_model()
    model.to(ctx.device)
    backend = make_backend(cfg.generation, model, tokenizer, inputs["model"].model_dir)
    if solutions is None:
        comps, _ = backend.generate([p["messages"] for p in prompts], cfg.generation, n=cfg.solutions_per_prompt,
                                    seed=ctx.seed, desc="step_labels: solutions")
        solutions = [Solution(p, c.text, c.finish_reason, j) for p, cs in zip(prompts, comps, strict=True)
                     for j, c in enumerate(cs)]
    solutions = select(solutions, cfg.max_solutions, ctx.seed)

    rows, dropped, n_rollouts, correct = [], 0, 0, []
    for k, sol in enumerate(tqdm(solutions, desc="step_labels: rollouts", unit="solution")):
        steps, labels, details = label_solution(sol, backend, cfg, rollout_seed(ctx.seed, k, 0))
        n_rollouts += details["rollouts_generated"]
        correct.append(details["correct"])
        if not steps:
            dropped += 1
            continue
        rows.append({
            "id": f"{sol.prompt['id']}-{sol.index}", "messages": sol.prompt["messages"], "steps": steps,
            "labels": labels, "source": "step_labels",
            "metadata": json.dumps({"prompt_id": sol.prompt["id"], "task": sol.prompt["task"],
                                    "answer": sol.prompt["answer"], "finish_reason": sol.finish_reason,
                                    "label": cfg.label, "delimiter": cfg.delimiter, **details}, sort_keys=True),
        })
    if not rows:
        raise SchemaError(f"step_labels: none of {len(solutions)} solution(s) has a labelled step (no steps, or no "
                          "rollout of a first step could be scored)")
    all_labels = [x for r in rows for x in r["labels"]]
    scored = [c for c in correct if c is not None]
    metrics = {
        "solutions": float(len(rows)),
        "solutions_dropped": float(dropped),
        "solution_accuracy": float(np.mean(scored)) if scored else 0.0,
        "steps": float(len(all_labels)),
        "steps_per_solution": len(all_labels) / len(rows),
        "rollouts": float(n_rollouts),
        "label_mean": float(np.mean(all_labels)),
        "positive_step_share": float(np.mean([x >= 0.5 for x in all_labels])),
    }
    ctx.log_metrics(metrics)
    ctx.log.info("step_labels: %d solutions, %d steps (%.0f%% labelled right), %d rollouts", len(rows),
                 len(all_labels), 100 * metrics["positive_step_share"], n_rollouts)
    return {"steps": write_dataset(ctx, "steps", from_rows(rows, "steps"), "steps", metrics)}
