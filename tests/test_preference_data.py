import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.configs import PreferenceDataConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages import preference_data as pd
from stages.base import LocalContext, read_user_table, write_dataset
from tests.conftest import fake_input

MSG = [{"role": "user", "content": "q"}]


def s(pid, i, reward, task="t", text=None):
    return {"prompt_id": pid, "sample_index": i, "reward": reward, "completion": text or f"{pid}{i}",
            "messages": MSG, "metadata": json.dumps({"task": task})}


def test_best_vs_worst_with_margin_and_ties():
    samples = [s("a", 0, 0.1), s("a", 1, 1.0), s("a", 2, 0.6), s("a", 3, None),
               s("b", 0, 0.5), s("b", 1, 0.5),  # a tie
               s("c", 0, 1.0), s("c", 1, 0.8)]  # margin 0.2 < 0.5
    pairs = pd.pairs_from_samples(samples, PreferenceDataConfig(min_margin=0.5))
    assert [(p["id"], p["chosen"], p["rejected"]) for p in pairs] == [("a-0", "a1", "a0")]
    assert pairs[0]["chosen_score"] - pairs[0]["rejected_score"] == pytest.approx(0.9)
    two = pd.pairs_from_samples(samples, PreferenceDataConfig(min_margin=0.0, pairs_per_prompt=2, drop_ties=False))
    assert [p["id"] for p in two] == ["a-0", "b-0", "c-0"]  # a has 3 scored: 2nd best vs 2nd worst is itself


def test_balance_caps_tasks_at_the_smallest():
    pairs = [{"id": str(i), "task": "big" if i < 6 else "small"} for i in range(8)]
    out = pd.balance(pairs, seed=0)
    assert sum(p["task"] == "big" for p in out) == 2 and sum(p["task"] == "small" for p in out) == 2
    assert out == pd.balance(pairs, seed=0)


def test_user_pairs_text_and_conversations():
    text = pd.user_pairs(pa.Table.from_pylist([{"prompt": "2+2?", "chosen": "4", "rejected": "5"}]), "t.jsonl")
    assert text[0]["messages"] == [{"role": "user", "content": "2+2?"}] and text[0]["chosen"] == "4"
    convs = pa.Table.from_pylist([{
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]}])
    pairs = pd.user_pairs(convs, "hh.jsonl")  # HH-RLHF style: the prompt is the conversation before the answer
    assert pairs[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == ("hello", "go away")
    # no such file to count lines in: the row, from 1 (a file's rows and lines count from 1, issue 59 item 13)
    with pytest.raises(SchemaError, match="^num.jsonl: row 1: column 'chosen' must be text .*got a number: 3$"):
        pd.user_pairs(pa.Table.from_pylist([{"prompt": "x", "chosen": 3, "rejected": "y"}]), "num.jsonl")
    with pytest.raises(SchemaError, match="missing column 'rejected'"):
        pd.user_pairs(pa.Table.from_pylist([{"prompt": "x", "chosen": "y"}]), "bad.jsonl")


def test_a_bad_line_of_a_users_preference_file_is_named_by_its_line(tmp_path):
    """Issue 59 item 13: rows were 0-based here, lines 1-based elsewhere; a blank line does not shift the count."""
    f = tmp_path / "pairs.jsonl"
    def turns(*roles):
        return [{"role": role, "content": "x"} for role in roles]

    good = json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    f.write_text(json.dumps({"chosen": turns("user", "assistant"), "rejected": turns("user", "assistant")}) + "\n\n"
                 + json.dumps({"chosen": turns("user"), "rejected": turns("user", "assistant")}) + "\n")
    with pytest.raises(SchemaError, match=rf"^{f}: line 3: column 'chosen' must be text or a conversation"):
        pd.check(PreferenceDataConfig(files=[str(f)]))
    f.write_text(good + "\n" + json.dumps({"prompt": "3+3?", "chosen": 6, "rejected": "5"}) + "\n")
    with pytest.raises(SchemaError, match=rf"^{f}: line 2: column 'chosen' is a number \(6\) where line 1 has text"):
        pd.check(PreferenceDataConfig(files=[str(f)]))


def test_stage_writes_preferences_and_unpaired(tmp_path):
    samples = [dict(s(p, i, r), correct=None, num_tokens=3, finish_reason="stop", reward_components="{}")
               for p, i, r in [("a", 0, 1.0), ("a", 1, 0.0), ("b", 0, 0.2), ("b", 1, 0.2)]]
    data = write_dataset(LocalContext(tmp_path / "d"), "s", from_rows(samples, "samples"), "samples")
    user = tmp_path / "mine.jsonl"
    user.write_text(json.dumps({"prompt": "hi", "chosen": "hello", "rejected": "no"}) + "\n")
    cfg = PreferenceDataConfig(min_margin=0.5, files=[str(user)])
    pd.check(cfg)
    out = pd.run(cfg, {"samples": fake_input(data.path, "dataset", "samples")}, LocalContext(tmp_path / "r"))
    prefs = pq.read_table(out["preferences"].path / "data.parquet").to_pylist()
    assert [(p["chosen"], p["rejected"], p["source"]) for p in prefs] == [("a0", "a1", "samples"), ("hello", "no", str(user))]
    unpaired = pq.read_table(out["unpaired"].path / "data.parquet").to_pylist()
    assert [(u["completion"], u["label"]) for u in unpaired] == [("a0", True), ("a1", False), ("hello", True), ("no", False)]


def test_no_pairs_is_a_clear_error(tmp_path):
    samples = [dict(s("a", i, 0.5), correct=None, num_tokens=3, finish_reason="stop", reward_components="{}")
               for i in range(2)]
    data = write_dataset(LocalContext(tmp_path / "d"), "s", from_rows(samples, "samples"), "samples")
    with pytest.raises(SchemaError, match="no preference pairs"):
        pd.run(PreferenceDataConfig(), {"samples": fake_input(data.path, "dataset", "samples")}, LocalContext(tmp_path / "r"))


def test_a_pairs_file_with_a_line_of_megabytes_reads(tmp_path):
    # pyarrow's JSON reader refused a line over two of its 1 MB blocks ("straddling object")
    user = tmp_path / "long.jsonl"
    user.write_text(json.dumps({"prompt": "hi", "chosen": "c" * 3_000_000, "rejected": "no"}) + "\n"
                    + json.dumps({"prompt": "ho", "chosen": "yes", "rejected": "n"}) + "\n")
    pd.check(PreferenceDataConfig(files=[str(user)]))
    pairs = pd.user_pairs(read_user_table(user), str(user))
    assert [len(p["chosen"]) for p in pairs] == [3_000_000, 3]
