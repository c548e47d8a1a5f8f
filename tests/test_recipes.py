"""Every recipe × profile loads; config errors are one clear line naming the key."""

from pathlib import Path

import pytest

from flows.recipes import PROFILE_DIR, RECIPE_DIR, available, load_plan, parse_override
from schemas.errors import ConfigError


@pytest.mark.parametrize("profile", available(PROFILE_DIR))
@pytest.mark.parametrize("recipe", available(RECIPE_DIR))
def test_every_recipe_loads_with_every_profile(recipe, profile):
    plan = load_plan(recipe, profile)
    assert plan.nodes and plan.recipe == recipe and plan.profile == profile
    seen = set()
    for node in plan.nodes:  # topological: inputs come from earlier nodes
        assert all(up in seen for up, _ in node.inputs.values()), node.name
        seen.add(node.name)


def test_recipe_and_profile_files_cover_the_documented_set():
    assert {"sft-eval"} <= set(available(RECIPE_DIR))
    assert {"tiny", "cpu", "gpu"} == set(available(PROFILE_DIR))


def test_precedence_defaults_recipe_profile_override():
    plan = load_plan("sft-eval", "tiny", ["sft.learning_rate=1e-4", "sft.lora.r=4"])
    sft = plan.node("sft").config
    assert sft.learning_rate == 1e-4  # --set beats the profile's 3e-3
    assert sft.max_steps == 120  # from the tiny profile
    assert sft.lora.r == 4 and sft.lora.alpha == 32  # nested override keeps siblings
    assert sft.weight_decay == 0.0  # class default
    assert plan.model == "tiny-random" and plan.node("base").config.ref == "tiny-random"


def test_model_and_seed_overrides(tmp_path):
    plan = load_plan("sft-eval", "tiny", [f"model={tmp_path}", "seed=7", "sft.seed=3"])
    assert plan.node("base").config.ref == str(tmp_path)
    assert plan.node("sft").seed == 3 and plan.node("eval_sft").seed == 7


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sft.learnin_rate=1"], "sft.learnin_rate: unknown key"),
        (["sft.learning_rate=-1"], "sft.learning_rate: Input should be greater than 0 (got -1"),
        (["sft.lr_scheduler=wavy"], "sft.lr_scheduler: Input should be 'cosine', 'linear' or 'constant'"),
        (["dpo.beta=0.1"], "unknown stage node 'dpo'"),
        (["sft"], "expected KEY=VALUE"),
        (["model=/no/such/dir"], "import_model.ref: /no/such/dir is not a directory"),
        (["prompts.tasks={no_such_task: {}}"], "unknown reasoning-gym task 'no_such_task'"),
        (["prompts.files=[/nonexistent.jsonl]"], "prompts.files: /nonexistent.jsonl does not exist"),
    ],
)
def test_bad_overrides_fail_before_compute(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_plan("sft-eval", "tiny", overrides)


def test_unknown_recipe_and_profile():
    with pytest.raises(ConfigError, match="unknown recipe 'nope'; known recipes: .*sft-eval"):
        load_plan("nope", "tiny")
    with pytest.raises(ConfigError, match="unknown profile 'huge'"):
        load_plan("sft-eval", "huge")


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def test_recipe_structure_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown stage 'sftt'"):
        load_plan(write(tmp_path, "name: x\nnodes:\n  a: {stage: sftt}\n"), "tiny")
    with pytest.raises(ConfigError, match="unknown upstream node 'nowhere'"):
        load_plan(write(tmp_path, "name: x\nnodes:\n  a: {stage: prompts, inputs: {x: nowhere.y}}\n"), "tiny")
    with pytest.raises(ConfigError, match="missing input\\(s\\) \\['data'\\]"):
        load_plan(write(tmp_path, "name: x\nnodes:\n  m: {stage: import_model}\n"
                                  "  s: {stage: sft, inputs: {model: m.model}}\n"), "tiny")
    with pytest.raises(ConfigError, match="expects sft\\|prompts, but m.model is model"):
        load_plan(write(tmp_path, "name: x\nnodes:\n  m: {stage: import_model}\n"
                                  "  s: {stage: sft, inputs: {model: m.model, data: m.model}}\n"), "tiny")
    with pytest.raises(ConfigError, match="cycle"):
        load_plan(write(tmp_path, "name: x\nnodes:\n  a: {stage: eval, inputs: {model: b.model, prompts: b.model}}\n"
                                  "  b: {stage: sft, inputs: {model: a.results, data: a.results}}\n"), "tiny")


def test_parse_override_types():
    assert parse_override("a.b=1e-4") == (["a", "b"], 1e-4)
    assert parse_override("a=3") == (["a"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=eval") == (["a"], "eval")
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
