"""`preference_optimization` stage: DPO and its family on preference pairs (or unpaired rows for KTO).

One step reads like the DPO paper: a micro-batch of pairs goes through the policy as one
concatenated forward pass (chosen rows, then rejected rows), each completion's token log-probs
are reduced to a sequence log-prob (sum, or mean for SimPO/ORPO), and the loss of
`stages/math/preference.py` compares them with the reference's, read from a cached
`reference_logprobs` artifact. The math lives in `preference_losses`; this module orders it.

The reference:
- from the `reference` input (a `reference_logprobs` artifact of the same model and data): the
  reference model is never loaded, and changing beta or the loss re-uses it;
- without it, computed here once before the first update, with the policy itself: before any
  step the policy *is* the reference (with LoRA: the input model; the adapter starts as a no-op).
KL(policy || reference) on held-out prompts is estimated at the end from sampled completions; the
reference log-probs then come from the policy with its adapter disabled (LoRA) or, with full
fine-tuning, from the input model loaded once after training.

Departures, on purpose:
- the loss of a step is the mean over all pairs of the step (every micro-batch contributes
  sum/pairs_in_step), so batch_size x grad_accum splits give the same update;
- a sequence longer than max_length keeps its completion (cut from its end only when the
  completion alone is too long) and loses the prompt's start, so every pair scores whole answers;
- on N processes every process takes 1/N of each micro-batch's units and divides its summed loss
  by the step's global unit count, gradients are summed (`stages.runtime.distributed`), KTO's reference
  point is the mean over the whole micro-batch, and a reference computed here is scored in N parts
  and gathered: the same step as on one process. Held-out metrics, KL and saving run on rank 0.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas.configs import GenerationSpec, PreferenceOptimizationConfig
from schemas.errors import ArtifactError, ConfigError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math import preference as pl
from stages.modeling import models
from stages.modeling.logprobs import completion_logprobs, score_examples
from stages.runtime import distributed
from stages.training.checkpoints import resume, save_checkpoint
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    resolve_precision,
    set_lr,
)
from stages.training.pairs import DESIRABLE, Example, examples_from, split_pairs, tokenize

VERSION = "4"  # 4: KTO's KL pairs take the next row under another prompt. 3: ipo averages token log-probs by default (logprob_reduction); orpo's log odds bounded. 2: sampler blocks of ceil(sqrt(V)) tokens (generation.BlockRaceSampler): other samples for the same seed
CONFIG = PreferenceOptimizationConfig
INPUTS = {"model": "model", "preferences": "preferences|unpaired", "reference": "ref_logprobs?"}
OUTPUTS = {"model": "model"}


def check(cfg: PreferenceOptimizationConfig) -> None:
    if cfg.loss == "cdpo" and cfg.label_smoothing == 0:
        raise ConfigError("preference_optimization.label_smoothing: cdpo needs a label_smoothing > 0 (0 is plain dpo)")


# ---------------------------------------------------------------------------- data


# ---------------------------------------------------------------------------- reference


def reference_table(ref: Input, examples: list[Example], tokenized: list[tuple[list[int], int]],
                    preferences: Input, model: Input, max_length: int) -> list[float]:
    """The cached reference log-prob of every example, checked against this data, model and tokenization."""
    for what, inp in (("dataset", preferences), ("model", model)):
        if inp.fingerprint not in ref.manifest.parents:
            raise ArtifactError(f"{ref.label}: reference log-probs were computed for another {what} "
                                f"(parents {[p[:12] for p in ref.manifest.parents]}), not {inp.label}")
    ref_len = ref.manifest.metrics.get("max_length")
    if ref_len != max_length:
        raise ArtifactError(f"{ref.label}: computed with max_length={ref_len}, this stage uses {max_length}: set the "
                            f"same max_length on the reference node")
    table = {(r["id"], r["role"]): r for r in ref.table("ref_logprobs").to_pylist()}
    out = []
    for ex, (_, n_c) in zip(examples, tokenized, strict=True):
        row = table.get((ex.id, ex.role))
        if row is None:
            hint = " (KTO needs include_kl: true on the reference node)" if ex.role == "kl" else ""
            raise ArtifactError(f"{ref.label}: no reference log-prob for id {ex.id!r} role {ex.role!r}{hint}")
        if row["tokens"] != n_c:
            raise ArtifactError(f"{ref.label}: id {ex.id!r} {ex.role} has {row['tokens']} completion tokens there but "
                                f"{n_c} here: set the same max_length on the reference node as on this stage")
        out.append(row["logp"])
    return out


# ---------------------------------------------------------------------------- loss of one micro-batch


def averages_logprobs(cfg: PreferenceOptimizationConfig) -> bool:
    """Whether sequence log-probs are per-token means (else sums): the loss's convention
    (`LOSSES[loss].average`: mean for ipo, simpo, orpo) unless `logprob_reduction` names one."""
    if cfg.logprob_reduction == "auto":
        return pl.LOSSES[cfg.loss].average
    return cfg.logprob_reduction == "mean"


def reference_of(ref_logps: list[float] | None, rows: list[int], mask: torch.Tensor, average: bool,
                 device: str) -> torch.Tensor | None:
    """The reference's sequence log-probs of `rows`, (R,), reduced as the policy's are: the reference
    stores sums, so a mean divides by the completion's token count (mask (R, T), at least 1)."""
    if ref_logps is None:
        return None
    ref = torch.tensor([ref_logps[r] for r in rows], device=device, dtype=torch.float32)
    return ref / mask.sum(dim=-1).clamp(min=1).to(ref.dtype) if average else ref


