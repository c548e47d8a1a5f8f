"""The distillation stages on the tiny model: a layer-dropped student has the hand-counted size and
runs; teacher traces are a valid `sft` artifact; a student trained on a teacher's traces (SFT) or
distributions (KD) gets closer to it; on-policy distillation runs; a student with another tokenizer
is refused for logit distillation before any weight loads; a crashed run resumes exactly.

The teacher is the tiny model fine-tuned for a few seconds on questions whose answer is always 7
(a skill it learns quickly: the tiny model cannot learn to copy a digit from the prompt in a test's
budget). The student is cut from the *untrained* tiny model, i.e. a smaller model of the same family
that has not seen the task, as R1's students had not seen R1's traces.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from schemas.artifacts import MODEL_DIR
from schemas.configs import (
    DistillConfig,
    DistillTracesConfig,
    GenerationSpec,
    LoraSpec,
    MakeStudentConfig,
    SFTConfig,
)
from schemas.datasets import from_rows
from schemas.errors import ConfigError, ModelError, SchemaError
from stages import distill, distill_traces, make_student, sft
from stages.base import LocalContext, write_dataset
from stages.modeling import models
from stages.rewards.verifiers import score
from stages.sampling.generation import generate
from stages.training.sequences import collate, tokenize_conversation
from tests.conftest import fake_input


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's matrices gain nothing from a second thread, and on a loaded machine OpenMP's
    threads wait for a descheduled sibling at every matmul (measured here: 10x slower with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# ---------------------------------------------------------------------------- students by layer dropping


@pytest.mark.parametrize("spec, n, expected", [
    ("every_2", 5, [0, 2, 4]), ("every_1", 3, [0, 1, 2]), ("every_3", 30, list(range(0, 30, 3))),
    ("spread_3", 30, [0, 14, 29]), ("spread_1", 4, [3]), ([1, 3], 4, [1, 3]),
])
def test_layer_indices(spec, n, expected):
    assert models.layer_indices(spec, n) == expected


@pytest.mark.parametrize("spec, message", [
    ("every_two", "expected 'every_K'"), ([], "at least one"), ([0, 7], "out of range"), ([2, 1], "increasing"),
    ("spread_9", "only 4 layers"),
])
def test_layer_indices_errors(spec, message):
    with pytest.raises(ModelError, match=message):
        models.layer_indices(spec, 4)


def test_layer_dropped_student_has_the_hand_counted_size_and_runs(tiny_model, tiny_tokenizer):
    """Llama parameters from the config: per layer q and o (h·h each), k and v (h·kv each, kv = KV
    heads × head dim), gate/up/down (h·i each), two RMSNorms (h each); plus the embedding (V·h) and
    the final norm (h). The LM head is tied to the embedding, so it adds nothing. Tiny model: V = 136,
    h = 64, kv = 32, i = 128: 36,992 per layer, 8,704 + 64 outside them."""
    c = tiny_model.config
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h
    outside = c.vocab_size * h + h
    assert (per_layer, outside) == (36_992, 8_768)
    assert models.count_parameters(tiny_model)["total"] == outside + 2 * per_layer == 82_752

    student = models.drop_layers(tiny_model, "every_2")
    assert student.config.num_hidden_layers == 1 and tiny_model.config.num_hidden_layers == 2  # teacher untouched
    assert models.count_parameters(student)["total"] == outside + per_layer == 45_760
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # still tied
    torch.testing.assert_close(student.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)
    second = models.drop_layers(tiny_model, [1])  # teacher layer 1 becomes student layer 0
    for (name, p), (_, q) in zip(second.model.layers[0].named_parameters(), tiny_model.model.layers[1].named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p, q, msg=name)

    ids = torch.tensor([tiny_tokenizer("hello")["input_ids"]])
    assert student(input_ids=ids).logits.shape == (1, ids.shape[1], c.vocab_size)
    comps, _ = generate(student, tiny_tokenizer, [[{"role": "user", "content": "hi"}]],
                        GenerationSpec(max_new_tokens=6, temperature=0.0), progress=False)
    assert comps[0][0].num_tokens > 0


def test_keeping_every_layer_is_the_teacher_and_its_kd_loss_is_zero(tiny_model, tiny_tokenizer):
    """A student that keeps every layer computes the teacher's logits, and distilling a model into
    itself costs nothing in any divergence: the KD loss is exactly 0 on real logits."""
    same = models.drop_layers(tiny_model, "every_1")
    batch = collate([tokenize_conversation(tiny_tokenizer, [{"role": "user", "content": "What is 3 + 4?"},
                                                            {"role": "assistant", "content": "<answer>7</answer>"}], 64)],
                    tiny_tokenizer.pad_token_id)
    torch.testing.assert_close(same(input_ids=batch["input_ids"]).logits, tiny_model(input_ids=batch["input_ids"]).logits)
    for divergence in ("forward", "reverse", "jsd"):
        cfg = DistillConfig(mode="logits", divergence=divergence, temperature=2.0)
        loss, nll, n = distill.micro_batch_loss(same, tiny_model, batch, cfg, len(tiny_tokenizer), None, "cpu")
        assert n == 5 and nll > 0  # "<answer>", "7", "</answer>", "<|im_end|>", "\n": the prompt is masked
        assert abs(loss.item()) < 1e-5, divergence


def test_make_student_stage_reports_teacher_and_student_sizes(tmp_path, tiny_model_input):
    ctx = LocalContext(tmp_path / "student")
    out = make_student.run(MakeStudentConfig(keep_layers="every_2"), {"model": tiny_model_input}, ctx)["model"]
    assert out.metrics["parameters"] == 45_760 and out.metrics["teacher_parameters"] == 82_752
    assert out.metrics["layers"] == 1 and out.metrics["teacher_layers"] == 2 and out.extra["kept_layers"] == [0]
    model, tokenizer = fake_input(out.path, "model", "model").load_model()
    assert model.config.num_hidden_layers == 1 and len(tokenizer) == len(models.build_tiny_tokenizer())
    with pytest.raises(ModelError, match="out of range"):
        make_student.run(MakeStudentConfig(keep_layers=[5]), {"model": tiny_model_input}, LocalContext(tmp_path / "bad"))
    with pytest.raises(ValueError, match="every_K"):
        MakeStudentConfig(keep_layers="half")


# ---------------------------------------------------------------------------- a teacher with a skill


def sevens(n: int = 64) -> list[dict]:
    """Arithmetic questions whose answer is 7; the last quarter is the eval split."""
    rows = []
    for i in range(n):
        a = i % 8
        question = f"What is {a} + {7 - a}?" if i % 2 else f"What is {a + 7} - {a}?"
        rows.append({"id": f"q{i}", "messages": [{"role": "user", "content": f"{question} (#{i})"}], "answer": "7",
                     "task": "sevens", "verifier": "exact", "split": "train" if i < 3 * n // 4 else "eval",
                     "metadata": "{}"})
    return rows


def accuracy(model_input, rows: list[dict]) -> float:
    model, tokenizer = model_input.load_model()
    comps, _ = generate(model, tokenizer, [r["messages"] for r in rows],
                        GenerationSpec(max_new_tokens=32, temperature=0.0, batch_size=32), progress=False)
    return sum(bool(score(r, c[0].text).correct) for r, c in zip(rows, comps, strict=True)) / len(rows)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_input):
    """Prompts, a teacher fine-tuned on them, its traces, and a student cut from the untrained tiny model."""
    root = tmp_path_factory.mktemp("distill")
    rows = sevens()
    prompts = fake_input(write_dataset(LocalContext(root / "p"), "p", from_rows(rows, "prompts"), "prompts").path,
                         "dataset", "prompts")
    sft_cfg = SFTConfig(max_steps=70, batch_size=8, learning_rate=3e-3, warmup_ratio=0.1, max_length=96,
                        lora=LoraSpec(r=0), gold_think="ok", checkpoint_every=1000)
    teacher = sft.run(sft_cfg, {"model": tiny_model_input, "data": prompts}, LocalContext(root / "teacher"))["model"]
    teacher = fake_input(teacher.path, "model", "model")
    traces_cfg = DistillTracesConfig(num_samples=4, filter="verified",
                                     generation=GenerationSpec(max_new_tokens=32, temperature=0.6, top_p=0.95,
                                                                           batch_size=64))
    traces = distill_traces.run(traces_cfg, {"model": teacher, "prompts": prompts}, LocalContext(root / "traces"))["traces"]
    student = make_student.run(MakeStudentConfig(), {"model": tiny_model_input}, LocalContext(root / "student"))["model"]
    return SimpleNamespace(root=root, rows=rows, prompts=prompts, teacher=teacher, traces_output=traces,
                           traces=fake_input(traces.path, "dataset", "sft"), student=fake_input(student.path, "model", "model"))


def distill_cfg(**kw) -> DistillConfig:
    base = dict(max_steps=40, batch_size=8, learning_rate=3e-3, warmup_ratio=0.0, lr_scheduler="constant",
                max_length=96, eval_fraction=0.2, checkpoint_every=1000, lora=LoraSpec(r=0),
                generation=GenerationSpec(max_new_tokens=24, temperature=1.0, batch_size=16))
    base.update(kw)
    return DistillConfig(**base)


def inputs(world, **kw) -> dict:
    out = {"teacher": world.teacher, "student": world.student, "traces": world.traces, "prompts": world.prompts}
    out.update(kw)
    return {k: v for k, v in out.items() if v is not None}


def curve(ctx, key="train/loss") -> list[float]:
    return [m[key] for step, m in ctx.metrics if step is not None and key in m]


def test_traces_are_a_valid_sft_artifact_of_verified_teacher_samples(world):
    table = world.traces.table("sft")  # validated against the sft schema
    rows = table.to_pylist()
    m = world.traces_output.metrics
    assert m["samples"] == 48 * 4 and len(rows) == m["traces"] > 0 and m["sample_accuracy"] > 0.2
    for r in rows:
        meta = json.loads(r["metadata"])
        assert r["messages"][-1]["role"] == "assistant" and r["source"] == "distill_traces"
        assert meta["correct"] is True and r["id"] == f"{meta['prompt_id']}-{meta['sample_index']}"
    assert {json.loads(r["metadata"])["prompt_id"] for r in rows} <= {r["id"] for r in world.rows[:48]}  # train split


def test_a_filter_that_keeps_nothing_fails_naming_the_way_out(world, tiny_model_input):
    cfg = DistillTracesConfig(num_samples=1, max_prompts=4, generation=GenerationSpec(max_new_tokens=4))
    with pytest.raises(SchemaError, match="none of the teacher's 4 traces passed filter='verified'.*lenient, format, none"):
        distill_traces.run(cfg, {"model": tiny_model_input, "prompts": world.prompts}, LocalContext(world.root / "none"))


@pytest.mark.slow
def test_student_trained_on_teacher_traces_gets_closer_to_the_teacher(world):
    ctx = LocalContext(world.root / "d-traces")
    out = distill.run(distill_cfg(mode="traces"), inputs(world), ctx)["model"]
    m = out.metrics
    assert m["heldout_nll_before"] > 3.0  # the untrained student: near uniform over 136 tokens
    assert m["heldout_nll_after"] < 0.25 * m["heldout_nll_before"]
    assert m["heldout_nll_after"] - m["heldout_nll_teacher"] < 0.1 * (m["heldout_nll_before"] - m["heldout_nll_teacher"])
    assert (m["student_parameters"], m["teacher_parameters"]) == (45_760, 82_752)
    eval_rows = [r for r in world.rows if r["split"] == "eval"]
    teacher_acc = accuracy(world.teacher, eval_rows)
    assert teacher_acc > 0.5 and accuracy(world.student, eval_rows) == 0
    assert accuracy(fake_input(out.path, "model", "model"), eval_rows) > 0.5 * teacher_acc


@pytest.mark.slow
def test_logits_mode_reduces_the_kd_loss(world):
    ctx = LocalContext(world.root / "d-logits")
    out = distill.run(distill_cfg(mode="logits", temperature=2.0), inputs(world, prompts=None), ctx)["model"]
    losses = curve(ctx)
    assert len(losses) == 40 and sum(losses[-5:]) < 0.2 * sum(losses[:5])
    assert out.metrics["heldout_nll_after"] < 0.5 * out.metrics["heldout_nll_before"]


def test_on_policy_mixes_student_samples_and_teacher_traces(world):
    ctx = LocalContext(world.root / "d-on-policy")
    cfg = distill_cfg(mode="on_policy", max_steps=2, batch_size=4, grad_accum=2, teacher_fraction=0.25,
                      divergence="reverse", lora=LoraSpec(r=4, alpha=8))
    out = distill.run(cfg, inputs(world), ctx)["model"]
    steps = [m for s, m in ctx.metrics if s is not None and "train/loss" in m]
    assert len(steps) == 2 and out.metrics["trained_steps"] == 2
    for m in steps:
        assert (m["train/teacher_sequences"], m["train/student_sequences"]) == (2, 6)
        assert m["train/loss"] > 0 and m["train/sample_length"] > 0
    # a LoRA student samples through its adapter and is saved as an adapter on the student artifact; its size is
    # the student model's, the adapter's matrices not counted (as in the full fine-tuning tests: 45,760)
    assert out.metrics["student_parameters"] == 45_760
    assert out.schema == "adapter" and out.extra["base_fingerprint"] == world.student.fingerprint
    assert (out.path / "model" / "adapter_config.json").exists()


def test_on_policy_samples_in_the_training_precision(world, monkeypatch):
    """The student samples under the stage's resolved precision (bf16 asked for here), as its training passes run."""
    asked = []

    def recording(*args, **kw):
        asked.append(kw.get("autocast_dtype"))
        return generate(*args, **kw)

    monkeypatch.setattr(distill, "generate", recording)
    cfg = distill_cfg(mode="on_policy", max_steps=1, batch_size=4, grad_accum=1, teacher_fraction=0.25,
                      precision="bf16")
    distill.run(cfg, inputs(world), LocalContext(world.root / "d-on-policy-bf16"))
    assert asked and all(a == torch.bfloat16 for a in asked), asked


