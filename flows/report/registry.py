"""The recipe's models in the MLflow Model Registry, moved on by every pipeline run (flows/run/pipeline.py).

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
- A deployment's run that regressed (flows/run/regressions.py) registers its versions and moves neither alias.

Load with `models:/r1flow-<recipe>@final` or `@champion`; the version's tags name the node,
stage, fingerprint and eval results.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from mlflow.exceptions import MlflowException

from flows.plan.recipes import Plan
from flows.report.comparison import CI_HIGH, CI_LOW
from flows.track.mlflow_runs import stage_runs
from flows.track.tracking import UI_QUERY, Tracker, sqlite_lock
from stages import get_stage

if TYPE_CHECKING:
    from flows.plan.results import StageResult
    from flows.store.artifacts import ArtifactStore

FINAL_ALIAS = "final"

CHAMPION_ALIAS = "champion"

FINGERPRINT_TAG = "r1flow.fingerprint"


def slug(text: str) -> str:
    """Lowercase letters, digits and dashes only (Prefect artifact keys; registry names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "recipe"


def registered_model_name(recipe: str) -> str:
    return f"r1flow-{slug(recipe)}"


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
    held: str = ""  # why no alias moved (a regressed run), or ""

    def markdown(self, tracker: Tracker) -> str:
        by_version: dict[str, list[str]] = {}
        for alias, v in self.aliases.items():
            by_version.setdefault(v, []).append(f"@{alias}")
        # MLflow's registry pages in its model-training view: without workflowType they open in the GenAI one (whose
        # sidebar has no Model registry), as a browser that never chose a view does
        base = f"{tracker.uri.rstrip('/')}/#/models/{quote(self.name)}" if tracker.is_server else None
        name = f"[`{self.name}`]({base}{UI_QUERY})" if base else f"`{self.name}`"
        lines = [f"Registered model {name} (load with `models:/{self.name}@{FINAL_ALIAS}` or "
                 f"`models:/{self.name}@{CHAMPION_ALIAS}`):", ""]
        if self.held:
            lines[-1:-1] = [f"No alias moved: {self.held}.", ""]
        for ref, v in self.versions.items():
            notes = by_version.get(v, []) + (["new"] if v in self.created else [])
            version = f"[version {v}]({base}/versions/{v}{UI_QUERY})" if base else f"version {v}"
            lines.append(f"- {ref}: {version}" + (f" ({', '.join(notes)})" if notes else ""))
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
                # aliases in code: MLflow renders the description as markdown, a bare @final as a link to GitHub
                description=f"r1flow recipe `{recipe}`: its final and evaluated models, one version per model "
                            f"fingerprint. `@{FINAL_ALIAS}`: the final model of the newest run; `@{CHAMPION_ALIAS}`: "
                            f"the best eval accuracy of the newest run that evaluated every model.")
        except MlflowException as e:  # a concurrent run created it first
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def register_models(plan: Plan, results: list[StageResult], tracker: Tracker,
                    store: ArtifactStore | None = None, parent_run_id: str | None = None,
                    hold_aliases: str = "") -> Registration | None:
    """Register the run's final and evaluated models under `r1flow-<recipe>` and move the aliases
    (scheme in the module docstring). Nodes skipped in this run are left out; None when none remain.
    `hold_aliases`: why this run moves no alias (a deployment's run that regressed: `@final` and `@champion` stay
    on the last good run's models), or "".

    Runs that finish together on one local sqlite store register one at a time (`sqlite_lock`: else both
    add a version of the same fingerprint, or one fails on `UNIQUE constraint failed:
    registered_model_aliases`); against a server, moving an alias is retried on that race."""
    with sqlite_lock(tracker.uri):
        return _register_models(plan, results, tracker, store, parent_run_id, hold_aliases)


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
                     parent_run_id: str | None, hold_aliases: str = "") -> Registration | None:
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
    if hold_aliases:
        reg.held = hold_aliases
        return reg
    final_versions = [v for ref, v in reg.versions.items() if finals and ref.split(".", 1)[0] == finals[-1]]
    if final_versions:
        _set_alias(client, name, FINAL_ALIAS, final_versions[0])
        reg.aliases[FINAL_ALIAS] = final_versions[0]
    if candidates and len(candidates) == len(all_evals):  # a partial run (--only) leaves @champion alone
        version = max(candidates)[3]
        _set_alias(client, name, CHAMPION_ALIAS, version)
        reg.aliases[CHAMPION_ALIAS] = version
    return reg
