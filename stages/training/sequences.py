"""Tokenized chat examples for training: assistant-only labels, packing several examples into one
row with attention kept inside each (block mask, restarted positions), and collation.

The block mask is a dense 4D mask: a packed row of T tokens computes T² attention scores, the
masked ones included, and on a GPU SDPA runs its memory-efficient kernel rather than flash
attention. Only models that take such a mask get it (`prefix_sharing.can_pack_prefix`: Llama, Mistral
and Qwen2, full attention, `sdpa`); others attend across the examples of a packed row, with a
warning from the sft stage (labels stay masked either way).

A tool transcript (the python environment's `<output>` observations in the assistant turn, as
rejection sampling with a tool and `tool_demos` write them) is tokenized segment by segment as the
multi-turn sampler builds it, and only the model's segments are labelled (`tokenize_completion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn.utils.rnn import pad_sequence

from schemas.errors import SchemaError
from stages.environments.python_tool import observation_spans
from stages.math.supervised import IGNORE


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, of the same length, their labels (IGNORE where no loss)."""

    input_ids: list[int]
    labels: list[int]
    segments: tuple[int, ...] = ()  # a packed block (`pack`): the lengths of the examples in it, in order

    @cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and labels as int64 tensors, made once: `collate` runs every step, and a
        tensor from a Python list is most of its cost."""
        return torch.tensor(self.input_ids, dtype=torch.long), torch.tensor(self.labels, dtype=torch.long)


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Example:
    """Chat-template the conversation; label only the final assistant turn."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise SchemaError("sft: the chat template renders the prompt differently with and without the answer; "
                          "cannot mask prompt tokens reliably")
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids, c_labels = tokenize_completion(tokenizer, full[len(prompt) :])
    ids = (p_ids + c_ids)[:max_length]
    labels = ([IGNORE] * len(p_ids) + c_labels)[:max_length]
    return Example(ids, labels)


def tokenize_completion(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(token ids, labels) of an assistant turn's text. Text without tool observations is tokenized whole, labels
    the ids. A tool transcript (`python_tool.observation_spans`: `<output>…</output>` after a `</python>`) is
    tokenized as the multi-turn sampler builds its sequence (`stages.sampling.multiturn`): each model segment and
    each observation on its own, appended in order, so the tokens are those a rollout of the same turns has; the
    observations' labels are IGNORE (the model never wrote them)."""
    spans = observation_spans(text)
    if not spans:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, list(ids)
    pieces, start = [], 0
    for a, b in spans:
        pieces += [(text[start:a], True), (text[a:b], False)]
        start = b
    pieces.append((text[start:], True))
    pieces = [(t, trained) for t, trained in pieces if t]
    tokenized = tokenizer([t for t, _ in pieces], add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for piece_ids, (_, trained) in zip(tokenized, pieces, strict=True):
        ids += piece_ids
        labels += piece_ids if trained else [IGNORE] * len(piece_ids)
    return ids, labels


def pack(examples: list[Example], max_length: int) -> list[Example]:
    """Greedily concatenate examples into blocks of at most max_length tokens.

    Each block records its examples' lengths (`segments`): `collate(blocked=True)` then keeps
    attention inside each example and restarts its positions, so a block trains as its examples
    would one by one, without the padding. The first token of every example but the first is
    never a target (alone, nothing predicts it). Labels stay as they were otherwise (only the
    assistant tokens are trained).
    """
    blocks, ids, labels, lengths = [], [], [], []
    for ex in examples:
        if ids and len(ids) + len(ex.input_ids) > max_length:
            blocks.append(Example(ids, labels, tuple(lengths)))
            ids, labels, lengths = [], [], []
        if ids:
            labels.append(IGNORE)
            labels += ex.labels[1:]
        else:
            labels = list(ex.labels)
        ids = ids + ex.input_ids
        lengths.append(len(ex.input_ids))
    if ids:
        blocks.append(Example(ids, labels, tuple(lengths)))
    return blocks


def block_attention(batch: list[Example], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, 1, width, width) bool attention mask and (B, width) position ids for packed rows: each token
    sees the tokens of its own example up to itself (causal inside the example, nothing across), and
    positions count from 0 in each example. Padding columns form one more segment of their own."""
    seg = torch.full((len(batch), width), -1, dtype=torch.long)
    pos = torch.zeros((len(batch), width), dtype=torch.long)
    for r, ex in enumerate(batch):
        lengths = torch.tensor(ex.segments or (len(ex.input_ids),), dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        seg[r, : len(ids)] = ids
        pos[r, : len(ids)] = torch.arange(len(ids)) - starts[ids]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    return mask[:, None], pos


def collate(batch: list[Example], pad_id: int, blocked: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch (training needs no left padding). With `blocked` and a packed block in the
    batch, also `block_mask` and `position_ids` (`block_attention`), for the decoder in place of the
    2D `attention_mask` (kept: it counts the real tokens)."""
    ids, labels = zip(*(e.tensors for e in batch), strict=True)
    lengths = torch.tensor([len(t) for t in ids])
    width = int(lengths.max())
    out = {"input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id),
           "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE),
           "attention_mask": (torch.arange(width)[None, :] < lengths[:, None]).long()}
    if blocked and any(len(e.segments) > 1 for e in batch):
        out["block_mask"], out["position_ids"] = block_attention(batch, width)
    return out
