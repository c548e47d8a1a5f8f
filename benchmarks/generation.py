"""Generation throughput of the engine (transformers backend): new tokens per second.

    .venv/bin/python benchmarks/generation.py                 # tiny model and SmolLM2, CPU
    .venv/bin/python benchmarks/generation.py --models smollm2-135m-instruct --prompts 64 --device cuda

Prompts are real R1-format arithmetic prompts (reasoning-gym basic_arithmetic). Prints one line
per (model, mode): prompts, completions, new tokens, seconds, tokens/s. Warm-up batch excluded.

`--compare` instead times, for the first model, one greedy batch of `--rows` prompts x at most
`--max-new-tokens` through plain transformers `generate()` with the dynamic and with the static
cache (compiled on a GPU) and through r1flow's backend (`cache: dynamic`: its own decode loop,
`decode_rows` + `lean_decode`; `cache: static`: `generate()` with prompts padded to 64-token
buckets), each after an untimed warm-up call of the same shape (compilation). One `GEN-RESULT {json}`
line per mode: seconds, warm-up seconds, new tokens, tokens/s, peak GPU memory, and how many rows
equal plain dynamic `generate()`'s tokens (greedy: the same tokens, up to float rounding):

    python benchmarks/generation.py --compare --models smollm2-random --rows 128 --max-new-tokens 128 \
        --dtype bf16 --device cuda
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
from stages.modeling import models  # noqa: E402
from stages.prompts import build_prompts  # noqa: E402
from stages.sampling.completions import render_prompts, stop_token_ids  # noqa: E402
from stages.sampling.generation import TransformersBackend  # noqa: E402

RESULT_MARK = "GEN-RESULT "


def bench_model_dir(name: str, cache_dir: Path) -> Path | str:
    """A benchmark model name (benchmarks.common.MODEL_REFS: tiny, smollm2, smollm2-random, 1b) or a builtin/ref."""
    from benchmarks.common import MODEL_REFS, ensure_model_dir

    return ensure_model_dir(name) if name in MODEL_REFS else models.resolve_model_dir(name, cache_dir)


def compare(args: argparse.Namespace) -> None:
    """Plain generate() (dynamic, static cache) against r1flow's backend (dynamic: decode_rows; static), greedy."""
    import json

    name = args.models.split(",")[0]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tok = models.load_model(bench_model_dir(name, Path(args.cache_dir)), dtype=dtype, device=args.device)
    model.eval()
    convs = [r["messages"] for r in build_prompts(PromptsConfig(size=args.rows * 2, eval_fraction=0.0), seed=0)]
    convs = convs[: args.rows]
    texts = render_prompts(tok, convs)
    eos = stop_token_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    cuda = args.device.startswith("cuda")

    def plain(cache: str) -> list[list[int]]:
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                      use_cache=True, temperature=None, top_p=None, top_k=None)
        if cache == "static":
            kwargs["cache_implementation"] = "static"
        with torch.no_grad():
            rows = model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1]:].tolist()
        return [row[: next((k + 1 for k, t in enumerate(row) if t in eos), len(row))] for row in rows]

    def ours(cache: str) -> list[list[int]]:
        spec = GenerationSpec(max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=len(convs), cache=cache)
        results, _ = TransformersBackend(model, tok).generate(convs, spec, progress=False)
        return [list(r[0].token_ids) for r in results]

    def timed(fn, cache: str) -> tuple[float, list[list[int]]]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows = fn(cache)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, rows

    print(f"compare: {name} {args.dtype} on {args.device}, {len(convs)} rows x <= {args.max_new_tokens} new tokens, "
          f"greedy; torch {torch.__version__}", flush=True)
    reference = None
    for label, fn, cache in (("generate() dynamic", plain, "dynamic"), ("r1flow decode_rows", ours, "dynamic"),
                             ("generate() static", plain, "static"), ("r1flow static", ours, "static"),
                             ("r1flow graph", ours, "graph")):
        warm_s, _ = timed(fn, cache)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        secs, rows = timed(fn, cache)
        tokens = sum(len(r) for r in rows)
        reference = rows if reference is None else reference
        out = {"mode": label, "cache": cache, "model": name, "dtype": args.dtype, "device": args.device,
               "rows": len(rows), "max_new_tokens": args.max_new_tokens, "seconds": secs, "warmup_s": warm_s,
               "new_tokens": tokens, "tokens_per_s": tokens / secs,
               "rows_equal_to_generate_dynamic": sum(a == b for a, b in zip(rows, reference, strict=True)),
               "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
        print(f"{label:22} {secs:8.3f} s  {tokens:6d} tokens  {tokens / secs:9.1f} tokens/s  (warm-up {warm_s:.1f} s; "
              f"{out['rows_equal_to_generate_dynamic']}/{len(rows)} rows equal generate() dynamic)", flush=True)
        print(RESULT_MARK + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-random,smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="n for the sampled mode")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache-dir", default=".r1flow/cache-models")
    ap.add_argument("--compare", action="store_true",
                    help="generate() dynamic/static against r1flow's backend dynamic/static (see above)")
    ap.add_argument("--rows", type=int, default=128, help="--compare: prompts in the one greedy batch")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="--compare: the weights' dtype")
    args = ap.parse_args()
    if args.compare:
        return compare(args)

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
