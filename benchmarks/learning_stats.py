"""`learning.py`'s statistics and verdicts (pure): accuracies, gains and paired differences with intervals over
seeds and prompts (`stages/math/stats.py`), and the rows of the table."""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.learning_plan import (
    ASYNC_TIME_SHARE,
    GAIN_TARGET,
    SPEEDUP_FLOOR,
    SPEEDUP_TARGET,
    TASK,
    TRANSFER,
    Plan,
    grpo_config,
)

ROW_KINDS = (("trl", "end", "TRL, budget"), ("r1flow", "equal_steps", "r1flow, TRL's steps"),
             ("r1flow", "end", "r1flow, budget"), ("r1flow_ppo", "end", "r1flow PPO, budget"),
             ("r1flow_async", "end", "r1flow async, budget"))
PHASES = ("generation", "scoring", "training")
# time to accuracy: (reference, side, goal for the speed-up, what the interval's low end must be above). Against
# sync r1flow the goal is issue 60's "sync's final accuracy in <= 0.7x sync's time", faster beyond the noise.
TIME_TO_ACCURACY = (("trl", "r1flow", SPEEDUP_TARGET, SPEEDUP_FLOOR),
                    ("trl", "r1flow_async", SPEEDUP_TARGET, SPEEDUP_FLOOR),
                    ("r1flow", "r1flow_async", 1 / ASYNC_TIME_SHARE, 1.0))


def eval_name(side: str, what: str, seed_index: int) -> str:
    """The evaluation of one side's model `what` ("end", "equal_steps", "t1", ...) of its `seed_index`-th seed."""
    return f"{side}_{what}_s{seed_index}"


def correct_vector(rows: list[dict], task: str) -> list[float]:
    return [float(bool(r["correct"])) for r in rows if r["task"] == task]


def prompt_ids(rows: list[dict], task: str) -> list[str]:
    return [r["prompt_id"] for r in rows if r["task"] == task]


def scores(evals: dict, names: list[str], task: str) -> np.ndarray:
    """(len(names), P): the evaluations' per-prompt correctness on `task`, after checking that every one scored the
    same prompt ids in the same order as the first (ValueError naming the first difference otherwise)."""
    ids = prompt_ids(evals[names[0]]["rows"], task)
    for name in names[1:]:
        other = prompt_ids(evals[name]["rows"], task)
        if other != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b), min(len(ids), len(other)))
            raise ValueError(f"{task}: {name} scored other prompts than {names[0]} ({len(other)} against {len(ids)}; "
                             f"first difference at position {at}: {other[at] if at < len(other) else 'none'} against "
                             f"{ids[at] if at < len(ids) else 'none'}): a paired comparison needs the same prompts")
    return np.array([correct_vector(evals[name]["rows"], task) for name in names], dtype=np.float64)


def accuracy_entry(rows: list[dict], task: str) -> dict:
    from stages.math.stats import bootstrap_ci

    v = correct_vector(rows, task)
    lo, hi = bootstrap_ci(v)
    fmt = [float(bool(r["format_ok"])) for r in rows if r["task"] == task]
    return {"accuracy": sum(v) / len(v) if v else float("nan"), "ci": [lo, hi], "n": len(v),
            "format_rate": sum(fmt) / len(fmt) if fmt else float("nan")}


def gain_entry(start_rows: list[dict], rows: list[dict], task: str) -> dict:
    """Gain over the start on the same prompts (one model), with a paired bootstrap interval over the prompts."""
    d = paired_diff({"a": {"rows": start_rows}, "b": {"rows": rows}}, "a", "b", task)
    return {"gain": d["diff"], "ci": d["ci"]}


def paired_diff(evals: dict, base: str, other: str, task: str = TASK) -> dict:
    """`other` minus `base` in accuracy on `task`, one model each, with its paired bootstrap interval over the
    prompts; ValueError unless both scored the same prompt ids in the same order."""
    from stages.math.stats import paired_bootstrap_diff

    a, b = scores(evals, [base, other], task)
    diff, lo, hi = paired_bootstrap_diff(a, b)
    return {"diff": diff, "ci": [lo, hi]}


