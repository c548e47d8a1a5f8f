"""GRPO with a colocated vLLM engine, against a stand-in for vLLM (it needs CUDA and is not installed here).

The stand-in (`fake_vllm` in conftest) is an `LLM` with the surface of vLLM that r1flow uses: it holds
its own transformers copy of the model directory, samples from it, and loads weights by checkpoint name
the way vLLM's `load_weights` does (an unknown name is an error). So the tests pin r1flow's side of the
contract: one engine per process on the external_launcher executor, the trainer's weights pushed in
before every rollout after the first (the engine then samples from the trained weights, not the
directory's), the prefix cache dropped with each push, LoRA adapters folded in under the base
checkpoint's names, prompts handed over as the token ids the trainer scores. What they cannot show is
that a real vLLM build accepts the calls; that needs a GPU.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec, ResourcesSpec, RewardSpec
from schemas.errors import ModelError
from stages import grpo
from stages.base import LocalContext
from stages.sampling.completions import render_prompts
from stages.sampling.vllm_backend import VLLMBackend, policy_weights


def _cfg(**kw) -> GRPOConfig:
    base = dict(steps=3, prompts_per_step=2, group_size=2, learning_rate=1e-2, lora=LoraSpec(r=0),
                generation=GenerationSpec(max_new_tokens=4, temperature=1.0, batch_size=2, backend="vllm"),
                minibatch_size=4, checkpoint_every=100, dynamic_sampling=False,
                reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=3, overlong_buffer=2))
    base.update(kw)
    return GRPOConfig(**base)


def test_the_engine_samples_from_the_trained_weights(fake_vllm, tmp_path, tiny_model_input, digit_prompts,
                                                     tiny_tokenizer):
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(_cfg(), {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    (engine,) = fake_vllm.made
    assert engine.kwargs == {"distributed_executor_backend": "external_launcher"}
    assert engine.memory == pytest.approx(0.3)
    # three rollouts: the directory's weights, then a push before each later one, each dropping the prefix cache
    assert len(engine.weights_at_generate) == 3 and len(engine.inner.pushes) == 2 and engine.resets == 2
    names = {n for n, _ in engine.hf.named_parameters()}
    assert all(set(push) == names for push in engine.inner.pushes)  # every weight, under its checkpoint name
    first, second, third = engine.weights_at_generate
    assert any(not torch.equal(first[n], second[n]) for n in names)  # the step changed what the engine samples from
    assert all(torch.equal(second[n], engine.inner.pushes[0][n]) for n in names)
    assert any(not torch.equal(second[n], third[n]) for n in names)
    # the prompts went in as the token ids the trainer scores: chat template, no special tokens added
    texts = render_prompts(tiny_tokenizer, [[{"role": "user", "content": f"Say {i}."}] for i in range(10)])
    expected = {tuple(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts}
    assert engine.prompts and {tuple(p) for p in engine.prompts} <= expected
    assert engine.shut_down  # the stage shut its engine down when it ended (generation.release)


def test_lora_weights_reach_the_engine_under_the_base_checkpoint_names(fake_vllm, tmp_path, tiny_model_input,
                                                                     digit_prompts):
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(_cfg(steps=2, lora=LoraSpec(r=4, alpha=8, merge=False)),
             {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    (engine,) = fake_vllm.made
    (push,) = engine.inner.pushes
    assert set(push) == {n for n, _ in engine.hf.named_parameters()}


def test_policy_weights_fold_lora_out_of_place(tiny_model):
    from peft import LoraConfig, get_peft_model

    names = {n for n, _ in tiny_model.named_parameters()}
    peft_model = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at 0: without this the fold changes nothing
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    got = dict(policy_weights(peft_model))
    assert set(got) == names
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    for n in names:
        torch.testing.assert_close(got[n], merged[n].detach(), rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], before["base_model.model." + q.replace("q_proj.", "q_proj.base_layer.")])
    for n, p in peft_model.named_parameters():  # the trained model untouched, bit for bit
        assert torch.equal(p, before[n])


def test_the_colocated_engine_joins_a_world_of_one(fake_vllm, tiny_model_input, tiny_tokenizer):
    import os

    backend = VLLMBackend(tiny_model_input.model_dir, tiny_tokenizer, seed=5, colocated=True)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    assert backend.llm.seed == 5  # + rank 0


def test_config_and_input_errors_come_before_any_model_is_loaded(fake_vllm, tmp_path, digit_prompts):
    with pytest.raises(ValueError, match="vllm with resources.distributed_type=fsdp is not built"):
        _cfg(resources=ResourcesSpec(num_processes=2, distributed_type="fsdp"), prompts_per_step=2)
    assert _cfg(resources=ResourcesSpec(num_processes=2), prompts_per_step=2).generation.backend == "vllm"
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text("{}")
    adapter = SimpleNamespace(model_dir=adapter_dir, label="sft.model (adapter)", fingerprint="f" * 64)
    with pytest.raises(ModelError, match=r"and this input is neither \(no config.json, no resolved base model\)"):
        grpo.run(_cfg(), {"model": adapter, "prompts": digit_prompts}, LocalContext(tmp_path / "run"))
    assert not fake_vllm.made
