"""Cluster mode on a real multi-node Ray cluster (tests/ray_cluster.py: every node, server and driver in a
network namespace of this test's own, loopback only), driven through the CLI as a user drives it:
`r1flow up` for the servers, `r1flow run --cluster`, `r1flow status --cluster`.

The Ray nodes start without any of r1flow's variables (`bare_nodes`: no MKL_CBWR, OMP_WAIT_POLICY, R1FLOW_*, ...),
as a real cluster's machines would: what a stage needs comes from the driver.

- The tiny `r1` recipe on two Ray nodes: every fingerprint equals the run without a cluster (reward_model's and
  grpo_final's too, which MKL's mode changes), its stages ran on both nodes (manifest and MLflow tag), and
  independent stages overlapped in time.
- sft-eval's checkpoint evals: Ray tasks of their own on the node their eval node's `resources:` pins, while sft
  trains on another.
- A wrong address: `r1flow run` and `r1flow status` say so in one line within seconds, before any flow run; status
  pointed at something that is no Ray head ends on SIGTERM.
- A node no machine can hold (a label none offers, more machines than there are): one line before any stage runs.
- `--parallel 2` on one machine: the same fingerprints as the sequential run.
- A machine lost mid-stage (its raylet and workers SIGKILLed): the stage is retried on another node, resumes
  from its checkpoint under the shared home, and the run's fingerprints equal an unbroken run's.
- The driver killed mid-stage: nothing of the run keeps running on the cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import clean_env
from tests.ray_cluster import LoopbackCluster, netns_available, ray_installed

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ray_installed(), reason="the cluster extra is not installed: pip install -e .[cluster]"),
              pytest.mark.skipif(not netns_available(), reason="needs root and `ip netns` (a loopback-only namespace)")]

R1FLOW = str(Path(sys.executable).parent / "r1flow")
TINY = ["--profile", "tiny"]
# The fault tests' run: the model, the prompts and an SFT long enough (400 steps, about 16 s on one core; 40 steps
# took under 2 s and could end before the test killed its machine) to be killed after its first checkpoint (step
# 40); nothing after it (sft-eval's two evals would only add time).
FAULT_RECIPE = """
name: sft-only
model: tiny-random
nodes:
  base: {stage: import_model, config: {ref: tiny-random}}
  prompts: {stage: prompts}
  sft: {stage: sft, inputs: {model: base.model, data: prompts.prompts}}
