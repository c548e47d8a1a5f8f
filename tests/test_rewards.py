"""Rewards on literal cases: extraction, the R1 format, each verifier, shaping terms, score(), pass@k.

Expected values are worked out by hand in the docstrings; no mock stands in for math-verify or
reasoning-gym. The sandbox is replaced by a recording fake only where the test is about how
the code verifier calls it; one test runs the real sandbox.
"""

from __future__ import annotations

import doctest
import json
import logging
import math
import sys
import threading
import time
import types
import typing
from concurrent.futures import ThreadPoolExecutor

import math_verify
import pydantic
import pytest
import reasoning_gym

from schemas.configs import RewardSpec, SandboxLimits
from stages.rewards import answers, math_verifier, shaping, verifiers
from stages.rewards.answers import (
    LANGUAGE_SCRIPTS,
    R1_FORMAT_EXAMPLE,
    R1_SYSTEM_PROMPT,
    extract_answer,
    extract_answer_lenient,
    extract_answer_strict,
    extract_program,
    format_ok,
    format_reward,
    gold_completion,
    language_consistency,
    reformat_r1,
)
from stages.rewards.math_verifier import shutdown_math_pool
from stages.rewards.shaping import cosine_scaled, overlong_penalty, repetition_penalty
from stages.rewards.verifiers import VERIFIERS, Verdict, pass_at_k, score

SPEC = RewardSpec()
ACCURACY_ONLY = RewardSpec(weights={"accuracy": 1.0})


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
    """The worked examples in the modules' docstrings are executed, not just read."""
    results = [doctest.testmod(module) for module in (answers, math_verifier, shaping, verifiers)]
    assert sum(r.failed for r in results) == 0
    assert sum(r.attempted for r in results) >= 10


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


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>x</think><answer> 7 </answer>", "7"),  # one block, stripped
        ("<think>x</think>so \\boxed{7}", None),  # no boxed fallback outside a block
        ("\\boxed{7}", None),
        ("<answer>The result is \\boxed{12}.</answer>", "12"),  # boxed inside the one block still counts
        ("<think>x</think><answer>6</answer><answer>7</answer>", None),  # two blocks: hedging, no answer
        ("<answer>6</answer> or maybe <answer>7</answer> <answer>8</answer>", None),  # three blocks
        ("<answer>6 <answer>7</answer>", None),  # a second <answer> inside the block
        ("<answer>7</answer><answer>", None),  # a dangling second <answer>
        ("</answer>7<answer>", None),  # tags in the wrong order
        ("<think>maybe <answer>6</answer></think><answer>7</answer>", "7"),  # blocks in thinking don't count
        ("<think>maybe <answer>6</answer></think>no block", None),
        ("<think>still thinking <answer>6</answer>", None),  # unclosed think: all thinking
        ("<answer>  </answer>", None),  # blank
        ("<answer>1</answer> \\boxed{2}", "1"),  # a box outside the block is ignored
    ],
)
def test_extract_answer_strict(completion, expected):
    assert extract_answer_strict(completion) == expected


def test_strict_answer_guard_stops_hedging_from_paying():
    """Two answer blocks, the last one right: extract_answer takes the last, so without the guard
    accuracy is 1; with strict_answer there is no answer, accuracy 0. Lenient correctness (an
    evaluation measure) stays extract_answer's: True both times."""
    hedge = "<think>6 or 7?</think><answer>6</answer><answer>7</answer>"
    loose = score(row("7"), hedge, ACCURACY_ONLY)
    assert (loose.extracted, loose.components["accuracy"], loose.reward, loose.correct) == ("7", 1.0, 1.0, True)
    strict = score(row("7"), hedge, RewardSpec(weights={"accuracy": 1.0}, strict_answer=True))
    assert (strict.extracted, strict.components["accuracy"], strict.reward, strict.correct) == (None, 0.0, 0.0, False)
    assert loose.correct_lenient is True and strict.correct_lenient is True


