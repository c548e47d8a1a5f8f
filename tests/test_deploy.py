"""Deployments and single-stage re-runs without a server: typed parameters, config building,
input references, lineage, retries of transient failures only, and the per-key stage lock."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from flows.run import deploy, pipeline
from schemas.errors import ArtifactError, ConfigError
from tests.conftest import harness_home


def test_stage_flow_parameters_are_typed_with_defaults_and_descriptions():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(deploy.STAGE_FLOWS["grpo"].fn).model_dump()
    props, defs = schema["properties"], schema["definitions"]
    assert props["config"]["default"]["group_size"] == 8
    grpo_cfg = defs[props["config"]["$ref"].split("/")[-1]]
    assert "completions per prompt" in grpo_cfg["properties"]["group_size"]["description"]
    inputs = defs[props["inputs"]["$ref"].split("/")[-1]]
    assert set(inputs["required"]) == {"model", "prompts"}  # reward_model is optional
    assert "latest:NODE[@RECIPE]" in inputs["properties"]["model"]["description"]
    pipe = parameter_schema(pipeline.pipeline.fn).model_dump()["properties"]
    assert "tiny (tests), cpu, gpu" in pipe["profile"]["description"]


def _enum(prop: dict, defs: dict) -> list | None:
    """The choices of a (possibly optional) parameter in Prefect's schema, as the UI reads them."""
    for option in [prop, *prop.get("anyOf", [])]:
        option = defs.get(option.get("$ref", "").split("/")[-1], option)
        if "enum" in option:
            return option["enum"]
    return None


def test_the_run_forms_offer_recipes_and_profiles_as_choices_and_hide_internals():
    from prefect.utilities.callables import parameter_schema

    from flows.plan.recipes import PROFILE_DIR, RECIPE_DIR, available

    schema = parameter_schema(deploy.recipe_pipeline.fn).model_dump()
    props, defs = schema["properties"], schema.get("definitions", {})
    assert _enum(props["recipe"], defs) == available(RECIPE_DIR) and "r1" in available(RECIPE_DIR)
    assert _enum(props["profile"], defs) == available(PROFILE_DIR) == ["cpu", "gpu", "tiny"]
    assert "settings" not in props and set(schema["required"]) == {"recipe", "profile"}
    # where the run goes: a Ray cluster's address, or stages at once on the worker's machine (issue 43)
    assert "Ray cluster address" in props["cluster"]["description"] and props["parallel"]["default"] == 1
    stage = parameter_schema(deploy.STAGE_FLOWS["sft"].fn).model_dump()
    assert _enum(stage["properties"]["recipe"], stage["definitions"]) == available(RECIPE_DIR)
    assert _enum(stage["properties"]["profile"], stage["definitions"]) == available(PROFILE_DIR)
    assert "settings" not in stage["properties"]
    import re

    schemas = [schema] + [parameter_schema(f.fn).model_dump() for f in deploy.STAGE_FLOWS.values()]
    for described in schemas:  # the UI renders descriptions as markdown: a bare <placeholder> would vanish
        for text in re.findall(r'"description": "((?:[^"\\]|\\.)*)"', json.dumps(described)):
            bare = re.sub(r"`[^`]*`", "", text)  # tags inside code spans are shown as written
            assert not re.findall(r"</?[a-zA-Z][^>]*>", bare), text


def test_stage_deployments_show_the_config_that_will_run():
    specs = deploy.deployment_specs(["sft-eval"], ["sft", "grpo"], "tiny", [])
    sft, grpo = specs[1]["parameters"], specs[2]["parameters"]
    recipe_sft, _, _ = deploy.stage_config("sft", "sft-eval", "tiny", None, {})
    assert sft == {"config": recipe_sft, "profile": "tiny", "recipe": "sft-eval"}
    assert sft["config"]["max_steps"] == 120  # the tiny profile's value, not the stage default
    assert grpo["config"] == deploy.stage_config("grpo", None, "tiny", None, {})[0]  # sft-eval has no grpo node
    assert "recipe" not in grpo


def test_stage_config_layers_recipe_profile_and_overrides():
    cfg, node, seed = deploy.stage_config("sft", "sft-eval", "tiny", None, {"learning_rate": 1e-3})
    assert (node, seed) == ("sft", 0)
    assert cfg["learning_rate"] == 1e-3 and cfg["max_steps"] == 120  # override over the tiny profile's value
    cfg, node, _ = deploy.stage_config("eval", None, "tiny", "my_eval", {})
    assert node == "my_eval" and cfg["max_prompts"] == 16
    with pytest.raises(ConfigError, match="sft.learning_rate"):
        deploy.stage_config("sft", None, None, None, {"learning_rate": "fast"})
    with pytest.raises(ConfigError, match="no 'grpo' node"):
        deploy.stage_config("grpo", "sft-eval", "tiny", None, {})
    with pytest.raises(ConfigError, match="is a 'eval' stage"):
        deploy.stage_config("sft", "sft-eval", "tiny", "eval_base", {})


