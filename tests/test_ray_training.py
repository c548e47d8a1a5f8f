"""Training stages across machines (issue 43, part 2): `resources: {nodes: N, num_processes: M}` runs the stage
as N × M Ray actors in a STRICT_SPREAD placement group (`stages.training.ray_launch`), running the same rank
code as `accelerate launch`, so the results are the single-node data-parallel ones. Asynchronous grpo's rollout
workers as Ray actors on the other node (issue 60): the same bytes as on one machine, a killed actor replaced with
the same bytes, a hung one a single line within async.sync_timeout_s.

The cluster is real (tests/ray_cluster.py): a head and a worker node, one CPU each, in a network namespace
of their own on loopback. The pytest process is outside that namespace, so everything that talks to Ray runs
in a driver subprocess inside it (tests/ray_training_driver.py); the filesystem is shared, as R1FLOW_HOME
must be on a real cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from schemas.configs import LoraSpec, ResourcesSpec, SFTConfig
from schemas.errors import ConfigError
from stages.base import LocalContext
from stages.training import async_rollouts, launch, ray_launch
from tests.ray_cluster import LoopbackCluster, netns_available, ray_installed
from tests.test_distributed import RTOL, TWO, _curve, _sft_input

DRIVER = Path(__file__).resolve().parent / "ray_training_driver.py"
TWO_NODES = ResourcesSpec(nodes=2, num_processes=1)

needs_cluster = pytest.mark.skipif(not (ray_installed() and netns_available()),
                                   reason="needs ray (pip install -e .[cluster]) and root with `ip netns`")


# ---------------------------------------------------------------------------- without a cluster


def test_resources_accept_processes_per_node_and_count_the_world():
    spec = ResourcesSpec.model_validate({"nodes": 2, "processes_per_node": 3})
    assert (spec.nodes, spec.num_processes, spec.world_size) == (2, 3, 6)
    assert ResourcesSpec().nodes == 1 and ResourcesSpec(num_processes=2).world_size == 2
    assert ResourcesSpec.model_validate(spec.model_dump()) == spec  # dumped as num_processes, read back
    with pytest.raises(ValueError):
        ResourcesSpec(nodes=0)


def test_two_nodes_without_a_cluster_is_a_config_error_before_any_compute(monkeypatch, tmp_path):
    """No Ray connection (not initialised, no RAY_ADDRESS): ConfigError naming the fix; nothing runs, not even
    the wait for an earlier run's ranks; no work directory is made. Ray not installed: the install command."""
    from stages import sft

    def no_compute(*a, **k):
        raise AssertionError("must not start anything")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(sft, "run", no_compute)
    monkeypatch.setattr(launch, "wait_for_earlier_ranks", no_compute)
    monkeypatch.setattr(launch, "run_distributed", no_compute)
    cfg = SFTConfig(batch_size=4, lora=LoraSpec(r=0), resources=TWO_NODES)
    ctx = LocalContext(tmp_path)
    if ray_installed():
        import ray

        assert not ray.is_initialized()
        with pytest.raises(ConfigError, match=r"^sft\.resources\.nodes=2 needs a Ray cluster: run with "
                                              r"`r1flow run --cluster ADDRESS` \(or RAY_ADDRESS\)$"):
            launch.run_stage(sft, cfg, {}, ctx)
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    with pytest.raises(ConfigError, match=r"needs Ray, which is not installed here: pip install -e \.\[cluster\]"):
        launch.run_stage(sft, cfg, {}, ctx)
    assert not list(tmp_path.glob(f"{launch.RANKS_WORK_PREFIX}*")) and not ctx.checkpoint_dir.exists()


def test_a_rank_that_cannot_see_the_shared_files_says_which_node(tmp_path):
    spec = tmp_path / "spec.json"
    assert ray_launch.check_readable(spec, 1, "10.0.0.2") == (
        f"rank 1 on node 10.0.0.2: cannot read {spec}: multi-node stages need R1FLOW_HOME on a filesystem every "
        f"node shares")
    (tmp_path / "model").mkdir()
    inputs = {"model": {"path": str(tmp_path / "model"), "base": None},
              "data": {"path": str(tmp_path / "model"), "base": {"path": str(tmp_path / "gone"), "base": None}}}
    spec.write_text(json.dumps({"inputs": inputs}))
    assert ray_launch.check_readable(spec, 3, "h").startswith(f"rank 3 on node h: cannot read {tmp_path / 'gone'}: ")
    inputs["data"]["base"] = None
    spec.write_text(json.dumps({"inputs": inputs}))
    assert ray_launch.check_readable(spec, 0, "h") is None


