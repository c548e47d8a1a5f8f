"""`reward_model` stage: a Bradley-Terry reward model — a scalar head on a causal LM, trained on
preference pairs — and `RewardScorer`, which loads the result and scores completions.

Reads like a training script: split the pairs (a seeded held-out share is never trained on),
tokenize, then a plain loop of micro-batches → optimizer steps with checkpoints, then pairwise
accuracy on the held-out pairs. Loss: Bradley & Terry (1952) as used for RLHF reward models by
InstructGPT (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155, eq. 1), optionally with
Llama 2's margin (Touvron et al. 2023, https://arxiv.org/abs/2307.09288, §3.2.2, eq. 2).

Choices and departures from common trainers (TRL's RewardTrainer):
- the model is `AutoModelForSequenceClassification(num_labels=1)` built from the input causal
  LM's config, with the LM's backbone weights copied in and a fresh `score` head. An adapter
  input is merged into its base first (`Input.load_model()` attaches it, `merge_and_unload()`
  folds it), so no temporary directory is written;
- the reward is read at the last *real* token, located from the attention mask. transformers'
  own pooling looks for the last token that is not `pad_token_id`, which is wrong when the pad
  token equals EOS (SmolLM2: both `<|im_end|>`, which also closes every chat turn), so we run the
  backbone and the `score` head ourselves (`pooled_rewards`);
- a sequence is chat_template(prompt, add_generation_prompt=True) + completion + EOS, shared by
  training and scoring (`format_sequence`); too long → cut from the left, keeping the end where
  the reward is read;
- chosen and rejected go through one concatenated forward pass per micro-batch;
- the loss is a mean over all pairs of the optimizer step (all micro-batches), so batch 4 ×
  accumulation 1 equals batch 2 × accumulation 2, and N processes (each 1/N of every micro-batch,
  gradients summed: `stages.runtime.distributed`) equal one;
- the result is always saved as merged full weights (`lora.merge=False` is ignored, and logged):
  a reward-model adapter could not be loaded by `Input.load_model()`, which attaches adapters to
  causal LMs only. A reward-model artifact as input is trained further with its head kept.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from schemas.configs import LoraSpec, RewardModelConfig
from schemas.errors import ArtifactError, ModelError, SchemaError
from stages import sft
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.modeling import logprobs, models
from stages.runtime import distributed

VERSION = "1"
CONFIG = RewardModelConfig
INPUTS = {"model": "model", "preferences": "preferences"}
OUTPUTS = {"model": "model"}

OUTPUT_SCHEMA = "reward_model"  # manifest `schema` of the model artifact this stage writes
_SPLIT_STREAM = 1  # RNG stream of the held-out split, apart from the data order's


# ---------------------------------------------------------------------------- pure pieces


def bt_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley-Terry loss: mean of -log σ(r_c - r_r - m).

    chosen_rewards, rejected_rewards: (B,); margin: (B,) or None (= 0). Bradley & Terry (1952);
    InstructGPT eq. 1 (https://arxiv.org/abs/2203.02155); the margin m (how much better the
    chosen answer was rated) is Llama 2's eq. 2 (https://arxiv.org/abs/2307.09288): pairs rated
    far apart must be separated by at least that much before the loss flattens.
    """
    logits = chosen_rewards.float() - rejected_rewards.float()
    if margin is not None:
        logits = logits - margin.float()
    return -F.logsigmoid(logits).mean()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs with r_c > r_r (ties count as wrong). chosen, rejected: (B,)."""
    return float((chosen > rejected).float().mean()) if chosen.numel() else float("nan")


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) position of the rightmost attended token of each row of a (B, T) mask (any padding side).

    Pad-token ids are never looked at: with pad == EOS they also occur inside the text.
    """
    if not bool((attention_mask.sum(-1) > 0).all()):
        raise ValueError("last_token_index: a row of the attention mask has no real token")
    positions = torch.arange(attention_mask.size(-1), device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def split_pairs(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a seeded permutation, the first round(f·n) held out
    (at least one whenever f > 0)."""
    perm = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n).tolist()
    n_eval = max(1, round(eval_fraction * n)) if eval_fraction > 0 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


# ---------------------------------------------------------------------------- text → tokens


def format_sequence(tokenizer, messages: list[dict], completion: str, max_length: int) -> list[int]:
    """Token ids of chat_template(messages, add_generation_prompt=True) + completion + EOS.

    Longer than `max_length` → the left end is cut (the prompt first), so the EOS where the reward
    is read always survives. Shared by training and `RewardScorer` so both see the same text.
    """
    if messages and messages[-1]["role"] == "assistant":
        raise SchemaError("reward_model: a prompt must not end with an assistant turn (the completion is scored separately)")
    if tokenizer.eos_token is None:
        raise ModelError("reward_model: the tokenizer has no EOS token to close the completion with")
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return (p_ids + c_ids)[-max_length:]


def collate(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to (input_ids, attention_mask), both (N, T)."""
    return logprobs.right_padded(sequences, pad_id)


# ---------------------------------------------------------------------------- the model


def _unwrap(model) -> PreTrainedModel:
    """The sequence-classification model under a PeftModel (LoRA layers stay injected in it)."""
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(getattr(inner, "score", None), torch.nn.Module):
        raise ModelError(
            f"reward_model: {type(inner).__name__} has no `score` head; reward models need an architecture "
            "whose *ForSequenceClassification class has one (Llama, Mistral, Qwen2, Gemma, …)"
        )
    return inner


def pooled_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float rewards: the `score` head applied to the backbone's hidden state at the last real
    token. input_ids, attention_mask: (B, T), any padding side."""
    inner = _unwrap(model)
    hidden = distributed.inner_output(model, inner.base_model, input_ids=input_ids, attention_mask=attention_mask,
                                      use_cache=False).last_hidden_state  # (B, T, H)
    last = last_token_index(attention_mask)  # (B,)
    pooled = hidden[torch.arange(hidden.size(0), device=hidden.device), last]  # (B, H)
    return inner.score(pooled).squeeze(-1).float()  # (B,)


def reward_model_from_causal_lm(lm: PreTrainedModel, pad_token_id: int) -> PreTrainedModel:
    """A `*ForSequenceClassification` (one label) with `lm`'s backbone weights and a fresh head.

    Built from the config and filled from the state dict, so nothing is written to disk; the head
    is initialised by transformers from the current torch RNG (seed it first).
    """
    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    config.architectures = None
    config.use_cache = False
    try:
        rm = AutoModelForSequenceClassification.from_config(config)
    except ValueError as err:
        raise ModelError(f"reward_model: no sequence-classification class for {type(lm).__name__}: {err}") from err
    _unwrap(rm)
    if rm.base_model is rm or lm.base_model is lm:
        raise ModelError(f"reward_model: cannot locate the backbone of {type(lm).__name__} inside {type(rm).__name__}")
    rm.base_model.load_state_dict(lm.base_model.state_dict())  # strict: every backbone weight must match
    return rm.to(dtype=next(lm.parameters()).dtype)


def apply_reward_lora(model: PreTrainedModel, spec: LoraSpec):
    """LoRA on the backbone with the (new) `score` head fully trained; r = 0 → train everything.

    models.apply_lora uses task_type CAUSAL_LM; a reward model needs SEQ_CLS and the head in
    modules_to_save, otherwise the randomly initialised head would stay frozen.
    """
    if spec.r == 0:
        return model.requires_grad_(True)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=spec.target_modules, task_type="SEQ_CLS", modules_to_save=["score"])
    with models.peft_reading_checkpointing():
        return get_peft_model(model, config)


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], pad_id: int, batch_size: int, device: str) -> torch.Tensor:
    """(N,) rewards of token sequences, in batches of similar length (no grad, eval mode)."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = torch.empty(len(sequences))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = collate([sequences[i] for i in idx], pad_id)
        out[idx] = pooled_rewards(model, ids.to(device), mask.to(device)).cpu()
    model.train(was_training)
    return out


class RewardScorer:
    """Scores (conversation, completion) pairs with a saved reward model; text formatted as in training."""

    def __init__(self, model: PreTrainedModel, tokenizer, device: str = "cpu", max_length: int | None = None):
        _unwrap(model)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.eos_token_id
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 2048

    @classmethod
    def from_dir(cls, model_dir: Path | str, device: str = "cpu", max_length: int | None = None) -> RewardScorer:
        model_dir = Path(model_dir)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise ModelError(f"cannot load reward model {str(model_dir)!r}: {err}") from err
        arch = model.config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in arch) or model.config.num_labels != 1:
            raise ModelError(f"{str(model_dir)!r} is not a reward model (architectures={arch}, "
                             f"num_labels={model.config.num_labels}); train one with the reward_model stage")
        return cls(model, tokenizer, device, max_length)

    @classmethod
    def from_input(cls, inp: Input, device: str = "cpu", max_length: int | None = None) -> RewardScorer:
        if inp.manifest.schema_name != OUTPUT_SCHEMA:
            raise ArtifactError(f"{inp.label}: expected a {OUTPUT_SCHEMA!r} model artifact")
        return cls.from_dir(inp.model_dir, device, max_length)

    def score(self, conversations: list[list[dict]], completions: list[str], batch_size: int = 16) -> list[float]:
        """One reward per (prompt turns, completion) pair."""
        if len(conversations) != len(completions):
            raise ValueError(f"RewardScorer.score: {len(conversations)} conversations but {len(completions)} completions")
        seqs = [format_sequence(self.tokenizer, m, c, self.max_length)
                for m, c in zip(conversations, completions, strict=True)]
        return score_sequences(self.model, seqs, self.pad_id, batch_size, self.device).tolist() if seqs else []


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Pair:
    chosen: list[int]
    rejected: list[int]
    margin: float  # 0.0 unless cfg.margin and both scores are known


def load_preferences(data: Input, cfg: RewardModelConfig, seed: int) -> tuple[list[dict], list[int], list[int]]:
    """(rows, train indices, held-out indices), checked before any model is loaded."""
    rows = data.table("preferences").to_pylist()
    if not rows:
        raise SchemaError(f"{data.label}: no preference pairs to train a reward model on")
    train_idx, eval_idx = split_pairs(len(rows), cfg.eval_fraction, seed)
    if not train_idx:
        raise SchemaError(f"{data.label}: {len(rows)} preference pair(s) are too few to hold out "
                          f"eval_fraction={cfg.eval_fraction} and still train on some")
    return rows, train_idx, eval_idx


def tokenize_pairs(rows: list[dict], tokenizer, cfg: RewardModelConfig) -> list[Pair]:
    pairs = []
    for r in rows:
        known = cfg.margin and r["chosen_score"] is not None and r["rejected_score"] is not None
        pairs.append(Pair(format_sequence(tokenizer, r["messages"], r["chosen"], cfg.max_length),
                          format_sequence(tokenizer, r["messages"], r["rejected"], cfg.max_length),
                          float(r["chosen_score"] - r["rejected_score"]) if known else 0.0))
    return pairs


# ---------------------------------------------------------------------------- the stage


def load_reward_model(source: Input, device: str) -> tuple[PreTrainedModel, object, int]:
    """(reward model, tokenizer, pad id) from a causal-LM artifact (full weights or an adapter), or
    from a reward-model artifact to train further (its head is kept)."""
    if source.manifest.schema_name == OUTPUT_SCHEMA:
        scorer = RewardScorer.from_input(source, device)
        return scorer.model, scorer.tokenizer, scorer.pad_id
    lm, tokenizer = source.load_model()
    if isinstance(lm, PeftModel):
        lm = lm.merge_and_unload()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rm = reward_model_from_causal_lm(lm, pad_id)
    del lm
    return rm.to(device), tokenizer, pad_id


def run(cfg: RewardModelConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    data = inputs["preferences"]
    rows, train_idx, eval_idx = load_preferences(data, cfg, ctx.seed)  # validates before loading the model
    dist = distributed.of(ctx)  # N processes: each takes 1/N of every micro-batch; gradients are summed
    if cfg.lora.r > 0 and not cfg.lora.merge:
        ctx.log.info("reward_model: lora.merge=False ignored; reward models are saved as merged full weights")
    seed_everything(ctx.seed)
    model, tokenizer, pad_id = load_reward_model(inputs["model"], dist.load_device(ctx.device))
    model = apply_reward_lora(model, cfg.lora)
    pairs = tokenize_pairs(rows, tokenizer, cfg)
    train = [pairs[i] for i in train_idx]
    held_out = [pairs[i] for i in eval_idx]
    truncated = sum(max(len(p.chosen), len(p.rejected)) == cfg.max_length for p in pairs)  # cut (or exactly that long)
    if cfg.margin and not any(p.margin for p in train):
        ctx.log.warning("reward_model: margin=True but no training pair has both scores (or they are equal); plain BT loss")

    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = sft.make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    autocast_dtype = sft.resolve_precision(cfg.precision, ctx.device)
    ctx.log_params({"pairs_train": len(train), "pairs_eval": len(held_out), "pairs_truncated": truncated,
                    "trainable_parameters": counts["trainable"], "total_parameters": counts["total"],
                    "precision": str(autocast_dtype or "fp32")})

    state = sft.resume(ctx, model, optimizer, "reward_model", cfg.max_steps)
    start, losses, accuracies = state["step"], state.get("losses", []), state.get("accuracies", [])
    for i, (loss, acc) in enumerate(zip(losses, accuracies, strict=True)):  # the whole curve in MLflow
        ctx.log_metrics({"train/loss": loss, "train/accuracy": acc}, step=i + 1)

    model.train()
    pairs_seen, t0 = 0, time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="reward_model", unit="step", disable=not dist.is_main)
    for step in range(start, cfg.max_steps):
        lr = sft.set_lr(optimizer, cfg.learning_rate * sft.lr_factor(step, cfg.max_steps, warmup, cfg.lr_scheduler))
        step_indices = [sft.micro_batch_indices(len(train), cfg.batch_size, ctx.seed, step * cfg.grad_accum + a)
                        for a in range(cfg.grad_accum)]
        n_pairs = sum(len(idx) for idx in step_indices)  # the global step's
        pairs_seen += n_pairs
        # this process's parts (under fsdp a weight-0 filler where a part is empty)
        micro = [([train[i] for i in m], real) for m, real in map(dist.part_or_filler, step_indices) if m]
        step_loss, step_correct = 0.0, 0
        for mb, real in micro:
            ids, mask = collate([p.chosen for p in mb] + [p.rejected for p in mb], pad_id)  # (2B, T)
            margin = torch.tensor([p.margin for p in mb], device=ctx.device)
            with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                rewards = pooled_rewards(model, ids.to(ctx.device), mask.to(ctx.device))  # (2B,)
            r_chosen, r_rejected = rewards[: len(mb)], rewards[len(mb) :]
            loss = bt_loss(r_chosen, r_rejected, margin) * (len(mb) / n_pairs * real)  # mean over the step's pairs
            loss.backward()
            step_loss += loss.item()
            step_correct += int((r_chosen > r_rejected).sum()) * real
        dist.sync_gradients(trainable)
        step_loss, step_correct = dist.sum([step_loss, step_correct])
        grad_norm = sft.clip_grad_norm(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        accuracies.append(step_correct / n_pairs)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            sft.save_checkpoint(ctx.checkpoint_dir, done, model, optimizer,
                                {"step": done, "losses": losses, "accuracies": accuracies}, cfg.keep_checkpoints, dist)
        ctx.log_metrics({"train/loss": step_loss, "train/accuracy": accuracies[-1], "train/lr": lr,
                         "train/grad_norm": grad_norm}, step=done)
        bar.set_postfix(loss=f"{step_loss:.4f}", acc=f"{accuracies[-1]:.2f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t0
    trained_steps = cfg.max_steps - start

    tail = max(1, min(10, len(losses) // 5))
    metrics = {
        "train_loss_final": float(np.mean(losses[-tail:])),
        "train_accuracy_final": float(np.mean(accuracies[-tail:])),
        "pairs_train": float(len(train)),
        "pairs_eval": float(len(held_out)),
        "pairs_truncated": float(truncated),
        "steps": float(cfg.max_steps),
        "trained_steps": float(trained_steps),
        "resumed_from_step": float(start),
        "pairs_per_s": pairs_seen / elapsed if elapsed and pairs_seen else 0.0,
    }
    plain = dist.full_model(model, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    if held_out and dist.is_main:
        bs = 2 * cfg.batch_size
        r_chosen = score_sequences(plain, [p.chosen for p in held_out], pad_id, bs, ctx.device)
        r_rejected = score_sequences(plain, [p.rejected for p in held_out], pad_id, bs, ctx.device)
        both = torch.cat([r_chosen, r_rejected])
        metrics |= {
            "eval_accuracy": pairwise_accuracy(r_chosen, r_rejected),
            "eval_margin": float((r_chosen - r_rejected).mean()),
            "eval_loss": float(bt_loss(r_chosen, r_rejected)),
            "reward_mean": float(both.mean()),
            "reward_std": float(both.std()) if both.numel() > 1 else 0.0,
        }
    ctx.log_metrics({k: v for k, v in metrics.items() if k != "steps"})

    out, model_dir = model_output_dir(ctx, "model")
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=True)
    return {"model": Output("model", OUTPUT_SCHEMA, out, metrics=metrics)}
