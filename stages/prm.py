"""`prm` stage: a process reward model — a classifier head on a causal LM, read at the last token of
every reasoning step and trained with binary cross-entropy on step labels — and its held-out
step accuracy, AUROC and first-error-step accuracy.

Lightman et al. 2023 (https://arxiv.org/abs/2305.20050) train a PRM to predict each step's label
at the step's last token; Math-Shepherd (https://arxiv.org/abs/2312.08935) trains on its automatic
labels with BCE, hard or soft. Here one sequence per solution, chat_template(prompt) + the steps
joined by the delimiter's separator, and one forward pass scores every step of it.

Choices, as in the `reward_model` stage: the model is a `*ForSequenceClassification(num_labels=1)`
with the input LM's backbone and a fresh `score` head (`reward_model_from_causal_lm`; a PRM artifact
as input is trained further, head kept); LoRA on the backbone with the head fully trained; saved
as merged full weights with `prm.json` (delimiter, max_length) beside them, which `StepScorer`
reads so a completion is cut into steps as in training. Labels come from the `steps` input
(e.g. step_labels) and/or user step files (`files`). The held-out share is split by prompt (no
held-out solution shares a prompt with a trained one); the solutions of `validation_fraction` of the
training prompts choose the saved model: they are validated at every checkpoint and the weights of
the lowest validation BCE are saved (`Best`), so a run longer than its data supports does not harm.
The loss of an optimizer step is the mean over all its steps (all micro-batches), so batch 4 x
accumulation 1 equals batch 2 x accumulation 2.
One process only (the config refuses more).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from schemas.configs import PRMConfig
from schemas.datasets import read_steps_jsonl
from schemas.errors import ConfigError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.stats import cluster_bootstrap_ratio
from stages.math.steps import (
    auroc,
    first_error_accuracy,
    hard_labels,
    join_steps,
    majority_baseline,
    prm_loss,
    split_by_group,
    step_accuracy,
)
from stages.modeling import models
from stages.modeling.heads import (
    PRM_SCHEMA,
    StepScorer,
    apply_reward_lora,
    batched_step_logits,
    encode_steps,
    load_reward_model,
    pad_positions,
    save_prm_settings,
    step_logits,
)
from stages.modeling.logprobs import right_padded
from stages.runtime import distributed
from stages.training.checkpoints import replace_synced, trainable_state
from stages.training.loop import Curves, Loop, StepResult, autocast, curve_tail, step_micro_batches
from stages.training.optim import resolve_precision

VERSION = "3"  # history: CHANGELOG.md
CONFIG = PRMConfig
INPUTS = {"model": "model", "steps": "steps?"}
OUTPUTS = {"model": "model"}


# ---------------------------------------------------------------------------- data


def check(cfg: PRMConfig, node: str = "prm") -> None:
    """Fail before any compute on a missing or bad step file (one error naming file, line and field)."""
    for f in cfg.files:
        if not Path(f).exists():
            raise ConfigError(f"{node}.files: {f} does not exist")
        read_steps_jsonl(f, cfg.neutral)


def cache_salt(cfg: PRMConfig) -> str:
    """User step files are inputs too: their content is part of the cache key."""
    files = cfg.files
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest() if files else ""


def load_rows(data: Input | None, cfg: PRMConfig) -> list[dict]:
    """The step-labelled solutions of the steps input and the files, validated before any model loads."""
    rows = data.table("steps").to_pylist() if data is not None else []
    for f in cfg.files:
        rows += read_steps_jsonl(f, cfg.neutral).to_pylist()
    if not rows:
        raise SchemaError("prm: no step-labelled solutions (wire a steps input or give files)")
    return rows


def prompt_key(row: dict) -> str:
    """What the splits group a solution by, and the bootstrap of the held-out gain resamples: its prompt turns."""
    return json.dumps(row["messages"], sort_keys=True)


def split_rows(rows: list[dict], cfg: PRMConfig, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Seeded (train, validation, held-out) indices, split by prompt: no solution shares a prompt with one on
    another side. The held-out share is drawn first, so it does not depend on `validation_fraction`."""
    prompts = [prompt_key(r) for r in rows]
    rest, held_out = split_by_group(prompts, cfg.eval_fraction, seed)
    train, validation = split_by_group([prompts[i] for i in rest], cfg.validation_fraction, seed + 1)
    return [rest[i] for i in train], [rest[i] for i in validation], held_out


