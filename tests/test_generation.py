"""The generation engine on the tiny model: shapes, order, determinism, finish reasons, stop
strings, and log-probs that match generate()'s own logits."""

import os

import pytest
import torch

from schemas.configs import GenerationSpec
from stages.generation import TransformersBackend, completion_logprobs, cut_at_stop, make_backend

CONVS = [[{"role": "user", "content": q}] for q in ("hi", "a much longer question here?", "2+2", "x")]


@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    from stages.models import build_tiny_model

    return TransformersBackend(build_tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer)


def test_n_completions_per_prompt_in_input_order(backend, tiny_tokenizer):
    spec = GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=3)
    out, stats = backend.generate(CONVS, spec, n=3, seed=1, progress=False)
    assert [len(c) for c in out] == [3, 3, 3, 3]
    assert stats.completions == 12 and stats.new_tokens == sum(c.num_tokens for cs in out for c in cs)
    for comps in out:
        for c in comps:
            assert 1 <= c.num_tokens <= 6 and len(c.token_ids) == c.num_tokens
            assert c.finish_reason in ("stop", "length")
            ended = c.token_ids[-1] == tiny_tokenizer.eos_token_id
            assert (c.finish_reason == "stop") == ended and (ended or c.num_tokens == 6)
    # order is the input order even though batches are sorted by prompt length
    single, _ = backend.generate([CONVS[1]], GenerationSpec(max_new_tokens=6, temperature=0.0), n=1, progress=False)
    greedy, _ = backend.generate(CONVS, GenerationSpec(max_new_tokens=6, temperature=0.0, batch_size=4), progress=False)
    assert greedy[1][0].text == single[0][0].text


def test_seeded_sampling_is_deterministic_and_seed_sensitive(backend):
    spec = GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=2)
    a, _ = backend.generate(CONVS, spec, n=2, seed=7, progress=False)
    b, _ = backend.generate(CONVS, spec, n=2, seed=7, progress=False)
    c, _ = backend.generate(CONVS, spec, n=2, seed=8, progress=False)
    assert a == b
    assert [x.text for cs in a for x in cs] != [x.text for cs in c for x in cs]


def test_logprobs_match_generates_own_logits(backend, tiny_tokenizer):
    """Greedy, one prompt (no padding): generate(output_logits=True) gives the raw logits at each
    step; log_softmax at the chosen token must equal our teacher-forced recomputation."""
    spec = GenerationSpec(max_new_tokens=5, temperature=0.0)
    out, _ = backend.generate([CONVS[0]], spec, logprobs=True, progress=False)
    comp = out[0][0]
    enc = tiny_tokenizer(tiny_tokenizer.apply_chat_template(CONVS[0], tokenize=False, add_generation_prompt=True),
                         return_tensors="pt", add_special_tokens=False)
    gen = backend.model.generate(**enc, do_sample=False, max_new_tokens=5, output_logits=True,
                                 return_dict_in_generate=True, temperature=None, top_p=None, top_k=None,
                                 eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    expected = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(gen.logits, comp.token_ids, strict=False)]
    assert comp.logprobs == pytest.approx(expected, abs=1e-4)
    assert all(lp <= 0 for lp in comp.logprobs)


def test_logprobs_unaffected_by_left_padding(backend):
    """The same prompt alone and batched next to a longer one (so it is left padded) gets the same
    completion log-probs: position ids follow the attention mask."""
    spec = GenerationSpec(max_new_tokens=4, temperature=0.0, batch_size=2)
    alone, _ = backend.generate([CONVS[0]], spec, logprobs=True, progress=False)
    batched, _ = backend.generate([CONVS[0], CONVS[1]], spec, logprobs=True, progress=False)
    assert alone[0][0].token_ids == batched[0][0].token_ids
    assert alone[0][0].logprobs == pytest.approx(batched[0][0].logprobs, abs=1e-4)


def test_completion_logprobs_masks_padding():
    """A 'model' whose logits are fixed: vocab 3, log_softmax of [0, 0, ln 2] is
    [ln 1/4, ln 1/4, ln 1/2]. Completion tokens [2, 0] → [ln .5, ln .25]; masked position → 0."""
    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids):
            logits = torch.tensor([0.0, 0.0, float(torch.log(torch.tensor(2.0)))]).expand(*input_ids.shape, 3)
            return type("O", (), {"logits": logits})()

    lp = completion_logprobs(Fixed(), torch.tensor([[1, 1]]), torch.tensor([[1, 1]]), torch.tensor([[2, 0, 0]]),
                             torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.5, 0.25, 1.0]])) * torch.tensor([[1.0, 1.0, 0.0]]))


def test_stop_strings():
    assert cut_at_stop("abc</answer>tail", ["</answer>"]) == ("abc</answer>", True)
    assert cut_at_stop("a;b.c", [".", ";"]) == ("a;", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


def test_stop_string_ends_generation(backend):
    spec = GenerationSpec(max_new_tokens=30, temperature=1.0, stop=["a", "e", "i", "o", "u", " "])
    out, _ = backend.generate(CONVS, spec, n=2, seed=3, progress=False)
    for comps in out:
        for c in comps:
            if c.finish_reason == "stop" and c.num_tokens < 30:
                continue
            assert not any(ch in c.text for ch in "aeiou ")


def test_vllm_backend_is_a_clear_error_without_vllm(backend, tmp_path):
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="vllm is not installed"):
        make_backend(GenerationSpec(backend="vllm"), backend.model, backend.tokenizer, tmp_path)


