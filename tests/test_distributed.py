"""Training on several processes (issue 9): the split of work, the gathered advantages, and the stages
under `accelerate launch` with 2 gloo processes on CPU against the same stage on 1 process.

What "the same" means: batch sizes are global, so 2 processes take half of every micro-batch each
and the summed gradients are the single-process gradients. In fp32 the only differences are the
order of floating-point sums (other padding widths, another thread count, the all-reduce), about
1e-7 relative per step; Adam carries them forward, so per-step losses are compared at rtol 1e-4
(the tolerance the single-process resume test already uses) over the whole curve.
"""

from __future__ import annotations

import json
import os
import socket
import types
from pathlib import Path

import pytest
import torch

from schemas.configs import (
    GenerationSpec,
    GRPOConfig,
    LoraSpec,
    PreferenceOptimizationConfig,
    ResourcesSpec,
    RewardSpec,
    SFTConfig,
)
from schemas.datasets import from_rows
from schemas.errors import StageError
from stages.base import LocalContext, write_dataset
from stages.math import rl
from stages.modeling import heads
from stages.runtime import distributed
from stages.training import checkpoints, launch
from tests.conftest import fake_input

TWO = ResourcesSpec(num_processes=2)
RTOL = 1e-4


# ---------------------------------------------------------------------------- the split of work


@pytest.mark.parametrize("n,world", [(8, 2), (12, 3), (4, 4)])
def test_shards_are_equal_contiguous_and_cover_the_batch(n, world):
    shards = [distributed.Dist(rank, world).shard(list(range(n))) for rank in range(world)]
    assert [x for s in shards for x in s] == list(range(n))
    assert {len(s) for s in shards} == {n // world}


def test_parts_may_be_uneven_and_gather_back_in_order():
    parts = [distributed.Dist(rank, 3).part(list(range(7))) for rank in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    assert distributed.Dist(0, 3).part([]) == []
    with pytest.raises(ValueError, match="evenly"):
        distributed.Dist(0, 3).shard(list(range(7)))


def test_single_is_the_identity():
    one = distributed.SINGLE
    assert one.shard([3, 1, 2]) == [3, 1, 2] and one.part([3, 1]) == [3, 1]
    assert one.sum([1, 2.5]) == [1.0, 2.5] and one.gather_list([1, 2]) == [1, 2]
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    one.sync_gradients([p])
    assert p.grad.tolist() == [3.0, 3.0]
    assert distributed.of(LocalContext()) is distributed.SINGLE


def test_batch_sizes_must_split_evenly_among_processes():
    with pytest.raises(ValueError, match="batch_size=3 does not split evenly"):
        SFTConfig(batch_size=3, resources=TWO)
    with pytest.raises(ValueError, match="prompts_per_step=5"):
        GRPOConfig(prompts_per_step=5, resources=TWO)
    assert SFTConfig(batch_size=4, resources=TWO).resources.num_processes == 2
    # across machines the split is over every rank: 2 nodes x 2 processes
    with pytest.raises(ValueError, match="batch_size=6 does not split evenly among the 4 processes"):
        SFTConfig(batch_size=6, resources={"nodes": 2, "num_processes": 2})
    with pytest.raises(ValueError, match="prompts_per_step=6 does not split evenly among the 4 processes"):
        GRPOConfig(prompts_per_step=6, resources={"nodes": 2, "processes_per_node": 2})


# ---------------------------------------------------------------------------- GRPO: groups on several ranks


def test_batch_advantages_need_the_gathered_rewards():
    """Rank 0 holds group [1, 0], rank 1 group [0, 0]. "batch" scales by the std of all four rewards:
    mean 0.25, population variance (0.75² + 3·0.25²)/4 = 0.1875, std 0.4330; rank 0's advantages are
    ±0.5 / (0.4330 + 1e-4) = ±1.1544. Rank 0 alone would divide by its own std 0.5 (→ ±1.0)."""
    by_rank = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]])]
    a0 = rl.sharded_group_advantages(by_rank, 0, "batch")
    torch.testing.assert_close(a0, torch.tensor([[1.1544, -1.1544]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(rl.sharded_group_advantages(by_rank, 1, "batch"), torch.zeros(1, 2))
    assert not torch.allclose(a0, rl.group_advantages(by_rank[0], "batch"))


def test_the_logprob_drift_is_over_every_processs_tokens():
    """Rank 0 trained tokens with |trainer - sampler| 0.25 and 0 (a padded one masked out), rank 1 one token of 0.5,
    rank 2 (no groups) none: the drift is of the three together, sorted (0, 0.25, 0.5): mean 0.25, p99 at position
    0.99 * 2 = 1.98: 0.25 + 0.98 * 0.25 = 0.495, max 0.5, 2 of 3 above 0.1 nats (rank 0 alone: max 0.25)."""
    from stages.training.rollouts import drift_metrics

    parts = [(torch.tensor([-1.0, -2.0]), torch.tensor([-1.25, -2.0])), (torch.tensor([-0.5]), torch.tensor([-1.0])),
             (torch.zeros(0), torch.zeros(0))]

    class Rank0:  # what all_gather_object hands rank 0: its own masked tokens, then the other ranks'
        def gather(self, obj):
            return [obj, *parts[1:]]

    d = drift_metrics(torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.25, -2.0, float("-inf")]]),
                      torch.tensor([[1, 1, 0]]), Rank0())
    assert d == pytest.approx({"sampler/logprob_delta_mean": 0.25, "sampler/logprob_delta_p99": 0.495,
                               "sampler/logprob_delta_max": 0.5, "sampler/logprob_delta_share_above_0.1": 2 / 3},
                              abs=1e-12)


