"""Rewards: answer extraction, the R1 format check, verifiers, reward shaping and pass@k.

Small deterministic checkers in the spirit of open-r1's `rewards.py`: a completion and a
`prompts` row in, a `Verdict` out. `None` always means "could not score" (no reference answer,
verifier "none", a reference math-verify cannot read, math-verify failing or running past its
deadline, a code task without tests) and is never folded into 0: a wrong answer is 0, an
unscoreable one is a null in the `correct` and `reward` columns.

Completions follow the DeepSeek-R1 format `<think>…</think><answer>…</answer>` (R1 paper §2.2.1:
an accuracy reward from a rule-based verifier plus a format reward). `score` adds the shaping
terms later recipes use — DAPO's soft overlong punishment, open-r1's n-gram repetition penalty,
the cosine length scaling of "Demystifying Long Chain-of-Thought", R1's language-consistency
reward (§2.3.2, `language_consistency`), a reward model's score — and weighs them with
`RewardSpec.weights`. Departures from the paper: the weights are ours (`RewardSpec`), and
reasoning-gym's partial credit is kept as its own component rather than used as the reward.
`RewardSpec.strict_answer` guards the accuracy reward against hedging (`extract_answer_strict`);
`reformat_r1` is R1's cold-start rewrite of a correct but unformatted completion.

math-verify and threads (docs/design.md §6): math-verify's own time limit uses `signal.alarm`, which
raises in any thread but the main one, and cannot interrupt sympy busy inside one C call anyway.
So math-verify is called with `parsing_timeout=None` and `timeout_seconds=None`, in a process
pool (`_math_check`): the caller's thread waits `RewardSpec.math_timeout_s` for the answer, and
on a miss scores None and kills the pool's workers (a pathological answer such as
`10^{10^{10^{10}}}` keeps sympy busy for over 20 s). Identical answers and
equal plain numbers are scored in-process without the pool (`_math_fast_path`).

Code rows (verifier "code") judge a program (`extract_program`) by the fraction of the row's
stdin/stdout tests it passes in `stages.rewards.sandbox`.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import textwrap
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from schemas.configs import RewardSpec

log = logging.getLogger(__name__)

R1_FORMAT_EXAMPLE = "<think> 7 * 6 = 42 </think> <answer>42</answer>"
R1_SYSTEM_PROMPT = (
    "You are a helpful assistant. First think step by step inside <think> </think> tags, "
    "then give only the final answer inside <answer> </answer> tags. "
    f"Example: {R1_FORMAT_EXAMPLE}"
)

# (extracted answer or None, prompts row, reward spec) -> score in [0, 1], or None when it cannot be scored.
Verifier = Callable[[str | None, Mapping[str, Any], RewardSpec], float | None]
# completion -> the answer a verifier judges, or None when the completion gives none.
Extractor = Callable[[str], str | None]

_THINK_TAG = re.compile(r"</?think>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
_R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_R1_FORMAT = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
_CHOICE = re.compile(r"\(?([a-z])[).]?")
# A fenced block: the info string (language) is the rest of the opening line.
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py"})

# --------------------------------------------------------------------------- extraction


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


# --------------------------------------------------------------------------- verifiers


def _metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's metadata as a dict (the Arrow column stores JSON text)."""
    meta = row.get("metadata")
    if meta is None:
        return {}
    return json.loads(meta) if isinstance(meta, str) else dict(meta)


