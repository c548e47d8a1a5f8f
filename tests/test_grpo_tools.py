"""grpo and ppo with an environment (issue 46): multi-turn trajectories through the shared RL skeleton.

Hand-worked: a two-turn group's loss mask, advantages and KL cover exactly the model's sampled tokens, and the
loss is blind to what sits at an observation's positions. On the tiny model: 2-step runs with the python
environment and with a user environment file that calls a tool every turn; the plan-time checks; single_turn's
cache keys as before."""

from __future__ import annotations

import textwrap

import pytest
import torch

from schemas.configs import EnvironmentSpec, GenerationSpec, GRPOConfig, LoraSpec, PPOConfig, RewardSpec
from schemas.errors import ConfigError
from stages import grpo, ppo
from stages.base import LocalContext
from stages.math import rl
from stages.sampling.multiturn import Trajectory
from stages.training import env_rollouts, groups

TOOL_EVERY_TURN = '''
from stages.environments.base import Observation
from stages.environments.python_tool import PythonTool


class _Episode:
    def __init__(self, env):
        self.inner = env.start({})

    def step(self, turn):
        from stages.environments.base import Turn
        return self.inner.step(Turn("<python>print(6 * 7)</python>", turn.token_ids, "stop", turn.index))


class ToolEveryTurn:
    """The python environment with the tiny model's every turn read as a call of print(6 * 7)."""

    name, stop = "tool_every_turn", ()

    def __init__(self, **options):
        self.env = PythonTool(**options)

    def start(self, row):
        return _Episode(self.env)

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return self.env.score(row, completion, num_tokens, rm_score)


def environment(**options):
    return ToolEveryTurn(**options)
'''


def _cfg(cls=GRPOConfig, **kw):
    base = dict(steps=2, prompts_per_step=2, group_size=2, learning_rate=1e-3, lora=LoraSpec(r=0),
                generation=GenerationSpec(max_new_tokens=4, temperature=1.0, batch_size=4),
                reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=6, overlong_buffer=5),
                minibatch_size=4, checkpoint_every=100)
    base.update(kw)
    return cls(**base)


@pytest.fixture()
def tool_file(tmp_path):
    path = tmp_path / "tool_every_turn.py"
    path.write_text(TOOL_EVERY_TURN)
    return str(path)


def test_grpo_runs_two_steps_with_a_tool_every_turn(tmp_path, tiny_model_input, digit_prompts, tool_file):
    cfg = _cfg(environment=EnvironmentSpec(name=tool_file, max_turns=3, max_total_tokens=40), beta=0.1,
               eval_every=2, eval_prompts=2)
    grpo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/turns"] > 1 and m["rollout/tool_calls"] > 0 and m["rollout/observation_tokens"] > 0
        assert m["rollout/tool_error_rate"] == 0.0 and "train/kl" in m
    print({k: v for k, v in steps[-1].items() if k.startswith(("rollout/", "time/", "eval/"))})
