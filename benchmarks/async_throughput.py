"""Throughput of asynchronous GRPO (issue 60, "Measure"): samples/s and overlap for K = max_staleness 0, 1, 2 on
the same resources, in two placements.

    .venv/bin/python benchmarks/async_throughput.py                        # the full run: SmolLM2, both placements
    .venv/bin/python benchmarks/async_throughput.py --model tiny --steps 3 --repeats 1    # a quick run

The default run is 12 stage runs (K 0, 1, 2; both placements; 2 repeats of 4 steps) of SmolLM2-135M under full
fine-tuning (every policy version the whole 540 MB of weights): about 12-13 minutes on 2 idle cores (estimated from
single runs beside other work), `--model tiny` about 3.

Placements (the same 2 cores for every K):
- `local` (b): one machine, 2 cores. The stage runs in a fresh process pinned to the first 2 cores the benchmark may
  use; with K >= 1 its one rollout worker is a process beside the learner (`async.rollout_workers: 1`).
  R1FLOW_THREADS fixes the split r1flow's thread share picks on an idle machine (K = 0: the learner takes both
  cores; K >= 1: one thread each), so other work on the machine cannot move it during a run.
- `ray` (a): a 2-node loopback Ray cluster in a network namespace (benchmarks/loopback_cluster.py, the one the
  cluster tests use), one core a node (each node's processes pinned to its own core with taskset, Ray's num_cpus
  1): the learner is the stage's Ray task on the node labelled `learn`, the rollout worker an actor on the node
  labelled `gen` (`async.worker_resources`). K = 0 is the synchronous stage on the `learn` node: the other node idles.
  Needs root (`ip netns`) and Ray (`pip install -e .[cluster]`).

Per setting, from the stage's own per-step metrics, over the steps after `--warmup` (the first step pays the
workers' start and the first passes' allocations):
- samples/s = completions trained / wall-clock between the end of the warm-up and the end of the last step (the
  moments the stage logs each step); s/step its inverse per step;
- t_gen = generation + scoring (`time/generation` + `time/scoring`: the worker's, when asynchronous), t_train =
  `time/training`, means per step; the ceiling (t_gen + t_train) / max(t_gen, t_train) from the synchronous run's
  phase times (of the same placement and repeat), the speed-up samples/s over K = 0's (paired by repeat) and its
  share of the ceiling;
- overlap, generation idle and training idle fractions: the means of `async/overlap`, `async/generation_idle`,
  `async/training_idle`; for K = 0, which logs no async metrics, from the phase times over each step's wall-clock
  (overlap 0: one side waits while the other runs); staleness mean: `async/staleness_mean` (K = 0: 0).
Each number is the mean over `--repeats` with half its range (for 2 repeats: the two values are mean -/+ that);
the order of the settings alternates between repeats (0, 1, 2 then 2, 1, 0), so a drifting load falls on all alike.
OpenMP's wait policy is chosen as the CLI chooses it (`threads.choose_wait_policy`: PASSIVE when the machine is
already busy as the benchmark starts). The environment is printed with the table: the CPU, the threads of each
process, MKL_CBWR, OpenMP's wait policy,
the load average at the start and the end (a loaded machine is reported as such) and, for the local runs, the
share of the cores other processes used while they ran. Output: a markdown section for docs/results (stdout, and
`--markdown`) and a JSON file (`--json`, default in the work folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.async_throughput_report import (  # noqa: E402
    environment_lines,
    markdown_section,
    summarize_run,
    throughput_rows,
)

PLACEMENTS = ("local", "ray")
# GRPO's shape per model: the speed suite's CPU shape, 4 prompts x 4 completions x <= 32 tokens, full fine-tuning
# (docs/results/speed.md: 3.5 s generating and 3.3 s training a step on 2 quiet cores, so the ceiling is near 2).
# Under LoRA (--lora-r 16) generation through the unmerged adapter took about twice as long here (19.3 s against
# 8.7 s a step, on a loaded machine) and training no less: the ceiling is lower (1.2 there).
SHAPES = {"smollm2": {"prompts": 4, "group": 4, "new_tokens": 32, "steps": 4},
          "tiny": {"prompts": 4, "group": 4, "new_tokens": 16, "steps": 3}}
RUN_TIMEOUT_S = 1800.0


# ---------------------------------------------------------------------------- the stage's config


def throughput_config(args: argparse.Namespace, k: int, placement: str) -> dict:
    """The grpo config of one setting, as its JSON dump: the same for every K but the `async` block."""
    from schemas.configs import GRPOConfig

    cfg = {"steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group, "mu": 1, "beta": 0.0,
           "minibatch_size": min(8, args.prompts * args.group), "learning_rate": 1e-4,
           "lora": {"r": args.lora_r, "alpha": 2 * max(args.lora_r, 1)},
           "reward": {"weights": {"accuracy": 1.0, "format": 0.5, "tags": 0.5}},
           "generation": {"max_new_tokens": args.new_tokens, "temperature": 1.0,
                          "batch_size": args.prompts * args.group},
           "checkpoint_every": 10_000, "eval_every": 0}
    if k:
        cfg["async"] = {"max_staleness": k, "rollout_workers": 1}
        if placement == "ray":
            cfg["async"]["worker_resources"] = {"cpus": 1, "labels": {"gen": 1}}
    return GRPOConfig.model_validate(cfg).model_dump(mode="json", by_alias=True)


# ---------------------------------------------------------------------------- the learner's process (child)


def run_learner(request: dict) -> dict:
    """The grpo stage through `run_stage`, as the pipeline runs it: in this process (local: with its share of the
    cores, `threads.stage_share`) or in a Ray task (the cluster: Ray's num_cpus sets the threads). Its per-step
    metrics, the moment each step was logged, and the threads the learner used."""
    import logging

    import torch

    from benchmarks.r1flow_side import TimedContext, inputs_from
    from schemas.configs import GRPOConfig
    from stages import grpo
    from stages.runtime import threads
    from stages.training.launch import run_stage

    class ThreadsSeen(TimedContext):
        def log_metrics(self, metrics, step=None):
            self.threads_seen.add(torch.get_num_threads())
            super().log_metrics(metrics, step)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = GRPOConfig.model_validate(request["config"])
    ctx = ThreadsSeen(Path(request["root"]), seed=0)
    ctx.threads_seen = set()
    inputs = inputs_from(request["prep"], "model", "prompts")
    share = threads.stage_share(ctx.log) if request["placement"] == "local" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with share:
        run_stage(grpo, cfg, inputs, ctx)
    return {"metrics": ctx.metrics, "params": ctx.params, "clock": ctx.step_clock, "stage_s": time.perf_counter() - t0,
            "learner_threads": sorted(ctx.threads_seen)}


def child_main(request_path: str, result_path: str) -> None:
    """One run in this fresh process: the stage here, or (request["task"]: Ray options) as a Ray task of the
    cluster at RAY_ADDRESS, which this process joins as its driver."""
    request = json.loads(Path(request_path).read_text())
    if request.get("task"):
        import logging

        import ray

        env = {"PYTHONPATH": str(ROOT), **request["env"]}  # the task and its actors import this module
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING, runtime_env={"env_vars": env})
        try:
            result = ray.get(ray.remote(max_retries=0, **request["task"])(run_learner).remote(request))
        finally:
            ray.shutdown()
    else:
        result = run_learner(request)
    Path(result_path).write_text(json.dumps(result, default=str))


# ---------------------------------------------------------------------------- the parent


def prepare(model: str, work: Path) -> dict:
    """The start model and the prompts, written once before any measured run."""
    from benchmarks.common import CACHE_DIR, MODEL_REFS, ensure_model_dir, path_fingerprint
    from schemas.configs import ModelConfig, PromptsConfig
    from stages import import_model, prompts
    from stages.base import LocalContext

    ctx = LocalContext(work / "prep", cache_dir=CACHE_DIR)
    ensure_model_dir(model)
    outs = {"model": import_model.run(ModelConfig(ref=MODEL_REFS[model]), {}, ctx)["model"],
            "prompts": prompts.run(PromptsConfig(size=64), {}, ctx)["prompts"]}
    return {key: {"kind": o.kind, "schema": o.schema, "path": str(o.path), "rows": o.rows,
                  "fingerprint": path_fingerprint(o.path)} for key, o in outs.items()}


def child_command(request: Path, result: Path) -> list[str]:
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.async_throughput import child_main; "
            f"child_main({str(request)!r}, {str(result)!r})")
    return [sys.executable, "-c", code]


def learner_env(args: argparse.Namespace, k: int, registry: Path) -> dict[str, str]:
    """The local learner's environment: the thread split of an idle machine fixed (R1FLOW_THREADS), a stage registry
    of its own (other people's stage processes on this machine do not count), MKL's reproducible mode, HF offline."""
    from benchmarks.suite import CHILD_ENV
    from stages.runtime.threads import REGISTRY_VAR, REPRODUCIBLE, REPRODUCIBLE_VAR, THREADS_VAR

    env = {**os.environ, **CHILD_ENV, REGISTRY_VAR: str(registry)}
    env.setdefault(REPRODUCIBLE_VAR, REPRODUCIBLE)
    env[THREADS_VAR] = str(local_threads(k, args.cores))
    return env


def local_threads(k: int, cores: int) -> int:
    """Threads of each local process: the cores split evenly between the learner and its one worker (K >= 1)."""
    from stages.runtime.threads import thread_share

    return thread_share(2 if k else 1, cores)


def _finish(proc: subprocess.Popen, name: str, log: Path, result: Path) -> dict:
    """The run's result once its process (a session of its own) exits; on a timeout or an interrupt the session
    is killed by its pid first."""
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        raise SystemExit(f"async_throughput: {name} did not finish within {RUN_TIMEOUT_S:.0f} s; log {log}") from None
    if rc != 0 or not result.exists():
        last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise SystemExit(f"async_throughput: {name} exited {rc}: {last[0]} (log {log})")
    return json.loads(result.read_text())


def run_local(args: argparse.Namespace, request: dict, name: str, work: Path) -> dict:
    """One setting on this machine: a fresh process on the first `--cores` cores, the worker (K >= 1) beside it."""
    from stages.runtime.threads import machine_busy_seconds

    req, result, log = work / f"{name}.request.json", work / f"{name}.result.json", work / f"{name}.log"
    req.write_text(json.dumps(request))
    cores = sorted(os.sched_getaffinity(0))[: args.cores]
    busy0, own0, t0 = machine_busy_seconds(), _children_cpu(), time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(child_command(req, result), stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=learner_env(args, request["k"], work / "registry"), start_new_session=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))
        out = _finish(proc, name, log, result)
    wall, busy1, own1 = time.perf_counter() - t0, machine_busy_seconds(), _children_cpu()
    if busy0 is not None and busy1 is not None:  # cores other processes kept busy while this run ran
        out["foreign_cores"] = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    out["worker_threads"] = local_threads(request["k"], args.cores) if request["k"] else None
    return out


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_on_cluster(cluster, request: dict, name: str, work: Path) -> dict:
    """One setting on the loopback cluster: this benchmark's child is the driver, inside the namespace; the stage
    is a Ray task on the `learn` node, its worker (K >= 1) an actor on the `gen` node."""
    from benchmarks.suite import CHILD_ENV
    from stages.runtime.threads import REGISTRY_VAR, REPRODUCIBLE, REPRODUCIBLE_VAR

    request = {**request, "task": {"num_cpus": 1, "resources": {"learn": 1}},
               "env": {**CHILD_ENV, REPRODUCIBLE_VAR: os.environ.get(REPRODUCIBLE_VAR, REPRODUCIBLE),
                       REGISTRY_VAR: str(work / "registry")}}
    req, result, log = work / f"{name}.request.json", work / f"{name}.result.json", work / f"{name}.log"
    req.write_text(json.dumps(request))
    proc = cluster.popen(child_command(req, result), log=log, env={"RAY_ADDRESS": cluster.address})
    out = _finish(proc, name, log, result)
    out["worker_threads"] = 1 if request["k"] else None  # Ray's num_cpus 1 on a node pinned to one core
    if request["k"] and (problem := misplaced(out["params"], cluster)):
        raise SystemExit(f"async_throughput: {name} {problem}; log {log}")
    return out


def misplaced(params: dict, cluster) -> str | None:
    """None when an asynchronous stage's recorded node ids (its `async.*` params) put the learner on the `learn` node
    (`start_cluster`'s head) and its one worker on the `gen` node; else where they ran, as the rest of a sentence."""
    where = (params.get("async.learner_node_id"), params.get("async.worker_node_ids"))
    want = (cluster.running["head"].node_id, cluster.running["worker"].node_id)
    if where == want:
        return None
    return (f"ran the learner on node {where[0]} and its worker on {where[1]}, not on the learn ({want[0]}) and gen "
            f"({want[1]}) nodes")


def start_cluster(work: Path):
    """Head (`learn`) on the first core, the other node (`gen`) on the second, one CPU each, in a namespace. Ray
    starts its worker processes at nice 15 (its `worker_niceness`); here they run at 0, as the local placement's
    processes do, so that other work on the machine slows both placements alike."""
    from benchmarks.loopback_cluster import LoopbackCluster

    first, second = sorted(os.sched_getaffinity(0))[:2]
    nodes = [("head", 1, {"learn": 1}), ("worker", 1, {"gen": 1})]
    return LoopbackCluster(work / "cluster", nodes=nodes, pinned={"head": str(first), "worker": str(second)},
                           env={"RAY_worker_niceness": "0"}).start()


def check_args(args: argparse.Namespace) -> list[int]:
    """The settings, or one line naming what is wrong, before any compute."""
    try:
        ks = sorted({int(k) for k in args.ks.split(",")})
    except ValueError:
        raise SystemExit(f"async_throughput: --ks {args.ks!r}: expected comma-separated integers, e.g. 0,1,2") from None
    problems = []
    if 0 not in ks or min(ks) < 0:
        problems.append(f"--ks {args.ks!r} must include 0 (the synchronous run every speed-up is measured against) "
                        "and no negative K")
    if args.warmup < 1 or args.steps <= args.warmup:
        problems.append(f"--warmup {args.warmup} must be at least 1 (the window starts at the end of a step) and "
                        f"--steps {args.steps} above it (no measured step otherwise)")
    if unknown := set(args.placements) - set(PLACEMENTS):
        problems.append(f"--placements: unknown {sorted(unknown)} (known: {', '.join(PLACEMENTS)})")
    if len(os.sched_getaffinity(0)) < args.cores or args.cores < 2:
        problems.append(f"--cores {args.cores}: needs at least 2, and this process may use "
                        f"{len(os.sched_getaffinity(0))}")
    if "ray" in args.placements:
        from benchmarks.loopback_cluster import netns_available, ray_installed

        if not ray_installed():
            problems.append("--placements ray needs Ray: pip install -e .[cluster] (or --placements local)")
        elif not netns_available():
            problems.append("--placements ray needs root and `ip netns` for the loopback cluster (or --placements local)")
    if problems:
        raise SystemExit("async_throughput: " + "; ".join(problems))
    return ks


def order_of(ks: list[int], repeat: int) -> list[int]:
    """The settings' order in a repeat: ascending in even repeats, descending in odd ones."""
    return list(ks) if repeat % 2 == 0 else list(reversed(ks))


def run_placement(args: argparse.Namespace, placement: str, ks: list[int], prep: dict, work: Path) -> list[dict]:
    """Every repeat of every setting of one placement; each run's summary."""
    cluster = start_cluster(work) if placement == "ray" else None
    runs = []
    try:
        for repeat in range(args.repeats):
            for k in order_of(ks, repeat):
                name = f"{placement}-k{k}-r{repeat}"
                root = work / "runs" / name
                request = {"config": throughput_config(args, k, placement), "prep": prep, "root": str(root),
                           "placement": placement, "k": k}
                t0 = time.perf_counter()
                out = (run_on_cluster(cluster, request, name, work) if cluster is not None
                       else run_local(args, request, name, work))
                summary = summarize_run(out, k, args.warmup, args.prompts * args.group)
                runs.append({"placement": placement, "k": k, "repeat": repeat, "wall_s": time.perf_counter() - t0,
                             **summary})
                print(f"  {name}: {summary['samples_per_s']:.3f} samples/s, {summary['s_per_step']:.2f} s/step, "
                      f"t_gen {summary['t_gen']:.2f} s, t_train {summary['t_train']:.2f} s, overlap "
                      f"{summary['overlap']:.2f}, staleness {summary['staleness_mean']:.2f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        if cluster is not None:
            cluster.stop()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2", help="smollm2 (the embedded SmolLM2-135M) "
                    "or tiny (the built-in random model: a quick run)")
    ap.add_argument("--ks", default="0,1,2", help="comma-separated max_staleness settings; 0 is required")
    ap.add_argument("--placements", type=lambda s: s.split(","), default=list(PLACEMENTS),
                    help="comma-separated: local (one machine, 2 cores), ray (2-node loopback cluster, a core each)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="grpo steps a run (default: the model's shape)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of every measure")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0, the default: full fine-tuning, every weight "
                    "published a step; r > 0: only the adapter)")
    ap.add_argument("--cores", type=int, default=2, help="cores of the local placement")
    ap.add_argument("--work", default=None, help="work folder (default: a new temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--keep", action="store_true", help="keep each run's outputs and checkpoints")
    args = ap.parse_args()
    shape = SHAPES[args.model]
    for key in ("steps", "prompts", "group", "new_tokens"):
        setattr(args, key, getattr(args, key) or shape[key])
    ks = check_args(args)
    load_start = os.getloadavg()
    from stages.runtime.threads import choose_wait_policy

    choose_wait_policy()  # as the CLI's first step: idle threads sleep (PASSIVE) when the machine is already busy
    started = time.time()
    work = Path(args.work or tempfile.mkdtemp(prefix="async-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"async throughput: {args.model}, K in {ks}, placements {args.placements}, {args.repeats} repeat(s), "
          f"{args.steps} steps ({args.warmup} warm-up); work {work}", flush=True)
    prep = prepare(args.model, work)
    runs = [run for placement in args.placements for run in run_placement(args, placement, ks, prep, work)]
    rows = throughput_rows(runs)
    env = environment_lines(args, runs, load_start, os.getloadavg())
    section = markdown_section(args, rows, env, started, " ".join(sys.argv[1:]))
    print("\n" + section, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(section + "\n")
    out = Path(args.json or work / "async_throughput.json")
    out.write_text(json.dumps({"args": vars(args), "ks": ks, "runs": runs, "rows": rows, "environment": env,
                               "load_start": load_start, "load_end": os.getloadavg()}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
