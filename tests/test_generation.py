"""The generation engine on the tiny model: shapes, order, determinism, finish reasons, stop
strings, and log-probs that match generate()'s own logits."""

import os

import pytest
import torch

from schemas.configs import GenerationSpec
from stages.sampling.completions import cut_at_stop
from stages.sampling.generation import TransformersBackend, make_backend, sampled_completion_logprobs

CONVS = [[{"role": "user", "content": q}] for q in ("hi", "a much longer question here?", "2+2", "x")]


@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    from stages.modeling.models import build_tiny_model

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


@pytest.mark.parametrize("cache", ["dynamic", "graph"])  # decode_rows, decode_static
def test_sampled_logprobs_read_at_decode_equal_a_second_pass_under_temperature_and_top_k(backend, tiny_tokenizer,
                                                                                         cache):
    """Sampling log-probs come from the decode step that drew each token (no second pass over prompt and completion,
    which cost a local async worker more than its decoding): the model's log-prob of the token before temperature and
    top-k, the quantity `sampled_completion_logprobs` computes by a forward pass; 0 past a completion's end."""
    spec = GenerationSpec(max_new_tokens=7, temperature=0.7, top_k=20, batch_size=4, cache=cache)
    out, _ = backend.generate(CONVS, spec, n=2, seed=3, logprobs=True, progress=False)
    for conv, comps in zip(CONVS, out, strict=True):
        enc = tiny_tokenizer(tiny_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                             return_tensors="pt", add_special_tokens=False)
        for c in comps:
            ids = torch.tensor([c.token_ids])
            second = sampled_completion_logprobs(backend.model, enc["input_ids"], enc["attention_mask"], ids,
                                                 torch.ones_like(ids))[0].tolist()
            assert len(c.logprobs) == c.num_tokens
            assert list(c.logprobs) == pytest.approx(second, abs=1e-5)


