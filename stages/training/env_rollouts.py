"""Multi-turn rollouts for the on-policy RL stages (`grpo`, `ppo`) with an `environment:` other than single_turn.

With `single_turn` (the default) none of this runs: the stages sample through their backend as before
(`groups.sample_groups` with no environment), so their behaviour and cache keys are unchanged. Otherwise:
- `check_environment`: the environment is made at plan time (an unknown name, a missing or broken user file:
  one ConfigError) and the settings that cannot go with it are refused (prefix sharing's shared-prompt passes
  assume prompt + one completion; each stage names its own);
- `rl_environment_salt`: grpo's and ppo's cache salt, their environment's (`registry.environment_salt`);
- `EnvironmentRollouts`: G trajectories per prompt from the policy's own KV-cache decode loop
  (`sampling.multiturn.sample_trajectories`: the rollout GenerationSpec per turn, every turn counted against
  `max_total_tokens`), or from the colocated vLLM engine turn by turn (`VLLMBackend.trajectories`, the same
  trajectories' layout), scored by the environment (`Environment.score` on the model's own text);
- `trajectory_rows`: the trainer's rows are the sampler's token ids as they are (`trajectories.trajectory_batch`),
  the loss mask 1 on the model's sampled tokens only, so an observation token has no policy loss, KL or entropy
  term, and the sampler's log-probs in the same layout;
- `tool_metrics`: tool calls, tool error rate, turns and observation tokens per trajectory.

In the stages: grpo runs whole rows (no prefix sharing), its `aggregation: constant` divides by
`max_total_tokens` (the longest a trajectory can be) instead of max_new_tokens, and process supervision is
refused; ppo's GAE runs over the sampled tokens only (`math.masking.multiturn_gae`); both evaluate the
held-out prompts with the environment. Reward-model components score the prompt and the model's own text.

May import: `schemas`, `stages.environments`, `stages.sampling`, `stages.rewards`, and the rest of
`stages.training`; never a stage module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from schemas.configs import GenerationSpec
from schemas.errors import ConfigError
from stages.environments import registry
from stages.environments.base import Environment
from stages.environments.registry import environment_from_spec
from stages.rewards.verifiers import Verdict
from stages.sampling.multiturn import RolloutStats, Trajectory, sample_trajectories
from stages.training.trajectories import trajectory_batch

if TYPE_CHECKING:
    from schemas.configs import RLConfig


def total_token_budget(cfg: RLConfig) -> int:
    """Tokens after the prompt over all turns of a trajectory: environment.max_total_tokens, or max_turns x the
    per-turn max_new_tokens."""
    spec = cfg.environment
    return spec.max_total_tokens or spec.max_turns * cfg.generation.max_new_tokens


def check_environment(stage: str, cfg: RLConfig, refusals: Sequence[tuple[str, bool]] = ()) -> Environment | None:
    """The run's environment, made now so a bad name or file fails before any compute (None for single_turn); a
    ConfigError for each setting in `refusals` (what, on) that is on."""
    if cfg.environment.is_single_turn:
        return None
    env = environment_from_spec(cfg.environment, cfg.reward)
    name = cfg.environment.name
    for what, on in refusals:
        if on:
            raise ConfigError(f"{stage}.environment: {name!r} does not go with {what}; use environment "
                              f"single_turn or turn that setting off")
    return env


def rl_environment_salt(cfg: RLConfig) -> str:
    """grpo's and ppo's cache salt: `registry.environment_salt` of their environment."""
    return registry.environment_salt(cfg.environment)


@dataclasses.dataclass
class EnvironmentRollouts:
    """Trajectories of `model` (the policy's whole weights) with `env`, each at most `max_total_tokens` after
    its prompt, decoded in `autocast_dtype` (None: as the caller's autocast state is); or, with `engine` (a
    colocated `VLLMBackend` holding the policy's weights), sampled by vLLM turn by turn (`VLLMBackend.trajectories`)."""

    env: Environment
    model: torch.nn.Module | None
    tokenizer: object
    max_total_tokens: int
    autocast_dtype: torch.dtype | None = None
    engine: object | None = None

    def generate(self, rows: list[dict], spec: GenerationSpec, n: int, seed: int
                 ) -> tuple[list[list[Trajectory]], RolloutStats]:
        """n trajectories of each row (in order), `spec` the per-turn GenerationSpec, `seed` the rollout's."""
        if self.engine is not None:
            return self.engine.trajectories(rows, self.env, spec, n=n, seed=seed, max_total_tokens=self.max_total_tokens)
        return sample_trajectories(self.model, self.tokenizer, rows, self.env, spec, n=n, seed=seed,
                                   max_total_tokens=self.max_total_tokens, autocast_dtype=self.autocast_dtype)

    def score(self, rows: list[dict], trajs: list[Trajectory], scorer=None) -> tuple[list[Verdict], torch.Tensor]:
        """Each trajectory's verdict (`env.score` on the model's own text, rows[i] for trajs[i]) and its reward (N,);
        unscorable: 0, as `rollouts.score_completions`. `scorer` (a RewardScorer) supplies the reward_model
        component from the prompt and the model's text (the observations left out, as the verifier judges)."""
        rm = scorer.score([r["messages"] for r in rows], [t.text for t in trajs]) if scorer is not None else None
        verdicts = [self.env.score(r, t.text, t.num_tokens, rm[i] if rm else None)
                    for i, (r, t) in enumerate(zip(rows, trajs, strict=True))]
        return verdicts, torch.tensor([v.reward if v.reward is not None else 0.0 for v in verdicts])

    def held_out_eval(self, rows: list[dict], generation: GenerationSpec, seed: int) -> dict[str, float]:
        """Greedy accuracy and format rate on held-out prompts with the environment (its tools), scored by it as
        in training but correctness as the eval stage reads it; and the tool metrics of those trajectories."""
        spec = GenerationSpec(max_new_tokens=generation.max_new_tokens, temperature=0.0, prefill=generation.prefill,
                              batch_size=generation.batch_size)
        trajs = [ts[0] for ts in self.generate(rows, spec, 1, seed)[0]]
        verdicts = [self.env.score(r, t.text, t.num_tokens) for r, t in zip(rows, trajs, strict=True)]
        scored = [v.correct for v in verdicts if v.correct is not None]
        return {"eval/accuracy": float(np.mean(scored)) if scored else 0.0,
                "eval/format_rate": float(np.mean([v.format_ok for v in verdicts])),
                **{k.replace("rollout/", "eval/"): v for k, v in tool_metrics(trajs).items()}}


def open_environment(stage: str, cfg: RLConfig, backend, autocast_dtype: torch.dtype | None
                     ) -> EnvironmentRollouts | None:
    """The run's multi-turn rollouts from the stage's `backend`: r1flow's decode loop on a TransformersBackend's
    model, or the vLLM engine itself (`generation.backend: vllm`); None for single_turn (the backend samples)."""
    env = check_environment(stage, cfg)
    if env is None:
        return None
    if cfg.generation.backend == "vllm":
        return EnvironmentRollouts(env, None, backend.tokenizer, total_token_budget(cfg), engine=backend)
    return EnvironmentRollouts(env, backend.model, backend.tokenizer, total_token_budget(cfg), autocast_dtype)


def group_rows(comps: list[list[Trajectory]], pad_id: int, mask_truncated: bool = False
               ) -> tuple[dict[str, torch.Tensor], list[list[int]], list[list[int]]]:
    """`trajectory_rows` of groups of trajectories (flattened in order), each group's prompt ids (its first
    trajectory's: every trajectory of a group starts with the same prompt) and each trajectory's ids after it."""
    flat = [t for ts in comps for t in ts]
    return (trajectory_rows(flat, pad_id, mask_truncated), [list(ts[0].token_ids[: ts[0].prompt_length]) for ts in comps],
            [list(t.token_ids[t.prompt_length :]) for t in flat])


def trajectory_rows(trajs: list[Trajectory], pad_id: int, mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """The trainer's rows of a step's trajectories: input_ids, attention_mask (N, L), loss_mask (N, L-1) on the
    positions that predict a sampled token, sampler_logprobs (N, L-1). `mask_truncated`: a trajectory cut by its
    token budget (finish_reason "length") gets an all-zero loss mask."""
    batch = trajectory_batch(trajs, pad_id)
    if mask_truncated:
        keep = torch.tensor([t.finish_reason != "length" for t in trajs], dtype=batch["loss_mask"].dtype)
        batch["loss_mask"] = batch["loss_mask"] * keep[:, None]
    return batch


def tool_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per trajectory means of tool calls, turns and observation tokens (appended tokens the model did not
    sample), and the share of tool calls that failed (0 without calls)."""
    if not trajs:
        return {}
    calls = sum(t.tool_calls for t in trajs)
    return {"rollout/tool_calls": calls / len(trajs),
            "rollout/tool_error_rate": sum(t.tool_errors for t in trajs) / calls if calls else 0.0,
            "rollout/turns": float(np.mean([t.turns for t in trajs])),
            "rollout/observation_tokens": float(np.mean([t.num_tokens - t.sampled_tokens for t in trajs]))}