@pytest.mark.parametrize("kind", sorted(rl.ADVANTAGES))
@pytest.mark.parametrize("std", ["population", "sample"])
def test_sharded_advantages_are_the_single_process_advantages(kind, std):
    torch.manual_seed(0)
    full = torch.randint(0, 3, (6, 4)).float()  # 6 groups of 4, some constant
    sizes = [3, 0, 2, 1]  # uneven after dynamic sampling; one rank kept nothing
    by_rank = list(torch.split(full, sizes))
    got = torch.cat([rl.sharded_group_advantages(by_rank, r, kind, std) for r in range(len(sizes))])
    torch.testing.assert_close(got, rl.group_advantages(full, kind, std), rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    """One of `world` real gloo processes: gather rewards of its groups, compute its advantages, and
    sum a gradient, then write what it got."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist, device = distributed.init_from_env("gloo", cuda=False)
    try:
        full = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 3.0, 0.5],
                             [5.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
        rows = [[0, 1, 2], [3, 4]][rank]  # whole groups per rank, unevenly
        by_rank = [m for m in dist.gather(full[rows])]
        adv = {kind: rl.sharded_group_advantages(by_rank, dist.rank, kind).tolist() for kind in rl.ADVANTAGES}
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.full((3,), float(rank + 1))
        q = torch.nn.Parameter(torch.zeros(2))  # no gradient on rank 0
        if rank:
            q.grad = torch.ones(2)
        dist.sync_gradients([p, q])
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"adv": adv, "grad": p.grad.tolist(), "q": q.grad.tolist(), "sum": dist.sum([rank + 1, 0.5]),
             "gathered": dist.gather_list(dist.part(list(range(5)))), "device": device}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_compute_the_single_process_advantages(tmp_path):
    """GRPO's acceptance line: with 2 processes the same rollouts give the same advantages as 1."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    full = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 3.0, 0.5],
                         [5.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    for kind in rl.ADVANTAGES:
        both = torch.tensor(got[0]["adv"][kind] + got[1]["adv"][kind])
        torch.testing.assert_close(both, rl.group_advantages(full, kind), rtol=0, atol=0)
    for g in got:
        assert g["grad"] == [3.0, 3.0, 3.0] and g["q"] == [1.0, 1.0]  # summed; a missing grad counts as 0
        assert g["sum"] == [3.0, 1.0] and g["gathered"] == [0, 1, 2, 3, 4] and g["device"] == "cpu"


# ---------------------------------------------------------------------------- 1 process is the in-process call


def test_one_process_runs_in_this_process(monkeypatch, tmp_path):
    """num_processes 1 (the default) and stages without `resources` call module.run here, unchanged:
    no launcher, no process group."""
    def no_launch(*a, **k):
        raise AssertionError("must not launch processes")

    monkeypatch.setattr(launch.subprocess, "Popen", no_launch)
    monkeypatch.setattr(launch, "run_distributed", no_launch)
    calls = []
    module = types.SimpleNamespace(__name__="stages.fake", OUTPUTS={},
                                   run=lambda cfg, inputs, ctx: calls.append((cfg, inputs, ctx)) or {"out": 1})
    ctx = LocalContext(tmp_path)
    for cfg in (SFTConfig(), GRPOConfig(), object()):
        assert launch.run_stage(module, cfg, {"x": 1}, ctx) == {"out": 1}
        assert calls[-1] == (cfg, {"x": 1}, ctx)
    assert launch.num_processes(SFTConfig()) == 1 and not torch.distributed.is_initialized()


def test_tail_returns_complete_lines_and_the_last_redraw(tmp_path):
    f = tmp_path / "log"
    tail = launch._Tail(f)
    assert tail.lines() == []
    f.write_bytes(b"first\nbar 1/3\rbar 2/3\rbar 3/3\nhalf")
    assert tail.lines() == ["first", "bar 3/3"]
    with open(f, "ab") as fh:
        fh.write(b" line\nnext")
    assert tail.lines() == ["half line"]
    assert tail.lines(final=True) == ["next"]


# ---------------------------------------------------------------------------- stages on 2 processes vs 1


def _curve(ctx: LocalContext, key: str) -> list[float]:
    return [m[key] for step, m in ctx.metrics if step is not None and key in m]


def _sft_input(root: Path, n: int):
    rows = []
    for i in range(n):
        word = "abcdefgh"[i % 8] * (1 + i % 3)
        rows.append({"id": str(i), "source": "test", "metadata": "{}", "messages": [
            {"role": "user", "content": f"say {word}"},
            {"role": "assistant", "content": f"<think>\n</think>\n<answer>{word}</answer>"}]})
    out = write_dataset(LocalContext(root), "d", from_rows(rows, "sft"), "sft")
    return fake_input(out.path, "dataset", "sft", n)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return _sft_input(tmp_path_factory.mktemp("sft"), 24)


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    from tests.test_preference_optimization import synthetic_pairs

    out = write_dataset(LocalContext(tmp_path_factory.mktemp("prefs")), "p",
                        from_rows(synthetic_pairs(40), "preferences"), "preferences")
    return fake_input(out.path, "dataset", "preferences")


def _assert_same_curve(one: LocalContext, two: LocalContext, key: str, steps: int) -> float:
    a, b = _curve(one, key), _curve(two, key)
    assert len(a) == len(b) == steps, (key, len(a), len(b))
    assert b == pytest.approx(a, rel=RTOL, abs=1e-6), (key, a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_sft_on_two_processes_follows_the_single_process_loss_curve(tmp_path, tiny_model_input, sft_data):
    """Global batch 4 × accumulation 2: one process takes all 8 sequences of a step, two take 2 + 2
    of each micro-batch; the token-mean over the step is the same, so is every update."""
    from stages import sft

    cfg = SFTConfig(max_steps=6, batch_size=4, grad_accum=2, learning_rate=3e-3, warmup_ratio=0.0, max_length=128,
                    checkpoint_every=3, lora=LoraSpec(r=0), lr_scheduler="constant")
    inputs = {"model": tiny_model_input, "data": sft_data}
    one, two = LocalContext(tmp_path / "one"), LocalContext(tmp_path / "two")
    sft.run(cfg, inputs, one)
    out = launch.run_stage(sft, cfg.model_copy(update={"resources": TWO}), inputs, two)["model"]
    worst = _assert_same_curve(one, two, "train/loss", 6)
    _assert_same_curve(one, two, "train/grad_norm", 6)
    print(f"sft: max relative loss difference 2 vs 1 processes over 6 steps: {worst:.2e}")
    assert (out.path / "model" / "model.safetensors").exists() and out.path == two.output_dir("model")
    assert two.params["examples"] == 24  # rank 0's params reached the caller's context
    assert checkpoints.latest_checkpoint(two.checkpoint_dir).name == "step-000006"  # rank 0 wrote checkpoints


@pytest.mark.slow
def test_dpo_on_two_processes_follows_the_single_process_loss_curve(tmp_path, tiny_model_input, prefs):
    """DPO with the reference computed in-line (scored in 2 parts and gathered), 4 pairs × 2
    micro-batches per step; rewards and accuracy are gathered over both processes' pairs."""
    from stages import preference_optimization as po

    cfg = PreferenceOptimizationConfig(loss="dpo", max_steps=5, batch_size=4, grad_accum=2, learning_rate=3e-3,
                                       lora=LoraSpec(r=0), max_length=64, eval_fraction=0.2, checkpoint_every=100,
                                       warmup_ratio=0.0, lr_scheduler="constant", kl_prompts=0)
    inputs = {"model": tiny_model_input, "preferences": prefs}
    one, two = LocalContext(tmp_path / "one"), LocalContext(tmp_path / "two")
    out1 = po.run(cfg, inputs, one)["model"]
    out2 = launch.run_stage(po, cfg.model_copy(update={"resources": TWO}), inputs, two)["model"]
    worst = _assert_same_curve(one, two, "train/loss", 5)
    for key in ("train/rewards/margin", "train/logps/chosen", "train/grad_norm"):
        a, b = _curve(one, key), _curve(two, key)
        assert b == pytest.approx(a, rel=1e-3, abs=1e-4), (key, a, b)
    # At step 1 the policy is the reference: every margin is 0 up to float rounding (~5e-8, from the
    # prompts' KV computed in other batches), and the share of pairs whose rounding is positive is
    # noise. From step 2 the margins are real and the accuracy must agree exactly.
    assert abs(_curve(one, "train/rewards/margin")[0]) < 1e-6 and abs(_curve(two, "train/rewards/margin")[0]) < 1e-6
    assert _curve(two, "train/rewards/accuracy")[1:] == _curve(one, "train/rewards/accuracy")[1:]
    print(f"dpo: max relative loss difference 2 vs 1 processes over 5 steps: {worst:.2e}")
    assert out2.metrics["eval_accuracy"] == pytest.approx(out1.metrics["eval_accuracy"])
    assert (out2.path / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_grpo_on_two_processes_rolls_out_whole_groups_and_logs_global_metrics(tmp_path, tiny_model_input):
    from stages import grpo

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i % 10}."}], "answer": str(i % 10),
             "task": "say", "verifier": "exact", "split": "train", "metadata": "{}"} for i in range(8)]
    prompts = fake_input(write_dataset(LocalContext(tmp_path / "p"), "p", from_rows(rows, "prompts"), "prompts").path,
                         "dataset", "prompts")
    cfg = GRPOConfig(steps=2, prompts_per_step=4, group_size=4, learning_rate=1e-3, lora=LoraSpec(r=0),
                     generation=GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=8),
                     reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=4, overlong_buffer=3),
                     advantage="batch", aggregation="token_mean", minibatch_size=4, checkpoint_every=100,
                     old_logprobs="sampler", resources=TWO)
    ctx = LocalContext(tmp_path / "two")
    out = launch.run_stage(grpo, cfg, {"model": tiny_model_input, "prompts": prompts}, ctx)["model"]
    assert len(_curve(ctx, "reward/mean")) == 2 and len(_curve(ctx, "train/loss")) == 2
    # the drift's gather across the two processes runs (fp32 on CPU: rounding only, as on one process)
    assert len(_curve(ctx, "sampler/logprob_delta_max")) == 2 and max(_curve(ctx, "sampler/logprob_delta_max")) < 1e-4
    lengths = _curve(ctx, "completion/mean_length")
    assert all(1 <= x <= 6 for x in lengths)
    assert out.metrics["steps"] == 2 and (out.path / "model" / "model.safetensors").exists()


