"""The pure helpers of benchmarks/vllm_cpu.py (vLLM's CPU build against r1flow's decode) and learning_vllm.py (GRPO
on vLLM against r1flow's decode), on hand-made numbers.
They run in r1flow's own venv: the benchmark's module imports no vLLM until an engine starts."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.learning_vllm import backend_markdown, backend_order, field_scores, side_command
from benchmarks.vllm_cpu import (
    first_divergence,
    greedy_agreement,
    median_and_range,
    prefix_logprob_gaps,
    rounding_explains,
    side_order,
    speed_summary,
    vllm_results_table,
)


def test_first_divergence_is_the_first_differing_token_or_the_end_of_a_prefix():
    assert first_divergence((5, 6, 7), (5, 6, 7)) is None
    assert first_divergence((5, 6, 7), (5, 9, 7)) == 1
    assert first_divergence((5, 6, 7), (4, 6, 7)) == 0
    assert first_divergence((5, 6), (5, 6, 2)) == 2  # one side stopped (EOS 2 is a token of the other)
    assert first_divergence((), ()) is None


def test_greedy_agreement_counts_identical_rows_and_names_where_the_others_part():
    got = greedy_agreement([(1, 2, 3), (1, 2), (4,), (7, 8)], [(1, 2, 3), (1, 5), (4,), (7, 8, 9)])
    assert got == {"rows": 4, "identical": 2, "share": 0.5, "differ": [(1, 1), (3, 2)]}
    with pytest.raises(ValueError, match="greedy_agreement: 1 rows against 2"):
        greedy_agreement([(1,)], [(1,), (2,)])


def test_prefix_logprob_gaps_compare_only_tokens_both_sides_scored_after_the_same_context():
    """Row 0 agrees throughout: gaps |-0.5 - -0.4| = 0.1 and |-1.0 - -1.25| = 0.25. Row 1 parts at position 1: only
    position 0 counts, |-2.0 - -2.0| = 0 (position 1's log-probs are of different tokens, -3.0 and -9.0)."""
    gaps = prefix_logprob_gaps([((1, 2), (-0.5, -1.0)), ((3, 4), (-2.0, -3.0))],
                               [((1, 2), (-0.4, -1.25)), ((3, 5), (-2.0, -9.0))])
    assert gaps == pytest.approx([0.1, 0.25, 0.0])


def test_a_flip_is_rounding_only_within_twice_the_largest_gap_between_the_sides():
    """Each log-prob of the margin may be off by the largest gap, 1e-5: a margin up to 2e-5 can flip by rounding."""
    assert rounding_explains(2e-5, 1e-5)
    assert rounding_explains(1e-6, 1e-5)
    assert not rounding_explains(2.1e-5, 1e-5)
    assert not rounding_explains(0.3, 1e-5)


def test_median_and_range_of_repeats():
    assert median_and_range([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert median_and_range([]) == {"median": None, "min": None, "max": None, "n": 0}


def test_the_sides_alternate_by_repeat():
    assert [side_order(r) for r in range(3)] == [("vllm", "r1flow"), ("r1flow", "vllm"), ("vllm", "r1flow")]


def test_speed_summary_pairs_each_repeats_sides_into_a_ratio():
    """Eval 8 x 32: repeat 0 vLLM 100 against r1flow 50 tokens/s (2.0x), repeat 1 90 against 60 (1.5x): ratios'
    median 1.75. A repeat with one side only (GRPO's) has no ratio, and each side's median is over its own repeats."""
    def rec(kind, side, repeat, tps, samples=1):
        return {"kind": kind, "side": side, "repeat": repeat, "tokens_per_s": tps, "prompts": 8, "samples": samples,
                "max_new_tokens": 32}

    rows = speed_summary([rec("eval", "vllm", 0, 100.0), rec("eval", "r1flow", 0, 50.0), rec("eval", "r1flow", 1, 60.0),
                          rec("eval", "vllm", 1, 90.0), {"kind": "agreement", "share": 1.0},
                          rec("grpo", "vllm", 0, 40.0, samples=4)])
    assert rows == [
        {"kind": "eval", "prompts": 8, "samples": 1, "max_new_tokens": 32,
         "vllm": {"median": 95.0, "min": 90.0, "max": 100.0, "n": 2},
         "r1flow": {"median": 55.0, "min": 50.0, "max": 60.0, "n": 2},
         "ratio": {"median": 1.75, "min": 1.5, "max": 2.0, "n": 2}},
        {"kind": "grpo", "prompts": 8, "samples": 4, "max_new_tokens": 32,
         "vllm": {"median": 40.0, "min": 40.0, "max": 40.0, "n": 1},
         "r1flow": {"median": None, "min": None, "max": None, "n": 0},
         "ratio": {"median": None, "min": None, "max": None, "n": 0}},
    ]


def test_the_markdown_table_reads_each_measurement():
    """The end of a run (a crash there would lose a 20-minute run's table): one row per shape and metric, start-up,
    sync, agreement, and a line per divergence."""
    records = [
        {"kind": "startup", "load_s": 2.0, "import_s": 10.0, "engine_s": 35.0, "kv_cache_gib": "1"},
        *[{"kind": "eval", "side": side, "repeat": r, "prompts": 8, "samples": 1, "max_new_tokens": 32,
           "tokens_per_s": tps, "tokens_per_cpu_s": tps / 2}
          for side, r, tps in (("vllm", 0, 30.0), ("r1flow", 0, 60.0), ("r1flow", 1, 50.0), ("vllm", 1, 40.0))],
        {"kind": "weight_sync", "median": 1.2, "min": 1.0, "max": 1.5, "n": 3, "gap_after_push": 2e-5,
         "gap_one_move_unpushed": 0.02},
        {"kind": "agreement", "prompts": 4, "max_new_tokens": 32, "identical": 3, "share": 0.75,
         "max_logprob_gap": 3e-5, "divergences": [
             {"row": 2, "position": 7, "margin": 1e-5, "rounding": True,
              "r1flow": {"id": 1, "text": " 4", "logprob": -0.69, "rank": 1},
              "vllm": {"id": 2, "text": " 5", "logprob": -0.69001, "rank": 2}}]},
    ]
    assert vllm_results_table(records).splitlines() == [
        "| measurement | vLLM-CPU | r1flow | vLLM / r1flow |",
        "|---|---|---|---|",
        "| eval 8 x 32 (greedy), tokens/s | 35.0 (30.0-40.0) | 55.0 (50.0-60.0) | 0.65x (0.50-0.80) |",
        "| eval 8 x 32 (greedy), tokens per CPU-s | 17.5 (15.0-20.0) | 27.5 (25.0-30.0) | 0.65x (0.50-0.80) |",
        "| start-up, s | engine 35.0 (import 10.0) | model load 2.0 | - |",
        "| weight sync, s (3 pushes) | 1.200 (1.000-1.500) | - | - |",
        "| largest log-prob gap after the last push / one move unpushed | 2.00e-05 / 2.00e-02 | - | - |",
        "| identical greedy completions, 4 x 32 | 3 of 4 (75.0%); of the others, 1 of 1 within rounding (largest "
        "log-prob gap on agreed tokens 3.00e-05) | - | - |",
        "",
        "- prompt 2, token 7: top-2 margin 1.00e-05; r1flow ' 4' (rank 1, log-prob -0.6900), vLLM ' 5' (rank 2, "
        "log-prob -0.6900); within rounding",
    ]


def test_learning_vllm_alternates_the_backends_and_scores_every_greedy_row():
    assert backend_order(0) == ("transformers", "vllm") and backend_order(1) == ("vllm", "transformers")
    rows = [{"prompt_id": "a", "mode": "greedy", "correct": True, "format_ok": True},
            {"prompt_id": "b", "mode": "greedy", "correct": None, "format_ok": False},  # unscored: counts as wrong
            {"prompt_id": "a", "mode": "sampled", "correct": False, "format_ok": True}]
    assert field_scores(rows, "correct") == {"a": 1.0, "b": 0.0}
    assert field_scores(rows, "format_ok") == {"a": 1.0, "b": 0.0}
    results = {"prompts": 2, "seeds": 1, "sets": [], "fields": {"correct": {
        "base": 0.25, "transformers": 0.5, "vllm": 0.75, "gain_transformers": [0.25, 0.0, 0.5],
        "gain_vllm": [0.5, 0.25, 0.75], "diff": [0.25, -0.1, 0.6], "verdict": "same"}},
        "sides": {"vllm": [{"grpo_seconds": 61.2, "steps": 12, "reward_last_half": 0.5,
                            "sampler/logprob_delta_mean": 1e-5, "sampler/logprob_delta_p99": 2e-5,
                            "sampler/logprob_delta_max": None}]}}
    md = backend_markdown(results)
    assert "| correct | 25.0% | 50.0% | 75.0% | +25.0 [+0.0, +50.0] | +50.0 [+25.0, +75.0] | +25.0 [-10.0, +60.0] | same |" in md
    assert "| vllm | 0 | 61 | 12 | 0.500 | 1.00e-05 | 2.00e-05 | - |" in md


def test_learning_vllm_runs_only_the_grpo_node_and_the_two_evals():
    args = argparse.Namespace(recipe="r1", profile="cpu", node="grpo_reasoning", eval="eval_grpo_reasoning",
                              base_eval="eval_sft_cold", set=["grpo_reasoning.steps=30"])
    cmd = side_command("r1flow", args, 2, "vllm", "s.json")
    assert cmd[:8] == ["r1flow", "run", "--recipe", "r1", "--profile", "cpu", "--json", "s.json"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--only"] == ["grpo_reasoning", "eval_grpo_reasoning",
                                                                        "eval_sft_cold"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] == [
        "grpo_reasoning.seed=2", "grpo_reasoning.generation.backend=vllm", "grpo_reasoning.steps=30"]


def test_learning_vllm_computes_the_shared_upstream_once_before_the_sides():
    from benchmarks.learning_vllm import prepare_command, upstream_nodes
    from flows.plan.recipes import load_plan

    args = argparse.Namespace(recipe="r1", profile="tiny", node="grpo_reasoning", eval="eval_grpo_reasoning",
                              base_eval="eval_sft_cold", set=["grpo_reasoning.steps=30"])
    nodes = upstream_nodes(load_plan("r1", "tiny"), args)
    assert nodes == ["base", "prompts", "cold_start", "sft_cold", "eval_sft_cold"]
    assert prepare_command("r1flow", args, nodes) == [
        "r1flow", "run", "--recipe", "r1", "--profile", "tiny", "--only", "base", "--only", "prompts",
        "--only", "cold_start", "--only", "sft_cold", "--only", "eval_sft_cold", "--set", "grpo_reasoning.steps=30"]
    zero = argparse.Namespace(recipe="r1-zero", profile="tiny", node="grpo", eval="eval_grpo", base_eval="eval_base", set=[])
    assert upstream_nodes(load_plan("r1-zero", "tiny"), zero) == ["base", "prompts", "eval_base"]
