"""The Prefect layer: one cached task per stage, a flow that orders them, and the run summary.

Caching (DESIGN.md §2, §6): each stage is a task whose `cache_key_fn` returns our cache key and
whose result (a small JSON of output fingerprints) is persisted. Before submitting, the flow
checks the store's own record for that key and verifies every output file; if anything is missing
or corrupt it sets `refresh_cache=True`, so a stale Prefect cache can never hand a deleted
artifact downstream. Tasks pass fingerprints and run ids, never tensors or tables.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.context import get_run_context

from flows.cache import cache_key, config_hash
from flows.context import FlowContext
from flows.recipes import Plan, load_plan
from flows.report import build_report, publish_report, register_models, report_location
from flows.results import StageResult, fmt_metric
from flows.settings import Settings
from flows.store import ArtifactStore, CacheRecord, host_id, owner_gone, process_owner
from flows.tracking import Tracker, run_name
from schemas.artifacts import DATA_FILE, Producer
from schemas.errors import ArtifactError, ConfigError, R1FlowError
from stages import get_stage
from stages.base import Input
from stages.runtime import lifetime
from stages.training.launch import run_stage

LOG_DATA_MAX_BYTES = 50 << 20  # datasets up to this size are copied into MLflow; larger ones by pointer


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _flow_run_id() -> str | None:
    try:
        ctx = get_run_context()
        run = getattr(ctx, "flow_run", None) or getattr(getattr(ctx, "task_run", None), "flow_run_id", None)
        return str(getattr(run, "id", run)) if run else None
    except Exception:  # outside Prefect
        return None


TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


def is_transient(exc: BaseException | None) -> bool:
    """Worth a retry: the tracking or orchestration server (or a remote store) was unreachable.

    Deterministic failures (bad config, bad data, a corrupt artifact, a bug) are not retried: the
    same inputs would fail the same way, and a retry would only repeat the compute.
    """
    if exc is None or isinstance(exc, R1FlowError):
        return False
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    try:
        import httpx

        if isinstance(exc, httpx.TransportError):
            return True
    except ImportError:  # pragma: no cover - prefect depends on httpx
        pass
    try:
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:  # pragma: no cover - mlflow depends on requests
        pass
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException) and exc.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"):
        return True
    # MLflow re-raises an unreachable server as MlflowException("API request ... failed") during the
    # requests.ConnectionError (its __context__, not __cause__); follow both links.
    inner = exc.__cause__ or exc.__context__
    return inner is not exc and is_transient(inner)


def _retry_transient(task, task_run, state) -> bool:
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result itself could not be read: treat what was raised
        exc = e
    return is_transient(exc if isinstance(exc, BaseException) else None)


@contextlib.contextmanager
def stage_lock(home: str, key: str):
    """One process at a time per cache key on this R1FLOW_HOME: a schedule firing while a user
    triggers the same stage from the UI waits here, then finds the other's published result."""
    path = Path(home) / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def execute_stage(
    *, node: str, stage: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str,
    parent_run_id: str | None, settings: dict[str, str], experiment: str, flow_run_id: str | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None, refresh: bool = False,
) -> dict[str, Any]:
    """Run one stage (or reuse its recorded outputs) and publish its artifacts. Plain function:
    the Prefect task wraps it, tests call it directly."""
    s = Settings(**settings)
    with stage_lock(s.home, key):
        return _execute_stage(node=node, stage=stage, config=config, inputs=inputs, seed=seed, key=key,
                              parent_run_id=parent_run_id, s=s, experiment=experiment, flow_run_id=flow_run_id,
                              log=log or logging.getLogger("r1flow"), refresh=refresh)


