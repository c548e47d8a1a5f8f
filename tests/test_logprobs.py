"""Chunked per-token log-probs equal the full-logits computation, in value and in gradient."""

import pytest
import torch

from stages.math.supervised import IGNORE, masked_token_loss
from stages.modeling import models
from stages.modeling.logprobs import head_logprobs, linear_logprobs, token_logprobs
from tests.conftest import assert_matches_whole_rows


@pytest.fixture()
def batch(tiny_tokenizer):
    torch.manual_seed(0)
    ids = torch.randint(3, len(tiny_tokenizer), (3, 11))
    attn = torch.ones_like(ids)
    attn[2, 7:] = 0  # a right-padded row
    return ids, attn


def _full(model, ids, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    full = torch.log_softmax(logits, -1)
    return full.gather(-1, ids[:, 1:, None]).squeeze(-1), -(full.exp() * full).sum(-1)


@pytest.mark.parametrize("chunk", [0, 1, 4, 7, 30, 4096])
@pytest.mark.parametrize("lora_r", [0, 4])
def test_chunked_logprobs_match_full_logits_values_and_grads(tiny_tokenizer, batch, chunk, lora_r):
    from schemas.configs import LoraSpec

    ids, attn = batch
    model = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=0), LoraSpec(r=lora_r))
    ref, ref_ent = _full(model, ids, attn)
    (ref * attn[:, 1:]).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    got, ent = token_logprobs(model, ids, attn, chunk_tokens=chunk, with_entropy=True)
    assert got.shape == (3, 10) and ent.shape == (3, 10) and not ent.requires_grad
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    (got * attn[:, 1:]).sum().backward()
    assert ref_grads
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_targets_reproduce_the_sft_masked_loss(tiny_tokenizer, batch):
    ids, attn = batch
    model = models.build_tiny_model(tiny_tokenizer, seed=0)
    labels = ids.clone()
    labels[:, :4] = IGNORE  # the prompt
    labels[attn == 0] = IGNORE
    expected, n = masked_token_loss(model(input_ids=ids, attention_mask=attn).logits, labels)
    logp, _ = token_logprobs(model, ids, attn, chunk_tokens=5, targets=labels[:, 1:].clamp(min=0))
    got = -(logp * (labels[:, 1:] != IGNORE)).sum()
    assert n == int((labels[:, 1:] != IGNORE).sum()) and n > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 3, 4096])
def test_positions_compute_only_the_scored_tokens_with_the_same_values_and_grads(tiny_tokenizer, batch, chunk):
    """The head at the masked positions alone: equal values there, exact 0 elsewhere, and the
    gradient of a loss over those positions equals the full computation's."""
    ids, attn = batch
    positions = torch.zeros(3, 10, dtype=torch.bool)
    positions[0, 5:] = True
    positions[1, [2, 3, 9]] = True
    positions[2, 3:6] = True  # row 2 is padded from 7 on
    model = models.build_tiny_model(tiny_tokenizer, seed=0)
    ref, ref_ent = _full(model, ids, attn)
    (ref * positions).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    got, ent = token_logprobs(model, ids, attn, chunk_tokens=chunk, with_entropy=True, positions=positions)
    torch.testing.assert_close(got[positions], ref[positions], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[positions], ref_ent.detach()[positions], rtol=1e-5, atol=1e-5)
    assert (got[~positions] == 0).all() and (ent[~positions] == 0).all()
    got.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_positions_gives_zeros_and_no_error(tiny_tokenizer, batch):
    ids, attn = batch
    model = models.build_tiny_model(tiny_tokenizer, seed=0)
    got, _ = token_logprobs(model, ids, attn, chunk_tokens=4, positions=torch.zeros(3, 10, dtype=torch.bool))
    assert got.shape == (3, 10) and (got == 0).all()


def test_linear_logprobs_hand_computed():
    """hidden [1, 0], head rows [1, 0], [0, 1], [0, 0]: logits [1, 0, 0], target 0.
    log p = 1 - log(e + 2) = -0.551445; d/dlogits = onehot - softmax = [0.423883, -0.211942, -0.211942],
    so d/dhidden = [0.423883, -0.211942]; entropy = 0.975328."""
    hidden = torch.tensor([[1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    logp, entropy = linear_logprobs(hidden, weight, None, torch.tensor([0]), chunk_tokens=4096, with_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([-0.551445]), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, torch.tensor([0.975328]), rtol=0, atol=1e-6)
    logp.sum().backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[0.423883, -0.211942]]), rtol=0, atol=1e-6)
    # d/dweight[v] = (onehot - softmax)[v] * hidden
    torch.testing.assert_close(weight.grad, torch.tensor([[0.423883, 0.0], [-0.211942, 0.0], [-0.211942, 0.0]]),
                               rtol=0, atol=1e-6)


