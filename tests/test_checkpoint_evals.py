"""Checkpoint evals (docs/guides/checkpoint-evals.md): a training node's published checkpoints evaluated beside it.
The pure pieces (when a step publishes, the report's rows, the plan's one-line refusals), then the sft-eval recipe
through the CLI on the tiny profile: the evals run while sft trains, the curve is in MLflow and report.md, and a
re-run of sft reuses them."""

from __future__ import annotations

import json

import pytest

from flows.cli.app import main
from flows.plan.recipes import load_plan
from flows.report.checkpoint_curve import checkpoint_rows
from flows.run.checkpoint_evals import check_plan, eval_spec
from flows.run.placement import NODE_RETRIES, Execution
from schemas.configs import SFTConfig
from schemas.errors import ConfigError
from schemas.rl_configs import GRPOConfig
from stages.training.checkpoints import publish_due
from tests.conftest import harness_home


def test_publish_due_every_n_steps_but_the_last():
    assert [d for d in range(1, 31) if publish_due(10, d, 30)] == [10, 20]  # 30: the stage's own output
    assert [d for d in range(1, 8) if publish_due(3, d, 7)] == [3, 6]
    assert not any(publish_due(0, d, 30) for d in range(1, 31))  # 0: off


def test_the_setting_leaves_the_default_key_alone():
    for cls in (SFTConfig, GRPOConfig):
        assert "publish_checkpoints_every" not in cls().model_dump(mode="json")
        assert cls(publish_checkpoints_every=5).model_dump(mode="json")["publish_checkpoints_every"] == 5


def test_grpo_publishes_its_model_without_changing_what_it_trains(tmp_path, tiny_model_input, digit_prompts):
    """A merged-LoRA grpo of 3 steps publishing every step: the context gets the models after steps 1 and 2 (not 3,
    the output), whole models; the final model has the bytes of a run that published nothing (saving a checkpoint
    merges a copy, never the adapter being trained)."""
    from schemas.specs import GenerationSpec, LoraSpec, RewardSpec
    from stages import grpo
    from stages.base import LocalContext

    def cfg(every: int) -> GRPOConfig:
        return GRPOConfig(steps=3, prompts_per_step=2, group_size=4, learning_rate=3e-3, minibatch_size=8,
                          lora=LoraSpec(r=4, alpha=8, merge=True), publish_checkpoints_every=every,
                          generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8),
                          reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=6, overlong_buffer=5))

    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    publishing, plain = LocalContext(tmp_path / "publishing"), LocalContext(tmp_path / "plain")
    out = grpo.run(cfg(1), inputs, publishing)["model"]
    ref = grpo.run(cfg(0), inputs, plain)["model"]
    assert [(step, o.kind, o.schema) for step, o in publishing.checkpoints] == [(1, "model", "model"),
                                                                               (2, "model", "model")]
    assert [o.metrics for _, o in publishing.checkpoints] == [{"step": 1.0}, {"step": 2.0}]
    assert all((o.path / "model" / "model.safetensors").exists() for _, o in publishing.checkpoints)
    assert plain.checkpoints == []
    weights = [(o.path / "model" / "model.safetensors").read_bytes() for o in (out, ref)]
    assert weights[0] == weights[1]


def test_report_rows():
    rows = checkpoint_rows(([10, 20], [0.25, 0.5]), ([10], [0.75]), (30, "eval_sft", 0.625, None))
    assert rows == [["10", "checkpoint", "0.250", "0.750"], ["20", "checkpoint", "0.500", "—"],
                    ["30", "final (eval_sft)", "0.625", "—"]]
    assert checkpoint_rows(([], []), ([], []), None) == []


