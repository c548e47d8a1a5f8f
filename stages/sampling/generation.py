"""The generation engine every sampling stage shares: n completions per prompt, one interface,
two backends (transformers by default, vLLM where installed).

transformers backend: prompts sorted by length before batching (less padding; results restored to
input order), left padding, KV cache, EOS and stop strings end a completion, each batch reseeded
from (seed, batch index) so results do not depend on what ran before. GRPO samples with the policy
it trains, in place: no weight reload. With the dynamic cache (the default) each prompt is
prefilled once for its n samples (a batch-wide system prompt once for the batch:
`prefill_prompts`) and our own decode loop (`decode_rows`) samples; it drops rows that have ended
from the batch, where generate() computes every row until the longest ends, and samples the tokens
generate() would. `cache: static` goes through transformers' generate() (preallocated cache; on a
GPU it compiles the decode step; prompts are padded to a bucket of 64 tokens so few shapes compile).
Sampling is transformers' temperature / top-k / top-p warpers then a two-level exponential race
(`BlockRaceSampler`); on CPU, fp32 linears over few rows run as W @ xᵀ where that CPU is faster
for it (`rows_first_linears`), and the decode writes into a preallocated KV cache (`PreallocatedLayer`).
Its progress bar (`GenerationProgress`) counts tokens as each decode step adds them and completions as they
end, not batches (a batch can take minutes); vLLM shows its own bar.

Details the config does not show:
- `decode_rows` drops ended rows once they are half of the rows still running, not each as it
  ends (a smaller batch is not always a cheaper step on CPU, and each drop copies the cache); each
  row keeps its own random numbers, so the tokens equal generate()'s from the same seed (tested,
  stop strings and early-ending rows included). Llama, Mistral and Qwen2 models step through
  `lean_decode.lean_step` (the same logits without the forward's per-call machinery).
- `cache: graph` decodes through `lean_decode.StaticDecode` (`decode_static`): fixed shapes over
  preallocated KV buffers, on CUDA one graph replay a token; finished rows keep decoding, so on CPU
  it is correct but not faster. Models `lean_decode` does not take run `decode_rows` instead.
- Why exponential races rather than an inverse CDF: an inverse CDF's boundaries move with every
  probability's rounding, so runs whose weights differ in the last bits (DDP against FSDP) would
  draw different tokens; the races do not (tested against hand-computed distributions and the
  model's own softmax).
- `ROWS_FIRST_RULES` is a fixed rule per torch CPU kernel level (AVX2: every linear over 2-64
  rows; AVX-512: only layers with more inputs than outputs, over 12-48 rows; other CPUs: none).
- vLLM runs as a separate engine for the sampling stages and colocated (in each training process)
  for grpo and on-policy distill, which push the trained weights into it before every rollout
  after the first (`policy_weights`, LoRA adapters folded in out of place; `load_weights`). Not
  with FSDP shards: both stages refuse `backend: vllm` with `distributed_type: fsdp` at config
  time.
Measured costs and savings: benchmarks/RESULTS.md, "Single-process speed".

Per-token log-probs, when asked, come from a teacher-forced forward pass over prompt + completion
with the same position ids generation used: log-probs of the sampled tokens under the model's own
distribution (temperature 1, no top-p/top-k), i.e. exactly what a trainer's forward pass computes.
The pass runs in row chunks, so [batch, seq, vocab] logits are never held for the whole batch.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import (
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from schemas.configs import GenerationSpec
from schemas.errors import ModelError
from stages.modeling import logprobs, models
from stages.runtime.seeds import seed_stream
from stages.sampling import lean_decode


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None  # one per token in token_ids, when asked for


@dataclass
class GenerationStats:
    prompts: int = 0
    completions: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class GenerationProgress:
    """The progress bar of one generate call, moving with the decode rather than per batch.

    It counts new tokens out of a budget of completions x max_new_tokens; a completion that ends before
    its budget gives the rest back (the total shrinks), so the bar ends at 100%, its rate is tokens/s and
    its ETA an upper bound. The postfix counts finished completions. A decode reports each step
    (`step`: integer additions; tqdm redraws at most every `mininterval` s); `batch_done` then sets the
    exact counts of the batch, so a backend that reports steps approximately (`_StepCounter`) is exact at
    every batch's end.
    """

    def __init__(self, completions: int, max_new_tokens: int, desc: str, enabled: bool = True):
        self.completions, self.max_new_tokens = completions, max_new_tokens
        self.ended = self.exact_tokens = self.exact_ended = 0
        self.bar = tqdm(total=completions * max_new_tokens, desc=desc, unit="tok", leave=False, disable=not enabled,
                        mininterval=0.5, postfix=f"0/{completions} done")

    def step(self, tokens: int, ended: int, steps_left: int) -> None:
        """A decode step added `tokens` and ended `ended` rows, each leaving `steps_left` tokens of budget unused."""
        if ended:
            self.ended += ended
            self.bar.total -= ended * steps_left
            self.bar.set_postfix_str(f"{self.ended}/{self.completions} done", refresh=False)
        self.bar.update(tokens)

    def batch_done(self, lengths: list[int]) -> None:
        """A batch's completions are in, of these lengths (in tokens)."""
        self.exact_tokens += sum(lengths)
        self.exact_ended += len(lengths)
        self.ended = self.exact_ended
        self.bar.total = self.exact_tokens + (self.completions - self.exact_ended) * self.max_new_tokens
        self.bar.n = self.exact_tokens
        self.bar.set_postfix_str(f"{self.ended}/{self.completions} done", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _StepCounter(StoppingCriteria):
    """For transformers' generate(): reports each step to a `GenerationProgress`, stops nothing. Rows count as
    ended at an EOS (a stop string's end is only known at the batch's end: `batch_done` corrects it)."""

    def __init__(self, progress: GenerationProgress, rows: int, max_new_tokens: int, eos_ids: list[int],
                 device: torch.device):
        self.progress, self.max_new_tokens = progress, max_new_tokens
        self.eos = torch.tensor(eos_ids, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.steps = self.n_done = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.steps += 1
        self.done |= torch.isin(input_ids[:, -1], self.eos)
        ran, self.n_done = len(self.done) - self.n_done, int(self.done.sum())  # generate() syncs every step anyway
        self.progress.step(ran, self.n_done - (len(self.done) - ran), self.max_new_tokens - self.steps)
        return torch.zeros_like(self.done)


class GenerationBackend(Protocol):
    def generate(self, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
                 logprobs: bool = False, desc: str = "generate", progress: bool = True,
                 prefills: list[str] | None = None) -> tuple[list[list[Completion]], GenerationStats]: ...


def row_prefills(conversations: list[list[dict]], spec: GenerationSpec, prefills: list[str] | None) -> list[str]:
    """Each conversation's prefill: `prefills[i]` when given (one per conversation: e.g. step_labels' step
    prefixes, all rolled out in one call), else `spec.prefill` for all."""
    if prefills is None:
        return [spec.prefill] * len(conversations)
    if len(prefills) != len(conversations):
        raise ValueError(f"prefills: {len(prefills)} for {len(conversations)} conversations (one each)")
    return list(prefills)


def render_prompts(tokenizer, conversations: list[list[dict]], prefill: str | list[str] = "") -> list[str]:
    """Chat-templated prompts ending with the assistant turn's header, then `prefill` (if any; a list: one per
    conversation)."""
    prefills = [prefill] * len(conversations) if isinstance(prefill, str) else prefill
    return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) + p
            for c, p in zip(conversations, prefills, strict=True)]


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to and including the earliest stop string, and whether one was found."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, False
    pos, stop = min(hits)
    return text[: pos + len(stop)], True