def test_completion_logprobs_masks_padding():
    """A 'model' whose logits are fixed: vocab 3, log_softmax of [0, 0, ln 2] is
    [ln 1/4, ln 1/4, ln 1/2]. Completion tokens [2, 0] → [ln .5, ln .25]; masked position → 0."""
    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids):
            logits = torch.tensor([0.0, 0.0, float(torch.log(torch.tensor(2.0)))]).expand(*input_ids.shape, 3)
            return type("O", (), {"logits": logits})()

    lp = sampled_completion_logprobs(Fixed(), torch.tensor([[1, 1]]), torch.tensor([[1, 1]]), torch.tensor([[2, 0, 0]]),
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
    from schemas.artifacts import MODEL_DIR
    from tests.conftest import fake_input

    (tmp_path / MODEL_DIR).mkdir()
    (tmp_path / MODEL_DIR / "config.json").write_text("{}")
    with pytest.raises(Exception, match="vllm is not installed"):
        make_backend(GenerationSpec(backend="vllm"), backend.model, backend.tokenizer,
                     fake_input(tmp_path, "model", "model"))


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


def test_a_prefill_per_conversation_in_one_call_equals_one_call_per_prefill(backend):
    """prefills (step_labels' step prefixes, batched): each conversation continues its own prefill, with the
    greedy tokens of a call that gives that prefill to all; the texts start with their own prefill, and a
    prefills list of the wrong length is refused."""
    prefills = ["<think>", "Step 1: two", "", "<answer>"]
    spec = GenerationSpec(max_new_tokens=5, temperature=0.0, batch_size=4)
    out, _ = backend.generate(CONVS, spec, n=2, progress=False, prefills=prefills)
    for conv, prefill, comps in zip(CONVS, prefills, out, strict=True):
        alone, _ = backend.generate([conv], spec.model_copy(update={"prefill": prefill}), n=2, progress=False)
        assert [c.token_ids for c in comps] == [c.token_ids for c in alone[0]]
        assert all(c.text == a.text and c.text.startswith(prefill) for c, a in zip(comps, alone[0], strict=True))
    with pytest.raises(ValueError, match="prefills: 1 for 4 conversations"):
        backend.generate(CONVS, spec, progress=False, prefills=["x"])


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


def _generate_reference(model, enc, n, kwargs, seed, tiny_tokenizer, top_p=1.0):
    """transformers' own loop: generate() over the n-fold rows with the backend's sampler under its argmax."""
    from stages.sampling.sampler import sampling_processors

    torch.manual_seed(seed)
    return model.generate(input_ids=enc["input_ids"].repeat_interleave(n, 0),
                          attention_mask=enc["attention_mask"].repeat_interleave(n, 0), do_sample=False,
                          logits_processor=sampling_processors(1.0, 0, top_p), temperature=None, top_p=None, top_k=None,
                          pad_token_id=tiny_tokenizer.pad_token_id, use_cache=True, **kwargs)


def _decode(model, enc, n, max_new, eos_ids, seed, tiny_tokenizer, top_p=1.0, min_common=None, **kw):
    from stages.sampling.kv_decode import decode_rows, prefill_prompts
    from stages.sampling.sampler import sampling_processors

    torch.manual_seed(seed)
    ids, mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], n, max_new, min_common,
                                       pad_id=tiny_tokenizer.pad_token_id)
    procs = list(sampling_processors(1.0, 0, top_p))
    return decode_rows(model, ids, mask, cache, max_new, eos_ids, tiny_tokenizer.pad_token_id, warpers=procs[:-1],
                       sampler=procs[-1], **kw)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_decode_rows_samples_equal_generate(backend, tiny_tokenizer, top_p):
    """n samples per prompt, each prompt prefilled once, decoded by our loop, are the samples generate()
    draws over the n-fold rows (the layout num_return_sequences uses) from the same seed (left-padded batch)."""
    model = backend.model
    tiny_tokenizer.padding_side = "left"
    texts = [tiny_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = [tiny_tokenizer.eos_token_id]
    expected = _generate_reference(model, enc, 3, dict(max_new_tokens=10, eos_token_id=eos), 3, tiny_tokenizer, top_p)
    got = _decode(model, enc, 3, 10, eos, 3, tiny_tokenizer, top_p)
    assert got.shape[0] == 12
    assert got.tolist() == expected[:, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("share", [0.125, 0.5])
def test_decode_rows_drops_finished_rows_and_samples_what_generate_samples(backend, tiny_tokenizer, share):
    """With 40 of the 136 tokens ending a row, rows end after a few tokens: the loop drops the ended
    rows exactly when they reach `share` of the rows it runs (the rows of the next step are then the
    running ones, else the same as before), and still returns generate()'s tokens, padding
    included, with the same logits for every row it runs."""
    model = backend.model
    tiny_tokenizer.padding_side = "left"
    texts = [tiny_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = [tiny_tokenizer.eos_token_id, *range(40, 79)]
    ref = _generate_reference(model, enc, 4, dict(max_new_tokens=24, eos_token_id=eos, output_logits=True,
                                                  return_dict_in_generate=True), 11, tiny_tokenizer)
    trace = []
    got = _decode(model, enc, 4, 24, eos, 11, tiny_tokenizer, trace=trace, compact_share=share)
    width = enc["input_ids"].shape[1]
    assert got.tolist() == ref.sequences[:, width:].tolist()
    ended_by = [next((k + 1 for k, t in enumerate(row) if t in eos), 10**9) for row in got.tolist()]
    running = [{r for r in range(16) if ended_by[r] > s} for s in range(len(trace))]
    lives = [set(live.tolist()) for live, _ in trace]
    assert lives[0] == set(range(16)) and len(lives[-1]) < 16  # rows were dropped
    for s in range(1, len(trace)):
        n_done = len(lives[s - 1] - running[s])
        assert lives[s] == (running[s] if n_done and n_done >= share * len(lives[s - 1]) else lives[s - 1]), s
    for step, (live, logits) in enumerate(trace):
        torch.testing.assert_close(logits, ref.logits[step][live].float(), rtol=1e-5, atol=1e-5)


def test_decode_rows_from_one_token_prompts_without_a_cache(backend, tiny_tokenizer):
    """One-token prompts leave prefill_prompts nothing to cache (None): the loop starts from the model's
    own first cache and samples what generate() samples from the same seed."""
    from stages.sampling.kv_decode import decode_rows, prefill_prompts
    from stages.sampling.sampler import sampling_processors

    model = backend.model
    enc = {"input_ids": torch.tensor([[5], [9], [20]]), "attention_mask": torch.ones(3, 1, dtype=torch.long)}
    eos = [tiny_tokenizer.eos_token_id, *range(40, 79)]
    ref = _generate_reference(model, enc, 2, dict(max_new_tokens=12, eos_token_id=eos), 2, tiny_tokenizer)
    torch.manual_seed(2)
    ids, mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], 2, 12)
    assert cache is None and ids.shape == (6, 1)
    procs = list(sampling_processors(1.0, 0, 1.0))
    got = decode_rows(model, ids, mask, cache, 12, eos, tiny_tokenizer.pad_token_id, warpers=procs[:-1],
                      sampler=procs[-1])
    assert got.tolist() == ref[:, 1:].tolist()


def test_decode_rows_stop_strings_end_rows_as_generate_does(backend, tiny_tokenizer):
    """Stop strings through transformers' StopStringCriteria on each live row: the tokens generate()
    returns with stop_strings, rows ended by a stop string padded after it."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    model = backend.model
    tiny_tokenizer.padding_side = "left"
    texts = [tiny_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    stops, eos = ["a", "e", " "], [tiny_tokenizer.eos_token_id]
    ref = _generate_reference(model, enc, 2, dict(max_new_tokens=20, eos_token_id=eos, stop_strings=stops,
                                                  tokenizer=tiny_tokenizer), 4, tiny_tokenizer)
    got = _decode(model, enc, 2, 20, eos, 4, tiny_tokenizer, stop=StopStringCriteria(tiny_tokenizer, stops))
    width = enc["input_ids"].shape[1]
    assert got.tolist() == ref[:, width:].tolist()
    texts = [tiny_tokenizer.decode([t for t in row if t != tiny_tokenizer.pad_token_id]) for row in got.tolist()]
    assert sum(any(s in t for s in stops) for t in texts) >= 2  # the stop strings did end rows


@pytest.mark.parametrize("min_common", [4, 10_000])
def test_batch_wide_common_prefix_samples_equal_generate(backend, tiny_tokenizer, min_common):
    """Prompts behind one shared system prompt: prefilling it once for the batch (rows re-laid as
    common | padding | own tokens) draws the same samples as generate() over the n-fold rows from the
    same seed, from the same logits; with a threshold above the shared length the per-prompt path runs, with the same samples."""
    model = backend.model
    tiny_tokenizer.padding_side = "left"
    system = {"role": "system", "content": "think first, answer after"}
    texts = [tiny_tokenizer.apply_chat_template([system, *c], tokenize=False, add_generation_prompt=True) for c in CONVS]
    enc = tiny_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = [tiny_tokenizer.eos_token_id]
    expected = _generate_reference(model, enc, 3, dict(max_new_tokens=10, eos_token_id=eos, output_logits=True,
                                                       return_dict_in_generate=True), 5, tiny_tokenizer)
    calls, trace = [], []
    hook = model.get_decoder().register_forward_hook(lambda m, a, kw, o: calls.append(tuple(kw["input_ids"].shape)),
                                                     with_kwargs=True)
    try:
        got = _decode(model, enc, 3, 10, eos, 5, tiny_tokenizer, min_common=min_common, trace=trace)
    finally:
        hook.remove()
    width = enc["input_ids"].shape[1]
    assert got.tolist() == expected.sequences[:, width:].tolist()
    # the tiny random model samples the same tokens from slightly wrong logits too: compare the logits
    for step, (live, logits) in enumerate(trace):
        torch.testing.assert_close(logits, expected.logits[step][live].float(), rtol=1e-5, atol=1e-5)
    rows = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
    n_common = len(os.path.commonprefix(rows))
    assert n_common >= 4
    if min_common < 10_000:  # the common part once, one row; then each prompt's own tokens but its last
        assert calls[:2] == [(1, n_common), (4, width - 1 - n_common)]
    else:
        assert calls[0] == (4, width - 1)


def test_block_race_sampler_live_rows_draw_what_the_whole_batch_draws():
    """draw(scores[live], live, total) gives each live row the token the whole batch's draw gives it."""
    from stages.sampling.sampler import BlockRaceSampler

    torch.manual_seed(0)
    scores = torch.randn(6, 300)
    sampler = BlockRaceSampler(block=64)
    torch.manual_seed(9)
    whole = sampler.draw(scores)
    live = torch.tensor([1, 4, 5])
    torch.manual_seed(9)
    part = sampler.draw(scores[live], live, 6)
    assert part.tolist() == whole[live].tolist()


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()


def test_block_race_sampler_draws_the_softmax_distribution():
    """probs [1/2, 1/4, 1/8, 1/8, 0] (logits log p, -inf for the last): 200,000 draws land within
    5 standard errors of each probability, the -inf token is never drawn, and every returned row
    is 0 at one token and -inf elsewhere (what generate's argmax needs)."""
    from stages.sampling.sampler import BlockRaceSampler

    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    n = 200_000
    torch.manual_seed(0)
    out = BlockRaceSampler(block=2)(torch.zeros(n, 1, dtype=torch.long), probs.log().expand(n, -1).clone())
    assert ((out == 0).sum(-1) == 1).all() and torch.isinf(out).sum() == n * 4
    freq = _frequencies(out.argmax(-1), 5)
    se = (probs * (1 - probs) / n).sqrt().double()
    assert freq[4] == 0
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-12).all(), freq


