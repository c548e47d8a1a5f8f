"""The speed suite's numbers (pure): each run's medians, repeats pooled, r1flow/TRL ratios against their targets,
a model's table and the run's RESULTS section (`suite.py` measures, this says what the measurements show)."""

from __future__ import annotations

from datetime import UTC, datetime

from benchmarks.common import MODEL_REFS, Shape, describe_allocator, median

TASKS = ("sft", "dpo", "grpo", "grpo_long")
GRPO_TASKS = ("grpo", "grpo_long")
FRAMEWORKS = ("r1flow", "trl")
# acceptance targets (issues 9 and 25), SmolLM2 only: (model, device kind, task) -> minimum speed ratio
TARGETS = {("smollm2", "cpu", "sft"): 1.5, ("smollm2", "cpu", "dpo"): 1.5, ("smollm2", "cpu", "grpo"): 3.0,
           ("smollm2", "cpu", "grpo_long"): 3.0, ("smollm2", "cuda", "grpo"): 10.0}
MEMORY_TARGETS = {("smollm2", "dpo")}  # r1flow's peak below TRL's (the cached reference), any device
SMOKE_MODELS = {"tiny"}  # a random model of 4 tiny layers: steps of milliseconds, run to test the suite, no target


def summarize_speed(task: str, r: dict | None) -> dict | None:
    """The reported numbers of one run: medians over its warm steps."""
    if r is None:
        return None
    if task in ("sft", "dpo"):
        step = median(r["step_s"])
        units = r["batch"] * (r["seq_len"] if task == "sft" else 1)
        return {"rate": units / step, "step_s": step, "n_steps": len(r["step_s"]), "seq_len": r["seq_len"],
                "peak_delta_mib": r["peak_delta_mib"], "peak_mib": r["peak_mib"],
                "reference_s": r.get("reference_s")}
    steps = r["steps"]
    gen = {k: median([s[k] for s in steps]) for k in ("generation", "scoring", "training", "total")}
    tokens = median([s["completion_tokens"] for s in steps])
    return {**gen, "n_steps": len(steps), "completion_tokens": tokens,
            "mean_length": tokens / r["completions"],
            "gen_tokens_per_s": median([s["completion_tokens"] / s["generation"] for s in steps]),
            "peak_delta_mib": r["peak_delta_mib"], "peak_mib": r["peak_mib"]}


def pool(runs: list[dict | None]) -> dict | None:
    """One result from repeated runs of the same (task, framework): their warm steps together (so the
    median is over all of them), the largest peak memory, and each run kept under `repeats`."""
    every = runs
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    if len(runs) == 1:
        return runs[0]
    merged = {**runs[0], "repeats": every, "peak_delta_mib": max(r["peak_delta_mib"] for r in runs),
              "peak_mib": max(r["peak_mib"] for r in runs)}
    key = "step_s" if "step_s" in runs[0] else "steps"
    merged[key] = [x for r in runs for x in r[key]]
    return merged


def repeat_ratios(task: str, ours: dict | None, theirs: dict | None) -> list[float]:
    """Speed ratio of each repeat (the runs made next to each other), for the spread across repeats."""
    if not ours or not theirs or "repeats" not in ours or "repeats" not in theirs:
        return []
    out = []
    for a, b in zip(ours["repeats"], theirs["repeats"], strict=False):
        if a is None or b is None:  # a failed run: its repeat has no ratio
            continue
        x = speed_ratio(task, summarize_speed(task, a), summarize_speed(task, b))
        if x is not None:
            out.append(x)
    return out


def speed_ratio(task: str, ours: dict | None, theirs: dict | None) -> float | None:
    """How many times faster r1flow is, from two `summarize_speed` results: tokens or pairs per second for
    sft/dpo, the step time for grpo."""
    key, higher_is_better = ("rate", True) if task in ("sft", "dpo") else ("total", False)
    return ratio(ours and ours[key], theirs and theirs[key], higher_is_better)


