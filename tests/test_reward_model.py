"""Reward model: the Bradley-Terry loss against hand-worked numbers, pooling at the last real
token, then the stage on the tiny model (held-out accuracy, crash + resume, the accumulation
invariant, LoRA merge, adapter input) and `RewardScorer` on the saved artifact."""

import random

import pytest
import torch

from schemas.configs import LoraSpec, RewardModelConfig
from schemas.datasets import from_rows
from schemas.errors import ModelError, SchemaError
from stages import reward_model as rm
from stages import sft
from stages.base import Input, LocalContext, write_dataset
from stages.math import supervised
from stages.modeling import heads, logprobs
from stages.training import checkpoints, pairs
from tests.conftest import fake_input
from tests.test_sft import CrashingContext, SimulatedCrash

# ---------------------------------------------------------------------------- pure math


def test_bt_loss_hand_computed():
    """r_c = [2, 0], r_r = [0, 0]: -log σ(2) = log(1 + e^-2) = 0.126928, -log σ(0) = log 2 =
    0.693147; mean 0.410038. With margin [1, 0]: -log σ(1) = 0.313262 → mean 0.503205."""
    r_c, r_r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    torch.testing.assert_close(supervised.bt_loss(r_c, r_r), torch.tensor((0.126928 + 0.693147) / 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(supervised.bt_loss(r_c, r_r, margin=torch.tensor([1.0, 0.0])),
                               torch.tensor((0.313262 + 0.693147) / 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(supervised.bt_loss(r_c, r_r, margin=torch.zeros(2)), supervised.bt_loss(r_c, r_r))


def test_bt_loss_gradient_pushes_chosen_up_and_rejected_down():
    """d/dr_c of -log σ(r_c - r_r) = -σ(r_r - r_c) / B: at r_c = r_r that is -0.5 / 2 = -0.25."""
    r_c = torch.tensor([0.0, 1.0], requires_grad=True)
    r_r = torch.tensor([0.0, 3.0], requires_grad=True)
    supervised.bt_loss(r_c, r_r).backward()
    assert torch.all(r_c.grad < 0) and torch.all(r_r.grad > 0)
    torch.testing.assert_close(r_c.grad[0], torch.tensor(-0.25))
    torch.testing.assert_close(r_r.grad, -r_c.grad)


def test_pairwise_accuracy_counts_ties_as_wrong():
    assert supervised.pairwise_accuracy(torch.tensor([1.0, 2.0, 0.0, 5.0]), torch.tensor([0.0, 3.0, 0.0, 4.0])) == 0.5


def test_last_token_index_from_the_mask_for_either_padding_side():
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]])
    assert heads.last_token_index(right).tolist() == [2, 0, 3]
    assert heads.last_token_index(left).tolist() == [3, 3]
    with pytest.raises(ValueError, match="no real token"):
        heads.last_token_index(torch.tensor([[0, 0]]))


def test_split_is_seeded_disjoint_and_complete():
    train, held = pairs.split_pairs(50, 0.2, seed=3)
    assert len(held) == 10 and sorted(train + held) == list(range(50))
    assert pairs.split_pairs(50, 0.2, seed=3) == (train, held)
    assert pairs.split_pairs(50, 0.2, seed=4)[1] != held
    assert pairs.split_pairs(5, 0.01, seed=0)[1] != []  # any positive fraction holds out at least one
    assert pairs.split_pairs(5, 0.0, seed=0) == ([0, 1, 2, 3, 4], [])


# ---------------------------------------------------------------------------- formatting and pooling

PROMPT = [{"role": "user", "content": "What is 2+3?"}]


def test_format_sequence_is_prompt_completion_eos_and_cuts_from_the_left(tiny_tokenizer):
    ids = heads.format_sequence(tiny_tokenizer, PROMPT, "<answer>5</answer>", max_length=512)
    text = tiny_tokenizer.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<answer>5</answer><|im_end|>"
    short = heads.format_sequence(tiny_tokenizer, PROMPT, "<answer>5</answer>", max_length=8)
    assert short == ids[-8:] and short[-1] == tiny_tokenizer.eos_token_id
    with pytest.raises(SchemaError, match="assistant"):
        heads.format_sequence(tiny_tokenizer, PROMPT + [{"role": "assistant", "content": "x"}], "y", 512)


@pytest.fixture()
def tiny_rm(tiny_model, tiny_tokenizer):
    torch.manual_seed(0)
    model = heads.reward_model_from_causal_lm(tiny_model, tiny_tokenizer.eos_token_id).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a visible head, so rewards differ clearly
    return model


def test_pooling_reads_the_last_real_token_even_when_pad_is_eos(tiny_rm, tiny_tokenizer):
    """Pad with EOS (as SmolLM2 does: pad == eos == <|im_end|>, which also closes the user turn
    inside every sequence). Batched rewards equal the rewards of each sequence alone; rewriting
    the padding changes nothing; changing the last real token changes that row's reward."""
    eos = tiny_tokenizer.eos_token_id
    seqs = [heads.format_sequence(tiny_tokenizer, PROMPT, c, 512) for c in ("5", "<answer>5</answer>", "it is five")]
    assert eos in seqs[0][:-1]  # EOS inside the text: pad-id detection would stop there or skip the end
    ids, mask = logprobs.right_padded(seqs, pad_id=eos)
    with torch.no_grad():
        batched = heads.pooled_rewards(tiny_rm, ids, mask)
        alone = torch.cat([heads.pooled_rewards(tiny_rm, *logprobs.right_padded([s], eos)) for s in seqs])
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)

        scrambled = ids.clone()
        scrambled[mask == 0] = torch.randint(10, 100, (int((mask == 0).sum()),))
        torch.testing.assert_close(heads.pooled_rewards(tiny_rm, scrambled, mask), batched)

        changed = ids.clone()
        last = heads.last_token_index(mask)
        changed[0, last[0]] = tiny_tokenizer.convert_tokens_to_ids("x")
        after = heads.pooled_rewards(tiny_rm, changed, mask)
        assert not torch.isclose(after[0], batched[0], atol=1e-4)
        torch.testing.assert_close(after[1:], batched[1:])