def sampled_completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                                completion_mask: torch.Tensor, chunk_rows: int = 8) -> torch.Tensor:
    """Log-prob of every completion token given the prompt and the tokens before it.

    prompt_ids/prompt_mask: (B, P), left padded; completion_ids/completion_mask: (B, C), right
    padded. Returns (B, C) float32 with 0 where completion_mask is 0. Position ids follow the
    attention mask, as in generation, so left padding does not shift positions.
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    p, out = prompt_ids.shape[1], []
    with torch.no_grad():
        for i in range(0, ids.shape[0], chunk_rows):
            rows = slice(i, i + chunk_rows)
            logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[rows]).logits
            logits = logits[:, p - 1 : -1, :].float()  # the positions that predict completion tokens
            lp = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[rows].unsqueeze(-1)).squeeze(-1)
            out.append(lp * completion_mask[rows])
    return torch.cat(out)


def prefill_prompts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, new_tokens: int,
                    min_common: int | None = None, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The KV cache of every prompt token but the last, each prompt prefilled once, not n times.

    Returns (input_ids, attention_mask, cache) of B * n rows laid out as `num_return_sequences=n`
    lays them (each prompt's n copies next to each other); the cache (None for one-token prompts)
    holds all but the last column, repeated n times, so only the last prompt token and the new
    tokens run per sample. When the B prompts start with at least `min_common` (default
    `logprobs.COMMON_PREFIX_MIN`) of the same tokens (a system prompt and chat template), those
    are prefilled once for the batch and each row is laid out [common | padding | own tokens]
    instead of left padded: same width, positions from the attention mask as before. On CPU the
    cache is a `PreallocatedLayer` per layer with room for `new_tokens` more.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefill = decoder if decoder is not None else model
    cache_arg = models.cache_name(prefill)
    cache, start = None, 0
    if decoder is not None and input_ids.shape[0] > 1:
        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
        n_common = logprobs.common_prefix_length(rows, min_common)
        if n_common:
            input_ids, attention_mask = _common_first(input_ids, attention_mask, n_common, pad_id)
            common = input_ids[:1, :n_common]
            cache = getattr(prefill(input_ids=common, attention_mask=torch.ones_like(common),
                                    position_ids=torch.arange(n_common, device=common.device)[None, :], use_cache=True),
                            cache_arg)
            cache.batch_repeat_interleave(input_ids.shape[0])
            start = n_common
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if input_ids.shape[1] - 1 > start:
        cache = getattr(prefill(input_ids=input_ids[:, start:-1], attention_mask=attention_mask[:, :-1],
                                position_ids=positions[:, start:-1], use_cache=True, **{cache_arg: cache}), cache_arg)
    if cache is not None:
        cache.batch_repeat_interleave(n)
        if input_ids.device.type == "cpu":
            preallocate_cache(cache, new_tokens)
    return input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0), cache


def supports_decode_rows(model) -> bool:
    """`decode_rows` needs a decoder to prefill and a forward that takes `logits_to_keep` (transformers'
    causal LMs; a peft wrapper passes it through to the model it wraps)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hasattr(base, "get_decoder") and "logits_to_keep" in inspect.signature(base.forward).parameters