def test_strict_answer_guard_drops_the_boxed_fallback_but_not_a_single_block():
    strict = RewardSpec(weights={"accuracy": 1.0}, strict_answer=True)
    assert score(row("2"), "<think>1 + 1</think> \\boxed{2}", ACCURACY_ONLY).reward == 1.0
    assert score(row("2"), "<think>1 + 1</think> \\boxed{2}", strict).reward == 0.0
    assert score(row("2"), r1("\\boxed{2}"), strict).reward == 1.0
    assert score(row("b", verifier="exact"), r1("(B)"), strict).reward == 1.0  # every answer verifier


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
    v = score(row(reference), completion, ACCURACY_ONLY)
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
    assert VERIFIERS["math"]("0.5", row("1/0"), SPEC) is None
    v = score(row("1/0"), r1("0.5"))
    assert v.correct is None
    assert v.reward is None
    assert "accuracy" not in v.components and "math" not in v.components


def test_math_unparseable_reference_is_none():
    """A reference with nothing math-verify can extract cannot be scored, even with no answer."""
    assert VERIFIERS["math"]("5", row(""), SPEC) is None
    assert VERIFIERS["math"](None, row(""), SPEC) is None
    assert VERIFIERS["math"](None, row("5"), SPEC) == 0.0


def test_math_verifier_in_worker_threads():
    """DESIGN §6: math-verify's signal.alarm raises off the main thread unless timeouts are off."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(ValueError, match="thread"):  # the trap, with math-verify's defaults
            pool.submit(math_verify.parse, "1/2").result()
        verdicts = list(pool.map(lambda c: score(row("1/2"), c, ACCURACY_ONLY),
                                 [r1("0.5"), r1("\\frac{1}{2}"), r1("0.6")]))
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
    # default weights: accuracy 1 + format 0.2; its 11 word trigrams are all distinct: repetition 0;
    # the thinking "5 - 3 = 2, 2 - 6 = -4" has no words: language 0
    assert right == Verdict(
        correct=True, extracted="-4", format_ok=True, reward=1.2,
        components={"format": 1.0, "tags": 1.0, "reasoning_gym": 1.0, "accuracy": 1.0, "repetition": 0.0,
                    "language": 0.0},
        correct_lenient=True,
    )
    wrong = score(rows[0], r1("4"), ACCURACY_ONLY)
    assert wrong.correct is False and wrong.reward == 0.0
    assert wrong.components["reasoning_gym"] == 0.0
    assert score(rows[1], r1("3")).correct is True
    assert score(rows[1], "<think>3</think>").correct is False  # no answer given


def test_reasoning_gym_partial_credit_is_not_correct():
    """basic_arithmetic's default checker: answer containing the reference scores
    len(ref)/len(answer): "-4" inside "x -4" is 2/4 = 0.5, kept raw, but not correct.
    """
    v = score(rg_rows()[0], r1("x -4"), ACCURACY_ONLY)
    assert v.components["reasoning_gym"] == 0.5
    assert v.correct is False
    assert v.components["accuracy"] == 0.0
    assert v.reward == 0.0
    # the raw score can be the reward itself by weighting it
    assert score(rg_rows()[0], r1("x -4"), RewardSpec(weights={"reasoning_gym": 1.0})).reward == 0.5


# --------------------------------------------------------------------------- score / registry


def test_verifier_none_cannot_score():
    v = score(row("anything", verifier="none"), r1("anything"))
    assert v.correct is None
    assert v.reward is None
    assert v.extracted == "anything"
    assert v.format_ok is True
    assert v.components == {"format": 1.0, "tags": 1.0, "repetition": 0.0, "language": 1.0}  # "anything"


def test_unknown_verifier_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match="'sympy'") as err:
        score(row("1", verifier="sympy"), r1("1"))
    for name in ("reasoning_gym", "math", "exact", "code", "none"):
        assert name in str(err.value)


def test_registry_has_the_five_verifiers():
    assert set(VERIFIERS) == {"reasoning_gym", "math", "exact", "code", "none"}


def test_format_weight_adds_to_accuracy():
    """weights accuracy 1, format 0.5: right + well formed = 1.5; right, no tags = 1.0;
    wrong + well formed = 0.5."""
    w = RewardSpec(weights={"accuracy": 1.0, "format": 0.5})
    assert score(row("2"), r1("2"), w).reward == 1.5
    assert score(row("2"), "\\boxed{2}", w).reward == 1.0
    assert score(row("2"), r1("3"), w).reward == 0.5


def test_default_spec_is_reward_specs_defaults():
    """No spec: RewardSpec()'s weights, accuracy 1 + format 0.2 (stages/eval.py calls score(row, text))."""
    assert RewardSpec().weights == {"accuracy": 1.0, "format": 0.2}
    v = score(row("2"), "\\boxed{2}")
    assert v.correct is True and v.format_ok is False
    assert v.reward == 1.0
    assert v.components["format"] == 0.0
    assert score(row("2"), r1("2")).reward == pytest.approx(1.2)