def test_prefill_starts_the_assistant_turn_and_is_returned_not_counted(backend, tiny_tokenizer):
    """With prefill "<think>" the model continues after it: greedy output equals a plain greedy run on
    the prompt that already ends with the prefill; the text includes the prefill, the tokens do not."""
    spec = GenerationSpec(max_new_tokens=6, temperature=0.0, prefill="<think>")
    out, _ = backend.generate(CONVS[:2], spec, progress=False)
    model = backend.model
    for conv, (c,) in zip(CONVS[:2], out, strict=True):
        assert c.text.startswith("<think>") and len(c.token_ids) == c.num_tokens
        prompt = tiny_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) + "<think>"
        ids = tiny_tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ref = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=tiny_tokenizer.eos_token_id,
                             pad_token_id=tiny_tokenizer.pad_token_id or tiny_tokenizer.eos_token_id)
        assert list(c.token_ids) == ref[0, ids.shape[1]:].tolist()[: c.num_tokens]


def test_static_cache_gives_the_same_greedy_completions_and_logprobs(backend):
    """cache: static (preallocated, compiled on GPU; prompts padded to a 64-token bucket) changes
    speed, not results: the same greedy tokens and log-probs as the dynamic cache."""
    dyn, _ = backend.generate(CONVS, GenerationSpec(max_new_tokens=12, temperature=0.0, batch_size=4), logprobs=True,
                              progress=False)
    sta, _ = backend.generate(CONVS, GenerationSpec(max_new_tokens=12, temperature=0.0, batch_size=4, cache="static"),
                              logprobs=True, progress=False)
    assert [c.token_ids for cs in dyn for c in cs] == [c.token_ids for cs in sta for c in cs]
    for d, s in zip([c for cs in dyn for c in cs], [c for cs in sta for c in cs], strict=True):
        assert d.finish_reason == s.finish_reason
        assert s.logprobs == pytest.approx(d.logprobs, abs=1e-4)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_shared_prefix_samples_equal_num_return_sequences(backend, tiny_tokenizer, top_p):
    """n samples per prompt with each prompt prefilled once are the samples generate() draws with
    num_return_sequences=n from the same seed: the same rows, the same RNG draws (left-padded batch)."""
    from stages.generation import generate_shared_prefix

    model = backend.model
    tiny_tokenizer.padding_side = "left"
    texts = [tiny_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=True, max_new_tokens=10, eos_token_id=tiny_tokenizer.eos_token_id,
                  pad_token_id=tiny_tokenizer.pad_token_id, use_cache=True, temperature=1.0, top_p=top_p, top_k=0)
    torch.manual_seed(3)
    expected = model.generate(**enc, num_return_sequences=3, **kwargs)
    torch.manual_seed(3)
    got = generate_shared_prefix(model, enc["input_ids"], enc["attention_mask"], 3, {**kwargs, "num_return_sequences": 3})
    assert got.shape[0] == 12
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("min_common", [4, 10_000])
def test_batch_wide_common_prefix_samples_equal_num_return_sequences(backend, tiny_tokenizer, min_common):
    """Prompts behind one shared system prompt: prefilling it once for the batch (rows re-laid as
    common | padding | own tokens) draws the same samples as num_return_sequences=n from the same
    seed, from the same logits; with a threshold above the shared length the per-prompt path runs, with the same samples."""
    from stages.generation import generate_shared_prefix

    model = backend.model
    tiny_tokenizer.padding_side = "left"
    system = {"role": "system", "content": "think first, answer after"}
    texts = [tiny_tokenizer.apply_chat_template([system, *c], tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=True, max_new_tokens=10, eos_token_id=tiny_tokenizer.eos_token_id,
                  pad_token_id=tiny_tokenizer.pad_token_id, use_cache=True, temperature=1.0, top_k=0,
                  output_logits=True, return_dict_in_generate=True)
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, kw, o: calls.append(tuple(kw["input_ids"].shape)),
                                                     with_kwargs=True)
    torch.manual_seed(5)
    expected = model.generate(**enc, num_return_sequences=3, **kwargs)
    torch.manual_seed(5)
    calls.clear()
    try:
        got = generate_shared_prefix(model, enc["input_ids"], enc["attention_mask"], 3,
                                     {**kwargs, "num_return_sequences": 3}, min_common=min_common)
    finally:
        hook.remove()
    width = enc["input_ids"].shape[1]
    assert got.sequences[:, width:].tolist() == expected.sequences[:, width:].tolist()
    # the tiny random model samples the same tokens from slightly wrong logits too: compare the logits
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-5, atol=1e-5)
    rows = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
    n_common = len(os.path.commonprefix(rows))
    assert n_common >= 4
    if min_common < 10_000:  # the common part once, one row; then each prompt's own tokens but its last
        assert calls[:2] == [(1, n_common), (4, width - 1 - n_common)]
    else:
        assert calls[0] == (4, width - 1)
