"""What the `r1flow` commands print: the end-of-run summary of `r1flow run` (the per-stage table, the model
comparison, where the report and the UIs are), terminal tables that fit the console's width, plain aligned
columns, and the servers a command uses."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from flows.servers.servers import MLFLOW_UI_QUERY, ui_port
from schemas.errors import R1FlowError, exception_chain


def print_servers_used(args: argparse.Namespace) -> None:
    print(f"servers ({args.servers_source}): Prefect {os.environ.get('PREFECT_API_URL') or 'temporary'}, "
          f"MLflow {os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite under the home'}", flush=True)


class _NoTracebackForR1FlowErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], R1FlowError):
            record.exc_info, record.exc_text = None, None
        return True


def one_line_errors() -> None:
    """Prefect logs the exception that ends a flow or task run with its traceback ("Encountered exception during
    execution", ~70 lines for a full disk). An r1flow error's message is the whole story, and the command prints it
    as its one `r1flow: error:` line: Prefect's record keeps its line (in the terminal and the UI), not the
    traceback. Other exceptions keep theirs."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForR1FlowErrors) for f in logger.filters):
            logger.addFilter(_NoTracebackForR1FlowErrors())


PREFECT_START_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def prefect_start_failure(exc: BaseException, timeout_s: str | None = None) -> str | None:
    """(pure) The one line for Prefect's temporary server not answering in time, or None for any other exception
    (searched along its causes). Prefect's RuntimeError carries the server's whole stdout and stderr; the line keeps
    its exit code, if it exited, and says what to change. `timeout_s`: the startup timeout in force
    (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, which flows/servers/settings.py sets to 90 unless the user did)."""
    for link in exception_chain(exc):
        text = str(link)
        if isinstance(link, RuntimeError) and text.startswith(PREFECT_START_TIMEOUT):
            code = re.search(r"exited with code (-?\d+)", text)
            within = f" within {timeout_s} s" if timeout_s else ""
            exited = f" (its process exited with code {code.group(1)})" if code else ""
            return (f"r1flow: error: the temporary Prefect server did not answer{within}{exited}; on a busy machine "
                    "raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or start the servers once with `r1flow up`")
    return None


SUMMARY_WIDTH = 100  # columns of the end-of-run summary when stdout is not a terminal and COLUMNS is not set


def _console(width: int | None = None):
    """A rich Console as wide as the terminal (or COLUMNS); SUMMARY_WIDTH when writing to a file or pipe."""
    # lazy: start-up (`r1flow --help` loads none of these: rich)
    from rich.console import Console

    if width is None and not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit():
        width = SUMMARY_WIDTH
    return Console(width=width, highlight=False)


@dataclass
class Column:
    """A column of a terminal table. `drop`: 0 is always shown; the others go, highest first, while
    the table is wider than the console. `wrap`: the cells may wrap inside the column (a list of
    metrics, wrapped between items); the others are never wrapped or cut."""

    header: str
    cells: list[str]
    drop: int = 0
    justify: str = "left"
    wrap: bool = False
    styles: list[str] | None = None  # one per cell (the status column's colour)

WRAP_MIN = 40  # a wrap column narrower than this is a mess of short lines: optional columns go first


def fit_table(console, columns: list[Column], row_styles: list[str] | None = None, **table_kw):
    """A rich Table of the columns that fit the console's width: optional ones are dropped, highest
    `drop` first, until the table fits with its wrap columns at least WRAP_MIN wide (or as wide as
    their widest cell); only wrap columns then wrap. Returns (table, the headers of the dropped columns)."""
    # lazy: start-up (`r1flow --help` loads none of these: rich)
    from rich import box
    from rich.cells import cell_len
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    shown, dropped = list(columns), []

    def build() -> Table:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, **table_kw)
        for c in shown:
            table.add_column(c.header, justify=c.justify, no_wrap=not c.wrap, overflow="fold")
        for i in range(len(columns[0].cells) if columns else 0):
            table.add_row(*(Text(c.cells[i], style=c.styles[i] if c.styles else "") for c in shown),  # not markup
                          style=row_styles[i] if row_styles else None)
        return table

    def needed(table: Table) -> int:  # its natural width, less what its wrap columns may give up
        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        slack = sum(max(0, max(map(cell_len, [c.header, *c.cells])) - WRAP_MIN) for c in shown if c.wrap)
        return natural - slack

    table = build()
    while needed(table) > console.width and any(c.drop for c in shown):
        worst = max((c for c in shown if c.drop), key=lambda c: (c.drop, shown.index(c)))
        shown.remove(worst)
        dropped.append(worst)
        table = build()
    for c in sorted(dropped, key=lambda c: (c.drop, columns.index(c))):  # the most wanted that fit again
        shown = sorted([*shown, c], key=columns.index)
        if needed(build()) > console.width:
            shown.remove(c)
        else:
            dropped.remove(c)
    return build(), [c.header for c in dropped]


