"""The report's "held-out accuracy by checkpoint" (docs/guides/checkpoint-evals.md): for each training node whose
producing MLflow run logged `checkpoint_eval/accuracy` (flows/run/checkpoint_evals.py), a table of the accuracy and
format rate of the model after each published step, then its final model's eval, and one plot of the curves
(`checkpoints.png`). Read from the run that produced the node's outputs, so a cached node shows its curve too."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.plan.recipes import Plan
from flows.report.plots import Curve, PlotPanel, plot_panels
from flows.report.tables import markdown_tables
from flows.track.mlflow_runs import StageRuns, metric_curve
from flows.track.tracking import Tracker

if TYPE_CHECKING:
    from flows.plan.results import StageResult

ACCURACY, FORMAT_RATE = "checkpoint_eval/accuracy", "checkpoint_eval/format_rate"
PLOT = "checkpoints.png"
HEADERS = ["step", "model", "accuracy", "format rate"]


def checkpoint_rows(accuracy: Curve, format_rate: Curve, final: tuple[int, str, float, float | None] | None,
                    ) -> list[list[str]]:
    """The table's rows (pure): one per evaluated checkpoint (step, "checkpoint", accuracy, format rate: "—" where
    not logged), then `final` (steps, its eval node, accuracy, format rate), the trained model the stage published."""
    rates = dict(zip(*format_rate, strict=True))
    rows = [[str(step), "checkpoint", f"{acc:.3f}", f"{rates[step]:.3f}" if step in rates else "—"]
            for step, acc in zip(*accuracy, strict=True)]
    if final is not None:
        step, node, acc, rate = final
        rows.append([str(step), f"final ({node})", f"{acc:.3f}", "—" if rate is None else f"{rate:.3f}"])
    return rows


def _final(plan: Plan, results: list[StageResult], trained: StageResult) -> tuple[int, str, float, float | None] | None:
    """The trained node's final model as its eval node scored it: (steps, eval node, accuracy, format rate)."""
    for r in results:
        if (r.stage == "eval" and "accuracy" in r.metrics and "steps" in trained.metrics
                and plan.node(r.node).inputs.get("model") == (trained.node, "model")):
            return int(trained.metrics["steps"]), r.node, r.metrics["accuracy"], r.metrics.get("format_rate")
    return None


def checkpoint_report(plan: Plan, results: list[StageResult], runs: dict[str, StageRuns | None],
                      tracker: Tracker) -> tuple[list[str], list[tuple[str, str, bytes]]]:
    """(markdown lines, [(file name, title, PNG)]) of the nodes with checkpoint evals; ([], []) without any."""
    md: list[str] = []
    lines: list[tuple[str, Curve]] = []
    for r in results:
        sr = runs.get(r.node)
        if sr is None or sr.source_run_id is None or ACCURACY not in sr.source_metrics:
            continue
        accuracy = metric_curve(tracker, sr.source_run_id, ACCURACY)
        rates = metric_curve(tracker, sr.source_run_id, FORMAT_RATE) if FORMAT_RATE in sr.source_metrics else ([], [])
        final = _final(plan, results, r)
        md += ["", f"### {r.node} ({r.stage})", "",
               *markdown_tables(HEADERS, checkpoint_rows(accuracy, rates, final))]
        steps, values = accuracy
        if final is not None:
            steps, values = [*steps, final[0]], [*values, final[2]]
        lines.append((r.node, (steps, values)))
    if not md:
        return [], []
    md = ["", "## Held-out accuracy by checkpoint", "",
          "Each published checkpoint evaluated beside its training by the node's eval "
          "(docs/guides/checkpoint-evals.md); the last row is the final model's eval.", *md]
    panels: list[PlotPanel] = [("held-out accuracy by checkpoint", "accuracy (greedy)", lines)]
    title = "held-out accuracy by checkpoint: " + ", ".join(node for node, _ in lines)
    return md, [(PLOT, title, plot_panels(panels, title))]
