"""What a run shows while it runs (issue 29): generation bars that move with the decode, one line per
pipeline node, and no deprecation warnings from our own calls into transformers. The node lines and the
absence of FutureWarnings through `r1flow run` itself: tests/test_flow.py's first two runs."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch

from schemas.configs import GenerationSpec, LoraSpec
from stages.modeling import models
from stages.sampling import completions, generation, kv_decode
from stages.sampling.completions import GenerationProgress
from stages.sampling.generation import TransformersBackend

CONVS = [[{"role": "user", "content": q}] for q in ("hi", "a much longer question here?", "2+2", "x", "say 7")]


# ---------------------------------------------------------------------------- generation progress


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_bar_counts_tokens_per_step_and_ends_exact(tiny_tokenizer, tiny_model, monkeypatch, cache):
    """Both transformers paths (our decode_rows, and generate() for the static cache) report every decode
    step, not once a batch; the bar ends on the exact token count, its total shrunk to it (budget a row
    did not use given back), with every completion counted as done."""
    steps, bars = [], []
    original_step, original_init = GenerationProgress.step, GenerationProgress.__init__

    def spy_step(self, tokens, ended, steps_left):
        steps.append((tokens, ended, steps_left))
        original_step(self, tokens, ended, steps_left)

    def spy_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        bars.append(self)

    monkeypatch.setattr(GenerationProgress, "step", spy_step)
    monkeypatch.setattr(GenerationProgress, "__init__", spy_init)
    spec = GenerationSpec(max_new_tokens=24, temperature=1.0, batch_size=3, cache=cache)
    out, stats = TransformersBackend(tiny_model, tiny_tokenizer).generate(CONVS, spec, n=2, seed=3, desc="t")
    (bar,) = bars
    batches = 2  # 5 prompts, 3 a batch
    assert len(steps) > 3 * batches  # per step: at least a few steps a batch
    assert bar.bar.n == stats.new_tokens == sum(c.num_tokens for cs in out for c in cs)
    assert bar.bar.total == stats.new_tokens and bar.ended == 10
    lengths = [c.num_tokens for cs in out for c in cs]
    assert any(n < 24 for n in lengths)  # some rows ended early: the total did shrink
    if cache == "dynamic":  # decode_rows' counts are exact step by step
        assert sum(t for t, _, _ in steps) == stats.new_tokens and sum(e for _, e, _ in steps) <= 10


def test_generation_progress_hand_worked():
    """2 completions of budget 5: step 1 both run (2 tokens), row 0 ends at step 2 (4 tokens, 3 steps of
    budget back: total 10 -> 7), row 1 runs to 5 tokens; the batch's exact lengths [2, 5] give 7/7."""
    p = GenerationProgress(2, 5, "t", enabled=True)
    p.step(2, 0, 4)
    p.step(2, 1, 3)
    assert (p.bar.n, p.bar.total, p.ended) == (4, 7, 1)
    p.step(1, 0, 2)
    p.step(1, 0, 1)
    p.step(1, 1, 0)
    assert (p.bar.n, p.bar.total, p.ended) == (7, 7, 2)
    p.batch_done([2, 5])
    assert (p.bar.n, p.bar.total, p.ended) == (7, 7, 2)
    p.close()


def test_no_progress_no_per_step_calls(tiny_tokenizer, tiny_model, monkeypatch):
    """progress=False (GRPO's rollouts): the decode gets no callback at all."""
    monkeypatch.setattr(GenerationProgress, "step", lambda *a: pytest.fail("step called without a bar"))
    spec = GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=4)
    TransformersBackend(tiny_model, tiny_tokenizer).generate(CONVS, spec, n=2, seed=0, progress=False)


# ---------------------------------------------------------------------------- node lines


def test_node_progress_lines_hand_worked():
    """The lines themselves (through `r1flow run`, once each on the terminal: tests/test_flow.py's first runs)."""
    from flows.run.pipeline import NodeProgress

    log, handler = logging.getLogger("r1flow.test-progress"), _Records(logging.INFO)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        p = NodeProgress(3, log)
        p.end("base", "import_model", "cached", 0.04)
        p.start("sft", "sft")
        p.end("sft", "sft", "run", 12.34)
        p.start("eval_sft", "eval")
    finally:
        log.removeHandler(handler)
    assert handler.messages == ["[1/3] base (import_model) cached in 0.0 s (elapsed 0:00; 0 run, 1 cached)",
                     "[2/3] sft (sft) ... (elapsed 0:00; 0 run, 1 cached)",
                     "[2/3] sft (sft) run in 12.3 s (elapsed 0:00; 1 run, 1 cached)",
                     "[3/3] eval_sft (eval) ... (elapsed 0:00; 1 run, 1 cached)"]


# ---------------------------------------------------------------------------- deprecations


