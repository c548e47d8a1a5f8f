"""eval: summary metrics on literal rows (hand-computed), prompt selection, and the stage on the tiny model."""

import hashlib
import json
import math

import pytest

from schemas.configs import EvalConfig
from schemas.datasets import from_rows
from schemas.errors import ConfigError, SchemaError, StageError
from stages import eval as eval_stage
from stages.base import LocalContext, write_dataset
from stages.math.stats import bootstrap_ci
from tests.conftest import fake_input


def row(pid, mode, correct, fmt=True, n=10, finish="stop", task="t", i=0, lenient=None):
    return {"prompt_id": pid, "task": task, "mode": mode, "sample_index": i, "completion": "", "extracted": None,
            "answer": None, "correct": correct, "correct_lenient": correct if lenient is None else lenient,
            "format_ok": fmt, "num_tokens": n, "finish_reason": finish}


def test_summarize_hand_computed():
    """greedy: 3 rows, correct [T, F, None] → accuracy 1/2 over the 2 scored, 1 unscored (lenient
    [T, T] → 1); its bootstrap interval over [1, 0]: a resample's mean is 0, 1/2 or 1 with
    probability 1/4, 1/2, 1/4, so the 2.5% and 97.5% quantiles are 0 and 1; format
    [T, T, F] → 2/3; lengths 10, 20, 30 → 20; one truncated → 1/3.
    sampled, k=2: prompt a has 1 of 2 correct → pass@2 = 1, pass@1 = 0.5; prompt b 0 of 2 → 0, 0.
    means: pass@2 = 0.5, pass@1 = 0.25."""
    rows = [row("a", "greedy", True, n=10), row("b", "greedy", False, n=20, lenient=True),
            row("c", "greedy", None, fmt=False, n=30, finish="length"),
            row("a", "sampled", True, i=0), row("a", "sampled", False, i=1),
            row("b", "sampled", False, i=0), row("b", "sampled", False, i=1)]
    m = eval_stage.summarize(rows, k=2)
    assert m["accuracy"] == pytest.approx(0.5)
    assert (m["accuracy_ci_low"], m["accuracy_ci_high"]) == (0.0, 1.0)
    assert m["accuracy_lenient"] == pytest.approx(1.0)  # b's answer was right, outside the answer block
    assert m["unscored"] == 1
    assert m["format_rate"] == pytest.approx(2 / 3)
    assert m["mean_length"] == pytest.approx(20)
    assert m["truncated_rate"] == pytest.approx(1 / 3)
    assert m["pass_at_2"] == pytest.approx(0.5)
    assert m["pass_at_1_sampled"] == pytest.approx(0.25)


def test_summarize_interval_is_over_the_scored_greedy_rows_only():
    """40 greedy rows: 30 correct, 6 wrong, 4 unscored; sampled rows (all wrong) do not count. The
    interval is the bootstrap of the 36 scored values with the fixed seed: the same for the same
    rows, around 30/36 = 0.833 with half-width about 1.96 * sqrt(0.833 * 0.167 / 36) = 0.12."""
    rows = ([row(f"c{i}", "greedy", True) for i in range(30)] + [row(f"w{i}", "greedy", False) for i in range(6)]
            + [row(f"u{i}", "greedy", None) for i in range(4)] + [row("c0", "sampled", False, i=i) for i in range(4)])
    m = eval_stage.summarize(rows, k=2)
    assert m["accuracy"] == pytest.approx(30 / 36)
    low, high = m["accuracy_ci_low"], m["accuracy_ci_high"]
    assert (low, high) == bootstrap_ci([1.0] * 30 + [0.0] * 6, confidence=0.95, seed=eval_stage.CI_SEED)
    assert low < 30 / 36 < high
    assert (high - low) / 2 == pytest.approx(1.96 * math.sqrt(30 / 36 * 6 / 36 / 36), abs=0.02)
    assert eval_stage.summarize(rows, k=2) == m  # pure: the same rows, the same interval
    only_scored = eval_stage.summarize(rows[:36], k=0)
    assert (only_scored["accuracy_ci_low"], only_scored["accuracy_ci_high"]) == (low, high)  # unscored rows count for nothing

    none_scored = eval_stage.summarize([row("u", "greedy", None)], k=0)
    assert math.isnan(none_scored["accuracy_ci_low"]) and math.isnan(none_scored["accuracy_ci_high"])
    assert eval_stage.summarize([row("a", "greedy", True)] * 5, k=0)["accuracy_ci_low"] == 1.0


