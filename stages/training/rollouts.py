"""RL rollout helpers shared by the on-policy stages (`grpo`, `ppo`): what is the same in both, once.

- the data of a run: the prompts with an answer to reward and the held-out ones (`load_prompts`), the check that
  a reward model is wired where the config needs one (`require_reward_model`), the set-up before any model loads
  (`start_run`);
- a step's rollout: its prompts, a pure function of (seed, step, attempt, rank) so a resumed run draws the same
  (`pick_prompts`), its sampling seed (`rollout_seed`), the score of each completion (`score_completions`), the
  training tensors of prompt + completion rows (`build_batch`), completions without their text for gathering
  (`text_free`);
- metrics: the rollout's rewards, accuracy, components and lengths (`rollout_metrics`), mini-batch statistics
  summed over every process (`stat_totals`), how far the sampler's log-probs are from the trainer's
  (`drift_metrics`).

The groups of a step are `stages.training.groups`; the step loop and the end of a run `stages.training.rl_loop`.

May import: `schemas`, `stages.base`, `stages.modeling`, `stages.sampling`, `stages.rewards`, `stages.runtime`,
`stages.math`, and the rest of `stages.training`; never a stage module.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from schemas.configs import RewardSpec
from schemas.errors import ConfigError, SchemaError
from stages.base import Input, StageContext, seed_everything
from stages.math import rl
from stages.modeling import logprobs
from stages.rewards.verifiers import Verdict, score
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.completions import Completion
from stages.sampling.multiturn import Trajectory
from stages.sampling.vllm_backend import check_vllm_model
from stages.training.env_rollouts import tool_metrics

if TYPE_CHECKING:
    from schemas.configs import RLConfig


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
        check_vllm_model(inputs["model"])
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


def score_completions(rows: list[dict], comps: list[Completion], reward: RewardSpec, scorer=None
                      ) -> tuple[list[Verdict], torch.Tensor]:
    """Each completion's verdict against its prompts row (rows[i] for comps[i]) and its reward (N,); one that cannot
    be scored gets reward 0 (`rollout_metrics` counts it in reward/unscored). `scorer` (a RewardScorer) supplies
    the reward_model component, all completions in one call."""
    rm = scorer.score([r["messages"] for r in rows], [c.text for c in comps]) if scorer is not None else None
    verdicts = [score(r, c.text, reward, num_tokens=c.num_tokens, rm_score=rm[i] if rm else None)
                for i, (r, c) in enumerate(zip(rows, comps, strict=True))]
    return verdicts, torch.tensor([v.reward if v.reward is not None else 0.0 for v in verdicts])


def text_free(comps: list[Completion]) -> list[Completion]:
    """The completions without text, tokens or log-probs: what metrics need, cheap to gather across processes.
    A multi-turn `Trajectory` keeps its token ids and model mask (its lengths and observation tokens)."""
    return [dataclasses.replace(c, text="", transcript="", logprobs=()) if isinstance(c, Trajectory)
            else dataclasses.replace(c, text="", token_ids=(), logprobs=None) for c in comps]


# ---------------------------------------------------------------------------- metrics


def rollout_metrics(rewards: torch.Tensor, verdicts: list[Verdict], comps: list[Completion],
                    zero_std_frac: float | None = None) -> dict[str, float]:
    """Reward mean and spread, unscored count, accuracy, format, components and lengths (of a multi-turn trajectory:
    every token after the prompt; and `env_rollouts.tool_metrics`) of a step's rollouts
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
    if comps and isinstance(comps[0], Trajectory):  # multi-turn: tool calls, errors, turns, observation tokens
        m.update(tool_metrics(comps))
    return m


def stat_sum(values: list) -> float:
    """The sum, in float64, of a step's mini-batch statistics: Python floats and 0-d tensors left on their device
    until now (one host sync per statistic and step instead of one per mini-batch)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    floats = [v for v in values if not isinstance(v, torch.Tensor)]
    total = float(np.sum(floats)) if floats else 0.0
    return total + (float(torch.stack([t.double() for t in tensors]).sum()) if tensors else 0.0)


def stat_totals(stats: dict[str, list], dist: distributed.Dist) -> dict[str, tuple[float, int]]:
    """Per key (sum, count) of a step's mini-batch statistics over every process."""
    keys = sorted(stats)
    flat = dist.sum([x for k in keys for x in (stat_sum(stats[k]), len(stats[k]))])
    return {k: (flat[2 * i], int(flat[2 * i + 1])) for i, k in enumerate(keys)}


DRIFT_THRESHOLD = 0.1  # nats: `sampler/logprob_delta_share_above_0.1`, the share of tokens further apart than this


def drift_metrics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                  dist: distributed.Dist) -> dict[str, float]:
    """`rl.logprob_drift` over every process's trained tokens, as `sampler/logprob_delta_{mean,p99,max}` and
    `sampler/logprob_delta_share_above_0.1`. trainer_logp, sampler_logp, mask: this process's (N, T); every process
    calls it (a gather), one without rows with empty tensors."""
    m = mask.bool()
    parts = dist.gather((trainer_logp.detach().cpu()[m.cpu()], sampler_logp.detach().cpu()[m.cpu()]))
    trainer, sampler = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    d = rl.logprob_drift(trainer, sampler, torch.ones_like(trainer, dtype=torch.bool), DRIFT_THRESHOLD)
    return {"sampler/logprob_delta_mean": float(d["mean"]), "sampler/logprob_delta_p99": float(d["p99"]),
            "sampler/logprob_delta_max": float(d["max"]),
            f"sampler/logprob_delta_share_above_{DRIFT_THRESHOLD:g}": float(d["share_above"])}
