"""The `r1flow` command line. Validates everything before importing Prefect or touching a model."""

from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from schemas.errors import R1FlowError  # noqa: E402


def _default_profile() -> str:
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _print_servers_used(args: argparse.Namespace) -> None:
    import os

    print(f"servers ({args.servers_source}): Prefect {os.environ.get('PREFECT_API_URL') or 'temporary'}, "
          f"MLflow {os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite under the home'}", flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    from flows.recipes import DEFAULT_RECIPE, load_plan
    from flows.settings import Settings, make_home, start_temporary_prefect

    recipe = args.recipe or DEFAULT_RECIPE
    profile = args.profile or _default_profile()
    plan = load_plan(recipe, profile, args.set)  # every config error surfaces here, before any compute
    for name in (args.only or []) + (args.force or []):
        plan.node(name)
    from flows.placement import Execution, check_driver, cluster_address
    from stages.runtime import threads

    execution = Execution(parallel=args.parallel, cluster=cluster_address(args.cluster))
    settings = Settings.from_env()
    check_driver(execution, settings.store, settings.tracking_uri)  # before anything is written
    make_home()
    start_temporary_prefect()
    print(f"r1flow: recipe {plan.recipe!r}, profile {plan.profile!r}, model {plan.model!r}, "
          f"{len(plan.nodes)} stages, {execution.describe()}; home {settings.home}; {threads.describe()}", flush=True)
    _print_servers_used(args)
    from flows.pipeline import pipeline

    t_flow = time.perf_counter()
    result = pipeline(recipe=recipe, profile=profile, overrides=list(args.set), only=args.only, force=args.force,
                      settings=settings.to_dict(), parallel=execution.parallel, cluster=execution.cluster)
    total = time.perf_counter() - _T_START
    if args.json:  # first: a reader of the summary that goes away (`| head`) must not lose it
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    print_summary(result, total=total, before_flow=t_flow - _T_START)
    return 0


SUMMARY_WIDTH = 100  # columns of the end-of-run summary when stdout is not a terminal and COLUMNS is not set
from flows.servers import MLFLOW_UI_PORT  # noqa: E402  (`r1flow ui`'s first choice; a home keeps the one it got)


def _console(width: int | None = None):
    """A rich Console as wide as the terminal (or COLUMNS); SUMMARY_WIDTH when writing to a file or pipe."""
    import os

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
    from flows.report import fmt_interval
    from flows.results import fmt_metric, key_metrics

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
    """The report's model comparison (flows/report.comparison_payload) for a terminal: each eval's
    model, accuracy with its 95% bootstrap interval and the eval size n; then, as width allows,
    pass@k, format rate, per-task accuracies and the model's fingerprint. A previous run's row
    (its model had another fingerprint) sits under the row of its eval node, as in the report."""
    from flows.report import TASK_ACCURACY, fmt_interval
    from flows.results import fmt_metric

    prev = payload.get("previous") or {}
    before = {p.get("eval"): p for p in prev.get("rows", [])}
    lines: list[tuple[str, dict]] = []
    for row in payload["rows"]:
        lines.append((row["eval"], row))
        if row["eval"] in before:
            lines.append((f"↳ previous (run {prev['parent_run_id'][:8]})", before[row["eval"]]))
    rows = [r for _, r in lines]
    tasks = list(dict.fromkeys(m.group(1) for r in rows for k in r if (m := TASK_ACCURACY.fullmatch(k))))
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
    ]
    columns += [Column(f"acc: {t}", [fmt_interval(r, f"{t}/accuracy") for r in rows], drop=4) for t in tasks]
    columns.append(Column("model fp", [(r.get("model_fingerprint") or "—")[:8] for r in rows], drop=5))
    styles = ["dim" if label.startswith("↳") else "" for label, _ in lines]
    return columns, styles


def _r1flow_command() -> str:
    """How to call r1flow from this shell: `r1flow` when that is on PATH and is this installation,
    else the venv's script (relative to the working directory when under it), else `python -m flows.cli`."""
    import shutil
    from pathlib import Path

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
    import os
    import shlex
    from pathlib import Path

    env = ""
    if Path(home).resolve() != Path(".r1flow").resolve():
        env = f"R1FLOW_HOME={shlex.quote(str(home))} "
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri and uri != f"sqlite:///{home}/mlflow.db":
        env += f"MLFLOW_TRACKING_URI={shlex.quote(uri)} "
    return f"{env}{_r1flow_command()} ui"