def test_even_passes_add_fillers_only_when_sharded():
    from stages import grpo

    class Sharded:
        sharded = True

        def max(self, value):  # the most mini-batches any rank has
            return 3.0

    a, b = torch.tensor([0, 1]), torch.tensor([2, 3])
    assert grpo.even_passes([a], Sharded()) == [a, None, None]
    assert grpo.even_passes([], Sharded()) == [None, None, None]  # a rank left without groups
    assert grpo.even_passes([a, b], distributed.Dist(0, 2)) == [a, b]  # ddp: sync_gradients handles it


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full_kl_eval", "lora_dynamic"])
def test_grpo_sharded_on_two_processes_follows_the_ddp_run(tmp_path, tiny_model_input, variant):
    """Same ranks and seeds as ddp, so the same rollouts: under fsdp each process samples from an
    unsharded copy refreshed before every step and trains its shard. The rewards, losses, the
    held-out eval and the saved weights follow the ddp run (measured: weights at most 6.6e-6 apart). full_kl_eval: full fine-tuning with a KL
    to a frozen reference and an eval mid-run. lora_dynamic: LoRA (the reference is the base in the
    sampling copy) and dynamic sampling without refills, so ranks can keep different numbers of
    groups (most completions run to the length limit and get the same penalty) and weight-0 fillers
    keep their passes even."""
    from safetensors.torch import load_file

    from stages import grpo

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say {i % 10}."}], "answer": str(i % 10),
             "task": "say", "verifier": "exact", "split": "train" if i < 8 else "eval", "metadata": "{}"}
            for i in range(12)]
    prompts = fake_input(write_dataset(LocalContext(tmp_path / "p"), "p", from_rows(rows, "prompts"), "prompts").path,
                         "dataset", "prompts")
    common = dict(prompts_per_step=4, group_size=4, learning_rate=3e-3, minibatch_size=4, checkpoint_every=2,
                  advantage="grpo", aggregation="token_mean", generation=GenerationSpec(max_new_tokens=8,
                                                                                      temperature=1.0, batch_size=8))
    if variant == "full_kl_eval":  # the language-consistency share of letters varies within every group
        cfg = GRPOConfig(**common, steps=3, lora=LoraSpec(r=0), beta=0.05, eval_every=2, eval_prompts=4,
                         reward=RewardSpec(weights={"language": 1.0}))
    else:  # only a completion that ends before the limit escapes the penalty: many groups are flat
        cfg = GRPOConfig(**common, steps=4, lora=LoraSpec(r=4), beta=0.05, dynamic_sampling=True, max_refill_rounds=0,
                         reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=8, overlong_buffer=1))
    inputs = {"model": tiny_model_input, "prompts": prompts}
    ddp, fsdp = LocalContext(tmp_path / "ddp"), LocalContext(tmp_path / "fsdp")
    out1 = launch.run_stage(grpo, cfg.model_copy(update={"resources": TWO}), inputs, ddp)["model"]
    out2 = launch.run_stage(grpo, cfg.model_copy(update={"resources": FSDP2}), inputs, fsdp)["model"]
    for key in ("reward/mean", "completion/mean_length", "reward/zero_std_groups"):
        assert _curve(fsdp, key) == _curve(ddp, key), key  # the same samples
    trained = len(_curve(ddp, "train/loss"))  # steps whose groups were all flat are skipped (the same in both)
    assert trained >= 2
    _assert_same_curve(ddp, fsdp, "train/loss", trained)
    # train/kl is not compared as a metric: k3 = exp(r) - r - 1 of a rare sampled token amplifies
    # float rounding (measured: 1.8% apart at one step, 1e-6 at the next); the weights it moves are.
    assert max(_curve(ddp, "train/kl")) > 1e-6 and max(_curve(fsdp, "train/kl")) > 1e-6  # away from the reference
    if variant == "full_kl_eval":
        assert _curve(fsdp, "eval/accuracy") == _curve(ddp, "eval/accuracy") and len(_curve(ddp, "eval/accuracy")) == 1
    else:  # a step where 3 of the 4 groups were flat left one rank with no group: it ran fillers only
        assert 0.75 in _curve(ddp, "reward/zero_std_groups"), _curve(ddp, "reward/zero_std_groups")
    assert fsdp.params["parameters_per_process"] < 0.6 * fsdp.params["total_parameters"]
    name = "adapter_model.safetensors" if variant == "lora_dynamic" else "model.safetensors"
    w1, w2 = (load_file(o.path / "model" / name) for o in (out1, out2))
    assert w1.keys() == w2.keys() and w1
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-3, atol=1e-5)
    assert grpo_checkpoint_is_whole(fsdp, tiny_model_input, lora=variant == "lora_dynamic")
    if variant == "full_kl_eval":  # resumed from the step-2 checkpoint: step 3 and the saved weights are the same
        import shutil

        resumed = LocalContext(tmp_path / "resumed")
        resumed.checkpoint_dir.mkdir(parents=True)
        shutil.copytree(fsdp.checkpoint_dir / "step-000002", resumed.checkpoint_dir / "step-000002")
        out3 = launch.run_stage(grpo, cfg.model_copy(update={"resources": FSDP2}), inputs, resumed)["model"]
        assert _curve(resumed, "reward/mean")[-1] == _curve(fsdp, "reward/mean")[-1]
        assert _curve(resumed, "train/loss")[-1] == pytest.approx(_curve(fsdp, "train/loss")[-1], rel=RTOL, abs=1e-6)
        w3 = load_file(out3.path / "model" / name)
        for key in w2:
            torch.testing.assert_close(w3[key], w2[key], rtol=1e-5, atol=1e-6)


