"""The `r1flow` command line. Validates everything before importing Prefect or touching a model."""

from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

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
    from flows.settings import Settings, make_home

    recipe = args.recipe or DEFAULT_RECIPE
    profile = args.profile or _default_profile()
    plan = load_plan(recipe, profile, args.set)  # every config error surfaces here, before any compute
    for name in (args.only or []) + (args.force or []):
        plan.node(name)
    make_home()
    settings = Settings.from_env()
    print(f"r1flow: recipe {plan.recipe!r}, profile {plan.profile!r}, model {plan.model!r}, "
          f"{len(plan.nodes)} stages; home {settings.home}", flush=True)
    _print_servers_used(args)
    from flows.pipeline import pipeline

    t_flow = time.perf_counter()
    result = pipeline(recipe=recipe, profile=profile, overrides=list(args.set), only=args.only, force=args.force,
                      settings=settings.to_dict())
    total = time.perf_counter() - _T_START
    print_summary(result, total=total, before_flow=t_flow - _T_START)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def print_summary(result: dict, total: float, before_flow: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from flows.pipeline import fmt_metric, key_metrics

    table = Table(title=f"r1flow run — recipe {result['recipe']}, profile {result['profile']}")
    for col in ("stage", "kind", "status", "seconds", "key metrics", "outputs"):
        table.add_column(col)
    stage_work = 0.0
    for r in result["stages"]:
        stage_work += r["seconds"]
        metrics = ", ".join(f"{k}={fmt_metric(v)}" for k, v in key_metrics(r["stage"], r["metrics"]).items())
        outs = ", ".join(f"{k}:{v[:12]}" for k, v in r["outputs"].items())
        style = {"run": "green", "cached": "cyan", "skipped": "dim"}[r["status"]]
        table.add_row(r["node"], r["stage"], f"[{style}]{r['status']}[/]", f"{r['seconds']:.1f}", metrics, outs)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(f"stage work {stage_work:.1f} s; fixed start-up overhead {total - stage_work:.1f} s "
                  f"(imports and validation {before_flow:.1f} s, the rest Prefect/MLflow); total {total:.1f} s")
    console.print(f"MLflow parent run {result['parent_run_id']}: {result['link']}")


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
    print(f"{'fingerprint':14} {'kind':8} {'schema':12} {'rows':>7} {'node':16} {'created':20}")
    for m in rows:
        print(f"{m.fingerprint[:12]:14} {m.kind:8} {m.schema_name:12} {m.rows if m.rows is not None else '-':>7} "
              f"{m.producer.node:16} {m.created_at:20}")
    print(f"{len(rows)} artifact(s) in {store.uri}")
    if unreadable:
        print(f"{len(unreadable)} more without a readable manifest (incomplete or damaged): "
              f"{', '.join(n[:12] for n in unreadable)}; `r1flow artifacts --verify` checks every artifact")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from stages.models import BUILTIN_MODELS

    print("builtin models:")
    for name, desc in BUILTIN_MODELS.items():
        print(f"  {name}: {desc}")
    store = _store()
    models = [m for m in store.list() if m.kind == "model"]
    print(f"model artifacts ({len(models)}):")
    for m in models:
        base = f" adapter on {m.extra['base_fingerprint'][:12]}" if "base_fingerprint" in m.extra else ""
        print(f"  {m.fingerprint[:12]} {m.schema_name}{base} from node {m.producer.node or m.producer.stage} "
              f"({m.created_at})")
    return 0


def _servers_home() -> str:
    from flows.settings import Settings

    return Settings.from_env().home


def _print_servers(info) -> None:
    from flows.servers import MLFLOW_UI_QUERY, env_for

    for s, what, page in ((info.prefect, "Prefect UI", ""), (info.mlflow, "MLflow UI ", f"/#/experiments{MLFLOW_UI_QUERY}")):
        took = f", up in {s.startup_s:.1f} s" if s.startup_s is not None else ""
        print(f"{what}  {s.url}{page}   (pid {s.pid}{took}; log {s.log})")
    print(f"r1flow commands with R1FLOW_HOME={info.home} use them without exports; for notebooks and the plain "
          "prefect/mlflow CLIs:")
    print("export " + " ".join(f"{k}={v}" for k, v in env_for(info).items()), flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from flows import servers

    home = _servers_home()
    print(f"r1flow: starting Prefect and MLflow servers on 127.0.0.1 for {home} ...", flush=True)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C, also while starting: nothing is left behind
        signal.signal(sig, _interrupt)
    try:
        info = servers.start(home, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                             timeout=args.timeout)
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

    home = _servers_home()
    info = servers.status(home)
    if info is None:
        print(f"r1flow: no servers running for {home} (start them with `r1flow up`)")
        return 1
    _print_servers(info)
    for s in servers.dead(info):
        print(f"warning: the {s.name} server (pid {s.pid}) is not running; see {s.log}")
    for r in info.runners:
        print(f"runner pid {r['pid']} ({r.get('name', 'runner')}, registered {r.get('registered_at', '?')})")
    return 0


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
    from flows.settings import Settings, make_home

    overrides = _overrides_dict(args.set)
    stage_config(args.name, args.recipe, args.profile, args.node, overrides)  # config errors before Prefect starts
    refs = _input_refs(args.input)
    make_home()
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


WORKER_STOP_GRACE_S = 8.0  # SIGTERM, then SIGKILL of the worker's process group (its flow runs included)


def cmd_worker(args: argparse.Namespace) -> int:
    """`prefect worker start` with r1flow's environment, registered with `r1flow up` so `r1flow down` stops it."""
    import contextlib
    import os
    import signal
    import subprocess

    from flows import servers
    from flows.settings import Settings, make_home, require_prefect_server

    url = require_prefect_server("worker", "polls a work pool")
    make_home()
    home = Settings.from_env().home
    cmd = [*servers.console_script("prefect"), "worker", "start", "--pool", args.pool, "--type", args.type]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    print(f"r1flow: worker for work pool {args.pool!r} on {url}; Prefect state and results under "
          f"{os.environ['PREFECT_HOME']}, artifacts under {home}", flush=True)
    child = subprocess.Popen(cmd, start_new_session=True)  # its own group: `r1flow down` ends it and its flow runs
    stopping: list[float] = []

    def _forward(signum, frame):
        stopping.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _forward)
    registered = servers.register_runner(home, pid=child.pid, name=f"worker {args.pool}")
    try:
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                # a worker with a flow run in progress can take minutes to stop: its group is killed after a grace
                if stopping and time.monotonic() - stopping[0] > WORKER_STOP_GRACE_S:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGKILL)
            except KeyboardInterrupt:
                _forward(signal.SIGINT, None)
    finally:
        if registered:
            servers.unregister_runner(home, pid=child.pid)
    stopped_by_us = bool(stopping) and code in (-signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGKILL)
    return 0 if code == 0 or stopped_by_us else code


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
    try:
        serve(specs, limit=args.limit)
    finally:
        if registered:
            servers.unregister_runner(home)
    return 0


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
    up = sub.add_parser("up", help="start local Prefect and MLflow servers (127.0.0.1) for this R1FLOW_HOME")
    up.add_argument("--prefect-port", type=int, help="default: a free port")
    up.add_argument("--mlflow-port", type=int, help="default: a free port")
    up.add_argument("--detach", action="store_true", help="return once both answer; stop them with `r1flow down`")
    up.add_argument("--timeout", type=float, default=120, help="seconds to wait for both to answer (default 120)")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop registered runners, then the servers started by `r1flow up`"
                   ).set_defaults(func=cmd_down)
    sub.add_parser("status", help="show the servers started by `r1flow up` (exit code 1 if none)"
                   ).set_defaults(func=cmd_status)
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
ENV_COMMANDS = frozenset({"run", "stage", "serve", "deploy", "worker", "artifacts", "models"})