def load_prm_or_backbone(source: Input, device: str):
    """(model, tokenizer, pad id): a PRM artifact to train further (head kept), or a causal LM's backbone with a
    fresh `score` head."""
    if source.manifest.schema_name == PRM_SCHEMA:
        scorer = StepScorer.from_input(source, device)
        return scorer.model, scorer.tokenizer, scorer.pad_id
    return load_reward_model(source, device)


# ---------------------------------------------------------------------------- tokens


def encode(rows: list[dict], tokenizer, cfg: PRMConfig) -> list[dict]:
    """Per solution: token ids, step-end positions and the labels of the steps that fit in max_length."""
    out = []
    for r in rows:
        text, ends = join_steps(r["steps"], cfg.delimiter)
        ids, pos = encode_steps(tokenizer, r["messages"], text, ends, cfg.max_length)
        labels = torch.tensor(r["labels"][: len(pos)], dtype=torch.float32)
        out.append({"ids": ids, "pos": pos, "labels": hard_labels(labels) if cfg.targets == "hard" else labels,
                    "dropped": len(ends) - len(pos), "prompt": prompt_key(r)})
    return out


@dataclass(frozen=True)
class Split:
    """The encoded solutions with a step within max_length, split: the held-out share is never trained on."""

    train: list[dict]
    held_out: list[dict]
    dropped_steps: int  # steps past max_length, of every solution
    validation: list[dict] = field(default_factory=list)  # choose the saved checkpoint, never trained on

    @property
    def steps_train(self) -> int:
        return sum(len(e["pos"]) for e in self.train)


def split_encoded(rows: list[dict], train_idx: list[int], eval_idx: list[int], tokenizer, cfg: PRMConfig,
                  val_idx: list[int] = ()) -> Split:
    """Encode every solution, then split them; refuses a run left with nothing to train on."""
    examples = encode(rows, tokenizer, cfg)
    dropped_steps = sum(e["dropped"] for e in examples)

    def kept(idx):
        return [examples[i] for i in idx if examples[i]["pos"]]
    train = kept(train_idx)
    if not train:
        raise SchemaError(f"prm: none of {len(train_idx)} training solution(s) has a step within "
                          f"max_length={cfg.max_length} tokens")
    return Split(train, kept(eval_idx), dropped_steps, kept(val_idx))


def pad_labels(labels: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(labels), width))
    for i, lab in enumerate(labels):
        out[i, : len(lab)] = lab
    return out


# ---------------------------------------------------------------------------- checkpoint choice


