"""`single_turn`: one model turn, scored as the sampling stages score a completion today
(`verifiers.score(row, text, reward, num_tokens=...)`, as `training.rollouts.score_completions` calls it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.configs import RewardSpec
from stages.environments.base import Observation, Turn
from stages.rewards.verifiers import Verdict, score


class _OneTurn:
    def step(self, turn: Turn) -> Observation | None:
        return None


@dataclass(frozen=True)
class SingleTurn:
    """Every trajectory is the model's first turn."""

    reward: RewardSpec = field(default_factory=RewardSpec)
    name: str = "single_turn"
    stop: tuple[str, ...] = ()

    def start(self, row: Mapping[str, Any]) -> _OneTurn:
        return _OneTurn()

    def score(self, row: Mapping[str, Any], completion: str, num_tokens: int | None = None,
              rm_score: float | None = None) -> Verdict:
        return score(row, completion, self.reward, num_tokens=num_tokens, rm_score=rm_score)
