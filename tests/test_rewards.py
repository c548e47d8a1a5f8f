"""Rewards on literal cases: extraction, the R1 format, each verifier, score(), pass@k.

Expected values are worked out by hand in the docstrings; no mock stands in for math-verify or
reasoning-gym.
"""

from __future__ import annotations

import doctest
import json
import math
from concurrent.futures import ThreadPoolExecutor

import math_verify
import pytest
import reasoning_gym

from stages import rewards
from stages.rewards import (
    R1_FORMAT_EXAMPLE,
    R1_SYSTEM_PROMPT,
    VERIFIERS,
    Verdict,
    extract_answer,
    format_ok,
    format_reward,
    gold_completion,
    pass_at_k,
    score,
)


def row(answer: str | None, verifier: str = "math", task: str = "math", metadata: dict | None = None) -> dict:
    """A `prompts` row as the Arrow table yields it (metadata is JSON text)."""
    return {
        "id": "p0",
        "messages": [{"role": "system", "content": R1_SYSTEM_PROMPT}, {"role": "user", "content": "What is it?"}],
        "answer": answer,
        "task": task,
        "verifier": verifier,
        "split": "eval",
        "metadata": json.dumps(metadata or {}),
    }


def r1(answer: str, think: str = "working") -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


def test_docstring_examples_hold():
    """The worked examples in the module's docstrings are executed, not just read."""
    result = doctest.testmod(rewards)
    assert result.attempted >= 10
    assert result.failed == 0


# --------------------------------------------------------------------------- extract_answer


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>x</think><answer>7</answer>", "7"),
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),  # last block wins, stripped
        ("<think>I guess <answer>9</answer></think><answer>3</answer>", "3"),  # block in think ignored
        ("<think>I guess <answer>9</answer></think>no tags here", None),  # only thinking had one
        ("<think>\\boxed{9}</think> so \\boxed{4}", "4"),  # boxed in think ignored
        ("<think>still thinking \\boxed{9}", None),  # unclosed think: the rest is thinking
        ("<think>a</think><think>b <answer>9</answer>", None),  # second, unclosed think
        ("prompt opened think \\boxed{9}</think><answer>5</answer>", "5"),  # stray </think>
        ("stray \\boxed{9}</think> nothing after", None),  # text before stray </think> is thinking
        ("first \\boxed{1}, finally \\boxed{2}", "2"),
        ("\\boxed{\\frac{63}{400}}", "\\frac{63}{400}"),  # nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not structure
        ("\\boxed{\\left\\{ x > 0 \\right.}", "\\left\\{ x > 0 \\right."),  # a lone \{ does not open
        ("\\boxed{\\boxed{6}}", "\\boxed{6}"),  # outermost box, inner not counted separately
        ("\\boxed{8} and a broken \\boxed{9", "8"),  # unbalanced box skipped
        ("<answer>The result is \\boxed{12}.</answer>", "12"),  # boxed inside the answer block
        ("<answer>  </answer>", None),  # blank answer
        ("<answer>5", None),  # unclosed answer block, no box
        ("The answer is 5.", None),
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_answer_block_beats_later_box():
    """An answer block is preferred over any \\boxed outside it, even a later one."""
    assert extract_answer("<answer>1</answer> \\boxed{2}") == "1"


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion",
    [
        "<think>a</think><answer>b</answer>",
        "  \n<think>\nmulti\nline\n</think>\n\n<answer> 42 </answer>\n",
        "<think></think><answer>42</answer>",  # empty think is allowed (documented)
        R1_FORMAT_EXAMPLE,
    ],
)
def test_format_ok_true(completion):
    assert format_ok(completion)
    assert format_reward(completion) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>42</answer>",  # missing think
        "<think>a</think>",  # missing answer
        "<think>a</think><answer>1</answer><answer>2</answer>",  # two answers
        "<think>a</think><think>b</think><answer>1</answer>",  # two thinks
        "<think>a</think><answer>1</answer> and more",  # text after answer
        "Sure! <think>a</think><answer>1</answer>",  # text before think
        "<think>a</think> so <answer>1</answer>",  # text between
        "<answer>1</answer><think>a</think>",  # wrong order
        "<think>a <answer>1</answer></think>",  # answer inside think
        "<think>a</think><answer>  </answer>",  # blank answer
        "<think>a</think><answer>1",  # unclosed answer (truncated generation)
        "<think>a<answer>1</answer>",  # unclosed think
        "",
    ],
)
def test_format_ok_false(completion):
    assert not format_ok(completion)
    assert format_reward(completion) == 0.0


def test_system_prompt_names_the_tags_and_its_example_is_well_formed():
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in R1_SYSTEM_PROMPT
    assert R1_FORMAT_EXAMPLE in R1_SYSTEM_PROMPT
    assert format_ok(R1_FORMAT_EXAMPLE)
    assert extract_answer(R1_FORMAT_EXAMPLE) == "42"
    assert len(R1_SYSTEM_PROMPT) < 300  # small models: keep it short


