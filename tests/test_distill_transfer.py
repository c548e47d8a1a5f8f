"""The pure helpers of benchmarks/distill_transfer.py (distillation variants against their teacher, per slice)."""

from __future__ import annotations

import pytest

from benchmarks.distill_transfer import (
    against_traces_markdown,
    student_minus_teacher,
    students_minus,
    transfer_markdown,
    variant_command,
)


def test_a_variant_reruns_only_its_nodes_on_the_runs_cache():
    cmd = variant_command("r1flow", "cpu", "diverse", 2, "s.json")
    assert cmd[:8] == ["r1flow", "run", "--recipe", "r1", "--profile", "cpu", "--json", "s.json"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--only"] == ["traces", "distill", "eval_student",
                                                                        "eval_grpo_final"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] == [
        "traces.num_samples=8", "traces.generation.temperature=1.0", "distill.seed=2"]
    plain = variant_command("r", "tiny", "traces", 0, "x")
    assert [plain[i + 1] for i, a in enumerate(plain) if a == "--set"] == ["distill.seed=0"]


def test_student_minus_teacher_over_seeds_and_prompts():
    teacher = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0}
    same = [dict(teacher), dict(teacher)]
    assert student_minus_teacher(teacher, same, ["a", "b", "c", "d"], resamples=200) == (0.0, 0.0, 0.0)
    worse = [{"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}, {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}]
    mean, low, high = student_minus_teacher(teacher, worse, ["a", "b", "c", "d"], resamples=2000)
    assert mean == pytest.approx(-3 / 8)  # seed 0 loses a (-1/4), seed 1 loses a and c (-2/4)
    assert -1.0 <= low < mean < high <= 0.0
    # only the slice's prompts count
    assert student_minus_teacher(teacher, worse, ["b", "d"], resamples=200) == (0.0, 0.0, 0.0)


def test_the_table_has_a_row_per_variant_and_slice():
    results = {"teacher": {"transfer": {"prompts": 4, "accuracy": 0.5}},
               "variants": {"logits": {"transfer": {"accuracy": [0.25, 0.5], "minus_teacher": (-0.125, -0.5, 0.0),
                                                    "distill_seconds": [61.0, 58.4]}}}}
    assert transfer_markdown(results)[2] == ("| logits | transfer | 4 | 50.0% | 25.0%, 50.0% | -12.5 [-50.0, +0.0] | "
                                             "61, 58 |")


def test_a_variant_against_the_traces_variant_pairs_seed_k_with_seed_k():
    traces = [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}]
    diverse = [{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 0.0}]
    mean, low, high = students_minus(traces, diverse, ["a", "b"], resamples=2000)
    assert mean == pytest.approx(0.5)  # seed 0 gains b (+1/2), seed 1 gains a (+1/2)
    assert 0.0 <= low <= mean <= high <= 1.0
    assert students_minus(traces, traces, ["a", "b"], resamples=200) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="2 students against 1 baselines"):
        students_minus(traces[:1], diverse, ["a"])
    results = {"variants": {"traces": {"transfer": {}},
                            "diverse": {"transfer": {"minus_traces": (0.5, 0.0, 1.0)}}}}
    assert against_traces_markdown(results)[2:] == ["| diverse | transfer | +50.0 [+0.0, +100.0] |"]
