"""The Prefect layer: one cached task per stage, a flow that orders them, and the run summary.

Caching (docs/design.md §2, §5, §6): each stage is a task whose `cache_key_fn` returns our cache key and
whose result (a small JSON of output fingerprints) is persisted. Before submitting, the flow
checks the store's own record for that key and verifies every output file; if anything is missing
or corrupt it sets `refresh_cache=True`, so a stale Prefect cache can never hand a deleted
artifact downstream. Tasks pass fingerprints and run ids, never tensors or tables.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import requests
from mlflow.exceptions import MlflowException
from prefect import flow, get_client, get_run_logger, task
from prefect.client.schemas.objects import TaskRunResult
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_engine import run_task
from prefect.utilities.annotations import quote

from flows.plan.recipes import Plan, load_plan
from flows.plan.results import StageResult
from flows.report.registry import register_models
from flows.report.report import build_report, publish_report, report_location
from flows.run import placement
from flows.run.checkpoint_evals import BESIDE, CheckpointEvals, check_plan, eval_spec
from flows.run.context import FlowContext
from flows.run.engines import check_vllm_nodes, resolve_auto
from flows.run.placement import Execution
from flows.run.reach import check_reachable, describe_node
from flows.run.reclaim import reclaim_abandoned
from flows.run.regressions import (
    RegressionPolicy,
    compare_with_baseline,
    failing,
    final_state,
    regression_metrics,
)
from flows.servers.settings import Settings, file_lock
from flows.store import lease
from flows.store.artifacts import ArtifactStore, CacheRecord, raise_if_disk_full
from flows.store.cache import cache_key, config_hash, reusable_record
from flows.store.lineage import with_lineage
from flows.track.tracking import Tracker, run_name
from schemas.artifacts import DATA_FILE, Producer
from schemas.errors import ArtifactError, ConfigError, R1FlowError, StageError
from stages import get_stage, stage_version
from stages.base import Input
from stages.runtime import lifetime, threads
from stages.training.launch import run_stage

LOG_DATA_MAX_BYTES = 50 << 20  # datasets up to this size are copied into MLflow; larger ones by pointer


def default_device() -> str:
    # lazy: start-up (torch: only a stage needs it; deploy and serve import this module)
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
    if isinstance(exc, httpx.TransportError):  # Prefect's client (httpx is a dependency of prefect)
        return True
    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):  # MLflow's (requests: of mlflow)
        return True

    if isinstance(exc, MlflowException) and exc.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"):
        return True
    # MLflow re-raises an unreachable server as MlflowException("API request ... failed") during the
    # requests.ConnectionError (its __context__, not __cause__); follow both links.
    inner = exc.__cause__ or exc.__context__
    return inner is not exc and is_transient(inner)


def _retry_transient(task, task_run, state) -> bool:
    if lifetime.stopping():  # a signal, or a server the run's watchdog found gone: no retry, the run is ending
        return False
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result itself could not be read: treat what was raised
        exc = e
    return is_transient(exc if isinstance(exc, BaseException) else None)


@contextlib.contextmanager
def stage_lock(home: str, key: str):
    """One process at a time per cache key on this R1FLOW_HOME: a schedule firing while a user
    triggers the same stage from the UI waits here, then finds the other's published result."""
    with file_lock(Path(home) / "locks" / f"{key}.lock"):
        yield


