"""A training stage across several machines: one Ray actor per rank, in a placement group.

`stages.training.launch.run_stage` comes here (through `launch.run_multi_node`) when a stage's
`resources.nodes` is more than 1. The stage then runs on nodes × num_processes ranks:

- **Connection** (`connect`): the Ray the calling process already has (the pipeline runs each stage
  as a Ray task in cluster mode, where Ray is initialised), else `ray.init(address=RAY_ADDRESS)`.
  Neither, or Ray not installed: `ConfigError` before anything is computed.
- **Placement** (`RayRanks`): a STRICT_SPREAD placement group of `nodes` bundles, one per machine,
  each `{"CPU": M}` plus `{"GPU": M}` on CUDA (M = num_processes, the ranks of that machine), and
  one actor per rank in its machine's bundle (1 CPU, 1 GPU on CUDA). Rank r = bundle × M + local rank.
- **Rendezvous**: rank 0's actor reports its node IP (`ray.util.get_node_ip_address()`) and a free
  port on its machine; every actor sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
  MASTER_ADDR and MASTER_PORT (and, on CUDA, CUDA_VISIBLE_DEVICES to its machine's ranks' GPUs in
  local-rank order, so that cuda:LOCAL_RANK is its own) and calls the rank body the caller hands it,
  `launch.run_rank`: torch.distributed's env:// rendezvous, gloo on CPU, nccl on GPU, the same
  `Dist` and the same stage code as under `accelerate launch`, hence the same results.
- **Files**: the caller makes the work directory (spec, events, result, error-rank files, rank 0's
  output log) beside the stage's checkpoints, under R1FLOW_HOME, which cluster mode requires to be
  shared; every rank first checks it can read the spec and the inputs (`check_readable`), and says
  which machine cannot. Each actor sends its stdout and stderr to a file there (rank 0's is
  output.log), which the caller tails as it tails accelerate's output.
- **Lifetime**: the actors are owned by the calling process: when it dies (even kill -9), Ray ends
  them on every machine. When it is interrupted (an exception, SIGTERM's SystemExit) `close()`
  kills them (`ray.kill`) and removes the placement group. `lifetime.watch_parent` is not used in
  the ranks: the caller's pid means nothing on another machine.

Why actors in a placement group rather than Ray Train's TorchTrainer: the ranks must run exactly
the code they run under `accelerate launch` (`launch.run_rank`: the spec file, RankContext, the
event file, the rank lock), with the torch.distributed environment set by us, so the distributed
tests that pin single-node results pin these too. TorchTrainer brings its own worker group,
process-group setup, checkpoint and reporting API (`ray.train.report`), which would be a second
way of running a stage to keep equal to the first, and an extra dependency (ray[train]). A
placement group and plain actors need only `ray` (the `cluster` extra).

The rank body is handed to the actors as a function (pickled by reference: the actor imports
`stages.training.launch` itself) so that this module need not import `launch`, which imports it.
Ray is imported lazily: nothing here is needed, or importable, without the cluster extra.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas.errors import ConfigError, StageError
from stages.runtime.threads import REPRODUCIBLE_VAR, reproducible_products

NOT_SHARED = "multi-node stages need R1FLOW_HOME on a filesystem every node shares"
INFEASIBLE_WAIT_S = 60.0  # too few machines with the resources: how long to wait for more (an autoscaler) before failing
PLACEMENT_TIMEOUT_S = 600.0  # enough machines, all busy: how long to wait for them to be free
ACTORS_START_S = 300.0
REPORT_EVERY_S = 30.0


def connect(stage: str, nodes: int) -> Any:
    """The `ray` module, connected: already (inside a Ray task, or a driver that called ray.init), or
    to RAY_ADDRESS. ConfigError when Ray is not installed or there is no cluster to use."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{stage}.resources.nodes={nodes} needs Ray, which is not installed here: "
                          f"pip install -e .[cluster]") from None
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError(f"{stage}.resources.nodes={nodes} needs a Ray cluster: run with "
                          f"`r1flow run --cluster ADDRESS` (or RAY_ADDRESS)")
    try:
        # the ranks' output comes through their log files (see RankActor.run), not Ray's log forwarding; MKL's mode
        # must be in the rank processes' environment when they start (stages.runtime.threads.reproducible_products)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                 runtime_env={"env_vars": {REPRODUCIBLE_VAR: reproducible_products(dict(os.environ))}})
    except ConnectionError as e:
        raise ConfigError(f"{stage}.resources.nodes={nodes}: cannot connect to the Ray cluster at "
                          f"RAY_ADDRESS={address}: {e}") from None
    return ray


