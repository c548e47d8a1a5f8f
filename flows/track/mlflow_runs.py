"""The MLflow runs behind a pipeline run's stage results (a cached stage's run names the run that produced its
outputs), their metric curves, and markdown links to runs, for the report, the comparison and the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlflow.exceptions import MlflowException

from flows.track.tracking import Tracker

if TYPE_CHECKING:
    from flows.plan.results import StageResult


@dataclass
class StageRuns:
    """The MLflow runs behind one stage result: the run of this pipeline run and the one that
    produced the outputs (the same run unless the stage was a cache hit)."""

    run_id: str
    experiment_id: str
    source_run_id: str | None  # None: the producing run is not in this tracking store
    source_experiment_id: str | None
    source_metrics: set[str] = field(default_factory=set)  # metric keys the producing run logged


def get_run(tracker: Tracker, run_id: str):
    try:
        return tracker.client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def stage_runs(tracker: Tracker, result: StageResult) -> StageRuns | None:
    if result.status == "skipped" or not result.mlflow_run_id:
        return None
    run = get_run(tracker, result.mlflow_run_id)
    if run is None:
        return None
    source = run
    if run.data.tags.get("r1flow.cache_hit") == "true":
        src_id = run.data.tags.get("r1flow.source_run_id")
        source = get_run(tracker, src_id) if src_id else None
    return StageRuns(run.info.run_id, run.info.experiment_id,
                     source.info.run_id if source else None, source.info.experiment_id if source else None,
                     set(source.data.metrics) if source else set())


def metric_curve(tracker: Tracker, run_id: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric, one value per step (the last one logged: a resumed stage may
    log a step twice), non-finite values dropped."""
    last: dict[int, tuple[int, float]] = {}
    for m in tracker.client.get_metric_history(run_id, key):
        if math.isfinite(m.value) and (m.step not in last or m.timestamp >= last[m.step][0]):
            last[m.step] = (m.timestamp, m.value)
    steps = sorted(last)
    return steps, [last[s][1] for s in steps]


def run_link(tracker: Tracker, run_id: str, experiment_id: str) -> str:
    target = tracker.run_url(run_id, experiment_id) or tracker.run_path(run_id, experiment_id)
    return f"[{run_id[:8]}]({target})"
