"""Learning efficacy, r1flow vs TRL: how much better GRPO makes one model, at equal steps and at equal wall-clock.

    make learn                                   # SmolLM2-135M, 10 minutes a side on the CPU, 3 seeds (1 h 15 min)
    make learn ARGS="--minutes 20"               # the RESULTS run: 20 minutes a side (~2 h 25 min)
    make learn ARGS="--minutes 5 --device cuda"  # a lent GPU
    make learn ARGS="--seeds 1"                  # one seed a side (intervals over prompts only)
    make learn ARGS="--algo grpo,ppo"             # adds r1flow's PPO on the same budget (row "r1flow PPO")
    make learn ARGS="--minutes 5 --sides trl,r1flow,r1flow_async --curve-points 4"   # adds asynchronous r1flow (issue 60)
    make learn ARGS="--resume .r1flow/learning/run-20261128-062000"   # go on with a stopped run's seeds
    .venv/bin/python benchmarks/learning.py --model tiny --quick --sides r1flow   # the CI smoke run

What it does, each part in its own process under one environment (`suite.child_env`: the same threads,
allocator variables and offline flags for every child):

1. **Start model** (`prep`, cached in the work dir by its settings): SmolLM2-135M-Instruct after a short
   R1-format cold start made by r1flow's own stages: `rejection_sampling` (read leniently, rewritten into
   <think>/<answer>) and a LoRA `sft`, merged. Both sides and all seeds start from this HF directory.
2. **Task**: reasoning-gym `basic_arithmetic` (train and held-out prompts) at `--task` difficulty, and
   `chain_sum` as a transfer task nothing trains on. `--split-seed` draws the prompts, their train/held-out split
   and the cold start: 0 is the tuning split (the difficulty and 8 prompts a step were chosen on its held-out
   prompts), the default 1 a fresh one no choice saw; the report counts the held-out prompts the two share.
3. **GRPO on both sides**, `--seeds` training seeds each (default 3), with the same hyper-parameters (`Plan`:
   reward, group size, prompts per step, max tokens, temperature, learning rate, LoRA, beta, advantages divided
   by the group's sample std as TRL's GRPOTrainer does, and for seed k the same prompts in the same order) for
   `--minutes` of training each (model loading excluded on both: the clock starts when the trainer
   starts its first step; a side stops after the first step that ends past the budget). The sides take turns
   to run first (seed k: r1flow first for even k, TRL for odd k). r1flow keeps its policy after as many steps as
   TRL's run of the same seed took (equal steps; when r1flow ran first it saved every step and keeps that one)
   and runs on to the budget (equal wall-clock). Both save snapshots at fixed fractions of the budget for the
   learning curve, and time each step's generation, scoring and training.
4. **One evaluator** for every model, r1flow's `eval` stage: greedy, strict accuracy (the answer in the
   <answer> block) and format rate, on `--eval-prompts` held-out basic_arithmetic prompts and
   `--transfer-prompts` chain_sum prompts; snapshots on the first `--curve-prompts` of them.
5. **Statistics** (`stages/math/stats.py`): the mean over seeds of each kind of model, every interval from a
   bootstrap that resamples the seeds and the prompts (one prompt draw shared by every seed and both sides,
   seed k of r1flow paired with seed k of TRL). The headline is the paired difference r1flow's gain minus
   TRL's at equal wall-clock, and their ratio with its interval, reported unbounded when TRL's gain interval
   reaches 0. The equal-steps check is two-sided: a difference beyond the noise either way says "investigate".
   Time to accuracy (issue 60; the gain ratio saturates once both sides converge, this does not): from the learning
   curves (the start, every snapshot, the end, on the curve prompts), how long r1flow takes to reach TRL's final
   held-out accuracy against TRL's own time (`compare_time_to_accuracy`: seed-mean curves, the first crossing read
   linearly between two points; the interval recomputes target and times in each replicate of the same bootstrap).
   Goal 6x with the interval's low end above 4x; "undetermined" when TRL's gain on those prompts cannot be told
   from 0.
6. `--trl-set KEY=VALUE` (TRL's GRPOConfig, TRL's side only) and `--r1flow-set` (r1flow's) make the sensitivity
   rows: e.g. TRL with the whole step in one per-device batch, or bf16 on a CPU with AMX (a setting that helps one
   side is offered to both, `benchmarks/trl_settings.py --side r1flow`; on the RESULTS machine bf16 speeds TRL up
   and slows r1flow down, so that row is `--trl-set bf16=true` against r1flow in fp32); the report lists each
   side's own settings.
   `--r1flow-from RUN` (or `--trl-from RUN`) reuses an earlier run's trained and evaluated side of the same plan,
   so a sensitivity row trains only the side that changed, against the very same runs of the other.
7. `--sides ...,r1flow_async`: r1flow's grpo with `async: {max_staleness: K, rollout_workers: 1}` (`--async-staleness
   K`, default 1), the r1flow side's plan otherwise, trained after each seed's r1flow/TRL pair; its clock includes
   the worker's start, which the learner's first step waits for. `--async-placement ray` (the default; root and Ray):
   the learner a Ray task on the `learn` node, the worker an actor on the `gen` node of a 2-node loopback cluster in
   a network namespace, one core a node (async_throughput.py's `start_cluster`, started for the side and stopped
   after it; the recorded node ids are checked); `local`: the worker a process beside the learner, one thread each.
   Its rows: time to TRL's final accuracy (goal as above), time to sync r1flow's final accuracy (goal: at most 0.7x
   sync's time, the interval's low end above 1x) and its held-out accuracy minus sync's at equal wall-clock
   (two-sided: below sync beyond the noise is a miss).
8. Each side of each seed, once trained, is kept in the run directory (`seed<k>/<side>.json`, written whole):
   `--resume RUN` goes on with a run that stopped (killed, or a session that ended) on the same plan, training only
   the sides not kept, so three seeds need not fit one sitting; every model is evaluated at the end. With a larger
   `--seeds` it adds seeds to a finished run (e.g. a one-seed sensitivity row grown to three).
9. A table (stdout and `--markdown`), one row a seed, the seconds a step by phase, the raw numbers (`--json`,
   default in the work dir) and a plot of held-out accuracy and training reward against wall-clock minutes for
   both sides (`--plot`).
"""