@dataclass
class Best:
    """The validated checkpoint with the lowest validation loss so far, resumable.

    Its trainable weights are a file beside the checkpoints, `best-step-N.safetensors` (fsync'ed, renamed),
    and its step and loss, with every validation so far, are in the checkpoint's state. The state's file is
    kept; any other best file is deleted at the next validation or resume, after the checkpoint that
    supersedes it is on disk, so a kill between the two never loses the best weights a resume refers to."""

    root: Path
    step: int = 0  # 0: none yet
    loss: float = math.inf
    history: list[list[float]] = field(default_factory=list)  # [step, loss, step accuracy] of every validation

    def path(self, step: int) -> Path:
        return self.root / f"best-step-{step:06d}.safetensors"

    def prune(self) -> None:
        """Delete every best file but this one's."""
        for p in self.root.glob("best-step-*.safetensors"):
            if p != self.path(self.step):
                p.unlink(missing_ok=True)

    def offer(self, step: int, loss: float, accuracy: float, model) -> bool:
        """Record a validation; a lower loss than the best so far saves the model's trainable weights as the
        new best. Whether it did."""
        self.prune()
        self.history.append([step, loss, accuracy])
        if not loss < self.loss:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        weights = trainable_state(model)
        replace_synced(self.path(step), lambda path: save_file(weights, str(path)))
        self.step, self.loss = step, loss
        return True

    def state(self) -> dict:
        return {"best_step": self.step, "best_loss": self.loss if self.step else None,
                "validation": [list(v) for v in self.history]}

    @classmethod
    def restore(cls, root: Path, state: dict, ctx: StageContext) -> Best:
        """The best of a resumed run's checkpoint state (its validations re-logged), other best files deleted;
        a best file that is missing (an older checkpoint resumed) or unreadable restarts the choice with a
        warning."""
        best = cls(root, state.get("best_step", 0), state.get("best_loss") or math.inf,
                   [list(v) for v in state.get("validation", [])])
        for step, loss, acc in best.history:
            ctx.log_metrics({"val/loss": loss, "val/step_accuracy": acc}, step=int(step))
        if best.step and not readable(best.path(best.step)):
            ctx.log.warning("prm: the best checkpoint's weights (step %d) are missing or unreadable; choosing "
                            "among the checkpoints from here on", best.step)
            best.step, best.loss = 0, math.inf
        best.prune()
        return best

    def load_into(self, model) -> None:
        """Put the best weights back into the model's trainable parameters."""
        weights = load_file(str(self.path(self.step)))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(weights) != trainable:
            raise RuntimeError(f"prm: the best checkpoint's weights do not match the model's trainable parameters "
                               f"({len(weights)} against {len(trainable)})")
        model.load_state_dict(weights, strict=False)  # the frozen parameters are not in the file


def readable(path: Path) -> bool:
    """Whether a safetensors file exists and its header reads."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (OSError, SafetensorError):
        return False
    return True


# ---------------------------------------------------------------------------- the training loop


@dataclass
class Session:
    """What every step reads and what the run accumulates: config, solutions, loop, precision, the curves."""

    cfg: PRMConfig
    ctx: StageContext
    data: Split
    pad_id: int
    loop: Loop
    autocast_dtype: torch.dtype | None
    curves: Curves = field(default_factory=lambda: Curves("train/step_accuracy"))  # every step's loss and accuracy so far
    best: Best | None = None  # with a validation split: the checkpoint to save


def open_session(cfg: PRMConfig, ctx: StageContext, dist: distributed.Dist, model, data: Split,
                 pad_id: int) -> Session:
    """Build the optimizer, log the run's parameters (one process: the model is not sharded)."""
    counts = models.count_parameters(model)
    loop = Loop.open(cfg, ctx, dist, model)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"solutions_train": len(data.train), "solutions_eval": len(data.held_out),
                    "solutions_validation": len(data.validation),
                    "steps_train": data.steps_train, "steps_dropped_by_max_length": data.dropped_steps,
                    "trainable_parameters": counts["trainable"], "total_parameters": counts["total"],
                    "precision": str(autocast_dtype or "fp32")})
    return Session(cfg, ctx, data, pad_id, loop, autocast_dtype)


def resume_session(s: Session) -> int:
    """Load the newest checkpoint and re-log its curves (the whole curve in MLflow); the step."""
    state = s.loop.resume("prm")
    s.curves.restore(state, s.ctx)
    if s.data.validation:
        s.best = Best.restore(s.ctx.checkpoint_dir, state, s.ctx)
    return state["step"]


def micro_batch_loss(s: Session, mb: list[dict], n_steps: int) -> tuple[float, int]:
    """Backward of a micro-batch's BCE over its steps, weighted as its share of the optimizer step's reasoning
    steps; (that loss, steps classified right)."""
    device = s.ctx.device
    ids, mask = right_padded([e["ids"] for e in mb], s.pad_id)  # (B, T)
    pos, pmask = pad_positions([e["pos"] for e in mb])  # (B, S)
    labels = pad_labels([e["labels"] for e in mb], pos.size(1))  # (B, S)
    with autocast(device, s.autocast_dtype):
        logits = step_logits(s.loop.model, ids.to(device), mask.to(device), pos.to(device))  # (B, S)
    real = int(pmask.sum())
    loss = prm_loss(logits, labels.to(device), pmask.to(device)) * (real / n_steps)
    loss.backward()
    on = pmask.bool()
    return loss.item(), int(((logits.detach().cpu()[on] >= 0) == (labels[on] >= 0.5)).sum())


