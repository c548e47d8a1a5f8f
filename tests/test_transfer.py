"""Issue 63 items 5 and 6 (first half): held-out transfer tasks and their slice of the report.

gsm_symbolic (reasoning-gym's grade-school word problems, built from templates shipped in the package) is a
fixed-seed, offline eval task whose answers r1flow's verifier scores as reasoning-gym does; a task named `NAME-LABEL`
is a variant of a trained task held out under its own name (new phrasings, a wider number range); every eval splits
its prompts into the trained kind and the held-out-only tasks (transfer), reports each slice's accuracy with its
interval, and the report's gains are paired per slice too. The cpu profile's transfer slice is sized for a paired
gain's 95% interval of +-10 points."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import pytest

import stages.eval as eval_stage
from flows.cli.app import main
from flows.plan.recipes import load_plan
from flows.plan.results import fmt_metric
from flows.report.comparison import accuracy_columns
from flows.report.gains import prompt_slices, prompts_for_interval, slice_gains
from flows.report.tables import read_tables
from schemas.configs import PromptsConfig
from schemas.errors import ConfigError
from stages.prompts import build_prompts, check
from stages.rewards.verifiers import score
from tests.conftest import harness_home


@pytest.fixture()
def no_network(monkeypatch):
    """Any connection attempt fails the test: what is built here is built offline."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network use: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def gsm_rows(seed: int, size: int = 6) -> list[dict]:
    cfg = PromptsConfig(tasks={}, eval_tasks={"gsm_symbolic": {}}, eval_size=size)
    return build_prompts(cfg, seed)


def test_gsm_symbolic_rows_are_built_offline_with_a_fixed_seed(no_network):
    """The same seed gives the same prompts (ids, questions, answers), another seed others; every row is held out
    (split eval), named gsm_symbolic, scored by reasoning-gym's checker, and its answer is an integer."""
    first, again, other = gsm_rows(1), gsm_rows(1), gsm_rows(2)
    assert [(r["id"], r["messages"], r["answer"]) for r in first] == [(r["id"], r["messages"], r["answer"])
                                                                      for r in again]
    assert {r["id"] for r in first}.isdisjoint({r["id"] for r in other})
    assert len(first) == 6
    assert {(r["task"], r["split"], r["verifier"]) for r in first} == {("gsm_symbolic", "eval", "reasoning_gym")}
    assert all(re.fullmatch(r"-?\d+", r["answer"]) for r in first), [r["answer"] for r in first]
    assert not any("gsm8k" in json.dumps(r).lower() for r in first)  # never called GSM8K


def test_r1flows_verifier_scores_gsm_symbolic_as_reasoning_gym_does():
    """On real items: the gold answer in the answer block is right, also as `288.0`; a wrong number is wrong; and for
    each candidate answer r1flow's verdict is reasoning-gym's own score_answer (>= 1 is correct). reasoning-gym reads
    the first number of the answer, so `1,288` reads as 1: a thousands separator is wrong, as in reasoning-gym."""
    import reasoning_gym

    check_answer = reasoning_gym.get_score_answer_fn("gsm_symbolic")
    for row in gsm_rows(1, size=5):
        gold = row["answer"]
        entry = {"question": json.loads(row["metadata"])["question"], "answer": gold,
                 "metadata": json.loads(row["metadata"])}
        for answer in (gold, f"{gold}.0", str(int(gold) + 1), f"{gold} apples", f"1,{gold}", "none"):
            verdict = score(row, f"<think>so</think><answer>{answer}</answer>")
            assert verdict.correct == (check_answer(answer, entry) >= 1.0), (gold, answer)
        assert score(row, f"<think>so</think><answer>{gold}</answer>").correct
        assert score(row, f"<think>so</think><answer>{gold}.0</answer>").correct
        assert not score(row, f"<think>so</think><answer>{int(gold) + 1}</answer>").correct


