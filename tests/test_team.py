"""Running it like a team, against real servers: `r1flow up`-style Prefect and MLflow servers on
127.0.0.1 (the session's `live_servers`), deployments served by `r1flow serve` and triggered the
way the UI triggers them (`run_deployment` with parameters), a cron schedule, a single-stage re-run
through its deployment, and two pipelines started at the same moment on one R1FLOW_HOME."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.servers import servers
from flows.servers.settings import PREFECT_HOME_FILES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
R1FLOW = [sys.executable, "-m", "flows.cli"]


def _env(info, home: Path) -> dict[str, str]:
    env = {**os.environ, **servers.env_for(info), "R1FLOW_HOME": str(home)}
    env.pop("PREFECT_HOME", None)  # the CLI puts it under R1FLOW_HOME
    return env


@pytest.fixture(scope="module")
def team(live_servers, tmp_path_factory):
    """The servers plus a `r1flow serve` runner for the eval recipe and the eval stage."""
    home = tmp_path_factory.mktemp("team-home")
    env = _env(live_servers, home)
    log = open(home / "serve.log", "w")
    runner = subprocess.Popen([*R1FLOW, "serve", "--recipe", "eval", "--stage", "eval", "--profile", "tiny"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: live_servers.prefect_api_url}):
        from prefect.client.orchestration import get_client

        deadline = time.time() + 180
        with get_client(sync_client=True) as client:
            while True:
                try:
                    client.read_deployment_by_name("r1flow-pipeline/eval-served")
                    client.read_deployment_by_name("r1flow-eval/eval-served")
                    break
                except Exception:
                    if runner.poll() is not None or time.time() > deadline:
                        raise AssertionError("r1flow serve did not register its deployments:\n"
                                             + (home / "serve.log").read_text()[-3000:]) from None
                    time.sleep(1)
        yield {"info": live_servers, "home": home, "env": env}
    os.killpg(runner.pid, signal.SIGTERM)
    try:
        runner.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)
    log.close()


def _run_deployment(info, name: str, parameters: dict) -> tuple[object, object]:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: info.prefect_api_url}):
        run = run_deployment(name, parameters=parameters, timeout=900, poll_interval=2)
        return run, run.state


def test_recipe_deployment_triggered_through_the_api(team):
    from mlflow.tracking import MlflowClient

    info = team["info"]
    run, state = _run_deployment(info, "r1flow-pipeline/eval-served", {"recipe": "eval", "profile": "tiny"})
    assert state.is_completed(), f"{state.name}: {state.message}\n" + (team["home"] / "serve.log").read_text()[-3000:]
    client = MlflowClient(info.mlflow_tracking_uri)
    exp = client.get_experiment_by_name("r1flow/eval")
    parents = client.search_runs([exp.experiment_id], f"tags.`r1flow.flow_run_id` = '{run.id}' and "
                                 "tags.`r1flow.recipe` = 'eval'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and "eval_base/accuracy" in parent.data.metrics
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {c.data.tags["r1flow.node"] for c in children} == {"base", "prompts", "eval_base"}
    assert all("stage_seconds" in c.data.metrics or c.data.tags["r1flow.cache_hit"] == "true" for c in children)
    report = [a.path for a in client.list_artifacts(parent.info.run_id, "report")]
    assert "report/report.md" in report
    version = client.get_model_version_by_alias("r1flow-eval", "final")
    base_fp = next(c for c in children if c.data.tags["r1flow.node"] == "base").data.tags["r1flow.output.model"]
    assert version.tags["r1flow.fingerprint"] == base_fp
    team["eval_children"] = {c.data.tags["r1flow.node"]: c for c in children}


def test_single_stage_rerun_through_its_deployment_joins_the_lineage(team):
    from mlflow.tracking import MlflowClient

    from flows.store.artifacts import ArtifactStore

    if "eval_children" not in team:
        pytest.skip("needs the recipe run of the previous test")  # ordering only; that test fails on its own
    children = team["eval_children"]
    model_fp = children["base"].data.tags["r1flow.output.model"]
    prompts_fp = children["prompts"].data.tags["r1flow.output.prompts"]
    run, state = _run_deployment(team["info"], "r1flow-eval/eval-served", {
        "inputs": {"model": model_fp, "prompts": prompts_fp[:16]},
        "config": {"max_prompts": 5}, "recipe": "eval", "profile": "tiny"})
    assert state.is_completed(), f"{state.name}: {state.message}"
    client = MlflowClient(team["info"].mlflow_tracking_uri)
    exp = client.get_experiment_by_name("r1flow/eval")
    stage_runs = client.search_runs([exp.experiment_id], f"tags.`r1flow.flow_run_id` = '{run.id}' and "
                                    "tags.`r1flow.node` = 'eval_base'")
    assert len(stage_runs) == 1, [(r.data.tags.get("r1flow.node"), r.data.tags.get("r1flow.flow_run_id"), r.data.tags.get("r1flow.cache_hit"), r.data.tags.get("mlflow.parentRunId"), r.info.run_id)
                                  for r in client.search_runs([exp.experiment_id], "")][:8] + [str(run.id)]
    tags = stage_runs[0].data.tags
    assert tags["r1flow.input.model"] == model_fp and tags["r1flow.input.prompts"] == prompts_fp
    assert stage_runs[0].data.metrics["prompts"] == 5
    store = ArtifactStore(str(team["home"]), home=str(team["home"]))
    manifest = store.verify(tags["r1flow.output.results"])
    assert manifest.parents == sorted([model_fp, prompts_fp])
    assert manifest.producer.mlflow_run_id == stage_runs[0].info.run_id
    assert tags["r1flow.output.results"] != children["eval_base"].data.tags["r1flow.output.results"]  # new config

    # as the UI's form submits it: every field as shown (the recipe's eval_base config on the tiny profile), one
    # changed; what runs is the shown config with that change
    with _prefect_client(team["info"]) as prefect:
        shown = prefect.read_deployment_by_name("r1flow-eval/eval-served").parameters
    assert shown["recipe"] == "eval" and shown["profile"] == "tiny"
    from flows.run.deploy import stage_config

    expected, _, _ = stage_config("eval", "eval", "tiny", None, {"max_prompts": 6})
    assert shown["config"] == {**expected, "max_prompts": shown["config"]["max_prompts"]}
    run, state = _run_deployment(team["info"], "r1flow-eval/eval-served", {
        **shown, "inputs": {"model": model_fp, "prompts": prompts_fp}, "config": {**shown["config"], "max_prompts": 6}})
    assert state.is_completed(), f"{state.name}: {state.message}"
    form_run = client.search_runs([exp.experiment_id], f"tags.`r1flow.flow_run_id` = '{run.id}' and "
                                  "tags.`r1flow.node` = 'eval_base'")
    assert len(form_run) == 1 and form_run[0].data.metrics["prompts"] == 6
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with _prefect_client(team["info"]) as prefect:  # the flow run's artifact says what the submission changed
        (artifact,) = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]), key=ArtifactFilterKey(any_=["stage-eval-base"])))
    assert "Fields changed: `max_prompts=6`" in artifact.data, artifact.data
    from flows.track.tracking import flatten

    logged = {k: v for k, v in form_run[0].data.params.items() if k.startswith("config.")}
    assert logged and logged == {k: str(v) for k, v in flatten({"config": expected}).items()}


def test_serve_prints_commands_that_start_its_deployments_without_exports(team):
    """`r1flow serve` prints how to start each served deployment from a shell; in a shell with nothing exported
    (docs/operations/servers.md's promise for `r1flow up` servers), the printed command creates the flow run on the
    served server. Prefect's own hint (`prefect deployment run ...`) went to a temporary server there and failed."""
    import shlex

    log = (team["home"] / "serve.log").read_text()
    commands = [line.strip() for line in log.splitlines() if "deployment run" in line]
    recipe = [c for c in commands if "r1flow-pipeline/eval-served" in c]
    assert len(recipe) == 1 and any("r1flow-eval/eval-served" in c and "--param inputs=" in c for c in commands), log
    env = _bare_env(team["home"])
    # (scheduled a day ahead: proves the command reaches the server and finds the deployment, runs nothing)
    out = subprocess.run(["bash", "-c", recipe[0] + " --start-in " + shlex.quote("1 day")], cwd="/", env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    created = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert created, out.stdout
    with _prefect_client(team["info"]) as client:
        flow_run = client.read_flow_run(created.group(1))
        assert flow_run.state.is_scheduled()
        client.delete_flow_run(flow_run.id)


def test_cron_deployment_lists_scheduled_runs(team, tmp_path):
    info = team["info"]
    out = subprocess.run([*R1FLOW, "deploy", "--recipe", "sft-eval", "--profile", "tiny", "--cron", "0 2 * * *",
                          "--pool", "test-pool", "--tag", "nightly"], cwd=ROOT, env=_env(info, tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "r1flow-pipeline/sft-eval -> work pool test-pool (cron 0 2 * * *)" in out.stdout
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: info.prefect_api_url}), get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("r1flow-pipeline/sft-eval")
        assert dep.work_pool_name == "test-pool" and "nightly" in dep.tags
        assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * *"]
        deadline, scheduled = time.time() + 120, []
        while not scheduled and time.time() < deadline:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                                         flow_run_filter=FlowRunFilter())
            scheduled = [r for r in runs if r.state and r.state.is_scheduled()]
            time.sleep(2)
    assert scheduled, "the server listed no scheduled runs for the cron deployment"
    assert all(r.expected_start_time.hour == 2 and r.expected_start_time.minute == 0 for r in scheduled)


def test_two_runs_started_together_share_stages_safely(live_servers, tmp_path):
    """`eval` and `sft-eval` share base, prompts and eval_base. Started at the same moment on one
    home, each shared stage runs once (the other run waits on its lock, then reuses the result),
    both runs succeed, and every artifact verifies against its fingerprint."""
    from mlflow.tracking import MlflowClient

    from flows.store.artifacts import ArtifactStore

    env = _env(live_servers, tmp_path)
    procs = {recipe: subprocess.Popen([*R1FLOW, "run", "--recipe", recipe, "--profile", "tiny", "--json",
                                       str(tmp_path / f"{recipe}.json")], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for recipe in ("eval", "sft-eval")}
    logs = {r: p.communicate(timeout=900)[0] for r, p in procs.items()}
    for recipe, p in procs.items():
        assert p.returncode == 0, logs[recipe][-4000:]
    results = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in procs}
    outputs = {r: {s["node"]: s["outputs"] for s in res["stages"]} for r, res in results.items()}
    for node in ("base", "prompts", "eval_base"):
        assert outputs["eval"][node] == outputs["sft-eval"][node], node
    store = ArtifactStore(str(tmp_path), home=str(tmp_path))
    fps = {fp for r in outputs.values() for outs in r.values() for fp in outs.values()}
    for fp in fps:
        store.verify(fp)
    client = MlflowClient(live_servers.mlflow_tracking_uri)
    parents = [res["parent_run_id"] for res in results.values()]
    exps = [res["experiment_id"] for res in results.values()]
    for node in ("base", "prompts", "eval_base"):
        executed = client.search_runs(exps, f"tags.`r1flow.node` = '{node}' and tags.`r1flow.cache_hit` = 'false'")
        executed = [r for r in executed if r.data.tags.get("mlflow.parentRunId") in parents]
        assert len(executed) == 1, (node, len(executed))


# ---------------------------------------------------------------------------- no exports: `r1flow up`'s servers


def _bare_env(home: Path) -> dict[str, str]:
    """A shell where the user exported nothing but R1FLOW_HOME (docs/operations/servers.md's promise)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "R1FLOW_STORE", *PREFECT_HOME_FILES)}
    return {**env, "R1FLOW_HOME": str(home)}


def _r1flow(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*R1FLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _prefect_client(info):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: info.prefect_api_url}), get_client(sync_client=True) as client:
        yield client


def _wait_for(what: str, probe, timeout: float, proc=None, log: Path | None = None):
    deadline = time.time() + timeout
    while True:
        try:
            got = probe()
            if got:
                return got
        except Exception:
            pass
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"{what}: not seen in {timeout:.0f} s" + (f"\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(1)


def test_every_command_uses_the_up_servers_without_exports(live_servers, session_dir, tmp_path):
    """`r1flow up`'s servers for a home, and a shell with nothing exported: run, stage, deploy and serve reach
    those servers (seen through their APIs), status shows them, artifacts and models list what the run made."""
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    info, home = live_servers, session_dir / "servers-home"  # the home `servers.start` recorded them for
    env = _bare_env(home)
    mlflow = MlflowClient(info.mlflow_tracking_uri)

    out = _r1flow(["status"], env)
    # status exits 1 for a scheduled deployment no worker polls: another test of this module's servers may leave one
    late = "its runs will go Late" in out.stdout
    assert out.returncode == (1 if late else 0), out.stdout + out.stderr
    assert info.prefect.url in out.stdout and info.mlflow.url in out.stdout

    out = _r1flow(["run", "--recipe", "eval", "--profile", "tiny", "--json", str(tmp_path / "run.json")], env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"Prefect {info.prefect_api_url}" in out.stdout and "r1flow up servers" in out.stdout
    assert "View run" not in out.stdout and "View experiment" not in out.stdout  # MLflow's links open its GenAI view
    run = json.loads((tmp_path / "run.json").read_text())
    with _prefect_client(info) as client:
        flow_run = client.read_flow_run(run["flow_run_id"])
        assert flow_run.state.is_completed()
        # which process runs it is bookkeeping (labels), not tags the flow run's header shows
        assert not [t for t in flow_run.tags if t.startswith("r1flow.")], flow_run.tags
        assert flow_run.labels["r1flow.host"] and flow_run.labels["r1flow.process"]
    parent = mlflow.get_run(run["parent_run_id"])  # on the server, not in a sqlite file under the home
    # the runs table shows ~18 characters of a name: the time, then the profile and the id that tell runs apart
    assert parent.data.tags["r1flow.recipe"] == "eval" and re.fullmatch(r"\d\d-\d\d \d\d:\d\d tiny [0-9a-f]{6} eval",
                                                                        parent.info.run_name)
    exp = mlflow.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3 opens the runs table
    # the MLflow link status (and up) print opens the experiment's runs table, not the list whose clicks go to GenAI
    out = _r1flow(["status"], env)
    assert f"r1flow/eval: {info.mlflow.url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" \
        in out.stdout, out.stdout
    assert "#/experiments?" not in out.stdout, out.stdout
    assert not (home / "mlflow.db").exists()
    outputs = {s["node"]: s["outputs"] for s in run["stages"]}

    out = _r1flow(["stage", "eval", "--profile", "tiny", "--input", f"model={outputs['base']['model'][:12]}",
                   "--input", "prompts=latest:prompts", "--set", "max_prompts=3", "--json", str(tmp_path / "st.json")],
                  env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "View run" not in out.stdout and "View experiment" not in out.stdout
    stage = json.loads((tmp_path / "st.json").read_text())
    stage_parent = mlflow.get_run(stage["parent_run_id"])
    assert stage_parent.data.tags["r1flow.output.results"] == stage["outputs"]["results"]
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d eval \(stage\) [0-9a-f]{6}", stage_parent.info.run_name)
    with _prefect_client(info) as client:
        assert client.read_flow_run(stage["flow_run_id"]).state.is_completed()
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[stage["flow_run_id"]])))
    keyed = [a for a in arts if a.key]  # (Prefect adds unkeyed ones of its own, e.g. for persisted results)
    assert [a.key for a in keyed] == ["stage-eval"] and keyed[0].type == "markdown", [(a.key, a.type) for a in arts]
    assert stage["outputs"]["results"] in keyed[0].data and info.mlflow.url in keyed[0].data
    assert "Fields changed: `max_prompts=3`" in keyed[0].data  # what the --set changed

    out = _r1flow(["deploy", "--recipe", "rejection-rounds", "--profile", "tiny", "--cron", "0 3 * * *", "--pool", "up-pool"],
                  env)
    assert out.returncode == 0, out.stderr[-3000:]
    with _prefect_client(info) as client:
        dep = client.read_deployment_by_name("r1flow-pipeline/rejection-rounds")
        assert dep.work_pool_name == "up-pool" and [s.schedule.cron for s in dep.schedules] == ["0 3 * * *"]
        assert client.read_work_pool("up-pool").type == "process"

    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        runner = subprocess.Popen([*R1FLOW, "serve", "--recipe", "rejection-rounds", "--stage", "sft", "--profile", "tiny"],
                                  cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with _prefect_client(info) as client:
            _wait_for("r1flow serve's deployments", lambda: client.read_deployment_by_name("r1flow-sft/sft-served"),
                      180, runner, log)
            served = client.read_deployment_by_name("r1flow-pipeline/rejection-rounds-served")
            assert served.work_pool_name is None
            assert client.read_deployment_by_name("r1flow-pipeline/rejection-rounds").work_pool_name == "up-pool"  # kept
        assert any(r["pid"] == runner.pid for r in servers.status(home).runners)  # `r1flow down` would stop it
        t0 = time.time()
        runner.send_signal(signal.SIGTERM)
        runner.wait(30)
        assert time.time() - t0 < 10, f"r1flow serve took {time.time() - t0:.1f} s to stop on SIGTERM"
        assert not any(r["pid"] == runner.pid for r in servers.status(home).runners)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)

    out = _r1flow(["deploy", "--recipe", "rejection-rounds", "--profile", "tiny", "--pool", "other-pool"], env)
    assert out.returncode == 2 and "--replace" in out.stderr and "up-pool" in out.stderr
    out = _r1flow(["artifacts"], env)
    assert out.returncode == 0 and outputs["eval_base"]["results"][:12] in out.stdout
    out = _r1flow(["models"], env)
    assert out.returncode == 0 and outputs["base"]["model"][:12] in out.stdout


def test_registering_without_a_server_fails_before_anything_is_registered(tmp_path):
    env = _bare_env(tmp_path)  # no `r1flow up` for this home, nothing exported
    for args in (["deploy", "--recipe", "eval"], ["serve", "--recipe", "eval"], ["worker", "--pool", "p"]):
        out = _r1flow([*args, "--profile", "tiny"] if args[0] != "worker" else args, env, timeout=120)
        assert out.returncode == 2, (args, out.stderr[-2000:])
        assert "r1flow up" in out.stderr and "temporary server" in out.stderr, out.stderr


def test_prefect_imported_before_the_servers_are_chosen_is_an_error_not_a_temporary_server(live_servers, session_dir):
    """The guard behind "one place decides": a process that imported Prefect (its settings fixed, no API URL)
    before prepare_environment chose `r1flow up`'s servers gets an error instead of a temporary server; in the
    right order Prefect uses those servers."""
    env = _bare_env(session_dir / "servers-home")
    late = ("import prefect.flows\n"
            "from flows.servers.settings import prepare_environment\n"
            "prepare_environment()\n")
    out = subprocess.run([sys.executable, "-c", late], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert ("RuntimeError: internal error: Prefect was imported before r1flow chose its servers (it uses a temporary "
            f"server, r1flow up's is {live_servers.prefect_api_url})") in out.stderr, out.stderr[-2000:]
    right = ("from flows.servers.settings import prepare_environment\n"
             "print(prepare_environment())\n"
             "from prefect.settings import get_current_settings\n"
             "print(get_current_settings().api.url)\n")
    out = subprocess.run([sys.executable, "-c", right], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == [f"r1flow up servers of {session_dir / 'servers-home'}",
                                          live_servers.prefect_api_url]