def test_changed_fields_is_what_a_form_changed():
    default = {"a": 1, "lora": {"r": 16, "alpha": 32}, "b": "x"}
    assert deploy.changed_fields({"a": 1, "lora": {"r": 0, "alpha": 32}, "b": "x"}, default) == {"lora": {"r": 0}}
    assert deploy.changed_fields(default, default) == {}


def test_bad_schedules_and_unknown_names_fail_before_registering():
    with pytest.raises(ConfigError, match="cron"):
        deploy.schedule_kwargs("every night", None)
    with pytest.raises(ConfigError, match="not both"):
        deploy.schedule_kwargs("0 2 * * *", 3600)
    assert deploy.schedule_kwargs("0 2 * * *", None) == {"cron": "0 2 * * *"}
    with pytest.raises(ConfigError, match="unknown recipe"):
        deploy.deployment_specs(["nope"], [], "tiny", [])
    with pytest.raises(ConfigError, match="unknown stage"):
        deploy.deployment_specs([], ["nope"], "tiny", [])
    specs = deploy.deployment_specs(["sft-eval"], ["sft", "eval"], "tiny", ["sft.max_steps=5"], cron="0 2 * * *",
                                    tags=["nightly"])
    assert [deploy.full_name(s) for s in specs] == ["r1flow-pipeline/sft-eval", "r1flow-sft/sft", "r1flow-eval/eval"]
    served = deploy.deployment_specs(["sft-eval"], ["sft"], "tiny", [], served=True)
    assert [deploy.full_name(s) for s in served] == ["r1flow-pipeline/sft-eval-served", "r1flow-sft/sft-served"]
    assert specs[0]["parameters"] == {"recipe": "sft-eval", "profile": "tiny", "overrides": ["sft.max_steps=5"]}
    assert specs[0]["cron"] == "0 2 * * *" and "nightly" in specs[0]["tags"]


def test_transient_failures_are_retried_and_deterministic_ones_are_not():
    import httpx
    from mlflow.exceptions import MlflowException

    assert pipeline.is_transient(ConnectionRefusedError("server down"))
    assert pipeline.is_transient(httpx.ConnectError("no route"))
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    assert pipeline.is_transient(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))
    try:  # what MlflowClient raises when its server is down: the ConnectionError is the __context__
        try:
            raise ConnectionError("Max retries exceeded")
        except ConnectionError as e:
            raise MlflowException(f"API request to http://127.0.0.1:1 failed with exception {e}") from None
    except MlflowException as unreachable:
        unreachable.__suppress_context__ = False
        assert pipeline.is_transient(unreachable)
    wrapped = RuntimeError("tracking failed")
    wrapped.__cause__ = TimeoutError()
    assert pipeline.is_transient(wrapped)
    for exc in (ConfigError("bad key"), ArtifactError("corrupt"), ValueError("bug"), FileNotFoundError("x"), None):
        assert not pipeline.is_transient(exc)


def test_stage_lock_serialises_one_key_and_not_others(tmp_path):
    order = []

    def hold(key, tag, wait):
        with pipeline.stage_lock(str(tmp_path), key):
            order.append(f"{tag}+")
            time.sleep(wait)
            order.append(f"{tag}-")

    a = threading.Thread(target=hold, args=("k1", "a", 0.4))
    a.start()
    time.sleep(0.1)
    b = threading.Thread(target=hold, args=("k1", "b", 0))  # same key: waits for a
    c = threading.Thread(target=hold, args=("k2", "c", 0))  # other key: does not
    b.start()
    c.start()
    for t in (a, b, c):
        t.join()
    assert order.index("b+") > order.index("a-")
    assert order.index("c-") < order.index("a-")


# ---------------------------------------------------------------------------- through Prefect (ephemeral)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with harness_home(tmp_path_factory.mktemp("deploy-home")) as path:
        yield path


