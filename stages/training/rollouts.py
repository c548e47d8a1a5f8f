"""RL rollout helpers shared by the on-policy stages (`grpo`, `ppo`): what is the same in both, once.

- the data of a run: the prompts with an answer to reward and the held-out ones (`load_prompts`), the check that
  a reward model is wired where the config needs one (`require_reward_model`);
- a step's rollout: its prompts, a pure function of (seed, step[, attempt, rank]) so a resumed run draws the same
  (`pick_prompts`), its sampling seed (`rollout_seed`), the training tensors of prompt + completion rows
  (`build_batch`), completions without their text for gathering (`text_free`);
- metrics: the rollout's rewards, accuracy, components and lengths (`rollout_metrics`), greedy accuracy on the
  held-out prompts (`held_out_eval`), first/last-tenth means of a run's curves (`summarize`);
- the step loop's bookkeeping (`StepLoop`: resumed history, progress bar, max_minutes budget, checkpoint / log /
  progress tail of a step) and the end-of-run save of the policy (`save_policy`).

May import: `schemas`, `stages.base`, `stages.modeling`, `stages.sampling`, `stages.rewards`, `stages.runtime`,
`stages.math`, and the rest of `stages.training`; never a stage module.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas.configs import GenerationSpec
from schemas.errors import ConfigError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.modeling import logprobs, models
from stages.rewards.verifiers import Verdict, score
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.generation import Completion, check_vllm_model_dir
from stages.training.checkpoints import save_checkpoint

if TYPE_CHECKING:
    from schemas.configs import GRPOConfig, PPOConfig

    RLConfig = GRPOConfig | PPOConfig


# ---------------------------------------------------------------------------- data


def load_prompts(cfg: RLConfig, inputs: dict[str, Input]) -> tuple[list[dict], list[dict]]:
    """(training rows with an answer to reward, held-out rows), checked before any model loads."""
    table = inputs["prompts"].table("prompts").to_pylist()
    rows = [r for r in table if r["split"] == cfg.split and r["answer"] is not None]
    if not rows:
        raise SchemaError(f"{inputs['prompts'].label}: no split={cfg.split!r} prompts with an answer to reward")
    return rows, [r for r in table if r["split"] == "eval"][: cfg.eval_prompts]


def require_reward_model(stage: str, inputs: dict[str, Input], reasons: tuple[tuple[str, bool], ...]) -> list[str]:
    """The config settings (name, on) that are on and need a reward model; raises if one is on and none is wired."""
    wants = [w for w, on in reasons if on]
    if wants and inputs.get("reward_model") is None:
        raise ConfigError(f"{stage}: {' and '.join(wants)} need a reward model; wire one to the node's "
                          f"`reward_model` input (inputs: {{reward_model: <node>.model}})")
    return wants


def start_run(stage: str, cfg: RLConfig, inputs: dict[str, Input], ctx: StageContext,
              rm_reasons: tuple[tuple[str, bool], ...]) -> tuple[list[dict], list[dict], list[str], distributed.Dist, bool]:
    """What a run checks and sets up before any model loads: (training rows, held-out rows, the settings that need
    a reward model (`require_reward_model`), the process group, whether a colocated vLLM engine samples); then
    seeds every RNG with the context's seed."""
    rows, held_out = load_prompts(cfg, inputs)
    wants_rm = require_reward_model(stage, inputs, rm_reasons)
    dist = distributed.of(ctx)
    engine = cfg.generation.backend == "vllm"
    if engine:
        check_vllm_model_dir(inputs["model"].model_dir, inputs["model"].label)
    seed_everything(ctx.seed)
    return rows, held_out, wants_rm, dist, engine


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---------------------------------------------------------------------------- a step's rollout


def pick_prompts(n_prompts: int, k: int, seed: int, step: int, attempt: int = 0, rank: int = 0) -> list[int]:
    """k prompt indices of a step: a pure function of (seed, step, attempt, rank), so a resumed run draws the same.
    grpo passes its rollout `attempt` (dynamic sampling's refills, each rank > 0 from its own stream)."""
    rng = np.random.default_rng(seed_stream(seed, "prompts", step, attempt, rank))
    return rng.choice(n_prompts, size=k, replace=n_prompts < k).tolist()


