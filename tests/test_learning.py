"""benchmarks/learning.py: the statistics and table on literal evaluations, the snapshot and budget rules, bad
settings refused before compute, and a smoke run of the whole script on the tiny model (r1flow's side: TRL lives
only in the benchmark venv; no targets here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import learning

ROOT = Path(__file__).resolve().parents[1]


def rows(task: str, correct: list[int], start: int = 0) -> list[dict]:
    return [{"prompt_id": f"{task}-{start + i:03d}", "task": task, "correct": bool(c), "format_ok": True,
             "num_tokens": 10} for i, c in enumerate(correct)]


def evaluation(task_correct: list[int], transfer_correct: list[int]) -> dict:
    return {"rows": rows(learning.TASK, task_correct) + rows(learning.TRANSFER, transfer_correct), "seconds": 1.0}


def test_gains_are_paired_differences_over_the_same_prompts():
    start = rows(learning.TASK, [0, 0, 1, 1])
    end = rows(learning.TASK, [1, 0, 1, 1])
    g = learning.gain_entry(start, end, learning.TASK)
    assert g["gain"] == pytest.approx(0.25)
    assert g["ci"][0] <= 0.25 <= g["ci"][1] and g["ci"][0] >= 0.0  # no resample can lose: only gains were paired
    with pytest.raises(ValueError, match="different prompts"):
        learning.gain_entry(start, rows(learning.TASK, [1, 0, 1, 1], start=1), learning.TASK)


def test_summary_compares_equal_steps_and_equal_time():
    n = 40
    evals = {"start": evaluation([0] * n, [0] * n),
             "trl_end": evaluation([1] * 4 + [0] * (n - 4), [0] * n),              # +10 points
             "r1flow_equal_steps": evaluation([1] * 5 + [0] * (n - 5), [0] * n),   # +12.5
             "r1flow_end": evaluation([1] * 10 + [0] * (n - 10), [1] + [0] * (n - 1))}  # +25: 2.5x TRL's gain
    runs = {"trl": {"steps": 30, "train_s": 1200.0},
            "r1flow": {"steps": 80, "train_s": 1190.0, "snapshots": [{"name": "equal_steps", "step": 30,
                                                                       "elapsed_s": 450.0}]}}
    s = learning.summarize_learning(learning.Plan(), evals, runs)
    by = {r["name"]: r for r in s["rows"]}
    assert [r["name"] for r in s["rows"]] == ["start", "trl_end", "r1flow_equal_steps", "r1flow_end"]
    assert by["r1flow_end"]["gain"]["gain"] == pytest.approx(0.25)
    assert by["r1flow_end"]["transfer_gain"]["gain"] == pytest.approx(1 / n)
    assert s["gain_ratio_equal_time"] == pytest.approx(2.5)
    assert s["equal_time_met"] is True
    assert s["equal_steps_diff"]["diff"] == pytest.approx(0.025) and s["equal_steps_diff"]["not_worse"]
    text = "\n".join(learning.table(s) + learning.verdict_lines(s))
    assert "| r1flow, budget | 80 | 19.8 | 25.0% [" in text
    assert "2.50x TRL's gain" in text and "met" in text
    # half TRL's gain at equal time: missed, and said so
    evals["r1flow_end"] = evaluation([1] * 2 + [0] * (n - 2), [0] * n)
    s = learning.summarize_learning(learning.Plan(), evals, runs)
    assert s["equal_time_met"] is False and "MISSED" in "\n".join(learning.verdict_lines(s))


def test_snapshots_follow_the_curve_times_and_the_equal_steps_point(tmp_path):
    class Model:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)

    plan = learning.Plan(minutes=4.0, curve_points=3)  # curve at 60, 120, 180 s
    snaps = learning.Snapshots(plan.curve_times(), tmp_path, at_step=2)
    for step, t in ((1, 50.0), (2, 130.0), (3, 170.0), (4, 250.0)):
        snaps.after_step(Model(), step, t)
    got = [(s["name"], s["step"]) for s in snaps.saved]
    assert got == [("t1", 2), ("t2", 2), ("equal_steps", 2), ("t3", 4)]  # a slow step crosses two curve times
    assert all(Path(s["adapter"]).is_dir() for s in snaps.saved)


def test_bad_settings_fail_before_any_compute(tmp_path):
    for extra, needle in ((["--r1flow-set", "dynamic_sampling=maybe"], "dynamic_sampling"),
                          (["--r1flow-set", "no_such_field=1"], "no_such_field"),
                          (["--group-size", "1"], "group_size"),
                          (["--sides", "r1flow,openrlhf"], "openrlhf")):
        p = subprocess.run([sys.executable, "benchmarks/learning.py", "--model", "tiny", "--sides", "r1flow",
                            "--work-dir", str(tmp_path), *extra], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and needle in p.stderr, (extra, p.stderr[-800:])
    assert not any(tmp_path.iterdir())  # nothing made




def test_a_reused_trl_run_must_have_trained_on_the_same_plan(tmp_path):
    plan = learning.Plan()
    raw = {"plan": learning.dataclasses.asdict(plan), "runs": {"trl": {"steps": 3}}, "evals": {}}
    (tmp_path / "learning.json").write_text(json.dumps(raw))
    tried = learning.Plan(r1flow_extra={"dynamic_sampling": True})  # r1flow-only settings may differ
    assert learning.reuse_trl(tmp_path, tried)["runs"]["trl"]["steps"] == 3
    with pytest.raises(SystemExit, match="learning_rate was 0.0002, this run's is 0.001"):
        learning.reuse_trl(tmp_path, learning.Plan(learning_rate=1e-3))
    with pytest.raises(SystemExit, match="no learning.json"):
        learning.reuse_trl(tmp_path / "nowhere", plan)
