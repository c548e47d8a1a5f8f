"""benchmarks/learning.py and the modules it is split into (learning_plan, learning_children, learning_stats,
learning_report, learning_runs): the statistics and table on literal evaluations, the snapshot and budget rules, bad
settings refused before compute, and a smoke run of the whole script on the tiny model (r1flow's side: TRL lives
only in the benchmark venv; no targets here)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import (
    learning,
    learning_children,
    learning_plan,
    learning_report,
    learning_runs,
    learning_stats,
)
from benchmarks.common import SEED, Snapshots
from benchmarks.learning_plan import TASK, TRANSFER, Plan

ROOT = Path(__file__).resolve().parents[1]


def rows(task: str, correct: list[int], start: int = 0) -> list[dict]:
    return [{"prompt_id": f"{task}-{start + i:03d}", "task": task, "correct": bool(c), "format_ok": True,
             "num_tokens": 10} for i, c in enumerate(correct)]


def evaluation(task_correct: list[int], transfer_correct: list[int]) -> dict:
    return {"rows": rows(TASK, task_correct) + rows(TRANSFER, transfer_correct), "seconds": 1.0}


def test_gains_are_paired_differences_over_the_same_prompts():
    start = rows(TASK, [0, 0, 1, 1])
    end = rows(TASK, [1, 0, 1, 1])
    g = learning_stats.gain_entry(start, end, TASK)
    assert g["gain"] == pytest.approx(0.25)
    assert g["ci"][0] <= 0.25 <= g["ci"][1] and g["ci"][0] >= 0.0  # no resample can lose: only gains were paired
    with pytest.raises(ValueError, match="other prompts"):
        learning_stats.gain_entry(start, rows(TASK, [1, 0, 1, 1], start=1), TASK)


def test_paired_diff_refuses_other_prompts_or_another_order():
    a = {"rows": rows(TASK, [0, 1, 1])}
    evals = {"a": a, "same": {"rows": rows(TASK, [1, 1, 1])},
             "shifted": {"rows": rows(TASK, [1, 1, 1], start=1)},
             "reordered": {"rows": list(reversed(rows(TASK, [1, 1, 1])))},
             "shorter": {"rows": rows(TASK, [1, 1])}}
    assert learning_stats.paired_diff(evals, "a", "same")["diff"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"shifted scored other prompts than a .*position 0: basic_arithmetic-001 "
                                          r"against basic_arithmetic-000"):
        learning_stats.paired_diff(evals, "a", "shifted")
    with pytest.raises(ValueError, match="reordered scored other prompts than a"):
        learning_stats.paired_diff(evals, "a", "reordered")
    with pytest.raises(ValueError, match=r"\(2 against 3; first difference at position 2: none"):
        learning_stats.paired_diff(evals, "a", "shorter")


def seeded_evals(n: int, start: list[int], **ends: list[list[int]]) -> dict:
    """evals of the start model and of each (side_what: one list of correct prompt indices a seed), on n prompts."""
    def correct(right):
        return [int(i in right) for i in range(n)]

    out = {"start": evaluation(correct(start), [0] * n)}
    for kind, per_seed in ends.items():
        side, what = kind.split("__")
        for k, right in enumerate(per_seed):
            out[learning_stats.eval_name(side, what, k)] = evaluation(correct(right), [0] * n)
    return out


def seeded_runs(trl_steps: list[int], r1_steps: list[int]) -> dict:
    return {"trl": [{"seed": k, "first": k % 2 == 1, "steps": s, "train_s": 1200.0, "curve": []}
                    for k, s in enumerate(trl_steps)],
            "r1flow": [{"seed": k, "first": k % 2 == 0, "steps": s, "train_s": 1190.0, "curve": [],
                        "snapshots": [{"name": "equal_steps", "step": trl_steps[k], "elapsed_s": 450.0}]}
                       for k, s in enumerate(r1_steps)]}


def test_summary_pools_seeds_and_compares_equal_steps_and_equal_time():
    """40 prompts, none right at the start; two seeds a side. TRL gets prompts 0-7 right with both seeds (+20
    points), r1flow 0-19 (+50): the difference is +30 points, the ratio 2.5. Every replicate's TRL gain is above 0
    unless a prompt draw misses all of 0-7, probability (32/40)^40 = 1.3e-4, so the ratio's interval is bounded and
    the target (2x, difference above 0) is met. At equal steps r1flow has TRL's very answers: 0 [0, 0], the same."""
    n = 40
    trl, r1 = list(range(8)), list(range(20))
    evals = seeded_evals(n, [], trl__end=[trl, trl], r1flow__end=[r1, r1], r1flow__equal_steps=[trl, trl])
    runs = seeded_runs([12, 14], [56, 60])
    s = learning_stats.summarize_learning(Plan(seeds=2), evals, runs)
    by = {r["name"]: r for r in s["rows"]}
    assert [r["name"] for r in s["rows"]] == ["start", "trl_end", "r1flow_equal_steps", "r1flow_end"]
    assert by["r1flow_end"]["gain"]["gain"] == pytest.approx(0.5) and by["r1flow_end"]["task"]["seeds"] == 2
    assert by["r1flow_equal_steps"]["steps"] == [12, 14] and by["trl_end"]["steps"] == [12, 14]
    assert [e["seed"] for e in by["r1flow_end"]["per_seed"]] == [0, 1]
    et = s["equal_time"]
    assert et["diff"] == pytest.approx(0.3) and et["ratio"] == pytest.approx(2.5) and et["seeds"] == 2
    assert et["gain_a_ci"][0] > 0 and et["ratio_ci"] is not None and et["verdict"] == "met"
    assert s["equal_steps"] == {"diff": 0.0, "ci": [0.0, 0.0], "seeds": 2, "verdict": "same"}
    assert s["std"] == "sample"
    text = "\n".join(learning_report.table(s) + learning_report.seed_table(s) + learning_report.verdict_lines(s))
    assert "| r1flow, budget | 56, 60 | 19.8, 19.8 | 50.0% [" in text
    assert "| TRL, budget | 1 | yes | 14 | 20.0 | 20.0% [" in text  # seed 1: TRL ran first
    assert "r1flow's gain minus TRL's +30.0 points [" in text and "2.50x TRL's gain [" in text
    assert "Target (>= 2x, difference's interval above 0): met" in text
    assert "equal steps, 2 seed(s): r1flow minus TRL +0.0 points [+0.0, +0.0] (two-sided): the same" in text


