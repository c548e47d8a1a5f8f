"""flows/report/gains.py: each model-producing stage's held-out gain over the model it was trained from, paired by prompt."""

from __future__ import annotations

import pytest

from flows.plan.recipes import load_plan
from flows.plan.results import StageResult
from flows.report.gains import fmt_gain, gain_pairs, gains_markdown, greedy_scores, paired_gain, stage_gains
from flows.report.tables import read_tables


def test_the_r1_plan_compares_every_model_with_what_it_was_trained_from():
    """The default recipe's lineage: cold-start SFT over the base, reasoning RL over the cold start, stage-3 SFT over
    the base it starts from and over the RL model its rejection-sampled data came from, DPO over that SFT, final RL
    over DPO, the student over its start (options.student=base: the base model) and over its teacher."""
    pairs = [(p["eval"], p["compared_with"], p["relation"]) for p in gain_pairs(load_plan("r1", "tiny", []))]
    assert pairs == [
        ("eval_sft_cold", "eval_base", "over its start"),
        ("eval_grpo_reasoning", "eval_sft_cold", "over its start"),
        ("eval_sft", "eval_base", "over its start"),
        ("eval_sft", "eval_grpo_reasoning", "over the model its data was sampled from"),
        ("eval_dpo", "eval_sft", "over its start"),
        ("eval_grpo_final", "eval_dpo", "over its start"),
        ("eval_student", "eval_base", "over its start"),
        ("eval_student", "eval_grpo_final", "over its teacher"),
    ]
    cut = [(p["eval"], p["compared_with"]) for p in gain_pairs(load_plan("r1", "tiny", ["options.student=cut"]))]
    assert ("eval_student", "eval_base") not in cut  # the cut student's start has no eval
    assert ("eval_student", "eval_grpo_final") in cut


def test_paired_gain_by_hand():
    """Four prompts: before 1 0 0 1, after 1 1 1 0: differences 0 +1 +1 -1, gain +0.25; every bootstrap mean of four
    differences from {-1, 0, +1} lies in [-1, +1] and the interval holds the gain. Different prompt sets: no gain."""
    before = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}
    g = paired_gain(before, after)
    assert g["gain"] == pytest.approx(0.25) and g["prompts"] == 4 and g["note"] == ""
    assert -1.0 <= g["ci_low"] <= 0.25 <= g["ci_high"] <= 1.0
    assert fmt_gain(g).startswith("+25.0 [")
    same = paired_gain(before, before)
    assert (same["gain"], same["ci_low"], same["ci_high"]) == (0.0, 0.0, 0.0)
    other = paired_gain(before, {"a": 1.0, "b": 1.0, "c": 1.0, "e": 0.0})
    assert other["gain"] is None and other["note"] == "not compared: 2 prompt(s) scored by one eval only"
    assert fmt_gain(other) == other["note"]


def test_stage_gains_read_each_evals_greedy_rows_once():
    """The rows come from the eval outputs (greedy, scored; sampled rows and unscored prompts left out); a pair
    whose eval was skipped is left out; the markdown calls a gain beyond the noise only when its interval
    excludes 0."""
    plan = load_plan("r1", "tiny", [])
    correct = {"eval_base": [0, 0, 0, 0, 0, 0, 0, 0], "eval_sft_cold": [1, 1, 1, 1, 1, 1, 1, 0]}

    def rows(node):
        out = [{"prompt_id": f"p{i}", "mode": "greedy", "correct": bool(c)} for i, c in enumerate(correct[node])]
        return out + [{"prompt_id": "p0", "mode": "sampled", "correct": False},
                      {"prompt_id": "p9", "mode": "greedy", "correct": None}]

    reads = []

    def read_eval(fp):
        reads.append(fp)
        return rows(fp)

    results = [StageResult(n, "eval", "run", 1.0, outputs={"results": n}) for n in correct]
    results.append(StageResult("eval_grpo_reasoning", "eval", "skipped", 0.0))
    assert greedy_scores(rows("eval_base")) == {f"p{i}": 0.0 for i in range(8)}
    gains = stage_gains(plan, results, read_eval)
    assert [(g["eval"], g["compared_with"]) for g in gains] == [("eval_sft_cold", "eval_base")]
    assert gains[0]["gain"] == pytest.approx(7 / 8) and gains[0]["prompts"] == 8 and gains[0]["ci_low"] > 0
    assert sorted(reads) == ["eval_base", "eval_sft_cold"]
    md = "\n".join(gains_markdown(gains))
    [row] = read_tables(md.split("## Stage gains")[1])
    assert row["gain, points [95% CI]"].startswith("+87.5 [") and {k: v for k, v in row.items() if "gain," not in k} == {
        "model": "sft_cold", "over": "base", "beyond the noise": "gain", "prompts": "8", "relation": "its start",
        "evals": "eval_sft_cold over eval_base"}  # one environment: the names alone
    assert gains_markdown([]) == []