def check_readable(spec_path: Path, rank: int, ip: str) -> str | None:
    """None if this machine sees the spec file and every input it names; else the one line that says not."""
    try:
        spec = json.loads(Path(spec_path).read_text())
    except (OSError, ValueError):
        return f"rank {rank} on node {ip}: cannot read {spec_path}: {NOT_SHARED}"
    for inp in spec.get("inputs", {}).values():
        while inp:
            if not Path(inp["path"]).exists():
                return f"rank {rank} on node {ip}: cannot read {inp['path']}: {NOT_SHARED}"
            inp = inp.get("base")
    return None


class RankActor:
    """One rank (a Ray actor; `ray.remote(RankActor)` at launch time, so that importing this module
    needs no Ray)."""

    def where(self) -> dict[str, Any]:
        import ray

        runtime = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node_id": runtime.get_node_id(), "pid": os.getpid(),
                "gpus": [str(g) for g in runtime.get_accelerator_ids().get("GPU", [])]}

    def free_port(self) -> int:
        """A port free on this machine now, for rank 0's rendezvous store."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, rank_fn: Callable[..., None], spec_path: str, log_path: str, env: dict[str, str]) -> dict[str, Any]:
        """Check the shared files, set the rank's environment, and run `rank_fn(spec_path)` with stdout
        and stderr in `log_path`. Returns {"ok": True} or {"ok": False, "error": a line or a traceback}."""
        import ray

        rank = int(env["RANK"])
        problem = check_readable(Path(spec_path), rank, ray.util.get_node_ip_address())
        if problem:
            return {"ok": False, "error": problem}
        os.environ.update(env)
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        saved = os.dup(1), os.dup(2)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            rank_fn(Path(spec_path), watch_parent=False)
            return {"ok": True}
        except BaseException:  # the rank body wrote error-rank<N>.txt too, where it could
            return {"ok": False, "error": traceback.format_exc()}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


class RayRanks:
    """The placement group and the rank actors of one multi-node stage run (a context manager:
    leaving it kills the actors and removes the group, whatever happened)."""

    def __init__(self, ray: Any, stage: str, nodes: int, per_node: int, cuda: bool, log: logging.Logger):
        self.ray, self.stage, self.nodes, self.per_node, self.cuda, self.log = ray, stage, nodes, per_node, cuda, log
        self.world = nodes * per_node
        self.bundle = {"CPU": float(per_node), **({"GPU": float(per_node)} if cuda else {})}
        self.pg = None
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.node_ips: dict[int, str] = {}
        self.pending: dict[Any, int] = {}
        self._failure: str | None = None

    def __enter__(self) -> RayRanks:
        try:
            self._place()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fitting_nodes(self) -> int:
        return sum(1 for n in self.ray.nodes() if n.get("Alive")
                   and all(n.get("Resources", {}).get(k, 0) >= v for k, v in self.bundle.items()))

    def _need(self) -> str:
        return (f"{self.stage}.resources.nodes={self.nodes} × num_processes={self.per_node} needs {self.nodes} Ray "
                f"nodes with {json.dumps(self.bundle)} each")

    def _place(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        fitting = self._fitting_nodes()
        timeout = PLACEMENT_TIMEOUT_S if fitting >= self.nodes else INFEASIBLE_WAIT_S
        if fitting < self.nodes:
            self.log.warning("%s; the cluster has %d: waiting %.0f s for more", self._need(), fitting, timeout)
        self.pg = placement_group([dict(self.bundle) for _ in range(self.nodes)], strategy="STRICT_SPREAD",
                                  name=f"r1flow-{self.stage}-{uuid.uuid4().hex[:8]}")
        start = time.monotonic()
        while not self.ray.wait([self.pg.ready()], timeout=min(REPORT_EVERY_S, timeout))[0]:
            waited = time.monotonic() - start
            if waited >= timeout:
                fitting = self._fitting_nodes()
                if fitting < self.nodes:
                    raise ConfigError(f"{self._need()}; the cluster has {fitting}")
                raise StageError(f"{self._need()}: not free after {waited:.0f} s (held by other tasks or stages)")
            self.log.info("%s: waiting for %d Ray nodes with %s free (%.0f s)", self.stage, self.nodes,
                          json.dumps(self.bundle), waited)
        actor = self.ray.remote(RankActor)
        for b in range(self.nodes):
            for _ in range(self.per_node):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=b)
                self.actors.append(actor.options(num_cpus=1, num_gpus=1 if self.cuda else 0, max_restarts=0,
                                                 scheduling_strategy=strategy).remote())
        try:
            self.infos = self.ray.get([a.where.remote() for a in self.actors], timeout=ACTORS_START_S)
        except Exception as e:
            raise StageError(f"{self.stage}: the {self.world} rank actors did not start: {e}") from None
        self.node_ips = {r: info["ip"] for r, info in enumerate(self.infos)}
        per_bundle = [{i["node_id"] for i in self.infos[b * self.per_node:(b + 1) * self.per_node]}
                      for b in range(self.nodes)]
        if any(len(ids) != 1 for ids in per_bundle) or len(set().union(*per_bundle)) != self.nodes:
            raise StageError(f"{self.stage}: the ranks were not placed one machine per bundle: {per_bundle}")

    def params(self) -> dict[str, Any]:
        """Where the ranks run, for the stage's tracked params: node b holds ranks b×M … b×M+M-1."""
        first = [self.infos[b * self.per_node] for b in range(self.nodes)]
        return {"ray.nodes": self.nodes, "ray.processes_per_node": self.per_node,
                "ray.node_ids": ",".join(i["node_id"] for i in first), "ray.node_ips": ",".join(i["ip"] for i in first)}

    def environment(self, rank: int, port: int) -> dict[str, str]:
        """torch.distributed's environment for one rank (what torchrun would set), plus its machine's GPUs."""
        node, local = divmod(rank, self.per_node)
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(self.per_node), "NODE_RANK": str(node), "GROUP_RANK": str(node),
               "MASTER_ADDR": self.infos[0]["ip"], "MASTER_PORT": str(port)}
        if self.cuda:
            mine = self.infos[node * self.per_node:(node + 1) * self.per_node]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for info in mine for g in info["gpus"])
        return env

    def start(self, rank_fn: Callable[..., None], spec_path: Path, logs: list[Path]) -> None:
        """Every rank runs `rank_fn(spec_path)` (rank r's output in logs[r]); `finished` says when they are done."""
        port = self.ray.get(self.actors[0].free_port.remote())
        self.log.info("%s: %d ranks on %d Ray nodes (%s), rendezvous at %s:%d", self.stage, self.world, self.nodes,
                      ", ".join(sorted(set(self.node_ips.values()))), self.infos[0]["ip"], port)
        for rank, actor in enumerate(self.actors):
            ref = actor.run.remote(rank_fn, str(spec_path), str(logs[rank]), self.environment(rank, port))
            self.pending[ref] = rank

    def finished(self) -> bool:
        """True once every rank has returned, or one has failed (the others may be waiting for it in a
        collective: the caller stops them by leaving the context)."""
        if self.pending and self._failure is None:
            ready, _ = self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
            for ref in ready:
                rank = self.pending.pop(ref)
                try:
                    out = self.ray.get(ref)
                except Exception as e:  # the actor died: its machine was lost, it was killed, out of memory
                    out = {"ok": False, "error": f"rank {rank} on node {self.node_ips[rank]} died: "
                                                 f"{type(e).__name__}: {str(e)[-2000:]}"}
                if not out["ok"] and self._failure is None:
                    error = out["error"]
                    if "\n" in error.strip():  # a traceback
                        error = f"rank{rank} on node {self.node_ips[rank]} failed:\n" + "\n".join(
                            error.splitlines()[-40:])
                    self._failure = error
        return self._failure is not None or not self.pending

    def failure(self) -> str | None:
        """What the first failed rank said (None if none failed)."""
        return self._failure

    def close(self) -> None:
        """Kill every rank actor and remove the placement group (idempotent)."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors, self.pending = [], {}
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