@pytest.fixture(scope="module")
def eval_run(home):
    from flows.cli.app import main

    out = home / "eval-run.json"
    assert main(["run", "--recipe", "eval", "--profile", "tiny", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _outputs(result: dict, node: str) -> dict[str, str]:
    return next(s for s in result["stages"] if s["node"] == node)["outputs"]


@pytest.mark.slow
def test_single_stage_rerun_from_references_joins_the_lineage(home, eval_run):
    from mlflow.tracking import MlflowClient

    from flows.store.artifacts import ArtifactStore

    model_fp, prompts_fp = _outputs(eval_run, "base")["model"], _outputs(eval_run, "prompts")["prompts"]
    prompts_run = next(s for s in eval_run["stages"] if s["node"] == "prompts")["mlflow_run_id"]
    result = deploy.stage_flow(stage="eval", inputs={"model": "latest:base", "prompts": f"mlflow:{prompts_run}"},
                               overrides={"max_prompts": 4}, recipe="eval", profile="tiny", node="eval_base")
    assert result["status"] == "run"
    assert result["inputs"] == {"model": model_fp, "prompts": prompts_fp}
    store = ArtifactStore(str(home), home=str(home))
    manifest = store.verify(result["outputs"]["results"])
    assert manifest.parents == sorted([model_fp, prompts_fp]) and manifest.producer.node == "eval_base"
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["r1flow.input.model"] == model_fp
    assert run.data.tags["r1flow.input.prompts"] == prompts_fp
    assert run.data.tags["mlflow.parentRunId"] == result["parent_run_id"]
    assert client.get_run(result["parent_run_id"]).data.tags["r1flow.output.results"] == result["outputs"]["results"]
    assert run.data.metrics["prompts"] == 4

    # the same stage, config and inputs as the pipeline's node: the pipeline's cached result, by prefix
    same = deploy.stage_flow(stage="eval", inputs={"model": model_fp[:12], "prompts": "latest:prompts@eval"},
                             recipe="eval", profile="tiny")
    assert same["status"] == "cached"
    assert same["outputs"] == _outputs(eval_run, "eval_base")



def test_a_stage_that_salts_its_cache_key_runs_alone(home):
    """prompts (like preference_data and prm) salts its cache key with the content of user files, reading the
    config object: a single-stage run hands it the validated config, not the JSON dict (AttributeError before)."""
    result = deploy.stage_flow(stage="prompts", inputs={}, profile="tiny", force=True)
    assert result["status"] == "run" and set(result["outputs"]) == {"prompts"}

@pytest.mark.slow
def test_bad_references_fail_naming_the_input_before_compute(home, eval_run):
    prompts_fp = _outputs(eval_run, "prompts")["prompts"]
    with pytest.raises(ArtifactError, match="input .model.*is a dataset.*takes a model"):
        deploy.run_single_stage("eval", {"model": prompts_fp, "prompts": prompts_fp}, profile="tiny")
    with pytest.raises(ArtifactError, match="no artifact"):
        deploy.run_single_stage("eval", {"model": "ffffffffffff", "prompts": prompts_fp}, profile="tiny")
    with pytest.raises(ArtifactError, match="node 'nope'"):
        deploy.run_single_stage("eval", {"model": "latest:nope", "prompts": prompts_fp}, profile="tiny")
    with pytest.raises(ConfigError, match="missing input"):
        deploy.run_single_stage("eval", {"prompts": prompts_fp}, profile="tiny")
    with pytest.raises(ConfigError, match="has no input"):
        deploy.run_single_stage("eval", {"model": prompts_fp, "prompts": prompts_fp, "extra": "x"}, profile="tiny")


@pytest.mark.slow
def test_transient_failure_is_retried_and_a_config_error_fails_the_flow_once(home, eval_run, monkeypatch):
    from prefect import flow

    calls = []
    real = pipeline.execute_stage

    def flaky(**kw):
        calls.append(kw["node"])
        if len(calls) == 1:
            raise ConnectionError("tracking server unreachable")
        return real(**kw)

    monkeypatch.setattr(pipeline, "execute_stage", flaky)
    monkeypatch.setattr(pipeline.stage_task, "retry_delay_seconds", 0)
    prompts_fp = _outputs(eval_run, "prompts")["prompts"]
    model_fp = _outputs(eval_run, "base")["model"]
    result = deploy.stage_flow(stage="eval", inputs={"model": model_fp, "prompts": prompts_fp},
                               overrides={"max_prompts": 3}, profile="tiny", force=True)
    assert len(calls) == 2 and result["status"] == "run"

    calls.clear()

    def broken(**kw):
        calls.append(kw["node"])
        raise ConfigError("eval.max_prompts: bad")

    monkeypatch.setattr(pipeline, "execute_stage", broken)

    @flow
    def wrapper():
        return deploy.run_single_stage("eval", {"model": model_fp, "prompts": prompts_fp}, {"max_prompts": 2},
                                profile="tiny", force=True)

    state = wrapper(return_state=True)
    assert state.is_failed() and len(calls) == 1
    with pytest.raises(ConfigError, match="max_prompts: bad"):
        state.result()


def test_entrypoints_resolve_to_the_flows():
    from prefect.flows import load_flow_from_entrypoint

    root = deploy.ROOT  # the source deployments register (from_source): the entrypoints are relative to it
    assert root == Path(__file__).resolve().parents[1]
    f = load_flow_from_entrypoint(str(root / "flows/run/deploy.py:grpo_stage"))
    assert f.name == "r1flow-grpo"
    assert load_flow_from_entrypoint(str(root / deploy.PIPELINE_ENTRYPOINT)).name == "r1flow-pipeline"
    assert load_flow_from_entrypoint(str(root / "flows/run/deploy.py:recipe_pipeline")).name == "r1flow-pipeline"


def test_nightly_recipe_new_prompts_leave_the_sft_model_cached(tmp_path):
    """The scheduled-refresh example: rewriting the new-prompts file changes the cache key of
    `new_prompts` only; `sft` hangs off `base` and `prompts`, whose keys stay put, so it is reused."""
    from flows.plan.recipes import load_plan

    f = tmp_path / "incoming.jsonl"
    keys = []
    for question in ("What is 2+2?", "What is 3+5?"):
        f.write_text(json.dumps({"question": question, "answer": "4"}) + "\n")
        plan = load_plan("nightly-preferences", "tiny", [f"new_prompts.files=[{f}]", "new_prompts.size=0"])
        keys.append({n.name: pipeline.node_key(n, {})[0] for n in plan.nodes if not n.inputs})
    assert keys[0]["new_prompts"] != keys[1]["new_prompts"]
    assert keys[0]["prompts"] == keys[1]["prompts"] and keys[0]["base"] == keys[1]["base"]
    assert plan.descendants({"new_prompts"}) == {"new_prompts", "rejection_sampling", "preference_data", "reward_model",
                                                 "dpo_reference", "dpo", "eval_dpo"}
    assert set(plan.ancestors({"sft"})) == {"sft", "base", "prompts"}


# ---------------------------------------------------------------------------- issue 44: the stage form's results


def _prefect_artifact(artifact_id: str) -> str:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[UUID(artifact_id)])))
        return found.data