def _rows_selectable(cache) -> bool:
    """Whether every layer of the cache can drop rows (linear-attention layers of hybrid models cannot)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(hasattr(layer, "batch_select_indices") for layer in layers)


COMPACT_SHARE = 0.5  # decode_rows drops finished rows once they are half the rows it still runs (see decode_rows)


@torch.no_grad()
def decode_rows(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, max_new_tokens: int,
                eos_ids: list[int], pad_id: int, warpers=(), sampler: BlockRaceSampler | None = None,
                stop=None, compact_share: float = COMPACT_SHARE, trace: list | None = None,
                lean: bool = True, progress: GenerationProgress | None = None) -> torch.Tensor:
    """New tokens [rows, steps] continuing left-padded prompts from a cache of all but their last column.

    The loop `generate(do_sample=False, logits_processor=[*warpers, sampler])` runs, without its
    per-step machinery, and with one difference: rows that are done (EOS, a `stop` criterion) stop
    being computed. Once they are `compact_share` of the rows still run, they are dropped from the
    batch and from the cache (`Cache.batch_select_indices`; caches whose layers cannot drop rows
    keep them all, as generate() does), so a batch whose completions end early decodes fewer rows
    each step where generate() runs every row until the longest ends. Half, not every finished row:
    a step is not cheaper for every smaller batch (SmolLM2 on an AVX-512 CPU: 16 rows 74-80 ms a
    step, 14 rows 88-90 ms, 12 rows 82-86 ms; sgemm kernels favour some row counts), and each drop
    copies the cache. The tokens are the ones generate() samples from the same seed: `sampler`
    draws its random numbers for every row of the batch, done or not, as generate() does, and hands
    each live row its own (same up to float rounding: a smaller batch can sum in another order).
    Finished rows are padded with `pad_id` after their last token; steps = the longest row's length.
    `stop`: a transformers StoppingCriteria called on (live rows' prompt + new tokens, None).
    `trace`: when a list, gets (live row indices, float logits) per step (tests).
    `lean`: run each step through `lean_decode.lean_step` where the model and cache allow it (the same
    modules and arithmetic as `model(...)` without its per-call machinery), else `model(...)`.
    `progress`: told after every step the tokens it added and the rows it ended (integers the loop counts
    anyway: no extra device sync).
    """
    rows, width, device = input_ids.shape[0], input_ids.shape[1], input_ids.device
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    seq = torch.cat([input_ids, out], 1) if stop is not None else None
    live = torch.arange(rows, device=device)
    eos = torch.tensor(eos_ids, device=device)
    mask = attention_mask
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    token = input_ids[:, -1:]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    fast = lean_decode.lean_step(model) if lean else None
    padded = not bool(attention_mask.all())  # as transformers decides each step whether the mask can be skipped
    checked, fast_cache = None, False
    cache_arg = models.cache_name(model)
    steps = n_done = 0
    for step in range(max_new_tokens):
        if fast is not None and cache is not checked:
            checked, fast_cache = cache, lean_decode.takes_cache(cache, LEAN_CACHE_LAYERS)
        if fast_cache:
            scores = fast(token, mask, pos, cache, padded).float()
        else:
            res = model(input_ids=token, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                        **{cache_arg: cache})
            cache = getattr(res, cache_arg)
            scores = res.logits[:, -1, :].float()
        if trace is not None:
            trace.append((live.clone(), scores.clone()))
        for warp in warpers:
            scores = warp(None, scores)
        nxt = sampler.draw(scores, live, rows) if sampler is not None else scores.argmax(-1)
        nxt = nxt.masked_fill(done, pad_id)
        out[live, step] = nxt
        steps = step + 1
        done = done | torch.isin(nxt, eos)
        if seq is not None:
            seq[live, width + step] = nxt
            done = done | stop(seq[live, : width + step + 1], None)
        ran, n_done = len(live) - n_done, int(done.sum())  # ran: rows not done before this step, one token each
        if progress is not None:
            progress.step(ran, n_done - (len(live) - ran), max_new_tokens - steps)
        if n_done == len(live):
            break
        if n_done and n_done >= compact_share * len(live) and _rows_selectable(cache):
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, mask, pos, nxt, done = live[keep], mask[keep], pos[keep], nxt[keep], done[keep]
            padded, n_done = not bool(mask.all()), 0
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], 1)
        pos = pos + 1
        token = nxt[:, None]
    return out[:, :steps]


@torch.no_grad()
def decode_static(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, max_new_tokens: int,
                  eos_ids: list[int], pad_id: int, warpers=(), sampler: BlockRaceSampler | None = None,
                  stop=None, progress: GenerationProgress | None = None, graphs: bool | None = None,
                  check_every: int = 8) -> torch.Tensor:
    """`decode_rows` over `lean_decode.StaticDecode`: fixed shapes, on CUDA one graph replay a token.

    Same inputs and tokens as `decode_rows` (up to float rounding: attention runs over every column
    of the buffer, the unwritten ones masked), with two differences that keep the step's shapes
    fixed: finished rows are not dropped (their tokens become `pad_id`, as in generate()), and
    whether every row is done is read from the device every `check_every` steps only (each read is
    a synchronisation), so up to check_every - 1 steps may run after the last row ends; those steps'
    tokens are padding. With a progress bar the counts are read every step (one small sync each).
    """
    rows, width, device = input_ids.shape[0], input_ids.shape[1], input_ids.device
    dec = lean_decode.StaticDecode(model, cache, attention_mask, max_new_tokens, graphs=graphs)
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    seq = torch.cat([input_ids, out], 1) if stop is not None else None
    live = torch.arange(rows, device=device)
    eos = torch.tensor(eos_ids, device=device)
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    token = input_ids[:, -1:]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    finished_at = torch.full((rows,), max_new_tokens - 1, dtype=torch.long, device=device)
    steps = n_done = 0
    for step in range(max_new_tokens):
        scores = dec.step(token, pos).float()
        for warp in warpers:
            scores = warp(None, scores)
        nxt = sampler.draw(scores, live, rows) if sampler is not None else scores.argmax(-1)
        nxt = nxt.masked_fill(done, pad_id)
        out[:, step] = nxt
        steps = step + 1
        was_done = done
        done = done | torch.isin(nxt, eos)
        if seq is not None:
            seq[:, width + step] = nxt
            done = done | stop(seq[:, : width + step + 1], None)
        finished_at = torch.where(done & ~was_done, step, finished_at)
        if progress is not None:
            before, n_done = n_done, int(done.sum())
            progress.step(rows - before, n_done - before, max_new_tokens - steps)
            if n_done == rows:
                break
        elif steps % check_every == 0 and bool(done.all()):
            break
        pos = pos + 1
        token = nxt[:, None]
    if bool(done.all()):  # as decode_rows: up to the step the last row ended (later steps were padding)
        steps = int(finished_at.max()) + 1
    return out[:, :steps]


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views into buffers with room for more positions:
    `update` writes the new positions in place, where DynamicLayer concatenates the whole cache
    into a new tensor every decode step (for SmolLM2's 16 rows, 30 layers x 2 copies of up to
    1.4 MB each a step; 160 -> 150 ms a decode step on CPU). If anything replaces the keys (crop,
    reordering, offloading in the base class), the next update copies them into a new buffer.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys, values
        self._k = self._v = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        b, h, length, d = self.keys.shape
        self._k = self.keys.new_empty(b, h, max(capacity, length), d)
        self._v = self.values.new_empty(b, self.values.shape[1], max(capacity, length), self.values.shape[-1])
        self._k[:, :, :length] = self.keys
        self._v[:, :, :length] = self.values
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def _in_buffers(self) -> bool:
        """Whether keys are still the front of the buffers (nothing replaced them: crop, reorder, offload)."""
        return self.keys.data_ptr() == self._k.data_ptr() and self.keys.shape[:2] == self._k.shape[:2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if not self._in_buffers() or self.keys.dtype != key_states.dtype or length + new > self._k.shape[-2]:
            self._allocate(2 * (length + new))
        self._k[:, :, length : length + new] = key_states
        self._v[:, :, length : length + new] = value_states
        self.keys, self.values = self._k[:, :, : length + new], self._v[:, :, : length + new]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows `indices` (decode_rows dropping finished rows), moved to the front of the same
        buffers: no new allocation, and the next updates still write in place."""
        if not self._in_buffers():
            return super().batch_select_indices(indices)
        length, rows = self.keys.shape[-2], len(indices)
        self._k[:rows, :, :length] = self.keys.index_select(0, indices)
        self._v[:rows, :, :length] = self.values.index_select(0, indices)
        self._k, self._v = self._k[:rows], self._v[:rows]
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]


