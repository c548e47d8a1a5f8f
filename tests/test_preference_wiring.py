"""The plan wires every preference_optimization node for its loss before any compute (the stage's plan hook
`wire_plan`, from `stages.preference_optimization.LOSS_NEEDS`): KTO trains on preference_data's unpaired rows
and its reference node scores those rows and KTO's mismatched (KL) pairs; SimPO and ORPO read no reference, so a reference node nothing else reads
is left out; a reference scores at its consumer's max_length. A `--set` that contradicts the wiring
fails at plan time with the `--set` that fixes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.plan.recipes import RECIPE_DIR, available, load_plan
from schemas.errors import ConfigError
from stages import get_stage
from stages.math import preference as pl
from stages.preference_optimization import LOSS_NEEDS

LOSSES = tuple(pl.LOSSES)  # every loss of the table (tests/test_stage_tables.py: the same as the config's Literal)
# every recipe with a preference_optimization node (rlhf, r1, nightly-preferences today), found by walking them
RECIPES = [r for r in available(RECIPE_DIR)
           if any(n.stage == "preference_optimization" for n in load_plan(r, "tiny", run_checks=False).nodes)]


def kind_of(plan, src: tuple[str, str]) -> str:
    up, out = src
    return get_stage(plan.node(up).stage).OUTPUTS[out]


def test_the_registry_and_the_table_agree():
    assert set(LOSS_NEEDS) == set(LOSSES)
    assert {loss for loss, n in LOSS_NEEDS.items() if not n.reference} == {"simpo", "orpo"}
    assert {loss for loss, n in LOSS_NEEDS.items() if n.kl} == {"kto"}
    assert {loss for loss, n in LOSS_NEEDS.items() if n.data[0] == "unpaired"} == {"kto"}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_loss_plans_in_every_recipe_with_a_preference_node(recipe, loss):
    assert {"rlhf", "r1", "nightly-preferences"} <= set(RECIPES)
    plan = load_plan(recipe, "tiny", [f"dpo.loss={loss}"])
    dpo = plan.node("dpo")
    assert dpo.config.loss == loss
    assert kind_of(plan, dpo.inputs["preferences"]) == ("unpaired" if loss == "kto" else "preferences")
    if loss in ("simpo", "orpo"):
        assert "reference" not in dpo.inputs
        assert not any(n.stage == "reference_logprobs" for n in plan.nodes)
        assert "reference-free" in plan.dropped["dpo_reference"]
        return
    ref = plan.node(dpo.inputs["reference"][0])
    assert ref.name == "dpo_reference" and ref.stage == "reference_logprobs"
    # the reference scores exactly the rows dpo trains on, from dpo's model, at dpo's max_length
    assert ref.inputs == {"model": dpo.inputs["model"], "preferences": dpo.inputs["preferences"]}
    assert ref.config.include_kl is (loss == "kto")
    assert ref.config.max_length == dpo.config.max_length
    assert not plan.dropped


def test_kto_in_rlhf_trains_on_the_unpaired_rows_with_kl_pairs():
    plan = load_plan("rlhf", "tiny", ["dpo.loss=kto"])
    assert plan.node("dpo").inputs == {"model": ("sft", "model"), "preferences": ("preference_data", "unpaired"),
                                       "reference": ("dpo_reference", "logprobs")}
    ref = plan.node("dpo_reference")
    assert ref.inputs["preferences"] == ("preference_data", "unpaired") and ref.config.include_kl
    assert [n.name for n in plan.nodes].index("dpo_reference") < [n.name for n in plan.nodes].index("dpo")
    # the default loss leaves the recipe's wiring as written
    plain = load_plan("rlhf", "tiny")
    assert plain.node("dpo").inputs["preferences"] == ("preference_data", "preferences")
    assert not plain.node("dpo_reference").config.include_kl


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


PREFIX = """name: custom
nodes:
  base: {stage: import_model, config: {ref: tiny-random}}
  prompts: {stage: prompts}
  samples: {stage: rejection_sampling, inputs: {model: base.model, prompts: prompts.prompts}}
  pairs: {stage: preference_data, inputs: {samples: samples.samples}}
"""


def test_the_rule_keys_on_the_stage_not_the_node_name(tmp_path):
    """Other node names, KTO chosen in the recipe itself, and a pairs input written as unpaired under a
    paired loss: each is wired by what its loss reads."""
    recipe = write(tmp_path, PREFIX + """  align_ref: {stage: reference_logprobs, inputs: {model: base.model, preferences: pairs.preferences}}
  align: {stage: preference_optimization, config: {loss: kto},
          inputs: {model: base.model, preferences: pairs.preferences, reference: align_ref.logprobs}}
  other: {stage: preference_optimization, inputs: {model: base.model, preferences: pairs.unpaired}}
""")
    plan = load_plan(recipe, "tiny")
    assert plan.node("align").inputs["preferences"] == plan.node("align_ref").inputs["preferences"] == ("pairs", "unpaired")
    assert plan.node("align_ref").config.include_kl
    assert plan.node("other").inputs["preferences"] == ("pairs", "preferences")  # dpo: the pairs of the same node
    assert load_plan(recipe, "tiny", ["align.loss=orpo"]).dropped == {
        "align_ref": "align.loss=orpo is reference-free, so 'align' reads no reference log-probs"}


def test_a_reference_shared_by_disagreeing_consumers_fails(tmp_path):
    recipe = write(tmp_path, PREFIX + """  ref: {stage: reference_logprobs, inputs: {model: base.model, preferences: pairs.preferences}}
  a: {stage: preference_optimization, inputs: {model: base.model, preferences: pairs.preferences, reference: ref.logprobs}}
  b: {stage: preference_optimization, inputs: {model: base.model, preferences: pairs.preferences, reference: ref.logprobs}}
