"""`ppo` stage: PPO with a learned critic, KL-penalised per-token rewards and GAE, the classic RLHF stage.

One step reads like InstructGPT (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155) on PPO (Schulman
et al. 2017, https://arxiv.org/abs/1707.06347): sample completions for B prompts from the current policy,
score each (verifiers, the learned reward model, shaping: routed per prompt as in grpo), compute the old
policy's and the reference's log-probs and the critic's values, spread the score over the tokens with a
KL penalty (`rl.kl_penalized_rewards`), estimate advantages by GAE (`rl.gae`, Schulman et al. 2016),
whiten them (`rl.whiten`), then run `mu` epochs (PPO's epochs) over shuffled mini-batches, each one optimizer
step on the clipped surrogate (`rl.policy_loss`, the one grpo uses, with per-token advantages) plus
`vf_coef` times the clipped value loss (`rl.value_loss`). GRPO is this with the critic replaced by the
group mean. The math lives in `stages/math/rl.py`; this module only orders it.

The critic is a `*ForSequenceClassification` model (`stages.reward_model`): the decoder with a
Linear(hidden, 1) `score` head, read at every token instead of pooled at the last one. `critic:
policy_copy` builds it from the input model with a fresh head; `critic: reward_model` starts from the
reward model input, head included (InstructGPT initialises the value function from the reward model).
LoRA or full fine-tuning for each (`lora`, `critic_lora`).

Choices and departures, on purpose:
- one AdamW over both models with two parameter groups (`learning_rate`, `critic_learning_rate`) and one
  backward of policy loss + vf_coef * value loss per mini-batch; the models share no weights, so this is
  two optimizers' update in one checkpoint; gradient norms are clipped per model;
- old log-probs and old values come from no-grad passes of the trainer after generation (the loss's
  numerics), so the first mini-batch's ratio is exactly 1 and clipping acts from the second on;
- V(s_t) of the state before completion token t is read at the position that predicts token t (the
  last prompt token for the first), so values, log-probs and the loss mask share one (N, L-1) layout;
- both losses are token means over the mini-batch's completion tokens, on every process together;
- a completion that cannot be scored gets score 0 and is counted in `reward/unscored`;
- an `environment:` other than single_turn rolls out multi-turn trajectories (`training.env_rollouts`): the
  losses, values and KL on the model's sampled tokens only, GAE across an observation as one transition
  (`masking.multiturn_gae`), the score on the last sampled token;
- asynchronous (`async.max_staleness` K >= 1, `training.async_rollouts`, the machinery grpo uses): rollout workers
  sample step s with the policy's weights after step max(0, s - K) and record each token's log-prob (mu); the
  learner's old passes at consumption give pi_prox (its weights before the step's first epoch) and the values, so
  the KL penalty, GAE and the critic's targets are the learner's, and the policy loss is the decoupled one
  (`offpolicy.decoupled_policy_loss`: the clipped ratio to pi_prox times min(pi_prox / mu, async.importance_cap));
  how far mu is from pi_prox on the step's tokens is logged as `sampler/logprob_delta_*` (`rollouts.drift_metrics`);
- on N processes (ddp) each rolls out prompts_per_step / N prompts and takes minibatch_size / N rows of
  every mini-batch; advantages are whitened over every process's tokens, the loss normaliser is the
  mini-batch's global token count and gradients are summed (`stages.runtime.distributed`), so the update is the
  single-process one. FSDP is not built for ppo (its config refuses it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import torch
from peft import PeftModel

from schemas.configs import PPOConfig
from schemas.errors import ConfigError, ModelError
from stages.base import Input, Output, StageContext
from stages.math import masking, offpolicy, rl
from stages.modeling import logprobs, models
from stages.modeling.heads import (
    RewardScorer,
    apply_reward_lora,
    load_reward_model,
    reward_model_from_causal_lm,
)
from stages.rewards.verifiers import Verdict
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.completions import Completion, render_prompts
from stages.sampling.generation import make_backend, release
from stages.training import async_rollouts, env_rollouts, groups, rl_loop, rollouts
from stages.training.checkpoints import resume
from stages.training.loop import CheckpointPublisher, autocast
from stages.training.optim import clip_grad_norm, load_trainable, lr_factor, make_optimizer, resolve_precision
from stages.training.rollout_batch import place
from stages.training.rollouts import build_batch

VERSION = "3"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = PPOConfig
INPUTS = {"model": "model", "prompts": "prompts", "reward_model": "model?"}
OUTPUTS = {"model": "model"}
cache_salt = env_rollouts.rl_environment_salt  # a user file's sha256, a built-in's version, "" for single_turn


def check(cfg: PPOConfig, node: str = "ppo") -> None:
    """Plan-time refusals, before any compute; `node`: the recipe node's name, for the `--set` an error names."""
    if cfg.generation.temperature == 0:
        raise ConfigError("ppo.generation.temperature: must be > 0 (greedy rollouts explore nothing, and the ratio "
                          "and KL are computed for the policy's own distribution)")
    if cfg.critic_warmup_steps >= cfg.steps:
        raise ConfigError(f"ppo.critic_warmup_steps: {cfg.critic_warmup_steps} of {cfg.steps} steps would never train "
                          "the policy; use fewer warmup steps or more steps")
    env_rollouts.check_environment("ppo", cfg)
    rl_loop.check_async(node, cfg)


