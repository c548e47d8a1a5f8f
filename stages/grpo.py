"""`grpo` stage: group-relative policy optimisation with verifiable rewards, and its variants.

One step reads like the paper (DeepSeekMath §4.1, arXiv 2402.03300): sample G completions for each
of B prompts from the current policy, score them, turn each group's rewards into advantages, then
take clipped policy-gradient steps, optionally anchored to a reference by a KL penalty. The math
lives in `stages/math/rl.py` (advantages, policy losses, aggregation, KL estimators), the rollouts and the
step loop in `stages/training/` (shared with ppo); this module only orders them. Variants are config: Dr. GRPO (`advantage: dr_grpo`, `aggregation: constant`), DAPO
(`epsilon_high > epsilon_low`, `aggregation: token_mean`, `dynamic_sampling`, overlong reward),
GSPO (`policy_loss: gspo`), CISPO (`policy_loss: cispo`), RLOO (`advantage: rloo`).

Departures from the papers, on purpose:
- old log-probs are the trainer's own forward pass of the first epoch (same numerics as the loss; the
  parameters change only after an epoch), so with mu = 1 the ratio is exactly 1 and clipping only matters for mu > 1;
- within one optimisation epoch, gradients of all mini-batches are accumulated into one optimizer
  step, each weighted by its share of the step (`rl.minibatch_share`), so mini-batching only bounds memory
  (tested: the same update within fp32 rounding);
- a completion that cannot be scored (reward None) gets reward 0 and is counted in `unscored`;
- `old_logprobs: sampler` takes the trainer's old log-probs from the first epoch's own forward pass
  (the parameters do not change within an epoch, so they are exact) and multiplies each token's
  policy loss by the truncated IS weight min(pi_trainer / pi_sampler, tis_cap); how far the two log-probs of the
  trained tokens are apart is logged per step (`sampler/logprob_delta_*`, `rollouts.drift_metrics`; async too, and
  on a vLLM engine in either mode: with `trainer` the engine's log-probs serve the drift only);
- process supervision (`process_coef > 0`) adds the accumulated, group-normalised step rewards to the
  outcome advantage instead of replacing it, so verifiable rewards still count (`stages.training.process_rewards`:
  from the `process_reward_model` input, or the reward model scoring each step prefix);
- on N processes the step's prompts are split among them (prompts_per_step / N whole groups each;
  a dynamic-sampling refill draws from a per-process stream), every process rolls out and scores
  its own groups with its own sampling seed, the reward matrices are gathered so the advantages
  are exactly one process's for the same rollouts (`rl.sharded_group_advantages`), the loss
  normalisers (sequences, tokens) are the whole step's, gradients are summed
  (`stages.runtime.distributed`), and rollout metrics cover every process's groups;
- an `environment:` other than single_turn rolls out multi-turn trajectories (`training.env_rollouts`), whole rows;
- without a KL term (beta = 0) the groups whose advantages are all 0 (equal rewards) skip the update's forward and
  backward passes (`trained_rows`): their loss and gradient are exactly 0 and the normalisers still count them, so
  the update is the same (tested) for less compute; `train/entropy` and the clip statistics then cover the rows
  trained, and `reward/zero_std_groups` says what share of the groups was flat.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import torch

from schemas.configs import GRPOConfig
from schemas.errors import ConfigError
from stages.base import Input, Output, StageContext
from stages.math import rl
from stages.modeling import models, prefix_sharing
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.completions import render_prompts
from stages.sampling.generation import TransformersBackend, make_backend, release
from stages.training import async_rollouts, env_rollouts, groups, process_rewards, rl_loop, rollouts
from stages.training.checkpoints import resume
from stages.training.loop import CheckpointPublisher, autocast
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    resolve_precision,
    set_lr,
)
from stages.training.rollout_batch import (
    RolloutBatch,
    even_passes,
    filler_backward,
    minibatch_rows,
    place,
    signal_rows,
)
from stages.training.rollouts import build_batch

VERSION = "5"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = GRPOConfig
INPUTS = {"model": "model", "prompts": "prompts", "reward_model": "model?", "process_reward_model": "model?"}
OUTPUTS = {"model": "model"}
cache_salt = env_rollouts.rl_environment_salt  # a user file's sha256, a built-in's version, "" for single_turn


def check(cfg: GRPOConfig, node: str = "grpo") -> None:
    """Plan-time refusals, before any compute; `node`: the recipe node's name, for the `--set` an error names."""
    if cfg.ref_refresh_every and cfg.lora.r > 0:
        raise ConfigError("grpo.ref_refresh_every: needs full fine-tuning (lora.r=0); with LoRA the reference "
                          "is the base model with the adapter disabled")
    if cfg.generation.temperature == 0:
        raise ConfigError("grpo.generation.temperature: must be > 0 (a group of identical greedy samples has no signal)")
    env_rollouts.check_environment("grpo", cfg, [("process_coef > 0 (step rewards)", cfg.process_coef > 0)])
    rl_loop.check_async(node, cfg)