def _execute_stage(*, node, stage, config, inputs, seed, key, parent_run_id, s: Settings, experiment, flow_run_id,
                   log, refresh) -> dict[str, Any]:
    store = ArtifactStore(s.store, home=s.home)
    record = None if refresh else store.lookup(key)
    if record is not None:
        return {"outputs": record.outputs, "metrics": record.metrics, "seconds": 0.0, "reused": True,
                "mlflow_run_id": record.mlflow_run_id}

    module = get_stage(stage)
    cfg = module.CONFIG.model_validate(config)
    resolved = {name: resolve_input(store, fp) for name, fp in inputs.items()}  # verified before any compute
    tracker = Tracker(s.tracking_uri, experiment, s.mlflow_artifact_location)
    run_id = tracker.start_run(node, {"r1flow.stage": stage, "r1flow.node": node, "r1flow.stage_version": module.VERSION,
                                       "r1flow.cache_key": key, "r1flow.cache_hit": "false",
                                       "r1flow.flow_run_id": flow_run_id or "",
                                       **{f"r1flow.input.{k}": v for k, v in inputs.items()}}, parent_run_id)
    tracker.log_params(run_id, {"config": config, "seed": seed,
                                "inputs": {k: v[:16] for k, v in inputs.items()}})
    ctx = FlowContext(store=store, tracker=tracker, run_id=run_id, cache_key=key, seed=seed,
                      device=default_device(), log=log)
    t0 = time.perf_counter()
    ok = False
    try:
        outputs = run_stage(module, cfg, resolved, ctx)  # in this process, or under accelerate launch (resources)
        if set(outputs) != set(module.OUTPUTS):
            raise ArtifactError(f"stage {stage!r} returned outputs {sorted(outputs)}, declared {sorted(module.OUTPUTS)}")
        seconds = time.perf_counter() - t0
        producer = Producer(stage=stage, node=node, stage_version=module.VERSION, config_hash=config_hash(config),
                            cache_key=key, mlflow_run_id=run_id, flow_run_id=flow_run_id)
        published, metrics = {}, {}
        for name, out in outputs.items():
            manifest = store.publish(out.path, kind=out.kind, schema=out.schema, producer=producer,
                                     parents=sorted(set(inputs.values())), rows=out.rows, metrics=out.metrics,
                                     extra=out.extra)
            published[name] = manifest.fingerprint
            metrics.update(out.metrics)
            tracker.log_text(run_id, manifest.to_json(), f"outputs/{name}/manifest.json")
            data = store.local_dir(manifest.fingerprint) / DATA_FILE
            if manifest.kind == "dataset" and data.exists() and data.stat().st_size <= LOG_DATA_MAX_BYTES:
                tracker.log_file(run_id, data, f"outputs/{name}")
            tracker.set_tags(run_id, {f"r1flow.output.{name}": manifest.fingerprint})
        metrics["stage_seconds"] = seconds
        tracker.log_metrics(run_id, {"stage_seconds": seconds})
        store.record(CacheRecord(key=key, node=node, stage=stage, outputs=published, mlflow_run_id=run_id,
                                 duration_s=seconds, metrics={k: float(v) for k, v in metrics.items()}))
        shutil.rmtree(ctx.checkpoint_dir, ignore_errors=True)  # published: the checkpoints are spent
        ok = True
        return {"outputs": published, "metrics": metrics, "seconds": seconds, "reused": False, "mlflow_run_id": run_id}
    finally:
        shutil.rmtree(ctx.staging, ignore_errors=True)
        tracker.end(run_id, ok)


def _task_key(_context, parameters: dict[str, Any]) -> str:
    return parameters["key"]


@task(persist_result=True, cache_key_fn=_task_key, result_serializer="json", task_run_name="{node}",
      log_prints=True, retries=2, retry_delay_seconds=10, retry_condition_fn=_retry_transient)
def stage_task(node: str, stage: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str,
               parent_run_id: str | None, settings: dict[str, str], experiment: str,
               refresh: bool = False) -> dict[str, Any]:
    return execute_stage(node=node, stage=stage, config=config, inputs=inputs, seed=seed, key=key,
                         parent_run_id=parent_run_id, settings=settings, experiment=experiment,
                         flow_run_id=_flow_run_id(), log=get_run_logger(), refresh=refresh)


