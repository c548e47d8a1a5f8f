"""grpo and ppo with an environment (issue 46): multi-turn trajectories through the shared RL skeleton.

Hand-worked: a two-turn group's loss mask, advantages and KL cover exactly the model's sampled tokens, and the
loss is blind to what sits at an observation's positions. On the tiny model: 2-step runs with the python
environment and with a user environment file that calls a tool every turn; the plan-time checks; single_turn's
cache keys as before."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from schemas.configs import EnvironmentSpec, GenerationSpec, GRPOConfig, LoraSpec, PPOConfig, RewardSpec
from schemas.errors import ConfigError
from stages import grpo, ppo
from stages.base import LocalContext
from stages.math import masking, rl
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


def _trajectory(ids, mask, lps, prompt_length, turns, calls=0) -> Trajectory:
    return Trajectory(tuple(ids), tuple(mask), tuple(lps), prompt_length, "", "", turns, calls, 0, "stop")


def _two_turn_group() -> list[list[Trajectory]]:
    """One prompt [1, 2], two trajectories finishing at different turns: turn [3, 4], observation [5, 6], turn [7];
    and a single turn [8, 9]."""
    return [[_trajectory([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 0, 1], [0, 0, -0.5, -0.6, 0, 0, -0.7], 2, 2, 1),
             _trajectory([1, 2, 8, 9], [0, 0, 1, 1], [0, 0, -0.2, -0.3], 2, 1)]]


def test_a_two_turn_group_by_hand():
    """Rows [1 2 3 4 5 6 7] and [1 2 8 9 p p p]; position t predicts token t+1, so the loss mask is 1 where the
    next token was sampled: [0 1 1 0 0 1] (3, 4 and 7) and [0 1 1 0 0 0] (8, 9). Rewards (1, 0): group mean 0.5,
    population std 0.5, advantages (+1, -1), spread over exactly those positions. A reference 0.1 below the
    policy on sampled positions and 5 below elsewhere: k3 = e^-0.1 + 0.1 - 1 = 0.0048374 per sampled token,
    whatever the observation positions hold."""
    batch, prompts, completions = env_rollouts.group_rows(_two_turn_group(), pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 8, 9, 0, 0, 0]]
    mask = batch["loss_mask"]
    assert mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]
    torch.testing.assert_close(batch["sampler_logprobs"], torch.tensor([[0, -0.5, -0.6, 0, 0, -0.7],
                                                                        [0, -0.2, -0.3, 0, 0, 0]]))
    assert prompts == [[1, 2]] and completions == [[3, 4, 5, 6, 7], [8, 9]]
    cut = [[dataclasses.replace(t, finish_reason="length") if i == 0 else t for i, t in enumerate(_two_turn_group()[0])]]
    assert env_rollouts.group_rows(cut, 0, mask_truncated=True)[0]["loss_mask"].tolist() == [[0] * 6, [0, 1, 1, 0, 0, 0]]
    adv = rl.group_advantages(torch.tensor([[1.0, 0.0]])).reshape(-1)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]), atol=1e-3, rtol=0)
    torch.testing.assert_close(masking.token_weights(adv, mask),
                               adv[:, None] * torch.tensor([[0.0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]))
    logp = torch.full_like(mask, -1.0)
    ref = torch.where(mask.bool(), logp - 0.1, logp - 5.0)
    kl = rl.KL_ESTIMATORS["k3"](logp, ref) * mask
    assert float(kl.sum() / mask.sum()) == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-5)
    assert float(rl.aggregate(kl, mask, "token_mean")) == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-5)


def test_multiturn_gae_by_hand():
    """Sampled positions 0, 1 and 4 (an observation at 2-3), gamma = lam = 1, rewards (0, 0, 1) there, values
    (0.2, 0.4, 0.6): A_4 = 1 - 0.6 = 0.4; A_1 = 0 + V_4 - V_1 + A_4 = 0.6 (the next state is after the
    observation, not the end); A_0 = 0.4 - 0.2 + 0.6 = 0.8; returns A + V = 1 at each. rl.gae alone would end the
    episode at the hole (A_1 = -0.4). With a contiguous mask both are the same."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 9, 9, 1]])
    values = torch.tensor([[0.2, 0.4, 9, 9, 0.6]])
    adv, returns = masking.multiturn_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.6, 0, 0, 0.4]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1, 0, 0, 1]]))
    assert float(rl.gae(rewards, values, mask, 1.0, 1.0)[0][0, 1]) == pytest.approx(-0.4)
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    contiguous = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    for a, b in zip(masking.multiturn_gae(r, v, contiguous, 0.9, 0.8), rl.gae(r, v, contiguous, 0.9, 0.8), strict=True):
        torch.testing.assert_close(a, b)


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
    assert steps[-1]["eval/tool_calls"] > 0 and "eval/accuracy" in steps[-1]  # the held-out eval uses the tool too
    print({k: v for k, v in steps[-1].items() if k.startswith(("rollout/", "time/", "eval/"))})