def _reference_head(hidden, head, targets, grad):
    logp = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    (logp * grad).sum().backward()
    return logp.detach()


@pytest.mark.parametrize("chunk", [1, 5, 13, 4096])  # recomputed per chunk (n > chunk) and kept (n <= chunk)
def test_linear_logprobs_with_bias_and_a_frozen_weight_matches_autograd(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True)
    head.weight.requires_grad_(False)  # as under LoRA: only the bias and the hidden states get gradients
    hidden = torch.randn(13, 8, requires_grad=True)
    targets, grad = torch.randint(0, 50, (13,)), torch.randn(13)
    ref = _reference_head(hidden, head, targets, grad)
    ref_hidden, ref_bias = hidden.grad.clone(), head.bias.grad.clone()
    hidden.grad, head.bias.grad = None, None
    got, entropy = linear_logprobs(hidden, head.weight, head.bias, targets, chunk_tokens=chunk)
    assert entropy is None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    (got * grad).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, ref_bias, rtol=1e-5, atol=1e-6)
    assert head.weight.grad is None


def test_fused_head_under_bf16_autocast_matches_the_module_path():
    """Under autocast the matmuls run in bf16 as nn.Linear's would: the fused path and the
    checkpointed module path agree to bf16 rounding, in values and gradients."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    hidden = torch.randn(1, 20, 16, requires_grad=True)
    targets, grad = torch.randint(0, 64, (1, 20)), torch.randn(1, 20)
    results = []
    for fused in (False, True):
        hidden.grad, head.weight.grad = None, None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = head_logprobs(head, hidden, targets, None, chunk_tokens=7, with_entropy=False, fused=fused)
        assert logp.dtype == torch.float32
        (logp * grad).sum().backward()
        assert head.weight.grad.dtype == torch.float32
        results.append((logp.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fused", [True, False])
def test_head_logprobs_chunk_0_is_one_chunk(fused):
    """chunk_tokens = 0 (the shared-prefix paths pass `logprob_chunk` through) computes every position
    at once, for the fused head and for a head that is not a plain nn.Linear alike."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 40, bias=False)
    head = linear if fused else torch.nn.Sequential(linear)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets, grad = torch.randint(0, 40, (2, 5)), torch.randn(2, 5)
    ref = _reference_head(hidden.reshape(10, 8), linear, targets.reshape(-1), grad.reshape(-1)).reshape(2, 5)
    ref_grad = hidden.grad.clone()
    hidden.grad = None
    got, _ = head_logprobs(head, hidden, targets, None, chunk_tokens=0, with_entropy=False, fused=fused)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    (got * grad).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_common_prefix_length_leaves_every_prompt_a_token_of_its_own():
    from stages.modeling.prefix_sharing import common_prefix_length

    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 9]], min_common=1) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]], min_common=1) == 2  # the shorter prompt keeps its last token
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]], min_common=1) == 2
    assert common_prefix_length([[7, 2], [1, 2]], min_common=1) == 0
    assert common_prefix_length([[1, 2, 3]], min_common=1) == 0  # one prompt: nothing to share across the batch
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5]], min_common=4) == 0  # 3 shared: under the minimum
    assert common_prefix_length([[1] * 40 + [2], [1] * 40 + [3]]) == 40  # the default minimum, 32
    assert common_prefix_length([[1] * 20 + [2], [1] * 20 + [3]]) == 0


