"""SFT: the pure pieces against hand-worked numbers, then the stage on the tiny model
(learning, loss masking, the accumulation invariant, crash + resume)."""

import math

import pytest
import torch
import torch.nn.functional as F

from schemas.configs import LoraSpec, SFTConfig
from schemas.datasets import from_rows
from stages import sft
from stages.base import LocalContext, write_dataset
from stages.math import supervised
from stages.training import checkpoints, optim, sequences
from tests.conftest import fake_input

IG = supervised.IGNORE


def test_masked_token_loss_hand_computed():
    """Vocabulary of 2, sequence of 3. Uniform logits at position 0 → CE ln 2 for label[1];
    position 1 predicts label[2] which is IGNORE → contributes nothing. Sum = ln 2, count = 1."""
    logits = torch.tensor([[[0.0, 0.0], [5.0, -5.0], [1.0, 2.0]]])
    labels = torch.tensor([[IG, 1, IG]])
    loss, n = supervised.masked_token_loss(logits, labels)
    assert n == 1
    torch.testing.assert_close(loss, torch.tensor(math.log(2.0)))


def test_prompt_positions_contribute_nothing_numerically():
    """Scrambling the logits at every position whose next token is a prompt token leaves loss and
    gradient of the completion positions unchanged, and the scrambled positions get zero gradient."""
    torch.manual_seed(0)
    labels = torch.tensor([[IG, IG, IG, 4, 2, 7]])  # 3 prompt tokens, 3 completion tokens
    logits = torch.randn(1, 6, 10, requires_grad=True)
    loss, n = supervised.masked_token_loss(logits, labels)
    loss.backward()
    assert n == 3
    expected = F.cross_entropy(logits[0, 2:5].detach(), labels[0, 3:6], reduction="sum")
    torch.testing.assert_close(loss.detach(), expected)
    assert torch.all(logits.grad[0, :2] == 0) and torch.all(logits.grad[0, 5] == 0)
    scrambled = logits.detach().clone()
    scrambled[0, :2] = torch.randn(2, 10) * 100
    torch.testing.assert_close(supervised.masked_token_loss(scrambled, labels)[0], loss.detach())


def test_tokenize_conversation_labels_only_the_assistant_turn(tiny_tokenizer):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n<answer>4</answer>"}]
    ex = sequences.tokenize_conversation(tiny_tokenizer, msgs, max_length=512)
    assert len(ex.input_ids) == len(ex.labels)
    labelled = [t for t in ex.labels if t != IG]
    text = tiny_tokenizer.decode(labelled)
    assert text.startswith("<think>\nadd\n</think>\n<answer>4</answer><|im_end|>")
    prompt_part = tiny_tokenizer.decode([t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab == IG])
    assert "2+2?" in prompt_part and "<answer>" not in prompt_part
    short = sequences.tokenize_conversation(tiny_tokenizer, msgs, max_length=10)
    assert len(short.input_ids) == 10 and all(lab == IG for lab in short.labels)


@pytest.mark.parametrize(
    "step, kind, expected",
    [(0, "cosine", 0.25), (3, "cosine", 1.0), (4, "cosine", 1.0), (14, "cosine", 0.5), (24, "cosine", 0.0),
     (14, "linear", 0.5), (20, "constant", 1.0)],
)
def test_lr_factor(step, kind, expected):
    """total 24 steps, warmup 4: step 0 → 1/4; after warmup progress = (step-4)/20; cosine at
    progress 0.5 → 0.5; linear at 0.5 → 0.5; at progress 1 both reach 0."""
    assert optim.lr_factor(step, 24, 4, kind) == pytest.approx(expected)


def test_micro_batches_cover_each_epoch_exactly_once_and_are_seeded():
    n, bs = 10, 3
    epoch0 = [i for m in range(4) for i in optim.micro_batch_indices(n, bs, seed=1, micro_step=m)]
    assert sorted(epoch0) == list(range(10))
    assert optim.micro_batch_indices(n, bs, 1, 4) != optim.micro_batch_indices(n, bs, 1, 0) or n < bs
    assert optim.micro_batch_indices(n, bs, 1, 5) == optim.micro_batch_indices(n, bs, 1, 5)
    assert optim.micro_batch_indices(n, bs, 2, 0) != optim.micro_batch_indices(n, bs, 1, 0)


