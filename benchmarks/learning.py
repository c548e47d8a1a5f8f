"""Learning efficacy, r1flow vs TRL: how much better GRPO makes one model, at equal steps and at equal wall-clock.

    make learn                                   # SmolLM2-135M, 10 minutes a side on the CPU, 3 seeds (1 h 15 min)
    make learn ARGS="--minutes 20"               # the RESULTS run: 20 minutes a side (~2 h 25 min)
    make learn ARGS="--minutes 5 --device cuda"  # a lent GPU
    make learn ARGS="--seeds 1"                  # one seed a side (intervals over prompts only)
    make learn ARGS="--algo grpo,ppo"             # adds r1flow's PPO on the same budget (row "r1flow PPO")
    make learn ARGS="--resume .r1flow/learning/run-20261128-062000"   # go on with a stopped run's seeds
    .venv/bin/python benchmarks/learning.py --model tiny --quick --sides r1flow   # the CI smoke run

What it does, each part in its own process under one environment (`suite.child_env`: the same threads,
allocator variables and offline flags for every child):

1. **Start model** (`prep`, cached in the work dir by its settings): SmolLM2-135M-Instruct after a short
   R1-format cold start made by r1flow's own stages: `rejection_sampling` (read leniently, rewritten into
   <think>/<answer>) and a LoRA `sft`, merged. Both sides and all seeds start from this HF directory.
2. **Task**: reasoning-gym `basic_arithmetic` (train and held-out prompts) at `--task` difficulty, and
   `chain_sum` as a transfer task nothing trains on. `--split-seed` draws the prompts, their train/held-out split
   and the cold start: 0 is the tuning split (the difficulty and 8 prompts a step were chosen on its held-out
   prompts), the default 1 a fresh one no choice saw; the report counts the held-out prompts the two share.
3. **GRPO on both sides**, `--seeds` training seeds each (default 3), with the same hyper-parameters (`Plan`:
   reward, group size, prompts per step, max tokens, temperature, learning rate, LoRA, beta, advantages divided
   by the group's sample std as TRL's GRPOTrainer does, and for seed k the same prompts in the same order) for
   `--minutes` of training each (model loading excluded on both: the clock starts when the trainer
   starts its first step; a side stops after the first step that ends past the budget). The sides take turns
   to run first (seed k: r1flow first for even k, TRL for odd k). r1flow keeps its policy after as many steps as
   TRL's run of the same seed took (equal steps; when r1flow ran first it saved every step and keeps that one)
   and runs on to the budget (equal wall-clock). Both save snapshots at fixed fractions of the budget for the
   learning curve, and time each step's generation, scoring and training.
4. **One evaluator** for every model, r1flow's `eval` stage: greedy, strict accuracy (the answer in the
   <answer> block) and format rate, on `--eval-prompts` held-out basic_arithmetic prompts and
   `--transfer-prompts` chain_sum prompts; snapshots on the first `--curve-prompts` of them.
5. **Statistics** (`stages/math/stats.py`): the mean over seeds of each kind of model, every interval from a
   bootstrap that resamples the seeds and the prompts (one prompt draw shared by every seed and both sides,
   seed k of r1flow paired with seed k of TRL). The headline is the paired difference r1flow's gain minus
   TRL's at equal wall-clock, and their ratio with its interval, reported unbounded when TRL's gain interval
   reaches 0. The equal-steps check is two-sided: a difference beyond the noise either way says "investigate".
6. `--trl-set KEY=VALUE` (TRL's GRPOConfig, TRL's side only) and `--r1flow-set` (r1flow's) make the sensitivity
   rows: e.g. TRL with the whole step in one per-device batch, or bf16 on a CPU with AMX (a setting that helps one
   side is offered to both, `benchmarks/trl_settings.py --side r1flow`; on the RESULTS machine bf16 speeds TRL up
   and slows r1flow down, so that row is `--trl-set bf16=true` against r1flow in fp32); the report lists each
   side's own settings.
   `--r1flow-from RUN` (or `--trl-from RUN`) reuses an earlier run's trained and evaluated side of the same plan,
   so a sensitivity row trains only the side that changed, against the very same runs of the other.
7. Each side of each seed, once trained, is kept in the run directory (`seed<k>/<side>.json`, written whole):
   `--resume RUN` goes on with a run that stopped (killed, or a session that ended) on the same plan, training only
   the sides not kept, so three seeds need not fit one sitting; every model is evaluated at the end. With a larger
   `--seeds` it adds seeds to a finished run (e.g. a one-seed sensitivity row grown to three).
8. A table (stdout and `--markdown`), one row a seed, the seconds a step by phase, the raw numbers (`--json`,
   default in the work dir) and a plot of held-out accuracy and training reward against wall-clock minutes for
   both sides (`--plot`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import CACHE_DIR, MODEL_REFS, SEED, Snapshots, ensure_model_dir  # noqa: E402

RESULT_MARK = "LEARN-RESULT "
SIDES = ("trl", "r1flow", "r1flow_ppo")  # r1flow_ppo: `--algo ppo`, r1flow's ppo stage on the same plan
TASK = "basic_arithmetic"
TRANSFER = "chain_sum"
GAIN_TARGET = 2.0  # r1flow's held-out gain at equal wall-clock over TRL's (issue 26)


@dataclass
class Plan:
    """Everything both sides share, and what the start model and the prompts are made of."""

    model: str = "smollm2"
    device: str = "cpu"
    # 10 minutes a side on a CPU, so that 3 seeds x 2 sides fit 90 minutes with the evaluation (issue 47). The
    # 20-minute run's curves (RESULTS.md, 2026-11-28): TRL's held-out gain is flat from 10 minutes on (+10.7, +10.9,
    # +10.7 at 10, 15, 20), r1flow's rises until 15 (+17.2, +23.7, +22.9): 10 minutes understates r1flow's gain, not
    # TRL's. `--minutes 20` is that run.
    minutes: float = 10.0
    max_steps: int = 2000  # a cap; the budget ends a run first
    # the task: reasoning-gym options of basic_arithmetic (train + held out) and chain_sum (held out only)
    # one-digit operands, no negation: the cold-started SmolLM2 scored 32% on 96 such held-out prompts (2 terms, 1-2
    # digits with negation: 13%; without negation: 19%; + and - only, 2 digits: 9%); 1,062 distinct prompts exist
    task: dict = field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                "allow_negation": False})
    transfer: dict = field(default_factory=lambda: {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2})
    train_prompts: int = 768
    eval_prompts: int = 256
    transfer_prompts: int = 256
    curve_prompts: int = 128
    curve_points: int = 3  # snapshots at 1/(n+1) .. n/(n+1) of the budget
    seeds: int = 3  # training seeds a side (SEED, SEED + 1, ...): prompt order, sampling, LoRA initialisation
    # the seed of the prompts' draw, their train/held-out split and the cold start's sampling. 0 is the tuning split:
    # the task's difficulty and 8 prompts a step were chosen on its held-out prompts (RESULTS.md, 2026-11-26), so the
    # default reports on split 1, which no choice in this file saw (issue 47)
    split_seed: int = 1
    # the cold start (0 steps: the imported model is the start, e.g. the tiny random model)
    cold_prompts: int = 256
    cold_samples: int = 4
    cold_steps: int = 40
    cold_learning_rate: float = 1e-3
    # GRPO hyper-parameters, both sides. 8 prompts a step: at 4, 20 minutes left r1flow (114 steps) and TRL (35)
    # on the same plateau, +8.2 and +7.4 points (1.11x); at 8 both take the larger batch, r1flow 56 steps and
    # TRL 12, +12.9 and +3.9 points (benchmarks/RESULTS.md, 2026-11-26)
    prompts_per_step: int = 8
    group_size: int = 8
    minibatch_size: int = 16
    max_new_tokens: int = 96
    temperature: float = 1.0
    learning_rate: float = 2e-4
    lora_r: int = 16
    beta: float = 0.0
    reward: dict = field(default_factory=lambda: {"weights": {"accuracy": 1.0, "format": 0.5}})
    eval_batch: int = 64
    # r1flow-only settings beyond the shared ones (GRPOConfig fields), reported with the results
    r1flow_extra: dict = field(default_factory=dict)
    # TRL-only GRPOConfig fields (`--trl-set`): the sensitivity row, TRL at the settings a TRL user on this machine
    # would try (e.g. per_device_train_batch_size = the whole step, bf16 on a CPU with AMX), reported with the results
    trl_extra: dict = field(default_factory=dict)

    def prep_key(self) -> str:
        keys = ("model", "task", "transfer", "train_prompts", "eval_prompts", "transfer_prompts", "curve_prompts",
                "cold_prompts", "cold_samples", "cold_steps", "cold_learning_rate", "max_new_tokens", "split_seed")
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def budget_s(self) -> float:
        return 60.0 * self.minutes

    def curve_times(self) -> list[float]:
        return [self.budget_s() * (i + 1) / (self.curve_points + 1) for i in range(self.curve_points)]


QUICK = {"seeds": 2, "minutes": 0.1, "max_steps": 200, "train_prompts": 32, "eval_prompts": 8, "transfer_prompts": 8,
         "curve_prompts": 4, "curve_points": 1, "cold_steps": 0, "prompts_per_step": 2, "group_size": 2,
         "minibatch_size": 4, "max_new_tokens": 8, "eval_batch": 8}


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


def grpo_config(plan: Plan, steps: int, max_minutes: float):
    """r1flow's GRPOConfig on the plan. std "sample": TRL's GRPOTrainer divides a group's centred rewards by
    torch.std (ddof 1), so r1flow does the same here (its default is the population std)."""
    from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec, RewardSpec

    shared = dict(steps=steps, prompts_per_step=plan.prompts_per_step, group_size=plan.group_size,
                  generation=GenerationSpec(max_new_tokens=plan.max_new_tokens, temperature=plan.temperature, top_p=1.0,
                                            top_k=0, batch_size=plan.prompts_per_step),
                  reward=RewardSpec(**plan.reward), lora=LoraSpec(r=plan.lora_r, alpha=2 * plan.lora_r),
                  minibatch_size=plan.minibatch_size, mu=1, beta=plan.beta, advantage="grpo", std="sample",
                  aggregation="seq_mean", learning_rate=plan.learning_rate, checkpoint_every=100_000,
                  max_minutes=max_minutes)
    return GRPOConfig(**{**shared, **plan.r1flow_extra})


def ppo_config(plan: Plan, steps: int, max_minutes: float):
    """r1flow's ppo stage on GRPO's budget: as many completions a step (prompts x group_size, as grpo's), one optimizer step over all of them a rollout (GRPO's mu=1; passes of GRPO's minibatch_size
    sequences), the same KL coefficient (here a penalty in the per-token rewards), reward, LoRA and learning rate;
    the critic is a LoRA copy of the policy at a tenth of the learning rate (the cpu profile's ratio: see its ppo
    block)."""
    from schemas.configs import GenerationSpec, LoraSpec, PPOConfig, RewardSpec

    return PPOConfig(steps=steps, prompts_per_step=plan.prompts_per_step, group_size=plan.group_size,
                     generation=GenerationSpec(max_new_tokens=plan.max_new_tokens, temperature=plan.temperature,
                                               top_p=1.0, top_k=0, batch_size=plan.prompts_per_step),
                     reward=RewardSpec(**plan.reward), lora=LoraSpec(r=plan.lora_r, alpha=2 * plan.lora_r),
                     critic_lora=LoraSpec(r=plan.lora_r, alpha=2 * plan.lora_r),
                     minibatch_size=plan.prompts_per_step * plan.group_size, micro_batch_size=plan.minibatch_size,
                     mu=1, beta=plan.beta, learning_rate=plan.learning_rate,
                     critic_learning_rate=plan.learning_rate / 10, checkpoint_every=100_000,
                     max_minutes=max_minutes)


def train_r1flow(plan: Plan, prep: dict, work: Path, at_step: int | None, algo: str = "grpo", seed: int = SEED,
                 every_step: bool = False) -> dict:
    """r1flow's grpo (or ppo) stage through `run_stage`, as the pipeline runs it, with `max_minutes` as the budget,
    context seed `seed`. `at_step` or `every_step`: the equal-steps snapshot (`Snapshots`)."""
    import importlib

    from stages.base import LocalContext
    from stages.training.launch import run_stage

    stage = importlib.import_module(f"stages.{algo}")  # the stage module whose policy loading is observed
    cfg = (ppo_config if algo == "ppo" else grpo_config)(plan, plan.max_steps, plan.minutes)
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
    stage.load_trainable = observed_load
    try:
        out = run_stage(stage, cfg, {"model": stage_input_of(prep["start"]), "prompts": stage_input_of(prep["prompts"])},
                        Clocked(work / "run", seed=seed, device=plan.device))["model"]
    finally:
        stage.load_trainable = load_trainable
    from schemas.artifacts import MODEL_DIR

    return {"curve": curve, "snapshots": snaps.saved, "steps": len(curve),
            "train_s": curve[-1]["elapsed_s"] if curve else 0.0, "final": str(Path(out.path) / MODEL_DIR),
            "final_kind": out.schema, "config": cfg.model_dump(mode="json"), "seed": seed}


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
    correctness and format, in a fixed prompt order."""
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
    elif args.child == "trl":
        from benchmarks import trl_side

        order = step_prompts(Path(prep["prompts"]["path"]), plan, args.seed)
        result = trl_side.run_grpo_learning(plan, prep, work, args.seed, order)
    elif args.child == "eval":
        result = evaluate_jobs(plan, prep, json.loads(Path(args.jobs).read_text()), work)
    else:
        raise SystemExit(f"unknown child {args.child}")
    result["threads"] = torch.get_num_threads()
    Path(args.result).write_text(json.dumps(result))
    print(RESULT_MARK + args.result, flush=True)