def test_summary_verdicts_a_barely_learning_trl_and_a_difference_at_equal_steps():
    """TRL right on prompt 0 only (+2.5 points): a prompt draw misses it with probability (39/40)^40 = 36%, so TRL's
    gain interval reaches 0 and the ratio (8x) has no bounded interval: "undetermined", not met. At equal steps
    r1flow is right on 10 more prompts than TRL with both seeds: higher beyond the noise, which is flagged
    INVESTIGATE, not counted as a win. r1flow at half TRL's gain: MISSED."""
    n = 40
    evals = seeded_evals(n, [], trl__end=[[0], [0]], r1flow__end=[range(8), range(8)],
                         r1flow__equal_steps=[range(11), range(11)])
    s = learning_stats.summarize_learning(Plan(seeds=2), evals, seeded_runs([12, 14], [56, 60]))
    assert s["equal_time"]["ratio"] == pytest.approx(8.0) and s["equal_time"]["ratio_ci"] is None
    assert s["equal_time"]["verdict"] == "undetermined"
    assert s["equal_steps"]["verdict"] == "higher"
    text = "\n".join(learning_report.verdict_lines(s))
    assert "its interval unbounded: TRL's gain interval reaches 0" in text and "undetermined" in text
    assert "r1flow HIGHER beyond the noise: INVESTIGATE" in text
    evals = seeded_evals(n, [], trl__end=[range(16), range(16)], r1flow__end=[range(8), range(8)])
    s = learning_stats.summarize_learning(Plan(seeds=2), evals, seeded_runs([12, 14], [56, 60]))
    assert s["equal_time"]["verdict"] == "MISSED" and "equal_steps" not in s


def test_equal_time_verdict_rules():
    def c(diff_low, ratio, ratio_ci):
        return {"diff_ci": [diff_low, 1.0], "ratio": ratio, "ratio_ci": ratio_ci}

    assert learning_stats.equal_time_verdict(c(0.01, 3.0, [2.1, 5.0])) == "met"
    assert learning_stats.equal_time_verdict(c(0.01, 2.0, [1.1, 5.0])) == "met"  # the point at 2x, the interval below
    assert learning_stats.equal_time_verdict(c(0.01, 1.9, [1.1, 5.0])) == "MISSED"
    assert learning_stats.equal_time_verdict(c(0.0, 3.0, [2.1, 5.0])) == "MISSED"  # the difference not above 0
    assert learning_stats.equal_time_verdict(c(0.01, 9.0, None)) == "undetermined"
    assert learning_stats.equal_time_verdict(c(0.01, None, None)) == "undetermined"  # TRL gained nothing at all


def test_sides_take_turns_to_run_first():
    assert [learning_runs.run_order(["trl", "r1flow"], k) for k in range(3)] == [["r1flow", "trl"],
                                                                                ["trl", "r1flow"], ["r1flow", "trl"]]
    assert learning_runs.run_order(["trl", "r1flow", "r1flow_ppo"], 1) == ["trl", "r1flow", "r1flow_ppo"]
    assert learning_runs.run_order(["r1flow"], 1) == ["r1flow"]