"""


def run_local(cluster: LoopbackCluster, home: Path, *args: str) -> dict:
    """`r1flow run` without a cluster, in its own home, reporting to the module's servers (in the namespace: a
    temporary Prefect server per run would only add start-up time)."""
    out = home / "run.json"
    servers = json.loads((Path(cluster.env["R1FLOW_HOME"]) / "servers" / "servers.json").read_text())
    env = {**clean_env(home), "PREFECT_API_URL": servers["prefect_api_url"],
           "MLFLOW_TRACKING_URI": servers["mlflow_tracking_uri"]}
    r = cluster.run([R1FLOW, "run", *args, "--json", str(out)], env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def fingerprints(result: dict) -> dict[str, dict[str, str]]:
    return {s["node"]: s["outputs"] for s in result["stages"]}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cluster-home")  # shared by every node: one machine's filesystem


@pytest.fixture(scope="module")
def fault_recipe(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("recipes") / "sft-only.yaml"
    path.write_text(FAULT_RECIPE)
    return ["--recipe", str(path), "--set", "sft.max_steps=400", "--set", "sft.checkpoint_every=40"]


@pytest.fixture(scope="module")
def cluster(home, tmp_path_factory):
    """Head and worker, 1 CPU each, and `r1flow up` servers (started while the nodes come up), all in the
    namespace; stopped by PID at the end."""
    root = tmp_path_factory.mktemp("ray")
    nodes = [("head", 1, {"head": 1}), ("worker", 1, {"worker": 1, "trainer": 1})]
    c = LoopbackCluster(root, nodes=nodes, env=clean_env(home), bare_nodes=True).create_namespace()
    try:
        up = c.popen([R1FLOW, "up", "--detach"], log=root / "up.log")
        c.start_nodes()
        assert up.wait(timeout=240) == 0, (root / "up.log").read_text()
        try:
            yield c
        finally:
            c.run([R1FLOW, "down"], timeout=120)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def sequential(cluster, tmp_path_factory) -> dict:
    return run_local(cluster, tmp_path_factory.mktemp("sequential"), *TINY)


def run_on(cluster: LoopbackCluster, home: Path, *args: str) -> tuple[dict, str]:
    out = home / f"run-{time.time_ns()}.json"
    r = cluster.run([R1FLOW, "run", *args, "--cluster", cluster.address, "--json", str(out)], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(out.read_text()), r.stdout + r.stderr


def test_only_loopback_exists_where_the_cluster_runs(cluster):
    links = cluster.run(["ip", "-o", "link", "show"], check=True).stdout.splitlines()
    assert [line.split(":")[1].strip() for line in links] == ["lo"]
    listening = cluster.run(["ss", "-Hltn"], check=True).stdout.split("\n")
    local = [line.split()[3] for line in listening if line.strip()]
    assert local and all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]") for a in local), local


def test_status_shows_the_clusters_nodes_and_resources(cluster):
    out = cluster.run([R1FLOW, "status", "--cluster", cluster.address], check=True).stdout
    assert "2 of 2 nodes alive" in out, out
    for node in cluster.running.values():
        line = next(x for x in out.splitlines() if x.startswith(node.node_id[:12]))
        assert "alive" in line and all(f"{k}={v:g}" in line for k, v in node.resources.items()), line


def test_tiny_r1_on_two_ray_nodes_equals_the_run_without_a_cluster(cluster, home, sequential):
    """All outputs equal the local run's, on nodes started without MKL_CBWR: reward_model's (and grpo_final's, which
    scores with it) differed around the 6th digit of the loss when the workers ran without MKL's strict mode."""
    from mlflow.tracking import MlflowClient

    from flows.store.artifacts import ArtifactStore
    from tests.ray_cluster import R1FLOW_VARIABLES

    for name in cluster.running:
        assert not [k for k in cluster.node_environ(name) if k.startswith(R1FLOW_VARIABLES)], name
    result, output = run_on(cluster, home, *TINY)
    assert fingerprints(result)["reward_model"] == fingerprints(sequential)["reward_model"]
    assert fingerprints(result) == fingerprints(sequential)
    timing = next(line for line in output.splitlines() if line.startswith("stage work"))
    assert "overhead -" not in timing and "side by side" in timing, timing  # stages overlapped: no negative overhead
    ran = [s for s in result["stages"] if s["status"] == "run"]
    assert len(ran) == len(result["stages"]) == len(sequential["stages"])
    node_ids = {n.node_id for n in cluster.running.values()}
    assert {s["ray_node_id"] for s in ran} == node_ids  # both nodes did work, and only they

    store, client = ArtifactStore(home, home=home), MlflowClient(f"sqlite:///{home}/servers/mlflow.db")
    for s in ran:
        for fp in s["outputs"].values():
            assert store.read_manifest(fp).producer.ray_node_id == s["ray_node_id"], s["node"]
        assert client.get_run(s["mlflow_run_id"]).data.tags["r1flow.ray_node_id"] == s["ray_node_id"], s["node"]

    # independent stages overlapped: some two stages that ran at the same time on different nodes
    overlaps = [(a["node"], b["node"]) for a in ran for b in ran
                if a["node"] < b["node"] and a["ray_node_id"] != b["ray_node_id"]
                and a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]]
    assert overlaps, [(s["node"], s["started_at"], s["ended_at"]) for s in ran]


def test_checkpoint_evals_are_ray_tasks_placed_by_their_eval_nodes_resources(cluster, home):
    """sft-eval with sft pinned to the worker and eval_sft to the head (`resources.labels`): sft's checkpoint evals
    ran as Ray tasks of their own on the head while sft trained on the worker (before, they ran in a process beside
    sft, on the worker), each an MLflow run nested under sft's, and their curve is in sft's run. eval_base is pinned
    to the worker so that nothing else holds the head's one CPU while sft trains."""
    from mlflow.tracking import MlflowClient

    result, _ = run_on(cluster, home, "--recipe", "sft-eval", *TINY, "--set", "sft.max_steps=400",
                       "--set", "sft.publish_checkpoints_every=150", "--set", "sft.resources.labels.worker=1",
                       "--set", "eval_sft.resources.labels.head=1", "--set", "eval_base.resources.labels.worker=1")
    head, worker = cluster.running["head"].node_id, cluster.running["worker"].node_id
    sft = next(s for s in result["stages"] if s["node"] == "sft")
    assert (sft["status"], sft["ray_node_id"]) == ("run", worker)
    client = MlflowClient(f"sqlite:///{home}/servers/mlflow.db")
    # the servers' artifacts (mlflow-artifacts:/<experiment>/<run>/artifacts) are files under the shared home
    where = client.get_run(sft["mlflow_run_id"]).info.artifact_uri.removeprefix("mlflow-artifacts:/")
    record = json.loads((home / "servers" / "mlartifacts" / where / "checkpoint_evals.json").read_text())
    evals = record["evals"]
    assert [(e["step"], e["eval"], e["cached"], e["ray_node_id"]) for e in evals] == [
        (150, "eval_sft@sft-step150", False, head), (300, "eval_sft@sft-step300", False, head)]
    # the first computed on the head while sft still trained on the worker
    assert evals[0]["started_at"] < evals[0]["computed_from"] < evals[0]["computed_to"] < record["training_ended_at"]
    nested = client.search_runs([result["experiment_id"]], f"tags.mlflow.parentRunId = '{sft['mlflow_run_id']}'")
    assert {r.data.tags["r1flow.node"]: r.data.tags["r1flow.ray_node_id"] for r in nested} == {
        "eval_sft@sft-step150": head, "eval_sft@sft-step300": head}
    history = client.get_metric_history(sft["mlflow_run_id"], "checkpoint_eval/accuracy")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (e["step"], e["checkpoint_eval/accuracy"]) for e in evals]


