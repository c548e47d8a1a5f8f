"""What each model-producing stage of a run gained on held-out prompts over the model it started from, paired by
prompt, with its interval: the report's "Stage gains" section and the end of `r1flow run`.

A gain needs two eval nodes of the plan on the same prompts input and environment: one of the stage's model, one of the model the
stage trained from (its `model` input; distill's `student`), and also of its `teacher` and of the model its `data`
was sampled from (rejection sampling: R1's stage-3 SFT must keep what the RL model it samples had gained). `gain_pairs` (pure) finds
them from the plan's wiring; `paired_gain` (pure) compares two evals' greedy rows prompt by prompt: the gain is the
mean of after - before over the prompts both scored, its 95% interval a percentile bootstrap of those differences
(`stages.math.stats.paired_bootstrap_diff`: resampling prompts, the same for both models, which is narrower than
comparing two independent intervals). Evals of different prompts (a different `max_prompts`) are not compared.
A recipe's `compare:` list adds pairs of its own (e.g. the r1-tools arm with the tool over the arm without it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.plan.recipes import Plan
from flows.report.tables import markdown_tables
from stages.math.stats import paired_bootstrap_diff

if TYPE_CHECKING:
    from flows.plan.results import StageResult

START_INPUTS = ("model", "student")  # the input a training stage starts from, in the order looked for
ALSO_COMPARED = {"teacher": "over its teacher"}  # other model inputs a stage's model is compared with


def gain_pairs(plan: Plan) -> list[dict[str, str]]:
    """(pure) For every eval node E of a model node M and every model M was made from (its start, its teacher) that
    an eval node E0 on the same prompts input evaluates: {eval: E, model: M, compared_with: E0, start: the other
    model's node, relation, environment and over_environment: the environments E and E0 sample in}. In plan order."""
    evals = {n.name: n for n in plan.nodes if n.stage == "eval" and "model" in n.inputs}
    by_model = {(n.inputs["model"], n.inputs.get("prompts"), _environment(n)): name for name, n in evals.items()}
    pairs = []
    for name, e in evals.items():
        model_node, _ = e.inputs["model"]
        made = plan.node(model_node)
        sources = [(made.inputs[k], "over its start") for k in START_INPUTS if k in made.inputs][:1]
        sources += [(made.inputs[k], rel) for k, rel in ALSO_COMPARED.items() if k in made.inputs]
        if "data" in made.inputs:  # trained on samples of another model (rejection sampling, traces): that model too
            sampler = plan.node(made.inputs["data"][0]).inputs.get("model")
            if sampler is not None:
                sources.append((sampler, "over the model its data was sampled from"))
        seen = set()
        for source, relation in sources:
            before = by_model.get((source, e.inputs.get("prompts"), _environment(e)))
            if before is not None and before != name and before not in seen:
                seen.add(before)
                pairs.append({"eval": name, "model": model_node, "compared_with": before, "start": source[0],
                              "relation": relation, "environment": _environment(e),
                              "over_environment": _environment(evals[before])})
    for name, over, label in plan.compare:  # the recipe's own pairs (e.g. two arms of one budget)
        if name in evals and over in evals:
            pairs.append({"eval": name, "model": evals[name].inputs["model"][0], "compared_with": over,
                          "start": evals[over].inputs["model"][0], "relation": label,
                          "environment": _environment(evals[name]), "over_environment": _environment(evals[over])})
    return pairs


def _environment(node: Any) -> str:
    """The environment an eval node samples in (evals with and without a tool are compared only within their kind)."""
    return node.config.environment.name


def greedy_scores(rows: list[dict[str, Any]]) -> dict[str, float]:
    """prompt id -> 1.0/0.0 of an eval's greedy rows that the verifier scored (unscored prompts left out)."""
    return {r["prompt_id"]: float(r["correct"]) for r in rows
            if r.get("mode") == "greedy" and r.get("correct") is not None}


def paired_gain(before: dict[str, float], after: dict[str, float], seed: int = 0) -> dict[str, Any]:
    """(pure) after - before over the prompts both scored, with its 95% paired bootstrap interval; `prompts`: how
    many; `note` when the two scored different prompt sets (then None values: not the same held-out set)."""
    if set(before) != set(after):
        only = len(set(before) ^ set(after))
        return {"gain": None, "ci_low": None, "ci_high": None, "prompts": len(set(before) & set(after)),
                "note": f"not compared: {only} prompt(s) scored by one eval only"}
    ids = sorted(before)
    gain, low, high = paired_bootstrap_diff([before[i] for i in ids], [after[i] for i in ids], seed=seed)
    finite = ids != []
    return {"gain": gain if finite else None, "ci_low": low if finite else None, "ci_high": high if finite else None,
            "prompts": len(ids), "note": ""}


def stage_gains(plan: Plan, results: list[StageResult],
                read_eval: Callable[[str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The gain rows of a run: gain_pairs whose two evals both ran or were cached, each with paired_gain over the
    eval outputs `read_eval(fingerprint)` returns (rows of the `eval` dataset)."""
    done = {r.node: r for r in results if r.stage == "eval" and r.status != "skipped" and r.outputs}
    scores: dict[str, dict[str, float]] = {}

    def of(node: str) -> dict[str, float]:
        if node not in scores:
            scores[node] = greedy_scores(read_eval(next(iter(done[node].outputs.values()))))
        return scores[node]

    return [{**p, **paired_gain(of(p["compared_with"]), of(p["eval"]))}
            for p in gain_pairs(plan) if p["eval"] in done and p["compared_with"] in done]


def fmt_gain(row: dict[str, Any]) -> str:
    """`+18.4 [+11.7, +25.0]` in accuracy points, or the row's note."""
    if row.get("gain") is None:
        return row.get("note") or "—"
    return f"{100 * row['gain']:+.1f} [{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}]"


def gain_labels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(model, the model it is compared with) of each gain row, as the report and the end of `r1flow run` show them:
    the nodes' names, each with the environment its eval sampled in (`sft_tools [python]`) when the rows span more
    than one (r1-tools evaluates every model with and without the tool: the same two models twice)."""
    several = len({r.get("environment") for r in rows} | {r.get("over_environment") for r in rows}) > 1

    def label(node: str, environment: str | None) -> str:
        return f"{node} [{Path(environment).name}]" if several and environment else node

    return [(label(r["model"], r.get("environment")), label(r["start"], r.get("over_environment"))) for r in rows]


def gains_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's "Stage gains" section (nothing without rows)."""
    if not rows:
        return []
    table = []
    for r, (model, over) in zip(rows, gain_labels(rows), strict=True):
        verdict = "—" if r.get("gain") is None else (
            "gain" if r["ci_low"] > 0 else "loss" if r["ci_high"] < 0 else "no")
        table.append([model, over, fmt_gain(r), verdict, str(r["prompts"]), r["relation"].removeprefix("over "),
                      f"{r['eval']} over {r['compared_with']}"])
    md = ["", "## Stage gains (held-out accuracy, paired by prompt)", "",
          *markdown_tables(["model", "over", "gain, points [95% CI]", "beyond the noise", "prompts", "relation",
                            "evals"], table)]
    md += ["", "Gain: accuracy of the model minus that of the model it was trained from (or its teacher), on the "
           "same greedy held-out prompts; the interval resamples prompts, the same for both models. \"beyond the "
           "noise\": the interval excludes 0 (one training seed: the seed's own variation is not in it). "
           "`[name]`: the environment the model's eval sampled in.", ""]
    return md