def run_learning_child(what: str, plan_file: Path, work: Path, log: Path, allocator: str, quiet_wait: float = 0.0,
                       **extra) -> dict:
    from benchmarks.suite import _children_cpu, child_env, cpu_busy_seconds, wait_until_quiet

    result_file = work / f"{what}-result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what, "--plan", str(plan_file), "--work", str(work),
           "--result", str(result_file)]
    for key, value in extra.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if quiet_wait > 0:
        wait_until_quiet(quiet_wait)
    busy0, own0 = cpu_busy_seconds(), _children_cpu()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(allocator))
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_busy_seconds(), _children_cpu()
    if proc.returncode or not result_file.exists():
        raise SystemExit(f"learning.py: the {what} process failed (exit {proc.returncode}); its log, {log}:\n"
                         + log.read_text()[-3000:])
    result = json.loads(result_file.read_text())
    result["wall_s"] = wall
    result["foreign_cpu"] = None if busy0 is None or busy1 is None else max(
        0.0, (busy1 - busy0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))
    return result


# ---------------------------------------------------------------------------- statistics and the table (pure)


ROW_KINDS = (("trl", "end", "TRL, budget"), ("r1flow", "equal_steps", "r1flow, TRL's steps"),
             ("r1flow", "end", "r1flow, budget"), ("r1flow_ppo", "end", "r1flow PPO, budget"))