def test_every_step_snapshots_settle_on_the_equal_steps_point(tmp_path):
    """r1flow ran first (every step saved); TRL then took 2 steps: step 2's adapter is the equal-steps one, the
    others are deleted, the curve snapshots stay."""
    class Model:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)

    snaps = Snapshots([150.0], tmp_path, at_step=None, every_step=True)
    for step, t in ((1, 50.0), (2, 100.0), (3, 170.0)):
        snaps.after_step(Model(), step, t)
    run = {"snapshots": snaps.saved}
    learning_runs.settle_equal_steps(run, 2)
    assert [(s["name"], s["step"]) for s in run["snapshots"]] == [("equal_steps", 2), ("t1", 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step2", "t1"]
    assert run["every_step_save_s"] >= 0
    run = {"snapshots": [dict(s, name=f"step{s['step']}") for s in snaps.saved if s["name"] == "equal_steps"]}
    learning_runs.settle_equal_steps(run, 5)  # TRL took more steps than r1flow: no equal-steps point
    assert run["snapshots"] == []


def test_phase_means_skip_the_first_step_and_need_every_phase():
    def step(g, sc, tr):
        return {"generation_s": g, "scoring_s": sc, "training_s": tr, "step_s": g + sc + tr}

    runs = [{"curve": [step(50, 1, 50), step(10, 1, 5), step(20, 1, 7)]}, {"curve": [step(9, 9, 9), step(30, 1, 9)]}]
    p = learning_stats.phase_means(runs)
    assert p == {"generation": 20.0, "scoring": 1.0, "training": 7.0, "total": 28.0, "steps": 3}
    assert learning_stats.phase_means([{"curve": [step(1, 1, 1), {"step_s": 3.0}]}]) is None  # an older run: no phases
    lines = learning_report.phase_lines({"phases": {"trl": p, "r1flow": None}})
    assert lines[2] == "| trl | 3 | 20.0 | 1.00 | 7.0 | 28.0 |" and len(lines) == 3


def test_trl_step_phases_leave_training_what_generation_and_scoring_do_not_take():
    trl_side = pytest.importorskip("benchmarks.trl_side")
    got = trl_side.step_phases(100.0, {"generation": 60.0, "scoring": 2.5, "completion_tokens": 900.0})
    assert got == {"generation": 60.0, "scoring": 2.5, "training": 37.5, "total": 100.0, "completion_tokens": 900.0}


def test_snapshots_follow_the_curve_times_and_the_equal_steps_point(tmp_path):
    class Model:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)

    plan = Plan(minutes=4.0, curve_points=3)  # curve at 60, 120, 180 s
    snaps = Snapshots(plan.curve_times(), tmp_path, at_step=2)
    for step, t in ((1, 50.0), (2, 130.0), (3, 170.0), (4, 250.0)):
        snaps.after_step(Model(), step, t)
    got = [(s["name"], s["step"]) for s in snaps.saved]
    assert got == [("t1", 2), ("t2", 2), ("equal_steps", 2), ("t3", 4)]  # a slow step crosses two curve times
    assert all(Path(s["adapter"]).is_dir() for s in snaps.saved)


def test_bad_settings_fail_before_any_compute(tmp_path):
    for extra, needle in ((["--r1flow-set", "dynamic_sampling=maybe"], "dynamic_sampling"),
                          (["--r1flow-set", "no_such_field=1"], "no_such_field"),
                          (["--group-size", "1"], "group_size"),
                          (["--seeds", "0"], "seeds"),
                          (["--sides", "r1flow,openrlhf"], "openrlhf")):
        p = subprocess.run([sys.executable, "benchmarks/learning.py", "--model", "tiny", "--sides", "r1flow",
                            "--work-dir", str(tmp_path), *extra], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and needle in p.stderr, (extra, p.stderr[-800:])
    assert not any(tmp_path.iterdir())  # nothing made


def test_bad_async_settings_fail_before_any_compute(tmp_path, monkeypatch, capsys):
    """learning.py's main in this process (its imports are loaded already): one `bad settings` line, exit 2,
    nothing made."""
    for extra, needle in ((["--async-staleness", "0"], "async_staleness: the r1flow_async side needs K >= 1"),
                          (["--async-placement", "local", "--r1flow-set", "policy_loss=gspo"],
                           "policy_loss: gspo does not go with async.max_staleness=1"),
                          (["--async-placement", "gpu"], "invalid choice: 'gpu'")):
        monkeypatch.setattr(sys, "argv", ["learning.py", "--model", "tiny", "--sides", "r1flow_async",
                                          "--work-dir", str(tmp_path), *extra])
        with pytest.raises(SystemExit) as e:
            learning.main()
        assert e.value.code == 2 and needle in capsys.readouterr().err, extra
    assert not any(tmp_path.iterdir())


def test_the_ray_placement_names_what_this_machine_lacks(monkeypatch):
    from benchmarks import learning_async, loopback_cluster

    assert learning_async.placement_problem(Plan(async_placement="local")) is None
    assert "with --device cuda use --async-placement local" in learning_async.placement_problem(Plan(device="cuda"))
    monkeypatch.setattr(loopback_cluster, "ray_installed", lambda: True)
    monkeypatch.setattr(loopback_cluster, "netns_available", lambda: False)
    assert learning_async.placement_problem(Plan()) == ("--async-placement ray needs root and `ip netns` for the "
                                                        "loopback cluster (or --async-placement local)")
    monkeypatch.setattr(loopback_cluster, "ray_installed", lambda: False)
    assert learning_async.placement_problem(Plan()).startswith("--async-placement ray needs Ray")


def fake_training(work, steps: int, extra: dict, curve_times: tuple[float, ...] = ()) -> dict:
    """What a faked training child returns: `steps` steps of 10 s each, its snapshots saved as directories by
    `Snapshots` (the curve's at `curve_times`, the equal-steps point or every step, as the parent asked)."""
    class Model:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)

    snaps = Snapshots(list(curve_times), Path(work) / "snapshots", extra.get("at_step"), bool(extra.get("every_step")))
    for step in range(1, steps + 1):
        snaps.after_step(Model(), step, 10.0 * step)
    return {"steps": steps, "train_s": 10.0 * steps, "snapshots": snaps.saved, "final": str(work),
            "final_kind": "adapter", "curve": [], "foreign_cpu": 0.0, "threads": 2}


def parent_args(tmp_path):
    """run_learning's arguments as main() parses them with no flags, the work dir under tmp_path."""
    import argparse

    return argparse.Namespace(work_dir=str(tmp_path / "w"), allocator="tuned", quiet_wait=0.0, trl_from=None,
                              r1flow_from=None, start_only=False, plot=None, json=None, markdown=None, resume=None)


def test_a_reused_trl_run_must_have_trained_on_the_same_plan(tmp_path):
    plan = Plan()
    raw = {"plan": dataclasses.asdict(plan), "runs": {"trl": [{"steps": 3}, {"steps": 4}, {"steps": 2}]},
           "evals": {}}
    (tmp_path / "learning.json").write_text(json.dumps(raw))
    tried = Plan(r1flow_extra={"dynamic_sampling": True})  # r1flow-only settings may differ
    assert learning_runs.reused_run(tmp_path, tried, "trl")["runs"]["trl"][0]["steps"] == 3
    assert learning_runs.reused_run(tmp_path, Plan(seeds=2), "trl")["runs"]["trl"][1]["steps"] == 4  # fewer seeds: fine
    with pytest.raises(SystemExit, match="it has 3 TRL seed"):
        learning_runs.reused_run(tmp_path, Plan(seeds=4), "trl")
    with pytest.raises(SystemExit, match="learning_rate was 0.0002, this run's is 0.001"):
        learning_runs.reused_run(tmp_path, Plan(learning_rate=1e-3), "trl")
    with pytest.raises(SystemExit, match="no learning.json"):
        learning_runs.reused_run(tmp_path / "nowhere", plan, "trl")
    raw["runs"]["trl"] = {"steps": 3}  # the one-seed version's layout
    (tmp_path / "learning.json").write_text(json.dumps(raw))
    with pytest.raises(SystemExit, match="one-seed version"):
        learning_runs.reused_run(tmp_path, plan, "trl")


def test_a_reused_r1flow_run_may_differ_in_trl_only_settings(tmp_path):
    """--r1flow-from: TRL's sensitivity rows train TRL only, against an earlier run's r1flow side of the same plan;
    TRL-only settings may differ, r1flow-only ones may not (that would be another r1flow)."""
    raw = {"plan": dataclasses.asdict(Plan()), "runs": {"r1flow": [{"steps": 9}]}, "evals": {}}
    (tmp_path / "learning.json").write_text(json.dumps(raw))
    tried = Plan(seeds=1, trl_extra={"per_device_train_batch_size": 64})
    assert learning_runs.reused_run(tmp_path, tried, "r1flow")["runs"]["r1flow"][0]["steps"] == 9
    with pytest.raises(SystemExit, match="--r1flow-from .*its r1flow_extra was {}, this run's is {'dynamic_sampling'"):
        learning_runs.reused_run(tmp_path, Plan(seeds=1, r1flow_extra={"dynamic_sampling": True}), "r1flow")
    with pytest.raises(SystemExit, match="--r1flow-from .*it has 1 r1flow seed"):
        learning_runs.reused_run(tmp_path, Plan(seeds=2), "r1flow")
    with pytest.raises(SystemExit, match="--trl-from .*that run has no TRL side"):
        learning_runs.reused_run(tmp_path, tried, "trl")


def test_a_trl_sensitivity_row_trains_trl_only_and_does_not_pair_unequal_steps(tmp_path, monkeypatch):
    """A first run trains both sides (TRL 3 steps, r1flow's equal-steps point at step 3); a second run with a TRL-only
    setting and --r1flow-from the first trains TRL alone (4 steps now), reuses r1flow's models and evaluations,
    compares the gains at equal wall-clock, and leaves out the equal-steps check (r1flow's point is at the other TRL
    run's step 3), saying so."""
    import argparse

    trained = []

    def fake_child(what, plan_file, work, log, allocator, quiet_wait=0.0, **extra):
        if what == "prep":
            Path(work).mkdir(parents=True)
            return {"start_dir": str(tmp_path / "start")}
        if what == "eval":
            names = [j["name"] for j in json.loads(Path(extra["jobs"]).read_text())]
            right = {n: {"start": 10, "trl_end_s0": 15}.get(n, 25) for n in names}  # of 40; r1flow's models 25
            return {n: evaluation([1] * k + [0] * (40 - k), [0] * 40) for n, k in right.items()}
        trained.append(what)
        tuned = bool(json.loads(Path(plan_file).read_text())["trl_extra"])
        steps = {"trl": 4 if tuned else 3, "r1flow": 5}[what]
        return fake_training(work, steps, extra)

    monkeypatch.setattr(learning, "run_learning_child", fake_child)
    monkeypatch.setattr(learning, "plot", lambda *a, **k: None)
    args = parent_args(tmp_path)
    first = learning.run_learning(Plan(seeds=1), ["trl", "r1flow"], args)
    assert trained == ["r1flow", "trl"] and first["summary"]["equal_steps"]["seeds"] == 1
    run_dir = next((tmp_path / "w").glob("run-*"))
    (run_dir / "learning.json").write_text(json.dumps(first))
    assert learning_runs.new_run_dir(tmp_path / "w") != run_dir  # a second run in the same second gets its own
    trained.clear()
    raw = learning.run_learning(Plan(seeds=1, trl_extra={"per_device_train_batch_size": 64}),
                                ["trl", "r1flow"], argparse.Namespace(**{**vars(args), "r1flow_from": str(run_dir)}))
    assert trained == ["trl"]
    assert raw["runs"]["r1flow"] == first["runs"]["r1flow"] and raw["runs"]["trl"][0]["steps"] == 4
    assert raw["evals"]["r1flow_end_s0"] == first["evals"]["r1flow_end_s0"]
    s = raw["summary"]
    assert s["equal_time"]["diff"] == pytest.approx(0.25)  # r1flow +15 of 40, TRL +5 of 40
    assert s["trl_only"] == {"per_device_train_batch_size": 64}
    assert "equal_steps" not in s
    assert s["equal_steps_unmatched"] == [{"seed": SEED, "trl_steps": 4, "r1flow_step": 3}]
    assert any("equal steps: not checked" in line and "step 3" in line for line in learning_report.verdict_lines(s))


def test_the_parent_alternates_sides_and_settles_equal_steps(tmp_path, monkeypatch):
    """run_learning with its children faked (no compute): seed 0 runs r1flow first, which saves every step since
    TRL's step count is not known yet, and keeps TRL's step 3 afterwards; seed 1 runs TRL first and r1flow saves
    step 3 only. Every seed's end and equal-steps models are evaluated, and the summary pairs them."""

    calls = []
    right = {"start": 0, "trl_end": 8, "r1flow_end": 20, "r1flow_equal_steps": 8}

    def fake_child(what, plan_file, work, log, allocator, quiet_wait=0.0, **extra):
        calls.append((what, extra.get("seed"), extra.get("at_step"), extra.get("every_step")))
        if what == "prep":
            Path(work).mkdir(parents=True)  # the child's work dir, renamed into the cache
            return {"start_dir": str(tmp_path / "start")}
        if what == "eval":
            names = [j["name"] for j in json.loads(Path(extra["jobs"]).read_text())]
            ones = {n: right.get(n.rsplit("_s", 1)[0], 0) for n in names}  # "r1flow_end_s1" -> r1flow_end's
            return {n: evaluation([1] * k + [0] * (40 - k), [0] * 40) for n, k in ones.items()}
        steps = {"trl": 3, "r1flow": 5}[what]
        return fake_training(work, steps, extra)

    monkeypatch.setattr(learning, "run_learning_child", fake_child)
    monkeypatch.setattr(learning, "plot", lambda *a, **k: None)
    args = parent_args(tmp_path)
    raw = learning.run_learning(Plan(seeds=2), ["trl", "r1flow"], args)
    assert [c for c in calls if c[0] in ("trl", "r1flow")] == [("r1flow", 0, None, 1), ("trl", 0, None, None),
                                                               ("trl", 1, None, None), ("r1flow", 1, 3, None)]
    for run in raw["runs"]["r1flow"]:
        assert [(s["name"], s["step"]) for s in run["snapshots"]] == [("equal_steps", 3)]
        assert Path(run["snapshots"][0]["adapter"]).is_dir()
    assert not list((tmp_path / "w").glob("run-*/seed0/r1flow/snapshots/step[1245]"))  # the others deleted
    assert [r["first"] for r in raw["runs"]["r1flow"]] == [True, False]
    assert [r["first"] for r in raw["runs"]["trl"]] == [False, True]
    assert {"r1flow_equal_steps_s0", "r1flow_equal_steps_s1", "trl_end_s1", "r1flow_end_s0"} <= set(raw["evals"])
    s = raw["summary"]
    assert s["equal_time"]["verdict"] == "met" and s["equal_time"]["diff"] == pytest.approx(0.3)
    assert s["equal_steps"]["verdict"] == "same" and s["equal_steps"]["seeds"] == 2


def test_a_stopped_run_goes_on_with_the_sides_it_had_not_finished(tmp_path, monkeypatch):
    """--resume: seed 0's two sides and seed 1's first (TRL) finished before the run was stopped during seed 1's
    r1flow side; the resumed run trains that side only (at TRL's step count, read from the kept TRL side), keeps
    the rest, and evaluates every model. A run directory of another plan is refused before any compute."""
    import argparse

    trained = []

    def fake_child(what, plan_file, work, log, allocator, quiet_wait=0.0, **extra):
        if what == "prep":
            Path(work).mkdir(parents=True)
            return {"start_dir": str(tmp_path / "start")}
        if what == "eval":
            names = [j["name"] for j in json.loads(Path(extra["jobs"]).read_text())]
            return {n: evaluation([1] * 10 + [0] * 30, [0] * 40) for n in names}
        if stop_at == (what, extra.get("seed")):
            Path(work, "snapshots", "step1").mkdir(parents=True)  # what a side killed part-way leaves
            raise KeyboardInterrupt
        trained.append((what, extra.get("seed"), extra.get("at_step")))
        steps = {"trl": 3, "r1flow": 5}[what]
        return fake_training(work, steps, extra)

    monkeypatch.setattr(learning, "run_learning_child", fake_child)
    monkeypatch.setattr(learning, "plot", lambda *a, **k: None)
    args = parent_args(tmp_path)
    stop_at = ("r1flow", 1)
    with pytest.raises(KeyboardInterrupt):
        learning.run_learning(Plan(seeds=2), ["trl", "r1flow"], args)
    assert trained == [("r1flow", 0, None), ("trl", 0, None), ("trl", 1, None)]
    run_dir = next((tmp_path / "w").glob("run-*"))
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.glob("seed*/*.json")) == [
        "seed0/r1flow.json", "seed0/trl.json", "seed1/trl.json"]
    kept = json.loads((run_dir / "seed0" / "r1flow.json").read_text())
    assert [s["name"] for s in kept["snapshots"]] == ["equal_steps"]  # kept after its equal-steps point settled

    with pytest.raises(SystemExit, match="its learning_rate was 0.0002, this run's is 0.001"):
        learning.run_learning(Plan(seeds=2, learning_rate=1e-3), ["trl", "r1flow"],
                              argparse.Namespace(**{**vars(args), "resume": str(run_dir)}))
    with pytest.raises(SystemExit, match="no plan.json"):
        learning_runs.resumed_run_dir(tmp_path, Plan())
    trained.clear()
    stop_at = None
    raw = learning.run_learning(Plan(seeds=2), ["trl", "r1flow"],
                                argparse.Namespace(**{**vars(args), "resume": str(run_dir)}))
    assert trained == [("r1flow", 1, 3)]
    assert not (run_dir / "seed1" / "r1flow" / "snapshots" / "step1").exists()  # the stopped attempt's leftovers
    assert [r["steps"] for r in raw["runs"]["trl"]] == [3, 3] and [r["steps"] for r in raw["runs"]["r1flow"]] == [5, 5]
    assert {f"{side}_end_s{k}" for side in ("trl", "r1flow") for k in (0, 1)} <= set(raw["evals"])
    assert raw["summary"]["equal_steps"]["seeds"] == 2

    # a finished run grows by the seeds it lacks; it never shrinks
    trained.clear()
    raw = learning.run_learning(Plan(seeds=3), ["trl", "r1flow"],
                                argparse.Namespace(**{**vars(args), "resume": str(run_dir)}))
    assert trained == [("r1flow", 2, None), ("trl", 2, None)]  # seed 2's order: r1flow first, as seed 0's
    assert [r["steps"] for r in raw["runs"]["trl"]] == [3, 3, 3] and raw["summary"]["equal_steps"]["seeds"] == 3
    assert json.loads((run_dir / "plan.json").read_text())["seeds"] == 3
    with pytest.raises(SystemExit, match="it ran 3 seeds, this run asks for 2"):
        learning_runs.resumed_run_dir(run_dir, Plan(seeds=2))


