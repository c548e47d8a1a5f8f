"""`distill` stage: teach a smaller student the teacher's reasoning.

Three modes, one training loop (sft's: a token-mean loss over the whole optimizer step, a data order
that is a pure function of (seed, step), checkpoints with exact resume):

- `traces` (DeepSeek-R1 §2.4: the distilled Qwen/Llama models are plain SFT on R1's verified
  traces): cross-entropy on the assistant tokens of the teacher's traces, exactly sft's loss.
- `logits` (Hinton et al. 2015, arXiv 1503.02531; word-level KD, Kim & Rush 2016): on the same
  traces the student matches the teacher's whole next-token distribution at every assistant token,
  `distill_losses.distill_loss` (forward or reverse KL at temperature T times T², or GKD's JSD).
  The teacher's logits come from a no-grad forward pass per micro-batch: [B, T, V] logits exist
  for one micro-batch at a time, never for the dataset.
- `on_policy` (GKD, Agarwal et al. 2023, arXiv 2306.13649, Algorithm 1): every step the student
  samples completions (`stages.sampling.generation.generate`) and the teacher's distributions supervise
  each sampled token, so the student learns on the prefixes it actually produces (including its
  mistakes); a share λ = `teacher_fraction` of the step's sequences are teacher traces instead.

Held out: the traces of a seeded `eval_fraction` of the prompts are never trained on; the
student's NLL per token of them is measured before and after training, next to the teacher's own
(`heldout_nll_before`, `heldout_nll_after`, `heldout_nll_teacher`).

Departures, on purpose:
- on_policy puts round(λ·B) teacher traces into *every* step instead of flipping a coin per step
  between an all-student and an all-teacher batch (GKD's Algorithm 1 with student fraction 1 − λ):
  the same expected mix, lower variance, and a resumed run sees the same batches;
- logits/on_policy need one tokenizer for teacher and student (checked before any weight loads)
  and compare distributions over its real tokens (the first len(tokenizer) logits), so models whose
  embedding matrices are padded to different sizes still line up;
- the student is trained on whole sequences of at most max_length tokens; longer traces lose
  their end (as in sft);
- on N processes each process takes 1/N of every micro-batch and divides by the step's global
  token count (gradients summed, `stages.runtime.distributed`); on_policy splits the step's student
  prompts among the processes (each rank from its own seed stream) and gathers the samples, so
  every rank sees the whole step. The held-out NLL and saving run on rank 0. Under fsdp the student
  samples through an unsharded copy on every rank (`Dist.copy_weights` refreshes it from the shards
  before each step's sampling): the sharding saves the gradients' and optimizer's memory, not the
  sampling copy's.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import time

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from schemas.configs import DistillConfig
from schemas.errors import ConfigError, ModelError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math.distill import distill_loss
from stages.math.supervised import IGNORE, masked_token_loss
from stages.modeling import models
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.completions import render_prompts
from stages.sampling.generation import generate, make_backend, release
from stages.sampling.vllm_backend import check_vllm_model
from stages.training.checkpoints import resume, save_checkpoint
from stages.training.loop import autocast
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    micro_batch_indices,
    resolve_precision,
    set_lr,
)
from stages.training.pairs import split_pairs
from stages.training.sequences import Example, collate, tokenize_conversation

VERSION = "4"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = DistillConfig
INPUTS = {"teacher": "model", "student": "model", "traces": "sft?", "prompts": "prompts?"}
OUTPUTS = {"model": "model"}

USES_TEACHER_LOGITS = ("logits", "on_policy")


def check(cfg: DistillConfig) -> None:
    if cfg.mode == "on_policy" and cfg.generation.temperature == 0 and cfg.teacher_fraction < 1:
        raise ConfigError("distill.generation.temperature: on_policy needs the student to sample (> 0); greedy "
                          "samples repeat one sequence per prompt")


# ---------------------------------------------------------------------------- inputs


def needed_inputs(cfg: DistillConfig, inputs: dict[str, Input]) -> None:
    """Fail before any compute when the mode lacks an input it needs."""
    has_traces, has_prompts = "traces" in inputs, "prompts" in inputs
    if cfg.mode in ("traces", "logits") and not has_traces:
        raise ConfigError(f"distill.mode={cfg.mode!r} trains on teacher traces: wire an sft dataset to the node's "
                          f"`traces` input (e.g. a distill_traces node)")
    if cfg.mode == "on_policy":
        if cfg.teacher_fraction < 1 and not has_prompts:
            raise ConfigError("distill.mode='on_policy' samples from the student on prompts: wire a prompts dataset "
                              "to the node's `prompts` input")
        if cfg.teacher_fraction > 0 and not has_traces:
            raise ConfigError(f"distill.teacher_fraction={cfg.teacher_fraction} mixes in teacher traces: wire an sft "
                              f"dataset to the node's `traces` input, or set teacher_fraction: 0")


def load_tokenizer(model: Input):
    """A model artifact's tokenizer, without its weights (an adapter's own, else its base's)."""
    directory = model.model_dir
    if not (directory / "tokenizer_config.json").exists() and model.base is not None:
        directory = model.base.model_dir
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise ModelError(f"{model.label}: cannot load its tokenizer from {directory}: {err}") from err


