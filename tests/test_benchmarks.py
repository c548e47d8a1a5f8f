"""The benchmark suite's own logic (benchmarks/suite.py, its numbers in benchmarks/speed_report.py): medians, ratios,
targets, the RESULTS.md section, the same allocator and prompts on both sides, fixed-length synthetic data and the
memory window. No TRL and no training here: that is `make bench`."""

import json
import random

import pytest

from benchmarks import common, speed_report, suite
from stages.modeling.models import build_tiny_tokenizer
from stages.runtime import host_memory

glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="malloc thresholds are glibc's (Linux)")


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
    s = speed_report.summarize_speed("sft", {"step_s": [1.0, 3.0, 2.0], "batch": 4, "seq_len": 100.0,
                                             "peak_delta_mib": 10.0, "peak_mib": 50.0})
    assert s["step_s"] == 2.0 and s["rate"] == pytest.approx(200.0)  # 4 x 100 tokens / 2 s
    d = speed_report.summarize_speed("dpo", {"step_s": [0.5, 0.25], "batch": 2, "seq_len": 10.0, "peak_delta_mib": 1.0,
                                             "peak_mib": 2.0, "reference_s": 3.0})
    assert d["rate"] == pytest.approx(2 / 0.375)
    steps = [{"generation": g, "scoring": 0.1, "training": 1.0, "total": g + 1.1, "completion_tokens": 64.0}
             for g in (1.0, 2.0, 4.0)]
    g = speed_report.summarize_speed("grpo", {"steps": steps, "completions": 16, "peak_delta_mib": 1.0,
                                              "peak_mib": 2.0})
    assert g["generation"] == 2.0 and g["total"] == pytest.approx(3.1)
    assert g["mean_length"] == 4.0 and g["gen_tokens_per_s"] == 32.0
    assert speed_report.summarize_speed("grpo", None) is None


def test_repeats_pool_their_steps_and_keep_each_repeats_ratio():
    def sft(steps, peak):
        return {"step_s": steps, "batch": 4, "seq_len": 100.0, "peak_delta_mib": peak, "peak_mib": peak + 5}

    ours = speed_report.pool([sft([1.0, 1.0], 10.0), sft([2.0, 2.0, 2.0], 12.0)])
    theirs = speed_report.pool([sft([4.0], 9.0), None, sft([3.0], 8.0)])
    assert ours["step_s"] == [1.0, 1.0, 2.0, 2.0, 2.0] and ours["peak_delta_mib"] == 12.0
    assert speed_report.summarize_speed("sft", ours)["step_s"] == 2.0  # the median of all five warm steps
    assert theirs["step_s"] == [4.0, 3.0] and theirs["peak_mib"] == 14.0
    # repeat 1: 4.0 / 1.0; repeat 2: TRL failed, no ratio; repeat 3 has no r1flow run
    assert speed_report.repeat_ratios("sft", ours, theirs) == [4.0]
    assert speed_report.pool([None, None]) is None
    single = sft([1.0], 1.0)
    assert speed_report.pool([single]) is single and speed_report.repeat_ratios("sft", single, single) == []


def test_ratios_say_how_many_times_better_r1flow_is():
    assert speed_report.ratio(300.0, 100.0, higher_is_better=True) == 3.0  # throughput
    assert speed_report.ratio(0.5, 2.0, higher_is_better=False) == 4.0  # seconds or MiB
    assert speed_report.ratio(None, 2.0, True) is None


def test_targets_are_smollm2s_and_the_tiny_model_is_a_smoke_run():
    assert speed_report.target_cell("smollm2", "cpu", "grpo", 3.2) == ">= 3x: met"
    assert speed_report.target_cell("smollm2", "cpu", "grpo_long", 2.9) == ">= 3x: MISSED"  # both GRPO shapes carry 3x
    assert speed_report.target_cell("smollm2", "cpu", "sft", 1.2) == ">= 1.5x: MISSED"
    assert speed_report.target_cell("smollm2", "cpu", "dpo", None) == ">= 1.5x: n/a"
    assert speed_report.target_cell("tiny", "cpu", "grpo", 1.0) == "smoke run"
    assert speed_report.target_cell("1b", "cuda", "sft", 9.0) == "-"
    assert {model for model, _, _ in speed_report.TARGETS} == {"smollm2"}


