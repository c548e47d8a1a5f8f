"""Log-probs of completions that share a prompt, the prompt run once (`completion_logprobs`).

Sharing the prompt. When several completions continue one prompt (a GRPO group, a DPO pair), the
prompt runs once and the values and gradients still equal whole rows (tested):
- `shared_prefix_logprobs` / `shared_prefix_rows`: the decoder runs over each prompt once, its KV
  cache is repeated per completion and the completions run against it, gradients flowing back
  through the cache: about (P + G·C) / (G·(P + C)) of the whole rows' decoder work for prompt
  length P, completion length C and G completions a prompt. What every prompt of the batch starts
  with (system prompt and chat template, at least `COMMON_PREFIX_MIN` tokens) runs once for all of
  them: the prompts' KV rows are then [common part | padding | own tokens].
- `packed_prefix_rows`: the same in one decoder call, a row per prompt (prompt, then each of its
  completions) or one row with the common part once, under a 4D mask that lets each completion
  see its prompt and its own earlier tokens, with positions continuing from the prompt as in its
  own row. No cache to repeat, every weight used once a step; the only way to share under gradient
  checkpointing, where transformers keeps no KV cache. Only where `can_pack_prefix` (Llama, Mistral
  and Qwen2 models, full attention, `sdpa`) and where it costs less: a packed row's attention spans
  all of it, so `packing_pays` / `packed_cost` count positions plus attention scores
  (`attention_share`) against `cached_cost`; other models share through the KV cache where
  `prefix_sharing_pays`. The dense 4D mask keeps SDPA off flash attention on a GPU.
- Completions of different lengths run in length buckets (`length_buckets`): the grouping that
  minimises padded positions plus a per-call cost (`default_bucket_overhead`, see the constants
  below); `bucketed_token_logprobs` does the same for whole prompt + completion rows. Under FSDP,
  where every process must run as many forwards, one bucket cut to the mini-batch's longest row.
Measured costs and savings: benchmarks/RESULTS.md, "Single-process speed".
"""

from __future__ import annotations

import copy
from itertools import chain

import torch
from tqdm.auto import tqdm

from stages.math.preference import sequence_logprobs
from stages.modeling import models
from stages.modeling.logprobs import (
    bucket_index,
    default_bucket_overhead,
    head_is_plain,
    head_logprobs,
    in_input_order,
    layer_parameters,
    length_buckets,
    right_padded,
    take_rows,
    token_logprobs,
)
from stages.modeling.models import LEAN_MODELS
from stages.runtime.distributed import is_sharded


