"""A real multi-node Ray cluster on this machine, every listener on loopback, for tests and benchmarks
(tests/test_ray_training.py, tests/test_cluster.py and benchmarks/async_throughput.py; tests/ray_cluster.py
re-exports it: benchmarks/ may not import tests/).

Ray binds the machine's external interface by default (even with --node-ip-address=127.0.0.1), so
the cluster lives in a network namespace the caller creates (`ip netns add`): inside it the only
interface is `lo`, Ray finds 127.0.0.1 and nothing it starts can be reached from, or reach, any
other address. Every command that talks to the cluster (the r1flow CLI, a driver script, the Prefect
and MLflow servers) runs in the same namespace through `run()` / `popen()`.

Each node is a `ray start --block` process in a session of its own: stopping a node (or losing it,
`kill_node`) signals that process group, never `ray stop` (which would stop every Ray process on
the machine, another test's included); whatever else is left in the namespace is killed by pid (`ip netns
pids`). Each cluster has its own --temp-dir. `pinned` (node name -> CPU list) starts a node under `taskset -c`,
so every process of that node (raylet, tasks, actors) runs on those cores only: "one core a node" on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
STOP_GRACE_S = 10.0
# What r1flow, its CLI and tests/conftest.py export (MKL_CBWR, OMP_WAIT_POLICY, the home and the servers): a machine
# of a real cluster has none of it, so `bare_nodes` starts the Ray nodes without it and a stage sees only what the
# driver hands its workers.
R1FLOW_VARIABLES = ("R1FLOW_", "PREFECT_", "MLFLOW_", "MKL_CBWR", "OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM")


def ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return Path(RAY).exists()


def netns_available() -> bool:
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen
    resources: dict[str, float]
    log: Path
    node_id: str = ""


@dataclass
class LoopbackCluster:
    """Head plus workers in one network namespace. `nodes` are (name, cpus, custom resources)."""

    root: Path
    nodes: list[tuple[str, int, dict[str, float]]] = field(
        default_factory=lambda: [("head", 1, {"head": 1}), ("worker", 1, {"worker": 1})])
    port: int = 6379
    object_store_bytes: int = 100_000_000
    env: dict[str, str] = field(default_factory=dict)
    bare_nodes: bool = False  # the Ray nodes start without R1FLOW_VARIABLES (the commands run in it keep `env`)
    pinned: dict[str, str] = field(default_factory=dict)  # node name -> `taskset -c` CPU list of all its processes

    def __post_init__(self):
        self.ns = f"r1flow-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.temp_dir = Path("/tmp") / f"ray-{self.ns}"  # Ray's socket paths must stay short: not under tmp_path
        self.running: dict[str, RayNode] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ namespace
    def _prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def _env(self, extra: dict[str, str] | None = None, bare: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | self.env | (extra or {})
        if bare:
            env = {k: v for k, v in env.items() if not k.startswith(R1FLOW_VARIABLES)}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray 2.60's `ray start --head --block` turns token authentication on and writes ~/.ray/auth_token, which
        # every cluster on this machine would share: off here, where the namespace already keeps others out.
        env["RAY_AUTH_MODE"] = "disabled"
        return env

    def run(self, cmd: list[str], *, timeout: float = 600, env: dict[str, str] | None = None,
            check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run a command inside the namespace (stdout and stderr captured as text)."""
        out = subprocess.run([*self._prefix(), *cmd], capture_output=True, text=True, timeout=timeout,
                             env=self._env(env), stdin=subprocess.DEVNULL, **kw)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def popen(self, cmd: list[str], *, log: Path, env: dict[str, str] | None = None, bare: bool = False,
              **kw) -> subprocess.Popen:
        """Start a command inside the namespace in a session of its own, output to `log` (bare: without
        R1FLOW_VARIABLES)."""
        f = open(log, "ab")
        return subprocess.Popen([*self._prefix(), *cmd], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self._env(env, bare), start_new_session=True, **kw)

    def python(self, code: str, *, timeout: float = 300, env: dict[str, str] | None = None) -> str:
        """Run Python code in the namespace as a driver of this cluster; its stdout (check: exit 0)."""
        return self.run([sys.executable, "-c", code], timeout=timeout, env={"RAY_ADDRESS": self.address, **(env or {})},
                        check=True).stdout

    # ------------------------------------------------------------------ nodes
    def start(self) -> LoopbackCluster:
        self.create_namespace()
        return self.start_nodes()

    def create_namespace(self) -> LoopbackCluster:
        """The namespace alone (commands can start in it while the nodes come up: start_nodes)."""
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        subprocess.run([*self._prefix(), "ip", "link", "set", "lo", "up"], check=True)
        return self

    def start_nodes(self) -> LoopbackCluster:
        try:
            head, *workers = self.nodes
            self.start_node(*head, head=True)
            self._wait_for_gcs()  # a worker started before the head's GCS answers fails to join
            for name, cpus, resources in workers:
                self.start_node(name, cpus, resources)
            self.wait_for_nodes(len(self.nodes))
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_gcs(self, timeout: float = 120) -> None:
        """Until the head's GCS accepts connections on its port (a socket probe in the namespace: no Ray driver)."""
        head = next(iter(self.running.values()))
        probe = (f"import socket, sys, time\nend = time.monotonic() + {timeout}\n"
                 "while time.monotonic() < end:\n"
                 f"    try: socket.create_connection(('127.0.0.1', {self.port}), 1).close(); sys.exit(0)\n"
                 "    except OSError: time.sleep(0.2)\nsys.exit(1)")
        if self.run([sys.executable, "-S", "-c", probe], timeout=timeout + 10).returncode != 0:
            raise AssertionError(f"the head's GCS is not listening on {self.address} after {timeout:.0f} s: "
                                 f"{head.log.read_text()[-3000:]}")

    def start_node(self, name: str, cpus: int, resources: dict[str, float], head: bool = False) -> RayNode:
        log = self.root / f"ray-{name}.log"
        common = [f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}",
                  f"--object-store-memory={self.object_store_bytes}", "--disable-usage-stats", "--block"]
        if head:
            cmd = [RAY, "start", "--head", f"--port={self.port}", "--include-dashboard=false",
                   f"--temp-dir={self.temp_dir}", *common]
        else:
            cmd = [RAY, "start", f"--address={self.address}", f"--temp-dir={self.temp_dir}", *common]
        if name in self.pinned:
            cmd = ["taskset", "-c", self.pinned[name], *cmd]
        node = RayNode(name, self.popen(cmd, log=log, bare=self.bare_nodes), resources, log)
        self.running[name] = node
        return node

    def nodes_alive(self, wait_for: int = 0, timeout: float = 0) -> list[dict]:
        """Every node Ray knows of, from one driver in the namespace; wait_for: first poll (up to timeout seconds)
        until that many are alive."""
        code = ("import json, time, ray; ray.init(logging_level='ERROR')\n"
                f"end = time.monotonic() + {timeout}\n"
                f"while sum(n['Alive'] for n in ray.nodes()) < {wait_for} and time.monotonic() < end: time.sleep(0.5)\n"
                "print(json.dumps([{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} "
                "for n in ray.nodes()]))")
        return json.loads(self.python(code, timeout=timeout + 120).strip().splitlines()[-1])

    def wait_for_nodes(self, n: int, timeout: float = 120) -> None:
        for name, node in self.running.items():
            if node.proc.poll() is not None:
                raise AssertionError(f"ray node {name} exited {node.proc.returncode}: {node.log.read_text()[-3000:]}")
        alive = [a for a in self.nodes_alive(wait_for=n, timeout=timeout) if a["alive"]]
        if len(alive) < n:
            raise AssertionError(f"{len(alive)} of {n} ray nodes up after {timeout:.0f} s: " + " | ".join(
                f"{name}: {node.log.read_text()[-1000:]}" for name, node in self.running.items()))
        for node in self.running.values():
            for a in alive:
                if all(a["resources"].get(k) == v for k, v in node.resources.items()):
                    node.node_id = a["id"]

    def node_environ(self, name: str) -> dict[str, str]:
        """The environment the node's `ray start` process runs with (`ip netns exec` execs it: the same pid)."""
        raw = Path(f"/proc/{self.running[name].proc.pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)

    def node_of(self, node_id: str) -> str:
        """The name of the node with this Ray node id."""
        return next(name for name, n in self.running.items() if n.node_id == node_id)

    def kill_node(self, name: str) -> None:
        """Lose a node: SIGKILL its raylet, then its whole process group (what a machine's loss looks like)."""
        node = self.running[name]
        pids = subprocess.run(["pgrep", "-g", str(node.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"raylet" in cmdline.split(b"\0")[0]:
                    os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(timeout=30)

    def processes(self) -> list[int]:
        """Pids of every process still running inside the namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self) -> None:
        """SIGKILL every node's process group and whatever else runs in the namespace, then delete it. A test
        cluster holds nothing worth a graceful drain (`ray start --block` on SIGTERM drains for up to 30 s)."""
        for node in reversed(list(self.running.values())):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
        for node in self.running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=STOP_GRACE_S)
        for pid in self.processes():  # anything else the tests started in the namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True)
        subprocess.run(["rm", "-rf", str(self.temp_dir)], capture_output=True)

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
