"""Does the distilled student keep its teacher's transfer? Distillation variants on a finished run's teacher (issue 63).

    .venv/bin/python benchmarks/distill_transfer.py --home /path/to/a/make-run/home        # 4 variants x 3 seeds
    .venv/bin/python benchmarks/distill_transfer.py --home H --variants traces,on_policy --seeds 2
    .venv/bin/python benchmarks/distill_transfer.py --home H --profile tiny --seeds 1       # smoke, on a tiny run

It reuses a finished `r1` run (`make run`, or `r1flow run --recipe r1` with `--profile`) in its r1flow home: the
teacher (`grpo_final`), its traces and the held-out prompts come from the cache, and each variant re-runs only
`distill` (and `traces` where the variant changes them) and the student's eval, `--set distill.seed=k` for
training seed k, through the CLI (`r1flow run --only ...`). The teacher's eval (`eval_grpo_final`) is the run's own.

Variants (`--variants`, comma list):
- `traces`: the run's own distillation (SFT on the teacher's verified traces).
- `diverse`: more and more varied traces (8 samples a prompt at temperature 1.0, against the profile's 4 at the
  stage's default), then the same SFT.
- `logits`: token-level KD to the teacher's distributions on its traces.
- `on_policy`: the student samples and the teacher's distributions supervise every sampled token (GKD).

For each variant and each held-out slice (`trained`, `transfer`: the eval's `<task>/transfer` metric): the student's
accuracy minus the teacher's, the mean over seeds, with a 95% interval that resamples seeds and prompts
(`stages/math/stats.py`, `seed_prompt_means`: the teacher is one model, repeated for every seed). The issue's
target: the transfer slice's interval includes 0 or lies above it. `distill s`: the distill stage's seconds in each
seed's run (0 where the cache had it: `traces` seed 0 is the run's own distillation). Where `traces` ran too, a
second table gives each other variant minus `traces` (seed k against seed k, same intervals): which keeps more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # name -> (extra nodes to re-run, --set pairs)
    "traces": ((), ()),
    "diverse": (("traces",), ("traces.num_samples=8", "traces.generation.temperature=1.0")),
    "logits": ((), ("distill.mode=logits",)),
    "on_policy": ((), ("distill.mode=on_policy",)),
}
TEACHER_EVAL, STUDENT_EVAL = "eval_grpo_final", "eval_student"


def variant_command(r1flow: str, profile: str, variant: str, seed: int, summary: Path) -> list[str]:
    """(pure) The `r1flow run` of one variant and training seed on the run's cached upstream."""
    nodes, sets = VARIANTS[variant]
    cmd = [r1flow, "run", "--recipe", "r1", "--profile", profile, "--json", str(summary)]
    for node in (*nodes, "distill", STUDENT_EVAL, TEACHER_EVAL):
        cmd += ["--only", node]
    for s in (*sets, f"distill.seed={seed}"):
        cmd += ["--set", s]
    return cmd


def students_minus(baseline: list[dict[str, float]], students: list[dict[str, float]], ids: list[str],
                   resamples: int = 10_000) -> tuple[float, float, float]:
    """(pure) mean over seeds and prompts `ids` of student k - baseline k (1.0/0.0 scores by prompt id, one dict per
    training seed), and its 95% interval over seeds and prompts (`seed_prompt_means`: seed k of both drawn together)."""
    import numpy as np

    from stages.math.stats import percentile_interval, seed_prompt_means

    if len(baseline) != len(students):
        raise ValueError(f"students_minus: {len(students)} students against {len(baseline)} baselines")
    d = np.array([[s[i] - b[i] for i in ids] for s, b in zip(students, baseline, strict=True)])
    low, high = percentile_interval(seed_prompt_means(d[None], resamples)[:, 0])
    return float(d.mean()), low, high


