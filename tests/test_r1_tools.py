"""The `r1-tools` recipe end to end on the tiny profile (issue 46): the tool demonstrations are checked by
running them and kept, both arms train, and every model is evaluated with the python tool (tool metrics) and
without it (single_turn: no tool metrics), on the same held-out prompts with the transfer task."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flows.cli.app import main
from flows.plan.recipes import load_plan
from flows.report.tables import read_tables
from stages.rewards import sandbox
from tests.conftest import harness_home

pytestmark = pytest.mark.slow

MODELS = ("base", "sft_tools", "grpo_tools", "sft_no_tool", "grpo_no_tool")
TOOL_METRICS = ("tool_calls_per_answer", "tool_error_rate", "turns", "calls_0/accuracy", "calls_0/share",
                "calls_1/share", "calls_2plus/share")


def test_the_plan_evaluates_every_model_with_and_without_the_tool():
    plan = load_plan("r1-tools", "tiny")
    evals = {n.name: n for n in plan.nodes if n.stage == "eval"}
    assert set(evals) == {f"eval_{m}{s}" for m in MODELS for s in ("", "_python")}
    for name, node in evals.items():
        assert node.config.environment.name == ("python" if name.endswith("_python") else "single_turn"), name
    assert plan.node("grpo_tools").config.environment.name == "python"
    assert plan.node("grpo_no_tool").config.environment.is_single_turn
    tools, no_tool = plan.node("grpo_tools").config, plan.node("grpo_no_tool").config
    assert tools.model_copy(update={"environment": no_tool.environment}) == no_tool  # the same budget


def test_r1_tools_end_to_end(tmp_path_factory, monkeypatch, capsys):
    if sandbox.isolation()["mode"] != "namespaces":  # as tests/test_sandbox.py: this host's only mode, opted into
        monkeypatch.setenv(sandbox.WEAK_ENV, "1")
    with harness_home(tmp_path_factory.mktemp("r1-tools-home")) as home:
        out = home / "run.json"
        assert main(["run", "--recipe", "r1-tools", "--profile", "tiny", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        report = Path(result["report"]["path"]).read_text()
    by_node = {s["node"]: s for s in result["stages"]}
    assert {s["status"] for s in result["stages"]} == {"run"}
    for arm in ("demos_tools", "demos_no_tool"):
        m = by_node[arm]["metrics"]
        assert m["kept"] > 0 and m["kept"] == m["with_expression"] and m["program_errors"] == 0, arm
    assert by_node["demos_tools"]["metrics"]["kept"] == by_node["demos_no_tool"]["metrics"]["kept"]
    for model in MODELS:
        plain, tool = by_node[f"eval_{model}"]["metrics"], by_node[f"eval_{model}_python"]["metrics"]
        for m in (plain, tool):
            assert 0 <= m["accuracy"] <= 1 and "chain_sum/accuracy" in m and "products/accuracy" in m, model
        assert all(k in tool for k in TOOL_METRICS), model
        assert not any(k in plain for k in TOOL_METRICS), model
        assert tool["turns"] >= 1 and (0 <= tool["tool_error_rate"] <= 1 if tool["tool_calls_per_answer"] else
                                       math.isnan(tool["tool_error_rate"]))  # a rate over no calls is none
    # the report: a tool-use row per eval with the tool, RL over the tool cold start, the tool arm over the no-tool arm
    tool_rows = read_tables(report.split("## Tool use (evals with a tool environment)")[1])
    assert [r["eval"] for r in tool_rows] == [f"eval_{m}_python" for m in MODELS]
    for r in tool_rows:  # a rate over no calls is none (issue 59)
        calls, rate = by_node[r["eval"]]["metrics"]["tool_calls_per_answer"], r["tool error rate"]
        assert (rate == "—") == (calls == 0), r
    # the untrained tiny model calls no tool: its tool error rate is "—" in the report, not 0, and logged as nan
    base = by_node["eval_base_python"]["metrics"]
    assert base["tool_calls_per_answer"] == 0 and math.isnan(base["tool_error_rate"]), base
    assert tool_rows[0]["tool calls / answer"] == "0" and tool_rows[0]["tool error rate"] == "—", tool_rows[0]
    gains = {(g["model"], g["over"], g["relation"], g["evals"])
             for g in read_tables(report.split("## Stage gains")[1])}
    assert ("grpo_tools [python]", "sft_tools [python]", "its start", "eval_grpo_tools_python over eval_sft_tools_python") \
        in gains
    assert ("grpo_tools [python]", "grpo_no_tool [single_turn]", "tool arm with the tool over the no-tool arm",
            "eval_grpo_tools_python over eval_grpo_no_tool") in gains
    # the end of the run: a line a gain, each telling apart the evals with and without the tool (issue 59)
    printed = capsys.readouterr().out.split("stage gains, held-out accuracy points")[1].splitlines()[1:]
    printed = [line for line in printed if line.startswith("  ") and " over " in line]
    assert len(printed) == len(result["comparison"]["gains"]) == len(set(printed)), printed