def tokenizer_differences(a, b) -> list[str]:
    """What makes two tokenizers produce different ids or special tokens; [] when they are one tokenizer."""
    problems = []
    if len(a) != len(b):
        problems.append(f"vocabulary sizes {len(a)} and {len(b)}")
    else:
        va, vb = a.get_vocab(), b.get_vocab()
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
        if diff:
            problems.append(f"{len(diff)} differing vocabulary entries (first: {diff[0][0]!r} -> id {diff[0][1]})")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(a, name) != getattr(b, name):
            problems.append(f"{name} {getattr(a, name)!r} vs {getattr(b, name)!r}")
    return problems


def check_shared_tokenizer(teacher: Input, student: Input, mode: str) -> bool:
    """True when teacher and student share a tokenizer; raises for the modes that need one."""
    problems = tokenizer_differences(load_tokenizer(teacher), load_tokenizer(student))
    if problems and mode in USES_TEACHER_LOGITS:
        raise ModelError(f"distill.mode={mode!r} compares teacher and student distributions token by token, so both "
                         f"need the same tokenizer, but teacher {teacher.label} and student {student.label} differ: "
                         f"{'; '.join(problems)}. Use mode: traces (SFT on the decoded traces works across "
                         f"tokenizers) or a student cut from the teacher (make_student).")
    return not problems


def trace_groups(data: Input) -> tuple[list[list[dict]], list[str]]:
    """Conversations of an sft dataset and the prompt each comes from (metadata prompt_id, else the row id)."""
    table = data.table("sft")
    if table.num_rows == 0:
        raise SchemaError(f"{data.label}: no traces to distil")
    groups = []
    for row_id, meta in zip(table["id"].to_pylist(), table["metadata"].to_pylist(), strict=True):
        try:
            parsed = json.loads(meta) if meta else {}
        except json.JSONDecodeError:
            parsed = {}
        groups.append(str(parsed.get("prompt_id", row_id)) if isinstance(parsed, dict) else row_id)
    return table["messages"].to_pylist(), groups


