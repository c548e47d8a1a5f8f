"""One decode step of a Llama-family causal LM, run through the model's own modules without its forward.

`kv_decode.decode_rows` runs a batch's model forward once per new token. For a one-token step,
transformers' forward spends most of its time outside the arithmetic on small models: building
the attention mask, rotary and kwargs plumbing, per-layer decorators, output dataclasses (the
tiny 2-layer model, 16 rows on CPU: 1.34 ms a step through `model(...)`, 0.74 ms through
`lean_step`). `lean_step` computes the same thing by calling the model's own modules in the
order its forward does (embedding, rotary embedding, each layer's norms, projections, MLP, the
final norm and head), with the attention done as transformers' SDPA integration does it for one
query token. The modules are the model's own, so LoRA adapters (peft injects them into the
projections) and weights updated in place take part as they do in `model(...)`.

On a small model the step is a few hundred tiny operations, each costing more in dispatch than in
arithmetic, so where the copies are small (`FUSE_MAX_BYTES`) a layer's query, key and value
projections run as one matmul on their weights concatenated, and so do the MLP's gate and up
projections (the tiny model, 16 rows: 0.78 -> 0.65 ms a step; SmolLM2-135M on CPU: 93 -> 90 ms,
within noise, for 430 MB of copies, so not there). The copies are taken when `lean_step` is called:
it is called again after the weights change (`decode_rows` calls it per batch). Only plain
`nn.Linear`s are fused (not LoRA layers, nor forwards replaced by anything but
`rows_first.rows_first_linears`, whose layout choice is for large weights), and only where the fused
product gives the separate products' bits (`fuses_exactly`, probed: not so with MKL's strict mode on every CPU).

Only models whose decode step is exactly that are taken (`lean_step` returns None otherwise and
the caller runs `model(...)`): Llama, Mistral and Qwen2 causal LMs with full attention in every
layer, the `sdpa` attention implementation, and no accelerate hooks (device maps, offloading).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from stages.modeling.models import LEAN_MODELS

LEAN_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
LEAN_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP")  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
FUSE_MAX_BYTES = 64 * 2**20  # concatenated projection weights kept for one decode, at most

# (token [rows, 1], attention mask [rows, cache length + 1], position ids [rows, 1], cache, padded) -> logits [rows, vocab]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache, bool], torch.Tensor]


def _full_attention(attn, config) -> bool:
    """No sliding window: Qwen2 sets it per layer on the attention module, Mistral reads its config."""
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return window is None


def _plain(linear) -> bool:
    """nn.Linear itself, its forward not replaced, or replaced by one marked `same_as_linear`."""
    if type(linear) is not torch.nn.Linear:
        return False
    replaced = vars(linear).get("forward")
    return replaced is None or getattr(getattr(replaced, "__func__", None), "same_as_linear", False)


def _fusable(linears) -> bool:
    """Plain linears (reading the same input) whose weights can be concatenated: one dtype and device, all
    biased or none."""
    return all(_plain(m) for m in linears) and len(
        {(m.weight.dtype, m.weight.device, m.bias is None) for m in linears}) == 1


def _concat(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return torch.cat([m.weight.detach() for m in linears]), bias


def fused_projections(layers, max_bytes: int = FUSE_MAX_BYTES) -> list[tuple]:
    """Per layer (q/k/v weight and bias concatenated, or None; gate/up likewise), taken only where they fit in
    `max_bytes` in all; otherwise None everywhere (nothing copied)."""
    groups = [([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
               [layer.mlp.gate_proj, layer.mlp.up_proj] if type(layer.mlp).__name__ in LEAN_MLP else None)
              for layer in layers]
    groups = [tuple(g if g is not None and _fusable(g) else None for g in pair) for pair in groups]
    size = sum(p.numel() * p.element_size() for pair in groups for g in pair if g for m in g for p in m.parameters())
    if size > max_bytes:
        return [(None, None)] * len(layers)
    fused = [tuple(_concat(g) if g else None for g in pair) for pair in groups]
    if not all(fuses_exactly(g, f) for g, f in zip(groups[0], fused[0], strict=True) if g):
        return [(None, None)] * len(layers)
    return fused


PROBE_ROWS = (1, 7, 32)  # matrix products pick their kernels by shape: a few batch sizes a decode step meets


@torch.no_grad()
def fuses_exactly(linears, fused: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    """Whether one product on the concatenated weights gives each linear's output bit for bit. It does with
    MKL's default mode, but not on every CPU with the strict reproducible one (MKL_CBWR=AUTO,STRICT on an AMD
    EPYC: ~1e-7 apart), where fusing would make the lean step differ from the model's forward; so it is probed
    (once per lean step, on the first layer's shapes) rather than assumed."""
    weight = linears[0].weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, 1, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
        whole = torch.nn.functional.linear(x, *fused)
        if not torch.equal(whole, torch.cat([m(x) for m in linears], -1)):
            return False
    return True


@dataclass(frozen=True)
class _Parts:
    """The modules one decode step calls, in the order the model's forward calls them."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    norm: torch.nn.Module
    head: torch.nn.Module
    layers: list
    attns: list
    fused: list
    rotate: Callable


def _parts(model, fuse_max_bytes: int = FUSE_MAX_BYTES) -> _Parts | None:
    """The step's modules for `model` (a causal LM, or a peft model wrapping one), or None where it does not apply."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner, config = getattr(base, "model", None), getattr(base, "config", None)
    if type(base).__name__ not in LEAN_MODELS or inner is None or config is None:
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(base, "hf_device_map", None):
        return None
    layers = list(inner.layers[: config.num_hidden_layers])
    if not layers or any(hasattr(m, "_hf_hook") for m in base.modules()):
        return None
    attns = [layer.self_attn for layer in layers]
    if any(type(a).__name__ not in LEAN_ATTENTION or not _full_attention(a, config) for a in attns):
        return None
    rotate = sys.modules[type(attns[0]).__module__].apply_rotary_pos_emb
    return _Parts(inner.embed_tokens, inner.rotary_emb, inner.norm, base.lm_head, layers, attns,
                  fused_projections(layers, fuse_max_bytes), rotate)


def _forward(p: _Parts, token: torch.Tensor, pos: torch.Tensor, attn_mask: torch.Tensor | None,
             kv: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Logits [rows, vocab] of one new token per row. `kv(layer, k, v)` stores the token's keys and values and
    returns the layer's whole keys and values; `attn_mask` [rows, 1, 1, columns] (True: attend) or None."""
    linear = torch.nn.functional.linear
    x = p.embed(token)
    cos, sin = p.rotary(x, pos)
    rows = x.shape[0]
    for i, (layer, attn, (qkv, gate_up)) in enumerate(zip(p.layers, p.attns, p.fused, strict=True)):
        h = layer.input_layernorm(x)
        if qkv is not None:
            q, k, v = linear(h, *qkv).split([attn.q_proj.out_features, attn.k_proj.out_features,
                                             attn.v_proj.out_features], -1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(rows, 1, -1, attn.head_dim).transpose(1, 2)
        k = k.view(rows, 1, -1, attn.head_dim).transpose(1, 2)
        v = v.view(rows, 1, -1, attn.head_dim).transpose(1, 2)
        q, k = p.rotate(q, k, cos, sin)
        k, v = kv(i, k, v)
        groups = attn.num_key_value_groups
        if groups > 1 and attn_mask is not None:  # transformers' pack_gqa: a group's heads as query positions
            o = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(rows, -1, groups, attn.head_dim), k, v, attn_mask=attn_mask, scale=attn.scaling)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, scale=attn.scaling, enable_gqa=groups > 1)
        x = x + attn.o_proj(o.reshape(rows, 1, -1))
        h = layer.post_attention_layernorm(x)
        if gate_up is not None:
            gate, up = linear(h, *gate_up).chunk(2, -1)
            x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        else:
            x = x + layer.mlp(h)
    return p.head(p.norm(x))[:, -1]


def applies(model) -> bool:
    """Whether `lean_step` and `StaticDecode` take this model (checks only; copies no weights)."""
    return _parts(model, fuse_max_bytes=0) is not None


def lean_step(model, fuse_max_bytes: int = FUSE_MAX_BYTES) -> Step | None:
    """The decode step for `model` (a causal LM, or a peft model wrapping one), or None where it does not apply."""
    parts = _parts(model, fuse_max_bytes)
    if parts is None:
        return None

    def step(token: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache,
             padded: bool) -> torch.Tensor:
        # One query token attends to every real column: the causal mask is the padding mask, None without padding.
        attn_mask = mask.bool()[:, None, None, :] if padded else None
        return _forward(parts, token, pos, attn_mask, lambda i, k, v: cache.update(k, v, i))

    return step


class StaticDecode:
    """Decode steps with fixed shapes, for CUDA graphs: `lean_step`'s arithmetic over preallocated buffers.

    transformers' dynamic cache grows every step, so every step's tensors have new shapes and each of
    a small model's few hundred kernels is launched from Python (on an H100, SmolLM2-135M: launch
    bound, ~20x off the arithmetic). Here every layer's keys and values live in buffers with room
    for the whole completion ([rows, kv heads, past + new tokens, head dim]), the step writes the new
    token's keys and values at a column index held in a device tensor (`index_copy_`), marks that
    column valid in a [rows, columns] mask and attends over all columns (the ones not yet written
    are masked), then advances the index in place. Nothing in a step depends on a Python value that
    changes, so on CUDA the step is captured once as a CUDA graph (`torch.cuda.CUDAGraph`) and
    replayed for every token: one launch a token instead of hundreds. Elsewhere (`graphs=False`) the
    same step runs eagerly (the CPU tests check it against `model(...)` token for token).

    Rows are fixed: finished rows keep decoding (their tokens are replaced by padding), as
    generate() does, where `decode_rows` drops them; use this where launches dominate (small models
    on a GPU), `decode_rows` where arithmetic does (CPU, large batches of uneven lengths).
    Each batch gets its own StaticDecode (its buffers, its graph), made after the weights last changed:
    fused projection copies (`fused_projections`, small models only) are taken when it is made. Graph capture runs on a side stream after two eager
    warm-up steps; under autocast the capture disables autocast's weight cache (a cast copy made
    during capture would be freed and reused by the graph's pool).
    """

    WARMUP_STEPS = 2

    def __init__(self, model, cache: DynamicCache, attention_mask: torch.Tensor, new_tokens: int,
                 graphs: bool | None = None, fuse_max_bytes: int = FUSE_MAX_BYTES):
        parts = _parts(model, fuse_max_bytes)
        if parts is None:
            raise ValueError("StaticDecode needs a Llama, Mistral or Qwen2 model with sdpa attention (see lean_step)")
        self.parts = parts
        rows, width = attention_mask.shape
        past = width - 1  # the cache holds every prompt column but the last, which the first step feeds
        device = attention_mask.device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        capacity = past + new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            if k.shape[2] != past:
                raise ValueError(f"StaticDecode: the cache holds {k.shape[2]} columns, the mask says {past}")
            kb = k.new_zeros(k.shape[0], k.shape[1], capacity, k.shape[3])
            vb = v.new_zeros(v.shape[0], v.shape[1], capacity, v.shape[3])
            kb[:, :, :past] = k
            vb[:, :, :past] = v
            self.keys.append(kb)
            self.values.append(vb)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.valid[:, :past] = attention_mask[:, :-1].bool()
        self.column = torch.full((1,), past, dtype=torch.long, device=device)
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.new_tokens, self.steps = new_tokens, 0
        self.graph, self.logits = None, None

    def _kv(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[i].index_copy_(2, self.column, k.to(self.keys[i].dtype))
        self.values[i].index_copy_(2, self.column, v.to(self.values[i].dtype))
        return self.keys[i], self.values[i]

    def _step(self) -> torch.Tensor:
        self.valid.index_fill_(1, self.column, True)
        logits = _forward(self.parts, self.token, self.pos, self.valid[:, None, None, :], self._kv)
        self.column.add_(1)
        return logits

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] after `token` [rows, 1] at positions `pos` [rows, 1]. The returned tensor is
        overwritten by the next step under graphs: read (or copy) it before."""
        if self.steps >= self.new_tokens:
            raise RuntimeError(f"StaticDecode: more than the {self.new_tokens} steps it was made for")
        self.token.copy_(token)
        self.pos.copy_(pos)
        self.steps += 1
        if not self.graphs:
            return self._step()
        if self.graph is None and self.steps <= self.WARMUP_STEPS:
            return self._step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            ctx = torch.autocast("cuda", dtype=dtype, cache_enabled=False) if autocast else contextlib.nullcontext()
            with ctx, torch.cuda.graph(self.graph, stream=stream):
                self.logits = self._step()
        torch.cuda.current_stream().wait_stream(stream)


def takes_cache(cache, layer_types: tuple[type, ...] = (DynamicLayer,)) -> bool:
    """Whether `cache` is one `lean_step` updates as `model(...)` would: a DynamicCache whose layers are all
    filled and of exactly `layer_types` (full attention: sliding-window, quantized and linear-attention layers
    subclass DynamicLayer but are not taken)."""
    return (type(cache) is DynamicCache and bool(cache.layers)
            and all(type(layer) in layer_types and layer.is_initialized for layer in cache.layers))