def batch_loss(model, cfg: PreferenceOptimizationConfig, batch: list[int], examples: list[Example],
               tokenized: list[tuple[list[int], int]], ref_logps: list[float] | None, pad_id: int, device: str,
               kl_ref: torch.Tensor | None = None) -> pl.PreferenceLoss:
    """The loss of a micro-batch of units (pair indices, or example indices for KTO), one forward pass.

    Paired losses: `batch` indexes pairs; rows 2i and 2i+1 of `examples` are pair i's chosen and
    rejected, and go through the model as [chosen..., rejected...].
    """
    spec = pl.LOSSES[cfg.loss]
    if cfg.loss in pl.PAIRED:
        rows = [2 * i for i in batch] + [2 * i + 1 for i in batch]
    else:
        rows = list(batch)
    logp, mask = completion_logprobs(model, [tokenized[r] for r in rows], pad_id, device, cfg.logprob_chunk)
    average = averages_logprobs(cfg)
    seq = pl.sequence_logprobs(logp, mask, average=average)  # (R,)
    ref = reference_of(ref_logps, rows, mask, average, device)
    b = len(batch)
    if cfg.loss in pl.PAIRED:
        inputs = {"policy_chosen": seq[:b], "policy_rejected": seq[b:]}
        if ref is not None:
            inputs.update(ref_chosen=ref[:b], ref_rejected=ref[b:])
        if cfg.loss == "orpo":
            inputs["nll_chosen"] = -seq[:b]  # mean token NLL of the chosen answer (ORPO's SFT term)
    else:
        inputs = {"policy": seq, "ref": ref, "desirable": torch.tensor([examples[r].role in DESIRABLE for r in rows], device=device),
                  "kl_ref": kl_ref if kl_ref is not None else torch.zeros((), device=device)}
    params = {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing, "gamma": cfg.simpo_gamma,
              "lambda_d": cfg.kto_lambda_d, "lambda_u": cfg.kto_lambda_u, "lam": cfg.orpo_lambda}
    out = pl.preference_loss(cfg.loss, inputs, **{k: params[k] for k in spec.params})
    extras = dict(out.extras)
    if cfg.loss in pl.PAIRED:
        raw = pl.sequence_logprobs(logp, mask) if average else seq  # summed log-probs, for the logps/* metrics
        extras["logps/chosen"] = raw[:b].detach()
        extras["logps/rejected"] = raw[b:].detach()
    return out._replace(extras=extras)


