"""What MKL's strict reproducible mode (MKL_CBWR=AUTO,STRICT, which r1flow sets: stages/runtime/threads.py) costs,
and whether a training step then gives the same bytes on 1 and on 2 threads.

    .venv/bin/python benchmarks/reproducible_products.py               # SmolLM2-135M's shape, 3 rounds
    .venv/bin/python benchmarks/reproducible_products.py --layers 4 --rounds 1

Every measurement runs in a fresh interpreter (MKL reads the variable at its first call), under each mode in turn,
the modes alternating which goes first from round to round, with torch's threads at the machine's cores:
- `train`: forward and backward of the causal-LM loss over 8 x 256 tokens, random weights of SmolLM2-135M's shape
  (the default model's), seconds per step (mean of 3 after a warm-up);
- `decode`: a forward over 8 rows of one token each (a decode step's matrix shapes, without a KV cache), seconds
  per call (mean of 30 after a warm-up);
- `same bytes`: one training step (loss, gradients, clipped norm, AdamW) on 1 thread and on 2, sha256 of the loss
  and of every weight after the step compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = {"default": None, "strict": "AUTO,STRICT"}

CHILD = r"""
import hashlib, json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
what, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
x = torch.randint(0, cfg.vocab_size, (8, 256), generator=torch.Generator().manual_seed(1))
def train():
    model.zero_grad(set_to_none=True)
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    return out.loss
def decode():
    with torch.no_grad():
        model(input_ids=x[:, :1])
if what == "same":
    torch.set_num_threads(int(sys.argv[3]))
    loss = train()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    h = hashlib.sha256(loss.detach().numpy().tobytes())
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    print(json.dumps({"sha256": h.hexdigest()}))
else:
    f, n = (train, 3) if what == "train" else (decode, 30)
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    print(json.dumps({"seconds": (time.perf_counter() - t) / n, "threads": torch.get_num_threads()}))
"""


def child(mode: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if MODES[mode]:
        env["MKL_CBWR"] = MODES[mode]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each timing, the modes alternating")
    args = p.parse_args(argv)
    print(f"{os.cpu_count()} cores; torch threads: the default (one per core); {args.layers} layers")
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for what in ("train", "decode"):
            for mode in order:
                s = child(mode, what, str(args.layers))["seconds"]
                times.setdefault((what, mode), []).append(s)
                print(f"round {r + 1} {what:6s} {mode:7s} {s * 1000:9.1f} ms", flush=True)
    for what in ("train", "decode"):
        d, s = (times[(what, m)] for m in MODES)
        print(f"{what:6s} default {statistics.mean(d) * 1000:9.1f} ms (range {min(d) * 1000:.1f}-{max(d) * 1000:.1f})"
              f"  strict {statistics.mean(s) * 1000:9.1f} ms (range {min(s) * 1000:.1f}-{max(s) * 1000:.1f})"
              f"  strict/default {statistics.mean(s) / statistics.mean(d):.3f}")
    for mode in MODES:
        one, two = (child(mode, "same", str(args.layers), str(n))["sha256"] for n in (1, 2))
        print(f"same bytes on 1 and 2 threads, {mode}: {one == two} ({one[:12]} / {two[:12]})")


if __name__ == "__main__":
    main()