def test_sampling_processors_apply_temperature_top_k_top_p_before_the_draw():
    """logits [2, 1, 0, -1]. top_k=2: softmax([2, 1]) = [0.7311, 0.2689]. temperature 0.5:
    softmax([4, 2, 0, -2]) = [0.8650, 0.1171, 0.0158, 0.0021]. top_p=0.8 at temperature 1: the
    sorted probs [0.6439, 0.2369, 0.0871, 0.0321] keep the first two, renormalised [0.7311, 0.2689]."""
    from stages.sampling.sampler import sampling_processors

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cases = [((1.0, 2, 1.0), [0.7311, 0.2689, 0.0, 0.0]),
             ((0.5, 0, 1.0), [0.8650, 0.1171, 0.0158, 0.0021]),
             ((1.0, 0, 0.8), [0.7311, 0.2689, 0.0, 0.0])]
    n = 200_000
    for (temperature, top_k, top_p), expected in cases:
        torch.manual_seed(1)
        out = sampling_processors(temperature, top_k, top_p)(torch.zeros(n, 1, dtype=torch.long),
                                                             logits.expand(n, -1).clone())
        freq, p = _frequencies(out.argmax(-1), 4), torch.tensor(expected, dtype=torch.float64)
        assert (freq[p == 0] == 0).all(), (temperature, top_k, top_p, freq)
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all(), (temperature, top_k, top_p, freq)


