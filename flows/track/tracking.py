"""MLflow tracking through MlflowClient with explicit run ids.

MLflow's fluent "active run" is thread-local and Prefect runs tasks in worker threads
(docs/design.md §6), so every call here names its run id; nothing relies on a current run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.servers.servers import MLFLOW_UI_QUERY, private_file
from flows.servers.settings import file_lock
from flows.store.artifacts import host_id, owner_gone, process_owner

PARAM_MAX = 6000
# MLflow 3 opens an experiment on its GenAI (traces) view. Ours are training runs: the experiment says so (the UI
# reads the tag when its workflow selector is off), and every link r1flow prints asks for the runs table (the
# selector, on in 3.17, reads the link's workflowType before the browser's stored choice, which defaults to GenAI).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
UI_QUERY = MLFLOW_UI_QUERY
OWNER_HOST_TAG = "r1flow.host"  # flows.store.artifacts.host_id() of the process that created the run
OWNER_PROCESS_TAG = "r1flow.process"  # its "<pid>:<start ticks>"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def run_name(what: str, flow_run_id: str | None, then: str = "") -> str:
    """An MLflow parent run name that tells runs apart: when (UTC, to the minute), what ran (a pipeline run's
    profile), a short id (the flow run's), then `then` (a pipeline run's recipe, which its experiment names already):
    `11-29 03:44 tiny 2cb409 eval`. MLflow's runs table shows the first ~18 characters (beside its assistant pane at
    1280 px), so what differs between runs of one experiment comes first: the time, the profile, and enough of the
    id to tell apart two runs started in the same minute."""
    short = (flow_run_id or uuid.uuid4().hex)[:6]
    return f"{datetime.now(UTC):%m-%d %H:%M} {what} {short}" + (f" {then}" if then else "")


@contextlib.contextmanager
def sqlite_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock beside a local sqlite tracking database (`<db>.lock`) across r1flow processes;
    nothing for a tracking server (it serialises its own writes).

    Runs started together on a fresh home each found no tables and ran MLflow's schema migration at once:
    `table _alembic_tmp_experiments already exists`, and a database left unusable (issue 28).
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    with file_lock(f"{Path(uri.removeprefix('sqlite:///'))}.lock"):
        yield


_READY: set[str] = set()


def mlflow_client(uri: str) -> MlflowClient:
    """An MlflowClient whose store is created (tables made or migrated) by one process at a time."""
    # MlflowClient prints "View run ... / View experiment ..." links for a tracking server on every run it ends; they
    # open MLflow 3's GenAI view (no workflowType). r1flow prints its own links (Tracker.run_url).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if uri in _READY:
        return MlflowClient(uri)
    with sqlite_lock(uri):  # the client's store (built in the constructor or at the first call) runs the migration
        if uri.startswith("sqlite:///"):
            private_file(Path(uri.removeprefix("sqlite:///")))  # 0600 before MLflow creates it
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
    _READY.add(uri)
    return client


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None = None):
        self.uri = tracking_uri
        self.client = mlflow_client(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_location,
                                                                   tags=EXPERIMENT_KIND)
            except MlflowException as e:  # another run created it between the two calls
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            self.experiment_id = exp.experiment_id
        if exp is not None and not EXPERIMENT_KIND.items() <= exp.tags.items():  # made before r1flow set the kind
            for key, value in EXPERIMENT_KIND.items():
                self.client.set_experiment_tag(self.experiment_id, key, value)

    def start_run(self, name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
        tags = {k: str(v) for k, v in tags.items()}
        pid, ticks, host = process_owner().split("-")  # which process owns the run (mark_abandoned)
        tags.update({OWNER_HOST_TAG: host, OWNER_PROCESS_TAG: f"{pid}:{ticks}"})
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def record_cache_hit(self, parent_run_id: str, *, node: str, stage: str, key: str, config: dict[str, Any],
                         seed: int, outputs: dict[str, str], metrics: dict[str, Any], source_run_id: str | None,
                         flow_run_id: str | None, host: str = "", ray_node_id: str = "") -> str:
        """A cached stage's own nested run: its config, its recorded metrics and outputs, and the run that produced
        them (`r1flow.source_run_id`), so a cached stage reads like one that ran. Returns its run id."""
        run_id = self.start_run(node, {"r1flow.stage": stage, "r1flow.node": node, "r1flow.cache_key": key,
                                       "r1flow.cache_hit": "true", "r1flow.source_run_id": source_run_id or "",
                                       "r1flow.flow_run_id": flow_run_id or "", "r1flow.host": host,
                                       "r1flow.ray_node_id": ray_node_id}, parent_run_id)
        self.log_params(run_id, {"config": config, "seed": seed})
        self.log_metrics(run_id, {k: v for k, v in metrics.items() if k != "stage_seconds"})
        self.set_tags(run_id, {f"r1flow.output.{k}": v for k, v in outputs.items()})
        self.end(run_id)
        return run_id

    def mark_abandoned(self, max_runs: int = 1000) -> int:
        """End as KILLED the r1flow runs still RUNNING whose process (on this host) is provably gone: a run killed
        with kill -9 closes none of its MLflow runs. Runs of live processes (concurrent runs on this home) are left
        alone. Returns how many were ended."""
        experiments = [e.experiment_id for e in self.client.search_experiments(filter_string="name LIKE 'r1flow/%'")]
        if not experiments:
            return 0
        runs = self.client.search_runs(
            experiments, f"attributes.status = 'RUNNING' and tags.`{OWNER_HOST_TAG}` = '{host_id()}'",
            max_results=max_runs)
        ended = 0
        for run in runs:
            pid, _, ticks = run.data.tags.get(OWNER_PROCESS_TAG, "").partition(":")
            if not (pid.isdigit() and ticks.isdigit() and owner_gone(int(pid), int(ticks), host_id())):
                continue
            self.client.set_tag(run.info.run_id, "r1flow.abandoned", f"process {pid} on {socket.gethostname()} is gone")
            self.client.set_terminated(run.info.run_id, "KILLED")
            ended += 1
        return ended

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        flat = [Param(k, str(v)[:PARAM_MAX]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), 100):
            self.client.log_batch(run_id, params=flat[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
        for i in range(0, len(batch), 500):
            self.client.log_batch(run_id, metrics=batch[i : i + 500])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_file(self, run_id: str, path: Path, subdir: str = "") -> None:
        self.client.log_artifact(run_id, str(path), subdir or None)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)

    def end(self, run_id: str, ok: bool = True) -> None:
        """FINISHED, or FAILED while an error is on its way up: then a failure to say so (the server is what
        failed) is a warning, never the error that replaces the real one; the next run ends the run as KILLED
        (mark_abandoned)."""
        try:
            self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
        except Exception as e:
            if ok:
                raise
            logging.getLogger("r1flow").warning("could not mark MLflow run %s FAILED: %s: %s", run_id,
                                                type(e).__name__, str(e)[:200])

    def log_dir(self, run_id: str, path: Path, subdir: str = "") -> None:
        """Every file under `path`, as artifacts of the run under `subdir`."""
        self.client.log_artifacts(run_id, str(path), subdir or None)

    @property
    def is_server(self) -> bool:
        return self.uri.startswith(("http://", "https://"))

    def run_path(self, run_id: str, experiment_id: str | None = None) -> str:
        """The MLflow UI's route to a run, relative to the UI's root."""
        return f"#/experiments/{experiment_id or self.experiment_id}/runs/{run_id}{UI_QUERY}"

    def run_url(self, run_id: str, experiment_id: str | None = None) -> str | None:
        """A clickable URL for a run when tracking goes to a server; None for a local store."""
        return f"{self.uri.rstrip('/')}/{self.run_path(run_id, experiment_id)}" if self.is_server else None

    def artifact_url(self, run_id: str, path: str) -> str | None:
        """A URL that serves one artifact file of a run (the server's `get-artifact` route), or None."""
        if not self.is_server:
            return None
        return f"{self.uri.rstrip('/')}/get-artifact?{urlencode({'path': path, 'run_uuid': run_id})}"

    def ui_hint(self) -> str:
        """How to open the UI for a local store (the run paths are relative to its root)."""
        home = os.environ.get("R1FLOW_HOME")
        prefix = f"R1FLOW_HOME={home} " if home and Path(home).resolve() != Path(".r1flow").resolve() else ""
        return f"{prefix}r1flow ui  (it prints its address; on port 5000:) http://127.0.0.1:5000/{UI_QUERY}"

    def run_link(self, run_id: str) -> str:
        """Where to look at a run: a URL for a server, else the `mlflow ui` command to start one."""
        return self.run_url(run_id) or f"{self.ui_hint()}{self.run_path(run_id)}"