SCORES_WITH_THE_STAGES_REWARD = '''
from schemas.configs import RewardSpec
from stages.rewards.verifiers import score


class _OneTurn:
    def step(self, turn):
        return None


class Mine:
    name, stop = "mine", ()

    def __init__(self, reward):
        self.reward = reward

    def start(self, row):
        return _OneTurn()

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return score(row, completion, self.reward, num_tokens=num_tokens, rm_score=rm_score)


def environment(reward=None, **options):  # None: made by hand, outside a stage
    return Mine(reward or RewardSpec())
'''


def test_a_user_environment_scores_grpo_with_the_stages_reward(tmp_path, tiny_model_input, digit_prompts):
    """Issue 59 item 5: grpo with `environment: {name: mine.py}` and `reward: {weights: {overlong: 1.0}, ...}`: the
    file's environment() is given that reward and scores with it, so every step's reward is the overlong penalty the
    config asks for (completions of 2-4 tokens past 6 - 5 = 1 are penalised), not accuracy + 0.2 format (the
    defaults). Before, the file was given `options` only and scored, silently, with the default weights."""
    path = tmp_path / "mine.py"
    path.write_text(SCORES_WITH_THE_STAGES_REWARD)
    cfg = _cfg(environment=EnvironmentSpec(name=str(path), max_turns=1))
    grpo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["reward/mean"] == pytest.approx(m["reward/overlong"]) and m["reward/unscored"] == 0
    assert min(m["reward/overlong"] for m in steps) < 0


def test_r1flow_run_refuses_a_user_environment_that_cannot_take_the_reward(tmp_path, monkeypatch, capsys):
    """The same file without a `reward` parameter, named in r1-zero's grpo node from the command line: one error line
    naming the file and the hook, before anything is computed or written."""
    from flows.cli.app import main

    path = tmp_path / "mine.py"
    path.write_text(SCORES_WITH_THE_STAGES_REWARD.replace(
        "def environment(reward=None, **options):  # None: made by hand, outside a stage\n    return Mine(reward or RewardSpec())",
        "def environment(weight=1.0):\n    return Mine(RewardSpec())"))
    assert "def environment(weight=1.0)" in path.read_text()
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "untouched"))
    assert main(["run", "--recipe", "r1-zero", "--profile", "tiny", "--set", f"grpo.environment.name={path}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"r1flow: error: environment file {path}: environment() takes no "
                                               f"`reward`"), err
    assert not (tmp_path / "untouched").exists()


def test_the_grpo_update_is_blind_to_observation_positions(tmp_path, tiny_model_input, digit_prompts, tool_file):
    """grpo's own advantages and mini-batch backward on the hand-made two-turn group (beta > 0, old_logprobs:
    sampler): d loss / d logp is 0 at every prompt, observation and padding position and not 0 at a sampled one;
    noise added there to the policy's log-probs, entropies, the reference's and the sampler's log-probs changes
    neither the loss, the KL, the entropy term nor any parameter's gradient."""
    cfg = _cfg(environment=EnvironmentSpec(name=tool_file), beta=0.1, old_logprobs="sampler")
    s, _ = grpo.open_session(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, LocalContext(tmp_path / "r"))
    g = groups.Groups(rows=[s.rows[0]], comps=_two_turn_group(), rewards=[torch.tensor([1.0, 0.0])])
    u = grpo.advantages(s, g, [torch.tensor([[1.0, 0.0]])], {"time/scoring": 0.0})
    mask = u.batch["loss_mask"]
    assert not u.shared and mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]
    torch.testing.assert_close(u.sampler_logp[0, 5], torch.tensor(-0.7))
    off = (1 - mask)
    noise = 3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    exact = u.rollout_batch.logprobs
    ref_logp, sampler_logp = u.ref_logp.clone(), u.sampler_logp.clone()

    def backward(perturb: bool):
        seen = {}

        def logprobs(net, idx, with_entropy=False):
            lp, ent = exact(net, idx, with_entropy)
            if perturb:
                lp, ent = lp + noise[idx] * off[idx], ent + noise[idx].abs() * off[idx]
            lp.retain_grad()
            seen["lp"], seen["idx"] = lp, idx
            return lp, ent

        u.rollout_batch.logprobs = logprobs
        u.ref_logp = ref_logp + noise * off * perturb
        u.sampler_logp = sampler_logp - noise * off * perturb
        s.model.zero_grad(set_to_none=True)
        stats = {k: [] for k in grpo.TRAIN_STATS}
        grpo.minibatch_backward(s, u, torch.arange(2), 0, 2.0, float(mask.sum()), stats)
        return stats, [p.grad.clone() for p in s.trainable], seen

    stats, grads, seen = backward(False)
    grad = seen["lp"].grad.cpu()
    rows_mask = mask[seen["idx"]]
    assert (grad[rows_mask == 0] == 0).all() and (grad[rows_mask == 1] != 0).all()
    stats2, grads2, _ = backward(True)
    for k in ("loss", "kl", "entropy"):
        assert [float(v) for v in stats[k]] == pytest.approx([float(v) for v in stats2[k]], rel=1e-6, abs=1e-9), k
    for a, b in zip(grads, grads2, strict=True):
        torch.testing.assert_close(a, b)


