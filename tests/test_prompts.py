import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.configs import PromptsConfig
from schemas.errors import ConfigError, SchemaError
from stages import prompts
from stages.base import LocalContext
from stages.rewards.answers import R1_SYSTEM_PROMPT
from stages.rewards.verifiers import score


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
        ({"question": "x", "verifier": "magic"}, "line 2: column 'verifier' value 'magic' unknown"),
        ({"question": "x", "split": "dev"}, "line 2: column 'split' must be 'train' or 'eval'"),
        ({"question": ""}, "line 2: column 'question' is empty"),
        # issue 59 item 13: was "column 'question' is empty"
        ({"question": 5}, "line 2: column 'question' must be text, got a number: 5"),
        ({"question": ["2+2?"]}, "line 2: column 'question' must be text, got a list: ['2+2?']"),
    ],
)
def test_bad_user_files_are_rejected_naming_file_line_and_column(tmp_path, record, message):
    """Lines count from 1 as an editor counts them, the blank line before the record included."""
    f = tmp_path / "bad.jsonl"
    f.write_text("\n" + json.dumps(record) + "\n")
    with pytest.raises(SchemaError, match=str(f) + ".*" + re.escape(message)):
        prompts.check(PromptsConfig(tasks={}, files=[str(f)]))


@pytest.mark.parametrize(
    "content, message",
    [  # issue 59 item 13: pyarrow's words named a byte position or a 0-based row of its block, not the line
        (b'{"question": "2+2?"}\n{"question": "caf\xe9?"}\n', "line 2: not UTF-8 text (byte 0xe9 at byte 18 of the line)"),
        (b'{"question": "2+2?"}\n\n{"question": 5}\n',
         "line 3: column 'question' is a number (5) where line 1 has text: every line must give it the same type"),
        (b'{"question": "2+2?"}\n{"question": "3+3?",}\n', "line 2: not valid JSON ("),
        (b'{"question": "2+2?"}\n["3+3?"]\n', "line 2: expected a JSON object, got a list"),
    ],
)
def test_a_line_pyarrow_cannot_read_is_named_by_its_line(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    with pytest.raises(SchemaError) as e:
        prompts.check(PromptsConfig(tasks={}, files=[str(f)]))
    assert str(e.value).startswith(f"{f}: {message}"), str(e.value)


def test_a_parquet_files_rows_count_from_1(tmp_path):
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "2+2?", "split": "train"}, {"question": "x", "split": "dev"}]), f)
    with pytest.raises(SchemaError, match=rf"^{f}: row 2: column 'split' must be 'train' or 'eval', got 'dev'"):
        prompts.check(PromptsConfig(tasks={}, files=[str(f)]))


def test_unknown_task_suggests_names():
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'chain_summ'.*chain_sum"):
        prompts.check(PromptsConfig(tasks={"chain_summ": {}}))
    with pytest.raises(ConfigError, match="prompts.tasks.chain_sum: invalid options"):
        prompts.check(PromptsConfig(tasks={"chain_sum": {"no_such_option": 3}}))


# ---------------------------------------------------------------------------- max_prompt_chars (issue 28 item 11)


def test_over_long_prompt_in_a_user_file_is_rejected_before_compute_naming_file_line_length_and_key(tmp_path):
    f = tmp_path / "mine.jsonl"
    long_q = "x" * 70_000  # over the default limit (65,536) with the system prompt or without it
    # a blank line: pyarrow skips it, the error still names the file's own line number
    f.write_text(json.dumps({"question": "short"}) + "\n\n" + json.dumps({"question": long_q}) + "\n"
                 + json.dumps({"question": "y" * 66_000}) + "\n")
    cfg = PromptsConfig(tasks={}, files=[str(f)])
    n = len(R1_SYSTEM_PROMPT) + len(long_q)
    message = (rf"{f}: line 3: the prompt is {n:,} characters, over the limit of 65,536 \(prompts.max_prompt_chars"
               rf".*1 more row\(s\) of this file are over it too.*--set prompts.max_prompt_chars={n}$")
    with pytest.raises(SchemaError, match=message):
        prompts.check(cfg)  # what a run's plan calls before any stage runs
    with pytest.raises(SchemaError, match=message):
        run(cfg, tmp=tmp_path / "out")
    # a node of another name names its own key
    with pytest.raises(SchemaError, match=rf"--set new_prompts.max_prompt_chars={n}$"):
        prompts.check(cfg, node="new_prompts")
    # and the key it names raises the limit
    assert len(run(cfg.model_copy(update={"max_prompt_chars": n}), tmp=tmp_path / "raised")) == 3


