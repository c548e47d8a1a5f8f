"""Asynchronous RL's math (stages/math/offpolicy.py) against hand-worked numbers, and its config block (`async`):
the truncated importance weight, the decoupled PPO loss and its gradients, K = 0 equal to today's loss bit for
bit, the diagnostics, the config's validation, plan-time refusals and cache keys."""

import math

import pytest
import torch
from pydantic import ValidationError
from torch.testing import assert_close

from flows.cli.app import main
from flows.plan.recipes import load_plan
from flows.store.cache import cache_key
from schemas.configs import ASYNC_POLICY_LOSSES, AsyncConfig, GRPOConfig, PPOConfig
from schemas.errors import ConfigError
from stages.math import offpolicy, rl
from stages.training import rl_loop

F64 = torch.float64
MASK = torch.tensor([[True, True, True], [True, True, False]])  # 2 x 3, the last token of row 1 is padding


def _log(values):
    """log of a nested list (0 stays -inf: padding's garbage, which must never reach an exp)."""
    return torch.tensor(values, dtype=F64).log()


# pi_prox / mu = (0.5, 1, 4), (1.5, 3, pad): with C = 2 the weights are (0.5, 1, 2), (1.5, 2, 0)
PROX = _log([[0.5, 0.5, 0.4], [0.3, 0.6, 0.9]])
BEHAVIOUR = _log([[1.0, 0.5, 0.1], [0.2, 0.2, 0.0]])


# ---------------------------------------------------------------------------- the weight


def test_weight_and_truncation_by_hand():
    """pi_prox / mu per token: row 0 .5/1 = 0.5, .5/.5 = 1, .4/.1 = 4; row 1 .3/.2 = 1.5, .6/.2 = 3, padding.
    C = 2 truncates 4 and 3 to 2: w = (0.5, 1, 2), (1.5, 2, 0); raw keeps (4, 3); padding is 0 in both
    (its behaviour log-prob is -inf: log 0)."""
    w, raw = offpolicy.importance_weights(PROX, BEHAVIOUR, MASK, cap=2.0)
    assert_close(w, torch.tensor([[0.5, 1.0, 2.0], [1.5, 2.0, 0.0]], dtype=F64))
    assert_close(raw, torch.tensor([[0.5, 1.0, 4.0], [1.5, 3.0, 0.0]], dtype=F64))
    assert torch.isfinite(w).all() and torch.isfinite(raw).all()
    with pytest.raises(ValueError, match="importance cap must be > 1"):
        offpolicy.importance_weights(PROX, BEHAVIOUR, MASK, cap=1.0)


def test_weight_is_exactly_one_when_behaviour_is_the_proximal_policy():
    """K = 0: mu = pi_prox, exp(0) = 1 exactly on every completion token, whatever the log-probs."""
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(4, 7, 11), -1)[..., 0]
    mask = torch.rand(4, 7) > 0.3
    w, raw = offpolicy.importance_weights(logp, logp.clone(), mask)
    assert torch.equal(w, mask.to(w.dtype)) and torch.equal(raw, mask.to(raw.dtype))


# ---------------------------------------------------------------------------- the loss


