"""Recipes and profiles: load YAML, overlay profile and `--set` overrides, validate, order the DAG.

Everything here runs before any compute, so a bad recipe, key or value fails in one clear line.
Config precedence (later wins): stage defaults < recipe node config < profile `stages.<type>` <
profile `nodes.<name>` < `--set`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from schemas.configs import STAGE_CONFIGS, ProfileConfig, RecipeConfig
from schemas.errors import ConfigError
from stages import STAGE_MODULES, get_stage

RECIPE_DIR = Path(__file__).parent / "recipes"
PROFILE_DIR = Path(__file__).parent / "profiles"
# The default recipe: `r1` once its stages exist; until then the longest recipe that exists.
DEFAULT_RECIPE = "sft-eval"


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


def pydantic_message(e: ValidationError, prefix: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
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


def _substitute(obj: Any, variables: dict[str, str]) -> Any:
    if isinstance(obj, str):
        for k, v in variables.items():
            obj = obj.replace("${" + k + "}", str(v))
        return obj
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

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
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


def _kinds(spec: str) -> set[str]:
    return set(spec.rstrip("?").split("|"))


def _required(declared: dict[str, str]) -> set[str]:
    """Input names a node must wire; a kind ending in '?' marks an optional input."""
    return {name for name, kind in declared.items() if not kind.endswith("?")}


def _topological(nodes: dict[str, dict]) -> list[str]:
    order, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"recipe has a cycle: {' -> '.join(trail + [name])}")
        state[name] = "visiting"
        for src in nodes[name].get("inputs", {}).values():
            visit(src.split(".", 1)[0], trail + [name])
        state[name] = "done"
        order.append(name)

    for name in nodes:  # recipe order breaks ties, so plans are stable
        visit(name, [])
    return order


def load_plan(recipe: str = DEFAULT_RECIPE, profile: str = "cpu", overrides: list[str] | tuple[str, ...] = (),
              run_checks: bool = True) -> Plan:
    raw, recipe_path = _load_yaml(recipe, RECIPE_DIR, "recipe")
    raw_profile, _ = _load_yaml(profile, PROFILE_DIR, "profile")
    try:
        rec = RecipeConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"recipe {recipe_path}: {pydantic_message(e, '')}") from None
    try:
        prof = ProfileConfig.model_validate(raw_profile)
    except ValidationError as e:
        raise ConfigError(f"profile {profile}: {pydantic_message(e, '')}") from None

    model, seed = prof.model or rec.model, rec.seed
    node_cfgs = {name: dict(n.config) for name, n in rec.nodes.items()}
    node_seeds = {name: n.seed for name, n in rec.nodes.items()}
    for name, n in rec.nodes.items():
        if n.stage not in STAGE_MODULES:
            raise ConfigError(f"recipe {rec.name!r} node {name!r}: unknown stage {n.stage!r}; known: {', '.join(STAGE_MODULES)}")
        node_cfgs[name] = deep_merge(node_cfgs[name], prof.stages.get(n.stage, {}))
    for name, overlay in prof.nodes.items():
        if name in node_cfgs:  # a profile may size nodes that only some recipes have
            node_cfgs[name] = deep_merge(node_cfgs[name], overlay)
    for stage_type in prof.stages:
        if stage_type not in STAGE_MODULES:
            raise ConfigError(f"profile {prof.name!r}: unknown stage type {stage_type!r}")

    for text in overrides:
        path, value = parse_override(text)
        if path == ["model"]:
            model = str(value)
        elif path == ["seed"]:
            if not isinstance(value, int):
                raise ConfigError(f"--set seed: expected an integer, got {value!r}")
            seed = value
        elif path[0] in node_cfgs:
            if len(path) == 2 and path[1] == "seed":
                node_seeds[path[0]] = int(value)
            elif len(path) < 2:
                raise ConfigError(f"--set {text!r}: name a config key, e.g. {path[0]}.<key>=VALUE")
            else:
                _set_path(node_cfgs[path[0]], path[1:], value)
        else:
            raise ConfigError(f"--set {text!r}: unknown stage node {path[0]!r} in recipe {rec.name!r}; "
                              f"nodes: {', '.join(rec.nodes)} (or model=, seed=)")

    nodes = []
    for name in _topological({k: v.model_dump() for k, v in rec.nodes.items()}):
        spec = rec.nodes[name]
        module = get_stage(spec.stage)
        cfg_dict = _substitute(node_cfgs[name], {"model": model})
        try:
            cfg = STAGE_CONFIGS[spec.stage].model_validate(cfg_dict)
        except ValidationError as e:
            raise ConfigError(pydantic_message(e, name)) from None
        declared = module.INPUTS
        given = set(spec.inputs)
        if given - set(declared):
            raise ConfigError(f"node {name!r}: stage {spec.stage!r} has no input(s) {sorted(given - set(declared))}; "
                              f"its inputs: {', '.join(declared) or 'none'}")
        if _required(declared) - given:
            raise ConfigError(f"node {name!r}: missing input(s) {sorted(_required(declared) - given)} of stage {spec.stage!r}")
        inputs = {}
        for inp, src in spec.inputs.items():
            up, out = src.split(".", 1)
            up_outputs = get_stage(rec.nodes[up].stage).OUTPUTS
            if out not in up_outputs:
                raise ConfigError(f"node {name!r} input {inp!r}: node {up!r} has no output {out!r}; "
                                  f"its outputs: {', '.join(up_outputs)}")
            if not _kinds(up_outputs[out]) & _kinds(declared[inp]):
                raise ConfigError(f"node {name!r} input {inp!r}: expects {declared[inp]}, but {src} is {up_outputs[out]}")
            inputs[inp] = (up, out)
        if run_checks and hasattr(module, "check"):
            module.check(cfg)
        nodes.append(Node(name, spec.stage, cfg, inputs, node_seeds[name] if node_seeds[name] is not None else seed))
    return Plan(rec.name, prof.name, rec.description, model, seed, nodes, tuple(overrides))