def test_grpo_runs_with_the_python_environment(tmp_path, tiny_model_input, digit_prompts, tiny_tokenizer):
    """The built-in python environment on the tiny model (which writes no code), with LoRA (the reference: the
    adapter disabled), the sampler's log-probs and a reward-model component scored on the model's text: it runs
    and logs the tool metrics."""
    from tests.test_grpo import _tiny_reward_model

    cfg = _cfg(environment=EnvironmentSpec(name="python", max_turns=2), old_logprobs="sampler", beta=0.1,
               lora=LoraSpec(r=4, alpha=8),
               reward=RewardSpec(weights={"overlong": 1.0, "reward_model": 0.1}, overlong_max_tokens=6,
                                 overlong_buffer=5))
    grpo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts,
                   "reward_model": _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert {"rollout/tool_calls", "rollout/tool_error_rate", "rollout/turns", "rollout/observation_tokens",
                "sampler/logprob_delta_mean", "train/kl", "reward/reward_model"} <= set(m)
        assert m["rollout/turns"] >= 1


def test_ppo_runs_two_steps_with_a_tool_every_turn(tmp_path, tiny_model_input, digit_prompts, tool_file):
    cfg = _cfg(PPOConfig, environment=EnvironmentSpec(name=tool_file, max_turns=3, max_total_tokens=40), beta=0.05,
               minibatch_size=4)
    ppo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    ppo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    steps = [m for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/turns"] > 1 and m["rollout/tool_calls"] > 0 and m["rollout/observation_tokens"] > 0
        assert math.isfinite(m["train/value_loss"]) and math.isfinite(m["train/policy_loss"])


@pytest.mark.parametrize("stage, cls", [(grpo, GRPOConfig), (ppo, PPOConfig)])
def test_check_refuses_before_compute(tmp_path, stage, cls):
    broken = tmp_path / "broken.py"
    broken.write_text("def environment(:\n")
    cases = [(EnvironmentSpec(name="nope"), {}, "unknown environment 'nope'"),
             (EnvironmentSpec(name=str(tmp_path / "missing.py")), {}, "no such file"),
             (EnvironmentSpec(name=str(broken)), {}, "SyntaxError"),
             (EnvironmentSpec(name="python", timeout_s=1, options={"max_turns": 0}), {}, "multiple values|max_turns")]
    if stage is grpo:
        cases.append((EnvironmentSpec(name="python"), {"process_coef": 0.5}, "process_coef"))
    for spec, kw, message in cases:
        with pytest.raises(ConfigError, match=message):
            stage.check(_cfg(cls, environment=spec, **kw))
    stage.check(_cfg(cls))  # single_turn
    # vLLM samples multi-turn too (tests/test_vllm_cpu.py, against a real engine)
    stage.check(_cfg(cls, environment=EnvironmentSpec(name="python"),
                     generation=GenerationSpec(backend="vllm", temperature=1.0)))


def test_cache_salt_is_a_user_files_digest_a_built_ins_version_and_empty_for_single_turn(tool_file):
    cfg = _cfg(environment=EnvironmentSpec(name=tool_file))
    salt = grpo.cache_salt(cfg)
    assert len(salt) == 64 and ppo.cache_salt(_cfg(PPOConfig, environment=EnvironmentSpec(name=tool_file))) == salt
    with open(tool_file, "a") as f:
        f.write("\n# edited\n")
    assert grpo.cache_salt(cfg) != salt
    assert grpo.cache_salt(_cfg(environment=EnvironmentSpec(name="python"))) == "python@2"  # BUILTIN_VERSIONS
    assert grpo.cache_salt(_cfg()) == "" and ppo.cache_salt(_cfg(PPOConfig)) == ""


def test_single_turn_keys_are_unchanged():
    """Every grpo and ppo node of every recipe and profile: no environment in its config dump and an empty salt,
    so its key is cache_key(stage, VERSION, config, inputs, seed, "") as it was before stages had a cache_salt."""
    from collections import defaultdict

    from flows.plan.recipes import PROFILE_DIR, RECIPE_DIR, available, load_plan
    from flows.run import pipeline
    from flows.store.cache import cache_key
    from stages import get_stage, stage_version

    upstream = defaultdict(lambda: defaultdict(lambda: "f" * 64))
    seen = 0
    for recipe in available(RECIPE_DIR):
        for profile in available(PROFILE_DIR):
            for node in load_plan(recipe, profile).nodes:
                if node.stage not in ("grpo", "ppo") or not node.config.environment.is_single_turn:
                    continue  # (r1-tools' grpo_tools names the python environment: its key has it)
                seen += 1
                key, inputs, salt = pipeline.node_key(node, upstream)
                assert salt == "" and "environment" not in node.config_dict, (recipe, profile, node.name)
                assert key == cache_key(node.stage, stage_version(get_stage(node.stage)), node.config_dict, inputs,
                                        node.seed, "")
    assert seen
