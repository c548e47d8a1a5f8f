"""The vLLM generation backend (optional extra, CUDA), and reading a trained policy's weights into it.

vLLM runs as a separate engine for the sampling stages and colocated (in each training process) for
grpo and on-policy distill, which push the trained weights into it before every rollout after the
first (`policy_weights`, LoRA adapters folded in out of place; `load_weights`). Not with FSDP shards:
both stages refuse `backend: vllm` with `distributed_type: fsdp` at config time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from schemas.configs import GenerationSpec
from schemas.errors import ModelError
from stages.sampling.completions import Completion, GenerationStats, render_prompts, row_prefills

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