@pytest.mark.parametrize(("answer", "think"), [("-4", "5 - 3 = 2, 2 - 6 = -4"), ("\\frac{1}{2}", ""), ("B", "x\ny")])
def test_gold_completion_round_trips(answer, think):
    completion = gold_completion(answer, think)
    assert completion == f"<think>\n{think}\n</think>\n<answer>{answer}</answer>"
    assert format_ok(completion)
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("answer", ["", "  ", "1</answer><answer>2"])
def test_gold_completion_rejects_what_would_be_malformed(answer):
    with pytest.raises(ValueError, match="well-formed"):
        gold_completion(answer, "t")


# --------------------------------------------------------------------------- math verifier


@pytest.mark.parametrize(
    ("reference", "completion", "correct"),
    [
        ("63/400", r1("\\boxed{\\frac{63}{400}}"), True),  # 63/400 = 0.1575
        ("0.1575", r1("\\boxed{\\frac{63}{400}}"), True),
        ("\\frac{63}{400}", r1("0.1575"), True),
        ("1/2", r1("0.5"), True),
        ("0.5", r1("\\frac12"), True),
        ("1/2", "so \\boxed{0.5}", True),  # boxed fallback, no tags
        ("2", r1("3"), False),
        ("2", r1("2x"), False),  # 2x is 2*x, not 2
        ("1/3", r1("0.33"), False),  # 1/3 = 0.3333…, differs at 6 places
        ("2", r1("the number two"), False),  # no math in the answer: wrong, not unscoreable
        ("2", "<think>it is \\boxed{2}</think>", False),  # answer only in thinking: none given
    ],
)
def test_math_verifier(reference, completion, correct):
    v = score(row(reference), completion)
    assert v.correct is correct
    assert v.reward == (1.0 if correct else 0.0)
    assert v.components["accuracy"] == v.reward
    assert v.components["math"] == v.reward


def test_math_verifier_failure_is_none_not_zero():
    """A reference of 1/0 is sympy's zoo; math-verify raises comparing with it.

    Its default mode (raise_on_error=False) turns that into False — a silent 0. We must
    return None (could not score) instead.
    """
    silent = math_verify.verify(
        math_verify.parse("$1/0$", parsing_timeout=None), math_verify.parse("$0.5$", parsing_timeout=None),
        timeout_seconds=None,
    )
    assert silent is False  # the trap this guards against exists in this math-verify version
    assert VERIFIERS["math"]("0.5", row("1/0")) is None
    v = score(row("1/0"), r1("0.5"))
    assert v.correct is None
    assert v.reward is None
    assert "accuracy" not in v.components and "math" not in v.components


def test_math_unparseable_reference_is_none():
    """A reference with nothing math-verify can extract cannot be scored, even with no answer."""
    assert VERIFIERS["math"]("5", row("")) is None
    assert VERIFIERS["math"](None, row("")) is None
    assert VERIFIERS["math"](None, row("5")) == 0.0