def _whole_rows(model, prompts: list[list[int]], prompt_of_row: list[int], comps: list[list[int]]):
    """The reference the shared and packed paths must match: each prompt + completion as its own right-padded
    row (`grpo.build_batch`), its log-probs and entropies, and the gradients of their masked sum (left in
    `.grad`: the caller zeroes them before its own pass). Returns (width, mask, ref, ref_ent, ref_grads)."""
    from stages import grpo

    batch = grpo.build_batch([prompts[k] for k in prompt_of_row], comps, pad_id=0, keep=[True] * len(comps))
    width, mask = batch["input_ids"].shape[1], batch["loss_mask"]
    ref, ref_ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], with_entropy=True)
    (ref * mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return width, mask, ref, ref_ent, ref_grads


@pytest.mark.parametrize("lora_r", [0, 4])
def test_batch_wide_common_prefix_gives_the_same_logprobs_and_gradients(tiny_tokenizer, lora_r):
    """Three prompts that start with the same 6 tokens and then differ in length (one is the common part
    plus a single token), one of them continued twice; completions of different lengths, one empty.
    Running the common part once for the batch (three decoder calls) gives the log-probs, entropies and
    parameter gradients of whole prompt+completion rows, and so does the path without it (two calls)."""
    from schemas.configs import LoraSpec
    from stages.modeling.prefix_sharing import shared_prefix_rows

    model = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=2), LoraSpec(r=lora_r)).train()
    common = [5, 6, 7, 8, 9, 10]
    prompts = [common + [11, 12, 13], common + [14], common + [15, 16, 17, 18, 19]]
    prompt_of_row = [0, 0, 1, 2]
    comps = [[20, 21, 22], [23], [], [24, 25, 26, 27]]
    width, mask, ref, ref_ent, ref_grads = _whole_rows(model, prompts, prompt_of_row, comps)

    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, k: calls.append(1), with_kwargs=False)
    try:
        # 6 shared tokens: used at min 4, not at min 7; completion buckets: one at the CPU default, and at
        # overhead 0 one per length (0, 1, 3, 4 tokens), each its own decoder call over its own cache rows
        for min_common, overhead, n_calls in ((4, None, 3), (7, None, 2), (4, 0, 6), (7, 0, 5)):
            model.zero_grad()
            calls.clear()
            got, ent = shared_prefix_rows(model, prompts, comps, prompt_of_row, pad_id=0, width=width, device="cpu",
                                          with_entropy=True, min_common=min_common, bucket_overhead=overhead,
                                          pack=False)
            assert len(calls) == n_calls
            assert_matches_whole_rows(model, got, ent, ref, ref_ent, mask, ref_grads)
    finally:
        hook.remove()


def test_length_buckets_minimise_padding_plus_overhead():
    """Hand-computed: lengths [32, 10, 32, 10] cost 4*32 + c as one group, 2*10 + 2*32 + 2c as two,
    so they split for c < 44 and not at 44 (a tie keeps one group); equal lengths never split; an
    overhead of 0 gives one group per distinct length, shortest first, rows in input order."""
    from stages.modeling.logprobs import length_buckets

    assert length_buckets([32, 10, 32, 10], 43) == [[1, 3], [0, 2]]
    assert length_buckets([32, 10, 32, 10], 44) == [[0, 1, 2, 3]]
    assert length_buckets([7, 7, 7], 0) == [[0, 1, 2]]
    assert length_buckets([3, 1, 2, 1], 0) == [[1, 3], [2], [0]]
    # [1, 2, 30, 31]: {1,2} + {30,31} = 2*2 + 2*31 + 2c = 66 + 2c; all: 4*31 + c = 124 + c; split for c < 58
    assert length_buckets([31, 2, 30, 1], 57) == [[1, 3], [0, 2]]
    assert length_buckets([31, 2, 30, 1], 58) == [[0, 1, 2, 3]]
    assert length_buckets([], 5) == [] and length_buckets([0], 5) == [[0]]


def test_bucket_overhead_grows_as_the_layers_narrow(tiny_tokenizer):
    """The tiny model's layer has 36,992 parameters: 64 * (3.5M / 36,992) ** (1/3) = 64 * 4.557 = 291.7 on
    CPU, 512 * 4.557 = 2333.2 on CUDA; a layer at least as wide as the reference, or a model without
    `layers`, keeps the device's constant."""
    from stages.modeling import logprobs, models

    tiny = models.build_tiny_model(tiny_tokenizer)
    assert logprobs.layer_parameters(tiny) == 36_992
    assert logprobs.default_bucket_overhead("cpu", tiny) == 292
    assert logprobs.default_bucket_overhead("cuda", tiny) == 2333

    class Wide(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width, bias=False)])

        def get_decoder(self):
            return self

    assert logprobs.default_bucket_overhead("cpu", Wide(1871)) == 64  # 3,500,641 parameters
    assert logprobs.default_bucket_overhead("cpu", Wide(1870)) == 64  # 3,496,900: 64 * 1.00036 = 64.02
    assert logprobs.default_bucket_overhead("cpu", Wide(935)) == 102  # 874,225: 64 * 1.5878 = 101.6
    assert logprobs.default_bucket_overhead("cpu", torch.nn.Linear(2, 2)) == 64  # no decoder layers
    assert logprobs.default_bucket_overhead("cuda") == 512


