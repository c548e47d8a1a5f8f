"""`learning.py`'s r1flow_async side, the parent's part: where its child runs. In the "ray" placement the side gets
the 2-node loopback Ray cluster of `async_throughput.py` (`start_cluster`: the `learn` node on the first core, the
`gen` node on the second, in a network namespace) for as long as it trains; its child runs inside the namespace as
the cluster's driver, the recorded node ids are checked (`misplaced`) and the cluster is stopped by its pids. The
child's side of it is `learning_children.train_async`. "local" runs the child like any other side's."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
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


class ClusterCpu:
    """CPU seconds the processes in `cluster`'s namespace use while it is entered (None: no cluster, 0.0). Sampled
    every `every` s per process (pid and start time), their own user and system time: Ray's worker processes, the
    learner and the rollout actor among them, end with the job and are not reaped by a process of the namespace, so
    their time would vanish from any one reading taken after the run (the "other processes used 81-90%" of the
    first run). A process's last `every` s are not counted."""

    def __init__(self, cluster, every: float = 0.5) -> None:
        self.cluster, self.every, self.seen = cluster, every, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for pid in self.cluster.processes():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.seen[(pid, fields[19])] = int(fields[11]) + int(fields[12])  # utime + stime; start time keys

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> ClusterCpu:
        if self.cluster is not None:
            self._sample()
            self.before = dict(self.seen)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def seconds(self) -> float:
        if self.cluster is None:
            return 0.0
        ticks = sum(v - self.before.get(k, 0) for k, v in self.seen.items())
        return ticks / os.sysconf("SC_CLK_TCK")


def check_placement(result: dict, cluster, log: Path) -> None:
    """On the cluster: SystemExit in one line unless the run recorded its learner on the `learn` node and its worker
    on the `gen` node."""
    from benchmarks.async_throughput import misplaced

    if cluster is not None and (problem := misplaced(result.get("async", {}), cluster)):
        raise SystemExit(f"learning.py: r1flow_async {problem}; log {log}")