def train_step(s: Session, step: int, lr: float) -> StepResult:
    """One optimizer step: the step's micro-batches, the mean loss over all their reasoning steps, the update."""
    train = s.data.train
    micro = [[train[i] for i in idx] for idx in step_micro_batches(len(train), s.cfg, s.ctx.seed, step)]
    n_steps = sum(len(e["pos"]) for mb in micro for e in mb)  # the optimizer step's reasoning steps
    step_loss, step_correct = 0.0, 0
    for mb in micro:
        loss, correct = micro_batch_loss(s, mb, n_steps)
        step_loss += loss
        step_correct += correct
    grad_norm = s.loop.update()
    result = s.curves.step(step_loss, step_correct / n_steps, lr, grad_norm)
    done = step + 1
    if s.best is not None and (done % s.cfg.checkpoint_every == 0 or done == s.cfg.max_steps):
        validate_checkpoint(s, done, result)
    return result


def validate_checkpoint(s: Session, done: int, result: StepResult) -> None:
    """At a checkpoint: the validation solutions' loss and step accuracy into the step's metrics, and the
    weights kept if the loss is the lowest so far; the choice into the checkpoint's state."""
    m = held_out_step_metrics(s.loop.model, s.data.validation, s.pad_id, s.cfg.batch_size, s.ctx.device)
    s.best.offer(done, m["eval_loss"], m["eval_step_accuracy"], s.loop.model)
    result.metrics |= {"val/loss": m["eval_loss"], "val/step_accuracy": m["eval_step_accuracy"]}
    result.state |= s.best.state()


# ---------------------------------------------------------------------------- results


def summarize(s: Session, start: int, elapsed: float) -> dict[str, float]:
    """The run's loss and step accuracy at its end, its data, its length and its time per step."""
    cfg, data = s.cfg, s.data
    return {
        "train_loss_final": float(np.mean(curve_tail(s.curves.losses))),
        "train_step_accuracy_final": float(np.mean(curve_tail(s.curves.accuracies))),
        "solutions_train": float(len(data.train)),
        "steps_train": float(data.steps_train),
        "steps_dropped_by_max_length": float(data.dropped_steps),
        "trained_steps": float(cfg.max_steps - start),
        "resumed_from_step": float(start),
        "seconds_per_step": elapsed / max(1, cfg.max_steps - start),
    } | ({"solutions_validation": float(len(data.validation)), "best_step": float(s.best.step),
          "val_loss_best": s.best.loss} if s.best is not None and s.best.step else {})


def accuracy_gain(probs: list[torch.Tensor], labels: list[torch.Tensor], prompts: list[str],
                  seed: int = 0) -> tuple[float, float, float]:
    """(step accuracy minus the majority label's, 95% low, high) over solutions (probs[i], labels[i]: one solution's
    steps), the interval a bootstrap over prompts: a prompt's solutions share its difficulty, so they are resampled
    together (`cluster_bootstrap_ratio`)."""
    majority = float((torch.cat(labels) >= 0.5).float().mean()) >= 0.5
    diff = [float(((p >= 0.5) == (y >= 0.5)).sum() - ((y >= 0.5) == majority).sum()) for p, y in zip(probs, labels, strict=True)]
    return cluster_bootstrap_ratio(diff, [float(len(y)) for y in labels], prompts, seed=seed)


