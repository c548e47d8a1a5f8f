"""Keep freed host memory for reuse while a stage runs on CPU (glibc malloc thresholds).

On CPU every tensor is a malloc. glibc serves a block above its mmap threshold (128 KiB at
first, adjusted upward to at most 32 MiB as blocks are freed) with a fresh `mmap` and gives it
back with `munmap` when the tensor dies. A training step allocates the same large tensors every
step (activations, the output head's logits chunk, SmolLM2's 113 MB embedding gradient): each
comes back as new pages that the kernel faults in and zeroes one at a time. Measured on the
SmolLM2-135M SFT step of the benchmark suite (4 x 149 tokens, 2 cores): ~106,000 page faults a
step, ~1,700 with the thresholds below; the step 3.57 -> 3.28 s and 3.57 -> 3.24 s in alternating
runs (this machine's noise is +-10%), peak memory within noise (3.0-3.2 GiB).
PyTorch's CPU performance guide recommends an allocator that keeps memory (jemalloc, tcmalloc
via LD_PRELOAD) for the same reason; this gets most of that from glibc itself, in-process.

`reuse_freed_memory(device)` raises both thresholds while a stage runs on CPU, so freed blocks
stay in the heap for the next step's tensors, then gives the free memory back (`malloc_trim`)
and sets glibc's initial values again (128 KiB each; glibc's upward adjustment of the mmap threshold
stays off once mallopt has set it, as with any mallopt call). It does nothing off Linux/glibc, on a CUDA device,
when the user set `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or malloc `GLIBC_TUNABLES`
themselves (theirs win), or with `R1FLOW_MALLOC_TUNING=0`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
GLIBC_DEFAULT = 128 * 1024  # both thresholds' initial values
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap; up to 1 GiB of free memory at its top is kept
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname on every architecture it supports
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tuning_wanted(device: str, environ: os._Environ | dict = os.environ) -> bool:
    """Whether a stage on `device` should raise the thresholds: CPU, not opted out, none set by the user."""
    if not device.startswith("cpu") or environ.get("R1FLOW_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no"):
        return False
    return not any(name in environ for name in USER_SETTINGS) and "glibc.malloc" not in environ.get("GLIBC_TUNABLES", "")


def _raise_thresholds(libc: ctypes.CDLL) -> bool:
    # mallopt(3) documents 32 MiB as the maximum on 64-bit; glibc 2.36 takes 1 GiB. Where refused, 32 MiB.
    kept = any(libc.mallopt(M_MMAP_THRESHOLD, size) for size in (KEEP_BYTES, 32 << 20))
    return kept and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))


def _restore_defaults(libc: ctypes.CDLL) -> None:
    libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT)
    libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT)
    libc.malloc_trim(0)  # the freed heap goes back to the system now, not at some later free


_lock = threading.Lock()
_holders = 0  # stages inside the block in this process (Prefect may run tasks in threads)
_kept = False


@contextmanager
def reuse_freed_memory(device: str) -> Iterator[bool]:
    """Within the block, glibc keeps freed blocks for reuse; yields whether it does. Blocks may overlap
    (stages in threads of one process): the defaults come back when the last one ends."""
    global _holders, _kept
    libc = _glibc() if tuning_wanted(device) else None
    if libc is None:
        yield False
        return
    with _lock:
        if _holders == 0:
            _kept = _raise_thresholds(libc)
        _holders += 1
        kept = _kept
    try:
        yield kept
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                _restore_defaults(libc)
