"""Scalar heads on a causal LM: the Bradley-Terry reward model (a Linear(hidden, 1) read at the
last real token), its LoRA, loading a reward-model artifact, and `RewardScorer`, which scores
(prompt, completion) pairs for rejection sampling, grpo and ppo.

The last real token is found from the attention mask, never by looking for the pad token:
SmolLM2's pad token is its EOS, which also occurs inside the text.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from schemas.configs import LoraSpec
from schemas.errors import ArtifactError, ModelError, SchemaError
from stages.modeling import logprobs, models
from stages.runtime import distributed

if TYPE_CHECKING:  # the stage API's input type, for annotations only (stages.base sits above this layer)
    from stages.base import Input

REWARD_MODEL_SCHEMA = "reward_model"  # manifest `schema` of a reward-model artifact


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) position of the rightmost attended token of each row of a (B, T) mask (any padding side).

    Pad-token ids are never looked at: with pad == EOS they also occur inside the text.
    """
    if not bool((attention_mask.sum(-1) > 0).all()):
        raise ValueError("last_token_index: a row of the attention mask has no real token")
    positions = torch.arange(attention_mask.size(-1), device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


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
        ids, mask = logprobs.right_padded([sequences[i] for i in idx], pad_id)
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
        if inp.manifest.schema_name != REWARD_MODEL_SCHEMA:
            raise ArtifactError(f"{inp.label}: expected a {REWARD_MODEL_SCHEMA!r} model artifact")
        return cls.from_dir(inp.model_dir, device, max_length)

    def score(self, conversations: list[list[dict]], completions: list[str], batch_size: int = 16) -> list[float]:
        """One reward per (prompt turns, completion) pair."""
        if len(conversations) != len(completions):
            raise ValueError(f"RewardScorer.score: {len(conversations)} conversations but {len(completions)} completions")
        seqs = [format_sequence(self.tokenizer, m, c, self.max_length)
                for m, c in zip(conversations, completions, strict=True)]
        return score_sequences(self.model, seqs, self.pad_id, batch_size, self.device).tolist() if seqs else []


def load_reward_model(source: Input, device: str) -> tuple[PreTrainedModel, object, int]:
    """(reward model, tokenizer, pad id) from a causal-LM artifact (full weights or an adapter), or
    from a reward-model artifact to train further (its head is kept)."""
    if source.manifest.schema_name == REWARD_MODEL_SCHEMA:
        scorer = RewardScorer.from_input(source, device)
        return scorer.model, scorer.tokenizer, scorer.pad_id
    lm, tokenizer = source.load_model()
    if isinstance(lm, PeftModel):
        lm = lm.merge_and_unload()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rm = reward_model_from_causal_lm(lm, pad_id)
    del lm
    return rm.to(device), tokenizer, pad_id


# ---------------------------------------------------------------------------- process reward models (issue 33)
# A PRM is the same `*ForSequenceClassification(num_labels=1)` as a reward model, its head read at the last
# token of every reasoning step instead of once at the end (the `prm` stage trains it; stages.math.steps holds
# the step splitting, boundary and label math).

PRM_SCHEMA = "process_reward_model"  # manifest `schema` of the prm stage's model artifact
PRM_SETTINGS_FILE = "prm.json"  # beside the weights: how completions are cut into steps, the token limit


def encode_steps(tokenizer, messages: list[dict], completion: str, char_ends: list[int],
                 max_length: int) -> tuple[list[int], list[int]]:
    """(token ids, step-end positions) of chat_template(messages, add_generation_prompt=True) + completion.

    char_ends: exclusive character end of each step in `completion`; a step's position is the token
    holding its last character (`stages.math.steps.boundary_positions`, from the tokenizer's offsets).
    No EOS: steps are read where they end. Longer than `max_length` → cut from the right, and the
    steps ending past the cut are dropped (the positions are those of the first len(positions) steps).
    """
    from stages.math.steps import boundary_positions

    if messages and messages[-1]["role"] == "assistant":
        raise SchemaError("prm: a prompt must not end with an assistant turn (the steps are the answer)")
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    enc = tokenizer(completion, add_special_tokens=False, return_offsets_mapping=True)
    positions = [len(p_ids) + p for p in boundary_positions(enc["offset_mapping"], char_ends)]
    return (p_ids + enc["input_ids"])[:max_length], [p for p in positions if p < max_length]


def pad_positions(positions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) step-end positions right padded with 0, and their 0/1 mask."""
    width = max(1, max((len(p) for p in positions), default=1))
    pos = torch.zeros((len(positions), width), dtype=torch.long)
    mask = torch.zeros((len(positions), width), dtype=torch.long)
    for i, p in enumerate(positions):
        pos[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, : len(p)] = 1
    return pos, mask


def step_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, S) logits of the `score` head at the step-end positions (B, S) (padding: any in-range index, masked
    by the caller). input_ids, attention_mask: (B, T), right padded. One forward pass scores every step."""
    inner = _unwrap(model)
    hidden = distributed.inner_output(model, inner.base_model, input_ids=input_ids, attention_mask=attention_mask,
                                      use_cache=False).last_hidden_state  # (B, T, H)
    picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.size(-1)))  # (B, S, H)
    return inner.score(picked).squeeze(-1).float()  # (B, S)