def test_math_verifier_in_worker_threads():
    """DESIGN §6: math-verify's signal.alarm raises off the main thread unless timeouts are off."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(ValueError, match="thread"):  # the trap, with math-verify's defaults
            pool.submit(math_verify.parse, "1/2").result()
        verdicts = list(pool.map(lambda c: score(row("1/2"), c), [r1("0.5"), r1("\\frac{1}{2}"), r1("0.6")]))
    assert [v.correct for v in verdicts] == [True, True, False]
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0]


# --------------------------------------------------------------------------- exact verifier


@pytest.mark.parametrize(
    ("reference", "answer", "correct"),
    [
        ("Paris", "  paris ", True),  # strip + casefold
        ("New  York", "new york", True),  # whitespace collapsed
        ("B", "(B)", True),
        ("(c)", "C", True),
        ("B", "b)", True),
        ("B", "(C)", False),
        ("Paris", "Lyon", False),
        ("ab", "(ab)", False),  # only a lone choice letter loses its parentheses
    ],
)
def test_exact_verifier(reference, answer, correct):
    v = score(row(reference, verifier="exact"), r1(answer))
    assert v.correct is correct
    assert v.components["exact"] == (1.0 if correct else 0.0)


def test_exact_without_answer_is_wrong_and_without_reference_is_none():
    assert score(row("B", verifier="exact"), "no answer at all").correct is False
    assert score(row(None, verifier="exact"), r1("B")).correct is None


# --------------------------------------------------------------------------- reasoning-gym verifier


def rg_rows(task: str = "basic_arithmetic") -> list[dict]:
    """Rows as the prompts stage stores them: entry metadata + question, through JSON."""
    ds = reasoning_gym.create_dataset(task, size=5, seed=1)
    return [
        row(e["answer"], verifier="reasoning_gym", task=task, metadata={**e["metadata"], "question": e["question"]})
        for e in ds
    ]


def test_reasoning_gym_basic_arithmetic_right_and_wrong():
    """seed 1, entry 0 is 'Calculate 5 - 3 - 6.' = -4; entry 1 is '2 - -1' = 3."""
    rows = rg_rows()
    assert [r["answer"] for r in rows[:2]] == ["-4", "3"]
    right = score(rows[0], gold_completion("-4", "5 - 3 = 2, 2 - 6 = -4"))
    assert right == Verdict(
        correct=True, extracted="-4", format_ok=True, reward=1.0,
        components={"format": 1.0, "reasoning_gym": 1.0, "accuracy": 1.0}, correct_lenient=True,
    )
    wrong = score(rows[0], r1("4"))
    assert wrong.correct is False and wrong.reward == 0.0
    assert wrong.components["reasoning_gym"] == 0.0
    assert score(rows[1], r1("3")).correct is True
    assert score(rows[1], "<think>3</think>").correct is False  # no answer given


def test_reasoning_gym_partial_credit_is_not_correct():
    """basic_arithmetic's default checker: answer containing the reference scores
    len(ref)/len(answer): "-4" inside "x -4" is 2/4 = 0.5, kept raw, but not correct.
    """
    v = score(rg_rows()[0], r1("x -4"))
    assert v.components["reasoning_gym"] == 0.5
    assert v.correct is False
    assert v.components["accuracy"] == 0.0
    assert v.reward == 0.0
    # the raw score can be the reward itself by weighting it
    assert score(rg_rows()[0], r1("x -4"), weights={"reasoning_gym": 1.0}).reward == 0.5


# --------------------------------------------------------------------------- score / registry


def test_verifier_none_cannot_score():
    v = score(row("anything", verifier="none"), r1("anything"))
    assert v.correct is None
    assert v.reward is None
    assert v.extracted == "anything"
    assert v.format_ok is True
    assert v.components == {"format": 1.0}


def test_unknown_verifier_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match="'sympy'") as err:
        score(row("1", verifier="sympy"), r1("1"))
    for name in ("reasoning_gym", "math", "exact", "none"):
        assert name in str(err.value)


def test_registry_has_the_four_verifiers():
    assert set(VERIFIERS) == {"reasoning_gym", "math", "exact", "none"}


def test_format_weight_adds_to_accuracy():
    """weights accuracy 1, format 0.5: right + well formed = 1.5; right, no tags = 1.0;
    wrong + well formed = 0.5."""
    w = {"accuracy": 1.0, "format": 0.5}
    assert score(row("2"), r1("2"), weights=w).reward == 1.5
    assert score(row("2"), "\\boxed{2}", weights=w).reward == 1.0
    assert score(row("2"), r1("3"), weights=w).reward == 0.5


def test_default_weights_ignore_format():
    v = score(row("2"), "\\boxed{2}")
    assert v.correct is True and v.format_ok is False
    assert v.reward == 1.0
    assert v.components["format"] == 0.0


def test_format_only_reward_is_defined_when_the_answer_cannot_be_scored():
    """No non-zero weight on an absent component: the reward exists."""
    assert score(row(None), r1("2"), weights={"format": 1.0}).reward == 1.0
    assert score(row(None), r1("2"), weights={"format": 1.0, "accuracy": 1.0}).reward is None


def test_unknown_weight_is_an_error():
    with pytest.raises(ValueError, match="acuracy"):
        score(row("2"), r1("2"), weights={"acuracy": 1.0})


def test_verdict_is_frozen():
    v = score(row("2"), r1("2"))
    with pytest.raises(AttributeError):
        v.correct = False  # type: ignore[misc]


# --------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (4, 0, 2, 0.0),  # nothing correct
        (4, 4, 2, 1.0),  # everything correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct one
        (3, 1, 3, 1.0),  # k = n: pass iff c > 0
    ],
)
def test_pass_at_k_hand_worked(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_form():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_finite():
    """C(1000, 500) overflows a float; the product form does not: pass@1 = c/n = 0.25."""
    assert pass_at_k(1000, 250, 1) == pytest.approx(0.25)
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # c = 1: k/n


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_lenient_accuracy_is_for_eval_only():
    """A base model that writes '5 - 3 = 2' without tags: strict incorrect (no answer to score, and
    the reward stays 0), lenient correct. A tagged wrong answer stays wrong leniently too."""
    row = {"verifier": "math", "answer": "2", "task": "t", "metadata": "{}", "messages": []}
    v = score(row, "5 - 3 = 2")
    assert v.correct is False and v.reward == 0.0 and v.correct_lenient is True
    v = score(row, "<think>it is 2</think><answer>3</answer>")
    assert v.correct is False and v.correct_lenient is False
    v = score(row, "<think>2</think>no number here")
    assert v.correct_lenient is False
    assert score({**row, "verifier": "none"}, "2").correct_lenient is None
