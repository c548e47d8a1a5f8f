"""The preference_optimization and reference_logprobs stages on the tiny model: tokenization and
masks line up, the losses learn a synthetic preference, the cached reference equals the in-line
one, and bad combinations fail before any compute."""

from __future__ import annotations

import pytest
import torch

from schemas.configs import LoraSpec, PreferenceOptimizationConfig, ReferenceLogprobsConfig
from schemas.datasets import from_rows
from schemas.errors import ArtifactError, ConfigError
from stages import preference_optimization as po
from stages import reference_logprobs
from stages.base import LocalContext, write_dataset
from stages.modeling import prefix_sharing
from stages.training import pairs
from tests.conftest import fake_input


def synthetic_pairs(n: int = 100, seed: int = 0) -> list[dict]:
    """A learnable preference the random model does not have: chosen answers are strings of even
    digits, rejected ones strings of odd digits of the same length, under varied prompts. Held-out
    pairs have unseen prompts and strings, so held-out accuracy measures the learned preference."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(3, 6)
        rows.append({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: pick {rng.randint(0, 99)}."}],
                     "chosen": "".join(rng.choice("02468") for _ in range(k)),
                     "rejected": "".join(rng.choice("13579") for _ in range(k)),
                     "chosen_score": 1.0, "rejected_score": 0.0, "source": "synthetic"})
    return rows


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    out = write_dataset(LocalContext(tmp_path_factory.mktemp("prefs")), "p", from_rows(synthetic_pairs(), "preferences"),
                        "preferences")
    return fake_input(out.path, "dataset", "preferences")


def test_tokenize_keeps_the_completion_and_cuts_the_prompt(tiny_tokenizer):
    msgs = [{"role": "user", "content": "x" * 200}]
    ids, n_c = pairs.tokenize(tiny_tokenizer, msgs, "abc", 40)
    assert len(ids) == 40 and n_c == 4 and ids[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(ids[-4:-1]) == "abc"
    ids, n_c = pairs.tokenize(tiny_tokenizer, msgs, "y" * 100, 40)
    assert len(ids) == 40 and n_c == 39  # one prompt token left to predict the first completion token


def test_kto_kl_pairs_are_mismatched(tmp_path):
    """preference_data's unpaired rows alternate one prompt's chosen and rejected answers: each row's KL
    pair takes the next row under *another* prompt (row i+1 would be the same prompt's other answer)."""
    q = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    rows = [{"id": f"{p}-{side}", "messages": q[p], "completion": f"{p}{side}", "label": side == "c"}
            for p in range(3) for side in "cr"]
    out = write_dataset(LocalContext(tmp_path / "u"), "u", from_rows(rows, "unpaired"), "unpaired")
    kl = [(e.id, e.messages[0]["content"], e.completion)
          for e in pairs.examples_from(fake_input(out.path, "dataset", "unpaired"), include_kl=True) if e.role == "kl"]
    assert kl == [("0-c", "q0", "1c"), ("0-r", "q0", "1c"), ("1-c", "q1", "2c"), ("1-r", "q1", "2c"),
                  ("2-c", "q2", "0c"), ("2-r", "q2", "0c")]
    assert pairs.next_other_prompt(["a", "a", "a"]) == [1, 2, 0]  # one prompt only: the next row
    assert pairs.next_other_prompt(["a", "b", "b", "a"]) == [1, 3, 3, 1]


def test_completion_logprobs_mask_matches_a_manual_forward(tiny_model, tiny_tokenizer):
    seqs = [pairs.tokenize(tiny_tokenizer, [{"role": "user", "content": "hi"}], c, 64) for c in ("12", "345")]
    logp, mask = prefix_sharing.completion_logprobs(tiny_model, seqs, 0, "cpu")
    for i, (ids, n_c) in enumerate(seqs):
        assert int(mask[i].sum()) == n_c
        full = torch.log_softmax(tiny_model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        expected = full[torch.arange(len(ids) - 1), torch.tensor(ids[1:])][-n_c:]
        torch.testing.assert_close(logp[i][mask[i]], expected, atol=1e-5, rtol=0)


def _ref_input(out, parents: list[str]):
    """The reference stage's output as the artifact the store would hand over (parents, metrics)."""
    inp = fake_input(out.path, "dataset", "ref_logprobs")
    return inp.__class__(inp.path, inp.manifest.model_copy(update={"parents": parents, "metrics": out.metrics}))


def _cfg(**kw) -> PreferenceOptimizationConfig:
    base = dict(max_steps=40, batch_size=8, learning_rate=3e-3, lora=LoraSpec(r=0), max_length=64, beta=0.1,
                eval_fraction=0.2, checkpoint_every=100, warmup_ratio=0.0, lr_scheduler="constant", kl_prompts=0)
    base.update(kw)
    return PreferenceOptimizationConfig(**base)


def _curve(ctx, key):
    return [m[key] for s, m in ctx.metrics if s is not None and key in m]


@pytest.mark.slow
@pytest.mark.parametrize("loss,kw", [
    ("dpo", {}),
    ("ipo", {"learning_rate": 1e-3}),  # (Δ - 1/(2β))² has gradients ~20x DPO's: a smaller step
    ("simpo", {"beta": 2.0, "simpo_gamma": 0.5}),
])
def test_learns_the_synthetic_preference(loss, kw, tmp_path, tiny_model_input, prefs):
    """Held-out reward accuracy from ~chance to > 90%, and the chosen-over-rejected margin grows.

    "Before" is one step at lr 1e-9: at step 0 policy = reference, so every DPO/IPO implicit reward
    is exactly 0 (a tie, counted wrong); the vanishing step breaks the ties at random, which is what
    chance means here. SimPO's rewards are the model's own average log-probs from the start."""
    ctx = LocalContext(tmp_path / loss)
    cfg = _cfg(loss=loss, eval_every=10, **kw)
    before = _cfg(**{**kw, "loss": loss, "max_steps": 1, "learning_rate": 1e-9})
    ctx0 = LocalContext(tmp_path / f"{loss}-0")
    out0 = po.run(before, {"model": tiny_model_input, "preferences": prefs}, ctx0)["model"]
    out = po.run(cfg, {"model": tiny_model_input, "preferences": prefs}, ctx)["model"]
    acc0, acc = out0.metrics["eval_accuracy"], out.metrics["eval_accuracy"]
    assert 0.2 <= acc0 <= 0.8, acc0
    assert acc > 0.9, (acc0, acc)
    assert out.metrics["eval_margin"] > out0.metrics["eval_margin"] + 0.1
    margins = _curve(ctx, "train/rewards/margin")
    assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5


def test_cached_reference_equals_inline_and_the_reference_model_is_not_loaded(tmp_path, tiny_model_input, prefs,
                                                                              monkeypatch):
    ref_out = reference_logprobs.run(ReferenceLogprobsConfig(max_length=64, batch_size=16),
                                     {"model": tiny_model_input, "preferences": prefs}, LocalContext(tmp_path / "ref"))
    ref = _ref_input(ref_out["logprobs"], [prefs.fingerprint, tiny_model_input.fingerprint])
    loads = []
    real = type(tiny_model_input).load_model

    def counting(self, *a, **k):
        loads.append(self.path)
        return real(self, *a, **k)

    monkeypatch.setattr(type(tiny_model_input), "load_model", counting)
    a, b = LocalContext(tmp_path / "inline"), LocalContext(tmp_path / "cached")
    cfg = _cfg(max_steps=3)
    out_a = po.run(cfg, {"model": tiny_model_input, "preferences": prefs}, a)["model"]
    loads.clear()
    out_b = po.run(cfg.model_copy(update={"beta": 0.2}), {"model": tiny_model_input, "preferences": prefs,
                                                          "reference": ref}, b)["model"]
    assert loads == [tiny_model_input.path]  # the policy only; kl_prompts=0 and the reference came cached
    la, lb = _curve(a, "train/logps/chosen"), _curve(b, "train/logps/chosen")
    assert la[0] == pytest.approx(lb[0], abs=1e-4)  # same first batch, same policy: same log-probs
    # step 1: policy == reference, so every implicit reward is 0 whichever way the reference came
    assert _curve(a, "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-5)
    assert _curve(b, "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-5)
    assert out_a.metrics["final_loss"] != out_b.metrics["final_loss"]  # beta changed the objective


def test_kto_orpo_cdpo_and_lora_run_with_heldout_kl(tmp_path, tiny_model_input, prefs):
    for loss in ("kto", "orpo", "cdpo"):
        ctx = LocalContext(tmp_path / loss)
        cfg = _cfg(loss=loss, max_steps=2, lora=LoraSpec(r=4, alpha=8), kl_prompts=2, kl_max_new_tokens=8)
        out = po.run(cfg, {"model": tiny_model_input, "preferences": prefs}, ctx)["model"]
        assert out.schema == "adapter"
        assert "eval_kl" in out.metrics and out.metrics["eval_kl_samples"] == 4
        logged = {k for _, m in ctx.metrics for k in m}
        assert "train/loss" in logged and "train/rewards/chosen" in logged
        if loss == "orpo":
            assert "train/or_loss" in logged and "train/rewards/accuracy" in logged


def test_mismatched_reference_and_bad_combinations_fail_before_training(tmp_path, tiny_model_input, prefs):
    ref_out = reference_logprobs.run(ReferenceLogprobsConfig(max_length=32), {"model": tiny_model_input,
                                     "preferences": prefs}, LocalContext(tmp_path / "ref"))
    out = ref_out["logprobs"]
    with pytest.raises(ArtifactError, match="another dataset"):
        po.run(_cfg(), {"model": tiny_model_input, "preferences": prefs, "reference": _ref_input(out, [])},
               LocalContext(tmp_path / "a"))
    with pytest.raises(ArtifactError, match="another model"):
        po.run(_cfg(), {"model": tiny_model_input, "preferences": prefs,
                        "reference": _ref_input(out, [prefs.fingerprint])}, LocalContext(tmp_path / "m"))
    ref = _ref_input(out, [prefs.fingerprint, tiny_model_input.fingerprint])
    with pytest.raises(ArtifactError, match="same max_length"):
        po.run(_cfg(max_length=64), {"model": tiny_model_input, "preferences": prefs, "reference": ref},
               LocalContext(tmp_path / "b"))
    with pytest.raises(ArtifactError, match="include_kl"):
        po.run(_cfg(loss="kto", max_length=32), {"model": tiny_model_input, "preferences": prefs, "reference": ref},
               LocalContext(tmp_path / "c"))
    with pytest.raises(ConfigError, match="label_smoothing"):
        po.check(_cfg(loss="cdpo", label_smoothing=0.0))


def test_prefix_sharing_is_chosen_by_cost_unless_forced(tiny_tokenizer, monkeypatch):
    """A Llama model packs each pair into one row (prompt, chosen, rejected: `packed_prefix_rows`) where that
    costs less than whole rows (`packing_pays`: here a ~40-token prompt shared, so it does) or when forced
    (share_prefix True); share_prefix False runs whole rows. A model that cannot be packed shares the prompt
    through the KV cache (`shared_prefix_rows`) where a second decoder call pays: the tiny model's narrow
    layers make one cost 292 positions, more than the ~40 saved, so whole rows run there, shared rows with a
    free call or when forced. Same numbers every way."""
    from stages.modeling import models, prefix_sharing

    model = models.build_tiny_model(tiny_tokenizer, seed=3).train()
    seqs = [pairs.tokenize(tiny_tokenizer, [{"role": "user", "content": "one prompt for both"}], c, 64)
            for c in ("12", "3456")]
    calls = []
    for name in ("packed_prefix_rows", "shared_prefix_rows"):
        real = getattr(prefix_sharing, name)
        monkeypatch.setattr(prefix_sharing, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    whole, mask = prefix_sharing.completion_logprobs(model, seqs, 0, "cpu", share_prefix=False)
    assert calls == []
    packed, _ = prefix_sharing.completion_logprobs(model, seqs, 0, "cpu")
    assert calls == ["packed_prefix_rows"]
    monkeypatch.setattr(prefix_sharing, "packing_pays", lambda *a: False)
    assert prefix_sharing.completion_logprobs(model, seqs, 0, "cpu")[0] is not None and len(calls) == 1  # whole rows
    prefix_sharing.completion_logprobs(model, seqs, 0, "cpu", share_prefix=True)
    assert calls[1:] == ["packed_prefix_rows"]

    calls.clear()
    monkeypatch.setattr(prefix_sharing, "can_pack_prefix", lambda m: False)
    assert prefix_sharing.completion_logprobs(model, seqs, 0, "cpu")[0] is not None and calls == []  # 292 > saved: whole
    forced, _ = prefix_sharing.completion_logprobs(model, seqs, 0, "cpu", share_prefix=True)
    assert calls == ["shared_prefix_rows"]
    monkeypatch.setattr(prefix_sharing, "default_bucket_overhead", lambda device, model=None: 0)
    cheap, _ = prefix_sharing.completion_logprobs(model, seqs, 0, "cpu")
    assert calls == ["shared_prefix_rows"] * 2
    for got in (packed, forced, cheap):
        torch.testing.assert_close(got[mask], whole[mask], rtol=1e-5, atol=1e-5)
        assert (got[~mask] == 0).all()


def test_shared_prompts_give_the_same_logprobs_and_gradients_as_whole_rows(tiny_tokenizer):
    """Two pairs with prompts of different lengths, laid out [chosen..., rejected...] as batch_loss
    does: each prompt run once (packed with its completions in one row, or through the KV cache) gives the
    whole rows' completion log-probs and parameter gradients."""
    from stages.modeling import models, prefix_sharing

    model = models.build_tiny_model(tiny_tokenizer, seed=2).train()
    prompts = ([{"role": "user", "content": "a short one"}], [{"role": "user", "content": "and a much longer prompt"}])
    seqs = [pairs.tokenize(tiny_tokenizer, p, c, 64) for p, c in zip(prompts * 2, ("12", "3456", "7", "890"), strict=True)]
    grads = {}
    for share in (False, True, "cache"):  # whole rows; packed rows; the KV-cache path of unpackable models
        model.zero_grad()
        with pytest.MonkeyPatch.context() as mp:
            if share == "cache":
                mp.setattr(prefix_sharing, "can_pack_prefix", lambda m: False)
            logp, mask = prefix_sharing.completion_logprobs(model, seqs, 0, "cpu", share_prefix=share is not False)
        assert (logp[~mask] == 0).all()
        (logp * torch.arange(1, logp.shape[1] + 1)).sum().backward()  # position-weighted: a misplaced value shows
        grads[share] = ({n: p.grad.clone() for n, p in model.named_parameters()}, logp.detach())
    for share in (True, "cache"):
        torch.testing.assert_close(grads[share][1], grads[False][1], rtol=1e-5, atol=1e-5)
        for name, g in grads[False][0].items():
            # float rounding relative to the tensor's scale (measured: ~1e-7 of its largest element)
            torch.testing.assert_close(grads[share][0][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()),
                                       msg=f"{share} {name}")


@pytest.mark.parametrize("reduction,loss,grad_chosen,grad_rejected", [
    ("auto", 16.0, -4.0, 2.0),  # IPO's default: per-token means (its authors' code, TRL)
    ("mean", 16.0, -4.0, 2.0),
    ("sum", 4.0, -4.0, 4.0),
])
def test_ipo_averages_token_logprobs_by_default_and_sums_on_request(reduction, loss, grad_chosen, grad_rejected,
                                                                     monkeypatch):
    """One pair through the stage's own batch_loss, the model's token log-probs given:
    chosen tokens (-0.5, -1.5): sum -2, mean -1; its reference sum -3 (2 tokens): mean -1.5.
    rejected tokens (-1, -1, -1, -1): sum -4, mean -1; its reference sum -2 (4 tokens): mean -0.5.
    beta 0.1: target 1/(2 beta) = 5.
    mean: Δ = (-1 + 1.5) - (-1 + 0.5) = 1, loss (1 - 5)² = 16; d loss / d chosen token = 2(Δ - 5) / 2 = -4,
          d / d rejected token = -2(Δ - 5) / 4 = +2.
    sum:  Δ = (-2 + 3) - (-4 + 2) = 3, loss (3 - 5)² = 4; d / d chosen token = 2(3 - 5) = -4, rejected +4."""
    token_logps = torch.tensor([[-0.5, -1.5, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float32,
                               requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    monkeypatch.setattr(po, "completion_logprobs", lambda *a, **k: (token_logps, mask))
    cfg = _cfg(loss="ipo", beta=0.1, logprob_reduction=reduction)
    out = po.batch_loss(None, cfg, [0], [], [([0], 2), ([0], 4)], [-3.0, -2.0], 0, "cpu")
    torch.testing.assert_close(out.losses.detach(), torch.tensor([loss]))
    (g,) = torch.autograd.grad(out.losses.sum(), token_logps)
    torch.testing.assert_close(g, torch.tensor([[grad_chosen, grad_chosen, 0.0, 0.0], [grad_rejected] * 4]))
    # the logged log-probs stay sums whichever reduction the loss uses
    torch.testing.assert_close(out.extras["logps/chosen"], torch.tensor([-2.0]))
    torch.testing.assert_close(out.extras["logps/rejected"], torch.tensor([-4.0]))
