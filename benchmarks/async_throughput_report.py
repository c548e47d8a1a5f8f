"""The numbers and the markdown of benchmarks/async_throughput.py: one run's summary from the stage's per-step
metrics, the settings' means with their spread over repeats, the speed-up over the synchronous run against the
ceiling (t_gen + t_train) / max(t_gen, t_train), and the environment the numbers were taken in."""

from __future__ import annotations

import argparse
import os
import statistics
import time

# (column heading, key, format): the table's columns after placement and K, in order
COLUMNS = (("samples/s", "samples_per_s", ".3f"), ("s/step", "s_per_step", ".2f"), ("t_gen s", "t_gen", ".2f"),
           ("t_train s", "t_train", ".2f"), ("ceiling", "ceiling", ".2f"), ("speed-up", "speedup", ".2f"),
           ("share of ceiling", "ceiling_share", ".2f"), ("overlap", "overlap", ".2f"),
           ("gen idle", "generation_idle", ".2f"), ("train idle", "training_idle", ".2f"),
           ("staleness mean", "staleness_mean", ".2f"))
LOADED_LOAD = 0.5  # a 1-minute load average at the start from this much other work on: not an idle machine
LOADED_CORES = 0.25  # cores other processes kept busy during a local run, from this much on: a loaded machine


def per_step(metrics: list) -> dict[int, dict[str, float]]:
    """The stage's logged metrics by step (1-based; a step logged in several calls merged), run-level ones left out."""
    out: dict[int, dict[str, float]] = {}
    for step, m in metrics:
        if step is not None:
            out.setdefault(int(step), {}).update(m)
    return out


