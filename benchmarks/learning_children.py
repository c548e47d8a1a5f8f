"""`learning.py`'s child processes, each run as `learning.py --child WHAT`: the start model and the prompts
(`prep`), one side's training (`r1flow`, `r1flow_ppo`, `trl`) and the evaluation of every model (`eval`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import CACHE_DIR, MODEL_REFS, ROOT, SEED, Snapshots, ensure_model_dir
from benchmarks.learning_plan import TASK, TRANSFER, Plan, grpo_config, ppo_config

RESULT_MARK = "LEARN-RESULT "


# ---------------------------------------------------------------------------- children: preparation


def stage_input_of(entry: dict):
    from benchmarks.common import stage_input
    from stages.base import Output

    return stage_input(Output(entry["kind"], entry["schema"], Path(entry["path"]), rows=entry.get("rows")),
                       parents=entry.get("parents"))


def entry_of(output) -> dict:
    return {"kind": output.kind, "schema": output.schema, "path": str(output.path), "rows": output.rows}


def make_prompts(plan: Plan, ctx):
    """The prompts artifact of the plan under `ctx`'s seed (`split_seed`): basic_arithmetic train + held out, and the
    chain_sum transfer prompts."""
    from schemas.configs import PromptsConfig
    from stages import prompts

    # twice as many as asked: the generators repeat easy items and the prompts stage keeps one of each; the eval stage
    # reads the first eval_prompts + transfer_prompts, round-robin over the two tasks
    total = plan.train_prompts + plan.eval_prompts
    return prompts.run(PromptsConfig(tasks={TASK: plan.task}, size=2 * total, eval_fraction=plan.eval_prompts / total,
                                     eval_tasks={TRANSFER: plan.transfer}, eval_size=2 * plan.transfer_prompts), {},
                       ctx)["prompts"]


def held_out_questions(prompts_dir: Path, n: int) -> list[str]:
    """The first n held-out basic_arithmetic questions of a prompts artifact: those the evaluator scores."""
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE

    rows = pq.read_table(Path(prompts_dir) / DATA_FILE).to_pylist()
    return [r["messages"][-1]["content"] for r in rows if r["split"] == "eval" and r["task"] == TASK][:n]


def tuning_overlap(plan: Plan, prompts_dir: Path, work: Path) -> dict:
    """How many of this split's scored held-out questions the tuning split (split_seed 0) also held out: a fresh
    split of a small task (about 1,060 distinct one-digit prompts) shares about a quarter of them by chance."""
    from stages.base import LocalContext

    ours = held_out_questions(prompts_dir, plan.eval_prompts)
    tuning = make_prompts(plan, LocalContext(work / "tuning-split", seed=0, device="cpu", cache_dir=CACHE_DIR))
    shared = set(ours) & set(held_out_questions(tuning.path, plan.eval_prompts))
    return {"held_out": len(ours), "also_in_tuning_split": len(shared)}


def prepare_start_and_prompts(plan: Plan, work: Path) -> dict:
    """The prompts, the held-out sets and the start model (cold start by r1flow's stages, LoRA merged), all drawn
    with the split seed."""
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE, MODEL_DIR
    from schemas.configs import (
        GenerationSpec,
        LoraSpec,
        ModelConfig,
        RejectionSamplingConfig,
        SFTConfig,
    )
    from schemas.datasets import from_rows
    from stages import import_model, rejection_sampling, sft
    from stages.base import LocalContext, write_dataset
    from stages.training.launch import run_stage

    ensure_model_dir(plan.model)
    ctx = LocalContext(work, seed=plan.split_seed, device=plan.device, cache_dir=CACHE_DIR)
    t0 = time.perf_counter()
    base = import_model.run(ModelConfig(ref=MODEL_REFS[plan.model]), {}, ctx)["model"]
    prm = make_prompts(plan, ctx)
    rows = pq.read_table(prm.path / DATA_FILE).to_pylist()
    held = [r for r in rows if r["split"] == "eval" and r["task"] == TASK]
    for task, have, want in ((TASK, len(held), plan.eval_prompts),
                             (TRANSFER, sum(r["task"] == TRANSFER for r in rows), plan.transfer_prompts)):
        if have < want:
            raise SystemExit(f"prompts: only {have} distinct held-out {task} prompts at these options, fewer than the "
                             f"{want} asked for: widen the task's difficulty range or ask for fewer")
    curve = write_dataset(ctx, "curve_prompts", from_rows(held[: plan.curve_prompts], "prompts"), "prompts")
    start, cold_info = base, {}
    if plan.cold_steps:
        rs_cfg = RejectionSamplingConfig(correctness="lenient", require_format=False, reformat=True,
                                         num_samples=plan.cold_samples, max_prompts=plan.cold_prompts,
                                         generation=GenerationSpec(max_new_tokens=plan.max_new_tokens, temperature=0.8,
                                                                   top_p=0.95, batch_size=32))
        cold = run_stage(rejection_sampling, rs_cfg, {"model": stage_input_of(entry_of(base)),
                                                      "prompts": stage_input_of(entry_of(prm))}, ctx)["data"]
        sft_cfg = SFTConfig(max_steps=plan.cold_steps, batch_size=8, learning_rate=plan.cold_learning_rate,
                            max_length=256, checkpoint_every=10_000, lora=LoraSpec(r=16, alpha=32, merge=True))
        start = run_stage(sft, sft_cfg, {"model": stage_input_of(entry_of(base)),
                                         "data": stage_input_of(entry_of(cold))}, ctx)["model"]
        cold_info = {"cold_examples": cold.rows, "rejection_sampling": rs_cfg.model_dump(mode="json"),
                     "sft": sft_cfg.model_dump(mode="json")}
    overlap = tuning_overlap(plan, prm.path, work) if plan.split_seed != 0 else None
    return {"prompts": entry_of(prm), "curve_prompts": entry_of(curve), "start": entry_of(start),
            "start_dir": str(Path(start.path) / MODEL_DIR), "seconds": time.perf_counter() - t0,
            "tuning_overlap": overlap, **cold_info}


def step_prompts(prompts_dir: Path, plan: Plan, seed: int) -> list[list[str]]:
    """The prompt ids of every GRPO step as r1flow's stage picks them with context seed `seed`: TRL reads this list."""
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE
    from stages.training.rollouts import pick_prompts

    rows = [r for r in pq.read_table(Path(prompts_dir) / DATA_FILE, columns=["id", "split", "answer"]).to_pylist()
            if r["split"] == "train" and r["answer"] is not None]
    return [[rows[i]["id"] for i in pick_prompts(len(rows), plan.prompts_per_step, seed, step, 0)]
            for step in range(plan.max_steps)]


# ---------------------------------------------------------------------------- children: training


def train_r1flow(plan: Plan, prep: dict, work: Path, at_step: int | None, algo: str = "grpo", seed: int = SEED,
                 every_step: bool = False, staleness: int = 0) -> dict:
    """r1flow's grpo (or ppo) stage through `run_stage`, as the pipeline runs it, with `max_minutes` as the budget,
    context seed `seed`. `at_step` or `every_step`: the equal-steps snapshot (`Snapshots`). `staleness` K >= 1: grpo's
    asynchronous loop (the r1flow_async side), its `async.*` params (where the learner and the worker ran) and the
    learner's threads in the result."""
    import importlib

    import torch

    from stages.base import LocalContext
    from stages.training.launch import run_stage

    stage = importlib.import_module(f"stages.{algo}")  # the stage module whose policy loading is observed
    cfg = (ppo_config(plan, plan.max_steps, plan.minutes) if algo == "ppo"
           else grpo_config(plan, plan.max_steps, plan.minutes, staleness))
    if cfg.lora.r == 0:
        raise SystemExit("learning.py: LoRA only (snapshots are adapters); pass --lora-r > 0")
    snaps = Snapshots(plan.curve_times(), work / "snapshots", at_step, every_step)
    held: dict = {}
    load_trainable = stage.load_trainable

    def observed_load(*args, **kwargs):  # the policy the stage trains, for the snapshots; changes nothing
        out = load_trainable(*args, **kwargs)
        held["model"], held["t0"] = out[0], time.perf_counter()
        return out

    class Clocked(LocalContext):
        def log_metrics(self, metrics, step=None):
            super().log_metrics(metrics, step)
            if step is not None and "reward/mean" in metrics:
                elapsed = time.perf_counter() - held["t0"]
                curve.append({"step": step, "elapsed_s": elapsed, "reward": metrics["reward/mean"],
                              "accuracy": metrics.get("reward/accuracy"), "step_s": metrics.get("time/step"),
                              **{f"{phase}_s": metrics.get(f"time/{phase}")
                                 for phase in ("generation", "scoring", "training")}})
                snaps.after_step(held["model"], step, elapsed)

    curve: list[dict] = []
    ctx = Clocked(work / "run", seed=seed, device=plan.device)
    stage.load_trainable = observed_load
    try:
        out = run_stage(stage, cfg, {"model": stage_input_of(prep["start"]), "prompts": stage_input_of(prep["prompts"])},
                        ctx)["model"]
    finally:
        stage.load_trainable = load_trainable
    from schemas.artifacts import MODEL_DIR

    extra = {"async": {k: v for k, v in ctx.params.items() if k.startswith("async.")},
             "threads": torch.get_num_threads()} if staleness else {}
    return {"curve": curve, "snapshots": snaps.saved, "steps": len(curve),
            "train_s": curve[-1]["elapsed_s"] if curve else 0.0, "final": str(Path(out.path) / MODEL_DIR),
            "final_kind": out.schema, "config": cfg.model_dump(mode="json"), "seed": seed, **extra}


def train_async(plan: Plan, prep: dict, work: Path, seed: int) -> dict:
    """The r1flow_async side: grpo with async {max_staleness: K, rollout_workers: 1}. "local": the learner here and
    its worker a process beside it, the cores split evenly between the two (R1FLOW_THREADS fixed to that share, so
    other work on the machine cannot move it; a stage registry of this run's own). "ray": this process is the driver
    (learning.py started it inside the loopback cluster's namespace, RAY_ADDRESS set); the learner is a Ray task on
    the `learn` node (one CPU: Ray gives it one thread) and the worker an actor on the `gen` node (the config's
    async.worker_resources). Either way the learner saves the snapshots: its task runs on this machine."""
    from stages.runtime import threads

    if plan.async_placement == "ray":
        return learn_on_ray(plan, prep, work, seed)
    os.environ.setdefault(threads.REGISTRY_VAR, str(work / "registry"))
    os.environ.setdefault(threads.THREADS_VAR, str(threads.thread_share(2, threads.available_cpus())))
    with threads.stage_share():  # the worker process inherits this environment and takes its share likewise
        return train_r1flow(plan, prep, work, None, "grpo", seed, staleness=plan.async_staleness)


def learn_on_ray(plan: Plan, prep: dict, work: Path, seed: int) -> dict:
    """`train_r1flow` as a Ray task on the node offering the `learn` resource, with this process's benchmark
    environment (HF offline, allocator variables) and this checkout importable."""
    import logging

    import ray

    from benchmarks.common import ALLOCATOR_MODES
    from benchmarks.suite import CHILD_ENV

    names = {*CHILD_ENV, *(k for mode in ALLOCATOR_MODES.values() for k in mode)}
    env = {"PYTHONPATH": str(ROOT), **{k: v for k, v in os.environ.items() if k in names}}
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING, runtime_env={"env_vars": env})
    try:
        task = ray.remote(max_retries=0, num_cpus=1, resources={"learn": 1})(train_r1flow)
        return ray.get(task.remote(plan, prep, work, None, "grpo", seed, False, plan.async_staleness))
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- children: evaluation


