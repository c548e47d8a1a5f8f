"""The model comparison of a pipeline run's report (flows/report/report.py).

**Model comparison.** Every eval node of a recipe scores its model on the same held-out prompts, so
`comparison_rows` (pure) makes one row per eval node that ran or was cached and logged `accuracy`:
eval node, model node, model and eval-output fingerprints, status, accuracy and its 95% bootstrap
interval (`accuracy_ci_low`, `accuracy_ci_high`; `stages.eval` logs them), lenient accuracy, pass@k
(the k that was logged), format rate, mean length, tokens/s, the eval size (`prompts`) and
`<task>/accuracy` with its interval for every task seen, and the held-out prompts found in the model's
training data (`contamination/prompts`, its share, `contaminated`: `stages.eval`'s decontamination). Wherever the report shows an eval's
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
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.exceptions import MlflowException

from flows.plan.recipes import Plan
from flows.plan.results import fmt_metric
from flows.report.tables import markdown_tables
from flows.track.mlflow_runs import get_run, run_link
from flows.track.tracking import Tracker

if TYPE_CHECKING:
    from flows.plan.results import StageResult

REPORT_DIR = "report"

COMPARISON_JSON = "comparison.json"  # under REPORT_DIR; written by publish_report, read by previous_comparison

COMPARISON_CSV = "comparison.csv"

MAX_PREVIOUS_RUNS = 5  # earlier parent runs tried for a comparison.json before giving up

COMPARISON_COLUMNS = (("accuracy", "accuracy [95% CI]"), ("accuracy_lenient", "lenient acc"), ("pass_at_k", "pass@k"),
                      ("format_rate", "format rate"), ("mean_length", "mean length"), ("tokens_per_s", "tokens/s †"),
                      ("prompts", "prompts"), ("contamination/prompts", "contaminated ‡"))

CONTAMINATION_KEYS = ("contamination/share", "contaminated")  # beside contamination/prompts in each row

CI_LOW, CI_HIGH = "_ci_low", "_ci_high"  # `<accuracy key><suffix>`: the eval stage's 95% bootstrap interval

PASS_AT_K = re.compile(r"pass_at_(\d+)")  # full match: `pass_at_1_sampled` and `<task>/pass_at_k` are not it

TASK_ACCURACY = re.compile(r"(?!slice/)(.+)/accuracy")  # full match: not `<task>/accuracy_lenient`, not a slice's

SLICE_ACCURACY = re.compile(r"slice/(.+)/accuracy")  # stages.eval's SLICE_PREFIX: trained tasks vs held-out-only ones


def accuracy_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(pure) (accuracy key, title) of the per-slice then per-task accuracies any row has: `slice/transfer/accuracy`
    is `acc: transfer slice`, `chain_sum/accuracy` is `acc: chain_sum`."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    slices = [(k, f"acc: {m.group(1)} slice") for k in keys if (m := SLICE_ACCURACY.fullmatch(k))]
    return sorted(slices) + [(k, f"acc: {m.group(1)}") for k in keys if (m := TASK_ACCURACY.fullmatch(k))]


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
    tokens_per_s, prompts (the eval size), contamination/prompts, contamination/share, contaminated (held-out
    prompts in the model's training data), and `<task>/accuracy`, `<task>/accuracy_ci_low`,
    `<task>/accuracy_ci_high` for every task any row has; every row has every key, None where a
    value is missing or not finite.
    """
    outputs = {r.node: r.outputs for r in results}
    evals = [r for r in results if r.stage == "eval" and r.status != "skipped" and "accuracy" in r.metrics]
    tasks = sorted({k for r in evals for k in r.metrics if TASK_ACCURACY.fullmatch(k) or SLICE_ACCURACY.fullmatch(k)})
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
        row.update({key: _finite(r.metrics.get(key)) for key in CONTAMINATION_KEYS})
        for key in tasks:
            row.update(with_interval(r.metrics, key))
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


def load_comparison(tracker: Tracker, run_id: str) -> dict[str, Any] | None:
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
    current = get_run(tracker, parent_run_id)
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
        if (data := load_comparison(tracker, run.info.run_id)) is not None:
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


def fmt_contamination(row: dict[str, Any]) -> str:
    """`0`, `2 (25.0%)`, or `2 (25.0%) contaminated` past the eval's threshold: held-out prompts found in the model's
    training data; "—" for an eval logged before the check."""
    count, share = row.get("contamination/prompts"), row.get("contamination/share")
    if not _is_finite(count):
        return "—"
    if not count or not _is_finite(share):
        return _cell(count)
    return f"{count:.0f} ({share:.1%})" + (" contaminated" if row.get("contaminated") else "")