def _flow_runs(cluster: LoopbackCluster) -> int:
    """How many flow runs the module's Prefect server holds (asked from inside the namespace)."""
    servers = json.loads((Path(cluster.env["R1FLOW_HOME"]) / "servers" / "servers.json").read_text())
    code = ("import json, urllib.request\n"
            f"req = urllib.request.Request({servers['prefect_api_url'] + '/flow_runs/count'!r}, data=b'{{}}', "
            "headers={'Content-Type': 'application/json'})\n"
            "print(json.load(urllib.request.urlopen(req, timeout=30)))")
    return int(cluster.python(code).strip())


@pytest.mark.parametrize("command", [["run", *TINY], ["status"]])
def test_a_wrong_address_is_one_line_within_seconds_before_any_flow_run(cluster, command):
    """Nothing listens at 127.0.0.1:1: Ray's connect repeated its GCS errors until killed (and status ignored
    SIGTERM meanwhile). Now one line, exit 2, and the Prefect server has no new flow run."""
    before = _flow_runs(cluster)
    start = time.monotonic()
    r = cluster.run([R1FLOW, *command, "--cluster", "127.0.0.1:1"], timeout=120)
    took = time.monotonic() - start
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.splitlines() == ["r1flow: error: no Ray cluster answers at 127.0.0.1:1 (connection refused): check "
                                     "the address of its head (`ray start --head` prints it) or start one"], r.stderr
    assert took < 30, took  # imports and the plan (run) included, on a busy 2-core machine
    assert _flow_runs(cluster) == before


def test_status_pointed_at_something_that_is_no_ray_head_ends_on_sigterm(cluster, tmp_path):
    """The Prefect server's port answers TCP but is no Ray head: Ray's connect would retry it for good, in C, where
    the SIGTERM handler it installs in the main thread never runs. Status connects from a helper thread instead."""
    servers = json.loads((Path(cluster.env["R1FLOW_HOME"]) / "servers" / "servers.json").read_text())
    port = servers["prefect_api_url"].rsplit(":", 1)[1].split("/")[0]
    status = cluster.popen([R1FLOW, "status", "--cluster", f"127.0.0.1:{port}"], log=tmp_path / "status.log")
    try:
        deadline = time.monotonic() + 60
        while b"Failed to connect to GCS" not in (tmp_path / "status.log").read_bytes():  # Ray is retrying now
            assert status.poll() is None and time.monotonic() < deadline, (tmp_path / "status.log").read_text()
            time.sleep(0.2)
        os.kill(status.pid, signal.SIGTERM)
        assert status.wait(timeout=10) == -signal.SIGTERM
    finally:
        if status.poll() is None:
            status.kill()
            status.wait()


def test_a_node_no_machine_can_hold_fails_in_one_line_before_any_stage_runs(cluster, tmp_path, fault_recipe):
    """A label no node offers (set with --set, the placement's key) hung for good; a stage trained across more
    machines than the cluster has failed only once the stages before it had run, after a ~55-line traceback. Now
    the driver waits 60 s for machines (an autoscaler's), then one r1flow line names both, and nothing ran."""
    out = tmp_path / "run.json"
    start = time.monotonic()
    r = cluster.run([R1FLOW, "run", *TINY, *fault_recipe, "--set", "prompts.resources.labels.a100=1", "--set",
                     "sft.resources.nodes=4", "--cluster", cluster.address, "--json", str(out)], timeout=600)
    took = time.monotonic() - start
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("r1flow: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "r1flow: error: node 'prompts' needs CPU=1, a100=1 on one Ray node (no node offers a100); node 'sft' needs "
        "CPU=1 on each of 4 Ray nodes (it trains across machines)"), r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-6000:]
    assert " ... (elapsed" not in r.stdout + r.stderr and not out.exists()  # no stage started; no summary
    assert 60 <= took < 150, took


