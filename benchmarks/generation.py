"""Generation throughput of the engine (transformers backend): new tokens per second.

    .venv/bin/python benchmarks/generation.py                 # tiny model and SmolLM2, CPU
    .venv/bin/python benchmarks/generation.py --models smollm2-135m-instruct --prompts 64 --device cuda

Prompts are real R1-format arithmetic prompts (reasoning-gym basic_arithmetic). Prints one line
per (model, mode): prompts, completions, new tokens, seconds, tokens/s. Warm-up batch excluded.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schemas.configs import GenerationSpec, PromptsConfig  # noqa: E402
from stages import models  # noqa: E402
from stages.generation import TransformersBackend  # noqa: E402
from stages.prompts import build_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-random,smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="n for the sampled mode")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-dir", default=".r1flow/cache-models")
    args = ap.parse_args()

    convs = [r["messages"] for r in build_prompts(PromptsConfig(size=args.prompts * 2, eval_fraction=0.0), seed=0)]
    convs = convs[: args.prompts]
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"prompts={len(convs)} max_new_tokens={args.max_new_tokens} batch={args.batch_size}")
    print(f"{'model':24} {'mode':10} {'prompts':>7} {'compl':>6} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for name in args.models.split(","):
        path = models.resolve_model_dir(name, Path(args.cache_dir))
        model, tok = models.load_model(path, device=args.device)
        backend = TransformersBackend(model, tok)
        backend.generate(convs[: args.batch_size], GenerationSpec(max_new_tokens=8, batch_size=args.batch_size),
                         progress=False)  # warm-up
        for mode, spec, n in [
            ("greedy", GenerationSpec(max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size), 1),
            (f"sample x{args.samples}", GenerationSpec(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95,
                                                       batch_size=max(1, args.batch_size // args.samples)), args.samples),
        ]:
            t0 = time.perf_counter()
            _, stats = backend.generate(convs, spec, n=n, seed=0, progress=False)
            secs = time.perf_counter() - t0
            print(f"{name:24} {mode:10} {stats.prompts:7d} {stats.completions:6d} {stats.new_tokens:7d} "
                  f"{secs:8.2f} {stats.new_tokens / secs:9.1f}", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
