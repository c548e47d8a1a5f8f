"""Length buckets in GRPO's training forward: one forward + backward of the completions' log-probs.

    .venv/bin/python benchmarks/completion_buckets.py                          # SmolLM2, 16 x 16..128 tokens
    .venv/bin/python benchmarks/completion_buckets.py --min-len 9 --max-len 32 --overheads 0,8,64
    .venv/bin/python benchmarks/completion_buckets.py --path whole             # whole rows (no prefix sharing)

4 R1-format prompts x 4 completions whose lengths are drawn uniformly from [min-len, max-len]
(random tokens: the cost of a forward does not depend on which), run through
`prefix_sharing.shared_prefix_rows` (`--path shared`, GRPO's default) or, as whole right-padded
prompt + completion rows, `logprobs.bucketed_token_logprobs` (`--path whole`: GRPO with
prefix_sharing off or gradient checkpointing) once per bucket overhead: a huge overhead is the single padded
batch, each other overhead the buckets `logprobs.length_buckets` picks for it. Prints per
overhead the bucket sizes, the padded positions, and the forward + backward seconds of each
repeat (runs alternate; the first of each is warm-up and not printed).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schemas.configs import PromptsConfig  # noqa: E402
from stages import grpo  # noqa: E402
from stages.modeling import logprobs, models, prefix_sharing  # noqa: E402
from stages.prompts import build_prompts  # noqa: E402
from stages.sampling.completions import render_prompts  # noqa: E402

ONE_BUCKET = 10**9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (4 prompts)")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--overheads", default="default,128", help="comma list; 'default' = the device's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=".r1flow/cache-models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", choices=["shared", "whole"], default="shared")
    args = ap.parse_args()

    convs = [r["messages"] for r in build_prompts(PromptsConfig(size=16, eval_fraction=0.0), seed=0)][:4]
    model, tok = models.load_model(models.resolve_model_dir(args.model, Path(args.cache_dir)), device="cpu")
    model.train()
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in render_prompts(tok, convs)]
    rng = random.Random(args.seed)
    n_rows = len(prompts) * args.group
    comps = [[rng.randrange(100, len(tok) - 1) for _ in range(rng.randint(args.min_len, args.max_len))]
             for _ in range(n_rows)]
    rows = [k for k in range(len(prompts)) for _ in range(args.group)]
    width = max(len(prompts[k]) + len(c) for k, c in zip(rows, comps, strict=True))
    lengths = [len(c) for c in comps]
    overheads = [ONE_BUCKET] + [logprobs.default_bucket_overhead("cpu") if o == "default" else int(o)
                                for o in args.overheads.split(",")]
    print(f"torch {torch.__version__} threads {torch.get_num_threads()} model {args.model} path {args.path} rows {n_rows} "
          f"completion lengths {sorted(lengths)} (tokens {sum(lengths)})")

    batch = grpo.build_batch([prompts[k] for k in rows], comps, pad_id=0, keep=[True] * n_rows)
    if args.path == "whole":  # the buckets group whole rows by prompt + completion length
        lengths = batch["attention_mask"].sum(-1).tolist()

    def run(overhead: int) -> float:
        t0 = time.perf_counter()
        if args.path == "whole":
            lp, _ = logprobs.bucketed_token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                                     bucket_overhead=overhead)
        else:
            lp, _ = prefix_sharing.shared_prefix_rows(model, prompts, comps, rows, pad_id=0, width=width, device="cpu",
                                                bucket_overhead=overhead)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[int, list[float]] = {o: [] for o in overheads}
    for r in range(args.repeats + 1):
        for o in overheads:
            t = run(o)
            if r:
                times[o].append(t)
    for o in overheads:
        buckets = logprobs.length_buckets(lengths, o)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in buckets)
        name = "one bucket" if o == ONE_BUCKET else f"overhead {o}"
        print(f"{name:14} buckets {[len(b) for b in buckets]} padded positions {padded} seconds "
              f"{' '.join(f'{t:.3f}' for t in times[o])} (min {min(times[o]):.3f})", flush=True)


if __name__ == "__main__":
    main()
