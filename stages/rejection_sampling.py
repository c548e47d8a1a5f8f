"""`rejection_sampling` stage: sample K completions per prompt, score them, keep up to M that pass.

This is how R1 built its cold-start data and its stage-3 SFT set: sample from a model, keep what a
verifier accepts. Accepted completions become an `sft` dataset (score kept in metadata); all
scored samples are kept too (`samples`, original completions), for preference pairs and for
inspection. Chaining rejection_sampling → sft → rejection_sampling in a recipe gives Llama-2-style
rounds.

Cold start (R1 paper §2.3.1) from a model that does not write the R1 format yet: `correctness:
lenient` accepts a right answer stated without tags (`Verdict.correct_lenient`), and `reformat`
rewrites each accepted completion that is not well formed into `<think>…</think><answer>…</answer>`
(`stages.rewards.answers.reformat_r1`; R1 used annotators and a summary here, we only restructure).

With `environment:` other than single_turn (e.g. python), the samples are multi-turn trajectories
(`stages.sampling.multiturn`), scored on the model's own text; the kept completion is the transcript
(the model's turns and the tool's outputs), so SFT on it learns tool use (`training.sequences`
trains on the model's spans only). vLLM samples one turn: that combination fails in `check`.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from schemas.configs import RejectionSamplingConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, seed_everything, write_dataset
from stages.environments.registry import check_sampling_environment, environment_from_spec, environment_salt
from stages.rewards.answers import extract_answer_lenient, reformat_r1
from stages.rewards.verifiers import Verdict, score
from stages.sampling.generation import make_backend, release, sample_with
from stages.sampling.multiturn import sample_trajectories

VERSION = "3"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = RejectionSamplingConfig
INPUTS = {"model": "model", "prompts": "prompts", "reward_model": "model?"}
OUTPUTS = {"samples": "samples", "data": "sft"}


def passes(sample: dict, cfg: RejectionSamplingConfig) -> bool:
    """The acceptance rule, on one scored sample row (`correctness: lenient` reads metadata's correct_lenient)."""
    meta = json.loads(sample["metadata"])
    if cfg.require_correct:
        correct = sample["correct"] if cfg.correctness == "strict" else meta["correct_lenient"]
        if correct is not True:
            return False
    if cfg.require_format and not meta["format_ok"]:
        return False
    if cfg.min_reward is not None and (sample["reward"] is None or sample["reward"] < cfg.min_reward):
        return False
    return True


def _normalise(text: str) -> str:
    return " ".join(text.split())


def accept(samples: list[dict], cfg: RejectionSamplingConfig) -> list[dict]:
    """Per prompt: passing samples, de-duplicated by normalised text, best reward first, at most M."""
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        by_prompt[s["prompt_id"]].append(s)
    kept = []
    for pid in sorted(by_prompt):
        ok = [s for s in by_prompt[pid] if passes(s, cfg)]
        ok.sort(key=lambda s: (-(s["reward"] if s["reward"] is not None else -np.inf), s["sample_index"]))
        seen: set[str] = set()
        for s in ok:
            key = _normalise(s["completion"])
            if key in seen:
                continue
            seen.add(key)
            kept.append(s)
            if len(seen) == cfg.keep_per_prompt:
                break
    return kept


def check(cfg: RejectionSamplingConfig) -> None:
    """Before any compute: the environment loads; only r1flow's decode loop runs multi-turn rollouts."""
    check_sampling_environment("rejection_sampling", cfg.environment, cfg.reward, cfg.generation.backend,
                               vllm_turns=True)


def cache_salt(cfg: RejectionSamplingConfig) -> str:
    """A user environment file's bytes; nothing for a built-in (its code moves with VERSION)."""
    return environment_salt(cfg.environment)


def sample_candidates(cfg: RejectionSamplingConfig, model_input: Input, prompts: list[dict], seed: int, device: str
                   ) -> tuple[list[list[dict]], float]:
    """num_samples answers per prompt and the sampling throughput. An answer: `text` (what is scored: the model's
    own text), `completion` (what is kept: the same for single_turn; with a tool environment the transcript, the
    tool's output included, so SFT on it learns to call the tool and read its output), num_tokens, finish_reason
    and `tool` (turns, tool_calls, tool_errors; None for single_turn)."""
    if cfg.environment.is_single_turn:
        comps, stats = sample_with(model_input, [p["messages"] for p in prompts], cfg.generation, cfg.num_samples,
                                   seed, device, "rejection sampling")
        return [[{"text": c.text, "completion": c.text, "num_tokens": c.num_tokens, "finish_reason": c.finish_reason,
                  "tool": None} for c in cs] for cs in comps], stats.tokens_per_s
    env, budget = environment_from_spec(cfg.environment, cfg.reward), cfg.environment.token_budget(
        cfg.generation.max_new_tokens)
    model, tokenizer = model_input.load_model()
    model.to(device)
    if cfg.generation.backend == "vllm":  # the engine samples every turn, prompts and observations as token ids
        engine = make_backend(cfg.generation, model, tokenizer, model_input, seed=seed)
        try:
            trajs, stats = engine.trajectories(prompts, env, cfg.generation, n=cfg.num_samples, seed=seed,
                                               max_total_tokens=budget)
        finally:
            release(engine)
    else:
        trajs, stats = sample_trajectories(model, tokenizer, prompts, env, cfg.generation, n=cfg.num_samples,
                                           seed=seed, max_total_tokens=budget)
    return [[{"text": t.text, "completion": t.transcript, "num_tokens": t.num_tokens,
              "finish_reason": t.finish_reason,
              "tool": {"turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors}}
             for t in ts] for ts in trajs], stats.tokens_per_s


def run(cfg: RejectionSamplingConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    table = inputs["prompts"].table("prompts")
    prompts = [r for r in table.to_pylist() if r["split"] == cfg.split][: cfg.max_prompts]
    if not prompts:
        raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r}")
    seed_everything(ctx.seed)
    answers, tokens_per_s = sample_candidates(cfg, inputs["model"], prompts, ctx.seed, ctx.device)
    rm_scores = reward_model_scores(inputs.get("reward_model"), prompts, [[a["text"] for a in g] for g in answers])
    env = environment_from_spec(cfg.environment, cfg.reward)
    samples = []
    for p_idx, (prompt, group) in enumerate(zip(prompts, answers, strict=True)):
        for i, a in enumerate(group):
            rm = rm_scores[p_idx][i] if rm_scores is not None else None
            v = (score(prompt, a["text"], cfg.reward, num_tokens=a["num_tokens"], rm_score=rm)
                 if cfg.environment.is_single_turn else env.score(prompt, a["text"], a["num_tokens"], rm))
            samples.append(sample_row(prompt, i, a["completion"], a["num_tokens"], a["finish_reason"], v, a["tool"]))
    kept = accept(samples, cfg)
    sft_rows = build_sft_rows(kept, cfg)

    metrics = acceptance_metrics(prompts, samples, kept)
    metrics["reformatted_rows"] = float(sum(json.loads(r["metadata"])["reformatted"] for r in sft_rows))
    metrics["tokens_per_s"] = tokens_per_s
    ctx.log_metrics(metrics)
    ctx.log.info("rejection sampling: %d/%d prompts accepted (%.1f%%), %d sft rows",
                 metrics["prompts_accepted"], len(prompts), 100 * metrics["acceptance_rate"], len(sft_rows))
    return {
        "samples": write_dataset(ctx, "samples", from_rows(samples, "samples"), "samples", metrics),
        "data": write_dataset(ctx, "data", from_rows(sft_rows, "sft"), "sft", metrics),
    }


def sample_row(prompt: dict, index: int, completion: str, num_tokens: int, finish_reason: str, v: Verdict,
               tool: dict | None = None) -> dict:
    """The `samples` row of one scored completion; what the schema has no column for goes to metadata (with a tool
    environment, `tool`: turns, tool_calls, tool_errors; single_turn rows have none, as before)."""
    meta = {"task": prompt["task"], "verifier": prompt["verifier"], "answer": prompt["answer"],
            "extracted": v.extracted, "format_ok": v.format_ok, "correct_lenient": v.correct_lenient, **(tool or {})}
    return {
        "prompt_id": prompt["id"], "messages": prompt["messages"], "completion": completion, "sample_index": index,
        "reward": v.reward, "reward_components": json.dumps(v.components, sort_keys=True),
        "correct": v.correct, "num_tokens": num_tokens, "finish_reason": finish_reason,
        "metadata": json.dumps(meta, sort_keys=True),
    }


def reformat_sample(sample: dict) -> str | None:
    """R1's cold-start rewrite of an accepted sample's completion (`reformat_r1`), or None where it
    stays as it is: already well formed, or no answer to put in the block.

    The answer is the one that was judged: metadata's `extracted`, else (accepted leniently) the
    lenient one, `extract_answer_lenient`.
    """
    meta = json.loads(sample["metadata"])
    if meta["format_ok"]:
        return None
    answer = meta["extracted"] if meta["extracted"] is not None else extract_answer_lenient(sample["completion"])
    if answer is None:
        return None
    try:
        return reformat_r1(sample["completion"], answer)
    except ValueError:  # an answer that is nothing but R1 tags
        return None


def build_sft_rows(kept: list[dict], cfg: RejectionSamplingConfig) -> list[dict]:
    """`sft` rows of the accepted samples, rewritten by `reformat_sample` when `cfg.reformat`."""
    rows = []
    for s in kept:
        rewritten = reformat_sample(s) if cfg.reformat else None
        content = s["completion"] if rewritten is None else rewritten
        rows.append({
            "id": f"{s['prompt_id']}-{s['sample_index']}",
            "messages": s["messages"] + [{"role": "assistant", "content": content}],
            "source": "rejection_sampling",
            "metadata": json.dumps({"prompt_id": s["prompt_id"], "sample_index": s["sample_index"],
                                    "reward": s["reward"], "reward_components": json.loads(s["reward_components"]),
                                    "task": json.loads(s["metadata"])["task"], "reformatted": rewritten is not None},
                                   sort_keys=True),
        })
    return rows


def reward_model_scores(rm: Input | None, prompts: list[dict], completions: list[list[str]]) -> list[list[float]] | None:
    """The optional reward model's score of every completion text (the `reward_model` reward component)."""
    if rm is None:
        return None
    from stages.modeling.heads import RewardScorer

    scorer = RewardScorer.from_input(rm)
    flat = scorer.score([p["messages"] for p, cs in zip(prompts, completions, strict=True) for _ in cs],
                        [c for cs in completions for c in cs])
    out, k = [], 0
    for cs in completions:
        out.append(flat[k : k + len(cs)])
        k += len(cs)
    return out


def acceptance_metrics(prompts: list[dict], samples: list[dict], kept: list[dict]) -> dict[str, float]:
    accepted_ids = {s["prompt_id"] for s in kept}
    rewards = [s["reward"] for s in samples if s["reward"] is not None]
    scored = [s["correct"] for s in samples if s["correct"] is not None]
    metrics: dict[str, float] = {
        "prompts": float(len(prompts)),
        "samples": float(len(samples)),
        "accepted_rows": float(len(kept)),
        "prompts_accepted": float(len(accepted_ids)),
        "acceptance_rate": len(accepted_ids) / len(prompts),
        "sample_accuracy": float(np.mean(scored)) if scored else 0.0,
        "sample_format_rate": float(np.mean([json.loads(s["metadata"])["format_ok"] for s in samples])),
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "mean_length": float(np.mean([s["num_tokens"] for s in samples])),
    }
    for task in sorted({p["task"] for p in prompts}):
        ids = {p["id"] for p in prompts if p["task"] == task}
        metrics[f"{task}/acceptance_rate"] = len(ids & accepted_ids) / len(ids)
    return metrics