def _results():
    sft = {"step_s": [1.0, 1.0], "batch": 8, "seq_len": 100.0, "peak_delta_mib": 100.0, "peak_mib": 500.0}
    steps = [{"generation": 1.0, "scoring": 0.1, "training": 0.5, "total": 1.6, "completion_tokens": 64.0}]
    return {("sft", "r1flow"): sft, ("sft", "trl"): {**sft, "step_s": [2.0, 2.0], "peak_delta_mib": 200.0},
            ("grpo", "r1flow"): {"steps": steps, "completions": 16, "peak_delta_mib": 1.0, "peak_mib": 1.0},
            ("grpo", "trl"): None,
            ("grpo_long", "r1flow"): {"steps": steps, "completions": 32, "peak_delta_mib": 1.0, "peak_mib": 1.0},
            ("grpo_long", "trl"): {"steps": [{**steps[0], "total": 6.4}], "completions": 32, "peak_delta_mib": 2.0,
                                   "peak_mib": 2.0}}


def test_report_rows_carry_a_ratio_and_the_target(capsys):
    shape = common.shape_for("cpu", "smollm2", quick=True)
    shapes = {"sft": shape, "grpo": shape, "grpo_long": common.grpo_long_shape(shape, "cpu", "smollm2", quick=True)}
    rows = speed_report.report("smollm2", "cpu", shapes, _results())
    assert rows and all(r[3].startswith("ratio ") for r in rows)
    by_label = {r[0]: r for r in rows}
    assert by_label["SFT tokens/s"][3] == "ratio 2.00x" and by_label["SFT tokens/s"][4] == ">= 1.5x: met"
    assert by_label["GRPO 4x4x32 step"][2] == "failed" and by_label["GRPO 4x4x32 step"][3] == "ratio n/a"
    assert by_label["GRPO 4x8x128 step"][3] == "ratio 4.00x" and by_label["GRPO 4x8x128 step"][4] == ">= 3x: met"
    assert by_label["SFT peak memory (MiB over start)"][3] == "ratio 2.00x"
    assert "GRPO 4x8x128 mean completion tokens" in by_label
    assert "GRPO 4x8x128 step" in capsys.readouterr().out
    tiny = speed_report.report("tiny", "cpu", shapes, _results())
    assert {r[4] for r in tiny if r[0] in ("SFT tokens/s", "GRPO 4x8x128 step")} == {"smoke run"}


def test_results_section_states_command_and_environment_once_then_a_table_per_model():
    shape = common.shape_for("cpu", "smollm2")
    shapes = {"sft": shape, "grpo": shape, "grpo_long": common.grpo_long_shape(shape, "cpu", "smollm2")}
    rows = speed_report.report("smollm2", "cpu", shapes, _results())
    report = {"env": {"MALLOC_MMAP_THRESHOLD_": "1073741824", "R1FLOW_MALLOC_TUNING": "0"},
              "in_process_tuning": False, "heap_serves_48MiB": True, "heap_serves_160MiB": True}
    env = speed_report.environment_line("tuned", report, {"torch": "2.13", "threads": 2})
    tables = [(speed_report.shape_line("smollm2", "cpu", shapes), rows)]
    text = speed_report.speed_markdown_section('make bench ARGS="--models smollm2"', "cpu (2 cores)", "abc1234", env,
                                               tables, when="2026-11-26 08:00 UTC")
    lines = text.splitlines()
    assert lines[0] == "## 2026-11-26 08:00 UTC, cpu (2 cores), r1flow abc1234"
    assert sum("Command: `make bench" in ln for ln in lines) == 1
    assert sum(ln.startswith("Environment: allocator tuned, the same for r1flow and TRL") for ln in lines) == 1
    assert "MALLOC_MMAP_THRESHOLD_=1073741824" in text and "4x8x128" in text
    assert "| measurement | r1flow | TRL | ratio | target |" in lines
    table = [ln for ln in lines if ln.startswith("| ") and "measurement" not in ln]
    assert len(table) == len(rows) and all(ln.split(" | ")[3].startswith("ratio ") for ln in table)


