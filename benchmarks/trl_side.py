"""The TRL side of the suite: TRL's public SFTTrainer, DPOTrainer and GRPOTrainer on the same artifacts.

Imported only in the benchmark venv (`make bench-setup`); TRL is not a dependency of r1flow.
Every trainer gets `report_to=[]`, no hub, no checkpoints (`save_strategy="no"`), no logging
(`logging_strategy="no"`), `gradient_checkpointing=False` (TRL's default is True; r1flow does not
checkpoint), fp32 on CPU and bf16 on CUDA (r1flow's `precision: auto`), a constant learning rate
and no warm-up. Everything else is TRL's default. The subclasses below only add clocks around
TRL's own methods; they change no behaviour.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import TrainerCallback, set_seed

from benchmarks.common import PeakMemory, Shape, Snapshots
from schemas.artifacts import MODEL_DIR
from schemas.configs import RewardSpec
from stages.modeling import models
from stages.rewards.verifiers import score


class StepClock(TrainerCallback):
    """When each optimizer step ends; the interval between two ends is one whole step."""

    def __init__(self):
        self.ends: list[float] = []
        self.per_step: list[dict] = []
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        if self.trainer is not None and hasattr(self.trainer, "bench"):
            self.per_step.append(dict(self.trainer.bench))
            self.trainer.bench = {k: 0.0 for k in self.trainer.bench}

    def intervals(self) -> list[float]:
        """Durations of steps 2..N (step 1 has no previous end and is the warm-up anyway)."""
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def common_args(device: str, out: Path, steps: int, learning_rate: float) -> dict:
    cuda = device.startswith("cuda")
    return {"output_dir": str(out), "max_steps": steps, "learning_rate": learning_rate,
            "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
            "gradient_checkpointing": False, "bf16": cuda, "fp16": False, "use_cpu": not cuda,
            "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
            "push_to_hub": False, "seed": 0, "dataloader_num_workers": 0}


def peft_config(lora_r: int, alpha: float | None = None):
    if lora_r == 0:
        return None
    from peft import LoraConfig

    from schemas.configs import LoraSpec

    # r1flow's defaults for dropout and target modules (and alpha, unless given)
    spec = LoraSpec(r=lora_r) if alpha is None else LoraSpec(r=lora_r, alpha=alpha)
    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.target_modules,
                      task_type="CAUSAL_LM")


def start_model_dir(prep: dict) -> Path:
    return Path(prep["model"]["path"]) / MODEL_DIR  # the import_model artifact r1flow's side trains from


def load(prep: dict):
    """(model, tokenizer) exactly as r1flow loads them: fp32, pad token set, left padding."""
    return models.load_model(start_model_dir(prep))


def table_rows(prep: dict, name: str) -> list[dict]:
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE

    return pq.read_table(Path(prep[name]["path"]) / DATA_FILE).to_pylist()


# ---------------------------------------------------------------------------- SFT


def run_sft(prep: dict, shape: Shape, device: str, work: Path) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**common_args(device, work / "trl-sft", shape.sft_steps + 1, shape.learning_rate),
                     per_device_train_batch_size=shape.sft_batch, gradient_accumulation_steps=1,
                     max_length=shape.max_length, packing=False, completion_only_loss=True)
    clock = StepClock()
    meter = PeakMemory(device)
    meter.start()  # the window starts before the data is read, as r1flow's stage reads it inside run()
    rows = table_rows(prep, "sft")
    data = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
    model, tokenizer = load(prep)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[clock], peft_config=peft_config(shape.lora_r))
    trainer.train()
    mem = meter.result()
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    return {"step_s": clock.intervals(), "seq_len": sum(lengths) / len(lengths), "batch": shape.sft_batch, **mem}


# ---------------------------------------------------------------------------- DPO


def run_dpo(prep: dict, shape: Shape, device: str, work: Path) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    class TimedDPO(DPOTrainer):
        bench_ref_s = 0.0

        def _precompute_ref_logps(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(*args, **kwargs)
            TimedDPO.bench_ref_s += time.perf_counter() - t0
            return out

    args = DPOConfig(**common_args(device, work / "trl-dpo", shape.dpo_steps + 1, shape.learning_rate),
                     per_device_train_batch_size=shape.dpo_batch, gradient_accumulation_steps=1,
                     max_length=shape.max_length, beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=True,
                     precompute_ref_batch_size=shape.dpo_batch)
    clock = StepClock()
    meter = PeakMemory(device)
    meter.start()
    model, tokenizer = load(prep)
    # Non-conversational strings, so the sequence is exactly r1flow's: chat-templated prompt, then the
    # completion and EOS (TRL appends the EOS token; the conversational form would add the template's "\n").
    rows = table_rows(prep, "prefs")
    data = Dataset.from_list([{"prompt": tokenizer.apply_chat_template(r["messages"], tokenize=False,
                                                                       add_generation_prompt=True),
                               "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
    trainer = TimedDPO(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[clock],
                       peft_config=peft_config(shape.lora_r))
    trainer.train()
    mem = meter.result()
    ds = trainer.train_dataset
    lengths = [len(p) + len(c) for p, c in zip(ds["prompt_ids"], ds["chosen_ids"], strict=True)]
    lengths += [len(p) + len(c) for p, c in zip(ds["prompt_ids"], ds["rejected_ids"], strict=True)]
    return {"step_s": clock.intervals(), "batch": shape.dpo_batch, "seq_len": sum(lengths) / len(lengths),
            "reference_s": TimedDPO.bench_ref_s, **mem}


# ---------------------------------------------------------------------------- GRPO


PROMPT_COLUMNS = ("id", "answer", "task", "verifier", "split", "metadata")  # what the scorer reads besides messages


def grpo_dataset(rows: list[dict]):
    """TRL's GRPO dataset of prompt rows: the conversation as `prompt`, the columns the scorer needs beside it."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["messages"], **{k: r[k] for k in PROMPT_COLUMNS}} for r in rows])


