"""Asynchronous GRPO on one machine (issue 60, `stages.training.async_rollouts`): K = 0 is the synchronous loop;
with K >= 1 rollout worker processes sample step s with the weights after step max(0, s - K), every consumed group's
staleness is min(K, s) and none is dropped; the loss's importance weights are wired to the behaviour log-probs; a
worker that hangs ends the stage in one line; a worker that dies is replaced (up to async.worker_restarts) with the
same outputs, and one death more ends the stage in one line; a resumed learner neither replays nor skips a group."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec
from schemas.errors import StageError
from stages import grpo
from stages.base import LocalContext
from stages.math import offpolicy
from stages.training import async_rollouts
from tests.test_grpo import short_is_better


def _run(tmp_path, name, inputs, **kw):
    ctx = LocalContext(tmp_path / name, seed=0)
    out = grpo.run(short_is_better(**kw), inputs, ctx)["model"]
    return ctx, out


def _model_sha(out) -> str:
    return hashlib.sha256((out.path / "model" / "model.safetensors").read_bytes()).hexdigest()


def _step_metrics(ctx) -> dict[int, dict[str, float]]:
    return {s: m for s, m in ctx.metrics if s is not None}


def _consumed(ctx, step: int) -> list[list]:
    return json.loads((ctx.checkpoint_dir / f"step-{step:06d}" / "state.json").read_text())["async_consumed"]


def test_k0_spelled_out_is_the_synchronous_loop(tmp_path, tiny_model_input, digit_prompts):
    """`async: {max_staleness: 0}` written out is the default: the same model bytes and the same metrics, step for
    step, as the config without the block (the synchronous code path; no worker starts)."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    plain_ctx, plain = _run(tmp_path, "plain", inputs, steps=3)
    spelled_ctx, spelled = _run(tmp_path, "spelled", inputs, steps=3, **{"async": {"max_staleness": 0}})
    assert _model_sha(plain) == _model_sha(spelled)
    strip = lambda ctx: [(s, {k: v for k, v in m.items() if not k.startswith("time")}) for s, m in ctx.metrics]  # noqa: E731
    assert strip(plain_ctx) == strip(spelled_ctx)
    assert not any(k.startswith("async/") for _, m in spelled_ctx.metrics for k in m)
    assert not (spelled_ctx.checkpoint_dir / async_rollouts.WEIGHTS_DIR).exists()


def _check_schedule(ctx, k: int, steps: int, prompts: int) -> None:
    """Every step's groups came from version max(0, s - K): staleness min(K, s) in the histogram and the consumed
    record, every group of every step consumed once, in order."""
    metrics = _step_metrics(ctx)
    assert sorted(metrics) == list(range(1, steps + 1))
    for done, m in metrics.items():
        s = done - 1
        assert m["async/staleness_max"] == m["async/staleness_mean"] == min(k, s) <= k
        assert m["async/policy_version"] == max(0, s - k)
        assert [m[f"async/staleness_{b}"] for b in range(k + 1)] == offpolicy.staleness_histogram([min(k, s)] * prompts, k)
        for key in ("async/generation_idle", "async/training_idle", "async/overlap"):
            assert 0.0 <= m[key] <= 1.0, key
    consumed = _consumed(ctx, steps)
    assert len(consumed) == steps * prompts  # nothing dropped
    assert [(s, j) for s, j, _, _ in consumed] == [(s, j) for s in range(steps) for j in range(prompts)]
    assert all(v == max(0, s - k) for s, _, _, v in consumed)


class KillingContext(LocalContext):
    """SIGKILLs the learner's rollout worker process `name` once, as the metrics of step `at` are logged (the
    learner has published version `at`): what the kernel's out-of-memory killer does to a worker."""

    def __init__(self, root, name: str, at: int):
        super().__init__(root, seed=0)
        self.name, self.at, self.killed = name, at, []

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, step)
        if step == self.at and not self.killed:
            worker = next(p for p in multiprocessing.active_children() if p.name == self.name)
            os.kill(worker.pid, signal.SIGKILL)
            self.killed.append(worker.pid)


