"""Rejection sampling: the acceptance rule and selection on literal rows, then the stage on the
tiny model, checking the sft output is exactly the accepted samples."""

import hashlib
import json

import pyarrow.parquet as pq
import pydantic
import pytest

from schemas.configs import GenerationSpec, RejectionSamplingConfig, RewardSpec
from schemas.datasets import from_rows
from schemas.errors import ConfigError
from stages import rejection_sampling as rs
from stages.base import LocalContext, write_dataset
from stages.rewards.answers import format_ok
from stages.rewards.verifiers import score
from tests.conftest import fake_input
from tests.test_eval import ONE_CALL_ENV


def sample(pid, i, reward, correct=True, fmt=True, text=None, lenient=None):
    return {"prompt_id": pid, "sample_index": i, "reward": reward, "correct": correct, "completion": text or f"{pid}-{i}",
            "metadata": json.dumps({"format_ok": fmt, "correct_lenient": correct if lenient is None else lenient})}


def test_passes_rule():
    cfg = RejectionSamplingConfig()
    assert rs.passes(sample("a", 0, 1.0), cfg)
    assert not rs.passes(sample("a", 0, 1.0, correct=False), cfg)
    assert not rs.passes(sample("a", 0, 1.0, correct=None), cfg)  # unscorable is not verified
    assert not rs.passes(sample("a", 0, 1.0, fmt=False), cfg)
    loose = RejectionSamplingConfig(require_correct=False, require_format=False, min_reward=0.5)
    assert rs.passes(sample("a", 0, 0.5, correct=False, fmt=False), loose)
    assert not rs.passes(sample("a", 0, 0.4), loose)
    assert not rs.passes(sample("a", 0, None), loose)


def test_passes_lenient_correctness_reads_correct_lenient():
    strict = RejectionSamplingConfig(require_format=False)
    lenient = RejectionSamplingConfig(require_format=False, correctness="lenient")
    untagged_right = sample("a", 0, 0.0, correct=False, fmt=False, lenient=True)
    assert not rs.passes(untagged_right, strict) and rs.passes(untagged_right, lenient)
    assert not rs.passes(sample("a", 0, 0.0, correct=False, fmt=False, lenient=False), lenient)
    assert not rs.passes(sample("a", 0, 0.0, correct=None, fmt=False, lenient=None), lenient)


def test_reformat_needs_require_format_off():
    with pytest.raises(pydantic.ValidationError, match="require_format"):
        RejectionSamplingConfig(reformat=True)
    assert RejectionSamplingConfig(reformat=True, require_format=False).reformat


def test_accept_keeps_best_m_distinct_per_prompt():
    cfg = RejectionSamplingConfig(keep_per_prompt=2)
    samples = [sample("a", 0, 0.5), sample("a", 1, 1.2), sample("a", 2, 1.2, text="a-1"),  # dup text of a-1
               sample("a", 3, 0.9), sample("a", 4, 2.0, correct=False),
               sample("b", 0, 1.0, fmt=False), sample("b", 1, 1.0, correct=False)]
    kept = rs.accept(samples, cfg)
    assert [(s["prompt_id"], s["sample_index"]) for s in kept] == [("a", 1), ("a", 3)]


def test_acceptance_metrics_hand_computed():
    prompts = [{"id": "a", "task": "x"}, {"id": "b", "task": "x"}, {"id": "c", "task": "y"}]
    samples = [dict(sample(p, 0, r, correct=c), num_tokens=n) for p, r, c, n in
               [("a", 1.0, True, 10), ("b", 0.0, False, 20), ("c", 1.0, True, 30)]]
    kept = [samples[0], samples[2]]
    m = rs.acceptance_metrics(prompts, samples, kept)
    assert m["acceptance_rate"] == 2 / 3 and m["x/acceptance_rate"] == 0.5 and m["y/acceptance_rate"] == 1.0
    assert m["sample_accuracy"] == 2 / 3 and m["mean_length"] == 20 and m["reward_mean"] == 2 / 3


def test_stage_on_tiny_model_outputs_exactly_the_accepted_samples(tmp_path, tiny_model_input):
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i), "task": "t",
             "verifier": "math", "split": "train", "metadata": "{}"} for i in range(6)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(rows, "prompts"), "prompts")
    # The random tiny model is never correct: accept on a reward threshold over shaped components.
    cfg = RejectionSamplingConfig(num_samples=4, keep_per_prompt=2, require_correct=False, require_format=False,
                                  min_reward=-0.2, generation=GenerationSpec(max_new_tokens=12, temperature=1.0),
                                  reward=RewardSpec(weights={"accuracy": 1.0, "repetition": 1.0}))
    out = rs.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts")},
                 LocalContext(tmp_path / "run", seed=3))
    samples = pq.read_table(out["samples"].path / "data.parquet").to_pylist()
    sft_rows = pq.read_table(out["data"].path / "data.parquet").to_pylist()
    assert len(samples) == 6 * 4
    expected = rs.accept(samples, cfg)  # recompute the selection from the scored samples
    assert 0 < len(expected) < len(samples)  # the threshold really selects
    assert [r["id"] for r in sft_rows] == [f"{s['prompt_id']}-{s['sample_index']}" for s in expected]
    for row, s in zip(sft_rows, expected, strict=True):
        assert row["messages"][:-1] == s["messages"]
        assert row["messages"][-1] == {"role": "assistant", "content": s["completion"]}
        assert json.loads(row["metadata"])["reward"] == s["reward"] >= -0.2
    assert out["data"].metrics["accepted_rows"] == len(expected)
    assert out["data"].metrics["reformatted_rows"] == 0  # reformat is off
    assert not any(json.loads(r["metadata"])["reformatted"] for r in sft_rows)
    assert all(json.loads(s["metadata"])["correct_lenient"] in (True, False) for s in samples)  # math rows: scored