def can_share_prefix(model) -> bool:
    """Whether `shared_prefix_logprobs` applies: a plain output head, and a KV cache in training (HF
    turns the cache off under gradient checkpointing)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or not head_is_plain(model) or is_sharded(model):
        return False  # (FSDP: two forwards per batch; kept simple, one forward)
    if not model.training:
        return True
    return not models.is_activation_checkpointing(model)



def shared_prefix_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor, prompt_of_row: torch.Tensor, chunk_tokens: int = 4096,
                           with_entropy: bool = False, common_ids: torch.Tensor | None = None,
                           bucket_overhead: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of completions that continue shared prompts, each prompt computed once.

    prompt_ids/prompt_mask: (K, P), left padded; completion_ids/completion_mask: (N, C), right
    padded; prompt_of_row (N,): the prompt row i continues (GRPO: G rows per prompt; DPO: chosen
    and rejected). Returns (N, C): log p(completion token j | prompt, completion tokens < j), 0
    where completion_mask is 0; and the entropy there if asked.

    The decoder runs over the K prompts once with a KV cache, the cache rows are gathered per
    completion, and the completions run against it; gradients flow through the cached keys and
    values into the prompt's computation, so values and gradients equal whole prompt+completion
    rows (up to float rounding) at about (K*P + N*C) / (N*(P+C)) of the decoder's cost. Positions
    follow the attention mask, as in generation. Needs `can_share_prefix(model)`.

    common_ids (1, L), if given: tokens every prompt starts with, run once for all K prompts, which
    then hold only what follows them (a batch-wide system prompt and chat template). The prompts'
    cache rows are then [common | left padding | own tokens], the padding masked out.

    Completions of different lengths run in length buckets (`length_buckets`): each bucket's rows
    padded to the bucket's longest, not the batch's, where that saves more than `bucket_overhead`
    token positions a bucket (default `default_bucket_overhead` for the device and the model's width); the head runs only
    on real completion tokens either way.
    """
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    cache_arg = models.cache_name(decoder)  # "cache", or "past_key_values" before transformers renamed it
    has_common = common_ids is not None and common_ids.shape[1] > 0
    embeds = _embed_once(decoder, ([common_ids] if has_common else []) + [prompt_ids, completion_ids])
    cache, lead = None, prompt_mask[:, :0]
    if has_common:
        n_common = common_ids.shape[1]
        positions = torch.arange(n_common, device=common_ids.device)[None, :]
        cache = getattr(decoder(inputs_embeds=embeds.pop(0), attention_mask=torch.ones_like(common_ids),
                                position_ids=positions, use_cache=True), cache_arg)
        cache.batch_repeat_interleave(prompt_ids.shape[0])  # for autograd: the common part's gradient sums over prompts
        lead = prompt_mask.new_ones(prompt_ids.shape[0], n_common)
    out = decoder(inputs_embeds=embeds[0], attention_mask=torch.cat([lead, prompt_mask], dim=1),
                  position_ids=lead.shape[1] + (prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                  **{cache_arg: cache})
    last = out.last_hidden_state[:, -1, :].index_select(0, prompt_of_row)  # (N, H): predicts completion token 0
    if completion_ids.shape[1] == 0:
        empty = last.new_zeros(completion_ids.shape, dtype=torch.float32)
        return empty, empty if with_entropy else None
    cache = getattr(out, cache_arg)
    row_mask = torch.cat([lead, prompt_mask], dim=1).index_select(0, prompt_of_row)
    positions = row_mask.sum(-1, keepdim=True) + torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    lengths = completion_mask.sum(-1).tolist()
    buckets = length_buckets(lengths, default_bucket_overhead(completion_ids.device, model) if bucket_overhead is None
                             else bucket_overhead)
    if not isinstance(getattr(cache, "layers", None), list):  # a cache whose rows `_cache_rows_copy` cannot copy
        buckets = [list(range(len(lengths)))]
    parts = []
    for rows in buckets:
        width = max(1, max(lengths[i] for i in rows))  # columns past it are padding in every row of the bucket
        index = bucket_index(rows, buckets, completion_ids.device)
        bucket_cache = cache if index is None else _cache_rows_copy(cache)  # one bucket: the cache as it is
        bucket_cache.batch_select_indices(take_rows(prompt_of_row, index))  # for autograd: a prompt's gradient sums over its rows
        h = decoder(inputs_embeds=take_rows(embeds[1], index)[:, :width], **{cache_arg: bucket_cache}, use_cache=True,
                    attention_mask=torch.cat([take_rows(row_mask, index), take_rows(completion_mask, index)[:, :width]], dim=1),
                    position_ids=take_rows(positions, index)[:, :width]).last_hidden_state  # (n, width, H)
        hidden = torch.cat([take_rows(last, index)[:, None, :], h[:, :-1, :]], dim=1)  # position j predicts completion token j
        parts.append(torch.nn.functional.pad(hidden, (0, 0, 0, completion_ids.shape[1] - width)))
    hidden = in_input_order(parts, buckets)
    return head_logprobs(head, hidden, completion_ids, completion_mask.bool(), chunk_tokens, with_entropy)



def prefix_sharing_pays(prompt_lengths: list[int], completion_lengths: list[int], row_lengths: list[int],
                        overhead: int) -> bool:
    """Whether running each distinct prompt once (`shared_prefix_rows`) costs fewer token positions than
    whole rows: K distinct prompts padded to the longest, plus N completions padded to the longest, plus
    `overhead` for the second decoder call, against N whole rows padded to the longest."""
    shared = len(prompt_lengths) * max(prompt_lengths, default=0) + len(completion_lengths) * max(
        completion_lengths, default=0)
    return shared + overhead < len(row_lengths) * max(row_lengths, default=0)



def _cache_rows_copy(cache):
    """A copy of a KV cache object whose layers can be re-indexed or extended without touching the
    original's (they share the tensors until then: `batch_select_indices` and `update` reassign)."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin


def _embed_once(decoder, id_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Input embeddings of several id tensors from one lookup: the embedding's backward then runs
    once, where one lookup per decoder call would zero and fill a whole (V, H) gradient per call
    and sum them (113 MB each for SmolLM2). Same values as the decoder's own lookup (a model that
    scales its embeddings does so in the embedding module or after it, on inputs_embeds too)."""
    flat = decoder.get_input_embeddings()(torch.cat([t.reshape(-1) for t in id_tensors]))
    return [e.view(*t.shape, -1) for e, t in zip(flat.split([t.numel() for t in id_tensors]), id_tensors, strict=True)]


COMMON_PREFIX_MIN = 32  # shortest batch-wide common prefix worth its own decoder call


def common_prefix_length(prompts: list[list[int]], min_common: int | None = None) -> int:
    """How many leading tokens all prompts share, leaving each at least one of its own; 0 for one
    prompt, or when they share fewer than `min_common` (default `COMMON_PREFIX_MIN`): too few to be
    worth a decoder call of their own."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts[1:]):
        n += 1
    return n if n >= max(COMMON_PREFIX_MIN if min_common is None else min_common, 1) else 0


def shared_prefix_rows(model, prompts: list[list[int]], completions: list[list[int]], prompt_of_row: list[int],
                       pad_id: int, width: int, device: str, chunk_tokens: int = 4096, with_entropy: bool = False,
                       min_common: int | None = None, bucket_overhead: int | None = None, pack: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`shared_prefix_logprobs` from token lists, laid out like whole right-padded rows: (N, width-1).

    Row i is prompts[prompt_of_row[i]] + completions[i]; its completion token j lands at position
    len(prompt) - 1 + j, the position that predicts it in a whole row (as `token_logprobs` returns
    it), 0 elsewhere. `width` is the whole rows' padded length (at least every len(prompt) + len(completion)).
    When the prompts share at least `min_common` (default `COMMON_PREFIX_MIN`) leading tokens (R1's
    system prompt and chat template), those run once for the whole batch (`common_ids`); below
    that, the saved positions are not worth a third decoder call.

    A model that `can_pack_prefix` runs the same in one decoder call (`packed_prefix_rows`: a row
    per prompt, or one row with the common part once) where that costs less (`packed_cost` against
    `cached_cost`, the bucket overhead counted per extra call); `pack` False never packs, True
    always (the cheaper of the two layouts).
    """
    n_common = common_prefix_length(prompts, min_common)
    if pack is not False and can_pack_prefix(model):
        lengths, c_lengths = [len(p) for p in prompts], [len(c) for c in completions]
        share = attention_share(model)
        per_prompt = packed_cost(lengths, c_lengths, prompt_of_row, share)
        one_row = packed_cost(lengths, c_lengths, prompt_of_row, share, n_common, one_row=True)
        overhead = default_bucket_overhead(device, model) if bucket_overhead is None else bucket_overhead
        if pack or min(per_prompt, one_row) < cached_cost(lengths, c_lengths, n_common, overhead):
            return packed_prefix_rows(model, prompts, completions, prompt_of_row, pad_id, width, device, chunk_tokens,
                                      with_entropy, n_common=n_common, one_row=one_row < per_prompt)
    common = None
    if n_common:
        common = torch.tensor([prompts[0][:n_common]], dtype=torch.long).to(device)
        prompts_own = [p[n_common:] for p in prompts]
    else:
        prompts_own = prompts
    p_max = max(len(p) for p in prompts_own)
    pids = torch.full((len(prompts), p_max), pad_id, dtype=torch.long)
    pmask = torch.zeros((len(prompts), p_max), dtype=torch.long)
    for i, p in enumerate(prompts_own):  # left padded, as in generation
        pids[i, p_max - len(p) :] = torch.tensor(p, dtype=torch.long)
        pmask[i, p_max - len(p) :] = 1
    cids, cmask = right_padded(completions, pad_id)
    index = torch.tensor(prompt_of_row, dtype=torch.long)
    lp, ent = shared_prefix_logprobs(model, pids.to(device), pmask.to(device), cids.to(device), cmask.to(device),
                                     index.to(device), chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                     common_ids=common, bucket_overhead=bucket_overhead)  # (N, C)
    return _as_whole_rows(lp, ent, prompts, prompt_of_row, width)


def _as_whole_rows(lp: torch.Tensor, ent: torch.Tensor | None, prompts: list[list[int]], prompt_of_row: list[int],
                   width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, C) values of completion tokens laid out as whole right-padded rows (N, width - 1): completion
    token j of row i at len(its prompt) - 1 + j, the position that predicts it there; 0 elsewhere."""
    n, c_max = lp.shape
    offsets = torch.tensor([len(prompts[k]) - 1 for k in prompt_of_row])
    cols = (offsets[:, None] + torch.arange(c_max)[None, :]).to(lp.device)  # distinct per row: scatter is exact

    def layout(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(n, width - 1 + c_max).scatter(1, cols, x)[:, : width - 1]

    return layout(lp), layout(ent) if ent is not None else None

# ---------------------------------------------------------------------------- packed prefix rows

PACKABLE_MODELS = LEAN_MODELS  # the Llama family, whose forward lean_decode reproduces too


def can_pack_prefix(model) -> bool:
    """Whether `packed_prefix_rows` applies: a plain output head, a Llama / Mistral / Qwen2 decoder with
    full attention in every layer (a 4D mask replaces the causal mask in every layer, so a sliding window
    would be lost), sdpa attention (it takes a boolean 4D mask as given; eager attention adds the mask to
    the scores, so a boolean one would be wrong, and flash-attention kernels take none), not
    FSDP-sharded. Gradient checkpointing is fine: no KV cache is involved."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if type(base).__name__ not in PACKABLE_MODELS or config is None or not head_is_plain(base) or is_sharded(model):
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def attention_share(model) -> float:
    """What one attention score costs beside one token position, for `packing_pays`: per layer, a row of T
    tokens runs p T multiply-adds in its linear layers (each of the layer's p parameters once per token) and
    2d T^2 in attention (d per score for the scores, d per score for their weighted sum of values, d the
    hidden size; every score is computed where a mask is given, the masked ones too); so a score costs
    2d / p positions (SmolLM2: 1152 / 3.5M; the tiny model 128 / 37K). (Until 2026-11-26 this counted the
    linear layers' FLOPs against attention's multiply-adds, d / p: half; no layout the benchmark suite runs
    changed with the correction.)"""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden, per_layer = getattr(getattr(base, "config", None), "hidden_size", None), layer_parameters(base)
    return 2 * hidden / per_layer if hidden and per_layer else 0.0


def packed_cost(prompt_lengths: list[int], completion_lengths: list[int], prompt_of_row: list[int], share: float,
                n_common: int = 0, one_row: bool = False) -> float:
    """What `packed_prefix_rows` runs, in token positions: rows x (T + share T^2), T the padded row length
    (one row per prompt, or with `one_row` a single row holding the common part once); `share`:
    `attention_share`, the attention of a packed row spans all of it."""
    rows = [n for n in prompt_lengths]
    for n, k in zip(completion_lengths, prompt_of_row, strict=True):
        rows[k] += n
    if one_row:
        rows = [sum(rows) - n_common * (len(rows) - 1)] if rows else []
    t = max(rows, default=0)
    return len(rows) * (t + share * t * t)


def packing_pays(prompt_lengths: list[int], completion_lengths: list[int], prompt_of_row: list[int],
                 row_lengths: list[int], share: float) -> bool:
    """Whether `packed_prefix_rows` (one row per prompt: the prompt, then its completions) costs less than
    whole rows: rows x (T + share T^2) each way, T the padded row length (`attention_share`: the packed
    rows are longer, so their attention grows faster than the positions they save)."""
    w = max(row_lengths, default=0)
    return packed_cost(prompt_lengths, completion_lengths, prompt_of_row, share) < len(row_lengths) * (w + share * w * w)


def cached_cost(prompt_lengths: list[int], completion_lengths: list[int], n_common: int, overhead: int) -> int:
    """What `shared_prefix_logprobs` runs, in token positions: the common part once, the prompts' own parts
    padded to the longest, the completions in their length buckets, and `overhead` for every decoder
    call after the first."""
    own = len(prompt_lengths) * max((n - n_common for n in prompt_lengths), default=0)
    buckets = length_buckets(completion_lengths, overhead)
    completions = sum(len(b) * max((completion_lengths[i] for i in b), default=0) for b in buckets)
    return n_common + own + completions + overhead * (len(buckets) + (n_common > 0))


def packed_prefix_rows(model, prompts: list[list[int]], completions: list[list[int]], prompt_of_row: list[int],
                       pad_id: int, width: int, device: str, chunk_tokens: int = 4096, with_entropy: bool = False,
                       n_common: int = 0, one_row: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`shared_prefix_rows`' result from one decoder call: prompts and their completions packed in rows.

    Row k is prompts[k] followed by every completion i with prompt_of_row[i] == k, right padded to
    the longest such row; completion i's tokens take positions len(prompt) .. len(prompt) + n - 1 (as
    in its own whole row) and a 4D attention mask lets each token see its prompt and the tokens of
    its own completion before it, nothing of the others. With `one_row`, everything is one row
    instead: the first `n_common` tokens, which every prompt starts with, once, then each prompt's
    own tokens and its completions; a prompt's tokens see the common part and themselves.
    So the values and gradients are those of whole prompt+completion rows (up to float
    rounding), each prompt computed once, like `shared_prefix_rows`, but in one decoder call, with
    no KV cache to repeat per completion (nor its backward's gathers), and every weight used once
    per step (with two calls each weight's gradient is the sum of two matmuls: one more
    weight-sized add each). The cost: the attention of a packed row spans all of it, the masked
    blocks included (`packed_cost`). Needs `can_pack_prefix(model)`. Returns (N, width - 1) as
    `shared_prefix_rows` does.
    """
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    c_max = max(len(c) for c in completions)
    if c_max == 0:  # nothing to score
        empty = torch.zeros(len(completions), width - 1, device=device)
        return empty, empty.clone() if with_entropy else None
    members: list[list[int]] = [[] for _ in prompts]
    for i, k in enumerate(prompt_of_row):
        members[k].append(i)
    n_common = n_common if one_row else 0
    packs = [list(range(len(prompts)))] if one_row else [[k] for k in range(len(prompts))]
    lengths = [n_common + sum(len(prompts[k]) - n_common + sum(len(completions[i]) for i in members[k]) for k in pack)
               for pack in packs]
    t = max(lengths)
    ids = torch.full((len(packs), t), pad_id, dtype=torch.long)
    pos = torch.zeros((len(packs), t), dtype=torch.long)
    # segment of each token: 0 the common part, then per row a segment per prompt and per completion
    # (padding: one of its own); a token sees the tokens before it in its segment, its parent's and 0's
    seg = torch.zeros((len(packs), t), dtype=torch.long)
    parent = [0]
    source = torch.zeros((len(completions), c_max), dtype=torch.long)  # flat hidden position predicting each token
    for r, pack in enumerate(packs):
        if n_common:
            ids[r, :n_common] = torch.tensor(prompts[pack[0]][:n_common], dtype=torch.long)
            pos[r, :n_common] = torch.arange(n_common)
        at = n_common
        for k in pack:
            own, prompt_seg = prompts[k][n_common:], len(parent)
            parent.append(0)
            ids[r, at : at + len(own)] = torch.tensor(own, dtype=torch.long)
            pos[r, at : at + len(own)] = torch.arange(n_common, len(prompts[k]))
            seg[r, at : at + len(own)] = prompt_seg
            last, at = r * t + at + len(own) - 1, at + len(own)
            for i in members[k]:
                n = len(completions[i])
                ids[r, at : at + n] = torch.tensor(completions[i], dtype=torch.long)
                pos[r, at : at + n] = torch.arange(len(prompts[k]), len(prompts[k]) + n)
                seg[r, at : at + n] = len(parent)
                parent.append(prompt_seg)
                if n:  # token 0 is predicted by the prompt's last position, token m by the completion's m - 1
                    source[i, :n] = torch.cat([torch.tensor([last]), r * t + torch.arange(at, at + n - 1)])
                at += n
        seg[r, at:] = len(parent)  # padding
        parent.append(len(parent))
    parents = torch.tensor(parent)[seg]  # (R, T)
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]
    sees = (k_seg == 0) | (k_seg == q_seg) | (k_seg == parents[:, :, None])
    mask = (torch.ones(t, t, dtype=torch.bool).tril() & sees) | torch.eye(t, dtype=torch.bool)
    hidden = decoder(input_ids=ids.to(device), attention_mask=mask[:, None].to(device), position_ids=pos.to(device),
                     use_cache=False).last_hidden_state  # (R, T, H)
    source = source.to(device)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source.reshape(-1)).view(*source.shape, -1)
    cids, cmask = right_padded(completions, pad_id)
    lp, ent = head_logprobs(head, picked, cids.to(device), cmask.bool().to(device), chunk_tokens, with_entropy)
    return _as_whole_rows(lp, ent, prompts, prompt_of_row, width)


def completion_logprobs(model, sequences: list[tuple[list[int], int]], pad_id: int, device: str,
                        chunk: int = 4096, share_prefix: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs of each sequence's completion and the mask over them: both (N, L-1).

    Right-padded, one forward pass (with gradient if enabled by the caller); position t of the
    result is log p(token t+1 | tokens <= t); the logits exist `chunk` positions at a time
    (`stages.modeling.logprobs`). Sequences with the same prompt (a pair's chosen and rejected) can share it,
    the same values and gradients either way: a Llama / Mistral / Qwen2 model runs each prompt and
    its completions as one row under a mask that keeps the completions apart
    (`logprobs.packed_prefix_rows`: one decoder call; `can_pack_prefix`), other models run each
    distinct prompt once, then the completions against its KV cache (`shared_prefix_rows`: two
    calls; `can_share_prefix`, not under gradient checkpointing). `share_prefix` None: where that
    costs less than whole rows (`packing_pays`: positions and attention; `prefix_sharing_pays`:
    positions and the second call, which on a very narrow model outweighs what sharing saves);
    True: wherever a prompt repeats; False: never.
    """
    row_lengths, completion_lengths = [len(s) for s, _ in sequences], [n_c for _, n_c in sequences]
    lengths = torch.tensor(row_lengths)
    width = max(row_lengths)
    columns = torch.arange(width)[None, :]
    real = columns < lengths[:, None]
    # position t predicts token t+1: the completion's n_c tokens are predicted from len - n_c - 1 to len - 2
    first = lengths - torch.tensor(completion_lengths) - 1
    mask = ((columns[:, :-1] >= first[:, None]) & (columns[:, :-1] < (lengths - 1)[:, None])).to(device)
    if share_prefix is not False:
        index: dict[tuple[int, ...], int] = {}
        prompt_of_row = [index.setdefault(tuple(s[: len(s) - n_c]), len(index)) for s, n_c in sequences]
        prompt_lengths = [len(p) for p in index]
        shared = None
        if len(index) == len(sequences):
            pass  # no prompt repeats
        elif can_pack_prefix(model):
            if share_prefix or packing_pays(prompt_lengths, completion_lengths, prompt_of_row, row_lengths,
                                                     attention_share(model)):
                shared = packed_prefix_rows
        elif can_share_prefix(model) and (share_prefix or prefix_sharing_pays(
                prompt_lengths, completion_lengths, row_lengths, default_bucket_overhead(device, model))):
            shared = shared_prefix_rows
        if shared is not None:
            logp, _ = shared(model, [list(p) for p in index], [s[len(s) - n_c :] for s, n_c in sequences],
                             prompt_of_row, pad_id, width, device, chunk_tokens=chunk)
            return logp, mask
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    ids[real] = torch.tensor(list(chain.from_iterable(s for s, _ in sequences)), dtype=torch.long)  # row-major: in order
    ids, attn = ids.to(device), real.long().to(device)
    logp, _ = token_logprobs(model, ids, attn, chunk_tokens=chunk, positions=mask)  # head on completions only
    return logp, mask


@torch.no_grad()
def score_examples(model, tokenized: list[tuple[list[int], int]], pad_id: int, device: str, batch_size: int,
                   autocast_dtype=None, desc: str = "reference log-probs") -> list[float]:
    """Summed completion log-probs of many sequences (the reference pass), in order."""
    out: list[float] = []
    was_training = model.training
    model.eval()
    for i in tqdm(range(0, len(tokenized), batch_size), desc=desc, unit="batch", leave=False):
        with torch.autocast(device_type=device.split(":")[0], dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            logp, mask = completion_logprobs(model, tokenized[i : i + batch_size], pad_id, device)
        out += sequence_logprobs(logp, mask).tolist()
    model.train(was_training)
    return out
