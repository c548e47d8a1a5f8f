"""Asynchronous RL's rollout workers as Ray actors, when the stage runs on a Ray cluster (issue 60, item 2).

`async_rollouts.AsyncRollouts` starts its workers here instead of as local processes when this process is
connected to Ray (`on_ray`: the stage runs as a Ray task of `r1flow run --cluster`, or in a driver that called
`ray.init`). The learner stays where it is (the stage's task); the schedule, the messages and the weight sync are
the one-machine loop's, so a run gives the same outputs on a cluster as on one machine:

- **Placement.** Each worker is an actor reserving `async.worker_resources` (cpus, gpus, memory_gb, labels: Ray
  num_cpus, num_gpus, memory, custom resources), so `labels: {gen: 1}` puts generation on the machines started with
  `ray start --resources='{"gen": 1}'`. That is placement, like a node's `resources:`: it is left out of the stage's
  cache key (`schemas.rl_configs.placement_free`). Before starting them, the learner waits INFEASIBLE_WAIT_S for a
  machine that offers what one worker needs, then fails in one line naming what no node offers.
- **Messages.** The workers' messages go through a `ray.util.queue.Queue` whose actor sits on the learner's node
  (0 CPUs): the same tuples as the local processes' `multiprocessing` queue.
- **Weights.** Versions stay safetensors files in the stage's checkpoint folder, which cluster mode already requires
  on a filesystem every node shares (R1FLOW_HOME): a resumed learner needs the K versions before its step on disk
  anyway, a file outlives the learner's process (Ray's object store frees what a dead owner put there), and one
  weight sync is then the same code on one machine and on a cluster.
- **Lifetime.** The actors are owned by the learner's process: Ray ends them when it dies (even kill -9), so a
  worker does not watch a parent pid, which means nothing on another machine; `close` kills them. Ray does not
  restart a dead actor itself (max_restarts 0): the learner replaces it (`replace`) with a new actor, placed by the
  same resources, that starts at the first step the learner has not received (`async_rollouts`).
- **Threads.** Ray sets each actor's thread count from its num_cpus; a worker does not take a share of the
  machine's cores as a local worker process does (`threads.stage_share`).

Ray is imported lazily: nothing here is needed, or importable, without the cluster extra. The worker's body is handed
to the actors as a function (pickled by reference) so that this module need not import `async_rollouts`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from schemas.errors import ConfigError, StageError
from stages.training.ray_launch import INFEASIBLE_WAIT_S

if TYPE_CHECKING:
    from schemas.configs import WorkerResources

POLL_S = 2.0


def on_ray() -> bool:
    """Whether this process is connected to a Ray cluster (a Ray task or actor, or a driver after `ray.init`); Ray
    is not imported to find out."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def actor_options(resources: WorkerResources) -> dict[str, Any]:
    """A worker actor's Ray options from `async.worker_resources`."""
    options: dict[str, Any] = {"num_cpus": resources.cpus, "num_gpus": resources.gpus, "max_restarts": 0}
    if resources.memory_gb:
        options["memory"] = int(resources.memory_gb * (1 << 30))
    if resources.labels:
        options["resources"] = dict(resources.labels)
    return options


def worker_demand(resources: WorkerResources) -> dict[str, float]:
    """What one machine must offer for one worker, by Ray's resource names (amounts of 0 left out)."""
    options = actor_options(resources)
    need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], "memory": options.get("memory", 0),
            **options.get("resources", {})}
    return {k: float(v) for k, v in need.items() if v}


class RolloutActor:
    """One rollout worker (`ray.remote(RolloutActor)` at start time, so that importing this module needs no Ray)."""

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "pid": os.getpid()}

    def run(self, body: Callable[[Any, Any], None], job: Any, out: Any) -> int:
        """`body(job, out)` (the worker's loop); its exit code (0: done, 1: it reported an error on `out`)."""
        try:
            body(job, out)
        except SystemExit as e:
            return int(e.code or 0)
        return 0


