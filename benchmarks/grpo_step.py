"""GRPO step time split into generation / scoring / training.

    .venv/bin/python benchmarks/grpo_step.py --model smollm2-135m-instruct            # the reference shape:
        16 prompts x 8 completions x 128 new tokens (slow on CPU: minutes per step)
    .venv/bin/python benchmarks/grpo_step.py --model tiny-random --steps 3

Runs the real `grpo` stage (LocalContext, no Prefect/MLflow) on basic_arithmetic prompts and prints
the per-step times it logs. Reference (docs/design.md §6, one H100): TRL GRPOTrainer with transformers
generation takes about 5.7-6 s per step for the SmolLM2 shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import stage_input  # noqa: E402
from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec, ModelConfig, PromptsConfig  # noqa: E402
from stages import grpo, import_model, prompts  # noqa: E402
from stages.base import LocalContext  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--cache-dir", default=".r1flow/cache-models")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="r1flow-bench-"))
    ctx = LocalContext(root / "data", cache_dir=Path(args.cache_dir), device=device)
    p = prompts.run(PromptsConfig(size=max(64, args.prompts * 4)), {}, ctx)["prompts"]
    m = import_model.run(ModelConfig(ref=args.model), {}, ctx)["model"]
    inputs = {"prompts": stage_input(p), "model": stage_input(m)}  # stage outputs, unpublished: no store needed
    cfg = GRPOConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
                     generation=GenerationSpec(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                               batch_size=args.prompts * args.group),
                     lora=LoraSpec(r=args.lora), minibatch_size=args.minibatch, learning_rate=1e-6,
                     checkpoint_every=10_000)
    run_ctx = LocalContext(root / "run", device=device)
    grpo.run(cfg, inputs, run_ctx)
    print(f"device={device} model={args.model} {args.prompts} prompts x {args.group} completions x "
          f"{args.max_new_tokens} new tokens, lora r={args.lora}")
    print(f"{'step':>4} {'generation':>11} {'scoring':>8} {'training':>9} {'total':>7} {'tokens':>7}")
    for step, metrics in run_ctx.metrics:
        if step is None or "time/step" not in metrics:
            continue
        tokens = metrics["completion/mean_length"] * args.prompts * args.group
        print(f"{step:4d} {metrics['time/generation']:11.2f} {metrics['time/scoring']:8.2f} "
              f"{metrics['time/training']:9.2f} {metrics['time/step']:7.2f} {tokens:7.0f}")


if __name__ == "__main__":
    main()
