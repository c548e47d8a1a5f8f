"""One decode step of a Llama-family causal LM, run through the model's own modules without its forward.

`generation.decode_rows` runs a batch's model forward once per new token. For a one-token step,
transformers' forward spends most of its time outside the arithmetic on small models: building
the attention mask, rotary and kwargs plumbing, per-layer decorators, output dataclasses (the
tiny 2-layer model, 16 rows on CPU: 1.34 ms a step through `model(...)`, 0.74 ms through
`lean_step`). `lean_step` computes the same thing by calling the model's own modules in the
order its forward does (embedding, rotary embedding, each layer's norms, projections, MLP, the
final norm and head), with the attention done as transformers' SDPA integration does it for one
query token. The modules are the model's own, so LoRA adapters (peft injects them into the
projections) and weights updated in place take part as they do in `model(...)`.

Only models whose decode step is exactly that are taken (`lean_step` returns None otherwise and
the caller runs `model(...)`): Llama, Mistral and Qwen2 causal LMs with full attention in every
layer, the `sdpa` attention implementation, and no accelerate hooks (device maps, offloading).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

LEAN_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LEAN_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")

# (token [rows, 1], attention mask [rows, cache length + 1], position ids [rows, 1], cache, padded) -> logits [rows, vocab]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache, bool], torch.Tensor]


def _full_attention(attn, config) -> bool:
    """No sliding window: Qwen2 sets it per layer on the attention module, Mistral reads its config."""
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return window is None


def lean_step(model) -> Step | None:
    """The decode step for `model` (a causal LM, or a peft model wrapping one), or None where it does not apply."""
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
    embed, rotary, norm, head = inner.embed_tokens, inner.rotary_emb, inner.norm, base.lm_head

    def step(token: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache,
             padded: bool) -> torch.Tensor:
        x = embed(token)
        cos, sin = rotary(x, pos)
        rows = x.shape[0]
        # One query token attends to every real column: the causal mask is the padding mask, None without padding.
        attn_mask = mask.bool()[:, None, None, :] if padded else None
        for i, (layer, attn) in enumerate(zip(layers, attns, strict=True)):
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            q, k = rotate(q, k, cos, sin)
            k, v = cache.update(k, v, i)
            groups = attn.num_key_value_groups
            if groups > 1 and attn_mask is not None:  # transformers' pack_gqa: a group's heads as query positions
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.reshape(rows, -1, groups, attn.head_dim), k, v, attn_mask=attn_mask, scale=attn.scaling)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, scale=attn.scaling, enable_gqa=groups > 1)
            x = x + attn.o_proj(o.reshape(rows, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return head(norm(x))[:, -1]

    return step


def takes_cache(cache, layer_types: tuple[type, ...] = (DynamicLayer,)) -> bool:
    """Whether `cache` is one `lean_step` updates as `model(...)` would: a DynamicCache whose layers are all
    filled and of exactly `layer_types` (full attention: sliding-window, quantized and linear-attention layers
    subclass DynamicLayer but are not taken)."""
    return (type(cache) is DynamicCache and bool(cache.layers)
            and all(type(layer) in layer_types and layer.is_initialized for layer in cache.layers))