def grpo_checkpoint_is_whole(ctx: LocalContext, model_input, lora: bool) -> bool:
    """The last checkpoint holds every trainable tensor whole (gathered), not a shard."""
    from safetensors.torch import load_file


    ckpt = load_file(checkpoints.latest_checkpoint(ctx.checkpoint_dir) / "trainable.safetensors")
    model, _ = model_input.load_model()
    if lora:
        return bool(ckpt) and all("lora_" in k for k in ckpt)
    return {k: v.shape for k, v in ckpt.items()} == {n: p.shape for n, p in model.named_parameters()}


@pytest.mark.slow
def test_a_failing_rank_fails_the_stage_with_its_traceback(tmp_path, tiny_model_input):
    from stages import sft

    rows = [{"id": "0", "source": "t", "metadata": "{}", "messages": [
        {"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}]
    data = fake_input(write_dataset(LocalContext(tmp_path / "d"), "d", from_rows(rows, "sft"), "sft").path,
                      "dataset", "sft", 1)
    cfg = SFTConfig(max_steps=1, batch_size=2, max_length=16, lora=LoraSpec(r=0), resources=TWO)
    with pytest.raises(StageError, match=r"(?s)sft on 2 processes: rank\d failed.*SchemaError.*max_length=16"):
        launch.run_stage(sft, cfg, {"model": tiny_model_input, "data": data}, LocalContext(tmp_path / "run"))


@pytest.mark.slow
def test_the_pipeline_publishes_and_tracks_a_launched_stage(tmp_path, tiny_model_input, sft_data):
    """execute_stage (the Prefect task's body) with resources.num_processes=2: rank 0's curve reaches
    MLflow through the caller, the output is published and recorded like an in-process stage's."""
    import shutil

    from mlflow.tracking import MlflowClient

    from flows.run.pipeline import execute_stage
    from flows.servers.settings import Settings
    from flows.store.artifacts import ArtifactStore
    from flows.store.cache import cache_key
    from schemas.artifacts import Producer

    home = tmp_path / "home"
    s = Settings(home=str(home), store=str(home), tracking_uri=f"sqlite:///{home}/mlflow.db")
    store = ArtifactStore(s.store, home=s.home)

    def put(inp, kind, schema):
        staged = store.new_staging_dir()
        shutil.copytree(inp.path, staged, dirs_exist_ok=True)
        return store.publish(staged, kind=kind, schema=schema, parents=[],
                             producer=Producer(stage="test", stage_version="0", config_hash="")).fingerprint

    inputs = {"model": put(tiny_model_input, "model", "model"), "data": put(sft_data, "dataset", "sft")}
    config = SFTConfig(max_steps=3, batch_size=4, max_length=128, lora=LoraSpec(r=0), checkpoint_every=2,
                       resources=TWO).model_dump(mode="json")
    key = cache_key("sft", "1", config, inputs, 0)
    out = execute_stage(node="sft", stage="sft", config=config, inputs=inputs, seed=0, key=key, parent_run_id=None,
                        settings=s.to_dict(), experiment="r1flow/test-distributed")
    assert not out["reused"] and store.lookup(key).outputs == out["outputs"]
    client = MlflowClient(s.tracking_uri)
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["config.resources.num_processes"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3]
    assert "examples" in run.data.params and "final_loss" in out["metrics"]
    assert not store.checkpoint_dir(key).exists()  # published: checkpoints removed as for one process


# ---------------------------------------------------------------------------- FSDP: the model sharded

FSDP2 = ResourcesSpec(num_processes=2, distributed_type="fsdp")


def test_fsdp_is_accepted_where_the_trained_model_generates():
    """GRPO and on-policy distillation sample through an unsharded copy under fsdp."""
    from schemas.configs import DistillConfig

    assert GRPOConfig(prompts_per_step=4, resources=FSDP2).resources.distributed_type == "fsdp"
    assert DistillConfig(mode="on_policy", batch_size=4, resources=FSDP2).resources.distributed_type == "fsdp"
    assert DistillConfig(mode="logits", batch_size=4, resources=FSDP2).resources.distributed_type == "fsdp"


def test_the_vllm_backend_is_refused_where_no_weight_sync_is_built():
    """GRPO and on-policy distillation push the trained weights into a colocated vLLM engine
    (tests/test_vllm_colocated.py, tests/test_distill.py), but not from FSDP shards: asking for that is an
    error, not a silent fall-back to transformers."""
    from schemas.configs import DistillConfig

    with pytest.raises(ValueError, match="vllm with resources.distributed_type=fsdp is not built"):
        GRPOConfig(prompts_per_step=4, generation=GenerationSpec(backend="vllm"), resources=FSDP2)
    with pytest.raises(ValueError, match="generation.backend=vllm and resources.distributed_type=fsdp is not built"):
        DistillConfig(mode="on_policy", batch_size=4, generation=GenerationSpec(backend="vllm"), resources=FSDP2)
    assert GRPOConfig(generation=GenerationSpec(backend="vllm")).generation.backend == "vllm"
    assert DistillConfig(mode="on_policy", generation=GenerationSpec(backend="vllm")).mode == "on_policy"
    assert DistillConfig(mode="traces", generation=GenerationSpec(backend="vllm")).mode == "traces"


def test_a_filler_keeps_every_sharded_rank_running_the_same_forwards():
    """FSDP all-gathers parameters in every forward, so a rank with an empty part must still run one
    (weight 0); without sharding an empty part stays empty."""
    ddp, fsdp = distributed.Dist(1, 2), distributed.Dist(1, 2, fsdp=True)
    assert ddp.part_or_filler([7]) == ([], True) and fsdp.part_or_filler([7]) == ([7], False)
    assert fsdp.part_or_filler([7, 8, 9]) == ([9], True) and fsdp.part_or_filler([]) == ([], True)
    assert not distributed.Dist(0, 1, fsdp=True).sharded and fsdp.sharded


# 21 examples, batch 4: the last micro-batch of an epoch holds one example and the second rank runs a weight-0 filler
SHARDED_SFT = SFTConfig(max_steps=6, batch_size=4, grad_accum=2, learning_rate=3e-3, warmup_ratio=0.0, max_length=128,
                        checkpoint_every=3, lora=LoraSpec(r=0), lr_scheduler="constant", resources=FSDP2)


@pytest.fixture(scope="module")
def sharded_sft(tmp_path_factory, tiny_model_input):
    """SHARDED_SFT's uninterrupted run on 2 processes (its inputs, context and model), which the loss-curve test and the
    resume test both compare against: one launch of 2 ranks for both."""
    from stages import sft

    root = tmp_path_factory.mktemp("sharded-sft")
    inputs = {"model": tiny_model_input, "data": _sft_input(root / "data", 21)}
    two = LocalContext(root / "two")
    out = launch.run_stage(sft, SHARDED_SFT, inputs, two)["model"]
    return inputs, two, out


@pytest.mark.slow
def test_sft_sharded_on_two_processes_follows_the_single_process_loss_curve(tmp_path, tiny_model_input, sharded_sft):
    """FSDP: each process holds half of every weight, gradient and Adam moment; the reduce-scatter
    sums, so the curve is the single-process one (SHARDED_SFT: the second rank runs a weight-0 filler at the end
    of every epoch). Checkpoints hold the full weights; the saved model is the same as the single process's."""
    from safetensors.torch import load_file

    from stages import sft

    inputs, two, out2 = sharded_sft
    one = LocalContext(tmp_path / "one")
    out1 = sft.run(SHARDED_SFT.model_copy(update={"resources": ResourcesSpec()}), inputs, one)["model"]
    worst = _assert_same_curve(one, two, "train/loss", 6)
    _assert_same_curve(one, two, "train/grad_norm", 6)
    print(f"sft fsdp: max relative loss difference 2 vs 1 processes over 6 steps: {worst:.2e}")
    w1, w2 = (load_file(o.path / "model" / "model.safetensors") for o in (out1, out2))
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-3, atol=1e-5)
    total = one.params["total_parameters"]
    assert two.params["parameters_per_process"] < 0.6 * total  # each process holds about half
    ckpt = load_file(checkpoints.latest_checkpoint(two.checkpoint_dir) / "trainable.safetensors")  # whole, not a shard
    model, _ = tiny_model_input.load_model()
    assert {k: v.shape for k, v in ckpt.items()} == {n: p.shape for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sft_sharded_resumes_from_its_checkpoint(tmp_path, sharded_sft):
    """A sharded run stopped after 3 steps and resumed to 6 (the full weights and Adam moments gathered
    into the checkpoint, loaded back into each process's shards) follows the uninterrupted run (the module's
    `sharded_sft`, the same config); a checkpoint written without fsdp is refused by a sharded resume, by name."""
    from stages import sft

    cfg = SHARDED_SFT
    inputs, whole, _ = sharded_sft
    parts = LocalContext(tmp_path / "parts")
    launch.run_stage(sft, cfg.model_copy(update={"max_steps": 3}), inputs, parts)
    out = launch.run_stage(sft, cfg, inputs, parts)["model"]
    assert out.metrics["resumed_from_step"] == 3 and out.metrics["trained_steps"] == 3
    a, b = _curve(whole, "train/loss"), _curve(parts, "train/loss")[-6:]
    assert b == pytest.approx(a, rel=RTOL, abs=1e-6)
    plain = LocalContext(tmp_path / "plain")
    sft.run(cfg.model_copy(update={"max_steps": 3, "resources": ResourcesSpec()}), inputs, plain)
    with pytest.raises(StageError, match="written without fsdp, resumed with it"):
        launch.run_stage(sft, cfg, inputs, plain)


@pytest.mark.slow
def test_dpo_sharded_on_two_processes_follows_the_single_process_run(tmp_path, tiny_model_input, prefs):
    """DPO under fsdp with a LoRA adapter (frozen and trainable weights in the same shards), the
    reference computed in-line and a held-out evaluation mid-run and at the end (rank 0, on the
    gathered model): the same curve, margins and held-out metrics as one process."""
    from stages import preference_optimization as po

    cfg = PreferenceOptimizationConfig(loss="dpo", max_steps=4, batch_size=4, grad_accum=2, learning_rate=3e-3,
                                       lora=LoraSpec(r=4, alpha=8), max_length=64, eval_fraction=0.2, eval_every=2,
                                       checkpoint_every=100, warmup_ratio=0.0, lr_scheduler="constant", kl_prompts=0)
    inputs = {"model": tiny_model_input, "preferences": prefs}
    one, two = LocalContext(tmp_path / "one"), LocalContext(tmp_path / "two")
    out1 = po.run(cfg, inputs, one)["model"]
    out2 = launch.run_stage(po, cfg.model_copy(update={"resources": FSDP2}), inputs, two)["model"]
    worst = _assert_same_curve(one, two, "train/loss", 4)
    for key in ("train/rewards/margin", "train/grad_norm", "eval/margin", "eval/loss"):
        a, b = _curve(one, key), _curve(two, key)
        assert a and b == pytest.approx(a, rel=1e-3, abs=1e-4), (key, a, b)
    print(f"dpo fsdp: max relative loss difference 2 vs 1 processes over 4 steps: {worst:.2e}")
    assert out2.metrics["eval_accuracy"] == pytest.approx(out1.metrics["eval_accuracy"])
    assert two.params["parameters_per_process"] < 0.6 * two.params["total_parameters"]
    assert out2.schema == "adapter" and (out2.path / "model" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_reward_model_sharded_on_two_processes_follows_the_single_process_run(tmp_path, tiny_model_input):
    """The reward model (a sequence-classification head on the backbone, LoRA merged at the end)
    under fsdp: the same curve and held-out accuracy as one process, and the same saved scores."""
    from schemas.configs import RewardModelConfig
    from stages import reward_model as rm
    from tests.test_reward_model import _arithmetic_pairs, _preferences

    cfg = RewardModelConfig(max_steps=4, batch_size=4, grad_accum=2, learning_rate=3e-3, warmup_ratio=0.0,
                            max_length=96, lr_scheduler="constant", checkpoint_every=2, lora=LoraSpec(r=4, alpha=8))
    inputs = {"model": tiny_model_input, "preferences": _preferences(tmp_path / "prefs", _arithmetic_pairs(30))}
    one, two = LocalContext(tmp_path / "one"), LocalContext(tmp_path / "two")
    out1 = rm.run(cfg, inputs, one)["model"]
    out2 = launch.run_stage(rm, cfg.model_copy(update={"resources": FSDP2}), inputs, two)["model"]
    _assert_same_curve(one, two, "train/loss", 4)
    for key in ("eval_accuracy", "eval_margin", "eval_loss"):
        assert out2.metrics[key] == pytest.approx(out1.metrics[key], rel=1e-3, abs=1e-5), key
    a, b = (heads.RewardScorer.from_input(fake_input(o.path, "model", "reward_model")) for o in (out1, out2))
    conv = [[{"role": "user", "content": "2+2?"}]]
    assert b.score(conv, ["4"]) == pytest.approx(a.score(conv, ["4"]), rel=1e-3, abs=1e-5)


def test_the_skeleton_for_the_gathered_copy_costs_no_memory(tiny_model_input):
    """Rank 0's skeleton (the module tree `full_model` fills with the gathered weights) holds no data,
    and making it leaves the model untouched."""
    model, _ = tiny_model_input.load_model()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    skeleton = distributed._meta_copy(model)
    assert all(p.is_meta for p in skeleton.parameters()) and all(b.is_meta for b in skeleton.buffers())
    assert {n: p.requires_grad for n, p in skeleton.named_parameters()} == {n: p.requires_grad for n, (p, _) in before.items()}
    for n, p in model.named_parameters():
        assert p is before[n][0] and not p.is_meta and torch.equal(p, before[n][1])
    assert [type(m).__name__ for m in distributed.decoder_layers(model)] == ["LlamaDecoderLayer"] * len(model.model.layers)
