"""lean_decode's step against the model's own forward: the same logits and cache for Llama (with and
without grouped-query attention, padded or not), Qwen2 (q/k/v biases) and a LoRA-wrapped model;
None for what it does not take; decode_rows' tokens the same with and without it."""

import copy

import pytest
import torch
from transformers import DynamicCache

from stages import lean_decode
from stages.generation import LEAN_CACHE_LAYERS, decode_rows, prefill_prompts, sampling_processors


def _distinct_norms(model):
    """Norm weights start at 1 in every layer: make each differ, so using the wrong norm would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _llama(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)
    return _distinct_norms(LlamaForCausalLM(cfg).eval())


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **kw)
    return _distinct_norms(Qwen2ForCausalLM(cfg).eval())


def _batch(padded: bool, rows: int = 3, width: int = 9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    if padded:
        mask[0, :4] = 0
        mask[2, :1] = 0
        ids[mask == 0] = 0
    return ids, mask


def _compare(model, padded: bool, steps: int = 4):
    """Runs `steps` decode steps through model(...) and through lean_step from the same prefilled cache,
    feeding both the forward's argmax; returns the largest logit difference and checks the caches."""
    step = lean_decode.lean_step(model)
    assert step is not None
    ids, mask = _batch(padded)
    with torch.no_grad():
        _, mask2, cache = prefill_prompts(model, ids, mask, 2, steps, pad_id=0)
        ref_cache, lean_cache = cache, copy.deepcopy(cache)
        assert lean_decode.takes_cache(lean_cache, LEAN_CACHE_LAYERS)
        token = ids.repeat_interleave(2, 0)[:, -1:]
        pos = (mask2.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        worst = 0.0
        for _ in range(steps):
            ref = model(input_ids=token, attention_mask=mask2, position_ids=pos, past_key_values=ref_cache,
                        use_cache=True, logits_to_keep=1).logits[:, -1]
            got = step(token, mask2, pos, lean_cache, not bool(mask2.all()))
            assert got.shape == ref.shape
            worst = max(worst, (got - ref).abs().max().item())
            token = ref.argmax(-1, keepdim=True)
            mask2 = torch.cat([mask2, mask2.new_ones(len(mask2), 1)], 1)
            pos = pos + 1
        for a, b in zip(ref_cache.layers, lean_cache.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
            torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
    return worst


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_lean_step_equals_the_llama_forward(padded, kv_heads):
    """Grouped (4 query heads on 2 key/value heads) and plain attention, left-padded rows (the packed-group
    SDPA path transformers takes with a mask) and none (no mask): the forward's logits, bit for bit."""
    assert _compare(_llama(kv_heads), padded) == 0.0


def test_lean_step_equals_the_qwen2_forward_with_biases():
    model = _qwen2()
    with torch.no_grad():
        for layer in model.model.layers:  # make the q/k/v biases matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    assert _compare(model, padded=True) == 0.0


def test_lean_step_runs_lora_adapters_as_the_peft_forward_does():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at 0: without this the adapters change nothing
    model.eval()
    assert _compare(model, padded=True) == 0.0


def test_lean_step_declines_models_whose_step_it_does_not_compute():
    eager = _llama()
    eager.config._attn_implementation = "eager"
    assert lean_decode.lean_step(eager) is None
    sliding = _qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert any(a.self_attn.sliding_window is not None for a in sliding.model.layers)
    assert lean_decode.lean_step(sliding) is None
    assert lean_decode.lean_step(_qwen2()) is not None

    from transformers import GPT2Config, GPT2LMHeadModel

    assert lean_decode.lean_step(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))) is None


def test_takes_cache_only_filled_full_attention_layers():
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    k = torch.zeros(1, 2, 3, 4)
    full = DynamicCache()
    full.update(k, k, 0)
    assert lean_decode.takes_cache(full)
    assert not lean_decode.takes_cache(None)
    assert not lean_decode.takes_cache(DynamicCache())  # nothing in it yet
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=2)]
    sliding.update(k, k, 0)
    assert not lean_decode.takes_cache(sliding)
    assert type(full.layers[0]) is DynamicLayer


@pytest.mark.parametrize("padded", [True, False])
def test_decode_rows_samples_the_same_with_and_without_the_lean_step(padded):
    """Sampling, with rows ending early (many EOS ids) so decode_rows drops them mid-way: the same tokens
    and the same logits per step whether each step runs through lean_step or model(...)."""
    model = _llama()
    ids, mask = _batch(padded, rows=4, width=7)
    outs, traces = [], []
    for lean in (True, False):
        with torch.no_grad():
            p_ids, p_mask, cache = prefill_prompts(model, ids, mask, 3, 12, pad_id=0)
            procs = list(sampling_processors(1.0, 0, 1.0))
            torch.manual_seed(7)
            trace = []
            outs.append(decode_rows(model, p_ids, p_mask, cache, 12, list(range(3, 13)), 0, warpers=procs[:-1],
                                    sampler=procs[-1], trace=trace, lean=lean))
            traces.append(trace)
    assert outs[0].tolist() == outs[1].tolist()
    assert len(traces[0]) == len(traces[1]) and len(traces[0][-1][0]) < 12  # rows were dropped
    for (live_a, a), (live_b, b) in zip(*traces, strict=True):
        assert live_a.tolist() == live_b.tolist()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
