"""`preference_optimization` stage: DPO and its family on preference pairs (or unpaired rows for KTO).

One step reads like the DPO paper: a micro-batch of pairs goes through the policy as one
concatenated forward pass (chosen rows, then rejected rows), each completion's token log-probs
are reduced to a sequence log-prob (sum, or mean for SimPO/ORPO), and the loss of
`stages/math/preference.py` compares them with the reference's, read from a cached
`reference_logprobs` artifact. The math lives in `stages.math.preference`; this module orders it.

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

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from schemas.configs import GenerationSpec, PreferenceOptimizationConfig
from schemas.errors import ArtifactError, ConfigError, SchemaError
from stages.base import Input, Output, StageContext, declared_kinds, seed_everything
from stages.math import preference as pl
from stages.modeling import models
from stages.modeling.prefix_sharing import completion_logprobs, score_examples
from stages.runtime import distributed
from stages.training.loop import Loop, StepResult, autocast, curve_tail, policy_output, save_policy
from stages.training.optim import load_trainable, resolve_precision
from stages.training.pairs import DESIRABLE, Example, examples_from, split_pairs, tokenize

VERSION = "5"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = PreferenceOptimizationConfig
INPUTS = {"model": "model", "preferences": "preferences|unpaired", "reference": "ref_logprobs?"}
OUTPUTS = {"model": "model"}


def check(cfg: PreferenceOptimizationConfig) -> None:
    if cfg.loss == "cdpo" and cfg.label_smoothing == 0:
        raise ConfigError("preference_optimization.label_smoothing: cdpo needs a label_smoothing > 0 (0 is plain dpo)")


# ---------------------------------------------------------------------------- plan hook: wiring for the loss


@dataclass(frozen=True)
class LossNeeds:
    """What a `preference_optimization` loss reads, so that the plan wires it before any compute.

    data: the dataset kinds it trains on, preferred first (KTO: labelled unpaired rows, else pairs
    read as chosen = desirable); reference: it reads reference log-probs (SimPO and ORPO do not);
    kl: its reference also scores mismatched (prompt, completion) pairs, KTO's reference point.
    """

    data: tuple[str, ...]
    reference: bool
    kl: bool


# From the loss registry, so a loss added there is wired by the inputs it declares.
LOSS_NEEDS: dict[str, LossNeeds] = {
    loss: LossNeeds(data=("preferences",) if loss in pl.PAIRED else ("unpaired", "preferences"),
                    reference=loss in pl.NEEDS_REFERENCE, kl="kl_ref" in spec.inputs)
    for loss, spec in pl.LOSSES.items()
}
TRAINS, REFERENCE = "preference_optimization", "reference_logprobs"  # the stages the hook wires


def _data_source(src: str, kinds: tuple[str, ...], node_outputs: dict[str, dict[str, str]], where: str) -> str:
    """`src` or a sibling output of its node with the first of `kinds` it has (pairs -> unpaired rows for KTO)."""
    up, out = src.split(".", 1)
    outputs = node_outputs[up]
    if out not in outputs:
        return src  # load_plan names the missing output
    for kind in kinds:
        if kind in declared_kinds(outputs[out]):
            return src
        sibling = next((o for o, k in outputs.items() if kind in declared_kinds(k)), None)
        if sibling is not None:
            return f"{up}.{sibling}"
    raise ConfigError(f"{where} trains on {' or '.join(kinds)}, but {src} is {outputs[out]} and node {up!r} has no "
                      f"{kinds[0]} output; wire one, or choose a loss that trains on {outputs[out]}")


def wire_plan(stages: dict[str, str], outputs: dict[str, dict[str, str]], cfgs: dict[str, Any],
              wiring: dict[str, dict[str, str]], user_set: dict[tuple[str, str], str]) -> dict[str, str]:
    """The plan hook (flows/plan/recipes.py calls it while planning, before any compute): wire every
    preference_optimization node for its loss (`LOSS_NEEDS`); returns the nodes dropped, with why.

    The data input takes the kind the loss trains on from the same upstream node (KTO: preference_data's
    unpaired rows). A reference-free loss reads no reference, and a reference_logprobs node that nothing
    else reads is dropped. A reference node scores exactly its consumer's data, at its max_length, with
    the KL pairs KTO needs. `user_set` ((node, field) -> the `--set` text): a `--set` that contradicts
    this fails here, before any compute, with the `--set` that fixes it. Mutates `cfgs` and `wiring`.
    """
    unread: dict[str, str] = {}  # reference node -> why its reader let it go
    consumers: dict[str, list[str]] = {}
    for name, stage in stages.items():
        if stage != TRAINS:
            continue
        loss = cfgs[name].loss
        needs, w = LOSS_NEEDS[loss], wiring[name]
        if "preferences" in w:
            w["preferences"] = _data_source(w["preferences"], needs.data, outputs, f"node {name!r} ({name}.loss={loss})")
        ref = w.get("reference", "").split(".", 1)[0]
        if not ref:
            continue
        if not needs.reference:
            del w["reference"]
            unread[ref] = f"{name}.loss={loss} is reference-free, so {name!r} reads no reference log-probs"
        elif stages[ref] == REFERENCE:
            consumers.setdefault(ref, []).append(name)

    for ref, names in consumers.items():
        wanted = {(wiring[n].get("model"), wiring[n].get("preferences"), cfgs[n].max_length) for n in names}
        if len(wanted) > 1:
            raise ConfigError(f"node {ref!r} is the reference of {', '.join(map(repr, names))}, which differ in model, "
                              f"data or max_length; give each its own {REFERENCE} node")
        ((model, source, length),) = wanted
        if wiring[ref].get("model") != model:
            raise ConfigError(f"node {ref!r} input 'model' is {wiring[ref].get('model')}, but {names[0]!r} trains "
                              f"from {model}: reference log-probs must come from the model being trained")
        if source is not None:
            wiring[ref]["preferences"] = source
        update: dict[str, Any] = {}
        if cfgs[ref].max_length != length:
            if (ref, "max_length") in user_set:
                raise ConfigError(f"--set {user_set[ref, 'max_length']} differs from {names[0]}.max_length={length}: "
                                  f"node {ref!r} must score at its consumer's max_length; add --set "
                                  f"{names[0]}.max_length={cfgs[ref].max_length}, or drop that --set")
            update["max_length"] = length
        kto = next((n for n in names if LOSS_NEEDS[cfgs[n].loss].kl), None)
        if kto is not None and not cfgs[ref].include_kl:
            if (ref, "include_kl") in user_set:
                raise ConfigError(f"--set {user_set[ref, 'include_kl']} contradicts {kto}.loss={cfgs[kto].loss}: node "
                                  f"{ref!r} must score KTO's mismatched pairs (field include_kl); use "
                                  f"--set {ref}.include_kl=true, or drop that --set")
            update["include_kl"] = True
        if update:
            cfgs[ref] = cfgs[ref].model_copy(update=update)

    read = {src.split(".", 1)[0] for w in wiring.values() for src in w.values()}
    dropped = {ref: why for ref, why in unread.items() if ref not in read and stages[ref] == REFERENCE}
    for ref in dropped:
        del wiring[ref], cfgs[ref]
    return dropped


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


# ---------------------------------------------------------------------------- data and reference


def load_examples(cfg: PreferenceOptimizationConfig, data: Input) -> list[Example]:
    """The rows to train on (pairs as chosen, rejected rows; KTO's scored and KL rows), checked before any model
    loads: a paired loss needs a preferences dataset."""
    kind = data.manifest.schema_name
    if cfg.loss in pl.PAIRED and kind != "preferences":
        raise ConfigError(f"preference_optimization.loss={cfg.loss!r} needs preference pairs; {data.label} is "
                          f"{kind!r} (only kto trains on unpaired rows)")
    return examples_from(data, include_kl=cfg.loss == "kto")


@dataclasses.dataclass(frozen=True)
class Units:
    """What a step samples: pairs (paired losses: pair i is rows 2i, 2i+1) or scored rows (kto), split by id."""

    train: list[int]
    eval: list[int]
    kl_rows: dict[int, int]  # kto: each unit's KL row (its completion under another prompt); else empty


def split_units(cfg: PreferenceOptimizationConfig, examples: list[Example], seed: int, label: str) -> Units:
    """The training and held-out units; the held-out split is by id, seeded."""
    if cfg.loss in pl.PAIRED:
        n_units = len(examples) // 2
        unit_ids = [examples[2 * i].id for i in range(n_units)]
    else:
        scored = [i for i, e in enumerate(examples) if e.role != "kl"]
        n_units, unit_ids = len(scored), [examples[i].id for i in scored]
    ids = sorted(set(unit_ids))
    train_id_idx, eval_id_idx = split_pairs(len(ids), cfg.eval_fraction, seed)
    eval_ids = {ids[i] for i in eval_id_idx}
    all_units = list(range(n_units)) if cfg.loss in pl.PAIRED else scored
    train_units = [u for u, i in zip(all_units, unit_ids, strict=True) if i not in eval_ids]
    eval_units = [u for u, i in zip(all_units, unit_ids, strict=True) if i in eval_ids]
    if not train_units:
        raise SchemaError(f"{label}: {len(ids)} id(s) are too few to hold out eval_fraction={cfg.eval_fraction}")
    kl_rows = {}
    if cfg.loss == "kto":
        kl_of = {e.id: i for i, e in enumerate(examples) if e.role == "kl"}
        kl_rows = {u: kl_of[examples[u].id] for u in all_units}
    return Units(train_units, eval_units, kl_rows)


@dataclasses.dataclass
class Session:
    """What every step reads and what the run accumulates: config, data, reference, model, precision."""

    cfg: PreferenceOptimizationConfig
    ctx: StageContext
    dist: distributed.Dist
    model: torch.nn.Module  # as the processes hold it (sharded under fsdp)
    tokenizer: object
    pad_id: int
    examples: list[Example]
    tokenized: list[tuple[list[int], int]]  # (token ids, completion tokens) of every example
    autocast_dtype: torch.dtype | None
    counts: dict[str, int]  # the model's parameters, trainable and total, before sharding
    units: Units | None = None
    ref_logps: list[float] | None = None  # the reference's summed log-prob of every example; None: reference-free
    history: list[dict] = dataclasses.field(default_factory=list)  # every step's metrics so far
    units_seen: int = 0  # trained since the run (re)started, every process's

    def step_units(self, step: int) -> list[list[int]]:
        """The step's grad_accum micro-batches of training units: a pure function of (seed, step)."""
        cfg, train_units = self.cfg, self.units.train
        rng = np.random.default_rng([self.ctx.seed, step])
        need = cfg.batch_size * cfg.grad_accum
        picked = [train_units[j] for j in rng.choice(len(train_units), size=need, replace=len(train_units) < need)]
        return [picked[i : i + cfg.batch_size] for i in range(0, need, cfg.batch_size)]

    def forward(self, units: list[int], group: distributed.Dist = distributed.SINGLE, net=None) -> pl.PreferenceLoss:
        """The loss of `units`, this rank's share of a micro-batch spread over `group` (KTO's z0 spans it),
        under `net` (default: the model being trained)."""
        cfg, device = self.cfg, self.ctx.device
        net = self.model if net is None else net
        kl_ref = (kto_reference_point(net, cfg, units, self.units.kl_rows, self.tokenized, self.ref_logps,
                                      self.pad_id, device, group)
                  if cfg.loss == "kto" else None)
        with autocast(device, self.autocast_dtype):
            return batch_loss(net, cfg, units, self.examples, self.tokenized, self.ref_logps, self.pad_id, device,
                              kl_ref)


def open_session(cfg: PreferenceOptimizationConfig, inputs: dict[str, Input], ctx: StageContext,
                 examples: list[Example]) -> tuple[Session, bool]:
    """Load and shard the policy, tokenize every example; (session, whether the input was an adapter)."""
    dist = distributed.of(ctx)
    seed_everything(ctx.seed)
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenized = [tokenize(tokenizer, e.messages, e.completion, cfg.max_length) for e in examples]
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    return Session(cfg, ctx, dist, model, tokenizer, pad_id, examples, tokenized, autocast_dtype, counts), merged_input


def reference_logps(s: Session, inputs: dict[str, Input]) -> tuple[list[float] | None, str]:
    """The reference's log-prob of every example (cached, or the policy's before its first update) and where
    it came from ("cached", "computed", or "none" for a reference-free loss)."""
    cfg, ctx, dist, ref_input = s.cfg, s.ctx, s.dist, inputs.get("reference")
    ref_logps, ref_source = None, "none"
    if cfg.loss in pl.NEEDS_REFERENCE:
        t0 = time.perf_counter()
        if ref_input is not None:
            ref_logps = reference_table(ref_input, s.examples, s.tokenized, inputs["preferences"], inputs["model"],
                                        cfg.max_length)
            ref_source = "cached"
        elif dist.active and not dist.sharded:  # the policy before its first update (N processes: a part each)
            ref_logps = dist.gather_list(score_examples(s.model, dist.part(s.tokenized), s.pad_id, ctx.device,
                                                        cfg.batch_size * 2, s.autocast_dtype))
            ref_source = "computed"
        else:  # one process, or fsdp (every rank must run the same forwards: each scores everything)
            ref_logps = score_examples(s.model, s.tokenized, s.pad_id, ctx.device, cfg.batch_size * 2, s.autocast_dtype)
            ref_source = "computed"
        ctx.log_metrics({"reference_seconds": time.perf_counter() - t0})
    elif ref_input is not None:
        ctx.log.info("preference_optimization: loss %s is reference-free; the reference input is not used", cfg.loss)
    return ref_logps, ref_source


# ---------------------------------------------------------------------------- the training loop


def resume_session(s: Session, loop: Loop) -> int:
    """Load the newest checkpoint and re-log its curve; the step."""
    state = loop.resume("preference_optimization")
    s.history = state.get("history", [])
    for i, m in enumerate(s.history):
        s.ctx.log_metrics(m, step=i + 1)
    return state["step"]


def train_step(s: Session, loop: Loop, step: int, lr: float) -> StepResult:
    """One optimizer step over the step's micro-batches (this rank's share of each), then held-out metrics
    every eval_every steps (not at the last: the run's end evaluates)."""
    cfg, dist = s.cfg, s.dist
    micro = s.step_units(step)
    n = sum(len(m) for m in micro)  # the global step's units
    outs, loss_total = [], 0.0
    for units in micro:
        out = s.forward(dist.shard(units), dist)
        loss = out.losses.sum() / n
        loss.backward()
        loss_total += float(loss.detach())
        outs.append(out)
        s.units_seen += len(units)
    dist.sync_gradients(loop.trainable)
    if dist.active:
        (loss_total,) = dist.sum([loss_total])
        outs = dist.gather_list([detached(o) for o in outs])
    grad_norm = loop.update()
    metrics = {"train/loss": loss_total, "train/lr": lr, "train/grad_norm": grad_norm,
               **{f"train/{k}": v for k, v in pl.reward_metrics(outs).items()}, **extras_means(outs)}
    done = step + 1
    if s.units.eval and cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
        net = dist.full_model(s.model, s.ctx.device)  # rank 0 evaluates (fsdp: an unsharded copy, gathered)
        if dist.is_main:
            metrics.update(held_out_preference_metrics(net, s.units.eval, partial(s.forward, net=net), cfg.batch_size))
        del net
    s.history.append(metrics)
    return StepResult(metrics, {"history": s.history}, {"loss": f"{loss_total:.4f}"})


def final_metrics(s: Session, plain, model_input: Input, merged_input: bool) -> dict[str, float]:
    """Rank 0's held-out metrics of the trained policy and its KL to the reference (eval/*)."""
    cfg, units = s.cfg, s.units
    final: dict[str, float] = {}
    if units.eval and s.dist.is_main:
        final.update(held_out_preference_metrics(plain, units.eval, partial(s.forward, net=plain), cfg.batch_size))
    if cfg.kl_prompts and s.dist.is_main:
        final.update(heldout_kl(plain, s.tokenizer, model_input, s.examples, units.eval or units.train, cfg, s.ctx,
                                s.pad_id, merged_input))
    return final


def summarize(history: list[dict], trained: int, units_per_s: float, final: dict[str, float]) -> dict[str, float]:
    """The run's loss at its start and end, its length, its throughput and its final held-out metrics."""
    return {"final_loss": float(np.mean([h["train/loss"] for h in curve_tail(history)])),
            "first_loss": history[0]["train/loss"], "trained_steps": float(trained), "units_per_s": units_per_s,
            **{k.replace("/", "_"): v for k, v in final.items()}}


# ---------------------------------------------------------------------------- the stage


def run(cfg: PreferenceOptimizationConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    examples = load_examples(cfg, inputs["preferences"])  # validates before any model loads
    s, merged_input = open_session(cfg, inputs, ctx, examples)
    dist = s.dist
    s.units = split_units(cfg, examples, ctx.seed, inputs["preferences"].label)
    s.ref_logps, ref_source = reference_logps(s, inputs)
    ctx.log_params({"units_train": len(s.units.train), "units_eval": len(s.units.eval), "reference": ref_source,
                    "trainable_parameters": s.counts["trainable"], "total_parameters": s.counts["total"],
                    "precision": str(s.autocast_dtype or "fp32")})
    loop = Loop.open(cfg, ctx, dist, s.model)
    start = resume_session(s, loop)
    elapsed = loop.train(start, f"preference_optimization ({cfg.loss})", partial(train_step, s, loop))
    trained = cfg.max_steps - start

    plain = dist.full_model(s.model, ctx.device)  # rank 0's evaluation and save (fsdp: gathered, unsharded)
    final = final_metrics(s, plain, inputs["model"], merged_input)
    ctx.log_metrics(final, step=cfg.max_steps)
    out, is_adapter = save_policy(ctx, dist, plain, s.tokenizer, cfg.lora, merged_input)
    summary = summarize(s.history, trained, s.units_seen / elapsed if elapsed and trained else 0.0, final)
    ctx.log_metrics({k: v for k, v in summary.items() if not k.startswith("eval_")})
    return {"model": policy_output(out, is_adapter, inputs["model"], summary)}


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
def held_out_preference_metrics(model, units: list[int], forward, batch_size: int) -> dict[str, float]:
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
