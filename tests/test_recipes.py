"""Every recipe × profile loads; config errors are one clear line naming the key."""

import re
from pathlib import Path

import pytest

from flows.plan.recipes import PROFILE_DIR, RECIPE_DIR, available, load_plan, parse_override
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
    (tmp_path / "config.json").write_text("{}")  # a model folder as the plan checks it: config and weights
    (tmp_path / "model.safetensors").write_bytes(b"")
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


def test_local_models_are_checked_when_the_plan_is_made(tmp_path, monkeypatch):
    """Before: a folder without weights, or a relative path that does not exist (taken for a hub name), failed
    only after the pipeline had started, naming an internal staging folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "empty").mkdir(parents=True)
    (tmp_path / "models" / "empty" / "config.json").write_text("{}")
    (tmp_path / "models" / "bare").mkdir()
    import re

    for ref, start, end in (("models/missing", "import_model.ref: models/missing is not a directory (relative to ", ""),
                            ("./mine", "import_model.ref: ./mine is not a directory", ""),
                            ("models/empty", "import_model.ref: models/empty (relative to ", ") holds no weights"),
                            ("models/bare", "import_model.ref: models/bare (relative to ", ") holds neither config.json")):
        with pytest.raises(ConfigError, match=re.escape(start) + ".*" + re.escape(end)):
            load_plan("sft-eval", "tiny", [f"model={ref}"])
    (tmp_path / "models" / "empty" / "model.safetensors").write_bytes(b"x")
    load_plan("sft-eval", "tiny", ["model=models/empty"])  # weights present: checked no further here
    load_plan("sft-eval", "tiny", ["model=HuggingFaceTB/SmolLM2-135M-Instruct"])  # a hub name: at run time


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


OPTIONS_RECIPE = """
name: opts
options: {use_b: true, init: a, layers: [0, 1]}
nodes:
  a: {stage: import_model, config: {ref: tiny-random}}
  b: {stage: import_model, when: "${use_b}", config: {ref: tiny-random}}
  p: {stage: prompts}
  s:
    stage: sft
    inputs: {model: "${init}.model", data: p.prompts}
  e:
    stage: eval
    inputs: {model: [b.model, s.model], prompts: p.prompts}
  st:
    stage: make_student
    inputs: {model: a.model}
    config: {keep_layers: "${layers}"}
"""


def test_recipe_options_when_and_input_alternatives(tmp_path):
    path = tmp_path / "opts.yaml"
    path.write_text(OPTIONS_RECIPE)
    plan = load_plan(str(path), "tiny")
    assert plan.options == {"use_b": True, "init": "a", "layers": [0, 1]}
    assert plan.node("e").inputs["model"] == ("b", "model")  # first enabled alternative
    assert plan.node("s").inputs["model"] == ("a", "model")
    assert plan.node("st").config.keep_layers == [0, 1]  # a whole-string placeholder keeps the list

    plan = load_plan(str(path), "tiny", ["options.use_b=false"])
    assert "b" not in {n.name for n in plan.nodes}
    assert plan.node("e").inputs["model"] == ("s", "model")  # falls through to the next source

    with pytest.raises(ConfigError, match="every source \\(b.model\\) is disabled"):
        load_plan(str(path), "tiny", ["options.use_b=false", "options.init=b"])
    with pytest.raises(ConfigError, match="has no option 'nope'; its options: use_b, init, layers"):
        load_plan(str(path), "tiny", ["options.nope=1"])
    with pytest.raises(ConfigError, match="node 'b' is disabled in this run"):
        load_plan(str(path), "tiny", ["options.use_b=false", "b.ref=x"])


WHEN_RECIPE = """
name: when
options: {arm: cut, a: true, b: true}
nodes:
  m: {stage: import_model, config: {ref: tiny-random}}
  cut: {stage: import_model, when: "${arm} == cut", config: {ref: tiny-random}}
  not_cut: {stage: import_model, when: "  ${arm}!=   cut ", config: {ref: tiny-random}}
  both: {stage: import_model, when: ["${a}", "${b}", "${arm} == cut"], config: {ref: tiny-random}}