def test_prefix_sharing_pays_counts_padded_positions_and_the_extra_call():
    """The tiny benchmark's DPO batch: 4 prompts of 51, 8 completions of 65, rows of 116: shared
    4*51 + 8*65 = 724 positions (+ overhead) against 8*116 = 928 whole; SmolLM2's: 2*62 + 4*65 = 384
    against 4*127 = 508. Padding counts: one long prompt pads them all."""
    from stages.modeling.prefix_sharing import prefix_sharing_pays

    assert not prefix_sharing_pays([51] * 4, [65] * 8, [116] * 8, 292)  # 1016 > 928
    assert prefix_sharing_pays([51] * 4, [65] * 8, [116] * 8, 203)  # 927 < 928
    assert not prefix_sharing_pays([51] * 4, [65] * 8, [116] * 8, 204)  # a tie runs whole rows
    assert prefix_sharing_pays([62] * 2, [65] * 4, [127] * 4, 64)  # 448 < 508
    # prompts 10 and 100, completions 5: shared 2*100 + 4*5 = 220 against 4*105 = 420 whole
    assert prefix_sharing_pays([10, 100], [5] * 4, [15, 15, 105, 105], 199)
    assert not prefix_sharing_pays([10, 100], [5] * 4, [15, 15, 105, 105], 200)


@pytest.mark.parametrize("overhead", [0, None])
def test_bucketed_whole_rows_match_one_padded_batch(tiny_tokenizer, overhead):
    """Right-padded rows of 3, 9, 2, 9 and 14 tokens (padded to 16): in length buckets the log-probs,
    entropies and parameter gradients at every position that predicts a real token equal one padded
    batch's; positions that predict padding are 0. Overhead 0: one decoder call per length, each cut
    to it (2, 3, 9, 14 columns). The CPU default, 64: one bucket costs 5 * 14 + 64 = 134 positions,
    the best split {2, 3, 9, 9} + {14} 4 * 9 + 14 + 2 * 64 = 178, so one call, cut to 14 of the
    16 columns. Left-padded rows are not cut: the plain result, one call of 16; one column: no positions."""
    from stages.modeling.logprobs import bucketed_token_logprobs

    model = models.build_tiny_model(tiny_tokenizer, seed=3).train()
    lengths = [3, 9, 2, 9, 14]
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(5, 16, dtype=torch.long)
    attn = torch.zeros(5, 16, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 60, (n,), generator=g)
        attn[i, :n] = 1
    real = attn[:, 1:].float()
    weights = torch.randn(5, 15, generator=g) * real
    ref, ref_ent = token_logprobs(model, ids, attn, with_entropy=True)
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []

    def record(module, args, kwargs, out):
        calls.append(kwargs["attention_mask"].shape[1])

    hook = model.get_decoder().register_forward_hook(record, with_kwargs=True)
    try:
        got, ent = bucketed_token_logprobs(model, ids, attn, with_entropy=True, bucket_overhead=overhead)
    finally:
        hook.remove()
    assert calls == ([2, 3, 9, 14] if overhead == 0 else [14])
    torch.testing.assert_close(got * real, ref * real, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent * real, ref_ent * real, rtol=1e-5, atol=1e-6)
    assert (got[real == 0] == 0).all() and (ent[real == 0] == 0).all()
    (got * weights).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6)

    left = attn.flip(1)
    calls.clear()
    hook = model.get_decoder().register_forward_hook(record, with_kwargs=True)
    try:
        got_left, _ = bucketed_token_logprobs(model, ids.flip(1), left, bucket_overhead=0)
    finally:
        hook.remove()
    assert calls == [16]
    torch.testing.assert_close(got_left, token_logprobs(model, ids.flip(1), left)[0])
    assert bucketed_token_logprobs(model, ids[:, :1], attn[:, :1])[0].shape == (5, 0)  # one column: nothing predicted


