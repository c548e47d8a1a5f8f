"""Process reward models, pure pieces (`stages/math/steps.py`) and the `steps` dataset kind: step
splitting and boundary tokens on worked examples, Monte-Carlo labels from scripted rollouts, the
PRM loss and metrics on hand-computed numbers, and step files with one clear error each."""

import json
import math
import re

import pyarrow as pa
import pytest
import torch

from schemas.datasets import SCHEMAS, from_rows, read_steps_jsonl, validate
from schemas.errors import SchemaError
from stages.math import steps as st

# ---------------------------------------------------------------------------- splitting

THREE = "Step 1: 3*4 = 12\n\nStep 2: 2 + 12 = 14\n\nStep 3: the answer is 14"


def test_three_step_solution_by_blank_lines_and_by_step_markers():
    """Spans are [start, end) in the text: "Step 1: 3*4 = 12" is 16 characters, then "\\n\\n"; step 2
    starts at 18 and is 19 characters long (ends at 37); step 3 starts at 39 and runs to the end (63)."""
    assert st.step_spans(THREE, "blank_line") == [(0, 16), (18, 37), (39, 63)]
    assert st.split_steps(THREE, "blank_line") == ["Step 1: 3*4 = 12", "Step 2: 2 + 12 = 14", "Step 3: the answer is 14"]
    # markers without blank lines: same steps; the marker stays in its step
    one_line = THREE.replace("\n\n", " ")
    assert st.split_steps(one_line, "step_k") == ["Step 1: 3*4 = 12", "Step 2: 2 + 12 = 14", "Step 3: the answer is 14"]
    # a preamble before the first marker is a step of its own
    assert st.split_steps("Let me see. Step 1: a Step 2: b", "step_k") == ["Let me see.", "Step 1: a", "Step 2: b"]
    assert st.split_steps("x = 1\ny = 2\n", "newline") == ["x = 1", "y = 2"]


def test_an_empty_step_is_not_a_step():
    """A blank piece between delimiters (here a line holding only spaces, between two blank lines)
    and surrounding whitespace are dropped: two steps, trimmed."""
    text = "  a = 1\n\n   \n\n\n b = 2  \n\n"
    assert st.step_spans(text, "blank_line") == [(2, 7), (16, 21)]
    assert st.split_steps(text, "blank_line") == ["a = 1", "b = 2"]
    assert st.split_steps("a\n\n\n\nb ", "blank_line") == ["a", "b"]
    assert st.split_steps("Step 1:\nStep 2: x", "step_k") == ["Step 1:", "Step 2: x"]  # a marker alone is text
    assert st.split_steps(" \n\n \t", "blank_line") == []  # blank text has no step


def test_a_solution_without_delimiter_is_one_step():
    text = "The answer is 14."
    for d in st.DELIMITERS:
        assert st.step_spans(text, d) == [(0, len(text))]
    with pytest.raises(ValueError, match="unknown step delimiter 'comma'"):
        st.split_steps(text, "comma")


def test_cap_spans_folds_the_tail_into_the_last_kept_step():
    spans = [(0, 2), (4, 6), (8, 10), (12, 14)]
    assert st.cap_spans(spans, 2) == [(0, 2), (4, 14)]
    assert st.cap_spans(spans, 4) == spans
    assert st.cap_spans(spans, 1) == [(0, 14)]


def test_join_steps_gives_the_step_ends_and_round_trips():
    text, ends = st.join_steps(["a = 1", "b = 2", "c"], "blank_line")
    assert text == "a = 1\n\nb = 2\n\nc" and ends == [5, 12, 15]
    assert st.split_steps(text, "blank_line") == ["a = 1", "b = 2", "c"]
    assert [e for _, e in st.step_spans(text, "blank_line")] == ends
    text, ends = st.join_steps(["Step 1: a", "Step 2: b"], "step_k")
    assert text == "Step 1: a\nStep 2: b" and ends == [9, 19]


# ---------------------------------------------------------------------------- boundary tokens


