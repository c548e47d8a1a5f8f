"""Environments by name, and users' environments from a Python file.

A user file defines `environment(reward, **options)` returning an object with the `Environment` protocol's
`name`, `stop`, `start` and `score` (`stages.environments.base`). A config names it by path (anything
ending in `.py`; a relative path is read from the working directory of the process that runs the stage), as it
would name a built-in; the file's bytes belong in the stage's cache salt (`environment_source_digest`), so
editing it re-runs the nodes that use it.

The hook, as `environment_from_spec` calls it: `environment(reward=<the stage's reward: settings, a RewardSpec>,
**<environment.options>)`; a file whose `environment` takes no `reward` is refused (one ConfigError), so a
stage's `reward:` (weights, strict_answer, overlong, ...) never silently misses the file; eval, which has no
`reward:`, passes `RewardSpec()`. What scores a trajectory is the object's `score(row, completion, num_tokens,
rm_score) -> Verdict` (`stages.rewards.verifiers`): `completion` is the model's own text (its turns, not the
observations), `num_tokens` every token after the prompt, `rm_score` the reward model's score where the stage
has one; `Verdict.reward` is what RL trains on (None: unscorable, 0), `correct` / `correct_lenient` what
accuracy and rejection sampling read, `format_ok` the format rate, `components` the logged `reward/<name>`.
`verifiers.score(row, completion, reward, num_tokens=num_tokens, rm_score=rm_score)` scores as every built-in
does, with the config's weights. r1flow bounds a trajectory's tokens only (`max_total_tokens`, else `max_turns`
x the per-turn `max_new_tokens`); the rest is the file's: when a trajectory ends (`step` returns None), and
what a tool call may do and for how long (a step runs in the stage's process, unsandboxed and without a deadline:
run model-written code through `stages.rewards.sandbox.run_program` with `SandboxLimits`, as `python` does).
`max_turns`, `timeout_s`, `max_output_chars` and `syntax` are the python environment's, not passed to a file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
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
                          f"or the path of a Python file defining {USER_FACTORY}(reward, **options)") from None
    return factory(**options)


def load_environment_file(path: str | Path, reward: RewardSpec | None = None, **options) -> Environment:
    """`environment(reward=reward, **options)` of the Python file at `path` (without `reward` when None), checked to
    take `reward` and to return the protocol's members."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"environment file {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"r1flow_user_environment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factory = getattr(module, USER_FACTORY, None)
    if not callable(factory):
        raise ConfigError(f"environment file {path}: defines no function {USER_FACTORY}(reward, **options)")
    if reward is not None:
        if not takes_keyword(factory, "reward"):
            raise ConfigError(f"environment file {path}: {USER_FACTORY}() takes no `reward`, the stage's reward: "
                              f"settings (a RewardSpec) it must score with; define {USER_FACTORY}(reward, **options) "
                              f"and score with it, e.g. verifiers.score(row, completion, reward, num_tokens=...)")
        options["reward"] = reward
    env = factory(**options)
    missing = [m for m in ("name", "stop", "start", "score") if not hasattr(env, m)]
    if missing:
        raise ConfigError(f"environment file {path}: {USER_FACTORY}() returned {type(env).__name__}, "
                          f"which lacks {', '.join(missing)}")
    return env


def takes_keyword(function: Callable, name: str) -> bool:
    """Whether `function` can be called with the keyword argument `name` (a parameter of that name, or **kwargs).

    >>> takes_keyword(lambda reward, **options: None, "reward"), takes_keyword(lambda **o: None, "reward")
    (True, True)
    >>> takes_keyword(lambda times=1: None, "reward")
    False
    """
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call tell
        return True
    return any((p.name == name and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params)


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


def check_sampling_environment(stage: str, spec: EnvironmentSpec, reward: RewardSpec | None, backend: str,
                               vllm_turns: bool = False) -> None:
    """Before any compute, for a stage that samples with `spec`: the environment loads (`environment_from_spec`), and
    a multi-turn one is not given to vLLM unless the stage runs its turns on the engine (`vllm_turns`:
    `VLLMBackend.trajectories`)."""
    environment_from_spec(spec, reward)
    if not spec.is_single_turn and backend == "vllm" and not vllm_turns:
        raise ConfigError(f"{stage}.generation.backend: vllm samples one turn per prompt; environment {spec.name!r} "
                          f"needs the transformers backend (r1flow's multi-turn decode loop)")


def environment_from_spec(spec: EnvironmentSpec, reward: RewardSpec | None = None) -> Environment:
    """The environment a stage's `environment:` names, scoring with the stage's `reward` (default `RewardSpec()`), which
    every environment is given as `reward`: built-ins also get the spec's fields (python: max_turns, timeout_s,
    max_output_chars, syntax, and the reward's sandbox limits), and `options`; a user file gets `options` (the module's
    docstring). Any failure to make it (unknown name, missing or broken file, a file that takes no `reward`, bad
    values) is one ConfigError naming it."""
    reward = reward if reward is not None else RewardSpec()
    if "reward" in spec.options:
        raise ConfigError(f"environment {spec.name!r}: options.reward: the environment is given the stage's reward: "
                          f"settings as `reward`; set them there")
    known = {"single_turn": {}, "python": {"max_turns": spec.max_turns, "timeout_s": spec.timeout_s,
                                           "max_output_chars": spec.max_output_chars, "syntax": spec.syntax,
                                           "limits": reward.sandbox}}
    try:
        return get_environment(spec.name, reward=reward, **{**known.get(spec.name, {}), **spec.options})
    except ConfigError:
        raise
    except Exception as e:  # a user file that does not import, or options the environment refuses
        raise ConfigError(f"environment {spec.name!r}: {type(e).__name__}: {e}") from e
