"""Environments by name, and users' environments from a Python file.

A user file defines `environment(**options)` returning an object with the `Environment` protocol's
`name`, `stop`, `start` and `score` (`stages.environments.base`). A config names it by path (anything
ending in `.py`), as it would name a built-in; the file's bytes belong in the stage's cache salt
(`environment_source_digest`), so editing it re-runs the nodes that use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from schemas.configs import EnvironmentSpec, RewardSpec
from schemas.errors import ConfigError
from stages.environments.base import Environment
from stages.environments.python_tool import PythonTool
from stages.environments.single_turn import SingleTurn

ENVIRONMENTS: Mapping[str, Callable[..., Environment]] = MappingProxyType({
    "single_turn": SingleTurn,
    "python": PythonTool,
})
USER_FACTORY = "environment"  # the function a user's environment file defines


def is_environment_file(name: str) -> bool:
    return name.endswith(".py")


def get_environment(name: str, **options) -> Environment:
    """The environment `name` (a built-in, or a user file's path ending in `.py`) made with `options`."""
    if is_environment_file(name):
        return load_environment_file(name, **options)
    try:
        factory = ENVIRONMENTS[name]
    except KeyError:
        raise ConfigError(f"unknown environment {name!r}; built in: {', '.join(ENVIRONMENTS)}, "
                          f"or the path of a Python file defining {USER_FACTORY}(**options)") from None
    return factory(**options)


def load_environment_file(path: str | Path, **options) -> Environment:
    """`environment(**options)` of the Python file at `path`, checked to have the protocol's members."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"environment file {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"r1flow_user_environment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factory = getattr(module, USER_FACTORY, None)
    if not callable(factory):
        raise ConfigError(f"environment file {path}: defines no function {USER_FACTORY}(**options)")
    env = factory(**options)
    missing = [m for m in ("name", "stop", "start", "score") if not hasattr(env, m)]
    if missing:
        raise ConfigError(f"environment file {path}: {USER_FACTORY}() returned {type(env).__name__}, "
                          f"which lacks {', '.join(missing)}")
    return env


def environment_source_digest(name: str) -> str | None:
    """sha256 of a user environment file's bytes (for a stage's cache salt); None for a built-in, whose code
    moves with the stage's VERSION."""
    if not is_environment_file(name):
        return None
    return hashlib.sha256(Path(name).read_bytes()).hexdigest()


# A built-in environment's version enters the key of every node that samples with it (`environment_salt`), so a
# change to what it shows the model re-runs those nodes and no others. History: python 2 (2026-11-28): tracebacks
# without the sandbox's bootstrap frames and run directory (`python_tool.model_traceback`); 1: none in the key.
BUILTIN_VERSIONS = {"python": "2"}


def environment_salt(spec: EnvironmentSpec) -> str:
    """A stage's cache salt for its `environment:`: a user file's sha256, so editing it re-runs the node; a versioned
    built-in's `name@version` (`BUILTIN_VERSIONS`); "" for single_turn, which leaves the key as it was without an
    environment."""
    if digest := environment_source_digest(spec.name):
        return digest
    version = BUILTIN_VERSIONS.get(spec.name)
    return f"{spec.name}@{version}" if version else ""


def check_sampling_environment(stage: str, spec: EnvironmentSpec, reward: RewardSpec | None, backend: str) -> None:
    """Before any compute, for a stage that samples with `spec`: the environment loads (`environment_from_spec`), and
    a multi-turn one is not given to vLLM, which samples one turn per prompt."""
    environment_from_spec(spec, reward)
    if not spec.is_single_turn and backend == "vllm":
        raise ConfigError(f"{stage}.generation.backend: vllm samples one turn per prompt; environment {spec.name!r} "
                          f"needs the transformers backend (r1flow's multi-turn decode loop)")


def environment_from_spec(spec: EnvironmentSpec, reward: RewardSpec | None = None) -> Environment:
    """The environment a stage's `environment:` names, scoring with the stage's `reward` (default `RewardSpec()`):
    built-ins get the spec's fields (python: max_turns, timeout_s, max_output_chars, syntax, and the reward's
    sandbox limits) and `options`; a user file gets `options` only. Any failure to make it (unknown name, missing or
    broken file, bad values) is one ConfigError naming it."""
    reward = reward if reward is not None else RewardSpec()
    known = {"single_turn": {}, "python": {"max_turns": spec.max_turns, "timeout_s": spec.timeout_s,
                                           "max_output_chars": spec.max_output_chars, "syntax": spec.syntax,
                                           "limits": reward.sandbox}}
    try:
        if spec.name in known:
            return get_environment(spec.name, reward=reward, **{**known[spec.name], **spec.options})
        return get_environment(spec.name, **spec.options)
    except ConfigError:
        raise
    except Exception as e:  # a user file that does not import, or options the environment refuses
        raise ConfigError(f"environment {spec.name!r}: {type(e).__name__}: {e}") from e