class _Records(logging.Handler):
    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def deprecations():
    """Every warning raised inside (each occurrence, not once per place), and every warning transformers logs
    (its `warning_once` memory cleared first, so one logged earlier in the session is logged again)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    handler, hf = _Records(), logging.getLogger("transformers")
    hf.addHandler(handler)
    found: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        hf.removeHandler(handler)
    found += [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
              if issubclass(w.category, FutureWarning | DeprecationWarning)]
    found += [f"transformers log: {m}" for m in handler.messages if "deprecat" in m.lower()]


def test_our_calls_raise_no_deprecation_warnings(tiny_tokenizer, tiny_model_input, tmp_path):
    """The calls a run makes into transformers and peft, on the tiny model, under every warning: sampling
    (our decode with the lean step and through model(...), and generate() for the static cache), prefill,
    log-probs over a shared prefix, SFT under activation checkpointing with LoRA, loading that adapter
    and evaluating it (a stage run each). None may warn of a deprecation (transformers 5.24:
    `past_key_values` -> `cache`, `gradient_checkpointing_*` -> `activation_checkpointing_*`); peft's own
    read of `is_gradient_checkpointing` is not shown (models.peft_reading_checkpointing)."""
    from schemas.configs import EvalConfig, SFTConfig
    from schemas.datasets import from_rows
    from stages import eval as eval_stage
    from stages import sft
    from stages.base import Input, LocalContext, write_dataset
    from stages.modeling import prefix_sharing
    from tests.conftest import fake_input

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i}."}], "answer": str(i), "task": "say",
             "verifier": "exact", "split": "train" if i < 6 else "eval", "metadata": "{}"} for i in range(8)]
    prompts_out = write_dataset(LocalContext(tmp_path / "p"), "p", from_rows(rows, "prompts"), "prompts")
    prompts = fake_input(prompts_out.path, "dataset", "prompts")
    model = models.build_tiny_model(tiny_tokenizer, seed=0)
    if models.cache_name(model) == "cache":  # the check sees the old name where it is deprecated
        with deprecations() as old_name:
            model(input_ids=torch.tensor([[5, 6]]), past_key_values=None, use_cache=True)
        assert old_name
    with deprecations() as found:
        for cache in ("dynamic", "static"):
            spec = GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=4, cache=cache)
            generation.generate(model, tiny_tokenizer, CONVS, spec, n=2, seed=0, logprobs=True, desc=cache)
        enc = tiny_tokenizer(completions.render_prompts(tiny_tokenizer, CONVS[:2]), return_tensors="pt", padding=True,
                             add_special_tokens=False)
        with torch.no_grad():
            ids, mask, cache = kv_decode.prefill_prompts(model, enc["input_ids"], enc["attention_mask"], 2, 4)
            kv_decode.decode_rows(model, ids, mask, cache, 4, [tiny_tokenizer.eos_token_id], 0, lean=False)
        lora = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=1), LoraSpec(r=4)).train()
        assert prefix_sharing.can_share_prefix(lora)
        comp = torch.tensor([[20, 21, 22], [23, 24, 0]])
        prefix_sharing.shared_prefix_logprobs(lora, enc["input_ids"], enc["attention_mask"], comp, (comp > 0).long(),
                                        torch.tensor([0, 1]), common_ids=enc["input_ids"][:1, :2])
        models.enable_activation_checkpointing(lora)
        assert models.is_activation_checkpointing(lora) and not prefix_sharing.can_share_prefix(lora)
        trained = LocalContext(tmp_path / "sft")
        out = sft.run(SFTConfig(max_steps=2, batch_size=2, max_length=64, lora=LoraSpec(r=4), gradient_checkpointing=True),
                      {"model": tiny_model_input, "data": prompts}, trained)
        adapter = Input(out["model"].path, fake_input(out["model"].path, "model", "adapter").manifest,
                        base=tiny_model_input)
        eval_stage.run(EvalConfig(max_prompts=2, max_new_tokens=6, pass_k=2, pass_k_prompts=1, batch_size=2),
                       {"model": adapter, "prompts": prompts}, LocalContext(tmp_path / "eval"))
    assert found == []


def test_cache_name_follows_the_installed_signature(tiny_model):
    """`cache` where forward takes it (transformers >= 5.2x), else `past_key_values` (the GPU machine's
    5.17 may predate the rename); a peft wrapper answers for the model it wraps."""
    import inspect

    expected = "cache" if "cache" in inspect.signature(type(tiny_model).forward).parameters else "past_key_values"
    assert models.cache_name(tiny_model) == models.cache_name(tiny_model.get_decoder()) == expected
    assert models.cache_name(models.apply_lora(tiny_model, LoraSpec(r=2))) == expected

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    assert models.cache_name(Old()) == "past_key_values"

