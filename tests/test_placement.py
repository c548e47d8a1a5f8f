"""Where nodes run (flows/run/placement.py) and what they declare (`resources:` in recipes and profiles): fast checks
without a cluster. The cluster itself is exercised in tests/test_cluster.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flows.plan.recipes import load_plan
from flows.run import placement
from flows.run.placement import Execution
from schemas.configs import NodeResources
from schemas.errors import ConfigError


def _recipe(tmp_path, node_resources: str = "", profile_resources: str = ""):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
name: r
model: tiny-random
nodes:
  base: {{stage: import_model, config: {{ref: tiny-random}}}}
  prompts: {{stage: prompts}}
  sft:
    stage: sft
    inputs: {{model: base.model, data: prompts.prompts}}
    {node_resources}
  eval_sft: {{stage: eval, inputs: {{model: sft.model, prompts: prompts.prompts}}}}
""")
    profile = tmp_path / "p.yaml"
    profile.write_text("name: p\nmodel: tiny-random\nstages: {sft: {max_steps: 2, batch_size: 2}}\n" + profile_resources)
    return str(recipe), str(profile)


def test_defaults_one_cpu_no_gpu_and_nothing_in_the_config(tmp_path):
    recipe, profile = _recipe(tmp_path)
    plan = load_plan(recipe, profile)
    assert all(n.resources == NodeResources() for n in plan.nodes)
    assert plan.node("sft").config.resources.num_processes == 1


def test_profile_by_name_beats_stage_type_beats_recipe(tmp_path):
    recipe, profile = _recipe(tmp_path, node_resources="resources: {cpus: 3, labels: {a100: 1}}",
                              profile_resources="resources:\n  sft: {cpus: 2, gpus: 1}\n  eval_sft: {memory_gb: 4}\n"
                                                "  eval: {cpus: 0.5}\n")
    plan = load_plan(recipe, profile)
    assert plan.node("sft").resources == NodeResources(cpus=2, gpus=1, labels={"a100": 1})
    assert plan.node("eval_sft").resources == NodeResources(cpus=0.5, memory_gb=4)


def test_the_placement_is_not_part_of_the_cache_key(tmp_path):
    from flows.run.pipeline import node_key

    recipe, profile = _recipe(tmp_path)
    plain = load_plan(recipe, profile)
    recipe2, _ = _recipe(tmp_path, node_resources="resources: {cpus: 4, gpus: 2, memory_gb: 10, labels: {x: 1}}")
    placed = load_plan(recipe2, profile)
    upstream = {"base": {"model": "m" * 64}, "prompts": {"prompts": "p" * 64}}
    assert node_key(plain.node("sft"), upstream)[0] == node_key(placed.node("sft"), upstream)[0]


def test_set_reaches_both_things_named_resources(tmp_path):
    """`--set NODE.resources.KEY=`: the placement's keys (cpus, gpus, memory_gb, labels) set the node's placement,
    over the recipe's and the profile's, outside the cache key; the training config's keys (num_processes, nodes,
    distributed_type, backend) set config.resources, in it. (Before: `sft.resources.labels: unknown key`.)"""
    from flows.run.pipeline import node_key

    recipe, profile = _recipe(tmp_path, node_resources="resources: {cpus: 3}")
    upstream = {"base": {"model": "m" * 64}, "prompts": {"prompts": "p" * 64}}
    plain = load_plan(recipe, profile)
    placed = load_plan(recipe, profile, ["sft.resources.labels.a100=1", "sft.resources.gpus=1",
                                         "eval_sft.resources.memory_gb=2"])
    assert placed.node("sft").resources == NodeResources(cpus=3, gpus=1, labels={"a100": 1})
    assert placed.node("eval_sft").resources == NodeResources(memory_gb=2)
    assert node_key(plain.node("sft"), upstream)[0] == node_key(placed.node("sft"), upstream)[0]
    trained = load_plan(recipe, profile, ["sft.resources.num_processes=2", "sft.resources.labels={a100: 2}"])
    assert trained.node("sft").config.resources.num_processes == 2
    assert trained.node("sft").resources.labels == {"a100": 2}
    with pytest.raises(ConfigError, match=r"node 'sft' resources\.gpus"):
        load_plan(recipe, profile, ["sft.resources.gpus=-1"])


def test_processes_per_node_becomes_the_training_topology(tmp_path):
    recipe, profile = _recipe(tmp_path, node_resources="resources: {processes_per_node: 2}")
    assert load_plan(recipe, profile).node("sft").config.resources.num_processes == 2


