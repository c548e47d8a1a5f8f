"""The `r1flow` command line. Validates everything before importing Prefect or touching a model.

Here: the parser, `main` (the environment, lifetime guards and errors of every command), `run` and the listing
commands (stages, recipes, artifacts, models); the server commands are flows/cli/server_commands.py's, the single-stage
and deployment commands flows/cli/deploy_commands.py's, what they print flows/cli/output.py's."""

from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from flows.cli.deploy_commands import add_deploy_commands  # noqa: E402
from flows.cli.output import (  # noqa: E402
    one_line_errors,
    prefect_start_failure,
    print_servers_used,
    print_summary,
    text_table,
)
from flows.cli.server_commands import add_server_commands  # noqa: E402
from schemas.errors import R1FlowError  # noqa: E402


def cmd_run(args: argparse.Namespace) -> int:
    # lazy: start-up (`r1flow --help` loads none of these: yaml, the stages)
    from flows.plan.recipes import DEFAULT_RECIPE, default_profile, load_plan
    from flows.servers.settings import Settings, make_home, start_temporary_prefect

    recipe = args.recipe or DEFAULT_RECIPE
    profile = args.profile or default_profile()
    plan = load_plan(recipe, profile, args.set)  # every config error surfaces here, before any compute
    for name in (args.only or []) + (args.force or []):
        plan.node(name)
    # lazy: start-up (`r1flow --help` loads none of these: the stages' runtime)
    from flows.run.checkpoint_evals import check_plan
    from flows.run.placement import Execution, check_driver, cluster_address
    from stages.runtime import threads

    check_plan(plan, set(args.only) if args.only else {n.name for n in plan.nodes})  # checkpoint evals (run_plan too)

    execution = Execution(parallel=args.parallel, cluster=cluster_address(args.cluster))
    settings = Settings.from_env()
    check_driver(execution, settings.store, settings.tracking_uri)  # before anything is written
    make_home()
    from flows.run.engines import check_vllm_nodes  # lazy: reads models only where a node samples on vLLM

    selected = set(args.only) if args.only else {n.name for n in plan.nodes}  # vLLM can serve (run_plan too)
    check_vllm_nodes(plan, selected, Path(settings.home) / "cache-models", on_cluster=bool(execution.cluster))
    start_temporary_prefect()
    print(f"r1flow: recipe {plan.recipe!r}, profile {plan.profile!r}, model {plan.model!r}, "
          f"{len(plan.nodes)} stages, {execution.describe()}; home {settings.home}; {threads.describe()}", flush=True)
    print_servers_used(args)
    # lazy: start-up (`r1flow --help` loads none of these: Prefect, MLflow)
    from flows.run.pipeline import pipeline

    t_flow = time.perf_counter()
    result = pipeline(recipe=recipe, profile=profile, overrides=list(args.set), only=args.only, force=args.force,
                      settings=settings.to_dict(), parallel=execution.parallel, cluster=execution.cluster)
    total = time.perf_counter() - _T_START
    if args.json:  # first: a reader of the summary that goes away (`| head`) must not lose it
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    print_summary(result, total=total, before_flow=t_flow - _T_START)
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    """Every stage, its inputs and outputs (and with -v its config fields): the same descriptions the documentation
    site's stage pages are generated from (docs/hooks/reference.py)."""
    # lazy: start-up (`r1flow --help` loads none of these)
    from schemas.config_fields import config_fields
    from stages import STAGE_MODULES, describe_stage

    for name in STAGE_MODULES:
        stage = describe_stage(name)
        ins = ", ".join(f"{k}:{v}" for k, v in stage.inputs.items()) or "-"
        outs = ", ".join(f"{k}:{v}" for k, v in stage.outputs.items())
        print(f"{name} (v{stage.version}) — {stage.summary}\n  inputs: {ins}\n  outputs: {outs}")
        if args.verbose:
            for field in config_fields(stage.config):
                print(f"    {field.name} = {field.default!r}  # {field.description}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    # lazy: start-up (`r1flow --help` loads none of these: yaml, the stages)
    from flows.plan.recipes import DEFAULT_RECIPE, PROFILE_DIR, RECIPE_DIR, available, load_plan

    for name in available(RECIPE_DIR):
        plan = load_plan(name, "tiny", run_checks=False)
        mark = " (default)" if name == DEFAULT_RECIPE else ""
        print(f"{name}{mark}: {plan.description}\n  " + " -> ".join(n.name for n in plan.nodes))
        if plan.options:
            print("  options (--set options.NAME=VALUE): " + ", ".join(f"{k}={v}" for k, v in plan.options.items()))
    print(f"profiles: {', '.join(available(PROFILE_DIR))}")
    return 0


def _store():
    # lazy: start-up (`r1flow --help` loads none of these: fsspec)
    from flows.servers.settings import Settings
    from flows.store.artifacts import ArtifactStore

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
    # lazy: start-up (`r1flow --help` loads none of these: torch)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="r1flow", description="DeepSeek-R1 style post-training as cached Prefect stages.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run_command(sub)
    _add_inspect_commands(sub)
    add_server_commands(sub)
    add_deploy_commands(sub)
    return p


def _add_run_command(sub) -> None:
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
                     "R1FLOW_HOME and servers every node reaches (docs/operations/cluster.md)")
    run.set_defaults(func=cmd_run)