def test_each_rank_gets_torchruns_environment_and_its_machines_gpus():
    ranks = ray_launch.RayRanks(None, "sft", nodes=2, per_node=2, cuda=True, log=None)
    ranks.infos = [{"ip": "10.0.0.1", "gpus": ["3"]}, {"ip": "10.0.0.1", "gpus": ["1"]},
                   {"ip": "10.0.0.2", "gpus": ["0"]}, {"ip": "10.0.0.2", "gpus": ["1"]}]
    assert ranks.bundle == {"CPU": 2.0, "GPU": 2.0}
    assert ranks.environment(3, 29500) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert ranks.environment(0, 1)["CUDA_VISIBLE_DEVICES"] == "3,1"  # cuda:LOCAL_RANK is each rank's own GPU
    assert ray_launch.RayRanks(None, "sft", 2, 1, cuda=False, log=None).bundle == {"CPU": 1.0}


def test_a_failed_rank_is_named_with_its_node(tmp_path):
    (tmp_path / "error-rank1.txt").write_text("Traceback (most recent call last):\nValueError: boom\n")
    msg = launch._failure_message("sft", 2, None, tmp_path, {0: "10.0.0.1", 1: "10.0.0.2"},
                                  where="2 processes on 2 nodes")
    assert msg == "sft on 2 processes on 2 nodes: rank1 on node 10.0.0.2 failed:\nTraceback (most recent call " \
                  "last):\nValueError: boom"
    (tmp_path / "error-rank1.txt").unlink()
    assert launch._failure_message("sft", 2, None, tmp_path, {}, "rank 1 on node h died: RayActorError",
                                   where="2 processes on 2 nodes").endswith(": rank 1 on node h died: RayActorError")