def test_format_only_reward_is_defined_when_the_answer_cannot_be_scored():
    """No non-zero weight on an absent component: the reward exists."""
    assert score(row(None), r1("2"), RewardSpec(weights={"format": 1.0})).reward == 1.0
    assert score(row(None), r1("2"), RewardSpec(weights={"format": 1.0, "accuracy": 1.0})).reward is None


def test_unknown_weight_is_an_error_naming_each():
    with pytest.raises(ValueError, match="acuracy") as err:
        score(row("2"), r1("2"), RewardSpec(weights={"acuracy": 1.0, "lenght": 0.0, "format": 1.0}))
    assert "lenght" in str(err.value)  # zero weights are checked too
    assert "format" not in str(err.value).split(";")[0]


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


# --------------------------------------------------------------------------- shaping terms


@pytest.mark.parametrize(
    ("length", "max_tokens", "buffer", "expected"),
    [
        (0, 512, 128, 0.0),
        (384, 512, 128, 0.0),  # L = L_max - L_cache: last unpunished length
        (385, 512, 128, -1 / 128),  # (384 - 385) / 128
        (448, 512, 128, -0.5),  # (384 - 448) / 128
        (512, 512, 128, -1.0),  # L = L_max: (384 - 512) / 128, the ramp meets the hard penalty
        (513, 512, 128, -1.0),  # past L_max
        (10_000, 512, 128, -1.0),
        (512, 512, 0, 0.0),  # no buffer: no soft zone
        (513, 512, 0, -1.0),
        (25, 100, 100, -0.25),  # buffer = L_max: the ramp starts at 0, (0 - 25) / 100
    ],
)
def test_overlong_penalty_hand_worked(length, max_tokens, buffer, expected):
    assert overlong_penalty(length, max_tokens, buffer) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("length", "max_tokens", "buffer"), [(-1, 512, 128), (1, 0, 0), (1, 512, -1)])
def test_overlong_penalty_rejects_bad_arguments(length, max_tokens, buffer):
    with pytest.raises(ValueError):
        overlong_penalty(length, max_tokens, buffer)


@pytest.mark.parametrize(
    ("text", "n", "max_penalty", "expected"),
    [
        ("a b a b a b", 2, -1.0, -0.6),  # bigrams ab ba ab ba ab: T = 5, U = 2, (1 - 2/5) * -1
        ("a a a a", 1, -1.0, -0.75),  # T = 4, U = 1
        ("a a a a", 1, -0.5, -0.375),  # (1 - 1/4) * -0.5
        ("A a\ta\na", 1, -1.0, -0.75),  # casefolded, any whitespace separates words
        ("a b c a b c", 3, -1.0, -0.25),  # abc bca cab abc: T = 4, U = 3
        ("the cat sat", 3, -1.0, 0.0),  # exactly n words: one trigram, nothing repeats
        ("the cat", 3, -1.0, 0.0),  # fewer than n words
        ("", 1, -1.0, 0.0),
        ("one two three four", 2, -1.0, 0.0),
    ],
)
def test_repetition_penalty_hand_worked(text, n, max_penalty, expected):
    assert repetition_penalty(text, n, max_penalty) == pytest.approx(expected, abs=1e-12)


def test_repetition_penalty_no_repeats_is_positive_zero():
    assert math.copysign(1.0, repetition_penalty("one two three", 1, -1.0)) == 1.0


