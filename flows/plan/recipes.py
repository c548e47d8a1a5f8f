"""Recipes and profiles: load YAML, overlay profile and `--set` overrides, validate, order the DAG.

Everything here runs before any compute, so a bad recipe, key or value fails in one clear line.
Config precedence (later wins): stage defaults < recipe node config < profile `stages.<type>` <
profile `nodes.<name>` < `--set`. Then a stage module that declares a plan hook (`wire_plan`) rewires its
nodes: preference optimisation wires each node for what its loss reads, so `--set dpo.loss=...` works in any
recipe with such a node. The planner names no stage: what a stage needs of the plan is the stage's.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from schemas.configs import NodeResources, ProfileConfig, RecipeConfig, RecipeOverlay, RLConfig
from schemas.errors import ConfigError
from stages import STAGE_CONFIGS, STAGE_MODULES, get_stage
from stages.base import declared_kinds

RECIPE_DIR = Path(__file__).parents[1] / "recipes"  # the YAML stays in flows/recipes/, flows/profiles/
PROFILE_DIR = Path(__file__).parents[1] / "profiles"
# The default recipe: DeepSeek-R1's whole multi-stage recipe (flows/recipes/r1.yaml).
DEFAULT_RECIPE = "r1"


def available(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _load_yaml(name_or_path: str, directory: Path, what: str) -> tuple[dict, str]:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = directory / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown {what} {name_or_path!r}; known {what}s: {', '.join(available(directory))} "
                          f"(or pass a path to a .yaml file)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data, str(path)


def _model_at(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the field at `loc` inside `model` (through nested models and
    `X | None`), or None where the path leaves models (a dict's keys are the user's: no hint)."""
    for part in loc:
        if model is None:
            return None
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        model = _model_in(info.annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # `LoraSpec | None`; dict values are keyed by the user: not followed
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """` (did you mean learning_rate?)` for a close match among `known`, else ""."""
    close = difflib.get_close_matches(key, list(known), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def pydantic_message(e: ValidationError, prefix: str, model: type[BaseModel] | None = None) -> str:
    """One line for a validation error; with the `model` that was validated, an unknown key gets
    the closest field names of the model it sits in (`sft.learnin_rate: unknown key (did you mean
    learning_rate?)`)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden" and err["loc"] and (holder := _model_at(model, err["loc"][:-1])):
            msg += did_you_mean(str(err["loc"][-1]), holder.model_fields)
        value = f" (got {err['input']!r})" if err["type"] != "extra_forbidden" and "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{where}: {msg}{value}")
    return "; ".join(parts)


def deep_merge(base: dict, overlay: dict) -> dict:
    """`overlay` over `base`, mappings merged key by key; any other value, and an empty mapping, replaces (`--set
    prompts.tasks={}` clears the default tasks rather than adding nothing to them)."""
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        if isinstance(v, dict) and v and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (['a','b','c'], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. sft.learning_rate=1e-4")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and value.strip():
        try:  # YAML reads "1e-4" as a string; users mean a number
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return path, value


# Two things are named `resources` on a node: its placement (`resources:` beside `config:` in a recipe node or a
# profile, schemas.configs.NodeResources) and a training stage's `config.resources` (processes, machines, ddp/fsdp,
# schemas.specs.ResourcesSpec). Their keys do not overlap, so `--set NODE.resources.KEY=` takes either: these keys set
# the placement; the others (nodes, num_processes, processes_per_node, distributed_type, backend) the config.
PLACEMENT_KEYS = frozenset(NodeResources.model_fields) - {"nodes", "processes_per_node"}


def _set_path(d: dict, path: list[str], value: Any) -> None:
    for p in path[:-1]:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[path[-1]] = value


def overrides_tree(pairs: list[str] | tuple[str, ...]) -> dict:
    """`--set` pairs as one nested dict: ['sft.lr=1e-4', 'seed=1'] -> {'sft': {'lr': 0.0001}, 'seed': 1}."""
    out: dict = {}
    for text in pairs:
        path, value = parse_override(text)
        _set_path(out, path, value)
    return out


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _substitute(obj: Any, variables: dict[str, Any]) -> Any:
    """Replace `${name}` for every name in `variables` (others are left as they are).

    A string that is exactly one placeholder becomes the value itself, keeping its type (`when:
    ${dpo}` is a bool, `keep_layers: ${layers}` may be a list); inside longer text the value is
    formatted with str().
    """
    if isinstance(obj, str):
        whole = _PLACEHOLDER.fullmatch(obj)
        if whole and whole.group(1) in variables:
            return copy.deepcopy(variables[whole.group(1)])
        return _PLACEHOLDER.sub(lambda m: str(variables[m.group(1)]) if m.group(1) in variables else m.group(0), obj)
    if isinstance(obj, dict):
        return {k: _substitute(v, variables) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, variables) for v in obj]
    return obj


@dataclass(frozen=True)
class Node:
    name: str
    stage: str
    config: BaseModel
    inputs: dict[str, tuple[str, str]]  # input name -> (upstream node, output name)
    seed: int
    resources: NodeResources = field(default_factory=NodeResources)  # where it runs (placement; not in the cache key)

    @property
    def config_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")


@dataclass(frozen=True)
class Plan:
    recipe: str
    profile: str
    description: str
    model: str
    seed: int
    nodes: list[Node]  # topological order
    overrides: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # the recipe's option values in this plan
    dropped: dict[str, str] = field(default_factory=dict)  # node -> why the plan left it out (a stage's wire_plan)
    compare: tuple[tuple[str, str, str], ...] = ()  # (eval, over, label): the recipe's compare pairs in this plan

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        if name in self.dropped:
            raise ConfigError(f"node {name!r} is not in this run: {self.dropped[name]}")
        raise ConfigError(f"recipe {self.recipe!r} has no stage node {name!r}; nodes: {', '.join(n.name for n in self.nodes)}")

    def descendants(self, names: set[str]) -> set[str]:
        out = set(names)
        for n in self.nodes:
            if any(up in out for up, _ in n.inputs.values()):
                out.add(n.name)
        return out

    def ancestors(self, names: set[str]) -> set[str]:
        out = set(names)
        for n in reversed(self.nodes):
            if n.name in out:
                out.update(up for up, _ in n.inputs.values())
        return out


def _required(declared: dict[str, str]) -> set[str]:
    """Input names a node must wire; a kind ending in '?' marks an optional input."""
    return {name for name, kind in declared.items() if not kind.endswith("?")}


def _topological(edges: dict[str, list[str]]) -> list[str]:
    """Node names with every node after its upstream nodes; `edges`: node -> upstream nodes."""
    order, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"recipe has a cycle: {' -> '.join(trail + [name])}")
        state[name] = "visiting"
        for up in edges[name]:
            visit(up, trail + [name])
        state[name] = "done"
        order.append(name)

    for name in edges:  # recipe order breaks ties, so plans are stable
        visit(name, [])
    return order


def _options(raw: dict, recipe: str, overlay: RecipeOverlay | None, overrides: list[tuple[list[str], Any, str]]) -> dict:
    """The recipe's option values: its defaults < the profile's overlay for it < `--set options.NAME=`."""
    declared = raw.get("options") or {}
    if not isinstance(declared, dict):
        raise ConfigError(f"recipe {recipe!r}: options must be a mapping of NAME: value")
    values = dict(declared)

    def put(name: str, value: Any, where: str) -> None:
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise ConfigError(f"{where}: recipe {recipe!r} has no option {name!r}; its options: {known}")
        values[name] = value

    for name, value in (overlay.options if overlay else {}).items():
        put(name, value, f"profile option {name!r}")
    for path, value, text in overrides:
        if path[0] == "options":
            if len(path) != 2:
                raise ConfigError(f"--set {text!r}: expected options.NAME=VALUE")
            put(path[1], value, f"--set {text!r}")
    return values


def _resolve_sources(spec: str | list[str], enabled: set[str]) -> str | None:
    """The first 'node.output' of `spec` whose node is enabled (None: all are disabled)."""
    for src in [spec] if isinstance(spec, str) else spec:
        if src.split(".", 1)[0] in enabled:
            return src
    return None


def load_plan(recipe: str = DEFAULT_RECIPE, profile: str = "cpu", overrides: list[str] | tuple[str, ...] = (),
              run_checks: bool = True) -> Plan:
    """The plan of a recipe under a profile and `--set` overrides, every config error raised here, before any
    compute. In phases: read the recipe (options applied) and profile; layer the node configs (recipe < profile
    < --set); wire each node's inputs from its enabled sources; validate the configs; let each stage module's plan
    hook rewire its nodes (`wire_plan`, docs/design.md §2); order the nodes and check every edge."""
    raw, recipe_path = _load_yaml(recipe, RECIPE_DIR, "recipe")
    prof = _read_profile(profile)
    parsed = [(*parse_override(text), text) for text in overrides]
    recipe_name = str(raw.get("name", recipe))
    overlay = prof.recipes.get(recipe_name)
    rec = _read_recipe(raw, recipe_path, recipe_name, overlay, parsed)

    enabled = {name for name, n in rec.nodes.items() if n.when}
    node_cfgs = {name: dict(n.config) for name, n in rec.nodes.items() if name in enabled}
    node_seeds = {name: n.seed for name, n in rec.nodes.items()}
    _check_stages(rec)
    _apply_profile(rec, prof, overlay, recipe_name, node_cfgs)
    placed: dict[str, dict] = {}  # --set NODE.resources.<placement key>: the node's placement, not its config
    model, seed = _apply_overrides(rec, parsed, node_cfgs, node_seeds, prof.model or rec.model, rec.seed, placed)
    wiring = _wire_sources(rec, enabled)

    resources = {name: node_resources(name, rec.nodes[name].stage, rec.nodes[name].resources, prof, node_cfgs,
                                      placed.get(name, {}))
                 for name in wiring}
    cfgs = _validate_configs(rec, wiring, node_cfgs, model)
    user_set = {(path[0], path[1]): text for path, _, text in parsed if len(path) == 2}
    dropped = _run_plan_hooks({n: rec.nodes[n].stage for n in wiring}, cfgs, wiring, user_set)
    _check_reward_models(rec, cfgs, wiring)

    nodes = []
    for name in _topological({n: [src.split(".", 1)[0] for src in w.values()] for n, w in wiring.items()}):
        spec = rec.nodes[name]
        module = get_stage(spec.stage)
        inputs = _node_inputs(rec, name, wiring[name])
        if run_checks:
            check_node(module, cfgs[name], name)
        nodes.append(Node(name, spec.stage, cfgs[name], inputs,
                          node_seeds[name] if node_seeds[name] is not None else seed, resources[name]))
    present = {n.name for n in nodes}
    compare = tuple((c.eval, c.over, c.label) for c in rec.compare if {c.eval, c.over} <= present)
    return Plan(rec.name, prof.name, rec.description, model, seed, nodes, tuple(overrides), dict(rec.options), dropped,
                compare)


def _read_profile(profile: str) -> ProfileConfig:
    raw_profile, _ = _load_yaml(profile, PROFILE_DIR, "profile")
    try:
        return ProfileConfig.model_validate(raw_profile)
    except ValidationError as e:
        raise ConfigError(f"profile {profile}: {pydantic_message(e, '', ProfileConfig)}") from None


def _read_recipe(raw: dict, recipe_path: str, recipe_name: str, overlay: RecipeOverlay | None,
                 parsed: list[tuple[list[str], Any, str]]) -> RecipeConfig:
    """The recipe with its option values (`_options`) substituted into its nodes, validated."""
    options = _options(raw, recipe_name, overlay, parsed)
    if options and isinstance(raw.get("nodes"), dict):
        raw = {**raw, "options": options, "nodes": _substitute(raw["nodes"], options)}
    try:
        return RecipeConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"recipe {recipe_path}: {pydantic_message(e, '', RecipeConfig)}") from None


def _check_stages(rec: RecipeConfig) -> None:
    for name, n in rec.nodes.items():
        if n.stage not in STAGE_MODULES:
            raise ConfigError(f"recipe {rec.name!r} node {name!r}: unknown stage {n.stage!r}; known: {', '.join(STAGE_MODULES)}")
    for k, c in enumerate(rec.compare):
        for name in (c.eval, c.over):
            if rec.nodes[name].stage != "eval":
                raise ConfigError(f"recipe {rec.name!r} compare[{k}]: {name!r} is a {rec.nodes[name].stage} node; "
                                  "compare names eval nodes")


def _apply_profile(rec: RecipeConfig, prof: ProfileConfig, overlay: RecipeOverlay | None, recipe_name: str,
                   node_cfgs: dict[str, dict]) -> None:
    """The profile's sizes on the enabled nodes' configs: by stage type, then by node name; then the same from the
    profile's overlay for this recipe (`recipes.<name>`). Mutates `node_cfgs`."""
    layers = [(prof.stages, prof.nodes, f"profile {prof.name!r}")]
    if overlay is not None:
        layers.append((overlay.stages, overlay.nodes, f"profile {prof.name!r} recipes.{recipe_name}"))
    for stages, nodes_overlay, where in layers:
        for stage_type in stages:
            if stage_type not in STAGE_MODULES:
                raise ConfigError(f"{where}: unknown stage type {stage_type!r}")
        for name in node_cfgs:
            node_cfgs[name] = deep_merge(node_cfgs[name], stages.get(rec.nodes[name].stage, {}))
        for name, cfg_overlay in nodes_overlay.items():
            if name in node_cfgs:  # a profile may size nodes that only some recipes (or options) have
                node_cfgs[name] = deep_merge(node_cfgs[name], cfg_overlay)
            elif overlay is not None and nodes_overlay is overlay.nodes and name not in rec.nodes:
                raise ConfigError(f"{where}: recipe {rec.name!r} has no node {name!r}")


def _apply_overrides(rec: RecipeConfig, parsed: list[tuple[list[str], Any, str]], node_cfgs: dict[str, dict],
                     node_seeds: dict[str, int | None], model: str, seed: int,
                     placed: dict[str, dict]) -> tuple[str, int]:
    """The `--set` overrides (options were applied with the recipe): `model=`, `seed=`, `<node>.seed=`,
    `<node>.resources.<placement key>=` (into `placed`: see PLACEMENT_KEYS) and `<node>.<key>=` (into `node_cfgs`,
    `node_seeds`). Returns (model, seed)."""
    for path, value, text in parsed:
        if path == ["model"]:
            model = str(value)
        elif path == ["seed"]:
            if not isinstance(value, int):
                raise ConfigError(f"--set seed: expected an integer, got {value!r}")
            seed = value
        elif path[0] == "options":
            continue  # applied above
        elif path[0] in node_cfgs:
            if len(path) == 2 and path[1] == "seed":
                node_seeds[path[0]] = int(value)
            elif len(path) < 2:
                raise ConfigError(f"--set {text!r}: name a config key, e.g. {path[0]}.<key>=VALUE")
            elif len(path) > 2 and path[1] == "resources" and path[2] in PLACEMENT_KEYS:
                _set_path(placed.setdefault(path[0], {}), path[2:], value)
            else:
                _set_path(node_cfgs[path[0]], path[1:], value)
        elif path[0] in rec.nodes:
            raise ConfigError(f"--set {text!r}: node {path[0]!r} is disabled in this run (its `when` is false; "
                              f"see the recipe's options: {', '.join(f'{k}={v}' for k, v in rec.options.items())})")
        else:
            extra = " or options.NAME=" if rec.options else ""
            raise ConfigError(f"--set {text!r}: unknown stage node {path[0]!r} in recipe {rec.name!r}; "
                              f"nodes: {', '.join(rec.nodes)} (or model=, seed={extra})")
    return model, seed


def _wire_sources(rec: RecipeConfig, enabled: set[str]) -> dict[str, dict[str, str]]:
    """enabled node -> input -> its first enabled source ('node.output'); a required input without one fails."""
    wiring: dict[str, dict[str, str]] = {}
    for name in [n for n in rec.nodes if n in enabled]:
        spec = rec.nodes[name]
        declared = get_stage(spec.stage).INPUTS
        wiring[name] = {}
        for inp, sources in spec.inputs.items():
            src = _resolve_sources(sources, enabled)
            if src is not None:
                wiring[name][inp] = src
            elif inp in declared and not declared[inp].endswith("?"):
                raise ConfigError(f"node {name!r} input {inp!r}: every source ({', '.join([sources] if isinstance(sources, str) else sources)}) "
                                  f"is disabled by its `when`; add an enabled alternative or disable {name!r} too")
    return wiring


def _validate_configs(rec: RecipeConfig, wiring: dict[str, dict[str, str]], node_cfgs: dict[str, dict],
                      model: str) -> dict[str, BaseModel]:
    """Each wired node's config as its stage's pydantic model, `${model}` replaced by the plan's model."""
    cfgs = {}
    for name in wiring:
        try:
            cfgs[name] = STAGE_CONFIGS[rec.nodes[name].stage].model_validate(_substitute(node_cfgs[name], {"model": model}))
        except ValidationError as e:
            raise ConfigError(pydantic_message(e, name, STAGE_CONFIGS[rec.nodes[name].stage])) from None
    return cfgs


def _run_plan_hooks(stages: dict[str, str], cfgs: dict[str, BaseModel], wiring: dict[str, dict[str, str]],
                    user_set: dict[tuple[str, str], str]) -> dict[str, str]:
    """Each stage module's optional plan hook, once per stage type in the plan (in plan order):
    `wire_plan(stages, outputs, cfgs, wiring, user_set) -> {dropped node: why}` may rewire the nodes (their
    inputs in `wiring`, their configs in `cfgs`) and drop nodes nothing reads; `stages`: node -> stage type,
    `outputs`: node -> its stage's OUTPUTS, `user_set`: (node, field) -> the `--set` text that set it, so that
    a contradicting `--set` fails with the `--set` that fixes it. Returns every dropped node, with why."""
    dropped: dict[str, str] = {}
    for stage in dict.fromkeys(stages.values()):
        hook = getattr(get_stage(stage), "wire_plan", None)
        if hook is None:
            continue
        outputs = {n: get_stage(s).OUTPUTS for n, s in stages.items()}
        dropped.update(hook(stages, outputs, cfgs, wiring, user_set))
        stages = {n: s for n, s in stages.items() if n in wiring}
    return dropped


def _check_reward_models(rec: RecipeConfig, cfgs: dict[str, BaseModel], wiring: dict[str, dict[str, str]]) -> None:
    """An RL node that weights a reward model's score needs one wired. Its optional `reward_model` input is left out
    quietly when a recipe option disables its source (r1's `preferences: false`), and the run would fail on it only
    after every stage upstream of the node had run."""
    for name, cfg in cfgs.items():
        weight = cfg.reward.weights.get("reward_model", 0) if isinstance(cfg, RLConfig) else 0
        if name not in wiring or weight == 0 or "reward_model" in wiring[name]:
            continue
        sources = rec.nodes[name].inputs.get("reward_model")
        why = "no `reward_model` input"
        if sources is not None:
            listed = ", ".join([sources] if isinstance(sources, str) else sources)
            why = f"its `reward_model` input's source ({listed}) is disabled by its `when`"
        options = f" (the recipe's options: {', '.join(f'{k}={v}' for k, v in rec.options.items())})" if rec.options else ""
        raise ConfigError(f"node {name!r}: reward.weights.reward_model={weight} scores completions with a reward model, "
                          f"but {why}; use --set {name}.reward.weights.reward_model=0, or enable a reward model "
                          f"source{options}")


def _node_inputs(rec: RecipeConfig, name: str, wiring: dict[str, str]) -> dict[str, tuple[str, str]]:
    """input -> (upstream node, output) of a node, every edge checked: the stage declares the input, no required
    input is missing, the upstream node has the output and its kind is one the input takes."""
    spec = rec.nodes[name]
    declared = get_stage(spec.stage).INPUTS
    given = set(spec.inputs)
    if given - set(declared):
        raise ConfigError(f"node {name!r}: stage {spec.stage!r} has no input(s) {sorted(given - set(declared))}; "
                          f"its inputs: {', '.join(declared) or 'none'}")
    if _required(declared) - given:
        raise ConfigError(f"node {name!r}: missing input(s) {sorted(_required(declared) - given)} of stage {spec.stage!r}")
    inputs = {}
    for inp, src in wiring.items():
        up, out = src.split(".", 1)
        up_outputs = get_stage(rec.nodes[up].stage).OUTPUTS
        if out not in up_outputs:
            raise ConfigError(f"node {name!r} input {inp!r}: node {up!r} has no output {out!r}; "
                              f"its outputs: {', '.join(up_outputs)}")
        if not declared_kinds(up_outputs[out]) & declared_kinds(declared[inp]):
            raise ConfigError(f"node {name!r} input {inp!r}: expects {declared[inp]}, but {src} is {up_outputs[out]}")
        inputs[inp] = (up, out)
    return inputs


def node_resources(name: str, stage: str, declared: dict[str, Any], prof: ProfileConfig,
                   node_cfgs: dict[str, dict], placed: dict[str, Any] | None = None) -> NodeResources:
    """A node's NodeResources: defaults < the recipe node's `resources` < the profile's for its stage type < the
    profile's for its name < `--set NODE.resources.<placement key>` (`placed`). A training topology given here
    (nodes, processes_per_node) is written into the node's config (`resources.nodes`, `resources.num_processes`),
    where it is part of the cache key."""
    merged = deep_merge(deep_merge(declared, prof.resources.get(stage, {})), prof.resources.get(name, {}))
    merged = deep_merge(merged, placed or {})
    try:
        res = NodeResources.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(pydantic_message(e, f"node {name!r} resources", NodeResources)) from None
    topology = {k: v for k, v in (("nodes", res.nodes), ("num_processes", res.processes_per_node)) if v is not None}
    if topology:
        if "resources" not in STAGE_CONFIGS[stage].model_fields:
            raise ConfigError(f"node {name!r} resources: nodes and processes_per_node apply to training stages; "
                              f"stage {stage!r} runs in one process")
        node_cfgs[name] = deep_merge(node_cfgs[name], {"resources": topology})
    return res


def check_node(module, cfg, node: str) -> None:
    """The stage's plan-time `check(cfg)`, told the node's name where it names config keys in its errors
    (`--set new_prompts.files=...`, not `prompts.files`)."""
    check = getattr(module, "check", None)
    if check is None:
        return
    if "node" in inspect.signature(check).parameters:
        check(cfg, node=node)
    else:
        check(cfg)


def default_profile() -> str:
    """gpu when CUDA is available, else cpu: the profile a command uses without --profile."""
    try:
        # lazy: start-up (torch, only to see whether a GPU is there)
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