def test_the_plan_names_the_eval_or_refuses_in_one_line():
    plan = load_plan("sft-eval", "tiny", ["sft.publish_checkpoints_every=10"])
    check_plan(plan, {n.name for n in plan.nodes})
    spec = eval_spec(plan, plan.node("sft"), {"prompts": {"prompts": "p" * 64}})
    assert (spec["node"], spec["inputs"], spec["seed"]) == ("eval_sft", {"prompts": "p" * 64}, plan.node("eval_sft").seed)
    assert spec["config"] == plan.node("eval_sft").config_dict
    assert spec["ray_options"] == {}  # off a cluster: nothing to reserve
    # on a cluster: the Ray options of eval_sft's own stage task, its `resources:` (labels pin it to a machine)
    pinned = load_plan("sft-eval", "tiny", ["sft.publish_checkpoints_every=10", "eval_sft.resources.labels.head=1",
                                            "eval_sft.resources.cpus=2"])
    on_ray = eval_spec(pinned, pinned.node("sft"), {"prompts": {"prompts": "p" * 64}}, Execution(cluster="head:6379"))
    assert on_ray["ray_options"] == {"num_cpus": 2, "num_gpus": 0, "max_retries": NODE_RETRIES,
                                     "resources": {"head": 1.0}}
    off = load_plan("sft-eval", "tiny", [])
    assert eval_spec(off, off.node("sft"), {}) is None  # off: no spec
    # r1's RL node: its eval's prompts are made before it
    r1 = load_plan("r1", "tiny", ["grpo_reasoning.publish_checkpoints_every=1"])
    check_plan(r1, {"grpo_reasoning"})
    assert eval_spec(r1, r1.node("grpo_reasoning"), {"prompts": {"prompts": "p" * 64}})["node"] == "eval_grpo_reasoning"
    two = load_plan("sft-eval", "tiny", ["sft.publish_checkpoints_every=10", "sft.resources.num_processes=2"])
    with pytest.raises(ConfigError, match=r"^sft.publish_checkpoints_every=10: checkpoint evals need the stage in one "
                                          r"process .*; use --set sft.publish_checkpoints_every=0$"):
        check_plan(two, {"sft"})


def test_the_cpu_profile_evaluates_grpo_reasonings_checkpoints():
    for overrides in ([], ["options.rl=ppo"]):
        plan = load_plan("r1", "cpu", overrides)
        node = plan.node("grpo_reasoning")
        assert (node.config.publish_checkpoints_every, node.config.steps) == (40, 80)
        check_plan(plan, {n.name for n in plan.nodes})
        assert eval_spec(plan, node, {"prompts": {"prompts": "p" * 64}})["node"] == "eval_grpo_reasoning"
    assert [d for d in range(1, 81) if publish_due(40, d, 80)] == [40]  # one eval, then the final model's


def test_a_node_no_eval_reads_is_one_line_before_any_compute(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    recipe = tmp_path / "no-eval.yaml"
    recipe.write_text("name: no-eval\nmodel: tiny-random\nnodes:\n  base: {stage: import_model, config: {ref: tiny-random}}\n"
                      "  prompts: {stage: prompts}\n"
                      "  sft: {stage: sft, inputs: {model: base.model, data: prompts.prompts}}\n")
    assert main(["run", "--recipe", str(recipe), "--profile", "tiny", "--set", "sft.publish_checkpoints_every=10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["r1flow: error: sft.publish_checkpoints_every=10: no eval node of recipe 'no-eval' reads sft.model, "
                   "so its checkpoints have no held-out eval to run; use --set sft.publish_checkpoints_every=0"]
    assert not (tmp_path / "artifacts").exists()  # nothing computed


# ---------------------------------------------------------------------------- through the CLI

@pytest.fixture(scope="module")
def home(tmp_path_factory):
    import flows.run.pipeline  # noqa: F401  (Prefect configures logging once, on import)

    with harness_home(tmp_path_factory.mktemp("checkpoint-evals-home")) as path:
        yield path


def run(home, *args: str) -> dict:
    out = home / "last-run.json"
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--json", str(out),
                 "--set", "sft.publish_checkpoints_every=40", *args]) == 0
    return json.loads(out.read_text())


def sft_run(client, result: dict):
    return next(r for r in client.search_runs([result["experiment_id"]],
                                              f"tags.mlflow.parentRunId = '{result['parent_run_id']}'")
                if r.data.tags["r1flow.node"] == "sft")