# ---------------------------------------------------------------------------- on a 2-node cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not (ray_installed() and netns_available()):
        pytest.skip("needs ray (pip install -e .[cluster]) and root with `ip netns`")
    c = LoopbackCluster(tmp_path_factory.mktemp("ray-cluster")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def sft_rows(tmp_path_factory):
    return _sft_input(tmp_path_factory.mktemp("sft"), 24)


def _sft_config(resources: ResourcesSpec) -> SFTConfig:
    """test_distributed's SFT run: 6 steps of batch 4 × accumulation 2, full fine-tuning, constant lr."""
    return SFTConfig(max_steps=6, batch_size=4, grad_accum=2, learning_rate=3e-3, warmup_ratio=0.0, max_length=128,
                     checkpoint_every=3, lora=LoraSpec(r=0), lr_scheduler="constant", resources=resources)


def _start_driver(cluster: LoopbackCluster, tmp: Path, cfg, inputs: dict, module: str = "stages.sft",
                  task: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """The driver runs `module`'s stage in itself, or (`task`: Ray options) as a Ray task placed by them."""
    request, result = tmp / "request.json", tmp / "result.json"
    request.write_text(json.dumps({"module": module, "config": cfg.model_dump(mode="json"), "seed": 0,
                                   "inputs": {k: launch._input_spec(v) for k, v in inputs.items()},
                                   "root": str(tmp / "run"), "task": task}))
    proc = cluster.popen([sys.executable, str(DRIVER), str(request), str(result)], log=tmp / "driver.log",
                         env={"RAY_ADDRESS": cluster.address})
    return proc, result


def _titled(cluster: LoopbackCluster, title: bytes) -> list[int]:
    """Ray worker processes in the namespace whose command line (Ray titles a worker after its actor and method)
    holds `title`."""
    found = []
    for pid in cluster.processes():
        try:
            if title in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def _rank_actors(cluster: LoopbackCluster) -> list[int]:
    """Ray worker processes in the namespace that are (or were about to be) rank actors."""
    return _titled(cluster, b"RankActor")


def _rollout_actors_running(cluster: LoopbackCluster) -> list[int]:
    """Ray worker processes in the namespace running a rollout actor's loop."""
    return _titled(cluster, b"RolloutActor.run")


def _on_rollout_actor_once_published(cluster: LoopbackCluster, run_root: Path, version: int, sig: int,
                                     proc: subprocess.Popen, timeout: float = 240) -> int:
    """As soon as the learner of the driver's run at `run_root` has published `version`, send `sig` to the rollout
    actor running its loop; its pid."""
    path = async_rollouts.version_file(LocalContext(run_root).checkpoint_dir / async_rollouts.WEIGHTS_DIR, version)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        pids = _rollout_actors_running(cluster) if path.exists() else []
        if len(pids) == 1:
            os.kill(pids[0], sig)
            return pids[0]
        time.sleep(0.02)
    raise AssertionError(f"version {version} was not published with one rollout actor running (driver exit code "
                         f"{proc.poll()}, actors {_rollout_actors_running(cluster)})")


@needs_cluster
@pytest.mark.slow
def test_sft_on_two_ray_nodes_follows_the_two_process_accelerate_run(cluster, tmp_path, tiny_model_input, sft_rows):
    """nodes 2 × 1 process on the Ray cluster against num_processes 2 under accelerate on this machine: the same
    ranks take the same shares of every micro-batch, so the same curve (RTOL over all 6 steps) and the same saved
    weights; the two ranks ran on the two different Ray nodes, and no rank actor is left afterwards."""
    from safetensors.torch import load_file

    from stages import sft

    inputs = {"model": tiny_model_input, "data": sft_rows}
    started = time.monotonic()
    proc, result = _start_driver(cluster, tmp_path, _sft_config(TWO_NODES), inputs)
    try:
        local = LocalContext(tmp_path / "accelerate")  # meanwhile, today's 2-process launch on this machine
        out_local = launch.run_stage(sft, _sft_config(TWO), inputs, local)["model"]
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "driver.log").read_text(errors="replace")
    assert rc == 0, log[-6000:]
    got = json.loads(result.read_text())
    ray_ctx = LocalContext(tmp_path / "unused")
    ray_ctx.metrics = [(step, m) for step, m in got["metrics"]]
    worst = 0.0
    for key in ("train/loss", "train/grad_norm"):
        a, b = _curve(local, key), _curve(ray_ctx, key)
        assert len(a) == len(b) == 6, (key, a, b)
        assert b == pytest.approx(a, rel=RTOL, abs=1e-6), (key, a, b)
        if key == "train/loss":
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))
    w_local = load_file(out_local.path / "model" / "model.safetensors")
    w_ray = load_file(Path(got["outputs"]["model"]) / "model" / "model.safetensors")
    assert w_local.keys() == w_ray.keys()
    weight_diff = max((w_local[k] - w_ray[k]).abs().max().item() for k in w_local)
    for k in w_local:
        torch.testing.assert_close(w_ray[k], w_local[k], rtol=1e-5, atol=1e-6, msg=k)
    node_ids = got["params"]["ray.node_ids"].split(",")
    assert sorted(node_ids) == sorted(n.node_id for n in cluster.running.values()), node_ids  # one rank on each
    assert got["params"]["examples"] == 24  # rank 0's params reached the driver's context
    assert "sft: 100%|" in log and "step/s, loss=" in log  # rank 0's output was streamed to the caller's log
    assert not list((tmp_path / "run").glob(f"{launch.RANKS_WORK_PREFIX}*"))  # work directory removed
    deadline = time.monotonic() + 15
    while _rank_actors(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _rank_actors(cluster)
    print(f"ray 2 nodes vs accelerate 2 processes: max relative loss difference {worst:.2e}, max weight "
          f"difference {weight_diff:.2e}, {time.monotonic() - started:.0f} s")


@needs_cluster
@pytest.mark.slow
def test_a_failing_rank_on_the_cluster_fails_the_stage_with_its_node_and_traceback(cluster, tmp_path,
                                                                                    tiny_model_input):
    from schemas.datasets import from_rows
    from stages.base import write_dataset
    from tests.conftest import fake_input

    rows = [{"id": "0", "source": "t", "metadata": "{}", "messages": [
        {"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}]
    data = fake_input(write_dataset(LocalContext(tmp_path / "d"), "d", from_rows(rows, "sft"), "sft").path,
                      "dataset", "sft", 1)
    cfg = SFTConfig(max_steps=1, batch_size=2, max_length=16, lora=LoraSpec(r=0), resources=TWO_NODES)
    proc, result = _start_driver(cluster, tmp_path, cfg, {"model": tiny_model_input, "data": data})
    assert proc.wait(timeout=300) != 0
    got = json.loads(result.read_text())
    assert got["error"] == "StageError", got
    assert re.match(r"(?s)sft on 2 processes on 2 nodes: rank\d on node 127\.0\.0\.1 failed:\n.*SchemaError.*"
                    r"max_length=16", got["message"]), got["message"]
    assert not list((tmp_path / "run").glob(f"{launch.RANKS_WORK_PREFIX}*"))


@needs_cluster
@pytest.mark.slow
def test_a_killed_driver_leaves_no_rank_on_any_node(cluster, tmp_path, tiny_model_input, sft_rows):
    """The ranks are actors owned by the calling process: kill -9 it mid-training and Ray ends them on both
    nodes (no lifetime.watch_parent there: its pid means nothing on another machine)."""
    cfg = _sft_config(TWO_NODES).model_copy(update={"max_steps": 100_000, "checkpoint_every": 100_000})
    proc, _ = _start_driver(cluster, tmp_path, cfg, {"model": tiny_model_input, "data": sft_rows})
    try:
        deadline = time.monotonic() + 120
        while not any('"metrics"' in p.read_text() for p in (tmp_path / "run").glob("r1flow-ranks-*/events.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-4000:]
            time.sleep(0.5)
        ranks = _rank_actors(cluster)
        assert len(ranks) == 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = time.monotonic()
    while (_rank_actors(cluster) or any(Path(f"/proc/{pid}").exists() for pid in ranks)) \
            and time.monotonic() < killed + 60:
        time.sleep(0.5)
    assert not _rank_actors(cluster) and not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    print(f"rank actors gone {time.monotonic() - killed:.1f} s after the driver was killed")


@needs_cluster
@pytest.mark.slow
def test_async_grpo_generates_on_one_ray_node_and_learns_on_the_other(cluster, tmp_path, tiny_model_input,
                                                                     digit_prompts):
    """Asynchronous grpo (K = 1) as a Ray task on the head node (resources {head: 1}, as a node's `resources:` place
    a stage of `r1flow run --cluster`), its rollout worker a Ray actor on the worker node (async.worker_resources
    labels {worker: 1}), that actor's process killed (SIGKILL) as soon as the learner published version 1 (it still
    owes step 3, sampled with version 2): a new actor on the worker node replaces it from the first step the learner
    had not received (one warning line naming the dead actor's pid and Ray node and the step), the node ids recorded
    say where everything ran, the schedule is min(K, s), the model's bytes equal the one-machine asynchronous run's
    (worker processes beside the learner, none killed), and the placement leaves the cache key as it is."""
    import hashlib

    from flows.store.cache import cache_key
    from stages import grpo
    from tests.test_async_rl import _check_schedule
    from tests.test_grpo import short_is_better

    placed = short_is_better(steps=4, **{"async": {"max_staleness": 1, "worker_resources": {"labels": {"worker": 1}}}})
    here = short_is_better(steps=4, **{"async": {"max_staleness": 1}})
    assert "worker_resources" in placed.model_dump(mode="json")["async"]  # the stage task gets it, the key does not
    assert cache_key("grpo", grpo.VERSION, placed.model_dump(mode="json"), {}, 0) == \
        cache_key("grpo", grpo.VERSION, here.model_dump(mode="json"), {}, 0)
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    started = time.monotonic()
    proc, result = _start_driver(cluster, tmp_path, placed, inputs, module="stages.grpo",
                                 task={"num_cpus": 1, "resources": {"head": 1}})
    killed: list = []
    killer = threading.Thread(target=lambda: killed.append(_killed_after(cluster, tmp_path / "run", proc)))
    killer.start()
    try:
        local = LocalContext(tmp_path / "one-machine", seed=0)  # meanwhile, the same stage on this machine
        out_local = grpo.run(here, inputs, local)["model"]
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        killer.join()
    log = (tmp_path / "driver.log").read_text(errors="replace")
    assert rc == 0, log[-6000:]
    assert isinstance(killed[0], int), killed
    got = json.loads(result.read_text())
    params = got["params"]
    worker_node = cluster.running["worker"].node_id
    assert params["async.placement"] == "ray", params
    assert params["async.learner_node_id"] == cluster.running["head"].node_id, params
    assert params["async.worker_node_ids"] == worker_node, params
    assert local.params["async.placement"] == "processes"
    replaced = re.findall(rf"grpo: async rollout worker 0 \(pid {killed[0]} on \S+, Ray node {worker_node}\) died "
                          r"\(\w+\) before delivering step (\d)'s groups \(policy version (\d)\); replaced \(1 of "
                          rf"async.worker_restarts=2\) by pid (\d+) on \S+, Ray node {worker_node}, from step (\d)", log)
    replaced = sorted(set(replaced))  # (the driver's log has every line of a Ray worker twice)
    assert len(replaced) == 1 and replaced[0][0] == replaced[0][3] in "123", (replaced, log[-4000:])
    assert int(replaced[0][1]) == max(0, int(replaced[0][0]) - 1) and int(replaced[0][2]) != killed[0]
    ray_ctx = LocalContext(tmp_path / "run")  # the driver's root: the checkpoints record the consumed groups
    ray_ctx.metrics = [(step, m) for step, m in got["metrics"]]
    _check_schedule(ray_ctx, 1, 4, 4)
    assert [m["async/worker_restarts"] for s, m in ray_ctx.metrics if s == 4] == [1.0]
    sha = lambda d: hashlib.sha256((Path(d) / "model" / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert sha(got["outputs"]["model"]) == sha(out_local.path)
    print(f"async grpo, learner on {params['async.learner_node_id'][:8]}, worker on "
          f"{params['async.worker_node_ids'][:8]}, killed and replaced from step {replaced[0][0]}: "
          f"{time.monotonic() - started:.0f} s")


def _killed_after(cluster: LoopbackCluster, run_root: Path, proc: subprocess.Popen) -> int | str:
    """The rollout actor SIGKILLed once version 1 is published (its pid), or why not."""
    try:
        return _on_rollout_actor_once_published(cluster, run_root, 1, signal.SIGKILL, proc)
    except AssertionError as e:
        return str(e)


@needs_cluster
@pytest.mark.slow
def test_a_hung_rollout_actor_ends_the_stage_in_one_line_within_the_sync_timeout(cluster, tmp_path, tiny_model_input,
                                                                                  digit_prompts):
    """The rollout actor of asynchronous grpo (K = 1, 4 steps, async.sync_timeout_s=20) stopped (SIGSTOP) as soon as
    the learner published version 1: it still owes step 3 at least, so the learner ends the stage within the
    timeout of its wait with one line naming the actor's pid, its Ray node and the policy version (a hang is not
    replaced: the actor is alive). 20 s, not less: on 2 loaded cores one honest step of the actor once took over 10 s."""
    from tests.test_grpo import short_is_better

    cfg = short_is_better(steps=4, **{"async": {"max_staleness": 1, "sync_timeout_s": 20,
                                                "worker_resources": {"labels": {"worker": 1}}}})
    proc, result = _start_driver(cluster, tmp_path, cfg, {"model": tiny_model_input, "prompts": digit_prompts},
                                 module="stages.grpo", task={"num_cpus": 1, "resources": {"head": 1}})
    stopped = None
    try:
        stopped = _on_rollout_actor_once_published(cluster, tmp_path / "run", 1, signal.SIGSTOP, proc)
        at = time.monotonic()
        rc = proc.wait(timeout=120)
        waited = time.monotonic() - at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stopped is not None and Path(f"/proc/{stopped}").exists():
            os.kill(stopped, signal.SIGKILL)
    log = (tmp_path / "driver.log").read_text(errors="replace")
    assert rc != 0, log[-4000:]
    got = json.loads(result.read_text())
    assert "StageError" in got["error"], got
    line = rf"grpo: async rollout worker 0 \(pid {stopped} on \S+, Ray node {cluster.running['worker'].node_id}\) " \
           r"did not (load policy version \d|deliver step \d's groups \(policy version \d\)) within " \
           r"async.sync_timeout_s=20 s"
    assert re.search(rf"(^|StageError: ){line}\Z", got["message"].strip(), re.M), got["message"]
    assert waited < 20 + 30, waited  # the timeout, a learner step and the driver's exit
    assert "replaced" not in log
    print(f"hung rollout actor: the stage ended {waited:.1f} s after the SIGSTOP")
