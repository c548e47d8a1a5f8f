"""Chunked per-token log-probs equal the full-logits computation, in value and in gradient."""

import pytest
import torch

from stages import models
from stages.logprobs import token_logprobs
from stages.sft import IGNORE, masked_token_loss


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