@functools.cache
def _rg_scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    # Imported here: reasoning_gym takes ~1 s to import and most callers never score with it.
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def verify_reasoning_gym(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """The task's own reasoning-gym checker: a float in [0, 1] (partial credit allowed).

    The entry is rebuilt from the row: question = metadata["question"] (else the last user
    turn), answer = row["answer"], metadata = the row's metadata. The task is
    metadata["source_dataset"] (right for composite datasets), else row["task"]. A missing
    answer is passed on as None, which reasoning-gym scores 0. A reference answer of None is
    not "unscoreable" here: tasks such as graph_color check the answer against the question.
    Errors from the checker propagate: it is plain Python over our own strings, so an
    exception is a bug to see, not a verdict.
    """
    meta = _metadata(row)
    question = meta.get("question")
    if question is None:
        question = next((m["content"] for m in reversed(row.get("messages") or []) if m["role"] == "user"), "")
    entry = {"question": question, "answer": row.get("answer"), "metadata": meta}
    task = meta.get("source_dataset") or row["task"]
    return float(_rg_scorer(task)(extracted, entry))


# ---- math: math-verify in a process pool with a deadline


def _mv_parse(text: str) -> list[Any]:
    # An extracted answer is one expression: reading it as LaTeX math ($…$) keeps "2x" as 2*x and
    # "1,2" as a set, where bare parsing finds "2" and 1.2. Bare parsing is the fallback.
    # timeouts off: see the module docstring; raise_on_error so failures are not scored False.
    for candidate in (f"${text}$", text):
        parsed = mv_parse(candidate, parsing_timeout=None, raise_on_error=True)
        if parsed:
            return parsed
    return []


def _math_equal(reference: str, answer: str | None) -> tuple[float | None, str]:
    """math-verify's verdict on `answer` against `reference`: (1.0 / 0.0 / None, why None).

    Runs in a pool worker (no time limit of its own; module docstring). Failures come back as
    values, not exceptions: sympy's exceptions need not pickle, and logging is the parent's job.
    """
    try:
        gold = _mv_parse(reference)
        if not gold:
            return None, f"reference {reference!r} does not parse"
        if answer is None:
            return 0.0, ""
        pred = _mv_parse(answer)
        if not pred:
            return 0.0, ""
        same = mv_verify(gold, pred, timeout_seconds=None, raise_on_error=True)
    except Exception as e:  # math-verify/sympy failure: could not score, never "wrong"
        return None, f"{type(e).__name__}: {e}"
    return (1.0 if same else 0.0), ""


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?|-?\d+/\d+")


def _plain_number(text: str) -> Fraction | None:
    """`text` as an exact rational if it is a plain integer, decimal or a/b; else None."""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except ZeroDivisionError:
        return None


def _math_fast_path(reference: str, answer: str | None) -> float | None:
    """The math verdict where it is certain without math-verify, else None (ask the pool).

    Identical answers (after stripping and collapsing whitespace) and plain numbers with equal
    exact values (1/2 and 0.5) are 1.0; no answer against a plain-number reference is 0.0.
    Unequal numbers still go to math-verify, whose float tolerance may call them equal.

    >>> _math_fast_path("63/400", "0.1575"), _math_fast_path("2", None), _math_fast_path("1/3", "0.33")
    (1.0, 0.0, None)
    """
    gold = _plain_number(reference.strip())
    if answer is None:
        return 0.0 if gold is not None else None
    if " ".join(reference.split()) == " ".join(answer.split()):
        return 1.0
    if gold is not None and gold == _plain_number(answer.strip()):
        return 1.0
    return None


_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_THREADS = os.environ.get("R1FLOW_THREADS", "")  # this process's share under --parallel (flows.placement)
_MATH_WORKERS = max(1, min(4, int(_THREADS) if _THREADS.isdigit() and int(_THREADS) > 0 else _CORES))
_MATH_STARTUP_S = 120.0  # a worker's first import of sympy; never charged to an answer's deadline
_MATH_ATTEMPTS = 3  # submissions per check when another check's deadline killed the pool under it
_math_pool_lock = threading.Lock()
_math_pool_instance: ProcessPoolExecutor | None = None


def _math_worker_init() -> None:
    # Ctrl-C reaches the whole process group; the parent decides what happens to the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns on every call that its timeouts are off; here they are off on purpose.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _math_pool() -> ProcessPoolExecutor:
    """The process-wide math-verify pool, started (and warmed) on first use.

    forkserver, not fork: forking a process with threads (Prefect's, torch's) is unsafe. When
    this is the first use of forkserver in the process, the fork server preloads this module, so
    sympy is imported once per process and a replacement pool (after a deadline) starts in
    milliseconds; otherwise each worker imports it. Either way each worker runs one check before
    the pool is handed out, so no answer's deadline pays for a worker's startup. As with any
    spawn/forkserver pool, a script that scores at import time needs `if __name__ == "__main__":`.
    """
    global _math_pool_instance
    with _math_pool_lock:
        if _math_pool_instance is None:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            context = multiprocessing.get_context(method)
            if method == "forkserver":
                # The stdlib default (__main__) plus this module; takes effect only if the fork
                # server is not running yet (it is process-wide).
                context.set_forkserver_preload(["__main__", __name__])
            pool = ProcessPoolExecutor(_MATH_WORKERS, mp_context=context, initializer=_math_worker_init)
            try:
                # Non-fork pools start a worker per submission while none is idle: one each.
                warm = [pool.submit(_math_equal, "1/2", "\\frac{1}{2}") for _ in range(_MATH_WORKERS)]
                for future in warm:
                    if future.result(timeout=_MATH_STARTUP_S) != (1.0, ""):
                        raise RuntimeError(f"warm-up check returned {future.result()!r}")
            except Exception as e:
                _kill_pool(pool)
                raise RuntimeError(f"math verifier: worker pool failed to start ({type(e).__name__}: {e})") from e
            _math_pool_instance = pool
        return _math_pool_instance


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's workers (a stuck sympy must stop burning CPU) and shut it down.

    Before Python 3.14 (`kill_workers`) the only way in is the private `_processes`. The pool's
    manager thread sees the dead workers, fails their futures with BrokenProcessPool and reaps
    them; queued futures are cancelled.
    """
    for process in list((pool._processes or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _discard_math_pool(pool: ProcessPoolExecutor) -> None:
    """Kill `pool` if it is still the current one; the next check starts a fresh pool."""
    global _math_pool_instance
    with _math_pool_lock:
        if _math_pool_instance is not pool:
            return  # another thread already replaced it
        _math_pool_instance = None
    _kill_pool(pool)


def shutdown_math_pool() -> None:
    """Kill the math-verify pool's workers, if any (registered with atexit; the next check restarts it)."""
    global _math_pool_instance
    with _math_pool_lock:
        pool, _math_pool_instance = _math_pool_instance, None
    if pool is not None:
        _kill_pool(pool)


atexit.register(shutdown_math_pool)


def _math_check(reference: str, answer: str | None, timeout_s: float, row_id: Any = None) -> float | None:
    """`_math_equal` in the pool, waiting at most `timeout_s` per submission; None past it.

    The deadline counts from submission, so it includes waiting for a free worker when more
    threads check at once than there are workers. On a miss the whole pool is killed (there is
    no way to tell which worker runs which call): checks of other threads that die with it are
    resubmitted to the new pool with a fresh deadline, up to `_MATH_ATTEMPTS` submissions.
    """
    for _ in range(_MATH_ATTEMPTS):
        pool = _math_pool()
        try:
            future = pool.submit(_math_equal, reference, answer)
        except (BrokenProcessPool, RuntimeError):  # shut down by another thread's deadline
            _discard_math_pool(pool)
            continue
        start = time.monotonic()
        try:
            value, why = future.result(timeout=timeout_s)
        except TimeoutError:
            log.warning("math verifier: no verdict on row %r within %.3g s (answer %.80r); scored None, "
                        "workers killed", row_id, timeout_s, answer)
            _discard_math_pool(pool)
            return None
        except (BrokenProcessPool, CancelledError):  # killed (or cancelled while queued) with the pool
            log.info("math verifier: pool went away under row %r after %.2f s; resubmitting", row_id,
                     time.monotonic() - start)
            _discard_math_pool(pool)
            continue
        if value is None:
            log.warning("math verifier: row %r: %s; scored None", row_id, why)
        return value
    log.warning("math verifier: pool went away %d times under row %r (a crashing answer?); scored None",
                _MATH_ATTEMPTS, row_id)
    return None


def verify_math(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """math-verify equivalence of the answer and row["answer"]: 1.0 or 0.0.

    1/2 = 0.5 = \\frac{1}{2}. None if there is no reference, the reference parses to nothing,
    math-verify raises (e.g. a reference of 1/0, which math-verify's default mode would
    silently score False), or no verdict comes within `spec.math_timeout_s` (module docstring).
    No answer, or one with no math in it, is 0.0. Safe to call from any thread.
    """
    reference = row.get("answer")
    if reference is None:
        return None
    fast = _math_fast_path(reference, extracted)
    if fast is not None:
        return fast
    return _math_check(reference, extracted, spec.math_timeout_s, row.get("id"))


# ---- other verifiers


def _normalize(text: str) -> str:
    """strip, casefold, collapse whitespace; a lone choice letter "(B)", "B)", "B." -> "b"."""
    text = " ".join(text.split()).casefold()
    choice = _CHOICE.fullmatch(text)
    return choice.group(1) if choice else text


def verify_exact(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """1.0 if the normalized answer equals the normalized row["answer"], else 0.0; None without a reference.

    >>> verify_exact("(B)", {"answer": " b"}, RewardSpec())
    1.0
    """
    reference = row.get("answer")
    if reference is None:
        return None
    if extracted is None:
        return 0.0
    return 1.0 if _normalize(extracted) == _normalize(reference) else 0.0


def verify_code(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """The fraction of the row's tests the program passes, run in the sandbox (`spec.sandbox`).

    `extracted` is the program (`extract_program`). Tests are metadata["tests"], a list of
    {"input": stdin text, "output": expected stdout}; none -> None (could not score). No program
    is 0.0. Sandbox errors propagate: a sandbox that cannot run is a fault, not a verdict.
    """
    tests = _metadata(row).get("tests")
    if not tests:
        return None
    if not isinstance(tests, list) or not all(isinstance(case, dict) for case in tests):
        raise ValueError(f"code verifier: row {row.get('id')!r}: metadata 'tests' must be a list of "
                         f"{{'input': str, 'output': str}} objects, got {str(tests)[:200]}")
    if extracted is None:
        return 0.0
    # Imported here: only code rows need it.
    from stages.rewards.sandbox import run_tests

    return float(run_tests(extracted, list(tests), spec.sandbox))


def verify_none(extracted: str | None, row: Mapping[str, Any], spec: RewardSpec) -> float | None:
    """Rows nobody can check (e.g. open-ended chat prompts): always None."""
    return None


VERIFIERS: Mapping[str, Verifier] = MappingProxyType({
    "reasoning_gym": verify_reasoning_gym,
    "math": verify_math,
    "exact": verify_exact,
    "code": verify_code,
    "none": verify_none,
})

# Verifier name -> (extractor, lenient extractor for evaluation) where the judged answer is not the
# R1 answer; every other verifier judges `extract_answer` (leniently `extract_answer_lenient`).
EXTRACTORS: Mapping[str, tuple[Extractor, Extractor]] = MappingProxyType({
    "code": (extract_program, extract_program),
})
_R1_ANSWER: tuple[Extractor, Extractor] = (extract_answer, extract_answer_lenient)
# RewardSpec.strict_answer: only the strict answer is rewarded; evaluation's lenient measure is unchanged.
_R1_ANSWER_STRICT: tuple[Extractor, Extractor] = (extract_answer_strict, extract_answer_lenient)


def get_verifier(name: str) -> Verifier:
    """The verifier registered as `name`; ValueError naming it and the known ones otherwise."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(VERIFIERS)}") from None


# --------------------------------------------------------------------------- shaping


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), in [-1, 0].

    With L = num_tokens, L_max = max_tokens, L_cache = buffer:
        0                                 if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
        -1                                if L > L_max

    >>> overlong_penalty(384, 512, 128), overlong_penalty(448, 512, 128), overlong_penalty(513, 512, 128)
    (0.0, -0.5, -1.0)
    """
    if num_tokens < 0 or max_tokens < 1 or buffer < 0:
        raise ValueError(f"overlong_penalty: need num_tokens >= 0, max_tokens >= 1, buffer >= 0; "
                         f"got {num_tokens}, {max_tokens}, {buffer}")
    soft_start = max_tokens - buffer
    if num_tokens <= soft_start:
        return 0.0
    if num_tokens <= max_tokens:  # here buffer > 0
        return (soft_start - num_tokens) / buffer
    return -1.0


def repetition_penalty(text: str, ngram: int, max_penalty: float) -> float:
    """n-gram repetition penalty as in open-r1's `get_repetition_penalty_reward`, in [max_penalty, 0].

    Words are the casefolded whitespace-separated tokens; over the T = len(words) - n + 1
    n-grams, of which U are distinct: penalty = (1 - U / T) * max_penalty. Fewer than n words
    is 0. (open-r1 credits Yeo et al. 2025, "Demystifying Long Chain-of-Thought", §5.)

    >>> repetition_penalty("a b a b a b", 2, -1.0)  # T = 5 (ab ba ab ba ab), U = 2: (1 - 2/5) * -1
    -0.6
    """
    if ngram < 1:
        raise ValueError(f"repetition_penalty: ngram must be >= 1, got {ngram}")
    if max_penalty > 0:
        raise ValueError(f"repetition_penalty: max_penalty must be <= 0, got {max_penalty}")
    words = text.casefold().split()
    if len(words) < ngram:
        return 0.0
    grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
    repeated = 1.0 - len(set(grams)) / len(grams)
    return repeated * max_penalty if repeated else 0.0  # not -0.0 in the tables


def cosine_scaled(correct: bool, num_tokens: int, spec: RewardSpec) -> float:
    """Cosine length scaling of the accuracy reward (Yeo et al. 2025, "Demystifying Long
    Chain-of-Thought Reasoning in LLMs", arXiv:2502.03373; open-r1's `get_cosine_scaled_reward`).

    progress = min(L / cosine_max_len, 1); c = cos(progress * pi);
    reward = lo + 0.5 * (hi - lo) * (1 + c), i.e. hi at L = 0 and lo from cosine_max_len on, with
        correct: lo = cosine_min_value_correct, hi = cosine_max_value_correct (short and right is best);
        wrong:   lo = cosine_max_value_wrong,   hi = cosine_min_value_wrong (swapped: short and wrong is
                 worst, so a wrong answer is pushed to think longer).
    open-r1 does not clamp progress; beyond max_len its cosine would swing back up.

    >>> cosine_scaled(True, 256, RewardSpec(cosine_max_len=512))  # 0.5 + 0.5 * 0.5 * (1 + 0)
    0.75
    """
    if num_tokens < 0:
        raise ValueError(f"cosine_scaled: num_tokens must be >= 0, got {num_tokens}")
    progress = min(num_tokens / spec.cosine_max_len, 1.0)
    cosine = math.cos(progress * math.pi)
    if correct:
        lo, hi = spec.cosine_min_value_correct, spec.cosine_max_value_correct
    else:
        lo, hi = spec.cosine_max_value_wrong, spec.cosine_min_value_wrong
    return lo + 0.5 * (hi - lo) * (1.0 + cosine)


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


# --------------------------------------------------------------------------- score


@dataclass(frozen=True)
class Verdict:
    """The scoring of one completion against one prompts row.

    correct: the verifier's score >= 1.0 (so reasoning-gym partial credit and code passing
        some tests are not correct); None when the row cannot be scored.
    extracted: what the verifier judged: `extract_answer(completion)` (`extract_answer_strict` under
        `RewardSpec.strict_answer`), or for code rows the program (`EXTRACTORS`).
    correct_lenient: like `correct`, but an answer missing from the answer block falls back to
        the last number outside the thinking part (evaluation only; see extract_answer_lenient).
    format_ok: `format_ok(completion)`.
    reward: sum of weight * component over `RewardSpec.weights`; None when a component with a
        non-zero weight is absent (with the default weights: whenever correct is None).
    components: see `score`.
    """

    correct: bool | None
    extracted: str | None
    format_ok: bool
    reward: float | None
    components: dict[str, float]
    correct_lenient: bool | None = None


_SHAPING = ("accuracy", "format", "tags", "overlong", "repetition", "cosine", "language", "reward_model")


def score(
    row: Mapping[str, Any],
    completion: str,
    spec: RewardSpec | None = None,
    *,
    num_tokens: int | None = None,
    rm_score: float | None = None,
) -> Verdict:
    """Score `completion` against a `prompts` row, routed by row["verifier"] through `VERIFIERS`.

    `spec` defaults to `RewardSpec()`. Components (`Verdict.components`):
        format        1/0, always;
        accuracy      1/0, and the verifier's raw score under its own name (e.g. "reasoning_gym":
                      0.5, "code": 2/3), when the row could be scored;
        overlong      `overlong_penalty(num_tokens, …)`, when num_tokens is given;
        cosine        `cosine_scaled(correct, num_tokens, spec)`, when num_tokens is given and the
                      row could be scored;
        repetition    `repetition_penalty(completion, …)`, always;
        language      `language_consistency(completion, spec.language_script)`, always;
        reward_model  rm_score, when given.
    With `spec.strict_answer`, answer verifiers (all but code) judge `extract_answer_strict`.
    The reward is the weighted sum over `spec.weights` (None if a non-zero weight names an
    absent component); a weight naming no component raises ValueError.
    """
    spec = spec if spec is not None else RewardSpec()
    known = {*_SHAPING, *VERIFIERS}
    unknown = set(spec.weights) - known
    if unknown:
        raise ValueError(f"unknown reward weight(s) {sorted(unknown)}; known components: {sorted(known)}")
    name = row["verifier"]
    verifier = get_verifier(name)
    extract, extract_lenient = EXTRACTORS.get(name, _R1_ANSWER_STRICT if spec.strict_answer else _R1_ANSWER)
    extracted = extract(completion)
    well_formed = format_ok(completion)
    raw = verifier(extracted, row, spec)

    components = {"format": 1.0 if well_formed else 0.0, "tags": tag_count_reward(completion)}
    correct: bool | None = None
    if raw is not None:
        correct = raw >= 1.0
        components[name] = raw
        components["accuracy"] = 1.0 if correct else 0.0
    if num_tokens is not None:
        components["overlong"] = overlong_penalty(num_tokens, spec.overlong_max_tokens, spec.overlong_buffer)
        if correct is not None:
            components["cosine"] = cosine_scaled(correct, num_tokens, spec)
    components["repetition"] = repetition_penalty(completion, spec.repetition_ngram, spec.repetition_max_penalty)
    components["language"] = language_consistency(completion, spec.language_script)
    if rm_score is not None:
        components["reward_model"] = float(rm_score)

    weighted = {k: w for k, w in spec.weights.items() if w != 0}
    reward: float | None = None
    if all(k in components for k in weighted):
        reward = sum(w * components[k] for k, w in weighted.items())

    correct_lenient = correct
    if extracted is None and correct is not None:
        lenient = extract_lenient(completion)
        raw_lenient = verifier(lenient, row, spec) if lenient is not None else None
        correct_lenient = raw_lenient >= 1.0 if raw_lenient is not None else False
    return Verdict(correct=correct, extracted=extracted, format_ok=well_formed, reward=reward, components=components,
                   correct_lenient=correct_lenient)




# --------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv:2107.03374).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which
    avoids the huge binomials (the paper's numerically stable form).

    >>> pass_at_k(4, 1, 1)  # 1 - 3/4
    0.25
    >>> pass_at_k(4, 1, 2)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    >>> round(pass_at_k(5, 2, 2), 12)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    0.7
    """
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