LEAN_CACHE_LAYERS = (DynamicLayer, PreallocatedLayer)  # cache layers lean_decode's step may update


def preallocate_cache(cache, new_tokens: int) -> None:
    """Swaps a DynamicCache's plain `DynamicLayer`s for `PreallocatedLayer`s with room for `new_tokens` more."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return  # another cache layout (sliding windows, quantized, linear attention): left as it is
    cache.layers = [PreallocatedLayer(layer.keys, layer.values, layer.keys.shape[-2] + new_tokens + 1)
                    for layer in layers]


def _common_first(input_ids: torch.Tensor, attention_mask: torch.Tensor, n_common: int, pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows re-laid as [first n_common tokens | padding | the rest], same width."""
    ids, mask = torch.full_like(input_ids, pad_id), torch.zeros_like(attention_mask)
    width = input_ids.shape[1]
    for i in range(input_ids.shape[0]):
        real = input_ids[i, attention_mask[i].bool()]
        ids[i, :n_common] = real[:n_common]
        ids[i, width - len(real) + n_common :] = real[n_common:]
        mask[i, :n_common] = 1
        mask[i, width - len(real) + n_common :] = 1
    return ids, mask


class BlockRaceSampler(LogitsProcessor):
    """Draws each row's next token from softmax(scores) in two exponential races: `draw` returns the
    token ids (`decode_rows`); as a logits processor it returns scores that are 0 at the drawn token
    and -inf elsewhere, so `generate(do_sample=False)`'s argmax takes it.

    The vocabulary is cut into blocks of `block` tokens (default ceil(sqrt(V)), which makes the
    count below smallest). A race over the blocks' masses, argmax of mass / Exp(1), picks block k
    with probability mass_k; a race inside it picks token j with probability p_j / mass_k: p_j
    overall, the distribution `do_sample=True` samples from (after the same temperature / top-k /
    top-p warpers, which run before this in the list). It draws ~V/block + block exponentials per
    row where `torch.multinomial` draws one per vocabulary entry (27 -> 4 ms a decode step on CPU
    for 16 rows of SmolLM2's 49,152 tokens; torch draws exponentials one at a time, ~10 ns each). Races, not an
    inverse CDF: a race's winner changes only when a float-rounding change of the probabilities
    reorders the top two ratios, while an inverse CDF moves every boundary by the rounding summed
    over the tokens before it, so two runs whose weights differ in the last bits (DDP against
    FSDP) would sample differently far more often. Exponentials come from torch's global
    generator, which the backend seeds per batch.
    """

    def __init__(self, block: int | None = None):
        self.block = block

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token = self.draw(scores)[:, None]
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    def draw(self, scores: torch.Tensor, live: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor:
        """One token id per row of `scores`. With `live` (row indices into a batch of `total` rows) the
        exponentials are drawn for all `total` rows and row i of `scores` takes those of live[i]: what
        a call with the whole batch would draw for that row (`decode_rows` after finished rows left)."""
        rows, vocab = scores.shape
        block = self.block or math.isqrt(max(vocab - 1, 0)) + 1  # ceil(sqrt(vocab))
        n_blocks = -(-vocab // block)
        probs = torch.nn.functional.pad(torch.softmax(scores.float(), dim=-1), (0, n_blocks * block - vocab))
        blocks = probs.view(rows, n_blocks, block)
        mass = blocks.sum(-1)
        k = (mass / self._exponentials(mass, live, total)).argmax(-1)
        inner = blocks[torch.arange(rows, device=scores.device), k]
        j = (inner / self._exponentials(inner, live, total)).argmax(-1)
        return (k * block + j).clamp_(max=vocab - 1)

    @staticmethod
    def _exponentials(like: torch.Tensor, live: torch.Tensor | None, total: int | None) -> torch.Tensor:
        if live is None:
            return torch.empty_like(like).exponential_()
        return like.new_empty(total, like.shape[1]).exponential_().index_select(0, live)


def sampling_processors(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' warpers in generate()'s own order, then the draw (`BlockRaceSampler`)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p))
    procs.append(BlockRaceSampler())
    return procs


@dataclass(frozen=True)
class RowsFirstRule:
    """Which no-grad fp32 CPU linears `rows_first_linears` runs as W @ xᵀ: those over min_rows..max_rows
    rows, and with `reducing_only` only layers with more inputs than outputs (an MLP's down projection)."""

    min_rows: int
    max_rows: int
    reducing_only: bool = False


# Per torch CPU kernel level (torch.backends.cpu.get_cpu_capability()), from MKL sgemm timings of
# SmolLM2's decode shapes on two machines (2 threads, weights of 30 layers streamed from memory):
# AMD EPYC, AVX2: every linear faster as W @ xᵀ (head on 16 rows 53 -> 25 ms, MLP 1.4-1.6x; a 16-row
#   decode step 219 -> 169 ms);
# Intel Xeon, AVX-512: only the down projection (1536 -> 576), at 12-48 rows (16 rows: 8.7 -> 4.3 ms
#   for 30 layers); at 2-8 rows, for the other shapes and the head, W @ xᵀ is up to 2x slower.
# Other kernel levels (ARM, no AVX) were not measured: F.linear as it is.
ROWS_FIRST_RULES: dict[str, RowsFirstRule] = {
    "AVX2": RowsFirstRule(2, 64),
    "AVX512": RowsFirstRule(12, 48, reducing_only=True),
}


def default_rows_first_rule() -> RowsFirstRule | None:
    """The rule for this machine's torch CPU kernel level, or None (no layer changed)."""
    return ROWS_FIRST_RULES.get(torch.backends.cpu.get_cpu_capability())


def _rows_first_forward(rule: RowsFirstRule):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not rule.min_rows <= rows <= rule.max_rows or torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], -1)

    forward.same_as_linear = True  # nn.Linear's function in another layout: lean_decode may fuse such layers
    return forward


