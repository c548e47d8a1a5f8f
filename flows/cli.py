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


def cmd_run(args: argparse.Namespace) -> int:
    from flows.recipes import DEFAULT_RECIPE, load_plan
    from flows.settings import Settings, prepare_environment

    recipe = args.recipe or DEFAULT_RECIPE
    profile = args.profile or _default_profile()
    plan = load_plan(recipe, profile, args.set)  # every config error surfaces here, before any compute
    for name in (args.only or []) + (args.force or []):
        plan.node(name)
    prepare_environment()
    settings = Settings.from_env()
    print(f"r1flow: recipe {plan.recipe!r}, profile {plan.profile!r}, model {plan.model!r}, "
          f"{len(plan.nodes)} stages; home {settings.home}", flush=True)
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
    rows = store.list()
    if args.kind:
        rows = [m for m in rows if m.kind == args.kind]
    print(f"{'fingerprint':14} {'kind':8} {'schema':12} {'rows':>7} {'node':16} {'created':20}")
    for m in rows:
        print(f"{m.fingerprint[:12]:14} {m.kind:8} {m.schema_name:12} {m.rows if m.rows is not None else '-':>7} "
              f"{m.producer.node:16} {m.created_at:20}")
    print(f"{len(rows)} artifact(s) in {store.uri}")
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
    art.add_argument("--verify", action="store_true", help="re-hash every file against the manifest")
    art.set_defaults(func=cmd_artifacts)
    sub.add_parser("models", help="list builtin models and model artifacts").set_defaults(func=cmd_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except R1FlowError as e:
        print(f"r1flow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("r1flow: interrupted; completed stages are cached and training resumes from its last checkpoint",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