def stage_columns(result: dict) -> list[Column]:
    """The per-stage table of a run: node, kind, status, seconds, key metrics, outputs (the
    outputs' fingerprints go first when narrow: the report and `r1flow artifacts` have them)."""
    # lazy: start-up (`r1flow --help` loads none of these: MLflow)
    from flows.plan.results import fmt_metric, key_metrics
    from flows.report.comparison import fmt_interval

    rows = result["stages"]
    metrics = [", ".join(f"{k}={fmt_interval(r['metrics'], k) if k == 'accuracy' else fmt_metric(v)}"
                         for k, v in key_metrics(r["stage"], r["metrics"]).items()) for r in rows]
    columns = [
        Column("stage", [r["node"] for r in rows]),
        Column("kind", [r["stage"] if r["stage"] != r["node"] else "" for r in rows], drop=2),
        Column("status", [r["status"] for r in rows],
               styles=[{"run": "green", "cached": "cyan", "skipped": "dim"}.get(r["status"], "") for r in rows]),
        Column("s", [f"{r['seconds']:.1f}" for r in rows], justify="right"),
        Column("key metrics", metrics, wrap=True),
        Column("outputs", [", ".join(f"{k}:{v[:12]}" for k, v in r["outputs"].items()) for r in rows], drop=3,
               wrap=True),
    ]
    return columns


def comparison_columns(payload: dict) -> tuple[list[Column], list[str]]:
    """The report's model comparison (flows/comparison.comparison_payload) for a terminal: each eval's
    model, accuracy with its 95% bootstrap interval and the eval size n; then, as width allows,
    pass@k, format rate, the held-out prompts found in the model's training data, the accuracy per slice (trained /
    transfer), per-task accuracies and the
    model's fingerprint. A previous run's row
    (its model had another fingerprint) sits under the row of its eval node, as in the report."""
    # lazy: start-up (`r1flow --help` loads none of these: MLflow)
    from flows.plan.results import fmt_metric
    from flows.report.comparison import accuracy_columns, fmt_contamination, fmt_interval

    prev = payload.get("previous") or {}
    before = {p.get("eval"): p for p in prev.get("rows", [])}
    lines: list[tuple[str, dict]] = []
    for row in payload["rows"]:
        lines.append((row["eval"], row))
        if row["eval"] in before:
            lines.append((f"↳ previous (run {prev['parent_run_id'][:8]})", before[row["eval"]]))
    rows = [r for _, r in lines]
    ks = sorted({r.get("pass_k") for r in rows if r.get("pass_at_k") is not None})

    def num(value) -> str:
        return "—" if value is None else fmt_metric(value)

    def pass_cell(r: dict) -> str:
        cell = num(r.get("pass_at_k"))
        return cell + (f" (k={r['pass_k']})" if len(ks) > 1 and r.get("pass_at_k") is not None else "")

    columns = [
        Column("eval", [label for label, _ in lines]),
        Column("model", [r.get("model") or "?" for r in rows]),
        Column("accuracy [95% CI]", [fmt_interval(r, "accuracy") for r in rows]),
        Column("n", [f"{r['prompts']:.0f}" if r.get("prompts") is not None else "—" for r in rows], justify="right"),
        Column(f"pass@{ks[0]}" if len(ks) == 1 else "pass@k", [pass_cell(r) for r in rows], drop=2, justify="right"),
        Column("format", [num(r.get("format_rate")) for r in rows], drop=1, justify="right"),
        Column("contaminated", [fmt_contamination(r) for r in rows], drop=3, justify="right"),
    ]
    accuracies = accuracy_columns(rows)
    slices = [key for key, _ in accuracies if key.startswith("slice/")]
    if slices:  # one narrow column, kept as long as the format's: `0.445 / 0.281`; their intervals are in the report
        columns.append(Column(" / ".join(key.split("/")[1] for key in slices),
                              [" / ".join(num(r.get(key)) for key in slices) for r in rows], drop=1, justify="right"))
    columns += [Column(title, [fmt_interval(r, key) for r in rows], drop=4)
                for key, title in accuracies if key not in slices]
    columns.append(Column("model fp", [(r.get("model_fingerprint") or "—")[:8] for r in rows], drop=5))
    styles = ["dim" if label.startswith("↳") else "" for label, _ in lines]
    return columns, styles