""")
    assert load_plan(recipe, "tiny").node("ref").config.include_kl is False
    with pytest.raises(ConfigError, match="node 'ref' is the reference of 'a', 'b', which differ in model, data or "
                                          "max_length; give each its own reference_logprobs node"):
        load_plan(recipe, "tiny", ["b.loss=kto"])


@pytest.mark.parametrize("recipe", ["rlhf", "r1"])
def test_a_contradicting_set_fails_before_compute_with_the_fix(recipe, tmp_path, monkeypatch, capsys):
    from flows.cli.app import main

    home = tmp_path / "untouched"
    monkeypatch.setenv("R1FLOW_HOME", str(home))
    assert main(["run", "--recipe", recipe, "--profile", "tiny", "--set", "dpo.loss=kto",
                 "--set", "dpo_reference.include_kl=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("r1flow: error: --set dpo_reference.include_kl=false contradicts dpo.loss=kto: node 'dpo_reference' "
                   "must score KTO's mismatched pairs (field include_kl); use --set dpo_reference.include_kl=true, "
                   "or drop that --set")
    assert not home.exists()
    plan = load_plan(recipe, "tiny", ["dpo.loss=kto", "dpo_reference.include_kl=true"])  # the fix it names
    assert plan.node("dpo_reference").config.include_kl
    assert load_plan(recipe, "tiny", ["dpo_reference.include_kl=false"]).node("dpo_reference").config.include_kl is False


def test_the_reference_follows_its_consumer_max_length():
    assert load_plan("rlhf", "tiny", ["dpo.max_length=128"]).node("dpo_reference").config.max_length == 128
    with pytest.raises(ConfigError, match=r"--set dpo_reference.max_length=128 differs from dpo.max_length=256: node "
                                          r"'dpo_reference' must score at its consumer's max_length; add --set "
                                          r"dpo.max_length=128, or drop that --set"):
        load_plan("rlhf", "tiny", ["dpo_reference.max_length=128"])
    assert load_plan("rlhf", "tiny", ["dpo_reference.max_length=128", "dpo.max_length=128"]).node("dpo").config.max_length == 128


def test_a_node_left_out_says_why():
    plan = load_plan("rlhf", "tiny", ["dpo.loss=simpo"])
    with pytest.raises(ConfigError, match="node 'dpo_reference' is not in this run: dpo.loss=simpo is reference-free"):
        plan.node("dpo_reference")


# ---------------------------------------------------------------------------- KTO through the planned DAG


@pytest.mark.slow
def test_kto_trains_through_the_planned_dag(tmp_path, tiny_model_input):
    """The rlhf plan's preference_data -> dpo_reference -> dpo nodes, as the pipeline runs them
    (`execute_stage`: store, cache keys, manifests with parents, MLflow), from a tiny model and
    scored samples: the KTO reference scores the unpaired rows and their KL pairs, and dpo reads it."""
    import shutil

    from flows.run.pipeline import execute_stage, node_key
    from flows.servers.settings import Settings
    from flows.store.artifacts import ArtifactStore
    from schemas.artifacts import Producer
    from schemas.datasets import from_rows
    from stages.base import LocalContext, write_dataset

    home = tmp_path / "home"
    s = Settings(home=str(home), store=str(home), tracking_uri=f"sqlite:///{home}/mlflow.db")
    store = ArtifactStore(s.store, home=s.home)

    def put(path: Path, kind: str, schema: str) -> str:
        staged = store.new_staging_dir()
        shutil.copytree(path, staged, dirs_exist_ok=True)
        return store.publish(staged, kind=kind, schema=schema, parents=[],
                             producer=Producer(stage="test", stage_version="0", config_hash="")).fingerprint

    samples = [{"prompt_id": f"q{p}", "messages": [{"role": "user", "content": f"What is {p} + {p}?"}],
                "completion": f"{2 * p}" if i == 0 else f"{p}{i} or so", "sample_index": i, "reward": 1.0 - i / 2,
                "reward_components": "{}", "correct": i == 0, "num_tokens": 3, "finish_reason": "stop",
                "metadata": json.dumps({"task": "add"})} for p in range(12) for i in range(2)]
    data = write_dataset(LocalContext(tmp_path / "s"), "samples", from_rows(samples, "samples"), "samples")
    upstream = {"sft": {"model": put(tiny_model_input.path, "model", "model")},
                "rejection_sampling": {"samples": put(data.path, "dataset", "samples")}}

    plan = load_plan("rlhf", "tiny", ["dpo.loss=kto", "dpo.max_steps=4"])
    results = {}
    for name in ("preference_data", "dpo_reference", "dpo"):
        node = plan.node(name)
        key, inputs, _ = node_key(node, upstream)
        results[name] = execute_stage(node=name, stage=node.stage, config=node.config_dict, inputs=inputs,
                                      seed=node.seed, key=key, parent_run_id=None, settings=s.to_dict(),
                                      experiment="r1flow/test-kto")
        upstream[name] = results[name]["outputs"]
    assert results["dpo_reference"]["metrics"]["completions"] == 2 * 24  # 24 unpaired rows and one KL pair each
    dpo = results["dpo"]
    assert dpo["metrics"]["trained_steps"] == 4 and "eval_kl" in dpo["metrics"]
    from mlflow.tracking import MlflowClient

    params = MlflowClient(s.tracking_uri).get_run(dpo["mlflow_run_id"]).data.params
    assert params["config.loss"] == "kto" and params["reference"] == "cached"
    assert params["units_train"] == "22"  # rows, not pairs: 24 minus eval_fraction 0.1 of them
