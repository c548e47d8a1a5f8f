"""The grpo stage on the tiny model: tensors line up, the loop runs for each variant, and training
climbs a reward the random model can find (DAPO's overlong reward with a short limit: stop early)."""

import pytest
import torch

from schemas.configs import GenerationSpec, GRPOConfig, LoraSpec, RewardSpec
from schemas.errors import ConfigError
from stages import grpo
from stages.base import LocalContext
from stages.modeling import heads
from stages.training import process_rewards
from stages.training.rollout_batch import RolloutBatch, minibatch_rows, place
from stages.training.rollouts import build_batch
from tests.conftest import assert_matches_whole_rows, fake_input


def test_build_batch_masks_exactly_the_completion_predictions():
    b = build_batch([[5, 6, 7], [5]], [[8, 9], [4, 4, 4]], pad_id=0, keep=[True, False])
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 4, 4, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # row 0: positions 2 and 3 predict tokens 8 and 9; row 1 is masked out (keep=False)
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]


def test_rollout_batch_logprobs_match_a_manual_forward(tiny_model, tiny_tokenizer):
    ids = torch.tensor([[5, 6, 7, 8]])
    rb = RolloutBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [[5]], [[6, 7, 8]], 1, 0, False,
                      "cpu", 4096)
    lp, ent = rb.logprobs(tiny_model, torch.tensor([0]), with_entropy=True)
    logits = tiny_model(input_ids=ids).logits[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(3), ids[0, 1:]]
    torch.testing.assert_close(lp[0], expected)
    assert ent.shape == (1, 3) and torch.all(ent > 0)


def short_is_better(**kw) -> GRPOConfig:
    base = dict(steps=24, prompts_per_step=4, group_size=8, learning_rate=3e-3, lora=LoraSpec(r=0),
                generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8),
                reward=RewardSpec(weights={"overlong": 1.0}, overlong_max_tokens=6, overlong_buffer=5),
                minibatch_size=16, checkpoint_every=100)
    base.update(kw)
    return GRPOConfig(**base)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    {"advantage": "grpo", "aggregation": "seq_mean"},
    {"advantage": "dr_grpo", "aggregation": "constant"},
    {"advantage": "grpo", "aggregation": "token_mean", "epsilon_high": 0.28, "dynamic_sampling": True, "mu": 2},
], ids=["grpo", "dr_grpo", "dapo"])
def test_mean_reward_rises(variant, tmp_path, tiny_model_input, digit_prompts):
    ctx = LocalContext(tmp_path / "run", seed=0)
    out = grpo.run(short_is_better(**variant), {"model": tiny_model_input, "prompts": digit_prompts}, ctx)["model"]
    curve = [m["reward/mean"] for step, m in ctx.metrics if step is not None and "reward/mean" in m]
    assert len(curve) == 24
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert last > first + 0.25, curve  # rewards live in [-1, 0]: a clear rise, not noise
    assert out.metrics["reward_last"] > out.metrics["reward_first"]
    assert (out.path / "model" / "model.safetensors").exists()


def test_kl_with_lora_reference_and_gspo_cispo_run(tmp_path, tiny_model_input, digit_prompts):
    for loss in ("gspo", "cispo"):
        ctx = LocalContext(tmp_path / loss)
        cfg = short_is_better(steps=2, policy_loss=loss, beta=0.1, lora=LoraSpec(r=4, alpha=8), eval_every=2,
                              eval_prompts=4)
        out = grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)["model"]
        logged = {k for _, m in ctx.metrics for k in m}
        for key in ("train/kl", "train/entropy", "train/clip_low", "reward/mean", "time/generation",
                    "time/scoring", "time/training", "eval/accuracy", "completion/truncated_frac"):
            assert key in logged, (loss, key)
        assert out.schema == "adapter"


def test_rollouts_sample_in_the_training_precision(tmp_path, tiny_model_input, digit_prompts, monkeypatch):
    """The rollout backend gets the stage's resolved precision (bf16 on a GPU with precision auto; bf16 asked for
    here, on the CPU), so fp32 master weights do not decode in fp32 while the training passes run in bf16."""
    made = []

    class Recording(grpo.TransformersBackend):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self.autocast_dtype)

    monkeypatch.setattr(grpo, "TransformersBackend", Recording)
    for precision, dtype in (("bf16", torch.bfloat16), ("auto", None)):  # auto on a CPU: fp32, no autocast
        grpo.run(short_is_better(steps=1, precision=precision), {"model": tiny_model_input, "prompts": digit_prompts},
                 LocalContext(tmp_path / precision))
        assert made[-1] == dtype, (precision, made)


