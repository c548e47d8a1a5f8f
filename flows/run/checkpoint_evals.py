"""Checkpoint evals (docs/guides/checkpoint-evals.md): a training node with `publish_checkpoints_every: N` hands the
model after every N-th step to its context (`stages.training.loop.CheckpointPublisher`); here each is published as a
model artifact (parents: the stage's inputs; `extra.checkpoint_of`, `extra.checkpoint_step`) and evaluated while the
training goes on, one at a time, from a thread of the stage's process, as a Prefect task run of its own nested under
the stage's MLflow run. The held-out curve goes to the stage's run as `checkpoint_eval/<metric>` at step N as each
eval ends, and `checkpoint_evals.json` (every eval's step, artifact, run, start and end) when the stage ends.

The eval's compute runs in a process of its own (`EvalWorker`, started with the stage): the global RNG that the
samplers seed per batch, and the torch threads, are per process, and a stage training beside it in the same process
would draw from the eval's seeds (its outputs would depend on when the eval ran). On a Ray cluster (the stage a Ray
task, `placement.on_cluster()`) each eval is instead a Ray task of its own, placed by the eval node's `resources:`
(`eval_on_ray`: the pipeline's `ray_options` for that node, as its own stage task gets), which runs the same stage
task there (cache lookup, MLflow run nested under the stage's, publish to the shared store).

The eval is the recipe's eval node of the training node's model (`eval_node_of`): its config, seed and other inputs
(the held-out prompts) with the checkpoint as its model. So its cache key is made as any eval node's (the checkpoint's
fingerprint, the config, the prompts, the model's ancestor datasets, the seed), and a re-run of the stage, whose
checkpoints have the same bytes, reuses every eval.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import importlib
import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from flows.plan.recipes import Node, Plan
from flows.run import placement
from flows.run.placement import Execution
from flows.store.cache import cache_key
from flows.store.lineage import with_lineage
from schemas.errors import ConfigError
from stages import get_stage, stage_version
from stages.base import Input, LocalContext, Output
from stages.runtime import lifetime, threads

if TYPE_CHECKING:
    from flows.store.artifacts import ArtifactStore
    from flows.track.tracking import Tracker
    from schemas.artifacts import Producer

CURVE_PREFIX = "checkpoint_eval/"  # the stage's run: checkpoint_eval/accuracy at step N
CURVE_METRICS = ("accuracy", "format_rate")
RECORD_FILE = "checkpoint_evals.json"  # logged to the stage's run
# set in a checkpoint eval's thread: how the pipeline runs that eval's stage (`EvalWorker.run`), not in this process
BESIDE: contextvars.ContextVar[Callable[..., dict[str, Output]] | None] = contextvars.ContextVar(
    "r1flow_checkpoint_eval_beside", default=None)


def eval_node_of(plan: Plan, node: Node) -> Node | None:
    """The plan's first eval node whose model is `node`'s model output: the eval its checkpoints get."""
    return next((n for n in plan.nodes if n.stage == "eval" and n.inputs.get("model") == (node.name, "model")), None)


def check_plan(plan: Plan, running: Collection[str]) -> None:
    """One ConfigError, before any compute, for a node in `running` whose checkpoints could not be evaluated: no eval
    node reads its model, that eval reads something not made before the node runs, or the node trains on several
    processes (whose contexts do not publish)."""
    for node in plan.nodes:
        every = getattr(node.config, "publish_checkpoints_every", 0)
        if node.name not in running or not every:
            continue
        where, off = f"{node.name}.publish_checkpoints_every={every}", f"--set {node.name}.publish_checkpoints_every=0"
        resources = node.config.resources
        if resources.num_processes > 1 or resources.nodes > 1:
            raise ConfigError(f"{where}: checkpoint evals need the stage in one process (resources.num_processes and "
                              f"resources.nodes 1); use {off}")
        ev = eval_node_of(plan, node)
        if ev is None:
            raise ConfigError(f"{where}: no eval node of recipe {plan.recipe!r} reads {node.name}.model, so its "
                              f"checkpoints have no held-out eval to run; use {off}")
        before = plan.ancestors({node.name})
        late = [f"{name} ({up}.{out})" for name, (up, out) in ev.inputs.items() if name != "model" and up not in before]
        if late:
            raise ConfigError(f"{where}: {ev.name} reads {', '.join(late)}, which {node.name} does not depend on, so "
                              f"it may not exist while {node.name} trains; use {off}")


def eval_spec(plan: Plan, node: Node, upstream: dict[str, dict[str, str]],
              execution: Execution = Execution()) -> dict[str, Any] | None:
    """What a training node's checkpoint evals run (`check_plan` passed): the eval node, its config and seed, its
    inputs but the model, as fingerprints, and on a cluster the Ray options of its stage task (`ray_options`: its
    `resources:`; empty off a cluster); None when the node publishes no checkpoints."""
    ev = eval_node_of(plan, node) if getattr(node.config, "publish_checkpoints_every", 0) else None
    if ev is None:
        return None
    return {"node": ev.name, "config": ev.config_dict, "seed": ev.seed,
            "inputs": {name: upstream[up][out] for name, (up, out) in ev.inputs.items() if name != "model"},
            "ray_options": placement.ray_options(ev.resources, ev.config, execution)}


def eval_key(store: ArtifactStore, spec: dict[str, Any], checkpoint: str) -> tuple[str, dict[str, str]]:
    """(the cache key, the inputs) of `spec`'s eval of the model `checkpoint`: made as an eval node's (pipeline
    `node_key`), lineage inputs included."""
    module = get_stage("eval")
    inputs = with_lineage(module, {**spec["inputs"], "model": checkpoint}, store)
    cfg = module.CONFIG.model_validate(spec["config"])
    salt = module.cache_salt(cfg) if hasattr(module, "cache_salt") else ""
    return cache_key("eval", stage_version(module), spec["config"], inputs, spec["seed"], salt), inputs


class _ChildContext(LocalContext):
    """The context of a stage `EvalWorker` runs: outputs where the runner staged them, files copied into `work` (the
    runner logs them), params, metrics and tags kept for the runner to log."""

    def __init__(self, seed: int, device: str, cache_dir: Path, checkpoint_dir: Path, outputs: dict[str, Path],
                 work: Path):
        super().__init__(root=work, seed=seed, device=device, cache_dir=cache_dir)
        self.checkpoint_dir, self.outputs, self.work = checkpoint_dir, outputs, work
        self.logged: list[tuple[str, str]] = []

    def output_dir(self, name: str) -> Path:
        self.outputs[name].mkdir(parents=True, exist_ok=True)
        return self.outputs[name]

    def log_file(self, path: Path, subdir: str = "") -> None:
        kept = self.work / f"file-{len(self.logged)}" / Path(path).name  # the stage may delete its own copy
        kept.parent.mkdir(parents=True)
        shutil.copy2(path, kept)
        self.logged.append((str(kept), subdir))


def _die_with(parent: int) -> None:
    """The worker's start: exit when the stage's process is gone (even killed with -9), and import the eval stage
    while the stage trains."""
    lifetime.watch_parent()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-stage-process").start()
    importlib.import_module("stages.eval")


def _run_child(module_name: str, cfg: Any, inputs: dict[str, Input], seed: int, device: str, cache_dir: Path,
               checkpoint_dir: Path, outputs: dict[str, Path], work: Path) -> dict[str, Any]:
    """In the worker: the stage's `run` with this process's share of the cores; its outputs and what it logged."""
    started_at = time.time()
    module = importlib.import_module(module_name)
    ctx = _ChildContext(seed, device, cache_dir, checkpoint_dir, outputs, work)
    with threads.stage_share():
        out = module.run(cfg, inputs, ctx)
    return {"outputs": out, "params": ctx.params, "metrics": ctx.metrics, "files": ctx.logged, "tags": ctx.tags,
            "started_at": started_at}


class EvalWorker:
    """The process beside a training stage that runs its checkpoint evals' stages (`run`: how the pipeline runs a
    stage while `BESIDE` is set), spawned when the stage starts so that its imports overlap the training's start."""

    def __init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="r1flow-checkpoint-evals-"))
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                           initializer=_die_with, initargs=(os.getpid(),))
        self.ready = self.pool.submit(int)  # start it now
        self.computed: list[tuple[float, float]] = []  # (start, end) of each stage run here, in order

    def run(self, module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx) -> dict[str, Output]:
        """`module.run(cfg, inputs, ...)` in the worker, its outputs in `ctx`'s staging and its logs replayed into
        `ctx` (the eval's MLflow run)."""
        work = Path(tempfile.mkdtemp(dir=self.work))
        outputs = {name: ctx.output_dir(name) for name in module.OUTPUTS}
        done = self.pool.submit(_run_child, module.__name__, cfg, inputs, ctx.seed, ctx.device, ctx.cache_dir,
                                ctx.checkpoint_dir, outputs, work).result()
        if done["params"]:
            ctx.log_params(done["params"])
        for step, metrics in done["metrics"]:
            ctx.log_metrics(metrics, step)
        for path, subdir in done["files"]:
            ctx.log_file(Path(path), subdir)
        if done["tags"]:
            ctx.set_tags(done["tags"])
        self.computed.append((done["started_at"], time.time()))
        return done["outputs"]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.work, ignore_errors=True)