PHASES = ("generation", "scoring", "training")


def eval_name(side: str, what: str, seed_index: int) -> str:
    """The evaluation of one side's model `what` ("end", "equal_steps", "t1", ...) of its `seed_index`-th seed."""
    return f"{side}_{what}_s{seed_index}"


def run_order(sides: list[str], seed_index: int) -> list[str]:
    """Which side trains first for a seed: r1flow for even seed indices, TRL for odd ones, any other side after
    them; a side that always ran first (or last) would carry whatever the machine does over an hour."""
    pair = [s for s in ("r1flow", "trl") if s in sides]
    if seed_index % 2:
        pair.reverse()
    return pair + [s for s in sides if s not in pair]


def correct_vector(rows: list[dict], task: str) -> list[float]:
    return [float(bool(r["correct"])) for r in rows if r["task"] == task]


def prompt_ids(rows: list[dict], task: str) -> list[str]:
    return [r["prompt_id"] for r in rows if r["task"] == task]


def scores(evals: dict, names: list[str], task: str) -> np.ndarray:
    """(len(names), P): the evaluations' per-prompt correctness on `task`, after checking that every one scored the
    same prompt ids in the same order as the first (ValueError naming the first difference otherwise)."""
    ids = prompt_ids(evals[names[0]]["rows"], task)
    for name in names[1:]:
        other = prompt_ids(evals[name]["rows"], task)
        if other != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b), min(len(ids), len(other)))
            raise ValueError(f"{task}: {name} scored other prompts than {names[0]} ({len(other)} against {len(ids)}; "
                             f"first difference at position {at}: {other[at] if at < len(other) else 'none'} against "
                             f"{ids[at] if at < len(ids) else 'none'}): a paired comparison needs the same prompts")
    return np.array([correct_vector(evals[name]["rows"], task) for name in names], dtype=np.float64)


def accuracy_entry(rows: list[dict], task: str) -> dict:
    from stages.math.stats import bootstrap_ci

    v = correct_vector(rows, task)
    lo, hi = bootstrap_ci(v)
    fmt = [float(bool(r["format_ok"])) for r in rows if r["task"] == task]
    return {"accuracy": sum(v) / len(v) if v else float("nan"), "ci": [lo, hi], "n": len(v),
            "format_rate": sum(fmt) / len(fmt) if fmt else float("nan")}


def gain_entry(start_rows: list[dict], rows: list[dict], task: str) -> dict:
    """Gain over the start on the same prompts (one model), with a paired bootstrap interval over the prompts."""
    d = paired_diff({"a": {"rows": start_rows}, "b": {"rows": rows}}, "a", "b", task)
    return {"gain": d["diff"], "ci": d["ci"]}


def paired_diff(evals: dict, base: str, other: str, task: str = TASK) -> dict:
    """`other` minus `base` in accuracy on `task`, one model each, with its paired bootstrap interval over the
    prompts; ValueError unless both scored the same prompt ids in the same order."""
    from stages.math.stats import paired_bootstrap_diff

    a, b = scores(evals, [base, other], task)
    diff, lo, hi = paired_bootstrap_diff(a, b)
    return {"diff": diff, "ci": [lo, hi]}


def seeds_entry(evals: dict, start: str, names: list[str], task: str) -> dict:
    """Mean accuracy on `task` of the models `names` (one a seed) and their gain over the start model, intervals
    over seeds and prompts (`stages.math.stats.seed_prompt_means`)."""
    from stages.math.stats import percentile_interval, seed_prompt_diff, seed_prompt_means

    x = scores(evals, [start, *names], task)
    end = x[1:]
    if end.shape[1] == 0:  # nothing of this task was evaluated
        nan = float("nan")
        return {"accuracy": nan, "ci": [nan, nan], "n": 0, "seeds": len(names), "format_rate": nan,
                "gain": {"gain": nan, "ci": [nan, nan]}}
    gain, glo, ghi = seed_prompt_diff(np.broadcast_to(x[0], end.shape), end)
    fmt = [float(bool(r["format_ok"])) for n in names for r in evals[n]["rows"] if r["task"] == task]
    return {"accuracy": float(end.mean()), "ci": list(percentile_interval(seed_prompt_means(end[None])[:, 0])),
            "n": end.shape[1], "seeds": len(names), "format_rate": sum(fmt) / len(fmt),
            "gain": {"gain": gain, "ci": [glo, ghi]}}


def equal_time_verdict(c: dict) -> str:
    """r1flow against TRL at equal wall-clock, from `compare_gains` (a = TRL, b = r1flow): "MISSED" unless the
    difference's interval is above 0; then "undetermined" when TRL's gain interval reaches 0 (the ratio has no
    bounded interval: a TRL that barely learns must not make any ratio look won), else "met" when the ratio is at
    least GAIN_TARGET, "MISSED" otherwise."""
    if c["diff_ci"][0] <= 0:
        return "MISSED"
    if c["ratio"] is None or c["ratio_ci"] is None:
        return "undetermined"
    return "met" if c["ratio"] >= GAIN_TARGET else "MISSED"


def equal_steps_at(run: dict) -> int | None:
    """The step of a run's equal-steps snapshot, None when it has none."""
    return next((snap["step"] for snap in run["snapshots"] if snap["name"] == "equal_steps"), None)


def phase_means(runs: list[dict]) -> dict | None:
    """Mean seconds a step by phase (generation, scoring, training, total) over the steps after the first (the
    warm-up) of every seed's run; None when the runs did not record phases."""
    steps = [c for run in runs for c in run["curve"][1:]]
    if not steps or any(c.get(f"{p}_s") is None for c in steps for p in PHASES):
        return None
    out = {p: float(np.mean([c[f"{p}_s"] for c in steps])) for p in PHASES}
    out["total"] = float(np.mean([c["step_s"] for c in steps]))
    out["steps"] = len(steps)
    return out


