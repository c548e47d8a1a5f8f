"""The PNG plots of a pipeline run's report (flows/report/report.py): which panels each stage's training plot has
(`TRAINING_PANELS`, from each stage's row in `stages.STAGES`; `training_panels`), and drawing panels of curves
and the eval bars with matplotlib (Agg). Pure: curves in, PNG bytes out; reading them from MLflow is the report's."""

from __future__ import annotations

import io
import math
from typing import Any

from flows.report.comparison import CI_HIGH, CI_LOW
from stages import STAGES, Panel

# what each stage's users watch: the panels of its row in `stages.STAGES`
TRAINING_PANELS: dict[str, tuple[Panel, ...]] = {name: s.panels for name, s in STAGES.items() if s.panels}

RL_STAGES = ("grpo", "ppo")  # their losses mean little to a reader (centred advantages): grpo.png compares them


def training_panels(stage: str, logged: set[str] | dict[str, Any]) -> list[tuple[Panel, list[tuple[str, str]]]]:
    """The panels of `stage` that have a logged metric, each with its (key, label) lines that were
    logged, in the table's order (pure). Unknown stages and stages without logged keys: []."""
    out = []
    for panel in TRAINING_PANELS.get(stage, ()):
        lines = []
        for key, label in panel.lines:
            if key.endswith("/*"):
                prefix = key[:-1]
                lines += [(k, k[len(prefix):]) for k in sorted(logged)
                          if k.startswith(prefix) and "/" not in k[len(prefix):] and k not in panel.exclude]
            elif key in logged:
                lines.append((key, label))
        if lines:
            out.append((panel, lines))
    return out

Curve = tuple[list[int], list[float]]


# (panel title, y label, [(legend label, (steps, values))]); a panel without lines is never drawn
PlotPanel = tuple[str, str, list[tuple[str, Curve]]]


def _figure(panels: int, width: float = 4.6, height: float = 3.2):
    # lazy: start-up (matplotlib, only when a report draws)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def panel_figure(panels: list[PlotPanel], title: str, alarms: dict[int, str] | None = None):
    """A figure of curves over optimizer steps, one panel each (empty panels dropped), integer step ticks; `alarms`
    (step -> the rules that fired there, `alarm/<rule>` metrics of an RL stage) a dotted red line on every panel."""
    # lazy: start-up (matplotlib, only when a report draws)
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in panels if any(steps for _, (steps, _) in p[2])]
    if not panels:
        raise ValueError(f"{title}: no curve has a point")
    fig, axes = _figure(len(panels), width=5.0)
    for ax, (panel_title, ylabel, lines) in zip(axes, panels, strict=True):
        for label, (steps, values) in lines:
            if steps:  # a single point (a metric logged at the last step only) needs a visible marker
                ax.plot(steps, values, marker="o" if len(steps) == 1 else "." if len(steps) < 30 else None,
                        label=label or None)
        for step, rules in sorted((alarms or {}).items()):
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1)
            ax.annotate(f"alarm: {rules}", (step, 1), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", rotation=90, va="top", fontsize="x-small", color="tab:red")
        ax.set_title(panel_title, fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole steps only, one point too
        ax.grid(alpha=0.3)
        if sum(1 for label, (steps, _) in lines if steps and label) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def plot_panels(panels: list[PlotPanel], title: str, alarms: dict[int, str] | None = None) -> bytes:
    return _png(panel_figure(panels, title, alarms))


ALARM_PREFIX = "alarm/"  # stages.training.rl_loop logs alarm/<rule> = 1 at the step a reward-hacking alarm fired


def alarm_marks(curves: dict[str, Curve]) -> dict[int, str]:
    """step -> the rules (comma-separated) whose `alarm/<rule>` curve has a point there (pure)."""
    marks: dict[int, list[str]] = {}
    for key, (steps, _) in sorted(curves.items()):
        if key.startswith(ALARM_PREFIX):
            for step in steps:
                marks.setdefault(step, []).append(key.removeprefix(ALARM_PREFIX))
    return {step: ", ".join(rules) for step, rules in marks.items()}


def plot_eval(rows: list[tuple[str, dict[str, float]]]) -> bytes:
    """rows: (label, metrics) per eval node; bars of accuracy (with its 95% interval as an error bar
    where the metrics have `accuracy_ci_low`/`_high`) and, where logged, format rate."""
    fig, (ax,) = _figure(1, width=max(4.6, 1.4 * len(rows) + 2), height=3.6)
    keys = [k for k in ("accuracy", "format_rate") if any(k in m for _, m in rows)]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))]
        values = [m.get(key, 0.0) for _, m in rows]
        nan = float("nan")  # no error bar drawn: an eval logged before intervals
        pairs = list(zip(values, (m for _, m in rows), strict=True))
        below = [max(0.0, v - m[key + CI_LOW]) if key + CI_LOW in m else nan for v, m in pairs]
        above = [max(0.0, m[key + CI_HIGH] - v) if key + CI_HIGH in m else nan for v, m in pairs]
        with_ci = key == "accuracy" and any(math.isfinite(e) for e in above)
        ax.bar(xs, values, width, yerr=[below, above] if with_ci else None, capsize=4,
               label=key.replace("_", " ") + (" (95% CI)" if with_ci else ""))
        for x, v, up in zip(xs, values, above, strict=True):  # above the error bar, not across it
            ax.annotate(f"{v:.2f}", (x, v + (up if with_ci and math.isfinite(up) else 0.0)), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize="small")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize="small")
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("fraction of held-out prompts")
    ax.legend(fontsize="small", loc="upper center", ncols=len(keys))
    ax.set_title("evaluation per model")
    return _png(fig)
