"""`python`: the model runs code in the sandbox between its turns (tool-integrated reasoning).

Syntax (r1flow's tags; a chat template's tool role is not used yet):

    model:        ... <python>
                  print(1234 * 5678)
                  </python>
    observation:  <output>
                  7006652
                  </output>
    model:        ... <answer>7006652</answer>

A turn ends at `</python>` (the environment's stop string), EOS, or its token budget. A turn whose
text closes a `<python>` block runs the last such block as a program in `stages.rewards.sandbox`
(the existing limits, `SandboxLimits`, with `timeout_s` as each call's wall-clock deadline and at
most that many CPU seconds); its stdout, then its stderr, cut to `max_output_chars`, is the next
observation. A failing program (exception, timeout, memory, output flood) is a tool error: the
observation says what happened and the trajectory goes on. A sandbox that cannot start
(`SandboxSetupError`) is a fault of the host and is raised. The trajectory ends at a turn without a
closed block, or after `max_turns` turns (that turn's code is not run).

The program gets its code and an empty stdin, nothing of the row: not the answer, not the
metadata. Where the sandbox isolates with namespaces, no host file (stored prompts included) is in
its file tree either (`stages.rewards.sandbox`).

Scoring is the row's verifier on the model's own text (`SingleTurn`'s scoring): output the program
printed counts only once the model writes it in its answer.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.configs import RewardSpec, SandboxLimits
from stages.environments.base import Observation, Turn
from stages.rewards.sandbox import SandboxResult, run_program
from stages.rewards.verifiers import Verdict, score

CALL_OPEN, CALL_CLOSE = "<python>", "</python>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# An observation as `observation_text` writes it, right after the turn that closed a block (a turn's last token
# may carry whitespace past the stop string)
_OBSERVATION = re.compile(re.escape(CALL_CLOSE) + r"\s*?(" + re.escape(OUTPUT_OPEN) + r"\n.*?\n"
                          + re.escape(OUTPUT_CLOSE) + r"\n)", re.DOTALL)
TRUNCATED = "\n[... {} more characters]"
_FAILURES = {"timeout": "timed out after {:g} s", "memory": "ran out of memory",
             "output_limit": "printed more than the sandbox keeps", "killed": "was killed"}


def last_program(text: str) -> str | None:
    """The code of the last closed `<python>…</python>` block in `text`, dedented; None if there is none
    or it is blank.

    >>> last_program("x <python>print(1)</python> y <python>\\n  print(2)\\n</python>")
    'print(2)'
    """
    blocks = _BLOCK.findall(text)
    if not blocks:
        return None
    code = textwrap.dedent(blocks[-1]).strip("\n")
    return code if code.strip() else None


def observation_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every observation in a transcript: `<output>\\n…\\n</output>\\n` right after a `</python>`
    (text the model wrote elsewhere, `<output>` included, is not one).

    >>> observation_spans("a<python>1</python><output>\\n1\\n</output>\\nb <output>\\nx\\n</output>\\n")
    [(19, 40)]
    """
    return [m.span(1) for m in _OBSERVATION.finditer(text)]


def cap_output(text: str, max_chars: int) -> str:
    """`text` cut to its first `max_chars` characters, saying how many were left out.

    >>> cap_output("abcdef", 4)
    'abcd\\n[... 2 more characters]'
    """
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATED.format(len(text) - max_chars)


def observation_text(result: SandboxResult, max_chars: int, timeout_s: float) -> str:
    """The observation of one run: stdout then stderr, capped, then what went wrong (when it did), tagged."""
    body = cap_output((result.stdout + result.stderr).rstrip("\n"), max_chars)
    note = None
    if result.status in _FAILURES:
        note = "[program " + _FAILURES[result.status].format(timeout_s) + "]"
    elif result.status == "error" and not result.stderr:
        note = f"[program exited with status {result.returncode}]"
    if note is not None:
        body = f"{body}\n{note}" if body else note
    return f"{OUTPUT_OPEN}\n{body}\n{OUTPUT_CLOSE}\n"


@dataclass
class _PythonEpisode:
    env: PythonTool
    turns: int = 0

    def step(self, turn: Turn) -> Observation | None:
        self.turns += 1
        code = last_program(turn.text) if turn.finish_reason == "stop" else None
        if code is None or self.turns >= self.env.max_turns:
            return None
        result = run_program(code, "", self.env.call_limits())
        return Observation(observation_text(result, self.env.max_output_chars, self.env.timeout_s),
                           tool_call=True, tool_error=result.status != "ok")


@dataclass(frozen=True)
class PythonTool:
    """max_turns: model turns per trajectory (so at most max_turns - 1 programs run); timeout_s: each
    program's wall-clock deadline; max_output_chars: the observation's cap; step_workers: programs run at
    once (one per trajectory, in threads, each in its own sandbox)."""

    reward: RewardSpec = field(default_factory=RewardSpec)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_turns: int = 4
    timeout_s: float = 5.0
    max_output_chars: int = 512
    step_workers: int = 8
    name: str = "python"
    stop: tuple[str, ...] = (CALL_CLOSE,)

    def __post_init__(self):
        if self.max_turns < 1 or self.timeout_s <= 0 or self.max_output_chars < 1 or self.step_workers < 1:
            raise ValueError(f"python environment: max_turns >= 1, timeout_s > 0, max_output_chars >= 1 and "
                             f"step_workers >= 1, got {self.max_turns}, {self.timeout_s}, {self.max_output_chars}, "
                             f"{self.step_workers}")

    def call_limits(self) -> SandboxLimits:
        """The sandbox limits of one call: `limits` with the deadline as wall clock and CPU-time bound."""
        cpu = max(1, min(self.limits.cpu_time_s, math.ceil(self.timeout_s)))
        return self.limits.model_copy(update={"wall_timeout_s": self.timeout_s, "cpu_time_s": cpu})

    def start(self, row: Mapping[str, Any]) -> _PythonEpisode:
        return _PythonEpisode(self)

    def score(self, row: Mapping[str, Any], completion: str, num_tokens: int | None = None,
              rm_score: float | None = None) -> Verdict:
        return score(row, completion, self.reward, num_tokens=num_tokens, rm_score=rm_score)
