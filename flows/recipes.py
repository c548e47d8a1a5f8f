"""Recipes and profiles: load YAML, overlay profile and `--set` overrides, validate, order the DAG.

Everything here runs before any compute, so a bad recipe, key or value fails in one clear line.
Config precedence (later wins): stage defaults < recipe node config < profile `stages.<type>` <
profile `nodes.<name>` < `--set`. Then every preference_optimization node is wired for what its
loss reads (`wire_preference_losses`), so `--set dpo.loss=...` works in any recipe with such a node.
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

from schemas.configs import STAGE_CONFIGS, NodeResources, ProfileConfig, RecipeConfig, RecipeOverlay
from schemas.errors import ConfigError
from stages import STAGE_MODULES, get_stage
from stages.math import preference as pl

RECIPE_DIR = Path(__file__).parent / "recipes"
PROFILE_DIR = Path(__file__).parent / "profiles"
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
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
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
    dropped: dict[str, str] = field(default_factory=dict)  # node -> why the plan left it out (wire_preference_losses)

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


def input_kinds(spec: str) -> set[str]:
    """The kinds a declared input or output takes: "model", "sft_data|preference_data?" -> {sft_data, preference_data}."""
    return set(spec.rstrip("?").split("|"))


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


# ---------------------------------------------------------------------------- what each preference loss needs


@dataclass(frozen=True)
class LossNeeds:
    """What a `preference_optimization` loss reads, so that the plan wires it before any compute.

    data: the dataset kinds it trains on, preferred first (KTO: labelled unpaired rows, else pairs
    read as chosen = desirable); reference: it reads reference log-probs (SimPO and ORPO do not);
    kl: its reference also scores mismatched (prompt, completion) pairs, KTO's reference point.
    """

    data: tuple[str, ...]
    reference: bool
    kl: bool


# From the loss registry, so a loss added there is wired by the inputs it declares.
LOSS_NEEDS: dict[str, LossNeeds] = {
    loss: LossNeeds(data=("preferences",) if loss in pl.PAIRED else ("unpaired", "preferences"),
                    reference=loss in pl.NEEDS_REFERENCE, kl="kl_ref" in spec.inputs)
    for loss, spec in pl.LOSSES.items()
}
TRAINS, REFERENCE = "preference_optimization", "reference_logprobs"  # the stages the rule wires


def _data_source(src: str, kinds: tuple[str, ...], stages: dict[str, str], where: str) -> str:
    """`src` or a sibling output of its node with the first of `kinds` it has (pairs -> unpaired rows for KTO)."""
    up, out = src.split(".", 1)
    outputs = get_stage(stages[up]).OUTPUTS
    if out not in outputs:
        return src  # load_plan names the missing output
    for kind in kinds:
        if kind in input_kinds(outputs[out]):
            return src
        sibling = next((o for o, k in outputs.items() if kind in input_kinds(k)), None)
        if sibling is not None:
            return f"{up}.{sibling}"
    raise ConfigError(f"{where} trains on {' or '.join(kinds)}, but {src} is {outputs[out]} and node {up!r} has no "
                      f"{kinds[0]} output; wire one, or choose a loss that trains on {outputs[out]}")


def wire_preference_losses(stages: dict[str, str], cfgs: dict[str, BaseModel], wiring: dict[str, dict[str, str]],
                           user_set: dict[tuple[str, str], str]) -> dict[str, str]:
    """Wire every preference_optimization node for its loss (`LOSS_NEEDS`); returns the nodes dropped, with why.

    The data input takes the kind the loss trains on from the same upstream node (KTO: preference_data's
    unpaired rows). A reference-free loss reads no reference, and a reference_logprobs node that nothing
    else reads is dropped. A reference node scores exactly its consumer's data, at its max_length, with
    the KL pairs KTO needs. `user_set` ((node, field) -> the `--set` text): a `--set` that contradicts
    this fails here, before any compute, with the `--set` that fixes it. Mutates `cfgs` and `wiring`.
    """
    unread: dict[str, str] = {}  # reference node -> why its reader let it go
    consumers: dict[str, list[str]] = {}
    for name, stage in stages.items():
        if stage != TRAINS:
            continue
        loss = cfgs[name].loss
        needs, w = LOSS_NEEDS[loss], wiring[name]
        if "preferences" in w:
            w["preferences"] = _data_source(w["preferences"], needs.data, stages, f"node {name!r} ({name}.loss={loss})")
        ref = w.get("reference", "").split(".", 1)[0]
        if not ref:
            continue
        if not needs.reference:
            del w["reference"]
            unread[ref] = f"{name}.loss={loss} is reference-free, so {name!r} reads no reference log-probs"
        elif stages[ref] == REFERENCE:
            consumers.setdefault(ref, []).append(name)

    for ref, names in consumers.items():
        wanted = {(wiring[n].get("model"), wiring[n].get("preferences"), cfgs[n].max_length) for n in names}
        if len(wanted) > 1:
            raise ConfigError(f"node {ref!r} is the reference of {', '.join(map(repr, names))}, which differ in model, "
                              f"data or max_length; give each its own {REFERENCE} node")
        ((model, source, length),) = wanted
        if wiring[ref].get("model") != model:
            raise ConfigError(f"node {ref!r} input 'model' is {wiring[ref].get('model')}, but {names[0]!r} trains "
                              f"from {model}: reference log-probs must come from the model being trained")
        if source is not None:
            wiring[ref]["preferences"] = source
        update: dict[str, Any] = {}
        if cfgs[ref].max_length != length:
            if (ref, "max_length") in user_set:
                raise ConfigError(f"--set {user_set[ref, 'max_length']} differs from {names[0]}.max_length={length}: "
                                  f"node {ref!r} must score at its consumer's max_length; add --set "
                                  f"{names[0]}.max_length={cfgs[ref].max_length}, or drop that --set")
            update["max_length"] = length
        kto = next((n for n in names if LOSS_NEEDS[cfgs[n].loss].kl), None)
        if kto is not None and not cfgs[ref].include_kl:
            if (ref, "include_kl") in user_set:
                raise ConfigError(f"--set {user_set[ref, 'include_kl']} contradicts {kto}.loss={cfgs[kto].loss}: node "
                                  f"{ref!r} must score KTO's mismatched pairs (field include_kl); use "
                                  f"--set {ref}.include_kl=true, or drop that --set")
            update["include_kl"] = True
        if update:
            cfgs[ref] = cfgs[ref].model_copy(update=update)

    read = {src.split(".", 1)[0] for w in wiring.values() for src in w.values()}
    dropped = {ref: why for ref, why in unread.items() if ref not in read and stages[ref] == REFERENCE}
    for ref in dropped:
        del wiring[ref], cfgs[ref]
    return dropped


def load_plan(recipe: str = DEFAULT_RECIPE, profile: str = "cpu", overrides: list[str] | tuple[str, ...] = (),
              run_checks: bool = True) -> Plan:
    raw, recipe_path = _load_yaml(recipe, RECIPE_DIR, "recipe")
    raw_profile, _ = _load_yaml(profile, PROFILE_DIR, "profile")
    try:
        prof = ProfileConfig.model_validate(raw_profile)
    except ValidationError as e:
        raise ConfigError(f"profile {profile}: {pydantic_message(e, '', ProfileConfig)}") from None
    parsed = [(*parse_override(text), text) for text in overrides]
    recipe_name = str(raw.get("name", recipe))
    overlay = prof.recipes.get(recipe_name)
    options = _options(raw, recipe_name, overlay, parsed)
    if options and isinstance(raw.get("nodes"), dict):
        raw = {**raw, "options": options, "nodes": _substitute(raw["nodes"], options)}
    try:
        rec = RecipeConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"recipe {recipe_path}: {pydantic_message(e, '', RecipeConfig)}") from None

    enabled = {name for name, n in rec.nodes.items() if n.when}
    model, seed = prof.model or rec.model, rec.seed
    node_cfgs = {name: dict(n.config) for name, n in rec.nodes.items() if name in enabled}
    node_seeds = {name: n.seed for name, n in rec.nodes.items()}
    for name, n in rec.nodes.items():
        if n.stage not in STAGE_MODULES:
            raise ConfigError(f"recipe {rec.name!r} node {name!r}: unknown stage {n.stage!r}; known: {', '.join(STAGE_MODULES)}")
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
            else:
                _set_path(node_cfgs[path[0]], path[1:], value)
        elif path[0] in rec.nodes:
            raise ConfigError(f"--set {text!r}: node {path[0]!r} is disabled in this run (its `when` is false; "
                              f"see the recipe's options: {', '.join(f'{k}={v}' for k, v in rec.options.items())})")
        else:
            extra = " or options.NAME=" if rec.options else ""
            raise ConfigError(f"--set {text!r}: unknown stage node {path[0]!r} in recipe {rec.name!r}; "
                              f"nodes: {', '.join(rec.nodes)} (or model=, seed={extra})")

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

    resources = {name: node_resources(name, rec.nodes[name].stage, rec.nodes[name].resources, prof, node_cfgs)
                 for name in wiring}
    cfgs = {}
    for name in wiring:
        try:
            cfgs[name] = STAGE_CONFIGS[rec.nodes[name].stage].model_validate(_substitute(node_cfgs[name], {"model": model}))
        except ValidationError as e:
            raise ConfigError(pydantic_message(e, name, STAGE_CONFIGS[rec.nodes[name].stage])) from None
    user_set = {(path[0], path[1]): text for path, _, text in parsed if len(path) == 2}
    dropped = wire_preference_losses({n: rec.nodes[n].stage for n in wiring}, cfgs, wiring, user_set)

    nodes = []
    for name in _topological({n: [src.split(".", 1)[0] for src in w.values()] for n, w in wiring.items()}):
        spec = rec.nodes[name]
        module = get_stage(spec.stage)
        cfg = cfgs[name]
        declared = module.INPUTS
        given = set(spec.inputs)
        if given - set(declared):
            raise ConfigError(f"node {name!r}: stage {spec.stage!r} has no input(s) {sorted(given - set(declared))}; "
                              f"its inputs: {', '.join(declared) or 'none'}")
        if _required(declared) - given:
            raise ConfigError(f"node {name!r}: missing input(s) {sorted(_required(declared) - given)} of stage {spec.stage!r}")
        inputs = {}
        for inp, src in wiring[name].items():
            up, out = src.split(".", 1)
            up_outputs = get_stage(rec.nodes[up].stage).OUTPUTS
            if out not in up_outputs:
                raise ConfigError(f"node {name!r} input {inp!r}: node {up!r} has no output {out!r}; "
                                  f"its outputs: {', '.join(up_outputs)}")
            if not input_kinds(up_outputs[out]) & input_kinds(declared[inp]):
                raise ConfigError(f"node {name!r} input {inp!r}: expects {declared[inp]}, but {src} is {up_outputs[out]}")
            inputs[inp] = (up, out)
        if run_checks:
            check_node(module, cfg, name)
        nodes.append(Node(name, spec.stage, cfg, inputs, node_seeds[name] if node_seeds[name] is not None else seed,
                          resources[name]))
    return Plan(rec.name, prof.name, rec.description, model, seed, nodes, tuple(overrides), dict(rec.options), dropped)


def node_resources(name: str, stage: str, declared: dict[str, Any], prof: ProfileConfig,
                   node_cfgs: dict[str, dict]) -> NodeResources:
    """A node's NodeResources: defaults < the recipe node's `resources` < the profile's for its stage type < the
    profile's for its name. A training topology given here (nodes, processes_per_node) is written into the node's
    config (`resources.nodes`, `resources.num_processes`), where it is part of the cache key."""
    merged = deep_merge(deep_merge(declared, prof.resources.get(stage, {})), prof.resources.get(name, {}))
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
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