def test_a_variant_of_a_trained_task_is_held_out_under_its_own_name():
    """`basic_arithmetic-phrased` is basic_arithmetic in reasoning-gym's natural phrasings: its own task name, ids
    and seed, scored by basic_arithmetic's checker (metadata's source_dataset); a question the train split has is
    dropped from the held-out-only tasks (a variant with the trained task's own options draws mostly trained
    questions: 4 of 32 here); an unknown generator is one ConfigError."""
    trained = {"basic_arithmetic": {"max_terms": 2, "max_digits": 1, "allow_negation": False}}
    cfg = PromptsConfig(tasks=trained, size=512, eval_size=32, eval_tasks={
        "basic_arithmetic-phrased": {**trained["basic_arithmetic"], "format_style": "natural"},
        "basic_arithmetic-same": trained["basic_arithmetic"]})
    check(cfg)
    rows = build_prompts(cfg, 0)
    train = {r["messages"][-1]["content"] for r in rows if r["split"] == "train"}
    phrased = [r for r in rows if r["task"] == "basic_arithmetic-phrased"]
    same = [r for r in rows if r["task"] == "basic_arithmetic-same"]
    assert len(phrased) == 32 and {r["split"] for r in phrased} == {"eval"}
    assert not any(r["messages"][-1]["content"].startswith("Calculate") for r in phrased)  # the trained phrasing
    assert all(json.loads(r["metadata"])["source_dataset"] == "basic_arithmetic" for r in phrased)
    assert len(same) < 32 and not {r["messages"][-1]["content"] for r in same + phrased} & train
    r = phrased[0]
    assert score(r, f"<think>x</think><answer>{r['answer']}</answer>").correct
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'no_such-phrased'"):
        check(PromptsConfig(eval_tasks={"no_such-phrased": {}}))


def row(pid: str, task: str, correct: bool | None, mode: str = "greedy") -> dict:
    return {"prompt_id": pid, "task": task, "mode": mode, "sample_index": 0, "correct": correct,
            "correct_lenient": correct, "format_ok": True, "num_tokens": 5, "finish_reason": "stop"}


def test_slices_and_their_metrics_by_hand():
    """Tasks with train-split prompts are the trained kind, the rest transfer. Rows: trained a (3 greedy: right,
    right, wrong -> 2/3), transfer b and c (b right, c wrong, c unscored -> 1/2 over the 2 scored; 3 greedy prompts);
    a sampled row counts for neither. An eval of one slice only has the per-task flags and no slice metrics."""
    slices = eval_stage.task_slices([{"task": "a", "split": "train"}, {"task": "a", "split": "eval"},
                                     {"task": "b", "split": "eval"}, {"task": "c", "split": "eval"}])
    assert slices == {"a": "trained", "b": "transfer", "c": "transfer"}
    rows = [row("1", "a", True), row("2", "a", True), row("3", "a", False), row("4", "b", True),
            row("5", "c", False), row("6", "c", None), row("1", "a", False, mode="sampled")]
    m = eval_stage.slice_metrics(rows, slices, k=0)
    assert (m["a/transfer"], m["b/transfer"], m["c/transfer"]) == (0.0, 1.0, 1.0)
    assert m["slice/trained/accuracy"] == pytest.approx(2 / 3) and m["slice/trained/prompts"] == 3
    assert m["slice/transfer/accuracy"] == pytest.approx(1 / 2) and m["slice/transfer/prompts"] == 3
    assert m["slice/trained/accuracy_ci_low"] <= 2 / 3 <= m["slice/trained/accuracy_ci_high"]
    assert eval_stage.slice_metrics(rows[:3], slices, k=0) == {"a/transfer": 0.0}