def materialize(start_dir: str, adapter: str | None, dest: Path) -> Path:
    """An HF directory of the start model with `adapter` folded in (or the start model itself)."""
    if adapter is None:
        return Path(start_dir)
    if (dest / "config.json").exists():
        return dest
    from peft import PeftModel

    from stages.modeling import models

    model, tokenizer = models.load_model(start_dir)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    models.save_model(merged, tokenizer, tmp)
    tmp.rename(dest)
    return dest


def evaluate_jobs(plan: Plan, prep: dict, jobs: list[dict], work: Path) -> dict:
    """r1flow's eval stage for every job {name, dir | adapter, prompts: "prompts" | "curve_prompts"}: per-prompt
    correctness and format, in a fixed prompt order. Each job's result is kept (`evals/<name>/result.json`, written
    whole) with the job and its model's files' sizes and times, so a run resumed after a stop in its evaluation
    (`--resume`; 48 models take most of an hour on 2 cores) evaluates only what it had not, and never reuses a result
    for a model that changed."""
    out = {}
    for job in jobs:
        kept = work / "evals" / job["name"] / "result.json"
        key = {"job": job, "plan": dataclasses.asdict(plan), "model": _files_stamp(job)}
        if kept.exists() and (old := json.loads(kept.read_text())).get("key") == key:
            out[job["name"]] = old["result"]
            print(f"  eval {job['name']}: kept from the stopped run", file=sys.stderr, flush=True)
            continue
        out.update(_evaluate_jobs(plan, prep, [job], work))
        tmp = kept.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "result": out[job["name"]]}))
        tmp.rename(kept)
    return out