def test_boundary_positions_from_word_piece_offsets():
    """text "ab cd\\n\\nef": steps "ab cd" (ends at 5) and "ef" (ends at 9). Tokens "ab" (0,2),
    " cd" (2,5), "\\n\\n" (5,7), "ef" (7,9): the last characters 4 and 8 sit in tokens 1 and 3.
    With a special token first ((0, 0), never chosen) every index moves by one; with the blank line
    glued to the word (" cd\\n\\n" (2,7)) step 1 still ends at that token."""
    text = "ab cd\n\nef"
    ends = [e for _, e in st.step_spans(text)]
    assert ends == [5, 9]
    assert st.boundary_positions([(0, 2), (2, 5), (5, 7), (7, 9)], ends) == [1, 3]
    assert st.boundary_positions([(0, 0), (0, 2), (2, 5), (5, 7), (7, 9)], ends) == [2, 4]
    assert st.boundary_positions([(0, 2), (2, 7), (7, 9)], ends) == [1, 2]
    # a character no token covers: the last token starting before it
    assert st.boundary_positions([(0, 1), (3, 4)], [3]) == [0]
    with pytest.raises(ValueError, match="character 9 has no token of its own"):
        st.boundary_positions([(0, 9)], ends)  # one token spans both steps' ends


def test_boundary_positions_with_the_tiny_tokenizer(tiny_tokenizer):
    """The tiny tokenizer has one token per character, so step ends map to the token just before."""
    enc = tiny_tokenizer(THREE, add_special_tokens=False, return_offsets_mapping=True)
    ends = [e for _, e in st.step_spans(THREE)]
    pos = st.boundary_positions(enc["offset_mapping"], ends)
    assert pos == [15, 36, 62]
    assert [tiny_tokenizer.decode([enc["input_ids"][p]]) for p in pos] == ["2", "4", "4"]


# ---------------------------------------------------------------------------- Monte-Carlo labels


def test_soft_and_hard_labels_from_scripted_rollouts():
    """A scripted policy: from the prefix ending at step 1, 2 of 4 rollouts reach the right answer;
    from step 2 (where the mistake is), 1 of 4 (it recovers once); from step 3, none. Soft labels
    are the shares 0.5, 0.25, 0; hard ones (any right) 1, 1, 0."""
    answer = "14"
    scripted = {0: ["14", "14", "13", "12"], 1: ["13", "14", "13", "13"], 2: ["13", "13", "13", "13"]}
    outcomes = [[out == answer for out in scripted[i]] for i in range(3)]
    assert st.mc_labels(outcomes, "soft") == [0.5, 0.25, 0.0]
    assert st.mc_labels(outcomes, "hard") == [1.0, 1.0, 0.0]
    # rollouts the verifier could not score are left out; a step with none scored has no label
    assert st.mc_labels([[None, True, False], [None, None]], "soft") == [0.5, None]
    assert st.mc_labels([[None, True, False], [None, None]], "hard") == [1.0, None]
    with pytest.raises(ValueError):
        st.mc_labels(outcomes, "any")


def test_hard_labels_threshold():
    assert st.hard_labels(torch.tensor([0.0, 0.25, 0.5, 1.0])).tolist() == [0.0, 0.0, 1.0, 1.0]


# ---------------------------------------------------------------------------- loss and metrics


def test_prm_loss_hand_computed_on_hard_and_soft_labels():
    """BCE(z, y) = max(z, 0) - z y + log(1 + e^-|z|):
    z=0, y=1: log 2 = 0.693147; z=2, y=0.5 (soft): 2 - 1 + log(1 + e^-2) = 1.126928;
    z=-1, y=0: log(1 + e^-1) = 0.313262. Mean 0.711112. The padded (B, S) form with a mask gives
    the same (the padded step's logit 9 and label 1 are ignored)."""
    flat = st.prm_loss(torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 0.5, 0.0]))
    torch.testing.assert_close(flat, torch.tensor(0.711112), atol=1e-6, rtol=0)
    padded = st.prm_loss(torch.tensor([[0.0, 2.0], [-1.0, 9.0]]), torch.tensor([[1.0, 0.5], [0.0, 1.0]]),
                         torch.tensor([[1, 1], [1, 0]]))
    torch.testing.assert_close(padded, flat)


def test_prm_loss_gradient_is_sigmoid_minus_label():
    """d BCE / dz = (σ(z) - y) / N: at z = 0 with soft label 0.25 over 2 steps → (0.5 - 0.25) / 2."""
    z = torch.zeros(2, requires_grad=True)
    st.prm_loss(z, torch.tensor([0.25, 1.0])).backward()
    torch.testing.assert_close(z.grad, torch.tensor([0.125, -0.25]))