from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import MODEL_REFS, SEED  # noqa: E402
from benchmarks.learning_async import (  # noqa: E402
    ClusterCpu,
    check_placement,
    placement_problem,
    run_in_cluster,
    side_cluster,
)
from benchmarks.learning_children import learning_child_main  # noqa: E402
from benchmarks.learning_plan import ASYNC_PLACEMENTS, SIDES, TASK, Plan, build_plan  # noqa: E402
from benchmarks.learning_report import learning_markdown_section, listed, pct, plot, with_ci  # noqa: E402
from benchmarks.learning_runs import (  # noqa: E402
    keep_side,
    kept_side,
    new_run_dir,
    resumed_run_dir,
    reused_run,
    run_order,
    settle_equal_steps,
)
from benchmarks.learning_stats import accuracy_entry, eval_name, summarize_learning  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=sorted(MODEL_REFS))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda: 5 minutes a side by default)")
    ap.add_argument("--sides", default="trl,r1flow", help="comma list of trl,r1flow,r1flow_ppo,r1flow_async "
                    "(r1flow_async: r1flow's grpo with async {max_staleness: --async-staleness, rollout_workers: 1})")
    ap.add_argument("--async-staleness", type=int, help=f"r1flow_async's K (default {Plan().async_staleness})")
    ap.add_argument("--async-placement", choices=ASYNC_PLACEMENTS,
                    help=f"r1flow_async's placement (default {Plan().async_placement}): local, the worker a process beside "
                    "the learner on the same cores; ray, the learner a Ray task on one node and the worker an actor on "
                    "the other of a 2-node loopback cluster, one core each (needs root and Ray)")
    ap.add_argument("--algo", default="grpo", help="r1flow's algorithm(s), comma list of grpo,ppo: ppo adds the side "
                    "r1flow_ppo (r1flow's ppo stage on the same budget, prompts and evaluator); ppo alone drops r1flow's "
                    "grpo side")
    ap.add_argument("--quick", action="store_true", help="a smoke run: seconds of training, a few prompts")
    ap.add_argument("--minutes", type=float, help="training budget of each side (default 10 on a CPU, 5 on CUDA)")
    ap.add_argument("--max-steps", type=int, help="cap on each side's steps (default 2000)")
    ap.add_argument("--task", help=f"{TASK}'s reasoning-gym options as JSON (default: {Plan().task})")
    ap.add_argument("--reward", help=f"RewardSpec as JSON, both sides (default: {Plan().reward})")
    for name, kind in (("seeds", int), ("split_seed", int), ("eval_prompts", int), ("transfer_prompts", int), ("curve_prompts", int), ("curve_points", int),
                       ("cold_steps", int), ("prompts_per_step", int), ("group_size", int), ("max_new_tokens", int),
                       ("temperature", float), ("learning_rate", float), ("lora_r", int), ("beta", float)):
        ap.add_argument("--" + name.replace("_", "-"), type=kind, help=f"default {getattr(Plan(), name)}")
    ap.add_argument("--trl-from", metavar="RUN",
                    help="reuse an earlier run's TRL side (its run directory or learning.json) when the plan is the "
                    "same but for --r1flow-set: one r1flow change at a time, measured against the same TRL run")
    ap.add_argument("--r1flow-from", metavar="RUN",
                    help="reuse an earlier run's r1flow side when the plan is the same but for --trl-set: TRL's "
                    "sensitivity rows, each against the same r1flow runs")
    ap.add_argument("--resume", metavar="RUN",
                    help="go on with a stopped run (its run directory): the same plan, or more --seeds; the sides of "
                    "the seeds it finished are kept, the others train, then every model is evaluated")
    ap.add_argument("--start-only", action="store_true",
                    help="make (or reuse) the start model, print its held-out accuracy and stop: to choose --task")
    ap.add_argument("--r1flow-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig field for r1flow's side only (e.g. dynamic_sampling=true), reported as such")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a field of TRL's GRPOConfig for TRL's side only (the sensitivity row, e.g. "
                    "per_device_train_batch_size=64 or bf16=true), reported as such; per_device_train_batch_size sets "
                    "gradient_accumulation_steps to the rest of the step")
    ap.add_argument("--allocator", default="tuned", help="malloc settings of every child (as suite.py)")
    ap.add_argument("--work-dir", default=str(ROOT / ".r1flow" / "learning"),
                    help="start models (cached by their settings), runs, evaluations and logs")
    ap.add_argument("--plot", help="PNG path (default: <work-dir>/<run>/learning.png)")
    ap.add_argument("--json", help="raw results (default: <work-dir>/<run>/learning.json)")
    ap.add_argument("--markdown", help="append the RESULTS.md section here")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each timed run, wait up to this many seconds for other processes to leave the CPUs")
    for hidden in ("--child", "--plan", "--work", "--result", "--prep", "--jobs"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--at-step", "--seed", "--every-step"):
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return learning_child_main(args)
    sides = [s for s in args.sides.split(",") if s]
    algos = [a for a in args.algo.split(",") if a]
    if unknown := [a for a in algos if a not in ("grpo", "ppo")]:
        ap.error(f"unknown --algo {unknown}; known: grpo, ppo")
    if "ppo" in algos:
        sides = [s for s in sides if s != "r1flow" or "grpo" in algos] + ["r1flow_ppo"] * ("r1flow_ppo" not in sides)
    if unknown := [s for s in sides if s not in SIDES]:
        ap.error(f"unknown side(s) {unknown}; known: {list(SIDES)}")
    if args.trl_from and args.r1flow_from:
        ap.error("--trl-from and --r1flow-from together would train nothing: reuse one side, train the other")
    if "trl" in sides and not args.trl_from and importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed in this interpreter; it lives only in the benchmark venv: run `make learn` "
                 "(or .bench-venv/bin/python benchmarks/learning.py), or pass --sides r1flow")
    try:
        plan = build_plan(args)
    except ValueError as e:  # pydantic's ValidationError names the field
        ap.error(f"bad settings: {e}")
    if "r1flow_async" in sides and (problem := placement_problem(plan)):
        ap.error(problem)
    run_learning(plan, sides, args)


