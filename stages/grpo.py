"""`grpo` stage: group-relative policy optimisation with verifiable rewards, and its variants.

One step reads like the paper (DeepSeekMath §4.1, arXiv 2402.03300): sample G completions for each
of B prompts from the current policy, score them, turn each group's rewards into advantages, then
take clipped policy-gradient steps, optionally anchored to a reference by a KL penalty. The math
lives in `stages/math/rl.py` (advantages, policy losses, aggregation, KL estimators); this module only
orders it. Variants are config: Dr. GRPO (`advantage: dr_grpo`, `aggregation: constant`), DAPO
(`epsilon_high > epsilon_low`, `aggregation: token_mean`, `dynamic_sampling`, overlong reward),
GSPO (`policy_loss: gspo`), CISPO (`policy_loss: cispo`), RLOO (`advantage: rloo`).

Departures from the papers, on purpose:
- old log-probs are recomputed with the trainer's own forward pass after generation (same numerics
  as the loss), so with mu = 1 the ratio is exactly 1 and clipping only matters for mu > 1;
- within one optimisation epoch, gradients of all mini-batches are accumulated into one optimizer
  step, normalised globally (per `aggregation`), so mini-batching only bounds memory;
- a completion that cannot be scored (reward None) gets reward 0 and is counted in `unscored`;
- `old_logprobs: sampler` takes the trainer's old log-probs from the first epoch's own forward pass
  (the parameters do not change within an epoch, so they are exact) and multiplies each token's
  policy loss by the truncated IS weight min(pi_trainer / pi_sampler, tis_cap);
- process supervision (`process_coef > 0`) adds the accumulated, group-normalised step rewards to the
  outcome advantage instead of replacing it, so verifiable rewards still count. The step rewards come
  from a process reward model (the `process_reward_model` input, the `prm` stage's: every step of a
  completion scored in one forward pass) or, without one, from the outcome reward model scoring each
  step prefix (one pass per prefix);
- on N processes the step's prompts are split among them (prompts_per_step / N whole groups each;
  a dynamic-sampling refill draws from a per-process stream), every process rolls out and scores
  its own groups with its own sampling seed, the reward matrices are gathered so the advantages
  are exactly one process's for the same rollouts (`rl.sharded_group_advantages`), the loss
  normalisers (sequences, tokens) are the whole step's, gradients are summed
  (`stages.runtime.distributed`), and rollout metrics cover every process's groups.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import numpy as np
import torch

from schemas.configs import GRPOConfig
from schemas.errors import ConfigError
from stages.base import Input, Output, StageContext
from stages.math import rl
from stages.modeling import logprobs, models
from stages.rewards.verifiers import Verdict, score
from stages.runtime import distributed
from stages.runtime.seeds import seed_stream
from stages.sampling.generation import (
    Completion,
    TransformersBackend,
    make_backend,
    render_prompts,
)
from stages.training import rollouts
from stages.training.checkpoints import resume
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    resolve_precision,
    set_lr,
)
from stages.training.rollouts import build_batch, pick_prompts, rollout_seed

VERSION = "4"  # 4: every random draw seeded by seed_stream (stages/runtime/seeds.py)
CONFIG = GRPOConfig
INPUTS = {"model": "model", "prompts": "prompts", "reward_model": "model?", "process_reward_model": "model?"}
OUTPUTS = {"model": "model"}


def check(cfg: GRPOConfig) -> None:
    if cfg.ref_refresh_every and cfg.lora.r > 0:
        raise ConfigError("grpo.ref_refresh_every: needs full fine-tuning (lora.r=0); with LoRA the reference "
                          "is the base model with the adapter disabled")
    if cfg.generation.temperature == 0:
        raise ConfigError("grpo.generation.temperature: must be > 0 (a group of identical greedy samples has no signal)")


# ---------------------------------------------------------------------------- tensors from rollouts


def place(values: list[list[float]], prompt_lens: list[int], width: int) -> torch.Tensor:
    """Per-completion-token values (e.g. sampler log-probs, token advantages) laid out like `loss_mask`.

    Row i's value j lands at position prompt_lens[i] - 1 + j, the position that predicts completion
    token j. Returns (N, width - 1), 0 elsewhere.
    """
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompt_lens, strict=True)):
        if len(v):
            out[i, p - 1 : p - 1 + len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   with_entropy: bool = False, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t+1 | tokens ≤ t) for every position of right-padded rows: (N, L-1), 0 where
    token t+1 is padding; and the entropy there if asked (`stages.modeling.logprobs`: the logits exist
    `chunk` positions at a time; rows of different lengths run in length buckets)."""
    return logprobs.bucketed_token_logprobs(model, input_ids, attention_mask, chunk_tokens=chunk,
                                            with_entropy=with_entropy)