def test_a_training_topology_on_a_stage_that_does_not_train_is_refused(tmp_path):
    recipe, profile = _recipe(tmp_path, profile_resources="resources:\n  eval: {nodes: 2}\n")
    with pytest.raises(ConfigError, match="node 'eval_sft' resources: nodes and processes_per_node apply to training"):
        load_plan(recipe, profile)


def test_a_bad_resource_names_the_node_and_field(tmp_path):
    recipe, profile = _recipe(tmp_path, node_resources="resources: {cpu: 2}")
    with pytest.raises(ConfigError, match=r"node 'sft' resources\.cpu: unknown key \(did you mean cpus\?\)"):
        load_plan(recipe, profile)
    recipe, profile = _recipe(tmp_path, node_resources="resources: {gpus: -1}")
    with pytest.raises(ConfigError, match=r"node 'sft' resources\.gpus"):
        load_plan(recipe, profile)


def test_every_shipped_profile_and_recipe_resolves_resources():
    from flows.plan.recipes import PROFILE_DIR, RECIPE_DIR, available

    for profile in available(PROFILE_DIR):
        for recipe in available(RECIPE_DIR):
            plan = load_plan(recipe, profile, run_checks=False)
            assert all(isinstance(n.resources, NodeResources) for n in plan.nodes)
    gpu = load_plan("r1", "gpu", run_checks=False)
    assert gpu.node("sft").resources.gpus == 1 and gpu.node("prompts").resources.gpus == 0


class _Cfg:
    def __init__(self, nodes=1, num_processes=1):
        self.resources = type("R", (), {"nodes": nodes, "num_processes": num_processes})()


def test_ray_options_reserve_per_process_and_nothing_for_a_multi_machine_stage():
    on = Execution(cluster="127.0.0.1:6379")
    res = NodeResources(cpus=2, gpus=1, memory_gb=1.5, labels={"a100": 1})
    assert placement.ray_options(res, _Cfg(), on) == {
        "num_cpus": 2, "num_gpus": 1, "max_retries": placement.NODE_RETRIES, "memory": int(1.5 * 2**30),
        "resources": {"a100": 1}}
    two = placement.ray_options(res, _Cfg(num_processes=2), on)
    assert (two["num_cpus"], two["num_gpus"], two["memory"]) == (4, 2, 3 * 2**30)
    spread = placement.ray_options(res, _Cfg(nodes=2, num_processes=2), on)  # its ranks reserve, in a placement group
    assert (spread["num_cpus"], spread["num_gpus"], "memory" in spread) == (0, 0, False)
    assert placement.ray_options(res, object(), on)["num_cpus"] == 2  # a stage without resources: one process
    assert placement.ray_options(res, _Cfg(), Execution(parallel=2)) == {}


def test_what_a_node_needs_of_the_clusters_machines():
    """placement_demand: the task's reservation by Ray's names on one machine; a multi-machine stage's ranks need
    num_processes CPUs on each of `nodes` machines (its task itself reserves nothing)."""
    on = Execution(cluster="h:1")
    res = NodeResources(cpus=2, gpus=0, memory_gb=1.5, labels={"a100": 1})
    assert placement.placement_demand(res, _Cfg(), on) == ({"CPU": 2.0, "memory": 1.5 * 2**30, "a100": 1.0}, 1)
    assert placement.placement_demand(NodeResources(cpus=0), object(), on) == ({}, 1)
    assert placement.placement_demand(res, _Cfg(nodes=3, num_processes=2), on) == ({"CPU": 2.0}, 3)