def test_backend_samples_the_models_next_token_distribution(backend, tiny_tokenizer):
    """20,000 one-token samples of one prompt at temperature 0.5 follow softmax(logits / 0.5) of the
    model's last prompt position: every token within 5 standard errors, and Pearson's chi-square
    over the 136 tokens below df + 5 sd (135 + 5 * sqrt(270) = 217), while against temperature 1's
    distribution it is above that (the test can tell the two apart)."""
    from stages.sampling.completions import render_prompts

    n = 20_000
    out, _ = backend.generate([CONVS[2]], GenerationSpec(max_new_tokens=1, temperature=0.5), n=n, seed=3,
                              progress=False)
    drawn = torch.tensor([c.token_ids[0] for c in out[0]])
    ids = tiny_tokenizer(render_prompts(tiny_tokenizer, [CONVS[2]]), return_tensors="pt",
                         add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        p = torch.softmax(backend.model(input_ids=ids).logits[0, -1].double() / 0.5, -1)
    freq = _frequencies(drawn, p.numel())
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all()
    df = p.numel() - 1
    limit = df + 5 * (2 * df) ** 0.5

    def chi2(q):
        return (n * (freq - q) ** 2 / q).sum().item()

    assert chi2(p) < limit
    p1 = torch.softmax(torch.log(p) * 0.5, -1)  # logits / 1 instead of / 0.5 (log p = logits/0.5 + c)
    assert chi2(p1) > limit


def test_rows_first_linears_equal_f_linear_and_are_restored():
    """Inside `rows_first_linears` (rule: every linear, 2..64 rows), an fp32 CPU nn.Linear gives
    F.linear's values (to float rounding) for 1, 2, 16, 64 and 65 rows, with and without bias, 2-D
    and 3-D input; with grad enabled it is F.linear itself (autograd intact); a module whose forward
    is already replaced is left alone; on exit every forward is the class's again."""
    import types

    from stages.sampling.rows_first import RowsFirstRule, rows_first_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8, bias=False), torch.nn.Linear(8, 8))
    hooked = model[2]
    hooked.forward = types.MethodType(lambda self, x: x * 2, hooked)
    with rows_first_linears(model, RowsFirstRule(2, 64)), torch.no_grad():
        assert "forward" in vars(model[0]) and hooked.forward(torch.ones(1)) == 2
        for shape in [(1, 24), (2, 24), (16, 24), (64, 24), (65, 24), (4, 4, 24)]:
            x = torch.randn(*shape)
            for lin in model[:2]:
                y = lin(x if lin.in_features == 24 else torch.randn(*shape[:-1], 40))
                assert y.shape == (*shape[:-1], lin.out_features) and y.is_contiguous()
            h = torch.randn(*shape[:-1], 40)
            torch.testing.assert_close(model[1](h), torch.nn.functional.linear(h, model[1].weight))
            torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    with rows_first_linears(model, RowsFirstRule(2, 64)):
        x = torch.randn(16, 24, requires_grad=True)
        model[0](x).sum().backward()
        torch.testing.assert_close(x.grad, model[0].weight.sum(0).expand(16, -1))
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1]) and "forward" in vars(hooked)


