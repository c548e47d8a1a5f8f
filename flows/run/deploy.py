"""Deployments and single-stage re-runs.

Two kinds of deployment, both typed so the Prefect UI renders a form with defaults, choices and
descriptions:
- one per recipe: the `r1flow-pipeline` flow (`recipe_pipeline`: recipe and profile are choices,
  no internal parameters) with the recipe's name as deployment name;
- one per stage: a flow `r1flow-<stage>` with the stage's name as deployment name, whose `config`
  parameter *is* the stage's pydantic config, shown with the values that will run (the deployment's
  recipe node and profile applied), and whose `inputs` parameter has one field per stage input.
`r1flow serve` registers the same flows under `<name>-served`, so serving a recipe on one machine
never replaces the work-pool deployment `r1flow deploy` registered for it, nor the other way round.

A single-stage run resolves each input reference to an artifact fingerprint, validates it (the
artifact exists, verifies, and is of the kind the stage takes), builds the config (stage defaults <
the recipe node's config, when a recipe is named < overrides; a blank node is the recipe's node that
reads what made the inputs, so the config, and any error in it, is the node's the run resolves to),
and runs the stage through the same
cached task as the pipeline: the same inputs and config give the same cache key, so the result
joins the lineage (manifest parents, MLflow input tags) and a pipeline run later reuses it.

Input references (flows/run/refs.py):
- a fingerprint or a unique prefix of one (`r1flow artifacts` lists them);
- `mlflow:<run id>[:<output>]`: an output of the stage run that MLflow run tracked;
- `latest:<node>[@<recipe>][:<output>]`: the newest output of that node: from MLflow's
  `r1flow/<recipe>` experiment when a recipe is named, else from the store's manifests.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.schedules import CronSchedule
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runner import Runner
from prefect.runtime import deployment as this_deployment
from pydantic import BaseModel, Field, ValidationError, create_model

from flows.plan.recipes import (
    PROFILE_DIR,
    RECIPE_DIR,
    _load_yaml,
    available,
    check_node,
    deep_merge,
    load_plan,
    pydantic_message,
)
from flows.plan.results import fmt_metric, key_metrics
from flows.run.engines import check_vllm_stage, resolve_auto_stage
from flows.run.pipeline import (
    _flow_run_id,
    experiment_name,
    node_outcome,
    pipeline,
    resolve_input,
    run_plan,
    submit_node,
)
from flows.run.placement import Execution, cluster_address
from flows.run.reclaim import reclaim_abandoned
from flows.run.refs import REF_HELP, resolve_ref
from flows.run.regressions import RegressionPolicy, final_state
from flows.servers.settings import Settings
from flows.store.artifacts import ArtifactStore
from flows.store.cache import cache_key, reusable_record
from flows.store.lineage import with_lineage
from flows.track.tracking import Tracker, flatten, run_name
from schemas.configs import ProfileConfig
from schemas.errors import ArtifactError, ConfigError
from stages import STAGE_CONFIGS, STAGE_MODULES, STAGES, get_stage, stage_version
from stages.base import declared_kinds
from stages.runtime import lifetime
from stages.sampling.engine_check import sampled_input

ROOT = Path(__file__).resolve().parents[2]  # the repository
log = logging.getLogger(__name__)
PIPELINE_ENTRYPOINT = "flows/run/pipeline.py:pipeline"
SERVED_SUFFIX = "-served"
RecipeName = Literal[tuple(available(RECIPE_DIR))]  # choices in the UI's run form
ProfileName = Literal[tuple(available(PROFILE_DIR))]


# ---------------------------------------------------------------------------- config


def _recipe_node(plan, stage: str, producers: dict[str, str] | None) -> str:
    """The recipe's node of `stage` a single-stage run with a blank node is: the only one, else the one whose inputs
    come from the nodes that made the given artifacts (`producers`: input name -> producing node). A model made by
    sft-eval's `sft` is evaluated as `eval_sft`, never under `eval_base`'s name. None: the first (the form's shown
    config, before any input is known)."""
    candidates = [n for n in plan.nodes if n.stage == stage]
    if not candidates:
        raise ConfigError(f"recipe {plan.recipe!r} has no {stage!r} node; name one with node=")
    if len(candidates) == 1 or producers is None:
        return candidates[0].name
    matching = [n.name for n in candidates
                if all(n.inputs[k][0] == made_by for k, made_by in producers.items() if k in n.inputs)]
    if len(matching) == 1:
        return matching[0]
    given = ", ".join(f"{k} made by node {v!r}" for k, v in sorted(producers.items())) or "inputs made by no node"
    raise ConfigError(f"recipe {plan.recipe!r} has {len(candidates)} {stage!r} nodes "
                      f"({', '.join(n.name for n in candidates)}) and the inputs ({given}) fit "
                      f"{'none' if not matching else 'several'} of them; name one with node=")


def stage_config(stage: str, recipe: str | None, profile: str | None, node: str | None,
                 overrides: dict[str, Any],
                 producers: dict[str, str] | None = None) -> tuple[dict[str, Any], str, int | None]:
    """(validated config dict, node name, seed from the recipe or None) for a single-stage run. A blank node with a
    recipe: `_recipe_node` (`producers`: the node that made each given input artifact)."""
    if stage not in STAGE_MODULES:
        raise ConfigError(f"unknown stage {stage!r}; known: {', '.join(STAGE_MODULES)}")
    seed = None
    if recipe:
        plan = load_plan(recipe, profile or "cpu")
        name = node or _recipe_node(plan, stage, producers)
        n = plan.node(name)
        if n.stage != stage:
            raise ConfigError(f"recipe {recipe!r} node {name!r} is a {n.stage!r} stage, not {stage!r}")
        base, seed = n.config_dict, n.seed
    else:
        name = node or stage
        base = STAGE_CONFIGS[stage]().model_dump(mode="json")
        if profile:
            raw, _ = _load_yaml(profile, PROFILE_DIR, "profile")
            base = deep_merge(base, ProfileConfig.model_validate(raw).stages.get(stage, {}))
    try:
        cfg = STAGE_CONFIGS[stage].model_validate(deep_merge(base, overrides))
    except ValidationError as e:
        raise ConfigError(pydantic_message(e, name, STAGE_CONFIGS[stage])) from None
    check_node(get_stage(stage), cfg, name)
    return cfg.model_dump(mode="json"), name, seed


def changed_fields(value: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The nested keys where `value` differs from `default` (what a UI form submission changed)."""
    out = {}
    for k, v in value.items():
        d = default.get(k)
        if isinstance(v, dict) and isinstance(d, dict):
            sub = changed_fields(v, d)
            if sub:
                out[k] = sub
        elif v != d:
            out[k] = v
    return out