# ---------------------------------------------------------------------------- tensors


def _critic_inner(critic):
    """The sequence-classification model under a PeftModel (LoRA layers stay injected in it)."""
    return critic.get_base_model() if isinstance(critic, PeftModel) else critic


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, L-1) float values: the critic's `score` head on the last hidden state at positions 0 .. L-2, i.e.
    V of the state before the token each position predicts. input_ids, attention_mask: (N, L), right padded."""
    inner = _critic_inner(critic)
    hidden = distributed.inner_output(critic, inner.base_model, input_ids=input_ids, attention_mask=attention_mask,
                                      use_cache=False).last_hidden_state  # (N, L, H)
    return inner.score(hidden[:, :-1]).squeeze(-1).float()


def everyones(x: torch.Tensor, mask: torch.Tensor, dist: distributed.Dist) -> tuple[torch.Tensor, int]:
    """x at every process's masked-in positions, 1-D in rank order, and where this process's part starts."""
    parts = dist.gather(x[mask.bool()].detach().cpu())
    return torch.cat(parts), sum(p.numel() for p in parts[: dist.rank])


def whiten_everywhere(x: torch.Tensor, mask: torch.Tensor, dist: distributed.Dist) -> torch.Tensor:
    """`rl.whiten` over the valid tokens of every process (on one process: rl.whiten itself)."""
    if not dist.active:
        return rl.whiten(x, mask)
    flat, start = everyones(x, mask, dist)
    white = rl.whiten(flat, torch.ones_like(flat))
    out = torch.zeros_like(x)
    m = mask.bool()
    out[m] = white[start : start + int(m.sum())].to(x.dtype)
    return out


# ---------------------------------------------------------------------------- models and session


@dataclasses.dataclass
class Models:
    """The policy, its critic, the frozen reference (None: LoRA's disabled adapter, or beta = 0), and both trained
    models as one module, so `checkpoints.save_checkpoint` / `checkpoints.resume` and one optimizer hold them together."""

    policy: torch.nn.Module
    critic: torch.nn.Module
    ref: torch.nn.Module | None
    is_lora: bool

    def __post_init__(self) -> None:
        self.trained = torch.nn.ModuleDict({"policy": self.policy, "critic": self.critic})
        self.policy_params = [p for p in self.policy.parameters() if p.requires_grad]
        self.critic_params = [p for p in self.critic.parameters() if p.requires_grad]

    def reference(self) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
        """(model, a fresh context to run it in) that computes the reference log-probs."""
        if self.is_lora:
            return self.policy, self.policy.disable_adapter()
        return self.ref, contextlib.nullcontext()


def load_critic(cfg: PPOConfig, inputs: dict[str, Input], tokenizer, device: str):
    """The value model: a sequence-classification copy of the policy's input model (fresh head) or the reward model."""
    if cfg.critic == "reward_model":
        model, rm_tokenizer, _ = load_reward_model(inputs["reward_model"], device)
        if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ModelError(f"ppo: critic=reward_model: {inputs['reward_model'].label} has another tokenizer than "
                             f"the policy {inputs['model'].label}; the critic reads the policy's tokens")
    else:
        lm, _ = inputs["model"].load_model()
        if isinstance(lm, PeftModel):
            lm = lm.merge_and_unload()
        model = reward_model_from_causal_lm(lm, rollouts.pad_token_id(tokenizer)).to(device)
        del lm
        init_value_head(model.score)
    if cfg.gradient_checkpointing:
        models.enable_activation_checkpointing(model, use_reentrant=False)
    return apply_reward_lora(model, cfg.critic_lora).train()


def init_value_head(head: torch.nn.Linear) -> None:
    """A fresh value head starts at zero (weights and bias): V = 0 at every token until the critic learns.

    transformers' default head (std 0.02 on Llama-style models) reads SmolLM2's last hidden states (norm ~50, a
    shared mean direction of norm ~38) as values of mean ~1.4 and spread ~0.8, against returns in [0, 1] whose
    spread on the CPU profile is ~0.05: explained variance -4 to -9, and GAE advantages that were mostly the
    head's noise. OpenRLHF's std 1 / (hidden + 1) still left a per-token spread on the reward's scale (explained
    variance -1 to -3, flat training reward over 12 steps). At zero the first advantages are the returns
    (REINFORCE with the whitening's mean as baseline) and the head grows from the gradient; the critic's LoRA
    weights get gradient once the head is nonzero (after its first update)."""
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


@dataclasses.dataclass
class Session:
    """What every phase of a step reads: config, models, optimizer, sampler, scorer, data, process group."""

    cfg: PPOConfig
    ctx: StageContext
    dist: distributed.Dist
    models: Models
    optimizer: torch.optim.Optimizer
    backend: object
    tokenizer: object
    pad_id: int
    scorer: RewardScorer | None
    rows: list[dict]
    held_out: list[dict]
    autocast_dtype: torch.dtype | None
    engine: bool  # a colocated vLLM engine samples; the policy's weights are pushed into it before each rollout
    env: env_rollouts.EnvironmentRollouts | None = None  # multi-turn rollouts (None: single_turn, the backend samples)
    rollouts: async_rollouts.AsyncRollouts | None = None  # async.max_staleness >= 1: the workers' groups
    synced: float | None = None  # seconds of this step's push of the policy's weights into the vLLM engine

    def autocast(self):
        return autocast(self.ctx.device, self.autocast_dtype)


def open_session(cfg: PPOConfig, inputs: dict[str, Input], ctx: StageContext) -> tuple[Session, bool]:
    """Load prompts, policy, reference, critic, scorer and sampler; (session, whether the input was an adapter)."""
    rows, held_out, _, dist, engine = rollouts.start_run("ppo", cfg, inputs, ctx, (
        ("critic=reward_model", cfg.critic == "reward_model"),
        ("reward.weights.reward_model", cfg.reward.weights.get("reward_model", 0) != 0)))
    policy, tokenizer, merged_input = load_trainable(inputs["model"], cfg, ctx.device)
    is_lora = cfg.lora.r > 0
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if cfg.beta > 0 and not is_lora else None
    critic = load_critic(cfg, inputs, tokenizer, ctx.device)
    m = Models(policy.train(), critic, ref, is_lora)
    optimizer = make_optimizer(m.policy_params, cfg.learning_rate, cfg.weight_decay)
    optimizer.add_param_group({"params": m.critic_params, "lr": cfg.critic_learning_rate or cfg.learning_rate})
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    backend = make_backend(cfg.generation, policy, tokenizer, inputs["model"], seed=ctx.seed,
                           colocated=True, autocast_dtype=autocast_dtype)  # rollouts in the training precision
    scorer = None
    if cfg.reward.weights.get("reward_model", 0) != 0:
        scorer = RewardScorer.from_input(inputs["reward_model"], device=ctx.device)
    pad_id = rollouts.pad_token_id(tokenizer)
    counts = models.count_parameters(m.trained)
    ctx.log_params({"train_prompts": len(rows), "trainable_parameters": counts["trainable"],
                    "critic_trainable_parameters": sum(p.numel() for p in m.critic_params),
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})
    return Session(cfg, ctx, dist, m, optimizer, backend, tokenizer, pad_id, scorer, rows, held_out,
                   autocast_dtype, engine, env_rollouts.open_environment("ppo", cfg, backend, autocast_dtype)
                   ), merged_input


# ---------------------------------------------------------------------------- rollout and scoring


@dataclasses.dataclass
class Rollout:
    """One process's rollouts of a step, scored: N = prompts x group_size sequences, as training tensors."""

    rows: list[dict]  # the prompts row of each sequence
    comps: list[Completion]
    batch: dict[str, torch.Tensor]
    verdicts: list[Verdict]
    scores: torch.Tensor  # (N,)
    seconds: float  # sampling
    score_seconds: float
    behaviour_logp: torch.Tensor | None = None  # (N, L-1) asynchronous: mu, the sampling worker's log-probs
    delivery: async_rollouts.Delivery | None = None  # asynchronous: the groups as the learner took them
    sampler_logp: torch.Tensor | None = None  # (N, L-1) synchronous on vLLM: the engine's log-probs (drift only)


def rollout(s: Session, step: int) -> Rollout:
    """Sample this process's share of the step's prompts from the current policy and score each completion (the
    reward's weighted components; unscorable: 0), as the groups of grpo (`groups.sample_groups`); asynchronous:
    the groups a rollout worker sampled and scored with the policy's weights after step max(0, step - K)."""
    cfg = s.cfg
    # asynchronous, the workers' engines sample (each pushed its version) and the learner's only evaluates
    sampling = s.engine and s.rollouts is None
    s.synced = s.backend.sync(s.models.policy, step, cfg.generation.sync_timeout_s) if sampling else None
    delivery = s.rollouts.take(step) if s.rollouts is not None else None
    # on vLLM the engine's log-probs come along, for the sampler/trainer drift (the loss does not use them)
    g = delivery.groups if delivery is not None else groups.sample_groups(s.backend, s.rows, cfg, s.ctx.seed, step,
                                                                          s.dist, s.scorer, env=s.env,
                                                                          logprobs=s.engine)
    k = cfg.group_size
    flat = [c for cs in g.comps for c in cs]
    behaviour = None
    if s.env is not None:  # the sampler's own ids; the loss mask on the model's tokens, never an observation's
        batch = env_rollouts.trajectory_rows(flat, s.pad_id)
        behaviour = batch["sampler_logprobs"]
    else:
        texts = render_prompts(s.tokenizer, [r["messages"] for r in g.rows], cfg.generation.prefill)
        prompt_ids = [s.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        batch = build_batch([p for p in prompt_ids for _ in range(k)], [list(c.token_ids) for c in flat], s.pad_id)
        if delivery is not None or s.engine:
            behaviour = place([list(c.logprobs or ()) for c in flat], [len(p) for p in prompt_ids for _ in range(k)],
                              batch["input_ids"].shape[1])
    scores = torch.cat(g.rewards) if g.rewards else torch.zeros(0)
    return Rollout([r for r in g.rows for _ in range(k)], flat, batch, [v for vs in g.verdicts for v in vs], scores,
                   g.seconds, g.score_seconds, behaviour if delivery is not None else None, delivery,
                   behaviour if delivery is None and s.engine else None)


# ---------------------------------------------------------------------------- values and advantages


def index_chunks(n: int, size: int) -> list[torch.Tensor]:
    return [torch.arange(i, min(n, i + size)) for i in range(0, n, size)]


@torch.no_grad()
def old_passes(s: Session, ro: Rollout) -> dict[str, torch.Tensor]:
    """old_logp, ref_logp (= old_logp when beta = 0) and old_values of the rollout, each (N, L-1) on the CPU."""
    cfg, m = s.cfg, s.models
    mask = ro.batch["loss_mask"]
    out = {k: torch.zeros_like(mask) for k in ("old_logp", "ref_logp", "old_values")}
    for idx in index_chunks(mask.shape[0], cfg.minibatch_size // s.dist.world):
        ids, attn = ro.batch["input_ids"][idx].to(s.ctx.device), ro.batch["attention_mask"][idx].to(s.ctx.device)
        with s.autocast():
            out["old_logp"][idx] = logprobs.bucketed_token_logprobs(m.policy, ids, attn, cfg.logprob_chunk)[0].float().cpu()
            out["old_values"][idx] = token_values(m.critic, ids, attn).cpu()
            if cfg.beta > 0:
                ref_model, ref_ctx = m.reference()
                with ref_ctx:
                    out["ref_logp"][idx] = logprobs.bucketed_token_logprobs(ref_model, ids, attn,
                                                                            cfg.logprob_chunk)[0].float().cpu()
    if cfg.beta == 0:
        out["ref_logp"] = out["old_logp"].clone()
    return out


def advantages(s: Session, ro: Rollout, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-token rewards (score on the last token, -beta * KL_t on each), GAE advantages (whitened over every
    process's tokens) and returns, all (N, L-1)."""
    cfg, mask = s.cfg, ro.batch["loss_mask"]
    rewards, kl = rl.kl_penalized_rewards(ro.scores, old["old_logp"], old["ref_logp"], mask, cfg.beta,
                                          cfg.kl_estimator)
    # multi-turn: GAE over the model's tokens only, an observation a transition between two of them
    gae = masking.multiturn_gae if s.env is not None else rl.gae
    adv, returns = gae(rewards, old["old_values"], mask, cfg.gamma, cfg.lam)
    white = whiten_everywhere(adv, mask, s.dist) if cfg.whiten_advantages else adv
    return {"advantages": white, "raw_advantages": adv, "returns": returns, "rewards": rewards, "kl": kl}


# ---------------------------------------------------------------------------- the update


def critic_only(cfg: PPOConfig, step: int) -> bool:
    """Whether `step` is one of the critic warmup's: the policy's loss left out and its learning rate 0."""
    return step < cfg.critic_warmup_steps


def set_lrs(s: Session, step: int) -> float:
    """The step's learning rates (warmup, then constant) into both parameter groups; the policy's back."""
    factor = lr_factor(step, s.cfg.steps, int(s.cfg.warmup_ratio * s.cfg.steps), "constant")
    policy_group, critic_group = s.optimizer.param_groups
    policy_group["lr"] = s.cfg.learning_rate * factor
    critic_group["lr"] = (s.cfg.critic_learning_rate or s.cfg.learning_rate) * factor
    if critic_only(s.cfg, step):
        policy_group["lr"] = 0.0
    return policy_group["lr"]


def minibatch_step(s: Session, ro: Rollout, old: dict, adv: dict, idx: torch.Tensor,
                   policy_on: bool = True) -> dict[str, tuple[float, float]]:
    """One optimizer step on rows `idx`: clipped policy loss + vf_coef * clipped value loss, token means over the
    mini-batch's tokens on every process (the policy loss left out during critic warmup: `policy_on` false), its
    forward and backward passes `micro_batch_size` rows at a time (the gradient is the same, the memory bounded).
    Returns stat name -> (value, weight) for token-weighted means."""
    cfg, m = s.cfg, s.models
    tokens = float(ro.batch["loss_mask"][idx].sum())
    total = max(1.0, s.dist.sum([tokens])[0])
    sums: dict[str, float] = {}
    for sub in idx.split(cfg.micro_batch_size or len(idx)):
        for k, v in micro_backward(s, ro, old, adv, sub, total, policy_on).items():
            sums[k] = sums.get(k, 0.0) + v
    s.dist.sync_gradients(m.policy_params + m.critic_params)
    grad_norm = clip_grad_norm(m.policy_params, cfg.max_grad_norm)
    critic_grad_norm = clip_grad_norm(m.critic_params, cfg.max_grad_norm)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    n = max(tokens, 1.0)
    return {**{k: (v / n, tokens) for k, v in sums.items()},
            "grad_norm": (grad_norm, 1.0), "critic_grad_norm": (critic_grad_norm, 1.0)}


def micro_backward(s: Session, ro: Rollout, old: dict, adv: dict, idx: torch.Tensor, total: float,
                   policy_on: bool) -> dict[str, float]:
    """Forward and backward of rows `idx`, the losses divided by the mini-batch's global token count `total`;
    each statistic's sum over these rows' tokens."""
    cfg, m, dev = s.cfg, s.models, s.ctx.device
    ids, attn = ro.batch["input_ids"][idx].to(dev), ro.batch["attention_mask"][idx].to(dev)
    mask = ro.batch["loss_mask"][idx].to(dev)
    with s.autocast():
        logp, entropy = logprobs.bucketed_token_logprobs(m.policy, ids, attn, cfg.logprob_chunk, with_entropy=True)
        values = token_values(m.critic, ids, attn)  # (B, T)
    old_logp = old["old_logp"][idx].to(dev)
    if ro.behaviour_logp is None:
        pg, pg_stats = rl.policy_loss(logp.float(), old_logp, adv["advantages"][idx].to(dev), mask, "token",
                                      cfg.epsilon, cfg.epsilon)
    else:  # asynchronous: old_logp is pi_prox (the learner's weights when it took the groups), mu the worker's
        pg, pg_stats = offpolicy.decoupled_policy_loss(logp.float(), old_logp, ro.behaviour_logp[idx].to(dev),
                                                       adv["advantages"][idx].to(dev), mask, "token", cfg.epsilon,
                                                       cfg.epsilon, cfg.async_.importance_cap)
    vf, vf_stats = rl.value_loss(values, old["old_values"][idx].to(dev), adv["returns"][idx].to(dev), mask,
                                 cfg.value_clip)
    ((pg.sum() * float(policy_on) + cfg.vf_coef * vf.sum()) / total).backward()
    mf, n = mask.float(), float(mask.sum())

    def token_sum(x: torch.Tensor) -> float:
        return float((x.detach().float() * mf).sum())

    return {"policy_loss": token_sum(pg), "value_loss": token_sum(vf),
            "clip_low": float(pg_stats["clip_low"]) * n, "clip_high": float(pg_stats["clip_high"]) * n,
            "value_clipfrac": float(vf_stats["value_clipfrac"]) * n,
            "approx_kl": token_sum(rl.kl_k3(old_logp, logp.detach().float())), "entropy": token_sum(entropy)}


def update(s: Session, ro: Rollout, old: dict, adv: dict, step: int) -> dict[str, float]:
    """`mu` epochs over the rollout in shuffled mini-batches (one optimizer step each; the order a pure
    function of seed, step and epoch). Token-weighted means of the mini-batch statistics over every process."""
    cfg, n = s.cfg, len(ro.comps)
    sums: dict[str, list[float]] = {}
    for epoch in range(cfg.mu):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed_stream(s.ctx.seed, "minibatch_order",
                                                                                       step, epoch)))
        for idx in index_chunks(n, cfg.minibatch_size // s.dist.world):
            for k, (value, weight) in minibatch_step(s, ro, old, adv, order[idx],
                                                     policy_on=not critic_only(cfg, step)).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + value * weight, acc[1] + weight
    keys = sorted(sums)
    flat = s.dist.sum([x for k in keys for x in sums[k]])
    out = {f"train/{k}": flat[2 * i] / max(flat[2 * i + 1], 1e-12) for i, k in enumerate(keys)}
    out["train/loss"] = out["train/policy_loss"] + cfg.vf_coef * out["train/value_loss"]
    out["train/clipfrac"] = out["train/clip_low"] + out["train/clip_high"]
    return out


# ---------------------------------------------------------------------------- metrics


def gathered_rollout_metrics(s: Session, ro: Rollout) -> dict[str, float]:
    """Score, accuracy, format, components and lengths over every process's completions."""
    gathered = s.dist.gather((ro.verdicts, rollouts.text_free(ro.comps), ro.scores))
    return rollouts.rollout_metrics(torch.cat([g[2] for g in gathered]), [v for g in gathered for v in g[0]],
                                    [c for g in gathered for c in g[1]])


def critic_metrics(s: Session, ro: Rollout, old: dict, adv: dict) -> dict[str, float]:
    """KL to the reference, the KL-penalised return, and how well the old values explain the returns (every process)."""
    mask = ro.batch["loss_mask"]
    values, _ = everyones(old["old_values"], mask, s.dist)
    returns, _ = everyones(adv["returns"], mask, s.dist)
    kl, _ = everyones(adv["kl"], mask, s.dist)
    raw, _ = everyones(adv["raw_advantages"], mask, s.dist)
    seq_rewards = torch.cat(s.dist.gather(adv["rewards"].sum(-1)))
    ones = torch.ones_like(values)
    m = {"train/kl": float(kl.mean()) if kl.numel() else 0.0,
         "reward/kl_penalized": float(seq_rewards.mean()),
         "train/values_mean": float(values.mean()) if values.numel() else 0.0,
         "train/returns_mean": float(returns.mean()) if returns.numel() else 0.0,
         "train/advantages_std": float(raw.std()) if raw.numel() > 1 else 0.0}
    # 1 - Var(R - V) / Var(R) means nothing when every return is the same (every completion scored alike and
    # beta = 0): that step logs none rather than -1e7
    if values.numel() > 1 and float(rl.masked_mean_var(returns, ones)[1]) > 1e-8:
        m["train/explained_variance"] = float(rl.explained_variance(values, returns, ones))
    return m


# first/last-tenth means of the reward and the critic's fit, so a run's progress is a few numbers
SUMMARY_CURVES = {"reward": "reward/mean", "value_loss": "train/value_loss",
                  "explained_variance": "train/explained_variance"}


# ---------------------------------------------------------------------------- the stage


def train_step(s: Session, step: int) -> dict[str, float]:
    """One PPO step: rollout, score, old log-probs / reference / values, advantages, update epochs; its metrics."""
    t_step = time.perf_counter()
    ro = rollout(s, step)
    t_train = time.perf_counter()
    old = old_passes(s, ro)
    adv = advantages(s, ro, old)
    lr = set_lrs(s, step)
    metrics = {**gathered_rollout_metrics(s, ro), **critic_metrics(s, ro, old, adv), **update(s, ro, old, adv, step),
               "train/lr": lr}
    now = time.perf_counter()
    metrics.update({"time/generation": ro.seconds, "time/scoring": ro.score_seconds,
                    "time/training": now - t_train, "time/step": now - t_step})
    if s.synced is not None:
        metrics["time/weight_sync"] = s.synced
    if ro.sampler_logp is not None:  # the vLLM engine's log-probs against the trainer's of the same tokens
        metrics.update(rollouts.drift_metrics(old["old_logp"], ro.sampler_logp, ro.batch["loss_mask"], s.dist))
    if ro.delivery is not None:  # the worker's log-probs (mu) against the learner's (pi_prox) of the same tokens
        metrics.update(rollouts.drift_metrics(old["old_logp"], ro.behaviour_logp, ro.batch["loss_mask"], s.dist))
        metrics.update(async_rollouts.weight_metrics(old["old_logp"], ro.behaviour_logp, ro.batch["loss_mask"],
                                                     s.cfg.async_.importance_cap))
        metrics.update(s.rollouts.step_metrics(ro.delivery))
    return metrics


def evaluate(s: Session, done: int) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts after step `done` (rank 0; the others return {})."""
    if not s.dist.is_main:
        return {}
    if s.engine:
        s.backend.sync(s.models.policy, done, s.cfg.generation.sync_timeout_s)
    if s.env is not None:  # with the tools of the training rollouts
        return s.env.held_out_eval(s.held_out, s.cfg.generation, s.ctx.seed)
    return rl_loop.held_out_eval(s.backend, s.held_out, s.cfg.generation, s.ctx.seed)


def run(cfg: PPOConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    s, merged_input = open_session(cfg, inputs, ctx)
    state = resume(ctx, s.models.trained, s.optimizer, "ppo", cfg.steps)
    publish = CheckpointPublisher(ctx, s.dist, cfg.publish_checkpoints_every, cfg.steps, lambda: s.models.policy,
                                  s.tokenizer, cfg.lora, merged_input, inputs["model"])
    loop = rl_loop.StepLoop("ppo", cfg, ctx, s.dist, state, s.models.trained, s.optimizer, s.held_out, publish)
    if cfg.async_.max_staleness and loop.steps:  # the rollout workers start from the resumed step's policy weights
        s.rollouts = async_rollouts.AsyncRollouts("ppo", cfg, ctx, inputs, s.rows, s.models.policy, state)
    finished = False
    try:
        for step in loop.steps:
            metrics = train_step(s, step)
            extra = None
            if s.rollouts is not None:  # the next version, for the workers, before the checkpoint and eval
                s.rollouts.publish(step + 1, s.models.policy)
                extra = s.rollouts.checkpoint_state()
            if loop.end_step(metrics, step + 1, lambda d: evaluate(s, d), extra,
                             reward=f"{metrics['reward/mean']:.3f}", value_loss=f"{metrics['train/value_loss']:.3g}"):
                break
        finished = True
    finally:
        if s.rollouts is not None:
            s.rollouts.close(finished)
        release(s.backend)  # a vLLM engine is shut down: the flow's next stage may start its own
    return loop.finish(inputs, s.models.policy, s.tokenizer, merged_input, SUMMARY_CURVES)