def _files_stamp(job: dict) -> list:
    """(name, size, mtime_ns) of every file of a job's model directory or adapter: a retrained model differs."""
    root = Path(job.get("dir") or job["adapter"])
    files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
    return sorted([str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files)


def _evaluate_jobs(plan: Plan, prep: dict, jobs: list[dict], work: Path) -> dict:
    import pyarrow.parquet as pq

    from benchmarks.common import stage_input
    from schemas.artifacts import DATA_FILE, MODEL_DIR
    from schemas.configs import EvalConfig
    from stages import eval as eval_stage
    from stages.base import LocalContext, Output
    from stages.training.launch import run_stage

    out = {}
    for job in jobs:
        model_dir = Path(job["dir"]) if job.get("dir") else materialize(prep["start_dir"], job["adapter"],
                                                                          work / "models" / job["name"] / MODEL_DIR)
        n = plan.eval_prompts + plan.transfer_prompts if job["prompts"] == "prompts" else plan.curve_prompts
        cfg = EvalConfig(max_prompts=n, max_new_tokens=plan.max_new_tokens, batch_size=plan.eval_batch, pass_k=0)
        t0 = time.perf_counter()
        ctx = LocalContext(work / "evals" / job["name"], seed=SEED, device=plan.device)
        model = stage_input(Output("model", "model", model_dir.parent))
        res = run_stage(eval_stage, cfg, {"model": model, "prompts": stage_input_of(prep[job["prompts"]])}, ctx)["results"]
        rows = pq.read_table(Path(res.path) / DATA_FILE, columns=["prompt_id", "task", "correct", "format_ok",
                                                                 "num_tokens"]).to_pylist()
        rows.sort(key=lambda r: r["prompt_id"])
        out[job["name"]] = {"rows": rows, "seconds": time.perf_counter() - t0}
        print(f"  eval {job['name']}: {sum(bool(r['correct']) for r in rows)}/{len(rows)} correct", file=sys.stderr,
              flush=True)
    return out


# ---------------------------------------------------------------------------- child entry


def learning_child_main(args: argparse.Namespace) -> None:
    import torch

    plan = Plan(**json.loads(Path(args.plan).read_text()))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prep = json.loads(Path(args.prep).read_text()) if args.prep else None
    if args.child == "prep":
        result = prepare_start_and_prompts(plan, work)
    elif args.child in ("r1flow", "r1flow_ppo"):
        result = train_r1flow(plan, prep, work, args.at_step, "ppo" if args.child == "r1flow_ppo" else "grpo",
                              args.seed, bool(args.every_step))
    elif args.child == "r1flow_async":
        result = train_async(plan, prep, work, args.seed)
    elif args.child == "trl":
        from benchmarks import trl_side

        order = step_prompts(Path(prep["prompts"]["path"]), plan, args.seed)
        result = trl_side.run_grpo_learning(plan, prep, work, args.seed, order)
    elif args.child == "eval":
        result = evaluate_jobs(plan, prep, json.loads(Path(args.jobs).read_text()), work)
    else:
        raise SystemExit(f"unknown child {args.child}")
    result.setdefault("threads", torch.get_num_threads())  # r1flow_async: the learner's (a Ray task's, on a cluster)
    Path(args.result).write_text(json.dumps(result))
    print(RESULT_MARK + args.result, flush=True)