def _add_inspect_commands(sub) -> None:
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


# Commands that reach Prefect, MLflow or the store: their servers and Prefect's home are decided before any of
# them imports Prefect or MLflow (flows/settings.prepare_environment).
ENV_COMMANDS = frozenset({"run", "stage", "serve", "deploy", "worker", "artifacts", "models", "ui"})


# Commands that start processes (Prefect's temporary server, launchers, ranks) that must end with them.
RUN_COMMANDS = frozenset({"run", "stage"})


def _stdout_gone() -> bool:
    """Has the reader of stdout gone (`r1flow stages -v | head -1`)? A pipe whose read end is closed
    polls as POLLERR on its write end; a BrokenPipeError from anything else is a real error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        return False


def _quiet_exit_on_closed_stdout() -> int:
    """What the shell's own tools do when the reader goes: stop without a word. stdout is pointed at
    /dev/null so that the interpreter's last flush of it does not print a BrokenPipeError either."""
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
    # lazy: start-up (`r1flow --help` loads none of these: the stages' runtime)
    from stages.runtime import lifetime
    from stages.runtime.threads import choose_wait_policy, reproducible_products

    choose_wait_policy()  # before anything loads torch (stages.runtime.threads)
    reproducible_products()  # before the first matrix product: outputs independent of the thread count
    if argv is None:
        lifetime.exit_without_final_collection()
    try:
        if supervised or (argv is None and args.command == "ui"):
            lifetime.adopt()
        if supervised:
            lifetime.terminate_on_signals("r1flow: stopping ({name}); completed stages are cached and training "
                                          "resumes from its last checkpoint")
        if args.command in ENV_COMMANDS:
            # lazy: start-up (`r1flow --help` loads none of these)
            from flows.servers.settings import prepare_environment

            args.servers_source = prepare_environment()
        if args.command in RUN_COMMANDS:  # an r1flow error ends a run as its one line, without Prefect's traceback
            one_line_errors()
        if supervised:  # a Prefect or MLflow server lost mid-run: one line and the run ends (flows/run/watchdog.py)
            # lazy: start-up (`r1flow --help` loads none of these)
            from flows.run import watchdog

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
    except Exception as e:
        line = prefect_start_failure(e, os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"))
        if line is not None:  # the cause in one line, not the traceback and the server's whole output
            print(line, file=sys.stderr)
            return 2
        if not supervised:
            raise
        # lazy: start-up (`r1flow --help` loads none of these)
        from flows.run import watchdog

        gone = watchdog.not_answering(watchdog.watched())
        if not gone:
            raise
        print(watchdog.lost_message(gone[0]), file=sys.stderr)  # the cause, not the traceback it caused
        return watchdog.EXIT_CODE
    except SystemExit as e:
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
            lifetime.exit_soon(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