def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def target_cell(name: str, kind: str, task: str, x: float | None) -> str:
    """The target cell of a speed row: 'smoke run' for a smoke model, '-' without a target."""
    if name in SMOKE_MODELS:
        return "smoke run"
    target = TARGETS.get((name, kind, task))
    if target is None:
        return "-"
    return f">= {target:g}x: {'n/a' if x is None else 'met' if x >= target else 'MISSED'}"


def grpo_label(shape: Shape) -> str:
    return f"GRPO {shape.grpo_prompts}x{shape.grpo_group}x{shape.grpo_new_tokens}"


def shape_line(name: str, device: str, shapes: dict[str, Shape]) -> str:
    """What one model's rows measure, in a line."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    base = shapes.get("sft") or next(iter(shapes.values()))
    grpo = "; ".join(f"{grpo_label(sh)} = {sh.grpo_prompts} prompts x {sh.grpo_group} x <= {sh.grpo_new_tokens} "
                     f"tokens, minibatch {sh.grpo_minibatch}, {sh.grpo_steps} timed step{'s' * (sh.grpo_steps != 1)} a run"
                     for t, sh in shapes.items() if t in GRPO_TASKS)
    smoke = ", a smoke run: no targets" if name in SMOKE_MODELS else ""
    return (f"{name} ({MODEL_REFS[name]}{smoke}): SFT {base.sft_batch} seqs/step; DPO {base.dpo_batch} pairs/step; "
            f"{grpo}; {f'LoRA r={base.lora_r}' if base.lora_r else 'full fine-tuning'}; "
            f"{'bf16 autocast' if kind == 'cuda' else 'fp32'}; "
            f"{'r1flow: its CUDA-graph decode (cache graph), TRL: its default dynamic cache' if base.cache == 'graph' else f'{base.cache} KV cache'}; r1flow generation "
            f"{base.r1flow_backend}; medians of warm steps")


def report(name: str, device: str, shapes: dict[str, Shape], res: dict) -> list[tuple[str, str, str, str, str]]:
    """Print the table of one model; return its rows (measurement, r1flow, TRL, ratio, target), each ratio cell
    starting with the word `ratio`."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    s = {(t, f): summarize_speed(t, res.get((t, f))) for t in TASKS for f in FRAMEWORKS}
    rows: list[tuple[str, str, str, str, str]] = []

    def contended(task: str) -> str:
        shares = {f: (res.get((task, f)) or {}).get("foreign_cpu") for f in FRAMEWORKS}
        busy = [f"{'TRL' if f == 'trl' else f} {100 * v:.0f}%" for f, v in shares.items() if v is not None and v > 0.1]
        return f" (contended: other processes used {', '.join(busy)} of the CPUs)" if busy else ""

    not_run = {f for f in FRAMEWORKS if not any((t, f) in res for t in TASKS)}  # --frameworks left it out

    def line(task: str, label: str, ours: str, theirs: str, x: float | None, target: str = "-",
             spread: str = "", headline: bool = False) -> None:
        if "r1flow" in not_run:
            ours = ours.replace("failed", "not run")
        if "trl" in not_run:
            theirs = theirs.replace("failed", "not run")
        if headline:  # a task's speed: with the other processes' share of the CPUs while it ran
            target += contended(task)
        print(f"   {label:40} r1flow {ours:>22}   TRL {theirs:>22}   ratio {fmt_ratio(x)}{spread}   [{target}]")
        rows.append((label, ours.strip(), theirs.strip(), f"ratio {fmt_ratio(x)}{spread}", target))

    def num(v, f=None):  # rates: three decimals below 10 (SmolLM2 DPO on CPU is ~0.3 pairs/s)
        return "failed" if v is None else (f or ("{:.3f}" if abs(v) < 10 else "{:.1f}")).format(v)

    def spread(task: str) -> str:
        xs = repeat_ratios(task, res.get((task, "r1flow")), res.get((task, "trl")))
        return f" (each repeat: {', '.join(fmt_ratio(x) for x in xs)})" if xs else ""

    for task, label in (("sft", "SFT tokens/s"), ("dpo", "DPO pairs/s")):
        a, b = s[(task, "r1flow")], s[(task, "trl")]
        if a is None and b is None:
            continue
        x = speed_ratio(task, a, b)
        line(task, label, num(a and a["rate"]), num(b and b["rate"]), x, target_cell(name, kind, task, x), spread(task),
             headline=True)
    for task in GRPO_TASKS:
        a, b = s[(task, "r1flow")], s[(task, "trl")]
        if a is None and b is None:
            continue
        g = grpo_label(shapes[task])
        x = speed_ratio(task, a, b)
        line(task, f"{g} step", num(a and a["total"], "{:.2f} s"), num(b and b["total"], "{:.2f} s"), x,
             target_cell(name, kind, task, x), spread(task), headline=True)
        for part in ("generation", "scoring", "training"):
            line(task, f"{g} {part}", num(a and a[part], "{:.3f} s"), num(b and b[part], "{:.3f} s"),
                 ratio(a and a[part], b and b[part], False))
        line(task, f"{g} generation tokens/s", num(a and a["gen_tokens_per_s"]), num(b and b["gen_tokens_per_s"]),
             ratio(a and a["gen_tokens_per_s"], b and b["gen_tokens_per_s"], True))
        line(task, f"{g} mean completion tokens", num(a and a["mean_length"]), num(b and b["mean_length"]),
             ratio(a and a["mean_length"], b and b["mean_length"], True), "- (sampled; ratio r1flow / TRL)")
    for task in TASKS:
        a, b = s[(task, "r1flow")], s[(task, "trl")]
        if a is None and b is None:
            continue
        x = ratio(a and a["peak_delta_mib"], b and b["peak_delta_mib"], False)
        target = "-"
        if name in SMOKE_MODELS:
            target = "smoke run"
        elif (name, task) in MEMORY_TARGETS:
            target = f"r1flow below TRL: {'n/a' if x is None else 'met' if x > 1 else 'MISSED'}"
        label = grpo_label(shapes[task]) if task in GRPO_TASKS else task.upper()
        line(task, f"{label} peak memory (MiB over start)", num(a and a["peak_delta_mib"], "{:.0f} MiB"),
             num(b and b["peak_delta_mib"], "{:.0f} MiB"), x, target)
    a, b = s[("dpo", "r1flow")], s[("dpo", "trl")]
    if a is not None and b is not None:
        print(f"   (DPO reference pass, not in pairs/s: r1flow reference_logprobs stage {a['reference_s']:.1f} s "
              f"wall incl. model load; TRL precompute {b['reference_s']:.1f} s)")
    for t in TASKS:
        for f in FRAMEWORKS:
            if s[(t, f)] is not None and "seq_len" in s[(t, f)]:
                print(f"   ({t} {f}: mean sequence {s[(t, f)]['seq_len']:.1f} tokens, {s[(t, f)]['n_steps']} timed steps)")
    return rows


def environment_line(allocator: str, alloc: dict, info: dict) -> str:
    """The environment every child of a run shared, in a line (stated once per section)."""
    return (f"{describe_allocator(allocator, alloc) if alloc else f'allocator {allocator}: no child reported'}; "
            f"torch {info.get('torch')}, transformers {info.get('transformers')}, trl {info.get('trl', '-')}, "
            f"{info.get('threads')} threads; each (framework, task) in its own process, HF offline")


def speed_markdown_section(command: str, device_name: str, code: str, environment: str,
                           tables: list[tuple[str, list[tuple[str, str, str, str, str]]]], when: str | None = None) -> str:
    """One run as a RESULTS.md section: heading, command and environment once, then a table per model."""
    when = when or datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"## {when}, {device_name}, r1flow {code}", "", f"Command: `{command}`", "", f"Environment: {environment}"]
    for model_line, rows in tables:
        out += ["", model_line, "", "| measurement | r1flow | TRL | ratio | target |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(out) + "\n"