def test_sampled_example_labels_only_the_completion():
    ex = distill.sampled_example([5, 6, 7], [8, 9, 3], max_length=5)
    assert ex.input_ids == [5, 6, 7, 8, 9] and ex.labels == [-100, -100, -100, 8, 9]


def test_other_tokenizer_is_refused_for_logits_before_any_weight_loads(world, tmp_path, tiny_tokenizer, monkeypatch):
    other_tok = models.build_tiny_tokenizer()
    other_tok.add_tokens(["<extra>"])
    models.save_model(models.build_tiny_model(other_tok), other_tok, tmp_path / "other" / MODEL_DIR)
    other = fake_input(tmp_path / "other", "model", "model")
    monkeypatch.setattr(distill, "load_trainable", lambda *a, **k: pytest.fail("loaded weights before checking"))
    for mode in ("logits", "on_policy"):
        with pytest.raises(ModelError, match="same tokenizer.*vocabulary sizes 136 and 137.*mode: traces"):
            distill.run(distill_cfg(mode=mode), inputs(world, student=other), LocalContext(tmp_path / mode))
    assert distill.check_shared_tokenizer(world.teacher, other, "traces") is False  # SFT on text needs no shared vocab
    assert distill.teacher_parameters(other) == 82_752 + 64  # counted on the meta device: one more embedding row
    assert distill.tokenizer_differences(tiny_tokenizer, models.build_tiny_tokenizer()) == []