def _r1flow_command() -> str:
    """How to call r1flow from this shell: `r1flow` when that is on PATH and is this installation,
    else the venv's script (relative to the working directory when under it), else `python -m flows.cli`."""
    script = Path(sys.executable).parent / "r1flow"
    found = shutil.which("r1flow")
    if found and (not script.exists() or Path(found).resolve() == script.resolve()):
        return "r1flow"
    if not script.exists():
        return f"{sys.executable} -m flows.cli"
    try:
        return str(script.absolute().relative_to(Path.cwd()))
    except ValueError:  # not under the working directory
        return str(script.absolute())


def ui_command(home: str) -> str:
    """A shell command that opens the MLflow UI on this home's tracking store (`r1flow ui`), with
    the environment it needs when this shell may not have it (a home other than ./.r1flow)."""
    env = ""
    if Path(home).resolve() != Path(".r1flow").resolve():
        env = f"R1FLOW_HOME={shlex.quote(str(home))} "
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri and uri != f"sqlite:///{home}/mlflow.db":
        env += f"MLFLOW_TRACKING_URI={shlex.quote(uri)} "
    return f"{env}{_r1flow_command()} ui"


def print_gains(console, gains: list[dict]) -> None:
    """Each stage's paired gain over the model it was trained from (flows/report/gains.py), a line each."""
    # lazy: start-up (`r1flow --help` loads none of these: yaml, the stages)
    from flows.report.gains import fmt_gain, gain_labels

    if not gains:
        return
    console.print("stage gains, held-out accuracy points, paired by prompt [95% interval]:")
    labels = gain_labels(gains)  # `[python]`: the environment an eval sampled in, where the gains span several
    width = max(len(model) for model, _ in labels)
    for g, (model, over) in zip(gains, labels, strict=True):
        console.print(f"  {model:<{width}}  {fmt_gain(g):<24} over {over} ({g['relation'].removeprefix('over ')})"
                      f", {g['prompts']} prompts", markup=False)
        if g.get("slices"):  # the trained kind and the held-out-only tasks (transfer), each paired the same way
            console.print(f"  {'':<{width}}  " + "; ".join(f"{name} {fmt_gain(s)} ({s['prompts']})"
                                                           for name, s in g["slices"].items()), markup=False)


def time_line(stage_work: float, total: float, before_flow: float) -> str:
    """(pure) Where a run's time went: the stages' seconds summed, and the rest of the total. Stages that ran side by
    side (--parallel, --cluster) sum to more than the flow's wall time, which leaves no start-up overhead to tell
    apart: then the line says so instead of printing a negative one."""
    flow = total - before_flow
    if stage_work <= flow:
        return (f"stage work {stage_work:.1f} s; fixed start-up overhead {total - stage_work:.1f} s (imports and "
                f"validation {before_flow:.1f} s, the rest Prefect/MLflow); total {total:.1f} s")
    return (f"stage work {stage_work:.1f} s, summed over stages that ran side by side within the flow's {flow:.1f} s; "
            f"imports and validation {before_flow:.1f} s; total {total:.1f} s")