def seeds_entry(evals: dict, start: str, names: list[str], task: str) -> dict:
    """Mean accuracy on `task` of the models `names` (one a seed) and their gain over the start model, intervals
    over seeds and prompts (`stages.math.stats.seed_prompt_means`)."""
    from stages.math.stats import percentile_interval, seed_prompt_diff, seed_prompt_means

    x = scores(evals, [start, *names], task)
    end = x[1:]
    if end.shape[1] == 0:  # nothing of this task was evaluated
        nan = float("nan")
        return {"accuracy": nan, "ci": [nan, nan], "n": 0, "seeds": len(names), "format_rate": nan,
                "gain": {"gain": nan, "ci": [nan, nan]}}
    gain, glo, ghi = seed_prompt_diff(np.broadcast_to(x[0], end.shape), end)
    fmt = [float(bool(r["format_ok"])) for n in names for r in evals[n]["rows"] if r["task"] == task]
    return {"accuracy": float(end.mean()), "ci": list(percentile_interval(seed_prompt_means(end[None])[:, 0])),
            "n": end.shape[1], "seeds": len(names), "format_rate": sum(fmt) / len(fmt),
            "gain": {"gain": gain, "ci": [glo, ghi]}}


def equal_time_verdict(c: dict) -> str:
    """r1flow against TRL at equal wall-clock, from `compare_gains` (a = TRL, b = r1flow): "MISSED" unless the
    difference's interval is above 0; then "undetermined" when TRL's gain interval reaches 0 (the ratio has no
    bounded interval: a TRL that barely learns must not make any ratio look won), else "met" when the ratio is at
    least GAIN_TARGET, "MISSED" otherwise."""
    if c["diff_ci"][0] <= 0:
        return "MISSED"
    if c["ratio"] is None or c["ratio_ci"] is None:
        return "undetermined"
    return "met" if c["ratio"] >= GAIN_TARGET else "MISSED"


def equal_steps_at(run: dict) -> int | None:
    """The step of a run's equal-steps snapshot, None when it has none."""
    return next((snap["step"] for snap in run["snapshots"] if snap["name"] == "equal_steps"), None)


def phase_means(runs: list[dict]) -> dict | None:
    """Mean seconds a step by phase (generation, scoring, training, total) over the steps after the first (the
    warm-up) of every seed's run; None when the runs did not record phases."""
    steps = [c for run in runs for c in run["curve"][1:]]
    if not steps or any(c.get(f"{p}_s") is None for c in steps for p in PHASES):
        return None
    out = {p: float(np.mean([c[f"{p}_s"] for c in steps])) for p in PHASES}
    out["total"] = float(np.mean([c["step_s"] for c in steps]))
    out["steps"] = len(steps)
    return out


