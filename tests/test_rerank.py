"""Best-of-N picks (stages.math.rerank) on hand-worked samples."""

import math

import pytest

from stages.math.rerank import best_pick, majority_pick, rerank_accuracy


def test_majority_takes_the_most_frequent_answer_and_the_first_on_a_tie():
    assert majority_pick(["4", "5", " 4", "5", "4"]) == 0  # "4" three times (whitespace stripped), "5" twice
    assert majority_pick(["7", "5", "5", "7"]) == 0  # a tie: the answer seen first
    assert majority_pick([None, "", "3", None]) == 2  # no answer never votes
    assert majority_pick([None, None]) == 0  # nothing answered: the first completion


def test_best_pick_takes_the_highest_score_and_nan_never_wins():
    assert best_pick([0.2, 0.9, 0.5]) == 1
    assert best_pick([0.9, 0.2, 0.9]) == 0  # a tie: the first
    assert best_pick([math.nan, -3.0]) == 1
    assert best_pick([math.nan, math.nan]) == 0
    with pytest.raises(ValueError):
        best_pick([])


def test_rerank_accuracy_counts_the_picked_completion_only():
    correct = [[False, True, True], [True, False, False], [None, False, True]]
    assert rerank_accuracy(correct, [1, 1, 0]) == pytest.approx(1 / 3)  # right, wrong, unscored
    assert rerank_accuracy(correct, [2, 0, 2]) == 1.0
    assert math.isnan(rerank_accuracy([], []))
    with pytest.raises(ValueError):
        rerank_accuracy(correct, [0])
