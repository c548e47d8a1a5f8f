"""`learning.py`'s r1flow_async side, the parent's part: where its child runs. In the "ray" placement the side gets
the 2-node loopback Ray cluster of `async_throughput.py` (`start_cluster`: the `learn` node on the first core, the
`gen` node on the second, in a network namespace) for as long as it trains; its child runs inside the namespace as
the cluster's driver, the recorded node ids are checked (`misplaced`) and the cluster is stopped by its pids. The
child's side of it is `learning_children.train_async`. "local" runs the child like any other side's."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.learning_plan import Plan


def placement_problem(plan: Plan) -> str | None:
    """Before any compute: what the r1flow_async side's placement lacks on this machine, as one line; None when
    nothing."""
    if plan.async_placement != "ray":
        return None
    if plan.device != "cpu":
        return (f"--async-placement ray is the 2-node loopback cluster of one CPU core a node; with --device "
                f"{plan.device} use --async-placement local")
    from benchmarks.loopback_cluster import netns_available, ray_installed

    if not ray_installed():
        return "--async-placement ray needs Ray: pip install -e .[cluster] (or --async-placement local)"
    if not netns_available():
        return "--async-placement ray needs root and `ip netns` for the loopback cluster (or --async-placement local)"
    if len(os.sched_getaffinity(0)) < 2:
        return (f"--async-placement ray needs 2 cores (one a node); this process may use "
                f"{len(os.sched_getaffinity(0))} (or --async-placement local)")
    return None


@contextlib.contextmanager
def side_cluster(plan: Plan, side: str, work: Path) -> Iterator[object | None]:
    """The loopback cluster while `side` trains, when it is r1flow_async in the ray placement (its files under
    `work`/cluster); None for every other side."""
    if side != "r1flow_async" or plan.async_placement != "ray":
        yield None
        return
    from benchmarks.async_throughput import start_cluster

    cluster = start_cluster(work)
    try:
        yield cluster
    finally:
        cluster.stop()


def run_in_cluster(cluster, cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """`cmd` inside the cluster's namespace as its driver (RAY_ADDRESS set), output appended to `log`; its exit
    code. Interrupted, its session is killed by its pid."""
    proc = cluster.popen(cmd, log=log, env={**env, "RAY_ADDRESS": cluster.address}, cwd=ROOT)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def cluster_cpu_seconds(cluster) -> float:
    """CPU seconds used so far by the processes in the cluster's namespace, their reaped children included (a Ray
    worker that ended counts in its raylet's); 0.0 without a cluster. The learner and worker run there, not in
    the parent's children, so the share of the CPUs "other processes" used leaves this out too."""
    if cluster is None:
        return 0.0
    ticks = 0
    for pid in cluster.processes():
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def check_placement(result: dict, cluster, log: Path) -> None:
    """On the cluster: SystemExit in one line unless the run recorded its learner on the `learn` node and its worker
    on the `gen` node."""
    from benchmarks.async_throughput import misplaced

    if cluster is not None and (problem := misplaced(result.get("async", {}), cluster)):
        raise SystemExit(f"learning.py: r1flow_async {problem}; log {log}")