def test_the_split_seed_keys_the_start_model_and_the_report_says_which_split(tmp_path):
    """Split 0 is the tuning split (its held-out prompts chose the task and the batch); the default reports on split
    1, a fresh draw of the prompts and the cold start, so the two are different start models; the tiny task's overlap
    of the two held-out sets is counted from the prompts themselves."""
    from stages.base import LocalContext

    tuned, fresh = Plan(split_seed=0), Plan()
    assert fresh.split_seed == 1 and tuned.prep_key() != fresh.prep_key()
    assert learning_report.split_text(tuned, {}).startswith("Split seed 0: the tuning split")
    text = learning_report.split_text(fresh, {"tuning_overlap": {"held_out": 256, "also_in_tuning_split": 61}})
    assert "Split seed 1: a fresh draw" in text and "61 of its 256 scored held-out prompts" in text
    plan = Plan(split_seed=1, train_prompts=48, eval_prompts=16, transfer_prompts=4)
    prm = learning_children.make_prompts(plan, LocalContext(tmp_path / "fresh", seed=1))
    overlap = learning_children.tuning_overlap(plan, prm.path, tmp_path)
    zero = learning_children.make_prompts(plan, LocalContext(tmp_path / "zero", seed=0))
    same = learning_children.tuning_overlap(Plan(split_seed=0, train_prompts=48, eval_prompts=16, transfer_prompts=4),
                                            zero.path, tmp_path / "again")
    assert overlap["held_out"] == 16 and 0 <= overlap["also_in_tuning_split"] < 16
    assert same == {"held_out": 16, "also_in_tuning_split": 16}  # seed 0 against itself: every prompt