# Commands that start processes (Prefect's temporary server, launchers, ranks) that must end with them.
RUN_COMMANDS = frozenset({"run", "stage"})


def main(argv: list[str] | None = None) -> int:
    """The `r1flow` command. Called with argv=None (the console script) a run or stage command also
    gets its lifetime guards (stages/lifetime.py): a sentinel that ends every process the run started
    when it ends, kill -9 included, and SIGTERM/SIGHUP that stop it within seconds. In-process calls
    (tests, notebooks) pass argv and get neither: they must not tie the caller's children to a sentinel."""
    args = build_parser().parse_args(argv)
    supervised = argv is None and args.command in RUN_COMMANDS
    try:
        if supervised:
            from stages import lifetime

            lifetime.adopt()
            lifetime.terminate_on_signals("r1flow: stopping ({name}); completed stages are cached and training "
                                          "resumes from its last checkpoint")
        if args.command in ENV_COMMANDS:
            from flows.settings import prepare_environment

            args.servers_source = prepare_environment()
        return args.func(args)
    except R1FlowError as e:
        print(f"r1flow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("r1flow: interrupted; completed stages are cached and training resumes from its last checkpoint",
              file=sys.stderr)
        if supervised:  # a worker thread must not keep the process alive
            from stages import lifetime

            lifetime.exit_soon(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
