"""Seeds of individual random draws, derived from a run's seed.

Every seeded draw of a stage (a rollout's sampling, a mini-batch order, a prompt pick) takes its seed
from `seed_stream(seed, stream, *keys)`: a name for the draw and the indices that tell its
repetitions apart (step, epoch, rank, ...). Two different (seed, keys) tuples give different seeds
unless sha256 collides, which linear formulas such as `seed + 31 * step + epoch` cannot promise
(that one gives seed 0's step 1 the order of seed 31's step 0).
"""

from __future__ import annotations

import hashlib
import json

SEED_BITS = 63  # fits torch.manual_seed, numpy's default_rng and vLLM's per-request seed


def seed_stream(seed: int, *keys: int | str) -> int:
    """A seed in [0, 2**63) for one draw: the first 8 bytes of sha256 over the JSON list [seed, *keys].

    Keys are ints or strings (a string names the draw, so two kinds of draw never share a stream);
    1 and "1" are different keys, and so are (1, 2) and (12,) or (1, 2, 0).
    """
    for k in (seed, *keys):
        if isinstance(k, bool) or not isinstance(k, int | str):
            raise TypeError(f"seed_stream: keys are ints or strings, got {k!r} ({type(k).__name__})")
    text = json.dumps([seed, *keys], separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> (64 - SEED_BITS)