def test_round_robin_prompts_over_tasks():
    import pyarrow as pa

    rows = [{"id": f"{t}{i}", "task": t, "split": s} for t in ("a", "b") for i, s in enumerate(["eval"] * 5 + ["train"])]
    picked = eval_stage.round_robin_prompts(pa.Table.from_pylist(rows), "eval", 4)
    assert [r["id"] for r in picked] == ["a0", "b0", "a1", "b1"]
    assert len(eval_stage.round_robin_prompts(pa.Table.from_pylist(rows), "train", 10)) == 2


def test_eval_stage_on_tiny_model(tmp_path, tiny_model_input):
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1),
                "task": "math" if i % 2 else "other", "verifier": "math", "split": "eval", "metadata": "{}"}
               for i in range(6)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(prompts, "prompts"), "prompts")
    ctx = LocalContext(tmp_path / "run")
    cfg = EvalConfig(max_prompts=6, max_new_tokens=8, batch_size=4, pass_k=3, pass_k_prompts=2)
    # the model's lineage (the runner adds it): its SFT data holds held-out p3 with its answer; the prompts dataset
    # itself is an ancestor too, but its rows are all of the held-out split, which no stage trains on
    sft = write_dataset(LocalContext(tmp_path / "s"), "s", from_rows([
        {"id": "s1", "messages": [{"role": "user", "content": "3 + 1 ?"}, {"role": "assistant", "content": "<answer>4"}],
         "source": "user", "metadata": "{}"}], "sft"), "sft")
    lineage = {"lineage.sft": fake_input(sft.path, "dataset", "sft"),
               "lineage.prompts": fake_input(data.path, "dataset", "prompts")}
    out = eval_stage.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts"),
                               **lineage}, ctx)["results"]
    assert out.rows == 6 + 2 * 3
    assert {k: v for k, v in out.metrics.items() if k.startswith("contamina")} == {
        "contamination/prompts": 1.0, "contamination/share": 1 / 6, "contamination/datasets": 2.0,
        "contamination/exact": 1.0, "contamination/ngram": 0.0, "contamination/answer_leak": 1.0, "contaminated": 1.0}
    assert out.extra["contamination"]["examples"] == [{"prompt_id": "p3", "question": "3+1?", "matches": {
        "answer_leak": f"{lineage['lineage.sft'].label} row 1", "exact": f"{lineage['lineage.sft'].label} row 1"}}]
    assert [f.name for f in ctx.files] == ["contamination.json"]  # logged to the run (MLflow, in a pipeline)
    with pytest.raises(StageError, match=r"^eval: 1 of 6 held-out prompts \(16.7%\) are in the model's training data, "
                       r"above contamination_threshold 0.1; e.g. 'p3': answer_leak in .* row 1, exact in .* row 1 "
                       r"\(fail_on_contamination\)$"):  # before the model loads: its folder is not there
        eval_stage.run(cfg.model_copy(update={"contamination_threshold": 0.1, "fail_on_contamination": True}),
                       {"model": fake_input(tmp_path / "no-model", "model", "model"),
                        "prompts": fake_input(data.path, "dataset", "prompts"), **lineage}, LocalContext(tmp_path / "f"))
    high = eval_stage.check_contamination(cfg.model_copy(update={"contamination_threshold": 0.2}), [
        *prompts], lineage, LocalContext(tmp_path / "h"))[0]
    assert high["contamination/share"] == 1 / 6 and high["contaminated"] == 0.0  # 1/6 is under 0.2
    for key in ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "format_rate", "mean_length", "pass_at_3",
                "tokens_per_s", "math/accuracy", "other/accuracy", "math/accuracy_ci_low", "other/accuracy_ci_high"):
        assert key in out.metrics, key
    for prefix in ("", "math/", "other/"):
        m = out.metrics
        assert m[f"{prefix}accuracy_ci_low"] <= m[f"{prefix}accuracy"] <= m[f"{prefix}accuracy_ci_high"], prefix
    assert 1 <= out.metrics["mean_length"] <= 8
    again = eval_stage.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts")},
                           LocalContext(tmp_path / "run2"))["results"]
    import pyarrow.parquet as pq

    a = pq.read_table(out.path / "data.parquet").to_pylist()
    b = pq.read_table(again.path / "data.parquet").to_pylist()
    assert a == b  # greedy and seeded sampling are deterministic (the lineage changes no answer)
    assert again.metrics["contamination/prompts"] == 0 and again.metrics["contaminated"] == 0  # no lineage: clean
    assert json.dumps(a[0])  # rows are plain JSON-able values