def run_learning(plan: Plan, sides: list[str], args: argparse.Namespace) -> dict:
    """The parent: the start model and its accuracy, every seed's sides trained in turn, every model evaluated by one
    evaluator, then the summary, the plot, the raw numbers and the report."""
    from benchmarks.suite import device_info

    root = Path(args.work_dir)
    if args.resume:
        run_dir = resumed_run_dir(Path(args.resume), plan)
    else:
        run_dir = new_run_dir(root)
    plan_file = run_dir / "plan.json"
    plan_file.write_text(json.dumps(dataclasses.asdict(plan), indent=1))
    command = os.environ.get("R1FLOW_BENCH_COMMAND") or "python benchmarks/learning.py " + shlex.join(sys.argv[1:])
    info = device_info(plan.device)
    print(f"learning efficacy: {plan.model} on {info['device_name']}, {plan.minutes:g} min of RL a side and seed, "
          f"{plan.seeds} seed(s) ({', '.join(sides)}); work dir {run_dir}", flush=True)
    prep_dir = root / f"start-{plan.model}-{plan.prep_key()}"
    prep = prepare_start(plan, prep_dir, run_dir, args.allocator)
    evals = evaluate_in_child(run_dir, "-start", [{"name": "start", "dir": prep["start_dir"], "prompts": "prompts"}],
                              prep_dir / "prep.json", args.allocator)
    start_acc = report_start(plan, evals)
    if args.start_only:
        return {"prep": prep, "start": start_acc}
    runs: dict = {side: [] for side in SIDES if side in sides}
    reused = reuse_earlier_sides(plan, args, runs, evals)
    for k in range(plan.seeds):
        train_seed(plan, args, run_dir, prep_dir / "prep.json", runs, reused, k)
    jobs = evaluation_jobs(runs, reused)
    print(f"[4/4] evaluating {len(jobs)} models", flush=True)
    evals.update(evaluate_in_child(run_dir, "", jobs, prep_dir / "prep.json", args.allocator))
    return write_learning_results(plan, args, run_dir, command, info, prep, evals, runs)