def summarize_learning(plan: Plan, evals: dict, runs: dict) -> dict:
    """The rows of the table and the verdicts. runs: side -> one run a seed, in seed order; evals: "start" and
    `eval_name(side, what, k)`. Every pooled accuracy, gain and difference has an interval over seeds and prompts,
    each seed's own row one over prompts."""
    from stages.math.stats import compare_gains, seed_prompt_diff, two_sided

    start = evals["start"]["rows"]
    rows = [{"name": "start", "label": "start model", "steps": [0], "minutes": [0.0],
             "task": accuracy_entry(start, TASK), "transfer": accuracy_entry(start, TRANSFER), "gain": None,
             "transfer_gain": None, "per_seed": []}]
    for side, what, label in ROW_KINDS:
        ks = [k for k in range(len(runs.get(side, []))) if eval_name(side, what, k) in evals]
        if not ks:
            continue
        names = [eval_name(side, what, k) for k in ks]
        if what == "end":
            at = [(runs[side][k]["steps"], runs[side][k]["train_s"]) for k in ks]
        else:
            at = [next((snap["step"], snap["elapsed_s"]) for snap in runs[side][k]["snapshots"] if snap["name"] == what)
                  for k in ks]
        task, transfer = seeds_entry(evals, "start", names, TASK), seeds_entry(evals, "start", names, TRANSFER)
        per_seed = [{"seed": runs[side][k]["seed"], "first": runs[side][k].get("first"), "steps": steps,
                     "minutes": secs / 60, "task": accuracy_entry(evals[n]["rows"], TASK),
                     "gain": gain_entry(start, evals[n]["rows"], TASK)}
                    for k, n, (steps, secs) in zip(ks, names, at, strict=True)]
        rows.append({"name": f"{side}_{what}", "label": label, "steps": [a[0] for a in at],
                     "minutes": [a[1] / 60 for a in at], "task": task, "transfer": transfer,
                     "gain": task.pop("gain"), "transfer_gain": transfer.pop("gain"), "per_seed": per_seed})
    out = {"rows": rows, "seeds": plan.seeds, "std": grpo_config(plan, 1, plan.minutes).std,
           "r1flow_only": dict(plan.r1flow_extra), "trl_only": dict(plan.trl_extra)}

    def both(side_a: str, what_a: str, side_b: str, what_b: str) -> tuple[list[int], list[str], list[str]]:
        return paired_names(evals, runs, side_a, what_a, side_b, what_b)

    _, trl, r1 = both("trl", "end", "r1flow", "end")
    if trl:  # the headline: gains at equal wall-clock, seed k of one side paired with seed k of the other
        x = scores(evals, ["start", *trl, *r1], TASK)
        c = dataclasses.asdict(compare_gains(x[0], x[1:1 + len(trl)], x[1 + len(trl):]))
        c["seeds"] = len(trl)
        c["verdict"] = equal_time_verdict(c)
        out["equal_time"] = c
    seed_ks, trl, r1 = both("trl", "end", "r1flow", "equal_steps")
    # an r1flow run reused (--r1flow-from) kept its equal-steps point at the earlier TRL run's step count: a pair only
    # where that point is this TRL run's step count
    matched = [i for i, k in enumerate(seed_ks) if equal_steps_at(runs["r1flow"][k]) == runs["trl"][k]["steps"]]
    if len(matched) < len(trl):
        out["equal_steps_unmatched"] = [{"seed": runs["trl"][k]["seed"], "trl_steps": runs["trl"][k]["steps"],
                                         "r1flow_step": equal_steps_at(runs["r1flow"][k])}
                                        for i, k in enumerate(seed_ks) if i not in matched]
    trl, r1 = [trl[i] for i in matched], [r1[i] for i in matched]
    if trl:  # the correctness check: the same algorithm for the same steps should learn the same
        x = scores(evals, [*trl, *r1], TASK)
        diff, lo, hi = seed_prompt_diff(x[: len(trl)], x[len(trl):])
        out["equal_steps"] = {"diff": diff, "ci": [lo, hi], "seeds": len(trl), "verdict": two_sided(lo, hi)}
    _, grpo, ppo = both("r1flow", "end", "r1flow_ppo", "end")
    if grpo:
        x = scores(evals, [*grpo, *ppo], TASK)
        diff, lo, hi = seed_prompt_diff(x[: len(grpo)], x[len(grpo):])
        out["ppo_minus_grpo"] = {"diff": diff, "ci": [lo, hi], "seeds": len(grpo)}
    out["phases"] = {side: phase_means(rs) for side, rs in runs.items()}
    if "r1flow_async" in runs:
        out["async_side"] = {"max_staleness": plan.async_staleness, "placement": plan.async_placement}
    out["time_to_accuracy"] = [row for ref, side, goal, floor in TIME_TO_ACCURACY
                               if (row := time_to_accuracy_row(evals, runs, ref, side, goal, floor)) is not None]
    _, sync, asynchronous = both("r1flow", "end", "r1flow_async", "end")
    if sync:
        out["async_equal_time"] = async_equal_time(evals, sync, asynchronous)
    return out


def paired_names(evals: dict, runs: dict, side_a: str, what_a: str, side_b: str,
                 what_b: str) -> tuple[list[int], list[str], list[str]]:
    """The seed indices evaluated on both sides (model `what_a` of one, `what_b` of the other), and their
    evaluations' names on each."""
    n = min(len(runs.get(side_a, [])), len(runs.get(side_b, [])))
    ks = [k for k in range(n) if eval_name(side_a, what_a, k) in evals and eval_name(side_b, what_b, k) in evals]
    return ks, [eval_name(side_a, what_a, k) for k in ks], [eval_name(side_b, what_b, k) for k in ks]


# ---------------------------------------------------------------------------- time to accuracy


def curve_prompt_ids(evals: dict, runs: dict) -> set[str] | None:
    """The prompts of the learning curves: those a snapshot's evaluation scored (`--curve-prompts`, the first
    held-out ones); None when no run has a snapshot on the curve."""
    for side, side_runs in runs.items():
        for k, run in enumerate(side_runs):
            for snap in run.get("snapshots", []):
                if snap["name"].startswith("t") and (name := eval_name(side, snap["name"], k)) in evals:
                    return set(prompt_ids(evals[name]["rows"], TASK))
    return None