def test_a_model_without_a_score_head_is_refused(tiny_model):
    ids, mask = logprobs.right_padded([[5, 6, 7]], 0)
    with pytest.raises(ModelError, match="no `score` head"):
        heads.pooled_rewards(tiny_model, ids, mask)


# ---------------------------------------------------------------------------- the stage on the tiny model


def _arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """'What is a+b?' → chosen: a well-formed R1 completion with the correct sum; rejected: a wrong
    sum in one of three broken formats (no tags, no <think>, no <answer>), as failed samples look.

    Correct-vs-wrong sum in the *same* format is not learnable by a 2-layer, width-64 model from
    160 pairs (it would have to learn addition; measured ~55% held out), so the learnable signal
    here is the format + well-formedness the R1 recipe prefers.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        right = a + b
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3]) if right > 3 else right + 1
        rejected = [f"{a}+{b}={wrong}. The answer is {wrong}.", f"<answer>{wrong}</answer>",
                    f"<think>\n{a}+{b}={wrong}\n</think>\n{wrong}"][i % 3]
        rows.append({"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {a}+{b}?"}],
                     "chosen": f"<think>\n{a}+{b}={right}\n</think>\n<answer>{right}</answer>",
                     "rejected": rejected, "chosen_score": 1.0, "rejected_score": 0.0, "source": "test"})
    return rows


def _preferences(root, rows) -> Input:
    out = write_dataset(LocalContext(root), "p", from_rows(rows, "preferences"), "preferences")
    return fake_input(out.path, "dataset", "preferences", len(rows))


@pytest.fixture(scope="module")
def pair_rows():
    return _arithmetic_pairs(200)


@pytest.fixture(scope="module")
def rm_inputs(tmp_path_factory, tiny_model_input, pair_rows):
    return {"model": tiny_model_input, "preferences": _preferences(tmp_path_factory.mktemp("prefs"), pair_rows)}


def _cfg(**kw):
    base = dict(max_steps=60, batch_size=16, learning_rate=3e-3, warmup_ratio=0.1, max_length=128,
                lr_scheduler="cosine", checkpoint_every=20, lora=LoraSpec(r=0))
    base.update(kw)
    return RewardModelConfig(**base)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, rm_inputs):
    ctx = LocalContext(tmp_path_factory.mktemp("rm-run"))
    return rm.run(_cfg(), rm_inputs, ctx)["model"], ctx


def test_reaches_90_percent_held_out_pairwise_accuracy(trained):
    out, ctx = trained
    m = out.metrics
    assert (m["pairs_train"], m["pairs_eval"]) == (160, 40)
    assert m["eval_accuracy"] > 0.9, m
    assert m["eval_margin"] > 0 and m["reward_std"] > 0
    curve = [(s, x) for s, x in ctx.metrics if s is not None]
    assert len(curve) == 60 and {"train/loss", "train/accuracy", "train/lr"} <= set(curve[0][1])
    assert m["train_loss_final"] < 0.5 * curve[0][1]["train/loss"]
    assert out.schema == "reward_model" and (out.path / "model" / "model.safetensors").exists()


def test_saved_artifact_scores_held_out_chosen_above_rejected(trained, pair_rows):
    out, ctx = trained
    scorer = heads.RewardScorer.from_input(fake_input(out.path, "model", "reward_model"))
    _, held = pairs.split_pairs(len(pair_rows), _cfg().eval_fraction, ctx.seed)
    rows = [pair_rows[i] for i in held]
    convs = [r["messages"] for r in rows]
    chosen = scorer.score(convs, [r["chosen"] for r in rows], batch_size=7)
    rejected = scorer.score(convs, [r["rejected"] for r in rows], batch_size=7)
    accuracy = sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(rows)
    assert accuracy == pytest.approx(out.metrics["eval_accuracy"])  # the reloaded model is the trained one
    assert sum(chosen) / len(chosen) - sum(rejected) / len(rejected) == pytest.approx(out.metrics["eval_margin"], rel=1e-4)
    assert scorer.score([], []) == []


def test_a_reward_model_input_keeps_training_its_head(trained, rm_inputs, tmp_path):
    """Continuing from a reward-model artifact starts where it left off (not from a fresh head:
    a fresh head starts at loss ≈ log 2 = 0.69)."""
    out, _ = trained
    ctx = LocalContext(tmp_path / "more")
    inputs = {"model": fake_input(out.path, "model", "reward_model"), "preferences": rm_inputs["preferences"]}
    rm.run(_cfg(max_steps=2, learning_rate=1e-4), inputs, ctx)
    assert _losses(ctx)[1] < 0.05


def test_scorer_refuses_a_plain_causal_lm(tiny_model_input):
    with pytest.raises(ModelError, match="not a reward model"):
        heads.RewardScorer.from_dir(tiny_model_input.model_dir)


def test_no_pairs_or_too_few_to_split_fail_naming_the_artifact(tmp_path, tiny_model_input):
    empty = _preferences(tmp_path / "e", [])
    with pytest.raises(SchemaError, match=f"{empty.fingerprint[:12]}.*no preference pairs"):
        rm.run(_cfg(), {"model": tiny_model_input, "preferences": empty}, LocalContext(tmp_path / "r1"))
    one = _preferences(tmp_path / "o", _arithmetic_pairs(1))
    with pytest.raises(SchemaError, match="too few"):
        rm.run(_cfg(), {"model": tiny_model_input, "preferences": one}, LocalContext(tmp_path / "r2"))


def test_margin_comes_from_the_scores_when_both_are_known(tiny_tokenizer):
    rows = _arithmetic_pairs(3)
    rows[0]["chosen_score"], rows[0]["rejected_score"] = 0.9, 0.2
    rows[1]["rejected_score"] = None
    margins = [p.margin for p in rm.tokenize_pairs(rows, tiny_tokenizer, _cfg(margin=True))]
    assert margins == pytest.approx([0.7, 0.0, 1.0])
    assert [p.margin for p in rm.tokenize_pairs(rows, tiny_tokenizer, _cfg())] == [0.0, 0.0, 0.0]


def _losses(ctx):
    return {step: m["train/loss"] for step, m in ctx.metrics if step is not None and "train/loss" in m}


def test_resume_after_crash_trains_exactly_the_remaining_steps(rm_inputs, tmp_path):
    """Crash after step 5 with checkpoints every 2: resume from step 4, redo 5-6, and match the
    uninterrupted run step for step."""
    cfg = _cfg(max_steps=6, checkpoint_every=2, margin=True)
    ref_ctx = LocalContext(tmp_path / "ref")
    ref = rm.run(cfg, rm_inputs, ref_ctx)["model"]
    root = tmp_path / "crash"
    with pytest.raises(SimulatedCrash):
        rm.run(cfg, rm_inputs, CrashingContext(root, crash_at=5))
    assert checkpoints.latest_checkpoint(root / "checkpoints").name == "step-000004"

    resumed_ctx = LocalContext(root)
    out = rm.run(cfg, rm_inputs, resumed_ctx)["model"]
    assert out.metrics["resumed_from_step"] == 4 and out.metrics["trained_steps"] == 2
    resumed, reference = _losses(resumed_ctx), _losses(ref_ctx)
    assert sorted(resumed) == list(range(1, 7))
    for step in (5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step
    assert out.metrics["eval_accuracy"] == ref.metrics["eval_accuracy"]
    assert out.metrics["eval_margin"] == pytest.approx(ref.metrics["eval_margin"], rel=1e-4, abs=1e-5)


def test_accumulation_invariant(rm_inputs, tmp_path):
    """batch 4 × accumulation 1 and batch 2 × accumulation 2 see the same pairs per step and
    average over the same pairs, so the loss curves match."""
    a, b = LocalContext(tmp_path / "a"), LocalContext(tmp_path / "b")
    rm.run(_cfg(max_steps=3, batch_size=4, grad_accum=1), rm_inputs, a)
    rm.run(_cfg(max_steps=3, batch_size=2, grad_accum=2), rm_inputs, b)
    la, lb = _losses(a), _losses(b)
    assert len(la) == 3
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-4), step


def test_lora_on_an_adapter_input_saves_merged_weights_that_score_as_trained(rm_inputs, pair_rows, tiny_model_input,
                                                                             tmp_path):
    """Input: an SFT LoRA adapter (resolved against its base). Output: full merged weights whose
    rewards, reloaded by RewardScorer, equal the rewards the stage measured before merging."""
    adapter_out = sft.run(
        sft.SFTConfig(max_steps=1, batch_size=2, max_length=64, lora=LoraSpec(r=4, alpha=8)),
        {"model": tiny_model_input, "data": _sft_data(tmp_path)}, LocalContext(tmp_path / "sft"))["model"]
    assert adapter_out.schema == "adapter"
    adapter = fake_input(adapter_out.path, "model", "adapter")
    inputs = {"model": Input(adapter.path, adapter.manifest, base=tiny_model_input),
              "preferences": rm_inputs["preferences"]}
    ctx = LocalContext(tmp_path / "rm")
    out = rm.run(_cfg(max_steps=4, lora=LoraSpec(r=4, alpha=8, merge=False)), inputs, ctx)["model"]
    assert ctx.params["trainable_parameters"] < ctx.params["total_parameters"] / 5
    model_dir = out.path / "model"
    assert (model_dir / "model.safetensors").exists() and not (model_dir / "adapter_config.json").exists()
    scorer = heads.RewardScorer.from_dir(model_dir)
    held = [pair_rows[i] for i in pairs.split_pairs(len(pair_rows), 0.2, ctx.seed)[1]]
    convs = [r["messages"] for r in held]
    margin = (torch.tensor(scorer.score(convs, [r["chosen"] for r in held]))
              - torch.tensor(scorer.score(convs, [r["rejected"] for r in held]))).mean()
    assert float(margin) == pytest.approx(out.metrics["eval_margin"], rel=1e-3, abs=1e-4)


def _sft_data(tmp_path) -> Input:
    rows = [{"id": str(i), "source": "t", "metadata": "{}", "messages": [
        {"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"<answer>{i + 1}</answer>"}]}
        for i in range(4)]
    out = write_dataset(LocalContext(tmp_path / "sd"), "d", from_rows(rows, "sft"), "sft")
    return fake_input(out.path, "dataset", "sft", 4)