def test_resume_after_crash_replays_the_same_steps(tmp_path, tiny_model_input, digit_prompts):
    """Rollouts are seeded by (seed, step) and the checkpoint restores weights, optimizer and RNG,
    so a run killed after step 4 (last checkpoint: 3) and resumed logs the same curve as an
    uninterrupted run and trains exactly steps 4-6."""
    from tests.test_sft import CrashingContext, SimulatedCrash

    cfg = short_is_better(steps=6, checkpoint_every=3)
    ref_ctx = LocalContext(tmp_path / "ref")
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ref_ctx)
    root = tmp_path / "crash"
    with pytest.raises(SimulatedCrash):
        grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, CrashingContext(root, crash_at=4))
    resumed = LocalContext(root)
    out = grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, resumed)["model"]

    def curve(ctx):
        return {s: m["reward/mean"] for s, m in ctx.metrics if s is not None and "reward/mean" in m}

    assert sorted(curve(resumed)) == list(range(1, 7))
    assert curve(resumed) == pytest.approx(curve(ref_ctx), abs=1e-6)
    assert out.metrics["steps"] == 6


def test_time_budget_stops_after_the_step_that_spends_it(tmp_path, tiny_model_input, digit_prompts, monkeypatch):
    """max_minutes: the loop's clock (stubbed: 7.5 s a call) passes 1.5 minutes within the first few steps, the
    last of them is checkpointed and the model is saved with their history, far short of steps=50."""
    clock = iter(range(10_000))
    monkeypatch.setattr(grpo.time, "perf_counter", lambda: 60.0 * next(clock) / 8)  # 7.5 s a call
    ctx = LocalContext(tmp_path / "budget")
    cfg = short_is_better(steps=50, max_minutes=1.5)
    out = grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)["model"]
    steps = sorted({s for s, m in ctx.metrics if s is not None and "reward/mean" in m})
    assert 1 <= len(steps) <= 3 and steps == list(range(1, len(steps) + 1))  # a step calls the clock ~10 times
    assert out.metrics["steps"] == len(steps)
    assert (ctx.checkpoint_dir / f"step-{len(steps):06d}").is_dir()
    assert (out.path / "model" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="max_minutes"):
        GRPOConfig(max_minutes=float("inf"))


# ---------------------------------------------------------------------------- sampler log-probs, process supervision


def test_place_puts_completion_values_where_loss_mask_is():
    b = build_batch([[5, 6, 7], [5]], [[8, 9], [4, 4, 4]], pad_id=0, keep=[True, True])
    placed = place([[0.1, 0.2], [0.3, 0.4, 0.5]], [3, 1], b["input_ids"].shape[1])
    assert torch.equal(placed != 0, b["loss_mask"].bool())
    torch.testing.assert_close(placed, torch.tensor([[0, 0, 0.1, 0.2], [0.3, 0.4, 0.5, 0]]))


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _LengthScorer:
    """A stand-in reward model: the reward of a prefix is its length in characters."""

    def __init__(self):
        self.calls = []

    def score(self, conversations, completions):
        self.calls.extend(completions)
        return [float(len(c)) for c in completions]


def test_process_advantages_hand_computed():
    """One group, newline steps (`steps.step_spans`): "a\\nbcd" has steps "a" (ends at token 0, prefix "a", reward
    1) and "bcd" (token 4, prefix "a\\nbcd", 5); "xy" one step (token 1, 2). Rewards [1, 5, 2]: mean 8/3,
    population std sqrt(78/27) = 1.699673, plus eps 1e-4: 1.699773; normalised -0.980523, 1.372732, -0.392209.
    Token 0 of the first gets -0.980523 + 1.372732 = 0.392209, its tokens 1-4 get 1.372732; both tokens of "xy"
    get -0.392209."""
    from stages.sampling.completions import Completion

    comps = [[Completion(t, len(t), "stop", tuple(ord(ch) for ch in t)) for t in ("a\nbcd", "xy")]]
    scorer = _LengthScorer()
    adv, metrics = process_rewards.process_advantages(scorer, _CharTokenizer(), [{"messages": []}], comps, "newline")
    assert scorer.calls == ["a", "a\nbcd", "xy"]
    torch.testing.assert_close(torch.tensor(adv[0]), torch.tensor([0.392209, 1.372732, 1.372732, 1.372732, 1.372732]),
                               atol=2e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(adv[1]), torch.full((2,), -0.392209), atol=2e-6, rtol=0)
    assert metrics["reward/steps_per_completion"] == 1.5
    assert metrics["reward/process_mean"] == pytest.approx(8 / 3)



