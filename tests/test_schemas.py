import json
import re

import pyarrow as pa
import pytest

from schemas import SCHEMAS, SchemaError, from_rows, validate


def prompt_row(**kw):
    row = {"id": "p1", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}],
           "answer": "4", "task": "t", "verifier": "math", "split": "train", "metadata": "{}"}
    row.update(kw)
    return row


def test_every_kind_has_a_schema_and_accepts_an_empty_table():
    assert set(SCHEMAS) == {"prompts", "sft", "samples", "preferences", "unpaired", "eval", "ref_logprobs", "steps"}
    for kind, schema in SCHEMAS.items():
        assert validate(schema.empty_table(), kind).schema.equals(schema)


def test_valid_prompts_roundtrip_and_extra_columns_dropped():
    table = pa.Table.from_pylist([dict(prompt_row(), extra=1)])
    out = validate(table, "prompts")
    assert out.column_names == SCHEMAS["prompts"].names
    assert out.to_pylist()[0]["answer"] == "4"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("task"), "missing column 'task'"),
        (lambda r: r.update(split="test"), "column 'split' has value(s) ['test']"),
        (lambda r: r.update(metadata="{not json"), "column 'metadata' row 0: not valid JSON"),
        (lambda r: r.update(messages=[{"role": "robot", "content": "x"}]), "role 'robot'"),
        (lambda r: r.update(messages=[]), "empty conversation"),
        (lambda r: r.update(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
         "must not end with an assistant turn"),
    ],
)
def test_prompt_violations_name_the_column(mutate, message):
    row = prompt_row()
    mutate(row)
    with pytest.raises(SchemaError, match=re.escape(message)):
        validate(pa.Table.from_pylist([row]), "prompts", where="prompts.jsonl")


def test_error_names_where_and_type():
    table = pa.Table.from_pylist([prompt_row()]).set_column(2, "answer", pa.array([1.5]))
    with pytest.raises(SchemaError, match=r"^my.parquet: column 'answer' has type double, expected string"):
        validate(table, "prompts", where="my.parquet")


def test_null_in_required_column():
    table = pa.Table.from_pylist([prompt_row(), prompt_row(id="p2", task=None)])
    with pytest.raises(SchemaError, match="column 'task' has 1 null"):
        validate(table, "prompts")


def test_nullable_answer_allowed_and_duplicate_ids_rejected():
    validate(pa.Table.from_pylist([prompt_row(answer=None)]), "prompts")
    with pytest.raises(SchemaError, match="duplicate value 'p1'"):
        validate(pa.Table.from_pylist([prompt_row(), prompt_row()]), "prompts")


def test_sft_must_end_with_assistant():
    row = {"id": "a", "messages": [{"role": "user", "content": "q"}], "source": "x", "metadata": "{}"}
    with pytest.raises(SchemaError, match="must end with an assistant turn"):
        from_rows([row], "sft")
    row["messages"].append({"role": "assistant", "content": "a"})
    assert from_rows([row], "sft").num_rows == 1


def test_int_columns_widen_and_floats_accept_ints():
    rows = [{"prompt_id": "p", "messages": [{"role": "user", "content": "q"}], "completion": "c", "sample_index": 0,
             "reward": 1, "reward_components": json.dumps({"a": 1}), "correct": True, "num_tokens": 3,
             "finish_reason": "stop", "metadata": "{}"}]
    table = pa.Table.from_pylist(rows)  # ints arrive as int64, reward as int64
    out = validate(table, "samples")
    assert out.schema.field("sample_index").type == pa.int32()
    assert out.column("reward").to_pylist() == [1.0]


def test_unknown_kind():
    with pytest.raises(SchemaError, match="unknown dataset kind 'foo'"):
        validate(pa.table({"a": [1]}), "foo")


def test_ref_logprobs_roles_are_checked():
    from schemas.datasets import from_rows
    from schemas.errors import SchemaError

    ok = from_rows([{"id": "a", "role": "chosen", "logp": -3.5, "tokens": 4}], "ref_logprobs")
    assert ok.num_rows == 1
    with pytest.raises(SchemaError, match="role"):
        from_rows([{"id": "a", "role": "winner", "logp": -3.5, "tokens": 4}], "ref_logprobs")


def test_grpo_and_ppo_share_one_name_per_idea():
    """What both RL stages have is declared once (RLConfig); none of the old second names survives."""
    from schemas.configs import GRPOConfig, PPOConfig, RLConfig

    shared = set(RLConfig.model_fields)
    assert {"steps", "prompts_per_step", "group_size", "mu", "generation", "reward", "beta", "lora"} <= shared
    assert shared <= set(GRPOConfig.model_fields) & set(PPOConfig.model_fields)
    assert not {"ppo_epochs", "samples_per_prompt", "max_steps"} & (set(GRPOConfig.model_fields)
                                                                     | set(PPOConfig.model_fields))
    assert (GRPOConfig().mu, PPOConfig().mu, GRPOConfig().group_size, PPOConfig().group_size) == (1, 2, 8, 1)


def test_old_ppo_names_are_accepted_with_a_deprecation_message():
    from schemas.configs import PPOConfig

    with pytest.warns(FutureWarning) as caught:
        cfg = PPOConfig(ppo_epochs=3, samples_per_prompt=2)
    assert sorted(str(w.message).split(" (")[0] for w in caught) == [
        "ppo.ppo_epochs is deprecated: it is now ppo.mu", "ppo.samples_per_prompt is deprecated: it is now ppo.group_size"]
    assert (cfg.mu, cfg.group_size) == (3, 2)
    dumped = cfg.model_dump(mode="json")  # what the cache key hashes: the current names only
    assert (dumped["mu"], dumped["group_size"]) == (3, 2) and "ppo_epochs" not in dumped
    # a profile's old name under a --set of the new one: the new one stands, the old one is reported ignored
    with pytest.warns(FutureWarning, match=r"ppo\.ppo_epochs=1 is ignored: ppo\.mu=4 is set"):
        assert PPOConfig(ppo_epochs=1, mu=4).mu == 4


def test_grpo_step_delimiter_is_a_named_delimiter():
    from pydantic import ValidationError

    from schemas.configs import GRPOConfig

    assert GRPOConfig().step_delimiter == "newline"
    with pytest.warns(FutureWarning, match="name it 'newline'"):
        assert GRPOConfig(step_delimiter="\n").step_delimiter == "newline"
    with pytest.warns(FutureWarning, match="name it 'blank_line'"):
        assert GRPOConfig(step_delimiter="\n\n").step_delimiter == "blank_line"
    with pytest.raises(ValidationError, match="step_delimiter"):
        GRPOConfig(step_delimiter=" ")