class ActorWorker:
    """The learner's handle on one worker actor: where it runs, whether it has ended."""

    def __init__(self, ray: Any, actor: Any, info: dict[str, Any], ref: Any) -> None:
        self.ray, self.actor, self.info, self.ref = ray, actor, info, ref

    def describe(self) -> str:
        return f"pid {self.info['pid']} on {self.info['host']}, Ray node {self.info['node_id']}"

    def exit_status(self) -> str | None:
        """None while the actor runs its loop; else how it ended, as the rest of a sentence."""
        if not self.ray.wait([self.ref], timeout=0)[0]:
            return None
        try:
            return f"exited with code {self.ray.get(self.ref)}"
        except Exception as e:  # the actor died: its machine was lost, it was killed, out of memory
            return f"died ({type(e).__name__})"

    def stop(self) -> None:
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass


class RayWorkers:
    """The worker actors of one asynchronous stage run and their message queue (on the learner's node)."""

    def __init__(self, stage: str, jobs: list[Any], body: Callable[[Any, Any], None], resources: WorkerResources,
                 start_s: float, log: Any) -> None:
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ray, self.stage, self.body, self.resources, self.start_s = ray, stage, body, resources, start_s
        self.learner_node = ray.get_runtime_context().get_node_id()
        self.wait_until_placeable(resources, log)
        here = NodeAffinitySchedulingStrategy(self.learner_node, soft=False)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.workers: list[ActorWorker] = self._start(jobs)

    def _start(self, jobs: list[Any]) -> list[ActorWorker]:
        """One actor per job, each running the worker's body once it answered where it runs; not started within
        start_s: one StageError line."""
        actor, actors = self.ray.remote(RolloutActor), []
        try:
            for _ in jobs:
                actors.append(actor.options(**actor_options(self.resources)).remote())
            infos = self.ray.get([a.where.remote() for a in actors], timeout=self.start_s)
        except Exception as e:
            for a in actors:
                ActorWorker(self.ray, a, {}, None).stop()
            raise StageError(f"{self.stage}: the {len(jobs)} async rollout worker actor(s) did not start within "
                             f"{self.start_s:.0f} s (async.worker_resources {json.dumps(worker_demand(self.resources))}"
                             f"): {type(e).__name__}") from None
        return [ActorWorker(self.ray, a, info, a.run.remote(self.body, job, self.queue))
                for a, info, job in zip(actors, infos, jobs, strict=True)]

    def replace(self, index: int, job: Any) -> None:
        """A new actor for worker `index` (whose actor has ended), starting at `job.start`."""
        self.workers[index].stop()
        self.workers[index] = self._start([job])[0]

    def get(self, timeout: float) -> tuple:
        """The next message of any worker (queue.Empty, which Ray's Empty is, after `timeout` s without one)."""
        return self.queue.get_nowait() if timeout <= 0 else self.queue.get(timeout=timeout)

    def drain(self, index: int) -> list[tuple]:
        """Nothing: an actor's put returns once the queue holds the message, so an ended actor's are all in it."""
        return []

    def wait_until_placeable(self, resources: WorkerResources, log: Any) -> None:
        """Until an alive machine offers what one worker needs; after INFEASIBLE_WAIT_S, one ConfigError line."""
        need = worker_demand(resources)

        def fitting() -> int:
            return sum(1 for n in self.ray.nodes() if n.get("Alive")
                       and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items()))

        start = time.monotonic()
        if not fitting():
            log.warning("%s: no Ray node offers %s for a rollout worker; waiting %.0f s for one", self.stage,
                        json.dumps(need), INFEASIBLE_WAIT_S)
        while not fitting():
            if time.monotonic() - start >= INFEASIBLE_WAIT_S:
                raise ConfigError(f"{self.stage}.async.worker_resources: no Ray node offers {json.dumps(need)} for a "
                                  f"rollout worker after {INFEASIBLE_WAIT_S:.0f} s; change the setting or add a "
                                  "machine that offers it (`ray start --resources=...`)")
            time.sleep(POLL_S)

    def params(self) -> dict[str, str]:
        """Where the learner and the workers run, for the stage's tracked params."""
        return {"async.placement": "ray", "async.learner_node_id": self.learner_node,
                "async.worker_node_ids": ",".join(w.info["node_id"] for w in self.workers),
                "async.worker_ips": ",".join(w.info["ip"] for w in self.workers)}

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        try:
            self.queue.shutdown()
        except Exception:  # already gone with its node
            pass
