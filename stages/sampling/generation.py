"""The generation engine every sampling stage shares: n completions per prompt, one interface
(`completions.GenerationBackend`), two backends (transformers here, vLLM where installed: `vllm_backend`).

transformers backend: prompts sorted by length before batching (less padding; results restored to
input order), left padding, KV cache, EOS and stop strings end a completion, each batch reseeded
from (seed, batch index) so results do not depend on what ran before. GRPO samples with the policy
it trains, in place: no weight reload. With the dynamic cache (the default) each prompt is
prefilled once for its n samples and our own decode loop samples (`kv_decode`); it drops rows that
have ended from the batch, where generate() computes every row until the longest ends, and samples
the tokens generate() would. `cache: static` goes through transformers' generate() (preallocated
cache; on a GPU it compiles the decode step; prompts are padded to a bucket of 64 tokens so few
shapes compile). `cache: graph` decodes through `kv_decode.decode_static`; models `lean_decode` does
not take run `decode_rows` instead. Sampling: `sampler`; fp32 CPU linears: `rows_first`.
The progress bar (`GenerationProgress`) counts tokens as each decode step adds them and completions
as they end, not batches (a batch can take minutes); vLLM shows its own bar.
Measured costs and savings: benchmarks/RESULTS.md, "Single-process speed".

Per-token log-probs, when asked, come from a teacher-forced forward pass over prompt + completion
with the same position ids generation used: log-probs of the sampled tokens under the model's own
distribution (temperature 1, no top-p/top-k), i.e. exactly what a trainer's forward pass computes.
The pass runs in row chunks, so [batch, seq, vocab] logits are never held for the whole batch.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.generation.stopping_criteria import (
    StoppingCriteria,
    StoppingCriteriaList,
)

from schemas.configs import GenerationSpec
from schemas.errors import ModelError
from stages.runtime import threads
from stages.runtime.seeds import seed_stream
from stages.sampling import lean_decode
from stages.sampling.completions import (
    Completion,
    CompletionStopStrings,
    GenerationBackend,
    GenerationProgress,
    GenerationStats,
    cut_at_stop,
    render_prompts,
    row_prefills,
    stop_token_ids,
)
from stages.sampling.kv_decode import (
    LEAN_CACHE_LAYERS,
    decode_rows,
    decode_static,
    prefill_prompts,
    supports_decode_rows,
)
from stages.sampling.rows_first import rows_first_linears
from stages.sampling.sampler import sampling_processors
from stages.sampling.vllm_backend import VLLMBackend, serving_engine


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
            threads.rebalance()  # this stage's share of the cores, if another r1flow run started or ended
            enc = tokenizer([texts[i] for i in idx], return_tensors="pt", add_special_tokens=False,
                            **({"padding": True} if spec.cache != "static" else
                               {"padding": True, "pad_to_multiple_of": STATIC_BUCKET})).to(device)
            torch.manual_seed(seed_stream(seed, "generate_batch", b))
            with rows_first_linears(model), self._precision(device):
                if spec.cache in ("dynamic", "graph") and supports_decode_rows(model):
                    p_ids, p_mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], n,
                                                           spec.max_new_tokens, pad_id=pad_id)
                    procs = list(sampling_processors(spec.temperature, spec.top_k, spec.top_p)) if do_sample else []
                    stop = CompletionStopStrings(tokenizer, list(spec.stop), p_ids.shape[1]) if spec.stop else None
                    static = (spec.cache == "graph" and lean_decode.applies(model)
                              and lean_decode.takes_cache(cache, LEAN_CACHE_LAYERS))
                    decode = decode_static if static else decode_rows  # graph on other models: decode_rows
                    step_lps = (torch.zeros(p_ids.shape[0], spec.max_new_tokens, device=device) if logprobs
                                else None)
                    new = decode(model, p_ids, p_mask, cache, spec.max_new_tokens, eos_ids, pad_id,
                                 warpers=procs[:-1], sampler=procs[-1] if procs else None, stop=stop,
                                 progress=steps, logprobs=step_lps)
                else:
                    new, step_lps = self._generate(enc, n, spec, eos_ids, pad_id, steps), None
            rows = self._rows(new.tolist(), eos_ids, spec.stop, pad_id)
            bar.batch_done([len(ids) for ids, _, _ in rows])
            lps = None
            if logprobs:  # read at the step that sampled each token; a second pass only where generate() sampled
                lens = torch.tensor([len(r[0]) for r in rows], device=device)
                cmask = (torch.arange(new.shape[1], device=device)[None, :] < lens[:, None]).long()
                lps = (step_lps[:, : new.shape[1]] * cmask if step_lps is not None else
                       sampled_completion_logprobs(model, enc["input_ids"].repeat_interleave(n, 0),
                                                   enc["attention_mask"].repeat_interleave(n, 0), new * cmask, cmask)
                       ).tolist()
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
        criteria = []
        if spec.stop:
            criteria.append(CompletionStopStrings(self.tokenizer, list(spec.stop), enc["input_ids"].shape[1]))
        if progress is not None:
            rows = enc["input_ids"].shape[0] * n
            criteria.append(_StepCounter(progress, rows, spec.max_new_tokens, eos_ids, enc["input_ids"].device))
        if criteria:
            kwargs.update(stopping_criteria=StoppingCriteriaList(criteria))
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


def make_backend(spec: GenerationSpec, model, tokenizer, model_input=None, seed: int = 0,
                 colocated: bool = False, autocast_dtype: torch.dtype | None = None) -> GenerationBackend:
    """The backend `spec` names; vllm serves `model`, the stage's loaded model of `model_input` (an `Input`: a full
    model, or an adapter on its base: `serving_engine`), `colocated` beside a trainer; transformers samples under
    `autocast_dtype` (a trainer's precision) when given."""
    if spec.backend == "vllm":
        if model_input is None:
            raise ModelError("generation.backend=vllm needs the model's artifact to start its engine from")
        return serving_engine(model_input, model, tokenizer, seed=seed, colocated=colocated)
    return TransformersBackend(model, tokenizer, autocast_dtype)


def auto_precision(device: str) -> torch.dtype | None:
    """The autocast dtype of `precision: auto`: bf16 on a CUDA device that supports it (as the trainers use), else
    None (fp32: the CPU path is unchanged)."""
    return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else None


def sample_with(model_input, conversations: list[list[dict]], spec: GenerationSpec, n: int, seed: int, device: str,
                desc: str) -> tuple[list[list[Completion]], GenerationStats]:
    """Load a stage's model input on `device` and sample `n` completions per conversation with the backend `spec`
    names (the sampling stages' whole use of a model: nothing of it is kept once this returns), under bf16
    autocast on a GPU (auto_precision)."""
    model, tokenizer = model_input.load_model()
    model.to(device)
    backend = make_backend(spec, model, tokenizer, model_input, autocast_dtype=auto_precision(device))
    try:
        return backend.generate(conversations, spec, n=n, seed=seed, desc=desc)
    finally:
        release(backend)


def release(backend) -> None:
    """A stage is done with `backend`: a vLLM engine is shut down (one engine at a time per process, and the next
    stage of a flow may start its own); r1flow's own needs nothing."""
    if isinstance(backend, VLLMBackend):
        backend.close()


def generate(model, tokenizer, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
             desc: str = "generate", progress: bool = True, logprobs: bool = False,
             autocast_dtype: torch.dtype | None = None) -> tuple[list[list[Completion]], GenerationStats]:
    """n completions per conversation (in input order) with the transformers backend."""
    return TransformersBackend(model, tokenizer, autocast_dtype).generate(
        conversations, spec, n=n, seed=seed, logprobs=logprobs, desc=desc, progress=progress)
