"""Where a GRPO step's time goes: the step split into phases, each between device synchronisations.

    python benchmarks/grpo_phases.py --device cuda --model smollm2-random          # the suite's GRPO shape
    python benchmarks/grpo_phases.py --device cuda --caches dynamic,graph         # with and without CUDA graphs
    python benchmarks/grpo_phases.py --device cpu --model tiny --quick            # the CPU dry run (CI)

It runs r1flow's own `grpo` stage, with the benchmark suite's shape and inputs (benchmarks/suite.py), and wraps
the stage's phase functions with timers that call `torch.cuda.synchronize()` before and after (on CUDA; the
wrappers observe, they change nothing the stage computes). Each phase's time is exclusive of the phases nested in
it. Phases of a step:

- `rollout`: `groups.sample_groups`: generation and scoring (the suite reports the two apart);
- `batch`: `grpo.advantages` less what is nested in it: advantages, tokenizing the prompts, the training tensors;
- `reference`: `grpo.reference_logprobs` (the KL anchor's no-grad pass; absent with beta 0, the suite's setting);
- `forward`: the policy's log-probs of each mini-batch (`RolloutBatch.logprobs` under grad: the first epoch's
  pass also gives the old log-probs);
- `backward`: `Tensor.backward` of each mini-batch's loss;
- `loss`: the rest of `grpo.minibatch_backward`: the loss arithmetic and its statistics (host syncs included);
- `optimizer`: the rest of `grpo.update`: gradient sync, clipping, the optimizer step;
- `other`: the rest of `grpo.train_step` (sampler sync, gathering, metrics).

The first step (warm-up: allocations, compilation, graph capture) is reported apart from the mean of the others.
Prints a table per cache mode and, with `--json`, writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("rollout", "batch", "reference", "forward", "backward", "loss", "optimizer", "other")


class PhaseClock:
    """Exclusive wall time per phase per step: a stack of open phases; each phase's time less its children's.
    `sync` runs before every clock reading (torch.cuda.synchronize on CUDA), so a phase owns its device work."""

    def __init__(self, sync=lambda: None):
        self.sync = sync
        self.steps: list[dict[str, float]] = []
        self._stack: list[list] = []  # [name, start, time of children]

    def new_step(self) -> None:
        self.steps.append(defaultdict(float))

    @contextlib.contextmanager
    def phase(self, name: str):
        self.sync()
        self._stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            self.sync()
            _, start, children = self._stack.pop()
            total = time.perf_counter() - start
            if self.steps:
                self.steps[-1][name] += total - children
            if self._stack:
                self._stack[-1][2] += total

    def wrap(self, owner, attr: str, name: str, when=lambda *a, **k: True):
        """Replace owner.attr by a timed call (phase `name` where `when(*args)`); returns an undo function."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not when(*args, **kwargs):
                return original(*args, **kwargs)
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, original)


def phase_summary(steps: list[dict[str, float]]) -> dict:
    """First step (warm-up) and the mean of the others, per phase, with the step total."""
    def row(s: dict[str, float]) -> dict[str, float]:
        out = {p: s.get(p, 0.0) for p in PHASES}
        out["step"] = sum(out.values())
        return out

    rows = [row(s) for s in steps]
    later = rows[1:] or rows
    mean = {k: sum(r[k] for r in later) / len(later) for k in (*PHASES, "step")}
    return {"first": rows[0] if rows else {}, "mean": mean, "steps_measured": len(later)}


