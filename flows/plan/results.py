"""What a pipeline run returns per node (`StageResult`) and the few metrics its tables show per
stage; shared by the pipeline, the report, the CLI and single-stage runs."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from stages import STAGES

# the metrics the summary table shows per stage: the key_metrics of its row in `stages.STAGES`
KEY_METRICS: dict[str, tuple[str, ...]] = {name: s.key_metrics for name, s in STAGES.items() if s.key_metrics}
# 0: the stage ran from its first step, or no held-out prompt was in the model's training data; that goes unsaid
SHOWN_WHEN_NONZERO = frozenset({"resumed_from_step", "contamination/prompts"})


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