@torch.no_grad()
def batched_step_logits(model, sequences: list[list[int]], positions: list[list[int]], pad_id: int,
                        batch_size: int, device: str) -> list[torch.Tensor]:
    """Per sequence the (S_i,) step logits at its positions (empty for an empty sequence): batches of similar
    length, no grad, eval mode."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for start in range(0, len(order), batch_size):
        idx = [i for i in order[start : start + batch_size] if sequences[i] and positions[i]]
        if not idx:
            continue
        ids, mask = logprobs.right_padded([sequences[i] for i in idx], pad_id)
        pos, pmask = pad_positions([positions[i] for i in idx])
        logits = step_logits(model, ids.to(device), mask.to(device), pos.to(device)).cpu()  # (b, S)
        for row, i in enumerate(idx):
            out[i] = logits[row, : int(pmask[row].sum())]
    model.train(was_training)
    return out


def save_prm_settings(model_dir: Path, delimiter: str, max_length: int) -> None:
    """What `StepScorer.from_dir` reads beside the weights: how completions are cut into steps, the token limit."""
    import json

    (Path(model_dir) / PRM_SETTINGS_FILE).write_text(
        json.dumps({"delimiter": delimiter, "max_length": max_length}, sort_keys=True))


class StepScorer:
    """Scores every step of (conversation, completion) pairs with a process reward model (`prm` stage).

    A completion is cut into steps with the delimiter the PRM was trained with (saved beside it); one
    forward pass per completion reads the head at every step's last token, the text formatted as in
    training. `score_steps` gives each completion's step ends (exclusive character offsets in the
    completion) and P(step is right); `score` aggregates them per completion (min, product, last, mean).
    """

    def __init__(self, model: PreTrainedModel, tokenizer, device: str = "cpu", max_length: int = 512,
                 delimiter: str = "blank_line"):
        _unwrap(model)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.eos_token_id
        self.max_length = max_length
        self.delimiter = delimiter

    @classmethod
    def from_dir(cls, model_dir: Path | str, device: str = "cpu") -> StepScorer:
        import json

        model_dir = Path(model_dir)
        settings = model_dir / PRM_SETTINGS_FILE
        if not settings.exists():
            raise ModelError(f"{str(model_dir)!r} is not a process reward model (no {PRM_SETTINGS_FILE}); train one "
                             "with the prm stage")
        try:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise ModelError(f"cannot load process reward model {str(model_dir)!r}: {err}") from err
        cfg = json.loads(settings.read_text())
        return cls(model, tokenizer, device, cfg["max_length"], cfg["delimiter"])

    @classmethod
    def from_input(cls, inp: Input, device: str = "cpu") -> StepScorer:
        if inp.manifest.schema_name != PRM_SCHEMA:
            raise ArtifactError(f"{inp.label}: expected a {PRM_SCHEMA!r} model artifact (the prm stage's)")
        return cls.from_dir(inp.model_dir, device)

    def score_steps(self, conversations: list[list[dict]], completions: list[str],
                    batch_size: int = 16) -> list[tuple[list[int], list[float]]]:
        """Per completion (step ends, step probabilities): the probabilities of the steps that fit in
        max_length tokens, a prefix of the ends (all of them unless the completion is cut)."""
        from stages.math.steps import step_spans

        if len(conversations) != len(completions):
            raise ValueError(f"StepScorer: {len(conversations)} conversations but {len(completions)} completions")
        ends = [[e for _, e in step_spans(c, self.delimiter)] for c in completions]
        encoded = [encode_steps(self.tokenizer, m, c, e, self.max_length)
                   for m, c, e in zip(conversations, completions, ends, strict=True)]
        logits = batched_step_logits(self.model, [ids for ids, _ in encoded], [p for _, p in encoded], self.pad_id,
                                     batch_size, self.device)
        return [(e, torch.sigmoid(lg).tolist()) for e, lg in zip(ends, logits, strict=True)]

    def score(self, conversations: list[list[dict]], completions: list[str], aggregation: str = "min",
              batch_size: int = 16) -> list[float | None]:
        """One score per completion, its step probabilities aggregated (`stages.math.steps.aggregate_step_scores`: min,
        product, last, mean); None for a completion without a scored step (never a silent 0)."""
        from stages.math.steps import AGGREGATIONS, aggregate_step_scores

        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown step-score aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
        out: list[float | None] = []
        for _, probs in self.score_steps(conversations, completions, batch_size):
            p = torch.tensor([probs], dtype=torch.float64)
            out.append(float(aggregate_step_scores(p, torch.ones_like(p, dtype=torch.bool), aggregation)[0]) if probs else None)
        return out
