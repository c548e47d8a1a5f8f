"""lean_decode's step against the model's own forward: the same logits and cache for Llama (with and
without grouped-query attention, padded or not, projections fused or not), Qwen2 (q/k/v biases) and a
LoRA-wrapped model; None for what it does not take; decode_rows' tokens the same with and without it."""

import copy

import pytest
import torch
from transformers import DynamicCache

from stages.modeling.models import cache_name
from stages.sampling import lean_decode
from stages.sampling.kv_decode import LEAN_CACHE_LAYERS, decode_rows, prefill_prompts
from stages.sampling.sampler import sampling_processors


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


def _compare(model, padded: bool, steps: int = 4, fuse_max_bytes: int = lean_decode.FUSE_MAX_BYTES):
    """Runs `steps` decode steps through model(...) and through lean_step from the same prefilled cache,
    feeding both the forward's argmax; returns the largest logit difference and checks the caches."""
    step = lean_decode.lean_step(model, fuse_max_bytes)
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
            ref = model(input_ids=token, attention_mask=mask2, position_ids=pos, use_cache=True, logits_to_keep=1,
                        **{cache_name(model): ref_cache}).logits[:, -1]
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


def _groups(layer) -> list[list[torch.nn.Linear]]:
    return [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            [layer.mlp.gate_proj, layer.mlp.up_proj]]


def test_projections_are_not_fused_where_the_fused_product_differs_in_a_bit():
    """The probe compares the fused product with the separate ones: a fused weight one ulp off in one element
    (MKL's strict mode on an AMD EPYC makes the fused product differ by about that) is refused, and then no layer
    is fused; the weights themselves, concatenated, are what the equality tests above fuse where it is exact."""
    model = _llama()
    layers = list(model.model.layers)
    q = _groups(layers[0])[0]
    w, b = lean_decode._concat(q)
    off = w.clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(float("inf")))
    assert not lean_decode.fuses_exactly(q, (off, b))
    real = lean_decode._concat
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(lean_decode, "_concat", lambda g: (off, b) if g is q else real(g))
        assert lean_decode.fused_projections(layers) == [(None, None)] * len(layers)


@pytest.mark.parametrize("fuse_max_bytes", [lean_decode.FUSE_MAX_BYTES, 0], ids=["fused", "unfused"])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_lean_step_equals_the_llama_forward(padded, kv_heads, fuse_max_bytes):
    """Grouped (4 query heads on 2 key/value heads) and plain attention, left-padded rows (the packed-group
    SDPA path transformers takes with a mask) and none (no mask), the projections fused (the small test
    model's default) or each its own matmul: the forward's logits, bit for bit."""
    model = _llama(kv_heads)
    layers = list(model.model.layers)
    fused = lean_decode.fused_projections(layers, fuse_max_bytes)
    # fused where the budget allows and this CPU's products give the same bits (not MKL's strict mode everywhere)
    exact = all(lean_decode.fuses_exactly(g, lean_decode._concat(g)) for g in _groups(layers[0]))
    assert all((qkv is not None and gate_up is not None) == (fuse_max_bytes > 0 and exact) for qkv, gate_up in fused)
    assert _compare(model, padded, fuse_max_bytes=fuse_max_bytes) == 0.0