def test_decoupled_token_loss_for_a_2x3_example_by_hand():
    """ratio r = pi / pi_prox: (1.0, 1.5, 0.5), (1.1, 0.7, pad); A = +1 for row 0, -2 for row 1 (GRPO's per-
    sequence advantages); eps 0.2; w from `test_weight_and_truncation_by_hand`: (0.5, 1, 2), (1.5, 2, 0).
    PPO's -min(r A, clip(r, .8, 1.2) A):
      row 0: -min(1, 1) = -1;  -min(1.5, 1.2) = -1.2 (clipped high);  -min(.5, .8) = -0.5
      row 1: -min(-2.2, -2.2) = 2.2;  -min(-1.4, -1.6) = 1.6 (clipped low);  padding 0
    times w: (-0.5, -1.2, -1.0), (3.3, 3.2, 0).  seq_mean: (-2.7/3 + 6.5/2) / 2 = (-0.9 + 3.25) / 2 = 1.175.
    d loss_t / d logp_t = -w r A where the clip does not bind, 0 where it does:
      row 0: -.5*1*1 = -0.5, 0, -2*.5*1 = -1.0;  row 1: -1.5*1.1*(-2) = 3.3, 0, 0.
    Stats: weight mean 7/5 = 1.4, ESS 7^2 / (5 * 11.5) = 0.85217, truncated 2/5 (the raw 4 and 3)."""
    logp = (PROX + _log([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])).detach().requires_grad_()
    loss, stats = offpolicy.decoupled_policy_loss(logp, PROX, BEHAVIOUR, torch.tensor([1.0, -2.0], dtype=F64), MASK)
    assert_close(loss, torch.tensor([[-0.5, -1.2, -1.0], [3.3, 3.2, 0.0]], dtype=F64))
    assert_close(rl.aggregate(loss, MASK, "seq_mean"), torch.tensor(1.175, dtype=F64))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, torch.tensor([[-0.5, 0.0, -1.0], [3.3, 0.0, 0.0]], dtype=F64))
    assert_close(stats["clip_high"], torch.tensor(0.2, dtype=F64))  # 1 of 5 tokens each side
    assert_close(stats["clip_low"], torch.tensor(0.2, dtype=F64))
    assert_close(stats["is_weight_mean"], torch.tensor(1.4, dtype=F64))
    assert_close(stats["is_weight_ess"], torch.tensor(49 / 57.5, dtype=F64))
    assert_close(stats["is_truncated"], torch.tensor(0.4, dtype=F64))


def test_decoupled_cispo_loss_gradient_by_hand_with_per_token_advantages():
    """CISPO: d loss_t / d logp_t = -w_t * sg(min(r_t, 1 + eps_high)) * A_t (no lower bound by default); advantages
    per token (PPO's GAE), here (1, 1, 1), (0.5, -1, 9) (the 9 sits on padding and must count for nothing).
      row 0: r (1.0, 1.5, 0.5) → clip (1.0, 1.2, 0.5), w (0.5, 1, 2): -(0.5, 1.2, 1.0)
      row 1: r (1.1, 0.7) → clip (1.1, 0.7), w (1.5, 2), A (0.5, -1): -(0.825, -1.4) = (-0.825, 1.4), padding 0."""
    logp = (PROX + _log([[1.0, 1.5, 0.5], [1.1, 0.7, 1.0]])).detach().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [0.5, -1.0, 9.0]], dtype=F64)
    loss, _ = offpolicy.decoupled_policy_loss(logp, PROX, BEHAVIOUR, adv, MASK, kind="cispo")
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, torch.tensor([[-0.5, -1.2, -1.0], [-0.825, 1.4, 0.0]], dtype=F64))


def test_no_gradient_flows_through_the_weight():
    """The weight is data: the proximal and behaviour log-probs get no gradient, and the policy's gradient is the
    unweighted loss's scaled by w (here 0.5 and 2 on two tokens whose clip does not bind)."""
    prox = PROX.clone().requires_grad_()
    behaviour = BEHAVIOUR.clone().requires_grad_()
    logp = PROX.clone().requires_grad_()  # r = 1: no clip binds
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, _ = offpolicy.decoupled_policy_loss(logp, prox, behaviour, adv, MASK)
    loss.sum().backward()
    assert prox.grad is None and behaviour.grad is None
    plain, _ = rl.policy_loss(logp, PROX, adv, MASK)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    w, _ = offpolicy.importance_weights(PROX, BEHAVIOUR, MASK)
    assert_close(logp.grad, g_plain * w)