@pytest.mark.parametrize(("n", "max_penalty"), [(0, -1.0), (2, 0.5)])
def test_repetition_penalty_rejects_bad_arguments(n, max_penalty):
    with pytest.raises(ValueError):
        repetition_penalty("a b c", n, max_penalty)


@pytest.mark.parametrize(
    ("correct", "length", "expected"),
    [
        # RewardSpec defaults: max_len 512; correct 0.5 (at max_len) .. 1.0 (at 0);
        # wrong 0.0 (at max_len) .. -0.5 (at 0). reward = lo + 0.5 (hi - lo)(1 + cos(pi L / 512)).
        (True, 0, 1.0),  # cos 0 = 1: hi
        (True, 128, 0.5 + 0.25 * (1 + math.sqrt(2) / 2)),  # cos(pi/4): 0.9267766952966369
        (True, 256, 0.75),  # cos(pi/2) = 0: the midpoint
        (True, 512, 0.5),  # cos pi = -1: lo
        (True, 1024, 0.5),  # clamped at max_len
        (False, 0, -0.5),  # short and wrong: the worst
        (False, 256, -0.25),
        (False, 512, 0.0),
        (False, 2000, 0.0),
    ],
)
def test_cosine_scaled_hand_worked(correct, length, expected):
    assert cosine_scaled(correct, length, SPEC) == pytest.approx(expected, abs=1e-12)


def test_cosine_scaled_uses_the_spec():
    """max_len 100, correct 0 .. 2: at L = 50, 0 + 0.5 * 2 * (1 + 0) = 1; wrong -1 .. 1 swapped:
    lo = 1 (max_value_wrong), hi = -1: at L = 0, -1; at L = 100, 1."""
    spec = RewardSpec(cosine_max_len=100, cosine_min_value_correct=0.0, cosine_max_value_correct=2.0,
                      cosine_min_value_wrong=-1.0, cosine_max_value_wrong=1.0)
    assert cosine_scaled(True, 50, spec) == pytest.approx(1.0)
    assert cosine_scaled(False, 0, spec) == pytest.approx(-1.0)
    assert cosine_scaled(False, 100, spec) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        cosine_scaled(True, -1, spec)


# --------------------------------------------------------------------------- score() components


ALL_WEIGHTS = RewardSpec(
    weights={"accuracy": 1.0, "format": 0.5, "overlong": 1.0, "cosine": 2.0, "repetition": 1.0, "reward_model": 0.1},
    overlong_max_tokens=512, overlong_buffer=128, cosine_max_len=896, repetition_ngram=1,
)


def test_score_components_and_weighted_sum():
    """Completion "<think>a a a a</think><answer>2</answer>", 448 tokens, reward model 3.0:
    accuracy 1; format 1; overlong (384 - 448) / 128 = -0.5; cosine at 448 / 896 = 1/2:
    0.5 + 0.25 * (1 + 0) = 0.75; repetition over the words ["<think>a", "a", "a",
    "a</think><answer>2</answer>"]: T = 4, U = 3, -0.25; reward_model 3.0.
    reward = 1 + 0.5 * 1 - 0.5 + 2 * 0.75 - 0.25 + 0.1 * 3 = 2.55.
    """
    v = score(row("2"), r1("2", think="a a a a"), ALL_WEIGHTS, num_tokens=448, rm_score=3.0)
    assert v.components == pytest.approx({
        "format": 1.0, "tags": 1.0, "accuracy": 1.0, "math": 1.0, "overlong": -0.5, "cosine": 0.75,
        "repetition": -0.25, "language": 1.0, "reward_model": 3.0,
    })
    assert v.reward == pytest.approx(2.55)
    assert v.correct is True


def test_score_wrong_answer_gets_the_wrong_cosine():
    """Wrong at 448 of 896: lo 0, hi -0.5 -> 0 + 0.5 * -0.5 * (1 + 0) = -0.25."""
    v = score(row("2"), r1("3"), ALL_WEIGHTS, num_tokens=448, rm_score=0.0)
    assert v.components["cosine"] == pytest.approx(-0.25)
    assert v.components["accuracy"] == 0.0