class _ScriptedStepScorer:
    """A stand-in process reward model: blank-line steps, a scripted probability per step; records its calls."""

    def __init__(self, probs):
        self.probs, self.calls = probs, []

    def score_steps(self, conversations, completions):
        from stages.math.steps import step_spans

        self.calls.append(list(completions))
        return [([e for _, e in step_spans(c, "blank_line")], self.probs[c]) for c in completions]


def test_prm_process_advantages_place_each_step_score_on_its_last_token():
    """A group of "ab" "\\n\\n" "c" (steps "ab", ending at token 0, and "c", token 2; PRM 0.9 and 0.1) and
    "x\\n\\ny" in one token (two steps, both ending at token 0: the later score, 0.5, stands): the same advantages
    as the reward-model path given those ends and scores, from ONE scorer call over both whole completions."""
    from stages.sampling.completions import Completion

    vocab = ["ab", "\n\n", "c", "x\n\ny"]

    class PieceTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(vocab[i] for i in ids)

    comps = [[Completion("ab\n\nc", 3, "stop", (0, 1, 2)), Completion("x\n\ny", 1, "stop", (3,))]]
    scorer = _ScriptedStepScorer({"ab\n\nc": [0.9, 0.1], "x\n\ny": [0.2, 0.5]})
    got_adv, got_metrics = process_rewards.prm_process_advantages(scorer, PieceTokenizer(), [{"messages": []}], comps)
    assert scorer.calls == [["ab\n\nc", "x\n\ny"]]
    want_adv, want_metrics = process_rewards.step_advantages_of(comps, [[[0, 2], [0]]], [[[0.9, 0.1], [0.5]]])
    assert got_adv == want_adv and got_metrics == want_metrics
    assert got_metrics["reward/steps_per_completion"] == 1.5


def test_a_process_reward_model_needs_process_supervision(tmp_path, tiny_model_input, digit_prompts):
    with pytest.raises(ConfigError, match="process_reward_model input .* used only with process_coef > 0"):
        grpo.run(short_is_better(steps=1), {"model": tiny_model_input, "prompts": digit_prompts,
                                            "process_reward_model": fake_input(tmp_path, "model", "process_reward_model")},
                 LocalContext(tmp_path / "s"))

