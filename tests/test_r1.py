"""The default `r1` recipe end to end on the tiny profile: every stage runs, every model is
evaluated on the same held-out prompts (with a transfer task), a second run is fully cached, and
changing `dpo.beta` re-runs exactly dpo and its descendants, whose old and new results the report
shows side by side. The first run goes through the CLI, as a user starts it in a 100-column terminal: what it
prints at the end (stage table, model comparison, report path, the command that opens the MLflow UI, the parent
run's URL) is checked here too (tests/test_cli_output.py has the rest of what the terminal shows)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli.app import main
from flows.plan.recipes import DEFAULT_RECIPE, load_plan
from flows.report.tables import read_tables
from tests.conftest import harness_home
from tests.test_cli_output import ACCURACY, ROOT, WIDTH, _env, _too_wide

pytestmark = pytest.mark.slow

EVALUATED = {"eval_base": "base", "eval_sft_cold": "sft_cold", "eval_grpo_reasoning": "grpo_reasoning",
             "eval_sft": "sft", "eval_dpo": "dpo", "eval_grpo_final": "grpo_final", "eval_student": "distill"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with harness_home(tmp_path_factory.mktemp("r1-home")) as path:
        yield path


@pytest.fixture(scope="module")
def first_run(home) -> tuple[dict, str, dict[str, str]]:
    """The module's first run: `python -m flows.cli run --profile tiny` (no --recipe: the default) on the module's
    home with nothing exported (a temporary Prefect server, the home's MLflow store), COLUMNS=100. Its --json result,
    its stdout and its environment; the end-to-end test goes on from it in-process, the terminal test reads it."""
    out = home / "first-run.json"
    env = _env(home, COLUMNS=str(WIDTH))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--profile", "tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, env


def run(home: Path, *args: str) -> dict:
    out = home / "last-run.json"
    assert main(["run", "--profile", "tiny", "--json", str(out), *args]) == 0  # no --recipe: the default
    return json.loads(out.read_text())


def statuses(result: dict) -> dict[str, str]:
    return {s["node"]: s["status"] for s in result["stages"]}


def report_text(home: Path, result: dict) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    path = client.download_artifacts(result["parent_run_id"], "report/report.md", str(home / f"dl-{result['parent_run_id']}"))
    return Path(path).read_text()


def comparison_table(report: str) -> list[str]:
    """The rows of the report's model comparison table (its split tables joined: flows/report/tables.py), each as a
    markdown row."""
    section = report.split("## Model comparison", 1)[1].split("\n## ", 1)[0]
    return ["| " + " | ".join(row.values()) + " |" for row in read_tables(section)]


def test_r1_is_the_default_recipe():
    assert DEFAULT_RECIPE == "r1"


def test_r1_end_to_end_then_cached_then_dpo_beta_reruns_only_its_descendants(home, first_run):
    first = first_run[0]
    assert first["recipe"] == "r1"
    st = statuses(first)
    assert set(st.values()) == {"run"}, st
    by_node = {s["node"]: s for s in first["stages"]}
    for ev in EVALUATED:
        m = by_node[ev]["metrics"]
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["format_rate"] <= 1 and m["tokens_per_s"] > 0, ev
        # the same held-out prompts, including the task no stage trains on (transfer)
        assert "chain_sum/accuracy" in m and "basic_arithmetic/accuracy" in m, ev
    assert by_node["cold_start"]["metrics"]["accepted_rows"] > 0
    assert by_node["preference_data"]["metrics"]["pairs"] > 0
    assert "student" not in by_node  # options.student=base: the base model is the student, nothing is cut
    distilled = by_node["distill"]["metrics"]
    assert distilled["student_parameters"] == distilled["teacher_parameters"]

    rows = comparison_table(report_text(home, first))
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {ev}", model] for ev, model in EVALUATED.items()]
    # decontamination: every model's held-out prompts against all the datasets it descends from (prompts, samples,
    # SFT data, preferences, traces): none found, shown as 0 in the report's column
    section = report_text(home, first).split("## Model comparison", 1)[1].split("\n## ", 1)[0]
    assert [r["contaminated ‡"] for r in read_tables(section)] == ["0"] * len(EVALUATED)
    assert by_node["eval_base"]["metrics"]["contamination/datasets"] == 0
    assert by_node["eval_student"]["metrics"]["contamination/datasets"] >= 5  # prompts, cold_start's two, rs, traces...
    assert not any("previous" in row for row in rows)  # the first run of this recipe and profile

    again = run(home)
    assert set(statuses(again).values()) == {"cached"}

    changed = run(home, "--set", "dpo.beta=0.3")
    ran = {n for n, s in statuses(changed).items() if s == "run"}
    plan = load_plan("r1", "tiny")
    assert ran == plan.descendants({"dpo"})
    assert ran == {"dpo", "eval_dpo", "grpo_final", "eval_grpo_final", "traces", "distill", "eval_student"}

    rows = comparison_table(report_text(home, changed))
    previous = [line for line in rows if "previous" in line]
    # old and new side by side for exactly the evals whose model changed
    assert len(previous) == 3, previous
    for ev in ("eval_dpo", "eval_grpo_final", "eval_student"):
        i = next(k for k, line in enumerate(rows) if line.startswith(f"| {ev} |"))
        assert "previous" in rows[i + 1], (ev, rows[i + 1])
    old_fp = {s["node"]: s["outputs"].get("model") for s in first["stages"]}
    new_fp = {s["node"]: s["outputs"].get("model") for s in changed["stages"]}
    assert old_fp["dpo"] != new_fp["dpo"] and old_fp["sft"] == new_fp["sft"]
    assert any(old_fp["dpo"][:8] in line for line in previous) and any(new_fp["dpo"][:8] in line for line in rows)


def test_tiny_r1_run_ends_with_comparison_report_path_and_ui_command(home, first_run):
    result, stdout, env = first_run
    lines = stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if "r1flow run — recipe r1" in line):]  # the summary
    print("\n".join(lines))  # shown with `pytest -rP`: what a user sees at the end of the run
    assert _too_wide(lines) == [], _too_wide(lines)
    assert "…" not in stdout

    start = next(i for i, line in enumerate(lines) if line.startswith("model comparison"))
    rows = [line for line in lines[start:] if line.strip().startswith("eval_")]
    assert [line.split()[:2] for line in rows] == [[ev, model] for ev, model in EVALUATED.items()]
    n = {r["eval"]: int(r["prompts"]) for r in result["comparison"]["rows"]}
    for line in rows:
        assert ACCURACY.search(line) and re.search(rf"\]\s+{n[line.split()[0]]}\b", line), line

    tail = [line for line in lines[start:] if line.strip()]
    report = Path(result["report"]["path"])
    assert report == home / "mlartifacts" / result["parent_run_id"] / "artifacts" / "report" / "report.md"
    assert report.is_file() and str(report) in tail
    assert (report.parent / "comparison.json").is_file()
    # the command runs from where `r1flow run` ran: the venv's script, and this home
    command = tail[-3]
    assert command.startswith(f"R1FLOW_HOME={home} ") and command.endswith(" ui"), command
    shown = subprocess.run(["bash", "-c", f"{command} --help"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "--port" in shown.stdout, shown.stderr
    assert tail[-1] == (f"http://127.0.0.1:5000/#/experiments/{result['experiment_id']}/runs/"
                        f"{result['parent_run_id']}?workflowType=machine_learning")


def test_r1_without_preferences_runs_the_final_rl_from_the_sft_model(home):
    """The cpu profile's shape of the recipe (options.preferences=false) on the tiny model: no preference stage runs,
    grpo_final starts from the stage-3 SFT model without a reward model, and the student is still distilled."""
    result = run(home, "--set", "options.preferences=false", "--set", "grpo_final.reward.weights.reward_model=0")
    st = statuses(result)
    assert set(st) == {n.name for n in load_plan("r1", "tiny", ["options.preferences=false",
                                                                 "grpo_final.reward.weights.reward_model=0"]).nodes}
    assert not {"pref_samples", "preference_data", "reward_model", "dpo_reference", "dpo", "eval_dpo"} & set(st)
    assert set(st.values()) <= {"run", "cached"} and st["grpo_final"] == st["eval_student"] == "run"
