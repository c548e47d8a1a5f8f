"""Run visibility: the report of a pipeline run, and the recipe's models in the MLflow Model Registry.

**Report.** `build_report` turns the stage results of one pipeline run into markdown (one table
row per stage node: a link to the stage's MLflow run, status run/cached/skipped, seconds, key
metrics; the model comparison table; the registry entry) and PNG plots, only where there is data:

- `training_loss.png`: `train/loss` over steps, one panel per node of a loss-trained stage (sft,
  distill, reward_model, preference_optimization; their scales differ too much for one axis). Not
  GRPO: its loss is ~0 by construction (group-centred advantages) and says nothing to a reader;
- `grpo.png`: the GRPO nodes side by side, one line per node: mean reward, held-out accuracy (when
  the stage evaluated during training), KL to the reference, mean completion length;
- `eval.png`: accuracy and format rate of every eval node, labelled with the model it evaluated;
- `train_<node>.png`, one per trained node: the metrics that stage's users watch, one panel each
  (`TRAINING_PANELS`; `training_panels` picks those the node logged, so no panel is empty): SFT
  loss, learning rate, gradient norm; distill loss and NLL; reward-model loss and pairwise
  accuracy; preference-optimisation loss, reward accuracy, margins and implicit rewards (train and
  held-out) and KL; GRPO mean reward, reward components, accuracy, format rate, KL, entropy,
  completion length, truncation, clip fraction, flat groups, gradient norm.

Every curve is over optimizer steps, with whole-number ticks; each panel's title names the node,
stage and metric, and each figure the MLflow run the curves were read from. Numbers that need
context say it: pass@k names the prompts it was computed on (`pass@4 (8 prompts)`), and throughput
(tokens/s, `*_per_s`, `time_per_step`, seconds) carries † and a note that it depends on the
machine's load.

Curves are read back from MLflow (`get_metric_history`). A cached stage's run in this pipeline run
is a fresh "cache hit" run with summary metrics only; its tag `r1flow.source_run_id` names the run
that produced the outputs, and the curves are read from there. `publish_report` logs
`report/report.md` and the PNGs as artifacts of the parent run and, inside a Prefect flow run, a
Prefect markdown artifact `r1flow-report-<recipe>` with the same text (a Prefect artifact cannot
embed local files: it names where the PNGs are; with an MLflow server it embeds them by URL).
MLflow errors propagate; a failed Prefect artifact only logs a warning.

**Model comparison.** Every eval node of a recipe scores its model on the same held-out prompts, so
`comparison_rows` (pure) makes one row per eval node that ran or was cached and logged `accuracy`:
eval node, model node, model and eval-output fingerprints, status, accuracy and its 95% bootstrap
interval (`accuracy_ci_low`, `accuracy_ci_high`; `stages.eval` logs them), lenient accuracy, pass@k
(the k that was logged), format rate, mean length, tokens/s, the eval size (`prompts`) and
`<task>/accuracy` with its interval for every task seen. Wherever the report shows an eval's
accuracy (stage table, comparison table, `eval.png`) its interval is next to it, `0.500 [0.363,
0.637]`; evals logged before r1flow had intervals show the accuracy alone. The report shows the rows
under "Model comparison"; `publish_report` logs them (full
fingerprints, with recipe, profile and parent run id) as `report/comparison.json` and
`report/comparison.csv`, only when there are rows, so a run without evals never hides an earlier
comparison. Old vs new, by lineage: `previous_comparison` loads `report/comparison.json` of the
newest other FINISHED parent run (tags `r1flow.recipe`, `r1flow.profile`; no `mlflow.parentRunId`)
of the same recipe and profile in this experiment, started no later than this one, passing over
at most `MAX_PREVIOUS_RUNS` runs without one. Under each eval node whose model fingerprint differs
from that run's row for the same eval node (a changed upstream config re-ran the model), the
table adds the previous row, `↳ previous (run <id>)`; unchanged fingerprints get none. Those rows
are in `comparison.json` under `previous` and in the CSV with their own `parent_run_id`.

**Registry scheme.** One registered model per recipe, `r1flow-<recipe>`. Its versions are the
recipe's model artifacts that matter:

- *final* models: the model outputs (a stage's `OUTPUTS` of kind `model`) of every model-producing
  node with no model-producing node downstream of it, directly or through datasets (in `sft-eval`
  that is `sft`; in `rlhf` `reward_model`; in `rejection-rounds` `sft_round2`);
- *evaluated* models: the model input of every eval node that ran or was cached in this run (so
  `base` is a version too when it is evaluated, and can be compared).

A version's source is the artifact's place in the store: its local directory, or the store URI +
`/artifacts/<fingerprint>` for a remote store. An MLflow server refuses local paths outside the
run's artifact directory, so with a server and a local store the source is
`runs:/<producing run>/outputs/<output>` (where the manifest is logged) and the local directory is
in the tag `r1flow.artifact`. Every version carries the tag `r1flow.fingerprint`; a model whose
fingerprint already has a version reuses it, so a cached re-run adds no versions. Aliases, moved
on every run that reaches them:

- `final`: the final model of the newest run (the last final node in plan order when a recipe has
  several). MLflow reserves the alias name `latest` (`models:/<name>/latest` is the highest version
  number, which need not be the final model), hence `final`.
- `champion`: the evaluated model with the highest eval `accuracy` in that run (ties: higher
  format rate, then the later node), moved only by runs in which every eval node ran or was
  cached (a `--only` run leaves it alone). Only evals of one run are compared: they share
  held-out prompts, while runs with other profiles or overrides need not.

Load with `models:/r1flow-<recipe>@final` or `@champion`; the version's tags name the node,
stage, fingerprint and eval results.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.exceptions import MlflowException
from prefect import get_run_logger  # imported with the module: Prefect sets up its logging on import

from flows.recipes import Plan
from flows.results import fmt_metric, key_metrics
from flows.tracking import Tracker, sqlite_lock
from stages import get_stage

if TYPE_CHECKING:
    from flows.results import StageResult
    from flows.store import ArtifactStore

log = logging.getLogger("r1flow")

REPORT_DIR = "report"
FINAL_ALIAS = "final"
CHAMPION_ALIAS = "champion"
FINGERPRINT_TAG = "r1flow.fingerprint"
TRAIN_LOSS = "train/loss"
GRPO_CURVES = (("reward/mean", "mean reward"), ("eval/accuracy", "held-out accuracy (greedy)"),
               ("train/kl", "KL to the reference per token (nats)"),
               ("completion/mean_length", "mean completion length (tokens)"))  # grpo.png: GRPO nodes side by side
COMPARISON_JSON = "comparison.json"  # under REPORT_DIR; written by publish_report, read by previous_comparison
COMPARISON_CSV = "comparison.csv"
MAX_PREVIOUS_RUNS = 5  # earlier parent runs tried for a comparison.json before giving up
COMPARISON_COLUMNS = (("accuracy", "accuracy [95% CI]"), ("accuracy_lenient", "lenient acc"), ("pass_at_k", "pass@k"),
                      ("format_rate", "format rate"), ("mean_length", "mean length"), ("tokens_per_s", "tokens/s †"),
                      ("prompts", "prompts"))
CI_LOW, CI_HIGH = "_ci_low", "_ci_high"  # `<accuracy key><suffix>`: the eval stage's 95% bootstrap interval
PASS_AT_K = re.compile(r"pass_at_(\d+)")  # full match: `pass_at_1_sampled` and `<task>/pass_at_k` are not it
TASK_ACCURACY = re.compile(r"(.+)/accuracy")  # full match: not `<task>/accuracy_lenient`
LOAD_DEPENDENT = re.compile(r".+_per_s|time_per_step")  # full match: wall-clock rates, marked † in the report
LOAD_NOTE = ("† Wall-clock throughput (tokens/s, `*_per_s`, `time_per_step`; also the `s` column): it depends on the "
             "machine and on its load while the stage ran (other processes, concurrent runs, CPU threads), so compare "
             "it only between runs on the same, equally idle machine. A cached stage shows the numbers of the run "
             "that produced its outputs.")


def slug(text: str) -> str:
    """Lowercase letters, digits and dashes only (Prefect artifact keys; registry names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "recipe"


def registered_model_name(recipe: str) -> str:
    return f"r1flow-{slug(recipe)}"


def artifact_key(recipe: str) -> str:
    return f"r1flow-report-{slug(recipe)}"


# ---------------------------------------------------------------------------------------- MLflow runs
@dataclass
class StageRuns:
    """The MLflow runs behind one stage result: the run of this pipeline run and the one that
    produced the outputs (the same run unless the stage was a cache hit)."""

    run_id: str
    experiment_id: str
    source_run_id: str | None  # None: the producing run is not in this tracking store
    source_experiment_id: str | None
    source_metrics: set[str] = field(default_factory=set)  # metric keys the producing run logged


def _get_run(tracker: Tracker, run_id: str):
    try:
        return tracker.client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def stage_runs(tracker: Tracker, result: StageResult) -> StageRuns | None:
    if result.status == "skipped" or not result.mlflow_run_id:
        return None
    run = _get_run(tracker, result.mlflow_run_id)
    if run is None:
        return None
    source = run
    if run.data.tags.get("r1flow.cache_hit") == "true":
        src_id = run.data.tags.get("r1flow.source_run_id")
        source = _get_run(tracker, src_id) if src_id else None
    return StageRuns(run.info.run_id, run.info.experiment_id,
                     source.info.run_id if source else None, source.info.experiment_id if source else None,
                     set(source.data.metrics) if source else set())


def metric_curve(tracker: Tracker, run_id: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric, one value per step (the last one logged: a resumed stage may
    log a step twice), non-finite values dropped."""
    last: dict[int, tuple[int, float]] = {}
    for m in tracker.client.get_metric_history(run_id, key):
        if math.isfinite(m.value) and (m.step not in last or m.timestamp >= last[m.step][0]):
            last[m.step] = (m.timestamp, m.value)
    steps = sorted(last)
    return steps, [last[s][1] for s in steps]


# ---------------------------------------------------------------------------------------- plots
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


# ---------------------------------------------------------------------------------------- model comparison
def _finite(value: float | None) -> float | None:
    """JSON and the table have no NaN: an unscored metric is missing, not a number."""
    return float(value) if value is not None and math.isfinite(value) else None


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def with_interval(metrics: dict[str, Any], key: str) -> dict[str, float | None]:
    """`key` and, beside it, `key_ci_low` and `key_ci_high` from metrics (None where missing or not finite)."""
    return {k: _finite(metrics.get(k)) for k in (key, key + CI_LOW, key + CI_HIGH)}


def fmt_interval(metrics: dict[str, Any], key: str) -> str:
    """`0.500 [0.363, 0.637]`: the value of `key` and its interval; the value alone when the
    metrics have no (finite) interval, as in evals logged before intervals; "—" when no value."""
    value, low, high = (metrics.get(k) for k in (key, key + CI_LOW, key + CI_HIGH))
    if not _is_finite(value):
        return "—"
    text = fmt_metric(value)
    return text + f" [{low:.3f}, {high:.3f}]" if _is_finite(low) and _is_finite(high) else text


def pass_k_prompts(config: Any, metrics: dict[str, Any]) -> int | None:
    """How many prompts an eval's pass@k was computed on (pure): the `pass_k_prompts` metric where
    the eval logged one, else the first `config.pass_k_prompts` of its `prompts` (the eval size),
    whichever is smaller; None when neither is known."""
    logged = metrics.get("pass_k_prompts")
    if _is_finite(logged):
        return int(logged)
    first = getattr(config, "pass_k_prompts", None)
    size = metrics.get("prompts")
    if first is None:
        return None
    return min(int(first), int(size)) if _is_finite(size) else int(first)


def fmt_pass_k(k: Any, prompts: Any) -> str:
    """`pass@4 (8 prompts)`: what a pass@k value was computed on."""
    return f"pass@{k}" + (f" ({prompts} prompt{'s' if prompts != 1 else ''})" if prompts else "")


def comparison_rows(plan: Plan, results: list[StageResult]) -> list[dict[str, Any]]:
    """One row per eval node that ran or was cached and logged `accuracy`, in plan order (pure).

    Keys: eval, model, model_output, model_fingerprint, eval_fingerprint, status, mlflow_run_id,
    accuracy, accuracy_ci_low, accuracy_ci_high (its 95% bootstrap interval), accuracy_lenient,
    pass_k and pass_at_k (the largest k logged as `pass_at_<k>`), pass_k_prompts (how many prompts
    pass@k was computed on, `pass_k_prompts`), format_rate, mean_length,
    tokens_per_s, prompts (the eval size), and `<task>/accuracy`, `<task>/accuracy_ci_low`,
    `<task>/accuracy_ci_high` for every task any row has; every row has every key, None where a
    value is missing or not finite.
    """
    outputs = {r.node: r.outputs for r in results}
    evals = [r for r in results if r.stage == "eval" and r.status != "skipped" and "accuracy" in r.metrics]
    tasks = sorted({m.group(1) for r in evals for k in r.metrics if (m := TASK_ACCURACY.fullmatch(k))})
    rows = []
    for r in evals:
        model, output = plan.node(r.node).inputs.get("model", (None, None))
        ks = [int(m.group(1)) for k in r.metrics if (m := PASS_AT_K.fullmatch(k))]
        k = max(ks) if ks else None
        row: dict[str, Any] = {
            "eval": r.node, "model": model, "model_output": output,
            "model_fingerprint": outputs.get(model, {}).get(output), "eval_fingerprint": next(iter(r.outputs.values()), None),
            "status": r.status, "mlflow_run_id": r.mlflow_run_id, "pass_k": k,
            "pass_at_k": _finite(r.metrics.get(f"pass_at_{k}")) if k else None}
        row["pass_k_prompts"] = pass_k_prompts(plan.node(r.node).config, r.metrics) if k else None
        for key, _ in COMPARISON_COLUMNS:
            if key == "accuracy":
                row.update(with_interval(r.metrics, key))
            elif key != "pass_at_k":
                row[key] = _finite(r.metrics.get(key))
        for t in tasks:
            row.update(with_interval(r.metrics, f"{t}/accuracy"))
        rows.append(row)
    return rows


def changed_rows(rows: list[dict[str, Any]], previous_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """eval node -> the previous run's row for it, where that row's model had another fingerprint."""
    before = {p.get("eval"): p for p in previous_rows}
    return {r["eval"]: before[r["eval"]] for r in rows
            if r["eval"] in before and before[r["eval"]].get("model_fingerprint") != r["model_fingerprint"]}


def _search_value(value: str) -> str | None:
    """A quoted string literal for an MLflow search filter, or None when the value has both quotes."""
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    return None


def _load_comparison(tracker: Tracker, run_id: str) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="r1flow-comparison-") as tmp:
        try:
            path = tracker.client.download_artifacts(run_id, f"{REPORT_DIR}/{COMPARISON_JSON}", tmp)
            data = json.loads(Path(path).read_text())
        except (MlflowException, OSError, ValueError):  # no such artifact (no evals, older r1flow), or unreadable
            return None
    return data if isinstance(data, dict) and isinstance(data.get("rows"), list) else None


def previous_comparison(tracker: Tracker, plan: Plan, parent_run_id: str) -> dict[str, Any] | None:
    """`report/comparison.json` of the newest other FINISHED parent run of the plan's recipe and
    profile in this experiment, started no later than `parent_run_id`; runs without one are passed
    over, at most MAX_PREVIOUS_RUNS of them. None when there is none. Its `parent_run_id` is the
    run it was read from."""
    wanted = {"r1flow.recipe": plan.recipe, "r1flow.profile": plan.profile}
    clauses = ["attributes.status = 'FINISHED'"]
    clauses += [f"tags.`{k}` = {q}" for k, v in wanted.items() if (q := _search_value(v))]  # else checked below only
    current = _get_run(tracker, parent_run_id)
    if current is not None:
        clauses.append(f"attributes.start_time <= {current.info.start_time}")
    runs = tracker.client.search_runs([tracker.experiment_id], " and ".join(clauses),
                                      max_results=MAX_PREVIOUS_RUNS + 1, order_by=["attributes.start_time DESC"])
    tried = 0
    for run in runs:
        tags = run.data.tags
        if (run.info.run_id == parent_run_id or "mlflow.parentRunId" in tags
                or any(tags.get(k) != v for k, v in wanted.items())):
            continue
        if tried == MAX_PREVIOUS_RUNS:
            break
        tried += 1
        if (data := _load_comparison(tracker, run.info.run_id)) is not None:
            return {**data, "parent_run_id": run.info.run_id}
    return None


def comparison_payload(plan: Plan, parent_run_id: str, rows: list[dict[str, Any]],
                       previous: dict[str, Any] | None) -> dict[str, Any]:
    """What `report/comparison.json` holds: this run's rows and, under `previous`, the rows of the
    previous comparison whose model fingerprint differs (None when there was no previous run)."""
    prev = None
    if previous is not None:
        prev = {"parent_run_id": previous["parent_run_id"],
                "rows": list(changed_rows(rows, previous["rows"]).values())}
    return {"recipe": plan.recipe, "profile": plan.profile, "parent_run_id": parent_run_id, "rows": rows,
            "previous": prev}


def comparison_csv(payload: dict[str, Any]) -> str:
    """The rows as CSV, each previous row right below the row of its eval node; the column
    `parent_run_id` says which run a row belongs to."""
    prev = payload["previous"] or {"parent_run_id": None, "rows": []}
    before = {p.get("eval"): p for p in prev["rows"]}
    lines = []
    for row in payload["rows"]:
        lines.append({"parent_run_id": payload["parent_run_id"], **row})
        if row["eval"] in before:
            lines.append({"parent_run_id": prev["parent_run_id"], **before[row["eval"]]})
    columns = list(dict.fromkeys(k for line in lines for k in line))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    return buf.getvalue()


def _cell(value: Any) -> str:
    return fmt_metric(value) if _is_finite(value) else "—"


def comparison_markdown(payload: dict[str, Any], tracker: Tracker) -> list[str]:
    """The "Model comparison" section: the table, then what its previous rows are."""
    rows, prev = payload["rows"], payload["previous"]
    before = {p.get("eval"): p for p in prev["rows"]} if prev else {}
    shown = rows + list(before.values())
    tasks = list(dict.fromkeys(m.group(1) for r in shown for k in r if (m := TASK_ACCURACY.fullmatch(k))))
    ks = {(r.get("pass_k"), r.get("pass_k_prompts")) for r in shown if r.get("pass_at_k") is not None}
    one_k = len(ks) == 1  # one k on one number of prompts: said once, in the header
    titles = [fmt_pass_k(*next(iter(ks))) if key == "pass_at_k" and one_k else title for key, title in COMPARISON_COLUMNS]
    md = ["", "## Model comparison", "",
          "| eval | model | model fp | " + " | ".join(titles + [f"acc: {t}" for t in tasks]) + " |",
          "|---|---|---|" + "---|" * (len(titles) + len(tasks))]

    def line(label: str, row: dict[str, Any]) -> str:
        cells = []
        for key, _ in COMPARISON_COLUMNS:
            cell = fmt_interval(row, key) if key == "accuracy" else _cell(row.get(key))
            if key == "pass_at_k" and not one_k and row.get(key) is not None:
                n = row.get("pass_k_prompts")
                cell += f" (k={row.get('pass_k')}" + (f", {n} prompts)" if n else ")")
            cells.append(cell)
        cells += [fmt_interval(row, f"{t}/accuracy") for t in tasks]
        fp = row.get("model_fingerprint")
        return f"| {label} | {row.get('model') or '?'} | {fp[:8] if fp else '—'} | " + " | ".join(cells) + " |"

    for row in rows:
        md.append(line(row["eval"], row))
        if row["eval"] in before:
            md.append(line(f"↳ previous (run {prev['parent_run_id'][:8]})", before[row["eval"]]))
    md += ["", "Accuracy `a [low, high]`: the 95% percentile bootstrap interval of the accuracy over the eval's "
           "scored greedy prompts (`prompts` is the eval size); no interval: an eval logged without one. "
           "Overlapping intervals of two models do not by themselves show that they are equal: both were "
           "scored on the same prompts, and the gain of one over the other has its own interval, usually "
           "narrower (paired by prompt: `stages.math.stats.paired_bootstrap_diff`).", "",
           "pass@k: the chance that at least one of k sampled completions is correct (unbiased estimator), "
           "averaged over the first N eval prompts only (header or cell: `N prompts`), so it is noisier than "
           "the greedy accuracy on all `prompts`.", "",
           "† tokens/s: wall-clock generation throughput of the eval; it depends on the machine and its load while "
           "the eval ran, so compare it only between runs on the same, equally idle machine.", ""]
    if prev is not None:
        link = _link(tracker, prev["parent_run_id"], tracker.experiment_id)
        md.append(f"Rows marked previous: the same eval node in run {link}, whose model had another fingerprint "
                  "(changed upstream config)." if before else
                  f"Compared with run {link}: every evaluated model has the same fingerprint there.")
        md.append("")
    md.append(f"Full fingerprints: `{REPORT_DIR}/{COMPARISON_JSON}` and `{REPORT_DIR}/{COMPARISON_CSV}` in the "
              "parent run's artifacts.")
    return md


# ---------------------------------------------------------------------------------------- report
@dataclass
class Report:
    recipe: str
    markdown: str
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (file name, PNG bytes)
    comparison: dict[str, Any] | None = None  # comparison.json (comparison_payload); None: no eval rows

    @property
    def key(self) -> str:
        return artifact_key(self.recipe)


def _link(tracker: Tracker, run_id: str, experiment_id: str) -> str:
    target = tracker.run_url(run_id, experiment_id) or tracker.run_path(run_id, experiment_id)
    return f"[{run_id[:8]}]({target})"


def _key_metric(plan: Plan, r: StageResult, key: str, value: float) -> str:
    """`key=value` for the stage table, with what the number needs to be read: the accuracy's
    interval, the prompts pass@k was computed on, † on wall-clock throughput."""
    if key == "accuracy":
        return f"{key}={fmt_interval(r.metrics, key)}"
    text = f"{key}={fmt_metric(value)}"
    if PASS_AT_K.fullmatch(key) and (n := pass_k_prompts(plan.node(r.node).config, r.metrics)):
        return f"{text} ({n} prompt{'s' if n != 1 else ''})"
    return f"{text} †" if LOAD_DEPENDENT.fullmatch(key) else text


def build_report(plan: Plan, results: list[StageResult], tracker: Tracker, parent_run_id: str,
                 registration: Registration | None = None) -> Report:
    """The run's report: markdown (stage table, model comparison beside the previous run's where a
    model's fingerprint changed, registry entry, plots), the PNGs and the comparison payload."""
    runs = {r.node: stage_runs(tracker, r) for r in results}
    md = [f"# r1flow run: recipe `{plan.recipe}`, profile `{plan.profile}`", "",
          f"MLflow parent run: {_link(tracker, parent_run_id, tracker.experiment_id)}; this report and its "
          f"plots are artifacts of that run under `{REPORT_DIR}/`.", "",
          # the link before the metrics: a long metrics cell widens the table past a Prefect or MLflow pane (1269 px
          # in 868 px), and what sits right of it is off-screen
          "| stage (kind) | MLflow run | status | s | key metrics |",
          "|---|---|---|---|---|"]
    outputs = ["", "## Outputs", "", "Artifact fingerprints (`r1flow artifacts PREFIX` shows one).", "",
               "| stage | output | fingerprint |", "|---|---|---|"]
    for r in results:
        metrics = ", ".join(_key_metric(plan, r, k, v) for k, v in key_metrics(r.stage, r.metrics).items())
        outputs += [f"| {r.node} | {k} | `{v[:16]}` |" for k, v in r.outputs.items()]
        sr = runs[r.node]
        link = "—"
        if sr is not None:
            link = _link(tracker, sr.run_id, sr.experiment_id)
            if sr.source_run_id and sr.source_run_id != sr.run_id:
                link += f" (produced by {_link(tracker, sr.source_run_id, sr.source_experiment_id)})"
        md.append(f"| {r.node} ({r.stage}) | {link} | {r.status} | {r.seconds:.1f} | {metrics} |")

    md += ["", LOAD_NOTE]

    rows = comparison_rows(plan, results)
    comparison = None
    if rows:
        comparison = comparison_payload(plan, parent_run_id, rows, previous_comparison(tracker, plan, parent_run_id))
        md += comparison_markdown(comparison, tracker)

    if registration is not None:
        md += ["", "## Model registry", "", registration.markdown(tracker)]
    md += outputs

    images = _plots(results, runs, tracker, rows)
    md += ["", "## Plots", ""]
    if not images:
        md.append("No training curves or eval results in this run.")
    for name, title, _ in images:
        path = f"{REPORT_DIR}/{name}"
        url = tracker.artifact_url(parent_run_id, path)  # a server serves them: embed (Prefect shows them too)
        md += [f"![{title}]({url})", ""] if url else [f"- {title}: `{path}` in the parent run's artifacts"]
    if not tracker.is_server:
        md += ["", f"MLflow links are relative to the MLflow UI; open it with `{tracker.ui_hint()}`."]
    return Report(plan.recipe, "\n".join(md) + "\n", [(n, png) for n, _, png in images], comparison)


def _plots(results: list[StageResult], runs: dict[str, StageRuns | None], tracker: Tracker,
           comparison: list[dict[str, Any]]) -> list[tuple[str, str, bytes]]:
    """(file name, title, PNG) for each plot that has data: the overviews (training_loss.png of the
    loss-trained nodes, grpo.png, eval.png), then `train_<node>.png` per trained node in plan order."""
    images, per_node = [], []
    loss: list[PlotPanel] = []
    grpo: dict[str, list[tuple[str, Curve]]] = {}
    for r in results:
        sr = runs[r.node]
        if sr is None or sr.source_run_id is None:
            continue
        label = f"{r.node} ({r.stage})" if r.node != r.stage else r.node
        chosen = training_panels(r.stage, sr.source_metrics)
        wanted = {k for _, lines in chosen for k, _ in lines} | {k for k, _ in GRPO_CURVES} | {TRAIN_LOSS}
        curves = {k: metric_curve(tracker, sr.source_run_id, k) for k in wanted & set(sr.source_metrics)}

        def curve(key: str, curves: dict[str, Curve] = curves) -> Curve:
            return curves.get(key, ([], []))

        panels = [(f"{label}: {p.title} per step", p.ylabel, [(text, curve(k)) for k, text in lines])
                  for p, lines in chosen]
        panels = [p for p in panels if any(steps for _, (steps, _) in p[2])]  # never an empty panel
        if panels:
            cached = " (cached: the run that produced it)" if sr.source_run_id != sr.run_id else ""
            title = f"{label}: training curves from MLflow run {sr.source_run_id[:8]}{cached}"
            per_node.append((f"train_{re.sub(r'[^A-Za-z0-9_.-]', '-', r.node)}.png", title, plot_panels(panels, title)))
        if r.stage in RL_STAGES:  # a GRPO loss is ~0 by construction (advantages are centred): the overview is grpo.png
            for key, _ in GRPO_CURVES:
                if curve(key)[0]:
                    grpo.setdefault(key, []).append((r.node, curve(key)))
        elif curve(TRAIN_LOSS)[0]:
            first = TRAINING_PANELS.get(r.stage, ())
            ylabel = first[0].ylabel if first and first[0].lines[0][0] == TRAIN_LOSS else TRAIN_LOSS
            loss.append((f"{label}: train loss per step", ylabel, [("", curve(TRAIN_LOSS))]))
    if loss:
        title = "train loss per optimizer step" + (" (GRPO/PPO nodes: grpo.png)" if grpo else "")
        images.append(("training_loss.png", "train loss over steps: " + ", ".join(p[0].split(":")[0] for p in loss),
                       plot_panels(loss, title)))
    if grpo:
        titles = dict(GRPO_CURVES)
        panels = [(f"RL: {titles[k]} per step", titles[k], grpo[k]) for k, _ in GRPO_CURVES if k in grpo]
        nodes = ", ".join(dict.fromkeys(n for lines in grpo.values() for n, _ in lines))
        images.append(("grpo.png", f"RL nodes (GRPO, PPO) side by side ({nodes}): " + ", ".join(titles[k] for k in grpo)
                       + " over steps", plot_panels(panels, f"RL nodes side by side: {nodes}")))
    shown = ("accuracy", "accuracy" + CI_LOW, "accuracy" + CI_HIGH, "format_rate")
    bars = [(f"{r['eval']}\n({r['model']}, {r['prompts']:.0f} prompts)" if r.get("prompts") else
             f"{r['eval']}\n({r['model']})", {k: r[k] for k in shown if r.get(k) is not None}) for r in comparison]
    if any(m for _, m in bars):
        images.append(("eval.png", "eval accuracy (95% CI) and format rate per model", plot_eval(bars)))
    return images + per_node


def _in_prefect_run() -> bool:
    try:
        from prefect.context import get_run_context

        get_run_context()
        return True
    except Exception:  # MissingContextError outside a flow or task run
        return False


def publish_report(report: Report, tracker: Tracker, parent_run_id: str) -> dict[str, Any]:
    """Log `report/report.md`, the PNGs and (with eval rows) `report/comparison.json` and
    `report/comparison.csv` to the parent run (MLflow errors propagate); inside a Prefect flow run
    also create the markdown artifact `report.key` (a failure there only warns)."""
    with tempfile.TemporaryDirectory(prefix="r1flow-report-") as tmp:
        d = Path(tmp)
        (d / "report.md").write_text(report.markdown)
        for name, png in report.images:
            (d / name).write_bytes(png)
        if report.comparison is not None:
            (d / COMPARISON_JSON).write_text(json.dumps(report.comparison, indent=1))
            (d / COMPARISON_CSV).write_text(comparison_csv(report.comparison))
        names = sorted(p.name for p in d.iterdir())
        tracker.log_dir(parent_run_id, d, REPORT_DIR)
    out: dict[str, Any] = {"mlflow_artifacts": [f"{REPORT_DIR}/{n}" for n in names], "prefect_artifact_id": None}
    if _in_prefect_run():
        try:
            from prefect.artifacts import create_markdown_artifact

            out["prefect_artifact_id"] = str(create_markdown_artifact(
                markdown=report.markdown, key=report.key,
                description=f"r1flow run report: recipe {report.recipe}, MLflow parent run {parent_run_id}"))
        except Exception as e:  # the report is in MLflow already; the run's work must not be lost over this
            _warn(f"could not create the Prefect report artifact {report.key!r}: {type(e).__name__}: {e}")
    return out


def _warn(message: str) -> None:
    try:
        get_run_logger().warning(message)
    except Exception:
        log.warning(message)


def report_location(tracker: Tracker, parent_run_id: str, files: list[str]) -> dict[str, Any]:
    """Where `publish_report` put the report: `uri`, the artifact URI of `report/report.md`; `path`,
    its local file when the parent run's artifacts are on this machine and it exists (a local
    tracking store keeps them under `<home>/mlartifacts/<run>/artifacts/`), else None; `files`,
    the other files logged beside it (`report/...`, as `publish_report` returns them)."""
    from urllib.parse import unquote, urlparse

    base = tracker.client.get_run(parent_run_id).info.artifact_uri.rstrip("/")
    uri = f"{base}/{REPORT_DIR}/report.md"
    parsed = urlparse(uri)
    path = None
    if parsed.scheme in ("", "file"):
        local = Path(unquote(parsed.path) if parsed.scheme else uri)
        path = str(local) if local.is_file() else None
    return {"uri": uri, "path": path, "files": [f for f in files if f != f"{REPORT_DIR}/report.md"]}


# ---------------------------------------------------------------------------------------- registry
def model_outputs(stage: str) -> list[str]:
    """Output names of a stage whose declared kind is `model`."""
    return [name for name, kind in get_stage(stage).OUTPUTS.items() if kind == "model"]


def final_model_nodes(plan: Plan) -> list[str]:
    """Model-producing nodes with no model-producing node downstream (directly or via datasets)."""
    producers = {n.name for n in plan.nodes if model_outputs(n.stage)}
    return [n.name for n in plan.nodes
            if n.name in producers and not (plan.descendants({n.name}) - {n.name}) & producers]


def evaluated_models(plan: Plan) -> dict[str, tuple[str, str]]:
    """eval node -> (node, output) of the model it evaluates."""
    return {n.name: n.inputs["model"] for n in plan.nodes if n.stage == "eval" and "model" in n.inputs}


@dataclass
class Registration:
    name: str
    versions: dict[str, str] = field(default_factory=dict)  # "node.output" -> version
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> version
    created: list[str] = field(default_factory=list)  # versions created by this run

    def markdown(self, tracker: Tracker) -> str:
        by_version: dict[str, list[str]] = {}
        for alias, v in self.aliases.items():
            by_version.setdefault(v, []).append(f"@{alias}")
        name = f"[`{self.name}`]({tracker.uri.rstrip('/')}/#/models/{self.name})" if tracker.is_server else f"`{self.name}`"
        lines = [f"Registered model {name} (load with `models:/{self.name}@{FINAL_ALIAS}` or "
                 f"`models:/{self.name}@{CHAMPION_ALIAS}`):", ""]
        for ref, v in self.versions.items():
            notes = by_version.get(v, []) + (["new"] if v in self.created else [])
            lines.append(f"- {ref}: version {v}" + (f" ({', '.join(notes)})" if notes else ""))
        return "\n".join(lines)


def _model_source(store: ArtifactStore | None, tracker: Tracker, fingerprint: str, output: str,
                  run_id: str | None) -> tuple[str, str]:
    """(model version source, the artifact's location in the store)."""
    runs_uri = f"runs:/{run_id}/outputs/{output}" if run_id else None
    if store is None:
        return runs_uri or f"r1flow-artifact:{fingerprint}", ""
    if not store.is_local:
        location = store.fs.unstrip_protocol(store.artifact_path(fingerprint))
        return location, location
    location = str(Path(store.artifact_path(fingerprint)).resolve())
    if tracker.is_server and runs_uri:  # a server refuses local paths outside the run's artifact dir
        return runs_uri, location
    return location, location


def _ensure_registered_model(tracker: Tracker, name: str, recipe: str) -> None:
    try:
        tracker.client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            tracker.client.create_registered_model(
                name, tags={"r1flow.recipe": recipe},
                description=f"r1flow recipe `{recipe}`: its final and evaluated models, one version per model "
                            f"fingerprint. @{FINAL_ALIAS}: the final model of the newest run; @{CHAMPION_ALIAS}: "
                            f"the best eval accuracy of the newest run that evaluated every model.")
        except MlflowException as e:  # a concurrent run created it first
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def register_models(plan: Plan, results: list[StageResult], tracker: Tracker,
                    store: ArtifactStore | None = None, parent_run_id: str | None = None) -> Registration | None:
    """Register the run's final and evaluated models under `r1flow-<recipe>` and move the aliases
    (scheme in the module docstring). Nodes skipped in this run are left out; None when none remain.

    Runs that finish together on one local sqlite store register one at a time (`sqlite_lock`: else both
    add a version of the same fingerprint, or one fails on `UNIQUE constraint failed:
    registered_model_aliases`); against a server, moving an alias is retried on that race."""
    with sqlite_lock(tracker.uri):
        return _register_models(plan, results, tracker, store, parent_run_id)


def _set_alias(client, name: str, alias: str, version: str, attempts: int = 5) -> None:
    """set_registered_model_alias, retried when a concurrent run moved the same alias at the same moment."""
    for attempt in range(attempts):
        try:
            client.set_registered_model_alias(name, alias, version)
            return
        except MlflowException as e:
            if "UNIQUE constraint" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def _register_models(plan: Plan, results: list[StageResult], tracker: Tracker, store: ArtifactStore | None,
                     parent_run_id: str | None) -> Registration | None:
    done = {r.node: r for r in results if r.status != "skipped" and r.outputs}
    finals = [n for n in final_model_nodes(plan) if n in done]
    all_evals = evaluated_models(plan)
    evaluated = {e: m for e, m in all_evals.items() if e in done and m[0] in done}  # evaluated in this run
    wanted: list[tuple[str, str]] = []
    for node in plan.nodes:
        refs = [(node.name, o) for o in model_outputs(node.stage)] if node.name in finals else []
        refs += [m for m in evaluated.values() if m[0] == node.name]
        wanted += [ref for ref in dict.fromkeys(refs) if ref not in wanted and ref[1] in done[ref[0]].outputs]
    if not wanted:
        return None
    name = registered_model_name(plan.recipe)
    _ensure_registered_model(tracker, name, plan.recipe)
    reg = Registration(name)
    client = tracker.client
    for node, output in wanted:
        r = done[node]
        fp = r.outputs[output]
        ref = f"{node}.{output}"
        same = client.search_model_versions(f"name='{name}' and tags.`{FINGERPRINT_TAG}` = '{fp}'")
        if same:
            reg.versions[ref] = str(max(int(v.version) for v in same))
            continue
        runs = stage_runs(tracker, r)
        run_id = (runs.source_run_id or runs.run_id) if runs else None
        source, location = _model_source(store, tracker, fp, output, run_id)
        tags = {FINGERPRINT_TAG: fp, "r1flow.node": node, "r1flow.stage": r.stage, "r1flow.output": output,
                "r1flow.recipe": plan.recipe, "r1flow.profile": plan.profile, "r1flow.artifact": location,
                "r1flow.final": str(node in finals).lower(), "r1flow.parent_run_id": parent_run_id or ""}
        mv = client.create_model_version(name, source, run_id=run_id, tags=tags,
                                         description=f"{r.stage} node `{node}` of recipe `{plan.recipe}`, "
                                                     f"artifact {fp[:12]}")
        reg.versions[ref] = str(mv.version)
        reg.created.append(str(mv.version))

    candidates = []
    order = {n.name: i for i, n in enumerate(plan.nodes)}
    for eval_node, (node, output) in evaluated.items():
        r = done.get(eval_node)
        version = reg.versions.get(f"{node}.{output}")
        if r is None or version is None or "accuracy" not in r.metrics:
            continue
        for key in ("accuracy", "accuracy" + CI_LOW, "accuracy" + CI_HIGH, "format_rate"):
            if key in r.metrics:
                client.set_model_version_tag(name, version, f"r1flow.eval.{eval_node}.{key}", str(r.metrics[key]))
        candidates.append((r.metrics["accuracy"], r.metrics.get("format_rate", 0.0), order[node], version))
    final_versions = [v for ref, v in reg.versions.items() if finals and ref.split(".", 1)[0] == finals[-1]]
    if final_versions:
        _set_alias(client, name, FINAL_ALIAS, final_versions[0])
        reg.aliases[FINAL_ALIAS] = final_versions[0]
    if candidates and len(candidates) == len(all_evals):  # a partial run (--only) leaves @champion alone
        version = max(candidates)[3]
        _set_alias(client, name, CHAMPION_ALIAS, version)
        reg.aliases[CHAMPION_ALIAS] = version
    return reg
