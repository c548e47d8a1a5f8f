"""Per-token log-probs of a causal LM without materialising the [batch, seq, vocab] logits.

Training stages need log p(token t+1 | tokens <= t) at every position (SFT's loss, DPO's sequence
log-probs, GRPO's ratios and entropy). The plain way, `model(...).logits` then `log_softmax`, holds
B x T x V floats two or three times over: for SmolLM2 (V = 49,152) a GRPO mini-batch of 16 x 176
tokens is 554 MB per copy in fp32. Here the decoder runs once to hidden states; the output head,
log-softmax and gather run over `chunk_tokens` positions at a time under activation
checkpointing, so only one chunk's logits exist at a time, in the forward pass and again in the
backward pass (the head is recomputed per chunk: ~V*H multiply-adds per token, about a fifth of a
135M model's forward pass).

For a plain `nn.Linear` head the head, log-softmax and gather are one autograd function
(`linear_logprobs`): the forward keeps only each position's log-sum-exp, and the backward forms
softmax - onehot in the logits buffer itself, without log-softmax's saved output or gather's
dense scatter. When the scored positions fit in one chunk the logits are kept from the forward
pass for the backward pass (no second head matmul); more than a chunk, they are recomputed chunk
by chunk, so `chunk_tokens` bounds the logits held at any time either way.

`positions` (a bool mask over the scored positions) restricts the head to the positions a loss
reads: the completion tokens in DPO and GRPO, the labelled tokens in SFT. The decoder still runs
over every position (the prompt is context), but the output head, the largest single matmul of a
small model (V x H per token: 28M multiply-adds per position for SmolLM2, a fifth of its
forward), runs only where a value is needed, forward and backward; elsewhere the result is 0.

An FSDP-sharded model (`stages.runtime.distributed`, distributed_type fsdp) runs through its root forward
with one logit position, the decoder's hidden states taken by a hook: the root all-gathers the
embeddings, final norm and head, which calling the decoder directly would skip.

Models whose forward does more than `head(hidden)` (Gemma's final logit soft-capping, Cohere's
logit scale) take the plain path, as does `chunk_tokens=0`.

Sharing a prompt among its completions: `stages.modeling.prefix_sharing`.
Measured costs and savings: benchmarks/RESULTS.md, "Single-process speed".
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from stages.runtime.distributed import inner_output, is_sharded

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def head_is_plain(model) -> bool:
    config = getattr(model, "config", None)
    return not any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS)


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    logp_all = torch.log_softmax(head(hidden).float(), dim=-1)  # (n, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp, entropy


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_tokens: int = 4096,
                   with_entropy: bool = False, targets: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T-1: (B, T-1) fp32; and the entropy
    of the next-token distribution there (no gradient) if asked. `targets` (B, T-1) replaces
    input_ids[:, 1:] as the tokens scored (e.g. SFT labels with masked positions set to any id).
    `positions` (B, T-1) bool: compute only there (0 elsewhere, in the log-probs and the entropy).
    `attention_mask` may be a 4D mask (packed SFT rows, `sft.block_attention`) with its `position_ids`.

    With chunk_tokens > 0 (and a plain output head) the logits exist `chunk_tokens` positions at
    a time; the values and gradients equal the full computation's up to float rounding.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if chunk_tokens <= 0 or decoder is None or head is None or not head_is_plain(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits[:, :-1, :]
        b, t = logits.shape[:2]
        y = (input_ids[:, 1:] if targets is None else targets).reshape(-1)
        logp, entropy = _chunk(torch.nn.Identity(), logits.reshape(b * t, -1), y, with_entropy)
        logp, entropy = logp.reshape(b, t), entropy.reshape(b, t) if entropy is not None else None
        if positions is not None:
            logp = logp * positions
            entropy = entropy * positions if entropy is not None else None
        return logp, entropy

    hidden = decoder_hidden(model, decoder, input_ids, attention_mask, position_ids)
    return head_logprobs(head, hidden[:, :-1, :], input_ids[:, 1:] if targets is None else targets, positions,
                         chunk_tokens, with_entropy, fused=not is_sharded(model))  # fsdp: the head as a module


def bucketed_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_tokens: int = 4096,
                            with_entropy: bool = False, bucket_overhead: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of right-padded rows in length buckets (`length_buckets`): each bucket's rows
    cut to the bucket's longest row, not the batch's (`bucket_overhead`: as in
    `shared_prefix_logprobs`). Returns (B, T-1) like `token_logprobs`, equal to it up to float
    rounding at every position that predicts a real token, and 0 where it would predict padding.

    One bucket, still cut to the longest row, for an FSDP-sharded model (every rank must run as
    many forwards: each gathers the layers). Rows that are not right padded, no rows, or fewer than
    two columns: `token_logprobs` itself.
    """
    b, t = input_ids.shape
    if b == 0 or t < 2 or not bool((attention_mask[:, :-1] >= attention_mask[:, 1:]).all()):
        return token_logprobs(model, input_ids, attention_mask, chunk_tokens, with_entropy)
    lengths = attention_mask.sum(-1).tolist()
    if is_sharded(model):
        overhead = 10**12
    else:
        overhead = default_bucket_overhead(input_ids.device, model) if bucket_overhead is None else bucket_overhead
    buckets = length_buckets(lengths, overhead)
    logps, entropies = [], []
    for rows in buckets:
        width = max(2, max(lengths[i] for i in rows))  # at least one position
        index = bucket_index(rows, buckets, input_ids.device)
        mask = take_rows(attention_mask, index)[:, :width]
        lp, ent = token_logprobs(model, take_rows(input_ids, index)[:, :width], mask, chunk_tokens, with_entropy)
        real = mask[:, 1:].to(lp.dtype)  # position j predicts token j+1: 0 where that is padding
        logps.append(torch.nn.functional.pad(lp * real, (0, t - width)))
        if ent is not None:
            entropies.append(torch.nn.functional.pad(ent * real, (0, t - width)))
    return (in_input_order(logps, buckets),
            in_input_order(entropies, buckets) if with_entropy else None)