# ---------------------------------------------------------------------------- the single-stage run


def read_inputs(stage: str, inputs: dict[str, str], store: ArtifactStore, tracking_uri: str
                ) -> tuple[dict[str, str], dict[str, str]]:
    """(input name -> fingerprint, input name -> the node that made it) of a single-stage run's input references: the
    names checked against the stage's inputs, each reference resolved and its manifest's kind matched against the
    input's (its files are re-hashed later, `store.verify`). The producers tell which recipe node a blank node is."""
    declared = get_stage(stage).INPUTS
    unknown = set(inputs) - set(declared)
    if unknown:
        raise ConfigError(f"stage {stage!r} has no input(s) {sorted(unknown)}; its inputs: {', '.join(declared)}")
    missing = {k for k, v in declared.items() if not v.endswith("?")} - {k for k, v in inputs.items() if v}
    if missing:
        raise ConfigError(f"stage {stage!r}: missing input(s) {sorted(missing)}; give each as a {REF_HELP}")
    resolved, producers = {}, {}
    for k, ref in inputs.items():
        if not ref:
            continue
        fp = resolve_ref(ref, k, store, tracking_uri)
        manifest = store.read_manifest(fp)
        if not {manifest.kind, manifest.schema_name} & declared_kinds(declared[k]):  # "model", or a dataset schema
            raise ArtifactError(f"input {k!r} ({ref}): artifact {fp[:12]} is a {manifest.kind} "
                                f"({manifest.schema_name}); stage {stage!r} takes a {declared[k].rstrip('?')}")
        resolved[k] = fp
        if manifest.producer.node:
            producers[k] = manifest.producer.node
    return resolved, producers


