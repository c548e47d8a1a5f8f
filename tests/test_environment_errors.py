"""An exception inside an environment's own code, met the way a user meets it (issue 59 item 9): `r1flow run` with a
user's environment file whose `step()` raises ends with one `r1flow: error:` line naming the environment, the method
and the line that raised, and the traceback is printed at most once (before: 208 lines, the traceback twice, no
`r1flow: error` line)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from schemas.errors import EnvironmentCodeError
from stages.environments.base import call_environment
from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
RAISES = 'raise KeyError("no such tool: calculator")'
USER_ENV = textwrap.dedent(f"""\
    from stages.environments.single_turn import SingleTurn


    class _Broken:
        def step(self, turn):
            {RAISES}


    class Env(SingleTurn):
        def start(self, row):
            return _Broken()


    def environment(**options):
        return Env(name="broken_tool")
    """)


def test_call_environment_names_the_environment_method_and_line_and_keeps_the_cause():
    def step():
        return {}["calculator"]

    with pytest.raises(EnvironmentCodeError) as info:
        call_environment("mine", "step", step)
    line = step.__code__.co_firstlineno + 1
    assert str(info.value) == f"environment 'mine': step() raised KeyError: 'calculator' at {__file__}:{line} in step"
    assert isinstance(info.value.__context__, KeyError)  # kept, not shown: the traceback is logged once
    assert call_environment("mine", "step", lambda: 3) == 3


@pytest.mark.slow
def test_an_exception_in_a_user_environments_step_is_one_error_line_and_one_traceback(tmp_path):
    env_file = tmp_path / "broken_env.py"
    env_file.write_text(USER_ENV)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--recipe", "eval", "--profile", "tiny",
                          "--set", "eval_base.max_prompts=2", "--set", f"eval_base.environment.name={env_file}"],
                         cwd=ROOT, env=clean_env(tmp_path / "home"), capture_output=True, text=True, timeout=600)
    errors = [line for line in out.stderr.splitlines() if line.startswith("r1flow: error:")]
    assert out.returncode == 2 and errors == [
        "r1flow: error: environment 'broken_tool': step() raised KeyError: 'no such tool: calculator' at "
        f"{env_file}:6 in step"], out.stderr[-3000:]
    assert out.stderr.count(RAISES) == 1, out.stderr  # the traceback once: the environment's frames, logged
    assert len(out.stderr.splitlines()) < 40, out.stderr