def summarize_learning(plan: Plan, evals: dict, runs: dict) -> dict:
    """The rows of the table and the verdicts. runs: side -> one run a seed, in seed order; evals: "start" and
    `eval_name(side, what, k)`. Every pooled accuracy, gain and difference has an interval over seeds and prompts,
    each seed's own row one over prompts."""
    from stages.math.stats import compare_gains, seed_prompt_diff, two_sided

    start = evals["start"]["rows"]
    rows = [{"name": "start", "label": "start model", "steps": [0], "minutes": [0.0],
             "task": accuracy_entry(start, TASK), "transfer": accuracy_entry(start, TRANSFER), "gain": None,
             "transfer_gain": None, "per_seed": []}]
    for side, what, label in ROW_KINDS:
        ks = [k for k in range(len(runs.get(side, []))) if eval_name(side, what, k) in evals]
        if not ks:
            continue
        names = [eval_name(side, what, k) for k in ks]
        if what == "end":
            at = [(runs[side][k]["steps"], runs[side][k]["train_s"]) for k in ks]
        else:
            at = [next((snap["step"], snap["elapsed_s"]) for snap in runs[side][k]["snapshots"] if snap["name"] == what)
                  for k in ks]
        task, transfer = seeds_entry(evals, "start", names, TASK), seeds_entry(evals, "start", names, TRANSFER)
        per_seed = [{"seed": runs[side][k]["seed"], "first": runs[side][k].get("first"), "steps": steps,
                     "minutes": secs / 60, "task": accuracy_entry(evals[n]["rows"], TASK),
                     "gain": gain_entry(start, evals[n]["rows"], TASK)}
                    for k, n, (steps, secs) in zip(ks, names, at, strict=True)]
        rows.append({"name": f"{side}_{what}", "label": label, "steps": [a[0] for a in at],
                     "minutes": [a[1] / 60 for a in at], "task": task, "transfer": transfer,
                     "gain": task.pop("gain"), "transfer_gain": transfer.pop("gain"), "per_seed": per_seed})
    out = {"rows": rows, "seeds": plan.seeds, "std": grpo_config(plan, 1, plan.minutes).std,
           "r1flow_only": dict(plan.r1flow_extra), "trl_only": dict(plan.trl_extra)}

    def both(side_a: str, what_a: str, side_b: str, what_b: str) -> tuple[list[int], list[str], list[str]]:
        """The seed indices evaluated on both sides, and their evaluations' names on each."""
        n = min(len(runs.get(side_a, [])), len(runs.get(side_b, [])))
        ks = [k for k in range(n) if eval_name(side_a, what_a, k) in evals and eval_name(side_b, what_b, k) in evals]
        return ks, [eval_name(side_a, what_a, k) for k in ks], [eval_name(side_b, what_b, k) for k in ks]

    _, trl, r1 = both("trl", "end", "r1flow", "end")
    if trl:  # the headline: gains at equal wall-clock, seed k of one side paired with seed k of the other
        x = scores(evals, ["start", *trl, *r1], TASK)
        c = dataclasses.asdict(compare_gains(x[0], x[1:1 + len(trl)], x[1 + len(trl):]))
        c["seeds"] = len(trl)
        c["verdict"] = equal_time_verdict(c)
        out["equal_time"] = c
    seed_ks, trl, r1 = both("trl", "end", "r1flow", "equal_steps")
    # an r1flow run reused (--r1flow-from) kept its equal-steps point at the earlier TRL run's step count: a pair only
    # where that point is this TRL run's step count
    matched = [i for i, k in enumerate(seed_ks) if equal_steps_at(runs["r1flow"][k]) == runs["trl"][k]["steps"]]
    if len(matched) < len(trl):
        out["equal_steps_unmatched"] = [{"seed": runs["trl"][k]["seed"], "trl_steps": runs["trl"][k]["steps"],
                                         "r1flow_step": equal_steps_at(runs["r1flow"][k])}
                                        for i, k in enumerate(seed_ks) if i not in matched]
    trl, r1 = [trl[i] for i in matched], [r1[i] for i in matched]
    if trl:  # the correctness check: the same algorithm for the same steps should learn the same
        x = scores(evals, [*trl, *r1], TASK)
        diff, lo, hi = seed_prompt_diff(x[: len(trl)], x[len(trl):])
        out["equal_steps"] = {"diff": diff, "ci": [lo, hi], "seeds": len(trl), "verdict": two_sided(lo, hi)}
    _, grpo, ppo = both("r1flow", "end", "r1flow_ppo", "end")
    if grpo:
        x = scores(evals, [*grpo, *ppo], TASK)
        diff, lo, hi = seed_prompt_diff(x[: len(grpo)], x[len(grpo):])
        out["ppo_minus_grpo"] = {"diff": diff, "ci": [lo, hi], "seeds": len(grpo)}
    out["phases"] = {side: phase_means(rs) for side, rs in runs.items()}
    return out


def pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