def test_collate_pads_right_and_leaves_the_examples_alone():
    a, b = sequences.Example([5, 6, 7], [IG, 6, 7]), sequences.Example([8], [IG])
    batch = sequences.collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IG, 6, 7], [IG, IG, IG]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    batch["input_ids"].fill_(1)  # the batch is a copy of the examples' cached tensors, not a view
    assert sequences.collate([b, a], pad_id=9)["input_ids"].tolist() == [[8, 9, 9], [5, 6, 7]]


def test_pack_keeps_labels_aligned():
    exs = [sequences.Example([1, 2, 3], [IG, 2, 3]), sequences.Example([4, 5], [IG, 5]), sequences.Example([6, 7, 8, 9], [IG, 7, 8, 9])]
    blocks = sequences.pack(exs, max_length=5)
    assert [b.input_ids for b in blocks] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert blocks[0].labels == [IG, 2, 3, IG, 5]
    assert [b.segments for b in blocks] == [(3, 2), (4,)]
    # an example whose first token is labelled: in a block nothing may predict it from the example before
    labelled = sequences.pack([sequences.Example([1, 2], [1, 2]), sequences.Example([3, 4], [3, 4])], max_length=8)
    assert labelled[0].labels == [1, 2, IG, 4] and labelled[0].segments == (2, 2)


def test_block_attention_hand_computed():
    """Segments (2, 3) in a row of width 6 (one padding column) and an unpacked example of 4: each token sees
    its own example up to itself; positions restart per example; padding is its own segment."""
    packed = sequences.Example([1, 2, 3, 4, 5], [IG] * 5, (2, 3))
    alone = sequences.Example([6, 7, 8, 9], [IG] * 4)
    mask, pos = sequences.block_attention([packed, alone], 6)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]]
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 0],
                                         [0, 0, 1, 0, 0, 0],
                                         [0, 0, 1, 1, 0, 0],
                                         [0, 0, 1, 1, 1, 0],
                                         [0, 0, 0, 0, 0, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 0],
                                         [1, 1, 1, 0, 0, 0],
                                         [1, 1, 1, 1, 0, 0],
                                         [0, 0, 0, 0, 1, 0],
                                         [0, 0, 0, 0, 1, 1]]
    batch = sequences.collate([packed, alone], pad_id=0, blocked=True)
    assert torch.equal(batch["block_mask"], mask[:, :, :5, :5]) and torch.equal(batch["position_ids"], pos[:, :5])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]  # counts real tokens
    assert "block_mask" not in sequences.collate([packed, alone], pad_id=0)  # not blocked unless asked
    assert "block_mask" not in sequences.collate([alone], pad_id=0, blocked=True)  # nothing packed: plain rows


def test_a_blocked_pack_trains_as_its_examples_alone(tiny_tokenizer):
    """Three conversations packed in one row with the block mask give each labelled token the log-prob it
    has in its conversation's own row, and the summed loss the same parameter gradients; without the
    block mask (attention across examples) the log-probs differ."""
    from stages.modeling import logprobs, models

    model = models.build_tiny_model(tiny_tokenizer, seed=4).train()
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in (("hi", "yes"), ("what is 2+2", "4"), ("go", "a longer answer"))]
    exs = [sequences.tokenize_conversation(tiny_tokenizer, c, 128) for c in convs]
    (block,) = sequences.pack(exs, max_length=512)

    def loss_and_grads(batch):
        model.zero_grad()
        labels = batch["labels"][:, 1:]
        logp, _ = logprobs.token_logprobs(model, batch["input_ids"], batch.get("block_mask", batch["attention_mask"]),
                                          targets=labels.clamp(min=0), positions=labels != IG,
                                          position_ids=batch.get("position_ids"))
        (-(logp * (labels != IG)).sum()).backward()
        return logp[labels != IG].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    alone = [loss_and_grads(sequences.collate([e], pad_id=1)) for e in exs]
    want_logp = torch.cat([lp for lp, _ in alone])
    got_logp, got_grads = loss_and_grads(sequences.collate([block], pad_id=1, blocked=True))
    torch.testing.assert_close(got_logp, want_logp, rtol=1e-5, atol=1e-5)
    for name, g in got_grads.items():
        want = sum(grads[name] for _, grads in alone)
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)
    crossed, _ = loss_and_grads(sequences.collate([block], pad_id=1))
    assert not torch.allclose(crossed, want_logp, atol=1e-3)