def test_missing_inputs_fail_before_compute(world):
    with pytest.raises(ConfigError, match="`traces` input"):
        distill.run(distill_cfg(mode="logits"), inputs(world, traces=None), LocalContext(world.root / "m1"))
    with pytest.raises(ConfigError, match="`prompts` input"):
        distill.run(distill_cfg(mode="on_policy"), inputs(world, prompts=None), LocalContext(world.root / "m2"))
    with pytest.raises(ConfigError, match="teacher_fraction: 0"):
        distill.run(distill_cfg(mode="on_policy"), inputs(world, traces=None), LocalContext(world.root / "m3"))


class Crash(RuntimeError):
    pass


class CrashingContext(LocalContext):
    def __init__(self, root, crash_at: int):
        super().__init__(root)
        self.crash_at = crash_at

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, step)
        if step == self.crash_at and "train/loss" in metrics:
            raise Crash(f"killed after step {step}")


def test_resume_after_a_crash_repeats_the_uninterrupted_run(world):
    """logits mode, checkpoints every 2 steps, killed after step 3: the re-run starts from step 2,
    trains steps 3-4 exactly as the uninterrupted run did, and keeps the held-out NLL measured
    before the first step (not the half-trained student's)."""
    cfg = distill_cfg(mode="logits", max_steps=4, checkpoint_every=2)
    ref_ctx = LocalContext(world.root / "ref")
    ref = distill.run(cfg, inputs(world), ref_ctx)["model"]
    with pytest.raises(Crash):
        distill.run(cfg, inputs(world), CrashingContext(world.root / "crash", 3))
    ctx = LocalContext(world.root / "crash")
    out = distill.run(cfg, inputs(world), ctx)["model"]
    assert out.metrics["resumed_from_step"] == 2 and out.metrics["trained_steps"] == 2
    assert curve(ctx) == pytest.approx(curve(ref_ctx), rel=1e-4)  # steps 1-2 re-logged from the checkpoint
    assert out.metrics["heldout_nll_before"] == ref.metrics["heldout_nll_before"]
    assert out.metrics["heldout_nll_after"] == pytest.approx(ref.metrics["heldout_nll_after"], rel=1e-4)