def bucket_index(rows: list[int], buckets: list[list[int]], device: torch.device) -> torch.Tensor | None:
    """The rows of one bucket as an index tensor; None when the bucket is the whole batch."""
    return None if len(buckets) == 1 else torch.tensor(rows, device=device)


def take_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def in_input_order(parts: list[torch.Tensor], buckets: list[list[int]]) -> torch.Tensor:
    """The buckets' results (one tensor per bucket, rows in bucket order) as one tensor in input row order."""
    if len(parts) == 1:
        return parts[0]
    order = torch.tensor([r for rows in buckets for r in rows], device=parts[0].device)
    return torch.cat(parts).index_select(0, order.argsort())


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                  chunk_tokens: int, with_entropy: bool, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[b, t] | hidden[b, t]) through the output head, `chunk_tokens` positions at a time,
    only at `positions` if given (0 elsewhere): (B, T) fp32 each. A plain `nn.Linear` head goes through
    `linear_logprobs` (`fused`); any other head through activation checkpointing per chunk.
    chunk_tokens <= 0: every position in one chunk."""
    b, t = targets.shape
    chunk_tokens = chunk_tokens if chunk_tokens > 0 else max(b * t, 1)
    flat = hidden.reshape(b * t, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    index = None
    if positions is not None:
        index = positions.reshape(-1).nonzero().squeeze(-1)  # (n,) flat positions that are scored
        flat, flat_targets = flat.index_select(0, index), flat_targets.index_select(0, index)
    if fused and type(head) is torch.nn.Linear:
        logp, entropy = linear_logprobs(flat, head.weight, head.bias, flat_targets, chunk_tokens, with_entropy)
        return (_scatter([logp], index, b, t, hidden),
                _scatter([entropy], index, b, t, hidden) if entropy is not None else None)
    logps, entropies = [], []
    for i in range(0, flat.shape[0], chunk_tokens):
        h, y = flat[i : i + chunk_tokens], flat_targets[i : i + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk, head, h, y, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, y, with_entropy)
        logps.append(lp)
        if ent is not None:
            entropies.append(ent)
    logp = _scatter(logps, index, b, t, hidden)
    return logp, _scatter(entropies, index, b, t, hidden) if with_entropy else None


class _LinearLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[target] per row, chunked; see `linear_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, with_entropy):
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        keep = n <= chunk  # one chunk: hold its logits for the backward pass instead of recomputing them
        kept = None
        for i in range(0, n, chunk):
            z = _linear(hidden[i : i + chunk], weight, bias, dtype)
            rows = slice(i, i + z.shape[0])
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:  # H = lse - sum_v p_v z_v
                entropy[rows] = lse[rows] - (torch.softmax(z, dim=-1) * z).sum(-1)
            kept = z if keep else None
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.kept, ctx.chunk, ctx.dtype = kept, chunk, dtype
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None  # fp32 sums over the chunks
        w = weight.to(dtype)
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i : i + chunk]
            rows = slice(i, i + h.shape[0])
            z = ctx.kept if ctx.kept is not None else _linear(h, weight, bias, dtype)
            g = grad_logp[rows, None].float()
            # d logp / d z = onehot(target) - softmax(z), in place in the logits buffer
            z = z.sub_(lse[rows, None]).exp_().mul_(-g).scatter_add_(1, targets[rows, None], g).to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = z @ w
            if ctx.needs_input_grad[1]:
                part = (z.t() @ h.to(dtype)).float()
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if ctx.needs_input_grad[2]:
                part = z.sum(0).float()
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
        ctx.kept = None
        return (grad_hidden,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


def _linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of h @ weight.T (+ bias), the matmul in `dtype` (the autocast dtype the forward saw)."""
    return torch.nn.functional.linear(h.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None).float()


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    chunk_tokens: int, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(hidden @ weight.T + bias)[targets] (N,) fp32, and the entropy (no gradient) if asked.

    hidden (N, H), weight (V, H), targets (N,). `chunk_tokens` rows of logits exist at a time; the
    forward keeps each row's log-sum-exp, and the backward turns the logits into
    onehot(target) - softmax in place: recomputed per chunk when N > chunk_tokens, kept from the
    forward when N <= chunk_tokens (one chunk, so no more memory than a chunk). The matmuls run in
    the autocast dtype active at the forward pass (as `nn.Linear` would), the softmax in fp32.
    """
    chunk = chunk_tokens if chunk_tokens > 0 else max(hidden.shape[0], 1)
    return _LinearLogprobs.apply(hidden, weight, bias, targets, chunk, with_entropy)



def decoder_hidden(model, decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's last hidden state (B, T, H); under FSDP through the root forward (see the module doc)."""
    return inner_output(model, decoder, {"logits_to_keep": 1}, input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, use_cache=False).last_hidden_state