@pytest.mark.parametrize("kind", ASYNC_POLICY_LOSSES)
@pytest.mark.parametrize("eps_high", [0.2, 0.28])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k0_equals_todays_loss_bit_for_bit(kind, eps_high, per_token, dtype):
    """K = 0 (behaviour log-probs = proximal ones): loss, stats and gradient are `rl.policy_loss`'s exactly
    (torch.equal), for every composing kind, clip-higher, GRPO's (B,) and PPO's (B, T) advantages; padding holds
    -inf log-probs."""
    torch.manual_seed(7)
    mask = torch.rand(5, 9) > 0.25
    old = torch.log_softmax(torch.randn(5, 9, 13), -1)[..., 3].to(dtype)
    old = torch.where(mask, old, torch.full_like(old, -math.inf))
    new = torch.where(mask, old + 0.3 * torch.randn(5, 9).to(dtype), old)
    adv = torch.randn(5, 9) if per_token else torch.randn(5)
    outs = []
    for fn in (lambda lp: rl.policy_loss(lp, old, adv, mask, kind, eps_high=eps_high),
               lambda lp: offpolicy.decoupled_policy_loss(lp, old, old.clone(), adv, mask, kind, eps_high=eps_high)):
        lp = new.clone().requires_grad_()
        loss, stats = fn(lp)
        for agg in ("seq_mean", "token_mean"):
            rl.aggregate(loss, mask, agg).backward(retain_graph=True)
        outs.append((loss.detach(), stats, lp.grad))
    (loss0, stats0, grad0), (loss1, stats1, grad1) = outs
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert all(torch.equal(stats0[k], stats1[k]) for k in stats0)
    assert stats1["is_weight_mean"] == 1 and stats1["is_weight_ess"] == 1 and stats1["is_truncated"] == 0


def test_gspo_does_not_compose():
    with pytest.raises(ValueError, match="policy loss 'gspo' does not compose"):
        offpolicy.decoupled_policy_loss(PROX, PROX, BEHAVIOUR, torch.ones(2, dtype=F64), MASK, kind="gspo")


# ---------------------------------------------------------------------------- diagnostics


def test_diagnostics_by_hand_and_masked_tokens_ignored():
    """w = (1, 1, 1, 4) on 4 tokens, garbage (100, inf) on two masked ones:
    mean 7/4 = 1.75; ESS = 7^2 / (4 * (1 + 1 + 1 + 16)) = 49/76 = 0.64474; equal weights give 1; one token
    carrying all the weight (1e-30 elsewhere) gives 1/n. Truncated with C = 2: raw (1, 1, 1, 4, 100, inf) → 1
    of the 4 masked-in tokens = 0.25. No token: mean 0, ESS 0, truncated 0."""
    w = torch.tensor([[1.0, 1.0, 1.0], [4.0, 100.0, math.inf]], dtype=F64)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)  # 0/1 float masks work as bool ones do
    assert_close(offpolicy.weight_mean(w, m), torch.tensor(1.75, dtype=F64))
    assert_close(offpolicy.effective_sample_size(w, m), torch.tensor(49 / 76, dtype=F64))
    assert_close(offpolicy.truncated_share(w, m, cap=2.0), torch.tensor(0.25, dtype=F64))
    assert_close(offpolicy.effective_sample_size(torch.full((2, 3), 0.7, dtype=F64), torch.ones(2, 3)),
                 torch.tensor(1.0, dtype=F64))
    spike = torch.tensor([[5.0, 1e-30, 1e-30, 1e-30]], dtype=F64)
    assert_close(offpolicy.effective_sample_size(spike, torch.ones(1, 4)), torch.tensor(0.25, dtype=F64))
    none = torch.zeros(2, 3)
    stats = offpolicy.weight_stats(torch.ones(2, 3), torch.ones(2, 3), none, cap=2.0)
    assert {k: float(v) for k, v in stats.items()} == {"is_weight_mean": 0.0, "is_weight_ess": 0.0, "is_truncated": 0.0}


def test_staleness_histogram_by_hand():
    """Groups consumed 0, 1, 1, 2, 0, 1 versions late with K = 2: (2, 3, 1); an older group breaks the bound."""
    assert offpolicy.staleness_histogram([0, 1, 1, 2, 0, 1], max_staleness=2) == [2, 3, 1]
    assert offpolicy.staleness_histogram([0, 0], max_staleness=0) == [2]
    assert offpolicy.staleness_histogram([], max_staleness=1) == [0, 0]
    for bad in (3, -1):
        with pytest.raises(ValueError, match=f"staleness {bad} was consumed; the bound is 0..2"):
            offpolicy.staleness_histogram([0, bad], max_staleness=2)