def split_by_prompt(groups: list[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows): whole prompts are held out, so no held-out prompt is trained on."""
    prompts = sorted(set(groups))
    if eval_fraction > 0 and len(prompts) < 2:
        return list(range(len(groups))), []  # one prompt cannot be split; nothing is held out
    _, held = split_pairs(len(prompts), eval_fraction, seed)
    held_prompts = {prompts[i] for i in held}
    return ([i for i, g in enumerate(groups) if g not in held_prompts],
            [i for i, g in enumerate(groups) if g in held_prompts])


# ---------------------------------------------------------------------------- tensors


def sampled_example(prompt_ids: list[int], completion_ids: list[int], max_length: int) -> Example:
    """A student sample as a training example: labels only on the completion tokens."""
    ids = (prompt_ids + completion_ids)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + completion_ids)[:max_length]
    return Example(ids, labels)


def micro_batch_loss(student, teacher, batch: dict[str, torch.Tensor], cfg: DistillConfig, vocab: int,
                     autocast_dtype, device: str) -> tuple[torch.Tensor, float, int]:
    """(summed loss with gradient, summed student NLL, target tokens) of one right-padded micro-batch.

    traces: the NLL is the loss. logits/on_policy: the divergence at every position whose next token
    is a target (labels != IGNORE), teacher logits from a no-grad pass over the same tokens.
    """
    ids, attn, labels = batch["input_ids"].to(device), batch["attention_mask"].to(device), batch["labels"].to(device)
    with autocast(device, autocast_dtype):
        logits = student(input_ids=ids, attention_mask=attn).logits
    nll, n = masked_token_loss(logits, labels)
    if cfg.mode == "traces":
        return nll, nll.item(), n
    with torch.no_grad(), autocast(device, autocast_dtype):
        teacher_logits = teacher(input_ids=ids, attention_mask=attn).logits
    mask = labels[:, 1:] != IGNORE  # (B, T-1): position t predicts target token t+1
    loss = distill_loss(cfg.divergence, logits[:, :-1, :vocab], teacher_logits[:, :-1, :vocab], mask,
                        cfg.temperature, cfg.jsd_beta, reduction="sum")
    return loss, nll.item(), n


@torch.no_grad()
def heldout_nll(model, examples: list[Example], pad_id: int, batch_size: int, autocast_dtype, device: str) -> float:
    """Mean NLL per target token of `examples` under `model` (the held-out teacher traces)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in collate(examples[i : i + batch_size], pad_id).items()}
        with autocast(device, autocast_dtype):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss, n = masked_token_loss(logits, batch["labels"])
        total, count = total + loss.item(), count + n
    model.train(was_training)
    return total / max(1, count)


def teacher_parameters(teacher: Input, loaded=None) -> float:
    """The teacher's parameter count: of the loaded model, else its manifest's, else built on the meta device."""
    if loaded is not None:
        return float(models.count_parameters(loaded)["total"])
    if "parameters" in teacher.manifest.metrics:
        return float(teacher.manifest.metrics["parameters"])
    config = AutoConfig.from_pretrained(teacher.base.model_dir if teacher.base is not None else teacher.model_dir)
    with torch.device("meta"):  # shapes only, no memory, no init
        return float(models.count_parameters(AutoModelForCausalLM.from_config(config))["total"])


# ---------------------------------------------------------------------------- what the run holds


@dataclasses.dataclass
class Plan:
    """What `check_inputs` settles before any weight loads."""

    shared: bool  # teacher and student share a tokenizer
    conversations: list[list[dict]]  # the teacher's traces
    train_rows: list[int]  # indices into conversations
    held_rows: list[int]
    prompts: list[dict]  # on_policy: the prompts rows the student samples on
    samples: bool  # the student samples (on_policy with teacher_fraction < 1)
    engine: bool  # a colocated vLLM engine samples, the student's weights pushed in


