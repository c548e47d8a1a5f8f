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
Where the evals have both slices (`stages.eval.task_slices`: tasks trained on, and held-out-only ones: transfer), each
gain row has the same paired gain per slice (`slice_gains`) under `slices`.
"""

from __future__ import annotations

from collections.abc import Callable
from math import ceil
from pathlib import Path
from statistics import NormalDist
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


def prompt_slices(rows: list[dict[str, Any]], metrics: dict[str, float]) -> dict[str, str]:
    """(pure) prompt id -> "trained" or "transfer" by its task's `<task>/transfer` metric (stages.eval), over an eval's
    greedy rows; empty where the eval has one slice only, or logged none (evals before eval VERSION 7)."""
    flags = {r["prompt_id"]: metrics.get(f"{r.get('task')}/transfer") for r in rows if r.get("mode") == "greedy"}
    slices = {pid: "transfer" if flag else "trained" for pid, flag in flags.items() if flag is not None}
    return slices if len(set(slices.values())) == 2 and len(slices) == len(flags) else {}


def slice_gains(before: dict[str, float], after: dict[str, float], slices: dict[str, str],
                seed: int = 0) -> dict[str, dict[str, Any]]:
    """(pure) slice -> `paired_gain` over that slice's prompts (slices: prompt id -> slice, `prompt_slices`)."""
    out = {}
    for name in sorted(set(slices.values())):
        ids = {i for i, s in slices.items() if s == name}
        out[name] = paired_gain({i: v for i, v in before.items() if i in ids},
                                {i: v for i, v in after.items() if i in ids}, seed=seed)
    return out


def prompts_for_interval(half_width: float, discordant: float = 0.5, gain: float = 0.0,
                         confidence: float = 0.95) -> int:
    """(pure) The prompts a paired gain needs for its interval to be +-`half_width` (normal approximation): a prompt's
    d = after - before is -1, 0 or 1, Var(d) = discordant - gain^2 (`discordant`: the share of prompts the two models
    score differently), n = ceil(z^2 Var(d) / half_width^2). Two models at accuracy p that err independently disagree
    on 2p(1 - p) <= 0.5 of the prompts: the default, the worst case of such models, needs 193 prompts for +-10 points."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return ceil(z * z * (discordant - gain * gain) / (half_width * half_width))


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
    scores: dict[str, tuple[dict[str, float], dict[str, str]]] = {}

    def of(node: str) -> tuple[dict[str, float], dict[str, str]]:
        if node not in scores:
            rows = read_eval(next(iter(done[node].outputs.values())))
            scores[node] = greedy_scores(rows), prompt_slices(rows, done[node].metrics)
        return scores[node]

    gains = []
    for p in gain_pairs(plan):
        if p["eval"] in done and p["compared_with"] in done:
            (before, _), (after, slices) = of(p["compared_with"]), of(p["eval"])
            gain = {**p, **paired_gain(before, after)}
            if slices and gain["gain"] is not None:  # the same prompts, so the same slices
                gain["slices"] = slice_gains(before, after, slices)
            gains.append(gain)
    return gains


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


def slice_title(name: str, rows: list[dict[str, Any]]) -> str:
    """`transfer (n=193)`: a slice's column, with its prompts where every row has the same number."""
    sizes = {r["slices"][name]["prompts"] for r in rows if name in r.get("slices", {})}
    return name + (f" (n={sizes.pop()})" if len(sizes) == 1 else "")


def gains_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's "Stage gains" section (nothing without rows)."""
    if not rows:
        return []
    table = []
    slices = sorted({s for r in rows for s in r.get("slices", {})})
    for r, (model, over) in zip(rows, gain_labels(rows), strict=True):
        verdict = "—" if r.get("gain") is None else (
            "gain" if r["ci_low"] > 0 else "loss" if r["ci_high"] < 0 else "no")
        by_slice = [fmt_gain(r["slices"][s]) if s in r.get("slices", {}) else "—" for s in slices]
        table.append([model, over, fmt_gain(r), verdict, str(r["prompts"]), *by_slice,
                      r["relation"].removeprefix("over "), f"{r['eval']} over {r['compared_with']}"])
    md = ["", "## Stage gains (held-out accuracy, paired by prompt)", "",
          *markdown_tables(["model", "over", "gain, points [95% CI]", "beyond the noise", "prompts",
                            *(slice_title(s, rows) for s in slices), "relation", "evals"], table)]
    md += ["", "Gain: accuracy of the model minus that of the model it was trained from (or its teacher), on the "
           "same greedy held-out prompts; the interval resamples prompts, the same for both models. \"beyond the "
           "noise\": the interval excludes 0 (one training seed: the seed's own variation is not in it). "
           "`[name]`: the environment the model's eval sampled in."
           + (" Per slice: the same gain over the prompts of the tasks trained on (`trained`) and of the held-out-only "
              "tasks no stage trains on (`transfer`), n prompts each." if slices else ""), ""]
    return md
