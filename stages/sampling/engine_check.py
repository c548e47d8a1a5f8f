"""Whether vLLM can serve a node's sampling, asked before any compute (the run's plan, a single stage's inputs).

A node samples on vLLM when its config says `backend: vllm` (eval) or `generation.backend: vllm` (every other
sampling stage; distill only in `mode: on_policy`, the one mode that samples). What can be known before a model
loads: whether vLLM is installed here, and on vLLM's CPU build whether its attention serves the model's head size
(it serves a fixed list of sizes; the tiny test model's 16 is not one). The model's size comes from its config
alone (`config.json`), read where the model is: the run's `import_model` node it descends from, or a stage's
input artifact. Nothing here imports torch or vLLM's engine until a node is known to sample on vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["auto_field", "cpu_head_dim_refusal", "head_dim", "sampled_input", "vllm_field", "vllm_head_sizes",
           "vllm_installed"]


def vllm_field(stage: str, config: Any) -> str | None:
    """(pure) The config field that puts a node's sampling on vLLM (`backend` or `generation.backend`), or None when
    the node does not sample on vLLM."""
    if getattr(config, "backend", None) == "vllm":
        return "backend"
    generation = getattr(config, "generation", None)
    if getattr(generation, "backend", None) != "vllm":
        return None
    if stage == "distill" and getattr(config, "mode", None) != "on_policy":
        return None  # traces and logits read the teacher's traces: nothing is sampled
    return "generation.backend"


def auto_field(config: Any) -> str | None:
    """(pure) The config field that leaves a node's backend to the plan (`backend: auto`, `generation.backend: auto`),
    or None."""
    if getattr(config, "backend", None) == "auto":
        return "backend"
    if getattr(getattr(config, "generation", None), "backend", None) == "auto":
        return "generation.backend"
    return None


def sampled_input(stage: str) -> str:
    """(pure) The input whose model a stage samples from: the student in on-policy distillation, else `model`."""
    return "student" if stage == "distill" else "model"


def head_dim(config: dict[str, Any]) -> int:
    """(pure) A transformers config's attention head size: `head_dim` where given, else hidden_size / heads."""
    heads = config.get("num_attention_heads") or 1
    return int(config.get("head_dim") or config.get("hidden_size", 0) // heads)


def cpu_head_dim_refusal(config: dict[str, Any], supported: list[int]) -> str | None:
    """(pure) Why vLLM's CPU attention cannot serve a model of this config (`supported`: its head sizes), or None."""
    size = head_dim(config)
    if not supported or size in supported:
        return None
    return (f"head_dim {size} is not served by vLLM's CPU attention (head sizes {', '.join(map(str, supported))}); "
            "use generation backend transformers for this model")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_head_sizes() -> list[int] | None:
    """The head sizes the installed vLLM's CPU attention serves, or None when the installed vLLM is not its CPU build
    (the CUDA build's kernels serve the common sizes: no list to check against). Imports vLLM (seconds)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())