def test_sampler_logprobs_match_the_trainer_and_tis_weights_are_one(tmp_path, tiny_model_input, digit_prompts):
    """On CPU in fp32 the sampler's log-probs (the generation engine's teacher-forced pass, left
    padded) equal the trainer's (right padded, train mode) to rounding: every step logs the drift
    (sampler/logprob_delta_*: mean, p99, max, share above 0.1 nats), it is ~0, and every TIS weight is 1. A
    misaligned placement would show a drift of whole nats. Measured (2 steps): mean |delta| 2.2e-7 and 2.1e-7, p99
    and max 9.5e-7 and 4.8e-7 (fp32 rounding); the bounds (mean 1e-5, max 1e-4) leave about 50x and 100x for
    other CPUs' kernels, and no token is 0.1 apart."""
    ctx = LocalContext(tmp_path / "s")
    grpo.run(short_is_better(steps=2, old_logprobs="sampler", mu=2), {"model": tiny_model_input,
                                                                      "prompts": digit_prompts}, ctx)
    steps = [m for s, m in ctx.metrics if s is not None and "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        drift = [m[f"sampler/logprob_delta_{k}"] for k in ("mean", "p99", "max", "share_above_0.1")]
        assert all(d >= 0 for d in drift) and drift[0] <= drift[2] and drift[1] <= drift[2], drift
        assert drift[0] < 1e-5 and drift[2] < 1e-4 and drift[3] == 0.0, drift
        assert m["train/mismatch_kl"] < 1e-6
        assert m["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m["train/tis_clipped"] == 0.0


def _tiny_reward_model(root, tiny_tokenizer):
    from schemas.artifacts import MODEL_DIR
    from stages import reward_model as rm
    from stages.modeling.models import build_tiny_model, save_model

    torch.manual_seed(0)
    model = heads.reward_model_from_causal_lm(build_tiny_model(tiny_tokenizer, seed=1), tiny_tokenizer.eos_token_id)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    save_model(model, tiny_tokenizer, root / MODEL_DIR)
    return fake_input(root, "model", rm.OUTPUT_SCHEMA)


def test_process_supervision_and_reward_model_reward_run(tmp_path, tiny_model_input, digit_prompts, tiny_tokenizer):
    rm_input = _tiny_reward_model(tmp_path / "rm", tiny_tokenizer)
    cfg = short_is_better(steps=2, process_coef=0.5, step_delimiter="newline",
                          reward=RewardSpec(weights={"overlong": 1.0, "reward_model": 0.1}, overlong_max_tokens=6,
                                            overlong_buffer=5))
    ctx = LocalContext(tmp_path / "run")
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts, "reward_model": rm_input}, ctx)
    steps = [m for s, m in ctx.metrics if s is not None and "reward/mean" in m]
    assert all(m["reward/steps_per_completion"] >= 1 for m in steps)
    assert all("reward/reward_model" in m for m in steps)


def test_reward_model_needed_but_missing_fails_before_compute(tmp_path, tiny_model_input, digit_prompts):
    from schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="process_coef > 0 .*reward_model"):
        grpo.run(short_is_better(process_coef=1.0), {"model": tiny_model_input, "prompts": digit_prompts},
                 LocalContext(tmp_path / "x"))


def test_prefill_is_part_of_the_prompt_the_trainer_scores(tmp_path, tiny_model_input, digit_prompts):
    """With a prefill the trainer must rebuild the same prompt the sampler saw (prompt + prefill):
    the sampler's and the trainer's log-probs then agree to rounding, as without one."""
    from schemas.configs import GenerationSpec

    ctx = LocalContext(tmp_path / "pf")
    cfg = short_is_better(steps=1, old_logprobs="sampler",
                          generation=GenerationSpec(max_new_tokens=8, temperature=1.0, batch_size=8, prefill="<t>"))
    grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)
    (m,) = [m for s, m in ctx.metrics if s is not None and "sampler/logprob_delta_mean" in m]
    assert m["sampler/logprob_delta_mean"] < 1e-4