@dataclasses.dataclass
class Session:
    """What every phase of the run reads: config, process group, models, tokenizer, data, optimizer, sampler."""

    cfg: DistillConfig
    ctx: StageContext
    dist: distributed.Dist
    student: torch.nn.Module  # after `prepare_training`: dist.prepare'd (sharded under fsdp)
    teacher: torch.nn.Module | None  # frozen; in traces mode loaded only for the held-out NLL, then dropped
    tokenizer: object
    merged_input: bool
    pad_id: int
    autocast_dtype: torch.dtype | None
    train: list[Example]
    held: list[Example]
    prompts: list[dict]
    scoring: bool  # this process measures the held-out NLL (rank 0, when anything is held out)
    vocab: int  # len(tokenizer): the real tokens whose distributions are compared
    params: dict[str, float] = dataclasses.field(default_factory=dict)  # teacher/student parameters, their ratio
    backend: object = None  # the vLLM engine, when one samples
    sampler: torch.nn.Module | None = None  # fsdp: the student's unsharded sampling copy
    optimizer: torch.optim.Optimizer | None = None
    trainable: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    warmup: int = 0
    tokens_seen: int = 0  # this process's tokens trained on (attention-mask ones)
    synced: float | None = None  # seconds of this step's push of the student's weights into the vLLM engine


# ---------------------------------------------------------------------------- phases


def check_inputs(cfg: DistillConfig, inputs: dict[str, Input], ctx: StageContext) -> Plan:
    """Everything that can be checked before a weight loads: inputs, tokenizers, traces, prompts, split."""
    needed_inputs(cfg, inputs)
    shared = check_shared_tokenizer(inputs["teacher"], inputs["student"], cfg.mode)
    conversations, groups = trace_groups(inputs["traces"]) if "traces" in inputs else ([], [])
    prompts = []
    if cfg.mode == "on_policy" and cfg.teacher_fraction < 1:
        prompts = [r for r in inputs["prompts"].table("prompts").to_pylist() if r["split"] == cfg.split]
        if not prompts:
            raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r} for the student to sample on")
    train_rows, held_rows = split_by_prompt(groups, cfg.eval_fraction, ctx.seed) if groups else ([], [])
    if conversations and not train_rows and (cfg.mode != "on_policy" or cfg.teacher_fraction > 0):
        raise SchemaError(f"{inputs['traces'].label}: every trace is held out (eval_fraction={cfg.eval_fraction})")

    samples = cfg.mode == "on_policy" and cfg.teacher_fraction < 1
    engine = samples and cfg.generation.backend == "vllm"
    if engine:
        check_vllm_model(inputs["student"])
    return Plan(shared, conversations, train_rows, held_rows, prompts, samples, engine)


def tokenize_traces(cfg: DistillConfig, inputs: dict[str, Input], plan: Plan, tokenizer) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples: traces with an assistant token left after truncation to max_length."""
    tokenized = [tokenize_conversation(tokenizer, c, cfg.max_length) for c in plan.conversations]
    train = [tokenized[i] for i in plan.train_rows if any(lab != IGNORE for lab in tokenized[i].labels[1:])]
    held = [tokenized[i] for i in plan.held_rows if any(lab != IGNORE for lab in tokenized[i].labels[1:])][: cfg.max_heldout]
    if plan.conversations and not train and (cfg.mode != "on_policy" or cfg.teacher_fraction > 0):
        raise SchemaError(f"{inputs['traces'].label}: every training trace lost its assistant tokens to "
                          f"max_length={cfg.max_length}")
    return train, held


def load_teacher(teacher: Input, device: str) -> torch.nn.Module:
    """The teacher, frozen, in eval mode, an adapter merged into its base."""
    model, _ = teacher.load_model()
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(device).eval().requires_grad_(False)


def log_sizes(s: Session, plan: Plan, teacher: Input) -> None:
    """Parameter counts (teacher, student, ratio: `s.params`) and the run's sizes, to the tracker."""
    counts = models.count_parameters(s.student)
    # the student's own size: a LoRA adapter's matrices are what it trains, not part of the model it is
    adapter = sum(p.numel() for n, p in s.student.named_parameters() if "lora_" in n)
    s.params = {"teacher_parameters": teacher_parameters(teacher, s.teacher),
                "student_parameters": float(counts["total"] - adapter)}
    s.params["parameter_ratio"] = s.params["student_parameters"] / s.params["teacher_parameters"]
    s.ctx.log_params({"traces_train": len(s.train), "traces_heldout": len(s.held), "train_prompts": len(s.prompts),
                      "trainable_parameters": counts["trainable"], "precision": str(s.autocast_dtype or "fp32"),
                      "shared_tokenizer": plan.shared})
    s.ctx.log_metrics(s.params)