def run_single_stage(stage: str, inputs: dict[str, str], overrides: dict[str, Any] | None = None, node: str | None = None,
              seed: int | None = None, recipe: str | None = None, profile: str | None = None,
              settings: dict[str, str] | None = None, force: bool = False) -> dict[str, Any]:
    """Run one stage on referenced artifacts (inside a flow: the stage runs as the cached task)."""
    lifetime.reinstall()  # SIGTERM stops the run within seconds, not Prefect's bridge (stages/runtime/lifetime.py)

    s = Settings(**settings) if settings else Settings.from_env()
    module = get_stage(stage)
    store = ArtifactStore(s.store, home=s.home)
    resolved, producers = read_inputs(stage, inputs, store, s.tracking_uri)
    # config errors name the node the inputs make it (a blank node), before any file is re-hashed
    config, name, recipe_seed = stage_config(stage, recipe, profile, node, overrides or {}, producers)
    sampled = sampled_input(stage)  # vLLM can serve the model it samples: one line before any compute
    sampled_inputs = {sampled: resolve_input(store, resolved[sampled])} if sampled in resolved else {}
    config = resolve_auto_stage(stage, module.CONFIG.model_validate(config), sampled_inputs).model_dump(mode="json")
    check_vllm_stage(name, stage, module.CONFIG.model_validate(config), sampled_inputs)
    resolved = with_lineage(module, resolved, store)  # an eval's model's ancestor datasets, as the pipeline's node_key
    for fp in resolved.values():
        store.verify(fp)  # every file matches, before any compute
    seed = seed if seed is not None else (recipe_seed if recipe_seed is not None else 0)
    salt = module.cache_salt(module.CONFIG.model_validate(config)) if hasattr(module, "cache_salt") else ""
    key = cache_key(stage, stage_version(module), config, resolved, seed, salt)
    experiment = experiment_name(recipe or "stages")
    tracker = Tracker(s.tracking_uri, experiment, s.mlflow_artifact_location)
    flow_run_id = _flow_run_id()
    reclaim_abandoned(store, tracker, flow_run_id)  # and tags this flow run with its process, as a pipeline run does
    parent = tracker.start_run(run_name(f"{name} (stage)", flow_run_id), {"r1flow.single_stage": "true", "r1flow.recipe": recipe or "",
                                                 "r1flow.profile": profile or "", "r1flow.flow_run_id": flow_run_id or "",
                                                 **{f"r1flow.input.{k}": v for k, v in resolved.items()}})
    ok = False
    t0 = time.perf_counter()
    try:
        record = None if force else reusable_record(store, key, name)
        state = submit_node(name, stage, config, resolved, seed, key, record=record, force=force, parent_run_id=parent,
                            s=s, experiment=experiment)
        out, cached, run_id = node_outcome(state, state.result(), record, tracker, parent, flow_run_id, node=name,
                                           stage=stage, key=key, config=config, seed=seed)
        source_run_id = out.get("mlflow_run_id")
        out = {**out, "mlflow_run_id": run_id}
        # the run the CLI and the Prefect artifact link to shows what ran (or was reused), not only tags
        tracker.log_params(parent, {"config": config, "seed": seed, "changed": flatten(overrides or {}) or "none"})
        tracker.log_metrics(parent, {k: v for k, v in out["metrics"].items() if k != "stage_seconds"})
        tracker.set_tags(parent, {**{f"r1flow.output.{k}": v for k, v in out["outputs"].items()},
                                  "r1flow.cache_hit": str(cached).lower(), "r1flow.source_run_id": source_run_id or ""})
        ok = True
    finally:
        tracker.end(parent, ok)
    result = {"stage": stage, "node": name, "status": "cached" if cached else "run", "seconds": time.perf_counter() - t0,
              "inputs": resolved, "outputs": out["outputs"], "metrics": out["metrics"], "config": config, "seed": seed,
              "changed": flatten(overrides or {}), "cache_key": key, "mlflow_run_id": out.get("mlflow_run_id"),
              "source_run_id": source_run_id, "parent_run_id": parent,
              "link": tracker.run_link(parent), "flow_run_id": flow_run_id}
    if flow_run_id:
        result["prefect_artifact_id"] = publish_stage_result(result, recipe, profile)
    return result