def print_summary(result: dict, total: float, before_flow: float, console=None) -> None:
    """The end of `r1flow run`: the per-stage table and timings, then the model comparison, where
    the report is, how to open the UIs and the URL of the MLflow parent run (each URL and path on
    a line of its own, never wrapped: they are copied)."""
    import os

    from rich.text import Text

    from flows.servers import MLFLOW_UI_QUERY, ui_port
    from flows.settings import Settings

    console = console or _console()
    table, _ = fit_table(console, stage_columns(result),
                         title=Text(f"r1flow run — recipe {result['recipe']}, profile {result['profile']}"))
    console.print(table)
    stage_work = sum(r["seconds"] for r in result["stages"])
    console.print(f"stage work {stage_work:.1f} s; fixed start-up overhead {total - stage_work:.1f} s "
                  f"(imports and validation {before_flow:.1f} s, the rest Prefect/MLflow); total {total:.1f} s")

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
    else:
        console.print("model comparison: none (no eval node of this run logged an accuracy)")

    report = result.get("report") or {}
    if report.get("path"):
        console.print("report (with its comparison CSV/JSON and plots in the same folder):")
        line(report["path"])
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


def cmd_stages(args: argparse.Namespace) -> int:
    from schemas.configs import STAGE_CONFIGS
    from stages import STAGE_MODULES, STAGE_SUMMARIES, get_stage

    for name in STAGE_MODULES:
        module = get_stage(name)
        ins = ", ".join(f"{k}:{v}" for k, v in module.INPUTS.items()) or "-"
        outs = ", ".join(f"{k}:{v}" for k, v in module.OUTPUTS.items())
        print(f"{name} (v{module.VERSION}) — {STAGE_SUMMARIES[name]}\n  inputs: {ins}\n  outputs: {outs}")
        if args.verbose:
            for field, info in STAGE_CONFIGS[name].model_fields.items():
                print(f"    {field} = {info.get_default(call_default_factory=True)!r}  # {info.description}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from flows.recipes import DEFAULT_RECIPE, PROFILE_DIR, RECIPE_DIR, available, load_plan

    for name in available(RECIPE_DIR):
        plan = load_plan(name, "tiny", run_checks=False)
        mark = " (default)" if name == DEFAULT_RECIPE else ""
        print(f"{name}{mark}: {plan.description}\n  " + " -> ".join(n.name for n in plan.nodes))
        if plan.options:
            print("  options (--set options.NAME=VALUE): " + ", ".join(f"{k}={v}" for k, v in plan.options.items()))
    print(f"profiles: {', '.join(available(PROFILE_DIR))}")
    return 0


def _store():
    from flows.settings import Settings
    from flows.store import ArtifactStore

    s = Settings.from_env()
    return ArtifactStore(s.store, home=s.home)


def text_table(headers: list[str], rows: list[list[str]], right: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """Plain aligned columns, each as wide as its longest cell (a long node name widens its column
    instead of pushing the others out of line); columns in `right` are right-aligned; the last
    column is not padded."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def cmd_artifacts(args: argparse.Namespace) -> int:
    store = _store()
    if args.fingerprint:
        fp = store.resolve_prefix(args.fingerprint)
        manifest = store.verify(fp) if args.verify else store.read_manifest(fp)
        print(manifest.to_json())
        print(f"path: {store.artifact_path(fp)}" + ("\nverified: all files match" if args.verify else ""))
        return 0
    if args.verify:  # every artifact, re-hashed; exit 1 if any is damaged
        results = store.verify_all()
        damaged = [(name, why) for name, why in results if why]
        for name, why in damaged:
            print(f"DAMAGED {name[:12]}: {why}")
        print(f"{len(results) - len(damaged)} of {len(results)} artifact(s) in {store.uri} verified"
              + (f"; {len(damaged)} damaged (a run that needs one recomputes it)" if damaged else ""))
        return 1 if damaged else 0
    rows, unreadable = store.scan()  # one read of every manifest
    if args.kind:
        rows = [m for m in rows if m.kind == args.kind]
    table = [[m.fingerprint[:12], m.kind, m.schema_name, "-" if m.rows is None else str(m.rows), m.created_at,
              m.producer.node or m.producer.stage] for m in rows]
    for line in text_table(["fingerprint", "kind", "schema", "rows", "created", "node"], table, right={3}):
        print(line)
    print(f"{len(rows)} artifact(s) in {store.uri}")
    if unreadable:
        print(f"{len(unreadable)} more without a readable manifest (incomplete or damaged): "
              f"{', '.join(n[:12] for n in unreadable)}; `r1flow artifacts --verify` checks every artifact")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from stages.modeling.models import BUILTIN_MODELS

    print("builtin models:")
    for name, desc in BUILTIN_MODELS.items():
        print(f"  {name}: {desc}")
    store = _store()
    models = [m for m in store.list() if m.kind == "model"]
    print(f"model artifacts ({len(models)}):")
    for m in models:
        base = f" on base model {m.extra['base_fingerprint'][:12]}" if "base_fingerprint" in m.extra else ""
        print(f"  {m.fingerprint[:12]} {m.schema_name}{base} from node {m.producer.node or m.producer.stage} "
              f"({m.created_at})")
    return 0


def _servers_home() -> str:
    from flows.settings import Settings

    return Settings.from_env().home


def mlflow_ui_links(url: str) -> list[str]:
    """Where to open MLflow's UI: each r1flow experiment's runs table (`<name>: <url>`). Not the experiments list:
    MLflow 3 opens an experiment clicked there on its GenAI overview (the list's links drop `workflowType`), so
    the list is given only while the server has no r1flow experiment (or cannot be asked)."""
    import json
    import urllib.parse
    import urllib.request

    from flows.servers import MLFLOW_UI_QUERY

    base = url.rstrip("/")
    query = urllib.parse.urlencode({"filter": "name LIKE 'r1flow/%'", "max_results": 100})
    try:
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/search?{query}", timeout=10) as r:
            experiments = json.load(r).get("experiments", [])
    except (OSError, ValueError):
        experiments = []
    links = [f"{e['name']}: {base}/#/experiments/{e['experiment_id']}/runs{MLFLOW_UI_QUERY}"
             for e in sorted(experiments, key=lambda e: e["name"])]
    return links or [f"{base}/#/experiments{MLFLOW_UI_QUERY}"]


def _print_servers(info) -> None:
    from flows.servers import env_for

    for s, what in ((info.prefect, "Prefect UI"), (info.mlflow, "MLflow UI ")):
        took = f", up in {s.startup_s:.1f} s" if s.startup_s is not None else ""
        print(f"{what}  {s.url}   (pid {s.pid}{took}; log {s.log})")
    for link in mlflow_ui_links(info.mlflow.url):
        print(f"  {link}")
    print(f"r1flow commands with R1FLOW_HOME={info.home} use them without exports; for notebooks and the plain "
          "prefect/mlflow CLIs:")
    print("export " + " ".join(f"{k}={v}" for k, v in env_for(info).items()), flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from flows import servers

    home = _servers_home()
    warning = servers.exposure_warning(args.host)
    if warning:
        print(f"r1flow: {warning}", file=sys.stderr, flush=True)
    advertised = servers.advertised_host(args.host, args.advertise)
    where = args.host if advertised == args.host else f"{args.host} (advertised as {advertised})"
    recorded = servers.status(home)
    gone = servers.broken(recorded) if recorded else []
    if gone:  # start() stops what is left of them and starts both afresh
        print(f"r1flow: the recorded {' and '.join(f'{s.name} server (pid {s.pid}, {s.url})' for s in gone)} "
              f"{'is' if len(gone) == 1 else 'are'} gone; stopping what is left and starting fresh", flush=True)
    print(f"r1flow: starting Prefect and MLflow servers on {where} for {home} ...", flush=True)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C, also while starting: nothing is left behind
        signal.signal(sig, _interrupt)
    try:
        info = servers.start(home, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                             timeout=args.timeout, host=args.host, advertise=args.advertise)
    except KeyboardInterrupt:  # start() has stopped whatever it had spawned
        print("r1flow: interrupted while starting; nothing is left running", file=sys.stderr)
        return 130
    code = 0
    try:
        _print_servers(info)
        if args.detach:
            print(f"stop them with: R1FLOW_HOME={home} r1flow down")
            return 0
        print("serving in the foreground; Ctrl-C or SIGTERM stops them (or `r1flow down` from another shell)",
              flush=True)
        while True:
            time.sleep(1)
            now = servers.status(home)
            if now is None or now.stopping:
                print("r1flow: the servers are being stopped elsewhere (r1flow down)", flush=True)
                return 0
            dead = servers.dead(now)
            if dead:
                for s in dead:
                    print(f"r1flow: error: the {s.name} server (pid {s.pid}) exited; see {s.log}", file=sys.stderr)
                code = 1
                break
    except KeyboardInterrupt:
        pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave half-stopped servers
    for line in servers.stop(home):
        print(f"stopped {line}")
    return code


def cmd_down(args: argparse.Namespace) -> int:
    from flows import servers

    home = _servers_home()
    stopped = servers.stop(home)
    for line in stopped:
        print(f"stopped {line}")
    if not stopped:
        print(f"r1flow: no running servers recorded for {home}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from flows import servers
    from flows.placement import cluster_address

    home = _servers_home()
    info = servers.status(home)
    address = cluster_address(args.cluster)
    if address:
        _print_cluster(address)
    if info is None:
        print(f"r1flow: no servers running for {home} (start them with `r1flow up`)")
        return 0 if address else 1  # the cluster was what was asked for
    _print_servers(info)
    for s in servers.dead(info):
        print(f"warning: the {s.name} server (pid {s.pid}) is not running; see {s.log}")
    for r in info.runners:
        print(f"runner pid {r['pid']} ({r.get('name', 'runner')}, registered {r.get('registered_at', '?')})")
    return 0


def _print_cluster(address: str) -> None:
    from flows.placement import cluster_nodes

    nodes = cluster_nodes(address)
    alive = [n for n in nodes if n["alive"]]
    print(f"Ray cluster {address}: {len(alive)} of {len(nodes)} nodes alive")
    rows = [[n["id"][:12], n["address"], "alive" if n["alive"] else "dead",
             ", ".join(f"{k}={v / 2**30:.1f} GiB" if k == "memory" else f"{k}={v:g}"
                       for k, v in sorted(n["resources"].items()) if k != "object_store_memory")]
            for n in nodes]
    for line in text_table(["node", "address", "state", "resources"], rows):
        print(line)


def _ui_store(home) -> tuple[str, object, object, int | None]:
    """What `r1flow ui` serves when tracking goes to no server: (tracking URI, artifacts folder, the database
    when it is a local sqlite file, the port it belongs on when the home has one). MLFLOW_TRACKING_URI when set;
    else `r1flow up`'s store once the servers are down (`<home>/servers/mlflow.db`, on up's MLflow port, so
    the links of its runs open), else the home's own (`<home>/mlflow.db`, on the home's ui port)."""
    import os
    from pathlib import Path

    from flows import servers

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        return uri, home / "mlartifacts", db, None
    up_db, own_db = servers.store_db(home), home / "mlflow.db"
    if up_db.exists() and (not own_db.exists() or up_db.stat().st_mtime >= own_db.stat().st_mtime):
        if own_db.exists():
            print(f"r1flow: also here, older: {own_db} (runs without `r1flow up`); open it with "
                  f"MLFLOW_TRACKING_URI=sqlite:///{own_db} r1flow ui", flush=True)
        return f"sqlite:///{up_db}", servers.servers_dir(home) / "mlartifacts", up_db, \
            servers.recorded_ports(home).get("mlflow")
    if up_db.exists():
        print(f"r1flow: also here, older: {up_db} (runs with `r1flow up`); `r1flow up` serves it", flush=True)
    return f"sqlite:///{own_db}", home / "mlartifacts", own_db, None


def _ui_port(home, asked: int | None, kept: int | None) -> int:
    """--port, else the store's kept port (taken: an error naming what holds it), else the home's ui port
    (MLflow's usual 5000 the first time; when that is taken, a free one, said loudly, kept for next time)."""
    from flows import servers
    from schemas.errors import ConfigError

    host = servers.HOST
    if asked is not None:
        e = servers.bind_error(asked, host)
        if e is not None:
            raise ConfigError(servers.port_taken_message(asked, host, e, "--port") + "; pick another with --port")
        return asked
    if kept is not None:
        e = servers.bind_error(kept, host)
        if e is not None:
            raise ConfigError(servers.port_taken_message(kept, host, e, f"this home's, in {servers.ports_path(home)}")
                              + "; stop what holds it, or pick another with --port")
        return kept
    with servers._locked(home):
        recorded = servers.recorded_ports(home).get("ui")
        port = recorded or servers.MLFLOW_UI_PORT
        e = servers.bind_error(port, host)
        if e is not None:
            if recorded:
                raise ConfigError(servers.port_taken_message(port, host, e, f"this home's, in {servers.ports_path(home)}")
                                  + "; stop what holds it, or pick another with --port")
            moved = servers._free_ports(1)[0]
            print(f"r1flow: WARNING: {servers.port_taken_message(port, host, e, 'MLflow UI default')}; serving on "
                  f"{host}:{moved} instead, from now on for this home: links to :{port} printed before do not open "
                  "here", file=sys.stderr, flush=True)
            port = moved
        if not recorded:
            servers.record_ports(home, ui=port)
    return port


def cmd_ui(args: argparse.Namespace) -> int:
    """MLflow's UI on 127.0.0.1 for this home's tracking store, in the foreground until Ctrl-C; or,
    when tracking goes to a server (MLFLOW_TRACKING_URI, `r1flow up`), that server's URL."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    from flows import servers
    from flows.servers import HOST
    from flows.settings import Settings
    from schemas.errors import ConfigError

    settings = Settings.from_env()
    uri, home = settings.tracking_uri, Path(settings.home)
    prefect = os.environ.get("PREFECT_API_URL", "")
    if uri.startswith(("http://", "https://")):
        up = servers.status(home)
        source = (f"the `r1flow up` server of {home}" if up is not None and up.mlflow.url.rstrip("/") == uri.rstrip("/")
                  else "MLFLOW_TRACKING_URI")
        print(f"r1flow: MLflow tracking goes to {source}; its UI:")
        print("\n".join(mlflow_ui_links(uri)))
        if prefect:
            print("Prefect UI:")
            print(prefect.rstrip("/").removesuffix("/api"))
        return 0
    uri, artifacts, db, kept = _ui_store(home)
    if db is not None and not db.exists():
        raise ConfigError(f"no MLflow store at {db} yet: nothing has run with R1FLOW_HOME={home} "
                          "(run `r1flow run` first, or set R1FLOW_HOME to the home of your runs)")
    port = _ui_port(home, args.port, kept)
    log = home / "logs" / f"mlflow-ui-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*servers.console_script("mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1",
           "--backend-store-uri", uri, "--artifacts-destination", str(artifacts)]
    url = f"http://{HOST}:{port}"

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell that starts a command in the background without job control (`cmd &` in a script, CI)
    # hands it SIGINT ignored, and then Ctrl-C or `kill -INT` would not stop the UI
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: the server is stopped, not left behind
        signal.signal(sig, _interrupt)
    print(f"r1flow: starting MLflow's UI on {HOST}:{port} for {uri} (log {log}) ...", flush=True)
    with open(log, "wb") as out:  # its own session: we stop its whole group (uvicorn's worker included)
        proc = subprocess.Popen(cmd, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    code = 0
    try:
        t0 = time.monotonic()
        while not servers._healthy(f"{url}/health"):
            if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
                why = "exited" if proc.poll() is not None else f"did not answer in {args.timeout:.0f} s"
                print(f"r1flow: error: MLflow's UI {why}; the end of {log}:\n{servers._log_tail(log)}",
                      file=sys.stderr)
                return 1
            time.sleep(0.3)
        print(f"MLflow UI for {home} (up in {time.monotonic() - t0:.1f} s), open:")
        print("\n".join(mlflow_ui_links(url)))
        if prefect:
            print("Prefect UI:")
            print(prefect.rstrip("/").removesuffix("/api"))
        print("serving in the foreground; Ctrl-C stops it", flush=True)
        while proc.poll() is None:
            time.sleep(0.5)
        print(f"r1flow: error: MLflow's UI exited ({proc.returncode}); the end of {log}:\n{servers._log_tail(log)}",
              file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave the server running
        if proc.poll() is None or servers._group_alive(proc.pid):
            servers._terminate(proc.pid, proc.pid)
            print("r1flow: MLflow UI stopped", flush=True)
    return code


def _overrides_dict(pairs: list[str]) -> dict:
    from flows.recipes import _set_path, parse_override

    out: dict = {}
    for text in pairs:
        path, value = parse_override(text)
        _set_path(out, path, value)
    return out


def _input_refs(pairs: list[str]) -> dict[str, str]:
    from schemas.errors import ConfigError

    refs = {}
    for text in pairs:
        name, sep, ref = text.partition("=")
        if not sep or not name or not ref:
            raise ConfigError(f"--input {text!r}: expected NAME=REF, e.g. model=latest:sft@sft-eval")
        refs[name.strip()] = ref.strip()
    return refs


def cmd_stage(args: argparse.Namespace) -> int:
    from flows.deploy import stage_config, stage_flow
    from flows.settings import Settings, make_home, start_temporary_prefect

    overrides = _overrides_dict(args.set)
    stage_config(args.name, args.recipe, args.profile, args.node, overrides)  # config errors before Prefect starts
    refs = _input_refs(args.input)
    make_home()
    start_temporary_prefect()
    _print_servers_used(args)

    result = stage_flow(stage=args.name, inputs=refs, overrides=overrides, node=args.node, seed=args.seed,
                        recipe=args.recipe, profile=args.profile, settings=Settings.from_env().to_dict(),
                        force=args.force)
    print(f"{result['node']} ({result['stage']}): {result['status']} in {result['seconds']:.1f} s")
    for k, v in result["inputs"].items():
        print(f"  input  {k}: {v}")
    for k, v in result["outputs"].items():
        print(f"  output {k}: {v}")
    print(f"MLflow run {result['parent_run_id']}: {result['link']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def _specs(args: argparse.Namespace, served: bool):
    from flows.deploy import deployment_specs
    from flows.recipes import DEFAULT_RECIPE
    from stages import STAGE_MODULES

    recipes = args.recipe or ([] if args.stage else [DEFAULT_RECIPE])
    stages = list(STAGE_MODULES) if args.all_stages else (args.stage or [])
    return deployment_specs(recipes, stages, args.profile or _default_profile(), args.set, args.cron, args.interval,
                            args.tag or [], served=served)


def cmd_worker(args: argparse.Namespace) -> int:
    """A Prefect worker (flows.worker) with r1flow's environment, registered with `r1flow up` so `r1flow down` stops
    it."""
    import os

    from flows import servers
    from flows.settings import Settings, make_home, require_prefect_server

    url = require_prefect_server("worker", "polls a work pool")
    make_home()
    home = Settings.from_env().home
    print(f"r1flow: worker for work pool {args.pool!r} on {url}; Prefect state and results under "
          f"{os.environ['PREFECT_HOME']}, artifacts under {home}", flush=True)
    registered = servers.register_runner(home, name=f"worker {args.pool}")
    from flows.worker import run_worker

    run_worker(args.pool, args.type, args.limit,
               on_exit=(lambda: servers.unregister_runner(home)) if registered else None)  # never returns
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.settings import require_prefect_server

    url = require_prefect_server("deploy", "registers deployments and their schedules")
    specs = _specs(args, served=False)
    from flows.deploy import deploy, full_name

    deploy(specs, args.pool, image=args.image, replace=args.replace)
    for spec in specs:
        sched = f" (cron {spec['cron']})" if "cron" in spec else (f" (every {spec['interval']} s)" if "interval" in spec else "")
        print(f"deployed {full_name(spec)} -> work pool {args.pool}{sched} on {url}")
    print(f"start a worker for it: r1flow worker --pool {args.pool}")
    return 0


def serve_hints(specs: list[dict], url: str) -> list[str]:
    """How to start the served deployments, as commands that work in a shell with nothing exported (Prefect's own
    hint, `prefect deployment run ...`, would go to a temporary server without PREFECT_API_URL)."""
    import shlex

    from flows import servers
    from flows.deploy import REF_HELP, full_name
    from stages import get_stage

    prefect = " ".join(shlex.quote(p) for p in servers.console_script("prefect"))
    lines = [f"start a run from the Prefect UI ({url.rstrip('/').removesuffix('/api')}/deployments) or a shell:"]
    for spec in specs:
        cmd = f"PREFECT_API_URL={shlex.quote(url)} {prefect} deployment run {shlex.quote(full_name(spec))}"
        if "inputs" not in spec["parameters"] and spec["entrypoint"].endswith("_stage"):  # a stage's inputs: no default
            stage = spec["entrypoint"].rsplit(":", 1)[1].removesuffix("_stage")
            refs = json.dumps({k: "REF" for k, kind in get_stage(stage).INPUTS.items() if not kind.endswith("?")})
            cmd += f" --param inputs={shlex.quote(refs)}"
        lines.append(f"  {cmd}")
    if any("--param inputs=" in line for line in lines):
        lines.append(f"  (REF: {REF_HELP})")
    return lines


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.settings import Settings, make_home, require_prefect_server

    url = require_prefect_server("serve", "registers deployments and serves their runs")
    make_home()
    specs = _specs(args, served=True)
    from flows import servers
    from flows.deploy import full_name, serve

    home = Settings.from_env().home
    registered = servers.register_runner(home, name="serve")
    for spec in specs:
        print(f"serving {full_name(spec)} on {url}", flush=True)
    for line in serve_hints(specs, url):
        print(line, flush=True)
    try:
        serve(specs, limit=args.limit)
    finally:
        if registered:
            servers.unregister_runner(home)
    # stopped (SIGTERM): its schedules are paused; the interpreter's exit (draining Prefect's log and event workers,
    # module teardown) took seconds more under load, past `r1flow down`'s grace
    sys.stdout.flush()
    os._exit(0)


def _add_deploy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", action="append", help="recipe to deploy (repeatable; default: the default recipe "
                   "unless --stage is given)")
    p.add_argument("--stage", action="append", help="stage to deploy as a single-stage re-run (repeatable)")
    p.add_argument("--all-stages", action="store_true", help="deploy every stage as a single-stage re-run")
    p.add_argument("--profile", help="tiny | cpu | gpu (default: gpu when CUDA is available, else cpu)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides baked into "
                   "the recipe deployments' default parameters")
    p.add_argument("--cron", help='schedule the recipe deployments, e.g. "0 2 * * *" (02:00 every night)')
    p.add_argument("--interval", type=float, metavar="SECONDS", help="schedule every N seconds instead")
    p.add_argument("--tag", action="append", help="extra deployment tag (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="r1flow", description="DeepSeek-R1 style post-training as cached Prefect stages.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe (default: the default recipe on the embedded model)")
    run.add_argument("--recipe", help="recipe name or path to a YAML file")
    run.add_argument("--profile", help="tiny | cpu | gpu (default: gpu when CUDA is available, else cpu)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. sft.learning_rate=1e-4, model=PATH, seed=1")
    run.add_argument("--only", action="append", metavar="NODE", help="run only this node (upstream from cache)")
    run.add_argument("--force", action="append", metavar="NODE", help="re-run this node even if cached")
    run.add_argument("--json", metavar="FILE", help="also write the run summary as JSON")
    run.add_argument("--parallel", type=int, default=1, metavar="N", help="run up to N independent stages at once on "
                     "this machine, each in its own process (default 1: one after another, as the plan lists them)")
    run.add_argument("--cluster", metavar="ADDRESS", help="run the stages on the Ray cluster at ADDRESS (host:port of "
                     "its head, or ray://host:10001; default: RAY_ADDRESS when set); needs the cluster extra, a shared "
                     "R1FLOW_HOME and servers every node reaches (README: Run on a cluster)")
    run.set_defaults(func=cmd_run)
    st = sub.add_parser("stages", help="list stages, their inputs, outputs (and config with -v)")
    st.add_argument("-v", "--verbose", action="store_true")
    st.set_defaults(func=cmd_stages)
    sub.add_parser("recipes", help="list recipes and profiles").set_defaults(func=cmd_recipes)
    art = sub.add_parser("artifacts", help="list artifacts, or show one by fingerprint prefix")
    art.add_argument("fingerprint", nargs="?")
    art.add_argument("--kind", choices=["dataset", "model"])
    art.add_argument("--verify", action="store_true", help="re-hash every file against its manifest: the one "
                     "artifact given, or every artifact (exit code 1 if any is damaged)")
    art.set_defaults(func=cmd_artifacts)
    sub.add_parser("models", help="list builtin models and model artifacts").set_defaults(func=cmd_models)
    up = sub.add_parser("up", help="start Prefect and MLflow servers (on 127.0.0.1 unless --host) for this "
                        "R1FLOW_HOME")
    up.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                    help="address both servers bind (default 127.0.0.1: this machine only). Another address lets "
                    "the machines of a cluster connect, without authentication (a warning says so): prefer a "
                    "private network's address; 0.0.0.0 binds every interface")
    up.add_argument("--advertise", metavar="ADDRESS",
                    help="address written into the recorded URLs (servers.json, PREFECT_API_URL, "
                    "MLFLOW_TRACKING_URI) for other machines to use; default: the --host address, or this "
                    "machine's hostname when --host is 0.0.0.0 or ::")
    up.add_argument("--prefect-port", type=int, help="default: a free port")
    up.add_argument("--mlflow-port", type=int, help="default: a free port")
    up.add_argument("--detach", action="store_true", help="return once both answer; stop them with `r1flow down`")
    up.add_argument("--timeout", type=float, default=120, help="seconds to wait for both to answer (default 120)")
    up.set_defaults(func=cmd_up)
    ui = sub.add_parser("ui", help="MLflow's UI on 127.0.0.1 for this R1FLOW_HOME's runs (foreground, Ctrl-C "
                        "stops it); with a tracking server, its URL")
    ui.add_argument("--port", type=int, help=f"default: the home's (the first time {MLFLOW_UI_PORT}, or a free "
                    "port when that is taken; after `r1flow up`, up's MLflow port)")
    ui.add_argument("--timeout", type=float, default=120, help="seconds to wait for it to answer (default 120)")
    ui.set_defaults(func=cmd_ui)
    sub.add_parser("down", help="stop registered runners, then the servers started by `r1flow up`"
                   ).set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="show the servers started by `r1flow up` (exit code 1 if none), and the Ray "
                            "cluster's nodes and resources when one is configured")
    status.add_argument("--cluster", metavar="ADDRESS", help="a Ray cluster to show (default: RAY_ADDRESS when set)")
    status.set_defaults(func=cmd_status)
    stg = sub.add_parser("stage", help="run one stage on existing artifacts (fingerprints, MLflow runs, latest:)")
    stg.add_argument("name", help="stage name (r1flow stages)")
    stg.add_argument("--input", action="append", default=[], metavar="NAME=REF",
                     help="an input: fingerprint or prefix, mlflow:<run id>[:<output>], latest:<node>[@<recipe>][:<output>]")
    stg.add_argument("--recipe", help="take the base config and seed from this recipe's node")
    stg.add_argument("--profile", help="profile applied to the base config")
    stg.add_argument("--node", help="node name (default: the recipe's node of this stage, else the stage name)")
    stg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. beta=0.2")
    stg.add_argument("--seed", type=int)
    stg.add_argument("--force", action="store_true", help="re-run even when cached")
    stg.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    stg.set_defaults(func=cmd_stage)
    dep = sub.add_parser("deploy", help="register recipe and stage deployments with a Prefect server's work pool")
    _add_deploy_args(dep)
    dep.add_argument("--pool", default="r1flow-process", help="work pool (created as a process pool if missing)")
    dep.add_argument("--image", help="container image with the project (kubernetes/docker pools)")
    dep.add_argument("--replace", action="store_true", help="replace a deployment of the same name that another "
                     "work pool (or `r1flow serve`) registered")
    dep.set_defaults(func=cmd_deploy)
    srv = sub.add_parser("serve", help="serve recipe and stage deployments from this machine (no work pool)")
    _add_deploy_args(srv)
    srv.add_argument("--limit", type=int, help="at most this many concurrent flow runs")
    srv.set_defaults(func=cmd_serve)
    wk = sub.add_parser("worker", help="start a Prefect worker for a work pool with r1flow's environment "
                        "(state under R1FLOW_HOME; `r1flow down` stops it)")
    wk.add_argument("--pool", default="r1flow-process", help="work pool (default r1flow-process, as deploy's)")
    wk.add_argument("--type", default="process", help="pool type if the worker creates it (default process)")
    wk.add_argument("--limit", type=int, help="at most this many concurrent flow runs")
    wk.set_defaults(func=cmd_worker)
    return p


# Commands that reach Prefect, MLflow or the store: their servers and Prefect's home are decided before any of
# them imports Prefect or MLflow (flows/settings.prepare_environment).
ENV_COMMANDS = frozenset({"run", "stage", "serve", "deploy", "worker", "artifacts", "models", "ui"})


# Commands that start processes (Prefect's temporary server, launchers, ranks) that must end with them.
RUN_COMMANDS = frozenset({"run", "stage"})


def _stdout_gone() -> bool:
    """Has the reader of stdout gone (`r1flow stages -v | head -1`)? A pipe whose read end is closed
    polls as POLLERR on its write end; a BrokenPipeError from anything else is a real error."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        return False


def _quiet_exit_on_closed_stdout() -> int:
    """What the shell's own tools do when the reader goes: stop without a word. stdout is pointed at
    /dev/null so that the interpreter's last flush of it does not print a BrokenPipeError either."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # as if killed by SIGPIPE, like `yes | head -1`


def main(argv: list[str] | None = None) -> int:
    """The `r1flow` command. Called with argv=None (the console script) a run or stage command also
    gets its lifetime guards (stages/runtime/lifetime.py): a sentinel that ends every process the run started
    when it ends, kill -9 included, and SIGTERM/SIGHUP that stop it within seconds (`r1flow ui` gets
    the sentinel: its MLflow server ends with it). In-process calls (tests, notebooks) pass argv and
    get neither: they must not tie the caller's children to a sentinel. Every command ends quietly
    (exit code 141) when the reader of its output goes away (`r1flow stages -v | head -1`)."""
    args = build_parser().parse_args(argv)
    supervised = argv is None and args.command in RUN_COMMANDS
    from stages.runtime.threads import yield_when_idle

    yield_when_idle()  # before anything loads torch (stages.runtime.threads)
    if argv is None:
        from stages.runtime.lifetime import exit_without_final_collection

        exit_without_final_collection()
    try:
        if supervised or (argv is None and args.command == "ui"):
            from stages.runtime import lifetime

            lifetime.adopt()
        if supervised:
            lifetime.terminate_on_signals("r1flow: stopping ({name}); completed stages are cached and training "
                                          "resumes from its last checkpoint")
        if args.command in ENV_COMMANDS:
            from flows.settings import prepare_environment

            args.servers_source = prepare_environment()
        if supervised:  # a Prefect or MLflow server lost mid-run: one line and the run ends (flows/watchdog.py)
            from flows import watchdog

            watchdog.watch(watchdog.watched())
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then a BrokenPipeError we handle
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return _quiet_exit_on_closed_stdout()
    except R1FlowError as e:
        print(f"r1flow: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        if not supervised:
            raise
        from flows import watchdog

        gone = watchdog.not_answering(watchdog.watched())
        if not gone:
            raise
        print(watchdog.lost_message(gone[0]), file=sys.stderr)  # the cause, not the traceback it caused
        return watchdog.EXIT_CODE
    except SystemExit as e:
        from stages.runtime import lifetime

        if not (supervised and lifetime.stopping()):
            raise
        # SIGTERM/SIGHUP or a lost server (its line is written): skip the interpreter's exit, whose atexit hooks
        # wait for Prefect's temporary server (up to 5 s) among others; the sentinel ends our children
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except KeyboardInterrupt:
        print("r1flow: interrupted; completed stages are cached and training resumes from its last checkpoint",
              file=sys.stderr)
        if supervised:  # a worker thread must not keep the process alive
            from stages.runtime import lifetime

            lifetime.exit_soon(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