def test_parallel_two_on_one_machine_gives_the_sequential_fingerprints(cluster, tmp_path, sequential):
    result = run_local(cluster, tmp_path, *TINY, "--parallel", "2")
    assert fingerprints(result) == fingerprints(sequential)
    ran = [s for s in result["stages"] if s["status"] == "run"]
    assert any(a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]
               for a in ran for b in ran if a["node"] < b["node"])  # it did run stages side by side


def _lock_holders(path: Path) -> list[int]:
    """Pids of processes with `path` open (the stage lock a running stage task holds)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if any(os.readlink(f"/proc/{entry}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{entry}/fd")):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def _running_checkpoint(home: Path, timeout: float = 240) -> str:
    """The cache key of the first stage that has written a checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in (home / "checkpoints").glob("*/step-*"):
            return d.parent.name
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint under {home / 'checkpoints'} after {timeout:.0f} s")


def _node_of(cluster: LoopbackCluster, pid: int) -> str:
    """The node whose `ray start` process is an ancestor of pid."""
    starts = {n.proc.pid: name for name, n in cluster.running.items()}
    while pid > 1:
        if pid in starts:
            return starts[pid]
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise AssertionError("not a process of any cluster node")


def test_a_node_lost_mid_stage_retries_it_elsewhere_from_its_checkpoint(cluster, home, tmp_path, fault_recipe):
    """The SFT stage may run only where `trainer` is offered (the worker and a spare started here). Once it has
    written a checkpoint, the machine running it is lost; Ray retries the stage on the other, which resumes."""
    (tmp_path / "unbroken").mkdir()
    unbroken = run_local(cluster, tmp_path / "unbroken", *TINY, *fault_recipe)
    cluster.start_node("spare", 1, {"spare": 1, "trainer": 1})
    cluster.wait_for_nodes(3)
    profile = tmp_path / "tiny-trainer.yaml"
    tiny = (Path(__file__).parents[1] / "flows" / "profiles" / "tiny.yaml").read_text()
    profile.write_text(tiny + "\nresources:\n  sft: {labels: {trainer: 1}}\n")
    out = home / "fault.json"
    log = tmp_path / "fault.log"
    driver = cluster.popen([R1FLOW, "run", "--profile", str(profile), *fault_recipe, "--cluster", cluster.address,
                            "--json", str(out)], log=log)
    try:
        key = _running_checkpoint(home)
        holders = _lock_holders(home / "locks" / f"{key}.lock")
        assert holders, "the stage that checkpoints holds its lock"
        lost = _node_of(cluster, holders[0])
        assert lost in ("worker", "spare")
        cluster.kill_node(lost)
        assert driver.wait(timeout=600) == 0, log.read_text()[-6000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    result = json.loads(out.read_text())
    assert fingerprints(result) == fingerprints(unbroken)
    sft = next(s for s in result["stages"] if s["node"] == "sft")
    survivor = cluster.running["spare" if lost == "worker" else "worker"].node_id
    assert sft["ray_node_id"] == survivor
    resumed = int(sft["metrics"]["resumed_from_step"])
    assert resumed > 0  # from the lost node's checkpoint, not from scratch
    # the table shows the stage's 400 steps and where it resumed, not trained_steps=<the last stretch>
    table = log.read_text()
    assert re.search(r"(?<!_)steps=400\b", table) and f"resumed_from_step={resumed}" in table, table[-4000:]
    assert "trained_steps" not in table


def test_a_killed_driver_leaves_nothing_running_on_the_cluster(cluster, home, tmp_path, fault_recipe):
    log = tmp_path / "driver.log"
    before = set(cluster.processes())
    driver = cluster.popen([R1FLOW, "run", *TINY, *fault_recipe, "--set", "seed=7", "--cluster", cluster.address],
                           log=log)
    try:
        key = _running_checkpoint(home)
        assert _lock_holders(home / "locks" / f"{key}.lock"), "a stage task is running on the cluster"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 60
    while True:  # Ray ends the dead driver's job: its task's worker process goes, and the stage lock with it
        left = [p for p in set(cluster.processes()) - before if _task_process(p)]
        holders = _lock_holders(home / "locks" / f"{key}.lock")
        if not (left or holders) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    assert not holders, [Path(f"/proc/{p}/cmdline").read_bytes() for p in holders if Path(f"/proc/{p}").exists()]


def _task_process(pid: int) -> bool:
    """A process that runs a stage task or a training rank (Ray titles a worker `ray::<task or actor>`)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return title.startswith(b"ray::") and not title.startswith((b"ray::IDLE", b"ray::RuntimeEnv", b"ray::DashboardA"))
