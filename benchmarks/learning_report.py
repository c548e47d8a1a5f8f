"""`learning.py`'s report: the tables, the verdicts in words, the plot and the RESULTS section."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import SEED
from benchmarks.learning_plan import GAIN_TARGET, TASK, TRANSFER, Plan
from benchmarks.learning_stats import correct_vector, eval_name


def pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


def with_ci(value: float, ci: list[float], signed: bool = False) -> str:
    head = f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}%"
    return f"{head} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if signed else f"{head} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def listed(values: list, fmt: str = "{}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def table(summary: dict) -> list[str]:
    lines = ["| model | RL steps (each seed) | training min (each seed) | basic_arithmetic (held out) | gain over start "
             "| format rate | chain_sum (transfer) | transfer gain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        gain = with_ci(r["gain"]["gain"], r["gain"]["ci"], signed=True) if r["gain"] else "-"
        tgain = with_ci(r["transfer_gain"]["gain"], r["transfer_gain"]["ci"], signed=True) if r["transfer_gain"] else "-"
        lines.append(f"| {r['label']} | {listed(r['steps'])} | {listed(r['minutes'], '{:.1f}')} | "
                     f"{with_ci(r['task']['accuracy'], r['task']['ci'])} | {gain} | {pct(r['task']['format_rate'])} | "
                     f"{with_ci(r['transfer']['accuracy'], r['transfer']['ci'])} | {tgain} |")
    return lines


def seed_table(summary: dict) -> list[str]:
    """Each seed's models: its run order, steps, accuracy and gain (intervals over prompts only)."""
    lines = ["| model | seed | ran first | RL steps | training min | basic_arithmetic (held out) | gain over start |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        for e in r["per_seed"]:
            first = {True: "yes", False: "no", None: "-"}[e["first"]]
            lines.append(f"| {r['label']} | {e['seed']} | {first} | {e['steps']} | {e['minutes']:.1f} | "
                         f"{with_ci(e['task']['accuracy'], e['task']['ci'])} | "
                         f"{with_ci(e['gain']['gain'], e['gain']['ci'], signed=True)} |")
    return lines


def phase_lines(summary: dict) -> list[str]:
    lines = ["| side | steps | generation s | scoring s | training s | step s |", "|---|---|---|---|---|---|"]
    for side, p in summary.get("phases", {}).items():
        if p:
            lines.append(f"| {side} | {p['steps']} | {p['generation']:.1f} | {p['scoring']:.2f} | {p['training']:.1f} | "
                         f"{p['total']:.1f} |")
    return lines if len(lines) > 2 else []


def points(d: dict) -> str:
    return f"{100 * d['diff']:+.1f} points [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]"


def verdict_lines(summary: dict) -> list[str]:
    out = []
    et = summary.get("equal_time")
    if et:
        out.append(f"- equal wall-clock, {et['seeds']} seed(s) a side: r1flow's gain minus TRL's "
                   f"{points({'diff': et['diff'], 'ci': et['diff_ci']})} (paired; interval over seeds and prompts); "
                   f"gains: r1flow {with_ci(et['gain_b'], et['gain_b_ci'], signed=True)}, TRL "
                   f"{with_ci(et['gain_a'], et['gain_a_ci'], signed=True)}")
        if et["ratio"] is None:
            ratio = "no ratio: TRL's gain is not above 0"
        elif et["ratio_ci"] is None:
            ratio = (f"{et['ratio']:.2f}x TRL's gain, its interval unbounded: TRL's gain interval reaches 0, so the "
                     "ratio could be anything above the point; read the difference")
        else:
            lo, hi = et["ratio_ci"]
            ratio = (f"{et['ratio']:.2f}x TRL's gain [{lo:.2f}, {hi:.2f}]"
                     + (f", at least {GAIN_TARGET:g}x beyond the noise" if lo >= GAIN_TARGET else ""))
        out.append(f"- equal wall-clock: {ratio}. Target (>= {GAIN_TARGET:g}x, difference's interval above 0): "
                   + {"met": "met", "MISSED": "MISSED",
                      "undetermined": "undetermined (the difference is above 0, the ratio unbounded)"}[et["verdict"]])
    eq = summary.get("equal_steps")
    if eq:
        verdict = {"same": "the same beyond the noise: pass",
                   "higher": "r1flow HIGHER beyond the noise: INVESTIGATE (the same algorithm for the same steps "
                             "should learn the same; a difference either way is a discrepancy, not a win)",
                   "lower": "r1flow LOWER beyond the noise: INVESTIGATE (the same algorithm for the same steps "
                            "should learn the same)"}[eq["verdict"]]
        out.append(f"- equal steps, {eq['seeds']} seed(s): r1flow minus TRL {points(eq)} (two-sided): {verdict}")
        if summary.get("r1flow_only"):
            out.append(f"  (r1flow ran with {json.dumps(summary['r1flow_only'])} and TRL without: equal steps are not "
                       "equal work here, so this is not the correctness check; a run without --r1flow-set is)")
    if unmatched := summary.get("equal_steps_unmatched"):
        out.append("- equal steps: not checked for seed(s) " + listed([u["seed"] for u in unmatched]) + ": r1flow's "
                   "equal-steps point (step " + listed([u["r1flow_step"] for u in unmatched]) + ") is from another TRL "
                   "run than this one (" + listed([u["trl_steps"] for u in unmatched]) + " steps): r1flow reused with "
                   "--r1flow-from; the run it came from has the check")
    pg = summary.get("ppo_minus_grpo")
    if pg:
        out.append(f"- equal wall-clock, r1flow: PPO minus GRPO {points(pg)} (paired, {pg['seeds']} seed(s))")
    return out + time_to_accuracy_lines(summary)


def side_words(summary: dict, side: str) -> str:
    a = summary.get("async_side") or {}
    return {"trl": "TRL", "r1flow": "r1flow (sync)", "r1flow_ppo": "r1flow PPO",
            "r1flow_async": f"r1flow async (K={a.get('max_staleness')}, {a.get('placement')})"}[side]


def speedup_text(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2f}"


def time_to_accuracy_lines(summary: dict) -> list[str]:
    """The time-to-accuracy verdicts (issue 60) and asynchronous r1flow's held-out accuracy at equal wall-clock."""
    out = []
    for r in summary.get("time_to_accuracy", []):
        ref, side = side_words(summary, r["reference"]), side_words(summary, r["side"])
        reached = "never reached it" if r["t_b"] is None else f"{r['t_b'] / 60:.1f} min"
        goal = (f">= {r['goal']:g}x, the interval's low end above {r['floor']:g}x" if r["reference"] == "trl" else
                f">= {r['goal']:.2f}x, i.e. at most {1 / r['goal']:.2g}x sync's time, the interval's low end above "
                f"{r['floor']:g}x")
        g = r["reference_gain"]
        verdict = {"met": "met", "MISSED": "MISSED",
                   "undetermined": f"undetermined ({ref}'s gain on these prompts, "
                                   f"{with_ci(g['gain'], g['ci'], signed=True)} points, cannot be told from 0)"}
        out.append(f"- time to accuracy, {side} against {ref}: wall-clock to reach {ref}'s final held-out accuracy "
                   f"({pct(r['target'])} on the {r['prompts']} curve prompts), {r['seeds']} seed(s): {ref} "
                   f"{r['t_a'] / 60:.1f} min, {side} {reached}: {speedup_text(r['speedup'])}x "
                   f"[{speedup_text(r['ci'][0])}, {speedup_text(r['ci'][1])}] (the noise: 95% interval resampling "
                   f"seeds and prompts; {side} never reached it in {pct(r['never_reached_share'])} of the replicates)."
                   f" Goal ({goal}): {verdict[r['verdict']]}")
    if a := summary.get("async_equal_time"):
        verdict = {"same": "not below sync beyond the noise: pass", "higher": "higher beyond the noise: pass",
                   "lower": "LOWER beyond the noise: MISSED (async must not end below sync)"}[a["verdict"]]
        out.append(f"- equal wall-clock, {side_words(summary, 'r1flow_async')} minus r1flow (sync): {points(a)} "
                   f"(paired, two-sided; {a['seeds']} seed(s), {a['prompts']} held-out prompts): {verdict}")
    return out


# ---------------------------------------------------------------------------- the plot


def curve_ids(prep: dict) -> set[str]:
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE

    return set(pq.read_table(Path(prep["curve_prompts"]["path"]) / DATA_FILE, columns=["id"]).column("id").to_pylist())


def plot(path: Path, plan: Plan, prep: dict, evals: dict, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stages.math.stats import bootstrap_ci

    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"r1flow": "tab:blue", "trl": "tab:orange", "r1flow_ppo": "tab:green", "r1flow_async": "tab:purple"}
    ids = curve_ids(prep)  # the start and end models' full evaluations include these prompts: read them there
    start = [r for r in evals["start"]["rows"] if r["prompt_id"] in ids]
    for side, side_runs in runs.items():
        for k, run in enumerate(side_runs):
            label = side if k == 0 else None  # one legend entry a side; its seeds share its colour
            curve_points = [(0.0, correct_vector(start, TASK))]
            for snap in run["snapshots"]:
                if snap["name"].startswith("t"):
                    rows = evals[eval_name(side, snap["name"], k)]["rows"]
                    curve_points.append((snap["elapsed_s"] / 60, correct_vector(rows, TASK)))
            end = [r for r in evals[eval_name(side, "end", k)]["rows"] if r["prompt_id"] in ids]
            curve_points.append((run["train_s"] / 60, correct_vector(end, TASK)))
            xs = [x for x, _ in curve_points]
            ys = [100 * sum(v) / len(v) for _, v in curve_points]
            cis = [bootstrap_ci(v) for _, v in curve_points]
            err = [[y - 100 * lo for y, (lo, _) in zip(ys, cis, strict=True)],
                   [100 * hi - y for y, (_, hi) in zip(ys, cis, strict=True)]]
            ax_acc.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[side], alpha=0.8, label=label)
            ts = [c["elapsed_s"] / 60 for c in run["curve"]]
            rs = [c["reward"] for c in run["curve"]]
            w = max(1, len(rs) // 15)  # a running mean over ~1/15 of the run
            smooth = [sum(rs[max(0, i - w + 1): i + 1]) / len(rs[max(0, i - w + 1): i + 1]) for i in range(len(rs))]
            ax_rew.plot(ts, rs, ".", alpha=0.2, color=colors[side])
            ax_rew.plot(ts, smooth, "-", color=colors[side],
                        label=f"{side} ({', '.join(str(len(r['curve'])) for r in side_runs)} steps)" if label else None)
    ax_acc.set(xlabel="training wall-clock (min)", ylabel=f"held-out {TASK} accuracy (%)",
               title=f"greedy, first {plan.curve_prompts} held-out prompts, 95% CI")
    ax_rew.set(xlabel="training wall-clock (min)", ylabel="mean training reward",
               title=f"training reward, {plan.prompts_per_step} prompts x {plan.group_size} completions a step")
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def async_text(plan: Plan, runs: dict) -> str:
    """What the r1flow_async side ran, for the report."""
    if "r1flow_async" not in runs:
        return ""
    where = ("the learner a Ray task on the `learn` node and its rollout worker an actor on the `gen` node of a "
             "2-node loopback Ray cluster, one core a node (benchmarks/loopback_cluster.py)"
             if plan.async_placement == "ray" else
             "the rollout worker a process beside the learner on the same cores, one thread each")
    return (f"r1flow async (`--sides ...,r1flow_async`): r1flow's grpo with async {{max_staleness: "
            f"{plan.async_staleness}, rollout_workers: 1}}, placement {plan.async_placement}: {where}; otherwise the "
            f"r1flow side's plan, prompts and snapshots; its clock includes the worker's start, which the learner's "
            f"first step waits for. ")


def split_text(plan: Plan, prep: dict) -> str:
    """Which held-out split the numbers are on, for the report."""
    if plan.split_seed == 0:
        return ("Split seed 0: the tuning split, on whose held-out prompts the task's difficulty and the prompts a "
                "step were chosen.")
    overlap = prep.get("tuning_overlap") or {}
    shared = (f"; {overlap['also_in_tuning_split']} of its {overlap['held_out']} scored held-out prompts were held out "
              f"in the tuning split too (chance, on a task of ~1,060 distinct prompts)" if overlap else "")
    return (f"Split seed {plan.split_seed}: a fresh draw of the prompts, the held-out split and the cold start, "
            f"never used for a choice (the tuning split is seed 0{shared}).")


def learning_markdown_section(plan: Plan, command: str, info: dict, code: str, summary: dict, runs: dict, prep: dict,
                              plot_path: Path) -> str:
    threads = {side: sorted({r.get("threads") for r in rs}, key=str) for side, rs in runs.items()}
    extra = f"; r1flow only: {json.dumps(plan.r1flow_extra)}" if plan.r1flow_extra else ""
    extra += f"; TRL only: {json.dumps(plan.trl_extra)}" if plan.trl_extra else ""
    seeds = listed(range(SEED, SEED + plan.seeds))
    lines = [f"### Learning efficacy, {plan.model}, {plan.minutes:g} min a side, {plan.seeds} seed(s) "
             f"({info['device_name']}, code {code})",
             "",
             f"`{command}`",
             "",
             f"Task: {TASK} {json.dumps(plan.task)}, {plan.train_prompts} train prompts, {plan.eval_prompts} held out; "
             f"transfer: {TRANSFER} {json.dumps(plan.transfer)}, {plan.transfer_prompts} prompts. {split_text(plan, prep)} "
             f"Start model: "
             f"{plan.model} after a cold start of {plan.cold_steps} LoRA SFT steps on {prep.get('cold_examples', 0)} "
             f"R1-format examples from r1flow's rejection sampling. GRPO, both sides: {plan.prompts_per_step} prompts x "
             f"{plan.group_size} completions a step, {plan.max_new_tokens} new tokens, temperature {plan.temperature:g}, "
             f"LoRA r={plan.lora_r}, lr {plan.learning_rate:g}, beta {plan.beta:g}, reward {json.dumps(plan.reward)}, "
             f"advantages divided by the group's {summary['std']} std (TRL: torch.std, the sample std), "
             f"the same prompts in the same order for a seed{extra}. "
             + ("r1flow PPO (`--algo ppo`): the same prompts, reward, LoRA, lr and completions a step "
                f"({plan.prompts_per_step} prompts x {plan.group_size} samples), one epoch in the same mini-batches, "
                f"beta as the KL penalty in the per-token rewards, the critic a LoRA copy of the policy. "
                if "r1flow_ppo" in runs else "")
             + async_text(plan, runs)
             + f"Training seeds {seeds} on each side (prompt order, sampling, LoRA initialisation; seed k of one side "
             f"has seed k's prompt order on the other)"
             + ("; r1flow trains first for even k, TRL for odd k. " if {"r1flow", "trl"} <= set(runs) else ". ")
             + f"One environment for every side (threads {threads}). "
             f"Evaluation: r1flow's eval stage, greedy, strict accuracy. Pooled rows: the mean over seeds, 95% "
             f"intervals from a bootstrap that resamples the seeds and the prompts (one prompt draw shared by every "
             f"seed and side: stages/math/stats.py, seed_prompt_means); gains and differences paired (seed k with "
             f"seed k, each prompt with itself). Time to accuracy: each side's curve is its held-out accuracy on the "
             f"first {plan.curve_prompts} held-out prompts at the start (0 min), at each snapshot and at the end, "
             f"averaged over seeds at the seeds' mean minutes; the time a curve first reaches the reference's final "
             f"accuracy is read between the two points around the crossing (linear); the interval recomputes the "
             f"target and both times in every replicate of the same bootstrap (stages/math/stats.py, "
             f"compare_time_to_accuracy).",
             "", *table(summary), "", "Each seed (intervals over prompts only):", "", *seed_table(summary), "",
             *verdict_lines(summary), ""]
    if phase := phase_lines(summary):
        lines += ["Seconds a step by phase (mean over every seed's steps after the first; training: what generation "
                  "and scoring leave of the step):", "", *phase, ""]
    lines += [f"Plot: `{plot_path}`", ""]
    return "\n".join(lines) + "\n"