def test_rerank_metrics_hand_computed():
    """Two prompts, three samples each. p1: answers 4, 5, 4 (right, wrong, right); p2: 7, 8, 8 (right, wrong, wrong).
    pass@1 = (2/3 + 1/3) / 2 = 0.5; majority picks a right 4 on p1 and a wrong 8 on p2: 0.5; the scorer's highest
    scores (0.1, 0.9, 0.3 | 0.8, 0.2, 0.5) pick a wrong 5 on p1 and a right 7 on p2: 0.5, and flipping p1's scores
    makes it 1.0. Greedy rows take no part."""
    rows = [row("g", "greedy", True)]
    for pid, answers, right in (("p1", ["4", "5", "4"], [True, False, True]), ("p2", ["7", "8", "8"], [True, False, False])):
        for i, (a, c) in enumerate(zip(answers, right, strict=True)):
            rows.append({**row(pid, "sampled", c, i=i), "extracted": a})
    m = eval_stage.rerank_metrics(rows, [0.1, 0.9, 0.3, 0.8, 0.2, 0.5], "orm")
    assert m == {"rerank/prompts": 2.0, "rerank/samples": 3.0, "rerank/pass_at_1": pytest.approx(0.5),
                 "rerank/majority_accuracy": 0.5, "rerank/orm_accuracy": 0.5}
    assert eval_stage.rerank_metrics(rows, [0.9, 0.1, 0.3, 0.8, 0.2, 0.5], "orm")["rerank/orm_accuracy"] == 1.0
    assert "rerank/orm_accuracy" not in eval_stage.rerank_metrics(rows, None, "majority")
    assert eval_stage.rerank_metrics([row("g", "greedy", True)], None, "majority") == {}


def test_rerank_settings_and_scorer_are_checked_before_any_compute(tmp_path):
    with pytest.raises(ValueError, match="pass_k >= 2"):
        EvalConfig(rerank="majority", pass_k=1)
    cfg = EvalConfig(rerank="orm")
    with pytest.raises(SchemaError, match="needs the input `scorer`"):
        eval_stage.check_scorer(cfg, {})
    with pytest.raises(SchemaError, match="'reward_model' artifact as `scorer`"):
        eval_stage.check_scorer(cfg, {"scorer": fake_input(tmp_path, "model", "model")})
    with pytest.raises(SchemaError, match="used only with rerank=orm or rerank=prm"):
        eval_stage.check_scorer(EvalConfig(), {"scorer": fake_input(tmp_path, "model", "reward_model")})
    eval_stage.check_scorer(cfg, {"scorer": fake_input(tmp_path, "model", "reward_model")})


def test_eval_reranks_its_samples_with_a_reward_model(tmp_path, tiny_model_input, tiny_tokenizer):
    """rerank=orm on the tiny model: the reported best-of-N equals the pick made from the reward model's own scores
    of the written sampled rows."""
    import pyarrow.parquet as pq

    from schemas.artifacts import MODEL_DIR
    from stages.modeling.heads import RewardScorer, reward_model_from_causal_lm
    from stages.modeling.models import build_tiny_model

    rm_dir = tmp_path / "rm"
    rm = reward_model_from_causal_lm(build_tiny_model(tiny_tokenizer, seed=1), tiny_tokenizer.pad_token_id)
    rm.save_pretrained(rm_dir / MODEL_DIR)
    tiny_tokenizer.save_pretrained(rm_dir / MODEL_DIR)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1),
                "task": "math", "verifier": "math", "split": "eval", "metadata": "{}"} for i in range(3)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(prompts, "prompts"), "prompts")
    cfg = EvalConfig(max_prompts=3, max_new_tokens=6, batch_size=4, pass_k=3, pass_k_prompts=3, rerank="orm")
    out = eval_stage.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts"),
                               "scorer": fake_input(rm_dir, "model", "reward_model")}, LocalContext(tmp_path / "r"))
    rows = pq.read_table(out["results"].path / "data.parquet").to_pylist()
    sampled = [r for r in rows if r["mode"] == "sampled"]
    by_id = {p["id"]: p["messages"] for p in prompts}
    scores = RewardScorer.from_dir(rm_dir / MODEL_DIR).score([by_id[r["prompt_id"]] for r in sampled],
                                                             [r["completion"] for r in sampled])
    assert out["results"].metrics == {**out["results"].metrics, **eval_stage.rerank_metrics(rows, scores, "orm")}
    assert out["results"].metrics["rerank/prompts"] == 3.0 and "rerank/orm_accuracy" in out["results"].metrics


# ---------------------------------------------------------------------------- environments (issue 46)