def eval_on_ray(options: dict[str, Any]) -> Callable[..., Any]:
    """A `submit` for the pipeline's `submit_node`, called in a Ray worker of a cluster run: the stage task as a Ray
    task of the same job (a Prefect task run through prefect-ray's runner, as the pipeline's nodes are), reserving
    `options`; returns its final state (Crashed when Ray lost it). Waited for from a thread other than the Ray
    worker's main one, so the stage keeps its reservation meanwhile: an eval that fits only there waits for good."""
    # lazy: optional extra (prefect-ray)
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    def submit(task_: Any, params: dict[str, Any], dependencies: dict[str, Any]) -> Any:
        with RayTaskRunner() as runner, remote_options(**options):  # Ray is up in this worker: the runner joins it
            future = runner.submit(task_, params, dependencies=dependencies)
            future.wait()
            return future.state

    return submit


class CheckpointEvals:
    """A running stage's published checkpoints and their evals (the context's `publish_checkpoint` calls `submit`).

    `spec`: `eval_spec`'s (None: the checkpoints are published, not evaluated, with a warning: a single-stage run has
    no eval node). `run_eval(node, config, inputs, seed, key, parent_run_id)`: runs one eval node as a Prefect task
    and returns its result (the pipeline's `stage_task`'s); called in this class's thread, in the stage's context,
    with `submit` (`eval_on_ray`) on a cluster, where no worker process is spawned."""

    def __init__(self, spec: dict[str, Any] | None, *, node: str, producer: Producer, parents: list[str],
                 store: ArtifactStore, tracker: Tracker, run_id: str, log, run_eval: Callable[..., dict[str, Any]]):
        self.spec, self.node, self.producer, self.parents = spec, node, producer, parents
        self.store, self.tracker, self.run_id, self.log, self.run_eval = store, tracker, run_id, log, run_eval
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.futures: list[concurrent.futures.Future] = []
        self.records: list[dict[str, Any]] = []
        self.on_ray = spec is not None and placement.on_cluster()
        self.worker = EvalWorker() if spec is not None and not self.on_ray else None

    def submit(self, step: int, output: Output) -> None:
        """Publish and evaluate the model after `step` in the background; returns at once."""
        if self.worker is not None and self.spec is not None:  # started with the stage: ready long before a real
            try:                                                 # stage's first checkpoint
                self.worker.ready.result()
            except Exception as e:  # noqa: BLE001 - the training goes on; its checkpoints are published unevaluated
                self.log.warning("%s: the checkpoint eval process did not start (%s: %s); checkpoints are published, "
                                 "not evaluated", self.node, type(e).__name__, e)
                self.spec = None
        if self.pool is None:  # one at a time, in the order published; Prefect's and MLflow's context goes along
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-evals-{self.node}")
        context = contextvars.copy_context()
        self.futures.append(self.pool.submit(context.run, self._evaluate, step, output))

    def _evaluate(self, step: int, output: Output) -> None:
        started_at = time.time()
        manifest = self.store.publish(output.path, kind=output.kind, schema=output.schema, producer=self.producer,
                                      parents=self.parents, metrics=output.metrics,
                                      extra={**output.extra, "checkpoint_of": self.node, "checkpoint_step": step})
        record: dict[str, Any] = {"step": step, "checkpoint": manifest.fingerprint}
        self.tracker.set_tags(self.run_id, {f"r1flow.checkpoint.{step}": manifest.fingerprint})
        if self.spec is None:
            self.records.append(record)
            return
        key, inputs = eval_key(self.store, self.spec, manifest.fingerprint)
        name = f"{self.spec['node']}@{self.node}-step{step}"
        if self.on_ray:
            out = self.run_eval(name, self.spec["config"], inputs, self.spec["seed"], key, self.run_id,
                                submit=eval_on_ray(self.spec.get("ray_options", {})))
            computed = (None, None) if out["reused"] else (out["started_at"], out["ended_at"])
        else:
            BESIDE.set(self.worker.run)  # this thread's context only: the eval's stage runs in the worker
            computing = len(self.worker.computed)
            out = self.run_eval(name, self.spec["config"], inputs, self.spec["seed"], key, self.run_id)
            computed = self.worker.computed[-1] if len(self.worker.computed) > computing else (None, None)
        curve = {f"{CURVE_PREFIX}{m}": float(out["metrics"][m]) for m in CURVE_METRICS if m in out["metrics"]}
        self.tracker.log_metrics(self.run_id, curve, step)
        self.records.append({**record, "eval": name, "key": key, "results": out["outputs"].get("results"),
                             "cached": bool(out["reused"]), "mlflow_run_id": out["mlflow_run_id"],
                             "started_at": started_at, "ended_at": time.time(), "computed_from": computed[0],
                             "computed_to": computed[1], "host": out.get("host", ""),
                             "ray_node_id": out.get("ray_node_id", ""), **curve})

    def finish(self) -> list[dict[str, Any]]:
        """After the training: wait for the evals still running, log `checkpoint_evals.json` to the stage's run;
        the records by step. A failed eval is one warning line: the trained model is still published."""
        trained_at = time.time()
        for future in self.futures:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - the training succeeded; its output is published regardless
                self.log.warning("%s: a checkpoint eval failed: %s: %s", self.node, type(e).__name__, e)
        if self.futures and self.spec is None:
            self.log.warning("%s: %d checkpoint(s) published, not evaluated: no eval node in this run",
                             self.node, len(self.records))
        records = sorted(self.records, key=lambda r: r["step"])
        if self.futures:
            self.tracker.log_text(self.run_id, json.dumps({"node": self.node, "training_ended_at": trained_at,
                                                           "evals": records}, indent=1), RECORD_FILE)
        return records

    def close(self) -> None:
        """Stop what has not started (the stage failed, or finished: then nothing is left) and wait for the rest."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.worker is not None:
            self.worker.close()
