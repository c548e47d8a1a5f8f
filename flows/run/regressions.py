"""A deployment's run compares every eval with the deployment's last successful run and fails on a regression
(docs/guides/regressions.md; the verdict is flows/report/regressions.py's).

The baseline: the newest flow run of the same deployment (id) whose state is Completed and that started before this
one (Prefect's API). A run that ended Failed, on a regression or otherwise, is never a baseline, so a regression
keeps failing until it is fixed or a run with `fail_on_regression` off accepts it. Its evals: `report/comparison.json`
of the MLflow parent run tagged with that flow run's id (r1flow.flow_run_id) in this recipe's experiment, whose
rows name each eval node's output fingerprint; its per-prompt results are read from the store. Runs outside a
deployment (`r1flow run`) compare nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import get_client, get_run_logger
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.runtime import deployment as this_deployment
from prefect.states import Failed

from flows.plan.recipes import Plan
from flows.report.comparison import comparison_rows, load_comparison
from flows.report.gains import greedy_scores
from flows.report.regressions import fmt_run, paired_regression, regression_line
from flows.track.tracking import Tracker
from schemas.errors import R1FlowError

log = logging.getLogger("r1flow")


@dataclass(frozen=True)
class RegressionPolicy:
    """What a deployed run does with a regression: fail the flow run (`fail`), and the drop in accuracy points the
    interval must lie wholly beyond (`tolerance_points`, 0: any drop beyond the noise)."""

    fail: bool = True
    tolerance_points: float = 0.0


def last_successful_run(client: Any, run: FlowRun) -> FlowRun | None:
    """The newest Completed flow run of `run`'s deployment that started before `run` (None: there is none)."""
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[run.deployment_id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED])),
        start_time=FlowRunFilterStartTime(before_=run.start_time)), sort=FlowRunSort.START_TIME_DESC, limit=2)
    return next((r for r in runs if r.id != run.id), None)


def baseline_rows(tracker: Tracker, flow_run_id: str) -> tuple[str, list[dict[str, Any]]] | None:
    """(MLflow parent run id, its comparison rows) of the pipeline run of Prefect flow run `flow_run_id` in this
    experiment; None when it has none (no such parent run, or one without evals)."""
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.`r1flow.flow_run_id` = '{flow_run_id}'",
                                      max_results=20)
    for run in runs:
        if "mlflow.parentRunId" not in run.data.tags and (data := load_comparison(tracker, run.info.run_id)):
            return run.info.run_id, data["rows"]
    return None


def compare_eval(row: dict[str, Any], previous: dict[str, Any] | None, read_eval: Callable[[str], list[dict]],
                 policy: RegressionPolicy) -> dict[str, Any]:
    """One eval node's comparison: its comparison row in this run (`row`) and in the baseline (`previous`), and
    `paired_regression` of their greedy results (`read_eval(fingerprint)`); with a `note` and no verdict when the
    baseline has no such eval or its results cannot be read (garbage-collected, damaged)."""
    out = {"eval": row["eval"], "current": row, "previous": previous, "gain": None, "regression": False}
    if previous is None or not previous.get("eval_fingerprint"):
        return {**out, "note": "not compared: the baseline run has no such eval"}
    try:
        before = greedy_scores(read_eval(previous["eval_fingerprint"]))
    except R1FlowError as e:  # said, not a failure of this run
        return {**out, "note": f"not compared: the baseline's eval output {previous['eval_fingerprint'][:12]} "
                               f"cannot be read ({e})"}
    after = greedy_scores(read_eval(row["eval_fingerprint"]))
    return {**out, **paired_regression(before, after, policy.tolerance_points)}


def compare_with_baseline(plan: Plan, results: list, tracker: Tracker, flow_run_id: str | None,
                          read_eval: Callable[[str], list[dict]], policy: RegressionPolicy) -> dict[str, Any] | None:
    """Every eval node of this run against the same node in the baseline run (module docstring). None outside a
    deployment. Otherwise {run, baseline (None: nothing to compare), rows (each eval's current and previous
    comparison rows, the paired change and `regression`), lines (one per regression), note, tolerance_points}."""
    deployment_id = this_deployment.id
    if not deployment_id or not flow_run_id:
        return None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        previous = last_successful_run(client, run)
        name = client.read_deployment(deployment_id).name
    check: dict[str, Any] = {"run": {"id": str(run.id), "name": run.name}, "baseline": None, "rows": [], "lines": [],
                             "tolerance_points": policy.tolerance_points, "fail": policy.fail}
    baseline = {"id": str(previous.id), "name": previous.name} if previous else None
    found = baseline and baseline_rows(tracker, baseline["id"])
    if not found:
        check["note"] = (f"No earlier successful run of deployment {name!r}: nothing to compare; this run is the next "
                         "one's baseline." if baseline is None else
                         f"The last successful run of deployment {name!r}, {fmt_run(baseline)}, left no eval rows in "
                         f"MLflow experiment {tracker.experiment_id}: nothing to compare.")
        _say(check["note"])
        return check
    check["baseline"] = {**baseline, "parent_run_id": found[0]}
    before = {r.get("eval"): r for r in found[1]}
    check["rows"] = [compare_eval(r, before.get(r["eval"]), read_eval, policy) for r in comparison_rows(plan, results)]
    check["lines"] = [regression_line(r["eval"], r, check["baseline"], check["run"])
                      for r in check["rows"] if r["regression"]]
    check["note"] = f"Baseline: {fmt_run(baseline)}, the last successful run of deployment {name!r} before this one."
    _say(check["note"] + " " + ("; ".join(check["lines"]) or "No regression."))
    return check


def regression_metrics(check: dict[str, Any] | None) -> dict[str, float]:
    """The parent MLflow run's metrics of a comparison: `<eval>/regression` (1 or 0) and the paired change in
    accuracy with its interval (`<eval>/regression/change`, `..._ci_low`, `..._ci_high`) where it was computed."""
    out = {}
    for r in (check or {}).get("rows", []):
        out[f"{r['eval']}/regression"] = float(r["regression"])
        if r["gain"] is not None:
            out.update({f"{r['eval']}/regression/change{suffix}": r[key]
                        for suffix, key in (("", "gain"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))})
    return out


def failing(check: dict[str, Any] | None) -> bool:
    return bool(check and check["fail"] and check["lines"])


def final_state(result: dict[str, Any]) -> Any:
    """What a pipeline flow returns: its result, or a Failed state whose message is one line per regression (the
    result kept as its data) when the run regressed and its policy fails on that."""
    check = result.get("regressions")
    return Failed(message="\n".join(check["lines"]), data=result) if failing(check) else result


def _say(message: str) -> None:
    try:
        get_run_logger().info(message)
    except Exception:  # outside a flow run
        log.info(message)