@pytest.mark.parametrize("lora_r,checkpointing", [(0, False), (4, False), (0, True)])
def test_packed_prefix_rows_give_the_same_logprobs_and_gradients(tiny_tokenizer, lora_r, checkpointing):
    """Three prompts of different lengths, one continued three times, one once, one twice with an empty
    completion: one decoder call over [prompt | its completions] rows gives the log-probs, entropies and
    parameter gradients of whole prompt+completion rows, with LoRA and under gradient checkpointing
    (no KV cache involved, so it applies there too)."""
    from schemas.configs import LoraSpec
    from stages.modeling.prefix_sharing import can_pack_prefix, packed_prefix_rows

    model = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=2), LoraSpec(r=lora_r)).train()
    if checkpointing:
        models.enable_activation_checkpointing(model)
    assert can_pack_prefix(model)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    prompt_of_row = [0, 2, 0, 1, 0, 2]
    comps = [[20, 21, 22], [23, 24], [25], [26, 27, 28, 29], [30, 31], []]
    width, mask, ref, ref_ent, ref_grads = _whole_rows(model, prompts, prompt_of_row, comps)
    model.zero_grad()
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, k: calls.append(1), with_kwargs=False)
    try:
        got, ent = packed_prefix_rows(model, prompts, comps, prompt_of_row, pad_id=0, width=width, device="cpu",
                                      with_entropy=True)
    finally:
        hook.remove()
    assert len(calls) == 1
    assert_matches_whole_rows(model, got, ent, ref, ref_ent, mask, ref_grads)


def test_packing_pays_hand_computed(tiny_tokenizer):
    """One prompt of 2 tokens with two completions of 20: packed, one row of 42 costs 42 + 1764 s; whole, two
    rows of 22 cost 44 + 968 s; packing pays while 796 s < 2, s < 0.0025126. Prompts of 10 with completions
    of 5 always pay (20 + 400 s against 30 + 450 s). The tiny model's share: 2 x 64 / 36,992 = 0.00346
    (a layer's 36,992 multiply-adds a token against 2 x 64 a score: 64 for q.k, 64 for the weighted values)."""
    from stages.modeling import prefix_sharing

    assert prefix_sharing.packing_pays([2], [20, 20], [0, 0], [22, 22], 0.0025)
    assert not prefix_sharing.packing_pays([2], [20, 20], [0, 0], [22, 22], 0.0026)
    assert prefix_sharing.packing_pays([10], [5, 5], [0, 0], [15, 15], 0.0)
    assert prefix_sharing.packing_pays([10], [5, 5], [0, 0], [15, 15], 1.0)
    # two prompts of unequal length: packed rows pad to the longest (10 + 2 + 2 = 14): 2 x 14 = 28 < 4 x 12 = 48
    assert prefix_sharing.packing_pays([10, 3], [2, 2, 2, 2], [0, 0, 1, 1], [12, 12, 5, 5], 0.0)
    # the same with the rows interleaved ([0, 1, 0, 1]): who belongs to which prompt counts, not the order
    assert prefix_sharing.packing_pays([10, 3], [2, 2, 2, 2], [0, 1, 0, 1], [12, 5, 12, 5], 0.0)
    # one prompt of 1 token, completions of 30 and 1: a packed row of 32 (32 + 1024 s) against 2 x 31 (62 + 1922 s)
    # pays at any share; completions of 30 and 30 (61 + 3721 s against 62 + 1922 s) only below 1 / 1799
    assert prefix_sharing.packing_pays([1], [30, 1], [0, 0], [31, 2], 10.0)
    assert prefix_sharing.packing_pays([1], [30, 30], [0, 0], [31, 31], 1 / 1800)
    assert not prefix_sharing.packing_pays([1], [30, 30], [0, 0], [31, 31], 1 / 1798)
    assert prefix_sharing.attention_share(models.build_tiny_model(tiny_tokenizer)) == pytest.approx(2 * 64 / 36_992)


def test_can_pack_prefix_only_where_a_4d_mask_means_what_it_says(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from schemas.configs import LoraSpec
    from stages.modeling.prefix_sharing import can_pack_prefix

    tiny = models.build_tiny_model(tiny_tokenizer)
    assert can_pack_prefix(tiny) and can_pack_prefix(models.apply_lora(tiny, LoraSpec(r=2)))
    flash = models.build_tiny_model(tiny_tokenizer)
    flash.config._attn_implementation = "flash_attention_2"
    assert not can_pack_prefix(flash)
    flash.config._attn_implementation = "eager"  # adds the mask to the scores: a boolean mask would be wrong
    assert not can_pack_prefix(flash)
    small = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    assert can_pack_prefix(Qwen2ForCausalLM(Qwen2Config(**small)))
    assert not can_pack_prefix(Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=4,
                                                            max_window_layers=0)))
    assert not can_pack_prefix(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))


