"""The optimizer-step loop the supervised training stages share (sft, reward_model,
preference_optimization): what is truly the same in their loops, and nothing of their losses.

A stage opens a `Loop` (AdamW over the trainable parameters, the schedule's warmup), resumes it, and
hands `Loop.train` its step: a function of (step, learning rate) that runs the step's micro-batches,
syncs the gradients, calls `Loop.update` (clip, optimizer step, zero) and returns a `StepResult`.
Around each step the loop sets the scheduled learning rate, saves a checkpoint every
`checkpoint_every` steps and at the last, logs the step's metrics and moves the progress bar.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from schemas.configs import LoraSpec, TrainingConfig
from stages.base import Input, Output, StageContext, model_output_dir
from stages.modeling import models
from stages.runtime import distributed, threads
from stages.training.checkpoints import publish_due, resume, save_checkpoint
from stages.training.optim import clip_grad_norm, lr_factor, make_optimizer, micro_batch_indices, set_lr


@dataclasses.dataclass
class StepResult:
    """What a step hands back to the loop."""

    metrics: dict[str, float]  # logged at the step
    state: dict  # the checkpoint's state besides "step": the curves so far
    postfix: dict[str, str]  # the progress bar's


@dataclasses.dataclass
class Loop:
    """The model being trained, its optimizer and learning-rate schedule, and where checkpoints go."""

    cfg: TrainingConfig
    ctx: StageContext
    dist: distributed.Dist
    model: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    warmup: int  # steps of linear warmup

    @classmethod
    def open(cls, cfg: TrainingConfig, ctx: StageContext, dist: distributed.Dist, model: torch.nn.Module) -> Loop:
        """AdamW over the model's trainable parameters (the model as the processes hold it: sharded under fsdp)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
        return cls(cfg, ctx, dist, model, trainable, optimizer, int(cfg.warmup_ratio * cfg.max_steps))

    def resume(self, stage: str) -> dict:
        """The newest good checkpoint loaded into model and optimizer; its state, or {"step": 0}."""
        return resume(self.ctx, self.model, self.optimizer, stage, self.cfg.max_steps)

    def update(self) -> float:
        """Clip the (synced) gradients, step the optimizer, clear the gradients; the norm before clipping."""
        grad_norm = clip_grad_norm(self.trainable, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        threads.rebalance()  # this stage's share of the cores, if another r1flow run started or ended
        return grad_norm

    def train(self, start: int, desc: str, step: Callable[[int, float], StepResult],
              publish: Callable[[int], None] | None = None) -> float:
        """Steps start .. max_steps - 1 of `step`, each after setting the scheduled learning rate, then a
        checkpoint (every checkpoint_every steps and at the last), `publish(done)` (a `CheckpointPublisher`), the
        step's metrics and the progress bar; the seconds they took."""
        cfg, dist = self.cfg, self.dist
        self.model.train()
        t0 = time.perf_counter()
        bar = tqdm(total=cfg.max_steps, initial=start, desc=desc, unit="step", disable=not dist.is_main)
        for i in range(start, cfg.max_steps):
            lr = set_lr(self.optimizer, cfg.learning_rate * lr_factor(i, cfg.max_steps, self.warmup, cfg.lr_scheduler))
            result = step(i, lr)
            done = i + 1
            if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
                save_checkpoint(self.ctx.checkpoint_dir, done, self.model, self.optimizer, {"step": done, **result.state},
                                cfg.keep_checkpoints, dist)
            if publish is not None:
                publish(done)
            self.ctx.log_metrics(result.metrics, step=done)
            bar.set_postfix(**result.postfix)
            bar.update(1)
        bar.close()
        return time.perf_counter() - t0



@dataclasses.dataclass
class Curves:
    """A classifier's per-step loss and accuracy (reward_model: pairs ranked right; prm: steps classified right),
    kept in the checkpoint state and re-logged whole after a resume, so MLflow shows one unbroken curve."""

    accuracy_metric: str  # the accuracy's metric name, e.g. "train/accuracy"
    losses: list[float] = dataclasses.field(default_factory=list)
    accuracies: list[float] = dataclasses.field(default_factory=list)

    def restore(self, state: dict, ctx: StageContext) -> None:
        self.losses, self.accuracies = state.get("losses", []), state.get("accuracies", [])
        for i, (loss, acc) in enumerate(zip(self.losses, self.accuracies, strict=True)):
            ctx.log_metrics({"train/loss": loss, self.accuracy_metric: acc}, step=i + 1)

    def step(self, loss: float, accuracy: float, lr: float, grad_norm: float) -> StepResult:
        """Append a step's loss and accuracy; its metrics, checkpoint state and progress-bar text."""
        self.losses.append(loss)
        self.accuracies.append(accuracy)
        return StepResult({"train/loss": loss, self.accuracy_metric: accuracy, "train/lr": lr, "train/grad_norm": grad_norm},
                          {"losses": self.losses, "accuracies": self.accuracies},
                          {"loss": f"{loss:.4f}", "acc": f"{accuracy:.2f}"})

def step_micro_batches(n: int, cfg: TrainingConfig, seed: int, step: int) -> list[list[int]]:
    """The grad_accum global micro-batches of `step` over n examples (`micro_batch_indices`: seeded epochs)."""
    return [micro_batch_indices(n, cfg.batch_size, seed, step * cfg.grad_accum + a) for a in range(cfg.grad_accum)]


def autocast(device: str, dtype: torch.dtype | None):
    """The training precision's autocast context on `device` (fp32: a disabled one)."""
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype or torch.float32, enabled=dtype is not None)