# ---------------------------------------------------------------------------- the config block


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_async_block_defaults_validation_and_round_trip(cls):
    cfg = cls()
    assert cfg.async_ == AsyncConfig(max_staleness=0, rollout_workers=1, importance_cap=2.0, sync_timeout_s=300.0)
    for bad in ({"max_staleness": -1}, {"rollout_workers": 0}, {"importance_cap": 1.0}, {"sync_timeout_s": 0},
                {"max_stalenes": 1}):
        with pytest.raises(ValidationError, match=f"async.{next(iter(bad))}"):
            cls.model_validate({"async": bad})
    given = cls.model_validate({"async": {"max_staleness": 2, "rollout_workers": 3}})
    dump = given.model_dump(mode="json")
    assert dump["async"] == {"max_staleness": 2, "rollout_workers": 3, "importance_cap": 2.0, "sync_timeout_s": 300.0}
    assert "async_" not in dump and cls.model_validate(dump) == given  # what a dump says is what it validates to
    assert cls(async_={"max_staleness": 1}).async_.max_staleness == 1  # by attribute name, in code
    assert "async" in cls.model_json_schema()["properties"]  # the Prefect UI's form names it as recipes do
    assert all(f.description for f in AsyncConfig.model_fields.values())


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_the_default_block_leaves_config_dumps_and_cache_keys_as_they_were(cls):
    """A default (or explicitly default) block is left out of the dump, so the cache key is the one of the same
    config without the block (every stage's key before the block existed); a block that differs enters it."""
    without = cls().model_dump(mode="json", exclude={"async_"})
    stage, version = cls.__name__.removesuffix("Config").lower(), "v"
    key = cache_key(stage, version, without, {"model": "f" * 64}, 0)
    for cfg in (cls(), cls.model_validate({"async": {}}), cls.model_validate({"async": {"max_staleness": 0}})):
        assert "async" not in cfg.model_dump(mode="json")
        assert cache_key(stage, version, cfg.model_dump(mode="json"), {"model": "f" * 64}, 0) == key
    changed = cls.model_validate({"async": {"importance_cap": 3.0}})
    assert cache_key(stage, version, changed.model_dump(mode="json"), {"model": "f" * 64}, 0) != key


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_where_the_rollout_workers_run_is_placement_outside_the_cache_key(cls):
    """async.worker_resources (the Ray resources of the worker actors) is in the dump the stage task validates, and
    out of the cache key: a block that differs only by it has the key of the same block without it, and a block
    that is otherwise the default has the key of no block at all; default, it is left out of the dump."""
    stage, inputs = cls.__name__.removesuffix("Config").lower(), {"model": "f" * 64}
    placement = {"labels": {"gen": 1}, "cpus": 2, "gpus": 1, "memory_gb": 8}
    for block, bare in (({"max_staleness": 1}, cls.model_validate({"async": {"max_staleness": 1}})), ({}, cls())):
        placed = cls.model_validate({"async": {**block, "worker_resources": placement}})
        dump = placed.model_dump(mode="json")
        assert dump["async"]["worker_resources"] == {"cpus": 2.0, "gpus": 1.0, "memory_gb": 8.0, "labels": {"gen": 1.0}}
        assert cls.model_validate(dump) == placed
        assert cache_key(stage, "v", dump, inputs, 0) == cache_key(stage, "v", bare.model_dump(mode="json"), inputs, 0)
    assert "worker_resources" not in cls.model_validate({"async": {"max_staleness": 1}}).model_dump(mode="json")["async"]


