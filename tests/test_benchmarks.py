"""The benchmark suite's own logic (benchmarks/suite.py): medians, ratios, targets, RESULTS.md lines,
fixed-length synthetic data and the memory window. No TRL and no training here: that is `make bench`."""

import random

import pytest

from benchmarks import common, suite
from stages.models import build_tiny_tokenizer


def test_exact_text_has_the_asked_token_count():
    tok = build_tiny_tokenizer()
    rng = random.Random(0)
    for n in (1, 7, 32):
        assert len(tok(common.exact_text(tok, n, rng), add_special_tokens=False)["input_ids"]) == n


def test_synthetic_rows_validate_as_their_dataset_kinds():
    from schemas.datasets import from_rows

    tok = build_tiny_tokenizer()
    assert from_rows(common.sft_rows(tok, 3, 8, 16), "sft").num_rows == 3
    prefs = common.preference_rows(tok, 2, 8, 16)
    assert from_rows(prefs, "preferences").num_rows == 2
    assert prefs[0]["chosen"] != prefs[0]["rejected"]


def test_summaries_take_medians_of_warm_steps():
    s = suite.summarize("sft", {"step_s": [1.0, 3.0, 2.0], "batch": 4, "seq_len": 100.0, "peak_delta_mib": 10.0,
                                "peak_mib": 50.0})
    assert s["step_s"] == 2.0 and s["rate"] == pytest.approx(200.0)  # 4 x 100 tokens / 2 s
    d = suite.summarize("dpo", {"step_s": [0.5, 0.25], "batch": 2, "seq_len": 10.0, "peak_delta_mib": 1.0,
                                "peak_mib": 2.0, "reference_s": 3.0})
    assert d["rate"] == pytest.approx(2 / 0.375)
    steps = [{"generation": g, "scoring": 0.1, "training": 1.0, "total": g + 1.1, "completion_tokens": 64.0}
             for g in (1.0, 2.0, 4.0)]
    g = suite.summarize("grpo", {"steps": steps, "completions": 16, "peak_delta_mib": 1.0, "peak_mib": 2.0})
    assert g["generation"] == 2.0 and g["total"] == pytest.approx(3.1)
    assert g["mean_length"] == 4.0 and g["gen_tokens_per_s"] == 32.0
    assert suite.summarize("grpo", None) is None


def test_repeats_pool_their_steps_and_keep_each_repeats_ratio():
    def sft(steps, peak):
        return {"step_s": steps, "batch": 4, "seq_len": 100.0, "peak_delta_mib": peak, "peak_mib": peak + 5}

    ours = suite.pool([sft([1.0, 1.0], 10.0), sft([2.0, 2.0, 2.0], 12.0)])
    theirs = suite.pool([sft([4.0], 9.0), None, sft([3.0], 8.0)])
    assert ours["step_s"] == [1.0, 1.0, 2.0, 2.0, 2.0] and ours["peak_delta_mib"] == 12.0
    assert suite.summarize("sft", ours)["step_s"] == 2.0  # the median of all five warm steps
    assert theirs["step_s"] == [4.0, 3.0] and theirs["peak_mib"] == 14.0
    # repeat 1: 4.0 / 1.0; repeat 2: TRL failed, no ratio; repeat 3 has no r1flow run
    assert suite.repeat_ratios("sft", ours, theirs) == [4.0]
    assert suite.pool([None, None]) is None
    single = sft([1.0], 1.0)
    assert suite.pool([single]) is single and suite.repeat_ratios("sft", single, single) == []


def test_ratios_say_how_many_times_better_r1flow_is():
    assert suite.ratio(300.0, 100.0, higher_is_better=True) == 3.0  # throughput
    assert suite.ratio(0.5, 2.0, higher_is_better=False) == 4.0  # seconds or MiB
    assert suite.ratio(None, 2.0, True) is None
    assert suite.verdict("cpu", "grpo", 3.2).endswith("met)")
    assert "MISSED" in suite.verdict("cpu", "sft", 1.2)
    assert suite.verdict("cpu", "generation", 9.0) == ""


def test_report_lines_carry_ratio_device_and_command(capsys):
    shape = common.shape_for("cpu", "tiny", quick=True)
    sft = {"step_s": [1.0, 1.0], "batch": 8, "seq_len": 100.0, "peak_delta_mib": 100.0, "peak_mib": 500.0}
    steps = [{"generation": 1.0, "scoring": 0.1, "training": 0.5, "total": 1.6, "completion_tokens": 64.0}]
    res = {("sft", "r1flow"): sft, ("sft", "trl"): {**sft, "step_s": [2.0, 2.0], "peak_delta_mib": 200.0},
           ("grpo", "r1flow"): {"steps": steps, "completions": 16, "peak_delta_mib": 1.0, "peak_mib": 1.0},
           ("grpo", "trl"): None}
    lines = suite.report("tiny", "cpu", shape, res, "make bench", {"device_name": "cpu (2 cores)"})
    assert lines and all(" ratio " in ln and "command: make bench" in ln for ln in lines)
    sft_line = next(ln for ln in lines if "SFT tokens/s" in ln)
    assert "ratio 2.00x" in sft_line and "target >= 1.5x: met" in sft_line
    assert any("GRPO step" in ln and "TRL failed" in ln and "ratio n/a" in ln for ln in lines)
    assert "ratio 2.00x" in next(ln for ln in lines if "SFT peak memory" in ln)
    assert "tiny" in capsys.readouterr().out


def test_quick_shapes_shorten_runs_and_keep_grpo_batches_whole():
    for (device, model), shape in common.SHAPES.items():
        quick = common.shape_for(device, model, quick=True, lora_r=8)
        assert quick.lora_r == 8 and quick.grpo_steps <= shape.grpo_steps
        assert (shape.grpo_prompts * shape.grpo_group) % shape.grpo_minibatch == 0
    with pytest.raises(SystemExit):
        common.shape_for("cpu", "1b")


def test_peak_memory_window_sees_an_allocation():
    meter = common.PeakMemory("cpu")
    meter.start()
    block = bytearray(64 * 2**20)
    block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page so it is resident
    result = meter.result()
    del block
    assert result["peak_delta_mib"] >= 48