def test_rows_first_rule_per_cpu_level(monkeypatch):
    """The default rule follows torch's CPU kernel level: AVX2 every linear, AVX-512 only layers with
    more inputs than outputs (and rows 12..48, where F.linear's values are still what comes out),
    an unmeasured level (ARM, no AVX) none; rule=None changes nothing."""
    from stages.sampling import rows_first
    from stages.sampling.rows_first import rows_first_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8))
    patched = {}
    for level in ["AVX2", "AVX512", "DEFAULT", "SVE256"]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda level=level: level)
        with rows_first_linears(model), torch.no_grad():
            patched[level] = ["forward" in vars(m) for m in model]
            for rows in [4, 12, 48, 49]:
                h = torch.randn(rows, 40)
                torch.testing.assert_close(model[1](h), torch.nn.functional.linear(h, model[1].weight, model[1].bias))
        assert not any("forward" in vars(m) for m in model)
    assert patched == {"AVX2": [True, True], "AVX512": [False, True], "DEFAULT": [False, False],
                       "SVE256": [False, False]}
    assert rows_first.default_rows_first_rule() is None  # SVE256 still patched in
    with rows_first_linears(model, None):
        assert not any("forward" in vars(m) for m in model)


def test_greedy_n_copies_without_the_shared_prefix_path(backend):
    """n > 1 through generate() itself (static cache): n rows per prompt, as num_return_sequences laid them."""
    spec = GenerationSpec(max_new_tokens=5, temperature=0.0, cache="static", batch_size=4)
    out, stats = backend.generate(CONVS, spec, n=2, progress=False)
    assert [len(c) for c in out] == [2, 2, 2, 2] and stats.completions == 8
    single, _ = backend.generate(CONVS, GenerationSpec(max_new_tokens=5, temperature=0.0, batch_size=4), progress=False)
    assert all(c[0].text == c[1].text == s[0].text for c, s in zip(out, single, strict=True))