def shared_prefix_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], group_size: int,
                           pad_id: int, width: int, device: str, with_entropy: bool = False, chunk: int = 4096,
                           pack: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of whole groups, laid out like `build_batch`'s (N, width-1), each prompt run once.

    prompt_ids: one per group (K); completion_ids: K*G rows, group k's at k*G .. k*G+G-1
    (`logprobs.shared_prefix_rows`: through a KV cache, or packed in one decoder call; `pack`).
    """
    prompt_of_row = [k for k in range(len(prompt_ids)) for _ in range(group_size)]
    return logprobs.shared_prefix_rows(model, prompt_ids, completion_ids, prompt_of_row, pad_id, width, device,
                                       chunk_tokens=chunk, with_entropy=with_entropy, pack=pack)


@dataclasses.dataclass
class RolloutBatch:
    """One step's rollouts as training tensors: `batch` (build_batch's whole rows), the groups'
    prompt ids (one per group) and each row's completion ids, for the shared-prefix path."""

    batch: dict[str, torch.Tensor]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    group_size: int
    pad_id: int
    shared: bool
    device: str
    chunk: int
    pack: bool | None = None  # True: only packing can share (no KV cache under gradient checkpointing)

    def logprobs(self, net, idx: torch.Tensor, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(len(idx), L-1) log-probs (and entropy) of rows `idx`; with `shared`, idx is whole groups."""
        if self.shared:
            groups = (idx[:: self.group_size] // self.group_size).tolist()
            return shared_prefix_logprobs(net, [self.prompt_ids[g] for g in groups],
                                          [self.completion_ids[r] for r in idx.tolist()], self.group_size, self.pad_id,
                                          self.batch["input_ids"].shape[1], self.device, with_entropy, self.chunk,
                                          self.pack)
        return token_logprobs(net, self.batch["input_ids"][idx].to(self.device),
                              self.batch["attention_mask"][idx].to(self.device), with_entropy=with_entropy,
                              chunk=self.chunk)


def minibatch_rows(n: int, group_size: int, minibatch_size: int, whole_groups: bool,
                   generator: torch.Generator) -> list[torch.Tensor]:
    """Row indices of an epoch's mini-batches in shuffled order: sequences, or whole groups (rows
    k*G .. k*G+G-1 together, max(1, minibatch_size // G) groups each) for prefix sharing."""
    if not whole_groups:
        order = torch.randperm(n, generator=generator)
        return [order[i : i + minibatch_size] for i in range(0, n, minibatch_size)]
    groups = torch.randperm(n // group_size, generator=generator)
    per = max(1, minibatch_size // group_size)
    return [(groups[i : i + per, None] * group_size + torch.arange(group_size)[None, :]).reshape(-1)
            for i in range(0, len(groups), per)]


def even_passes(minibatches: list[torch.Tensor], dist: distributed.Dist) -> list[torch.Tensor | None]:
    """The mini-batches, and under fsdp None (a filler) up to the most any rank has: FSDP all-gathers
    the layers in every forward and reduce-scatters in every backward, so every rank runs as many.
    Ranks differ when dynamic sampling leaves one with fewer groups, or none."""
    if not dist.sharded:
        return list(minibatches)
    most = int(dist.max(len(minibatches)))
    return list(minibatches) + [None] * (most - len(minibatches))


def filler_backward(model, pad_id: int, device: str) -> None:
    """A forward and backward of two pad tokens with weight 0: the collectives of a mini-batch, no gradient."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    (logp.sum() * 0.0).backward()


# ---------------------------------------------------------------------------- rollout


def rollout(backend, tokenizer, rows: list[dict], cfg: GRPOConfig, seed: int, scorer=None):
    """Sample G completions per prompt row and score them. Returns (completions, verdicts, rewards (B, G)).

    The sampler's own log-probs come along when `old_logprobs: sampler`; `scorer` (a RewardScorer)
    supplies the `reward_model` reward component.
    """
    completions, stats = backend.generate([r["messages"] for r in rows], cfg.generation, n=cfg.group_size,
                                          seed=seed, progress=False, logprobs=cfg.old_logprobs == "sampler")
    t0 = time.perf_counter()
    rm = None
    if scorer is not None:
        flat = scorer.score([r["messages"] for r, cs in zip(rows, completions, strict=True) for _ in cs],
                            [c.text for cs in completions for c in cs])
        rm = [flat[i * cfg.group_size : (i + 1) * cfg.group_size] for i in range(len(rows))]
    verdicts = [[score(r, c.text, cfg.reward, num_tokens=c.num_tokens, rm_score=rm[i][j] if rm else None)
                 for j, c in enumerate(comps)]
                for i, (r, comps) in enumerate(zip(rows, completions, strict=True))]
    rewards = torch.tensor([[v.reward if v.reward is not None else 0.0 for v in vs] for vs in verdicts])
    return completions, verdicts, rewards, stats.seconds, time.perf_counter() - t0


def stat_totals(stats: dict[str, list[float]], dist: distributed.Dist) -> dict[str, tuple[float, int]]:
    """Per key (sum, count) of a step's mini-batch statistics over every process."""
    keys = sorted(stats)
    flat = dist.sum([x for k in keys for x in (float(np.sum(stats[k])) if stats[k] else 0.0, len(stats[k]))])
    return {k: (flat[2 * i], int(flat[2 * i + 1])) for i, k in enumerate(keys)}


# ---------------------------------------------------------------------------- process supervision


def step_ends(pieces: list[str], delimiter: str = "\n") -> list[int]:
    """Inclusive token indices where a reasoning step ends, from each token's decoded text.

    A step ends at a token whose text contains the delimiter, once the step has non-blank text; the
    last token ends a trailing step. E.g. pieces ["a", "\n", "\n", "b"] → [1, 3] (a blank line is
    not a step).
    """
    ends, content = [], False
    for i, piece in enumerate(pieces):
        head, sep, tail = piece.partition(delimiter)
        content = content or bool(head.strip())
        if sep and content:
            ends.append(i)
            content = bool(tail.strip())
        elif sep:
            content = bool(tail.strip())
    if content and pieces and (not ends or ends[-1] != len(pieces) - 1):  # one token can end only one step
        ends.append(len(pieces) - 1)
    return ends


def process_advantages(scorer, tokenizer, rows: list[dict], comps: list[list], delimiter: str
                       ) -> tuple[list[list[float]], dict[str, float]]:
    """Process supervision from an outcome reward model: per-completion-token advantages from its scores of
    step prefixes.

    Each completion is cut into steps at `delimiter`; the reward model scores the prompt with the
    completion prefix up to the end of each step (one pass per prefix); the step rewards of a group are
    normalised together and every token gets the sum of the normalised rewards of the steps ending at or
    after it (`step_advantages_of`). Returns one list per completion (flattened B*G, in order) and metrics.
    """
    ends = [[step_ends([tokenizer.decode([t], skip_special_tokens=True) for t in c.token_ids], delimiter)
             for c in cs] for cs in comps]
    convs, texts = [], []
    for r, cs, es in zip(rows, comps, ends, strict=True):
        for c, e in zip(cs, es, strict=True):
            for end in e:
                convs.append(r["messages"])
                texts.append(tokenizer.decode(list(c.token_ids[: end + 1]), skip_special_tokens=True))
    flat = iter(scorer.score(convs, texts) if texts else [])
    return step_advantages_of(comps, ends, [[[next(flat) for _ in e] for e in es] for es in ends])


def token_ends_of(pieces: list[str], char_ends: list[int]) -> list[int]:
    """The token holding each step's last character: for exclusive character ends `char_ends` of the text
    "".join(pieces), the inclusive token index whose text covers character end - 1. E.g. pieces
    ["ab", "c\n", "\nd"] with steps "abc" and "d" (ends 3, 6) -> [1, 2]."""
    out, stop, i = [], 0, -1
    for end in char_ends:
        while stop < end and i + 1 < len(pieces):
            i += 1
            stop += len(pieces[i])
        out.append(max(i, 0))
    return out


def prm_process_advantages(step_scorer, tokenizer, rows: list[dict], comps: list[list]
                           ) -> tuple[list[list[float]], dict[str, float]]:
    """Process supervision from a process reward model: its probability that each step is right, all steps of a
    completion in one forward pass (`heads.StepScorer`, steps cut at the PRM's own delimiter), placed on the
    token that ends each step (`token_ends_of`; two steps ending in one token keep the later score), then
    normalised and accumulated as with a reward model (`step_advantages_of`)."""
    pieces = [[[tokenizer.decode([t], skip_special_tokens=True) for t in c.token_ids] for c in cs] for cs in comps]
    convs = [r["messages"] for r, cs in zip(rows, comps, strict=True) for _ in cs]
    texts = ["".join(p) for ps in pieces for p in ps]
    scored = iter(step_scorer.score_steps(convs, texts) if texts else [])
    ends, scores = [], []
    for ps in pieces:
        e_group, s_group = [], []
        for p in ps:
            char_ends, probs = next(scored)
            tok = token_ends_of(p, char_ends[: len(probs)])
            keep = [j for j in range(len(tok)) if j + 1 == len(tok) or tok[j + 1] != tok[j]]
            e_group.append([tok[j] for j in keep])
            s_group.append([probs[j] for j in keep])
        ends.append(e_group)
        scores.append(s_group)
    return step_advantages_of(comps, ends, scores)


def step_advantages_of(comps: list[list], ends: list[list[list[int]]], scores: list[list[list[float]]]
                       ) -> tuple[list[list[float]], dict[str, float]]:
    """Per group: the step scores (each completion's, at its inclusive token ends) normalised together
    (`rl.normalize_step_rewards`), and every token given the sum of the normalised scores of the steps ending
    at or after it (`rl.step_advantages`). One list per completion (B*G, in order) and metrics."""
    out, raw = [], []
    for cs, es, ss in zip(comps, ends, scores, strict=True):
        g, s_max = len(cs), max(1, max(len(e) for e in es))
        t_max = max(1, max(c.num_tokens for c in cs))
        r = torch.zeros(g, s_max)
        e_t = torch.full((g, s_max), -1, dtype=torch.long)
        for i, (e, s) in enumerate(zip(es, ss, strict=True)):
            r[i, : len(e)] = torch.tensor(s, dtype=torch.float32)
            e_t[i, : len(e)] = torch.tensor(e, dtype=torch.long)
            raw.extend(s)
        normed = rl.normalize_step_rewards(r, e_t >= 0)
        mask = torch.arange(t_max)[None, :] < torch.tensor([c.num_tokens for c in cs])[:, None]
        adv = rl.step_advantages(normed, e_t, mask)
        out.extend(adv[i, : c.num_tokens].tolist() for i, c in enumerate(cs))
    n = sum(len(cs) for cs in comps)
    return out, {"reward/process_mean": float(np.mean(raw)) if raw else 0.0,
                 "reward/steps_per_completion": len(raw) / max(1, n)}


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

    @property
    def whole_policy(self) -> torch.nn.Module:
        """The policy's weights in one piece: the sampling copy under fsdp, else the model."""
        return self.sampler if self.sampler is not None else self.model

    @property
    def share(self) -> int:
        """Whole groups per process and step."""
        return self.cfg.prompts_per_step // self.dist.world

    def sync_sampler(self, done: int) -> None:
        """fsdp: the weights after step `done` into the sampling copy (a collective), once per step."""
        if self.sampler is not None and self.synced != done:
            self.dist.copy_weights(self.model, self.sampler)
            self.synced = done

    def autocast(self):
        return torch.autocast(device_type=self.ctx.device.split(":")[0], dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)


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
        backend = make_backend(cfg.generation, model, tokenizer, inputs["model"].model_dir, seed=ctx.seed,
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
                   step_scorer), merged_input


# ---------------------------------------------------------------------------- rollout and scoring


@dataclasses.dataclass
class Groups:
    """One process's groups of a step (G completions of one prompt each; dynamic sampling kept only groups whose
    rewards differ), with how many groups were rolled out, how many were flat, and the times spent."""

    rows: list[dict] = dataclasses.field(default_factory=list)  # the prompts row of each group
    comps: list[list[Completion]] = dataclasses.field(default_factory=list)
    verdicts: list[list[Verdict]] = dataclasses.field(default_factory=list)
    rewards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # (G,) each
    zero_std_groups: int = 0
    total_groups: int = 0
    seconds: float = 0.0
    score_seconds: float = 0.0


def sample_groups(s: Session, step: int) -> Groups:
    """Roll out and score this process's share of the step's prompts; dynamic sampling drops all-equal groups
    and refills from this process's own stream, up to max_refill_rounds times."""
    cfg, dist, g = s.cfg, s.dist, Groups()
    for attempt in range(1 + (cfg.max_refill_rounds if cfg.dynamic_sampling else 0)):
        if attempt == 0:  # the step's prompts, split among the processes in whole groups
            picked_idx = dist.shard(pick_prompts(len(s.rows), cfg.prompts_per_step, s.ctx.seed, step, 0))
        else:  # a refill of this process's dropped groups, from its own stream
            picked_idx = pick_prompts(len(s.rows), s.share - len(g.rows), s.ctx.seed, step, attempt, dist.rank)
        picked = [s.rows[i] for i in picked_idx]
        c, v, r, tg, ts = rollout(s.backend, s.tokenizer, picked, cfg,
                                  seed=rollout_seed(s.ctx.seed, step, attempt, dist.rank),
                                  scorer=s.scorer if cfg.reward.weights.get("reward_model", 0) != 0 else None)
        g.seconds, g.score_seconds = g.seconds + tg, g.score_seconds + ts
        flat = (r.max(dim=1).values == r.min(dim=1).values).tolist()
        g.zero_std_groups += sum(flat)
        g.total_groups += len(flat)
        for i in range(len(picked)):
            if cfg.dynamic_sampling and flat[i]:
                continue
            g.rows.append(picked[i])
            g.comps.append(c[i])
            g.verdicts.append(v[i])
            g.rewards.append(r[i])
        if len(g.rows) >= s.share or not cfg.dynamic_sampling:
            break
    return g


def gather_groups(s: Session, g: Groups) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Every process's rewards (B_rank, G), in rank order, and the rollout metrics over every process's groups
    (gathered text-free: the advantages and metrics need them, the update only this process's)."""
    local_rewards = torch.stack(g.rewards) if g.rewards else torch.zeros(0, s.cfg.group_size)  # (B_rank, G)
    zero_std_groups, total_groups, t_gen, t_score = g.zero_std_groups, g.total_groups, g.seconds, g.score_seconds
    if s.dist.active:
        gathered = s.dist.gather((g.verdicts, [rollouts.text_free(cs) for cs in g.comps], local_rewards,
                                  (zero_std_groups, total_groups, t_gen, t_score)))
        rewards_by_rank = [x[2] for x in gathered]
        all_verdicts, all_comps = [v for x in gathered for v in x[0]], [c for x in gathered for c in x[1]]
        all_rewards = [row for x in gathered for row in x[2]]
        zero_std_groups, total_groups = sum(x[3][0] for x in gathered), sum(x[3][1] for x in gathered)
        t_gen, t_score = max(x[3][2] for x in gathered), max(x[3][3] for x in gathered)
    else:
        rewards_by_rank, all_verdicts, all_comps, all_rewards = [local_rewards], g.verdicts, g.comps, g.rewards
    metrics = rollouts.rollout_metrics(torch.stack(all_rewards) if all_rewards else torch.zeros(0, s.cfg.group_size),
                                       [v for vs in all_verdicts for v in vs], [c for cs in all_comps for c in cs],
                                       zero_std_groups / max(1, total_groups))
    metrics.update({"time/generation": t_gen, "time/scoring": t_score})
    return rewards_by_rank, metrics


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
    sampler_logp: torch.Tensor | None = None  # old_logprobs: sampler
    tis_w: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # beta > 0


def advantages(s: Session, g: Groups, rewards_by_rank: list[torch.Tensor], metrics: dict[str, float]) -> Update:
    """Group-relative advantages of this process's sequences (exactly one process's for every process's rewards)
    and their training tensors; with process_coef > 0 plus the reward model's per-token step advantages."""
    cfg = s.cfg
    adv = rl.sharded_group_advantages(rewards_by_rank, s.dist.rank, cfg.advantage, cfg.std).reshape(-1)  # (B*G,)
    n = adv.numel()
    if not n:
        return Update(adv, n)
    prompt_texts = render_prompts(s.tokenizer, [r["messages"] for r in g.rows], cfg.generation.prefill)
    prompt_ids = [s.tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
    flat_prompt_ids = [p for p in prompt_ids for _ in range(cfg.group_size)]
    flat_comps = [c for cs in g.comps for c in cs]
    keep = [not (cfg.mask_truncated and c.finish_reason == "length") for c in flat_comps]
    batch = build_batch(flat_prompt_ids, [list(c.token_ids) for c in flat_comps], s.pad_id, keep)
    prompt_lens = [len(p) for p in flat_prompt_ids]
    if cfg.process_coef > 0:
        adv = process_supervision(s, g, adv, prompt_lens, batch["input_ids"].shape[1], metrics)  # (B*G, L-1)
    s.model.train()
    # the prompt runs once per group through a KV cache or packed with its completions (either where both
    # can, by cost); under gradient checkpointing there is no cache: packed if the model can be
    cached = logprobs.can_share_prefix(s.model)
    shared = cfg.prefix_sharing and (cached or logprobs.can_pack_prefix(s.model))
    rollout_batch = RolloutBatch(batch, prompt_ids, [list(c.token_ids) for c in flat_comps], cfg.group_size,
                                 s.pad_id, shared, s.ctx.device, cfg.logprob_chunk, None if cached else True)
    u = Update(adv, n, batch, rollout_batch, shared)
    # The old policy's log-probs are the first epoch's own forward pass (filled in `minibatch_backward`): the
    # parameters change only after an epoch's last mini-batch, so they are exact, and no separate no-grad pass
    # over the batch is needed.
    u.old_logp = torch.zeros_like(batch["loss_mask"])
    if cfg.old_logprobs == "sampler":
        u.sampler_logp = place([list(c.logprobs or ()) for c in flat_comps], prompt_lens, batch["input_ids"].shape[1])
        u.tis_w = torch.zeros_like(u.sampler_logp)
    if cfg.beta > 0:
        u.ref_logp = reference_logprobs(s, u)
    return u


def process_supervision(s: Session, g: Groups, adv: torch.Tensor, prompt_lens: list[int], width: int,
                        metrics: dict[str, float]) -> torch.Tensor:
    """The outcome advantages (B*G,) plus process_coef times the step advantages of the process reward model
    (`prm_process_advantages`) or, without one, of the reward model (`process_advantages`), per token (B*G, L-1); its metrics into `metrics`, its time counted as scoring."""
    t_ps = time.perf_counter()
    if s.step_scorer is not None:
        step_adv, ps_metrics = prm_process_advantages(s.step_scorer, s.tokenizer, g.rows, g.comps)
    else:
        step_adv, ps_metrics = process_advantages(s.scorer, s.tokenizer, g.rows, g.comps, s.cfg.step_delimiter)
    metrics.update(ps_metrics)
    adv = adv[:, None] + s.cfg.process_coef * place(step_adv, prompt_lens, width)  # (B*G, L-1)
    metrics["time/scoring"] += time.perf_counter() - t_ps
    return adv


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


TRAIN_STATS = ("loss", "clip_low", "clip_high", "kl", "entropy", "gap", "mismatch_kl", "weight_mean", "clipped")


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
    for epoch in range(cfg.mu):
        generator = torch.Generator().manual_seed(seed_stream(s.ctx.seed, "minibatch_order", step, epoch))
        for idx in even_passes(minibatch_rows(u.n, cfg.group_size, cfg.minibatch_size, u.n > 0 and u.shared,
                                              generator), dist):
            if idx is None:  # fsdp: a weight-0 pass, so every rank runs as many forwards and backwards
                filler_backward(s.model, s.pad_id, s.ctx.device)
                continue
            minibatch_backward(s, u, idx, epoch, n_all, total_tokens, train_stats)
        dist.sync_gradients(s.trainable)
        grad_norm = clip_grad_norm(s.trainable, cfg.max_grad_norm)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
    return train_stats, grad_norm, lr


def minibatch_backward(s: Session, u: Update, idx: torch.Tensor, epoch: int, n_all: float, total_tokens: float,
                       train_stats: dict[str, list[float]]) -> None:
    """The clipped policy loss of rows `idx` (times the TIS weight, plus beta * KL to the reference), aggregated
    and weighted by the mini-batch's share of the step; backward, and its statistics into `train_stats`."""
    cfg, dev = s.cfg, s.ctx.device
    mask = u.batch["loss_mask"][idx].to(dev)
    with s.autocast():
        logp, entropy = u.rollout_batch.logprobs(s.model, idx, with_entropy=True)
    if epoch == 0:  # params unchanged within an epoch: exact old log-probs
        u.old_logp[idx] = logp.detach().float().cpu()
    if u.sampler_logp is not None and epoch == 0:
        w, tis_stats = rl.tis_weights(u.old_logp[idx], u.sampler_logp[idx], u.batch["loss_mask"][idx], cfg.tis_cap)
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
        train_stats["kl"].append(float(kl.detach().sum() / mask.sum().clamp(min=1)))
    loss = rl.aggregate(per_token, mask, cfg.aggregation, max_tokens=cfg.generation.max_new_tokens)
    weight = float(mask.sum()) / total_tokens if cfg.aggregation == "token_mean" else len(idx) / n_all
    (loss * weight).backward()
    train_stats["loss"].append(float(loss.detach()) * weight)
    train_stats["clip_low"].append(float(stats["clip_low"]))
    train_stats["clip_high"].append(float(stats["clip_high"]))
    train_stats["entropy"].append(float((entropy * mask).sum() / mask.sum().clamp(min=1)))


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
    totals = stat_totals(train_stats, s.dist)  # key -> (sum, count) over every process's mini-batches
    metrics = {
        "train/loss": totals["loss"][0] / cfg.mu,
        **{f"train/{k}": totals[k][0] / totals[k][1] for k in ("clip_low", "clip_high", "entropy")},
        "train/grad_norm": grad_norm, "train/lr": lr, "time/training": time.perf_counter() - t_train,
        "time/step": time.perf_counter() - t_step,
    }
    if totals["kl"][1]:
        metrics["train/kl"] = totals["kl"][0] / totals["kl"][1]
    if totals["gap"][1]:
        metrics.update({f"train/{name}": totals[k][0] / totals[k][1] for name, k in (
            ("logprob_gap", "gap"), ("mismatch_kl", "mismatch_kl"), ("tis_weight_mean", "weight_mean"),
            ("tis_clipped", "clipped"))})
    return metrics


def evaluate(s: Session, done: int) -> dict[str, float]:
    """Every eval_every steps: greedy accuracy on the held-out prompts (every rank syncs the sampling copy, a
    collective under fsdp; rank 0 evaluates)."""
    if not rollouts.eval_due(s.cfg, s.held_out, done):
        return {}
    s.sync_sampler(done)
    if not s.dist.is_main:
        return {}
    if s.engine:
        s.backend.sync(s.model, done)
    return rollouts.held_out_eval(s.backend, s.held_out, s.cfg.generation, s.ctx.seed)


# ---------------------------------------------------------------------------- the stage


def train_step(s: Session, step: int) -> dict[str, float]:
    """One GRPO step: rollout and score, advantages (and process supervision), reference pass, mu update epochs;
    its metrics. A step whose groups were all flat (every process's) trains nothing: `train/skipped`."""
    t_step = time.perf_counter()
    s.sync_sampler(step)
    if s.engine:  # the policy's current weights into the vLLM engine, in place (LoRA folded in)
        s.backend.sync(s.model, step)
    g = sample_groups(s, step)
    rewards_by_rank, metrics = gather_groups(s, g)
    if not any(len(r) for r in rewards_by_rank):  # every group was flat: nothing to learn from this step
        metrics.update({"train/skipped": 1.0, "time/training": 0.0})
        return metrics
    t_train = time.perf_counter()
    u = advantages(s, g, rewards_by_rank, metrics)
    train_stats, grad_norm, lr = update(s, u, step)
    refresh_reference(s, step)
    metrics.update(train_metrics(s, train_stats, grad_norm, lr, t_train, t_step))
    return metrics


def skip_step(s: Session, loop: rollouts.StepLoop, metrics: dict[str, float], done: int) -> bool:
    """A step that trained nothing: logged, not checkpointed unless it spends the budget; whether to stop."""
    loop.history.append(metrics)
    s.ctx.log_metrics(metrics, step=done)
    loop.bar.update(1)
    if loop.out_of_time(done):
        loop.checkpoint(done, s.model, s.optimizer, ref_state(s.cfg, done))
        return True
    return False


def run(cfg: GRPOConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    s, merged_input = open_session(cfg, inputs, ctx)
    state = resume(ctx, s.model, s.optimizer, "grpo", cfg.steps)
    if s.ref is not None and state.get("ref_is_policy"):  # refreshed before the crash: approximate by the policy
        s.dist.copy_weights(s.model, s.ref)
    loop = rollouts.StepLoop("grpo", cfg, ctx, s.dist, state)
    done = loop.start
    for step in range(loop.start, cfg.steps):
        metrics = train_step(s, step)
        done = step + 1
        if "train/skipped" in metrics:
            if skip_step(s, loop, metrics, done):
                break
            continue
        out_of_time = loop.out_of_time(done)
        metrics.update(evaluate(s, done))
        if loop.finish_step(metrics, done, out_of_time, s.model, s.optimizer, ref_state(cfg, done),
                            reward=f"{metrics['reward/mean']:.3f}"):
            break
    loop.bar.close()
    s.sync_sampler(done)  # fsdp: the final weights, whole, in the sampling copy (a collective)
    return rollouts.save_policy(ctx, inputs, cfg, s.whole_policy, s.tokenizer, merged_input, s.dist,
                                rollouts.summarize(loop.history, {"reward": "reward/mean"}))
