import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.configs import PromptsConfig
from schemas.errors import ConfigError, SchemaError
from stages import prompts
from stages.base import LocalContext
from stages.rewards import R1_SYSTEM_PROMPT, score


def run(cfg, seed=0, tmp=None):
    out = prompts.run(cfg, {}, LocalContext(tmp, seed=seed))["prompts"]
    return pq.read_table(out.path / "data.parquet").to_pylist()


def test_reasoning_gym_prompts_deterministic_split_and_scorable(tmp_path):
    cfg = PromptsConfig(size=40, eval_fraction=0.25, eval_tasks={"chain_sum": {"min_terms": 2, "max_terms": 3}}, eval_size=8)
    rows = run(cfg, tmp=tmp_path / "a")
    assert rows == run(cfg, tmp=tmp_path / "b")  # same config, same seed → same rows and split
    assert rows != run(cfg, seed=1, tmp=tmp_path / "c")
    arith = [r for r in rows if r["task"] == "basic_arithmetic"]
    assert sum(r["split"] == "eval" for r in arith) == round(len(arith) * 0.25)
    assert all(r["split"] == "eval" for r in rows if r["task"] == "chain_sum")
    assert len({r["id"] for r in rows}) == len(rows)
    r = arith[0]
    assert r["messages"][0] == {"role": "system", "content": R1_SYSTEM_PROMPT}
    assert json.loads(r["metadata"])["question"] == r["messages"][1]["content"]
    assert score(r, f"<think>x</think><answer>{r['answer']}</answer>").correct is True
    assert score(r, "<think>x</think><answer>999999</answer>").correct is False


def test_adding_a_task_does_not_change_another_tasks_prompts(tmp_path):
    one = run(PromptsConfig(size=20), tmp=tmp_path / "a")
    two = run(PromptsConfig(size=20, tasks={"basic_arithmetic": {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                                                 "max_digits": 2}, "chain_sum": {}}), tmp=tmp_path / "b")
    assert [r for r in two if r["task"] == "basic_arithmetic"] == one


def test_user_files_jsonl_and_parquet(tmp_path):
    jl = tmp_path / "mine.jsonl"
    jl.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(8)))
    pq.write_table(pa.Table.from_pylist([{"question": "mc?", "answer": "B", "verifier": "exact", "split": "eval"}]),
                   tmp_path / "mc.parquet")
    cfg = PromptsConfig(tasks={}, files=[str(jl), str(tmp_path / "mc.parquet")], eval_fraction=0.5)
    prompts.check(cfg)
    rows = run(cfg, tmp=tmp_path / "out")
    mine = [r for r in rows if r["task"] == "file:mine"]
    assert len(mine) == 8 and sum(r["split"] == "eval" for r in mine) == 4
    assert all(r["verifier"] == "math" for r in mine)
    mc = next(r for r in rows if r["task"] == "file:mc")
    assert mc["verifier"] == "exact" and mc["split"] == "eval"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "x"}, "needs a 'question' or 'messages' column"),
        ({"question": "x", "verifier": "magic"}, "row 0: column 'verifier' value 'magic' unknown"),
        ({"question": "x", "split": "dev"}, "row 0: column 'split' must be 'train' or 'eval'"),
        ({"question": ""}, "row 0: column 'question' is empty"),
    ],
)
def test_bad_user_files_are_rejected_naming_file_and_column(tmp_path, record, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(record) + "\n")
    with pytest.raises(SchemaError, match=str(f) + ".*" + message.replace("(", r"\(")):
        prompts.check(PromptsConfig(tasks={}, files=[str(f)]))


def test_unknown_task_suggests_names():
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'chain_summ'.*chain_sum"):
        prompts.check(PromptsConfig(tasks={"chain_summ": {}}))
    with pytest.raises(ConfigError, match="prompts.tasks.chain_sum: invalid options"):
        prompts.check(PromptsConfig(tasks={"chain_sum": {"no_such_option": 3}}))