"""


def test_when_compares_string_options_and_lists_must_all_hold(tmp_path):
    """`when:` after option substitution: "A == B" / "A != B" compare the stripped sides as strings; a list holds
    when every item does; a bool is read as before (OPTIONS_RECIPE)."""
    path = tmp_path / "when.yaml"
    path.write_text(WHEN_RECIPE)
    names = lambda *sets: {n.name for n in load_plan(str(path), "tiny", list(sets)).nodes}  # noqa: E731
    assert names() == {"m", "cut", "both"}
    assert names("options.arm=base") == {"m", "not_cut"}
    assert names("options.b=false") == {"m", "cut"}
    assert names('options.arm=" cut"') == {"m", "cut", "both"}  # " cut == cut": the sides compared stripped
    quoted = tmp_path / "quoted.yaml"  # a quoted bool reads as before the comparisons existed
    quoted.write_text('name: q\nnodes:\n  m: {stage: import_model, when: "false"}\n  n: {stage: import_model, '
                      'when: " True "}\n')
    assert {n.name for n in load_plan(str(quoted), "tiny").nodes} == {"n"}


@pytest.mark.parametrize(
    "when, message",
    [
        ('"${arm}"', "nodes.m.when: Value error, 'cut' is not a comparison; expected true/false, \"A == B\" or "
                     "\"A != B\" (after option substitution), or a list of them that must all hold"),
        ('"${arm} = cut"', "'cut = cut' is not a comparison"),
        ('"${arm} == cut == cut"', "'cut == cut == cut' is not a comparison"),
        ('"== cut"', "'== cut' is not a comparison"),
        ('"${nope} == cut"', "nodes.m.when: Value error, ${nope} names no option of the recipe"),
        ('["${a}", 2]', "nodes.m.when: Value error, 2 in the list"),
        ("[]", "nodes.m.when: Value error, an empty list"),
    ],
)
def test_a_when_that_is_no_condition_fails_naming_the_node(tmp_path, when, message):
    path = write(tmp_path, f"name: w\noptions: {{arm: cut, a: true}}\nnodes:\n  m: {{stage: import_model, when: {when}}}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_plan(path, "tiny")


def test_r1_options_rewire_the_dag():
    default = load_plan("r1", "tiny")
    names = {n.name for n in default.nodes}
    assert {"pref_samples", "preference_data", "reward_model", "dpo", "dpo_reference", "eval_dpo"} <= names
    assert "student" not in names  # options.student=base: the base model is the student
    assert default.node("distill").inputs["student"] == ("base", "model")
    assert default.node("sft").inputs["model"] == ("base", "model")
    assert default.node("grpo_final").inputs["model"] == ("dpo", "model")
    assert default.node("grpo_final").inputs["reward_model"] == ("reward_model", "model")

    plan = load_plan("r1", "tiny", ["options.dpo=false", "options.sft_init=grpo_reasoning", "options.student=cut",
                                    "options.student_layers=[0]"])
    names = {n.name for n in plan.nodes}
    assert not {"dpo", "dpo_reference", "eval_dpo"} & names and "reward_model" in names
    assert plan.node("grpo_final").inputs["model"] == ("sft", "model")
    assert plan.node("sft").inputs["model"] == ("grpo_reasoning", "model")
    assert plan.node("student").config.keep_layers == [0]
    assert plan.node("student").inputs["model"] == ("grpo_final", "model")
    assert plan.node("distill").inputs["student"] == ("student", "model")
    # every model the recipe produces is evaluated, on the same prompts
    evaluated = {n.inputs["model"][0] for n in default.nodes if n.stage == "eval"}
    assert evaluated == {"base", "sft_cold", "grpo_reasoning", "sft", "dpo", "grpo_final", "distill"}
    assert {n.inputs["prompts"] for n in default.nodes if n.stage == "eval"} == {("prompts", "prompts")}


PREFERENCE_NODES = {"pref_samples", "preference_data", "reward_model", "dpo_reference", "dpo", "eval_dpo"}


def test_r1_without_preferences_drops_them_and_dpo_and_needs_no_reward_model():
    """options.preferences=false drops DPO too, whatever options.dpo says; grpo_final's reward-model weight must
    then be 0, and the plan says so before any compute (grpo or ppo)."""
    for rl in ("grpo", "ppo"):
        with pytest.raises(ConfigError, match=re.escape(
                "node 'grpo_final': reward.weights.reward_model=0.1 scores completions with a reward model, but its "
                "`reward_model` input's source (reward_model.model) is disabled by its `when`; use --set "
                "grpo_final.reward.weights.reward_model=0, or enable a reward model source (the recipe's options: ")
                + ".*preferences=False"):
            load_plan("r1", "tiny", ["options.preferences=false", f"options.rl={rl}"])
    plan = load_plan("r1", "tiny", ["options.preferences=false", "options.dpo=true",
                                    "grpo_final.reward.weights.reward_model=0"])
    assert not PREFERENCE_NODES & {n.name for n in plan.nodes}
    assert plan.node("grpo_final").inputs == {"model": ("sft", "model"), "prompts": ("prompts", "prompts")}
    with pytest.raises(ConfigError, match="--set 'dpo.beta=0.3': node 'dpo' is disabled in this run"):
        load_plan("r1", "tiny", ["options.preferences=false", "grpo_final.reward.weights.reward_model=0",
                                 "dpo.beta=0.3"])


def test_the_cpu_r1_plan_spends_its_second_half_on_rft_rl_and_a_base_student():
    """The cpu profile's r1 options (issue 47 item 5): stage-3 SFT from the RL checkpoint, no preference stages, the
    base model as the distilled student, taught with the cold start's LoRA shape."""
    plan = load_plan("r1", "cpu")
    names = [n.name for n in plan.nodes]
    assert names == ["base", "prompts", "eval_base", "cold_start", "sft_cold", "eval_sft_cold", "grpo_reasoning",
                     "eval_grpo_reasoning", "rs_reasoning", "sft", "eval_sft", "grpo_final", "eval_grpo_final",
                     "traces", "distill", "eval_student"]
    assert plan.node("sft").inputs["model"] == ("grpo_reasoning", "model")
    assert plan.node("grpo_final").inputs == {"model": ("sft", "model"), "prompts": ("prompts", "prompts")}
    final = plan.node("grpo_final").config
    assert final.steps == 6 and final.reward.weights["reward_model"] == 0
    assert final.reward.weights["accuracy"] == 1.0 and final.reward.weights["overlong"] == 1.0  # merged, not replaced
    assert plan.node("distill").inputs["student"] == ("base", "model")
    distill = plan.node("distill").config
    assert (distill.lora.r, distill.lora.alpha, distill.learning_rate, distill.max_steps) == (16, 32, 1e-3, 16)
    traces = plan.node("traces").config
    assert (traces.filter, traces.num_samples, traces.max_prompts) == ("verified", 4, 64)

    cut = load_plan("r1", "cpu", ["options.student=cut", "distill.lora.r=0"])
    assert cut.node("student").inputs["model"] == ("grpo_final", "model")
    assert cut.node("distill").inputs["student"] == ("student", "model")
    assert cut.node("student").config.keep_layers == "every_2"
    with_prefs = load_plan("r1", "cpu", ["options.preferences=true", "grpo_final.reward.weights.reward_model=0.1"])
    assert PREFERENCE_NODES <= {n.name for n in with_prefs.nodes}
    assert with_prefs.node("grpo_final").inputs["model"] == ("dpo", "model")
    assert with_prefs.node("grpo_final").inputs["reward_model"] == ("reward_model", "model")


def test_profile_recipe_overlay_applies_to_that_recipe_only(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text("name: p\nmodel: tiny-random\nstages: {eval: {max_prompts: 7}}\n"
                       "recipes: {r1: {stages: {eval: {max_prompts: 5}}, nodes: {eval_base: {max_prompts: 3}},"
                       " options: {dpo: false}}}\n")
    r1 = load_plan("r1", str(profile))
    assert r1.node("eval_sft").config.max_prompts == 5 and r1.node("eval_base").config.max_prompts == 3
    assert r1.options["dpo"] is False and "dpo" not in {n.name for n in r1.nodes}
    assert load_plan("sft-eval", str(profile)).node("eval_sft").config.max_prompts == 7
    profile.write_text("name: p\nmodel: tiny-random\nrecipes: {r1: {nodes: {evl_base: {max_prompts: 3}}}}\n")
    with pytest.raises(ConfigError, match="recipes.r1: recipe 'r1' has no node 'evl_base'"):
        load_plan("r1", str(profile))
