"""Length and repetition shaping terms of the reward (DAPO's overlong punishment, open-r1's n-gram
repetition penalty, the cosine length scaling of "Demystifying Long Chain-of-Thought")."""

from __future__ import annotations

import math

from schemas.configs import RewardSpec


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