def tool_row(pid, correct, calls, errors=0, turns=None):
    return {**row(pid, "greedy", correct), "tool_calls": calls, "tool_errors": errors,
            "turns": calls + 1 if turns is None else turns}


def test_tool_metrics_hand_computed():
    """Five answers: calls 0, 0, 1, 2, 3 (6 calls, 2 failed), turns 1, 1, 2, 3, 4 (mean 11/5 = 2.2).
    0 calls: correct, wrong -> 0.5 of 2/5 of the answers; 1 call: correct -> 1.0 of 1/5; 2+ calls: wrong, correct
    -> 0.5 of 2/5."""
    rows = [tool_row("a", True, 0), tool_row("b", False, 0), tool_row("c", True, 1, 1),
            tool_row("d", False, 2, 0), tool_row("e", True, 3, 1)]
    m = eval_stage.summarize(rows, k=0)
    assert m["tool_calls_per_answer"] == pytest.approx(6 / 5)
    assert m["tool_error_rate"] == pytest.approx(2 / 6)
    assert m["turns"] == pytest.approx(2.2)
    assert (m["calls_0/accuracy"], m["calls_1/accuracy"], m["calls_2plus/accuracy"]) == (0.5, 1.0, 0.5)
    assert (m["calls_0/share"], m["calls_1/share"], m["calls_2plus/share"]) == (0.4, 0.2, 0.4)
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert "tool_calls_per_answer" not in eval_stage.summarize([row("a", "greedy", True)], k=0)


def test_eval_rows_with_tool_columns_keep_them_and_single_turn_rows_have_none():
    table = from_rows([tool_row("a", True, 1, 1)], "eval")
    assert table.column_names[-3:] == ["turns", "tool_calls", "tool_errors"]
    assert table.to_pylist()[0]["tool_errors"] == 1
    assert from_rows([row("a", "greedy", True)], "eval").column_names == list(eval_stage_schema())


def eval_stage_schema():
    from schemas.datasets import SCHEMAS

    return SCHEMAS["eval"].names


ONE_CALL_ENV = '''
from stages.environments.base import Observation
from stages.rewards.verifiers import score


class _Episode:
    def step(self, turn):
        if turn.index == 0:  # the first turn "calls the tool" and the call fails; the second turn ends it
            return Observation("<output>\\n42\\n</output>\\n", tool_call=True, tool_error=True)
        return None


class _Env:
    name, stop = "one_call", ()

    def start(self, row):
        return _Episode()

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return score(row, completion)


def environment(**options):
    return _Env()
'''


def test_eval_with_an_environment_records_turns_and_tool_calls(tmp_path, tiny_model_input):
    env_file = tmp_path / "one_call.py"
    env_file.write_text(ONE_CALL_ENV)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1),
                "task": "math", "verifier": "math", "split": "eval", "metadata": "{}"} for i in range(3)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(prompts, "prompts"), "prompts")
    cfg = EvalConfig(max_prompts=3, max_new_tokens=4, batch_size=2, pass_k=2, pass_k_prompts=1,
                     environment={"name": str(env_file), "max_turns": 2, "max_total_tokens": 64})
    eval_stage.check(cfg)
    assert eval_stage.cache_salt(cfg) == hashlib.sha256(env_file.read_bytes()).hexdigest()
    assert eval_stage.cache_salt(EvalConfig()) == ""
    out = eval_stage.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts")},
                         LocalContext(tmp_path / "run"))["results"]
    import pyarrow.parquet as pq

    rows = pq.read_table(out.path / "data.parquet").to_pylist()
    assert len(rows) == 3 + 2
    assert all((r["turns"], r["tool_calls"], r["tool_errors"]) == (2, 1, 1) for r in rows)
    assert all("<output>\n42\n</output>\n" in r["completion"] for r in rows)  # the transcript
    m = out.metrics
    assert (m["tool_calls_per_answer"], m["tool_error_rate"], m["turns"], m["calls_1/share"]) == (1.0, 1.0, 2.0, 1.0)
    assert "math/tool_calls_per_answer" in m


def test_an_unknown_environment_fails_the_check():
    with pytest.raises(ConfigError):
        eval_stage.check(EvalConfig(environment={"name": "nope"}))


def test_contamination_settings_leave_the_default_key_alone():
    """Out of the config's dump (so of every eval's cache key) while default; in it when set."""
    assert not {"contamination_threshold", "fail_on_contamination"} & set(EvalConfig().model_dump(mode="json"))
    set_ = EvalConfig(contamination_threshold=0.05, fail_on_contamination=True).model_dump(mode="json")
    assert set_["contamination_threshold"] == 0.05 and set_["fail_on_contamination"] is True