def curve_tail(curve: list) -> list:
    """The end of a training curve that a stage's summary averages: its last fifth, 1 to 10 points."""
    return curve[-max(1, min(10, len(curve) // 5)) :]


def save_policy(ctx: StageContext, dist: distributed.Dist, plain, tokenizer, lora: LoraSpec,
                merged_input: bool, name: str = "model") -> tuple[Path, bool]:
    """Rank 0 saves the trained causal LM (`plain`: unsharded), merged or as an adapter, as output `name`; (the
    artifact's staging directory, whether it is an adapter)."""
    out, model_dir = model_output_dir(ctx, name)
    merge = lora.merge or merged_input
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=merge)
    return out, lora.r > 0 and not merge


def policy_output(out: Path, is_adapter: bool, model_input: Input, metrics: dict[str, float]) -> Output:
    """The `model` output of a stage that trains the input model: an adapter names its base's fingerprint."""
    extra = {"base_fingerprint": model_input.fingerprint} if is_adapter else {}
    return Output("model", "adapter" if is_adapter else "model", out, metrics=metrics, extra=extra)


@dataclasses.dataclass
class CheckpointPublisher:
    """Hands the model as it is after every `every`-th step of `total` (`publish_due`) to the runner as a model of its
    own (the context's `publish_checkpoint`), which publishes and evaluates it while the training goes on
    (docs/guides/checkpoint-evals.md). A context without `publish_checkpoint` gets nothing."""

    ctx: StageContext
    dist: distributed.Dist
    every: int
    total: int
    policy: Callable[[], torch.nn.Module]  # the whole model being trained, as save_policy takes it
    tokenizer: object
    lora: LoraSpec
    merged_input: bool
    model_input: Input

    def __call__(self, done: int) -> None:
        publish = getattr(self.ctx, "publish_checkpoint", None)
        if publish is None or not publish_due(self.every, done, self.total):
            return
        plain = self.policy()
        if isinstance(plain, torch.nn.Module) and self.lora.r > 0 and (self.lora.merge or self.merged_input):
            plain = copy.deepcopy(plain)  # saving merges the adapter in place: the training goes on with the original
        out, is_adapter = save_policy(self.ctx, self.dist, plain, self.tokenizer, self.lora, self.merged_input,
                                      name=f"checkpoint-{done:06d}")
        if self.dist.is_main:
            publish(done, policy_output(out, is_adapter, self.model_input, {"step": float(done)}))