def prepare_start(plan: Plan, prep_dir: Path, run_dir: Path, allocator: str) -> dict:
    """1. The start model and the prompts, cached in `prep_dir` by their settings (made under a temporary name,
    renamed when whole)."""
    prep_file = prep_dir / "prep.json"
    if not prep_file.exists():
        print(f"[1/4] start model: cold start by r1flow's stages ({plan.cold_steps} SFT steps) into {prep_dir}",
              flush=True)
        tmp = prep_dir.with_name(prep_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        result = run_learning_child("prep", run_dir / "plan.json", tmp, run_dir / "prep.log", allocator)
        if tmp.exists():
            shutil.rmtree(prep_dir, ignore_errors=True)
            tmp.rename(prep_dir)
        prep = json.loads(json.dumps(result).replace(str(tmp), str(prep_dir)))
        prep_file.write_text(json.dumps(prep))
    else:
        print(f"[1/4] start model: cached, {prep_dir}", flush=True)
        prep = json.loads(prep_file.read_text())
    return prep


def evaluate_in_child(run_dir: Path, tag: str, jobs: list[dict], prep_file: Path, allocator: str) -> dict:
    """The evaluations of `jobs` by the eval child (its jobs in `jobs<tag>.json`, its log `eval<tag>.log`)."""
    (run_dir / f"jobs{tag}.json").write_text(json.dumps(jobs))
    result = run_learning_child("eval", run_dir / "plan.json", run_dir / "eval", run_dir / f"eval{tag}.log", allocator,
                                prep=prep_file, jobs=run_dir / f"jobs{tag}.json")
    return {k: v for k, v in result.items() if isinstance(v, dict) and "rows" in v}


def report_start(plan: Plan, evals: dict) -> dict:
    """2. The start model's accuracy, first: it says at once whether the task's difficulty suits this model."""
    start_acc = accuracy_entry(evals["start"]["rows"], TASK)
    print(f"[2/4] start model: {TASK} {with_ci(start_acc['accuracy'], start_acc['ci'])} on {start_acc['n']} held-out "
          f"prompts, format rate {pct(start_acc['format_rate'])}", flush=True)
    if not plan.model == "tiny" and not 0.2 <= start_acc["accuracy"] <= 0.6:
        print(f"  note: outside 20-60%; set --task (now {json.dumps(plan.task)}) so RL has room and a signal",
              flush=True)
    return start_acc


def reuse_earlier_sides(plan: Plan, args: argparse.Namespace, runs: dict, evals: dict) -> set[str]:
    """3, for `--trl-from` / `--r1flow-from`: an earlier run's side, trained and evaluated on this very plan, seed by
    seed, into `runs` and `evals`; the sides reused."""
    reused = set()
    for side, source in (("trl", args.trl_from), ("r1flow", args.r1flow_from)):
        if not source or side not in runs:
            continue
        earlier = reused_run(Path(source), plan, side)
        runs[side] = earlier["runs"][side][: plan.seeds]
        names = {eval_name(side, snap["name"], k) for k, r in enumerate(runs[side]) for snap in r["snapshots"]}
        names |= {eval_name(side, "end", k) for k in range(plan.seeds)}
        evals.update({k: v for k, v in earlier["evals"].items() if k in names})
        reused.add(side)
        print(f"[3/4] {side}: reused from {source} ({listed([r['steps'] for r in runs[side]])} steps)", flush=True)
    return reused


def train_seed(plan: Plan, args: argparse.Namespace, run_dir: Path, prep_file: Path, runs: dict, reused: set[str],
               k: int) -> None:
    """3. Seed k's sides, in their turn (`run_order`), each after a quiet moment, each kept once trained; a side kept
    by a stopped run is not trained again."""
    order = run_order([s for s in runs if s not in reused], k)
    for side in order:
        if (kept := kept_side(run_dir, k, side)) is not None:
            runs[side].append(kept)
            print(f"[3/4] seed {SEED + k}, {side}: kept from the stopped run ({kept['steps']} steps)", flush=True)
            continue
        shutil.rmtree(run_dir / f"seed{k}" / side, ignore_errors=True)  # a side stopped part-way starts over
        print(f"[3/4] seed {SEED + k}, {side}: {algorithm_label(plan, side)} for {plan.minutes:g} min", flush=True)
        trl_steps = runs["trl"][k]["steps"] if len(runs.get("trl", [])) > k else None
        work, log = run_dir / f"seed{k}" / side, run_dir / f"seed{k}-{side}.log"
        with side_cluster(plan, side, work) as cluster:
            r = run_learning_child(side, run_dir / "plan.json", work, log, args.allocator, quiet_wait=args.quiet_wait,
                                   cluster=cluster, prep=prep_file, seed=SEED + k,
                                   at_step=trl_steps if side == "r1flow" else None,
                                   every_step=1 if side == "r1flow" and trl_steps is None and "trl" in runs else None)
            check_placement(r, cluster, log)
        pair = [s for s in order if s in ("r1flow", "trl")]
        r["seed"], r["first"] = SEED + k, (pair[0] == side if len(pair) == 2 and side in pair else None)
        runs[side].append(r)
        keep_side(run_dir, k, side, r)
        print(f"  {side}: {r['steps']} steps in {r['train_s'] / 60:.1f} min ({r['train_s'] / max(1, r['steps']):.1f} "
              f"s a step), other processes used {100 * (r['foreign_cpu'] or 0):.0f}% of the CPUs", flush=True)
    if "r1flow" not in reused and len(runs.get("r1flow", [])) > k and len(runs.get("trl", [])) > k:
        settle_equal_steps(runs["r1flow"][k], runs["trl"][k]["steps"])
        keep_side(run_dir, k, "r1flow", runs["r1flow"][k])  # with its equal-steps point settled


def algorithm_label(plan: Plan, side: str) -> str:
    if side == "r1flow_async":
        return f"asynchronous GRPO (K={plan.async_staleness}, {plan.async_placement})"
    return "PPO" if side == "r1flow_ppo" else "GRPO"


def evaluation_jobs(runs: dict, reused: set[str]) -> list[dict]:
    """4. Every end model and snapshot of the sides trained here, for the one evaluator."""
    jobs = []
    for side, side_runs in runs.items():
        if side in reused:
            continue
        for k, r in enumerate(side_runs):
            end = {"adapter": r["final"]} if r["final_kind"] == "adapter" else {"dir": r["final"]}
            jobs.append({"name": eval_name(side, "end", k), **end, "prompts": "prompts"})
            for snap in r["snapshots"]:
                jobs.append({"name": eval_name(side, snap["name"], k), "adapter": snap["adapter"],
                             "prompts": "prompts" if snap["name"] == "equal_steps" else "curve_prompts"})
    return jobs


def write_learning_results(plan: Plan, args: argparse.Namespace, run_dir: Path, command: str, info: dict, prep: dict,
                           evals: dict, runs: dict) -> dict:
    """The summary, the plot, the raw numbers (learning.json) and the RESULTS section (printed, and appended to
    `--markdown`); the raw numbers returned."""
    from benchmarks.suite import code_version

    summary = summarize_learning(plan, evals, runs)
    plot_path = Path(args.plot or run_dir / "learning.png")
    plot(plot_path, plan, prep, evals, runs)
    raw = {"plan": dataclasses.asdict(plan), "summary": summary, "runs": runs, "prep": prep, "device": info,
           "evals": {k: {"seconds": v["seconds"], "rows": v["rows"]} for k, v in evals.items()}}
    Path(args.json or run_dir / "learning.json").write_text(json.dumps(raw, indent=1))
    section = learning_markdown_section(plan, command, info, code_version(), summary, runs, prep, plot_path)
    if args.markdown:
        with open(args.markdown, "a") as fh:
            fh.write(section)
    print("\n" + section, flush=True)
    return raw


def run_learning_child(what: str, plan_file: Path, work: Path, log: Path, allocator: str, quiet_wait: float = 0.0,
                       cluster=None, **extra) -> dict:
    """One child process (`--child WHAT`), inside `cluster`'s namespace as its driver when one is given; its result
    with the wall-clock and the share of the CPUs other processes used meanwhile (neither this parent's children nor
    the cluster's processes)."""
    from benchmarks.suite import _children_cpu, child_env, cpu_busy_seconds, wait_until_quiet

    result_file = work / f"{what}-result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what, "--plan", str(plan_file), "--work", str(work),
           "--result", str(result_file)]
    for key, value in extra.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if quiet_wait > 0:
        wait_until_quiet(quiet_wait)
    busy0, own0 = cpu_busy_seconds(), _children_cpu()
    t0 = time.perf_counter()
    with log.open("w") as fh, ClusterCpu(cluster) as ray_cpu:
        rc = (subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(allocator)).returncode
              if cluster is None else run_in_cluster(cluster, cmd, log, child_env(allocator)))
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_busy_seconds(), _children_cpu()
    if rc or not result_file.exists():
        raise SystemExit(f"learning.py: the {what} process failed (exit {rc}); its log, {log}:\n"
                         + log.read_text()[-3000:])
    result = json.loads(result_file.read_text())
    result["wall_s"] = wall
    result["foreign_cpu"] = None if busy0 is None or busy1 is None else max(
        0.0, (busy1 - busy0) - (own1 - own0) - ray_cpu.seconds()) / (wall * (os.cpu_count() or 1))
    return result


if __name__ == "__main__":
    main()