def test_packing_blocks_attention_in_the_stage_or_warns(sft_inputs, tmp_path, monkeypatch, caplog):
    """The stage packs with the block mask on the tiny Llama (every micro-batch of packed rows carries it);
    a model that cannot take it trains with attention across examples and says so."""
    from stages.modeling import prefix_sharing

    seen = []
    real = sequences.collate
    monkeypatch.setattr(sft, "collate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    sft.run(_cfg(max_steps=2, packing=True, max_length=256), sft_inputs, LocalContext(tmp_path / "blocked"))
    assert seen and all("block_mask" in b for b in seen)
    seen.clear()
    monkeypatch.setattr(prefix_sharing, "can_pack_prefix", lambda m: False)
    with caplog.at_level("WARNING", logger="stages.sft"):
        sft.run(_cfg(max_steps=2, packing=True, max_length=256), sft_inputs, LocalContext(tmp_path / "crossed"))
    assert seen and not any("block_mask" in b for b in seen)
    assert "attend to the examples before them" in caplog.text


# ---------------------------------------------------------------------------- the stage on the tiny model


@pytest.fixture()
def sft_inputs(tmp_path, tiny_model_input):
    """A learnable set: 'say X' → the R1-format answer X."""
    rows = []
    for i in range(24):
        word = "abcdefgh"[i % 8] * (1 + i % 3)
        rows.append({"id": str(i), "source": "test", "metadata": "{}", "messages": [
            {"role": "user", "content": f"say {word}"},
            {"role": "assistant", "content": f"<think>\n</think>\n<answer>{word}</answer>"}]})
    out = write_dataset(LocalContext(tmp_path / "data"), "d", from_rows(rows, "sft"), "sft")
    return {"model": tiny_model_input, "data": fake_input(out.path, "dataset", "sft", 24)}


def _cfg(**kw):
    base = dict(max_steps=12, batch_size=4, learning_rate=3e-3, warmup_ratio=0.0, max_length=128,
                checkpoint_every=4, lora=LoraSpec(r=0), lr_scheduler="constant")
    base.update(kw)
    return SFTConfig(**base)


def test_loss_curve_decreases(sft_inputs, tmp_path):
    ctx = LocalContext(tmp_path / "run")
    out = sft.run(_cfg(max_steps=30), sft_inputs, ctx)["model"]
    losses = [m["train/loss"] for step, m in ctx.metrics if step is not None and "train/loss" in m]
    assert len(losses) == 30
    assert out.metrics["final_loss"] < 0.6 * losses[0]
    assert (out.path / "model" / "model.safetensors").exists()


def test_a_diverged_loss_stops_the_stage_naming_the_step_and_metric(sft_inputs, tmp_path, monkeypatch):
    from schemas.errors import StageError

    real = sft.logprobs.token_logprobs
    calls = []

    def diverging(*args, **kwargs):  # the forward pass of step 3 on gives NaN log-probs, as a blown-up model does
        calls.append(1)
        logp, entropy = real(*args, **kwargs)
        return (logp * float("nan"), entropy) if len(calls) >= 3 else (logp, entropy)

    monkeypatch.setattr(sft.logprobs, "token_logprobs", diverging)
    ctx = LocalContext(tmp_path / "run")
    with pytest.raises(StageError, match=r"training diverged at step 3: train/loss = nan; nothing was published"):
        sft.run(_cfg(max_steps=8), sft_inputs, ctx)  # batch 4, no accumulation: one forward pass a step
    assert len([m for s, m in ctx.metrics if "train/loss" in m]) == 2  # the finite steps were logged
    assert not any((tmp_path / "run").rglob("model.safetensors"))  # no model saved


class SimulatedCrash(RuntimeError):
    pass


class CrashingContext(LocalContext):
    """Dies right after optimizer step `crash_at` (after that step's checkpoint, if one was due)."""

    def __init__(self, root, crash_at: int):
        super().__init__(root)
        self.crash_at = crash_at

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, step)
        if step == self.crash_at and "train/loss" in metrics:
            raise SimulatedCrash(f"killed after step {step}")