@contextlib.contextmanager
def rows_first_linears(model: torch.nn.Module, rule: RowsFirstRule | None | str = "auto"):
    """fp32 CPU `nn.Linear`s compute W @ xᵀ (then transpose) instead of x @ Wᵀ in no-grad decode,
    where `rule` says (default: `ROWS_FIRST_RULES` for this machine's CPU kernel level; None: none).

    MKL's sgemm picks other kernels for the two layouts, and on decode shapes (a few rows against a
    large weight) one is up to 2x faster than the other, which one depending on the CPU
    (`ROWS_FIRST_RULES`). Same values up to float rounding (another summation order); the choice is
    a fixed function of the machine, never timed at run time, so a run's samples do not depend on
    timing. Only plain `nn.Linear`s of fp32 CPU weights are touched (a LoRA layer's base and
    adapters are such), none whose forward is already replaced (accelerate's offload hooks), and
    every forward is restored on exit.
    """
    rule = default_rows_first_rule() if rule == "auto" else rule
    mods = [] if rule is None else [
        m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)
        and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
        and (not rule.reducing_only or m.in_features > m.out_features)]
    forward = _rows_first_forward(rule) if mods else None
    for m in mods:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward


STATIC_BUCKET = 64  # cache: static pads prompts to a multiple of this, so a compiled decode sees few shapes