def verdicts(spec: RewardSpec, prompts, completions, completion_ids, columns: dict) -> list:
    """r1flow's scorer (`stages.rewards.verifiers.score`) on a TRL reward call's completions, one Verdict each."""
    out = []
    for i, completion in enumerate(completions):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        row = {k: columns[k][i] for k in PROMPT_COLUMNS}
        row["messages"] = prompts[i]
        out.append(score(row, text, spec, num_tokens=len(completion_ids[i])))
    return out


def r1_reward(prompts, completions, completion_ids, **columns):
    """r1flow's own scorer (`stages.rewards.verifiers.score`, default RewardSpec: accuracy + 0.2 format), so
    scoring costs the same on both sides."""
    return [v.reward for v in verdicts(RewardSpec(), prompts, completions, completion_ids, columns)]


def timed_grpo_trainer():
    """TRL's GRPOTrainer with clocks around its generation (`_generate`: templating, generate, decode) and its reward
    calls, summed in `trainer.bench` until a callback reads and resets them, and the prompt ids of each generation
    batch in `trainer.sampled`. The class is made on call (TRL is imported only in the benchmark venv); it changes no
    behaviour."""
    from trl import GRPOTrainer

    class TimedGRPO(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            self.bench = {"generation": 0.0, "scoring": 0.0, "completion_tokens": 0.0}
            self.sampled: list[list[str]] = []
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self.sampled.append([x["id"] for x in inputs[:: self.num_generations]])
            return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.bench["generation"] += time.perf_counter() - t0
            self.bench["completion_tokens"] += sum(len(c) for c in out[1])
            return out

        def _calculate_rewards(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            self.bench["scoring"] += time.perf_counter() - t0
            return out

    return TimedGRPO


def step_phases(total: float, bench: dict) -> dict:
    """One step's seconds by phase from its whole duration and the clocks of `timed_grpo_trainer` during it:
    training is what generation and scoring leave (the loss, backward and optimizer step, and TRL's own
    bookkeeping)."""
    return {"generation": bench["generation"], "scoring": bench["scoring"],
            "training": total - bench["generation"] - bench["scoring"], "total": total,
            "completion_tokens": bench["completion_tokens"]}


def run_grpo(prep: dict, shape: Shape, device: str, work: Path, step_prompts: list[list[str]]) -> dict:
    """step_prompts: the prompt ids of each step, warm-up first (the ones r1flow's stage picks): the trainer's
    dataset is exactly those rows in that order, read unshuffled, so step k samples for list k; the ids
    each generation call did get are recorded (`step_prompts`) for the suite to compare."""
    from trl import GRPOConfig

    n = shape.grpo_prompts * shape.grpo_group
    if n % shape.grpo_minibatch:
        raise SystemExit(f"grpo: prompts x group ({n}) must be a multiple of the minibatch ({shape.grpo_minibatch})")
    args = GRPOConfig(**common_args(device, work / "trl-grpo", shape.grpo_steps + 1, shape.learning_rate),
                      per_device_train_batch_size=shape.grpo_minibatch,
                      gradient_accumulation_steps=n // shape.grpo_minibatch,
                      num_generations=shape.grpo_group, max_completion_length=shape.grpo_new_tokens,
                      temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, epsilon=0.2,
                      loss_type="grpo", scale_rewards="group", use_vllm=False, log_completions=False,
                      # graph is r1flow's own decode implementation, not a cache TRL has: TRL keeps its default
                      # (transformers' dynamic cache, the baseline issue 30 measures against)
                      cache_implementation={"dynamic": None, "static": "static", "graph": None}[shape.cache],
                      shuffle_dataset=False)
    clock = StepClock()
    meter = PeakMemory(device)
    meter.start()
    by_id = {r["id"]: r for r in table_rows(prep, "prompts")}
    rows = [by_id[i] for step in step_prompts for i in step]  # one generation batch a step, in this order
    data = grpo_dataset(rows)
    model, tokenizer = load(prep)
    trainer = timed_grpo_trainer()(model=model, reward_funcs=r1_reward, args=args, train_dataset=data,
                                   processing_class=tokenizer, callbacks=[clock], peft_config=peft_config(shape.lora_r))
    clock.trainer = trainer
    trainer.train()
    mem = meter.result()
    totals = clock.intervals()
    # per_step[k] belongs to step k+1, the end of interval k
    steps = [{"step": k + 1, **step_phases(total, clock.per_step[k])} for k, total in enumerate(totals, start=1)]
    return {"steps": steps, "completions": n, "step_prompts": trainer.sampled, **mem}


def versions() -> dict[str, str]:
    import transformers
    import trl

    return {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


# ---------------------------------------------------------------------------- GRPO learning (benchmarks/learning.py)


def run_grpo_learning(plan, prep: dict, work: Path, seed: int, step_prompts: list[list[str]]) -> dict:
    """TRL's GRPOTrainer on `learning.py`'s plan: the same start model, prompts (`step_prompts`, r1flow's order for
    this training seed, read unshuffled), reward (r1flow's scorer with the plan's RewardSpec), LoRA, group size,
    prompts per step, max tokens, temperature, learning rate and beta; the same budget rule (no step starts once
    `plan.minutes` of training are spent, counted from the trainer's first step) and the same snapshots. `seed` is
    the trainer's seed (LoRA initialisation, sampling). Each step's curve entry has its generation, scoring and
    training seconds (`timed_grpo_trainer`)."""
    import pyarrow.parquet as pq
    from trl import GRPOConfig

    from schemas.artifacts import DATA_FILE

    spec = RewardSpec(**plan.reward)
    pending: list[tuple[float, float]] = []  # (mean reward, accuracy) of each scored generation batch

    def reward(prompts, completions, completion_ids, **columns):
        vs = verdicts(spec, prompts, completions, completion_ids, columns)
        out = [v.reward if v.reward is not None else 0.0 for v in vs]  # r1flow's stage: an unscored completion gets 0
        correct = [float(bool(v.correct)) for v in vs]
        pending.append((sum(out) / len(out), sum(correct) / len(correct)))
        return out

    snaps = Snapshots(plan.curve_times(), work / "snapshots", None)
    curve: list[dict] = []

    class Budget(TrainerCallback):
        t0 = 0.0
        trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            elapsed = time.perf_counter() - self.t0
            r, acc = pending[-1] if pending else (float("nan"), float("nan"))
            pending.clear()
            phases = step_phases(elapsed - (curve[-1]["elapsed_s"] if curve else 0.0), self.trainer.bench)
            self.trainer.bench = {k: 0.0 for k in self.trainer.bench}
            curve.append({"step": state.global_step, "elapsed_s": elapsed, "reward": r, "accuracy": acc,
                          "step_s": phases["total"], "generation_s": phases["generation"],
                          "scoring_s": phases["scoring"], "training_s": phases["training"],
                          "completion_tokens": phases["completion_tokens"]})
            snaps.after_step(model, state.global_step, elapsed)
            if elapsed >= 60.0 * plan.minutes:
                control.should_training_stop = True

    n = plan.prompts_per_step * plan.group_size
    extra = dict(getattr(plan, "trl_extra", None) or {})  # --trl-set: the sensitivity row's TRL-only settings
    mb = int(extra.pop("per_device_train_batch_size", min(plan.minibatch_size, n)))
    if n % mb:
        raise SystemExit(f"learning: prompts x group ({n}) must be a multiple of the minibatch ({mb})")
    args = GRPOConfig(**{**common_args(plan.device, work / "trl-grpo", plan.max_steps, plan.learning_rate),
                         "seed": seed,
                         "per_device_train_batch_size": mb, "gradient_accumulation_steps": n // mb,
                         "num_generations": plan.group_size, "max_completion_length": plan.max_new_tokens,
                         "temperature": plan.temperature, "top_p": 1.0, "top_k": 0, "beta": plan.beta,
                         "num_iterations": 1, "epsilon": 0.2, "loss_type": "grpo", "scale_rewards": "group",
                         "use_vllm": False, "log_completions": False, "shuffle_dataset": False, **extra})
    by_id = {r["id"]: r for r in pq.read_table(Path(prep["prompts"]["path"]) / DATA_FILE).to_pylist()}
    rows = [by_id[i] for step in step_prompts for i in step]
    data = grpo_dataset(rows)
    # GRPOTrainer wraps the model in LoRA before Trainer.__init__ seeds from args.seed: seed first, as r1flow's stage
    # seeds every RNG with its context seed before loading, so the seed sets the LoRA initialisation on both sides
    set_seed(seed)
    model, tokenizer = models.load_model(prep["start_dir"])
    budget = Budget()
    # scale_rewards="group": TRL divides by the group's sample std (torch.std, ddof 1); learning.grpo_config sets
    # r1flow's std to "sample" to match
    trainer = timed_grpo_trainer()(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                   processing_class=tokenizer, callbacks=[budget],
                                   peft_config=peft_config(plan.lora_r, alpha=2 * plan.lora_r))  # as grpo_config's
    budget.trainer = trainer
    trainer.train()
    final = work / "final"
    trainer.model.save_pretrained(str(final))
    return {"curve": curve, "snapshots": snaps.saved, "steps": len(curve),
            "train_s": curve[-1]["elapsed_s"] if curve else 0.0, "final": str(final), "final_kind": "adapter",
            "seed": seed, "versions": versions()}