def stage_result_markdown(result: dict[str, Any], recipe: str | None, profile: str | None) -> str:
    """What a single-stage re-run shows on its Prefect flow run: inputs, outputs, key metrics, MLflow link."""
    where = ", ".join(f"{k} `{v}`" for k, v in (("recipe", recipe), ("profile", profile)) if v) or "stage defaults"
    lines = [f"# Stage re-run: {result['node']} ({result['stage']})", "",
             f"**{result['status']}** in {result['seconds']:.1f} s; config from {where}, seed {result['seed']}.", "",
             "Fields changed: " + (", ".join(f"`{k}={v}`" for k, v in result["changed"].items()) or "nothing"), "",
             "| | name | fingerprint |", "|---|---|---|"]
    lines += [f"| input | {k} | `{v}` |" for k, v in result["inputs"].items()]
    lines += [f"| output | {k} | `{v}` |" for k, v in result["outputs"].items()]
    metrics = key_metrics(result["stage"], result["metrics"] or {})
    if metrics:
        lines += ["", "Key metrics: " + ", ".join(f"{k} = {fmt_metric(v)}" for k, v in metrics.items())]
    link = result["link"]
    lines += ["", f"MLflow: [{result['parent_run_id']}]({link})" if link.startswith("http") else f"MLflow: {link}"]
    return "\n".join(lines) + "\n"


def publish_stage_result(result: dict[str, Any], recipe: str | None, profile: str | None) -> str | None:
    """A markdown artifact on the current flow run (key `stage-<node>`); a failure only warns, the result stands."""
    key = "stage-" + re.sub(r"[^a-z0-9-]+", "-", result["node"].lower()).strip("-")
    try:
        return str(create_markdown_artifact(markdown=stage_result_markdown(result, recipe, profile), key=key,
                                            description=f"r1flow stage re-run {result['node']}: outputs and MLflow run"))
    except Exception as e:  # the stage's outputs are published and tracked already
        get_run_logger().warning(f"could not create the Prefect artifact {key!r}: {type(e).__name__}: {e}")
        return None



@flow(name="r1flow-stage", persist_result=True, result_serializer="json", log_prints=True)
def stage_flow(stage: str, inputs: dict[str, str], overrides: dict[str, Any] | None = None, node: str | None = None,
               seed: int | None = None, recipe: str | None = None, profile: str | None = None,
               settings: dict[str, str] | None = None, force: bool = False) -> dict[str, Any]:
    """Run one stage on referenced artifacts.

    Args:
        stage: Stage name (r1flow stages lists them).
        inputs: Input name -> artifact reference: a fingerprint (or unique prefix), mlflow:RUN_ID[:OUTPUT],
            or latest:NODE[@RECIPE][:OUTPUT].
        overrides: Config values over the base config (nested mapping).
        node: Node name (default: the recipe's node of this stage, else the stage name).
        seed: Seed (default: the recipe node's, else 0).
        recipe: Take the base config (and seed) from this recipe's node.
        profile: Profile applied to the base config (tiny, cpu, gpu).
        settings: Storage and tracking locations (default: from the environment).
        force: Re-run even when a valid cached result exists.
    """
    return run_single_stage(stage, inputs, overrides, node, seed, recipe, profile, settings, force)


def _inputs_model(stage: str) -> type[BaseModel]:
    fields = {}
    for name, kind in get_stage(stage).INPUTS.items():
        desc = f"A {kind.rstrip('?')} artifact: {REF_HELP}."
        fields[name] = (str | None, Field(None, description=desc)) if kind.endswith("?") else (
            str, Field(..., description=desc))
    return create_model(f"{stage.title().replace('_', '')}Inputs", **fields)


