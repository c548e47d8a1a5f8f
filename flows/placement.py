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
it can before any compute; each node checks what it reaches before its stage computes (flows.reach).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from schemas.errors import ConfigError
from stages.runtime.threads import THREADS_VAR, available_cpus, thread_share

CLUSTER_VAR = "R1FLOW_CLUSTER"  # set in the environment of every Ray worker of a cluster run
NODE_RETRIES = 2  # a stage whose machine was lost is retried this many times on another one (Ray max_retries)
INSTALL_HINT = "install the cluster extra: pip install -e '.[cluster]'"
# What a stage task on a Ray worker must see as the driver does (Ray workers start from the raylet's environment).
FORWARDED_ENV = ("R1FLOW_HOME", "R1FLOW_STORE", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME",
                 "PREFECT_SERVER_ANALYTICS_ENABLED", "TOKENIZERS_PARALLELISM", "OMP_WAIT_POLICY", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "GOOGLE_APPLICATION_CREDENTIALS")


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
            threads = thread_share(self.parallel, available_cpus(), os.environ.get(THREADS_VAR))
            return f"{self.parallel} stages at a time on this machine, {threads} thread(s) each"
        return "one stage at a time"


def use_threads(n: int) -> None:
    """Run in each `--parallel` worker process before its first stage: torch (and the OpenMP/MKL pools of any
    process it launches) use n threads, and the process exits without a final collection (stages.runtime.lifetime)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ[THREADS_VAR] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    from stages.runtime.lifetime import exit_without_final_collection

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


def worker_env(settings: dict[str, str]) -> dict[str, str]:
    """The environment a Ray worker runs a stage task with: the run's settings and servers, credentials for a
    remote store when the driver has them, and the cluster marker."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    env.update({"R1FLOW_HOME": settings["home"], "R1FLOW_STORE": settings["store"],
                "MLFLOW_TRACKING_URI": settings["tracking_uri"], CLUSTER_VAR: "1"})
    return env


def task_runner(execution: Execution, settings: dict[str, str]):
    """The Prefect task runner for a concurrent execution (None: run in this process, one after another)."""
    if execution.cluster:
        require_cluster_extra()
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=execution.cluster, init_kwargs={
            "namespace": "r1flow", "runtime_env": {"env_vars": worker_env(settings)}, "log_to_driver": True})
    if execution.parallel > 1:
        from prefect.task_runners import ProcessPoolTaskRunner

        threads = thread_share(execution.parallel, available_cpus(), os.environ.get(THREADS_VAR))
        return ProcessPoolTaskRunner(max_workers=execution.parallel, initializer=use_threads, initargs=(threads,))
    return None


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


def on_cluster() -> bool:
    """Whether this process is a Ray worker of a cluster run."""
    return os.environ.get(CLUSTER_VAR) == "1"


def where() -> dict[str, str]:
    """Where this process runs: the host name, and the Ray node id when it is a Ray worker."""
    out = {"host": socket.gethostname(), "ray_node_id": ""}
    if on_cluster():
        import ray

        if ray.is_initialized():
            out["ray_node_id"] = ray.get_runtime_context().get_node_id()
    return out


def cluster_nodes(address: str) -> list[dict[str, Any]]:
    """The cluster's nodes (`r1flow status --cluster`): id, address, alive, resources."""
    require_cluster_extra()
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False, namespace="r1flow")
    try:
        return [{"id": n["NodeID"], "address": n.get("NodeManagerAddress", ""), "alive": n["Alive"],
                 "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
                for n in ray.nodes()]
    finally:
        ray.shutdown()