def test_quick_shapes_shorten_runs_and_keep_grpo_batches_whole():
    for (device, model), shape in common.SHAPES.items():
        quick = common.shape_for(device, model, quick=True, lora_r=8)
        assert quick.lora_r == 8 and quick.grpo_steps <= shape.grpo_steps
        assert (shape.grpo_prompts * shape.grpo_group) % shape.grpo_minibatch == 0
    with pytest.raises(SystemExit):
        common.shape_for("cpu", "1b")


def test_the_second_grpo_shape_samples_longer_and_is_cpus_only():
    base = common.shape_for("cpu", "smollm2")
    long = common.grpo_long_shape(base, "cpu", "smollm2")
    assert (long.grpo_prompts, long.grpo_group, long.grpo_new_tokens) == (4, 8, 128)
    assert (long.grpo_prompts * long.grpo_group) % long.grpo_minibatch == 0 and long.sft_batch == base.sft_batch
    assert common.grpo_long_shape(base, "cpu", "smollm2", quick=True).grpo_steps == 1
    assert common.grpo_long_shape(common.shape_for("cuda", "smollm2"), "cuda", "smollm2") is None  # already 16x8x128


# ---------------------------------------------------------------------------- the same conditions on both sides


def test_every_child_gets_the_same_allocator_variables(monkeypatch, tmp_path):
    """run_speed_child gives r1flow's and TRL's processes one environment: the mode's variables, r1flow's own
    in-process tuning off (host_memory then leaves glibc alone), the caller's other variables kept."""
    import subprocess

    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen[cmd[cmd.index("--child") + 1]] = env
        return subprocess.CompletedProcess(cmd, 0, stdout=suite.RESULT_MARK + "{}\n")

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    monkeypatch.setenv("SOME_SETTING", "kept")
    shape = common.shape_for("cpu", "tiny")
    for mode in ("tuned", "glibc"):
        for what in ("r1flow:sft", "trl:sft", "r1flow:reference"):
            suite.run_speed_child(what, "cpu", tmp_path / "prep.json", shape, tmp_path, tmp_path / "log", allocator=mode)
        assert seen["r1flow:sft"] == seen["trl:sft"] == seen["r1flow:reference"]
        env = seen["trl:sft"]
        assert env["SOME_SETTING"] == "kept" and env["R1FLOW_MALLOC_TUNING"] == "0"
        assert not host_memory.tuning_wanted("cpu", env)
        malloc = {k: v for k, v in env.items() if k.startswith("MALLOC_")}
        if mode == "tuned":
            assert malloc == {"MALLOC_MMAP_THRESHOLD_": str(host_memory.KEEP_BYTES),
                              "MALLOC_TRIM_THRESHOLD_": str(host_memory.KEEP_BYTES)}
        else:
            assert malloc == {}