def student_minus_teacher(teacher: dict[str, float], students: list[dict[str, float]], ids: list[str],
                          resamples: int = 10_000) -> tuple[float, float, float]:
    """(pure) `students_minus` against one teacher, the same model for every seed."""
    return students_minus([teacher] * len(students), students, ids, resamples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True, help="the r1flow home of a finished r1 run")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / ".r1flow" / "distill-transfer"))
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    out = Path(args.out) / time.strftime("run-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "R1FLOW_", "RAY_"))}
    env.update(R1FLOW_HOME=args.home, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    r1flow = str(Path(sys.executable).parent / "r1flow")
    runs: dict[tuple[str, int], dict] = {}
    for seed in range(args.seeds):
        for variant in variants:
            summary, log = out / f"{variant}-seed{seed}.json", out / f"{variant}-seed{seed}.log"
            t0 = time.monotonic()
            with log.open("w") as fh:
                rc = subprocess.run(variant_command(r1flow, args.profile, variant, seed, summary), env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
            if rc != 0:
                raise SystemExit(f"{variant} seed {seed}: r1flow run exited {rc}; its output: {log}")
            runs[variant, seed] = json.loads(summary.read_text())
            print(f"  {variant} seed {seed}: {time.monotonic() - t0:.0f} s", flush=True)
    results = summarise(args.home, runs, variants, args.seeds)
    (out / "distill_transfer.json").write_text(json.dumps(results, indent=2))
    print("\n".join(transfer_markdown(results)))
    if "traces" in variants and len(variants) > 1:
        print("\n" + "\n".join(against_traces_markdown(results)))


def summarise(home: str, runs: dict, variants: list[str], seeds: int) -> dict:
    """Each variant's student - teacher per slice, from the runs' eval outputs in the home's store."""
    os.environ["R1FLOW_HOME"] = home
    from flows.report.gains import greedy_scores, prompt_slices
    from flows.run.pipeline import resolve_input
    from flows.servers.settings import Settings
    from flows.store.artifacts import ArtifactStore

    s = Settings.from_env()
    store = ArtifactStore(s.store, home=s.home)

    def stage(result: dict, node: str) -> dict:
        return next(r for r in result["stages"] if r["node"] == node)

    def rows(result: dict, node: str) -> list[dict]:
        return resolve_input(store, next(iter(stage(result, node)["outputs"].values()))).table("eval").to_pylist()

    first = runs[variants[0], 0]
    teacher_rows = rows(first, TEACHER_EVAL)
    teacher = greedy_scores(teacher_rows)
    slices = prompt_slices(teacher_rows, stage(first, TEACHER_EVAL)["metrics"]) or dict.fromkeys(teacher, "all")
    by_variant = {v: [greedy_scores(rows(runs[v, k], STUDENT_EVAL)) for k in range(seeds)] for v in variants}
    out: dict = {"teacher": {}, "variants": {}}
    for name in sorted(set(slices.values())):
        ids = sorted(i for i, sl in slices.items() if sl == name)
        out["teacher"][name] = {"prompts": len(ids), "accuracy": sum(teacher[i] for i in ids) / len(ids)}
        for variant, students in by_variant.items():
            out["variants"].setdefault(variant, {})[name] = {
                "accuracy": [sum(st[i] for i in ids) / len(ids) for st in students],
                "minus_teacher": student_minus_teacher(teacher, students, ids),
                "distill_seconds": [stage(runs[variant, k], "distill")["seconds"] for k in range(seeds)]}
            if "traces" in by_variant and variant != "traces":
                out["variants"][variant][name]["minus_traces"] = students_minus(by_variant["traces"], students, ids)
    return out


def transfer_markdown(results: dict) -> list[str]:
    """(pure) One row per variant and slice: the student's accuracy by seed and its difference from the teacher."""
    lines = ["| variant | slice | prompts | teacher | student by seed | student - teacher [95%] | distill s |",
             "|---|---|---|---|---|---|---|"]
    for variant, by_slice in results["variants"].items():
        for name, r in by_slice.items():
            t = results["teacher"][name]
            d = r["minus_teacher"]
            lines.append(f"| {variant} | {name} | {t['prompts']} | {100 * t['accuracy']:.1f}% | "
                         f"{', '.join(f'{100 * a:.1f}%' for a in r['accuracy'])} | "
                         f"{100 * d[0]:+.1f} [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}] | "
                         f"{', '.join(f'{x:.0f}' for x in r['distill_seconds'])} |")
    return lines


def against_traces_markdown(results: dict) -> list[str]:
    """(pure) Each variant's student minus the `traces` variant's student (seed k against seed k), per slice: which
    variant keeps more (a row only where both ran)."""
    lines = ["| variant | slice | student - traces student [95%] |", "|---|---|---|"]
    for variant, by_slice in results["variants"].items():
        for name, r in by_slice.items():
            if "minus_traces" in r:
                d = r["minus_traces"]
                lines.append(f"| {variant} | {name} | {100 * d[0]:+.1f} [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}] |")
    return lines


if __name__ == "__main__":
    main()
