"""`python`: the model runs code in the sandbox between its turns (tool-integrated reasoning).

Two syntaxes. `tags` (the default, r1flow's own, what `tool_demos` writes):

    model:        ... <python>
                  print(1234 * 5678)
                  </python>
    observation:  <output>
                  7006652
                  </output>
    model:        ... <answer>7006652</answer>

A turn ends at `</python>` (the environment's stop string), EOS, or its token budget; a turn whose text
closes a `<python>` block runs the last such block.

`chat_template` (the model's own tool role, for a model already taught its template's tool calls): the
model ends its turn as any assistant turn ends (its end-of-turn token); a turn whose text holds a
`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>` (the Hermes/Qwen form) or a
fenced python block (```python ... ```) runs the last of them; the observation is the template's tool
message with the output as its content, then the next assistant header: exactly the text the template
renders for [..., assistant turn, tool message] with the generation prompt, after the end-of-turn token
the model sampled (`chat_tool_turn` in the sampler derives the two pieces around the content once per
tokenizer, and refuses a template that renders no tool message). The prompt gets the tool's JSON schema
(`tools`), which templates with tool support put in their system prompt and others ignore. A malformed
call (not JSON, another tool's name, no code) is a tool error, answered, not raised.

Either way the program's stdout, then its stderr, cut to `max_output_chars`, is the next observation,
run in `stages.rewards.sandbox` (the existing limits, `SandboxLimits`, with `timeout_s` as each call's
wall-clock deadline and at most that many CPU seconds). A failing program (exception, timeout, memory,
output flood) is a tool error: the observation says what happened and the trajectory goes on. A sandbox
that cannot start (`SandboxSetupError`) is a fault of the host and is raised. The trajectory ends at a
turn without a call, or after `max_turns` turns (that turn's code is not run).

The program gets its code and an empty stdin, nothing of the row: not the answer, not the
metadata. Where the sandbox isolates with namespaces, no host file (stored prompts included) is in
its file tree either (`stages.rewards.sandbox`).

Scoring is the row's verifier on the model's own text (`SingleTurn`'s scoring): output the program
printed counts only once the model writes it in its answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

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
# chat_template syntax: a Hermes/Qwen tool call, or a fenced python block
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
TOOL_NAME = "python"
# the tool's JSON schema as chat templates take it (`apply_chat_template(tools=...)`)
TOOL_SCHEMA = {"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Runs a Python program in a sandbox (no network, no files) and returns what it prints: stdout, "
                   "then stderr.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                   "required": ["code"]}}}
Syntax = Literal["tags", "chat_template"]
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


def template_call(text: str) -> tuple[str | None, str | None]:
    """(code, None) of the last tool call in a chat_template-syntax turn (a `<tool_call>` JSON naming `python`, or a
    fenced python block, whichever comes last), (None, what is wrong) for a malformed call, (None, None) for a
    turn without one.

    >>> template_call('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    ('print(1)', None)
    >>> template_call("x ```python\nprint(2)\n``` y")
    ('print(2)', None)
    >>> template_call('<tool_call>{"name": "search"}</tool_call>')
    (None, "unknown tool 'search'; the tool is python")
    >>> template_call("no call")
    (None, None)
    """
    calls = [(m.start(), "json", m.group(1)) for m in _TOOL_CALL.finditer(text)]
    calls += [(m.start(), "fence", m.group(1)) for m in _FENCE.finditer(text)]
    if not calls:
        return None, None
    _, kind, body = max(calls)
    if kind == "fence":
        code = textwrap.dedent(body).strip("\n")
    else:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
        name = call.get("name") if isinstance(call, dict) else None
        if name != TOOL_NAME:
            return None, f"unknown tool {name!r}; the tool is {TOOL_NAME}"
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str):
            return None, 'the tool call has no "code" argument (a string)'
    return (code, None) if code.strip() else (None, "the tool call has no code")


# the bootstrap's frames at the top of a traceback: its `exec`, and its `compile` when the program does not parse
_BOOT_FRAMES = re.compile(r'Traceback \(most recent call last\):\n  File "<string>", line \d+, in <module>\n'
                          r'(  File "<string>", line \d+, in _boot\n)?')
_PROGRAM_PATH = re.compile(r'File "[^"\n]*/r1flow-sandbox-[^/"\n]*/prog\.py"')


def model_traceback(stderr: str) -> str:
    """A program's stderr as `python prog.py` would print it: the sandbox's bootstrap frames (the outermost
    `File "<string>"` of a traceback, which exec's the program, and its compile when the program does not parse,
    whose error then has no traceback header, as Python prints a script's SyntaxError) dropped, and the run
    directory's path cut from the program's file name: the model sees `File "prog.py", line 2` and nothing of the
    host. The program's own exec'd strings keep their `<string>` frames (they are never first).
    """
    def strip(m: re.Match) -> str:
        return "" if m.group(1) else "Traceback (most recent call last):\n"

    return _PROGRAM_PATH.sub('File "prog.py"', _BOOT_FRAMES.sub(strip, stderr))


def observation_body(result: SandboxResult, max_chars: int, timeout_s: float) -> str:
    """What one run shows the model: stdout then stderr (`model_traceback`), capped, then what went wrong (when it
    did)."""
    body = cap_output((result.stdout + model_traceback(result.stderr)).rstrip("\n"), max_chars)
    note = None
    if result.status in _FAILURES:
        note = "[program " + _FAILURES[result.status].format(timeout_s) + "]"
    elif result.status == "error" and not result.stderr:
        note = f"[program exited with status {result.returncode}]"
    if note is not None:
        body = f"{body}\n{note}" if body else note
    return body


def observation_text(result: SandboxResult, max_chars: int, timeout_s: float) -> str:
    """The tags syntax's observation of one run: `observation_body` in output tags."""
    return _tagged(observation_body(result, max_chars, timeout_s))


def _tagged(body: str) -> str:
    return f"{OUTPUT_OPEN}\n{body}\n{OUTPUT_CLOSE}\n"


@dataclass
class _PythonEpisode:
    env: PythonTool
    turns: int = 0

    def step(self, turn: Turn) -> Observation | None:
        self.turns += 1
        if self.env.syntax == "tags":
            code, problem = (last_program(turn.text) if turn.finish_reason == "stop" else None), None
        else:  # a call ends the model's turn as any turn ends: its end-of-turn token
            code, problem = template_call(turn.text) if turn.finish_reason == "eos" else (None, None)
        if (code is None and problem is None) or self.turns >= self.env.max_turns:
            return None
        if problem is not None:
            return Observation(self.env.wrap(f"[{problem}]"), tool_call=True, tool_error=True)
        result = run_program(code, "", self.env.call_limits())
        return Observation(self.env.wrap(observation_body(result, self.env.max_output_chars, self.env.timeout_s)),
                           tool_call=True, tool_error=result.status != "ok")


@dataclass(frozen=True)
class PythonTool:
    """max_turns: model turns per trajectory (so at most max_turns - 1 programs run); timeout_s: each
    program's wall-clock deadline; max_output_chars: the observation's cap; step_workers: programs run at
    once (one per trajectory, in threads, each in its own sandbox); syntax: `tags` or `chat_template`
    (the module's docstring). With `chat_template` the sampler calls `with_tool_turn` with the model's
    template's text before and after a tool message's content (`tool_turn`) before it samples."""

    reward: RewardSpec = field(default_factory=RewardSpec)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_turns: int = 4
    timeout_s: float = 5.0
    max_output_chars: int = 512
    step_workers: int = 8
    syntax: Syntax = "tags"
    tool_turn: tuple[str, str] | None = None
    name: str = "python"

    def __post_init__(self):
        if self.max_turns < 1 or self.timeout_s <= 0 or self.max_output_chars < 1 or self.step_workers < 1:
            raise ValueError(f"python environment: max_turns >= 1, timeout_s > 0, max_output_chars >= 1 and "
                             f"step_workers >= 1, got {self.max_turns}, {self.timeout_s}, {self.max_output_chars}, "
                             f"{self.step_workers}")
        if self.syntax not in ("tags", "chat_template"):
            raise ValueError(f"python environment: syntax is tags or chat_template, got {self.syntax!r}")

    @property
    def stop(self) -> tuple[str, ...]:
        """Strings that end a turn besides EOS: the call's closing tag (tags); none (chat_template)."""
        return (CALL_CLOSE,) if self.syntax == "tags" else ()

    @property
    def uses_chat_template(self) -> bool:
        return self.syntax == "chat_template"

    @property
    def tools(self) -> list[dict] | None:
        """The tool schemas for the prompt's chat template (chat_template syntax), else None."""
        return [TOOL_SCHEMA] if self.syntax == "chat_template" else None

    def with_tool_turn(self, tool_turn: tuple[str, str]) -> PythonTool:
        return dataclasses.replace(self, tool_turn=tool_turn)

    def wrap(self, body: str) -> str:
        """An observation's text around `body`: output tags, or the template's tool message."""
        if self.syntax == "tags":
            return _tagged(body)
        if self.tool_turn is None:
            raise RuntimeError("python environment (chat_template syntax): the sampler did not give it the "
                               "template's tool turn (with_tool_turn)")
        before, after = self.tool_turn
        return before + body + after

    def call_limits(self) -> SandboxLimits:
        """The sandbox limits of one call: `limits` with the deadline as wall clock and CPU-time bound."""
        cpu = max(1, min(self.limits.cpu_time_s, math.ceil(self.timeout_s)))
        return self.limits.model_copy(update={"wall_timeout_s": self.timeout_s, "cpu_time_s": cpu})

    def start(self, row: Mapping[str, Any]) -> _PythonEpisode:
        if self.syntax == "chat_template" and self.tool_turn is None:
            self.wrap("")  # raises: the sampler must bind the template first
        return _PythonEpisode(self)

    def score(self, row: Mapping[str, Any], completion: str, num_tokens: int | None = None,
              rm_score: float | None = None) -> Verdict:
        return score(row, completion, self.reward, num_tokens=num_tokens, rm_score=rm_score)