def test_the_callers_own_malloc_settings_are_refused_unless_the_mode_sets_them():
    tuned = common.ALLOCATOR_MODES["tuned"]
    assert common.allocator_env("tuned", {"MALLOC_MMAP_THRESHOLD_": tuned["MALLOC_MMAP_THRESHOLD_"]})
    assert common.allocator_env("glibc", {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"})["GLIBC_TUNABLES"]
    assert common.allocator_env("glibc", {"R1FLOW_MALLOC_TUNING": "1"})["R1FLOW_MALLOC_TUNING"] == "0"
    for mode, environ in (("glibc", {"MALLOC_MMAP_THRESHOLD_": "1073741824"}), ("tuned", {"MALLOC_ARENA_MAX": "2"}),
                          ("tuned", {"MALLOC_TRIM_THRESHOLD_": "131072"}),
                          ("glibc", {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1073741824"})):
        with pytest.raises(common.UnfairComparison, match="allocator settings in the environment"):
            common.allocator_env(mode, environ)


@glibc_only
def test_a_mixed_pair_is_refused(monkeypatch):
    """r1flow tuning glibc in-process (its default outside the suite) against TRL at glibc's defaults: the
    reports differ, and the suite stops instead of printing a ratio."""
    for name in ("R1FLOW_MALLOC_TUNING", *host_memory.USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    with common.AllocatorProbe() as probe, host_memory.reuse_freed_memory("cpu") as kept:
        pass
    assert kept and probe.report()["in_process_tuning"] and probe.report()["heap_serves_160MiB"]
    r1flow = {"allocator": probe.report()}
    trl = {"allocator": common.allocator_report(False)}
    assert trl["allocator"]["heap_serves_160MiB"] is False
    fair = suite.SameConditions()
    fair.check("smollm2 r1flow:sft", r1flow)
    with pytest.raises(common.UnfairComparison, match="different allocator settings"):
        fair.check("smollm2 trl:sft", trl)
    with pytest.raises(common.UnfairComparison, match="no allocator setting"):
        suite.SameConditions().check("smollm2 trl:sft", {"step_s": [1.0]})


@glibc_only
@pytest.mark.parametrize("mode", ["tuned", "glibc"])
def test_child_processes_report_the_same_allocator_on_both_sides(tmp_path, mode):
    """Real children started as the suite starts them (no training: the report alone; r1flow's through
    run_stage, where its in-process tuning would act): the same setting, and glibc doing what the mode says
    with a 160 MiB block (heap and kept once freed when tuned, a fresh mapping at glibc's defaults)."""
    prep = tmp_path / "prep.json"
    prep.write_text("{}")
    shape = common.shape_for("cpu", "tiny")
    fair = suite.SameConditions()
    for fw in speed_report.FRAMEWORKS:
        out = suite.run_speed_child(f"{fw}:allocator", "cpu", prep, shape, tmp_path, tmp_path / f"{fw}.log",
                                    timeout=300, allocator=mode)
        assert out is not None, (tmp_path / f"{fw}.log").read_text()
        fair.check(f"tiny {fw}:allocator", out)
    alloc = fair.allocator
    assert alloc["in_process_tuning"] is False and alloc["env"]["R1FLOW_MALLOC_TUNING"] == "0"
    assert alloc["heap_serves_160MiB"] is (mode == "tuned") and alloc["heap_serves_48MiB"] is (mode == "tuned")
    assert alloc["heap_keeps_freed_160MiB"] is (True if mode == "tuned" else None)
    assert json.dumps(alloc)  # goes into the result JSON as it is


def test_a_grpo_run_on_other_prompts_than_the_list_is_refused():
    alloc = {"env": {}, "in_process_tuning": False}
    listed = [["p1", "p2"], ["p3", "p4"]]
    fair = suite.SameConditions()
    assert fair.check("tiny r1flow:grpo", {"allocator": alloc, "step_prompts": listed}, listed)
    with pytest.raises(common.UnfairComparison, match="not the list both sides read"):
        fair.check("tiny trl:grpo", {"allocator": alloc, "step_prompts": [["p2", "p1"], ["p3", "p4"]]}, listed)
    assert fair.check("tiny trl:grpo", None, listed) is None  # a failed run: nothing to compare


def test_peak_memory_window_sees_an_allocation():
    meter = common.PeakMemory("cpu")
    meter.start()
    block = bytearray(64 * 2**20)
    block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page so it is resident
    result = meter.result()
    del block
    assert result["peak_delta_mib"] >= 48


def test_learning_summary_has_a_ppo_row_and_its_paired_difference_with_grpo():
    """`benchmarks/learning.py --algo grpo,ppo`: the table gains the row "r1flow PPO, budget", and the verdicts the
    paired PPO-minus-GRPO difference on the same held-out prompts (here GRPO right on 3 of 4, PPO on 1: -50 points)."""
    from benchmarks.learning_plan import TASK, Plan
    from benchmarks.learning_report import table, verdict_lines
    from benchmarks.learning_stats import summarize_learning

    def rows(correct):
        return [{"prompt_id": f"p{i}", "task": TASK, "correct": c, "format_ok": True, "num_tokens": 5}
                for i, c in enumerate(correct)]

    evals = {"start": {"rows": rows([0, 0, 0, 0])}, "r1flow_end_s0": {"rows": rows([1, 1, 1, 0])},
             "r1flow_ppo_end_s0": {"rows": rows([1, 0, 0, 0])}}
    runs = {"r1flow": [{"seed": 0, "snapshots": [], "steps": 10, "train_s": 60.0, "curve": []}],
            "r1flow_ppo": [{"seed": 0, "snapshots": [], "steps": 4, "train_s": 60.0, "curve": []}]}
    summary = summarize_learning(Plan(seeds=1), evals, runs)
    assert [r["label"] for r in summary["rows"]] == ["start model", "r1flow, budget", "r1flow PPO, budget"]
    assert summary["rows"][2]["steps"] == [4] and summary["rows"][2]["gain"]["gain"] == 0.25
    assert summary["ppo_minus_grpo"]["diff"] == -0.5
    assert any("PPO minus GRPO -50.0 points" in line for line in verdict_lines(summary))
    assert any(line.startswith("| r1flow PPO, budget | 4 |") for line in table(summary))


def test_grpo_phase_clock_counts_each_phase_without_its_nested_phases(monkeypatch):
    """benchmarks/grpo_phases.py: a phase's time is its own, less the phases nested in it (worked by hand: `other`
    runs 0-10 s, `rollout` 1-4 s inside it, then `forward` 5-6 s and `backward` 6-9 s: rollout 3, forward 1,
    backward 3, other 10 - 7 = 3); the device sync runs at every clock reading; the first step is the warm-up."""
    from benchmarks import grpo_phases

    ticks = iter([0.0, 1.0, 4.0, 5.0, 6.0, 6.0, 9.0, 10.0])
    monkeypatch.setattr(grpo_phases.time, "perf_counter", lambda: next(ticks))
    syncs = []
    clock = grpo_phases.PhaseClock(sync=lambda: syncs.append(1))
    clock.new_step()
    with clock.phase("other"):
        with clock.phase("rollout"):
            pass
        with clock.phase("forward"):
            pass
        with clock.phase("backward"):
            pass
    assert dict(clock.steps[0]) == {"rollout": 3.0, "forward": 1.0, "backward": 3.0, "other": 3.0}
    assert len(syncs) == 8
    later = {"rollout": 1.0, "other": 0.5}
    summary = grpo_phases.phase_summary([clock.steps[0], later, later])
    assert summary["first"]["step"] == 10.0 and summary["steps_measured"] == 2
    assert summary["mean"]["rollout"] == 1.0 and summary["mean"]["step"] == 1.5 and summary["mean"]["backward"] == 0.0


# ---------------------------------------------------------------------------- benchmarks/async_throughput.py (issue 60)

ASYNC_COLUMNS = ["placement", "K", "samples/s", "s/step", "t_gen s", "t_train s", "ceiling", "speed-up",
                 "share of ceiling", "overlap", "gen idle", "train idle", "staleness mean"]


def test_async_throughput_numbers_by_hand():
    """Worked by hand, 16 completions a step, steps after the first measured. Sync: steps end at 10, 14, 18 s, each
    3 s generating and 1 s training: 32 completions / 8 s = 4 samples/s, generation idle 1 - 3/4, training idle
    1 - 1/4, ceiling (3 + 1) / 3 = 4/3. K = 1: steps end at 10, 13, 16 s: 32 / 6 = 5.33 samples/s, 4/3 times the
    sync run's: the whole ceiling. A second repeat at half the K = 1 speed-up's gain (steps of 3.5 s: 32 / 7) makes
    the spread: mean and half the range over the repeats."""
    from benchmarks.async_throughput import order_of
    from benchmarks.async_throughput_report import markdown_table, summarize_run, throughput_rows

    def run(ends, gen, train, asynchronous=None):
        metrics = [(s, {"time/generation": gen - 0.5, "time/scoring": 0.5, "time/training": train,
                        **(asynchronous or {})}) for s in (1, 2, 3)]
        return {"clock": {str(s): t for s, t in zip((1, 2, 3), ends, strict=True)}, "metrics": [*metrics, (None, {})]}

    sync = summarize_run(run((10.0, 14.0, 18.0), 3.0, 1.0), 0, 1, 16)
    assert sync["samples_per_s"] == 4.0 and sync["s_per_step"] == 4.0 and sync["steps_measured"] == 2
    assert (sync["t_gen"], sync["t_train"], sync["overlap"], sync["staleness_mean"]) == (3.0, 1.0, 0.0, 0.0)
    assert sync["generation_idle"] == 0.25 and sync["training_idle"] == 0.75
    seen = {"async/overlap": 0.3, "async/generation_idle": 0.1, "async/training_idle": 0.6, "async/staleness_mean": 1.0}
    fast = summarize_run(run((10.0, 13.0, 16.0), 3.0, 1.0, seen), 1, 1, 16)
    assert fast["samples_per_s"] == pytest.approx(32 / 6) and fast["overlap"] == 0.3 and fast["staleness_mean"] == 1.0
    slower = summarize_run(run((10.0, 13.5, 17.0), 3.0, 1.0, seen), 1, 1, 16)
    runs = [{"placement": "local", "k": k, "repeat": r, **s}
            for k, r, s in ((0, 0, sync), (1, 0, fast), (0, 1, sync), (1, 1, slower))]
    rows = {row["k"]: row for row in throughput_rows(runs)}
    assert rows[0]["speedup"]["mean"] == 1.0 and rows[0]["ceiling"]["mean"] == pytest.approx(4 / 3)
    assert rows[1]["speedup"]["values"] == pytest.approx([4 / 3, 8 / 7])
    assert rows[1]["speedup"]["mean"] == pytest.approx((4 / 3 + 8 / 7) / 2)
    assert rows[1]["speedup"]["half_range"] == pytest.approx((4 / 3 - 8 / 7) / 2)
    assert rows[1]["ceiling_share"]["values"] == pytest.approx([1.0, (8 / 7) / (4 / 3)])
    assert "| local | 1 | 4.952 ± 0.381 | 3.25 ± 0.25 |" in markdown_table(list(rows.values()))
    assert order_of([0, 1, 2], 0) == [0, 1, 2] and order_of([0, 1, 2], 1) == [2, 1, 0]


def test_async_throughput_refuses_bad_settings_in_one_line_before_any_compute(tmp_path):
    import subprocess
    import sys

    from benchmarks.async_throughput import ROOT

    out = subprocess.run([sys.executable, "benchmarks/async_throughput.py", "--ks", "1,2", "--steps", "1",
                          "--placements", "local,moon", "--work", str(tmp_path / "w")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("async_throughput: --ks '1,2' must include 0")
    assert "--steps 1 above it" in out.stderr and "unknown ['moon']" in out.stderr
    assert not (tmp_path / "w").exists()


def _table(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return head, [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.mark.slow
def test_async_throughput_smoke_run_prints_every_column(tmp_path):
    """`benchmarks/async_throughput.py --model tiny`, 2 steps, K in {0, 1}, one machine: a row per K with every
    column, finite sane values (K = 0: speed-up 1, no overlap, staleness 0; K = 1: staleness 1 after the warm-up
    step), the threads split as said (K = 0: the learner 2; K = 1: learner 1 + worker 1 process), the environment
    printed, and the JSON written."""
    import math
    import subprocess
    import sys

    from benchmarks.async_throughput import ROOT

    out_json = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "benchmarks/async_throughput.py", "--model", "tiny", "--steps", "2",
                           "--ks", "0,1", "--placements", "local", "--repeats", "1", "--work", str(tmp_path / "w"),
                           "--json", str(out_json)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head, rows = _table(proc.stdout)
    assert head == ASYNC_COLUMNS
    assert [r[:2] for r in rows] == [["local", "0"], ["local", "1"]]
    values = {int(r[1]): dict(zip(head[2:], map(float, r[2:]), strict=True)) for r in rows}
    for k, v in values.items():
        assert all(math.isfinite(x) for x in v.values()), v
        assert v["samples/s"] > 0 and v["s/step"] > 0 and v["t_gen s"] > 0 and v["t_train s"] > 0, v
        assert 1.0 <= v["ceiling"] <= 2.0 and v["speed-up"] > 0, v
        assert v["share of ceiling"] == pytest.approx(v["speed-up"] / v["ceiling"], abs=0.011), v
        for key in ("overlap", "gen idle", "train idle"):
            assert 0.0 <= v[key] <= 1.0, (k, key, v)
    assert values[0]["speed-up"] == 1.0 and values[0]["overlap"] == 0.0 and values[0]["staleness mean"] == 0.0
    assert values[1]["staleness mean"] == 1.0
    for needle in ("- CPU: ", "MKL_CBWR=", "OMP_WAIT_POLICY=", "load average (1, 5, 15 min) at the start",
                   "Command: `.venv/bin/python benchmarks/async_throughput.py --model tiny"):
        assert needle in proc.stdout
    saved = json.loads(out_json.read_text())
    threads = {r["k"]: (r["learner_threads"], r["worker_threads"]) for r in saved["runs"]}
    assert threads == {0: ([2], None), 1: ([1], 1)}
    assert [r["placement_params"].get("async.placement") for r in saved["runs"]] == [None, "processes"]