def test_step_accuracy_majority_baseline_and_auroc():
    """accuracy: predictions (≥ .5) [1, 0, 1, 0] against labels [1, 1, 0, 0] → 2 of 4.
    AUROC: positives scored {.9, .8, .3}, negatives {.8, .1}: pairs won .9>.8, .9>.1, .8>.1, .3>.1,
    the tie .8=.8 counts 1/2, .3<.8 lost → 4.5 / 6 = 0.75."""
    assert st.step_accuracy(torch.tensor([0.9, 0.4, 0.6, 0.2]), torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.5
    assert st.majority_baseline(torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.75
    assert st.majority_baseline(torch.tensor([0.0, 0.2, 1.0])) == pytest.approx(2 / 3)  # soft 0.2 is a 0
    scores = torch.tensor([0.9, 0.8, 0.3, 0.8, 0.1])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    assert st.auroc(scores, labels) == pytest.approx(0.75)
    assert st.auroc(-scores, labels) == pytest.approx(0.25)
    assert math.isnan(st.auroc(scores, torch.ones(5)))  # one class only


def test_first_error_step_accuracy():
    """Predicted first wrong step (first prob < .5): [1, none, 0]; labelled: [1, none, 2] → 2 of 3.
    Row 2's padded step (prob 0.0, label 0) is masked out, else it would read as an error at 2."""
    probs = torch.tensor([[0.9, 0.4, 0.8], [0.9, 0.9, 0.0], [0.2, 0.9, 0.9]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert st.first_error_index(probs, mask).tolist() == [1, st.NO_ERROR, 0]
    assert st.first_error_index(labels, mask).tolist() == [1, st.NO_ERROR, 2]
    assert st.first_error_accuracy(probs, labels, mask) == pytest.approx(2 / 3)


def test_aggregation_of_step_scores():
    """Steps [.9, .5, .8] and [.6, .7] (+ a padded step): min .5 / .6; product .36 / .42; last .8 / .7;
    mean 2.2/3 / .65. A solution without steps cannot be scored: NaN."""
    scores = torch.tensor([[0.9, 0.5, 0.8], [0.6, 0.7, 0.0], [0.3, 0.3, 0.3]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    expected = {"min": [0.5, 0.6], "product": [0.36, 0.42], "last": [0.8, 0.7], "mean": [2.2 / 3, 0.65]}
    for how, want in expected.items():
        got = st.aggregate_step_scores(scores, mask, how)
        torch.testing.assert_close(got[:2], torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0, msg=how)
        assert math.isnan(got[2]), how
    with pytest.raises(ValueError, match="unknown step-score aggregation 'max'"):
        st.aggregate_step_scores(scores, mask, "max")


# ---------------------------------------------------------------------------- the steps kind and step files


def steps_row(**kw):
    row = {"id": "s1", "messages": [{"role": "user", "content": "2+3*4?"}], "steps": ["3*4 = 12", "2 + 12 = 14"],
           "labels": [1.0, 0.5], "source": "test", "metadata": "{}"}
    row.update(kw)
    return row


def test_steps_kind_validates_rows():
    assert "steps" in SCHEMAS
    assert from_rows([steps_row()], "steps").to_pylist()[0]["labels"] == [1.0, 0.5]
    for mutate, message in [
        ({"labels": [1.0]}, "row 0: column 'labels': 1 value(s) for 2 step(s)"),
        ({"labels": [1.0, 1.5]}, "row 0: column 'labels': label 1 is 1.5"),
        ({"steps": ["a", "  "]}, "row 0: column 'steps': step 1 is blank"),
        ({"steps": [], "labels": []}, "row 0: column 'steps': no steps"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "assistant turn"),
    ]:
        with pytest.raises(SchemaError, match=re.escape(message)):
            validate(pa.Table.from_pylist([steps_row(**mutate)]), "steps", where="my.parquet")


def write_lines(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_step_file_import_accepts_labels_bools_and_prm800k_ratings(tmp_path):
    path = write_lines(tmp_path / "prm.jsonl", [
        {"prompt": "2+3*4?", "steps": ["3*4 = 12", "2 + 12 = 14"], "labels": [True, False]},
        "",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
         "steps": ["1 + 1 = 2", "so 2", "done"], "ratings": [1, 0, -1], "id": "mine", "source": "prm800k",
         "metadata": {"phase": 2}},
        {"prompt": "x?", "steps": ["y"], "labels": [0.25]},
    ])
    rows = read_steps_jsonl(path).to_pylist()
    assert [r["id"] for r in rows] == ["prm-1", "mine", "prm-4"]  # default id: file stem and line number
    assert rows[0]["labels"] == [1.0, 0.0] and rows[0]["messages"] == [{"role": "user", "content": "2+3*4?"}]
    assert rows[0]["source"] == "file:prm.jsonl"
    assert rows[1]["labels"] == [1.0, 1.0, 0.0] and rows[1]["source"] == "prm800k"  # neutral counts as right
    assert json.loads(rows[1]["metadata"]) == {"phase": 2}
    assert rows[2]["labels"] == [0.25]
    assert read_steps_jsonl(path, neutral=0.0).to_pylist()[1]["labels"] == [1.0, 0.0, 0.0]


GOOD = {"prompt": "2+2?", "steps": ["2 + 2 = 4"], "labels": [1]}


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "2+2?", "steps": ["4"], ', "line 2: not valid JSON"),
    ('["a list"]', "line 2: expected a JSON object, got list"),
    ({"steps": ["a"], "labels": [1]}, "line 2: field 'prompt': give exactly one of 'prompt'"),
    ({"prompt": "q", "messages": [{"role": "user", "content": "q"}], "steps": ["a"], "labels": [1]},
     "line 2: field 'prompt': give exactly one"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "steps": ["a"],
      "labels": [1]}, "line 2: field 'messages': must not end with an assistant turn"),
    ({"messages": [{"role": "robot", "content": "q"}], "steps": ["a"], "labels": [1]},
     "line 2: field 'messages': turn 0 must be an object with a role in"),
    ({"prompt": "q", "labels": [1]}, "line 2: field 'steps': must be a list of strings, got nothing"),
    ({"prompt": "q", "steps": "a. b.", "labels": [1]}, "line 2: field 'steps': must be a list of strings, got str"),
    ({"prompt": "q", "steps": ["a", ""], "labels": [1, 1]}, "line 2: field 'steps': step 1 is blank"),
    ({"prompt": "q", "steps": [], "labels": []}, "line 2: field 'steps': no steps"),
    ({"prompt": "q", "steps": ["a"]}, "line 2: field 'labels': give exactly one of 'labels'"),
    ({"prompt": "q", "steps": ["a", "b"], "labels": [1]}, "line 2: field 'labels': 1 value(s) for 2 step(s)"),
    ({"prompt": "q", "steps": ["a"], "labels": [1.5]}, "line 2: field 'labels': label 0 is 1.5"),
    ({"prompt": "q", "steps": ["a"], "labels": ["yes"]}, "line 2: field 'labels': label 0 is 'yes'"),
    ({"prompt": "q", "steps": ["a"], "ratings": [2]}, "line 2: field 'ratings': rating 0 is 2; expected -1, 0 or 1"),
    ({"prompt": "q", "steps": ["a", "b"], "ratings": [1]}, "line 2: field 'ratings': 1 value(s) for 2 step(s)"),
    ({"prompt": "q", "steps": ["a"], "labels": [1], "id": "steps-1"}, "line 2: field 'id': duplicate value 'steps-1'"),
    ({"prompt": "q", "steps": ["a"], "labels": [1], "metadata": [1]}, "line 2: field 'metadata': must be an object"),
])
def test_a_bad_step_file_gets_one_error_naming_file_line_and_field(tmp_path, bad, message):
    """Line 1 is good, line 2 bad, line 4 bad too: the one error is line 2's and names the file."""
    path = write_lines(tmp_path / "steps.jsonl", [GOOD, bad, "", {"prompt": "q", "steps": [], "labels": []}])
    with pytest.raises(SchemaError) as err:
        read_steps_jsonl(path)
    text = str(err.value)
    assert text.startswith(f"{path}: line 2: ") and message in text, text
    assert "line 4" not in text


def test_an_empty_step_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(SchemaError, match="no step-labelled solutions"):
        read_steps_jsonl(path)


def test_split_by_group_keeps_a_prompt_on_one_side():
    groups = ["a", "a", "b", "c", "c", "c", "d", "e"]
    train, held = st.split_by_group(groups, 0.4, seed=0)
    assert sorted(train + held) == list(range(8))
    assert {groups[i] for i in train}.isdisjoint({groups[i] for i in held})
    assert len({groups[i] for i in held}) == 2  # round(0.4 * 5 groups)
    assert st.split_by_group(groups, 0.4, seed=0) == (train, held)
    assert st.split_by_group(groups, 0.0, seed=0) == (list(range(8)), [])
    assert st.split_by_group(["a", "a"], 0.5, seed=0) == ([0, 1], [])  # one prompt: nothing to hold out


@pytest.mark.parametrize(("pieces", "char_ends", "want"), [
    (["ab", "c\n", "\nd"], [3, 6], [1, 2]),  # "abc" ends inside token 1, "d" is token 2's last character
    (["a\n\nb"], [1, 4], [0, 0]),  # two steps in one token
    (["x", "y"], [], []),
])
def test_token_ends_of(pieces, char_ends, want):
    assert st.token_ends_of(pieces, char_ends) == want