def kto_reference_point(model, cfg, units: list[int], kl_rows: dict[int, int], tokenized, ref_logps, pad_id,
                        device, dist: distributed.Dist = distributed.SINGLE) -> torch.Tensor:
    """z0 for a KTO micro-batch: the batch mean of log pi - log pi_ref on its mismatched pairs.

    `units` is this rank's share; with several processes the mean is over every rank's share.
    """
    rows = [kl_rows[u] for u in units]
    average = averages_logprobs(cfg)  # z0 is compared with the loss's log-ratios: the same reduction
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [tokenized[r] for r in rows], pad_id, device)
        seq = pl.sequence_logprobs(logp, mask, average=average)
    ref = reference_of(ref_logps, rows, mask, average, device)
    if not dist.active:
        return pl.kto_kl_estimate(seq, ref)
    total, count = dist.sum([float((seq - ref).sum()), seq.numel()])
    return torch.tensor(max(0.0, total / count) if count else 0.0, device=device)


# ---------------------------------------------------------------------------- the stage


def run(cfg: PreferenceOptimizationConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    data, ref_input = inputs["preferences"], inputs.get("reference")
    kind = data.manifest.schema_name
    if cfg.loss in pl.PAIRED and kind != "preferences":
        raise ConfigError(f"preference_optimization.loss={cfg.loss!r} needs preference pairs; {data.label} is "
                          f"{kind!r} (only kto trains on unpaired rows)")
    examples = examples_from(data, include_kl=cfg.loss == "kto")  # validates before any model loads
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenized = [tokenize(tokenizer, e.messages, e.completion, cfg.max_length) for e in examples]
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp

    # units: pairs (paired losses) or scored rows (kto); the held-out split is by id, seeded
    if cfg.loss in pl.PAIRED:
        n_units = len(examples) // 2
        unit_ids = [examples[2 * i].id for i in range(n_units)]
    else:
        scored = [i for i, e in enumerate(examples) if e.role != "kl"]
        n_units, unit_ids = len(scored), [examples[i].id for i in scored]
    ids = sorted(set(unit_ids))
    train_id_idx, eval_id_idx = split_pairs(len(ids), cfg.eval_fraction, ctx.seed)
    eval_ids = {ids[i] for i in eval_id_idx}
    all_units = list(range(n_units)) if cfg.loss in pl.PAIRED else scored
    train_units = [u for u, i in zip(all_units, unit_ids, strict=True) if i not in eval_ids]
    eval_units = [u for u, i in zip(all_units, unit_ids, strict=True) if i in eval_ids]
    if not train_units:
        raise SchemaError(f"{data.label}: {len(ids)} id(s) are too few to hold out eval_fraction={cfg.eval_fraction}")
    kl_rows = {}
    if cfg.loss == "kto":
        kl_of = {e.id: i for i, e in enumerate(examples) if e.role == "kl"}
        kl_rows = {u: kl_of[examples[u].id] for u in all_units}

    ref_logps, ref_source = None, "none"
    if cfg.loss in pl.NEEDS_REFERENCE:
        t0 = time.perf_counter()
        if ref_input is not None:
            ref_logps = reference_table(ref_input, examples, tokenized, data, inputs["model"], cfg.max_length)
            ref_source = "cached"
        elif dist.active and not dist.sharded:  # the policy before its first update (N processes: a part each)
            ref_logps = dist.gather_list(score_examples(model, dist.part(tokenized), pad_id, ctx.device,
                                                        cfg.batch_size * 2, autocast_dtype))
            ref_source = "computed"
        else:  # one process, or fsdp (every rank must run the same forwards: each scores everything)
            ref_logps = score_examples(model, tokenized, pad_id, ctx.device, cfg.batch_size * 2, autocast_dtype)
            ref_source = "computed"
        ctx.log_metrics({"reference_seconds": time.perf_counter() - t0})
    elif ref_input is not None:
        ctx.log.info("preference_optimization: loss %s is reference-free; the reference input is not used", cfg.loss)
    ctx.log_params({"units_train": len(train_units), "units_eval": len(eval_units), "reference": ref_source,
                    "trainable_parameters": counts["trainable"], "total_parameters": counts["total"],
                    "precision": str(autocast_dtype or "fp32")})

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.max_steps)
    state = resume(ctx, model, optimizer, "preference_optimization", cfg.max_steps)
    start, history = state["step"], state.get("history", [])
    for i, m in enumerate(history):
        ctx.log_metrics(m, step=i + 1)

    def step_units(step: int) -> list[list[int]]:
        rng = np.random.default_rng([ctx.seed, step])
        need = cfg.batch_size * cfg.grad_accum
        picked = [train_units[j] for j in rng.choice(len(train_units), size=need, replace=len(train_units) < need)]
        return [picked[i : i + cfg.batch_size] for i in range(0, need, cfg.batch_size)]

    def forward(units: list[int], group: distributed.Dist = distributed.SINGLE, net=None) -> pl.PreferenceLoss:
        """The loss of `units`, this rank's share of a micro-batch spread over `group` (KTO's z0 spans it),
        under `net` (default: the model being trained)."""
        net = model if net is None else net
        kl_ref = (kto_reference_point(net, cfg, units, kl_rows, tokenized, ref_logps, pad_id, ctx.device, group)
                  if cfg.loss == "kto" else None)
        with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            return batch_loss(net, cfg, units, examples, tokenized, ref_logps, pad_id, ctx.device, kl_ref)

    model.train()
    units_seen, t_train = 0, time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc=f"preference_optimization ({cfg.loss})", unit="step",
               disable=not dist.is_main)
    for step in range(start, cfg.max_steps):
        lr = set_lr(optimizer, cfg.learning_rate * lr_factor(step, cfg.max_steps, warmup, cfg.lr_scheduler))
        micro = step_units(step)
        n = sum(len(m) for m in micro)  # the global step's units
        outs, loss_total = [], 0.0
        for units in micro:
            out = forward(dist.shard(units), dist)
            loss = out.losses.sum() / n
            loss.backward()
            loss_total += float(loss.detach())
            outs.append(out)
            units_seen += len(units)
        dist.sync_gradients(trainable)
        if dist.active:
            (loss_total,) = dist.sum([loss_total])
            outs = dist.gather_list([detached(o) for o in outs])
        grad_norm = clip_grad_norm(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = {"train/loss": loss_total, "train/lr": lr, "train/grad_norm": grad_norm,
                   **{f"train/{k}": v for k, v in pl.reward_metrics(outs).items()}, **extras_means(outs)}
        done = step + 1
        if eval_units and cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
            net = dist.full_model(model, ctx.device)  # rank 0 evaluates (fsdp: an unsharded copy, gathered)
            if dist.is_main:
                metrics.update(evaluate(net, eval_units, partial(forward, net=net), cfg.batch_size))
            del net
        history.append(metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            save_checkpoint(ctx.checkpoint_dir, done, model, optimizer, {"step": done, "history": history},
                            cfg.keep_checkpoints, dist)
        ctx.log_metrics(metrics, step=done)
        bar.set_postfix(loss=f"{loss_total:.4f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t_train
    trained = cfg.max_steps - start

    final: dict[str, float] = {}
    plain = dist.full_model(model, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    if eval_units and dist.is_main:
        final.update(evaluate(plain, eval_units, partial(forward, net=plain), cfg.batch_size))
    if cfg.kl_prompts and dist.is_main:
        final.update(heldout_kl(plain, tokenizer, inputs["model"], examples, eval_units or train_units, cfg, ctx,
                                pad_id, merged_input))
    ctx.log_metrics(final, step=cfg.max_steps)

    out, model_dir = model_output_dir(ctx, "model")
    merge = cfg.lora.merge or merged_input
    if dist.is_main:
        models.save_model(plain, tokenizer, model_dir, merge=merge)
    is_adapter = cfg.lora.r > 0 and not merge
    tail = history[-max(1, min(10, len(history) // 5)) :]
    summary = {"final_loss": float(np.mean([h["train/loss"] for h in tail])), "first_loss": history[0]["train/loss"],
               "trained_steps": float(trained), "units_per_s": units_seen / elapsed if elapsed and trained else 0.0,
               **{k.replace("/", "_"): v for k, v in final.items()}}
    ctx.log_metrics({k: v for k, v in summary.items() if not k.startswith("eval_")})
    extra = {"base_fingerprint": inputs["model"].fingerprint} if is_adapter else {}
    return {"model": Output("model", "adapter" if is_adapter else "model", out, metrics=summary, extra=extra)}


def detached(out: pl.PreferenceLoss) -> pl.PreferenceLoss:
    """A CPU copy without gradient, to send to the other ranks for step metrics."""
    return out._replace(losses=out.losses.detach().cpu(), chosen_rewards=out.chosen_rewards.detach().cpu(),
                        rejected_rewards=out.rejected_rewards.detach().cpu(),
                        extras={k: v.detach().cpu() for k, v in out.extras.items()})


def extras_means(outs: list[pl.PreferenceLoss]) -> dict[str, float]:
    keys = sorted({k for o in outs for k in o.extras})
    out = {}
    for k in keys:
        vals = torch.cat([o.extras[k].reshape(-1).double() for o in outs if k in o.extras])
        out[f"train/{k}"] = float(vals.mean())
    return out


@torch.no_grad()
def evaluate(model, units: list[int], forward, batch_size: int) -> dict[str, float]:
    """Reward accuracy, rewards, margin and log-probs on the held-out pairs (eval/*)."""
    was_training = model.training
    model.eval()
    outs = [forward(units[i : i + batch_size]) for i in range(0, len(units), batch_size)]
    model.train(was_training)
    m = {f"eval/{k.removeprefix('rewards/')}": v for k, v in pl.reward_metrics(outs).items()}
    m["eval/loss"] = float(torch.cat([o.losses.detach() for o in outs]).mean())
    for k, v in extras_means(outs).items():
        if k.startswith("train/logps/"):
            m[k.replace("train/", "eval/", 1)] = v
    return m


def heldout_kl(model, tokenizer, model_input: Input, examples: list[Example], units: list[int],
               cfg: PreferenceOptimizationConfig, ctx: StageContext, pad_id: int, merged_input: bool) -> dict[str, float]:
    """KL(policy || reference) per completion, estimated on completions sampled from the policy.

    k1 on the policy's own samples: mean over samples of sum_t (log pi - log pi_ref), an unbiased
    estimate of the sequence-level KL. Prompts: the first kl_prompts distinct held-out prompts.
    """
    from stages.sampling.generation import generate

    seen, prompts = set(), []
    for u in units:
        key = repr(examples[u if cfg.loss not in pl.PAIRED else 2 * u].messages)
        if key not in seen:
            seen.add(key)
            prompts.append(examples[u if cfg.loss not in pl.PAIRED else 2 * u].messages)
        if len(prompts) == cfg.kl_prompts:
            break
    spec = GenerationSpec(max_new_tokens=cfg.kl_max_new_tokens, temperature=1.0, top_p=1.0, batch_size=len(prompts))
    comps, _ = generate(model, tokenizer, prompts, spec, n=2, seed=ctx.seed, progress=False)
    seqs = [tokenize(tokenizer, p, c.text, cfg.max_length) for p, cs in zip(prompts, comps, strict=True) for c in cs]
    policy = score_examples(model, seqs, pad_id, ctx.device, cfg.batch_size * 2, desc="kl: policy")
    if cfg.lora.r > 0:
        with model.disable_adapter():
            ref = score_examples(model, seqs, pad_id, ctx.device, cfg.batch_size * 2, desc="kl: reference")
    else:  # full fine-tuning: the reference is the input model, loaded once now that training is over
        ref_model, _ = model_input.load_model()
        if merged_input:
            ref_model = ref_model.merge_and_unload()
        ref = score_examples(ref_model.to(ctx.device), seqs, pad_id, ctx.device, cfg.batch_size * 2,
                             desc="kl: reference")
        del ref_model
    diffs = np.array(policy) - np.array(ref)
    return {"eval/kl": float(diffs.mean()), "eval/kl_samples": float(len(diffs))}