# ---------------------------------------------------------------------------- the recipe, end to end


@pytest.mark.slow
def test_distill_recipe_runs_end_to_end_on_the_tiny_profile(tmp_path):
    """teacher → traces → student → distill → eval of both, through the CLI (Prefect, MLflow, store)."""
    from flows.cli.app import main
    from tests.conftest import harness_home

    with harness_home(tmp_path / "home") as home:
        out = home / "run.json"
        assert main(["run", "--recipe", "distill", "--profile", "tiny", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
    stages = {s["node"]: s for s in result["stages"]}
    assert {n: s["status"] for n, s in stages.items()} == dict.fromkeys(
        ["teacher", "prompts", "traces", "student", "distill", "eval_teacher", "eval_student"], "run")
    manifest = json.loads((home / "artifacts" / stages["traces"]["outputs"]["traces"] / "manifest.json").read_text())
    assert manifest["kind"] == "dataset" and manifest["schema"] == "sft" and manifest["rows"] == 48
    student = json.loads((home / "artifacts" / stages["distill"]["outputs"]["model"] / "manifest.json").read_text())
    m = student["metrics"]
    assert (m["student_parameters"], m["teacher_parameters"]) == (45_760, 82_752)
    assert {"heldout_nll_before", "heldout_nll_after", "heldout_nll_teacher"} <= set(m)


@pytest.mark.slow
def test_logits_mode_sharded_on_two_processes_follows_the_single_process_run(world):
    """distill under fsdp (the student sharded, the teacher whole on each process): the KD curve,
    the held-out NLL before and after (rank 0, on the gathered student) and the saved student are
    the single process's."""
    from safetensors.torch import load_file

    from schemas.configs import ResourcesSpec
    from stages.training import launch

    cfg = distill_cfg(mode="logits", temperature=2.0, max_steps=4, batch_size=4, grad_accum=2)
    one, two = LocalContext(world.root / "d-fsdp-1"), LocalContext(world.root / "d-fsdp-2")
    out1 = distill.run(cfg, inputs(world, prompts=None), one)["model"]
    fsdp = cfg.model_copy(update={"resources": ResourcesSpec(num_processes=2, distributed_type="fsdp")})
    out2 = launch.run_stage(distill, fsdp, inputs(world, prompts=None), two)["model"]
    assert curve(two) == pytest.approx(curve(one), rel=1e-4, abs=1e-6) and len(curve(one)) == 4
    for key in ("heldout_nll_before", "heldout_nll_after", "heldout_nll_teacher"):
        assert out2.metrics[key] == pytest.approx(out1.metrics[key], rel=1e-4), key
    w1, w2 = (load_file(o.path / "model" / "model.safetensors") for o in (out1, out2))
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], rtol=1e-3, atol=1e-5) for k in w1)


