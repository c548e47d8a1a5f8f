"""Cleaning up after runs that were killed (kill -9, a lost server): what a provably dead r1flow process on this
host left behind, found once as each run starts (`reclaim_abandoned`): staging and incoming folders, the sandbox's
run directories in the temporary directory (model-written programs), Prefect flow and task runs still RUNNING
(marked Crashed), MLflow runs still RUNNING (marked KILLED).

A flow run names its process in its labels (host id, pid and start ticks); the labels are also written first to a
file under the home (`<home>/flow-runs/<flow run id>`), so a run whose Prefect server died before the label update
is still tied to its process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from prefect import get_client
from prefect.client.schemas import filters as f
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

from flows.store.artifacts import ArtifactStore, host_id, owner_gone, process_owner
from flows.track.tracking import Tracker
from stages.rewards.sandbox import sweep_run_dirs

PREFECT_HOST_LABEL = "r1flow.host"  # flows.store.artifacts.host_id(): a flow run an r1flow process on this host runs
PREFECT_PROCESS_LABEL = "r1flow.process"  # "<pid>:<start ticks>" of that process
ABANDONED_FLOW_STATES = ("PENDING", "RUNNING", "CANCELLING")
ABANDONED_TASK_STATES = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "PAUSED")


def _owner_labels() -> dict[str, str]:
    pid, ticks, host = process_owner().split("-")
    return {PREFECT_HOST_LABEL: host, PREFECT_PROCESS_LABEL: f"{pid}:{ticks}"}


def _owner_files(owners: Path | None, found: list) -> dict[str, dict[str, str]]:
    """The owner labels recorded on this host's disk for the unfinished flow runs `found`; files of runs no longer
    unfinished are removed."""
    if owners is None or not owners.is_dir():
        return {}
    unfinished = {str(run.id) for run in found}
    recorded = {}
    for path in owners.iterdir():
        if path.name not in unfinished:
            path.unlink(missing_ok=True)
            continue
        with contextlib.suppress(OSError, ValueError):
            recorded[path.name] = json.loads(path.read_text())
    return recorded


def mark_abandoned_flow_runs(flow_run_id: str | None = None, owners: Path | None = None) -> tuple[int, int]:
    """Label this flow run with the process that runs it; set Crashed the flow runs (and their unfinished task runs)
    that another r1flow process on this host left unfinished and that is provably gone (kill -9 leaves them
    RUNNING for ever). Flow runs of live processes, of other hosts, or without an owner are left alone. Returns
    (flow runs, task runs) marked.

    `owners`: a folder on this host where the labels are also written, first, as a file named by the flow run:
    a Prefect server lost between creating the flow run and the label update leaves a run without labels that
    only this file ties to its (dead) process."""
    mine = _owner_labels()
    if owners is not None and flow_run_id:
        owners.mkdir(parents=True, exist_ok=True)
        (owners / flow_run_id).write_text(json.dumps(mine))
    with get_client(sync_client=True) as client:
        if flow_run_id:
            client.update_flow_run_labels(flow_run_id, mine)  # merged into its labels
        found = client.read_flow_runs(flow_run_filter=f.FlowRunFilter(  # (no label filter in Prefect's API)
            state=f.FlowRunFilterState(type=f.FlowRunFilterStateType(any_=[StateType(t) for t in ABANDONED_FLOW_STATES]))),
            limit=200)
        recorded = _owner_files(owners, found)
        dead: dict[Any, str] = {}
        for run in found:
            labels = run.labels if (run.labels or {}).get(PREFECT_HOST_LABEL) else recorded.get(str(run.id), {})
            if labels.get(PREFECT_HOST_LABEL) != mine[PREFECT_HOST_LABEL]:
                continue
            pid, _, ticks = str(labels.get(PREFECT_PROCESS_LABEL, "")).partition(":")
            if str(run.id) != flow_run_id and pid.isdigit() and ticks.isdigit() and owner_gone(int(pid), int(ticks),
                                                                                                 host_id()):
                dead[run.id] = f"abandoned: process {pid} on {socket.gethostname()} is gone (found by {os.getpid()})"
        if not dead:
            return 0, 0
        tasks = client.read_task_runs(task_run_filter=f.TaskRunFilter(
            flow_run_id=f.TaskRunFilterFlowRunId(any_=list(dead)),
            state=f.TaskRunFilterState(type=f.TaskRunFilterStateType(any_=[StateType(t) for t in ABANDONED_TASK_STATES]))))
        for t in tasks:
            client.set_task_run_state(t.id, Crashed(message=dead[t.flow_run_id]), force=True)
        for run_id, message in dead.items():
            client.set_flow_run_state(run_id, Crashed(message=message), force=True)
        return len(dead), len(tasks)


def reclaim_abandoned(store: ArtifactStore, tracker: Tracker, flow_run_id: str | None,
                      log: Any = print) -> dict[str, Any]:
    """What runs killed earlier (kill -9) left, cleaned once as a run starts: their staging and incoming folders,
    set-aside copies beyond the cap, their sandbox run directories, their Prefect flow and task runs (Crashed) and
    MLflow runs (KILLED). Only what a provably dead process owned; a failure here is a warning, never the run's
    failure. One line if anything was done; the counts and the seconds it took are returned."""
    t0 = time.perf_counter()
    counts: dict[str, Any] = {}
    for what, fn in (("folders", store.sweep), ("sandbox", lambda: sweep_run_dirs(owner_gone)),
                     ("prefect", lambda: mark_abandoned_flow_runs(flow_run_id, store.home / "flow-runs")
                      if flow_run_id else (0, 0)),
                     ("mlflow", tracker.mark_abandoned)):
        try:
            counts[what] = fn()
        except Exception as e:  # noqa: BLE001 - housekeeping must not stop the run
            log(f"r1flow: could not clean up after killed runs ({what}): {type(e).__name__}: {e}")
    counts["seconds"] = time.perf_counter() - t0
    folders = counts.get("folders") or {}
    n_flows, n_tasks = counts.get("prefect") or (0, 0)
    if any(folders.values()) or counts.get("sandbox") or n_flows or n_tasks or counts.get("mlflow"):
        log(f"r1flow: cleaned after killed runs: {folders.get('staging', 0)} staging, {folders.get('incoming', 0)} "
            f"incoming and {counts.get('sandbox', 0)} sandbox folders of dead processes, {folders.get('corrupt', 0)} "
            "set-aside copies over the cap; marked "
            f"{n_flows} Prefect flow runs and {n_tasks} task runs Crashed, {counts.get('mlflow', 0)} MLflow runs KILLED "
            f"({counts['seconds']:.2f} s)")
    return counts