def test_fused_projections_take_plain_linears_within_the_budget(monkeypatch):
    """The concatenated weights are q;k;v and gate;up in that order; LoRA-wrapped projections and forwards
    replaced by something else stay separate; rows_first_linears' replacement counts as plain; over the
    budget nothing is copied."""
    from peft import LoraConfig, get_peft_model

    from stages.sampling.rows_first import RowsFirstRule, rows_first_linears

    model = _llama()
    layer = model.model.layers[0]
    monkeypatch.setattr(lean_decode, "fuses_exactly", lambda linears, fused: True)  # the probe: its own test
    (w, b), (gu, gu_b) = lean_decode.fused_projections(list(model.model.layers))[0]
    assert b is None and gu_b is None
    assert torch.equal(w, torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                     layer.self_attn.v_proj.weight]))
    assert torch.equal(gu, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
    size = sum(p.numel() * 4 for lyr in model.model.layers for m in (lyr.self_attn.q_proj, lyr.self_attn.k_proj,
                                                                     lyr.self_attn.v_proj, lyr.mlp.gate_proj,
                                                                     lyr.mlp.up_proj) for p in m.parameters())
    assert lean_decode.fused_projections(list(model.model.layers), size)[0][0] is not None
    assert lean_decode.fused_projections(list(model.model.layers), size - 1) == [(None, None)] * 2

    with rows_first_linears(model, RowsFirstRule(1, 1000)):
        assert "forward" in vars(layer.self_attn.q_proj)
        assert all(q is not None and g is not None for q, g in lean_decode.fused_projections(list(model.model.layers)))
    layer.mlp.up_proj.forward = lambda x: torch.nn.functional.linear(x, layer.mlp.up_proj.weight)
    assert lean_decode.fused_projections([layer])[0][1] is None

    lora = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    qkv, gate_up = lean_decode.fused_projections(list(lora.get_base_model().model.layers))[0]
    assert qkv is None and gate_up is not None


def test_decode_rows_takes_the_weights_of_each_call():
    """The fused copies are made per decode_rows call: after an in-place update (a training step) the next
    call samples from the new weights, as model(...) does."""
    model = _llama()
    ids, mask = _batch(True, rows=3, width=6)
    outs = {}
    for lean in (True, False):
        torch.manual_seed(0)
        m = copy.deepcopy(model)
        runs = []
        for _ in range(2):
            with torch.no_grad():
                p_ids, p_mask, cache = prefill_prompts(m, ids, mask, 2, 6, pad_id=0)
                trace = []
                decode_rows(m, p_ids, p_mask, cache, 6, [49], 0, trace=trace, lean=lean)
                runs.append(torch.cat([t[1] for t in trace]))
                for p in m.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        outs[lean] = runs
    assert not torch.equal(outs[True][0], outs[True][1])  # the update changed the logits
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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


# ---------------------------------------------------------------------------- StaticDecode (CUDA graphs' step)


@pytest.mark.parametrize("model_fn", [lambda: _llama(2), lambda: _llama(4), lambda: _qwen2()],
                         ids=["llama-gqa", "llama", "qwen2-biases"])
@pytest.mark.parametrize("padded", [True, False])
def test_static_decode_gives_the_model_forwards_logits_step_by_step(model_fn, padded):
    """Teacher-forced through the same tokens: StaticDecode's step (fixed buffers, every column attended with
    the unwritten ones masked) gives model(...)'s logits with a growing DynamicCache."""
    model = model_fn()
    ids, mask = _batch(padded, rows=3, width=9)
    steps = 6
    with torch.no_grad():
        p_ids, p_mask, cache = prefill_prompts(model, ids, mask, 1, steps, pad_id=0)
        ref_cache = copy.deepcopy(cache)
        dec = lean_decode.StaticDecode(model, cache, p_mask, steps, graphs=False)
        token, m = p_ids[:, -1:], p_mask
        pos = (p_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
        for _ in range(steps):
            ref = model(input_ids=token, attention_mask=m, position_ids=pos, use_cache=True, logits_to_keep=1,
                        **{cache_name(model): ref_cache})
            ref_cache = getattr(ref, cache_name(model))
            got = dec.step(token, pos)
            torch.testing.assert_close(got, ref.logits[:, -1], rtol=1e-5, atol=1e-5)
            token = ref.logits[:, -1].argmax(-1, keepdim=True)
            m = torch.cat([m, m.new_ones(len(m), 1)], 1)
            pos = pos + 1
        with pytest.raises(RuntimeError, match="more than the 6 steps"):
            dec.step(token, pos)


@pytest.mark.parametrize("check_every", [1, 8])
def test_decode_static_samples_what_decode_rows_samples(check_every):
    """Sampling, rows ending early (many EOS ids): the same tokens and the same width as decode_rows (which
    drops finished rows; decode_static keeps them and checks for the end every `check_every` steps)."""
    from stages.sampling.kv_decode import decode_static

    model = _llama()
    ids, mask = _batch(True, rows=4, width=7)
    outs = []
    for fn in (decode_rows, lambda *a, **k: decode_static(*a, **k, graphs=False, check_every=check_every)):
        with torch.no_grad():
            p_ids, p_mask, cache = prefill_prompts(model, ids, mask, 3, 12, pad_id=0)
            procs = list(sampling_processors(1.0, 0, 1.0))
            torch.manual_seed(7)
            outs.append(fn(model, p_ids, p_mask, cache, 12, list(range(3, 13)), 0, warpers=procs[:-1],
                           sampler=procs[-1]))
    assert outs[0].shape[1] < 12  # every row ended before the budget: the width is the longest row's
    assert outs[1].tolist() == outs[0].tolist()


def test_the_graph_cache_generates_what_the_dynamic_cache_generates(tiny_tokenizer):
    """The backend with `cache: graph` (StaticDecode, eager on CPU) against `cache: dynamic` (decode_rows),
    sampling n=3 per prompt from the same seed; a model StaticDecode does not take falls back to decode_rows."""
    from schemas.configs import GenerationSpec
    from stages.modeling.models import build_tiny_model
    from stages.sampling.generation import TransformersBackend

    model = build_tiny_model(tiny_tokenizer, seed=3).eval()
    assert lean_decode.applies(model)
    convs = [[{"role": "user", "content": "What is " + "2*" * i + "3?"}] for i in range(5)]
    got = {}
    for cache in ("dynamic", "graph"):
        spec = GenerationSpec(max_new_tokens=16, temperature=1.0, batch_size=3, cache=cache)
        results, _ = TransformersBackend(model, tiny_tokenizer).generate(convs, spec, n=3, seed=5, progress=False)
        got[cache] = [[c.token_ids for c in r] for r in results]
    assert got["graph"] == got["dynamic"]
