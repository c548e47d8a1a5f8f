"""Run visibility: the report of a pipeline run.

**Report.** `build_report` turns the stage results of one pipeline run into markdown (one table
row per stage node: a link to the stage's MLflow run, status run/cached/skipped, seconds; each node's
key metrics in a list; the model comparison; the registry entry; every table split to fit a pane,
flows/report/tables.py) and PNG plots, only where there is data:

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

The model comparison is flows/report/comparison.py's, the registry entry flows/report/registry.py's, the plots
flows/report/plots.py's; the MLflow runs behind the stage results are found by flows/track/mlflow_runs.py.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from prefect import get_run_logger  # imported with the module: Prefect sets up its logging on import
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context

from flows.plan.recipes import Plan
from flows.plan.results import fmt_metric, key_metrics
from flows.report.checkpoint_curve import checkpoint_report
from flows.report.comparison import (
    CI_HIGH,
    CI_LOW,
    COMPARISON_CSV,
    COMPARISON_JSON,
    PASS_AT_K,
    REPORT_DIR,
    comparison_csv,
    comparison_markdown,
    comparison_payload,
    comparison_rows,
    fmt_interval,
    pass_k_prompts,
    previous_comparison,
    tool_use_markdown,
)
from flows.report.gains import gains_markdown, stage_gains
from flows.report.plots import (
    ALARM_PREFIX,
    RL_STAGES,
    TRAINING_PANELS,
    Curve,
    PlotPanel,
    alarm_marks,
    plot_eval,
    plot_panels,
    training_panels,
)
from flows.report.registry import Registration, slug
from flows.report.regressions import regressions_markdown
from flows.report.tables import markdown_tables
from flows.track.mlflow_runs import StageRuns, metric_curve, run_link, stage_runs
from flows.track.tracking import UI_QUERY, Tracker

if TYPE_CHECKING:
    from flows.plan.results import StageResult

log = logging.getLogger("r1flow")

TRAIN_LOSS = "train/loss"
GRPO_CURVES = (("reward/mean", "mean reward"), ("eval/accuracy", "held-out accuracy (greedy)"),
               ("train/kl", "KL to the reference per token (nats)"),
               ("completion/mean_length", "mean completion length (tokens)"))  # grpo.png: GRPO nodes side by side
LOAD_DEPENDENT = re.compile(r".+_per_s|time_per_step")  # full match: wall-clock rates, marked † in the report
SLICE_ACCURACY = re.compile(r"slice/[a-z]+/accuracy")  # full match: an eval's accuracy per slice (stages.eval), with its interval
LOAD_NOTE = ("† Wall-clock throughput (tokens/s, `*_per_s`, `time_per_step`; also the `s` column): it depends on the "
             "machine and on its load while the stage ran (other processes, concurrent runs, CPU threads), so compare "
             "it only between runs on the same, equally idle machine. A cached stage shows the numbers of the run "
             "that produced its outputs.")


def artifact_key(recipe: str) -> str:
    return f"r1flow-report-{slug(recipe)}"


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


def _key_metric(plan: Plan, r: StageResult, key: str, value: float) -> str:
    """`key=value` for the stage table, with what the number needs to be read: the accuracy's
    interval, the prompts pass@k was computed on, † on wall-clock throughput."""
    if key == "accuracy" or SLICE_ACCURACY.fullmatch(key):
        return f"{key}={fmt_interval(r.metrics, key)}"
    text = f"{key}={fmt_metric(value)}"
    if PASS_AT_K.fullmatch(key) and (n := pass_k_prompts(plan.node(r.node).config, r.metrics)):
        return f"{text} ({n} prompt{'s' if n != 1 else ''})"
    return f"{text} †" if LOAD_DEPENDENT.fullmatch(key) else text


def build_report(plan: Plan, results: list[StageResult], tracker: Tracker, parent_run_id: str,
                 registration: Registration | None = None,
                 read_eval: Callable[[str], list[dict[str, Any]]] | None = None,
                 regressions: dict[str, Any] | None = None) -> Report:
    """The run's report: markdown (stage table, model comparison beside the previous run's where a
    model's fingerprint changed, a deployment's regressions against its last successful run, registry entry, plots),
    the PNGs and the comparison payload."""
    runs = {r.node: stage_runs(tracker, r) for r in results}
    md = [f"# r1flow run: recipe `{plan.recipe}`, profile `{plan.profile}`", "",
          f"MLflow parent run: {run_link(tracker, parent_run_id, tracker.experiment_id)}; this report and its "
          f"plots are artifacts of that run under `{REPORT_DIR}/`.", ""]
    stages, metrics, outputs = [], [], []
    for r in results:
        shown = ", ".join(_key_metric(plan, r, k, v) for k, v in key_metrics(r.stage, r.metrics).items())
        metrics += [f"- {r.node}: {shown}"] if shown else []
        outputs += [[r.node, k, f"`{v[:16]}`"] for k, v in r.outputs.items()]
        sr = runs[r.node]
        link = "—"
        if sr is not None:
            link = run_link(tracker, sr.run_id, sr.experiment_id)
            if sr.source_run_id and sr.source_run_id != sr.run_id:
                link += f" (from {run_link(tracker, sr.source_run_id, sr.source_experiment_id)})"
        stages.append([f"{r.node} ({r.stage})", link, r.status, f"{r.seconds:.1f}"])
    # the key metrics in a list, which wraps: in a table cell (Prefect's never wrap) they widened the table past
    # the pane, and what sat right of them was cut off
    md += markdown_tables(["stage (kind)", "MLflow run", "status", "s"], stages)
    md += ["", "Key metrics:", "", *metrics, "", LOAD_NOTE]

    rows = comparison_rows(plan, results)
    comparison = None
    if rows:
        comparison = comparison_payload(plan, parent_run_id, rows, previous_comparison(tracker, plan, parent_run_id))
        md += comparison_markdown(comparison, tracker)
        md += tool_use_markdown(results)
        if read_eval is not None:  # each stage's paired gain over the model it was trained from (flows/report/gains.py)
            comparison["gains"] = stage_gains(plan, results, read_eval)
            md += gains_markdown(comparison["gains"])
    if regressions:  # a deployment's run (flows/run/regressions.py)
        md += regressions_markdown(regressions)

    if registration is not None:
        md += ["", "## Model registry", "", registration.markdown(tracker)]
    md += ["", "## Outputs", "", "Artifact fingerprints (`r1flow artifacts PREFIX` shows one).", ""]
    md += markdown_tables(["stage", "output", "fingerprint"], outputs)

    images = _plots(results, runs, tracker, rows)
    curve_md, curve_images = checkpoint_report(plan, results, runs, tracker)  # docs/guides/checkpoint-evals.md
    md += curve_md
    images += curve_images
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
        wanted = ({k for _, lines in chosen for k, _ in lines} | {k for k, _ in GRPO_CURVES} | {TRAIN_LOSS}
                  | {k for k in sr.source_metrics if k.startswith(ALARM_PREFIX)})
        curves = {k: metric_curve(tracker, sr.source_run_id, k) for k in wanted & set(sr.source_metrics)}

        def curve(key: str, curves: dict[str, Curve] = curves) -> Curve:
            return curves.get(key, ([], []))

        panels = [(f"{label}: {p.title} per step", p.ylabel, [(text, curve(k)) for k, text in lines])
                  for p, lines in chosen]
        panels = [p for p in panels if any(steps for _, (steps, _) in p[2])]  # never an empty panel
        if panels:
            cached = " (cached: the run that produced it)" if sr.source_run_id != sr.run_id else ""
            title = f"{label}: training curves from MLflow run {sr.source_run_id[:8]}{cached}"
            per_node.append((f"train_{re.sub(r'[^A-Za-z0-9_.-]', '-', r.node)}.png", title,
                             plot_panels(panels, title, alarm_marks(curves))))
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
    tracking store keeps them under `<home>/mlartifacts/<run>/artifacts/`), else None; `url`, with a
    tracking server, the report in its UI (the run's Artifacts tab; an `mlflow-artifacts:` URI opens
    nowhere), else None; `files`, the other files logged beside it (`report/...`, as `publish_report`
    returns them)."""
    run = tracker.client.get_run(parent_run_id).info
    uri = f"{run.artifact_uri.rstrip('/')}/{REPORT_DIR}/report.md"
    parsed = urlparse(uri)
    path = None
    if parsed.scheme in ("", "file"):
        local = Path(unquote(parsed.path) if parsed.scheme else uri)
        path = str(local) if local.is_file() else None
    url = None
    if tracker.is_server:
        url = (f"{tracker.uri.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{parent_run_id}/artifacts/"
               f"{REPORT_DIR}/report.md{UI_QUERY}")
    return {"uri": uri, "path": path, "url": url, "files": [f for f in files if f != f"{REPORT_DIR}/report.md"]}


