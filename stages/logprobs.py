"""Per-token log-probs of a causal LM without materialising the [batch, seq, vocab] logits.

Training stages need log p(token t+1 | tokens <= t) at every position (SFT's loss, DPO's sequence
log-probs, GRPO's ratios and entropy). The plain way, `model(...).logits` then `log_softmax`, holds
B x T x V floats two or three times over: for SmolLM2 (V = 49,152) a GRPO mini-batch of 16 x 176
tokens is 554 MB per copy in fp32. Here the decoder runs once to hidden states; the output head,
log-softmax and gather run over `chunk_tokens` positions at a time under activation
checkpointing, so only one chunk's logits exist at a time, in the forward pass and again in the
backward pass (the head is recomputed per chunk: ~V*H multiply-adds per token, about a fifth of a
135M model's forward pass).

Models whose forward does more than `head(hidden)` (Gemma's final logit soft-capping, Cohere's
logit scale) take the plain path, as does `chunk_tokens=0`.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _head_is_plain(model) -> bool:
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
                   with_entropy: bool = False, targets: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T-1: (B, T-1) fp32; and the entropy
    of the next-token distribution there (no gradient) if asked. `targets` (B, T-1) replaces
    input_ids[:, 1:] as the tokens scored (e.g. SFT labels with masked positions set to any id).

    With chunk_tokens > 0 (and a plain output head) the logits exist `chunk_tokens` positions at
    a time; the values and gradients equal the full computation's up to float rounding.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if chunk_tokens <= 0 or decoder is None or head is None or not _head_is_plain(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1, :]
        b, t = logits.shape[:2]
        y = (input_ids[:, 1:] if targets is None else targets).reshape(-1)
        logp, entropy = _chunk(torch.nn.Identity(), logits.reshape(b * t, -1), y, with_entropy)
        return logp.reshape(b, t), entropy.reshape(b, t) if entropy is not None else None

    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    b, t = input_ids.shape[0], input_ids.shape[1] - 1
    flat = hidden[:, :-1, :].reshape(b * t, hidden.shape[-1])
    flat_targets = (input_ids[:, 1:] if targets is None else targets).reshape(-1)
    logps, entropies = [], []
    for i in range(0, b * t, chunk_tokens):
        h, y = flat[i : i + chunk_tokens], flat_targets[i : i + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk, head, h, y, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, y, with_entropy)
        logps.append(lp)
        if ent is not None:
            entropies.append(ent)
    logp = torch.cat(logps).reshape(b, t)
    return logp, torch.cat(entropies).reshape(b, t) if with_entropy else None
