"""vLLM's CPU build against r1flow's own decode on the same cores (issue 61): greedy agreement and speed.

    /opt/vllm-venv/bin/python benchmarks/vllm_cpu.py           # the measurement: 13 minutes on 2 shared cores
    /opt/vllm-venv/bin/python benchmarks/vllm_cpu.py --quick   # tiny shapes, a smoke run: about 2 minutes

It runs where vLLM's CPU build is installed, a venv of its own (docs/guides/vllm.md; `.vllm-venv/bin/python` for the
one `make test-vllm` builds). Results of 2026-11-29: docs/results/vllm.md. One process holds both sides:
r1flow's decode (`TransformersBackend`, as the stages call it) on the embedded SmolLM2-135M-Instruct, loaded once, and
one vLLM engine (`VLLMBackend`: fp32, eager, the 1 GiB KV cache r1flow gives it unless VLLM_CPU_KVCACHE_SPACE says
otherwise) started once from the same model folder. Both compute on this process's torch thread pool at the same
`torch.set_num_threads` (`--threads`, default every core; checked before each timed call); OpenMP's wait policy and
MKL's mode are chosen as the CLI chooses them (stages/runtime/threads.py). Prompts: the held-out (split=eval) rows of
the default `prompts` stage's task (basic_arithmetic), chat-templated, no prefill.

Each measurement is one `VLLM-RESULT {json}` line; a markdown table of them ends the run.
- agreement: greedy completions of `--prompts` held-out prompts x 128 tokens (fp32 on both sides, each asked for its
  tokens' log-probs): the share identical token for token, and for each one that differs, the first differing
  position and, from one unbatched forward pass of r1flow's model over the prompt and the common prefix, the top-2
  log-prob margin there and vLLM's token's rank. A flip is put down to float rounding when that margin is at most
  twice the largest log-prob gap between the two sides on the tokens they agree on (`rounding_explains`); a wider
  one points to a bug. The call is timed too (an eval shape, with log-probs on both sides, once a side).
- speed: new tokens per second (wall-clock of the backend's `generate`, tokenizing included) and per CPU-second of
  this process at eval shapes (greedy; r1flow in batches of 64, as the cpu profile's eval) and GRPO group shapes
  (prompts x 8 samples, temperature 1; r1flow's batch of 24 prompts, as the cpu profile's grpo), `--repeats` times
  with the order of the sides alternated (vLLM first in even repeats; `side_order`); median and range over the
  repeats, and the median of the repeats' vLLM / r1flow ratios. Untimed first calls of each path come before.
- start-up: the import of vLLM's engine (`from vllm import LLM`) and its start (`VLLMBackend(...)`), once, beside
  r1flow's model load, once.
- weight sync: r1flow's model moved by N(0, 1e-4^2) noise on every weight, then pushed into the engine
  (`VLLMBackend.sync`), `--syncs` times: median and range of the seconds. Then a check that the pushes land: the
  two sides' largest log-prob gap on 16 prompts x 32 greedy tokens after the last push, and after one more move that
  is not pushed.

The machine's load is not controlled (other work may share the cores): the load average is printed at start and
end, and the range over repeats is the noise to read the figures against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.runtime.threads import choose_wait_policy, reproducible_products  # noqa: E402  (no torch)

WAIT_POLICY = choose_wait_policy()  # before torch loads libgomp, as the CLI's first step
reproducible_products()  # before the first matrix product, as the CLI

import torch  # noqa: E402

from benchmarks.common import ensure_model_dir  # noqa: E402
from schemas.configs import GenerationSpec, PromptsConfig  # noqa: E402
from stages.modeling import models  # noqa: E402
from stages.prompts import build_prompts  # noqa: E402
from stages.sampling.completions import render_prompts  # noqa: E402
from stages.sampling.generation import TransformersBackend  # noqa: E402
from stages.sampling.vllm_backend import VLLMBackend  # noqa: E402

RESULT_MARK = "VLLM-RESULT "
SIDES = ("vllm", "r1flow")
EVAL_BATCH = 64  # r1flow's prompts per generate() at eval shapes (flows/profiles/cpu.yaml, eval.batch_size)
GRPO_BATCH = 24  # ... at GRPO shapes (cpu.yaml, grpo generation.batch_size)
SYNC_NOISE = 1e-4  # std of the move of every weight before a push
# shapes: agreement (prompts, new tokens); eval (prompts, new tokens); grpo (prompts, samples, new tokens)
FULL = {"agree": (256, 128), "eval": [(64, 128)], "grpo": [(4, 8, 128), (8, 8, 128)], "repeats": 3, "syncs": 5}
QUICK = {"agree": (16, 32), "eval": [(8, 32)], "grpo": [(2, 4, 32)], "repeats": 2, "syncs": 3}
CHECK_SHAPE = (16, 32)  # the sync check's greedy prompts x tokens


# ---------------------------------------------------------------------------- pure helpers


def first_divergence(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int | None:
    """The first position where token sequences `a` and `b` differ (the shorter one's length when it is a prefix
    of the other); None when they are equal."""
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_agreement(ours: list, theirs: list) -> dict:
    """Share of identical rows of two sides' token sequences (one per prompt), and (row, first differing position)
    of each row that differs."""
    if len(ours) != len(theirs):
        raise ValueError(f"greedy_agreement: {len(ours)} rows against {len(theirs)}")
    differ = [(i, k) for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
              if (k := first_divergence(a, b)) is not None]
    rows = len(ours)
    return {"rows": rows, "identical": rows - len(differ), "share": (rows - len(differ)) / rows if rows else 0.0,
            "differ": differ}


def prefix_logprob_gaps(ours: list, theirs: list) -> list[float]:
    """|log-prob difference| of the two sides at each token of each row's common prefix (positions before the first
    divergence, where both scored the same token after the same context). Rows: (token ids, log-probs) pairs."""
    gaps = []
    for (ids_a, lps_a), (ids_b, lps_b) in zip(ours, theirs, strict=True):
        k = first_divergence(ids_a, ids_b)
        end = len(ids_a) if k is None else k
        gaps += [abs(x - y) for x, y in zip(lps_a[:end], lps_b[:end], strict=True)]
    return gaps


def rounding_explains(margin: float, max_gap: float) -> bool:
    """A greedy flip at a position whose top-2 log-prob margin (r1flow's model) is `margin` is within float rounding
    when the margin is at most 2 x `max_gap`, the largest log-prob gap seen between the two sides: each of the two
    log-probs of the margin may be off by that much."""
    return margin <= 2 * max_gap


def median_and_range(values: list[float]) -> dict:
    """median, min, max and count of repeated measurements (the range is the noise reported with the median)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def side_order(repeat: int) -> tuple[str, str]:
    """The order of the two sides in repeat `repeat`: vLLM first in even repeats, r1flow first in odd ones."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


# ---------------------------------------------------------------------------- measuring


def emit(record: dict) -> dict:
    print(RESULT_MARK + json.dumps(record), flush=True)
    return record


def held_out_conversations(count: int) -> list[list[dict]]:
    """The first `count` held-out prompts of the default prompts stage, its size raised so that the eval split holds
    them (a quarter of the rows, after repeated prompts are dropped: size 1024 held out 250, 1280 310)."""
    cfg = PromptsConfig(size=5 * count, eval_fraction=0.25)
    convs = [r["messages"] for r in build_prompts(cfg, seed=0) if r["split"] == "eval"]
    if len(convs) < count:
        raise SystemExit(f"vllm_cpu: the prompts stage gave {len(convs)} held-out prompts, not {count}")
    return convs[:count]


def timed_call(backend, threads: int, convs: list, spec: GenerationSpec, n: int = 1, seed: int = 0,
               logprobs: bool = False) -> tuple[float, list, float]:
    """(seconds, completions per prompt, CPU-seconds of this process) of one `generate` of `backend`, on `threads`
    threads (checked: vLLM's engine would set them to 1 at its start, and its CPU worker keeps it from doing so)."""
    if torch.get_num_threads() != threads:
        raise SystemExit(f"vllm_cpu: torch runs {torch.get_num_threads()} threads, not the {threads} set")
    t0, cpu0 = time.perf_counter(), time.process_time()
    results, _ = backend.generate(convs, spec, n=n, seed=seed, logprobs=logprobs, progress=False)
    return time.perf_counter() - t0, results, time.process_time() - cpu0


def speed_record(kind: str, side: str, timed: tuple[float, list, float], **shape) -> dict:
    """One timed call's figures: tokens/s of wall-clock, and per CPU-second of this process (all its threads; less
    sensitive to what else runs on the machine)."""
    seconds, results, cpu_s = timed
    tokens = sum(c.num_tokens for group in results for c in group)
    completions = sum(len(group) for group in results)
    return {"kind": kind, "side": side, **shape, "seconds": seconds, "cpu_s": cpu_s, "new_tokens": tokens,
            "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu_s, "mean_tokens": tokens / completions,
            "threads": torch.get_num_threads(), "load1": os.getloadavg()[0]}


@torch.no_grad()
def divergence_detail(model, tokenizer, conv: list[dict], ours: tuple[int, ...], theirs: tuple[int, ...],
                      position: int) -> dict:
    """r1flow's model at the first differing position of one prompt's two greedy completions: one unbatched forward
    pass over the prompt and the common prefix; its top-2 log-prob margin there, and the rank and log-prob of each
    side's token (None where that side had already ended)."""
    (text,) = render_prompts(tokenizer, [conv])
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([prompt + list(ours[:position])])).logits[0, -1].float()
    lps = torch.log_softmax(logits, dim=-1)
    top = lps.topk(2).values.tolist()

    def token(ids: tuple[int, ...]) -> dict | None:
        if position >= len(ids):
            return None
        t = ids[position]
        return {"id": t, "text": tokenizer.decode([t]), "logprob": lps[t].item(),
                "rank": int((lps > lps[t]).sum().item()) + 1}

    return {"position": position, "margin": top[0] - top[1], "r1flow": token(ours), "vllm": token(theirs)}


def measure_agreement(sides: dict, model, tokenizer, threads: int, shape: tuple[int, int]) -> list[dict]:
    """Greedy on both sides (vLLM first), with log-probs; the agreement and each divergence (module docstring)."""
    prompts, new_tokens = shape
    convs = held_out_conversations(prompts)
    spec = GenerationSpec(max_new_tokens=new_tokens, temperature=0.0, batch_size=EVAL_BATCH)
    out, records = {}, []
    for side in SIDES:
        timed = timed_call(sides[side], threads, convs, spec, logprobs=True)
        out[side] = timed[1]
        records.append(emit(speed_record("eval-logprobs", side, timed, prompts=prompts, samples=1,
                                         max_new_tokens=new_tokens, repeat=0)))
    rows = {side: [(g[0].token_ids, g[0].logprobs) for g in out[side]] for side in SIDES}
    agreement = greedy_agreement([ids for ids, _ in rows["r1flow"]], [ids for ids, _ in rows["vllm"]])
    gaps = prefix_logprob_gaps(rows["r1flow"], rows["vllm"])
    max_gap = max(gaps, default=0.0)
    details = [divergence_detail(model, tokenizer, convs[i], rows["r1flow"][i][0], rows["vllm"][i][0], k)
               for i, k in agreement["differ"]]
    for (i, _), d in zip(agreement["differ"], details, strict=True):
        d.update(row=i, rounding=rounding_explains(d["margin"], max_gap))
    gaps.sort()
    records.append(emit({"kind": "agreement", "prompts": prompts, "max_new_tokens": new_tokens,
                         "identical": agreement["identical"], "share": agreement["share"],
                         "compared_tokens": len(gaps), "max_logprob_gap": max_gap,
                         "median_logprob_gap": statistics.median(gaps) if gaps else None,
                         "divergences": details}))
    return records


def measure_speed(sides: dict, threads: int, plan: dict, repeats: int) -> list[dict]:
    """Eval and GRPO shapes on both sides, `repeats` times, the sides' order alternated (`side_order`)."""
    eval_convs = held_out_conversations(max(p for p, _ in plan["eval"]))
    grpo_convs = held_out_conversations(max(p for p, _, _ in plan["grpo"]))
    calls = ([("eval", eval_convs[:p], 1, GenerationSpec(max_new_tokens=t, temperature=0.0, batch_size=EVAL_BATCH))
              for p, t in plan["eval"]]
             + [("grpo", grpo_convs[:p], n, GenerationSpec(max_new_tokens=t, temperature=1.0, batch_size=GRPO_BATCH))
                for p, n, t in plan["grpo"]])
    records = []
    for repeat in range(repeats):
        for kind, convs, n, spec in calls:
            for side in side_order(repeat):
                timed = timed_call(sides[side], threads, convs, spec, n=n, seed=repeat)
                records.append(emit(speed_record(kind, side, timed, prompts=len(convs), samples=n,
                                                 max_new_tokens=spec.max_new_tokens, repeat=repeat)))
    return records


def check_gap(sides: dict, threads: int, convs: list) -> float:
    """The largest log-prob gap between the two sides' greedy tokens on their common prefixes (`CHECK_SHAPE`)."""
    spec = GenerationSpec(max_new_tokens=CHECK_SHAPE[1], temperature=0.0, batch_size=EVAL_BATCH)
    rows = {}
    for side in SIDES:
        _, results, _ = timed_call(sides[side], threads, convs, spec, logprobs=True)
        rows[side] = [(g[0].token_ids, g[0].logprobs) for g in results]
    return max(prefix_logprob_gaps(rows["r1flow"], rows["vllm"]), default=0.0)


@torch.no_grad()
def move_weights(model, generator: torch.Generator) -> None:
    """A small step of every weight, as a training step would take (N(0, SYNC_NOISE^2))."""
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * SYNC_NOISE)


