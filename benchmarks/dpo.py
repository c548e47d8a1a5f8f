"""DPO throughput and peak memory, with and without a cached reference.

    .venv/bin/python benchmarks/dpo.py --model smollm2-135m-instruct        # CPU: a few minutes
    .venv/bin/python benchmarks/dpo.py --model tiny-random --steps 20

Each configuration runs in its own subprocess (so peak memory is its own), on synthetic pairs of
realistic length (prompt ~60 tokens, chosen/rejected ~100 tokens each):
- cached:  `reference_logprobs` first (timed separately), then `preference_optimization` with it;
           the reference model is never loaded during training;
- inline:  `preference_optimization` without a reference input: it scores every pair with the
           policy before its first update (the same numbers), so its wall time includes that pass.
Printed: training pairs/s, wall seconds of the stage, and peak resident memory (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the of and to in is that for it as with was on be by this are from at or an which".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    return [{"id": f"p{i}", "messages": [{"role": "user", "content": text(45)}], "chosen": text(80),
             "rejected": text(80), "chosen_score": 1.0, "rejected_score": 0.0, "source": "bench"} for i in range(n)]


def dpo_child(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.common import stage_input
    from schemas.configs import LoraSpec, ModelConfig, PreferenceOptimizationConfig, ReferenceLogprobsConfig
    from schemas.datasets import from_rows
    from stages import import_model, preference_optimization, reference_logprobs
    from stages.base import LocalContext, write_dataset

    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="r1flow-bench-dpo-"))
    ctx = LocalContext(root / "data", cache_dir=Path(args.cache_dir), device=device)
    model = stage_input(import_model.run(ModelConfig(ref=args.model), {}, ctx)["model"])
    prefs = stage_input(write_dataset(ctx, "prefs", from_rows(_pairs(args.pairs), "preferences"), "preferences"))
    inputs = {"model": model, "preferences": prefs}
    ref_seconds = 0.0
    if args.mode == "cached":
        t0 = time.perf_counter()
        out = reference_logprobs.run(ReferenceLogprobsConfig(max_length=args.max_length, batch_size=args.batch * 2),
                                     inputs, LocalContext(root / "ref", device=device))["logprobs"]
        ref_seconds = time.perf_counter() - t0
        ref = stage_input(out, parents=[prefs.fingerprint, model.fingerprint])
        inputs = {**inputs, "reference": ref}
    cfg = PreferenceOptimizationConfig(max_steps=args.steps, batch_size=args.batch, max_length=args.max_length,
                                       lora=LoraSpec(r=args.lora), kl_prompts=0, eval_fraction=0.0,
                                       checkpoint_every=10_000, learning_rate=1e-6)
    run_ctx = LocalContext(root / "run", device=device)
    t0 = time.perf_counter()
    out = preference_optimization.run(cfg, inputs, run_ctx)["model"]
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux → MiB
    gpu_peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
    print(json.dumps({"mode": args.mode, "device": device, "pairs_per_s": out.metrics["units_per_s"],
                      "stage_seconds": wall, "reference_stage_seconds": ref_seconds, "peak_rss_mib": peak,
                      "peak_gpu_mib": gpu_peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--cache-dir", default=".r1flow/cache-models")
    ap.add_argument("--mode", choices=["cached", "inline"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return dpo_child(args)
    rows = []
    for mode in ("cached", "inline"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"model={args.model} device={rows[0]['device']} pairs/step={args.batch} steps={args.steps} "
          f"max_length={args.max_length} lora r={args.lora} pairs in dataset={args.pairs}")
    print(f"{'reference':>9} {'train pairs/s':>13} {'stage s':>8} {'ref stage s':>11} {'peak RSS MiB':>12} {'peak GPU MiB':>12}")
    for r in rows:
        print(f"{r['mode']:>9} {r['pairs_per_s']:13.2f} {r['stage_seconds']:8.1f} {r['reference_stage_seconds']:11.1f} "
              f"{r['peak_rss_mib']:12.0f} {r['peak_gpu_mib']:12.0f}")


if __name__ == "__main__":
    main()