@pytest.mark.slow
@pytest.mark.parametrize("lora_r", [0, 4])
def test_on_policy_sharded_on_two_processes_follows_the_ddp_run(world, lora_r):
    """on_policy under fsdp: each process samples its part of the step's prompts through an unsharded
    copy refreshed from the shards before the step, and trains its shard. With the same ranks and
    seeds as ddp the samples are the same (lengths, student/teacher mix), and so are the loss curve,
    the held-out NLL and the saved student (full fine-tuning, and a LoRA adapter)."""
    from safetensors.torch import load_file

    from schemas.configs import ResourcesSpec
    from stages.training import launch

    cfg = distill_cfg(mode="on_policy", max_steps=3, batch_size=4, grad_accum=1, teacher_fraction=0.25,
                      divergence="reverse", lora=LoraSpec(r=lora_r, alpha=8), learning_rate=3e-3)
    runs = {}
    for kind in ("ddp", "fsdp"):
        ctx = LocalContext(world.root / f"d-on-policy-{kind}-{lora_r}")
        resources = ResourcesSpec(num_processes=2, distributed_type=kind)
        out = launch.run_stage(distill, cfg.model_copy(update={"resources": resources}), inputs(world), ctx)["model"]
        steps = [m for s, m in ctx.metrics if s is not None and "train/loss" in m]
        runs[kind] = (out, steps)
    (out1, steps1), (out2, steps2) = runs["ddp"], runs["fsdp"]
    assert len(steps1) == 3 and all(m["train/student_sequences"] == 3 for m in steps1)
    for key in ("train/sample_length", "train/teacher_sequences"):
        assert [m[key] for m in steps2] == [m[key] for m in steps1], key  # the same samples
    assert [m["train/loss"] for m in steps2] == pytest.approx([m["train/loss"] for m in steps1], rel=1e-4, abs=1e-6)
    assert out2.metrics["heldout_nll_after"] == pytest.approx(out1.metrics["heldout_nll_after"], rel=1e-4)
    assert out2.metrics["heldout_nll_after"] != pytest.approx(out2.metrics["heldout_nll_before"], rel=1e-4)  # trained
    name = "adapter_model.safetensors" if lora_r else "model.safetensors"
    w1, w2 = (load_file(o.path / "model" / name) for o in (out1, out2))
    assert w1.keys() == w2.keys() and w1
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-3, atol=1e-5)