def _losses(ctx):
    return {step: m["train/loss"] for step, m in ctx.metrics if step is not None and "train/loss" in m}


@pytest.mark.parametrize("crash_at", [8, 6, 12])
def test_resume_after_crash_trains_exactly_the_remaining_steps(sft_inputs, tmp_path, crash_at):
    """crash_at=8: exactly on a checkpoint boundary; 6: between checkpoints (steps 5-6 are redone);
    12: after the final step's checkpoint but before publishing: resume must publish, not retrain,
    and must not report success without a model."""
    cfg = _cfg()
    ref_ctx = LocalContext(tmp_path / "ref")
    ref = sft.run(cfg, sft_inputs, ref_ctx)["model"]

    root = tmp_path / "crash"
    with pytest.raises(SimulatedCrash):
        sft.run(cfg, sft_inputs, CrashingContext(root, crash_at))
    last_ckpt = checkpoints.latest_checkpoint(root / "checkpoints")
    expected_start = (crash_at // cfg.checkpoint_every) * cfg.checkpoint_every
    assert last_ckpt.name == f"step-{expected_start:06d}"
    assert not (root / "outputs" / "model" / "model").exists() or not any((root / "outputs" / "model" / "model").iterdir())

    resumed_ctx = LocalContext(root)  # same checkpoint dir, as the flow gives a re-run with the same cache key
    out = sft.run(cfg, sft_inputs, resumed_ctx)["model"]
    assert out.metrics["resumed_from_step"] == expected_start
    assert out.metrics["trained_steps"] == cfg.max_steps - expected_start
    trained = _losses(resumed_ctx)
    assert sorted(trained) == list(range(1, cfg.max_steps + 1))  # curve re-logged whole, then the new steps
    ref_losses = _losses(ref_ctx)
    for step in range(expected_start + 1, cfg.max_steps + 1):
        assert trained[step] == pytest.approx(ref_losses[step], rel=1e-4, abs=1e-5), step
    assert out.metrics["final_loss"] == pytest.approx(ref.metrics["final_loss"], rel=1e-4)
    assert (out.path / "model" / "model.safetensors").exists()


def test_accumulation_invariant(sft_inputs, tmp_path):
    """batch 4 × accumulation 1 and batch 1 × accumulation 4 see the same examples per step and
    normalise by the same token count, so the loss curves match."""
    a = LocalContext(tmp_path / "a")
    b = LocalContext(tmp_path / "b")
    sft.run(_cfg(max_steps=4, batch_size=4, grad_accum=1), sft_inputs, a)
    sft.run(_cfg(max_steps=4, batch_size=1, grad_accum=4), sft_inputs, b)
    la, lb = _losses(a), _losses(b)
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-4), step


@pytest.mark.parametrize("lora_r", [0, 4])
def test_gradient_checkpointing_changes_memory_not_the_loss_curve(sft_inputs, tmp_path, lora_r):
    """Recomputed activations give the same gradients: the loss curves match step for step."""
    plain, ckpt = LocalContext(tmp_path / "plain"), LocalContext(tmp_path / "ckpt")
    sft.run(_cfg(max_steps=4, lora=LoraSpec(r=lora_r)), sft_inputs, plain)
    sft.run(_cfg(max_steps=4, lora=LoraSpec(r=lora_r), gradient_checkpointing=True), sft_inputs, ckpt)
    lp, lc = _losses(plain), _losses(ckpt)
    assert lp[1] == pytest.approx(lc[1], rel=1e-6)
    assert lp[4] != lp[1]  # it trained
    for step in lp:
        assert lp[step] == pytest.approx(lc[step], rel=1e-5), step


def test_lora_trains_only_the_adapter_and_saves_an_adapter(sft_inputs, tmp_path):
    ctx = LocalContext(tmp_path / "lora")
    out = sft.run(_cfg(max_steps=3, lora=LoraSpec(r=4, alpha=8)), sft_inputs, ctx)["model"]
    assert out.schema == "adapter" and out.extra["base_fingerprint"] == sft_inputs["model"].fingerprint
    assert (out.path / "model" / "adapter_config.json").exists()
    assert not (out.path / "model" / "model.safetensors").exists()
    assert ctx.params["trainable_parameters"] < ctx.params["total_parameters"] / 5