def test_preallocated_layer_returns_what_dynamic_layer_returns():
    """Against transformers' DynamicLayer fed the same states: after each update (one position, then
    several past the buffer's capacity, so it grows), after a crop, a batch reorder and a selection of
    rows (and an update after each), the keys and values returned and held are equal, and get_seq_length agrees."""
    from transformers.cache_utils import DynamicLayer

    from stages.sampling.kv_decode import PreallocatedLayer

    torch.manual_seed(0)
    k0, v0 = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    ref = DynamicLayer()
    ref.update(k0, v0)
    pre = PreallocatedLayer(k0.clone(), v0.clone(), capacity=7)

    def check(step):
        assert pre.get_seq_length() == ref.get_seq_length(), step
        torch.testing.assert_close(pre.keys, ref.keys, rtol=0, atol=0, msg=step)
        torch.testing.assert_close(pre.values, ref.values, rtol=0, atol=0, msg=step)

    for step, n in enumerate([1, 1, 3, 1]):  # 5 -> 6 -> 7 -> 10 (grows) -> 11
        k, v = torch.randn(3, 2, n, 4), torch.randn(3, 2, n, 4)
        out_p, out_r = pre.update(k, v), ref.update(k, v)
        torch.testing.assert_close(out_p[0], out_r[0], rtol=0, atol=0)
        check(step)
    pre.crop(-2), ref.crop(-2)
    check("crop")
    k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    pre.update(k, v), ref.update(k, v)
    check("after crop")
    order = torch.tensor([2, 0, 1])
    pre.reorder_cache(order), ref.reorder_cache(order)
    k, v = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    pre.update(k, v), ref.update(k, v)
    check("after reorder")
    keep = torch.tensor([0, 2])
    pre.batch_select_indices(keep), ref.batch_select_indices(keep)
    check("select")
    assert pre.keys.data_ptr() == pre._k.data_ptr()  # still a view of its buffer: the next update writes in place
    k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    pre.update(k, v), ref.update(k, v)
    check("after select")


def test_prefill_preallocates_the_cache_on_cpu(backend, tiny_tokenizer, monkeypatch):
    """prefill_prompts hands the decode loop PreallocatedLayers on CPU, and the samples equal those
    drawn with transformers' plain DynamicLayers (preallocation switched off)."""
    from stages.sampling import kv_decode

    spec = GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=4)
    seen = []
    real = kv_decode.preallocate_cache

    def spy(cache, new_tokens):
        real(cache, new_tokens)
        seen.append({type(layer).__name__ for layer in cache.layers})

    monkeypatch.setattr(kv_decode, "preallocate_cache", spy)
    a, _ = backend.generate(CONVS, spec, n=3, seed=5, progress=False)
    assert seen and all(s == {"PreallocatedLayer"} for s in seen)
    monkeypatch.setattr(kv_decode, "preallocate_cache", lambda cache, new_tokens: None)
    b, _ = backend.generate(CONVS, spec, n=3, seed=5, progress=False)
    assert [[c.token_ids for c in cs] for cs in a] == [[c.token_ids for c in cs] for cs in b]