class NodeProgress:
    """One line per node as a run goes: `[5/23] grpo_reasoning (grpo) ...` when it starts computing, and
    `[5/23] grpo_reasoning (grpo) run in 12.3 s` (or `cached in 0.2 s`) when it ends, each with the run's
    elapsed time and its run/cached counts so far. Through the flow run's logger (Prefect prints it once
    on the terminal and keeps it with the flow run; outside a flow run the `r1flow` logger), or `log`."""

    def __init__(self, total: int, log: logging.Logger | logging.LoggerAdapter | None = None):
        self.total, self.index, self.counts = total, 0, {"run": 0, "cached": 0}
        self.t0 = time.perf_counter()
        self.log = log or _run_logger()

    def _so_far(self) -> str:
        elapsed = int(time.perf_counter() - self.t0)
        return f"elapsed {elapsed // 60}:{elapsed % 60:02d}; {self.counts['run']} run, {self.counts['cached']} cached"

    def start(self, node: str, stage: str) -> None:
        self.log.info("[%d/%d] %s (%s) ... (%s)", self.index + 1, self.total, node, stage, self._so_far())

    def end(self, node: str, stage: str, status: str, seconds: float) -> None:
        self.index += 1
        self.counts[status] += 1
        self.log.info("[%d/%d] %s (%s) %s in %.1f s (%s)", self.index, self.total, node, stage, status, seconds,
                      self._so_far())


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:  # outside a flow run
        return logging.getLogger("r1flow")


def node_key(plan_node, upstream: dict[str, dict[str, str]]) -> tuple[str, dict[str, str], str]:
    module = get_stage(plan_node.stage)
    inputs = {inp: upstream[up][out] for inp, (up, out) in plan_node.inputs.items()}
    salt = module.cache_salt(plan_node.config) if hasattr(module, "cache_salt") else ""
    return cache_key(plan_node.stage, module.VERSION, plan_node.config_dict, inputs, plan_node.seed, salt), inputs, salt


def experiment_name(recipe: str) -> str:
    return f"r1flow/{recipe}"