def test_a_prompt_exactly_at_the_limit_passes_one_over_fails(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question": "q" * 90}) + "\n")
    system = "s" * 10  # a question's prompt is the system prompt + the question: 100 characters
    rows = run(PromptsConfig(tasks={}, files=[str(f)], system_prompt=system, max_prompt_chars=100), tmp=tmp_path / "a")
    assert len(rows) == 1 and prompts.prompt_chars(rows[0]["messages"]) == 100
    with pytest.raises(SchemaError, match=rf"{f}: line 1: the prompt is 100 characters, over the limit of 99 "):
        prompts.check(PromptsConfig(tasks={}, files=[str(f)], system_prompt=system, max_prompt_chars=99))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_messages_prompts_count_every_message(tmp_path, suffix):
    messages = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 100},
                {"role": "assistant", "content": "a" * 100}, {"role": "user", "content": "v" * 100}]
    records = [{"messages": messages[1:2]}, {"messages": messages}]  # 100 and 400 characters
    f = tmp_path / f"chat{suffix}"
    if suffix == ".jsonl":
        f.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), f)
    prompts.check(PromptsConfig(tasks={}, files=[str(f)], max_prompt_chars=400))
    where = "line 2" if suffix == ".jsonl" else "row 2"  # parquet has no lines: the row, from 1 as lines
    with pytest.raises(SchemaError, match=rf"{f}: {where}: the prompt is 400 characters, over the limit of 399 "):
        prompts.check(PromptsConfig(tasks={}, files=[str(f)], max_prompt_chars=399))


def test_generated_prompts_obey_the_limit_too(tmp_path):
    rows = run(PromptsConfig(size=16), tmp=tmp_path / "a")  # the default never triggers
    assert max(prompts.prompt_chars(r["messages"]) for r in rows) < PromptsConfig().max_prompt_chars // 100
    with pytest.raises(ConfigError, match=r"prompts.tasks.basic_arithmetic: generated item 0: the prompt is .* "
                                          r"over the limit of 50 .*--set prompts.max_prompt_chars="):
        run(PromptsConfig(size=16, max_prompt_chars=50), tmp=tmp_path / "b")
    with pytest.raises(ValueError, match="max_prompt_chars"):
        PromptsConfig(max_prompt_chars=0)


def test_a_run_fails_at_planning_on_an_over_long_prompt_and_the_named_set_raises_the_limit(tmp_path):
    """The issue: a 1 MB prompt was accepted and an eval ran 16 minutes on it. Now the plan (made before any
    stage runs) stops with the file, line, length and the `--set` that raises the limit; that `--set` works."""
    from flows.plan.recipes import load_plan

    f = tmp_path / "big.jsonl"
    f.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n"
                 + json.dumps({"question": "x" * 1_000_000, "answer": "1"}) + "\n")
    n = len(R1_SYSTEM_PROMPT) + 1_000_000
    with pytest.raises(SchemaError, match=rf"{f}: line 2: the prompt is {n:,} characters.*"
                                          rf"--set prompts.max_prompt_chars={n}$"):
        load_plan("sft-eval", "tiny", [f"prompts.files=[{f}]"])
    load_plan("sft-eval", "tiny", [f"prompts.files=[{f}]", f"prompts.max_prompt_chars={n}"])


def test_the_plan_names_the_node_that_holds_the_file(tmp_path):
    """In nightly-preferences the user file is on `new_prompts`: the `--set` in the message must say so."""
    from flows.plan.recipes import load_plan

    f = tmp_path / "big.jsonl"
    f.write_text(json.dumps({"question": "x" * 70_000, "answer": "1"}) + "\n")
    with pytest.raises(SchemaError, match=r"--set new_prompts\.max_prompt_chars="):
        load_plan("nightly-preferences", "tiny", [f"new_prompts.files=[{f}]"])