def test_per_slice_gains_by_hand():
    """Six prompts: trained t1-t3 before 0 0 1, after 1 1 1 -> +2/3; transfer x1-x3 before 0 1 0, after 0 0 1 -> 0.
    The slice of a prompt comes from its task's `<task>/transfer` metric; one slice only, or an older eval without
    the metrics: no slices."""
    rows = [row(p, "a" if p[0] == "t" else "b", False) for p in ("t1", "t2", "t3", "x1", "x2", "x3")]
    slices = prompt_slices(rows, {"a/transfer": 0.0, "b/transfer": 1.0})
    assert slices == {"t1": "trained", "t2": "trained", "t3": "trained",
                      "x1": "transfer", "x2": "transfer", "x3": "transfer"}
    assert prompt_slices(rows, {}) == {} and prompt_slices(rows[:3], {"a/transfer": 0.0}) == {}
    before = dict(zip(slices, [0.0, 0.0, 1.0, 0.0, 1.0, 0.0], strict=True))
    after = dict(zip(slices, [1.0, 1.0, 1.0, 0.0, 0.0, 1.0], strict=True))
    gains = slice_gains(before, after, slices)
    assert list(gains) == ["trained", "transfer"]
    assert gains["trained"]["gain"] == pytest.approx(2 / 3) and gains["trained"]["prompts"] == 3
    assert gains["transfer"]["gain"] == pytest.approx(0.0) and gains["transfer"]["prompts"] == 3


def test_prompts_for_a_paired_gains_interval():
    """n = ceil(z^2 (discordant - gain^2) / h^2), z = 1.959964: discordant 0.5, h 0.10 -> 3.841459 * 0.5 / 0.01 =
    192.07 -> 193 (the cpu profile's transfer slice); discordant 0.3 -> 115.2 -> 116; discordant 0.25 at a gain of
    0.1 -> 3.841459 * 0.24 / 0.01 = 92.2 -> 93; the 32 chain_sum prompts of before: +-24.5 points at 0.5."""
    assert prompts_for_interval(0.10) == 193
    assert prompts_for_interval(0.10, discordant=0.3) == 116
    assert prompts_for_interval(0.10, discordant=0.25, gain=0.1) == 93
    assert 1.959964 * math.sqrt(0.5 / 32) == pytest.approx(0.245, abs=1e-3)


def test_the_cpu_default_eval_has_a_transfer_slice_of_127_prompts():
    """The default run (recipe r1, profile cpu): every eval's held-out prompts are 257 of the trained kind and 127
    of held-out-only tasks (chain_sum, new phrasings, two-digit operands), enough for +-10 points where two models
    disagree on a third of them (the run's time bounds the eval: 384 prompts, 2 batches of 192)."""
    plan = load_plan("r1", "cpu")
    rows = build_prompts(plan.node("prompts").config, plan.node("prompts").seed)
    import pyarrow as pa

    picked = eval_stage.round_robin_prompts(pa.Table.from_pylist(rows), "eval", plan.node("eval_base").config.max_prompts)
    slices = eval_stage.task_slices(rows)
    count = {s: sum(slices[r["task"]] == s for r in picked) for s in eval_stage.SLICES}
    assert count == {"trained": 257, "transfer": 127}
    assert count["transfer"] >= prompts_for_interval(0.10, discordant=0.33)
    assert "gsm_symbolic" in load_plan("r1", "gpu").node("prompts").config.eval_tasks


def test_accuracy_columns_put_slices_before_tasks():
    rows = [{"chain_sum/accuracy": 0.5, "slice/transfer/accuracy": 0.5, "basic_arithmetic/accuracy": 0.2,
             "slice/trained/accuracy": 0.2, "chain_sum/accuracy_ci_low": 0.1}]
    assert accuracy_columns(rows) == [("slice/trained/accuracy", "acc: trained slice"),
                                      ("slice/transfer/accuracy", "acc: transfer slice"),
                                      ("chain_sum/accuracy", "acc: chain_sum"),
                                      ("basic_arithmetic/accuracy", "acc: basic_arithmetic")]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with harness_home(tmp_path_factory.mktemp("transfer-home")) as path:
        yield path