def test_trl_only_settings_are_parsed_and_checked_against_trls_config(monkeypatch):
    """--trl-set: KEY=VALUE read as YAML; a key that TRL's GRPOConfig lacks fails before any compute (a stand-in
    GRPOConfig here: TRL lives in the benchmark venv only)."""
    import dataclasses
    import types

    assert learning_plan.parse_set(["bf16=true", "per_device_train_batch_size=64"], "--trl-set") == {
        "bf16": True, "per_device_train_batch_size": 64}
    with pytest.raises(SystemExit, match="--trl-set 'bf16': expected KEY=VALUE"):
        learning_plan.parse_set(["bf16"], "--trl-set")

    @dataclasses.dataclass
    class GRPOConfig:
        bf16: bool = False
        per_device_train_batch_size: int = 8

    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=GRPOConfig))
    monkeypatch.setattr(learning_plan.importlib.util, "find_spec", lambda name: object())
    learning_plan.check_trl_extra({"bf16": True, "per_device_train_batch_size": 64})
    with pytest.raises(ValueError, match="--trl-set: use_paged is not a field of TRL's GRPOConfig"):
        learning_plan.check_trl_extra({"bf16": True, "use_paged": True})


# ---------------------------------------------------------------------------- time to accuracy (issue 60)


def curve_evals(n: int, curve: int, **models: list[int]) -> dict:
    """evals for the learning curves: "start" and every `side__what__k` given as how many of the first prompts it got
    right: end models on all n held-out prompts (and n transfer ones), snapshots ("t1", ...) on the first `curve`."""
    out = {"start": evaluation([0] * n, [0] * n)}
    for kind, right in models.items():
        side, what, k = kind.split("__")
        size = n if what == "end" else curve
        correct = [int(i < right) for i in range(size)]
        out[learning_stats.eval_name(side, what, int(k))] = (evaluation(correct, [0] * n) if what == "end"
                                                              else {"rows": rows(TASK, correct), "seconds": 1.0})
    return out


