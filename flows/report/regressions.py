"""Regressions of a deployment's evals against its last successful run: the verdict (pure), the one-line message a
failed flow run carries, and the report's "Regressions" section (docs/guides/regressions.md).

An eval regressed when its greedy accuracy, paired by prompt id with the same eval node's in the baseline run, fell
by more than the noise: the whole 95% paired bootstrap interval of the change (after - before, `gains.paired_gain`,
resampling prompts the same for both) lies below -tolerance. With tolerance 0 that is "the interval's upper bound
is below 0": a drop the prompts cannot explain by chance. Evals whose scored prompt ids differ are not compared.
"""

from __future__ import annotations

from typing import Any

from flows.plan.results import fmt_metric
from flows.report.comparison import fmt_interval
from flows.report.gains import paired_gain
from flows.report.tables import markdown_tables


def paired_regression(before: dict[str, float], after: dict[str, float], tolerance_points: float = 0.0,
                      seed: int = 0) -> dict[str, Any]:
    """(pure) `paired_gain(before, after)` (prompt id -> 1.0/0.0 of the baseline's and this run's greedy answers)
    plus `regression`: the change's interval lies wholly below -tolerance_points / 100 (accuracy points)."""
    if tolerance_points < 0:
        raise ValueError(f"tolerance_points must be >= 0, got {tolerance_points}")
    row = paired_gain(before, after, seed=seed)
    row["regression"] = row["gain"] is not None and row["ci_high"] < -tolerance_points / 100
    return row


def fmt_run(run: dict[str, str]) -> str:
    """`name (…id)`: a Prefect flow run as its UI lists it, with the last 8 characters of its id (names repeat; Prefect's
    ids start with their creation time, so the first characters of two runs of one night are the same)."""
    return f"{run['name']} ({run['id'][-8:]})"


def regression_line(eval_node: str, row: dict[str, Any], before: dict[str, str], after: dict[str, str]) -> str:
    """`eval_sft: accuracy dropped 62.5 points [43.8, 81.2] from run a (…) to run b (…)`: the drop and its interval,
    in accuracy points (the interval of after - before, negated)."""
    return (f"{eval_node}: accuracy dropped {-100 * row['gain']:.1f} points [{-100 * row['ci_high']:.1f}, "
            f"{-100 * row['ci_low']:.1f}] from run {fmt_run(before)} to run {fmt_run(after)}")


def _change(row: dict[str, Any]) -> str:
    if row.get("gain") is None:
        return row.get("note") or "—"
    return f"{100 * row['gain']:+.1f} [{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}]"


def regressions_markdown(check: dict[str, Any]) -> list[str]:
    """The report's "Regressions" section from `flows.run.regressions.compare_with_baseline`'s result: each eval's row
    in this run and in the baseline run, the paired change and the verdict; or why nothing was compared."""
    md = ["", "## Regressions (against the last successful run of this deployment)", ""]
    baseline = check.get("baseline")
    if baseline is None:
        return md + [check["note"], ""]
    table = []
    for r in check["rows"]:
        verdict = "regression" if r.get("regression") else "—" if r.get("gain") is None else "no"
        for label, row, run in ((r["eval"], r["current"], check["run"]), ("↳ baseline", r["previous"], baseline)):
            fp = (row or {}).get("model_fingerprint")
            table.append([label, fmt_run(run), fp[:8] if fp else "—", fmt_interval(row or {}, "accuracy"),
                          fmt_metric(row["prompts"]) if row and row.get("prompts") is not None else "—",
                          *([_change(r), verdict] if row is r["current"] else ["", ""])])
    md += markdown_tables(["eval", "flow run", "model fp", "accuracy [95% CI]", "prompts", "change, points [95% CI]",
                           "regression"], table)
    tolerance = check.get("tolerance_points", 0.0)
    md += ["", "Change: this run's greedy accuracy minus the baseline's, paired by prompt id; a regression when the "
           "whole interval is below " + (f"-{tolerance:g} points (the tolerance)" if tolerance else "0")
           + ". " + check["note"], ""]
    return md