def test_backend_samples_under_the_trainers_autocast_and_leaves_the_callers_alone(tiny_tokenizer):
    """A trainer's backend (autocast_dtype = its resolved precision, bf16 on a GPU) runs every decoder
    call under that autocast, so fp32 master weights do not decode in fp32; without one it leaves the
    caller's autocast state as it is (on or off) instead of switching it off."""
    from stages.modeling.models import build_tiny_model

    model = build_tiny_model(tiny_tokenizer, seed=0)
    seen: list[tuple[bool, torch.dtype]] = []
    model.lm_head.register_forward_pre_hook(  # every prefill and decode step ends in the head, lean or not
        lambda m, a: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    spec = GenerationSpec(max_new_tokens=4, temperature=1.0)
    for cache in ("dynamic", "static"):  # our decode loop and generate()'s
        seen.clear()
        TransformersBackend(model, tiny_tokenizer, torch.bfloat16).generate(
            CONVS[:2], spec.model_copy(update={"cache": cache}), n=2, progress=False)
        assert seen and all(s == (True, torch.bfloat16) for s in seen), (cache, seen)
    seen.clear()
    TransformersBackend(model, tiny_tokenizer).generate(CONVS[:2], spec, n=2, progress=False)
    assert seen and not any(on for on, _ in seen)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        TransformersBackend(model, tiny_tokenizer).generate(CONVS[:2], spec, n=2, progress=False)
    assert seen and all(on for on, _ in seen)


def test_a_stop_string_row_ends_at_the_token_that_completes_it(backend, tiny_tokenizer):
    """Decoding pads a row that a stop string ended up to the batch's longest row; that padding is no part of the
    completion (its token ids, and so num_tokens), as for a row that EOS ended."""
    pad = tiny_tokenizer.pad_token_id
    ids = tiny_tokenizer("xa", add_special_tokens=False)["input_ids"]
    assert pad not in ids and tiny_tokenizer.eos_token_id != pad
    assert backend._rows([ids + [pad, pad]], [tiny_tokenizer.eos_token_id], ["a"], pad) == [(ids, "xa", "stop")]
    assert backend._rows([ids + [pad, pad]], [tiny_tokenizer.eos_token_id], [], pad) == [(ids + [pad, pad], "xa",
                                                                                           "length")]


def test_sampling_stages_sample_in_fp32_on_the_cpu(monkeypatch, tmp_path, tiny_model_input, digit_prompts):
    """Issue 48: eval, rejection_sampling, distill_traces and step_labels sample under bf16 autocast on a GPU
    (tests/test_cuda.py) and, on the CPU, in plain fp32 as before (no autocast dtype)."""
    from stages.sampling.generation import auto_precision
    from tests.sampling_precision import SAMPLING_STAGES, sampling_dtypes

    assert auto_precision("cpu") is None
    dtypes = sampling_dtypes(monkeypatch, tmp_path, tiny_model_input, digit_prompts, "cpu")
    assert dtypes == dict.fromkeys(SAMPLING_STAGES, None)


def test_a_stop_string_across_the_prompts_end_does_not_end_the_completion(tiny_tokenizer):
    """The prompt ends in a newline (ChatML); with `stop: ["\\n\\n"]` transformers' StopStringCriteria ended a row
    whose first new token was a newline (prompt + completion end in "\\n\\n"), giving a one-token completion. The
    criterion the sampler uses fires only when the stop string lies inside the completion."""
    import torch
    from transformers.generation.stopping_criteria import StopStringCriteria

    from stages.sampling.completions import CompletionStopStrings, render_prompts

    prompt = render_prompts(tiny_tokenizer, [[{"role": "user", "content": "Say 7."}]])[0]
    assert prompt.endswith("\n")
    p = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    nl = tiny_tokenizer("\n", add_special_tokens=False)["input_ids"]
    seven = tiny_tokenizer("7", add_special_tokens=False)["input_ids"]
    stop = CompletionStopStrings(tiny_tokenizer, ["\n\n"], len(p))
    across = torch.tensor([p + nl])
    assert StopStringCriteria(tiny_tokenizer, ["\n\n"])(across, None).tolist() == [True]  # the prompt's newline counts
    assert stop(across, None).tolist() == [False]
    assert stop(torch.tensor([p + seven + nl + nl, p + seven + seven + nl]), None).tolist() == [True, False]
    longer = torch.tensor([p + seven * 5 + nl + nl])  # past the horizon: transformers' answer as it is
    assert stop(longer, None).tolist() == [True]
