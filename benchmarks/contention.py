"""Two r1flow processes on one machine: how much each slows the other, and where the CPU time goes.

    .venv/bin/python benchmarks/contention.py                      # the embedded model, both wait policies
    .venv/bin/python benchmarks/contention.py --model tiny --seconds 20 --policies PASSIVE

Workloads, each in a process of its own started the way a stage process starts (fresh interpreter, the
environment below):
- `eval`: greedy decoding of arithmetic prompts with r1flow's sampler (stages.sampling.generation.generate, the
  eval stage's path), batches of 8 prompts x 64 new tokens, until `--seconds` have passed;
- `train`: SFT-shaped steps (forward and backward of the causal-LM loss over 8 x 128 tokens, AdamW) for as long.

Scenarios: one eval alone; two evals at once; an eval beside a training process; an eval beside other work (a
plain Python loop on one core, no torch: what a tiny run's imports and servers are to the default run beside it). Each under each OpenMP wait
policy: `default` (OMP_WAIT_POLICY unset: libgomp's threads spin a while on their core when idle) and `PASSIVE`
(they sleep: what r1flow sets, stages/runtime/threads.py). torch's intra-op threads are its default (one per
core) in every process, as when two people or two flow runs share a box. Printed per scenario and process:
decoded tokens/s (eval) or steps/s (train), the process's CPU seconds per token (user + system), and the eval's
slow-down against the same policy's eval alone. Scenarios alternate policies, so drifting load hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.runtime import threads  # noqa: E402

SCENARIOS = {"alone": ["eval"], "two evals": ["eval", "eval"], "eval + train": ["eval", "train"],
             "eval + other": ["eval", "other"]}
SCENARIO_NAMES = {"alone": "alone", "two": "two evals", "train": "eval + train", "other": "eval + other"}


def _model(name: str):
    from stages.modeling import models

    if name == "tiny":
        tokenizer = models.build_tiny_tokenizer()
        return models.build_tiny_model(tokenizer), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import ensure_model_dir

    path = ensure_model_dir(name)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def work(kind: str, model_name: str, seconds: float, start_at: float) -> dict:
    """One workload in this process (the child side): runs from `start_at` (wall clock) for `seconds`. `other`:
    a plain Python loop on one core, no torch and no r1flow stage (what a tiny run's imports and servers are to the
    default run beside it)."""
    if kind == "other":
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, t0, units = _cpu(), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            units += sum(i * i for i in range(10_000)) > 0
        return {"kind": kind, "units": units, "wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - cpu0, "threads": 1}
    import torch

    from schemas.configs import GenerationSpec
    from stages.sampling.generation import generate

    model, tokenizer = _model(model_name)
    conversations = [[{"role": "user", "content": f"What is {i} + {2 * i + 7}? Think, then answer."}]
                     for i in range(8)]
    spec = GenerationSpec(max_new_tokens=64, temperature=0.0, batch_size=8)
    ids = torch.randint(0, tokenizer.vocab_size, (8, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    time.sleep(max(0.0, start_at - time.time()))  # both processes loaded: start together
    share = contextlib.nullcontext()
    if os.environ.get(threads.REGISTRY_VAR):  # policy `budget`: a stage's share of the cores, as execute_stage takes
        share = threads.stage_share(None)
    with share:
        return _run(kind, model, tokenizer, conversations, spec, ids, opt, seconds, generate)


def _run(kind, model, tokenizer, conversations, spec, ids, opt, seconds, generate) -> dict:
    import torch

    cpu0, t0, units = _cpu(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        if kind == "eval":
            with torch.no_grad():
                _, stats = generate(model, tokenizer, conversations, spec, progress=False)
            units += stats.new_tokens
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            threads.rebalance()  # as the training loops do between steps
            units += 1
    wall = time.perf_counter() - t0
    return {"kind": kind, "units": units, "wall_s": wall, "cpu_s": _cpu() - cpu0, "threads": torch.get_num_threads()}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def scenario(kinds: list[str], policy: str, model: str, seconds: float) -> list[dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "R1FLOW_THREADS", "GOMP_SPINCOUNT")}
    policy, *extra = policy.split("+")  # e.g. share+GOMP_SPINCOUNT=10000: more variables for this policy
    env.update(item.split("=", 1) for item in extra)
    if policy in ("budget", "share"):  # each process takes its share of the cores (stages/runtime/threads.py)
        env["R1FLOW_STAGE_PROCESSES"] = tempfile.mkdtemp(prefix="r1flow-contention-")
        if policy == "budget":  # and PASSIVE; `share`: libgomp's default wait policy
            env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    start_at = time.time() + 60  # replaced below once every child has loaded: see the handshake
    procs = []
    for kind in kinds:
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.contention import work; "
                f"sys.stdout.write('ready\\n'); sys.stdout.flush(); start = float(sys.stdin.readline()); "
                f"print(json.dumps(work({kind!r}, {model!r}, {seconds}, start)))")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT))
    for p in procs:  # each has imported torch; its model loads inside work(), before the common start
        assert p.stdout.readline().strip() == "ready"
    start_at = time.time() + 15  # time to build the model (the embedded one loads in a few seconds)
    for p in procs:
        p.stdin.write(f"{start_at}\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 600)
        if p.returncode != 0:
            raise SystemExit(f"workload exited {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the embedded model) or tiny")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long each workload runs")
    ap.add_argument("--policies", default="default,PASSIVE,budget,share", help="comma-separated: default, PASSIVE, "
                    "ACTIVE, budget (PASSIVE and each process's share of the cores, as r1flow's stages take it), share "
                    "(the share with libgomp's default wait policy); +VAR=VALUE adds a variable, e.g. "
                    "share+GOMP_SPINCOUNT=10000")
    ap.add_argument("--scenarios", default="alone,two,train,other", help="comma-separated: alone, two, train, other "
                    "(an eval beside a plain Python loop on one core: other work than r1flow's)")
    args = ap.parse_args()
    chosen = {SCENARIO_NAMES[k] for k in args.scenarios.split(",")}
    cores = len(os.sched_getaffinity(0))
    print(f"# {cores} cores, load average {os.getloadavg()[0]:.2f} at start; model {args.model}; "
          f"{args.seconds:.0f} s per workload; torch threads: its default in every process")
    policies = args.policies.split(",")
    alone: dict[str, float] = {}
    print(f"{'scenario':<14} {'policy':<8} {'process':<7} {'rate':>12} {'CPU s/token':>12} {'slow-down':>9}")
    for name, kinds in SCENARIOS.items():
        if name not in chosen:
            continue
        order = policies if len(alone) % 2 == 0 else list(reversed(policies))
        for policy in order:
            for r in scenario(kinds, policy, args.model, args.seconds):
                rate = r["units"] / r["wall_s"]
                if r["kind"] == "eval":
                    alone.setdefault(policy, rate) if name == "alone" else None
                    slow = f"{alone[policy] / rate:8.2f}x" if policy in alone else ""
                    print(f"{name:<14} {policy:<8} {'eval':<7} {rate:9.1f} t/s {r['cpu_s'] / max(r['units'], 1):12.4f} "
                          f"{slow:>9}")
                elif r["kind"] == "train":
                    print(f"{name:<14} {policy:<8} {'train':<7} {rate:7.2f} step/s {'':>12} {'':>9}")
                else:
                    print(f"{name:<14} {policy:<8} {'other':<7} {r['cpu_s'] / r['wall_s']:6.2f} cores {'':>12} {'':>9}")
            sys.stdout.flush()
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