@pytest.mark.slow
def test_k1_runs_deterministically_whatever_the_number_of_workers_or_a_killed_one(tmp_path, tiny_model_input,
                                                                                 digit_prompts, caplog):
    """K = 1 with one worker and with two, worker 1 of the two killed (SIGKILL) after step 1: the same schedule, so
    the same model bytes and rewards; the dead worker is replaced (one warning line naming it, its host and the
    step its successor starts at: 1 or 3, whichever it had not delivered; `async/worker_restarts` counts it);
    staleness is exactly min(1, s); step 0 (the input model, staleness 0) has importance weights 1, and once the
    weights have changed a stale step's weights are not all 1 (the behaviour log-probs reach the loss)."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    one_ctx, one = _run(tmp_path, "one", inputs, steps=4, **{"async": {"max_staleness": 1}})
    two_ctx = KillingContext(tmp_path / "two", "grpo-rollout-1", at=1)
    with caplog.at_level(logging.WARNING, logger="r1flow.stage"):
        two = grpo.run(short_is_better(steps=4, **{"async": {"max_staleness": 1, "rollout_workers": 2}}), inputs,
                       two_ctx)["model"]
    _check_schedule(one_ctx, 1, 4, 4)
    _check_schedule(two_ctx, 1, 4, 4)
    assert _model_sha(one) == _model_sha(two)
    replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert len(replaced) == 1 and two_ctx.killed, replaced
    line = re.fullmatch(rf"grpo: async rollout worker 1 \(pid {two_ctx.killed[0]} on \S+\) exited with code -9 "
                        r"before delivering step (\d)'s groups \(policy version (\d)\); replaced \(1 of "
                        r"async.worker_restarts=2\) by pid \d+ on \S+, from step \1", replaced[0])
    assert line and (line[1], line[2]) in {("1", "0"), ("3", "2")}, replaced[0]
    assert _step_metrics(two_ctx)[4]["async/worker_restarts"] == 1.0
    assert {m["async/worker_restarts"] for m in _step_metrics(one_ctx).values()} == {0.0}
    rewards = lambda ctx: [m["reward/mean"] for m in _step_metrics(ctx).values()]  # noqa: E731
    assert rewards(one_ctx) == rewards(two_ctx)
    assert _consumed(one_ctx, 4) == _consumed(two_ctx, 4)
    m = _step_metrics(one_ctx)
    assert m[1]["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m[1]["async/is_weight_ess"] == pytest.approx(1.0, abs=1e-5)
    stale = [m[d] for d in (3, 4)]  # versions 1 and 2 sample steps 2 and 3: the policy moved by then
    assert any(abs(x["async/is_weight_mean"] - 1.0) > 1e-3 and x["async/is_weight_ess"] < 1.0 - 1e-4 for x in stale), stale
    assert not (one_ctx.checkpoint_dir / async_rollouts.WEIGHTS_DIR).exists()  # removed after a finished run


def _check_drift(m: dict[int, dict[str, float]], fresh: int, stale: tuple[int, ...]) -> None:
    """Every step logs the drift (`sampler/logprob_delta_*`), ordered mean, p99 <= max; step `fresh`, sampled by the
    learner's own version, drifts by the fp32 numerics only (mean < 1e-5, max < 1e-4: measured ~2e-7 and ~1e-6), the
    `stale` steps by the policy's change since their version too (mean > 1e-3: measured 0.015 to 0.075)."""
    for x in m.values():
        d = [x[f"sampler/logprob_delta_{k}"] for k in ("mean", "p99", "max", "share_above_0.1")]
        assert min(d) >= 0 and d[0] <= d[2] and d[1] <= d[2] and d[3] <= 1, d
    assert m[fresh]["sampler/logprob_delta_mean"] < 1e-5 and m[fresh]["sampler/logprob_delta_max"] < 1e-4, m[fresh]
    assert all(m[s]["sampler/logprob_delta_mean"] > 1e-3 for s in stale), [m[s] for s in stale]


