"""Decode speed of multi-turn rollouts against single-turn generation, per sampled token (issue 46).

    .venv/bin/python benchmarks/multiturn_speed.py                      # tiny model, CPU
    .venv/bin/python benchmarks/multiturn_speed.py --shape smollm2      # SmolLM2-135M's layers, random weights

Three ways to sample the same number of tokens per row, greedy (so every row samples its whole budget: no
early EOS to favour one side), each timed `--repeats` times (interleaved) after an untimed warm-up, median and fastest printed:
- `generate`: today's `generation.generate`, one turn of `--tokens` tokens;
- `single_turn`: `multiturn.sample_trajectories` with the single_turn environment (the same turn through the
  multi-turn path);
- `multi_turn`: `--turns` turns of `--tokens / --turns` tokens, after each but the last an observation
  (`OBSERVATION`, as the python environment formats one) appended and prefilled into the KV cache.
Tokens/s counts sampled tokens only. Two rates: the whole call's, and decode's, which leaves out the time
spent prefilling observation tokens into the cache and between turns (`RolloutStats`): the observation
tokens are not sampled, and with the tiny character tokenizer an observation is about as many tokens as a turn,
so their prefill (which any multi-turn sampler pays, and without a KV cache pays again for the whole
conversation every turn) would otherwise dominate the comparison. Both include the prompts' prefill. The
acceptance (issue 46): multi_turn decode within 20% of generate per sampled token.
`--shape smollm2` builds a random Llama with SmolLM2-135M's layer sizes and the tiny tokenizer (the decoder's
cost without a download; the small vocabulary makes the head cheaper than SmolLM2's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schemas.configs import GenerationSpec  # noqa: E402
from stages.environments.base import Observation  # noqa: E402
from stages.environments.single_turn import SingleTurn  # noqa: E402
from stages.modeling.models import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from stages.sampling import generation, multiturn  # noqa: E402

OBSERVATION = "<output>\n7006652\n</output>\n"
SHAPES = {"tiny": {}, "smollm2": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                      intermediate_size=1536, max_position_embeddings=2048)}


class FixedTurns(SingleTurn):
    """Answers every turn but the `turns`-th with `OBSERVATION`."""

    def __init__(self, turns: int):
        super().__init__()
        object.__setattr__(self, "turns", turns)
        object.__setattr__(self, "name", "fixed_turns")

    def start(self, row):
        turns = self.turns

        class Episode:
            def step(self, turn):
                return Observation(OBSERVATION, tool_call=True) if turn.index + 1 < turns else None

        return Episode()


def prompt_rows(n: int) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {1000 + 37 * i} * {2000 + 91 * i}?"}],
             "answer": str((1000 + 37 * i) * (2000 + 91 * i)), "task": "products", "verifier": "exact"}
            for i in range(n)]


def timed(fns: dict, repeats: int) -> dict[str, tuple[float, float, int]]:
    """name -> (median and fastest seconds of `repeats` calls after a warm-up, sampled tokens of a call). The calls
    are interleaved (a, b, c, a, b, c, ...) so that a shared machine's changing load falls on all alike; the fastest
    call is the one the other processes disturbed least."""
    tokens = {name: fn() for name, fn in fns.items()}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(seconds[name]), min(seconds[name]), tokens[name]) for name in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--rows", type=int, default=16, help="prompts, one trajectory each, in one batch")
    ap.add_argument("--tokens", type=int, default=96, help="sampled tokens per row, all turns together")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0, **SHAPES[args.shape]).eval()
    rows = prompt_rows(args.rows)
    convs = [r["messages"] for r in rows]
    per_turn = args.tokens // args.turns
    obs_tokens = len(tok(OBSERVATION, add_special_tokens=False)["input_ids"])
    one = GenerationSpec(max_new_tokens=per_turn * args.turns, temperature=0.0, batch_size=args.rows)
    turns = GenerationSpec(max_new_tokens=per_turn, temperature=0.0, batch_size=args.rows)
    total = per_turn * args.turns + (args.turns - 1) * obs_tokens + 1

    def run_generate() -> int:
        out, stats = generation.generate(model, tok, convs, one, progress=False)
        return stats.new_tokens

    between: dict[str, list[float]] = {"single_turn": [], "multi_turn": []}  # seconds outside decoding, per call

    def run_single() -> int:
        stats = multiturn.sample_trajectories(model, tok, rows, SingleTurn(), one)[1]
        between["single_turn"].append(stats.observation_seconds + stats.environment_seconds)
        return stats.new_tokens

    def run_multi() -> int:
        out, stats = multiturn.sample_trajectories(model, tok, rows, FixedTurns(args.turns), turns,
                                                   max_total_tokens=total)
        assert all(t.turns == args.turns for ts in out for t in ts), "a row ended early (EOS): pick other prompts"
        between["multi_turn"].append(stats.observation_seconds + stats.environment_seconds)
        return stats.new_tokens

    print(f"multi-turn decode speed: {args.shape} shape ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters), {args.rows} rows x {per_turn * args.turns} sampled tokens, greedy, CPU, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; multi_turn: {args.turns} turns of {per_turn} "
          f"tokens, {args.turns - 1} observations of {obs_tokens} tokens; median of {args.repeats}")
    timings = timed({"generate": run_generate, "single_turn": run_single, "multi_turn": run_multi}, args.repeats)
    decode = {}
    for name, (median, best, tokens) in timings.items():
        outside = statistics.median(between[name][1:]) if name in between else 0.0  # the warm-up call left out
        decode[name] = tokens / (median - outside)
        print(f"  {name:<12} {tokens:6d} tokens  median {median:7.3f} s {tokens / median:8.1f} tokens/s  "
              f"(fastest {best:7.3f} s {tokens / best:8.1f} tokens/s)  observation prefill and environment "
              f"{outside:6.3f} s  decode {decode[name]:8.1f} tokens/s", flush=True)
    for what, multi, base in (("whole call", timings["multi_turn"][2] / timings["multi_turn"][0],
                               timings["generate"][2] / timings["generate"][0]),
                              ("decode", decode["multi_turn"], decode["generate"])):
        ratio = multi / base
        print(f"  multi_turn / generate per sampled token, {what} (medians): {ratio:.3f} "
              f"({'within' if ratio >= 0.8 else 'NOT within'} 20%)")


if __name__ == "__main__":
    main()