# ---------------------------------------------------------------------------- session


@dataclasses.dataclass
class Session:
    """What every phase of a step reads: config, the policy (sharded under fsdp), its frozen reference, the
    unsharded sampling copy, optimizer, sampler backend, scorer, data, process group."""

    cfg: GRPOConfig
    ctx: StageContext
    dist: distributed.Dist
    model: torch.nn.Module
    ref: torch.nn.Module | None  # full fine-tuning with beta > 0 (LoRA: the base, the adapter disabled)
    sampler: torch.nn.Module | None  # fsdp: rollouts come from an unsharded copy, refreshed before each rollout
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    backend: object
    tokenizer: object
    pad_id: int
    scorer: object | None  # a RewardScorer: the reward_model reward component and process supervision
    rows: list[dict]
    held_out: list[dict]
    autocast_dtype: torch.dtype | None
    engine: bool  # a colocated vLLM engine samples; the trainer's weights are pushed into it before each rollout
    step_scorer: object | None = None  # a heads.StepScorer (the process_reward_model input): process supervision
    synced: int | None = None  # the step whose weights the sampler holds (fsdp)
    env: env_rollouts.EnvironmentRollouts | None = None  # multi-turn rollouts (None: single_turn, the backend samples)
    rollouts: async_rollouts.AsyncRollouts | None = None  # async.max_staleness >= 1: the workers' groups

    @property
    def weight_cap(self) -> float:
        """C of the per-token importance weight: async.importance_cap when asynchronous, else tis_cap."""
        return self.cfg.async_.importance_cap if self.rollouts is not None else self.cfg.tis_cap

    @property
    def whole_policy(self) -> torch.nn.Module:
        """The policy's weights in one piece: the sampling copy under fsdp, else the model."""
        return self.sampler if self.sampler is not None else self.model

    def sync_sampler(self, done: int) -> None:
        """fsdp: the weights after step `done` into the sampling copy (a collective), once per step."""
        if self.sampler is not None and self.synced != done:
            self.dist.copy_weights(self.model, self.sampler)
            self.synced = done

    def autocast(self):
        return autocast(self.ctx.device, self.autocast_dtype)