@pytest.mark.slow
def test_a_blank_node_in_the_stage_form_is_named_after_the_model_it_evaluates(home, eval_run):
    """The eval form with recipe sft-eval (nodes eval_base and eval_sft), node left blank, given a model that
    sft-eval's `sft` node made: it runs as eval_sft (artifact, MLflow run, task), not eval_base; the stage-<node>
    artifact lists the field the submission changed. Several candidates the inputs do not tell apart: one error."""
    from mlflow.tracking import MlflowClient

    from flows.store.artifacts import ArtifactStore

    prompts_fp, base_fp = _outputs(eval_run, "prompts")["prompts"], _outputs(eval_run, "base")["model"]
    sft = deploy.STAGE_FLOWS["sft"](inputs={"model": base_fp, "data": prompts_fp}, config={"max_steps": 2},
                                   recipe="sft-eval", profile="tiny")
    assert sft["node"] == "sft"
    result = deploy.STAGE_FLOWS["eval"](inputs={"model": sft["outputs"]["model"], "prompts": prompts_fp},
                                        config={"max_prompts": 2}, recipe="sft-eval", profile="tiny")
    assert result["node"] == "eval_sft"
    # as a pipeline node: the model's ancestor datasets (sft's data) are inputs, in the key (flows/store/lineage.py)
    assert result["inputs"] == {"model": sft["outputs"]["model"], "prompts": prompts_fp,
                                f"lineage.{prompts_fp[:12]}": prompts_fp}
    assert result["metrics"]["contamination/datasets"] == 1.0
    store = ArtifactStore(str(home), home=str(home))
    assert store.verify(result["outputs"]["results"]).producer.node == "eval_sft"
    run = MlflowClient(f"sqlite:///{home}/mlflow.db").get_run(result["mlflow_run_id"])
    assert run.data.tags["r1flow.node"] == "eval_sft" and run.info.run_name == "eval_sft"
    shown = _prefect_artifact(result["prefect_artifact_id"])
    assert "# Stage re-run: eval_sft (eval)" in shown
    assert "`max_prompts=2`" in shown  # what the submission changed
    assert "`max_prompts=2`" not in _prefect_artifact(sft["prefect_artifact_id"])  # (each lists its own)
    assert "`max_steps=2`" in _prefect_artifact(sft["prefect_artifact_id"])

    # a model no eval node of sft-eval reads (made by a node `mine`): one error naming the choices
    mine = deploy.STAGE_FLOWS["sft"](inputs={"model": base_fp, "data": prompts_fp}, config={"max_steps": 1},
                                    profile="tiny", node="mine")
    with pytest.raises(ConfigError, match=r"recipe 'sft-eval' has 2 'eval' nodes \(eval_base, eval_sft\).*"
                                          r"made by node 'mine'.*node="):
        deploy.run_single_stage("eval", {"model": mine["outputs"]["model"], "prompts": prompts_fp}, recipe="sft-eval",
                         profile="tiny")