@pytest.mark.parametrize("lora_r", [0, 4])
def test_shared_prefix_logprobs_equal_whole_rows_in_value_and_gradient(tiny_tokenizer, lora_r):
    """Two groups of G=3 with prompts of different lengths (left padding inside the shared pass) and
    completions of different lengths, one empty: the prompt run once gives the same log-probs,
    entropies and parameter gradients as the G whole prompt+completion rows."""
    from stages.modeling import logprobs, models, prefix_sharing

    model = models.apply_lora(models.build_tiny_model(tiny_tokenizer, seed=1), LoraSpec(r=lora_r)).train()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    comps = [[20, 21, 22], [23], [24, 25, 26, 27], [28, 29], [], [30, 31, 32, 33, 34]]
    flat_prompts = [p for p in prompts for _ in range(3)]
    batch = build_batch(flat_prompts, comps, pad_id=0, keep=[True] * 6)
    mask = batch["loss_mask"]

    ref, ref_ent = logprobs.bucketed_token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                                    with_entropy=True)
    (ref * mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    assert prefix_sharing.can_share_prefix(model)
    rb = RolloutBatch(batch, prompts, comps, 3, 0, True, "cpu", 4096)
    got, ent = rb.logprobs(model, torch.arange(6), with_entropy=True)
    assert_matches_whole_rows(model, got, ent, ref, ref_ent, mask, ref_grads)


def test_minibatch_rows_keep_groups_whole_and_cover_every_row():
    g = torch.Generator().manual_seed(0)
    mbs = minibatch_rows(12, 3, 7, True, g)  # 7 // 3 = 2 groups per mini-batch
    assert [len(m) for m in mbs] == [6, 6]
    for m in mbs:
        rows = m.view(-1, 3)
        assert (rows[:, 1:] - rows[:, :-1] == 1).all() and (rows[:, 0] % 3 == 0).all()
    assert sorted(torch.cat(mbs).tolist()) == list(range(12))
    assert [len(m) for m in minibatch_rows(12, 3, 2, True, g)] == [3] * 4  # at least one group
    assert [len(m) for m in minibatch_rows(12, 3, 5, False, g)] == [5, 5, 2]


@pytest.mark.parametrize(("beta", "minibatch", "min_common", "path"),
                         [(0.0, 8, None, "auto"), (0.1, 8, None, "auto"), (0.0, 16, 1, "auto"),
                          (0.0, 16, 1, "kv-cache"), (0.0, 8, None, "checkpointing")],
                         ids=["per-group", "per-group-kl", "batch-wide-common", "batch-wide-common-kv-cache",
                              "packed-under-checkpointing"])
def test_prefix_sharing_trains_the_same_model(tmp_path, tiny_model_input, digit_prompts, beta, minibatch, min_common,
                                              path, monkeypatch):
    """Same rollouts, same updates: the metrics and final weights of a run with prefix sharing equal
    those of a run that computes every row whole, with and without a KL term, and with the prompts'
    common part (10 chat-template tokens here) run once per two-group mini-batch and once per
    generate() batch (`prefix_sharing.COMMON_PREFIX_MIN` lowered to reach it). Each tensor's total
    update must agree to 0.1% of its norm. Not element by element: Adam divides each gradient element by
    its own magnitude, so an element whose gradient is ~1e-9 moves by up to lr on float rounding alone
    (measured: single elements up to 4.2e-5 apart, 1.4% of one step's lr of 3e-3, while every tensor's
    update agrees to 1.1e-4 of its norm; a misplaced prefix or position differs by whole percents).
    For the same reason the KL term, a function of the policy-reference weight difference, is
    compared through the weights it moves, not as a metric. `path`: the tiny Llama packs prompts and
    completions in one decoder call where that costs less (auto); kv-cache: as a model that cannot be
    packed, through the KV cache; checkpointing: with gradient checkpointing on (no KV cache), packed."""
    from stages.modeling import models, prefix_sharing

    if min_common is not None:
        monkeypatch.setattr(prefix_sharing, "COMMON_PREFIX_MIN", min_common)
    if path == "kv-cache":
        monkeypatch.setattr(prefix_sharing, "can_pack_prefix", lambda m: False)
    used = []
    for name in ("packed_prefix_rows", "shared_prefix_logprobs"):
        real = getattr(prefix_sharing, name)
        monkeypatch.setattr(prefix_sharing, name, lambda *a, _r=real, _n=name, **k: used.append(_n) or _r(*a, **k))
    runs = {}
    for sharing in (True, False):
        used.clear()
        cfg = short_is_better(steps=3, beta=beta, prefix_sharing=sharing, minibatch_size=minibatch,
                              gradient_checkpointing=path == "checkpointing")
        ctx = LocalContext(tmp_path / f"run-{sharing}", seed=0)
        out = grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)["model"]
        curve = [(m["reward/mean"], m["train/loss"]) for step, m in ctx.metrics if step is not None and "train/loss" in m]
        if beta:  # step 1's reference is the policy itself: a misplaced shared reference pass would show a KL
            first_kl = next(m["train/kl"] for step, m in ctx.metrics if step == 1 and "train/kl" in m)
            assert abs(first_kl) < 1e-6
        if not sharing:
            assert used == []
        elif path == "kv-cache":
            assert set(used) == {"shared_prefix_logprobs"}
        else:
            assert set(used) == {"packed_prefix_rows"}  # the tiny model's calls cost more than packing
        model, _ = models.load_model(out.path / "model")
        runs[sharing] = (curve, {k: v.clone() for k, v in model.state_dict().items()})
    (curve_s, weights_s), (curve_u, weights_u) = runs[True], runs[False]
    assert len(curve_s) == 3
    torch.testing.assert_close(torch.tensor(curve_s), torch.tensor(curve_u), rtol=1e-4, atol=1e-5)
    initial = models.build_tiny_model(models.build_tiny_tokenizer(), seed=0).state_dict()
    moved = max(float((weights_u[k] - initial[k]).abs().max()) for k in weights_u)
    assert moved > 2.9e-3  # trained: Adam's first step alone moves every weight with a gradient by lr (3e-3)
    for k in weights_u:
        update = (weights_u[k] - initial[k]).norm()
        assert update > 0, k
        assert (weights_s[k] - weights_u[k]).norm() <= 1e-3 * update, k