def side_curves(evals: dict, runs: dict, side: str, ks: list[int], ids: set[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """(S, T, P) correctness and (S, T) seconds of one side's seeds `ks` at the points `plot` draws: the start model
    (0 s), every `t*` snapshot each of these seeds saved, the end model (its training seconds); start and end on the
    curve prompts `ids` only (all held-out prompts when None). ValueError unless every point scored the same prompts
    in the same order."""
    runs_k = [runs[side][k] for k in ks]
    names = [[snap["name"] for snap in r.get("snapshots", []) if snap["name"].startswith("t")] for r in runs_k]
    common = [n for n in names[0] if all(n in other for other in names[1:])]
    keep = (lambda rows: rows) if ids is None else (lambda rows: [r for r in rows if r["prompt_id"] in ids])
    x, t = [], []
    for k, run in zip(ks, runs_k, strict=True):
        snaps = {snap["name"]: snap for snap in run.get("snapshots", [])}
        local = {"start": {"rows": keep(evals["start"]["rows"])},
                 "end": {"rows": keep(evals[eval_name(side, "end", k)]["rows"])},
                 **{n: evals[eval_name(side, n, k)] for n in common}}
        x.append(scores(local, ["start", *common, "end"], TASK))
        t.append([0.0, *(snaps[n]["elapsed_s"] for n in common), run["train_s"]])
    return np.stack(x), np.array(t, dtype=np.float64)


def time_to_accuracy_row(evals: dict, runs: dict, ref: str, side: str, goal: float, floor: float) -> dict | None:
    """`side`'s wall-clock to reach `ref`'s final accuracy on the curve prompts against `ref`'s own time, seeds
    paired (`stages.math.stats.compare_time_to_accuracy`), with `ref`'s gain on the same prompts (start to end), and
    the verdict: "undetermined" when that gain's interval reaches 0 (the target is then the start's accuracy, as in
    `equal_time_verdict`), else "met" when the speed-up is at least `goal` and its interval's low end above `floor`,
    "MISSED" otherwise. None unless both sides have every model of a seed evaluated."""
    from stages.math.stats import compare_time_to_accuracy, seed_prompt_diff

    n = min(len(runs.get(ref, [])), len(runs.get(side, [])))

    def evaluated(s: str, k: int) -> bool:
        return all(eval_name(s, w, k) in evals for w in ["end", *(snap["name"] for snap in runs[s][k].get("snapshots", [])
                                                                  if snap["name"].startswith("t"))])

    ks = [k for k in range(n) if evaluated(ref, k) and evaluated(side, k)]
    if not ks:
        return None
    ids = curve_prompt_ids(evals, runs)
    (a, times_a), (b, times_b) = side_curves(evals, runs, ref, ks, ids), side_curves(evals, runs, side, ks, ids)
    if a.shape[2] != b.shape[2] or (a[:, 0] != b[:, 0]).any():
        raise ValueError(f"time to accuracy: {ref} and {side} start from other scores on the curve prompts")
    c = dataclasses.asdict(compare_time_to_accuracy(a, times_a, b, times_b))
    gain, lo, hi = seed_prompt_diff(a[:, 0], a[:, -1])
    c.update(reference=ref, side=side, goal=goal, floor=floor, reference_gain={"gain": gain, "ci": [lo, hi]},
             ci=list(c["ci"]))
    c["verdict"] = ("undetermined" if lo <= 0 else
                    "met" if c["speedup"] >= goal and c["ci"][0] > floor else "MISSED")
    return c


def async_equal_time(evals: dict, sync: list[str], asynchronous: list[str]) -> dict:
    """Held-out accuracy at equal wall-clock, asynchronous r1flow minus sync (their end models, seed k with seed
    k), two-sided: "lower" beyond the noise is a miss (async must not end below sync)."""
    from stages.math.stats import seed_prompt_diff, two_sided

    x = scores(evals, [*sync, *asynchronous], TASK)
    diff, lo, hi = seed_prompt_diff(x[: len(sync)], x[len(sync):])
    return {"diff": diff, "ci": [lo, hi], "seeds": len(sync), "prompts": x.shape[1], "verdict": two_sided(lo, hi)}
