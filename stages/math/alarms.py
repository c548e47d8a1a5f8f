"""Reward-hacking alarms of the RL stages: rules over a run's step metrics (docs/guides/alarms.md).

Each rule reads `history` (the metrics of steps 1..t, `history[i]` logged at step i + 1, as `StepLoop` keeps them)
and its thresholds, and returns an `Alarm` when the run misbehaves at its latest step t, else None. Pure: no torch;
`raised` runs the rules an `AlarmsConfig` (an RL config's `alarms:` block) names, after every step
(`stages/training/rl_loop.py`).

The per-step rules (length, repetition, format, entropy, kl) compare the latest `patience` steps with a baseline,
the mean of the first `baseline_steps` values, so one noisy step does not fire. The held-out rule asks whether the
held-out accuracy fell beyond its noise: Newcombe's interval for a difference of two proportions (his method 10,
from two Wilson score intervals; Newcombe 1998, Statistics in Medicine 17:873) stays above 0, while the training
reward rose. The held-out prompts are the same at every eval, so the two accuracies are paired; the interval for
independent samples is wider than a paired one would be: the rule errs on the side of silence.

Which policy an alarm implicates: a step's rollout and training metrics (reward, length, format, entropy, kl) at
step b come from the policy after b - 1 steps, so when they turn bad at step b the newest policy not implicated is
the one after b - 2 steps (`Alarm.last_good`). A held-out eval at step e measures the policy after e steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from schemas.rl_configs import AlarmsConfig

LENGTH = "completion/mean_length"
TRUNCATED = "completion/truncated_frac"
REPETITION = "reward/repetition"  # the n-gram repetition penalty: repeated share x repetition_max_penalty (<= 0)
FORMAT = "reward/format_rate"
ENTROPY = "train/entropy"
KL = "train/kl"
REWARD = "reward/mean"
HELD_OUT = "eval/accuracy"

Z_95 = 1.959963984540054  # the standard normal's 0.975 quantile


@dataclass(frozen=True)
class Alarm:
    """A rule that fired at step `step` (as logged); its evidence began at step `began`; `last_good`: the number of
    steps of the newest policy the evidence does not implicate (0: the input model); `message`: one line naming
    the metric, the steps and the numbers."""

    rule: str
    step: int
    began: int
    last_good: int
    message: str


def series(history: list[dict[str, float]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every step that logged `key`, in order (steps from 1)."""
    return [(i + 1, float(m[key])) for i, m in enumerate(history) if key in m]


def _sustained(history: list[dict[str, float]], key: str, baseline_steps: int, patience: int,
               bad: Callable[[float, float], bool]) -> tuple[float, list[tuple[int, float]]] | None:
    """(baseline, the bad run) when the latest `patience` values of `key`, after its first `baseline_steps` values
    (their mean: the baseline), all satisfy `bad(value, baseline)` and the latest is the run's newest step; the bad
    run is every consecutive bad value that ends at the latest one, back to the baseline at most."""
    points = series(history, key)
    if len(points) < baseline_steps + patience or points[-1][0] != len(history):
        return None
    baseline = sum(v for _, v in points[:baseline_steps]) / baseline_steps
    run: list[tuple[int, float]] = []
    for step, value in reversed(points[baseline_steps:]):
        if not bad(value, baseline):
            break
        run.insert(0, (step, value))
    return (baseline, run) if len(run) >= patience else None


def _rollout_alarm(rule: str, found: tuple[float, list[tuple[int, float]]], what: str) -> Alarm:
    baseline, run = found
    began, step = run[0][0], run[-1][0]
    values = ", ".join(f"{v:.3g}" for _, v in run)
    return Alarm(rule, step, began, max(0, began - 2),
                 f"{what}: {values} at steps {began}-{step}, its baseline (the mean of its first values) {baseline:.3g}")


def length_alarm(history: list[dict[str, float]], factor: float = 2.0, truncated_rise: float = 0.3,
                 baseline_steps: int = 3, patience: int = 2) -> Alarm | None:
    """Completion length exploding, for `patience` steps: the mean completion length at least `factor` times its
    baseline, or (a length that runs into max_new_tokens cannot double) the share of completions cut at
    max_new_tokens at least `truncated_rise` above its baseline."""
    found = _sustained(history, LENGTH, baseline_steps, patience, lambda v, b: v >= factor * b and v > b)
    if found:
        return _rollout_alarm("length", found, f"{LENGTH} at least {factor:g}x its baseline")
    found = _sustained(history, TRUNCATED, baseline_steps, patience, lambda v, b: v >= b + truncated_rise)
    return _rollout_alarm("length", found, f"{TRUNCATED} (completions cut at max_new_tokens) at least "
                          f"{truncated_rise:g} above its baseline") if found else None


def repetition_alarm(history: list[dict[str, float]], max_penalty: float, rise: float = 0.3,
                     baseline_steps: int = 3, patience: int = 2) -> Alarm | None:
    """Repetition exploding: the share of repeated n-grams in the completions (`reward/repetition` divided by the
    reward's `repetition_max_penalty`, < 0) at least `rise` above its baseline for `patience` steps. A
    max_penalty of 0 logs 0 always: no alarm."""
    if max_penalty >= 0:
        return None
    shares = [{**m, REPETITION: m[REPETITION] / max_penalty} if REPETITION in m else m for m in history]
    found = _sustained(shares, REPETITION, baseline_steps, patience, lambda v, b: v >= b + rise)
    return _rollout_alarm("repetition", found, f"repeated n-gram share ({REPETITION} / {max_penalty:g}) at least "
                          f"{rise:g} above its baseline") if found else None


