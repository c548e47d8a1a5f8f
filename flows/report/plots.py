"""The PNG plots of a pipeline run's report (flows/report/report.py): which panels each stage's training plot has
(`TRAINING_PANELS`, `training_panels`), and drawing panels of curves and the eval bars with matplotlib (Agg).
Pure: curves in, PNG bytes out; reading them from MLflow is the report's."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from flows.report.comparison import CI_HIGH, CI_LOW


@dataclass(frozen=True)
class Panel:
    """One panel of a stage's training plot: the metrics its users watch that share a y axis.

    lines: (metric key, legend label); a key ending in `/*` stands for every logged key under that
    prefix except `exclude`, each labelled by the rest of its name (GRPO's reward components)."""

    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]
    exclude: frozenset[str] = frozenset()

_LR = Panel("learning rate", "learning rate", (("train/lr", "learning rate"),))

_GRAD = Panel("gradient norm before clipping", "global L2 norm", (("train/grad_norm", "grad norm"),))


# what each stage's users watch, from the keys the stages log per step (ctx.log_metrics(..., step=));
# the first panel of a loss-trained stage (train/loss) is its panel in the overview training_loss.png
TRAINING_PANELS: dict[str, tuple[Panel, ...]] = {
    "sft": (Panel("train loss", "NLL per target token (nats)", (("train/loss", "train batch"),)), _LR, _GRAD),
    "distill": (
        Panel("distillation loss", "loss per target token", (("train/loss", "train batch"),)),
        Panel("student NLL of the training tokens", "NLL per target token (nats)", (("train/nll", "train batch"),)),
        Panel("student sample length (on-policy)", "tokens", (("train/sample_length", "mean"),)),
        _LR, _GRAD),
    "reward_model": (
        Panel("Bradley-Terry loss", "loss per pair", (("train/loss", "train batch"),)),
        Panel("pairwise accuracy", "fraction of pairs, chosen > rejected", (("train/accuracy", "train batch"),)),
        _LR, _GRAD),
    "preference_optimization": (
        Panel("preference loss", "loss per pair (or example)", (("train/loss", "train batch"), ("eval/loss", "held-out"))),
        Panel("reward accuracy", "fraction of pairs, chosen > rejected",
              (("train/rewards/accuracy", "train batch"), ("eval/accuracy", "held-out"))),
        Panel("implicit reward margin", "chosen - rejected", (("train/rewards/margin", "train batch"),
                                                              ("eval/margin", "held-out"))),
        Panel("implicit rewards", "beta * log-ratio to the reference",
              (("train/rewards/chosen", "chosen, train"), ("train/rewards/rejected", "rejected, train"),
               ("eval/chosen", "chosen, held-out"), ("eval/rejected", "rejected, held-out"))),
        Panel("KL to the reference (held-out prompts)", "nats per completion", (("eval/kl", "KL(policy || ref)"),)),
        _LR, _GRAD),
    "grpo": (
        Panel("mean reward", "reward (weighted sum)", (("reward/mean", "rollouts"),)),
        Panel("reward components", "mean per completion (unweighted)", (("reward/*", ""),),
              frozenset({"reward/mean", "reward/std", "reward/zero_std_groups", "reward/unscored", "reward/accuracy",
                         "reward/format_rate", "reward/process_mean", "reward/steps_per_completion"})),
        Panel("accuracy", "fraction correct", (("reward/accuracy", "rollouts (sampled)"),
                                               ("eval/accuracy", "held-out (greedy)"))),
        Panel("format rate", "fraction well-formed", (("reward/format_rate", "rollouts (sampled)"),
                                                      ("eval/format_rate", "held-out (greedy)"))),
        Panel("KL to the reference", "KL estimate per token (nats)", (("train/kl", "KL(policy || ref)"),)),
        Panel("policy entropy", "nats per token", (("train/entropy", "entropy"),)),
        Panel("completion length", "tokens", (("completion/mean_length", "mean"), ("completion/max_length", "max"))),
        Panel("completions cut at max_new_tokens", "fraction of completions", (("completion/truncated_frac", "cut"),)),
        Panel("clip fraction", "fraction of tokens clipped", (("train/clip_low", "ratio below 1 - eps_low"),
                                                              ("train/clip_high", "ratio above 1 + eps_high"))),
        Panel("groups with equal rewards (no signal)", "fraction of groups", (("reward/zero_std_groups", "groups"),)),
        Panel("process reward", "mean step score", (("reward/process_mean", "process reward"),)),
        Panel("sampler / trainer mismatch", "KL per token (nats)", (("train/mismatch_kl", "mismatch KL"),)),
        _GRAD),
    "ppo": (
        Panel("mean reward", "score per completion", (("reward/mean", "rollouts"),
                                                      ("reward/kl_penalized", "score - beta * KL (the return)"))),
        Panel("accuracy", "fraction correct", (("reward/accuracy", "rollouts (sampled)"),
                                               ("eval/accuracy", "held-out (greedy)"))),
        Panel("KL to the reference", "KL estimate per token (nats)", (("train/kl", "KL(policy || ref)"),)),
        Panel("value loss", "clipped squared error / 2", (("train/value_loss", "value loss"),)),
        Panel("explained variance", "1 - Var(R - V) / Var(R)", (("train/explained_variance", "critic"),)),
        Panel("clip fractions", "fraction of tokens clipped", (("train/clip_low", "policy, ratio below 1 - eps"),
                                                               ("train/clip_high", "policy, ratio above 1 + eps"),
                                                               ("train/value_clipfrac", "value"))),
        Panel("approximate KL between updates", "k3 per token (nats)", (("train/approx_kl", "new || old"),)),
        Panel("policy entropy", "nats per token", (("train/entropy", "entropy"),)),
        Panel("completion length", "tokens", (("completion/mean_length", "mean"), ("completion/max_length", "max"))),
        Panel("gradient norms before clipping", "global L2 norm", (("train/grad_norm", "policy"),
                                                                    ("train/critic_grad_norm", "critic"))),
    ),
}

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


def panel_figure(panels: list[PlotPanel], title: str):
    """A figure of curves over optimizer steps, one panel each (empty panels dropped), integer step ticks."""
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
        ax.set_title(panel_title, fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole steps only, one point too
        ax.grid(alpha=0.3)
        if sum(1 for label, (steps, _) in lines if steps and label) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def plot_panels(panels: list[PlotPanel], title: str) -> bytes:
    return _png(panel_figure(panels, title))


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