@pytest.mark.slow
def test_sft_eval_run_shows_the_transfer_slice_and_its_gains(home, capsys, monkeypatch):
    """Through the CLI on the tiny profile: sft-eval with gsm_symbolic and new phrasings of the trained task held
    out (3 prompts each of 9: 3 trained, 6 transfer). The end of the run shows each eval's accuracy per slice in the
    model comparison (`trained / transfer`) and sft's gain over the base per slice; report.md has the slice columns in both tables; MLflow
    has the slice metrics. Cheap: 2 sft steps, no pass@k."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("COLUMNS", "200")
    out = home / "run.json"
    args = ["run", "--recipe", "sft-eval", "--profile", "tiny", "--json", str(out),
            "--set", "prompts.eval_tasks={gsm_symbolic: {}, basic_arithmetic-phrased: {format_style: natural}}",
            "--set", "prompts.eval_size=4", "--set", "sft.max_steps=2"]
    for node in ("eval_base", "eval_sft"):
        args += ["--set", f"{node}.max_prompts=9", "--set", f"{node}.pass_k=0"]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {r["eval"]: r for r in result["comparison"]["rows"]}
    for node in ("eval_base", "eval_sft"):
        m = next(s for s in result["stages"] if s["node"] == node)["metrics"]
        assert (m["slice/trained/prompts"], m["slice/transfer/prompts"]) == (3, 6), node
        assert (m["gsm_symbolic/transfer"], m["basic_arithmetic-phrased/transfer"], m["basic_arithmetic/transfer"]) \
            == (1, 1, 0)
        assert 0 <= rows[node]["slice/transfer/accuracy"] <= 1 and "gsm_symbolic/accuracy" in rows[node]
        logged = MlflowClient(f"sqlite:///{home}/mlflow.db").get_run(rows[node]["mlflow_run_id"]).data.metrics
        assert logged["slice/transfer/prompts"] == 6 and "slice/trained/accuracy" in logged
    lines = stdout.splitlines()
    print("\n".join(lines[next(i for i, line in enumerate(lines) if "model comparison" in line):]))  # pytest -rP
    header = next(line for line in lines if "trained / transfer" in line)
    assert "acc: gsm_symbolic" in header
    at = lines.index(header)
    for node in ("eval_base", "eval_sft"):  # the slices' accuracies, `0 / 0.167`, right-aligned under their header
        line = next(line for line in lines[at:] if line.strip().startswith(node))
        cell = f"{fmt_metric(rows[node]['slice/trained/accuracy'])} / {fmt_metric(rows[node]['slice/transfer/accuracy'])}"
        assert line[:header.index("trained / transfer") + len("trained / transfer")].endswith(cell), (line, cell)
    [gain] = result["comparison"]["gains"]
    assert (gain["model"], gain["start"]) == ("sft", "base")
    assert {k: v["prompts"] for k, v in gain["slices"].items()} == {"trained": 3, "transfer": 6}
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("sft ") and "over base" in line)
    assert re.fullmatch(r"\s+trained [+-]\d+\.\d \[.*\] \(3\); transfer [+-]\d+\.\d \[.*\] \(6\)", lines[at + 1]), \
        lines[at:at + 2]
    report = Path(result["report"]["path"]).read_text()
    comparison = read_tables(report.split("## Model comparison", 1)[1].split("\n## ", 1)[0])
    assert [set(r) >= {"acc: trained slice", "acc: transfer slice"} for r in comparison] == [True, True]
    [stage_gain] = read_tables(report.split("## Stage gains", 1)[1].split("\n## ", 1)[0])
    assert stage_gain["model"] == "sft" and re.fullmatch(r"[+-]\d+\.\d \[.*\]", stage_gain["transfer (n=6)"])
    assert "trained (n=3)" in stage_gain
    assert "gsm8k" not in (stdout + report).lower()