def curve_run(k: int, t1_s: float, end_s: float) -> dict:
    return {"seed": k, "first": None, "steps": 10, "train_s": end_s, "curve": [],
            "snapshots": [{"name": "t1", "step": 3, "elapsed_s": t1_s, "adapter": "-"}]}


def test_time_to_accuracy_rows_read_the_curves_and_give_each_verdict():
    """40 held-out prompts, the curves on the first 20; nothing right at the start; two identical seeds a side.
    TRL: 2 of 20 at 300 s, prompts 0-7 at the end (1200 s): its final accuracy on the curve prompts is 8/20 = 40%
    (20% on all 40: the start and end models are read on the curve prompts only), reached at 1200 s. r1flow: 20 of
    20 at 100 s, so it crosses 40% at 0.4 * 100 = 40 s: 30x, and in every replicate it gets there by 100 s while TRL
    needs 1200 (or 300, if a draw holds prompts 0-1 and none of 2-7: (14/20)^20 = 0.08%): the interval is far above
    4x: met. r1flow async: 20 of 20 at 50 s, sync's final 100% at 50 s against sync's 100 s: 2.0x in every replicate,
    [2, 2], at least 1/0.7 = 1.43x with the low end above 1: met. At equal wall-clock async ends right on prompts
    0-21 and sync on 0-19: +5 points, and a draw misses both extra prompts with probability (38/40)^40 = 13%, so
    the interval reaches 0: not below sync, pass."""
    n, curve = 40, 20
    evals = curve_evals(n, curve, **{f"{side}__{what}__{k}": right for k in (0, 1) for side, what, right in (
        ("trl", "t1", 2), ("trl", "end", 8), ("r1flow", "t1", 20), ("r1flow", "end", 20),
        ("r1flow_async", "t1", 20), ("r1flow_async", "end", 22))})
    runs = {"trl": [curve_run(k, 300.0, 1200.0) for k in (0, 1)],
            "r1flow": [curve_run(k, 100.0, 1200.0) for k in (0, 1)],
            "r1flow_async": [curve_run(k, 50.0, 1200.0) for k in (0, 1)]}
    s = learning_stats.summarize_learning(Plan(seeds=2, async_placement="local"), evals, runs)
    by = {(r["reference"], r["side"]): r for r in s["time_to_accuracy"]}
    assert list(by) == [("trl", "r1flow"), ("trl", "r1flow_async"), ("r1flow", "r1flow_async")]
    r = by["trl", "r1flow"]
    assert (r["target"], r["t_a"], r["t_b"], r["speedup"]) == (0.4, 1200.0, pytest.approx(40.0), pytest.approx(30.0))
    assert r["ci"][0] > 4.0 and r["never_reached_share"] == 0.0 and (r["seeds"], r["prompts"]) == (2, 20)
    assert r["reference_gain"]["gain"] == pytest.approx(0.4) and r["verdict"] == "met"
    assert by["trl", "r1flow_async"]["speedup"] == pytest.approx(60.0)  # 40% at 0.4 * 50 = 20 s
    r = by["r1flow", "r1flow_async"]
    assert (r["target"], r["t_a"], r["t_b"], r["speedup"], r["ci"]) == (1.0, 100.0, 50.0, 2.0, [2.0, 2.0])
    assert r["verdict"] == "met"
    assert s["async_equal_time"]["diff"] == pytest.approx(0.05) and s["async_equal_time"]["verdict"] == "same"
    assert s["async_equal_time"]["prompts"] == n
    text = "\n".join(learning_report.table(s) + learning_report.verdict_lines(s))
    assert "| r1flow async, budget | 10, 10 | 20.0, 20.0 | 55.0% [" in text
    assert ("time to accuracy, r1flow (sync) against TRL: wall-clock to reach TRL's final held-out accuracy (40.0% "
            "on the 20 curve prompts), 2 seed(s): TRL 20.0 min, r1flow (sync) 0.7 min: 30.00x [") in text
    assert "Goal (>= 6x, the interval's low end above 4x): met" in text
    assert ("time to accuracy, r1flow async (K=1, local) against r1flow (sync): wall-clock to reach r1flow (sync)'s "
            "final held-out accuracy (100.0% on the 20 curve prompts), 2 seed(s): r1flow (sync) 1.7 min, r1flow async "
            "(K=1, local) 0.8 min: 2.00x [2.00, 2.00]") in text
    assert "Goal (>= 1.43x, i.e. at most 0.7x sync's time, the interval's low end above 1x): met" in text
    assert ("equal wall-clock, r1flow async (K=1, local) minus r1flow (sync): +5.0 points [" in text
            and "(paired, two-sided; 2 seed(s), 40 held-out prompts): not below sync beyond the noise: pass" in text)


