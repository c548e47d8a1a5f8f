"""The math verifier: math-verify equivalence of an answer and the reference, in a process pool with a
deadline (`verify_math`).

math-verify and threads (docs/design.md §6): math-verify's own time limit uses `signal.alarm`, which
raises in any thread but the main one, and cannot interrupt sympy busy inside one C call anyway.
So math-verify is called with `parsing_timeout=None` and `timeout_seconds=None`, in a process
pool (`_math_check`): the caller's thread waits `RewardSpec.math_timeout_s` for the answer, and
on a miss scores None and kills the pool's workers (a pathological answer such as
`10^{10^{10^{10}}}` keeps sympy busy for over 20 s). Identical answers and
equal plain numbers are scored in-process without the pool (`_math_fast_path`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from fractions import Fraction
from typing import Any

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from schemas.configs import RewardSpec

log = logging.getLogger(__name__)


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
_THREADS = os.environ.get("R1FLOW_THREADS", "")  # this process's share under --parallel (flows.run.placement)
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