@pytest.mark.slow
def test_a_config_error_with_a_blank_node_names_the_node_the_inputs_resolve_to(home, eval_run, capsys):
    """Issue 59 item 7: the eval stage with recipe sft-eval, node left blank, a model sft-eval's `sft` made and a bad
    value: the error names eval_sft (the node the run resolves to), in the single-stage run the form's flow makes
    and in `r1flow stage` (one line, before Prefect starts); with the base model, eval_base. Before, the config
    was checked before the inputs were read, as the recipe's first eval node: `eval_base.max_prompts`."""
    from flows.cli.app import main

    prompts_fp, base_fp = _outputs(eval_run, "prompts")["prompts"], _outputs(eval_run, "base")["model"]
    sft = deploy.STAGE_FLOWS["sft"](inputs={"model": base_fp, "data": prompts_fp}, config={"max_steps": 2},
                                   recipe="sft-eval", profile="tiny")
    bad = "max_prompts: Input should be greater than or equal to 1 (got 0)"
    for model, node in ((sft["outputs"]["model"], "eval_sft"), (base_fp, "eval_base")):
        with pytest.raises(ConfigError, match=rf"^{node}\.{re.escape(bad)}$"):
            deploy.run_single_stage("eval", {"model": model, "prompts": prompts_fp}, {"max_prompts": 0},
                                    recipe="sft-eval", profile="tiny")
        capsys.readouterr()
        assert main(["stage", "eval", "--recipe", "sft-eval", "--profile", "tiny", "--input", f"model={model[:12]}",
                     "--input", f"prompts={prompts_fp[:12]}", "--set", "max_prompts=0"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"r1flow: error: {node}.{bad}"]


@pytest.mark.slow
def test_a_cached_single_stage_rerun_gets_a_nested_run_like_a_cached_pipeline_node(home, eval_run):
    """The pipeline's eval_base, re-run alone with the same config and inputs: cached, and its MLflow run (the link
    printed) has a nested run with the config, the metrics and the run that produced the outputs, as a cached
    pipeline node has."""
    from mlflow.tracking import MlflowClient

    model_fp, prompts_fp = _outputs(eval_run, "base")["model"], _outputs(eval_run, "prompts")["prompts"]
    source = next(s for s in eval_run["stages"] if s["node"] == "eval_base")
    result = deploy.stage_flow(stage="eval", inputs={"model": model_fp, "prompts": prompts_fp}, recipe="eval",
                               profile="tiny")
    assert result["status"] == "cached" and result["outputs"] == source["outputs"]
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    parent = client.get_run(result["parent_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{result['parent_run_id']}'")
    assert len(children) == 1
    child = children[0]
    assert child.info.run_id == result["mlflow_run_id"] and child.info.run_name == "eval_base"
    tags = child.data.tags
    assert tags["r1flow.cache_hit"] == "true" and tags["r1flow.source_run_id"] == source["mlflow_run_id"]
    assert tags["r1flow.output.results"] == source["outputs"]["results"]
    assert child.data.params["config.max_prompts"] == str(source_config_max_prompts(eval_run))
    assert child.data.metrics["accuracy"] == pytest.approx(source["metrics"]["accuracy"])
    assert parent.data.tags["r1flow.source_run_id"] == source["mlflow_run_id"]
    assert parent.data.metrics["accuracy"] == pytest.approx(source["metrics"]["accuracy"])  # the link is not empty


def source_config_max_prompts(run: dict) -> int:
    from flows.plan.recipes import load_plan

    return load_plan(run["recipe"], run["profile"]).node("eval_base").config.max_prompts