# Token positions a separate completion bucket must save to be worth its own decoder call (forward and
# backward) and its own gather of the prompts' cache rows. CPU, measured (benchmarks/completion_buckets.py,
# SmolLM2, 2 threads): each extra bucket costs about as much as 36 positions; 16 completions of 18-124
# tokens run 7.6 s -> 5.3 s a forward + backward in 4 buckets at 64 or 3 at 128. CUDA, not measured (no GPU
# lent): estimated from the H100 numbers (a 128 x 176-token step in 0.18 s, ~8 us a position) and
# ~4 ms of kernel launches for a decoder call's forward and backward.
BUCKET_OVERHEAD_CPU = 64
BUCKET_OVERHEAD_CUDA = 512
# Those are positions of a SmolLM2-sized model (3.5M parameters a decoder layer). A decoder call's fixed cost is
# mostly per-op dispatch, about the same at any width, while a position costs in proportion to the layer's
# parameters: in a narrower model the same call is worth more positions. Measured on CPU (benchmarks/call_overhead.py:
# 2 T(B rows) - T(2B rows) in positions of the 2B-row call, forward + backward, 2 threads, median over row lengths
# 32-128): the tiny model (37K parameters a layer) 436 (240-454), 185K 153, 738K 60, 2.8M 27, SmolLM2 (3.5M, 30
# layers) 48; (3.5M / p) ** (1/3) scales 64 to 292, 171, 108, 69 and 64: the right order, between the tiny model
# (where it decides DPO's prefix sharing) and SmolLM2 on the cautious side (fewer calls). Layers at least as wide
# as the reference keep the constants. CUDA: the same scaling, not measured.
OVERHEAD_REFERENCE_LAYER_PARAMETERS = 3_500_000


def layer_parameters(model) -> int | None:
    """Parameters of the model's first decoder layer (LoRA weights included); None if it has no `layers`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) == 0:
        return None
    return sum(p.numel() for p in layers[0].parameters())


def default_bucket_overhead(device: torch.device | str, model=None) -> int:
    """What one more decoder call (forward and backward) costs, in token positions: the device's constant,
    scaled up for a model with narrower layers than the reference (see above)."""
    base = BUCKET_OVERHEAD_CUDA if torch.device(device).type == "cuda" else BUCKET_OVERHEAD_CPU
    n = layer_parameters(model) if model is not None else None
    if not n or n >= OVERHEAD_REFERENCE_LAYER_PARAMETERS:
        return base
    return round(base * (OVERHEAD_REFERENCE_LAYER_PARAMETERS / n) ** (1 / 3))


def length_buckets(lengths: list[int], overhead: int) -> list[list[int]]:
    """Rows grouped so that each group runs padded to its own longest row: the grouping by length
    that minimises padded positions + `overhead` per group (exact: dynamic programming over the
    distinct lengths, shortest first; rows of equal length always share a group). Each group lists
    its rows in input order, groups go from shorter to longer; one group `[0, ..., n-1]` when
    splitting saves no more than the overheads it adds."""
    if not lengths:
        return []
    values = sorted(set(lengths))
    counts = [0] * len(values)
    slot = {v: k for k, v in enumerate(values)}
    for n in lengths:
        counts[slot[n]] += 1
    rows_upto = [0]
    for c in counts:
        rows_upto.append(rows_upto[-1] + c)
    m = len(values)
    best, cut = [0] + [None] * m, [0] * (m + 1)
    for j in range(1, m + 1):  # best[j]: the rows of the j shortest lengths; the last group values[i:j], padded to values[j-1]
        for i in range(j):
            c = best[i] + (rows_upto[j] - rows_upto[i]) * values[j - 1] + overhead
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i
    bounds, j = [], m
    while j > 0:
        bounds.append((values[cut[j]], values[j - 1]))
        j = cut[j]
    return [[r for r, n in enumerate(lengths) if lo <= n <= hi] for lo, hi in reversed(bounds)]


def right_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) ids and 0/1 attention mask of the sequences, right padded to the longest."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def _scatter(parts: list[torch.Tensor], index: torch.Tensor | None, b: int, t: int, like: torch.Tensor) -> torch.Tensor:
    """The chunks' values laid out as (B, T): in order, or at `index` with 0 elsewhere (differentiable)."""
    values = torch.cat(parts) if parts else like.new_zeros(0, dtype=torch.float32)
    if index is None:
        return values.reshape(b, t)
    return values.new_zeros(b * t).index_copy(0, index, values).reshape(b, t)


