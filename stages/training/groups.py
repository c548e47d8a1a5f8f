"""A step's rollouts for the on-policy RL stages: G completions of each prompt (a group), sampled from the
current policy and scored, on every process its own share of the step's prompts.

`sample_groups` picks the step's prompts (`rollouts.pick_prompts`), samples with the step's seed
(`rollouts.rollout_seed`) and scores (`rollouts.score_completions`); with dynamic sampling (DAPO) it drops
the groups whose rewards are all equal and refills from this process's own stream. `gather_groups` collects
every process's rewards and the rollout metrics over every process's groups.

May import: `schemas`, `stages.rewards`, `stages.runtime`, `stages.sampling`, and the rest of `stages.training`;
never a stage module.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from stages.rewards.verifiers import Verdict
from stages.runtime import distributed
from stages.sampling.completions import Completion
from stages.training.env_rollouts import EnvironmentRollouts
from stages.training.rollouts import pick_prompts, rollout_metrics, rollout_seed, score_completions, text_free

if TYPE_CHECKING:
    from schemas.configs import RLConfig


@dataclasses.dataclass
class Groups:
    """One process's groups of a step (G completions of one prompt each; dynamic sampling kept only groups whose
    rewards differ), with how many groups were rolled out, how many were flat, and the times spent."""

    rows: list[dict] = dataclasses.field(default_factory=list)  # the prompts row of each group
    comps: list[list[Completion]] = dataclasses.field(default_factory=list)  # or Trajectory (an environment)
    verdicts: list[list[Verdict]] = dataclasses.field(default_factory=list)
    rewards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # (G,) each
    zero_std_groups: int = 0
    total_groups: int = 0
    seconds: float = 0.0  # sampling
    score_seconds: float = 0.0


def sample_groups(backend, rows: list[dict], cfg: RLConfig, seed: int, step: int, dist: distributed.Dist,
                  scorer=None, dynamic_sampling: bool = False, max_refill_rounds: int = 0,
                  logprobs: bool = False, env: EnvironmentRollouts | None = None) -> Groups:
    """Roll out and score this process's share of step `step`'s prompts (prompts_per_step / processes groups of
    cfg.group_size completions). `scorer` (a RewardScorer) supplies the reward_model component; `logprobs`: the
    sampler's log-probs come along in the completions. With `dynamic_sampling`, groups whose rewards are all equal
    are dropped and this process's share refilled from its own stream, up to `max_refill_rounds` times. `env`:
    multi-turn trajectories (`env_rollouts.EnvironmentRollouts`) instead of the backend's completions, scored by
    the environment."""
    g, share, n = Groups(), cfg.prompts_per_step // dist.world, cfg.group_size
    for attempt in range(1 + (max_refill_rounds if dynamic_sampling else 0)):
        if attempt == 0:  # the step's prompts, split among the processes in whole groups
            picked = [rows[i] for i in dist.shard(pick_prompts(len(rows), cfg.prompts_per_step, seed, step, 0))]
        else:  # a refill of this process's dropped groups, from its own stream
            picked = [rows[i] for i in pick_prompts(len(rows), share - len(g.rows), seed, step, attempt, dist.rank)]
        if env is None:
            comps, stats = backend.generate([r["messages"] for r in picked], cfg.generation, n=n,
                                            seed=rollout_seed(seed, step, attempt, dist.rank), progress=False,
                                            logprobs=logprobs)
        else:  # multi-turn trajectories (they carry the sampler's log-probs always)
            comps, stats = env.generate(picked, cfg.generation, n, rollout_seed(seed, step, attempt, dist.rank))
        t0 = time.perf_counter()
        flat_rows, flat = [r for r in picked for _ in range(n)], [c for cs in comps for c in cs]
        verdicts, rewards = (score_completions(flat_rows, flat, cfg.reward, scorer) if env is None
                             else env.score(flat_rows, flat, scorer))
        rewards = rewards.reshape(len(picked), n)  # (B, G)
        g.seconds, g.score_seconds = g.seconds + stats.seconds, g.score_seconds + time.perf_counter() - t0
        flat = (rewards.max(dim=1).values == rewards.min(dim=1).values).tolist()
        g.zero_std_groups += sum(flat)
        g.total_groups += len(flat)
        for i in range(len(picked)):
            if not (dynamic_sampling and flat[i]):
                g.rows.append(picked[i])
                g.comps.append(comps[i])
                g.verdicts.append(verdicts[i * n : (i + 1) * n])
                g.rewards.append(rewards[i])
        if len(g.rows) >= share or not dynamic_sampling:
            break
    return g


def gather_groups(g: Groups, dist: distributed.Dist, group_size: int) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Every process's rewards (B_rank, G), in rank order, and the rollout metrics over every process's groups
    (gathered text-free: the advantages and metrics need them, the update only this process's)."""
    local_rewards = torch.stack(g.rewards) if g.rewards else torch.zeros(0, group_size)  # (B_rank, G)
    zero_std_groups, total_groups, t_gen, t_score = g.zero_std_groups, g.total_groups, g.seconds, g.score_seconds
    if dist.active:
        gathered = dist.gather((g.verdicts, [text_free(cs) for cs in g.comps], local_rewards,
                                (zero_std_groups, total_groups, t_gen, t_score)))
        rewards_by_rank = [x[2] for x in gathered]
        all_verdicts, all_comps = [v for x in gathered for v in x[0]], [c for x in gathered for c in x[1]]
        all_rewards = [row for x in gathered for row in x[2]]
        zero_std_groups, total_groups = sum(x[3][0] for x in gathered), sum(x[3][1] for x in gathered)
        t_gen, t_score = max(x[3][2] for x in gathered), max(x[3][3] for x in gathered)
    else:
        rewards_by_rank, all_verdicts, all_comps, all_rewards = [local_rewards], g.verdicts, g.comps, g.rewards
    metrics = rollout_metrics(torch.stack(all_rewards) if all_rewards else torch.zeros(0, group_size),
                              [v for vs in all_verdicts for v in vs], [c for cs in all_comps for c in cs],
                              zero_std_groups / max(1, total_groups))
    metrics.update({"time/generation": t_gen, "time/scoring": t_score})
    return rewards_by_rank, metrics