def test_prompts_input_builds_gold_targets(tmp_path, tiny_model_input):
    from stages.rewards.answers import format_ok

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1),
             "task": "t", "verifier": "math", "split": "train" if i < 4 else "eval", "metadata": "{}"}
            for i in range(6)]
    out = write_dataset(LocalContext(tmp_path / "d"), "p", from_rows(rows, "prompts"), "prompts")
    convs = sft.conversations_from(fake_input(out.path, "dataset", "prompts"), _cfg())
    assert len(convs) == 4  # train split only
    assert all(format_ok(c[-1]["content"]) and c[-1]["role"] == "assistant" for c in convs)
    assert convs[0][-1]["content"].endswith("<answer>1</answer>")


def test_adapter_artifact_finds_its_base_by_fingerprint_not_by_path(sft_inputs, tmp_path):
    """The adapter config records an absolute base path; artifacts must survive that path moving
    (another machine, a remote store), so the base comes from the resolved base artifact."""
    import json

    from stages.base import Input

    out = sft.run(_cfg(max_steps=2, lora=LoraSpec(r=4, alpha=8)), sft_inputs, LocalContext(tmp_path / "l"))["model"]
    cfg_path = out.path / "model" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "moved-away")
    cfg_path.write_text(json.dumps(cfg))
    adapter = fake_input(out.path, "model", "adapter")
    with pytest.raises(Exception, match="moved-away"):
        adapter.load_model()
    model, _ = Input(adapter.path, adapter.manifest, base=sft_inputs["model"]).load_model()
    assert hasattr(model, "peft_config")


@pytest.mark.parametrize("damage", ["truncate", "garbage_optimizer"])
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumes(sft_inputs, tmp_path, caplog, damage):
    """Issue 28 item 6: a truncated checkpoint used to fail every re-run with a raw SafetensorError."""
    cfg = _cfg(keep_checkpoints=3)
    ref_ctx = LocalContext(tmp_path / "ref")
    sft.run(cfg, sft_inputs, ref_ctx)
    root = tmp_path / "crash"
    with pytest.raises(SimulatedCrash):
        sft.run(cfg, sft_inputs, CrashingContext(root, 10))
    ckpts = root / "checkpoints"
    assert [p.name for p in checkpoints.complete_checkpoints(ckpts)] == ["step-000008", "step-000004"]
    if damage == "truncate":
        f = ckpts / "step-000008" / "trainable.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:  # same size, unreadable content
        f = ckpts / "step-000008" / "optimizer.pt"
        f.write_bytes(b"\0" * f.stat().st_size)

    resumed_ctx = LocalContext(root)
    with caplog.at_level("WARNING"):
        out = sft.run(cfg, sft_inputs, resumed_ctx)["model"]
    assert out.metrics["resumed_from_step"] == 4  # fell back to the previous good checkpoint
    assert "step-000008" in caplog.text and "set aside" in caplog.text
    trained, ref_losses = _losses(resumed_ctx), _losses(ref_ctx)
    for step in range(5, cfg.max_steps + 1):
        assert trained[step] == pytest.approx(ref_losses[step], rel=1e-4, abs=1e-5), step
    assert len(list(ckpts.glob(".corrupt-step-000008-*"))) == 1  # kept for a post-mortem, never resumed again


def test_every_checkpoint_damaged_starts_fresh_and_set_aside_copies_are_capped(sft_inputs, tmp_path):
    cfg = _cfg(max_steps=4, checkpoint_every=1, keep_checkpoints=4)
    root = tmp_path / "run"
    with pytest.raises(SimulatedCrash):
        sft.run(cfg, sft_inputs, CrashingContext(root, 4))
    ckpts = root / "checkpoints"
    for p in checkpoints.complete_checkpoints(ckpts):
        (p / "trainable.safetensors").write_bytes(b"x")
    out = sft.run(cfg, sft_inputs, LocalContext(root))["model"]
    assert out.metrics["resumed_from_step"] == 0
    assert len(list(ckpts.glob(".corrupt-*"))) == checkpoints.KEEP_CORRUPT  # 4 set aside, the newest 2 kept


# ---------------------------------------------------------------------------- tool transcripts (issue 46)

