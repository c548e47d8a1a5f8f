"""Which autocast dtype each sampling stage's generation runs under, on a device: shared by the CPU test
(tests/test_generation.py: fp32, the path unchanged) and the CUDA test (tests/test_cuda.py: bf16, as the trainers)."""

from __future__ import annotations

SAMPLING_STAGES = ("eval", "rejection_sampling", "distill_traces", "step_labels")


def sampling_dtypes(monkeypatch, tmp_path, model_input, prompts, device: str) -> dict[str, object]:
    """stage -> the autocast dtype its transformers backend was made with, each stage run once on `device` on the
    tiny model (a few prompts, a few tokens)."""
    from schemas.configs import (
        DistillTracesConfig,
        EvalConfig,
        GenerationSpec,
        RejectionSamplingConfig,
        StepLabelsConfig,
    )
    from stages import distill_traces, rejection_sampling, step_labels
    from stages import eval as eval_stage
    from stages.base import LocalContext
    from stages.sampling import generation

    seen: list[object] = []
    real_init = generation.TransformersBackend.__init__

    def spy(self, model, tokenizer, autocast_dtype=None, *args, **kwargs):
        seen.append(autocast_dtype)
        real_init(self, model, tokenizer, autocast_dtype, *args, **kwargs)

    monkeypatch.setattr(generation.TransformersBackend, "__init__", spy)
    spec = GenerationSpec(max_new_tokens=4, temperature=1.0, batch_size=4)
    runs = {
        "eval": (eval_stage, EvalConfig(max_prompts=2, max_new_tokens=4, pass_k=1)),
        "rejection_sampling": (rejection_sampling, RejectionSamplingConfig(num_samples=2, generation=spec,
                                                                           max_prompts=2, require_correct=False,
                                                                           require_format=False)),
        "distill_traces": (distill_traces, DistillTracesConfig(num_samples=1, generation=spec, max_prompts=2)),
        "step_labels": (step_labels, StepLabelsConfig(rollouts=1, solutions_per_prompt=1, generation=spec,
                                                      max_prompts=1)),
    }
    dtypes = {}
    for name, (module, cfg) in runs.items():
        seen.clear()
        try:
            module.run(cfg, {"model": model_input, "prompts": prompts}, LocalContext(tmp_path / name, seed=0,
                                                                                     device=device))
        except Exception as e:  # noqa: BLE001 - a stage that found nothing to keep has still sampled
            if not seen:
                raise AssertionError(f"{name} failed before sampling: {e}") from e
        assert seen, f"{name} sampled with no transformers backend"
        assert len(set(map(str, seen))) == 1, (name, seen)
        dtypes[name] = seen[0]
    return dtypes