def test_time_to_accuracy_misses_never_reached_and_undetermined():
    """TRL as before (40% on the curve prompts at 1200 s). r1flow: 4 of 20 at 600 s, 6 of 20 (30%) at the end: it
    never reaches 40%, speed-up 0: MISSED, "never reached it". Async against sync's final 30%: sync gets there at
    1200 s; async has 2 of 20 at 600 s and 10 of 20 at 1200 s, crossing 30% at 600 + (0.3 - 0.1) / (0.5 - 0.1) * 600
    = 900 s: 1.33x, under 1/0.7: MISSED. Its end models: right on 10 prompts against sync's 6: higher. A TRL right on
    prompt 0 only: its gain on the curve prompts cannot be told from 0 (a draw misses it with probability
    (19/20)^20 = 36%): undetermined, whatever the speed-up."""
    n, curve = 40, 20
    evals = curve_evals(n, curve, **{f"{side}__{what}__{k}": right for k in (0, 1) for side, what, right in (
        ("trl", "t1", 2), ("trl", "end", 8), ("r1flow", "t1", 4), ("r1flow", "end", 6),
        ("r1flow_async", "t1", 2), ("r1flow_async", "end", 10))})
    runs = {side: [curve_run(k, t1, 1200.0) for k in (0, 1)]
            for side, t1 in (("trl", 300.0), ("r1flow", 600.0), ("r1flow_async", 600.0))}
    s = learning_stats.summarize_learning(Plan(seeds=2), evals, runs)
    by = {(r["reference"], r["side"]): r for r in s["time_to_accuracy"]}
    r = by["trl", "r1flow"]
    assert (r["t_b"], r["speedup"], r["verdict"]) == (None, 0.0, "MISSED") and r["never_reached_share"] > 0.5
    r = by["r1flow", "r1flow_async"]
    assert (r["t_a"], r["t_b"], r["verdict"]) == (1200.0, pytest.approx(900.0), "MISSED")
    assert r["speedup"] == pytest.approx(4 / 3)
    assert s["async_equal_time"]["verdict"] == "higher"
    text = "\n".join(learning_report.verdict_lines(s))
    assert "r1flow (sync) never reached it: 0.00x [" in text and "Goal (>= 6x, the interval's low end above 4x): MISSED" in text
    assert "r1flow async (K=1, ray) 15.0 min: 1.33x [" in text
    assert "higher beyond the noise: pass" in text
    evals.update(curve_evals(n, curve, trl__t1__0=0, trl__t1__1=0, trl__end__0=1, trl__end__1=1))
    s = learning_stats.summarize_learning(Plan(seeds=2), evals, runs)
    r = s["time_to_accuracy"][0]
    assert r["reference_gain"]["ci"][0] <= 0 and r["verdict"] == "undetermined"
    assert "undetermined (TRL's gain on these prompts, +5.0 [" in "\n".join(learning_report.verdict_lines(s))


def test_the_async_side_trains_after_each_seeds_pair_and_joins_the_verdicts(tmp_path, monkeypatch):
    """`--sides trl,r1flow,r1flow_async` with the children faked: each seed trains its r1flow/TRL pair in its turn,
    then r1flow_async (no equal-steps point, no cluster in the local placement); its end model and curve snapshot are
    evaluated (the snapshot on the curve prompts) and the summary has its time-to-accuracy rows and the equal
    wall-clock check. --resume after a stop during seed 1's async side trains that side only."""
    import argparse

    calls, stop_at = [], None
    right = {"start": 0, "trl_end": 8, "trl_t1": 2, "r1flow_end": 20, "r1flow_t1": 20, "r1flow_equal_steps": 8,
             "r1flow_async_end": 20, "r1flow_async_t1": 20}

    def fake_child(what, plan_file, work, log, allocator, quiet_wait=0.0, **extra):
        if what == "prep":
            Path(work).mkdir(parents=True)
            return {"start_dir": str(tmp_path / "start")}
        if what == "eval":
            out = {}
            for job in json.loads(Path(extra["jobs"]).read_text()):
                k, size = right[job["name"].rsplit("_s", 1)[0]], 40 if job["prompts"] == "prompts" else 20
                out[job["name"]] = evaluation([int(i < k) for i in range(size)], [0] * 40) if size == 40 else {
                    "rows": rows(TASK, [int(i < k) for i in range(size)]), "seconds": 1.0}
            return out
        if stop_at == (what, extra.get("seed")):
            raise KeyboardInterrupt
        calls.append((what, extra.get("seed"), extra.get("at_step"), extra.get("every_step"), extra.get("cluster")))
        steps = {"trl": 3, "r1flow": 5, "r1flow_async": 6}[what]
        return fake_training(work, steps, extra, curve_times=(20.0,))

    monkeypatch.setattr(learning, "run_learning_child", fake_child)
    monkeypatch.setattr(learning, "plot", lambda *a, **k: None)
    args = parent_args(tmp_path)
    plan = Plan(seeds=2, async_placement="local", async_staleness=2)
    sides = ["trl", "r1flow", "r1flow_async"]
    stop_at = ("r1flow_async", 1)
    with pytest.raises(KeyboardInterrupt):
        learning.run_learning(plan, sides, args)
    stop_at = None
    raw = learning.run_learning(plan, sides, argparse.Namespace(
        **{**vars(args), "resume": str(next((tmp_path / "w").glob("run-*")))}))
    assert [c[:2] for c in calls] == [("r1flow", 0), ("trl", 0), ("r1flow_async", 0), ("trl", 1), ("r1flow", 1),
                                      ("r1flow_async", 1)]
    assert all(c[2:] == (None, None, None) for c in calls if c[0] == "r1flow_async")
    assert [r["first"] for r in raw["runs"]["r1flow_async"]] == [None, None]
    assert {"r1flow_async_end_s0", "r1flow_async_t1_s1"} <= set(raw["evals"])
    assert len(raw["evals"]["r1flow_async_t1_s1"]["rows"]) == 20  # a snapshot on the curve prompts
    s = raw["summary"]
    assert [(r["reference"], r["side"]) for r in s["time_to_accuracy"]] == [
        ("trl", "r1flow"), ("trl", "r1flow_async"), ("r1flow", "r1flow_async")]
    assert s["async_equal_time"]["diff"] == 0.0 and s["async_side"] == {"max_staleness": 2, "placement": "local"}
    run_dir = next((tmp_path / "w").glob("run-*"))
    section = learning_report.learning_markdown_section(Plan(**json.loads((run_dir / "plan.json").read_text())),
                                                        "cmd", {"device_name": "cpu"}, "abc", s, raw["runs"], {},
                                                        run_dir / "learning.png")
    assert "r1flow's grpo with async {max_staleness: 2, rollout_workers: 1}, placement local: the rollout worker" in section