def measure(cache: str, args, prep: dict, work: Path) -> dict:
    """One grpo run of the suite's shape with the phase clock around the stage's functions."""
    import torch

    from benchmarks.common import SEED, shape_for
    from benchmarks.r1flow_side import inputs_from
    from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec
    from stages import grpo
    from stages.base import LocalContext
    from stages.training import groups
    from stages.training.launch import run_stage
    from stages.training.rollout_batch import RolloutBatch

    shape = replace(shape_for(args.device, args.model, quick=args.quick, cache=cache), grpo_steps=args.steps)
    cuda = args.device.startswith("cuda")
    clock = PhaseClock(torch.cuda.synchronize if cuda else (lambda: None))
    cfg = GRPOConfig(steps=shape.grpo_steps + 1, prompts_per_step=shape.grpo_prompts, group_size=shape.grpo_group,
                     generation=GenerationSpec(max_new_tokens=shape.grpo_new_tokens, temperature=1.0, top_p=1.0,
                                               top_k=0, batch_size=shape.grpo_prompts, cache=cache),
                     lora=LoraSpec(r=shape.lora_r), minibatch_size=shape.grpo_minibatch, mu=1, beta=args.beta,
                     advantage="grpo", aggregation="seq_mean", learning_rate=shape.learning_rate,
                     checkpoint_every=10_000)
    undo = []
    train_step = grpo.train_step

    def step_with_clock(s, step):
        clock.new_step()
        with clock.phase("other"):
            return train_step(s, step)

    undo.append(lambda: setattr(grpo, "train_step", train_step))
    grpo.train_step = step_with_clock
    undo.append(clock.wrap(groups, "sample_groups", "rollout"))
    undo.append(clock.wrap(grpo, "advantages", "batch"))
    undo.append(clock.wrap(grpo, "reference_logprobs", "reference"))
    undo.append(clock.wrap(grpo, "update", "optimizer"))
    undo.append(clock.wrap(grpo, "minibatch_backward", "loss"))
    undo.append(clock.wrap(RolloutBatch, "logprobs", "forward", when=lambda *a, **k: torch.is_grad_enabled()))
    undo.append(clock.wrap(torch.Tensor, "backward", "backward",
                           when=lambda *a, **k: bool(clock._stack) and clock._stack[-1][0] == "loss"))
    t0 = time.perf_counter()
    try:
        run_stage(grpo, cfg, {"model": inputs_from(prep, "model")["model"],
                              "prompts": inputs_from(prep, "prompts")["prompts"]},
                  LocalContext(work / f"grpo-{cache}", seed=SEED, device=args.device))
    finally:
        for u in reversed(undo):
            u()
    out = phase_summary(clock.steps)
    out.update({"cache": cache, "wall_s": time.perf_counter() - t0, "shape": {
        "prompts": shape.grpo_prompts, "group": shape.grpo_group, "new_tokens": shape.grpo_new_tokens,
        "minibatch": shape.grpo_minibatch, "lora_r": shape.lora_r}})
    return out


def phase_table(results: list[dict]) -> str:
    head = "| cache | step | " + " | ".join(PHASES) + " | step s |"
    lines = [head, "|" + "---|" * (len(PHASES) + 3)]
    for r in results:
        for which in ("first", "mean"):
            cells = " | ".join(f"{r[which].get(p, 0.0):.3f}" for p in PHASES)
            label = "first (warm-up)" if which == "first" else f"mean of {r['steps_measured']}"
            lines.append(f"| {r['cache']} | {label} | {cells} | {r[which].get('step', 0.0):.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="benchmark model (default: smollm2-random on cuda, tiny on cpu)")
    ap.add_argument("--caches", default=None, help="comma list of generation caches (default: dynamic,graph on "
                    "cuda, dynamic on cpu)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up step")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (>0 adds the reference pass)")
    ap.add_argument("--quick", action="store_true", help="the suite's quick shape")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("smollm2-random" if cuda else "tiny")
    caches = (args.caches or ("dynamic,graph" if cuda else "dynamic")).split(",")
    from benchmarks.common import shape_for
    from benchmarks.suite import prepare_shared_inputs

    work = Path(args.work or tempfile.mkdtemp(prefix="grpo-phases-"))
    shape = replace(shape_for(args.device, args.model, quick=args.quick), grpo_steps=args.steps)
    prep = prepare_shared_inputs(args.model, shape, work)
    results = []
    for cache in caches:
        print(f"grpo phases: {args.model} on {args.device}, cache {cache}, {args.steps} steps after a warm-up",
              flush=True)
        results.append(measure(cache, args, prep, work))
        print(phase_table(results[-1:]), flush=True)
    print("\n" + phase_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "model": args.model, "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