def test_on_policy_samples_through_a_colocated_vllm_engine_holding_the_student(world, fake_vllm):
    """generation.backend=vllm on-policy (a stand-in engine, see conftest's fake_vllm): one engine, started from
    the student's directory; before every sampling step after the first the student's current weights are
    pushed in (every weight, under its checkpoint name) and the prefix cache dropped, so the engine samples
    from the student being trained."""
    ctx = LocalContext(world.root / "d-on-policy-vllm")
    cfg = distill_cfg(mode="on_policy", max_steps=3, batch_size=4, grad_accum=1, teacher_fraction=0.25,
                      generation=GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=16, backend="vllm"))
    distill.run(cfg, inputs(world), ctx)
    (engine,) = fake_vllm.made
    assert engine.kwargs == {"distributed_executor_backend": "external_launcher"}
    assert len(engine.weights_at_generate) == 3 and len(engine.inner.pushes) == 2 and engine.resets == 2
    names = {n for n, _ in engine.hf.named_parameters()}
    assert all(set(push) == names for push in engine.inner.pushes)
    first, second, _ = engine.weights_at_generate
    assert any(not torch.equal(first[n], second[n]) for n in names)
    steps = [m for s, m in ctx.metrics if s is not None and "train/loss" in m]
    assert [(m["train/teacher_sequences"], m["train/student_sequences"]) for m in steps] == [(1, 3)] * 3