def open_session(cfg: DistillConfig, inputs: dict[str, Input], ctx: StageContext, plan: Plan) -> Session:
    """Load the student (seeded), tokenize the traces, load the teacher where the mode or the held-out NLL needs it."""
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    student, tokenizer, merged_input = load_trainable(inputs["student"], cfg, dist.load_device(ctx.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    train, held = tokenize_traces(cfg, inputs, plan, tokenizer)
    scoring = bool(held) and dist.is_main  # the held-out NLL is rank 0's job
    teacher = None
    if cfg.mode in USES_TEACHER_LOGITS or (plan.shared and scoring):
        teacher = load_teacher(inputs["teacher"], ctx.device)
    s = Session(cfg, ctx, dist, student, teacher, tokenizer, merged_input, pad_id, autocast_dtype, train, held,
                plan.prompts, scoring, vocab=len(tokenizer))
    log_sizes(s, plan, inputs["teacher"])
    return s


def prepare_training(s: Session, plan: Plan, student: Input) -> None:
    """The sampler (vLLM engine, or fsdp's unsharded copy), the student prepared for the processes, the optimizer."""
    cfg, ctx = s.cfg, s.ctx
    s.backend = make_backend(cfg.generation, s.student, s.tokenizer, student, seed=ctx.seed,
                             colocated=True) if plan.engine else None
    # fsdp: the student samples through an unsharded copy on every rank, refreshed before each step's sampling
    s.sampler = copy.deepcopy(s.student).requires_grad_(False).to(ctx.device) if s.dist.sharded and plan.samples else None
    s.student = s.dist.prepare(s.student, ctx)  # sharded across the processes under fsdp
    s.trainable = [p for p in s.student.parameters() if p.requires_grad]
    s.optimizer = make_optimizer(s.trainable, cfg.learning_rate, cfg.weight_decay)
    s.warmup = int(cfg.warmup_ratio * cfg.max_steps)


def heldout_before(s: Session, before: float | None) -> dict[str, float]:
    """The student's held-out NLL before training (a resumed run keeps its first) and the teacher's; then, in
    traces mode, the teacher is dropped (it was loaded only for this)."""
    heldout = {}
    net = s.dist.full_model(s.student, s.ctx.device) if s.held and before is None else None  # fsdp: every rank gathers
    if s.scoring:
        heldout["heldout_nll_before"] = before or heldout_nll(net, s.held, s.pad_id, s.cfg.batch_size,
                                                              s.autocast_dtype, s.ctx.device)
        if s.teacher is not None:
            heldout["heldout_nll_teacher"] = heldout_nll(s.teacher, s.held, s.pad_id, s.cfg.batch_size,
                                                         s.autocast_dtype, s.ctx.device)
        s.ctx.log_metrics(heldout)
    del net
    if s.cfg.mode == "traces" and s.teacher is not None:  # loaded only for its held-out NLL
        s.teacher = None
        gc.collect()
    return heldout


def sample_student(s: Session, step: int, n: int) -> tuple[list[tuple[Example, int]], object]:
    """n student samples on the step's seeded prompts, gathered from every process: ((example, completion
    tokens) per sample, this process's generation stats)."""
    cfg, dist = s.cfg, s.dist
    rng = np.random.default_rng(seed_stream(s.ctx.seed, "prompts", step))
    picked = rng.choice(len(s.prompts), n, replace=len(s.prompts) < n)
    convs = dist.part([s.prompts[i]["messages"] for i in picked])  # N processes: each samples a part
    if s.sampler is not None:
        dist.copy_weights(s.student, s.sampler)  # a collective: every rank, every step
    seed = seed_stream(s.ctx.seed, "rollout", step, 0, dist.rank)
    if s.backend is not None:  # the student's current weights into the engine, in place (LoRA folded in)
        s.synced = s.backend.sync(s.student, step, cfg.generation.sync_timeout_s)
        comps, stats = s.backend.generate(convs, cfg.generation, n=1, seed=seed, progress=False)
    else:
        comps, stats = generate(s.sampler if s.sampler is not None else s.student, s.tokenizer, convs, cfg.generation,
                                n=1, seed=seed, progress=False, autocast_dtype=s.autocast_dtype)
    texts = render_prompts(s.tokenizer, convs, cfg.generation.prefill)  # a prefill is prompt: not trained
    prompt_ids = [s.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sampled = dist.gather_list([(sampled_example(p, list(c[0].token_ids), cfg.max_length), c[0].num_tokens)
                                for p, c in zip(prompt_ids, comps, strict=True)])
    return sampled, stats


def step_batches(s: Session, step: int) -> tuple[list[list[Example]], dict[str, float]]:
    """One step's micro-batches, on every rank: a pure function of (seed, step) and, on-policy, the student."""
    cfg, train = s.cfg, s.train
    if cfg.mode != "on_policy":
        return [[train[i] for i in micro_batch_indices(len(train), cfg.batch_size, s.ctx.seed,
                                                       step * cfg.grad_accum + a)]
                for a in range(cfg.grad_accum)], {}
    total = cfg.batch_size * cfg.grad_accum
    n_teacher = round(cfg.teacher_fraction * total) if train else 0
    examples = [train[i] for i in np.random.default_rng(seed_stream(s.ctx.seed, "teacher_traces", step)).choice(
        len(train), n_teacher, replace=len(train) < n_teacher)] if n_teacher else []
    info = {"train/teacher_sequences": float(n_teacher)}
    if total - n_teacher:
        sampled, stats = sample_student(s, step, total - n_teacher)
        examples += [ex for ex, _ in sampled]
        info.update({"train/student_sequences": float(total - n_teacher),
                     "time/generation": s.dist.max(stats.seconds),
                     **({"time/weight_sync": s.synced} if s.synced is not None else {}),
                     "train/sample_length": float(np.mean([n for _, n in sampled]))})
    return [examples[i : i + cfg.batch_size] for i in range(0, len(examples), cfg.batch_size)], info


def train_step(s: Session, step: int) -> dict[str, float]:
    """One optimizer step over the step's micro-batches (a token mean over all of them, every process); its metrics."""
    cfg, dist = s.cfg, s.dist
    lr = set_lr(s.optimizer, cfg.learning_rate * lr_factor(step, cfg.max_steps, s.warmup, cfg.lr_scheduler))
    micro, metrics = step_batches(s, step)  # the global step's micro-batches, on every rank
    n_tokens = max(1, sum(lab != IGNORE for m in micro for ex in m for lab in ex.labels[1:]))
    # this process's parts (under fsdp a weight-0 filler where a part is empty)
    batches = [(collate(m, s.pad_id), real) for m, real in map(dist.part_or_filler, micro) if m]
    t_train = time.perf_counter()
    step_loss = step_nll = 0.0
    for batch, real in batches:
        loss_sum, nll_sum, _ = micro_batch_loss(s.student, s.teacher, batch, cfg, s.vocab, s.autocast_dtype,
                                                s.ctx.device)
        (loss_sum * real / n_tokens).backward()
        step_loss += loss_sum.item() * real / n_tokens
        step_nll += nll_sum * real / n_tokens
        s.tokens_seen += int(batch["attention_mask"].sum()) * real
    dist.sync_gradients(s.trainable)
    step_loss, step_nll = dist.sum([step_loss, step_nll])
    grad_norm = clip_grad_norm(s.trainable, cfg.max_grad_norm)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    metrics.update({"train/loss": step_loss, "train/nll": step_nll, "train/lr": lr, "train/grad_norm": grad_norm,
                    "train/tokens": float(n_tokens), "time/training": time.perf_counter() - t_train})
    return metrics


def save_student(s: Session, plain: torch.nn.Module) -> tuple[object, bool]:
    """Rank 0 saves the trained student (merged where asked or where its input was); (output dir, is an adapter)."""
    out, model_dir = model_output_dir(s.ctx, "model")
    merge = s.cfg.lora.merge or s.merged_input
    if s.dist.is_main:
        models.save_model(plain, s.tokenizer, model_dir, merge=merge)
    return out, s.cfg.lora.r > 0 and not merge


def summarize(s: Session, history: list[dict], heldout: dict[str, float], start: int, tokens_seen: float,
              elapsed: float) -> dict[str, float]:
    """The stage's metrics: parameter counts, held-out NLLs, first and final loss, steps, data sizes, throughput."""
    trained_steps = s.cfg.max_steps - start
    losses = [m["train/loss"] for m in history]
    tail = losses[-max(1, min(10, len(losses) // 5)) :]
    return {**s.params, **heldout,
            "final_loss": float(np.mean(tail)), "first_loss": float(losses[0]),
            "trained_steps": float(trained_steps), "resumed_from_step": float(start),
            "traces_train": float(len(s.train)), "traces_heldout": float(len(s.held)),
            "tokens_per_s": tokens_seen / elapsed if elapsed and trained_steps else 0.0}


# ---------------------------------------------------------------------------- the stage


def run(cfg: DistillConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    plan = check_inputs(cfg, inputs, ctx)  # before any weight loads
    s = open_session(cfg, inputs, ctx, plan)
    prepare_training(s, plan, inputs["student"])
    state = resume(ctx, s.student, s.optimizer, "distill", cfg.max_steps)
    start, history = state["step"], state.get("history", [])
    for i, m in enumerate(history):  # the curve of the interrupted run, so MLflow shows it whole
        ctx.log_metrics(m, step=i + 1)
    heldout = heldout_before(s, state.get("heldout_nll_before"))

    s.student.train()
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc=f"distill ({cfg.mode})", unit="step",
               disable=not s.dist.is_main)
    for step in range(start, cfg.max_steps):
        metrics = train_step(s, step)
        history.append(metrics)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            save_checkpoint(ctx.checkpoint_dir, done, s.student, s.optimizer,
                            {"step": done, "history": history, **heldout}, cfg.keep_checkpoints, s.dist)
        ctx.log_metrics(metrics, step=done)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        bar.update(1)
    bar.close()
    release(s.backend)  # a vLLM engine is shut down: the flow's next stage may start its own
    elapsed = time.perf_counter() - t0
    (tokens_seen,) = s.dist.sum([s.tokens_seen])

    plain = s.dist.full_model(s.student, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    if s.scoring:
        heldout["heldout_nll_after"] = heldout_nll(plain, s.held, s.pad_id, cfg.batch_size, s.autocast_dtype,
                                                   ctx.device)
    out, is_adapter = save_student(s, plain)
    metrics = summarize(s, history, heldout, start, tokens_seen, elapsed)
    ctx.log_metrics(metrics)
    if s.scoring:
        ctx.log.info("distill (%s): held-out NLL of teacher traces %.3f -> %.3f per token (teacher %s)", cfg.mode,
                     heldout["heldout_nll_before"], heldout["heldout_nll_after"],
                     f"{heldout['heldout_nll_teacher']:.3f}" if "heldout_nll_teacher" in heldout else "n/a")
    extra = {"base_fingerprint": inputs["student"].fingerprint} if is_adapter else {}
    return {"model": Output("model", "adapter" if is_adapter else "model", out, metrics=metrics, extra=extra)}
