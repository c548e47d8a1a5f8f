"""tool_demos (issue 46): expressions found in questions, demonstrations written by hand-checked rules, each
program run in the sandbox, and only right answers kept."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from schemas.configs import ToolDemosConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages import tool_demos
from stages.base import LocalContext, write_dataset
from stages.environments.python_tool import PythonTool, observation_spans
from stages.rewards import sandbox
from stages.rewards.answers import format_ok
from stages.rewards.verifiers import score
from tests.conftest import fake_input


@pytest.fixture(autouse=True)
def _weak_sandbox_where_it_is_the_mode(monkeypatch):
    if sandbox.isolation()["mode"] != "namespaces":  # as tests/test_sandbox.py
        monkeypatch.setenv(sandbox.WEAK_ENV, "1")


@pytest.mark.parametrize("question, expected", [
    ("Solve the following multiplication: 1663 * 5242. Give only the result as your final answer.", "1663 * 5242"),
    ("Calculate -1515 * -61.", "-1515 * -61"),
    ("Calculate ( 241 * -468 ).", "( 241 * -468 )"),
    ("State the final answer to the following arithmetic problem: 57 + 87 + 70 =", "57 + 87 + 70"),
    ("What is 12?", None),
    ("Compute 2 ** 10.", None),  # only + - * /
    ("Say 3.", None),
])
def test_arithmetic_expression(question, expected):
    assert tool_demos.arithmetic_expression(question) == expected


def _prompt(i, question, answer, split="train", verifier="math"):
    return {"id": f"p{i}", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": question}],
            "answer": answer, "task": "products", "verifier": verifier, "split": split, "metadata": "{}"}


PROMPTS = [
    _prompt(0, "Solve the following multiplication: 1663 * 5242. Give only the result as your final answer.",
            "8717446"),
    _prompt(1, "Calculate -1515 * -61.", "92415"),
    _prompt(2, "Calculate 12 * 12.", "145"),  # a wrong gold answer: the run disagrees, dropped
    _prompt(3, "Say hello.", "hello"),  # no expression
    _prompt(4, "Calculate 7 * 6.", "42", split="eval"),
]


def _run(tmp_path, **config):
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(PROMPTS, "prompts"), "prompts")
    out = tool_demos.run(ToolDemosConfig(**config), {"prompts": fake_input(data.path, "dataset", "prompts")},
                         LocalContext(tmp_path / "run"))["data"]
    return out, pq.read_table(out.path / "data.parquet").to_pylist()


def test_demonstrations_run_their_program_and_keep_only_right_answers(tmp_path):
    out, rows = _run(tmp_path)
    assert [r["id"] for r in rows] == ["p0", "p1"]
    assert rows[0]["messages"][:-1] == PROMPTS[0]["messages"]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": (
        "<think>\nThis needs exact arithmetic, so I will compute it with Python.\n<python>\nprint(1663 * 5242)\n"
        "</python><output>\n8717446\n</output>\n</think>\n<answer>8717446</answer>")}
    assert rows[1]["messages"][-1]["content"].endswith(
        "<python>\nprint(-1515 * -61)\n</python><output>\n92415\n</output>\n</think>\n<answer>92415</answer>")
    assert out.metrics == {"prompts": 4.0, "with_expression": 3.0, "kept": 2.0, "kept_rate": 0.5,
                           "program_errors": 0.0}
    meta = json.loads(rows[0]["metadata"])
    assert (meta["expression"], meta["with_tool"], meta["task"]) == ("1663 * 5242", True, "products")


def test_a_demonstration_reads_as_a_python_environment_trajectory():
    """One observation, right after `</python>`; the model's text without it is well formed and right (what the
    python environment scores), and so is the transcript."""
    result = sandbox.run_program("print(1663 * 5242)")
    content = tool_demos.demonstration(PROMPTS[0], "1663 * 5242", result, ToolDemosConfig(),
                                       PythonTool())
    (a, b), = observation_spans(content)
    assert content[a:b] == "<output>\n8717446\n</output>\n"
    model_text = content[:a] + content[b:]
    assert format_ok(model_text) and format_ok(content)
    assert score(PROMPTS[0], model_text).correct is True


def test_a_failing_program_is_not_a_demonstration():
    failed = sandbox.SandboxResult(status="error", returncode=1, stdout="", stderr="ZeroDivisionError", wall_s=0.0)
    assert tool_demos.demonstration(PROMPTS[0], "1 / 0", failed, ToolDemosConfig(), PythonTool()) is None


def test_the_no_tool_arm_answers_the_same_prompts_without_the_tool(tmp_path):
    _, rows = _run(tmp_path, with_tool=False)
    assert [r["id"] for r in rows] == ["p0", "p1"]
    assert rows[0]["messages"][-1]["content"] == \
        "<think>\nI need to compute 1663 * 5242.\n</think>\n<answer>8717446</answer>"
    assert all("<python>" not in r["messages"][-1]["content"] for r in rows)


def test_no_prompts_in_the_split_is_an_error(tmp_path):
    rows = [p for p in PROMPTS if p["split"] == "train"]
    data = write_dataset(LocalContext(tmp_path / "e"), "p", from_rows(rows, "prompts"), "prompts")
    with pytest.raises(SchemaError, match="no prompts with split='eval'"):
        tool_demos.run(ToolDemosConfig(split="eval"), {"prompts": fake_input(data.path, "dataset", "prompts")},
                       LocalContext(tmp_path / "run-e"))