@pytest.mark.parametrize("one_row", [False, True])
def test_packed_rows_with_a_common_prefix_equal_whole_rows(tiny_tokenizer, one_row):
    """The batch-wide common prefix case packed: one row per prompt, or one row holding the 6 common tokens
    once, then each prompt's own tokens and its completions (one prompt has a single own token, one
    completion is empty). One decoder call; the whole rows' log-probs, entropies and gradients."""
    from stages.modeling.prefix_sharing import packed_prefix_rows

    model = models.build_tiny_model(tiny_tokenizer, seed=5).train()
    common = [5, 6, 7, 8, 9, 10]
    prompts = [common + [11, 12, 13], common + [14], common + [15, 16, 17, 18, 19]]
    prompt_of_row = [0, 0, 1, 2, 1]
    comps = [[20, 21, 22], [23], [], [24, 25, 26, 27], [28, 29]]
    width, mask, ref, ref_ent, ref_grads = _whole_rows(model, prompts, prompt_of_row, comps)
    model.zero_grad()
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, k: calls.append(a), with_kwargs=False)
    try:
        got, ent = packed_prefix_rows(model, prompts, comps, prompt_of_row, pad_id=0, width=width, device="cpu",
                                      with_entropy=True, n_common=6, one_row=one_row)
    finally:
        hook.remove()
    assert len(calls) == 1
    assert_matches_whole_rows(model, got, ent, ref, ref_ent, mask, ref_grads)


def test_packed_and_cached_costs_hand_computed():
    """Prompts of 10 and 12 tokens (8 common), completions [3, 5] of the first and [4] of the second:
    a row per prompt pads to max(10 + 8, 12 + 4) = 18: 2 x 18 = 36 positions (share 0), 2 x (18 + 0.01 x 324)
    = 42.48 at share 0.01; one row, the common part once: 8 + 2 + 8 + 4 + 4 = 26, 26 + 6.76 = 32.76.
    The KV-cache path: 8 common + 2 prompts x 4 own + the completions in length buckets (at overhead 64 one
    bucket, 3 x 5 = 15; at 0 one per length, 3 + 5 + 4 = 12) + the overhead per call after the first (the
    common part's and each bucket's): 8 + 8 + 15 + 64 x 2 = 159 at 64, 8 + 8 + 12 = 28 at 0."""
    from stages.modeling.prefix_sharing import cached_cost, packed_cost

    args = ([10, 12], [3, 5, 4], [0, 0, 1])
    assert packed_cost(*args, 0.0) == 36
    assert packed_cost(*args, 0.01) == pytest.approx(42.48)
    assert packed_cost(*args, 0.01, n_common=8, one_row=True) == pytest.approx(32.76)
    assert packed_cost(*args, 0.0, n_common=8, one_row=True) == 26
    assert cached_cost([10, 12], [3, 5, 4], 8, 64) == 159
    assert cached_cost([10, 12], [3, 5, 4], 8, 0) == 28
    assert cached_cost([10, 12], [3, 5, 4], 0, 0) == 2 * 12 + 12  # no common part: no call for it


def test_shared_prefix_rows_packs_where_it_costs_less(tiny_tokenizer, monkeypatch):
    """The tiny Llama can be packed: shared_prefix_rows packs when the packed cost is below the KV-cache
    path's (here at the CPU default overhead of 292 a call), in the cheaper layout, and keeps the cache path
    when forced off or when packing costs more (a free call, overhead 0, and attention counted heavily)."""
    from stages.modeling import prefix_sharing

    model = models.build_tiny_model(tiny_tokenizer, seed=5).train()
    common = list(range(5, 45))  # 40 common tokens: above COMMON_PREFIX_MIN
    prompts = [common + [50, 51], common + [52]]
    comps, prompt_of_row = [[60, 61], [62], [63, 64, 65]], [0, 0, 1]
    layouts = []
    real = prefix_sharing.packed_prefix_rows
    monkeypatch.setattr(prefix_sharing, "packed_prefix_rows",
                        lambda *a, **k: layouts.append(k["one_row"]) or real(*a, **k))
    width = 46
    prefix_sharing.shared_prefix_rows(model, prompts, comps, prompt_of_row, 0, width, "cpu")
    assert layouts == [True]  # one row of 40 + 2 + 3 + 1 + 3 = 49 against 2 rows of 45
    prefix_sharing.shared_prefix_rows(model, prompts, comps, prompt_of_row, 0, width, "cpu", pack=False)
    monkeypatch.setattr(prefix_sharing, "attention_share", lambda m: 1.0)
    prefix_sharing.shared_prefix_rows(model, prompts, comps, prompt_of_row, 0, width, "cpu", bucket_overhead=0)
    assert layouts == [True]