def execute_stage(
    *, node: str, stage: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str,
    parent_run_id: str | None, settings: dict[str, str], experiment: str, flow_run_id: str | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None, refresh: bool = False,
    checkpoint_eval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one stage (or reuse its recorded outputs) and publish its artifacts. Plain function:
    the Prefect task wraps it, tests call it directly. `checkpoint_eval`: what its published checkpoints' evals run
    (flows/run/checkpoint_evals.py, `eval_spec`)."""
    s = Settings(**settings)
    log = log or logging.getLogger("r1flow")
    if placement.on_cluster():  # one clear line, before any compute, when this node cannot reach what the run uses
        check_reachable(s, os.environ.get("PREFECT_API_URL"), describe_node(placement.where()["ray_node_id"]))
    # this machine's processes queue on the lock; other machines sharing the store on the lease (flows/store/lease.py)
    store = ArtifactStore(s.store, home=s.home)
    with stage_lock(s.home, key), lease.hold(store, key, log=log):
        return _execute_stage(node=node, stage=stage, config=config, inputs=inputs, seed=seed, key=key,
                              parent_run_id=parent_run_id, s=s, store=store, experiment=experiment,
                              flow_run_id=flow_run_id, log=log, refresh=refresh, checkpoint_eval=checkpoint_eval)


def _execute_stage(*, node, stage, config, inputs, seed, key, parent_run_id, s: Settings, store: ArtifactStore,
                   experiment, flow_run_id, log, refresh, checkpoint_eval=None) -> dict[str, Any]:
    started_at, here = time.time(), placement.where()
    record = None if refresh else store.lookup(key)
    if record is not None:
        return {"outputs": record.outputs, "metrics": record.metrics, "seconds": 0.0, "reused": True,
                "mlflow_run_id": record.mlflow_run_id, "started_at": started_at, "ended_at": time.time(), **here}

    module = get_stage(stage)
    cfg = module.CONFIG.model_validate(config)
    resolved = {name: resolve_input(store, fp) for name, fp in inputs.items()}  # verified before any compute
    tracker = Tracker(s.tracking_uri, experiment, s.mlflow_artifact_location)
    run_id = tracker.start_run(node, {"r1flow.stage": stage, "r1flow.node": node, "r1flow.stage_version": module.VERSION,
                                       "r1flow.cache_key": key, "r1flow.cache_hit": "false",
                                       "r1flow.flow_run_id": flow_run_id or "", "r1flow.host": here["host"],
                                       "r1flow.ray_node_id": here["ray_node_id"],
                                       **{f"r1flow.input.{k}": v for k, v in inputs.items()}}, parent_run_id)
    tracker.log_params(run_id, {"config": config, "seed": seed,
                                "inputs": {k: v[:16] for k, v in inputs.items()}})
    producer = Producer(stage=stage, node=node, stage_version=module.VERSION, config_hash=config_hash(config),
                        cache_key=key, mlflow_run_id=run_id, flow_run_id=flow_run_id, host=here["host"],
                        ray_node_id=here["ray_node_id"] or None)
    evals = CheckpointEvals(checkpoint_eval, node=node, producer=producer, parents=sorted(set(inputs.values())),
                            store=store, tracker=tracker, run_id=run_id, log=log,
                            run_eval=functools.partial(_run_checkpoint_eval, store=store, s=s, experiment=experiment))
    ctx = FlowContext(store=store, tracker=tracker, run_id=run_id, cache_key=key, seed=seed,
                      device=default_device(), log=log, checkpoint_evals=evals)
    t0 = time.perf_counter()
    ok = False
    try:
        try:
            outputs = _run_stage_here(module, cfg, resolved, ctx, log)
        except Exception as e:  # a full disk: one line naming the file (else the staging folder) and the store
            raise_if_disk_full(e, ctx.staging, store.uri)
            raise
        if set(outputs) != set(module.OUTPUTS):
            raise ArtifactError(f"stage {stage!r} returned outputs {sorted(outputs)}, declared {sorted(module.OUTPUTS)}")
        evals.finish()  # the evals of its checkpoints still running: their curve is in the run before it ends
        seconds = time.perf_counter() - t0
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
        return {"outputs": published, "metrics": metrics, "seconds": seconds, "reused": False, "mlflow_run_id": run_id,
                "started_at": started_at, "ended_at": time.time(), **here}
    finally:
        evals.close()
        shutil.rmtree(ctx.staging, ignore_errors=True)
        tracker.end(run_id, ok)


def _run_stage_here(module, cfg, resolved, ctx: FlowContext, log) -> dict[str, Any]:
    """`run_stage` in this process, or under accelerate launch (resources), with this process's share of the cores (on
    a cluster Ray sets the threads per task); a checkpoint eval in the process beside its stage (`BESIDE`)."""
    beside = BESIDE.get()
    if beside is not None:
        return beside(module, cfg, resolved, ctx)
    with contextlib.nullcontext() if placement.on_cluster() else threads.stage_share(log):
        return run_stage(module, cfg, resolved, ctx)


def _run_checkpoint_eval(node: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str,
                         parent_run_id: str, *, store: ArtifactStore, s: Settings, experiment: str,
                         submit: Callable[..., Any] | None = None) -> dict[str, Any]:
    """A checkpoint's eval as an eval node's stage task (a Prefect task run, its MLflow run nested under the training
    stage's; `submit`: on a cluster, a Ray task of its own), reused from the store when its key is there; its result,
    `reused` true for a cache hit."""
    record = reusable_record(store, key, node)
    state = submit_node(node, "eval", config, inputs, seed, key, record=record, force=False,
                        parent_run_id=parent_run_id, s=s, experiment=experiment, submit=submit)
    out = state.result()
    return {**out, "reused": state.name == "Cached" or out["reused"]}


def _task_key(_context, parameters: dict[str, Any]) -> str:
    return parameters["key"]


@task(persist_result=True, cache_key_fn=_task_key, result_serializer="json", task_run_name="{node}",
      log_prints=True, retries=2, retry_delay_seconds=10, retry_condition_fn=_retry_transient)
def stage_task(node: str, stage: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str,
               parent_run_id: str | None, settings: dict[str, str], experiment: str,
               refresh: bool = False, checkpoint_eval: dict[str, Any] | None = None, threads: int | None = None) -> dict[str, Any]:
    if threads:  # a --parallel worker process: its share of the cores (placement.pool_threads)
        placement.use_threads(threads)
    return execute_stage(node=node, stage=stage, config=config, inputs=inputs, seed=seed, key=key,
                         parent_run_id=parent_run_id, settings=settings, experiment=experiment,
                         flow_run_id=_flow_run_id(), log=get_run_logger(), refresh=refresh,
                         checkpoint_eval=checkpoint_eval)


def submit_node(node: str, stage: str, config: dict[str, Any], inputs: dict[str, str], seed: int, key: str, *,
                record: CacheRecord | None, force: bool, parent_run_id: str, s: Settings, experiment: str,
                upstream: Collection[UUID] = (), submit: Callable[[Any, dict[str, Any], dict], Any] | None = None,
                checkpoint_eval: dict[str, Any] | None = None):
    """Hand one node's stage task to Prefect: the one submit path of pipeline nodes (run_plan) and single-stage runs
    (flows/run/deploy.py, run_single_stage). `record`: the store's verified record of `key` (None: not cached, or forced), so
    Prefect's cache of the key is refreshed unless the store holds it. `upstream`: the task runs of this flow run that
    made the node's inputs, recorded as its `inputs` parameter's task inputs (the edges of Prefect's run graph: `inputs`
    holds fingerprints, which Prefect cannot trace to the runs that made them). Called now (submit None: its final
    state) or handed to `submit(task, parameters, dependencies)` (a task runner's future). `checkpoint_eval`: what the
    evals of the checkpoints it publishes run (flows/run/checkpoint_evals.py)."""
    task_ = stage_task.with_options(refresh_cache=record is None)
    params = dict(node=node, stage=stage, config=config, inputs=inputs, seed=seed, key=key, parent_run_id=parent_run_id,
                  settings=s.to_dict(), experiment=experiment, refresh=force)
    if checkpoint_eval is not None:  # absent otherwise: a stage task's parameters as they were
        params["checkpoint_eval"] = checkpoint_eval
    dependencies = {"inputs": {TaskRunResult(id=run_id) for run_id in upstream}}
    if submit is None:
        # In this process Prefect would look every value inside the parameters up among this flow run's task results by
        # id(), and a shared object (the empty string of sft's result and of eval_base's config) draws a false edge
        # (sft -> eval_base). quote() skips that look-up; the task gets the values unwrapped. A task runner's task
        # starts in a context of its own, with no results to confuse, and pickles its parameters (quote does not).
        quoted = {k: quote(v) for k, v in params.items()}
        return run_task(task_, parameters=quoted, return_type="state", dependencies=dependencies)
    return submit(task_, params, dependencies)


def node_outcome(state, out: dict[str, Any], record: CacheRecord | None, tracker: Tracker, parent_run_id: str,
                 flow_run_id: str | None, *, node: str, stage: str, key: str, config: dict[str, Any],
                 seed: int) -> tuple[dict[str, Any], bool, str | None]:
    """(the node's output, whether it was a cache hit, its MLflow run) from its task's final state and result. A
    cache hit gets a nested run of its own naming the run that produced it (`Tracker.record_cache_hit`), so a
    cached node reads like one that ran; the output's `mlflow_run_id` stays that producing run."""
    cached = state.name == "Cached" or out["reused"]
    if not cached:
        return out, False, out["mlflow_run_id"]
    if record is not None and out["outputs"] != record.outputs:
        # Prefect's result for this key is older than ours (a --force since); ours was verified.
        out = {**out, "outputs": record.outputs, "metrics": record.metrics, "mlflow_run_id": record.mlflow_run_id}
    run_id = tracker.record_cache_hit(parent_run_id, node=node, stage=stage, key=key, config=config, seed=seed,
                                      outputs=out["outputs"], metrics=out["metrics"],
                                      source_run_id=out.get("mlflow_run_id"), flow_run_id=flow_run_id,
                                      host=out.get("host", ""), ray_node_id=out.get("ray_node_id", ""))
    return out, True, run_id


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
    try:
        return get_run_logger()
    except MissingContextError:  # outside a flow run
        return logging.getLogger("r1flow")


def node_key(plan_node, upstream: dict[str, dict[str, str]],
             store: ArtifactStore | None = None) -> tuple[str, dict[str, str], str]:
    """(cache key, inputs, salt) of a node whose upstream nodes made `upstream`; with the store, an eval's inputs
    gain its model's ancestor datasets (flows/store/lineage.py). Without one (keys compared from a plan alone, in
    tests): the inputs of the plan only."""
    module = get_stage(plan_node.stage)
    inputs = {inp: upstream[up][out] for inp, (up, out) in plan_node.inputs.items()}
    if store is not None:
        inputs = with_lineage(module, inputs, store)
    salt = module.cache_salt(plan_node.config) if hasattr(module, "cache_salt") else ""
    return cache_key(plan_node.stage, stage_version(module), plan_node.config_dict, inputs, plan_node.seed, salt), inputs, salt


def experiment_name(recipe: str) -> str:
    return f"r1flow/{recipe}"


@flow(name="r1flow-pipeline", persist_result=True, result_serializer="json", log_prints=True)
def pipeline(recipe: str, profile: str, overrides: list[str] | None = None, only: list[str] | None = None,
             force: list[str] | None = None, settings: dict[str, str] | None = None, parallel: int = 1,
             cluster: str | None = None, fail_on_regression: bool = True, regression_tolerance: float = 0.0) -> Any:
    """Run a recipe: every stage node in dependency order, reusing cached outputs where valid.

    Args:
        recipe: Recipe name (r1flow recipes lists them) or path to a recipe YAML.
        profile: Profile sizing the stages: tiny (tests), cpu, gpu.
        overrides: Config overrides KEY=VALUE, e.g. sft.learning_rate=1e-4, dpo.beta=0.2, model=PATH, seed=1.
        only: Run only these nodes; their upstream nodes must be cached.
        force: Re-run these nodes even when cached.
        settings: Storage and tracking locations (default: R1FLOW_HOME, R1FLOW_STORE, MLFLOW_TRACKING_URI).
        parallel: Run up to this many independent stages at once on this machine (each in its own process).
        cluster: Ray cluster address (host:port or ray://host:10001): every stage runs on the cluster where its
            resources fit; independent stages run at the same time.
        fail_on_regression: A run of a deployment fails when an eval's accuracy dropped beyond its paired interval
            since the deployment's last successful run (docs/guides/regressions.md).
        regression_tolerance: Accuracy points a drop's whole interval must exceed to fail the run (0: any drop
            beyond the noise).
    """
    plan = load_plan(recipe, profile, overrides or [])
    s = Settings(**settings) if settings else Settings.from_env()
    return final_state(run_plan(plan, s, only=set(only or []), force=set(force or []),
                                execution=Execution(parallel=parallel, cluster=placement.cluster_address(cluster)),
                                regression=RegressionPolicy(fail_on_regression, regression_tolerance)))


# Flow run labels (not tags: the UI shows tags in every flow run's header; this is bookkeeping)

def run_plan(plan: Plan, s: Settings, only: set[str] = frozenset(), force: set[str] = frozenset(),
             execution: Execution = Execution(), regression: RegressionPolicy | None = None) -> dict[str, Any]:
    """Run the plan's nodes, then its report; `regression`: in a deployment's run, compare its evals with the
    deployment's last successful run (flows/run/regressions.py; the MLflow parent run ends FAILED on a regression
    that the policy fails on)."""
    for name in only | force:
        plan.node(name)  # raises a clear error for unknown names
    placement.check_driver(execution, s.store, s.tracking_uri)
    lifetime.reinstall()  # SIGTERM stops the run within seconds, not Prefect's bridge (stages/runtime/lifetime.py)
    store = ArtifactStore(s.store, home=s.home)
    # one line before any compute, and before the MLflow parent run starts (a refused plan leaves no run RUNNING)
    selected = set(only) if only else {n.name for n in plan.nodes}
    plan = resolve_auto(plan, store.home / "cache-models", on_cluster=bool(execution.cluster),  # backend: auto chosen
                        logger=_run_logger())
    check_plan(plan, selected)  # checkpoint evals
    check_vllm_nodes(plan, selected, store.home / "cache-models", on_cluster=bool(execution.cluster))  # vLLM can serve
    experiment = experiment_name(plan.recipe)
    tracker = Tracker(s.tracking_uri, experiment, s.mlflow_artifact_location)
    flow_run_id = _flow_run_id()
    reclaim_abandoned(store, tracker, flow_run_id)
    parent = tracker.start_run(run_name(plan.profile, flow_run_id, plan.recipe), {"r1flow.recipe": plan.recipe, "r1flow.profile": plan.profile,
                                                                 "r1flow.flow_run_id": flow_run_id or "",
                                                                 "r1flow.execution": execution.describe()})
    tracker.log_params(parent, {"recipe": plan.recipe, "profile": plan.profile, "model": plan.model, "seed": plan.seed,
                                "overrides": " ".join(plan.overrides), "only": ",".join(sorted(only)),
                                "force": ",".join(sorted(force)), "options": plan.options,
                                "parallel": execution.parallel, "cluster": execution.cluster or ""})
    runner = _NodeRunner(plan, s, store, tracker, parent, experiment, flow_run_id, selected, plan.ancestors(selected),
                         set(force), execution)
    ok = False
    try:
        results = runner.run()
        summary = {f"{r.node}/{k}": v for r in results for k, v in r.key_metrics().items()}
        summary.update({f"{r.node}/seconds": r.seconds for r in results if r.status != "skipped"})
        tracker.log_metrics(parent, summary)

        def read_eval(fingerprint: str) -> list[dict[str, Any]]:
            return resolve_input(store, fingerprint).table("eval").to_pylist()

        check = regression and compare_with_baseline(plan, results, tracker, flow_run_id, read_eval, regression)
        tracker.log_metrics(parent, regression_metrics(check))
        regressed = failing(check)
        held = "this run regressed (Regressions above)" if regressed else ""
        registration = register_models(plan, results, tracker, store=store, parent_run_id=parent, hold_aliases=held)
        report = build_report(plan, results, tracker, parent, registration, read_eval=read_eval, regressions=check)
        published = publish_report(report, tracker, parent)
        ok = not regressed
    finally:
        tracker.end(parent, ok)
    return {"recipe": plan.recipe, "profile": plan.profile, "parent_run_id": parent,
            "experiment_id": tracker.experiment_id, "link": tracker.run_link(parent), "flow_run_id": flow_run_id,
            "execution": execution.describe(), "stages": [r.__dict__ for r in results],
            # the end of `r1flow run` prints these: the comparison table (None: no eval rows) and where the report is
            "comparison": report.comparison, "report": report_location(tracker, parent, published["mlflow_artifacts"]),
            "regressions": check}


class _NodeRunner:
    """Runs a plan's needed nodes: each when its inputs are published. One at a time in this process (the default:
    plan order, fail at the first error), or several at once through a Prefect task runner (`Execution`): a node
    starts as soon as its upstream nodes are done; a failed node's descendants are skipped while the other branches
    finish, and the run then fails naming every error."""

    def __init__(self, plan: Plan, s: Settings, store: ArtifactStore, tracker: Tracker, parent: str, experiment: str,
                 flow_run_id: str | None, selected: set[str], needed: set[str], forced: set[str], execution: Execution):
        self.plan, self.s, self.store, self.tracker, self.parent = plan, s, store, tracker, parent
        self.experiment, self.flow_run_id, self.execution = experiment, flow_run_id, execution
        self.selected, self.needed, self.forced = selected, needed, forced
        self.upstream: dict[str, dict[str, str]] = {}
        self.states: dict[str, Any] = {}  # each finished node's final task state: its task run is its dependants' edge
        self.results: dict[str, StageResult] = {}
        self.progress = NodeProgress(sum(n.name in needed for n in plan.nodes))

    def run(self) -> list[StageResult]:
        for node in self.plan.nodes:
            if node.name not in self.needed:
                self.results[node.name] = StageResult(node.name, node.stage, "skipped", 0.0, "")
        if self.execution.concurrent:
            self._run_concurrently()
        else:
            for node in self.plan.nodes:
                if node.name in self.needed:
                    submitted = self._start(node, submit=None)
                    if submitted is not None:
                        state, key, record, t0 = submitted
                        self._finish(node, key, record, t0, state, state.result())
        return [self.results[n.name] for n in self.plan.nodes]

    def _start(self, node, submit):
        """Reuse an upstream-of-`--only` node from the cache, or hand the node's stage task to Prefect: called now
        (submit None: its final state) or submitted (its future). None when nothing was submitted."""
        key, inputs, _ = node_key(node, self.upstream, self.store)
        t0 = time.perf_counter()
        if node.name not in self.selected:  # an upstream of --only: must come from the cache
            damaged: list[tuple[str, str]] = []
            rec = self.store.lookup(key, damaged)
            if rec is None:
                why = "".join(f" (output {output!r}: {problem})" for output, problem in damaged[:1])
                raise ConfigError(f"--only {','.join(sorted(self.selected))}: upstream node {node.name!r} has no valid "
                                  f"cached outputs for this config{why}; run it first (or drop --only)")
            self.upstream[node.name] = rec.outputs
            self.results[node.name] = StageResult(node.name, node.stage, "cached", time.perf_counter() - t0, "",
                                                  rec.outputs, rec.metrics, rec.mlflow_run_id)
            self.progress.end(node.name, node.stage, "cached", self.results[node.name].seconds)
            return None
        forced = node.name in self.forced
        # verified: every output file re-hashed; a damaged one is recomputed with a line saying so
        record = None if forced else reusable_record(self.store, key, node.name)
        if record is None:  # it computes (a cached node gets its end line only)
            self.progress.start(node.name, node.stage)
        upstream = {self.states[up].state_details.task_run_id for up, _ in node.inputs.values() if up in self.states}
        handle = submit_node(node.name, node.stage, node.config_dict, inputs, node.seed, key, record=record,
                             force=forced, parent_run_id=self.parent, s=self.s, experiment=self.experiment,
                             upstream=upstream, submit=None if submit is None else functools.partial(submit, node),
                             checkpoint_eval=eval_spec(self.plan, node, self.upstream, self.execution))
        return handle, key, record, t0

    def _finish(self, node, key: str, record: CacheRecord | None, t0: float, state, out: dict[str, Any]) -> None:
        seconds = time.perf_counter() - t0
        out, cached, run_id = node_outcome(state, out, record, self.tracker, self.parent, self.flow_run_id,
                                           node=node.name, stage=node.stage, key=key, config=node.config_dict,
                                           seed=node.seed)
        self.upstream[node.name], self.states[node.name] = out["outputs"], state
        self.results[node.name] = StageResult(
            node.name, node.stage, "cached" if cached else "run", seconds, state.name, out["outputs"], out["metrics"],
            run_id, out.get("started_at"), out.get("ended_at"), out.get("host", ""), out.get("ray_node_id", ""))
        self.progress.end(node.name, node.stage, self.results[node.name].status, seconds)

    def _run_concurrently(self) -> None:
        runner = placement.task_runner(self.execution, self.s.to_dict())
        limit = self.execution.parallel if not self.execution.cluster else len(self.plan.nodes)
        done: queue.Queue[str] = queue.Queue()
        running: dict[str, tuple[Any, str, CacheRecord | None, float]] = {}
        errors: dict[str, BaseException] = {}
        blocked: set[str] = set()  # not run: an upstream node failed
        waiting = [n for n in self.plan.nodes if n.name in self.needed]
        deps = {n.name: {up for up, _ in n.inputs.values()} for n in waiting}

        threads = placement.pool_threads(self.execution)

        def submit(node, task_, params, dependencies):
            if threads:
                params = {**params, "threads": threads}
            options = placement.ray_options(node.resources, node.config, self.execution)
            if options:
                # lazy: optional extra (prefect-ray)
                from prefect_ray.context import remote_options

                with remote_options(**options):
                    future = runner.submit(task_, params, dependencies=dependencies)
            else:
                future = runner.submit(task_, params, dependencies=dependencies)
            future.add_done_callback(lambda _f, name=node.name: done.put(name))
            return future

        with _children_share_this_api(), runner:
            placement.check_placeable(self.execution, waiting, _run_logger())  # before any task is submitted
            while waiting or running:
                for node in list(waiting):
                    failed_up = sorted(deps[node.name] & (set(errors) | blocked))
                    if failed_up:
                        waiting.remove(node)
                        blocked.add(node.name)
                        self.results[node.name] = StageResult(node.name, node.stage, "skipped", 0.0,
                                                              f"not run: {', '.join(failed_up)} failed")
                        continue
                    if len(running) >= limit or not deps[node.name] <= set(self.upstream):
                        continue
                    waiting.remove(node)
                    try:
                        submitted = self._start(node, submit)
                    except R1FlowError as e:
                        errors[node.name] = e
                        self.results[node.name] = StageResult(node.name, node.stage, "failed", 0.0, type(e).__name__)
                        continue
                    if submitted is not None:
                        running[node.name] = submitted
                if not running:
                    if waiting and not any(deps[n.name] <= set(self.upstream) for n in waiting):
                        raise RuntimeError(f"internal error: nodes {[n.name for n in waiting]} wait for nothing running")
                    continue
                name = done.get()
                future, key, record, t0 = running.pop(name)
                future.wait()
                state = future.state
                node = self.plan.node(name)
                try:
                    out = state.result()
                except Exception as e:  # noqa: BLE001 - named at the end, after the other branches finish
                    errors[name] = e
                    self.results[name] = StageResult(name, node.stage, "failed", time.perf_counter() - t0, state.name)
                    _run_logger().error("%s (%s) failed: %s: %s", name, node.stage, type(e).__name__, e)
                    continue
                self._finish(node, key, record, t0, state, out)
        if errors:
            if len(errors) == 1:
                raise next(iter(errors.values()))
            raise StageError(f"{len(errors)} stages failed: " + "; ".join(
                f"{name}: {type(e).__name__}: {e}" for name, e in errors.items()))


@contextlib.contextmanager
def _children_share_this_api():
    """Without a configured Prefect server, --parallel's worker processes would each start a temporary server of
    their own (seconds and hundreds of MB each): point them at this process's instead, for the flow's duration
    (the task runner hands its children the settings in force when it starts)."""
    if PREFECT_API_URL.value():
        yield
        return

    with get_client(sync_client=True) as client:
        url = str(client.api_url).rstrip("/")
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def resolve_input(store: ArtifactStore, fingerprint: str) -> Input:
    """A verified local view of an artifact; an adapter also gets its base model, found by fingerprint."""
    inp = store.get(fingerprint)
    base_fp = inp.manifest.extra.get("base_fingerprint")
    return Input(inp.path, inp.manifest, resolve_input(store, base_fp)) if base_fp else inp