TOOL_TURN_1 = "<think>\nmultiply\n</think>\n<python>\nprint(2 * 3)\n</python>"
TOOL_OBSERVATION = "<output>\n6\n</output>\n"
TOOL_TURN_2 = "<answer>6</answer>"
TOOL_MESSAGES = [{"role": "user", "content": "2 * 3?"},
                 {"role": "assistant", "content": TOOL_TURN_1 + TOOL_OBSERVATION + TOOL_TURN_2}]


def merging_tokenizer():
    """The tiny tokenizer's characters plus two tokens that merge across a segment boundary of a tool transcript:
    `><` (`</python>` then `<output>`) and `\\n<` (`</output>\\n` then `<answer>`), so tokenizing the transcript whole
    and segment by segment give different ids."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import AddedToken, PreTrainedTokenizerFast

    from stages.modeling.models import CHATML_TEMPLATE, TINY_SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate([*TINY_SPECIAL_TOKENS, "><", "\n<", *(chr(c) for c in range(128))])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"><|\n<|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>", chat_template=CHATML_TEMPLATE)


def test_a_tool_transcript_labels_exactly_the_model_segments():
    """Prompt P, then turn 1 (labelled), the observation (IGNORE), turn 2 with the template's end (labelled), each
    tokenized alone: `><` never merges `</python>` into `<output>`, nor `\\n<` the observation's end into
    `<answer>`."""
    tok = merging_tokenizer()
    ex = sequences.tokenize_conversation(tok, TOOL_MESSAGES, max_length=512)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = tok.apply_chat_template(TOOL_MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    suffix = tok.apply_chat_template(TOOL_MESSAGES, tokenize=False)[len(prompt) + len(TOOL_MESSAGES[1]["content"]):]
    p, t1, obs, t2 = enc(prompt), enc(TOOL_TURN_1), enc(TOOL_OBSERVATION), enc(TOOL_TURN_2 + suffix)
    assert ex.input_ids == p + t1 + obs + t2
    assert ex.labels == [IG] * len(p) + t1 + [IG] * len(obs) + t2
    whole = enc(TOOL_TURN_1 + TOOL_OBSERVATION + TOOL_TURN_2 + suffix)
    assert whole != t1 + obs + t2  # the boundaries do merge when tokenized whole: the segmenting matters
    assert tok.decode([i for i, lab in zip(ex.input_ids, ex.labels, strict=True) if lab == IG][len(p):]) \
        == TOOL_OBSERVATION


def test_a_tool_transcripts_tokens_are_the_multiturn_samplers():
    """The sampler's sequence for the same turns: the rendered prompt, each turn's tokens, each observation
    tokenized alone (`step_episodes`: one batch call, no special tokens), then the end-of-turn token; the model
    mask is the labels' mask."""
    from stages.sampling.completions import render_prompts, stop_token_ids

    tok = merging_tokenizer()
    ex = sequences.tokenize_conversation(tok, TOOL_MESSAGES, max_length=512)
    prompt = tok(render_prompts(tok, [TOOL_MESSAGES[:1]])[0], add_special_tokens=False)["input_ids"]
    turns = [tok(t, add_special_tokens=False)["input_ids"] for t in (TOOL_TURN_1, TOOL_TURN_2)]
    observation = tok([TOOL_OBSERVATION], add_special_tokens=False)["input_ids"][0]
    eos = [stop_token_ids(tok)[0]]
    sampled = prompt + turns[0] + observation + turns[1] + eos
    model_mask = [0] * len(prompt) + [1] * len(turns[0]) + [0] * len(observation) + [1] * (len(turns[1]) + 1)
    assert ex.input_ids[: len(sampled)] == sampled
    assert [int(lab != IG) for lab in ex.labels[: len(sampled)]] == model_mask


def test_single_turn_data_tokenizes_as_before():
    """No observation after a `</python>` (an `<output>` the model wrote itself included): one tokenizer call."""
    tok = merging_tokenizer()
    for content in ("<think>\nadd\n</think>\n<answer>4</answer>", "<output>\n4\n</output>\n<answer>4</answer>"):
        msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": content}]
        prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(full[len(prompt):], add_special_tokens=False)["input_ids"]
        ex = sequences.tokenize_conversation(tok, msgs, max_length=512)
        assert ex.input_ids == p + c and ex.labels == [IG] * len(p) + c