@pytest.mark.slow
def test_k2_schedule_and_lora_adapter_sync(tmp_path, tiny_model_input, digit_prompts):
    """K = 2 under LoRA (only the adapter is published): staleness 0, 1, 2, 2, the record complete; the sampler/trainer
    log-prob drift is the numerics' at step 1 (measured: mean 2.2e-7, max 9.5e-7) and the policy's change over two
    versions at steps 3 and 4 (mean 0.015 and 0.032)."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    ctx, out = _run(tmp_path, "k2", inputs, steps=4, lora=LoraSpec(r=4, alpha=8), **{"async": {"max_staleness": 2}})
    _check_schedule(ctx, 2, 4, 4)
    assert out.schema == "adapter"
    _check_drift(_step_metrics(ctx), fresh=1, stale=(3, 4))


def test_published_versions_hold_only_the_trainable_weights(tmp_path, tiny_tokenizer):
    """A version file is the trainable parameters by name (the adapter under LoRA), and versions older than the
    oldest checkpoint less K are pruned while the ones a resume needs stay."""
    from stages.modeling import models

    model = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=0), LoraSpec(r=2, alpha=4))
    ctx = LocalContext(tmp_path / "v")
    ro = async_rollouts.AsyncRollouts.__new__(async_rollouts.AsyncRollouts)
    ro.k, ro.dir = 1, ctx.checkpoint_dir / async_rollouts.WEIGHTS_DIR
    ro.dir.mkdir(parents=True)
    (ctx.checkpoint_dir / "step-000002").mkdir()
    (ctx.checkpoint_dir / "step-000002" / "state.json").write_text("{}")
    for v in range(6):
        ro.publish(v, model)
    kept = sorted(p.name for p in ro.dir.iterdir())
    assert kept == [f"weights-v{v:06d}.safetensors" for v in (1, 2, 3, 4, 5)]  # checkpoint 2 less K = 1
    from safetensors.torch import load_file

    names = set(load_file(ro.dir / kept[-1]))
    assert names and names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in names)


# ---------------------------------------------------------------------------- the loss's weights, wired


def _async_update(tmp_path, tiny_tokenizer, adv: torch.Tensor, behaviour_shift: torch.Tensor | None):
    """One grpo update (mu 1, SGD lr 1, seq_mean) of the tiny model on 8 fixed rows (2 groups of 4); with
    `behaviour_shift` (per row) the session is asynchronous (C = 2) and the behaviour log-probs are the model's own
    less that shift, so each token's weight is min(exp(shift), 2). (parameter change, the update's weights)."""
    from stages.modeling import models
    from stages.runtime import distributed
    from stages.training.rollout_batch import RolloutBatch
    from stages.training.rollouts import build_batch

    model = models.build_tiny_model(tiny_tokenizer, seed=0).train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 3)]
    comps = [torch.randint(3, 60, (1 + (3 * i) % 7,), generator=g).tolist() for i in range(8)]
    batch = build_batch([prompts[i // 4] for i in range(8)], comps, pad_id=0)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, minibatch_size=8, max_grad_norm=1e9, learning_rate=1.0,
                     lora=LoraSpec(r=0), generation=GenerationSpec(max_new_tokens=8), tis_cap=5.0,
                     **{"async": {"max_staleness": 1, "importance_cap": 2.0}})  # the async cap, not tis_cap
    trainable = list(model.parameters())
    s = grpo.Session(cfg, LocalContext(tmp_path, seed=0), distributed.SINGLE, model, None, None, trainable,
                     torch.optim.SGD(trainable, lr=1.0), None, tiny_tokenizer, 0, None, [], [], None, False)
    rb = RolloutBatch(batch, prompts, comps, 4, 0, False, "cpu", 4096)
    u = grpo.Update(adv, 8, batch, rb, False, old_logp=torch.zeros_like(batch["loss_mask"]))
    if behaviour_shift is not None:
        s.rollouts = object()  # asynchronous: the weight's cap is async.importance_cap
        with torch.no_grad():
            own = rb.logprobs(model, torch.arange(8))[0].float()
        u.sampler_logp = (own - behaviour_shift[:, None]) * batch["loss_mask"]
        u.tis_w = torch.zeros_like(u.sampler_logp)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    grpo.update(s, u, step=0)
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}, u.tis_w


def test_the_update_weights_each_token_by_min_prox_over_behaviour_and_cap(tmp_path, tiny_tokenizer):
    """Behaviour log-probs below the learner's by log 1.5 (group 0) and log 3 (group 1): the weights are 1.5 and
    min(3, C = 2) = 2 on every completion token, 0 elsewhere; in the first epoch the ratio to pi_prox is 1, so the
    update equals the synchronous one with each row's advantage times its weight (1.5 A, 2 A)."""
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.6, -1.2, 0.3, 0.3])
    shift = torch.tensor([1.5] * 4 + [3.0] * 4).log()
    delta, w = _async_update(tmp_path / "a", tiny_tokenizer, adv, shift)
    expected_row = torch.tensor([1.5] * 4 + [2.0] * 4)
    on = w > 0
    assert on.sum() > 0
    torch.testing.assert_close(w[on], expected_row[:, None].expand_as(w)[on], rtol=1e-5, atol=1e-6)
    ref, _ = _async_update(tmp_path / "s", tiny_tokenizer, adv * expected_row, None)
    for name in delta:
        torch.testing.assert_close(delta[name], ref[name], rtol=1e-4, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------- failures in one line


@pytest.mark.slow
def test_a_worker_that_hangs_in_a_sync_ends_the_stage_in_one_line(tmp_path, tiny_model_input, digit_prompts,
                                                                  monkeypatch):
    """Worker 0 stops answering when it loads version 1 (the sync before step 2 with K = 1): within
    sync_timeout_s of the learner's wait, one line names the worker, its pid, the host and the version."""
    import socket

    monkeypatch.setenv(async_rollouts.HANG_VAR, "0:1")
    t0 = time.monotonic()
    with pytest.raises(StageError) as e:
        _run(tmp_path, "hang", {"model": tiny_model_input, "prompts": digit_prompts}, steps=4,
             **{"async": {"max_staleness": 1, "sync_timeout_s": 2}})
    msg = str(e.value)
    assert "\n" not in msg
    assert re.fullmatch(rf"grpo: async rollout worker 0 \(pid \d+ on {re.escape(socket.gethostname())}\) did not "
                        r"load policy version 1 within async.sync_timeout_s=2 s", msg), msg
    assert time.monotonic() - t0 < 120


def slow_learner(monkeypatch, pause: float) -> None:
    """Every training step takes `pause` s longer: the sleep is inside the learner's busy window (from taking the
    step's groups to its step metrics), so the idle metrics see a slow learner, not an idle one."""
    step_metrics = async_rollouts.AsyncRollouts.step_metrics

    def slow(self, d):
        time.sleep(pause)
        return step_metrics(self, d)

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "step_metrics", slow)