def print_summary(result: dict, total: float, before_flow: float, console=None) -> None:
    """The end of `r1flow run`: the per-stage table and timings, then the model comparison, where
    the report is, how to open the UIs and the URL of the MLflow parent run (each URL and path on
    a line of its own, never wrapped: they are copied)."""
    # lazy: start-up (`r1flow --help` loads none of these: rich)
    from rich.text import Text

    from flows.servers.settings import Settings

    console = console or _console()
    table, _ = fit_table(console, stage_columns(result),
                         title=Text(f"r1flow run — recipe {result['recipe']}, profile {result['profile']}"))
    console.print(table)
    console.print(time_line(sum(r["seconds"] for r in result["stages"]), total, before_flow))

    def line(text: str) -> None:  # a path or URL: not wrapped, so it can be copied whole
        console.print(text, soft_wrap=True, markup=False)

    payload = result.get("comparison")
    console.print()
    if payload:
        columns, styles = comparison_columns(payload)
        table, dropped = fit_table(console, columns, styles, title="model comparison (held-out prompts)",
                                   title_justify="left")
        console.print(table)
        notes = ["accuracy [95% bootstrap interval] on n held-out prompts"]
        if payload.get("previous") and payload["previous"].get("rows"):
            notes.append("↳ previous: that eval in the last run of this recipe and profile (its model differed)")
        if dropped:
            notes.append(f"also in the report: {', '.join(dropped)}")
        console.print("; ".join(notes), markup=False)
        print_gains(console, payload.get("gains") or [])
    else:
        console.print("model comparison: none (no eval node of this run logged an accuracy)")

    report = result.get("report") or {}
    if report.get("path"):
        console.print("report (with its comparison CSV/JSON and plots in the same folder):")
        line(report["path"])
    elif report.get("url"):  # a tracking server: its mlflow-artifacts: URI opens nowhere, the UI's page does
        console.print("report (in the MLflow parent run's Artifacts, beside the comparison and plots):")  # < 80 columns: one line
        line(report["url"])
    elif report.get("uri"):
        console.print("report (an artifact of the MLflow parent run; the UI shows it under Artifacts):")
        line(report["uri"])
    files = [f.rsplit("/", 1)[-1] for f in report.get("files", [])]
    plots = [f for f in files if f.endswith(".png")]
    others = [f for f in files if f not in plots] + ([f"{len(plots)} PNG plots"] if plots else [])
    if others:
        console.print("  beside it: " + ", ".join(others), markup=False)

    home = Settings.from_env().home
    link = result.get("link") or ""
    if link.startswith(("http://", "https://")):  # an MLflow server: its UI is already up
        console.print("MLflow UI: the tracking server; parent run:")
        line(link)
    else:
        port = ui_port(home)
        console.print(f"MLflow UI (on 127.0.0.1:{port}, this home's; Ctrl-C stops it):")
        line(ui_command(home))
        console.print("then the parent run:")
        line(f"http://127.0.0.1:{port}/#/experiments/{result['experiment_id']}/runs/"
             f"{result['parent_run_id']}{MLFLOW_UI_QUERY}")
    prefect = os.environ.get("PREFECT_API_URL", "")
    if prefect and result.get("flow_run_id"):
        console.print("Prefect flow run:")
        line(f"{prefect.rstrip('/').removesuffix('/api')}/runs/flow-run/{result['flow_run_id']}")


def text_table(headers: list[str], rows: list[list[str]], right: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """Plain aligned columns, each as wide as its longest cell (a long node name widens its column
    instead of pushing the others out of line); columns in `right` are right-aligned; the last
    column is not padded."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(headers)] + [line(r) for r in rows]
