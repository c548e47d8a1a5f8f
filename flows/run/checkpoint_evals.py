"""Checkpoint evals (docs/guides/checkpoint-evals.md): a training node with `publish_checkpoints_every: N` hands the
model after every N-th step to its context (`stages.training.loop.CheckpointPublisher`); here each is published as a
model artifact (parents: the stage's inputs; `extra.checkpoint_of`, `extra.checkpoint_step`) and evaluated while the
training goes on, one at a time in a thread of the stage's process, as a Prefect task run of its own nested under
the stage's MLflow run. The held-out curve goes to the stage's run as `checkpoint_eval/<metric>` at step N as each
eval ends, and `checkpoint_evals.json` (every eval's step, artifact, run, start and end) when the stage ends.

The eval is the recipe's eval node of the training node's model (`eval_node_of`): its config, seed and other inputs
(the held-out prompts) with the checkpoint as its model. So its cache key is made as any eval node's (the checkpoint's
fingerprint, the config, the prompts, the model's ancestor datasets, the seed), and a re-run of the stage, whose
checkpoints have the same bytes, reuses every eval.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from flows.plan.recipes import Node, Plan
from flows.store.cache import cache_key
from flows.store.lineage import with_lineage
from schemas.errors import ConfigError
from stages import get_stage, stage_version

if TYPE_CHECKING:
    from flows.store.artifacts import ArtifactStore
    from flows.track.tracking import Tracker
    from schemas.artifacts import Producer
    from stages.base import Output

CURVE_PREFIX = "checkpoint_eval/"  # the stage's run: checkpoint_eval/accuracy at step N
CURVE_METRICS = ("accuracy", "format_rate")
RECORD_FILE = "checkpoint_evals.json"  # logged to the stage's run


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


def eval_spec(plan: Plan, node: Node, upstream: dict[str, dict[str, str]]) -> dict[str, Any] | None:
    """What a training node's checkpoint evals run (`check_plan` passed): the eval node, its config and seed, and its
    inputs but the model, as fingerprints; None when the node publishes no checkpoints."""
    ev = eval_node_of(plan, node) if getattr(node.config, "publish_checkpoints_every", 0) else None
    if ev is None:
        return None
    return {"node": ev.name, "config": ev.config_dict, "seed": ev.seed,
            "inputs": {name: upstream[up][out] for name, (up, out) in ev.inputs.items() if name != "model"}}


def eval_key(store: ArtifactStore, spec: dict[str, Any], checkpoint: str) -> tuple[str, dict[str, str]]:
    """(the cache key, the inputs) of `spec`'s eval of the model `checkpoint`: made as an eval node's (pipeline
    `node_key`), lineage inputs included."""
    module = get_stage("eval")
    inputs = with_lineage(module, {**spec["inputs"], "model": checkpoint}, store)
    cfg = module.CONFIG.model_validate(spec["config"])
    salt = module.cache_salt(cfg) if hasattr(module, "cache_salt") else ""
    return cache_key("eval", stage_version(module), spec["config"], inputs, spec["seed"], salt), inputs


class CheckpointEvals:
    """A running stage's published checkpoints and their evals (the context's `publish_checkpoint` calls `submit`).

    `spec`: `eval_spec`'s (None: the checkpoints are published, not evaluated, with a warning: a single-stage run has
    no eval node). `run_eval(node, config, inputs, seed, key, parent_run_id)`: runs one eval node as a Prefect task
    and returns its result (the pipeline's `stage_task`'s); called in this class's thread, in the stage's context."""

    def __init__(self, spec: dict[str, Any] | None, *, node: str, producer: Producer, parents: list[str],
                 store: ArtifactStore, tracker: Tracker, run_id: str, log, run_eval: Callable[..., dict[str, Any]]):
        self.spec, self.node, self.producer, self.parents = spec, node, producer, parents
        self.store, self.tracker, self.run_id, self.log, self.run_eval = store, tracker, run_id, log, run_eval
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.futures: list[concurrent.futures.Future] = []
        self.records: list[dict[str, Any]] = []

    def submit(self, step: int, output: Output) -> None:
        """Publish and evaluate the model after `step` in the background; returns at once."""
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
        out = self.run_eval(name, self.spec["config"], inputs, self.spec["seed"], key, self.run_id)
        curve = {f"{CURVE_PREFIX}{m}": float(out["metrics"][m]) for m in CURVE_METRICS if m in out["metrics"]}
        self.tracker.log_metrics(self.run_id, curve, step)
        self.records.append({**record, "eval": name, "key": key, "results": out["outputs"].get("results"),
                             "cached": bool(out["reused"]), "mlflow_run_id": out["mlflow_run_id"],
                             "started_at": started_at, "ended_at": time.time(), **curve})

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