def test_minibatch_share_hand_computed():
    """A step of 3 sequences with 2, 3 and 5 completion tokens whose per-token losses are 1, 2 and 1 (row sums 2, 6,
    5), split into mini-batches {0, 1} and {2}. Whole step: seq_mean (1 + 2 + 1) / 3 = 4/3; token_mean 13 / 10 = 1.3;
    constant (max_tokens 5) 13 / 15. Mini-batch {0, 1}: seq_mean 1.5 with share 2/3 (of the sequences) -> 1.0, and
    {2}: 1 with share 1/3 -> 1/3, 4/3 in all; token_mean (8 / 5) * 5/10 (of the tokens) + (5 / 5) * 5/10 = 1.3;
    constant (8 / 10) * 2/3 + (5 / 5) * 1/3 = 13/15."""
    from stages.math import rl

    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    loss = torch.tensor([[1.0] * 5, [2.0] * 5, [1.0] * 5]) * mask
    assert rl.minibatch_share("seq_mean", 2, 5.0, 3, 10.0) == pytest.approx(2 / 3)
    assert rl.minibatch_share("constant", 1, 5.0, 3, 10.0) == pytest.approx(1 / 3)
    assert rl.minibatch_share("token_mean", 2, 5.0, 3, 10.0) == pytest.approx(0.5)
    for kind, whole in (("seq_mean", 4 / 3), ("token_mean", 1.3), ("constant", 13 / 15)):
        torch.testing.assert_close(rl.aggregate(loss, mask, kind, max_tokens=5), torch.tensor(whole))
        split = sum(rl.aggregate(loss[idx], mask[idx], kind, max_tokens=5)
                    * rl.minibatch_share(kind, len(idx), float(mask[idx].sum()), 3, 10.0) for idx in ([0, 1], [2]))
        torch.testing.assert_close(split, torch.tensor(whole))
    with pytest.raises(ValueError, match="unknown aggregation"):
        rl.minibatch_share("mean", 1, 1.0, 1, 1.0)


MIXED_ADV = (1.0, -0.5, 0.25, -0.75, 0.6, -1.2, 0.3, 0.3)


