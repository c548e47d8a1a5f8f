"""Batched generation with transformers: n completions per prompt, left padding, KV cache.

Prompts are sorted by length before batching (less padding) and results restored to input order.
Each batch reseeds from (seed, batch index), so results do not depend on what ran before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from schemas.configs import GenerationSpec


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


@dataclass
class GenerationStats:
    prompts: int = 0
    completions: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def render_prompts(tokenizer, conversations: list[list[dict]]) -> list[str]:
    return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((text.find(s) + len(s) for s in stops if s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    conversations: list[list[dict]],
    spec: GenerationSpec,
    n: int = 1,
    seed: int = 0,
    desc: str = "generate",
    progress: bool = True,
) -> tuple[list[list[Completion]], GenerationStats]:
    """Return n completions per conversation (in input order) and throughput stats."""
    texts = render_prompts(tokenizer, conversations)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    eos_ids = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    results: list[list[Completion] | None] = [None] * len(texts)
    stats = GenerationStats(prompts=len(texts))
    do_sample = spec.temperature > 0
    t0 = time.perf_counter()
    batches = [order[i : i + spec.batch_size] for i in range(0, len(order), spec.batch_size)]
    for b, idx in enumerate(tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False)):
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        torch.manual_seed(seed * 1_000_003 + b)
        kwargs = dict(do_sample=do_sample, max_new_tokens=spec.max_new_tokens, num_return_sequences=n,
                      eos_token_id=eos_ids, pad_token_id=pad_id)
        if do_sample:
            # top_k=0 disables the filter; None would fall back to the model's generation_config (often 50).
            kwargs.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        for j, row in enumerate(new.tolist()):
            length = next((k + 1 for k, t in enumerate(row) if t in eos_ids), None)
            finish = "stop" if length is not None else "length"
            length = length if length is not None else len(row)
            text = tokenizer.decode(row[:length], skip_special_tokens=True)
            if spec.stop:
                text, stopped = _cut_at_stop(text, spec.stop)
                if stopped:
                    finish = "stop"
            stats.new_tokens += length
            pos = idx[j // n]
            if results[pos] is None:
                results[pos] = []
            results[pos].append(Completion(text, length, finish))
    stats.completions = len(texts) * n
    stats.seconds = time.perf_counter() - t0
    model.train(was_training)
    return [r or [] for r in results], stats