def open_session(cfg: GRPOConfig, inputs: dict[str, Input], ctx: StageContext) -> tuple[Session, bool]:
    """Load prompts, policy, reference, sampling copy, optimizer, sampler and scorer; (session, whether the input
    was an adapter)."""
    prm = inputs.get("process_reward_model")
    if prm is not None and cfg.process_coef <= 0:
        raise ConfigError(f"grpo: the process_reward_model input ({prm.label}) is used only with process_coef > 0 "
                          "(process supervision); set process_coef (e.g. 0.5) or leave the input out")
    rows, held_out, wants_rm, dist, engine = rollouts.start_run("grpo", cfg, inputs, ctx, (
        ("process_coef > 0", cfg.process_coef > 0 and prm is None),
        ("reward.weights.reward_model", cfg.reward.weights.get("reward_model", 0) != 0)))
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    is_lora = cfg.lora.r > 0
    ref = None
    if cfg.beta > 0 and not is_lora:
        ref = copy.deepcopy(model).eval().requires_grad_(False).to(ctx.device)
    sampler = copy.deepcopy(model).requires_grad_(False).to(ctx.device) if dist.sharded else None
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    if engine:
        backend = make_backend(cfg.generation, model, tokenizer, inputs["model"], seed=ctx.seed,
                               colocated=True)
    else:
        # rollouts in the training passes' precision (bf16 on a GPU), not the fp32 master weights'
        backend = TransformersBackend(sampler if sampler is not None else model, tokenizer, autocast_dtype)
    scorer = None
    if inputs.get("reward_model") is not None and wants_rm:
        from stages.modeling.heads import RewardScorer

        scorer = RewardScorer.from_input(inputs["reward_model"], device=ctx.device)
    step_scorer = None
    if prm is not None:
        from stages.modeling.heads import StepScorer

        step_scorer = StepScorer.from_input(prm, device=ctx.device)
    ctx.log_params({"train_prompts": len(rows), "trainable_parameters": counts["trainable"],
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})
    return Session(cfg, ctx, dist, model, ref, sampler, trainable, optimizer, backend, tokenizer,
                   rollouts.pad_token_id(tokenizer), scorer, rows, held_out, autocast_dtype, engine,
                   step_scorer, env=env_rollouts.open_environment("grpo", cfg, backend, autocast_dtype)), merged_input


# ---------------------------------------------------------------------------- advantages and training tensors


@dataclasses.dataclass
class Update:
    """A step's training tensors on this process. n = 0: it has no groups (dynamic sampling) but still joins every
    gradient sum; the tensors are then None."""

    adv: torch.Tensor  # (N,) outcome advantages, or (N, L-1) per token with process supervision
    n: int  # this process's sequences
    batch: dict[str, torch.Tensor] | None = None  # build_batch's whole rows
    rollout_batch: RolloutBatch | None = None
    shared: bool = False  # mini-batches of whole groups, each prompt run once
    old_logp: torch.Tensor | None = None  # (N, L-1), filled by the first epoch's forward passes
    sampler_logp: torch.Tensor | None = None  # old_logprobs: sampler, async, or (drift only) a vLLM engine's
    tis_w: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # beta > 0


def with_sampler_logprobs(s: Session) -> bool:
    """Whether a step's samples carry the sampler's log-probs: the behaviour policy of the importance weight
    (`old_logprobs: sampler`, asynchronous workers), or a vLLM engine's, for the drift alone."""
    return s.cfg.old_logprobs == "sampler" or s.rollouts is not None or bool(s.engine)