def test_recipe_rl_nodes_keep_their_configs_with_the_default_block_set_explicitly():
    """The r1 recipe's RL nodes (GRPO and, with options.rl=ppo, PPO) dump the same config, so keep their cache
    keys, whether or not a --set spells out the default block."""
    for rl_option in ("grpo", "ppo"):
        base = load_plan("r1", "cpu", [f"options.rl={rl_option}"])
        spelled = load_plan("r1", "cpu", [f"options.rl={rl_option}", "grpo_reasoning.async.max_staleness=0",
                                          "grpo_final.async={max_staleness: 0, importance_cap: 2.0}"])
        for node in ("grpo_reasoning", "grpo_final"):
            assert base.node(node).stage == rl_option
            assert base.node(node).config_dict == spelled.node(node).config_dict
            assert "async" not in base.node(node).config_dict


# ---------------------------------------------------------------------------- plan-time refusals


@pytest.mark.parametrize("recipe, setting, message", [
    ("rl-compare", ["ppo.async.max_staleness=1", "ppo.resources.num_processes=2"], "ppo.resources.num_processes: 2 "
     "does not go with async.max_staleness=1 yet (the rollout workers feed one learner process); "
     "use --set ppo.resources.num_processes=1, or --set ppo.async.max_staleness=0"),
    ("r1-zero", ["grpo.async.max_staleness=1", "grpo.resources.num_processes=2"], "grpo.resources.num_processes: 2 "
     "does not go with async.max_staleness=1 yet (the rollout workers feed one learner process); "
     "use --set grpo.resources.num_processes=1, or --set grpo.async.max_staleness=0"),
    ("r1", ["grpo_reasoning.async.max_staleness=2", "grpo_reasoning.resources.distributed_type=fsdp"],
     "grpo_reasoning.resources.distributed_type: fsdp does not go with async.max_staleness=2 yet"),
    ("r1-zero", ["grpo.policy_loss=gspo", "grpo.async.max_staleness=1"], "grpo.policy_loss: gspo does not go with "
     "async.max_staleness=1 (the off-policy weight is per token, gspo's ratio per sequence); use --set "
     "grpo.policy_loss=token or cispo, or --set grpo.async.max_staleness=0"),
    ("r1-zero", ["grpo.async.importance_cap=1"], "grpo.async.importance_cap: Input should be greater than 1"),
    ("r1-zero", ["grpo.async.rollout_workers=0"], "grpo.async.rollout_workers: Input should be greater than or equal"),
])
def test_async_settings_fail_the_plan_in_one_line_before_any_compute(recipe, setting, message, capsys, tmp_path,
                                                                      monkeypatch):
    home = tmp_path / "untouched"
    monkeypatch.setenv("R1FLOW_HOME", str(home))
    argv = ["run", "--recipe", recipe, "--profile", "tiny"]
    for s in setting:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"r1flow: error: {message}"), err
    assert not home.exists()  # nothing was computed or written


def test_the_step_loop_refuses_async_too():
    """A stage driven by hand (no plan) still refuses what the asynchronous loop does not do before its first step,
    rather than running synchronously."""
    cfg = PPOConfig.model_validate({"async": {"max_staleness": 1}, "resources": {"num_processes": 2}})
    with pytest.raises(ConfigError, match="ppo.resources.num_processes: 2 does not go with async.max_staleness=1"):
        rl_loop.StepLoop("ppo", cfg, None, None, {"step": 0}, None, None, [])
    rl_loop.check_async("ppo", PPOConfig.model_validate({"async": {"max_staleness": 1}}))  # ppo runs asynchronously
    rl_loop.check_async("grpo", GRPOConfig())  # the synchronous default passes


def test_busy_fractions_by_hand():
    """Window [10, 20]: generation busy 8-12 and 11-15 (merged: 10-15 inside the window, 5 s) and 18-25 (18-20,
    2 s): 0.7; training busy 14-19 (5 s): 0.5; both busy 14-15 and 18-19: 0.2. An empty window is all zeros."""
    got = offpolicy.busy_fractions((10.0, 20.0), [(8.0, 12.0), (11.0, 15.0), (18.0, 25.0)], [(14.0, 19.0)])
    assert got == pytest.approx({"generation": 0.7, "training": 0.5, "overlap": 0.2})
    assert offpolicy.busy_fractions((5.0, 5.0), [(0.0, 9.0)], [(0.0, 9.0)]) == {
        "generation": 0.0, "training": 0.0, "overlap": 0.0}
