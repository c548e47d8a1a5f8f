"""Environments (issue 46): the protocol's built-ins, the python tool's sandbox calls, the registry and user files.

The python environment's guarantees are checked on real sandbox runs: a hanging program costs at most its
deadline, a failing one is an observation, output is capped, and the program never sees the row's answer.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from schemas.configs import RewardSpec
from schemas.errors import ConfigError
from stages.environments.base import Observation, Turn
from stages.environments.python_tool import PythonTool, cap_output, last_program, observation_text
from stages.environments.registry import (
    ENVIRONMENTS,
    environment_source_digest,
    get_environment,
    load_environment_file,
)
from stages.environments.single_turn import SingleTurn
from stages.rewards import sandbox
from stages.rewards.verifiers import score
from tests.test_layers import GRAPH

NAMESPACES = sandbox.isolation()["mode"] == "namespaces"
ROW = {"id": "p0", "messages": [{"role": "user", "content": "What is 1234 * 5678?"}], "answer": "7006652",
       "task": "products", "verifier": "exact", "split": "train", "metadata": "{}"}


def _turn(text: str, end: str = "stop", index: int = 0) -> Turn:
    return Turn(text, (), end, index)


def _call(env: PythonTool, code: str) -> Observation | None:
    return env.start(ROW).step(_turn(f"<think>let me compute</think><python>\n{code}\n</python>"))


@pytest.fixture(autouse=True)
def _weak_sandbox_where_it_is_the_mode(monkeypatch):
    if not NAMESPACES:  # as tests/test_sandbox.py: this host's only mode, opted into for the test
        monkeypatch.setenv(sandbox.WEAK_ENV, "1")


def test_environments_sit_beneath_the_sampler_and_import_only_schemas_and_rewards():
    modules = [m for m in GRAPH if m == "stages.environments" or m.startswith("stages.environments.")]
    assert len(modules) >= 5
    wrong = {m: sorted(d for d in GRAPH[m] if not d.startswith(("schemas", "stages.rewards", "stages.environments")))
             for m in modules}
    assert not {m: d for m, d in wrong.items() if d}


def test_single_turn_ends_after_one_turn_and_scores_as_the_sampling_stages_do():
    env = SingleTurn(RewardSpec())
    assert env.stop == () and env.start(ROW).step(_turn("<answer>1</answer>", "eos")) is None
    text = "<think>x</think><answer>7006652</answer>"
    assert env.score(ROW, text, num_tokens=12) == score(ROW, text, RewardSpec(), num_tokens=12)
    assert env.score(ROW, text).correct is True


def test_last_program_takes_the_last_closed_block_and_the_cap_says_what_it_cut():
    assert last_program("a <python>print(1)</python> b <python>\n    print(2)\n</python>\n") == "print(2)"
    assert last_program("<python>print(1)") is None  # not closed: the turn ran out of budget
    assert last_program("<python>\n \n</python>") is None
    assert cap_output("abcdef", 6) == "abcdef"
    assert cap_output("abcdef", 4) == "abcd\n[... 2 more characters]"


def test_a_tool_call_returns_the_programs_output_as_the_observation():
    obs = _call(PythonTool(), "print(1234 * 5678)")
    assert obs == Observation("<output>\n7006652\n</output>\n", tool_call=True, tool_error=False)


def test_an_exception_is_an_observation_with_the_traceback_not_a_crash():
    obs = _call(PythonTool(), "print('before')\nraise ValueError('boom')")
    assert obs.tool_call and obs.tool_error
    assert obs.text.startswith("<output>\nbefore\nTraceback") and "ValueError: boom" in obs.text
    assert obs.text.endswith("</output>\n")
    # the model sees its own frame by file name, not the sandbox's bootstrap frame or the run directory's path
    assert '  File "prog.py", line 2, in <module>\n' in obs.text
    assert "<string>" not in obs.text and "r1flow-sandbox" not in obs.text and "/tmp" not in obs.text


def test_the_model_reads_tracebacks_as_python_prints_a_scripts():
    """The sandbox's bootstrap frames and run directory are cut from what the model reads (`model_traceback`): a
    SyntaxError has no traceback header (Python prints a script's so), and a program's own exec'd string keeps its
    `<string>` frame. Real sandbox runs."""
    from stages.environments.python_tool import model_traceback

    bad = _call(PythonTool(), "x = 1\n</code>").text
    assert bad.startswith('<output>\n  File "prog.py", line 2\n    </code>\n') and "SyntaxError" in bad
    assert "Traceback" not in bad and "_boot" not in bad
    nested = _call(PythonTool(), 'exec("1/0")').text
    assert nested.startswith('<output>\nTraceback (most recent call last):\n  File "prog.py", line 1, in <module>\n')
    assert '  File "<string>", line 1, in <module>\nZeroDivisionError' in nested
    assert model_traceback("no traceback here\n") == "no traceback here\n"


@pytest.mark.parametrize("code", ["import time\ntime.sleep(60)", "while True:\n    pass"])
def test_a_hanging_program_costs_at_most_its_deadline(code):
    env = PythonTool(timeout_s=1.0)
    assert env.call_limits().wall_timeout_s == 1.0 and env.call_limits().cpu_time_s == 1
    t0 = time.perf_counter()
    obs = _call(env, code)
    elapsed = time.perf_counter() - t0
    assert obs.tool_error and "[program timed out after 1 s]" in obs.text
    # the deadline plus a sandbox start (~0.1-0.2 s idle; this machine is shared): never the 60 s the program asked
    assert elapsed < 1.0 + 2.0


def test_the_memory_limit_and_an_output_flood_are_tool_errors():
    obs = _call(PythonTool(), "x = bytearray(10 ** 10)")
    assert obs.tool_error and "MemoryError" in obs.text and "[program ran out of memory]" in obs.text
    flood = _call(PythonTool(max_output_chars=100), "while True:\n    print('y' * 100)")
    assert flood.tool_error and flood.text.startswith("<output>\n" + "y" * 100 + "\n[... ")
    assert flood.text.endswith(" more characters]\n[program printed more than the sandbox keeps]\n</output>\n")


def test_the_observation_is_cut_to_the_output_cap():
    """stdout is 5000 'a' and a newline; the newline is dropped, 100 characters kept: 4900 more."""
    obs = _call(PythonTool(max_output_chars=100), "print('a' * 5000)")
    assert obs.text == "<output>\n" + "a" * 100 + "\n[... 4900 more characters]\n</output>\n"
    assert not obs.tool_error


def test_a_turn_without_a_closed_block_or_past_max_turns_ends_the_trajectory():
    env = PythonTool(max_turns=2)
    episode = env.start(ROW)
    assert episode.step(_turn("<python>print(1)</python>", "stop", 0)).text == "<output>\n1\n</output>\n"
    assert episode.step(_turn("<python>print(2)</python>", "stop", 1)) is None  # the 2nd turn is the last
    assert env.start(ROW).step(_turn("<answer>3</answer>", "eos")) is None
    assert env.start(ROW).step(_turn("<python>print(1)", "length")) is None
    assert env.start(ROW).step(_turn("<python>print(1)</python>", "length")) is None  # only a turn stopped on the tag


def test_observation_text_names_a_silent_failure():
    result = sandbox.SandboxResult("error", 3, "", "", 0.1)
    assert observation_text(result, 50, 5.0) == "<output>\n[program exited with status 3]\n</output>\n"


def test_the_program_cannot_read_the_expected_answer(tmp_path):
    """The answer is in the row and in a prompts file on the host; the program gets neither: not on stdin, argv,
    the environment or /proc, and (namespaces) the file is not in its file tree."""
    secret = "7006652"
    stored = tmp_path / "prompts.jsonl"
    stored.write_text(f'{{"answer": "{secret}"}}\n')
    code = f"""
import os, sys
print(sys.stdin.read(), sys.argv, dict(os.environ))
for p in ("/proc/self/cmdline", "/proc/1/cmdline", "/proc/self/environ"):
    try:
        print(open(p, "rb").read())
    except OSError as e:
        print(p, type(e).__name__)
try:
    print(open({str(stored)!r}).read())
except OSError as e:
    print("stored:", type(e).__name__)
"""
    obs = _call(PythonTool(max_output_chars=20000), code)
    assert not obs.tool_error, obs.text
    if NAMESPACES:
        assert secret not in obs.text and "stored: FileNotFoundError" in obs.text
    else:  # audit-hook mode protects no file: only what the environment hands the program is checked
        assert secret not in obs.text.split("stored:")[0]


def test_the_registry_makes_built_ins_by_name_with_options():
    assert set(ENVIRONMENTS) == {"single_turn", "python"}
    env = get_environment("python", max_turns=3, timeout_s=2.0)
    assert isinstance(env, PythonTool) and env.max_turns == 3 and env.stop == ("</python>",)
    assert isinstance(get_environment("single_turn"), SingleTurn)
    with pytest.raises(ConfigError, match="unknown environment 'shell'.*single_turn, python"):
        get_environment("shell")
    with pytest.raises(ValueError, match="max_turns >= 1"):
        get_environment("python", max_turns=0)
    assert environment_source_digest("python") is None


USER_ENV = '''
from stages.environments.base import Observation
from stages.environments.single_turn import SingleTurn


class Echo(SingleTurn):
    def start(self, row):
        return EchoEpisode(self.times)


class EchoEpisode:
    def __init__(self, times):
        self.left = times

    def step(self, turn):
        self.left -= 1
        return Observation("echo: " + turn.text) if self.left >= 0 else None


def environment(times=1, **options):
    env = Echo(**options)
    object.__setattr__(env, "times", times)
    object.__setattr__(env, "name", "echo")
    return env
'''


def test_a_user_environment_loads_from_a_python_file_and_its_bytes_salt_the_cache(tmp_path):
    path = tmp_path / "echo_env.py"
    path.write_text(USER_ENV)
    env = get_environment(str(path), times=2)
    assert env.name == "echo"
    episode = env.start(ROW)
    assert episode.step(_turn("hi")).text == "echo: hi" and episode.step(_turn("x")) is not None
    assert episode.step(_turn("y")) is None
    assert environment_source_digest(str(path)) == hashlib.sha256(USER_ENV.encode()).hexdigest()
    (tmp_path / "bad.py").write_text("def make():\n    return 1\n")
    with pytest.raises(ConfigError, match="defines no function environment"):
        load_environment_file(tmp_path / "bad.py")
    (tmp_path / "half.py").write_text("def environment():\n    return object()\n")
    with pytest.raises(ConfigError, match="lacks name, stop, start, score"):
        load_environment_file(tmp_path / "half.py")
    with pytest.raises(ConfigError, match="no such file"):
        get_environment(str(tmp_path / "missing.py"))


SCORES_WITH_REWARD = '''
from stages.environments.single_turn import SingleTurn


def environment(reward, bonus=0.0):
    env = SingleTurn(reward)
    object.__setattr__(env, "bonus", bonus)
    return env
'''


def test_a_user_file_is_given_the_stages_reward_and_one_that_cannot_take_it_is_refused(tmp_path, monkeypatch):
    """Issue 59 item 5: `environment_from_spec` calls a user file's environment(reward=<the stage's reward:>,
    **options), so it scores with the config's weights (before: options only, and the file scored with whatever it
    chose, the defaults here); a file whose environment() cannot take `reward`, and `options.reward`, are one
    ConfigError each, before any compute. A relative path is read from the working directory."""
    from schemas.configs import EnvironmentSpec
    from stages.environments.registry import environment_from_spec

    (tmp_path / "scores.py").write_text(SCORES_WITH_REWARD)
    reward = RewardSpec(weights={"format": 1.0}, strict_answer=True)
    env = environment_from_spec(EnvironmentSpec(name=str(tmp_path / "scores.py"), options={"bonus": 2.0}), reward)
    assert (env.reward, env.bonus) == (reward, 2.0)
    well_formed = "<think>4 * 5 is 20</think><answer>7006652</answer>"
    assert env.score(ROW, well_formed).reward == 1.0  # format only, as the config weighs it (defaults: 1.2)
    assert environment_from_spec(EnvironmentSpec(name=str(tmp_path / "scores.py"))).reward == RewardSpec()  # eval

    (tmp_path / "no_reward.py").write_text(USER_ENV.replace("def environment(times=1, **options)",
                                                            "def environment(times=1)").replace("Echo(**options)",
                                                                                                "Echo()"))
    with pytest.raises(ConfigError, match=r"no_reward\.py: environment\(\) takes no `reward`.*"
                                          r"define environment\(reward, \*\*options\)") as e:
        environment_from_spec(EnvironmentSpec(name=str(tmp_path / "no_reward.py")), reward)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"options\.reward: .*given the stage's reward: settings"):
        environment_from_spec(EnvironmentSpec(name=str(tmp_path / "scores.py"), options={"reward": {}}), reward)

    monkeypatch.chdir(tmp_path)
    assert environment_from_spec(EnvironmentSpec(name="scores.py"), reward).reward == reward


def test_a_stage_configs_environment_spec_makes_its_environment(tmp_path):
    from schemas.configs import EnvironmentSpec, SandboxLimits
    from stages.environments.registry import environment_from_spec

    reward = RewardSpec(weights={"accuracy": 1.0}, sandbox=SandboxLimits(memory_mb=256))
    env = environment_from_spec(EnvironmentSpec(name="python", max_turns=3, timeout_s=2.0, max_output_chars=64),
                                reward)
    assert isinstance(env, PythonTool)
    assert (env.max_turns, env.timeout_s, env.max_output_chars, env.reward, env.limits.memory_mb) == \
        (3, 2.0, 64, reward, 256)
    assert environment_from_spec(EnvironmentSpec()) == SingleTurn(RewardSpec())
    assert EnvironmentSpec(max_turns=3).token_budget(32) == 96
    assert EnvironmentSpec(max_turns=3, max_total_tokens=50).token_budget(32) == 50
    with pytest.raises(ConfigError, match="unknown environment"):
        environment_from_spec(EnvironmentSpec(name="nope"))


# --- the chat_template syntax: the model's own tool role -------------------------------------------------------

def test_template_call_takes_the_last_call_and_names_what_is_wrong_with_a_bad_one():
    from stages.environments.python_tool import template_call

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    assert template_call("I will compute. " + call) == ("print(6 * 7)", None)
    # the arguments as a JSON string (some models write them so), and the later of a fence and a JSON call
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert template_call(as_string) == ("print(1)", None)
    assert template_call(call + " then ```python\n    print(2)\n```") == ("print(2)", None)
    assert template_call("```python\nprint(2)\n``` then " + call) == ("print(6 * 7)", None)
    assert template_call("```py\nprint(3)\n```") == ("print(3)", None)
    assert template_call("no call, ```\nprint(4)\n``` is not python") == (None, None)
    assert template_call("<tool_call>{'name': 'python'}</tool_call>")[1].startswith("the tool call is not valid JSON")
    assert template_call('<tool_call>{"name": "search", "arguments": {}}</tool_call>') == (
        None, "unknown tool 'search'; the tool is python")
    assert template_call('<tool_call>{"name": "python", "arguments": {"code": 7}}</tool_call>') == (
        None, 'the tool call has no "code" argument (a string)')
    assert template_call("```python\n  \n```") == (None, "the tool call has no code")


def test_chat_template_syntax_runs_a_call_that_ends_the_turn_and_answers_in_the_templates_tool_message():
    env = PythonTool(syntax="chat_template", max_turns=3)
    assert env.stop == () and env.tools[0]["function"]["name"] == "python" and PythonTool().tools is None
    with pytest.raises(RuntimeError, match="with_tool_turn"):
        env.start(ROW)  # the sampler binds the template first
    bound = env.with_tool_turn(("<B>", "<A>"))
    episode = bound.start(ROW)
    obs = episode.step(_turn("let me compute ```python\nprint(1234 * 5678)\n```", "eos"))
    assert obs == Observation("<B>7006652<A>", tool_call=True, tool_error=False)
    bad = episode.step(_turn('<tool_call>{"name": "calc"}</tool_call>', "eos", 1))
    assert bad == Observation("<B>[unknown tool 'calc'; the tool is python]<A>", tool_call=True, tool_error=True)
    # a turn cut by its token budget runs nothing, nor a call in tags, nor the last allowed turn's call
    assert bound.start(ROW).step(_turn("```python\nprint(1)\n```", "length")) is None
    assert bound.start(ROW).step(_turn("<python>print(1)</python>", "eos")) is None
    last = bound.start(ROW)
    assert last.step(_turn("```python\nprint(1)\n```", "eos")) is not None
    assert last.step(_turn("```python\nprint(1)\n```", "eos", 1)) is not None
    assert last.step(_turn("```python\nprint(1)\n```", "eos", 2)) is None
    with pytest.raises(ValueError, match="syntax is tags or chat_template"):
        PythonTool(syntax="xml")


def test_the_spec_carries_the_syntax_to_the_python_tool_only_and_leaves_tags_keys_alone():
    from pydantic import ValidationError

    from schemas.configs import EnvironmentSpec
    from stages.environments.registry import environment_from_spec

    assert "syntax" not in EnvironmentSpec(name="python").model_dump()  # the tags default: cache keys unchanged
    spec = EnvironmentSpec(name="python", syntax="chat_template")
    assert spec.model_dump()["syntax"] == "chat_template"
    assert environment_from_spec(spec).uses_chat_template
    with pytest.raises(ValidationError, match="python environment's"):
        EnvironmentSpec(name="single_turn", syntax="chat_template")