def test_score_optional_components_are_absent_without_their_inputs():
    v = score(row("2"), r1("2"))
    assert set(v.components) == {"format", "tags", "accuracy", "math", "repetition", "language"}
    unscorable = score(row(None), r1("2"), num_tokens=10)
    # no cosine without a verdict
    assert set(unscorable.components) == {"format", "tags", "overlong", "repetition", "language"}


@pytest.mark.parametrize(
    ("weights", "kwargs"),
    [
        ({"accuracy": 1.0, "reward_model": 0.5}, {"num_tokens": 10}),  # no rm_score
        ({"accuracy": 1.0, "overlong": 1.0}, {"rm_score": 1.0}),  # no num_tokens
        ({"cosine": 1.0}, {}),
    ],
)
def test_reward_is_none_when_a_weighted_component_is_missing(weights, kwargs):
    assert score(row("2"), r1("2"), RewardSpec(weights=weights), **kwargs).reward is None


def test_zero_weight_on_a_missing_component_does_not_matter():
    spec = RewardSpec(weights={"accuracy": 1.0, "reward_model": 0.0, "cosine": 0.0})
    assert score(row("2"), r1("2"), spec).reward == 1.0


def test_overlong_applies_to_unscorable_rows_too():
    """A length penalty needs no verdict: with only overlong weighted, 513 tokens is -1 either way."""
    spec = RewardSpec(weights={"overlong": 1.0})
    assert score(row(None, verifier="none"), r1("x"), spec, num_tokens=513).reward == -1.0


# --------------------------------------------------------------------------- code verifier


@pytest.mark.parametrize(
    ("completion", "program"),
    [
        ("```python\nprint(1)\n```", "print(1)"),
        ("<think>t</think><answer>```python\nprint(1)\n```</answer>", "print(1)"),
        ("```\nx = 1\nprint(x)\n```", "x = 1\nprint(x)"),  # untagged
        ("```Python \nprint(1)\n```", "print(1)"),  # info string casefolded, stripped
        ("```py\na()\n```\nthen\n```python\nb()\n```", "b()"),  # the last python block
        ("```python\na()\n```\nOutput:\n```\n5\n```", "a()"),  # python beats a later untagged block
        ("```\nold()\n```\n```cpp\nint main() {}\n```", "old()"),  # other languages ignored
        ("- step:\n  ```python\n  if x:\n      y()\n  ```", "if x:\n    y()"),  # dedented
        ("<think>```python\nprint(0)\n```</think>", None),  # only in thinking
        ("```python\nprint(1)", None),  # unclosed: truncated
        ("```cpp\nint main() {}\n```", None),
        ("<think>t</think><answer>print(3)</answer>", "print(3)"),  # no fence: the answer is the program
        ("```python\n\n```", None),  # empty
    ],
)
def test_extract_program(completion, program):
    assert extract_program(completion) == program


def code_row(tests: list[dict] | None) -> dict:
    return row(None, verifier="code", task="code", metadata={"tests": tests} if tests is not None else {})