@pytest.mark.slow
def test_neither_a_slow_learner_nor_a_slow_worker_makes_a_group_older_than_k(tmp_path, tiny_model_input,
                                                                            digit_prompts, monkeypatch):
    """K = 2, once with a learner that sleeps 1.5 s a step (the workers run ahead and are throttled: generation idles
    more than training) and once with a worker that sleeps 1.5 s a step (the learner waits: training idles more):
    both consume every group once, in order, exactly min(2, s) versions old, and train the same bytes."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    cfg = short_is_better(steps=4, **{"async": {"max_staleness": 2}})
    with monkeypatch.context() as m:
        slow_learner(m, pause=1.5)
        learner_ctx = LocalContext(tmp_path / "learner", seed=0)
        a = grpo.run(cfg, inputs, learner_ctx)["model"]
    monkeypatch.setenv(async_rollouts.SLOW_VAR, "1.5")
    slow_worker = LocalContext(tmp_path / "worker", seed=0)
    b = grpo.run(cfg, inputs, slow_worker)["model"]
    for ctx in (learner_ctx, slow_worker):
        _check_schedule(ctx, 2, 4, 4)
    assert _model_sha(a) == _model_sha(b)
    idle = lambda ctx, key: sum(m[key] for m in _step_metrics(ctx).values())  # noqa: E731
    assert idle(learner_ctx, "async/generation_idle") > idle(learner_ctx, "async/training_idle")
    assert idle(slow_worker, "async/training_idle") > idle(slow_worker, "async/generation_idle")


@pytest.mark.slow
def test_a_worker_that_dies_past_its_restarts_ends_the_stage_in_one_line(tmp_path, tiny_model_input, digit_prompts,
                                                                          monkeypatch, caplog):
    """Worker 0 exits with code 3 before generating step 2, and so does its replacement (the hook holds for every
    worker 0): with async.worker_restarts=1 the first death is one warning line and a new worker from step 2, the
    second ends the stage in one line with the new pid, the host, exit code, step, version and the bound."""
    monkeypatch.setenv(async_rollouts.EXIT_VAR, "0:2")
    with caplog.at_level(logging.WARNING, logger="r1flow.stage"), pytest.raises(StageError) as e:
        _run(tmp_path, "dead", {"model": tiny_model_input, "prompts": digit_prompts}, steps=4,
             **{"async": {"max_staleness": 1, "worker_restarts": 1}})
    msg = str(e.value)
    assert "\n" not in msg
    last = re.fullmatch(r"grpo: async rollout worker 0 \(pid (\d+) on \S+\) exited with code 3 before delivering "
                        r"step 2's groups \(policy version 1\); no replacement left \(async.worker_restarts=1\)", msg)
    assert last, msg
    replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    first = re.fullmatch(r"grpo: async rollout worker 0 \(pid (\d+) on \S+\) exited with code 3 before delivering "
                         r"step 2's groups \(policy version 1\); replaced \(1 of async.worker_restarts=1\) by pid "
                         r"(\d+) on \S+, from step 2", replaced[0]) if len(replaced) == 1 else None
    assert first and first[2] == last[1] != first[1], (replaced, msg)


def _dead_worker_learner(restarts: int, steps: int, workers: int, taken: int, buffered: set[int]):
    """The learner's side of a run of `steps` steps with `workers` workers whose steps before `taken` were consumed
    and `buffered` received, and whose worker processes have all exited with code -9 (stand-ins that record the
    replacements)."""

    class Ended:
        def __init__(self, pid):
            self.pid = pid

        def describe(self):
            return f"pid {self.pid} on h"

        def exit_status(self):
            return "exited with code -9"

    class Pool:
        def __init__(self):
            self.workers, self.started = [Ended(100 + i) for i in range(workers)], []

        def drain(self, i):
            return []

        def replace(self, i, job):
            self.started.append((i, job.start))
            self.workers[i] = Ended(200 + len(self.started))

    ro = async_rollouts.AsyncRollouts.__new__(async_rollouts.AsyncRollouts)
    ro.stage, ro.k, ro.timeout, ro.log = "grpo", 1, 300.0, logging.getLogger("r1flow.stage")
    ro.cfg = short_is_better(steps=steps, **{"async": {"max_staleness": 1, "worker_restarts": restarts}})
    ro.pool = Pool()
    ro.workers, ro.next, ro.restarts = ro.pool.workers, taken, 0
    ro.jobs = [async_rollouts.WorkerJob(i, workers, "grpo", {}, None, None, [], 0, "cpu", None, 0, 1)
               for i in range(workers)]
    ro.buffer = {s: None for s in buffered}
    ro.heard, ro.synced, ro.generating = [0.0] * workers, [0] * workers, {}
    return ro


def test_a_dead_worker_is_replaced_from_the_first_step_the_learner_has_not_received():
    """Two workers, 6 steps, steps 0-1 consumed and 3 received: dead worker 0 resumes at step 2 and dead worker 1 at
    step 5 (its step 3 is in); with 5 steps worker 1 owes nothing and is not replaced. With the bound spent (or 0)
    a death is the one line, without a bound clause at 0."""
    ro = _dead_worker_learner(restarts=2, steps=6, workers=2, taken=2, buffered={3})
    ro._dead(0, "exited with code -9")
    ro._dead(1, "exited with code -9")
    assert ro.pool.started == [(0, 2), (1, 5)] and ro.restarts == 2
    assert [j.start for j in ro.jobs] == [2, 5] and list(ro.jobs[0].steps(6)) == [2, 4] and list(ro.jobs[1].steps(6)) == [5]
    with pytest.raises(StageError, match=r"^grpo: async rollout worker 0 \(pid 201 on h\) exited with code -9 before "
                                         r"delivering step 2's groups \(policy version 1\); no replacement left "
                                         r"\(async.worker_restarts=2\)$"):
        ro._dead(0, "exited with code -9")
    ro = _dead_worker_learner(restarts=2, steps=5, workers=2, taken=2, buffered={3})
    ro._dead(1, "exited with code -9")
    assert ro.pool.started == []
    ro = _dead_worker_learner(restarts=0, steps=4, workers=1, taken=1, buffered=set())
    with pytest.raises(StageError, match=r"^grpo: async rollout worker 0 \(pid 100 on h\) exited with code -9 before "
                                         r"delivering step 1's groups \(policy version 0\)$"):
        ro._dead(0, "exited with code -9")


def test_a_local_workers_outbox_flushes_what_it_was_given_even_when_nobody_reads():
    """`flush` returns once every message put has gone down the pipe (the exit hook flushes, then os._exit skips the
    sending thread: without it the hook's worker lost its last groups and died 'before' an earlier step than the
    test's); with the reading end closed, `flush` still returns (the messages are dropped) and `close` ends."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    out = async_rollouts.Outbox(writer)
    for s in range(50):
        out.put(("groups", 0, s, 0, "x" * 100, 0.0, 0.0))  # within the pipe's buffer
    out.flush()
    assert [reader.recv()[2] for _ in range(50)] == list(range(50)) and not reader.poll()
    reader.close()
    for s in range(3):
        out.put(("groups", 0, s, 0, "x" * 100, 0.0, 0.0))  # within the pipe's buffer
    out.flush()
    out.close()
    assert not out.thread.is_alive()


def test_worker_restarts_is_out_of_the_dump_while_default_and_out_of_the_cache_key():
    """async.worker_restarts (default 2) is operational: left out of the dump while default, so dumps and keys of
    today's configs stay as they were; set, it is in the dump the stage validates and out of the cache key."""
    from flows.store.cache import cache_key

    k1 = short_is_better(**{"async": {"max_staleness": 1}})
    assert k1.async_.worker_restarts == 2 and "worker_restarts" not in k1.model_dump(mode="json")["async"]
    for block, bare in (({"max_staleness": 1}, k1), ({}, short_is_better())):
        set_ = short_is_better(**{"async": {**block, "worker_restarts": 5}})
        dump = set_.model_dump(mode="json")
        assert dump["async"]["worker_restarts"] == 5 and GRPOConfig.model_validate(dump) == set_
        assert cache_key("grpo", "v", dump, {}, 0) == cache_key("grpo", "v", bare.model_dump(mode="json"), {}, 0)
    with pytest.raises(ValueError, match="async.worker_restarts"):
        short_is_better(**{"async": {"worker_restarts": -1}})


# ---------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_a_resumed_learner_neither_replays_nor_skips_a_group(tmp_path, tiny_model_input, digit_prompts):
    """K = 1, killed after step 3 (last checkpoint: step 2): the resumed run trains steps 3-5 only, its record of
    consumed groups equals an uninterrupted run's, and so do the model bytes."""
    cfg = short_is_better(steps=5, checkpoint_every=2, **{"async": {"max_staleness": 1}})
    _resumes_without_replay_or_skip(grpo, cfg, {"model": tiny_model_input, "prompts": digit_prompts}, tmp_path)


def _resumes_without_replay_or_skip(stage, cfg, inputs, tmp_path) -> None:
    """`stage` (grpo or ppo) with `cfg` (5 steps, 4 prompts a step, checkpoint every 2), killed after step 3 and
    resumed: steps 1-2 come back from the checkpoint's history (logged first), 3-5 are trained, each once, in
    order; the consumed groups and the model bytes equal an uninterrupted run's."""
    from tests.test_sft import CrashingContext, SimulatedCrash

    ref_ctx = LocalContext(tmp_path / "ref", seed=0)
    ref = stage.run(cfg, inputs, ref_ctx)["model"]
    root = tmp_path / "crash"
    with pytest.raises(SimulatedCrash):
        stage.run(cfg, inputs, CrashingContext(root, crash_at=3))
    assert len(_consumed(LocalContext(root), 2)) == 2 * 4
    resumed = LocalContext(root, seed=0)
    out = stage.run(cfg, inputs, resumed)["model"]
    assert [s for s, m in resumed.metrics if s is not None and "train/loss" in m] == [1, 2, 3, 4, 5]
    assert _consumed(resumed, 5) == _consumed(ref_ctx, 5)
    assert _model_sha(out) == _model_sha(ref)


def test_resumed_record_must_cover_exactly_the_steps_before():
    ok = [[0, 0, "p1", 0], [0, 1, "p2", 0], [1, 0, "p3", 0], [1, 1, "p1", 0]]
    assert async_rollouts.resumed_record({"async_consumed": ok}, 2) == ok
    with pytest.raises(StageError, match="not written by this asynchronous run"):
        async_rollouts.resumed_record({"step": 2}, 2)
    with pytest.raises(StageError, match="out of order"):
        async_rollouts.resumed_record({"async_consumed": [ok[0], ok[1], ok[3], ok[2]]}, 2)


# ---------------------------------------------------------------------------- multi-turn environments


@pytest.mark.slow
def test_a_multi_turn_environment_runs_asynchronously(tmp_path, tiny_model_input, digit_prompts, tiny_tokenizer):
    """The worker runs the environment's rollouts (a tool answering every turn, from a user's file) and scores them
    with a reward-model component (the worker loads the reward model): K = 1 runs 3 steps with tool calls every
    step, staleness min(1, s), and the stale step's weights come from the trajectories' sampler log-probs."""
    from schemas.configs import EnvironmentSpec, RewardSpec
    from tests.test_grpo import _tiny_reward_model
    from tests.test_grpo_tools import TOOL_EVERY_TURN, _cfg

    path = tmp_path / "tool_every_turn.py"
    path.write_text(TOOL_EVERY_TURN)
    cfg = _cfg(steps=3, environment=EnvironmentSpec(name=str(path), max_turns=3, max_total_tokens=40),
               reward=RewardSpec(weights={"overlong": 1.0, "reward_model": 0.1}, overlong_max_tokens=6,
                                 overlong_buffer=5), **{"async": {"max_staleness": 1}})
    grpo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts,
                   "reward_model": _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)}, ctx)
    _check_schedule(ctx, 1, 3, 2)
    for m in _step_metrics(ctx).values():
        assert m["rollout/tool_calls"] > 0 and m["rollout/turns"] > 1 and "reward/reward_model" in m
        assert 0.0 < m["async/is_weight_ess"] <= 1.0