def held_out_step_metrics(model, examples: list[dict], pad_id: int, batch_size: int, device: str) -> dict[str, float]:
    """Step accuracy (with the held-out labels' majority class as its baseline, and the gain over it with a 95%
    bootstrap interval over prompts), AUROC, first-error-step accuracy and BCE of the held-out solutions, labels
    thresholded at 0.5 where a metric needs classes."""
    logits = batched_step_logits(model, [e["ids"] for e in examples], [e["pos"] for e in examples], pad_id,
                                 batch_size, device)
    flat_logits, flat_labels = torch.cat(logits), torch.cat([e["labels"] for e in examples])
    width = max(len(lg) for lg in logits)
    mask = pad_labels([torch.ones(len(lg)) for lg in logits], width)
    solution_probs = [torch.sigmoid(lg) for lg in logits]
    probs = pad_labels(solution_probs, width)
    gain, low, high = accuracy_gain(solution_probs, [e["labels"] for e in examples], [e["prompt"] for e in examples])
    return {
        "eval_solutions": float(len(examples)),
        "eval_steps": float(flat_labels.numel()),
        "eval_loss": float(prm_loss(flat_logits, flat_labels)),
        "eval_step_accuracy": step_accuracy(torch.sigmoid(flat_logits), flat_labels),
        "eval_majority_baseline": majority_baseline(flat_labels),
        "eval_accuracy_gain": gain,
        "eval_accuracy_gain_low": low,
        "eval_accuracy_gain_high": high,
        "eval_prompts": float(len({e["prompt"] for e in examples})),
        "eval_auroc": auroc(flat_logits, flat_labels),
        "eval_first_error_accuracy": first_error_accuracy(probs, pad_labels([e["labels"] for e in examples], width),
                                                          mask),
    }


def log_held_out(ctx: StageContext, metrics: dict[str, float]) -> None:
    ctx.log.info("prm: held-out step accuracy %.3f (majority baseline %.3f; gain %+.3f, 95%% CI over %d prompts "
                 "[%+.3f, %+.3f]), AUROC %.3f, first-error accuracy %.3f", metrics["eval_step_accuracy"],
                 metrics["eval_majority_baseline"], metrics["eval_accuracy_gain"], metrics["eval_prompts"],
                 metrics["eval_accuracy_gain_low"], metrics["eval_accuracy_gain_high"], metrics["eval_auroc"],
                 metrics["eval_first_error_accuracy"])


def save_prm(ctx: StageContext, model, tokenizer, cfg: PRMConfig) -> Path:
    """Merged full weights with `prm.json` (delimiter, max_length) beside them; the artifact's staging directory."""
    out, model_dir = model_output_dir(ctx, "model")
    models.save_model(model, tokenizer, model_dir, merge=True)
    save_prm_settings(model_dir, cfg.delimiter, cfg.max_length)
    return out


# ---------------------------------------------------------------------------- the stage


def run(cfg: PRMConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    rows = load_rows(inputs.get("steps"), cfg)  # validates before loading the model
    train_idx, val_idx, eval_idx = split_rows(rows, cfg, ctx.seed)
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    model, tokenizer, pad_id = load_prm_or_backbone(inputs["model"], ctx.device)
    model = apply_reward_lora(model, cfg.lora)
    data = split_encoded(rows, train_idx, eval_idx, tokenizer, cfg, val_idx)
    s = open_session(cfg, ctx, dist, model, data, pad_id)
    start = resume_session(s)
    elapsed = s.loop.train(start, "prm", partial(train_step, s))
    if s.best is not None and s.best.step:
        s.best.load_into(s.loop.model)
        ctx.log.info("prm: saving step %d of %d, the lowest validation loss (%.4f on %d solutions)", s.best.step,
                     cfg.max_steps, s.best.loss, len(data.validation))
    metrics = summarize(s, start, elapsed)
    if data.held_out:
        metrics |= held_out_step_metrics(s.loop.model, data.held_out, pad_id, cfg.batch_size, ctx.device)
    ctx.log_metrics(metrics)
    if data.held_out:
        log_held_out(ctx, metrics)
    out = save_prm(ctx, s.loop.model, tokenizer, cfg)
    return {"model": Output("model", PRM_SCHEMA, out, metrics=metrics)}