def test_a_2mb_prompt_line_through_the_cli_is_one_error_naming_file_line_length_and_limit(tmp_path, monkeypatch,
                                                                                         capsys):
    """Issue 44 item 14: a JSON line over pyarrow's 1 MB blocks gave "cannot read (ArrowInvalid: straddling
    object straddles two block boundaries...)". Now the file reads, and the over-long row is the one error,
    printed by `r1flow run` (its entry point, in this process) before anything is computed."""
    from flows.cli.app import main

    f = tmp_path / "big.jsonl"
    f.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n"
                 + json.dumps({"question": "x" * 2_000_000, "answer": "1"}) + "\n")
    n = len(R1_SYSTEM_PROMPT) + 2_000_000
    home = tmp_path / "home"
    monkeypatch.setenv("R1FLOW_HOME", str(home))
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--set", f"prompts.files=[{f}]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"r1flow: error: {f}: line 2: the prompt is {n:,} characters, over the limit of "
                          f"65,536 (prompts.max_prompt_chars"), err
    assert err.rstrip().endswith(f"--set prompts.max_prompt_chars={n}") and err.count("\n") == 1
    assert not (home / "artifacts").exists() or not any((home / "artifacts").iterdir())  # nothing computed
    # within the limit, the 2 MB line is read (a 4 MB line too: the block grows with the longest line)
    assert len(prompts.file_rows(f, R1_SYSTEM_PROMPT, n)) == 2
    f.write_text(json.dumps({"question": "y" * 4_000_000}) + "\n" + json.dumps({"question": "z"}) + "\n")
    assert [len(r["messages"][1]["content"]) for r in prompts.file_rows(f, R1_SYSTEM_PROMPT)] == [4_000_000, 1]


def test_a_repeated_question_in_a_user_file_is_dropped_with_a_count_and_a_clashing_id_is_refused(tmp_path, caplog):
    """Issue 47 item 6: a file with a repeated question failed after the stage ran ("prompts output: column 'id'
    has duplicate value ...", no file, no line). Now the repeat is dropped (the first kept) and the log counts it;
    an id of the file's own that names two different prompts is refused before compute, naming both lines."""
    import logging

    f = tmp_path / "mine.jsonl"
    rows = [{"question": "What is 2+2?", "answer": "4"}, {"question": "What is 3+3?", "answer": "6"},
            {"question": "What is 2+2?", "answer": "4"}, {"question": "What is 5+5?", "answer": "10"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PromptsConfig(tasks={}, files=[str(f)], eval_fraction=0.5)
    prompts.check(cfg)
    ctx = LocalContext(tmp_path / "out", seed=0)
    with caplog.at_level(logging.INFO):
        out = prompts.run(cfg, {}, ctx)["prompts"]
    got = pq.read_table(out.path / "data.parquet").to_pylist()
    assert [r["messages"][1]["content"] for r in got] == ["What is 2+2?", "What is 3+3?", "What is 5+5?"]
    assert f"prompts: {f}: 1 repeated prompt(s) dropped" in caplog.text
    assert prompts.without_repeats([{"id": "a"}, {"id": "b"}, {"id": "a"}, {"id": "a"}]) == ([{"id": "a"}, {"id": "b"}], 2)

    rows[3]["id"] = rows[1]["id"] = "q7"
    f.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line: lines count it
    with pytest.raises(SchemaError, match=rf"^{f}: line 3 and line 5: id 'q7' names two different prompts"):
        prompts.check(cfg)


def test_a_users_own_held_out_set_for_a_single_stage_run_replaces_the_default_tasks(tmp_path):
    """Issue 47 item 6: `r1flow stage prompts --set files=[mine.jsonl] --set tasks={}` kept the default
    basic_arithmetic task (the `{}` merged into it), so 256 generated prompts joined the user's set. `{}` (and `[]`)
    now replace; a recipe's `--set prompts.tasks={}` did already."""
    from flows.plan.recipes import deep_merge, load_plan, overrides_tree
    from flows.run.deploy import stage_config

    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"question": "What is 2+2?", "answer": "4", "split": "eval"}) + "\n")
    overrides = overrides_tree([f"files=[{f}]", "tasks={}"])
    cfg, _, _ = stage_config("prompts", None, "cpu", None, overrides)
    assert cfg["tasks"] == {} and cfg["files"] == [str(f)]
    assert [r["split"] for r in prompts.build_prompts(PromptsConfig(**cfg), seed=0)] == ["eval"]
    plan = load_plan("eval", "tiny", [f"prompts.files=[{f}]", "prompts.tasks={}"])
    assert plan.node("prompts").config_dict["tasks"] == {}
    assert deep_merge({"a": {"x": 1}, "b": [1]}, {"a": {"y": 2}, "b": []}) == {"a": {"x": 1, "y": 2}, "b": []}
    assert deep_merge({"a": {"x": 1}}, {"a": {}}) == {"a": {}}
