"""`r1flow stage`, `deploy`, `serve` and `worker`: one stage on existing artifacts, and the deployments of
recipes and stages on a Prefect server (flows/run/deploy.py)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from flows.cli.output import print_servers_used
from flows.servers import processes, servers
from schemas.errors import ConfigError


def _input_refs(pairs: list[str]) -> dict[str, str]:
    refs = {}
    for text in pairs:
        name, sep, ref = text.partition("=")
        if not sep or not name or not ref:
            raise ConfigError(f"--input {text!r}: expected NAME=REF, e.g. model=latest:sft@sft-eval")
        refs[name.strip()] = ref.strip()
    return refs


def cmd_stage(args: argparse.Namespace) -> int:
    # lazy: start-up (`r1flow --help` loads none of these: yaml, the stages, Prefect, fsspec)
    from flows.plan.recipes import overrides_tree
    from flows.run.deploy import read_inputs, stage_config, stage_flow
    from flows.servers.settings import Settings, make_home, start_temporary_prefect
    from flows.store.artifacts import ArtifactStore

    overrides = overrides_tree(args.set)
    refs = _input_refs(args.input)
    producers = None  # what made the inputs: the recipe node a blank --node is, which config errors name
    if refs and args.recipe and not args.node:
        s = Settings.from_env()
        producers = read_inputs(args.name, refs, ArtifactStore(s.store, home=s.home), s.tracking_uri)[1]
    stage_config(args.name, args.recipe, args.profile, args.node, overrides, producers)  # before Prefect starts
    make_home()
    start_temporary_prefect()
    print_servers_used(args)

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
    # lazy: start-up (`r1flow --help` loads none of these: yaml, the stages, Prefect)
    from flows.plan.recipes import DEFAULT_RECIPE, default_profile
    from flows.run.deploy import deployment_specs
    from stages import STAGE_MODULES

    recipes = args.recipe or ([] if args.stage else [DEFAULT_RECIPE])
    stages = list(STAGE_MODULES) if args.all_stages else (args.stage or [])
    return deployment_specs(recipes, stages, args.profile or default_profile(), args.set, args.cron, args.interval,
                            args.tag or [], served=served, fail_on_regression=args.fail_on_regression,
                            regression_tolerance=args.regression_tolerance)

def cmd_worker(args: argparse.Namespace) -> int:
    """A Prefect worker (flows.run.worker) with r1flow's environment, registered with `r1flow up` so `r1flow down` stops
    it."""
    # lazy: start-up (`r1flow --help` loads none of these: Prefect's worker)
    from flows.run.worker import run_worker
    from flows.servers.settings import Settings, make_home, require_prefect_server

    url = require_prefect_server("worker", "polls a work pool")
    make_home()
    home = Settings.from_env().home
    print(f"r1flow: worker for work pool {args.pool!r} on {url}; Prefect state and results under "
          f"{os.environ['PREFECT_HOME']}, artifacts under {home}", flush=True)
    registered = servers.register_runner(home, name=f"worker {args.pool}")
    run_worker(args.pool, args.type, args.limit,
               on_exit=(lambda: servers.unregister_runner(home)) if registered else None)  # never returns
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    # lazy: start-up (`r1flow --help` loads none of these)
    from flows.servers.settings import require_prefect_server

    url = require_prefect_server("deploy", "registers deployments and their schedules")
    specs = _specs(args, served=False)
    # lazy: start-up (`r1flow --help` loads none of these: Prefect)
    from flows.run.deploy import deploy, full_name

    deploy(specs, args.pool, image=args.image, replace=args.replace)
    for spec in specs:
        sched = f" (cron {spec['cron']})" if "cron" in spec else (f" (every {spec['interval']} s)" if "interval" in spec else "")
        print(f"deployed {full_name(spec)} -> work pool {args.pool}{sched} on {url}")
    print(f"start a worker for it: r1flow worker --pool {args.pool}")
    return 0


def serve_hints(specs: list[dict], url: str) -> list[str]:
    """How to start the served deployments, as commands that work in a shell with nothing exported (Prefect's own
    hint, `prefect deployment run ...`, would go to a temporary server without PREFECT_API_URL)."""
    # lazy: start-up (`r1flow --help` loads none of these: Prefect, fsspec)
    from flows.run.deploy import full_name
    from flows.run.refs import REF_HELP
    from stages import get_stage

    prefect = " ".join(shlex.quote(p) for p in processes.console_script("prefect"))
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
    # lazy: start-up (`r1flow --help` loads none of these)
    from flows.servers.settings import Settings, make_home, require_prefect_server

    url = require_prefect_server("serve", "registers deployments and serves their runs")
    make_home()
    specs = _specs(args, served=True)
    # lazy: start-up (`r1flow --help` loads none of these: Prefect)
    from flows.run.deploy import full_name, serve

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
    p.add_argument("--fail-on-regression", action=argparse.BooleanOptionalAction, default=True,
                   help="a recipe deployment's run fails when an eval's accuracy dropped beyond its paired interval "
                   "since the deployment's last successful run (default: on; docs/guides/regressions.md)")
    p.add_argument("--regression-tolerance", type=float, default=0.0, metavar="POINTS",
                   help="accuracy points a drop's whole interval must exceed to fail the run (default 0)")


def add_deploy_commands(sub) -> None:
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