def test_reward_model_score_as_a_reward_component(tmp_path, tiny_model_input, tiny_tokenizer):
    """With an (untrained, randomly headed) reward model wired in and weight 1 on it alone, every
    sample's reward is exactly the scorer's score of that completion."""
    import pytest

    from schemas.artifacts import MODEL_DIR
    from stages.modeling.heads import RewardScorer, reward_model_from_causal_lm
    from stages.modeling.models import build_tiny_model

    rm_dir = tmp_path / "rm"
    rm = reward_model_from_causal_lm(build_tiny_model(tiny_tokenizer, seed=1), tiny_tokenizer.pad_token_id)
    rm.save_pretrained(rm_dir / MODEL_DIR)
    tiny_tokenizer.save_pretrained(rm_dir / MODEL_DIR)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i), "task": "t",
             "verifier": "math", "split": "train", "metadata": "{}"} for i in range(3)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(rows, "prompts"), "prompts")
    cfg = RejectionSamplingConfig(num_samples=2, require_correct=False, require_format=False,
                                  generation=GenerationSpec(max_new_tokens=8, temperature=1.0),
                                  reward=RewardSpec(weights={"reward_model": 1.0}))
    out = rs.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts"),
                       "reward_model": fake_input(rm_dir, "model", "reward_model")}, LocalContext(tmp_path / "r"))
    samples = pq.read_table(out["samples"].path / "data.parquet").to_pylist()
    expected = RewardScorer.from_dir(rm_dir / MODEL_DIR).score([s["messages"] for s in samples],
                                                               [s["completion"] for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx(expected, abs=1e-5)
    assert all("reward_model" in json.loads(s["reward_components"]) for s in samples)
    assert len(set(round(r, 6) for r in expected)) > 1  # a real signal, not a constant


# --------------------------------------------------------------------------- cold start: lenient + reformat

PROMPT = {"id": "p", "messages": [{"role": "user", "content": "What is 12 + 30?"}], "answer": "42", "task": "t",
          "verifier": "math", "split": "train", "metadata": "{}"}
WELL_FORMED = "<think>12 + 30 = 42</think>\n<answer>42</answer>"
UNTAGGED_RIGHT = "First, 12 + 30 = 42."
UNTAGGED_WRONG = "First, 12 + 30 = 43."


def scored(texts: list[str]) -> list[dict]:
    """`samples` rows as the stage writes them, from real scores of literal completions."""
    return [rs.sample_row(PROMPT, i, t, 10, "stop", score(PROMPT, t)) for i, t in enumerate(texts)]


def test_lenient_correct_unformatted_completion_is_accepted_only_with_lenient_correctness():
    samples = scored([UNTAGGED_RIGHT, UNTAGGED_WRONG])
    assert [s["correct"] for s in samples] == [False, False]
    assert [json.loads(s["metadata"])["correct_lenient"] for s in samples] == [True, False]
    strict = RejectionSamplingConfig(require_format=False, keep_per_prompt=2)
    lenient = RejectionSamplingConfig(require_format=False, keep_per_prompt=2, correctness="lenient")
    assert rs.accept(samples, strict) == []
    assert [s["completion"] for s in rs.accept(samples, lenient)] == [UNTAGGED_RIGHT]
    # with the format required, lenient accepts nothing more than strict
    assert rs.accept(samples, RejectionSamplingConfig(correctness="lenient")) == []


def test_reformat_rewrites_unformatted_rows_to_correct_r1_and_leaves_well_formed_ones():
    """Accepted: the well-formed completion (reward 1.2, first) and the untagged right one (reward 0).
    Reformatted, the untagged one reads '<think>\\nFirst, 12 + 30 = 42.\\n</think>\\n<answer>42</answer>',
    which score() marks well formed and correct; the well-formed one is kept byte for byte."""
    cfg = RejectionSamplingConfig(require_format=False, correctness="lenient", reformat=True, keep_per_prompt=3)
    samples = scored([UNTAGGED_RIGHT, WELL_FORMED, UNTAGGED_WRONG])
    kept = rs.accept(samples, cfg)
    assert [s["sample_index"] for s in kept] == [1, 0]
    rows = rs.build_sft_rows(kept, cfg)
    assert [r["id"] for r in rows] == ["p-1", "p-0"]
    texts = [r["messages"][-1]["content"] for r in rows]
    assert texts[0] == WELL_FORMED
    assert texts[1] == "<think>\nFirst, 12 + 30 = 42.\n</think>\n<answer>42</answer>"
    assert [json.loads(r["metadata"])["reformatted"] for r in rows] == [False, True]
    v = score(PROMPT, texts[1])
    assert (v.format_ok, v.correct, v.extracted) == (True, True, "42")
    assert all(r["messages"][:-1] == PROMPT["messages"] for r in rows)
    assert samples[0]["completion"] == UNTAGGED_RIGHT  # the samples output keeps the original
    assert all(format_ok(t) for t in texts)


def test_reformat_uses_the_judged_answer_and_is_off_by_default():
    """Strictly accepted but not well formed (text after </answer>): the judged answer, 42, goes in the
    block; without reformat the row is the original completion."""
    text = "<think>12 + 30 = 42</think><answer>42</answer> Done."
    (s,) = scored([text])
    assert s["correct"] is True and json.loads(s["metadata"])["format_ok"] is False
    on = RejectionSamplingConfig(require_format=False, reformat=True)
    (row,) = rs.build_sft_rows([s], on)
    assert row["messages"][-1]["content"] == "<think>\n12 + 30 = 42 42 Done.\n</think>\n<answer>42</answer>"
    (row,) = rs.build_sft_rows([s], RejectionSamplingConfig(require_format=False))
    assert row["messages"][-1]["content"] == text and json.loads(row["metadata"])["reformatted"] is False


def test_reformat_leaves_a_row_without_an_answer_as_it_is():
    """Accepted on reward alone with no answer anywhere: nothing to put in the block."""
    (s,) = scored(["no idea"])
    cfg = RejectionSamplingConfig(require_correct=False, require_format=False, reformat=True)
    assert rs.reformat_sample(s) is None
    (row,) = rs.build_sft_rows([s], cfg)
    assert row["messages"][-1]["content"] == "no idea" and json.loads(row["metadata"])["reformatted"] is False


# ---------------------------------------------------------------------------- environments (issue 46)

def test_a_tool_environment_passes_the_check_on_either_backend_and_an_unknown_one_fails(tmp_path):
    rs.check(RejectionSamplingConfig(environment={"name": "python"}))
    rs.check(RejectionSamplingConfig(generation=GenerationSpec(backend="vllm")))  # single_turn: as before
    # the engine runs the tool's turns (VLLMBackend.trajectories; tests/test_vllm_cpu.py runs it)
    rs.check(RejectionSamplingConfig(environment={"name": "python"}, generation=GenerationSpec(backend="vllm")))
    with pytest.raises(ConfigError, match="no such file"):
        rs.check(RejectionSamplingConfig(environment={"name": str(tmp_path / "missing.py")}))
    assert rs.cache_salt(RejectionSamplingConfig(environment={"name": "python"})) == "python@2"  # BUILTIN_VERSIONS
    assert rs.cache_salt(RejectionSamplingConfig()) == ""  # single_turn: the key as before environments


def test_with_an_environment_the_kept_completion_is_the_transcript(tmp_path, tiny_model_input):
    env_file = tmp_path / "one_call.py"
    env_file.write_text(ONE_CALL_ENV)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i), "task": "t",
             "verifier": "math", "split": "train", "metadata": "{}"} for i in range(3)]
    data = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(rows, "prompts"), "prompts")
    cfg = RejectionSamplingConfig(num_samples=2, keep_per_prompt=2, require_correct=False, require_format=False,
                                  generation=GenerationSpec(max_new_tokens=6, temperature=1.0),
                                  environment={"name": str(env_file), "max_turns": 2, "max_total_tokens": 64})
    rs.check(cfg)
    assert rs.cache_salt(cfg) == hashlib.sha256(env_file.read_bytes()).hexdigest()
    out = rs.run(cfg, {"model": tiny_model_input, "prompts": fake_input(data.path, "dataset", "prompts")},
                 LocalContext(tmp_path / "run", seed=3))
    samples = pq.read_table(out["samples"].path / "data.parquet").to_pylist()
    sft_rows = pq.read_table(out["data"].path / "data.parquet").to_pylist()
    assert len(samples) == 3 * 2 and sft_rows
    for s in samples:
        meta = json.loads(s["metadata"])
        assert (meta["turns"], meta["tool_calls"], meta["tool_errors"]) == (2, 1, 1)
        assert "<output>\n42\n</output>\n" in s["completion"]
    assert all("<output>\n42\n</output>\n" in r["messages"][-1]["content"] for r in sft_rows)


def test_single_turn_sample_rows_have_no_tool_metadata():
    row = rs.sample_row({"id": "p", "messages": [], "task": "t", "verifier": "math", "answer": "1"}, 0, "x", 1,
                        "stop", score({"answer": "1", "verifier": "math"}, "x"))
    assert set(json.loads(row["metadata"])) == {"task", "verifier", "answer", "extracted", "format_ok",
                                                "correct_lenient"}
