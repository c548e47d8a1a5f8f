"""What one more decoder call costs, in token positions, for models of different widths.

    .venv/bin/python benchmarks/call_overhead.py                        # tiny, 128-, 256-, 512-wide, SmolLM2
    .venv/bin/python benchmarks/call_overhead.py --models tiny,w256 --repeats 25

For each model and row length L: one forward + backward of `logprobs.token_logprobs` (one scored
position a row, so the head costs the same everywhere) on B rows and on 2B rows, alternating,
medians. Splitting the 2B rows into two calls of B costs 2 T(B) - T(2B) more; divided by what a
position costs in the big call, T(2B) / (2B L), that is a decoder call's fixed cost in positions of
that model: what `logprobs.default_bucket_overhead` estimates as 64 * (3.5M / p)^(1/3) for p
parameters a layer (64 at SmolLM2's 3.5M and wider). Printed per model: parameters a layer, the
times, the split cost per L and its median, and the estimate.

Models: `tiny` (the built-in 2-layer, 64-wide Llama), `wN` (a random 4-layer Llama N wide,
intermediate 2.75 N), `smollm2` (SmolLM2-135M-Instruct from the local cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stages.modeling import logprobs, models  # noqa: E402

SMALL = (8, [32, 64, 128])  # B rows (against 2B) and the row lengths
LARGE = (2, [32, 64])


def build(name: str):
    if name == "smollm2":
        from transformers import AutoModelForCausalLM

        from benchmarks.common import ensure_model_dir

        return AutoModelForCausalLM.from_pretrained(ensure_model_dir("smollm2")), LARGE
    tokenizer = models.build_tiny_tokenizer()
    if name == "tiny":
        return models.build_tiny_model(tokenizer), SMALL
    if not name.startswith("w") or not name[1:].isdigit():
        raise SystemExit(f"unknown model {name!r}: tiny, smollm2 or wN (N wide)")
    width = int(name[1:])
    model = models.build_tiny_model(tokenizer, hidden_size=width, num_layers=4, num_heads=max(4, width // 64),
                                    num_kv_heads=max(2, width // 192), intermediate_size=int(width * 2.75))
    return model, SMALL


def one_call(model, ids: torch.Tensor) -> float:
    positions = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    positions[:, -1] = True
    t0 = time.perf_counter()
    lp, _ = logprobs.token_logprobs(model, ids, torch.ones_like(ids), positions=positions)
    lp.sum().backward()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def split_cost(model, rows: int, length: int, repeats: int) -> tuple[float, float, float]:
    """(T(rows), T(2 rows), 2 T(rows) - T(2 rows) in positions of the 2-row call), medians, alternating."""
    ids = torch.randint(3, model.config.vocab_size, (2 * rows, length))
    small, big = [], []
    for i in range(repeats + 2):  # the first two of each are warm-up
        s, b = one_call(model, ids[:rows]), one_call(model, ids)
        if i >= 2:
            small.append(s)
            big.append(b)
    t_small, t_big = statistics.median(small), statistics.median(big)
    return t_small, t_big, (2 * t_small - t_big) / (t_big / (2 * rows * length))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,w128,w256,w512,smollm2")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per shape (SmolLM2: a third of them)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; forward + backward, medians")
    for name in args.models.split(","):
        model, shapes = build(name)
        model.train()
        model.config.use_cache = False
        per_layer = logprobs.layer_parameters(model)
        repeats = max(3, args.repeats // 3) if name == "smollm2" else args.repeats
        rows, lengths = shapes
        costs = []
        for length in lengths:
            t_small, t_big, cost = split_cost(model, rows, length, repeats)
            costs.append(cost)
            print(f"  {name} L={length}: {rows} rows {t_small * 1000:.2f} ms, {2 * rows} rows {t_big * 1000:.2f} ms; "
                  f"a second call costs {cost:.0f} positions", flush=True)
        print(f"{name}: {per_layer:,} parameters a layer; a second decoder call costs {statistics.median(costs):.0f} "
              f"positions (median over L); default_bucket_overhead on cpu: "
              f"{logprobs.default_bucket_overhead('cpu', model)}", flush=True)


if __name__ == "__main__":
    main()
