"""What changes on a GPU, checked on one: bf16 autocast training against fp32, r1flow's own decode loop
against `generate()`, packed log-probs against whole rows, and a GRPO stage end to end on CUDA.

Every test here is marked `cuda` and skipped without a CUDA device (CI has none); on a lent GPU machine
`benchmarks/gpu_check.sh --device cuda` runs them first. The tiny model and tokenizer are the CPU
tests' (tests/conftest.py), moved to the GPU. Matmuls stay in true fp32 (TF32 off, torch's default),
so the fp32 comparisons hold to float rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _true_fp32():
    """TF32 would make fp32 matmuls round to 10 mantissa bits: the fp32 references must be fp32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bf16_autocast_training_step_matches_fp32(tiny_tokenizer):
    """One forward/backward of the tiny model on 4 rows of 48 tokens, in fp32 and under bf16 autocast (what
    `precision: auto` picks on a GPU): both losses finite, within 0.05 nats of each other (bf16 keeps 8 bits
    of mantissa; the loss is ~ln(136) = 4.9), gradients pointing the same way (cosine > 0.99); then five
    AdamW steps under autocast on that batch lower the loss."""
    from stages.modeling.models import build_tiny_model

    model = build_tiny_model(tiny_tokenizer, seed=0).to(DEVICE).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, len(tiny_tokenizer), (4, 48), generator=g).to(DEVICE)
    losses, grads = {}, {}
    for name, enabled in (("fp32", False), ("bf16", True)):
        model.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16, enabled=enabled):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[name], grads[name] = loss.item(), _flat_grads(model).float()
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert abs(losses["bf16"] - losses["fp32"]) < 0.05, losses
    assert torch.isfinite(grads["bf16"]).all()
    assert torch.nn.functional.cosine_similarity(grads["bf16"], grads["fp32"], dim=0).item() > 0.99

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = []
    for _ in range(6):
        opt.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        curve.append(loss.item())
    assert all(math.isfinite(v) for v in curve) and curve[-1] < curve[0] - 0.1, curve


def _prompts(tokenizer, n: int = 5) -> list[str]:
    from stages.sampling.completions import render_prompts

    return render_prompts(tokenizer, [[{"role": "user", "content": "What is " + "1+" * (3 * i) + "1?"}]
                                      for i in range(n)])


def test_decode_rows_gives_generate_greedy_tokens_on_cuda(tiny_tokenizer):
    """Left-padded prompts of different lengths, greedy, fp32: r1flow's decode loop (`decode_rows`, with and
    without the lean step) gives `generate()`'s tokens on CUDA, row by row up to each row's EOS."""
    from stages.modeling.models import build_tiny_model
    from stages.sampling.completions import stop_token_ids
    from stages.sampling.kv_decode import decode_rows, prefill_prompts

    model = build_tiny_model(tiny_tokenizer, seed=3).to(DEVICE).eval()
    tiny_tokenizer.padding_side = "left"
    enc = tiny_tokenizer(_prompts(tiny_tokenizer), return_tensors="pt", padding=True,
                         add_special_tokens=False).to(DEVICE)
    eos, pad, new = stop_token_ids(tiny_tokenizer), tiny_tokenizer.pad_token_id, 24

    def until_eos(rows: torch.Tensor) -> list[list[int]]:
        return [r[: next((k + 1 for k, t in enumerate(r) if t in eos), len(r))] for r in rows.tolist()]

    with torch.no_grad():
        ref = model.generate(**enc, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad,
                             temperature=None, top_p=None, top_k=None)[:, enc["input_ids"].shape[1]:]
        expected = until_eos(ref)
        assert max(len(r) for r in expected) > 4  # not a batch that stops at once
        for lean in (True, False):
            p_ids, p_mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], 1, new, pad_id=pad)
            got = decode_rows(model, p_ids, p_mask, cache, new, eos, pad, lean=lean)
            assert until_eos(got) == expected, f"lean={lean}"


def test_backend_greedy_equals_generate_on_cuda(tiny_tokenizer):
    """The generation backend as the stages call it (cache: dynamic, prompts sorted by length, one batch) on
    CUDA: the same completions as plain `generate()`, each prompt twice (n=2)."""
    from schemas.configs import GenerationSpec
    from stages.modeling.models import build_tiny_model
    from stages.sampling.completions import stop_token_ids
    from stages.sampling.generation import TransformersBackend

    model = build_tiny_model(tiny_tokenizer, seed=3).to(DEVICE).eval()
    convs = [[{"role": "user", "content": "What is " + "2*" * i + "3?"}] for i in range(4)]
    results, stats = TransformersBackend(model, tiny_tokenizer).generate(
        convs, GenerationSpec(max_new_tokens=20, temperature=0.0, batch_size=4), n=2, progress=False)
    eos = stop_token_ids(tiny_tokenizer)
    tiny_tokenizer.padding_side = "left"
    for conv, got in zip(convs, results, strict=True):
        text = tiny_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        enc = tiny_tokenizer([text], return_tensors="pt", add_special_tokens=False).to(DEVICE)
        with torch.no_grad():
            row = model.generate(**enc, do_sample=False, max_new_tokens=20, eos_token_id=eos,
                                 pad_token_id=tiny_tokenizer.pad_token_id, temperature=None, top_p=None,
                                 top_k=None)[0, enc["input_ids"].shape[1]:].tolist()
        row = row[: next((k + 1 for k, t in enumerate(row) if t in eos), len(row))]
        assert [list(c.token_ids) for c in got] == [row, row]
    assert stats.new_tokens > 0


