"""Running it like a team, against real servers: `r1flow up`-style Prefect and MLflow servers on
127.0.0.1 (the session's `live_servers`), deployments served by `r1flow serve` and triggered the
way the UI triggers them (`run_deployment` with parameters), a cron schedule, a single-stage re-run
through its deployment, and two pipelines started at the same moment on one R1FLOW_HOME."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import servers

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
                    client.read_deployment_by_name("r1flow-pipeline/eval")
                    client.read_deployment_by_name("r1flow-eval/rerun")
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
    run, state = _run_deployment(info, "r1flow-pipeline/eval", {"recipe": "eval", "profile": "tiny"})
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

    from flows.store import ArtifactStore

    if "eval_children" not in team:
        pytest.skip("needs the recipe run of the previous test")  # ordering only; that test fails on its own
    children = team["eval_children"]
    model_fp = children["base"].data.tags["r1flow.output.model"]
    prompts_fp = children["prompts"].data.tags["r1flow.output.prompts"]
    run, state = _run_deployment(team["info"], "r1flow-eval/rerun", {
        "inputs": {"model": model_fp, "prompts": prompts_fp[:16]},
        "config": {"max_prompts": 5}, "recipe": "eval", "profile": "tiny"})
    assert state.is_completed(), f"{state.name}: {state.message}"
    client = MlflowClient(team["info"].mlflow_tracking_uri)
    exp = client.get_experiment_by_name("r1flow/eval")
    stage_runs = client.search_runs([exp.experiment_id], f"tags.`r1flow.flow_run_id` = '{run.id}' and "
                                    "tags.`r1flow.node` = 'eval_base'")
    assert len(stage_runs) == 1
    tags = stage_runs[0].data.tags
    assert tags["r1flow.input.model"] == model_fp and tags["r1flow.input.prompts"] == prompts_fp
    assert stage_runs[0].data.metrics["prompts"] == 5
    store = ArtifactStore(str(team["home"]), home=str(team["home"]))
    manifest = store.verify(tags["r1flow.output.results"])
    assert manifest.parents == sorted([model_fp, prompts_fp])
    assert manifest.producer.mlflow_run_id == stage_runs[0].info.run_id
    assert tags["r1flow.output.results"] != children["eval_base"].data.tags["r1flow.output.results"]  # new config


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

    from flows.store import ArtifactStore

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