def measure_sync(engine: VLLMBackend, sides: dict, model, threads: int, syncs: int) -> list[dict]:
    """`syncs` moves of r1flow's model, each pushed into the engine and timed; then the gap check (docstring)."""
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for step in range(1, syncs + 1):
        move_weights(model, generator)
        seconds.append(engine.sync(model, step))
    convs = held_out_conversations(CHECK_SHAPE[0])
    pushed = check_gap(sides, threads, convs)
    move_weights(model, generator)
    stale = check_gap(sides, threads, convs)
    return [emit({"kind": "weight_sync", "pushes": seconds, **median_and_range(seconds), "noise_std": SYNC_NOISE,
                  "parameters": sum(p.numel() for p in model.parameters()), "gap_after_push": pushed,
                  "gap_one_move_unpushed": stale})]


# ---------------------------------------------------------------------------- the summary


def speed_summary(records: list[dict], metric: str = "tokens_per_s") -> list[dict]:
    """One row per timed shape (kind, prompts, samples, new tokens): each side's `metric` over its repeats
    (`median_and_range`) and the vLLM / r1flow ratio of each repeat, paired by repeat."""
    shapes: dict[tuple, dict] = {}
    for r in records:
        if metric in r:
            key = (r["kind"], r["prompts"], r["samples"], r["max_new_tokens"])
            shapes.setdefault(key, {}).setdefault(r["repeat"], {})[r["side"]] = r[metric]
    rows = []
    for (kind, prompts, samples, new_tokens), by_repeat in shapes.items():
        paired = [v for v in by_repeat.values() if len(v) == 2]
        rows.append({"kind": kind, "prompts": prompts, "samples": samples, "max_new_tokens": new_tokens,
                     **{side: median_and_range([v[side] for v in by_repeat.values() if side in v]) for side in SIDES},
                     "ratio": median_and_range([v["vllm"] / v["r1flow"] for v in paired])})
    return rows