@pytest.mark.parametrize("one_row", [False, True])
def test_packed_prefix_rows_equal_whole_rows_on_cuda_fp32(tiny_tokenizer, one_row):
    """Prompts sharing 6 tokens, completions of different lengths (one empty), packed into one decoder call
    with a 4D mask (on CUDA, SDPA's memory-efficient kernel) against each prompt + completion as its own
    right-padded row: the same log-probs, entropies and parameter gradients in fp32."""
    from stages import grpo
    from stages.modeling.logprobs import token_logprobs
    from stages.modeling.models import build_tiny_model
    from stages.modeling.prefix_sharing import packed_prefix_rows

    model = build_tiny_model(tiny_tokenizer, seed=5).to(DEVICE).train()
    common = [5, 6, 7, 8, 9, 10]
    prompts = [common + [11, 12, 13], common + [14], common + [15, 16, 17, 18, 19]]
    prompt_of_row = [0, 0, 1, 2, 1]
    comps = [[20, 21, 22], [23], [], [24, 25, 26, 27], [28, 29]]
    batch = grpo.build_batch([prompts[k] for k in prompt_of_row], comps, pad_id=0, keep=[True] * len(comps))
    ids, attn, mask = (batch[k].to(DEVICE) for k in ("input_ids", "attention_mask", "loss_mask"))
    ref, ref_ent = token_logprobs(model, ids, attn, with_entropy=True)
    (ref * mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, ent = packed_prefix_rows(model, prompts, comps, prompt_of_row, pad_id=0, width=ids.shape[1], device=DEVICE,
                                  with_entropy=True, n_common=6, one_row=one_row)
    scored = mask > 0
    assert got.shape == mask.shape and (got[~scored] == 0).all()
    torch.testing.assert_close(got[scored], ref[scored], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent[scored], ref_ent[scored], rtol=1e-5, atol=2e-5)
    (got * mask).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_grpo_stage_runs_on_cuda_in_bf16(tmp_path, tiny_model_input, digit_prompts):
    """The GRPO stage end to end on CUDA (rollouts through the decode loop, packed or cached log-probs under
    bf16 autocast, the update): two steps, precision auto resolves to bf16, every logged number finite."""
    from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec
    from stages import grpo
    from stages.base import LocalContext

    ctx = LocalContext(tmp_path / "run", seed=0, device=DEVICE)
    cfg = GRPOConfig(steps=2, prompts_per_step=4, group_size=4, learning_rate=1e-3, lora=LoraSpec(r=0),
                     generation=GenerationSpec(max_new_tokens=12, temperature=1.0, batch_size=4),
                     minibatch_size=8, checkpoint_every=100)
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "time/step" in m]
    assert len(steps) == 2
    assert ctx.params["precision"] == "torch.bfloat16"
    for m in steps:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m


@pytest.mark.parametrize("autocast", [False, True])
def test_graph_decode_replays_what_the_eager_steps_compute_on_cuda(tiny_tokenizer, autocast):
    """StaticDecode captured as a CUDA graph (two eager warm-up steps, then replays) gives the eager steps'
    tokens, greedy, in fp32 and under bf16 autocast (capture with autocast's weight cache off)."""
    from stages.modeling.models import build_tiny_model
    from stages.sampling.completions import stop_token_ids
    from stages.sampling.kv_decode import decode_static, prefill_prompts

    model = build_tiny_model(tiny_tokenizer, seed=3).to(DEVICE).eval()
    tiny_tokenizer.padding_side = "left"
    enc = tiny_tokenizer(_prompts(tiny_tokenizer), return_tensors="pt", padding=True,
                         add_special_tokens=False).to(DEVICE)
    eos, pad, new = stop_token_ids(tiny_tokenizer), tiny_tokenizer.pad_token_id, 24
    outs = []
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cuda", enabled=False)
    for graphs in (False, True):
        with torch.no_grad(), ctx:
            p_ids, p_mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], 1, new, pad_id=pad)
            outs.append(decode_static(model, p_ids, p_mask, cache, new, eos, pad, graphs=graphs))
    assert outs[0].shape[1] > 4
    assert outs[1].tolist() == outs[0].tolist()


def test_sampling_stages_sample_under_bf16_autocast_on_cuda(monkeypatch, tmp_path, tiny_model_input, digit_prompts):
    """Issue 48: eval, rejection_sampling, distill_traces and step_labels sampled in fp32 on a GPU; now under bf16
    autocast, as the trainers (`precision: auto`), where the GPU supports bf16."""
    from tests.sampling_precision import SAMPLING_STAGES, sampling_dtypes

    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    assert sampling_dtypes(monkeypatch, tmp_path, tiny_model_input, digit_prompts, DEVICE) == dict.fromkeys(
        SAMPLING_STAGES, want)