# ---------------------------------------------------------------------------- through the CLI, into MLflow


@pytest.mark.slow
def test_r1flow_run_trains_grpo_asynchronously_and_logs_the_async_metrics_to_mlflow(tmp_path):
    """`r1flow run --recipe r1-zero --profile tiny --set grpo.async.max_staleness=1`: the grpo node runs under
    Prefect with its rollout workers, and its MLflow run has, per step, the staleness histogram (min(1, s)), the
    importance weights' mean and ESS, the truncated share and the idle and overlap fractions."""
    import subprocess
    import sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from tests.conftest import clean_env

    home, out = tmp_path / "home", tmp_path / "run.json"
    env = {**clean_env(home), "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--recipe", "r1-zero", "--profile", "tiny",
                           "--set", "grpo.async.max_staleness=1", "--json", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    runs = client.search_runs([result["experiment_id"]], f"tags.mlflow.parentRunId = '{result['parent_run_id']}'")
    grpo_run = next(r for r in runs if r.data.tags["r1flow.node"] == "grpo")
    stale = {m.step: m.value for m in client.get_metric_history(grpo_run.info.run_id, "async/staleness_max")}
    assert stale and stale == {d: float(min(1, d - 1)) for d in stale}
    for key in ("async/staleness_0", "async/staleness_1", "async/is_weight_mean", "async/is_weight_ess",
                "async/is_truncated", "async/generation_idle", "async/training_idle", "async/overlap"):
        assert len(client.get_metric_history(grpo_run.info.run_id, key)) == len(stale), key


# ---------------------------------------------------------------------------- ppo through the same machinery


def _ppo_run(tmp_path, name, inputs, **kw):
    from stages import ppo
    from tests.test_ppo import small

    ctx = LocalContext(tmp_path / name, seed=0)
    cfg = small(prompts_per_step=4, group_size=4, **kw)
    ppo.check(cfg)
    return ctx, ppo.run(cfg, inputs, ctx)["model"]


def test_ppo_k0_spelled_out_is_the_synchronous_loop(tmp_path, tiny_model_input, digit_prompts):
    """ppo with `async: {max_staleness: 0}` written out: the same model bytes and metrics as without the block."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    plain_ctx, plain = _ppo_run(tmp_path, "plain", inputs, steps=2)
    spelled_ctx, spelled = _ppo_run(tmp_path, "spelled", inputs, steps=2, **{"async": {"max_staleness": 0}})
    assert _model_sha(plain) == _model_sha(spelled)
    strip = lambda ctx: [(s, {k: v for k, v in m.items() if not k.startswith("time")}) for s, m in ctx.metrics]  # noqa: E731
    assert strip(plain_ctx) == strip(spelled_ctx)
    assert not any(k.startswith("async/") for _, m in spelled_ctx.metrics for k in m)
    assert not (spelled_ctx.checkpoint_dir / async_rollouts.WEIGHTS_DIR).exists()


def _ppo_policy_grad(tiny_tokenizer, adv: torch.Tensor, behaviour_shift: torch.Tensor | None) -> dict:
    """The policy's gradient from one ppo mini-batch (`ppo.micro_backward`) on 8 fixed rows, with per-token
    advantages `adv` broadcast over each row and pi_prox the policy's own log-probs (ratio 1, nothing clipped); with
    `behaviour_shift` (per row) the rollout is asynchronous (C = 2) and mu = pi_prox / exp(shift)."""
    from stages import ppo
    from stages.modeling import logprobs, models
    from stages.modeling.heads import reward_model_from_causal_lm
    from stages.runtime import distributed
    from stages.training.rollouts import build_batch
    from tests.test_ppo import small

    policy = models.build_tiny_model(tiny_tokenizer, seed=0).train()
    critic = reward_model_from_causal_lm(models.build_tiny_model(tiny_tokenizer, seed=1), 0).train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 3)]
    comps = [torch.randint(3, 60, (1 + (3 * i) % 7,), generator=g).tolist() for i in range(8)]
    batch = build_batch([prompts[i // 4] for i in range(8)], comps, pad_id=0)
    mask = batch["loss_mask"]
    cfg = small(**{"async": {"max_staleness": 1, "importance_cap": 2.0}})
    s = ppo.Session(cfg, LocalContext("unused"), distributed.SINGLE, ppo.Models(policy, critic, None, False), None,
                    None, tiny_tokenizer, 0, None, [], [], None, False)
    with torch.no_grad():
        own = logprobs.bucketed_token_logprobs(policy, batch["input_ids"], batch["attention_mask"])[0].float()
    behaviour = None if behaviour_shift is None else (own - behaviour_shift[:, None]) * mask
    ro = ppo.Rollout([], [], batch, [], torch.zeros(8), 0.0, 0.0, behaviour)
    old = {"old_logp": own * mask, "old_values": torch.zeros_like(mask)}
    advantages = {"advantages": adv[:, None] * mask, "returns": torch.zeros_like(mask)}
    ppo.micro_backward(s, ro, old, advantages, torch.arange(8), float(mask.sum()), True)
    return {k: p.grad.detach().clone() for k, p in policy.named_parameters() if p.grad is not None}


def test_ppo_weights_each_tokens_policy_loss_by_min_prox_over_behaviour_and_cap(tiny_tokenizer):
    """mu below pi_prox by log 1.5 (rows 0-3) and log 3 (rows 4-7): the weights are 1.5 and min(3, C = 2) = 2, so
    the policy's gradient equals the synchronous one with each row's advantages times 1.5 and 2 (ratio 1 at
    pi_prox: the clip is inactive, and the weight is a constant of the loss)."""
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.6, -1.2, 0.3, 0.3])
    weights = torch.tensor([1.5] * 4 + [2.0] * 4)
    got = _ppo_policy_grad(tiny_tokenizer, adv, torch.tensor([1.5] * 4 + [3.0] * 4).log())
    want = _ppo_policy_grad(tiny_tokenizer, adv * weights, None)
    plain = _ppo_policy_grad(tiny_tokenizer, adv, None)
    assert got.keys() == want.keys() and got
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(not torch.allclose(got[n], plain[n]) for n in got)  # the weight changes the update


@pytest.mark.slow
def test_ppo_k1_runs_deterministically_whatever_the_number_of_workers(tmp_path, tiny_model_input, digit_prompts):
    """Asynchronous ppo, K = 1, with one worker and with two: staleness exactly min(1, s), every group consumed once
    in order, the same model bytes (policy and critic trained alike: the values are the learner's) and rewards;
    step 0 (the input model) has importance weights 1, and a stale step's are not all 1 (mu reaches the loss)."""
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    one_ctx, one = _ppo_run(tmp_path, "one", inputs, steps=4, **{"async": {"max_staleness": 1}})
    two_ctx, two = _ppo_run(tmp_path, "two", inputs, steps=4, **{"async": {"max_staleness": 1, "rollout_workers": 2}})
    _check_schedule(one_ctx, 1, 4, 4)
    _check_schedule(two_ctx, 1, 4, 4)
    assert _model_sha(one) == _model_sha(two)
    metrics = lambda ctx, key: [m[key] for m in _step_metrics(ctx).values()]  # noqa: E731
    for key in ("reward/mean", "train/value_loss", "train/policy_loss", "async/is_weight_mean"):
        assert metrics(one_ctx, key) == metrics(two_ctx, key), key
    m = _step_metrics(one_ctx)
    assert m[1]["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m[1]["async/is_weight_ess"] == pytest.approx(1.0, abs=1e-5)
    stale = [m[d] for d in (3, 4)]
    assert any(abs(x["async/is_weight_mean"] - 1.0) > 1e-3 and x["async/is_weight_ess"] < 1.0 - 1e-4 for x in stale), stale
    assert not (one_ctx.checkpoint_dir / async_rollouts.WEIGHTS_DIR).exists()


@pytest.mark.slow
def test_a_resumed_ppo_learner_neither_replays_nor_skips_a_group(tmp_path, tiny_model_input, digit_prompts):
    """Asynchronous ppo, K = 1, killed after step 3 (last checkpoint: step 2): the resumed run trains steps 3-5, its
    record of consumed groups equals an uninterrupted run's, and so do the model bytes."""
    from stages import ppo
    from tests.test_ppo import small

    cfg = small(steps=5, prompts_per_step=4, group_size=4, checkpoint_every=2, **{"async": {"max_staleness": 1}})
    _resumes_without_replay_or_skip(ppo, cfg, {"model": tiny_model_input, "prompts": digit_prompts}, tmp_path)


@pytest.mark.slow
def test_async_ppo_runs_a_multi_turn_environment(tmp_path, tiny_model_input, digit_prompts):
    """Asynchronous ppo (K = 1, 2 steps) with a tool answering every turn (a user's environment file): the worker
    runs the multi-turn rollouts and records mu on the model's tokens, the learner's critic and GAE take the
    trajectories; staleness is min(1, s), every group is consumed once, and each step logs the async metrics beside
    the tool's: weights 1 at step 0 (sampled by the learner's own version 0), not all 1 at the stale step 1 (mu, from
    the trajectories' sampler log-probs, reaches the loss)."""
    import math

    from schemas.configs import EnvironmentSpec, PPOConfig
    from stages import ppo
    from tests.test_grpo_tools import TOOL_EVERY_TURN, _cfg

    path = tmp_path / "tool_every_turn.py"
    path.write_text(TOOL_EVERY_TURN)
    # every reward is the same here: whitened, the advantages would be 0 and the policy would not move at all
    cfg = _cfg(PPOConfig, environment=EnvironmentSpec(name=str(path), max_turns=3, max_total_tokens=40), beta=0.05,
               whiten_advantages=False, **{"async": {"max_staleness": 1}})
    ppo.check(cfg)
    ctx = LocalContext(tmp_path / "run", seed=0)
    ppo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    _check_schedule(ctx, 1, 2, 2)
    m = _step_metrics(ctx)
    for step in m.values():
        assert step["rollout/turns"] > 1 and step["rollout/tool_calls"] > 0 and step["rollout/observation_tokens"] > 0
        assert math.isfinite(step["train/value_loss"]) and math.isfinite(step["train/policy_loss"])
        assert 0.0 < step["async/is_weight_ess"] <= 1.0 and 0.0 <= step["async/is_truncated"] <= 1.0
        assert step["async/worker_restarts"] == 0.0
    assert m[1]["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m[1]["async/is_weight_ess"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m[2]["async/is_weight_mean"] - 1.0) > 1e-4 and m[2]["async/is_weight_ess"] < 1.0 - 1e-4, m[2]
    _check_drift(m, fresh=1, stale=(2,))  # measured: mean 1.4e-7 at step 1, 0.075 at step 2