ADD_TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}, {"input": "0 0\n", "output": "0"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.fixture()
def fake_sandbox(monkeypatch):
    """Replace stages.rewards.sandbox.run_tests by a recorder returning a set fraction (the module is
    stood in for if it cannot be imported)."""
    try:
        import stages.rewards.sandbox as module
    except ImportError:
        module = types.ModuleType("stages.rewards.sandbox")
        monkeypatch.setitem(sys.modules, "stages.rewards.sandbox", module)
    calls: list[tuple] = []
    state = {"fraction": 1.0}

    def run_tests(code, tests, limits):
        calls.append((code, tests, limits))
        return state["fraction"]

    monkeypatch.setattr(module, "run_tests", run_tests, raising=False)
    return calls, state


def test_code_verifier_runs_the_program_on_the_rows_tests(fake_sandbox):
    calls, state = fake_sandbox
    spec = RewardSpec(sandbox=SandboxLimits(wall_timeout_s=3.0), weights={"accuracy": 1.0, "code": 1.0})
    completion = r1(f"```python\n{ADD_PROGRAM}\n```", think="add them")
    v = score(code_row(ADD_TESTS), completion, spec)
    assert calls == [(ADD_PROGRAM, ADD_TESTS, spec.sandbox)]
    assert v.extracted == ADD_PROGRAM
    assert v.correct is True and v.correct_lenient is True
    assert v.components["code"] == 1.0 and v.reward == 2.0

    state["fraction"] = 2 / 3  # partial: raw score kept, not correct
    v = score(code_row(ADD_TESTS), completion, spec)
    assert v.correct is False
    assert v.components["code"] == pytest.approx(2 / 3)
    assert v.components["accuracy"] == 0.0
    assert v.reward == pytest.approx(2 / 3)


def test_code_verifier_without_tests_or_program(fake_sandbox):
    calls, _ = fake_sandbox
    assert score(code_row(None), r1("```python\nprint(1)\n```")).correct is None  # no tests: unscorable
    assert score(code_row([]), r1("```python\nprint(1)\n```")).correct is None
    v = score(code_row(ADD_TESTS), "<think>```python\nprint(1)\n```</think>")  # program only in thinking
    assert v.correct is False and v.correct_lenient is False and v.extracted is None
    assert calls == []  # nothing ran


def test_code_verifier_rejects_malformed_tests(fake_sandbox):
    with pytest.raises(ValueError, match="'p0'.*tests"):
        score(code_row({"input": "1"}), r1("print(1)"))  # type: ignore[arg-type]


def test_code_verifier_with_the_real_sandbox():
    spec = RewardSpec(sandbox=SandboxLimits(wall_timeout_s=10.0, cpu_time_s=5))
    right = score(code_row(ADD_TESTS), r1(f"```python\n{ADD_PROGRAM}\n```"), spec)
    assert right.correct is True and right.components["code"] == 1.0
    # a - b is right only for "0 0": 1 of 3
    wrong = score(code_row(ADD_TESTS), r1(f"```python\n{ADD_PROGRAM.replace('a + b', 'a - b')}\n```"), spec)
    assert wrong.correct is False and wrong.components["code"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------- math-verify pool

# 10^{10^{10^{10}}} against 1: math-verify/sympy ran for over 20 s (killed there) in the main
# thread, at ~90 MB and 100 % CPU (math-verify 0.9.0, sympy 1.14; measured 2026-11).
PATHOLOGICAL = "10^{10^{10^{10}}}"
KNOWN_CORRECT = [  # (reference, answer): math-verify says equal
    ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("63/400", "0.1575"), ("\\frac{63}{400}", "0.1575"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("2x+1", "1+2x"), ("\\{1,2\\}", "\\{2,1\\}"),
    ("x^2-1", "(x-1)(x+1)"), ("\\dfrac{3}{4}", "0.75"), ("10^{3}", "1000"), ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\sin(\\pi/6)", "\\frac12"),
]


def _pids_alive(pids) -> set[int]:
    """Those of `pids` still running (not gone and not zombies)."""
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_known_correct_answers_from_a_thread_pool():
    """DESIGN §6 acceptance: verifiers work from worker threads; each known-correct answer is 1.0."""
    assert sum(math_verifier._math_fast_path(ref, ans) is None for ref, ans in KNOWN_CORRECT) >= 8  # most use the pool
    with ThreadPoolExecutor(max_workers=8) as pool:
        verdicts = list(pool.map(lambda pair: score(row(pair[0]), r1(pair[1]), ACCURACY_ONLY), KNOWN_CORRECT * 2))
    assert [v.components["accuracy"] for v in verdicts] == [1.0] * len(KNOWN_CORRECT) * 2
    assert [v.reward for v in verdicts] == [1.0] * len(KNOWN_CORRECT) * 2


@pytest.mark.parametrize(
    ("reference", "answer"),
    [("1/2", "0.5"), ("63/400", "0.1575"), ("-3", "-3.0"), ("4/6", "2/3"), ("007", "7"), ("x + 1", " x  +\t1 "),
     ("2", None), ("1/3", "0.33"), ("2", "3"), ("1/0", "1/0")],
)
def test_fast_path_agrees_with_math_verify(reference, answer):
    """Where the fast path decides, math-verify (called directly, main thread) agrees. Exception
    by design: identical answers are 1.0 even where math-verify fails (1/0)."""
    fast = math_verifier._math_fast_path(reference, answer)
    if fast is not None and reference != "1/0":
        assert math_verifier._math_equal(reference, answer)[0] == fast


def test_pathological_answer_times_out_to_none_and_the_pool_recovers(caplog):
    """A check past math_timeout_s is None ("could not score", never 0), returned at the
    deadline; the stuck worker is killed, not left burning CPU; the next check gets a new pool."""
    spec = RewardSpec(math_timeout_s=1.0, weights={"accuracy": 1.0})
    old = math_verifier._math_pool()
    pids = set(old._processes)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="stages.rewards.math_verifier"):
        v = score(row(PATHOLOGICAL), r1("1"), spec)
    elapsed = time.monotonic() - start
    assert v.correct is None and v.reward is None and "accuracy" not in v.components
    assert 1.0 <= elapsed < 1.0 + 1.0
    assert "no verdict" in caplog.text  # a deadline, not a math-verify error
    deadline = time.monotonic() + 5.0
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_alive(pids)
    assert score(row("\\frac{1}{2}"), r1("0.5"), spec).reward == 1.0
    assert math_verifier._math_pool() is not old


def test_checks_killed_with_the_pool_are_resubmitted(caplog):
    """Another thread's deadline kills the whole pool: an innocent check in flight is resubmitted
    to the new pool and still gets its verdict. 2^{2^{28}} vs 3 takes ~1.4 s of sympy (wrong: 0.0)."""
    spec = RewardSpec(math_timeout_s=60.0)
    pool = math_verifier._math_pool()
    result: list = []
    with caplog.at_level(logging.INFO, logger="stages.rewards.math_verifier"):
        worker = threading.Thread(target=lambda: result.append(VERIFIERS["math"]("3", row("2^{2^{28}}"), spec)))
        worker.start()
        time.sleep(0.2)
        math_verifier._discard_math_pool(pool)  # what a timed-out check does
        worker.join(30)
    assert result == [0.0]
    assert "resubmitting" in caplog.text


def test_shutdown_math_pool_kills_workers_and_a_later_check_restarts():
    pids = set(math_verifier._math_pool()._processes)
    shutdown_math_pool()
    assert math_verifier._math_pool_instance is None
    deadline = time.monotonic() + 5.0
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_alive(pids)
    assert VERIFIERS["math"]("\\frac{1}{2}", row("0.5"), SPEC) == 1.0
    shutdown_math_pool()
    shutdown_math_pool()  # idempotent


def test_pool_workers_are_not_forked_from_this_process():
    """fork from a threaded process is unsafe: the pool uses forkserver (or spawn)."""
    assert math_verifier._math_pool()._mp_context.get_start_method() in ("forkserver", "spawn")


@pytest.mark.parametrize("text, expected", [
    ("<think>a</think><answer>1</answer>", 1.0),
    ("<think>a</think> 1", 0.5),
    ("<think><think>a</think>", 0.25),  # a doubled tag earns nothing for that tag
    ("no tags", 0.0),
])
def test_tag_count_reward(text, expected):
    assert answers.tag_count_reward(text) == expected
    row = {"verifier": "none", "answer": None, "task": "t", "metadata": "{}", "messages": []}
    assert score(row, text).components["tags"] == expected


# --------------------------------------------------------------------------- language consistency


@pytest.mark.parametrize(
    ("completion", "script", "expected"),
    [
        ("<think>the sum is 12</think><answer>12</answer>", "latin", 1.0),  # 3 words, digits are no words
        ("<think>the sum is 结果</think><answer>12</answer>", "latin", 0.75),  # 3 of 4
        ("<think>the sum is 结果</think><answer>12</answer>", "cjk", 0.25),  # 1 of 4
        ("<think>so kaфe is 5</think>", "latin", 2 / 3),  # "kaфe" mixes Latin and Cyrillic: neither
        ("<think>so kaфe is 5</think>", "cyrillic", 0.0),
        ("<think>сумма равна 12, ok</think>", "cyrillic", 2 / 3),  # сумма, равна of 3
        ("<think>αβγ = x</think>", "greek", 0.5),
        ("<think>12 + 3 = 15</think><answer>15</answer>", "latin", 0.0),  # no words
        ("", "latin", 0.0),
        ("<think>a</think> b c d", "latin", 1.0),  # only the thinking: "a"
        ("<think>a</think> b c 结果", "latin", 1.0),
        ("<think>a <think>b</think>结果", "latin", 1.0),  # a nested <think> is thinking text, not a word
        ("<think>dit is 结果", "latin", 2 / 3),  # unclosed think runs to the end
        ("prompt opened it 结果</think><answer>x</answer>", "latin", 0.75),  # stray </think>: before is thinking
        ("no tags at all 结果", "latin", 0.8),  # no think tag: the whole completion, 4 of 5
        ("<answer>结果</answer> ok", "latin", 0.5),  # no think tag: tags are not words; 结果, ok
        ("cafe\u0301 nai\u0308ve", "latin", 1.0),  # decomposed accents stay inside their word
        ("كَتَبَ الولد", "arabic", 1.0),  # 2 words; harakat do not split them
        ("食べる 人々 한국어 ok", "cjk", 0.75),  # kanji+kana, 々, hangul are all cjk
    ],
)
def test_language_consistency(completion, script, expected):
    assert language_consistency(completion, script) == pytest.approx(expected, abs=1e-12)


def test_language_scripts_are_reward_specs_choices():
    choices = typing.get_args(RewardSpec.model_fields["language_script"].annotation)
    assert set(LANGUAGE_SCRIPTS) == set(choices)
    with pytest.raises(pydantic.ValidationError, match="language_script"):
        RewardSpec(language_script="klingon")
    with pytest.raises(ValueError, match="klingon"):
        language_consistency("x", "klingon")


def test_language_is_a_weighted_component():
    """Weight 1 on language alone: the reward is the share, 0.75 in Latin, 0.25 in cjk; the
    component is there for any row, scorable or not."""
    text = "<think>the sum is 结果</think><answer>12</answer>"
    assert score(row("12"), text, RewardSpec(weights={"language": 1.0})).reward == 0.75
    assert score(row("12"), text, RewardSpec(weights={"language": 1.0}, language_script="cjk")).reward == 0.25
    assert score(row(None, verifier="none"), text).components["language"] == 0.75


# --------------------------------------------------------------------------- reformat_r1


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("2 + 3 = 5", "5", "<think>\n2 + 3 = 5\n</think>\n<answer>5</answer>"),
        ("  <think>2 + 3 = 5</think> so 5 \n", "5", "<think>\n2 + 3 = 5 so 5\n</think>\n<answer>5</answer>"),
        ("<think>a</think>5", "5", "<think>\na 5\n</think>\n<answer>5</answer>"),  # tags between words: a space
        ("<answer>1</answer><answer>2</answer>", "2", "<think>\n1 2\n</think>\n<answer>2</answer>"),
        ("<thi<think>nk>", "<answer>7", "<think>\n<thi nk>\n</think>\n<answer>7</answer>"),  # no tag re-forms
    ],
)
def test_reformat_r1(completion, answer, expected):
    out = reformat_r1(completion, answer)
    assert out == expected
    assert format_ok(out)


def test_reformat_r1_of_a_lenient_answer_scores_correct():
    """A base model's '12 + 30 = 42' is lenient-correct only; reformatted with its lenient answer it
    is well formed and strictly correct, even under the strict-answer guard."""
    text = "First, 12 + 30 = 42."
    v = score(row("42"), text)
    assert (v.correct, v.correct_lenient, v.format_ok) == (False, True, False)
    out = reformat_r1(text, extract_answer_lenient(text))
    assert out == "<think>\nFirst, 12 + 30 = 42.\n</think>\n<answer>42</answer>"
    strict = score(row("42"), out, RewardSpec(strict_answer=True))
    assert (strict.correct, strict.format_ok, strict.reward) == (True, True, pytest.approx(1.2))


@pytest.mark.parametrize("answer", ["", "  ", "<answer></answer>"])
def test_reformat_r1_needs_an_answer(answer):
    with pytest.raises(ValueError, match="no answer"):
        reformat_r1("2 + 3 = 5", answer)