def _one_update(tmp_path, tiny_tokenizer, aggregation: str, minibatch_size: int, shared: bool,
                adv: tuple[float, ...] = MIXED_ADV, seen: list | None = None) -> dict[str, torch.Tensor]:
    """The parameter change of one grpo update (mu 1, SGD with lr 1: minus the accumulated gradient) of the tiny
    model on 8 fixed rows (2 groups of 4, completions of 1 to 7 tokens, mixed-sign advantages by default); the
    rows each forward pass ran are appended to `seen`."""
    from stages.modeling import models
    from stages.runtime import distributed
    from stages.training.rollout_batch import RolloutBatch
    from stages.training.rollouts import build_batch

    model = models.build_tiny_model(tiny_tokenizer, seed=0).train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 3)]
    comps = [torch.randint(3, 60, (1 + (3 * i) % 7,), generator=g).tolist() for i in range(8)]
    batch = build_batch([prompts[i // 4] for i in range(8)], comps, pad_id=0)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, minibatch_size=minibatch_size, aggregation=aggregation,
                     max_grad_norm=1e9, learning_rate=1.0, lora=LoraSpec(r=0),
                     generation=GenerationSpec(max_new_tokens=8))
    trainable = list(model.parameters())
    s = grpo.Session(cfg, LocalContext(tmp_path, seed=0), distributed.SINGLE, model, None, None, trainable,
                     torch.optim.SGD(trainable, lr=1.0), None, tiny_tokenizer, 0, None, [], [], None, False)
    rb = RolloutBatch(batch, prompts, comps, 4, 0, shared, "cpu", 4096)
    if seen is not None:
        forward = rb.logprobs
        rb.logprobs = lambda net, idx, **kw: (seen.append(sorted(idx.tolist())), forward(net, idx, **kw))[1]
    u = grpo.Update(torch.tensor(adv), 8, batch, rb, shared, old_logp=torch.zeros_like(batch["loss_mask"]))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    grpo.update(s, u, step=0)
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean", "constant"])
@pytest.mark.parametrize(("minibatch_size", "shared"), [(3, False), (4, True)], ids=["rows-3-3-2", "one-group-each"])
def test_minibatches_leave_the_update_unchanged(tmp_path, tiny_tokenizer, aggregation, minibatch_size, shared):
    """One update over the step's 8 rows at once equals the same update in mini-batches (of 3, 3 and 2 rows, or of
    one group each through the shared-prefix path), within fp32 rounding: the mini-batches of an epoch accumulate
    into one optimizer step, each weighted by `rl.minibatch_share`."""
    whole = _one_update(tmp_path / "whole", tiny_tokenizer, aggregation, 8, shared)
    split = _one_update(tmp_path / "split", tiny_tokenizer, aggregation, minibatch_size, shared)
    assert max(float(d.abs().max()) for d in whole.values()) > 1e-3  # the update moved the weights
    for k in whole:
        torch.testing.assert_close(split[k], whole[k])


def test_signal_rows_keeps_whole_groups_with_a_nonzero_advantage():
    """Groups of 3: per-sequence advantages [0 0 0 | 0 .5 -.5 | 0 0 0] keep rows 3-5 only. Per token (process
    supervision): a non-zero advantage counts only at a masked (completion) position, so group 0's 2.0 on a prompt
    position keeps nothing and group 2's -1.0 on a completion position keeps rows 6-8."""
    from stages.training.rollout_batch import signal_rows

    adv = torch.tensor([0.0, 0, 0, 0, 0.5, -0.5, 0, 0, 0])
    assert signal_rows(adv, torch.ones(9, 4), 3).tolist() == [3, 4, 5]
    per_token = torch.zeros(9, 4)
    mask = torch.zeros(9, 4)
    mask[:, 2:] = 1
    per_token[0, 0] = 2.0  # a prompt position
    per_token[8, 3] = -1.0
    assert signal_rows(per_token, mask, 3).tolist() == [6, 7, 8]
    assert signal_rows(torch.zeros(6), torch.ones(6, 2), 3).tolist() == []


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
@pytest.mark.parametrize(("minibatch_size", "shared"), [(3, False), (4, True)], ids=["rows-3", "one-group-each"])
def test_flat_groups_skip_their_passes_and_leave_the_update_unchanged(tmp_path, tiny_tokenizer, monkeypatch,
                                                                      aggregation, minibatch_size, shared):
    """Without a KL term a group whose advantages are all 0 adds exactly 0 to the loss, so the update skips its
    forward and backward passes: with group 1 flat only rows 0-3 run, and the parameter change equals the update
    that ran all 8 rows (the normalisers still count the flat group's rows and tokens). When every group is flat,
    one group still runs (zero gradients, so the optimizer steps as before)."""
    adv = (1.0, -0.5, 0.25, -0.75, 0.0, 0.0, 0.0, 0.0)
    seen: list = []
    skipped = _one_update(tmp_path / "skip", tiny_tokenizer, aggregation, minibatch_size, shared, adv, seen)
    assert sorted(r for rows in seen for r in rows) == [0, 1, 2, 3]
    with monkeypatch.context() as m:
        m.setattr(grpo, "trained_rows", lambda u, group_size: torch.arange(u.n))
        every: list = []
        full = _one_update(tmp_path / "all", tiny_tokenizer, aggregation, minibatch_size, shared, adv, every)
    assert sorted(r for rows in every for r in rows) == list(range(8))
    assert max(float(d.abs().max()) for d in full.values()) > 1e-3
    for k in full:
        torch.testing.assert_close(skipped[k], full[k])
    seen.clear()
    flat = _one_update(tmp_path / "flat", tiny_tokenizer, aggregation, minibatch_size, shared, (0.0,) * 8, seen)
    assert sorted(r for rows in seen for r in rows) == [0, 1, 2, 3]
    assert max(float(d.abs().max()) for d in flat.values()) == 0.0