def with_ci(value: float, ci: list[float], signed: bool = False) -> str:
    head = f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}%"
    return f"{head} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if signed else f"{head} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def listed(values: list, fmt: str = "{}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def table(summary: dict) -> list[str]:
    lines = ["| model | RL steps (each seed) | training min (each seed) | basic_arithmetic (held out) | gain over start "
             "| format rate | chain_sum (transfer) | transfer gain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        gain = with_ci(r["gain"]["gain"], r["gain"]["ci"], signed=True) if r["gain"] else "-"
        tgain = with_ci(r["transfer_gain"]["gain"], r["transfer_gain"]["ci"], signed=True) if r["transfer_gain"] else "-"
        lines.append(f"| {r['label']} | {listed(r['steps'])} | {listed(r['minutes'], '{:.1f}')} | "
                     f"{with_ci(r['task']['accuracy'], r['task']['ci'])} | {gain} | {pct(r['task']['format_rate'])} | "
                     f"{with_ci(r['transfer']['accuracy'], r['transfer']['ci'])} | {tgain} |")
    return lines


def seed_table(summary: dict) -> list[str]:
    """Each seed's models: its run order, steps, accuracy and gain (intervals over prompts only)."""
    lines = ["| model | seed | ran first | RL steps | training min | basic_arithmetic (held out) | gain over start |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        for e in r["per_seed"]:
            first = {True: "yes", False: "no", None: "-"}[e["first"]]
            lines.append(f"| {r['label']} | {e['seed']} | {first} | {e['steps']} | {e['minutes']:.1f} | "
                         f"{with_ci(e['task']['accuracy'], e['task']['ci'])} | "
                         f"{with_ci(e['gain']['gain'], e['gain']['ci'], signed=True)} |")
    return lines


def phase_lines(summary: dict) -> list[str]:
    lines = ["| side | steps | generation s | scoring s | training s | step s |", "|---|---|---|---|---|---|"]
    for side, p in summary.get("phases", {}).items():
        if p:
            lines.append(f"| {side} | {p['steps']} | {p['generation']:.1f} | {p['scoring']:.2f} | {p['training']:.1f} | "
                         f"{p['total']:.1f} |")
    return lines if len(lines) > 2 else []


def points(d: dict) -> str:
    return f"{100 * d['diff']:+.1f} points [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]"


def verdict_lines(summary: dict) -> list[str]:
    out = []
    et = summary.get("equal_time")
    if et:
        out.append(f"- equal wall-clock, {et['seeds']} seed(s) a side: r1flow's gain minus TRL's "
                   f"{points({'diff': et['diff'], 'ci': et['diff_ci']})} (paired; interval over seeds and prompts); "
                   f"gains: r1flow {with_ci(et['gain_b'], et['gain_b_ci'], signed=True)}, TRL "
                   f"{with_ci(et['gain_a'], et['gain_a_ci'], signed=True)}")
        if et["ratio"] is None:
            ratio = "no ratio: TRL's gain is not above 0"
        elif et["ratio_ci"] is None:
            ratio = (f"{et['ratio']:.2f}x TRL's gain, its interval unbounded: TRL's gain interval reaches 0, so the "
                     "ratio could be anything above the point; read the difference")
        else:
            lo, hi = et["ratio_ci"]
            ratio = (f"{et['ratio']:.2f}x TRL's gain [{lo:.2f}, {hi:.2f}]"
                     + (f", at least {GAIN_TARGET:g}x beyond the noise" if lo >= GAIN_TARGET else ""))
        out.append(f"- equal wall-clock: {ratio}. Target (>= {GAIN_TARGET:g}x, difference's interval above 0): "
                   + {"met": "met", "MISSED": "MISSED",
                      "undetermined": "undetermined (the difference is above 0, the ratio unbounded)"}[et["verdict"]])
    eq = summary.get("equal_steps")
    if eq:
        verdict = {"same": "the same beyond the noise: pass",
                   "higher": "r1flow HIGHER beyond the noise: INVESTIGATE (the same algorithm for the same steps "
                             "should learn the same; a difference either way is a discrepancy, not a win)",
                   "lower": "r1flow LOWER beyond the noise: INVESTIGATE (the same algorithm for the same steps "
                            "should learn the same)"}[eq["verdict"]]
        out.append(f"- equal steps, {eq['seeds']} seed(s): r1flow minus TRL {points(eq)} (two-sided): {verdict}")
        if summary.get("r1flow_only"):
            out.append(f"  (r1flow ran with {json.dumps(summary['r1flow_only'])} and TRL without: equal steps are not "
                       "equal work here, so this is not the correctness check; a run without --r1flow-set is)")
    if unmatched := summary.get("equal_steps_unmatched"):
        out.append("- equal steps: not checked for seed(s) " + listed([u["seed"] for u in unmatched]) + ": r1flow's "
                   "equal-steps point (step " + listed([u["r1flow_step"] for u in unmatched]) + ") is from another TRL "
                   "run than this one (" + listed([u["trl_steps"] for u in unmatched]) + " steps): r1flow reused with "
                   "--r1flow-from; the run it came from has the check")
    pg = summary.get("ppo_minus_grpo")
    if pg:
        out.append(f"- equal wall-clock, r1flow: PPO minus GRPO {points(pg)} (paired, {pg['seeds']} seed(s))")
    return out


# ---------------------------------------------------------------------------- the plot


def curve_ids(prep: dict) -> set[str]:
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE

    return set(pq.read_table(Path(prep["curve_prompts"]["path"]) / DATA_FILE, columns=["id"]).column("id").to_pylist())


def plot(path: Path, plan: Plan, prep: dict, evals: dict, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stages.math.stats import bootstrap_ci

    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"r1flow": "tab:blue", "trl": "tab:orange", "r1flow_ppo": "tab:green"}
    ids = curve_ids(prep)  # the start and end models' full evaluations include these prompts: read them there
    start = [r for r in evals["start"]["rows"] if r["prompt_id"] in ids]
    for side, side_runs in runs.items():
        for k, run in enumerate(side_runs):
            label = side if k == 0 else None  # one legend entry a side; its seeds share its colour
            curve_points = [(0.0, correct_vector(start, TASK))]
            for snap in run["snapshots"]:
                if snap["name"].startswith("t"):
                    rows = evals[eval_name(side, snap["name"], k)]["rows"]
                    curve_points.append((snap["elapsed_s"] / 60, correct_vector(rows, TASK)))
            end = [r for r in evals[eval_name(side, "end", k)]["rows"] if r["prompt_id"] in ids]
            curve_points.append((run["train_s"] / 60, correct_vector(end, TASK)))
            xs = [x for x, _ in curve_points]
            ys = [100 * sum(v) / len(v) for _, v in curve_points]
            cis = [bootstrap_ci(v) for _, v in curve_points]
            err = [[y - 100 * lo for y, (lo, _) in zip(ys, cis, strict=True)],
                   [100 * hi - y for y, (_, hi) in zip(ys, cis, strict=True)]]
            ax_acc.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[side], alpha=0.8, label=label)
            ts = [c["elapsed_s"] / 60 for c in run["curve"]]
            rs = [c["reward"] for c in run["curve"]]
            w = max(1, len(rs) // 15)  # a running mean over ~1/15 of the run
            smooth = [sum(rs[max(0, i - w + 1): i + 1]) / len(rs[max(0, i - w + 1): i + 1]) for i in range(len(rs))]
            ax_rew.plot(ts, rs, ".", alpha=0.2, color=colors[side])
            ax_rew.plot(ts, smooth, "-", color=colors[side],
                        label=f"{side} ({', '.join(str(len(r['curve'])) for r in side_runs)} steps)" if label else None)
    ax_acc.set(xlabel="training wall-clock (min)", ylabel=f"held-out {TASK} accuracy (%)",
               title=f"greedy, first {plan.curve_prompts} held-out prompts, 95% CI")
    ax_rew.set(xlabel="training wall-clock (min)", ylabel="mean training reward",
               title=f"training reward, {plan.prompts_per_step} prompts x {plan.group_size} completions a step")
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- the parent


def parse_set(items: list[str], flag: str = "--r1flow-set") -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def check_trl_extra(extra: dict) -> None:
    """Before any compute: every --trl-set key is a field of TRL's GRPOConfig (where TRL is installed; the children
    that run TRL always have it)."""
    if not extra or importlib.util.find_spec("trl") is None:
        return
    from trl import GRPOConfig

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    if unknown := sorted(set(extra) - known):
        raise ValueError(f"--trl-set: {', '.join(unknown)} is not a field of TRL's GRPOConfig")


def build_plan(args: argparse.Namespace) -> Plan:
    plan = Plan(model=args.model, device=args.device)
    if args.device.startswith("cuda"):
        plan.minutes = 5.0
    if args.quick:
        plan = dataclasses.replace(plan, **QUICK)
    for name in ("seeds", "split_seed", "minutes", "max_steps", "eval_prompts", "transfer_prompts", "curve_prompts", "curve_points",
                 "cold_steps", "prompts_per_step", "group_size", "max_new_tokens", "temperature", "learning_rate",
                 "lora_r", "beta"):
        value = getattr(args, name)
        if value is not None:
            setattr(plan, name, value)
    if args.task:
        plan.task = json.loads(args.task)
    if args.reward:
        plan.reward = json.loads(args.reward)
    plan.r1flow_extra = parse_set(args.r1flow_set)
    plan.trl_extra = parse_set(args.trl_set, "--trl-set")
    check_trl_extra(plan.trl_extra)
    if plan.seeds < 1:
        raise ValueError(f"seeds: at least 1 training seed a side, got {plan.seeds}")
    grpo_config(plan, plan.max_steps, plan.minutes)  # bad settings fail here, before any compute
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=sorted(MODEL_REFS))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda: 5 minutes a side by default)")
    ap.add_argument("--sides", default="trl,r1flow", help="comma list of trl,r1flow,r1flow_ppo")
    ap.add_argument("--algo", default="grpo", help="r1flow's algorithm(s), comma list of grpo,ppo: ppo adds the side "
                    "r1flow_ppo (r1flow's ppo stage on the same budget, prompts and evaluator); ppo alone drops r1flow's "
                    "grpo side")
    ap.add_argument("--quick", action="store_true", help="a smoke run: seconds of training, a few prompts")
    ap.add_argument("--minutes", type=float, help="training budget of each side (default 10 on a CPU, 5 on CUDA)")
    ap.add_argument("--max-steps", type=int, help="cap on each side's steps (default 2000)")
    ap.add_argument("--task", help=f"{TASK}'s reasoning-gym options as JSON (default: {Plan().task})")
    ap.add_argument("--reward", help=f"RewardSpec as JSON, both sides (default: {Plan().reward})")
    for name, kind in (("seeds", int), ("split_seed", int), ("eval_prompts", int), ("transfer_prompts", int), ("curve_prompts", int), ("curve_points", int),
                       ("cold_steps", int), ("prompts_per_step", int), ("group_size", int), ("max_new_tokens", int),
                       ("temperature", float), ("learning_rate", float), ("lora_r", int), ("beta", float)):
        ap.add_argument("--" + name.replace("_", "-"), type=kind, help=f"default {getattr(Plan(), name)}")
    ap.add_argument("--trl-from", metavar="RUN",
                    help="reuse an earlier run's TRL side (its run directory or learning.json) when the plan is the "
                    "same but for --r1flow-set: one r1flow change at a time, measured against the same TRL run")
    ap.add_argument("--r1flow-from", metavar="RUN",
                    help="reuse an earlier run's r1flow side when the plan is the same but for --trl-set: TRL's "
                    "sensitivity rows, each against the same r1flow runs")
    ap.add_argument("--resume", metavar="RUN",
                    help="go on with a stopped run (its run directory): the same plan, or more --seeds; the sides of "
                    "the seeds it finished are kept, the others train, then every model is evaluated")
    ap.add_argument("--start-only", action="store_true",
                    help="make (or reuse) the start model, print its held-out accuracy and stop: to choose --task")
    ap.add_argument("--r1flow-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig field for r1flow's side only (e.g. dynamic_sampling=true), reported as such")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a field of TRL's GRPOConfig for TRL's side only (the sensitivity row, e.g. "
                    "per_device_train_batch_size=64 or bf16=true), reported as such; per_device_train_batch_size sets "
                    "gradient_accumulation_steps to the rest of the step")
    ap.add_argument("--allocator", default="tuned", help="malloc settings of every child (as suite.py)")
    ap.add_argument("--work-dir", default=str(ROOT / ".r1flow" / "learning"),
                    help="start models (cached by their settings), runs, evaluations and logs")
    ap.add_argument("--plot", help="PNG path (default: <work-dir>/<run>/learning.png)")
    ap.add_argument("--json", help="raw results (default: <work-dir>/<run>/learning.json)")
    ap.add_argument("--markdown", help="append the RESULTS.md section here")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each timed run, wait up to this many seconds for other processes to leave the CPUs")
    for hidden in ("--child", "--plan", "--work", "--result", "--prep", "--jobs"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--at-step", "--seed", "--every-step"):
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return learning_child_main(args)
    sides = [s for s in args.sides.split(",") if s]
    algos = [a for a in args.algo.split(",") if a]
    if unknown := [a for a in algos if a not in ("grpo", "ppo")]:
        ap.error(f"unknown --algo {unknown}; known: grpo, ppo")
    if "ppo" in algos:
        sides = [s for s in sides if s != "r1flow" or "grpo" in algos] + ["r1flow_ppo"] * ("r1flow_ppo" not in sides)
    if unknown := [s for s in sides if s not in SIDES]:
        ap.error(f"unknown side(s) {unknown}; known: {list(SIDES)}")
    if args.trl_from and args.r1flow_from:
        ap.error("--trl-from and --r1flow-from together would train nothing: reuse one side, train the other")
    if "trl" in sides and not args.trl_from and importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed in this interpreter; it lives only in the benchmark venv: run `make learn` "
                 "(or .bench-venv/bin/python benchmarks/learning.py), or pass --sides r1flow")
    try:
        plan = build_plan(args)
    except ValueError as e:  # pydantic's ValidationError names the field
        ap.error(f"bad settings: {e}")
    run_learning(plan, sides, args)


def run_learning(plan: Plan, sides: list[str], args: argparse.Namespace) -> dict:
    from benchmarks.suite import code_version, device_info

    root = Path(args.work_dir)
    if args.resume:
        run_dir = resumed_run_dir(Path(args.resume), plan)
    else:
        run_dir = new_run_dir(root)
    plan_file = run_dir / "plan.json"
    plan_file.write_text(json.dumps(dataclasses.asdict(plan), indent=1))
    command = os.environ.get("R1FLOW_BENCH_COMMAND") or "python benchmarks/learning.py " + shlex.join(sys.argv[1:])
    info = device_info(plan.device)
    print(f"learning efficacy: {plan.model} on {info['device_name']}, {plan.minutes:g} min of RL a side and seed, "
          f"{plan.seeds} seed(s) ({', '.join(sides)}); work dir {run_dir}", flush=True)

    # 1. the start model and the prompts, cached by their settings
    prep_dir = root / f"start-{plan.model}-{plan.prep_key()}"
    prep_file = prep_dir / "prep.json"
    if not prep_file.exists():
        print(f"[1/4] start model: cold start by r1flow's stages ({plan.cold_steps} SFT steps) into {prep_dir}",
              flush=True)
        tmp = prep_dir.with_name(prep_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        result = run_learning_child("prep", plan_file, tmp, run_dir / "prep.log", args.allocator)
        if tmp.exists():
            shutil.rmtree(prep_dir, ignore_errors=True)
            tmp.rename(prep_dir)
        prep = json.loads(json.dumps(result).replace(str(tmp), str(prep_dir)))
        prep_file.write_text(json.dumps(prep))
    else:
        print(f"[1/4] start model: cached, {prep_dir}", flush=True)
    prep = json.loads(prep_file.read_text())

    # 2. the start model's accuracy first: it says at once whether the task's difficulty suits this model
    evals: dict = {}
    jobs = [{"name": "start", "dir": prep["start_dir"], "prompts": "prompts"}]
    (run_dir / "jobs-start.json").write_text(json.dumps(jobs))
    evals.update({k: v for k, v in run_learning_child("eval", plan_file, run_dir / "eval", run_dir / "eval-start.log",
                                                      args.allocator, prep=prep_file, jobs=run_dir / "jobs-start.json").items()
                  if isinstance(v, dict) and "rows" in v})
    start_acc = accuracy_entry(evals["start"]["rows"], TASK)
    print(f"[2/4] start model: {TASK} {with_ci(start_acc['accuracy'], start_acc['ci'])} on {start_acc['n']} held-out "
          f"prompts, format rate {pct(start_acc['format_rate'])}", flush=True)
    if not plan.model == "tiny" and not 0.2 <= start_acc["accuracy"] <= 0.6:
        print(f"  note: outside 20-60%; set --task (now {json.dumps(plan.task)}) so RL has room and a signal",
              flush=True)

    if args.start_only:
        return {"prep": prep, "start": start_acc}

    # 3. training: every seed, the sides in alternating order (run_order), each after a quiet moment
    runs: dict = {side: [] for side in SIDES if side in sides}
    reused = set()
    for side, source in (("trl", args.trl_from), ("r1flow", args.r1flow_from)):
        if not source or side not in runs:
            continue  # an earlier run's side, trained and evaluated on this very plan, seed by seed
        earlier = reused_run(Path(source), plan, side)
        runs[side] = earlier["runs"][side][: plan.seeds]
        names = {eval_name(side, snap["name"], k) for k, r in enumerate(runs[side]) for snap in r["snapshots"]}
        names |= {eval_name(side, "end", k) for k in range(plan.seeds)}
        evals.update({k: v for k, v in earlier["evals"].items() if k in names})
        reused.add(side)
        print(f"[3/4] {side}: reused from {source} ({listed([r['steps'] for r in runs[side]])} steps)", flush=True)
    for k in range(plan.seeds):
        order = run_order([s for s in runs if s not in reused], k)
        for side in order:
            if (kept := kept_side(run_dir, k, side)) is not None:
                runs[side].append(kept)
                print(f"[3/4] seed {SEED + k}, {side}: kept from the stopped run ({kept['steps']} steps)", flush=True)
                continue
            shutil.rmtree(run_dir / f"seed{k}" / side, ignore_errors=True)  # a side stopped part-way starts over
            print(f"[3/4] seed {SEED + k}, {side}: {'PPO' if side == 'r1flow_ppo' else 'GRPO'} for {plan.minutes:g} min",
                  flush=True)
            trl_steps = runs["trl"][k]["steps"] if len(runs.get("trl", [])) > k else None
            r = run_learning_child(side, plan_file, run_dir / f"seed{k}" / side, run_dir / f"seed{k}-{side}.log",
                                   args.allocator, quiet_wait=args.quiet_wait, prep=prep_file, seed=SEED + k,
                                   at_step=trl_steps if side == "r1flow" else None,
                                   every_step=1 if side == "r1flow" and trl_steps is None and "trl" in runs else None)
            pair = [s for s in order if s in ("r1flow", "trl")]
            r["seed"], r["first"] = SEED + k, (pair[0] == side if len(pair) == 2 and side in pair else None)
            runs[side].append(r)
            keep_side(run_dir, k, side, r)
            print(f"  {side}: {r['steps']} steps in {r['train_s'] / 60:.1f} min ({r['train_s'] / max(1, r['steps']):.1f} "
                  f"s a step), other processes used {100 * (r['foreign_cpu'] or 0):.0f}% of the CPUs", flush=True)
        if "r1flow" not in reused and len(runs.get("r1flow", [])) > k and len(runs.get("trl", [])) > k:
            settle_equal_steps(runs["r1flow"][k], runs["trl"][k]["steps"])
            keep_side(run_dir, k, "r1flow", runs["r1flow"][k])  # with its equal-steps point settled

    # 4. every end model and snapshot, by the same evaluator
    jobs = []
    for side, side_runs in runs.items():
        if side in reused:
            continue
        for k, r in enumerate(side_runs):
            end = {"adapter": r["final"]} if r["final_kind"] == "adapter" else {"dir": r["final"]}
            jobs.append({"name": eval_name(side, "end", k), **end, "prompts": "prompts"})
            for snap in r["snapshots"]:
                jobs.append({"name": eval_name(side, snap["name"], k), "adapter": snap["adapter"],
                             "prompts": "prompts" if snap["name"] == "equal_steps" else "curve_prompts"})
    print(f"[4/4] evaluating {len(jobs)} models", flush=True)
    (run_dir / "jobs.json").write_text(json.dumps(jobs))
    evals.update({k: v for k, v in run_learning_child("eval", plan_file, run_dir / "eval", run_dir / "eval.log", args.allocator,
                                                      prep=prep_file, jobs=run_dir / "jobs.json").items()
                  if isinstance(v, dict) and "rows" in v})

    summary = summarize_learning(plan, evals, runs)
    plot_path = Path(args.plot or run_dir / "learning.png")
    plot(plot_path, plan, prep, evals, runs)
    raw = {"plan": dataclasses.asdict(plan), "summary": summary, "runs": runs, "prep": prep, "device": info,
           "evals": {k: {"seconds": v["seconds"], "rows": v["rows"]} for k, v in evals.items()}}
    Path(args.json or run_dir / "learning.json").write_text(json.dumps(raw, indent=1))
    section = learning_markdown_section(plan, command, info, code_version(), summary, runs, prep, plot_path)
    if args.markdown:
        with open(args.markdown, "a") as fh:
            fh.write(section)
    print("\n" + section, flush=True)
    return raw


def new_run_dir(root: Path) -> Path:
    """A run directory of its own, named by the time it started ("-2", "-3", ... after the name when two runs start
    in the same second: one must never write into another's)."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"learning.py: no free run directory name under {root} ({name}-N)")


def keep_side(run_dir: Path, seed_index: int, side: str, run: dict) -> None:
    """Keep a trained side's results in the run directory (`seed<k>/<side>.json`), written whole (a temporary file
    renamed), so a stopped run can go on from it (`--resume`)."""
    path = run_dir / f"seed{seed_index}" / f"{side}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(path)


def kept_side(run_dir: Path, seed_index: int, side: str) -> dict | None:
    """A side of a seed that a stopped run finished (`keep_side`), or None: it trains again."""
    path = run_dir / f"seed{seed_index}" / f"{side}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def resumed_run_dir(path: Path, plan: Plan) -> Path:
    """The run directory `--resume` names, if it was made with this very plan but for more `--seeds` (a finished run
    grows by the seeds it lacks): SystemExit naming the first difference (or what is missing) otherwise, before any
    compute."""
    plan_file = path / "plan.json"
    if not plan_file.is_file():
        raise SystemExit(f"--resume {path}: no plan.json there (not a run directory of learning.py)")
    earlier = json.loads(plan_file.read_text())
    if earlier.get("seeds", 1) > plan.seeds:
        raise SystemExit(f"--resume {path}: it ran {earlier['seeds']} seeds, this run asks for {plan.seeds} (--seeds "
                         f"{earlier['seeds']} or more)")
    if difference := plan_difference(earlier, plan, ignore=("seeds",)):
        raise SystemExit(f"--resume {path}: {difference}")
    return path


def settle_equal_steps(run: dict, steps: int) -> None:
    """A run made before the one that sets its equal-steps point saved every step ("step<N>" snapshots): keep step
    `steps` as "equal_steps" and delete the others (a run that stopped short of `steps` has no equal-steps point).
    The saves' seconds, inside that run's clock, are kept in "every_step_save_s"."""
    kept, spent = [], 0.0
    for snap in run["snapshots"]:
        if not snap["name"].startswith("step"):
            kept.append(snap)
            continue
        spent += snap.get("save_s", 0.0)
        if snap["step"] == steps:
            kept.append({**snap, "name": "equal_steps"})
        else:
            shutil.rmtree(snap["adapter"], ignore_errors=True)
    run["snapshots"] = kept
    run["every_step_save_s"] = spent


REUSE_FLAGS = {"trl": "--trl-from", "r1flow": "--r1flow-from"}


def reused_run(path: Path, plan: Plan, side: str) -> dict:
    """An earlier run's raw results (its learning.json, or the run directory holding it), if that run trained `side`
    ("trl" or "r1flow") on the same plan, the other side's own settings (`--r1flow-set` when TRL is reused,
    `--trl-set` when r1flow is) aside, for at least as many seeds: SystemExit naming the first difference otherwise.
    One side's change at a time is then measured against the very same runs of the other side."""
    flag, name = REUSE_FLAGS[side], {"trl": "TRL"}.get(side, side)
    raw_file = path / "learning.json" if path.is_dir() else path
    if not raw_file.is_file():
        raise SystemExit(f"{flag} {path}: no learning.json there")
    raw = json.loads(raw_file.read_text())
    if side not in raw.get("runs", {}):
        raise SystemExit(f"{flag} {path}: that run has no {name} side")
    if not isinstance(raw["runs"][side], list):
        raise SystemExit(f"{flag} {path}: made by the one-seed version of learning.py (before --seeds); run {name} "
                         "again")
    if len(raw["runs"][side]) < plan.seeds:
        raise SystemExit(f"{flag} {path}: it has {len(raw['runs'][side])} {name} seed(s), this run asks for "
                         f"{plan.seeds}")
    other_extra = "r1flow_extra" if side == "trl" else "trl_extra"
    if difference := plan_difference(raw["plan"], plan, ignore=(other_extra, "seeds")):
        raise SystemExit(f"{flag} {path}: {difference}")
    return raw