def test_a_demand_no_alive_node_holds_is_named_with_what_no_node_offers():
    """unplaceable: a demand fits when enough alive nodes each have all of it (a dead node counts for nothing);
    the message names the node, what no machine offers at all, and what the alive machines offer."""
    nodes = [{"NodeID": "aaaaaaaa11", "Alive": True, "Resources": {"CPU": 1.0, "head": 1.0, "node:127.0.0.1": 1.0}},
             {"NodeID": "bbbbbbbb22", "Alive": True, "Resources": {"CPU": 1.0, "trainer": 1.0}},
             {"NodeID": "cccccccc33", "Alive": False, "Resources": {"CPU": 8.0, "a100": 1.0}}]
    demands = {"sft": ({"CPU": 1.0, "a100": 1.0}, 1), "prompts": ({"CPU": 1.0}, 1), "eval": ({}, 1),
               "dpo": ({"CPU": 1.0, "trainer": 1.0}, 1), "big": ({"CPU": 2.0}, 1), "wide": ({"CPU": 1.0}, 3),
               "pair": ({"CPU": 1.0}, 2)}
    missing = placement.unplaceable(demands, nodes)
    assert list(missing) == ["sft", "big", "wide"]
    line = placement.unplaceable_message(missing, nodes, "10.0.0.1:6379", 60.2)
    assert "\n" not in line
    assert line.startswith("node 'sft' needs CPU=1, a100=1 on one Ray node (no node offers a100); "
                           "node 'big' needs CPU=2 on one Ray node (0 node(s) have that much); "
                           "node 'wide' needs CPU=1 on each of 3 Ray nodes (it trains across machines) (2 node(s) "
                           "have that much); still so after 60 s on the cluster at 10.0.0.1:6379 (its alive nodes: "
                           "aaaaaaaa: CPU=1, head=1; bbbbbbbb: CPU=1, trainer=1)"), line


def test_the_driver_waits_for_a_machine_that_fits_then_names_what_none_offers():
    """wait_until_placeable polls the cluster's nodes: a machine that joins within the wait (an autoscaler's) ends
    it; none within the wait is one ConfigError."""
    import logging

    small = {"NodeID": "a" * 8, "Alive": True, "Resources": {"CPU": 1.0}}
    big = {"NodeID": "b" * 8, "Alive": True, "Resources": {"CPU": 1.0, "a100": 1.0}}

    class Cluster:
        def __init__(self, views):
            self.views = views

        def nodes(self):
            return self.views.pop(0) if len(self.views) > 1 else self.views[0]

    log = logging.getLogger("test")
    placement.wait_until_placeable(Cluster([[small], [small], [small, big]]), {"sft": ({"a100": 1.0}, 1)}, "h:1", log,
                                   wait_s=5, poll_s=0.01)
    with pytest.raises(ConfigError, match=r"^node 'sft' needs a100=1 on one Ray node \(no node offers a100\); "
                                          r"still so after 0 s"):
        placement.wait_until_placeable(Cluster([[small]]), {"sft": ({"a100": 1.0}, 1)}, "h:1", log, wait_s=0.05,
                                       poll_s=0.01)


def test_execution_modes():
    assert not Execution().concurrent and Execution(parallel=2).concurrent and Execution(cluster="h:1").concurrent
    with pytest.raises(ConfigError, match="--parallel 0"):
        Execution(parallel=0)
    assert "Ray cluster at h:1" in Execution(cluster="h:1").describe()


def test_cluster_address_from_the_flag_or_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert placement.cluster_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert placement.cluster_address(None) == "10.0.0.1:6379"
    assert placement.cluster_address("h:2") == "h:2"


