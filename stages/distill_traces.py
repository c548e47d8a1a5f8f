"""`distill_traces` stage: the teacher's reasoning traces on prompts, as a re-usable `sft` dataset.

DeepSeek-R1 §2.4 distilled R1 into smaller models by fine-tuning them on ~800k samples drawn from
R1 and filtered for correctness. This stage is the drawing: n traces per prompt sampled from the
teacher (temperature configurable; R1 recommends 0.6 with top-p 0.95), scored by the prompt's
verifier, kept if they pass `filter`. Its output is an `sft` artifact of its own, cached by teacher +
prompts + config, so any number of students (other sizes, other modes of `distill`) re-use it.

Unlike `rejection_sampling`, every passing trace is kept, duplicates included: the traces are a
sample of the teacher's distribution, and a trace the teacher writes twice is one it prefers.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from schemas.configs import DistillTracesConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, seed_everything, write_dataset
from stages.rewards.verifiers import Verdict, score
from stages.sampling.completions import Completion
from stages.sampling.generation import sample_with

VERSION = "3"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = DistillTracesConfig
INPUTS = {"model": "model", "prompts": "prompts"}
OUTPUTS = {"traces": "sft"}

# filter name -> does this scored trace pass?
FILTERS: dict[str, Callable[[Verdict], bool]] = {
    "verified": lambda v: v.correct is True,
    "lenient": lambda v: v.correct_lenient is True,
    "format": lambda v: v.format_ok,
    "none": lambda v: True,
}


def keep(verdict: Verdict, completion: Completion, cfg: DistillTracesConfig) -> bool:
    return FILTERS[cfg.filter](verdict) and not (cfg.drop_truncated and completion.finish_reason == "length")


def select_prompts(table, cfg: DistillTracesConfig, label: str) -> list[dict]:
    prompts = [r for r in table.to_pylist() if r["split"] == cfg.split][: cfg.max_prompts]
    if not prompts:
        raise SchemaError(f"{label}: no prompts with split={cfg.split!r} to sample traces on")
    if cfg.filter in ("verified", "lenient") and all(p["verifier"] == "none" for p in prompts):
        raise SchemaError(f"{label}: filter={cfg.filter!r} needs prompts a verifier can score; all {len(prompts)} "
                          f"have verifier 'none' (use filter: format or none)")
    return prompts


def run(cfg: DistillTracesConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    prompts = select_prompts(inputs["prompts"].table("prompts"), cfg, inputs["prompts"].label)
    seed_everything(ctx.seed)
    completions, stats = sample_with(inputs["model"], [p["messages"] for p in prompts], cfg.generation, cfg.num_samples,
                                     ctx.seed, ctx.device, "teacher traces")
    rows, verdicts = [], []
    for prompt, comps in zip(prompts, completions, strict=True):
        for i, c in enumerate(comps):
            v = score(prompt, c.text, cfg.reward, num_tokens=c.num_tokens)
            verdicts.append((v, c))
            if not keep(v, c, cfg):
                continue
            rows.append({
                "id": f"{prompt['id']}-{i}",
                "messages": prompt["messages"] + [{"role": "assistant", "content": c.text}],
                "source": "distill_traces",
                "metadata": json.dumps({"prompt_id": prompt["id"], "sample_index": i, "task": prompt["task"],
                                        "correct": v.correct, "correct_lenient": v.correct_lenient,
                                        "format_ok": v.format_ok, "reward": v.reward, "num_tokens": c.num_tokens,
                                        "finish_reason": c.finish_reason}, sort_keys=True),
            })
    metrics = trace_metrics(verdicts, rows, len(prompts))
    metrics["tokens_per_s"] = stats.tokens_per_s
    ctx.log_metrics(metrics)
    ctx.log.info("distill_traces: kept %d of %d traces (filter %s) on %d prompts; teacher accuracy %.3f",
                 len(rows), len(verdicts), cfg.filter, len(prompts), metrics["sample_accuracy"])
    if not rows:
        raise SchemaError(f"distill_traces: none of the teacher's {len(verdicts)} traces passed filter={cfg.filter!r} "
                          f"(teacher accuracy {metrics['sample_accuracy']:.3f}, lenient "
                          f"{metrics['sample_accuracy_lenient']:.3f}, format rate {metrics['format_rate']:.3f}): use "
                          f"a stronger teacher, more samples, or a looser filter (lenient, format, none)")
    return {"traces": write_dataset(ctx, "traces", from_rows(rows, "sft"), "sft", metrics)}


def trace_metrics(verdicts: list[tuple[Verdict, Completion]], rows: list[dict], n_prompts: int) -> dict[str, float]:
    """The teacher's sampling statistics and what the filter kept."""
    def rate(values: list) -> float:
        scored = [x for x in values if x is not None]
        return float(np.mean(scored)) if scored else 0.0

    kept_prompts = {json.loads(r["metadata"])["prompt_id"] for r in rows}
    return {
        "prompts": float(n_prompts),
        "samples": float(len(verdicts)),
        "traces": float(len(rows)),
        "keep_rate": len(rows) / max(1, len(verdicts)),
        "prompts_covered": len(kept_prompts) / max(1, n_prompts),
        "sample_accuracy": rate([v.correct for v, _ in verdicts]),
        "sample_accuracy_lenient": rate([v.correct_lenient for v, _ in verdicts]),
        "format_rate": rate([v.format_ok for v, _ in verdicts]),
        "mean_length": float(np.mean([c.num_tokens for _, c in verdicts])) if verdicts else 0.0,
        "truncated_rate": rate([c.finish_reason == "length" for _, c in verdicts]),
    }