def evals_record(client, run) -> dict:
    path = client.download_artifacts(run.info.run_id, "checkpoint_evals.json")
    return json.loads(open(path).read())


@pytest.mark.slow
def test_checkpoint_evals_run_beside_sft_show_their_curve_and_are_reused(home):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    result = run(home)
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    sft = sft_run(client, result)
    record = evals_record(client, sft)
    evals = record["evals"]
    assert [(e["step"], e["eval"], e["cached"]) for e in evals] == [(40, "eval_sft@sft-step40", False),
                                                                    (80, "eval_sft@sft-step80", False)]
    # beside the training: each eval started after sft did, in a process of its own; the first computed before sft's
    # last step was done
    started = sft.info.start_time / 1000
    assert all(started <= e["started_at"] < e["computed_from"] < e["computed_to"] < e["ended_at"] for e in evals)
    assert evals[0]["computed_to"] < record["training_ended_at"], (evals, record["training_ended_at"])
    # the checkpoint: a model artifact of its own, parents sft's inputs, marked with its step
    manifest = json.loads((home / "artifacts" / evals[0]["checkpoint"] / "manifest.json").read_text())
    sft_manifest = json.loads((home / "artifacts" / result_of(result, "sft")["model"] / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["parents"] == sft_manifest["parents"]
    assert (manifest["extra"]["checkpoint_of"], manifest["extra"]["checkpoint_step"]) == ("sft", 40)
    assert manifest["producer"]["mlflow_run_id"] == sft.info.run_id
    # each eval: an MLflow run nested under sft's, and a Prefect task run of this flow run
    eval_runs = {r.data.tags["r1flow.node"]: r for r in client.search_runs(
        [result["experiment_id"]], f"tags.mlflow.parentRunId = '{sft.info.run_id}'")}
    assert set(eval_runs) == {"eval_sft@sft-step40", "eval_sft@sft-step80"}
    assert eval_runs["eval_sft@sft-step40"].data.tags["r1flow.input.model"] == evals[0]["checkpoint"]
    with get_client(sync_client=True) as prefect:
        tasks = prefect.request("POST", "/task_runs/filter",
                                json={"flow_runs": {"id": {"any_": [result["flow_run_id"]]}}}).json()
    assert {"eval_sft@sft-step40", "eval_sft@sft-step80"} <= {t["name"] for t in tasks}
    # the curve: MLflow (sft's run, at the checkpoint's step) and the report
    history = client.get_metric_history(sft.info.run_id, "checkpoint_eval/accuracy")
    assert sorted(m.step for m in history) == [40, 80]
    assert min(m.timestamp for m in history) / 1000 < record["training_ended_at"]  # in MLflow while sft trained
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [e["checkpoint_eval/accuracy"] for e in evals]
    report = open(client.download_artifacts(result["parent_run_id"], "report/report.md")).read()
    final = result_of(result, "eval_sft", "metrics")["accuracy"]
    table = ["| step | model | accuracy | format rate |", "|---|---|---|---|",
             *[f"| {e['step']} | checkpoint | {e['checkpoint_eval/accuracy']:.3f} | "
               f"{e['checkpoint_eval/format_rate']:.3f} |" for e in evals]]
    assert "## Held-out accuracy by checkpoint" in report
    assert "\n".join(table) in report, report
    assert f"| 120 | final (eval_sft) | {final:.3f} |" in report
    assert "report/checkpoints.png" in {a.path for a in client.list_artifacts(result["parent_run_id"], "report")}

    # sft again (--force): the same checkpoints, so every eval is reused from the cache
    again = run(home, "--force", "sft")
    assert result_of(again, "sft", "status") == "run"
    record2 = evals_record(client, sft_run(client, again))
    assert [(e["step"], e["checkpoint"], e["results"], e["cached"]) for e in record2["evals"]] == [
        (e["step"], e["checkpoint"], e["results"], True) for e in evals]
    assert "## Held-out accuracy by checkpoint" in open(
        client.download_artifacts(again["parent_run_id"], "report/report.md")).read()


def result_of(result: dict, node: str, what: str = "outputs"):
    return next(s[what] for s in result["stages"] if s["node"] == node)