def _make_stage_flow(stage: str):
    """A flow for one stage whose parameters are typed by that stage's config and inputs."""
    cfg_cls, inputs_cls = STAGE_CONFIGS[stage], _inputs_model(stage)
    default = cfg_cls().model_dump(mode="json")

    def rerun(inputs, config=None, recipe=None, profile=None, node=None, seed=None, force=False):
        # The fields the caller gave (the UI's form gives all of them; an API call may give a few): Prefect has
        # validated `config` into the model already, whose fields_set still tells given from defaulted.
        cfg = config if isinstance(config, cfg_cls) else cfg_cls.model_validate(config or {})
        given_cfg = cfg.model_dump(mode="json", exclude_unset=True)
        given = inputs.model_dump() if isinstance(inputs, BaseModel) else dict(inputs)
        shown = _shown_config(default)  # what the form showed: the deployment's config (recipe and profile applied)
        return run_single_stage(stage, {k: v for k, v in given.items() if v}, changed_fields(given_cfg, shown),
                         node, seed, recipe, profile, force=force)

    P = inspect.Parameter
    rerun.__signature__ = inspect.Signature([
        P("inputs", P.POSITIONAL_OR_KEYWORD, annotation=inputs_cls),
        P("config", P.POSITIONAL_OR_KEYWORD, default=cfg_cls(), annotation=cfg_cls),
        P("recipe", P.POSITIONAL_OR_KEYWORD, default=None, annotation=RecipeName | None),
        P("profile", P.POSITIONAL_OR_KEYWORD, default=None, annotation=ProfileName | None),
        P("node", P.POSITIONAL_OR_KEYWORD, default=None, annotation=str | None),
        P("seed", P.POSITIONAL_OR_KEYWORD, default=None, annotation=int | None),
        P("force", P.POSITIONAL_OR_KEYWORD, default=False, annotation=bool),
    ], return_annotation=dict)
    rerun.__annotations__ = {p.name: p.annotation for p in rerun.__signature__.parameters.values()}
    rerun.__annotations__["return"] = dict
    rerun.__doc__ = f"""Re-run the {stage} stage: {STAGES[stage].summary}

    Args:
        inputs: One artifact reference per input: {REF_HELP}.
        config: The {stage} config as it will run: the deployment's recipe node and profile applied. What you
            change here is applied over the recipe and profile chosen below (change those and every field you
            leave as shown takes their value).
        recipe: Take the base config and seed from this recipe's {stage} node (blank: the stage defaults).
        profile: Profile over the base config (blank: none).
        node: Node name for lineage and tracking (default: the recipe's {stage} node or {stage!r}).
        seed: Seed (default: the recipe node's, else 0).
        force: Re-run even when a valid cached result exists.
    """
    rerun.__name__ = rerun.__qualname__ = f"{stage}_stage"
    rerun.__module__ = __name__
    return flow(name=f"r1flow-{stage.replace('_', '-')}", persist_result=True, result_serializer="json",
                log_prints=True)(rerun)


STAGE_FLOWS = {stage: _make_stage_flow(stage) for stage in STAGE_MODULES}
globals().update({f"{stage}_stage": f for stage, f in STAGE_FLOWS.items()})  # entrypoints flows/run/deploy.py:<stage>_stage


# ---------------------------------------------------------------------------- deployments


def schedule_kwargs(cron: str | None, interval: float | None) -> dict[str, Any]:
    if cron and interval:
        raise ConfigError("give --cron or --interval, not both")
    if cron:
        try:
            CronSchedule(cron=cron)
        except (ValueError, ValidationError) as e:
            raise ConfigError(f"--cron {cron!r}: not a valid cron expression ({e})") from None
        return {"cron": cron}
    return {"interval": interval} if interval else {}


@flow(name="r1flow-pipeline", persist_result=True, result_serializer="json", log_prints=True)
def recipe_pipeline(recipe: RecipeName, profile: ProfileName, overrides: list[str] | None = None,
                    only: list[str] | None = None, force: list[str] | None = None, parallel: int = 1,
                    cluster: str | None = None, fail_on_regression: bool = True,
                    regression_tolerance: float = 0.0) -> Any:
    """Run a recipe: every stage node in dependency order, reusing cached outputs where valid.

    Args:
        recipe: Recipe (r1flow recipes describes each).
        profile: Profile sizing the stages: tiny (seconds, tests), cpu, gpu.
        overrides: Config overrides KEY=VALUE, e.g. sft.learning_rate=1e-4, dpo.beta=0.2, model=PATH, seed=1.
        only: Run only these nodes; their upstream nodes must be cached.
        force: Re-run these nodes even when cached.
        parallel: Run up to this many independent stages at once on the worker's machine (each in its own process).
        cluster: Ray cluster address (host:port of its head): run the stages there, independent ones at the same
            time (default: the worker's RAY_ADDRESS, if any).
        fail_on_regression: Fail the run when an eval's accuracy dropped beyond its paired interval since this
            deployment's last successful run (off: the run still compares and reports; a run with it off that
            completes is the next run's baseline).
        regression_tolerance: Accuracy points a drop's whole interval must exceed to fail the run (0: any drop
            beyond the noise).
    """
    plan = load_plan(recipe, profile, overrides or [])
    return final_state(run_plan(plan, Settings.from_env(), only=set(only or []), force=set(force or []),
                                execution=Execution(parallel=parallel, cluster=cluster_address(cluster)),
                                regression=RegressionPolicy(fail_on_regression, regression_tolerance)))