def plan_difference(earlier: dict, plan: Plan, ignore: tuple[str, ...] = ()) -> str | None:
    """The first field (in Plan's order, less `ignore`) in which an earlier run's plan (as its JSON holds it) differs
    from `plan`, said as "its KEY was A, this run's is B"; None when they agree."""
    for key, value in json.loads(json.dumps(dataclasses.asdict(plan))).items():
        if key not in ignore and earlier.get(key) != value:
            return f"its {key} was {earlier.get(key)!r}, this run's is {value!r}"
    return None


def split_text(plan: Plan, prep: dict) -> str:
    """Which held-out split the numbers are on, for the report."""
    if plan.split_seed == 0:
        return ("Split seed 0: the tuning split, on whose held-out prompts the task's difficulty and the prompts a "
                "step were chosen.")
    overlap = prep.get("tuning_overlap") or {}
    shared = (f"; {overlap['also_in_tuning_split']} of its {overlap['held_out']} scored held-out prompts were held out "
              f"in the tuning split too (chance, on a task of ~1,060 distinct prompts)" if overlap else "")
    return (f"Split seed {plan.split_seed}: a fresh draw of the prompts, the held-out split and the cold start, "
            f"never used for a choice (the tuning split is seed 0{shared}).")


def learning_markdown_section(plan: Plan, command: str, info: dict, code: str, summary: dict, runs: dict, prep: dict,
                              plot_path: Path) -> str:
    threads = {side: sorted({r.get("threads") for r in rs}, key=str) for side, rs in runs.items()}
    extra = f"; r1flow only: {json.dumps(plan.r1flow_extra)}" if plan.r1flow_extra else ""
    extra += f"; TRL only: {json.dumps(plan.trl_extra)}" if plan.trl_extra else ""
    seeds = listed(range(SEED, SEED + plan.seeds))
    lines = [f"### Learning efficacy, {plan.model}, {plan.minutes:g} min a side, {plan.seeds} seed(s) "
             f"({info['device_name']}, code {code})",
             "",
             f"`{command}`",
             "",
             f"Task: {TASK} {json.dumps(plan.task)}, {plan.train_prompts} train prompts, {plan.eval_prompts} held out; "
             f"transfer: {TRANSFER} {json.dumps(plan.transfer)}, {plan.transfer_prompts} prompts. {split_text(plan, prep)} "
             f"Start model: "
             f"{plan.model} after a cold start of {plan.cold_steps} LoRA SFT steps on {prep.get('cold_examples', 0)} "
             f"R1-format examples from r1flow's rejection sampling. GRPO, both sides: {plan.prompts_per_step} prompts x "
             f"{plan.group_size} completions a step, {plan.max_new_tokens} new tokens, temperature {plan.temperature:g}, "
             f"LoRA r={plan.lora_r}, lr {plan.learning_rate:g}, beta {plan.beta:g}, reward {json.dumps(plan.reward)}, "
             f"advantages divided by the group's {summary['std']} std (TRL: torch.std, the sample std), "
             f"the same prompts in the same order for a seed{extra}. "
             + ("r1flow PPO (`--algo ppo`): the same prompts, reward, LoRA, lr and completions a step "
                f"({plan.prompts_per_step} prompts x {plan.group_size} samples), one epoch in the same mini-batches, "
                f"beta as the KL penalty in the per-token rewards, the critic a LoRA copy of the policy. "
                if "r1flow_ppo" in runs else "")
             + f"Training seeds {seeds} on each side (prompt order, sampling, LoRA initialisation; seed k of one side "
             f"has seed k's prompt order on the other)"
             + ("; r1flow trains first for even k, TRL for odd k. " if {"r1flow", "trl"} <= set(runs) else ". ")
             + f"One environment for every side (threads {threads}). "
             f"Evaluation: r1flow's eval stage, greedy, strict accuracy. Pooled rows: the mean over seeds, 95% "
             f"intervals from a bootstrap that resamples the seeds and the prompts (one prompt draw shared by every "
             f"seed and side: stages/math/stats.py, seed_prompt_means); gains and differences paired (seed k with "
             f"seed k, each prompt with itself).",
             "", *table(summary), "", "Each seed (intervals over prompts only):", "", *seed_table(summary), "",
             *verdict_lines(summary), ""]
    if phase := phase_lines(summary):
        lines += ["Seconds a step by phase (mean over every seed's steps after the first; training: what generation "
                  "and scoring leave of the step):", "", *phase, ""]
    lines += [f"Plot: `{plot_path}`", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