def test_r1_tools_compares_within_an_environment_and_the_recipes_own_pairs():
    """Evals with the python tool are compared with the start's eval with the tool, plain ones with plain ones (RL
    over the tool cold start is one of those), and the recipe's `compare:` pairs follow: the arm trained with the
    tool, evaluated with it, over the no-tool arm of the same budget evaluated without it."""
    pairs = [(p["eval"], p["compared_with"], p["relation"]) for p in gain_pairs(load_plan("r1-tools", "tiny", []))]
    assert ("eval_grpo_tools_python", "eval_sft_tools_python", "over its start") in pairs
    assert ("eval_grpo_tools", "eval_sft_tools", "over its start") in pairs
    assert not any(a.endswith("_python") != b.endswith("_python") for a, b, rel in pairs if rel == "over its start")
    assert pairs[-2:] == [
        ("eval_grpo_tools_python", "eval_grpo_no_tool", "tool arm with the tool over the no-tool arm"),
        ("eval_sft_tools_python", "eval_sft_no_tool", "tool cold start with the tool over the no-tool one"),
    ]
    assert len(pairs) == 10


def test_r1_tools_gains_say_which_environment_each_model_was_evaluated_in(capsys):
    """r1-tools evaluates every model with the python tool and without it: the same two models are compared twice.
    The end of `r1flow run` printed each such gain twice with the same text (issue 59); each line, and each row of
    the report's table, names the environment its evals sampled in."""
    from rich.console import Console

    from flows.cli.output import print_gains

    gains = [{**p, "gain": 0.1 * i, "ci_low": 0.0, "ci_high": 0.2, "prompts": 8, "note": ""}
             for i, p in enumerate(gain_pairs(load_plan("r1-tools", "tiny", [])))]
    print_gains(Console(width=200, highlight=False), gains)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == len(gains) == len(set(lines)) == 10
    assert any(line.strip().startswith("grpo_tools [python]") and "over sft_tools [python] (its start)" in line
               for line in lines), lines
    assert any(line.strip().startswith("grpo_tools [single_turn]") and "over sft_tools [single_turn] (its start)"
               in line for line in lines), lines
    assert any(line.strip().startswith("grpo_tools [python]") and "over grpo_no_tool [single_turn] (tool arm with" in
               line for line in lines), lines
    rows = read_tables("\n".join(gains_markdown(gains)).split("## Stage gains")[1])
    assert len({(r["model"], r["over"], r["relation"]) for r in rows}) == len(rows) == 10


def test_a_compare_entry_must_name_eval_nodes_of_the_recipe(tmp_path, monkeypatch):
    """One clear error before any compute: an unknown node, or a node that is not an eval."""
    from flows.plan import recipes
    from schemas.errors import ConfigError

    base = (recipes.RECIPE_DIR / "sft-eval.yaml").read_text()
    for extra, message in (("compare: [{eval: eval_nope, over: eval_sft, label: x}]\n", "unknown node 'eval_nope'"),
                           ("compare: [{eval: sft, over: eval_base, label: x}]\n", "'sft' is a sft node")):
        path = tmp_path / "mine.yaml"
        path.write_text(base + "\n" + extra)
        with pytest.raises(ConfigError, match=message):
            load_plan(str(path), "tiny", [])
