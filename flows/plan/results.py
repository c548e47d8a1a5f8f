"""What a pipeline run returns per node (`StageResult`) and the few metrics its tables show per
stage; shared by the pipeline, the report, the CLI and single-stage runs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

KEY_METRICS = {
    "import_model": ("parameters",),
    "prompts": ("train_rows", "eval_rows"),
    "sft": ("final_loss", "steps", "resumed_from_step"),  # the stage's steps, not those of its last stretch alone
    "rejection_sampling": ("acceptance_rate", "accepted_rows", "sample_accuracy"),
    "preference_data": ("pairs", "mean_margin"),
    "reward_model": ("eval_accuracy", "eval_margin"),
    "grpo": ("reward_first", "reward_last", "eval_accuracy_last", "time_per_step"),
    "ppo": ("reward_first", "reward_last", "explained_variance_last", "eval_accuracy_last", "time_per_step"),
    "reference_logprobs": ("completions", "sequences_per_s"),
    "preference_optimization": ("eval_accuracy", "eval_margin", "eval_kl", "units_per_s"),
    "distill_traces": ("traces", "keep_rate", "sample_accuracy", "sample_accuracy_lenient"),
    "make_student": ("parameters", "teacher_parameters", "layers"),
    "distill": ("student_parameters", "teacher_parameters", "heldout_nll_before", "heldout_nll_after",
                "heldout_nll_teacher"),
    "eval": ("accuracy", "accuracy_lenient", "format_rate", "pass_at_[0-9]", "pass_at_[0-9][0-9]", "mean_length"),
}
SHOWN_WHEN_NONZERO = frozenset({"resumed_from_step"})  # 0: the stage ran from its first step, which goes unsaid


@dataclass
class StageResult:
    node: str
    stage: str
    status: str  # "run" | "cached" | "skipped"
    seconds: float
    prefect_state: str = ""
    outputs: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    started_at: float | None = None  # wall clock (epoch seconds) where the stage task ran: overlap is visible
    ended_at: float | None = None
    host: str = ""  # the machine it ran on
    ray_node_id: str = ""  # and the Ray node, in cluster mode

    def key_metrics(self) -> dict[str, float]:
        return key_metrics(self.stage, self.metrics)


def key_metrics(stage: str, metrics: dict[str, float]) -> dict[str, float]:
    """The few metrics the summary table shows for a stage (patterns allow e.g. pass_at_4)."""
    return {k: v for pattern in KEY_METRICS.get(stage, ()) for k, v in metrics.items() if fnmatch.fnmatchcase(k, pattern)
            and not (k in SHOWN_WHEN_NONZERO and not v)}


def fmt_metric(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 or float(v).is_integer() else f"{v:.3f}"