def _mean(values: list[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def summarize_run(out: dict, k: int, warmup: int, samples_per_step: int) -> dict:
    """One run's numbers over the steps after `warmup` (1-based steps warmup+1 .. last): samples/s over the
    wall-clock from the end of step `warmup` to the end of the last, the phase times' means, and the overlap and
    idle fractions (K >= 1: the stage's async/* metrics; K = 0: its phase times over each step's wall-clock, the
    overlap 0) and the staleness mean (K = 0: 0, every group is the learner's own)."""
    clock = {int(s): float(t) for s, t in out["clock"].items()}
    steps = per_step(out["metrics"])
    last = max(clock)
    window = [s for s in sorted(steps) if warmup < s <= last]
    span = clock[last] - clock[warmup]
    gen = [steps[s].get("time/generation", 0.0) + steps[s].get("time/scoring", 0.0) for s in window]
    train = [steps[s].get("time/training", 0.0) for s in window]
    if k:
        overlap = _mean([steps[s]["async/overlap"] for s in window])
        gen_idle = _mean([steps[s]["async/generation_idle"] for s in window])
        train_idle = _mean([steps[s]["async/training_idle"] for s in window])
        staleness = _mean([steps[s]["async/staleness_mean"] for s in window])
    else:
        wall = [clock[s] - clock[s - 1] for s in window]
        overlap, staleness = 0.0, 0.0
        gen_idle = _mean([max(0.0, 1.0 - g / w) for g, w in zip(gen, wall, strict=True)])
        train_idle = _mean([max(0.0, 1.0 - t / w) for t, w in zip(train, wall, strict=True)])
    return {"samples_per_s": len(window) * samples_per_step / span, "s_per_step": span / len(window),
            "t_gen": _mean(gen), "t_train": _mean(train), "overlap": overlap, "generation_idle": gen_idle,
            "training_idle": train_idle, "staleness_mean": staleness, "steps_measured": len(window),
            "stage_s": out.get("stage_s"), "learner_threads": out.get("learner_threads"),
            "worker_threads": out.get("worker_threads"), "foreign_cores": out.get("foreign_cores"),
            "placement_params": {key: v for key, v in out.get("params", {}).items() if key.startswith("async.")},
            "steps": {s: {key: v for key, v in steps[s].items() if key.startswith(("time/", "async/"))}
                      | {"wall_s": clock[s] - clock[s - 1]} for s in window}}


def ceiling(t_gen: float, t_train: float) -> float:
    """How many times faster overlapping generation and training could make a step: (t_gen + t_train) / max."""
    return (t_gen + t_train) / max(t_gen, t_train)


def spread(values: list[float]) -> dict:
    """The mean of the repeats' values and half their range (two repeats: the values are mean -/+ it)."""
    return {"mean": _mean(values), "half_range": (max(values) - min(values)) / 2 if values else float("nan"),
            "values": list(values)}


def throughput_rows(runs: list[dict]) -> list[dict]:
    """One row per (placement, K): each column's mean and spread over the repeats. The ceiling comes from the
    same placement's and repeat's synchronous run (K = 0), and the speed-up is the samples/s over that run's."""
    by = {(r["placement"], r["k"], r["repeat"]): r for r in runs}
    rows = []
    for placement in dict.fromkeys(r["placement"] for r in runs):
        for k in sorted({r["k"] for r in runs if r["placement"] == placement}):
            cells: dict[str, list[float]] = {key: [] for _, key, _ in COLUMNS}
            for (p, kk, repeat), run in sorted(by.items()):
                sync = by.get((p, 0, repeat))
                if p != placement or kk != k or sync is None:
                    continue
                top = ceiling(sync["t_gen"], sync["t_train"])
                speedup = run["samples_per_s"] / sync["samples_per_s"]
                derived = {"ceiling": top, "speedup": speedup, "ceiling_share": speedup / top}
                for _, key, _ in COLUMNS:
                    cells[key].append(derived[key] if key in derived else run[key])
            rows.append({"placement": placement, "k": k, "repeats": len(cells["samples_per_s"]),
                         **{key: spread(values) for key, values in cells.items()}})
    return rows


def cell(value: dict, fmt: str) -> str:
    text = format(value["mean"], fmt)
    return f"{text} ± {format(value['half_range'], fmt)}" if len(value["values"]) > 1 else text


def markdown_table(rows: list[dict]) -> str:
    head = "| placement | K | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for row in rows:
        lines.append(f"| {row['placement']} | {row['k']} | "
                     + " | ".join(cell(row[key], fmt) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def _threads_line(runs: list[dict]) -> str:
    seen: dict[tuple[str, bool], tuple[set, set]] = {}
    for r in runs:
        learner, worker = seen.setdefault((r["placement"], r["k"] > 0), (set(), set()))
        learner.update(r.get("learner_threads") or [])
        if r.get("worker_threads"):
            worker.add(r["worker_threads"])
    parts = []
    for (placement, asynchronous), (learner, worker) in seen.items():
        who = f"K >= 1: learner {sorted(learner)} + worker {sorted(worker)}" if asynchronous else f"K = 0: {sorted(learner)}"
        parts.append(f"{placement} {who}")
    return "torch threads per process (" + "; ".join(parts) + ")"


def environment_lines(args: argparse.Namespace, runs: list[dict], load_start: tuple, load_end: tuple) -> list[str]:
    """What the numbers were taken on and beside: the CPU, threads, MKL's and OpenMP's modes, the load."""
    import torch
    import transformers

    from benchmarks.suite import code_version, cpu_model

    foreign = [r["foreign_cores"] for r in runs if r.get("foreign_cores") is not None]
    loaded = load_start[0] >= LOADED_LOAD or (foreign and max(foreign) >= LOADED_CORES)
    verdict = ("LOADED: other work ran on the machine, so these numbers are slower and noisier than an idle "
               "machine's" if loaded else "idle at the start")
    lines = [f"CPU: {cpu_model()}, {os.cpu_count()} cores on the machine; local: {args.cores} cores (the learner's "
             f"process and its worker pinned to them); ray: one core a node (taskset), Ray num_cpus 1",
             _threads_line(runs) + "; MKL_CBWR=" + os.environ.get("MKL_CBWR", "AUTO,STRICT (set by the benchmark)")
             + "; OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "unset (libgomp's default)"),
             f"load average (1, 5, 15 min) at the start {', '.join(f'{x:.2f}' for x in load_start)}, at the end "
             f"{', '.join(f'{x:.2f}' for x in load_end)} (the end's includes this benchmark's own runs): {verdict}"]
    if foreign:
        lines.append(f"cores other processes kept busy during the local runs: mean {_mean(foreign):.2f}, "
                     f"max {max(foreign):.2f}")
    lines.append(f"torch {torch.__version__}, transformers {transformers.__version__}, r1flow {code_version()}")
    return lines


def markdown_section(args: argparse.Namespace, rows: list[dict], env: list[str], started: float, argv: str) -> str:
    """The section for docs/results: heading, command, shape, environment, the table and how to read it."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lora = f"LoRA r{args.lora_r}" if args.lora_r else "full fine-tuning"
    return "\n".join([
        f"## {when}: asynchronous GRPO throughput (issue 60), {args.model}",
        "",
        f"Command: `.venv/bin/python benchmarks/async_throughput.py {argv}`",
        "",
        f"GRPO {args.prompts} prompts x {args.group} completions x <= {args.new_tokens} tokens, {lora}, mu 1; "
        f"{args.steps} steps a run, the first {args.warmup} left out; each number the mean ± half its range over "
        f"{args.repeats} repeat(s), the settings' order alternated between repeats.",
        "",
        *[f"- {line}" for line in env],
        "",
        markdown_table(rows),
        "",
        "local: one machine, the learner and (K >= 1) one worker process on the same cores; ray: a 2-node loopback "
        "cluster, the learner a Ray task on one node, the worker an actor on the other (K = 0: the other node "
        "idles). ceiling = (t_gen + t_train) / max(t_gen, t_train) of the same placement's synchronous run; "
        "speed-up = samples/s over K = 0's, paired by repeat; share of ceiling = speed-up / ceiling. t_gen and "
        "t_train are each side's own time a step (with K >= 1 the worker's and the learner's, each on its share "
        "of the cores). K = 0's overlap and idle fractions come from its phase times over each step's wall-clock.",
    ])