def _stage_base(stage: str, recipes: list[str], profile: str) -> dict[str, Any]:
    """A stage deployment's default parameters: the one recipe given, if it has a node of that stage, and the
    config that will run with it and the profile (so the UI form shows what runs)."""
    recipe = None
    if len(recipes) == 1 and any(n.stage == stage for n in load_plan(recipes[0], profile, run_checks=False).nodes):
        recipe = recipes[0]
    config, _, _ = stage_config(stage, recipe, profile, None, {})
    return {"config": config, "profile": profile, **({"recipe": recipe} if recipe else {})}


def deployment_specs(recipes: list[str], stages: list[str], profile: str, overrides: list[str],
                     cron: str | None = None, interval: float | None = None,
                     tags: list[str] = (), served: bool = False, fail_on_regression: bool = True,
                     regression_tolerance: float = 0.0) -> list[dict[str, Any]]:
    """What to register: flow, entrypoint, name, parameters, schedule, tags, description. Validates
    every recipe with its overrides first, so a bad one fails before anything is registered.
    Recipe deployments are named after the recipe, stage deployments after the stage; `served`
    (`r1flow serve`) adds SERVED_SUFFIX so they never replace work-pool deployments. A recipe deployment's runs fail
    on a regression unless `fail_on_regression` is off; either setting is a parameter only where not the default."""
    suffix = SERVED_SUFFIX if served else ""
    specs = []
    sched = schedule_kwargs(cron, interval)
    if regression_tolerance < 0:
        raise ConfigError(f"--regression-tolerance {regression_tolerance:g}: a drop in accuracy points, >= 0")
    regression = {k: v for k, v, default in (("fail_on_regression", fail_on_regression, True),
                                             ("regression_tolerance", regression_tolerance, 0.0)) if v != default}
    for recipe in recipes:
        plan = load_plan(recipe, profile, overrides)
        if recipe in available(RECIPE_DIR):  # the form offers the project's recipes and profiles as choices
            flow_, entrypoint = recipe_pipeline, "flows/run/deploy.py:recipe_pipeline"
        else:  # a recipe file elsewhere: the pipeline flow itself, whose recipe is any name or path
            flow_, entrypoint = pipeline, PIPELINE_ENTRYPOINT
        specs.append({"flow": flow_, "entrypoint": entrypoint, "name": plan.recipe + suffix,
                      "parameters": {"recipe": recipe, "profile": profile, "overrides": list(overrides), **regression},
                      "tags": ["r1flow", "recipe", plan.recipe, *tags], "description": plan.description, **sched})
    for stage in stages:
        if stage not in STAGE_FLOWS:
            raise ConfigError(f"unknown stage {stage!r}; known: {', '.join(STAGE_FLOWS)}")
        specs.append({"flow": STAGE_FLOWS[stage], "entrypoint": f"flows/run/deploy.py:{stage}_stage",
                      "name": stage + suffix, "parameters": _stage_base(stage, recipes, profile),
                      "tags": ["r1flow", "stage", stage, *tags],
                      "description": f"Re-run the {stage} stage from cached artifacts: {STAGES[stage].summary}"})
    return specs


RUNNER_STOP_GRACE_S = 8.0  # SIGTERM to exit, whatever is left undone; `r1flow down` waits 10 s (processes.STOP_GRACE_S)


