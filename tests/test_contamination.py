"""Decontamination's pure functions (stages/math/contamination.py), on literal texts worked out by hand."""

from __future__ import annotations

from stages.math.contamination import (
    NGRAM,
    HeldOut,
    TrainingRow,
    contamination_metrics,
    examples,
    find_contamination,
    training_rows,
    words,
)


def test_normalisation_keeps_what_changes_a_problem():
    # NFKC maps the full-width digits, casefold the capital, U+2212 is "-"; the final "." and "?" go
    assert words("Calculate \uff15 \u2212 3.") == ("calculate", "5", "-", "3")
    assert words("calculate 5-3") == words("Calculate 5 - 3.")
    assert words("2 - -1") == ("2", "-", "-", "1") != words("2 - 1")
    assert words("What is 3.5 + x2?") == ("what", "is", "3.5", "+", "x2")
    assert words("(4 * 5) / 2 = ?, \"yes\"; 10%") == ("(", "4", "*", "5", ")", "/", "2", "=", "yes", "10", "%")


def rows(*questions: str, completion: str = "") -> list[TrainingRow]:
    return [TrainingRow(q, (completion,) if completion else (), f"d row {i}") for i, q in enumerate(questions, 1)]


def test_short_prompts_match_only_whole_questions():
    held = [HeldOut("a", "What is 3 + 4?", "7"), HeldOut("b", "Calculate 3 + 4.", "7")]
    # "what is 3 + 5" differs in one number; "calculate 3 + 4 + 5" holds prompt b word for word, yet is another problem
    found = find_contamination(held, rows("What is 3 + 5?", "Calculate 3 + 4 + 5."))
    assert [f.kinds for f in found] == [{}, {}]
    found = find_contamination(held, rows("what is 3+4"))
    assert [f.kinds for f in found] == [{"exact": "d row 1"}, {}]


def test_answer_leakage_needs_the_same_question_and_the_answer_as_words():
    held = [HeldOut("a", "Calculate -33 / 11 + -22.", "-25"), HeldOut("b", "Calculate 5 - 3.", "2")]
    training = [TrainingRow("calculate -33/11 + -22", ("<think>so</think><answer>-25</answer>",), "sft row 1"),
                TrainingRow("Calculate 5 - 3.", ("the answer is 25",), "sft row 2"),  # "2" is not the word "25"
                TrainingRow("Calculate 6 - 4.", ("2",), "sft row 3")]  # the answer of another question
    found = find_contamination(held, training)
    assert found[0].kinds == {"exact": "sft row 1", "answer_leak": "sft row 1"}
    assert found[1].kinds == {"exact": "sft row 2"}


TEMPLATE = "State the final answer to the following arithmetic problem:"  # 9 words (":" is dropped)


def test_ngram_overlap_needs_most_of_a_long_prompt_covered():
    # 9 template words + "1663 - 5242 - 9376 - 8961 + 7634 =" (10 words) = 19 words, 7 windows of 13
    held = [HeldOut("c", f"{TEMPLATE} 1663 - 5242 - 9376 - 8961 + 7634 =")]
    assert len(words(held[0].question)) == 19
    # a neighbour sharing the first 13 words: 13/19 = 0.68 of the prompt covered < 0.8: clean
    assert find_contamination(held, rows(f"{TEMPLATE} 1663 - 5242 - 1 =")) == find_contamination(held, [])
    assert find_contamination(held, rows(f"{TEMPLATE} 1663 - 5242 - 1 ="))[0].kinds == {}
    # a completion quoting the last 16 words (from "answer"): 16/19 = 0.84 covered: flagged by n-gram, not exact
    quote = "answer to the following arithmetic problem: 1663 - 5242 - 9376 - 8961 + 7634 = -14282"
    found = find_contamination(held, [TrainingRow("something else", (quote,), "samples row 4")])
    assert found[0].kinds == {"ngram": "samples row 4"}
    # the last 15 words (from "to"): 15/19 = 0.79 < 0.8: clean
    quote15 = "to the following arithmetic problem: 1663 - 5242 - 9376 - 8961 + 7634 ="
    assert len(words(quote15)) == 15 and NGRAM == 13
    assert find_contamination(held, rows(quote15))[0].kinds == {}


def test_training_rows_by_kind():
    msgs = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Calculate 5 - 3."}]
    prompts = [{"messages": msgs, "answer": "2", "split": "train"}, {"messages": msgs, "answer": "2", "split": "eval"}]
    assert training_rows("prompts", prompts, "p", "eval") == [TrainingRow("Calculate 5 - 3.", ("2",), "p row 1")]
    sft = [{"messages": [*msgs, {"role": "assistant", "content": "<answer>2</answer>"}]}]
    assert training_rows("sft", sft, "s", "eval") == [TrainingRow("Calculate 5 - 3.", ("<answer>2</answer>",), "s row 1")]
    pref = [{"messages": msgs, "chosen": "2", "rejected": "3"}]
    assert training_rows("preferences", pref, "q", "eval")[0].completions == ("2", "3")
    steps = [{"messages": msgs, "steps": ["5 - 3 = 2", "so 2"]}]
    assert training_rows("steps", steps, "t", "eval")[0].completions == ("5 - 3 = 2\nso 2",)
    assert training_rows("eval", [{"completion": "x"}], "e", "eval") == []


def test_metrics_and_examples():
    held = [HeldOut(str(i), f"Calculate {i} + 1.", str(i + 1)) for i in range(4)]
    found = find_contamination(held, [TrainingRow("Calculate 0 + 1.", ("1",), "r1"),
                                      TrainingRow("Calculate 2 + 1.", ("4",), "r2")])
    assert contamination_metrics(found, datasets=2) == {
        "contamination/prompts": 2.0, "contamination/share": 0.5, "contamination/datasets": 2.0,
        "contamination/exact": 2.0, "contamination/ngram": 0.0, "contamination/answer_leak": 1.0}
    assert examples(found, limit=1) == [{"prompt_id": "0", "question": "Calculate 0 + 1.",
                                         "matches": {"answer_leak": "r1", "exact": "r1"}}]
    assert contamination_metrics([], datasets=0)["contamination/share"] == 0.0