def comparison_markdown(payload: dict[str, Any], tracker: Tracker) -> list[str]:
    """The "Model comparison" section: the table, then what its previous rows are."""
    rows, prev = payload["rows"], payload["previous"]
    before = {p.get("eval"): p for p in prev["rows"]} if prev else {}
    shown = rows + list(before.values())
    accuracies = accuracy_columns(shown)
    ks = {(r.get("pass_k"), r.get("pass_k_prompts")) for r in shown if r.get("pass_at_k") is not None}
    one_k = len(ks) == 1  # one k on one number of prompts: said once, in the header
    columns = sorted(COMPARISON_COLUMNS, key=lambda c: c[0] != "accuracy" and c[0] != "prompts")  # n by accuracy
    titles = [fmt_pass_k(*next(iter(ks))) if key == "pass_at_k" and one_k else title for key, title in columns]

    def line(label: str, row: dict[str, Any]) -> list[str]:
        cells = []
        for key, _ in columns:
            cell = (fmt_interval(row, key) if key == "accuracy" else fmt_contamination(row)
                    if key == "contamination/prompts" else _cell(row.get(key)))
            if key == "pass_at_k" and not one_k and row.get(key) is not None:
                n = row.get("pass_k_prompts")
                cell += f" (k={row.get('pass_k')}" + (f", {n} prompts)" if n else ")")
            cells.append(cell)
        cells += [fmt_interval(row, key) for key, _ in accuracies]
        fp = row.get("model_fingerprint")
        return [label, row.get("model") or "?", fp[:8] if fp else "—", *cells]

    lines = []
    for row in rows:
        lines.append(line(row["eval"], row))
        if row["eval"] in before:
            lines.append(line(f"↳ previous (run {prev['parent_run_id'][:8]})", before[row["eval"]]))
    md = ["", "## Model comparison", "",
          *markdown_tables(["eval", "model", "model fp", *titles, *(title for _, title in accuracies)], lines)]
    md += ["", "Accuracy `a [low, high]`: the 95% percentile bootstrap interval of the accuracy over the eval's "
           "scored greedy prompts (`prompts` is the eval size); no interval: an eval logged without one. "
           "Overlapping intervals of two models do not by themselves show that they are equal: both were "
           "scored on the same prompts, and the gain of one over the other has its own interval, usually "
           "narrower (paired by prompt: `stages.math.stats.paired_bootstrap_diff`).", "",
           "pass@k: the chance that at least one of k sampled completions is correct (unbiased estimator), "
           "averaged over the first N eval prompts only (header or cell: `N prompts`), so it is noisier than "
           "the greedy accuracy on all `prompts`.", "",
           "† tokens/s: wall-clock generation throughput of the eval; it depends on the machine and its load while "
           "the eval ran, so compare it only between runs on the same, equally idle machine.", "",
           "Slices: `trained` is the tasks with prompts in the train split (the kind the recipe trains on), `transfer` "
           "the held-out-only tasks (`eval_tasks`: no stage trains on them); shown where an eval has both.", "",
           "‡ contaminated: held-out prompts found in the evaluated model's training data (every dataset among its "
           "ancestors: same question, 13-word overlap, or the answer in a completion of the same question), with "
           "their share; `contaminated` past the eval's `contamination_threshold` (docs/guides/decontamination.md).",
           ""]
    if prev is not None:
        link = run_link(tracker, prev["parent_run_id"], tracker.experiment_id)
        md.append(f"Rows marked previous: the same eval node in run {link}, whose model had another fingerprint "
                  "(changed upstream config)." if before else
                  f"Compared with run {link}: every evaluated model has the same fingerprint there.")
        md.append("")
    md.append(f"Full fingerprints: `{REPORT_DIR}/{COMPARISON_JSON}` and `{REPORT_DIR}/{COMPARISON_CSV}` in the "
              "parent run's artifacts.")
    return md


TOOL_BINS = (("calls_0", "0 calls"), ("calls_1", "1 call"), ("calls_2plus", "2+ calls"))  # stages/eval.py's bins


def tool_use_markdown(results: list[StageResult]) -> list[str]:
    """The report's "Tool use" section (pure; nothing when no eval sampled with a tool environment): per eval with
    tool metrics, tool calls per answer, the share of calls that failed, model turns per answer, accuracy, and the
    accuracy of the answers that made 0, 1, 2+ calls with their share of the answers."""
    evals = [r for r in results if r.stage == "eval" and r.status != "skipped" and "tool_calls_per_answer" in r.metrics]
    if not evals:
        return []
    rows = []
    for r in evals:
        m = r.metrics
        bins = [f"{_cell(_finite(m.get(f'{key}/accuracy')))} ({_cell(_finite(m.get(f'{key}/share')))})"
                for key, _ in TOOL_BINS]
        calls = _finite(m.get("tool_calls_per_answer"))
        errors = _cell(_finite(m.get("tool_error_rate"))) if calls else "—"  # no calls (an older eval logged 0): none
        rows.append([r.node, _cell(calls), errors, _cell(_finite(m.get("turns"))), fmt_interval(m, "accuracy"), *bins])
    md = ["", "## Tool use (evals with a tool environment)", "",
          *markdown_tables(["eval", "tool calls / answer", "tool error rate", "turns", "accuracy",
                            *(f"acc, {label} (share)" for _, label in TOOL_BINS)], rows)]
    md += ["", "Greedy answers; a bin with no answers has no accuracy (—). The tool error rate is over calls (— without "
           "calls).", ""]
    return md