def test_the_driver_refuses_a_cluster_run_it_cannot_serve(monkeypatch):
    head = socket.create_server(("127.0.0.1", 0))  # something that answers where the cluster's head should
    on = Execution(cluster=f"127.0.0.1:{head.getsockname()[1]}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(ConfigError, match="needs a Prefect server that every cluster node can reach"):
        placement.check_driver(on, "/shared/home", "sqlite:////shared/home/mlflow.db")
    monkeypatch.setenv("PREFECT_API_URL", "http://10.0.0.1:4200/api")
    with pytest.raises(ConfigError, match="relative path"):
        placement.check_driver(on, "home", "http://10.0.0.1:5000")
    with pytest.raises(ConfigError, match="not an absolute path"):
        placement.check_driver(on, "/shared/home", "sqlite:///mlflow.db")
    placement.check_driver(on, "s3://bucket/r1flow", "http://10.0.0.1:5000")
    head.close()  # nothing answers there now: one line at once, not Ray's connection retries
    with pytest.raises(ConfigError, match=f"no Ray cluster answers at {on.cluster} \\(connection refused\\)"):
        placement.check_driver(on, "s3://bucket/r1flow", "http://10.0.0.1:5000")
    monkeypatch.delenv("PREFECT_API_URL")
    placement.check_driver(Execution(parallel=2), "home", "sqlite:///x.db")  # one machine: nothing to check


def test_a_ray_address_names_the_port_its_first_connection_goes_to():
    assert placement.head_endpoint("10.0.0.5:6380") == ("10.0.0.5", 6380)
    assert placement.head_endpoint("head") == ("head", 6379)  # Ray's default GCS port
    assert placement.head_endpoint("ray://head") == ("head", 10001)  # Ray Client's
    assert placement.head_endpoint("ray://[::1]:10002") == ("::1", 10002)
    assert placement.head_endpoint("auto") is None  # Ray finds it on this machine
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        placement.head_endpoint("head:port")


def test_workers_get_the_runs_settings_and_the_cluster_marker(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://10.0.0.1:4200/api")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    env = placement.worker_env({"home": "/shared/h", "store": "s3://b/p", "tracking_uri": "http://10.0.0.1:5000"})
    assert env["R1FLOW_HOME"] == "/shared/h" and env["R1FLOW_STORE"] == "s3://b/p"
    assert env["MLFLOW_TRACKING_URI"] == "http://10.0.0.1:5000" and env["PREFECT_API_URL"].endswith(":4200/api")
    assert env[placement.CLUSTER_VAR] == "1" and env["AWS_SECRET_ACCESS_KEY"] == "s" and "AWS_SESSION_TOKEN" not in env


def test_workers_start_with_the_drivers_mkl_mode(monkeypatch):
    """MKL reads MKL_CBWR at a process's first product, so a worker must start with it (a node's own environment
    may have none): the driver's mode, else the default."""
    settings = {"home": "/shared/h", "store": "/shared/h", "tracking_uri": "http://10.0.0.1:5000"}
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert placement.worker_env(settings)["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert placement.worker_env(settings)["MKL_CBWR"] == "COMPATIBLE"


def test_a_run_outside_a_cluster_records_its_host_only(monkeypatch):
    monkeypatch.delenv(placement.CLUSTER_VAR, raising=False)
    here = placement.where()
    assert here["host"] and here["ray_node_id"] == ""


def test_one_machine_configs_keep_the_keys_they_had_before_multi_machine_training():
    """`resources.nodes` enters a config (and its cache key) only when it is not 1: every key computed before the
    field existed still finds its cached outputs."""
    from schemas.configs import ResourcesSpec

    assert ResourcesSpec().model_dump() == {"num_processes": 1, "distributed_type": "ddp", "backend": "auto"}
    assert ResourcesSpec(nodes=2).model_dump()["nodes"] == 2
    assert ResourcesSpec.model_validate(ResourcesSpec(nodes=3, processes_per_node=2).model_dump()).world_size == 6


def test_a_cluster_node_that_cannot_reach_a_server_fails_before_any_compute(tmp_path, monkeypatch):
    """What a stage task on a cluster node does first (flows.run.pipeline.execute_stage): one line naming the node and
    the server it could not reach; no lock, lease, MLflow run or artifact was made."""
    import socket

    from flows.run.pipeline import execute_stage

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv(placement.CLUSTER_VAR, "1")
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed}/api")
    home = tmp_path / "home"
    home.mkdir()
    settings = {"home": str(home), "store": str(home), "tracking_uri": f"sqlite:///{home}/mlflow.db"}
    with pytest.raises(ConfigError) as e:
        execute_stage(node="prompts", stage="prompts", config={}, inputs={}, seed=0, key="k" * 64,
                      parent_run_id=None, settings=settings, experiment="r1flow/x")
    message = str(e.value)
    assert "\n" not in message and f"node {socket.gethostname()}" in message
    assert f"cannot reach the Prefect API http://127.0.0.1:{closed}/api" in message
    assert sorted(p.name for p in home.iterdir()) == []  # before anything: nothing written


def test_parallel_stage_processes_share_the_cores_between_them(monkeypatch):
    """--parallel N: each stage process gets an equal share of the cores (torch's default, one thread per core in
    every process, makes them spin-wait on each other's cores), at least one; R1FLOW_THREADS overrides it."""
    share = placement.thread_share
    assert [share(n, 2) for n in (1, 2, 3)] == [2, 1, 1]
    assert [share(n, 16) for n in (2, 3, 4, 5)] == [8, 5, 4, 3]
    assert share(4, 16, "6") == 6
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="R1FLOW_THREADS"):
            share(2, 16, bad)
    monkeypatch.setenv("R1FLOW_THREADS", "zero")
    with pytest.raises(ConfigError, match="R1FLOW_THREADS='zero'"):
        Execution(parallel=2)  # before any compute
    with pytest.raises(ConfigError, match="R1FLOW_THREADS='zero'"):
        Execution(parallel=1)
    monkeypatch.delenv("R1FLOW_THREADS")
    assert Execution(parallel=1).parallel == 1


def test_a_parallel_worker_runs_torch_and_its_children_with_its_share():
    code = ("import os, torch; from flows.run.placement import use_threads; use_threads(3); "
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], os.environ['R1FLOW_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")})
    assert out.stdout.split() == ["3", "3", "3"]


def test_openmp_threads_sleep_on_a_busy_machine_unless_the_user_chose_a_policy(tmp_path):
    """Every r1flow command chooses the OpenMP wait policy before torch loads libgomp (stages/runtime/threads.py):
    PASSIVE when the load average is at least the cores (spinning idle threads slowed concurrent processes ~9x
    here), libgomp's default on an idle machine (PASSIVE made a small model's decoding alone about a third
    slower), and a policy the user set is kept whatever the load."""
    from stages.runtime.threads import choose_wait_policy

    env: dict[str, str] = {}
    assert choose_wait_policy(env, load=2.0, cores=2) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {}
    assert choose_wait_policy(env, load=1.9, cores=2) == "default" and env == {}
    assert choose_wait_policy(env, load=0.1, cores=16) == "default" and env == {}
    assert choose_wait_policy({"OMP_WAIT_POLICY": "ACTIVE"}, load=9.0, cores=2) == "ACTIVE"
    code = ("import os, sys; from flows.cli.app import main; main(['artifacts']); "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.getloadavg()[0], len(os.sched_getaffinity(0)))")
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"R1FLOW_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**base, "OMP_WAIT_POLICY": "active"})
    assert out.stdout.split()[-3] == "active", out.stdout[-500:]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=base)
    policy, load, cores = out.stdout.split()[-3:]
    assert policy in ("None", "PASSIVE"), out.stdout[-500:]
    if abs(float(load) - int(cores)) > 1:  # far from the threshold: the load cannot have crossed it meanwhile
        assert policy == ("PASSIVE" if float(load) >= int(cores) else "None"), out.stdout[-500:]


def test_a_stage_takes_its_share_of_the_cores_among_the_stage_processes_running_on_the_host(tmp_path, monkeypatch,
                                                                                            caplog):
    """stages.runtime.threads.stage_share: alone, a stage gets every core (as before); beside another live stage
    process, half; entries of dead processes, and of a pid reused by a new process (another start time), are not
    counted and are removed; R1FLOW_THREADS wins; the choice is logged and the entry removed afterwards."""
    import logging

    import torch

    from stages.runtime import threads

    monkeypatch.delenv("R1FLOW_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    registry = tmp_path / "stages"
    log = logging.getLogger("r1flow.test")
    before = torch.get_num_threads()
    with threads.stage_share(log, registry) as n:
        assert n == 4 and torch.get_num_threads() == 4 and (registry / f"{os.getpid()}.pid").exists()
    assert list(registry.iterdir()) == [] and torch.get_num_threads() == before

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (registry / f"{other.pid}.pid").write_text(threads._start_time(other.pid))
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        (registry / f"{int(dead.stdout)}.pid").write_text("123")  # exited: not counted, removed
        (registry / "1.pid").write_text("not-the-start-time-of-pid-1")  # pid reused by another process
        with caplog.at_level(logging.INFO, logger="r1flow.test"), threads.stage_share(log, registry) as n:
            assert n == 2 and torch.get_num_threads() == 2
            assert threads.running_stage_processes(registry) == 2
        assert "threads: 2 (2 r1flow stage process(es) on 4 cores" in caplog.text
        assert sorted(p.name for p in registry.iterdir()) == [f"{other.pid}.pid"]
        monkeypatch.setenv("R1FLOW_THREADS", "3")
        with threads.stage_share(log, registry) as n:
            assert n == 3
    finally:
        other.kill()
        other.wait()
    assert threads.running_stage_processes(registry) == 0 and list(registry.iterdir()) == []


def test_a_running_stage_gives_up_and_takes_back_its_share_as_other_runs_start_and_end(tmp_path, monkeypatch):
    """stages.runtime.threads.rebalance, called between generation batches and training steps: a stage that started
    alone (4 threads of 4 cores) drops to 2 once another stage process registers, at most once a second, and goes
    back to 4 when that one ends; nothing outside a stage or with R1FLOW_THREADS set."""
    import torch

    from stages.runtime import threads

    monkeypatch.delenv("R1FLOW_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    monkeypatch.setattr(threads, "busy_sample", lambda now: None)  # the registry alone (the load: the next test)
    registry = tmp_path / "stages"
    assert threads.rebalance() is None
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with threads.stage_share(None, registry) as n:
            assert n == 4
            t0 = threads._running["checked"]
            (registry / f"{other.pid}.pid").write_text(threads._start_time(other.pid))
            assert threads.rebalance(now=t0 + 0.5) == 4  # not yet: at most once a second
            assert threads.rebalance(now=t0 + 1.5) == 2 and torch.get_num_threads() == 2
            other.kill()
            other.wait()
            assert threads.rebalance(now=t0 + 3.0) == 4 and torch.get_num_threads() == 4
            monkeypatch.setenv("R1FLOW_THREADS", "3")
            assert threads.rebalance(now=t0 + 5.0) is None
        assert threads.rebalance() is None and threads._running == {}
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_other_work_on_the_machine_takes_cores_from_a_running_stage(tmp_path, monkeypatch):
    """rebalance leaves free the cores other processes kept busy since its last check (/proc/stat's busy time less
    this process's own): hand-computed samples (wall, machine busy s, own CPU s) on 4 cores: 2.2 cores of other
    work -> 2 threads, 0.4 -> all 4, 3.9 -> still 1. And the pure parts: cores busy, cores free."""
    import torch

    from stages.runtime import threads

    assert threads.other_busy_cores((0.0, 100.0, 10.0), (2.0, 103.0, 11.0)) == 1.0  # (3 - 1) / 2
    assert threads.other_busy_cores((0.0, 100.0, 10.0), (2.0, 101.0, 11.5)) == 0.0  # never below 0
    assert threads.other_busy_cores((5.0, 1.0, 1.0), (5.0, 9.0, 1.0)) == 0.0  # no time passed
    assert [threads.free_cores(2, x) for x in (0.0, 0.4, 0.6, 1.0, 3.0)] == [2, 2, 1, 1, 1]
    assert threads.free_cores(4, 2.6) == 1 and threads.free_cores(4, 2.2) == 2
    busy = threads.machine_busy_seconds()
    assert busy is not None and busy > 0

    monkeypatch.delenv("R1FLOW_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    samples = iter([(0.0, 50.0, 5.0),  # the stage starts
                    (2.0, 55.4, 6.0),  # 5.4 busy, 1.0 own: 4.4 / 2 = 2.2 cores of other work
                    (4.0, 59.2, 9.0),  # 3.8 - 3.0 = 0.8 / 2 = 0.4
                    (6.0, 68.0, 9.2)])  # 8.8 - 0.2 = 8.6 / 2 = 4.3: more than the machine, one thread left
    monkeypatch.setattr(threads, "busy_sample", lambda now: next(samples))
    with threads.stage_share(None, tmp_path / "stages") as n:
        assert n == 4
        t0 = threads._running["checked"]
        assert threads.rebalance(now=t0 + 2.0) == 2 and torch.get_num_threads() == 2
        assert threads.rebalance(now=t0 + 4.0) == 4 and torch.get_num_threads() == 4
        assert threads.rebalance(now=t0 + 6.0) == 1 and torch.get_num_threads() == 1


# A weight's gradient: a small output summed over a long inner dimension (every token of a batch), which MKL splits
# among its threads; prints the product's sha256 on 1 thread and on 2.
PRODUCT_ON_1_AND_2_THREADS = """
import hashlib, os, torch
from stages.runtime.threads import reproducible_products
reproducible_products()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(65536, 64, generator=g), torch.randn(65536, 128, generator=g)
for n in (1, 2):
    torch.set_num_threads(n)
    print(os.environ.get("MKL_CBWR"), hashlib.sha256((x.t() @ y).numpy().tobytes()).hexdigest())
"""


def test_a_stages_matrix_products_do_not_depend_on_its_thread_count():
    """stages.runtime.threads.reproducible_products: a user's MKL_CBWR is kept; else MKL's strict reproducible mode,
    with which the product a training step computes for a weight's gradient has the same bits on 1 and 2 threads
    (the thread count follows the machine's load; without the mode, MKL rounds such a product differently on 2
    threads on the machines this was written on, and the tiny r1 run gave other fingerprints under --parallel 2)."""
    from stages.runtime.threads import reproducible_products

    env: dict[str, str] = {}
    assert reproducible_products(env) == "AUTO,STRICT" and env == {"MKL_CBWR": "AUTO,STRICT"}
    assert reproducible_products({"MKL_CBWR": "COMPATIBLE"}) == "COMPATIBLE"
    base = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", PRODUCT_ON_1_AND_2_THREADS], capture_output=True, text=True,
                         check=True, env=base).stdout.split()
    assert out[0] == out[2] == "AUTO,STRICT" and out[1] == out[3], out
