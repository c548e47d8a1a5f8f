"""TRL's GRPO at the settings a TRL user on this machine would try: seconds a step, by phase, for each.

    .bench-venv/bin/python benchmarks/trl_settings.py                 # the default candidates, 3 min each
    .bench-venv/bin/python benchmarks/trl_settings.py --minutes 2 --set "per_device_train_batch_size=64"
    .bench-venv/bin/python benchmarks/trl_settings.py --side r1flow   # r1flow's side: fp32 against bf16 autocast

Picks the setting for `learning.py`'s TRL sensitivity row (`--trl-set ... --r1flow-from RUN`) by speed alone: each
candidate trains TRL's side of `learning.py`'s default plan (the same start model, prompts of training seed 0,
LoRA, group, tokens) for `--minutes`, in its own process under `suite.child_env`, after a quiet moment, and the
report is its steps and mean seconds a step by phase (steps after the first). No held-out prompt is scored: the
choice sees no evaluation, so the held-out split stays unused by it. Candidates that change only how the step is
computed (per-device batch, generation engine) do the same update; one that changes the numbers (bf16) is
reported as such and offered to both sides: `--side r1flow` below tells whether it helps r1flow too.

`--side r1flow` screens r1flow's side the same way (r1flow GRPOConfig fields, `learning.py`'s `--r1flow-set`):
whether a setting that helps TRL (bf16) helps r1flow too, so that a sensitivity row gives each side its faster
setting.

A candidate whose child fails (e.g. a setting TRL does not support on a CPU) is reported with its error's last
line, and the others go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import learning  # noqa: E402
from benchmarks.common import SEED  # noqa: E402
from benchmarks.learning_plan import Plan, check_trl_extra, grpo_config, parse_set  # noqa: E402
from benchmarks.learning_runs import new_run_dir  # noqa: E402
from benchmarks.learning_stats import phase_means  # noqa: E402

# what a TRL user on a CPU would try first: the whole step (8 prompts x 8) in one per-device batch instead of 4
# accumulated micro-batches of 16, transformers' continuous batching for generation, and both
CANDIDATES = {"trl": ("", "per_device_train_batch_size=64", "use_transformers_continuous_batching=true",
                       "per_device_train_batch_size=64;use_transformers_continuous_batching=true"),
              # r1flow: its default fp32 against bf16 autocast (rollouts and training), TRL's one faster setting here
              "r1flow": ("", "precision=bf16")}


def parse_candidate(text: str) -> dict:
    return parse_set([t for t in text.split(";") if t], "--set")


def check_candidate(side: str, extra: dict, base: Plan) -> None:
    """Before any compute: every key is a field of that side's GRPOConfig (r1flow's also validates its values)."""
    if side == "trl":
        check_trl_extra(extra)
    else:
        grpo_config(dataclasses.replace(base, r1flow_extra=extra), 1, 1.0)


def step_timing(run: dict) -> dict:
    """Steps and mean seconds a step by phase over the steps after the first (the warm-up)."""
    phases = phase_means([run]) or {}
    phases["timed_steps"] = phases.pop("steps", 0)
    first = run["curve"][0]["step_s"] if run.get("curve") else float("nan")
    return {"steps": run["steps"], "train_s": run["train_s"], "first_step_s": first, **phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("trl", "r1flow"), default="trl", help="whose settings to screen")
    ap.add_argument("--minutes", type=float, default=3.0, help="each candidate's training budget")
    ap.add_argument("--set", action="append", dest="candidates", metavar="K=V[;K=V]",
                    help="a candidate (that side's GRPOConfig fields, ';' between them; '' for the defaults); "
                    "repeatable")
    ap.add_argument("--split-seed", type=int, default=Plan().split_seed)
    ap.add_argument("--work-dir", default=str(ROOT / ".r1flow" / "learning"))
    ap.add_argument("--allocator", default="tuned")
    ap.add_argument("--quiet-wait", type=float, default=120.0)
    args = ap.parse_args()
    candidates = args.candidates if args.candidates is not None else list(CANDIDATES[args.side])
    base = Plan(split_seed=args.split_seed, minutes=args.minutes, seeds=1, curve_points=0)
    extras = [parse_candidate(c) for c in candidates]  # bad syntax or fields fail here, before any compute
    for extra in extras:
        try:
            check_candidate(args.side, extra, base)
        except ValueError as e:  # pydantic's ValidationError names the field
            ap.error(f"bad --set {json.dumps(extra)}: {e}")
    root = Path(args.work_dir)
    prep_file = root / f"start-{base.model}-{base.prep_key()}" / "prep.json"
    if not prep_file.is_file():
        sys.exit(f"no start model for this plan at {prep_file.parent}: run `make learn ARGS=\"--start-only\"` first")
    work = new_run_dir(root / f"{args.side}-settings")
    label = {"trl": "TRL", "r1flow": "r1flow"}[args.side]
    print(f"{label} settings, {args.minutes:g} min each, training seed {SEED}, one process each; work dir {work}",
          flush=True)
    results = []
    for i, extra in enumerate(extras):
        plan = dataclasses.replace(base, **{f"{args.side}_extra": extra})
        plan_file = work / f"plan{i}.json"
        plan_file.write_text(json.dumps(dataclasses.asdict(plan), indent=1))
        t0 = time.perf_counter()
        try:
            run = learning.run_learning_child(args.side, plan_file, work / f"c{i}", work / f"c{i}.log", args.allocator,
                                              quiet_wait=args.quiet_wait, prep=prep_file, seed=SEED)
            row = {"settings": extra, **step_timing(run), "foreign_cpu": run.get("foreign_cpu")}
        except SystemExit as e:
            # the first line says how it ended ("the trl process failed (exit -9)": killed, on Linux most often for
            # memory); the log's tail follows it
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            row = {"settings": extra, "error": lines[0] if lines else str(e)}
        row["wall_s"] = time.perf_counter() - t0
        results.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| {label} settings | steps | first step s | generation s | training s | step s | other processes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        defaults = {"trl": "micro-batch 16, 4 accumulated", "r1flow": "fp32"}[args.side]
        name = json.dumps(r["settings"]) if r["settings"] else f"defaults of learning.py ({defaults})"
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:160]} | | | | | |")
        else:
            print(f"| {name} | {r['steps']} | {r['first_step_s']:.1f} | {r.get('generation', float('nan')):.1f} | "
                  f"{r.get('training', float('nan')):.1f} | {r.get('total', float('nan')):.1f} | "
                  f"{100 * (r['foreign_cpu'] or 0):.0f}% |")
    (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
