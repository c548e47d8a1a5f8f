"""The KV-cache decode loops of the transformers backend: prefill each prompt once for its n samples
(`prefill_prompts`), then sample token by token (`decode_rows`, or `decode_static` over fixed shapes).

- `decode_rows` drops ended rows once they are half of the rows still running, not each as it
  ends (a smaller batch is not always a cheaper step on CPU, and each drop copies the cache); each
  row keeps its own random numbers, so the tokens equal generate()'s from the same seed (tested,
  stop strings and early-ending rows included). Llama, Mistral and Qwen2 models step through
  `lean_decode.lean_step` (the same logits without the forward's per-call machinery).
- `decode_static` (`cache: graph`) decodes through `lean_decode.StaticDecode`: fixed shapes over
  preallocated KV buffers, on CUDA one graph replay a token; finished rows keep decoding, so on CPU
  it is correct but not faster.
- On CPU the cache is a `PreallocatedLayer` per layer: the decode writes in place.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicLayer

from stages.modeling import models, prefix_sharing
from stages.runtime import threads
from stages.sampling import lean_decode

if TYPE_CHECKING:
    from stages.sampling.completions import GenerationProgress
    from stages.sampling.sampler import BlockRaceSampler


def prefill_prompts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, new_tokens: int,
                    min_common: int | None = None, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The KV cache of every prompt token but the last, each prompt prefilled once, not n times.

    Returns (input_ids, attention_mask, cache) of B * n rows laid out as `num_return_sequences=n`
    lays them (each prompt's n copies next to each other); the cache (None for one-token prompts)
    holds all but the last column, repeated n times, so only the last prompt token and the new
    tokens run per sample. When the B prompts start with at least `min_common` (default
    `prefix_sharing.COMMON_PREFIX_MIN`) of the same tokens (a system prompt and chat template), those
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
        n_common = prefix_sharing.common_prefix_length(rows, min_common)
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
                lean: bool = True, progress: GenerationProgress | None = None, logprobs: torch.Tensor | None = None
                ) -> torch.Tensor:
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
    `stop`: a StoppingCriteria on (live rows' prompt + new tokens, None). `trace`: gets (live rows, logits) a step.
    `lean`: run each step through `lean_decode.lean_step` where the model and cache allow it (the same
    modules and arithmetic as `model(...)` without its per-call machinery), else `model(...)`.
    `progress`: told after every step the tokens it added and the rows it ended (no extra device sync).
    `logprobs`: a float32 [rows, max_new_tokens] buffer filled with each sampled token's log-prob before `warpers`
    (what a second forward pass over prompt and completion gives, read at the step that drew it); 0 past an end.
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
        threads.rebalance()  # a batch decodes for a minute: the share follows other work within a second
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
        model_logp = torch.log_softmax(scores, -1) if logprobs is not None else None
        for warp in warpers:
            scores = warp(None, scores)
        nxt = sampler.draw(scores, live, rows) if sampler is not None else scores.argmax(-1)
        nxt = nxt.masked_fill(done, pad_id)
        out[live, step] = nxt
        if model_logp is not None:
            logprobs[live, step] = sampled_logprob(model_logp, nxt, done)
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


def sampled_logprob(model_logp: torch.Tensor, tokens: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Each row's log-prob of the token it sampled, from log_softmax of the step's logits [rows, vocab]; 0 for rows
    already done (their token is padding)."""
    return model_logp.gather(-1, tokens[:, None]).squeeze(-1).masked_fill(done, 0.0)


@torch.no_grad()
def decode_static(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, max_new_tokens: int,
                  eos_ids: list[int], pad_id: int, warpers=(), sampler: BlockRaceSampler | None = None,
                  stop=None, progress: GenerationProgress | None = None, graphs: bool | None = None,
                  check_every: int = 8, logprobs: torch.Tensor | None = None) -> torch.Tensor:
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
        threads.rebalance()  # a batch decodes for a minute: the share follows other work within a second
        scores = dec.step(token, pos).float()
        model_logp = torch.log_softmax(scores, -1) if logprobs is not None else None
        for warp in warpers:
            scores = warp(None, scores)
        nxt = sampler.draw(scores, live, rows) if sampler is not None else scores.argmax(-1)
        nxt = nxt.masked_fill(done, pad_id)
        out[:, step] = nxt
        if model_logp is not None:
            logprobs[:, step] = sampled_logprob(model_logp, nxt, done)
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