def advantages(s: Session, g: groups.Groups, rewards_by_rank: list[torch.Tensor], metrics: dict[str, float]) -> Update:
    """Group-relative advantages of this process's sequences (exactly one process's for every process's rewards)
    and their training tensors; with process_coef > 0 plus process_coef times the per-token step advantages."""
    cfg = s.cfg
    adv = rl.sharded_group_advantages(rewards_by_rank, s.dist.rank, cfg.advantage, cfg.std).reshape(-1)  # (B*G,)
    n = adv.numel()
    if not n:
        return Update(adv, n)
    flat_comps = [c for cs in g.comps for c in cs]
    if s.env is not None:  # the sampler's own ids; the loss mask on the model's tokens, never an observation's
        batch, prompt_ids, completion_ids = env_rollouts.group_rows(g.comps, s.pad_id, cfg.mask_truncated)
    else:
        prompt_texts = render_prompts(s.tokenizer, [r["messages"] for r in g.rows], cfg.generation.prefill)
        prompt_ids = [s.tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
        completion_ids = [list(c.token_ids) for c in flat_comps]
        keep = [not (cfg.mask_truncated and c.finish_reason == "length") for c in flat_comps]
        batch = build_batch([p for p in prompt_ids for _ in range(cfg.group_size)], completion_ids, s.pad_id, keep)
    prompt_lens = [len(p) for p in prompt_ids for _ in range(cfg.group_size)]
    if cfg.process_coef > 0:  # plus the step advantages of each token: (B*G, L-1); their time counts as scoring
        t_ps = time.perf_counter()
        step_adv, ps_metrics = process_rewards.token_advantages(s.step_scorer, s.scorer, s.tokenizer, g.rows, g.comps,
                                                                cfg.step_delimiter)
        adv = adv[:, None] + cfg.process_coef * place(step_adv, prompt_lens, batch["input_ids"].shape[1])
        metrics.update({**ps_metrics, "time/scoring": metrics["time/scoring"] + time.perf_counter() - t_ps})
    s.model.train()
    # the prompt runs once per group through a KV cache or packed with its completions (either where both
    # can, by cost); under gradient checkpointing there is no cache: packed if the model can be
    cached = prefix_sharing.can_share_prefix(s.model)
    shared = cfg.prefix_sharing and s.env is None and (cached or prefix_sharing.can_pack_prefix(s.model))
    rollout_batch = RolloutBatch(batch, prompt_ids, completion_ids, cfg.group_size, s.pad_id, shared, s.ctx.device,
                                 cfg.logprob_chunk, None if cached else True)
    u = Update(adv, n, batch, rollout_batch, shared)
    u.old_logp = torch.zeros_like(batch["loss_mask"])  # the first epoch's own passes fill it (exact: see above)
    corrected = cfg.old_logprobs == "sampler" or s.rollouts is not None  # async: mu, the behaviour policy's
    if with_sampler_logprobs(s):  # on vLLM the engine's log-probs come along for the drift (the loss uses them if corrected)
        u.sampler_logp = (batch["sampler_logprobs"] if s.env is not None  # multi-turn: already in the mask's layout
                          else place([list(c.logprobs or ()) for c in flat_comps], prompt_lens, batch["input_ids"].shape[1]))
        u.tis_w = torch.zeros_like(u.sampler_logp) if corrected else None
    if cfg.beta > 0:
        u.ref_logp = reference_logprobs(s, u)
    return u


@torch.no_grad()
def reference_logprobs(s: Session, u: Update) -> torch.Tensor:
    """(N, L-1) log-probs of the frozen reference. LoRA: the base, the adapter disabled; under fsdp in the
    unsharded sampling copy, which holds this step's weights, so no rank's reference pass is a collective."""
    ref_logp = torch.zeros_like(u.batch["loss_mask"])
    is_lora = s.cfg.lora.r > 0
    base = s.whole_policy
    with base.disable_adapter() if is_lora else contextlib.nullcontext():
        for idx in minibatch_rows(u.n, s.cfg.group_size, s.cfg.minibatch_size, u.shared, torch.Generator()):
            ref_logp[idx] = u.rollout_batch.logprobs(base if is_lora else s.ref, idx)[0].float().cpu()
    return ref_logp


# ---------------------------------------------------------------------------- the update


TRAIN_STATS = ("loss", "clip_low", "clip_high", "kl", "entropy", "mismatch_kl", "weight_mean", "clipped")


def update(s: Session, u: Update, step: int) -> tuple[dict[str, list[float]], float, float]:
    """mu epochs over the step's sequences in shuffled mini-batches; each epoch accumulates all of them into one
    optimizer step, normalised by the whole step's sequences or tokens. (this process's mini-batch statistics,
    the last gradient norm, the learning rate)."""
    cfg, dist = s.cfg, s.dist
    lr = set_lr(s.optimizer, cfg.learning_rate * lr_factor(step, cfg.steps, int(cfg.warmup_ratio * cfg.steps),
                                                           "constant"))
    # normalisers of the whole step (every process's sequences and tokens)
    n_all, total_tokens = dist.sum([u.n, float(u.batch["loss_mask"].sum()) if u.n else 0.0])
    total_tokens = max(1.0, total_tokens)
    train_stats: dict[str, list[float]] = {k: [] for k in TRAIN_STATS}
    rows = trained_rows(u, cfg.group_size)
    for epoch in range(cfg.mu):
        generator = torch.Generator().manual_seed(seed_stream(s.ctx.seed, "minibatch_order", step, epoch))
        batches = [rows[m] for m in minibatch_rows(len(rows), cfg.group_size, cfg.minibatch_size,
                                                   u.n > 0 and u.shared, generator)]
        for idx in even_passes(batches, dist):
            if idx is None:  # fsdp: a weight-0 pass, so every rank runs as many forwards and backwards
                filler_backward(s.model, s.pad_id, s.ctx.device)
                continue
            minibatch_backward(s, u, idx, epoch, n_all, total_tokens, train_stats)
        dist.sync_gradients(s.trainable)
        grad_norm = clip_grad_norm(s.trainable, cfg.max_grad_norm)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
    return train_stats, grad_norm, lr


def trained_rows(u: Update, group_size: int) -> torch.Tensor:
    """The rows the update runs forward and backward: without a KL term (no reference log-probs) only the groups
    whose advantages are not all zero (`signal_rows`: the others' loss and gradient are exactly 0, and the step's
    normalisers still count them), else every row. Late in a run most groups can be flat (every sample right):
    their passes were half a step's training time for no gradient."""
    if u.n == 0 or u.ref_logp is not None:
        return torch.arange(u.n)
    rows = signal_rows(u.adv, u.batch["loss_mask"], group_size)
    # every group flat (no dynamic sampling): one group still runs, so the step's gradients are zeros rather than
    # none and the optimizer steps as it did (Adam's moments move with a zero gradient), with its statistics
    return rows if len(rows) else torch.arange(group_size)


def minibatch_backward(s: Session, u: Update, idx: torch.Tensor, epoch: int, n_all: float, total_tokens: float,
                       train_stats: dict[str, list[float]]) -> None:
    """The clipped policy loss of rows `idx` (times the TIS weight, plus beta * KL to the reference), aggregated
    and weighted by the mini-batch's share of the step; backward, and its statistics into `train_stats` (on the device)."""
    cfg, dev = s.cfg, s.ctx.device
    mask = u.batch["loss_mask"][idx].to(dev)
    with s.autocast():
        logp, entropy = u.rollout_batch.logprobs(s.model, idx, with_entropy=True)
    if epoch == 0:  # params unchanged within an epoch: exact old log-probs
        u.old_logp[idx] = logp.detach().float().cpu()
    if u.tis_w is not None and epoch == 0:
        w, tis_stats = rl.tis_weights(u.old_logp[idx], u.sampler_logp[idx], u.batch["loss_mask"][idx], s.weight_cap)
        u.tis_w[idx] = w
        for k, val in tis_stats.items():
            train_stats[k].append(float(val))
    per_token, stats = rl.policy_loss(logp, u.old_logp[idx].to(dev), u.adv[idx].to(dev), mask, cfg.policy_loss,
                                      cfg.epsilon_low, cfg.epsilon_high)
    if u.tis_w is not None:
        per_token = per_token * u.tis_w[idx].to(dev)
    if u.ref_logp is not None:
        kl = rl.KL_ESTIMATORS[cfg.kl_estimator](logp, u.ref_logp[idx].to(dev)) * mask
        per_token = per_token + cfg.beta * kl
        train_stats["kl"].append(kl.detach().sum() / mask.sum().clamp(min=1))
    loss = rl.aggregate(per_token, mask, cfg.aggregation,
                        max_tokens=s.env.max_total_tokens if s.env else cfg.generation.max_new_tokens)
    weight = rl.minibatch_share(cfg.aggregation, len(idx), float(u.batch["loss_mask"][idx].sum()), n_all, total_tokens)
    (loss * weight).backward()
    train_stats["loss"].append(loss.detach().double() * weight)
    train_stats["clip_low"].append(stats["clip_low"])
    train_stats["clip_high"].append(stats["clip_high"])
    train_stats["entropy"].append((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))


def refresh_reference(s: Session, step: int) -> None:
    """ref_refresh_every: the reference becomes the policy every that many steps (full fine-tuning only)."""
    if s.ref is not None and s.cfg.ref_refresh_every and (step + 1) % s.cfg.ref_refresh_every == 0:
        s.dist.copy_weights(s.model, s.ref)


def ref_state(cfg: GRPOConfig, done: int) -> dict[str, bool]:
    """What a checkpoint records of the reference: whether it has been refreshed to the policy by step `done`."""
    return {"ref_is_policy": bool(cfg.ref_refresh_every and done >= cfg.ref_refresh_every)}


# ---------------------------------------------------------------------------- metrics


def train_metrics(s: Session, train_stats: dict[str, list[float]], grad_norm: float, lr: float, t_train: float,
                  t_step: float) -> dict[str, float]:
    """Means of the step's mini-batch statistics over every process, and the step's times."""
    cfg = s.cfg
    totals = rollouts.stat_totals(train_stats, s.dist)  # key -> (sum, count) over every process's mini-batches
    metrics = {
        "train/loss": totals["loss"][0] / cfg.mu,
        **{f"train/{k}": totals[k][0] / totals[k][1] for k in ("clip_low", "clip_high", "entropy")},
        "train/grad_norm": grad_norm, "train/lr": lr, "time/training": time.perf_counter() - t_train,
        "time/step": time.perf_counter() - t_step,
    }
    if totals["kl"][1]:
        metrics["train/kl"] = totals["kl"][0] / totals["kl"][1]
    if totals["mismatch_kl"][1]:
        metrics.update({f"train/{name}": totals[k][0] / totals[k][1] for name, k in (
            ("mismatch_kl", "mismatch_kl"), ("tis_weight_mean", "weight_mean"), ("tis_clipped", "clipped"))})
    return metrics


def evaluate(s: Session, done: int) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts after step `done` (every rank syncs the sampling copy, a collective
    under fsdp; rank 0 evaluates, the others return {})."""
    s.sync_sampler(done)
    if not s.dist.is_main:
        return {}
    if s.engine:
        s.backend.sync(s.model, done, s.cfg.generation.sync_timeout_s)
    if s.env is not None:  # with the tools of the training rollouts
        return s.env.held_out_eval(s.held_out, s.cfg.generation, s.ctx.seed)
    return rl_loop.held_out_eval(s.backend, s.held_out, s.cfg.generation, s.ctx.seed)


# ---------------------------------------------------------------------------- the stage


def train_step(s: Session, step: int) -> dict[str, float]:
    """One GRPO step: rollout and score, advantages (and process supervision), reference pass, mu update epochs;
    its metrics. A step whose groups were all flat (every process's) trains nothing: `train/skipped`."""
    t_step = time.perf_counter()
    s.sync_sampler(step)
    cfg = s.cfg
    # the policy's current weights into the vLLM engine, in place (LoRA folded in), timed; asynchronous, the workers'
    # engines sample (each pushed the version it samples with) and the learner's only evaluates
    sampling = s.engine and s.rollouts is None
    synced = s.backend.sync(s.model, step, cfg.generation.sync_timeout_s) if sampling else None
    if s.rollouts is not None:  # sampled and scored by a rollout worker with policy version max(0, step - K)
        delivery = s.rollouts.take(step)
        g = delivery.groups
    else:
        g = groups.sample_groups(s.backend, s.rows, cfg, s.ctx.seed, step, s.dist,
                                 s.scorer if cfg.reward.weights.get("reward_model", 0) != 0 else None,
                                 cfg.dynamic_sampling, cfg.max_refill_rounds,
                                 logprobs=with_sampler_logprobs(s),
                                 env=s.env)
    rewards_by_rank, metrics = groups.gather_groups(g, s.dist, cfg.group_size)
    if synced is not None:
        metrics["time/weight_sync"] = synced
    if not any(len(r) for r in rewards_by_rank):  # every group was flat: nothing to learn from this step
        metrics.update({"train/skipped": 1.0, "time/training": 0.0})
        if s.rollouts is not None:
            metrics.update(s.rollouts.step_metrics(delivery))
        return metrics
    t_train = time.perf_counter()
    u = advantages(s, g, rewards_by_rank, metrics)
    train_stats, grad_norm, lr = update(s, u, step)
    refresh_reference(s, step)
    metrics.update(train_metrics(s, train_stats, grad_norm, lr, t_train, t_step))
    if with_sampler_logprobs(s):  # every process: the drift is gathered
        metrics.update(sampler_metrics(s, u))
    if s.rollouts is not None:
        metrics.update(s.rollouts.step_metrics(delivery))
    return metrics


def sampler_metrics(s: Session, u: Update) -> dict[str, float]:
    """The sampler's log-probs against the trainer's first-epoch ones on the step's trained tokens: their drift
    (`rollouts.drift_metrics`, every process's tokens) and, asynchronous, the importance weights. Asynchronous the
    sampler is a worker holding the weights of `async/staleness_mean` versions ago, so the drift holds that change
    of the policy as well as the numerics."""
    if u.n == 0:  # no groups on this process (dynamic sampling): it still joins the gather
        empty = torch.zeros(0, 0)
        return rollouts.drift_metrics(empty, empty, empty, s.dist)
    rows = trained_rows(u, s.cfg.group_size)
    trained = (u.old_logp[rows], u.sampler_logp[rows], u.batch["loss_mask"][rows])
    metrics = rollouts.drift_metrics(*trained, s.dist)
    if s.rollouts is not None:
        metrics.update(async_rollouts.weight_metrics(*trained, s.weight_cap))
    return metrics


def run(cfg: GRPOConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    s, merged_input = open_session(cfg, inputs, ctx)
    state = resume(ctx, s.model, s.optimizer, "grpo", cfg.steps)
    if s.ref is not None and state.get("ref_is_policy"):  # refreshed before the crash: approximate by the policy
        s.dist.copy_weights(s.model, s.ref)
    publish = CheckpointPublisher(ctx, s.dist, cfg.publish_checkpoints_every, cfg.steps, lambda: s.whole_policy,
                                  s.tokenizer, cfg.lora, merged_input, inputs["model"])
    loop = rl_loop.StepLoop("grpo", cfg, ctx, s.dist, state, s.model, s.optimizer, s.held_out, publish)
    if cfg.async_.max_staleness and loop.steps:  # the rollout workers start from the resumed step's weights
        s.rollouts = async_rollouts.AsyncRollouts("grpo", cfg, ctx, inputs, s.rows, s.model, state)
    done, finished = loop.start, False
    try:
        for step in loop.steps:
            metrics = train_step(s, step)
            done = step + 1
            if s.rollouts is not None:  # the next version, for the workers, before the checkpoint and eval
                s.rollouts.publish(done, s.model)
            extra = {**ref_state(cfg, done), **(s.rollouts.checkpoint_state() if s.rollouts is not None else {})}
            if "train/skipped" in metrics:
                stop = loop.skipped_step(metrics, done, extra)
            else:
                stop = loop.end_step(metrics, done, lambda d: evaluate(s, d), extra,
                                     reward=f"{metrics['reward/mean']:.3f}")
            if stop:
                break
        finished = True
    finally:
        if s.rollouts is not None:
            s.rollouts.close(finished)
        release(s.backend)  # a vLLM engine is shut down: the flow's next stage may start its own
    s.sync_sampler(done)  # fsdp: the final weights, whole, in the sampling copy (a collective)
    return loop.finish(inputs, s.whole_policy, s.tokenizer, merged_input, {"reward": "reward/mean"})
