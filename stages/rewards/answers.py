"""What a completion says, read as text: its answer, its program, its R1 form, and the rewards on form
alone (format, tag count, language consistency).

Completions follow the DeepSeek-R1 format `<think>…</think><answer>…</answer>` (R1 paper §2.2.1).
The answer comes only from the last `<answer>` or `\\boxed{}` outside `<think>`.
`extract_answer_strict` guards the accuracy reward against hedging (`RewardSpec.strict_answer`);
`reformat_r1` is R1's cold-start rewrite of a correct but unformatted completion.
"""

from __future__ import annotations

import re
import textwrap
import unicodedata
from collections.abc import Callable, Mapping
from types import MappingProxyType

R1_FORMAT_EXAMPLE = "<think> 7 * 6 = 42 </think> <answer>42</answer>"
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant. First think step by step inside <think> </think> tags, "
    "then give only the final answer inside <answer> </answer> tags. "
    f"Example: {R1_FORMAT_EXAMPLE}"
)

# completion -> the answer a verifier judges, or None when the completion gives none.
Extractor = Callable[[str], str | None]

_THINK_TAG = re.compile(r"</?think>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
_R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_R1_FORMAT = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
# A fenced block: the info string (language) is the rest of the opening line.
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py"})

def _split_think(completion: str) -> tuple[list[str], list[str]]:
    """(thinking spans, visible spans) of a completion, without the think tags that delimit them.

    Thinking is `<think>…</think>`; an unclosed `<think>` runs to the end; a `</think>` with no
    opening tag before it (chat templates that open `<think>` in the prompt) makes everything
    before it thinking. A `<think>` inside thinking stays in its text.
    """
    thinking: list[str] = []
    visible: list[str] = []
    pos, inside = 0, False
    for tag in _THINK_TAG.finditer(completion):
        if tag.group() == "<think>":
            if not inside:
                visible.append(completion[pos : tag.start()])
                inside, pos = True, tag.end()
        elif inside:
            thinking.append(completion[pos : tag.start()])
            inside, pos = False, tag.end()
        else:  # stray </think>: what came before was thinking
            thinking = [*visible, *thinking, completion[pos : tag.start()]]
            visible, pos = [], tag.end()
    (thinking if inside else visible).append(completion[pos:])
    return thinking, visible


def _outside_think(completion: str) -> str:
    """The completion with every thinking span removed (see `_split_think`)."""
    return "\n".join(_split_think(completion)[1])


_R1_TAG_RUN = re.compile(r"(?:</?(?:think|answer)>)+")


def _strip_r1_tags(text: str) -> str:
    """`text` without R1 tags; a run of tags between two non-space characters becomes one space
    (so "a</think>5" reads "a 5", not "a5", and no tag can re-form from the pieces)."""

    def gap(m: re.Match[str]) -> str:
        joins = 0 < m.start() and m.end() < len(text) and not text[m.start() - 1].isspace()
        return " " if joins and not text[m.end()].isspace() else ""

    return _R1_TAG_RUN.sub(gap, text)


def _last_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{…}` with balanced braces (`\\{`, `\\}` are literal)."""
    found: str | None = None
    start = text.find(_BOXED)
    while start != -1:
        depth, i, end = 1, start + len(_BOXED), None
        while i < len(text):
            ch = text[i]
            if ch == "\\":
                i += 2  # an escaped character, e.g. \{ in a set
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            i += 1
        if end is None:  # unbalanced: nothing later can close either
            break
        found = text[start + len(_BOXED) : end]
        start = text.find(_BOXED, end + 1)  # skip boxes nested inside this one
    return found


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion, or None if it gives none.

    The content of the last `<answer>…</answer>` block; else the last `\\boxed{…}`. Both are
    looked for only outside the thinking part (see `_outside_think`). A `\\boxed{x}` inside the
    answer block yields x. Whitespace is stripped; an empty answer is None.

    >>> extract_answer("<think>maybe <answer>1</answer></think><answer> 2 </answer>")
    '2'
    >>> extract_answer("so \\\\boxed{\\\\frac{63}{400}}")
    '\\\\frac{63}{400}'
    >>> extract_answer("<think>\\\\boxed{5}") is None
    True
    """
    visible = _outside_think(completion)
    blocks = _ANSWER_BLOCK.findall(visible)
    if blocks:
        answer = blocks[-1]
        boxed = _last_boxed(answer)
        answer = boxed if boxed is not None else answer
    else:
        answer = _last_boxed(visible)
    if answer is None:
        return None
    return answer.strip() or None


def extract_answer_strict(completion: str) -> str | None:
    """The answer of a completion that gives exactly one answer block, else None (`RewardSpec.strict_answer`).

    Outside the thinking part there must be exactly one `<answer>` and one `</answer>`, in that
    order: two or more answer blocks are no answer (listing several answers must not pay, as it
    would with `extract_answer`, which takes the last), and there is no `\\boxed{…}` fallback
    outside a block. A `\\boxed{x}` inside the block yields x; whitespace is stripped; an empty
    answer is None.

    >>> extract_answer_strict("<think>1 or 2?</think><answer>1</answer><answer>2</answer>") is None
    True
    >>> extract_answer_strict("<think><answer>1</answer></think><answer>\\\\boxed{2}</answer>")
    '2'
    """
    visible = _outside_think(completion)
    if visible.count("<answer>") != 1 or visible.count("</answer>") != 1:
        return None
    block = _ANSWER_BLOCK.search(visible)
    if block is None:  # </answer> before <answer>
        return None
    boxed = _last_boxed(block.group(1))
    answer = boxed if boxed is not None else block.group(1)
    return answer.strip() or None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_answer_lenient(completion: str) -> str | None:
    """`extract_answer`, else the last number outside the thinking part.

    For evaluation only: it measures what a model knows before it has learnt the answer format
    (a base model that writes "2 + 3 = 5" gets credit). Rewards never use it — an RL policy
    would learn to spray numbers.

    >>> extract_answer_lenient("2 + 3 = 5")
    '5'
    >>> extract_answer_lenient("<think>7</think> no idea") is None
    True
    """
    strict = extract_answer(completion)
    if strict is not None:
        return strict
    numbers = _NUMBER.findall(_outside_think(completion))
    return numbers[-1] if numbers else None

def extract_program(completion: str) -> str | None:
    """The program a code completion gives, or None.

    The last fenced block tagged python (```python, ```py, ```python3) outside the thinking part;
    else the last untagged fenced block (```); else `extract_answer(completion)`, taken as the
    program itself. A python-tagged block beats a later untagged one, so sample output printed
    after the code (a common habit) is not run as the program; blocks in other languages are
    ignored. An unclosed fence (truncated generation) is no block. The program is dedented and
    stripped of blank first/last lines; an empty one is None.

    >>> extract_program("<think>```python\\nprint(0)\\n```</think><answer>```python\\nprint(1)\\n```</answer>")
    'print(1)'
    >>> extract_program("```python\\nprint(2)\\n```\\nOutput:\\n```\\n2\\n```")
    'print(2)'
    >>> extract_program("<answer>print(3)</answer>")
    'print(3)'
    """
    tagged: str | None = None
    untagged: str | None = None
    for fence in _FENCE.finditer(_outside_think(completion)):
        info = fence.group(1).strip().casefold()
        if info in _PYTHON_TAGS:
            tagged = fence.group(2)
        elif info == "":
            untagged = fence.group(2)
    program = tagged if tagged is not None else untagged
    if program is None:
        return extract_answer(completion)
    return textwrap.dedent(program).strip("\n") or None


# --------------------------------------------------------------------------- format


def format_ok(completion: str) -> bool:
    """Whether the completion is exactly `<think>…</think><answer>…</answer>`.

    Each tag appears exactly once, in that order; only whitespace before `<think>`, between
    `</think>` and `<answer>`, and after `</answer>`; the answer is not blank. The think part
    may be empty: the format asks where reasoning goes, not that there is any (R1-Zero style
    short answers stay well formed; the accuracy reward judges them).

    >>> format_ok("<think></think><answer>42</answer>")
    True
    >>> format_ok("<answer>42</answer>")
    False
    """
    if any(completion.count(tag) != 1 for tag in _R1_TAGS):
        return False
    match = _R1_FORMAT.fullmatch(completion)
    return match is not None and match.group(2).strip() != ""


_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def tag_count_reward(completion: str) -> float:
    """0.25 for each of <think>, </think>, <answer>, </answer> that appears exactly once.

    A partial format signal (as open-r1's tag-count reward): a small model that never writes the
    full R1 format (format_ok) still earns credit for the tags it does write, so RL from a base
    model (R1-Zero) has a gradient to follow.

    >>> tag_count_reward("<think>x</think> 5")
    0.5
    """
    return sum(0.25 for tag in _FORMAT_TAGS if completion.count(tag) == 1)


def format_reward(completion: str) -> float:
    """1.0 if `format_ok(completion)` else 0.0."""
    return 1.0 if format_ok(completion) else 0.0


def reformat_r1(completion: str, answer: str) -> str:
    """R1's cold-start "post-processing into a readable format" (R1 paper §2.3.1) of a completion
    whose answer is known to be right: `<think>\\n{reasoning}\\n</think>\\n<answer>{answer}</answer>`.

    reasoning is the whole completion, R1 tags removed (`_strip_r1_tags`), whitespace-stripped;
    answer (the one that was judged, e.g. `extract_answer_lenient`) likewise. The result is
    `format_ok`; an answer that is blank without its tags raises ValueError.
    Departure: R1 rewrote its cold-start data with human annotators and a summary; we only move
    the answer into its block.

    >>> reformat_r1("2 + 3 = 5", "5")
    '<think>\\n2 + 3 = 5\\n</think>\\n<answer>5</answer>'
    """
    answer = _strip_r1_tags(answer).strip()
    if not answer:
        raise ValueError(f"reformat_r1: no answer to put in the answer block (got {answer!r})")
    reasoning = _strip_r1_tags(completion).strip()
    return f"<think>\n{reasoning}\n</think>\n<answer>{answer}</answer>"


def gold_completion(answer: str, think: str) -> str:
    """A well-formed R1 completion for a known answer (SFT targets built from gold answers).

    Raises ValueError if the result would not pass `format_ok` (blank answer, or tags in it).

    >>> gold_completion("42", "6 * 7 = 42")
    '<think>\\n6 * 7 = 42\\n</think>\\n<answer>42</answer>'
    """
    completion = f"<think>\n{think}\n</think>\n<answer>{answer}</answer>"
    if not format_ok(completion):
        raise ValueError(f"gold_completion: answer {answer!r} / think {think[:80]!r} do not make a well-formed R1 completion")
    return completion




# Script -> prefixes of the Unicode character names of its letters (`unicodedata.name`). cjk is one
# group for Chinese, Japanese and Korean, which mix Han ideographs with kana or hangul within a word.
# Keys are RewardSpec.language_script's choices.
LANGUAGE_SCRIPTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "latin": ("LATIN",),
    "cyrillic": ("CYRILLIC",),
    "greek": ("GREEK",),
    "arabic": ("ARABIC",),
    "cjk": ("CJK", "IDEOGRAPHIC", "HIRAGANA", "KATAKANA", "HANGUL"),
})
_WORD = re.compile(r"[^\W\d_]+")


def _thinking(completion: str) -> str:
    """The thinking part (`_split_think`), or the whole completion when it has no think tag."""
    if _THINK_TAG.search(completion) is None:
        return completion
    return "\n".join(_split_think(completion)[0])


def language_consistency(completion: str, script: str) -> float:
    """R1's language-consistency reward (R1 paper §2.3.2): the share of target-language words in the
    CoT, in [0, 1]; 0.0 when the CoT has no words.

    The CoT is the thinking part (the whole completion when it has no think tag), R1 tags removed.
    Words are maximal runs of letters (`[^\\W\\d_]+`, after NFC and dropping combining marks so an
    Arabic vowel sign does not split a word); a word is in the target language when every letter's
    Unicode name starts with one of `LANGUAGE_SCRIPTS[script]`, so "x" in "x = 2" counts as Latin
    and a mixed-script word counts as neither. Departure: R1 counts words of a language, we count
    words of a script; scripts written without spaces (Chinese, Japanese) count one word per run.

    >>> language_consistency("<think>the sum is 结果</think><answer>12</answer>", "latin")  # 3 of 4
    0.75
    """
    try:
        prefixes = LANGUAGE_SCRIPTS[script]
    except KeyError:
        raise ValueError(f"unknown script {script!r}; known scripts: {', '.join(LANGUAGE_SCRIPTS)}") from None
    text = unicodedata.normalize("NFC", _strip_r1_tags(_thinking(completion)))
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("M"))
    words = _WORD.findall(text)
    if not words:
        return 0.0
    target = sum(all(unicodedata.name(ch, "").startswith(prefixes) for ch in word) for word in words)
    return target / len(words)