def spread_text(stat: dict, digits: int = 1, unit: str = "") -> str:
    """'median (min-max)', or the one value of a single measurement."""
    if stat["n"] == 0:
        return "-"
    if stat["n"] == 1:
        return f"{stat['median']:.{digits}f}{unit} (once)"
    return f"{stat['median']:.{digits}f}{unit} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def speed_lines(records: list[dict]) -> list[str]:
    names = {"eval": "greedy", "eval-logprobs": "greedy, log-probs on", "grpo": "temperature 1"}
    lines = []
    for metric, label in (("tokens_per_s", "tokens/s"), ("tokens_per_cpu_s", "tokens per CPU-s")):
        for row in speed_summary(records, metric):
            shape = (f"{row['prompts']} x {row['samples']} x {row['max_new_tokens']}" if row["samples"] > 1 else
                     f"{row['prompts']} x {row['max_new_tokens']}")
            lines.append(f"| {row['kind'].split('-')[0]} {shape} ({names[row['kind']]}), {label} | "
                         f"{spread_text(row['vllm'])} | {spread_text(row['r1flow'])} | "
                         f"{spread_text(row['ratio'], 2, 'x')} |")
    return lines


def vllm_results_table(records: list[dict]) -> str:
    """The run's figures: speed per shape (median (min-max) over repeats), start-up, weight sync, agreement; then
    each greedy divergence."""
    lines = ["| measurement | vLLM-CPU | r1flow | vLLM / r1flow |", "|---|---|---|---|", *speed_lines(records)]
    by_kind = {r["kind"]: r for r in records if "side" not in r}
    if start := by_kind.get("startup"):
        lines.append(f"| start-up, s | engine {start['engine_s']:.1f} (import {start['import_s']:.1f}) | "
                     f"model load {start['load_s']:.1f} | - |")
    if sync := by_kind.get("weight_sync"):
        lines.append(f"| weight sync, s ({sync['n']} pushes) | {spread_text(sync, 3)} | - | - |")
        lines.append(f"| largest log-prob gap after the last push / one move unpushed | {sync['gap_after_push']:.2e} / "
                     f"{sync['gap_one_move_unpushed']:.2e} | - | - |")
    if agree := by_kind.get("agreement"):
        within = sum(d["rounding"] for d in agree["divergences"])
        lines.append(f"| identical greedy completions, {agree['prompts']} x {agree['max_new_tokens']} | "
                     f"{agree['identical']} of {agree['prompts']} ({agree['share']:.1%}); of the others, {within} of "
                     f"{len(agree['divergences'])} within rounding (largest log-prob gap on agreed tokens "
                     f"{agree['max_logprob_gap']:.2e}) | - | - |")
        lines.append("")
        lines += [f"- prompt {d['row']}, token {d['position']}: top-2 margin {d['margin']:.2e}; r1flow "
                  f"{token_text(d['r1flow'])}, vLLM {token_text(d['vllm'])}; "
                  f"{'within rounding' if d['rounding'] else 'NOT within rounding'}" for d in agree["divergences"]]
    return "\n".join(lines)


