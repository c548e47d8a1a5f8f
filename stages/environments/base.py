"""The environment protocol: a trajectory alternates model turns and observations.

    episode = env.start(row)
    turn 1 (sampled) -> episode.step(turn) -> Observation (appended as tokens) | None (the end)
    turn 2 (sampled) -> ...
    env.score(row, completion, num_tokens) -> Verdict

The sampler owns the tokens: an observation is text, tokenized once and appended after the turn's
tokens; nothing earlier is re-tokenized (`stages.sampling.multiturn`). An episode holds one
trajectory's state (turns taken, tool calls); `score` is stateless so a trajectory can be scored
from its row and text alone. `completion` is the model's own text (its turns, without the
observations): text a program printed earns nothing until the model writes it itself.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from schemas.errors import EnvironmentCodeError, R1FlowError
from stages.rewards.verifiers import Verdict

T = TypeVar("T")
log = logging.getLogger(__name__)

TurnEnd = Literal["eos", "stop", "length"]  # an EOS token, a stop string, the turn's or trajectory's token budget


@dataclass(frozen=True)
class Turn:
    """One model turn as sampled: its decoded text, its token ids, how it ended, and its index (0 first)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: TurnEnd
    index: int


@dataclass(frozen=True)
class Observation:
    """What the environment answers a turn with: `text` to append (tokenized once, never trained on),
    whether the turn was a tool call and whether that call failed (an exception, a timeout, the memory
    limit, an output flood: the program's fault, reported to the model, never raised)."""

    text: str
    tool_call: bool = False
    tool_error: bool = False


class Episode(Protocol):
    def step(self, turn: Turn) -> Observation | None:
        """The observation that follows `turn`, or None when the trajectory ends with it."""
        ...


class Environment(Protocol):
    name: str
    stop: tuple[str, ...]  # strings that end a model turn (besides EOS), e.g. a tool call's closing tag
    # optional: `step_workers: int`, how many episodes' steps the sampler may run at once in threads (default 1;
    # the python environment's steps are sandbox runs, which mostly wait on a subprocess).
    # optional: `uses_chat_template: bool` with `with_tool_turn((before, after)) -> Environment`: observations
    # written as the model's chat template writes a tool message; the sampler passes the template's text around
    # the message's content (`sampling.multiturn.chat_tool_turn`) before it samples; `tools: list[dict] | None`,
    # JSON schemas rendered into the prompt by templates that describe tools.

    def start(self, row: Mapping[str, Any]) -> Episode:
        """A new trajectory for a `prompts` row."""
        ...

    def score(self, row: Mapping[str, Any], completion: str, num_tokens: int | None = None,
              rm_score: float | None = None) -> Verdict:
        """The finished trajectory's verdict: `completion` is the model's text (prefill and turns, no
        observations), `num_tokens` the trajectory's tokens after the prompt."""
        ...


def call_environment(env_name: str, method: str, call: Callable[[], T]) -> T:
    """`call()` (an environment's `method`), with an exception from the environment's code turned into one
    EnvironmentCodeError that names the environment, the method and the line that raised. The exception's own
    traceback, the environment's frames only, is logged here, once (a traceback shown with the error would repeat
    r1flow's and Prefect's frames): the run's one error line is the EnvironmentCodeError's message. r1flow's own
    errors pass unchanged."""
    try:
        return call()
    except R1FlowError:
        raise
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]  # [0] is this function's call()
        where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        log.error("environment %r: %s() raised; its traceback:\n%s", env_name, method,
                  "".join(traceback.format_list(frames) + traceback.format_exception_only(e)).rstrip())
        raise EnvironmentCodeError(f"environment {env_name!r}: {method}() raised {type(e).__name__}: {e}{where}") from None