def format_alarm(history: list[dict[str, float]], drop: float = 0.3, baseline_steps: int = 3,
                 patience: int = 2) -> Alarm | None:
    """Format rate collapsing: the share of well-formed completions at least `drop` below its baseline for
    `patience` steps."""
    found = _sustained(history, FORMAT, baseline_steps, patience, lambda v, b: v <= b - drop)
    return _rollout_alarm("format", found, f"{FORMAT} at least {drop:g} below its baseline") if found else None


def entropy_alarm(history: list[dict[str, float]], fraction: float = 0.1, baseline_steps: int = 3,
                  patience: int = 2) -> Alarm | None:
    """Entropy collapse: the policy's mean token entropy on its rollouts at most `fraction` of its baseline for
    `patience` steps."""
    found = _sustained(history, ENTROPY, baseline_steps, patience, lambda v, b: b > 0 and v <= fraction * b)
    return _rollout_alarm("entropy", found, f"{ENTROPY} at most {fraction:g}x its baseline") if found else None


def kl_alarm(history: list[dict[str, float]], limit: float = 1.0, baseline_steps: int = 3,
             patience: int = 2) -> Alarm | None:
    """KL running away: the per-token KL to the reference at least `limit` nats for `patience` steps (after the
    first `baseline_steps`, where it starts near 0)."""
    found = _sustained(history, KL, baseline_steps, patience, lambda v, b: v >= limit)
    return _rollout_alarm("kl", found, f"{KL} at least {limit:g}") if found else None


def wilson_interval(p: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson's score interval (low, high) of a proportion p observed on n trials (n >= 1)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def accuracy_drop_interval(before: float, n_before: int, after: float, n_after: int,
                           z: float = Z_95) -> tuple[float, float]:
    """Newcombe's interval (method 10) of `before - after`, accuracies on `n_before` and `n_after` prompts: the
    difference minus/plus the root of the squared distances from each accuracy to its Wilson bound on that side."""
    l1, u1 = wilson_interval(before, n_before, z)
    l2, u2 = wilson_interval(after, n_after, z)
    d = before - after
    return d - math.sqrt((before - l1) ** 2 + (u2 - after) ** 2), d + math.sqrt((u1 - before) ** 2 + (after - l2) ** 2)


def _reward_near(history: list[dict[str, float]], step: int, window: int) -> float | None:
    """The mean training reward of the `window` steps ending at `step`, None when none logged one."""
    xs = [v for s, v in series(history[:step], REWARD)][-window:]
    return sum(xs) / len(xs) if xs else None


def held_out_alarm(history: list[dict[str, float]], n_prompts: int, z: float = Z_95,
                   window: int = 3) -> Alarm | None:
    """Training reward rising while held-out accuracy falls beyond its noise: at the latest step's held-out eval,
    the accuracy's drop from its best earlier eval has a Newcombe interval (z) above 0 on `n_prompts` prompts, and
    the training reward (the mean of `window` steps) is higher than around that best eval."""
    evals = series(history, HELD_OUT)
    if n_prompts < 1 or len(evals) < 2 or evals[-1][0] != len(history):
        return None
    step, after = evals[-1]
    best_step, before = max(evals[:-1], key=lambda e: (e[1], -e[0]))
    low, _ = accuracy_drop_interval(before, n_prompts, after, n_prompts, z)
    r_before, r_after = _reward_near(history, best_step, window), _reward_near(history, step, window)
    if low <= 0 or r_before is None or r_after is None or r_after <= r_before:
        return None
    return Alarm("held_out", step, best_step + 1, best_step,
                 f"{HELD_OUT} fell from {before:.3g} at step {best_step} to {after:.3g} at step {step} on "
                 f"{n_prompts} held-out prompts (the drop's interval starts at {low:.3g} > 0) while {REWARD} rose "
                 f"from {r_before:.3g} to {r_after:.3g}")


RULES: dict[str, Callable[[list[dict[str, float]], AlarmsConfig, int, float], Alarm | None]] = {
    "length": lambda h, c, n, rep: length_alarm(h, c.length_factor, c.truncated_rise, c.baseline_steps,
                                                c.patience),
    "repetition": lambda h, c, n, rep: repetition_alarm(h, rep, c.repetition_rise, c.baseline_steps, c.patience),
    "format": lambda h, c, n, rep: format_alarm(h, c.format_drop, c.baseline_steps, c.patience),
    "entropy": lambda h, c, n, rep: entropy_alarm(h, c.entropy_fraction, c.baseline_steps, c.patience),
    "kl": lambda h, c, n, rep: kl_alarm(h, c.kl_limit, c.baseline_steps, c.patience),
    "held_out": lambda h, c, n, rep: held_out_alarm(h, n, c.held_out_z, c.reward_window),
}


def raised(history: list[dict[str, float]], cfg: AlarmsConfig, n_prompts: int, repetition_max_penalty: float,
           fired: set[str]) -> list[Alarm]:
    """The alarms of `cfg.rules` that fire at the latest step of `history` and have not fired before (`fired`):
    each rule speaks once a run. `n_prompts`: the held-out prompts of the periodic eval."""
    found = (RULES[rule](history, cfg, n_prompts, repetition_max_penalty) for rule in cfg.rules if rule not in fired)
    return [a for a in found if a is not None]