def token_text(token: dict | None) -> str:
    if token is None:
        return "(ended)"
    return f"{token['text']!r} (rank {token['rank']}, log-prob {token['logprob']:.4f})"


def warm_up(sides: dict, threads: int) -> None:
    """Untimed first calls of each path the measurements take (greedy with log-probs, sampling n > 1): first-call
    costs (allocations, vLLM's first schedules) out of the figures."""
    convs = held_out_conversations(8)
    for side in SIDES:
        timed_call(sides[side], threads, convs, GenerationSpec(max_new_tokens=16, temperature=0.0), logprobs=True)
        timed_call(sides[side], threads, convs[:2], GenerationSpec(max_new_tokens=16, temperature=1.0), n=4)


def start_engine(model_dir: Path, tokenizer) -> tuple[VLLMBackend, dict]:
    """One engine for every measurement; the import of vLLM's engine timed apart from its start (`import vllm` alone
    loads little: its names load on first use)."""
    t0 = time.perf_counter()
    from vllm import LLM  # noqa: F401  # lazy: timed apart from the engine's start (seconds)

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = VLLMBackend(model_dir, tokenizer, seed=0)
    return engine, {"import_s": import_s, "engine_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tiny shapes, a smoke run: {QUICK}")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of both sides")
    ap.add_argument("--prompts", type=int, default=None, help="agreement prompts (default 256; --quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="speed repeats (default 3; --quick 2)")
    ap.add_argument("--syncs", type=int, default=None, help="weight pushes timed (default 5; --quick 3)")
    args = ap.parse_args()
    plan = dict(QUICK if args.quick else FULL)
    if args.prompts:
        plan["agree"] = (args.prompts, plan["agree"][1])
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"vllm_cpu: threads={args.threads} OMP_WAIT_POLICY={WAIT_POLICY} MKL_CBWR={os.environ.get('MKL_CBWR')} "
          f"torch {torch.__version__}; load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
          f"plan {plan}", flush=True)
    model_dir = ensure_model_dir("smollm2")
    t0 = time.perf_counter()
    model, tokenizer = models.load_model(model_dir)
    load_s = time.perf_counter() - t0
    engine, start = start_engine(model_dir, tokenizer)
    records = [emit({"kind": "startup", "load_s": load_s, **start,
                     "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")})]
    sides = {"vllm": engine, "r1flow": TransformersBackend(model, tokenizer)}
    try:
        warm_up(sides, args.threads)
        records += measure_agreement(sides, model, tokenizer, args.threads, plan["agree"])
        records += measure_speed(sides, args.threads, plan, args.repeats or plan["repeats"])
        records += measure_sync(engine, sides, model, args.threads, args.syncs or plan["syncs"])
    finally:
        engine.close()
    load_end = os.getloadavg()
    print(f"\nload average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, at end "
          f"{load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}\n")
    print(vllm_results_table(records), flush=True)


if __name__ == "__main__":
    main()