def rollout_seed(seed: int, step: int, attempt: int = 0, rank: int = 0) -> int:
    """Sampling seed of one process's rollout of a step's attempt."""
    return seed_stream(seed, "rollout", step, attempt, rank)


def build_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                keep: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows and a mask over the positions that predict completion tokens.

    Returns input_ids/attention_mask (N, L) and loss_mask (N, L-1): 1 at the positions that predict a completion
    token (position t predicts token t+1), the layout of `logprobs.bucketed_token_logprobs`. `keep[i] = False`
    (e.g. a truncated completion under mask_truncated) zeroes that row's loss mask.
    """
    ids, attn = logprobs.right_padded([p + c for p, c in zip(prompt_ids, completion_ids, strict=True)], pad_id)
    loss_mask = torch.zeros((ids.shape[0], ids.shape[1] - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if keep is None or keep[i]:
            loss_mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def text_free(comps: list[Completion]) -> list[Completion]:
    """The completions without text, tokens or log-probs: what metrics need, cheap to gather across processes."""
    return [dataclasses.replace(c, text="", token_ids=(), logprobs=None) for c in comps]


# ---------------------------------------------------------------------------- metrics


def rollout_metrics(rewards: torch.Tensor, verdicts: list[Verdict], comps: list[Completion],
                    zero_std_frac: float | None = None) -> dict[str, float]:
    """Reward mean and spread, unscored count, accuracy, format, components and lengths of a step's rollouts
    (every process's: the caller gathers them); `zero_std_frac`: the share of groups whose rewards are all equal."""
    m: dict[str, float] = {
        "reward/mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward/std": float(rewards.std(unbiased=False)) if rewards.numel() else 0.0,
    }
    if zero_std_frac is not None:
        m["reward/zero_std_groups"] = zero_std_frac
    m["reward/unscored"] = float(sum(v.reward is None for v in verdicts))
    if verdicts:
        scored = [v.correct for v in verdicts if v.correct is not None]
        m["reward/accuracy"] = float(np.mean(scored)) if scored else 0.0
        m["reward/format_rate"] = float(np.mean([v.format_ok for v in verdicts]))
        for name in sorted({k for v in verdicts for k in v.components}):
            m[f"reward/{name}"] = float(np.mean([v.components.get(name, 0.0) for v in verdicts]))
        lengths = [c.num_tokens for c in comps]
        m["completion/mean_length"] = float(np.mean(lengths))
        m["completion/max_length"] = float(np.max(lengths))
        m["completion/truncated_frac"] = float(np.mean([c.finish_reason == "length" for c in comps]))
    return m


def eval_due(cfg: RLConfig, held_out: list[dict], done: int) -> bool:
    """Whether the held-out prompts are evaluated after step `done` (every eval_every steps, if there are any)."""
    return bool(cfg.eval_every and held_out and done % cfg.eval_every == 0)


def held_out_eval(backend, rows: list[dict], generation: GenerationSpec, seed: int) -> dict[str, float]:
    """Greedy accuracy and format rate on held-out prompts, scored as the eval stage scores."""
    spec = GenerationSpec(max_new_tokens=generation.max_new_tokens, temperature=0.0, prefill=generation.prefill,
                          batch_size=generation.batch_size)
    comps, _ = backend.generate([r["messages"] for r in rows], spec, seed=seed, progress=False)
    verdicts = [score(r, cs[0].text) for r, cs in zip(rows, comps, strict=True)]
    scored = [v.correct for v in verdicts if v.correct is not None]
    return {"eval/accuracy": float(np.mean(scored)) if scored else 0.0,
            "eval/format_rate": float(np.mean([v.format_ok for v in verdicts]))}


def summarize(history: list[dict], curves: dict[str, str]) -> dict[str, float]:
    """First/last-tenth means of each curve (`curves`: summary name -> metric), so a run's progress is a few
    numbers in the summary table: `<name>_first`, `<name>_last`; and the last held-out eval, the time per step."""
    k = max(1, len(history) // 10)
    out = {"steps": float(len(history))}
    for name, key in curves.items():
        xs = [h[key] for h in history if key in h]
        out[f"{name}_first"], out[f"{name}_last"] = (float(np.mean(xs[:k])), float(np.mean(xs[-k:]))) if xs else (0.0, 0.0)
    evals = [h for h in history if "eval/accuracy" in h]
    if evals:
        out["eval_accuracy_last"] = evals[-1]["eval/accuracy"]
        out["eval_format_rate_last"] = evals[-1]["eval/format_rate"]
    out["time_per_step"] = float(np.mean([h.get("time/step", 0.0) for h in history])) if history else 0.0
    return out


# ---------------------------------------------------------------------------- the step loop and the end of a run


class StepLoop:
    """The bookkeeping around a run's steps: the resumed history (replayed into the metrics log), the progress
    bar, the max_minutes budget and the tail of each finished step (history, checkpoint, log, bar).
    `state`: what `checkpoints.resume` returned."""

    def __init__(self, stage: str, cfg: RLConfig, ctx: StageContext, dist: distributed.Dist, state: dict) -> None:
        self.stage, self.cfg, self.ctx, self.dist = stage, cfg, ctx, dist
        self.start: int = state["step"]
        self.history: list[dict] = state.get("history", [])
        for i, m in enumerate(self.history):
            ctx.log_metrics(m, step=i + 1)
        self.bar = tqdm(total=cfg.steps, initial=self.start, desc=stage, unit="step", disable=not dist.is_main)
        self.t_loop = time.perf_counter()

    def out_of_time(self, done: int) -> bool:
        """max_minutes: whether no further step may start; every process stops after the same step."""
        if not self.cfg.max_minutes or done >= self.cfg.steps:
            return False
        return self.dist.sum([float(time.perf_counter() - self.t_loop >= 60.0 * self.cfg.max_minutes)])[0] > 0

    def checkpoint(self, done: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   extra: dict | None = None) -> None:
        """Every process (gathered under fsdp): weights, optimizer, RNG, the step and the history so far."""
        save_checkpoint(self.ctx.checkpoint_dir, done, module, optimizer,
                        {"step": done, "history": self.history, **(extra or {})}, self.cfg.keep_checkpoints, self.dist)

    def finish_step(self, metrics: dict[str, float], done: int, out_of_time: bool, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, extra: dict | None = None, **postfix: str) -> bool:
        """History, checkpoint (every checkpoint_every steps, the last one, and the one that spends the budget),
        log, progress bar; whether the run stops here (the budget is spent)."""
        self.history.append(metrics)
        if done % self.cfg.checkpoint_every == 0 or done == self.cfg.steps or out_of_time:
            self.checkpoint(done, module, optimizer, extra)
        self.ctx.log_metrics(metrics, step=done)
        self.bar.set_postfix(**postfix)
        self.bar.update(1)
        if out_of_time:
            self.ctx.log.info(f"{self.stage}: the %.4g-minute budget is spent after step %d of %d; saving the model "
                              "as it is", self.cfg.max_minutes, done, self.cfg.steps)
        return out_of_time


def save_policy(ctx: StageContext, inputs: dict[str, Input], cfg: RLConfig, policy: torch.nn.Module, tokenizer,
                merged_input: bool, dist: distributed.Dist, summary: dict[str, float]) -> dict[str, Output]:
    """The trained policy as the stage's `model` output (rank 0 writes it): merged if asked or if the input was an
    adapter, else an adapter under LoRA (recording its base's fingerprint); the run's summary logged with it."""
    out, model_dir = model_output_dir(ctx, "model")
    merge = cfg.lora.merge or merged_input
    if dist.is_main:
        models.save_model(policy, tokenizer, model_dir, merge=merge)
    is_adapter = cfg.lora.r > 0 and not merge
    ctx.log_metrics(summary)
    extra = {"base_fingerprint": inputs["model"].fingerprint} if is_adapter else {}
    return {"model": Output("model", "adapter" if is_adapter else "model", out, metrics=summary, extra=extra)}