@flow(name="r1flow-pipeline", persist_result=True, log_prints=True)
def pipeline(recipe: str, profile: str, overrides: list[str] | None = None, only: list[str] | None = None,
             force: list[str] | None = None, settings: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a recipe: every stage node in dependency order, reusing cached outputs where valid.

    Args:
        recipe: Recipe name (r1flow recipes lists them) or path to a recipe YAML.
        profile: Profile sizing the stages: tiny (tests), cpu, gpu.
        overrides: Config overrides KEY=VALUE, e.g. sft.learning_rate=1e-4, dpo.beta=0.2, model=PATH, seed=1.
        only: Run only these nodes; their upstream nodes must be cached.
        force: Re-run these nodes even when cached.
        settings: Storage and tracking locations (default: R1FLOW_HOME, R1FLOW_STORE, MLFLOW_TRACKING_URI).
    """
    plan = load_plan(recipe, profile, overrides or [])
    s = Settings(**settings) if settings else Settings.from_env()
    return run_plan(plan, s, only=set(only or []), force=set(force or []))


PREFECT_HOST_TAG = "r1flow.host:"  # + flows.store.host_id(): a flow run an r1flow process on this host runs
PREFECT_PROCESS_TAG = "r1flow.process:"  # + "<pid>:<start ticks>" of that process
ABANDONED_FLOW_STATES = ("PENDING", "RUNNING", "CANCELLING")
ABANDONED_TASK_STATES = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "PAUSED")


def _owner_tags() -> list[str]:
    pid, ticks, host = process_owner().split("-")
    return [f"{PREFECT_HOST_TAG}{host}", f"{PREFECT_PROCESS_TAG}{pid}:{ticks}"]


def mark_abandoned_flow_runs(flow_run_id: str | None = None) -> tuple[int, int]:
    """Tag this flow run with the process that runs it; set Crashed the flow runs (and their unfinished task runs)
    that another r1flow process on this host left unfinished and that is provably gone (kill -9 leaves them
    RUNNING for ever). Flow runs of live processes, of other hosts, or without the tags are left alone. Returns
    (flow runs, task runs) marked."""
    from prefect import get_client
    from prefect.client.schemas import filters as f
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    mine = _owner_tags()
    with get_client(sync_client=True) as client:
        if flow_run_id:
            current = client.read_flow_run(flow_run_id)
            client.update_flow_run(current.id, tags=sorted(set(current.tags) | set(mine)))
        found = client.read_flow_runs(flow_run_filter=f.FlowRunFilter(
            tags=f.FlowRunFilterTags(all_=[mine[0]]),
            state=f.FlowRunFilterState(type=f.FlowRunFilterStateType(any_=[StateType(t) for t in ABANDONED_FLOW_STATES]))),
            limit=200)
        dead: dict[Any, str] = {}
        for run in found:
            owner = next((t.removeprefix(PREFECT_PROCESS_TAG) for t in run.tags if t.startswith(PREFECT_PROCESS_TAG)), "")
            pid, _, ticks = owner.partition(":")
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
    set-aside copies beyond the cap, their Prefect flow and task runs (Crashed) and MLflow runs (KILLED). Only what
    a provably dead process owned; a failure here is a warning, never the run's failure. One line if anything was
    done; the counts and the seconds it took are returned."""
    t0 = time.perf_counter()
    counts: dict[str, Any] = {}
    for what, fn in (("folders", store.sweep),
                     ("prefect", lambda: mark_abandoned_flow_runs(flow_run_id) if flow_run_id else (0, 0)),
                     ("mlflow", tracker.mark_abandoned)):
        try:
            counts[what] = fn()
        except Exception as e:  # noqa: BLE001 - housekeeping must not stop the run
            log(f"r1flow: could not clean up after killed runs ({what}): {type(e).__name__}: {e}")
    counts["seconds"] = time.perf_counter() - t0
    folders = counts.get("folders") or {}
    n_flows, n_tasks = counts.get("prefect") or (0, 0)
    if any(folders.values()) or n_flows or n_tasks or counts.get("mlflow"):
        log(f"r1flow: cleaned after killed runs: {folders.get('staging', 0)} staging and {folders.get('incoming', 0)} "
            f"incoming folders of dead processes, {folders.get('corrupt', 0)} set-aside copies over the cap; marked "
            f"{n_flows} Prefect flow runs and {n_tasks} task runs Crashed, {counts.get('mlflow', 0)} MLflow runs KILLED "
            f"({counts['seconds']:.2f} s)")
    return counts


def run_plan(plan: Plan, s: Settings, only: set[str] = frozenset(), force: set[str] = frozenset()) -> dict[str, Any]:
    for name in only | force:
        plan.node(name)  # raises a clear error for unknown names
    lifetime.reinstall()  # SIGTERM stops the run within seconds, not Prefect's bridge (stages/runtime/lifetime.py)
    store = ArtifactStore(s.store, home=s.home)
    experiment = experiment_name(plan.recipe)
    tracker = Tracker(s.tracking_uri, experiment, s.mlflow_artifact_location)
    flow_run_id = _flow_run_id()
    reclaim_abandoned(store, tracker, flow_run_id)
    parent = tracker.start_run(run_name(f"{plan.recipe} {plan.profile}", flow_run_id), {"r1flow.recipe": plan.recipe, "r1flow.profile": plan.profile,
                                                                 "r1flow.flow_run_id": flow_run_id or ""})
    tracker.log_params(parent, {"recipe": plan.recipe, "profile": plan.profile, "model": plan.model, "seed": plan.seed,
                                "overrides": " ".join(plan.overrides), "only": ",".join(sorted(only)),
                                "force": ",".join(sorted(force)), "options": plan.options})
    selected = set(only) if only else {n.name for n in plan.nodes}
    needed = plan.ancestors(selected)
    forced = set(force)
    upstream: dict[str, dict[str, str]] = {}
    results: list[StageResult] = []
    progress = NodeProgress(sum(n.name in needed for n in plan.nodes))
    ok = False
    try:
        for node in plan.nodes:
            if node.name not in needed:
                results.append(StageResult(node.name, node.stage, "skipped", 0.0, ""))
                continue
            key, inputs, _ = node_key(node, upstream)
            t0 = time.perf_counter()
            if node.name not in selected:  # an upstream of --only: must come from the cache
                rec = store.lookup(key)
                if rec is None:
                    raise ConfigError(f"--only {','.join(sorted(selected))}: upstream node {node.name!r} has no valid "
                                      f"cached outputs for this config; run it first (or drop --only)")
                upstream[node.name] = rec.outputs
                results.append(StageResult(node.name, node.stage, "cached", time.perf_counter() - t0, "",
                                           rec.outputs, rec.metrics, rec.mlflow_run_id))
                progress.end(node.name, node.stage, "cached", results[-1].seconds)
                continue
            record = None if node.name in forced else store.lookup(key)  # verified: every output file re-hashed
            if record is None:  # it computes (a cached node gets its end line only)
                progress.start(node.name, node.stage)
            state = stage_task.with_options(refresh_cache=record is None)(
                node=node.name, stage=node.stage, config=node.config_dict, inputs=inputs, seed=node.seed, key=key,
                parent_run_id=parent, settings=s.to_dict(), experiment=experiment, refresh=node.name in forced,
                return_state=True)
            out = state.result()
            cached = state.name == "Cached" or out["reused"]
            seconds = time.perf_counter() - t0
            if cached:
                if record is not None and out["outputs"] != record.outputs:
                    # Prefect's result for this key is older than ours (a --force since); ours was verified.
                    out = {**out, "outputs": record.outputs, "metrics": record.metrics,
                           "mlflow_run_id": record.mlflow_run_id}
                run_id = tracker.start_run(node.name, {"r1flow.stage": node.stage, "r1flow.node": node.name,
                                                       "r1flow.cache_key": key, "r1flow.cache_hit": "true",
                                                       "r1flow.source_run_id": out.get("mlflow_run_id") or "",
                                                       "r1flow.flow_run_id": flow_run_id or ""}, parent)
                tracker.log_params(run_id, {"config": node.config_dict, "seed": node.seed})
                tracker.log_metrics(run_id, {k: v for k, v in out["metrics"].items() if k != "stage_seconds"})
                tracker.set_tags(run_id, {f"r1flow.output.{k}": v for k, v in out["outputs"].items()})
                tracker.end(run_id)
            else:
                run_id = out["mlflow_run_id"]
            upstream[node.name] = out["outputs"]
            results.append(StageResult(node.name, node.stage, "cached" if cached else "run", seconds, state.name,
                                       out["outputs"], out["metrics"], run_id))
            progress.end(node.name, node.stage, results[-1].status, seconds)
        summary = {f"{r.node}/{k}": v for r in results for k, v in r.key_metrics().items()}
        summary.update({f"{r.node}/seconds": r.seconds for r in results if r.status != "skipped"})
        tracker.log_metrics(parent, summary)

        registration = register_models(plan, results, tracker, store=store, parent_run_id=parent)
        report = build_report(plan, results, tracker, parent, registration)
        published = publish_report(report, tracker, parent)
        ok = True
    finally:
        tracker.end(parent, ok)
    return {"recipe": plan.recipe, "profile": plan.profile, "parent_run_id": parent,
            "experiment_id": tracker.experiment_id, "link": tracker.run_link(parent), "flow_run_id": flow_run_id,
            "stages": [r.__dict__ for r in results],
            # the end of `r1flow run` prints these: the comparison table (None: no eval rows) and where the report is
            "comparison": report.comparison, "report": report_location(tracker, parent, published["mlflow_artifacts"])}


def render_markdown(plan: Plan, results: list[StageResult]) -> str:
    lines = [f"# r1flow run: recipe `{plan.recipe}`, profile `{plan.profile}`", "",
             "| stage | kind | status | seconds | key metrics | outputs |", "|---|---|---|---|---|---|"]
    for r in results:
        metrics = ", ".join(f"{k}={fmt_metric(v)}" for k, v in r.key_metrics().items())
        outs = ", ".join(f"{k}:{v[:12]}" for k, v in r.outputs.items())
        lines.append(f"| {r.node} | {r.stage} | {r.status} | {r.seconds:.1f} | {metrics} | {outs} |")
    return "\n".join(lines) + "\n"


def resolve_input(store: ArtifactStore, fingerprint: str) -> Input:
    """A verified local view of an artifact; an adapter also gets its base model, found by fingerprint."""
    inp = store.get(fingerprint)
    base_fp = inp.manifest.extra.get("base_fingerprint")
    return Input(inp.path, inp.manifest, resolve_input(store, base_fp)) if base_fp else inp