def test_the_async_side_on_the_cluster_checks_where_the_learner_and_worker_ran(tmp_path, monkeypatch):
    """The ray placement with the cluster faked: the side's child gets the cluster, and a run whose recorded node ids
    put the learner or the worker elsewhere than the `learn` and `gen` nodes fails in one line."""
    import contextlib
    import types

    node = types.SimpleNamespace
    cluster = node(running={"head": node(node_id="LEARN"), "worker": node(node_id="GEN")})
    where = {}

    @contextlib.contextmanager
    def fake_cluster(plan, side, work):
        yield cluster if side == "r1flow_async" else None

    def fake_child(what, plan_file, work, log, allocator, quiet_wait=0.0, **extra):
        if what == "prep":
            Path(work).mkdir(parents=True)
            return {"start_dir": str(tmp_path / "start")}
        if what == "eval":
            return {j["name"]: evaluation([1] * 4, [0] * 4) for j in json.loads(Path(extra["jobs"]).read_text())}
        assert extra["cluster"] is (cluster if what == "r1flow_async" else None)
        return {**fake_training(work, 2, extra), "async": dict(where)}

    monkeypatch.setattr(learning, "run_learning_child", fake_child)
    monkeypatch.setattr(learning, "side_cluster", fake_cluster)
    monkeypatch.setattr(learning, "plot", lambda *a, **k: None)
    where.update({"async.learner_node_id": "LEARN", "async.worker_node_ids": "GEN"})
    raw = learning.run_learning(Plan(seeds=1), ["r1flow", "r1flow_async"], parent_args(tmp_path))
    assert raw["runs"]["r1flow_async"][0]["async"]["async.worker_node_ids"] == "GEN"
    where["async.worker_node_ids"] = "LEARN"
    with pytest.raises(SystemExit, match=r"^learning.py: r1flow_async ran the learner on node LEARN and its worker on "
                                         r"LEARN, not on the learn \(LEARN\) and gen \(GEN\) nodes; log .*seed0-r1flow_async.log$"):
        learning.run_learning(Plan(seeds=1), ["r1flow", "r1flow_async"], parent_args(tmp_path / "again"))


def test_a_resumed_evaluation_keeps_what_was_evaluated_and_redoes_a_changed_model(tmp_path, monkeypatch):
    """Evaluating 48 models takes most of an hour on 2 cores: a run stopped during it keeps each finished result
    (`evals/<name>/result.json`) and a resumed run evaluates only the others; a model whose files changed since
    (a side trained again) is evaluated again, never served the old result."""
    from benchmarks import learning_children

    plan = Plan()
    adapters = {name: tmp_path / name for name in ("a", "b")}
    for path in adapters.values():
        path.mkdir()
        (path / "adapter.safetensors").write_bytes(b"weights")
    jobs = [{"name": name, "adapter": str(path), "prompts": "curve_prompts"} for name, path in adapters.items()]
    evaluated = []

    def fake(plan_, prep, batch, work):
        evaluated.extend(j["name"] for j in batch)
        return {j["name"]: {"rows": [{"prompt_id": "p0", "correct": len(evaluated)}], "seconds": 1.0} for j in batch}

    monkeypatch.setattr(learning_children, "_evaluate_jobs", fake)
    first = learning_children.evaluate_jobs(plan, {}, jobs, tmp_path / "eval")
    assert evaluated == ["a", "b"]
    assert learning_children.evaluate_jobs(plan, {}, jobs, tmp_path / "eval") == first and evaluated == ["a", "b"]
    (adapters["b"] / "adapter.safetensors").write_bytes(b"weights, trained again")
    again = learning_children.evaluate_jobs(plan, {}, jobs, tmp_path / "eval")
    assert evaluated == ["a", "b", "b"] and again["a"] == first["a"] and again["b"] != first["b"]


def test_the_cluster_cpu_counts_processes_that_end_before_the_run_does():
    """The async side's learner and worker are Ray worker processes that end with the job, reaped by no process of
    the namespace: read once after the run, their CPU time vanished and was counted as "other processes" (81-90% in
    the first run). Sampled while they live, a process that burned ~1 s of CPU and ended is counted."""
    import time

    from benchmarks.learning_async import ClusterCpu

    class OneProcessCluster:
        def __init__(self):
            self.proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                                          "while time.process_time() - t < 1.0: pass"])

        def processes(self):
            return [self.proc.pid] if self.proc.poll() is None else []

    cluster = OneProcessCluster()
    with ClusterCpu(cluster, every=0.05) as cpu:
        cluster.proc.wait()
        time.sleep(0.1)
    assert 0.6 <= cpu.seconds() <= 1.5, cpu.seconds()
    assert ClusterCpu(None).__enter__().seconds() == 0.0
