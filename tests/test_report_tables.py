"""The report's tables and names as users read them (issue 59 item 9): tables split to fit Prefect's artifact pane
(flows/report/tables.py; the browser check is tests/test_ui_browser.py) and the documentation's example of a run's
name (docs/operations/servers.md, moved there from the README, issue 62). A tool eval without tool calls (its tool
error rate "—", not 0): tests/test_r1_tools.py's eval_base_python, in the same end-to-end run that checks every other
tool row."""

from __future__ import annotations

import re
from pathlib import Path

from flows.report.tables import PANE_CHARS, column_groups, markdown_tables, read_tables, shown_width
from flows.track.tracking import run_name

ROOT = Path(__file__).resolve().parent.parent


def test_a_wide_table_splits_into_tables_that_fit_each_repeating_its_key_column():
    headers = ["eval", *(f"metric number {i}" for i in range(8))]
    rows = [["eval_grpo_no_tool_python", *(f"[0.{i}00](http://127.0.0.1:5000/#/a/very/long/url)" for i in range(8))],
            ["↳ previous (run 7c68b6b3)", *("0.500 [0.363, 0.637]" for _ in range(8))]]
    groups = column_groups(headers, rows)
    assert len(groups) > 1 and all(g[0] == 0 for g in groups)
    assert sorted(c for g in groups for c in g[1:]) == list(range(1, 9))  # every column once, in order
    for g in groups:  # each table within the budget, as its cells show (a link as its text)
        assert sum(max(shown_width(c) for c in [headers[i], *(r[i] for r in rows)]) + 3 for i in g) <= PANE_CHARS
    lines = markdown_tables(headers, rows)
    assert sum(line.startswith("| eval |") for line in lines) == len(groups)
    assert [list(r.values()) for r in read_tables("\n".join(lines) + "\n\nText after the tables.\n| x |")] == rows
    assert markdown_tables(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]  # narrow: one table


def test_the_docs_name_runs_as_runs_are_named():
    """The documentation's example of a parent run's name (`11-26 13:40 cpu 3f2a9c r1`) is what run_name makes: time,
    profile, the flow run's short id, recipe (issue 59: it showed the order of an older version)."""
    page = (ROOT / "docs" / "operations" / "servers.md").read_text()
    example = re.search(r"holds a parent run per pipeline run \(`([^`]+)`", page).group(1)
    made = run_name("cpu", "3f2a9c" + "0" * 26, "r1")
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d cpu 3f2a9c r1", made)
    assert example[len("11-26 13:40"):] == made[len("11-26 13:40"):], (example, made)