def serve(specs: list[dict[str, Any]], limit: int | None = None) -> None:
    """Serve the deployments from this process (a Prefect runner; flow runs in subprocesses) until SIGTERM, which
    cancels its runs in progress and pauses its schedules (`r1flow down` sends it before stopping the servers)."""
    deployments = [s["flow"].to_deployment(name=s["name"], parameters=s["parameters"], tags=s["tags"],
                                           description=s["description"],
                                           **{k: s[k] for k in ("cron", "interval") if k in s})
                   for s in specs]
    runner = _runner_class()(pause_on_shutdown=True, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    # no Prefect starting message: it suggests `prefect deployment run ...`, which fails without the exports r1flow
    # does not need; the CLI prints commands that work instead (cli_deploy.serve_hints), and this line once they are served
    asyncio.run(_start_and_say_so(runner, len(deployments)))


async def _start_and_say_so(runner: Any, n: int) -> None:
    started = asyncio.create_task(runner.start())
    while not (runner.started or started.done()):
        await asyncio.sleep(0.2)
    if runner.started:
        print(f"r1flow serve: {n} deployment(s) being served and polling for runs; `r1flow down` or SIGTERM stops",
              flush=True)
    await started


def _runner_class():
    class StoppingRunner(Runner):
        """Prefect's SIGTERM handler calls the sync `stop()` inside the running loop, where it only creates the
        coroutine ("coroutine 'Runner.astop' was never awaited") and then raises SystemExit through the loop:
        under load the runner took 12-23 s to exit and `r1flow down` SIGKILLed it (issue 44 item 8). Here the
        stop runs in the loop, and the process exits RUNNER_STOP_GRACE_S after the signal at the latest."""

        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            lifetime.exit_soon(128 + signal.SIGTERM, RUNNER_STOP_GRACE_S)
            if not self.started:
                sys.exit(0)
            self._logger.info("SIGTERM received: cancelling runs in progress, pausing schedules, stopping")
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(lambda: setattr(self, "_r1flow_stop", loop.create_task(self.astop())))

    return StoppingRunner


def ensure_work_pool(name: str, kind: str = "process") -> None:
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=kind))
        except ObjectAlreadyExists:
            pass


def existing_elsewhere(specs: list[dict[str, Any]], pool: str | None) -> list[str]:
    """The deployments among `specs` that already exist with another work pool (None: served by a runner)."""
    clashes = []
    with get_client(sync_client=True) as client:
        for s in specs:
            try:
                dep = client.read_deployment_by_name(full_name(s))
            except ObjectNotFound:
                continue
            if dep.work_pool_name != pool:
                clashes.append(f"{full_name(s)} (work pool {dep.work_pool_name or 'none: served by r1flow serve'})")
    return clashes


def deploy(specs: list[dict[str, Any]], pool: str, image: str | None = None, replace: bool = False) -> list[str]:
    """Register the deployments with a work pool (created as a process pool if missing). Without an
    image the code is loaded from this checkout (process workers on this machine or a shared disk).
    A deployment of the same name on another pool is an error unless `replace` (nothing is registered)."""
    clashes = [] if replace else existing_elsewhere(specs, pool)
    if clashes:
        raise ConfigError(f"already deployed elsewhere: {'; '.join(clashes)}; deploying to work pool {pool!r} would "
                          "replace them: pass --replace to do that")
    if image is None:
        ensure_work_pool(pool)
    ids = []
    for s in specs:
        kwargs = {k: s[k] for k in ("cron", "interval") if k in s}
        source = s["flow"] if image else s["flow"].from_source(source=str(ROOT), entrypoint=s["entrypoint"])
        # to_deployment + apply: what Flow.deploy does without its image build/push and next-steps printing.
        dep = source.to_deployment(name=s["name"], work_pool_name=pool, parameters=s["parameters"], tags=s["tags"],
                                   description=s["description"], **kwargs)
        ids.append(str(dep.apply(image=image) if image else dep.apply()))
    return ids


def _shown_config(default: dict[str, Any]) -> dict[str, Any]:
    """The config a deployment's form showed (its `config` parameter), else the stage defaults."""
    shown = None
    try:
        if this_deployment.id:  # (runtime.deployment.parameters are the flow run's, not the deployment's defaults)
            with get_client(sync_client=True) as client:
                shown = (client.read_deployment(this_deployment.id).parameters or {}).get("config")
    except Exception as e:  # no deployment or no API: the stage defaults were what a form showed
        log.warning("could not read the deployment's parameters (%s: %s); the stage defaults are the base",
                    type(e).__name__, e)
    return deep_merge(default, shown) if isinstance(shown, dict) else default


def full_name(spec: dict[str, Any]) -> str:
    return f"{spec['flow'].name}/{spec['name']}"


def api_url() -> str | None:
    return os.environ.get("PREFECT_API_URL")
