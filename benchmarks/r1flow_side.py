"""The r1flow side of the suite: each stage through `run_stage`, as the pipeline runs it, under a LocalContext
(no Prefect, no MLflow).

Each function runs one stage on the prepared artifacts and returns plain numbers; step times are
taken from the moments the stage logs each step (`TimedContext`), so they cover the whole step
(data, forward, backward, optimizer) and nothing the benchmark adds.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import SEED, PeakMemory, Shape, stage_input
from stages.base import LocalContext, Output
from stages.training import pairs, sequences
from stages.training.launch import run_stage


class TimedContext(LocalContext):
    """LocalContext that also records when each step's metrics arrive (first report per step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_clock: dict[int, float] = {}

    def log_metrics(self, metrics, step=None):
        if step is not None and step not in self.step_clock:
            self.step_clock[step] = time.perf_counter()
        super().log_metrics(metrics, step)

    def intervals(self, first: int, last: int) -> list[float]:
        """Durations of steps first..last (1-based): clock[k] - clock[k-1]."""
        return [self.step_clock[k] - self.step_clock[k - 1] for k in range(first, last + 1)]


def inputs_from(prep: dict, *names: str) -> dict:
    out = {}
    for name in names:
        o = prep[name]
        out[name] = stage_input(Output(o["kind"], o["schema"], Path(o["path"]), rows=o.get("rows")),
                                parents=o.get("parents"))
    return out


def run_sft(prep: dict, shape: Shape, device: str, work: Path) -> dict:
    from schemas.configs import LoraSpec, SFTConfig
    from stages import sft

    inp = inputs_from(prep, "model", "sft")
    cfg = SFTConfig(max_steps=shape.sft_steps + 2, batch_size=shape.sft_batch, grad_accum=1,
                    learning_rate=shape.learning_rate, lr_scheduler="constant", warmup_ratio=0.0,
                    max_length=shape.max_length, lora=LoraSpec(r=shape.lora_r), checkpoint_every=10_000)
    meter = PeakMemory(device)
    ctx = TimedContext(work / "sft", device=device)
    meter.start()
    run_stage(sft, cfg, {"model": inp["model"], "data": inp["sft"]}, ctx)
    mem = meter.result()
    # step 1 warms up; the last step also writes the final checkpoint: time steps 2 .. max_steps - 1
    steps = ctx.intervals(2, cfg.max_steps - 1)
    _, tokenizer = inp["model"].load_model()
    lengths = [len(sequences.tokenize_conversation(tokenizer, c, cfg.max_length).input_ids)
               for c in sft.conversations_from(inp["sft"], cfg)]
    return {"step_s": steps, "seq_len": sum(lengths) / len(lengths), "batch": shape.sft_batch, **mem}


def run_reference(prep: dict, shape: Shape, device: str, work: Path) -> dict:
    """The cached reference: `reference_logprobs` once, in its own process, before the DPO run."""
    from schemas.configs import ReferenceLogprobsConfig
    from stages import reference_logprobs

    inp = inputs_from(prep, "model", "prefs")
    cfg = ReferenceLogprobsConfig(max_length=shape.max_length, batch_size=2 * shape.dpo_batch)
    t0 = time.perf_counter()
    out = run_stage(reference_logprobs, cfg, {"model": inp["model"], "preferences": inp["prefs"]},
                    LocalContext(work / "reference", device=device))["logprobs"]
    return {"seconds": time.perf_counter() - t0, "kind": out.kind, "schema": out.schema, "path": str(out.path),
            "rows": out.rows, "metrics": out.metrics,
            "parents": [inp["prefs"].fingerprint, inp["model"].fingerprint]}


def run_dpo(prep: dict, shape: Shape, device: str, work: Path, reference: dict) -> dict:
    from schemas.configs import LoraSpec, PreferenceOptimizationConfig
    from stages import preference_optimization as po

    inp = inputs_from(prep, "model", "prefs")
    ref = stage_input(Output(reference["kind"], reference["schema"], Path(reference["path"]), rows=reference["rows"],
                             metrics=reference["metrics"]), parents=reference["parents"])
    cfg = PreferenceOptimizationConfig(max_steps=shape.dpo_steps + 2, batch_size=shape.dpo_batch, grad_accum=1,
                                       learning_rate=shape.learning_rate, lr_scheduler="constant", warmup_ratio=0.0,
                                       max_length=shape.max_length, lora=LoraSpec(r=shape.lora_r), kl_prompts=0,
                                       eval_fraction=0.0, checkpoint_every=10_000, loss="dpo", beta=0.1)
    meter = PeakMemory(device)
    ctx = TimedContext(work / "dpo", device=device)
    meter.start()
    run_stage(po, cfg, {"model": inp["model"], "preferences": inp["prefs"], "reference": ref}, ctx)
    mem = meter.result()
    steps = ctx.intervals(2, cfg.max_steps - 1)
    _, tokenizer = inp["model"].load_model()
    seqs = [pairs.tokenize(tokenizer, e.messages, e.completion, cfg.max_length) for e in pairs.examples_from(inp["prefs"])]
    return {"step_s": steps, "batch": shape.dpo_batch, "seq_len": sum(len(s) for s, _ in seqs) / len(seqs),
            "reference_s": reference["seconds"], **mem}


def run_grpo(prep: dict, shape: Shape, device: str, work: Path) -> dict:
    """The stage picks each step's prompts itself (`rollouts.pick_prompts`, context seed SEED: the list the suite gives
    TRL); the ids it samples for are recorded (`step_prompts`) for the suite to compare with that list."""
    from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec
    from stages import grpo
    from stages.training import groups

    inp = inputs_from(prep, "model", "prompts")
    n = shape.grpo_prompts * shape.grpo_group
    cfg = GRPOConfig(steps=shape.grpo_steps + 1, prompts_per_step=shape.grpo_prompts, group_size=shape.grpo_group,
                     generation=GenerationSpec(max_new_tokens=shape.grpo_new_tokens, temperature=1.0, top_p=1.0,
                                               top_k=0, batch_size=shape.grpo_prompts, cache=shape.cache,
                                               backend=shape.r1flow_backend),
                     lora=LoraSpec(r=shape.lora_r), minibatch_size=shape.grpo_minibatch, mu=1, beta=0.0,
                     advantage="grpo", aggregation="seq_mean", learning_rate=shape.learning_rate,
                     checkpoint_every=10_000)
    meter = PeakMemory(device)
    ctx = TimedContext(work / "grpo", seed=SEED, device=device)
    sampled: list[list[str]] = []  # each rollout's prompt ids, in order (one rollout a step: no dynamic sampling)
    sample_groups = groups.sample_groups

    def recorded_sample_groups(*args, **kwargs):
        g = sample_groups(*args, **kwargs)
        sampled.append([r["id"] for r in g.rows])
        return g

    groups.sample_groups = recorded_sample_groups  # observes the stage's own calls; changes nothing
    meter.start()
    try:
        run_stage(grpo, cfg, {"model": inp["model"], "prompts": inp["prompts"]}, ctx)
    finally:
        groups.sample_groups = sample_groups
    mem = meter.result()
    steps = []
    for step, m in sorted((s, m) for s, m in ctx.metrics if s is not None and "time/step" in m):
        steps.append({"step": step, "generation": m["time/generation"], "scoring": m["time/scoring"],
                      "training": m["time/training"], "total": m["time/step"],
                      "completion_tokens": m["completion/mean_length"] * n})
    return {"steps": steps[1:], "completions": n, "step_prompts": sampled, **mem}