class TransformersBackend:
    """Generation with the model in hand (a trainer's policy, or a loaded model).

    autocast_dtype: sample under `torch.autocast` with this dtype (a trainer's resolved precision,
    bf16 on a GPU), as the trainer's own passes run; None samples in the weights' dtype (a trainer's
    fp32 master weights would otherwise decode in fp32). Logits are read in float32 either way.
    """

    def __init__(self, model, tokenizer, autocast_dtype: torch.dtype | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.autocast_dtype = autocast_dtype

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
                 logprobs: bool = False, desc: str = "generate", progress: bool = True,
                 prefills: list[str] | None = None) -> tuple[list[list[Completion]], GenerationStats]:
        model, tokenizer = self.model, self.tokenizer
        prefills = row_prefills(conversations, spec, prefills)
        texts = render_prompts(tokenizer, conversations, prefills)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        eos_ids = stop_token_ids(tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        results: list[list[Completion]] = [[] for _ in texts]
        stats = GenerationStats(prompts=len(texts))
        do_sample = spec.temperature > 0
        t0 = time.perf_counter()
        batches = [order[i : i + spec.batch_size] for i in range(0, len(order), spec.batch_size)]
        bar = GenerationProgress(len(texts) * n, spec.max_new_tokens, desc, enabled=progress)
        steps = bar if progress else None  # no per-step calls at all without a bar (GRPO's rollouts)
        for b, idx in enumerate(batches):
            enc = tokenizer([texts[i] for i in idx], return_tensors="pt", add_special_tokens=False,
                            **({"padding": True} if spec.cache != "static" else
                               {"padding": True, "pad_to_multiple_of": STATIC_BUCKET})).to(device)
            torch.manual_seed(seed_stream(seed, "generate_batch", b))
            with rows_first_linears(model), self._precision(device):
                if spec.cache in ("dynamic", "graph") and supports_decode_rows(model):
                    p_ids, p_mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], n,
                                                           spec.max_new_tokens, pad_id=pad_id)
                    procs = list(sampling_processors(spec.temperature, spec.top_k, spec.top_p)) if do_sample else []
                    stop = StopStringCriteria(tokenizer, list(spec.stop)) if spec.stop else None
                    static = (spec.cache == "graph" and lean_decode.applies(model)
                              and lean_decode.takes_cache(cache, LEAN_CACHE_LAYERS))
                    decode = decode_static if static else decode_rows  # graph on other models: decode_rows
                    new = decode(model, p_ids, p_mask, cache, spec.max_new_tokens, eos_ids, pad_id,
                                 warpers=procs[:-1], sampler=procs[-1] if procs else None, stop=stop,
                                 progress=steps)
                else:
                    new = self._generate(enc, n, spec, eos_ids, pad_id, steps)
            rows = self._rows(new.tolist(), eos_ids, spec.stop, pad_id)
            bar.batch_done([len(ids) for ids, _, _ in rows])
            lps = None
            if logprobs:
                lens = torch.tensor([len(r[0]) for r in rows], device=device)
                cmask = (torch.arange(new.shape[1], device=device)[None, :] < lens[:, None]).long()
                lps = sampled_completion_logprobs(model, enc["input_ids"].repeat_interleave(n, 0),
                                                  enc["attention_mask"].repeat_interleave(n, 0), new * cmask, cmask).tolist()
            for j, (ids, text, finish) in enumerate(rows):
                stats.new_tokens += len(ids)
                lp = tuple(lps[j][: len(ids)]) if lps is not None else None
                results[idx[j // n]].append(Completion(prefills[idx[j // n]] + text, len(ids), finish, tuple(ids), lp))
        bar.close()
        stats.completions = len(texts) * n
        stats.seconds = time.perf_counter() - t0
        model.train(was_training)
        return results, stats

    def _precision(self, device: torch.device):
        # None leaves the caller's autocast state alone (an autocast(enabled=False) would switch it off)
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def _generate(self, enc, n: int, spec: GenerationSpec, eos_ids: list[int], pad_id: int,
                  progress: GenerationProgress | None = None) -> torch.Tensor:
        """New tokens from transformers' generate(): the static cache (compiled decode on a GPU) and models
        `decode_rows` does not take. Sampling is the draw of `sampling_processors` under generate's greedy
        argmax; generate() refuses num_return_sequences > 1 without do_sample, so rows are repeated here."""
        # use_cache explicitly: trainers set config.use_cache=False, which must not slow sampling.
        kwargs = dict(do_sample=False, max_new_tokens=spec.max_new_tokens, num_return_sequences=1,
                      eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True, temperature=None, top_p=None, top_k=None)
        if spec.cache == "static":  # a fixed-size cache: on CUDA, generate() compiles the decode step
            kwargs.update(cache_implementation="static")
        if spec.temperature > 0:
            kwargs.update(logits_processor=sampling_processors(spec.temperature, spec.top_k, spec.top_p))
        if spec.stop:
            kwargs.update(stop_strings=list(spec.stop), tokenizer=self.tokenizer)
        if progress is not None:
            rows = enc["input_ids"].shape[0] * n
            kwargs.update(stopping_criteria=StoppingCriteriaList([_StepCounter(
                progress, rows, spec.max_new_tokens, eos_ids, enc["input_ids"].device)]))
        out = self.model.generate(**{k: v.repeat_interleave(n, 0) for k, v in enc.items()}, **kwargs)
        return out[:, enc["input_ids"].shape[1] :]

    def _rows(self, generated: list[list[int]], eos_ids: list[int], stops: list[str], pad_id: int):
        """(token ids up to and including EOS or the token that completes a stop string, text, finish reason) per
        generated row (rows are padded with `pad_id` after they end, up to the batch's longest)."""
        out = []
        for row in generated:
            end = next((k + 1 for k, t in enumerate(row) if t in eos_ids), None)
            finish = "stop" if end is not None else "length"
            ids = row[: end if end is not None else len(row)]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if stops:
                # generate() stops on the token completing a stop string; cut any characters after it.
                text, stopped = cut_at_stop(text, stops)
                if stopped and end is None:  # the padding after that token is no part of the completion
                    while ids and ids[-1] == pad_id:
                        ids = ids[:-1]
                finish = "stop" if stopped else finish
            out.append((ids, text, finish))
        return out


COLOCATED_GPU_MEMORY = 0.3  # vLLM's share of the GPU beside a trainer (R1FLOW_VLLM_GPU_MEMORY_UTILIZATION overrides)


class VLLMBackend:
    """vLLM (optional extra, CUDA). Needs a full model directory (merge adapters first).

    Prompts go in as token ids, tokenized as `TransformersBackend` tokenizes them (chat template,
    no special tokens added), so a trainer's log-probs are of the prompt vLLM continued.

    `colocated`: the engine runs inside this process beside a trainer and shares its GPU (vLLM's
    `external_launcher` executor, the one `accelerate launch` / torchrun processes can host: each
    process its own engine, seeded by its rank), taking `COLOCATED_GPU_MEMORY` of the device's
    memory; `load_weights` then replaces the engine's weights with the trainer's in place (no
    reload) and drops its prefix cache, whose keys and values came from the old weights.
    """

    def __init__(self, model_dir: Path | str, tokenizer, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 colocated: bool = False):
        try:
            from vllm import LLM
        except ImportError:
            raise ModelError("generation backend 'vllm' requested but vllm is not installed "
                             "(pip install 'r1flow[vllm]' on a CUDA machine), or use backend: transformers") from None
        self.tokenizer = tokenizer
        kwargs = {}
        if colocated:
            import os
            import socket

            # external_launcher joins the torch.distributed world the environment describes; a lone process is one
            # of 1 (set where unset, for the process's lifetime, as long as the engine's process group lives)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(key, value)
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as sock:  # a free local port for the world of one
                    sock.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
            seed += int(os.environ["RANK"])
            gpu_memory_utilization = float(os.environ.get("R1FLOW_VLLM_GPU_MEMORY_UTILIZATION", COLOCATED_GPU_MEMORY))
            kwargs = {"distributed_executor_backend": "external_launcher"}
        self.llm = LLM(model=str(model_dir), seed=seed, gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        self.holds = 0  # the training step whose weights the engine holds (`sync`): the directory's are step 0's

    def sync(self, model, step: int) -> None:
        """Before sampling at `step`: `model`'s weights into the engine (`load_weights(policy_weights(model))`),
        unless it holds that step's already."""
        if self.holds != step:
            self.load_weights(policy_weights(model))
            self.holds = step

    def load_weights(self, weights) -> None:
        """Replace the engine's weights by `weights` ((name, tensor) pairs under the model's checkpoint names,
        `policy_weights`), in place, and drop the prefix cache. Colocated engines only (the model is in this
        process)."""
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
        self.llm.reset_prefix_cache()

    def generate(self, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
                 logprobs: bool = False, desc: str = "generate", progress: bool = True,
                 prefills: list[str] | None = None) -> tuple[list[list[Completion]], GenerationStats]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k or -1,
                                max_tokens=spec.max_new_tokens, stop=list(spec.stop) or None, seed=seed,
                                include_stop_str_in_output=True, logprobs=0 if logprobs else None)
        t0 = time.perf_counter()
        prefills = row_prefills(conversations, spec, prefills)
        prompts = [{"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}
                   for text in render_prompts(self.tokenizer, conversations, prefills)]
        outs = self.llm.generate(prompts, params, use_tqdm=progress)
        stats = GenerationStats(prompts=len(conversations), completions=len(conversations) * n)
        results = []
        for o, prefill in zip(outs, prefills, strict=True):
            comps = []
            for c in o.outputs:
                lp = tuple(next(iter(d.values())).logprob for d in c.logprobs) if logprobs and c.logprobs else None
                comps.append(Completion(prefill + c.text, len(c.token_ids), "length" if c.finish_reason == "length" else "stop",
                                        tuple(c.token_ids), lp))
                stats.new_tokens += len(c.token_ids)
            results.append(comps)
        stats.seconds = time.perf_counter() - t0
        return results, stats


def policy_weights(model):
    """(name, tensor) for every weight of `model` under its checkpoint's names (what `save_pretrained` writes and
    vLLM's `load_weights` reads), LoRA adapters folded in out of place: W + the adapters' delta, computed per
    layer, the trained model untouched (peft's merge_adapter / unmerge_adapter would add and subtract the delta
    in place, leaving rounding in the weights being trained)."""
    if not hasattr(model, "get_base_model"):
        for name, p in model.named_parameters():
            yield name, p.detach()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            if getattr(module, "merged", False):
                raise ModelError(f"{name}: a merged LoRA layer (merge_adapter) cannot be read out of place")
            deltas[f"{name}.base_layer.weight"] = module
    for name, p in base.named_parameters():
        if "modules_to_save" in name or "original_module" in name:
            raise ModelError(f"{name}: LoRA modules_to_save are not synced (not used by r1flow's adapters)")
        if ".lora_" in name:  # folded into the base weight below
            continue
        weight = p.detach()
        module = deltas.get(name)
        if module is not None:
            with torch.no_grad():
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        yield name.replace(".base_layer.", "."), weight


def check_vllm_model_dir(model_dir: Path | None, label: str = "the model input") -> None:
    """The vllm backend starts its engine from a full model directory: anything else (an adapter) is an error
    naming the input, raised before any weight loads."""
    if model_dir is None or not (Path(model_dir) / "config.json").exists():
        raise ModelError(f"{label}: generation.backend=vllm starts its engine from a full model directory, and this "
                         f"input is an adapter; merge it first (lora.merge: true upstream)")


def make_backend(spec: GenerationSpec, model, tokenizer, model_dir: Path | None = None, seed: int = 0,
                 colocated: bool = False, autocast_dtype: torch.dtype | None = None) -> GenerationBackend:
    """The backend `spec` names; vllm loads `model_dir` (a full model), `colocated` beside a trainer;
    transformers samples under `autocast_dtype` (a trainer's precision) when given."""
    if spec.backend == "vllm":
        check_vllm_model_dir(model_dir)
        return VLLMBackend(model_dir, tokenizer, seed=seed, colocated=colocated)
    return TransformersBackend(model, tokenizer, autocast_dtype)


def sample_with(model_input, conversations: list[list[dict]], spec: GenerationSpec, n: int, seed: int, device: str,
                desc: str) -> tuple[list[list[Completion]], GenerationStats]:
    """Load a stage's model input on `device` and sample `n` completions per conversation with the backend `spec`
    names (the sampling stages' whole use of a model: nothing of it is kept once this returns)."""
    model, tokenizer = model_input.load_model()
    model.to(device)
    backend = make_backend(spec, model, tokenizer, model_input.model_dir)
    return backend.generate(conversations, spec, n=n, seed=seed, desc=desc)


def generate(model, tokenizer, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
             desc: str = "generate", progress: bool = True, logprobs: bool = False,
             autocast_dtype: torch.dtype | None = None) -> tuple[list[list[Completion]], GenerationStats]:
    """n completions per conversation (in input order) with the transformers backend."""
    return TransformersBackend(model, tokenizer, autocast_dtype).generate(
        conversations, spec, n=n, seed=seed, logprobs=logprobs, desc=desc, progress=progress)
