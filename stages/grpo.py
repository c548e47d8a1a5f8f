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
- process supervision (`process_coef > 0`) adds the accumulated, group-normalised step rewards of
  a reward model to the outcome advantage instead of replacing it, so verifiable rewards still count;
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
from tqdm.auto import tqdm

from schemas.configs import GenerationSpec, GRPOConfig
from schemas.errors import ConfigError, SchemaError
from stages.base import Input, Output, StageContext, model_output_dir, seed_everything
from stages.math import rl
from stages.modeling import logprobs, models
from stages.rewards.verifiers import score
from stages.runtime import distributed
from stages.sampling.generation import TransformersBackend, check_vllm_model_dir, make_backend, render_prompts
from stages.training.checkpoints import resume, save_checkpoint
from stages.training.optim import (
    clip_grad_norm,
    load_trainable,
    lr_factor,
    make_optimizer,
    resolve_precision,
    set_lr,
)

VERSION = "3"  # (max_minutes, default 0, changes nothing else.) 3: on a GPU, rollouts sample under the training precision (bf16 autocast), not in fp32. 2: sampler blocks of ceil(sqrt(V)) tokens (generation.BlockRaceSampler): other samples for the same seed
CONFIG = GRPOConfig
INPUTS = {"model": "model", "prompts": "prompts", "reward_model": "model?"}
OUTPUTS = {"model": "model"}


def check(cfg: GRPOConfig) -> None:
    if cfg.ref_refresh_every and cfg.lora.r > 0:
        raise ConfigError("grpo.ref_refresh_every: needs full fine-tuning (lora.r=0); with LoRA the reference "
                          "is the base model with the adapter disabled")
    if cfg.generation.temperature == 0:
        raise ConfigError("grpo.generation.temperature: must be > 0 (a group of identical greedy samples has no signal)")


# ---------------------------------------------------------------------------- tensors from rollouts


def build_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                keep: list[bool]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows and a mask over the positions that predict completion tokens.

    Returns input_ids/attention_mask (N, L) and loss_mask (N, L-1) aligned with `token_logprobs`.
    `keep[i] = False` (e.g. a truncated completion under mask_truncated) zeroes that row's loss mask.
    """
    rows = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        if keep[i]:
            loss_mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0  # position t predicts token t+1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


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


def pick_prompts(n_prompts: int, k: int, seed: int, step: int, attempt: int, rank: int = 0) -> list[int]:
    """k prompt indices for a step's rollout `attempt`; rank > 0 draws from its own stream (refills)."""
    rng = np.random.default_rng([seed, step, attempt, rank] if rank else [seed, step, attempt])
    return rng.choice(n_prompts, size=k, replace=n_prompts < k).tolist()


def rollout_seed(seed: int, step: int, attempt: int, rank: int = 0) -> int:
    """Sampling seed of one process's rollout of a step's attempt (rank 0: the single-process seed)."""
    return seed * 1_000_003 + step * 101 + attempt + rank * 1_000_000_007


def stat_totals(stats: dict[str, list[float]], dist: distributed.Dist) -> dict[str, tuple[float, int]]:
    """Per key (sum, count) of a step's mini-batch statistics over every process."""
    keys = sorted(stats)
    flat = dist.sum([x for k in keys for x in (float(np.sum(stats[k])) if stats[k] else 0.0, len(stats[k]))])
    return {k: (flat[2 * i], int(flat[2 * i + 1])) for i, k in enumerate(keys)}


def process_advantages(scorer, tokenizer, rows: list[dict], comps: list[list], delimiter: str
                       ) -> tuple[list[list[float]], dict[str, float]]:
    """Process supervision: per-completion-token advantages from a reward model's step scores.

    Each completion is cut into steps at `delimiter`; the reward model scores the prompt with the
    completion prefix up to the end of each step; the step rewards of a group are normalised
    together (`rl.normalize_step_rewards`) and every token gets the sum of the normalised rewards
    of the steps ending at or after it (`rl.step_advantages`). Returns one list per completion
    (flattened B*G, in order) and metrics.
    """
    ends = [[step_ends([tokenizer.decode([t], skip_special_tokens=True) for t in c.token_ids], delimiter)
             for c in cs] for cs in comps]
    convs, texts = [], []
    for r, cs, es in zip(rows, comps, ends, strict=True):
        for c, e in zip(cs, es, strict=True):
            for end in e:
                convs.append(r["messages"])
                texts.append(tokenizer.decode(list(c.token_ids[: end + 1]), skip_special_tokens=True))
    flat = scorer.score(convs, texts) if texts else []
    out, k, raw = [], 0, []
    for cs, es in zip(comps, ends, strict=True):
        g, s_max = len(cs), max(1, max(len(e) for e in es))
        t_max = max(1, max(c.num_tokens for c in cs))
        r = torch.zeros(g, s_max)
        e_t = torch.full((g, s_max), -1, dtype=torch.long)
        for i, e in enumerate(es):
            r[i, : len(e)] = torch.tensor(flat[k : k + len(e)])
            e_t[i, : len(e)] = torch.tensor(e, dtype=torch.long)
            raw.extend(flat[k : k + len(e)])
            k += len(e)
        normed = rl.normalize_step_rewards(r, e_t >= 0)
        mask = torch.arange(t_max)[None, :] < torch.tensor([c.num_tokens for c in cs])[:, None]
        adv = rl.step_advantages(normed, e_t, mask)
        out.extend(adv[i, : c.num_tokens].tolist() for i, c in enumerate(cs))
    n = sum(len(cs) for cs in comps)
    return out, {"reward/process_mean": float(np.mean(raw)) if raw else 0.0,
                 "reward/steps_per_completion": len(raw) / max(1, n)}


# ---------------------------------------------------------------------------- the stage


def run(cfg: GRPOConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    table = inputs["prompts"].table("prompts")
    rows = [r for r in table.to_pylist() if r["split"] == cfg.split and r["answer"] is not None]
    if not rows:
        raise SchemaError(f"{inputs['prompts'].label}: no split={cfg.split!r} prompts with an answer to reward")
    held_out = [r for r in table.to_pylist() if r["split"] == "eval"][: cfg.eval_prompts]
    rm_input = inputs.get("reward_model")
    wants_rm = [w for w, on in (("process_coef > 0", cfg.process_coef > 0),
                                ("reward.weights.reward_model", cfg.reward.weights.get("reward_model", 0) != 0)) if on]
    if wants_rm and rm_input is None:
        raise ConfigError(f"grpo: {' and '.join(wants_rm)} need a reward model; wire one to the node's "
                          f"`reward_model` input (inputs: {{reward_model: <node>.model}})")
    dist = distributed.of(ctx)
    share = cfg.prompts_per_step // dist.world  # whole groups per process and step
    engine = cfg.generation.backend == "vllm"  # a colocated vLLM engine samples; the trainer's weights pushed into it
    if engine:
        check_vllm_model_dir(inputs["model"].model_dir, inputs["model"].label)
    seed_everything(ctx.seed)
    model, tokenizer, merged_input = load_trainable(inputs["model"], cfg, dist.load_device(ctx.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    is_lora = cfg.lora.r > 0
    ref = None
    if cfg.beta > 0 and not is_lora:
        ref = copy.deepcopy(model).eval().requires_grad_(False).to(ctx.device)
    # fsdp: rollouts come from an unsharded copy on every rank, refreshed before each step's rollout
    sampler = copy.deepcopy(model).requires_grad_(False).to(ctx.device) if dist.sharded else None
    counts = models.count_parameters(model)
    model = dist.prepare(model, ctx)  # sharded across the processes under fsdp
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg.learning_rate, cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * cfg.steps)
    autocast_dtype = resolve_precision(cfg.precision, ctx.device)
    if engine:
        backend = make_backend(cfg.generation, model, tokenizer, inputs["model"].model_dir, seed=ctx.seed,
                               colocated=True)
    else:
        # rollouts in the training passes' precision (bf16 on a GPU), not the fp32 master weights'
        backend = TransformersBackend(sampler if sampler is not None else model, tokenizer, autocast_dtype)
    synced = None  # the step whose weights the sampler holds (fsdp)

    def sync_sampler(done: int) -> None:
        nonlocal synced
        if sampler is not None and synced != done:
            dist.copy_weights(model, sampler)
            synced = done

    kl_fn = rl.KL_ESTIMATORS[cfg.kl_estimator]
    scorer = None
    if rm_input is not None and wants_rm:
        from stages.modeling.heads import RewardScorer

        scorer = RewardScorer.from_input(rm_input, device=ctx.device)
    ctx.log_params({"train_prompts": len(rows), "trainable_parameters": counts["trainable"],
                    "total_parameters": counts["total"], "precision": str(autocast_dtype or "fp32")})

    state = resume(ctx, model, optimizer, "grpo", cfg.steps)
    start, history = state["step"], state.get("history", [])
    if ref is not None and state.get("ref_is_policy"):  # refreshed before the crash: approximate by the policy
        dist.copy_weights(model, ref)
    for i, m in enumerate(history):
        ctx.log_metrics(m, step=i + 1)

    bar = tqdm(total=cfg.steps, initial=start, desc="grpo", unit="step", disable=not dist.is_main)
    t_loop, done = time.perf_counter(), start

    def budget_spent(done: int) -> bool:
        """max_minutes: whether no further step may start; every process stops after the same step."""
        if not cfg.max_minutes or done >= cfg.steps:
            return False
        return dist.sum([float(time.perf_counter() - t_loop >= 60.0 * cfg.max_minutes)])[0] > 0

    for step in range(start, cfg.steps):
        t_step = time.perf_counter()
        sync_sampler(step)
        if engine:  # the policy's current weights into the vLLM engine, in place (LoRA folded in)
            backend.sync(model, step)
        # ---- rollout and scoring of this process's share (dynamic sampling drops all-equal groups and refills)
        batch_rows, comps, verdicts, rewards = [], [], [], []
        t_gen = t_score = 0.0
        zero_std_groups = total_groups = 0
        for attempt in range(1 + (cfg.max_refill_rounds if cfg.dynamic_sampling else 0)):
            if attempt == 0:  # the step's prompts, split among the processes in whole groups
                picked_idx = dist.shard(pick_prompts(len(rows), cfg.prompts_per_step, ctx.seed, step, 0))
            else:  # a refill of this process's dropped groups, from its own stream
                picked_idx = pick_prompts(len(rows), share - len(batch_rows), ctx.seed, step, attempt, dist.rank)
            picked = [rows[i] for i in picked_idx]
            c, v, r, tg, ts = rollout(backend, tokenizer, picked, cfg, seed=rollout_seed(ctx.seed, step, attempt, dist.rank),
                                      scorer=scorer if cfg.reward.weights.get("reward_model", 0) != 0 else None)
            t_gen, t_score = t_gen + tg, t_score + ts
            flat = (r.max(dim=1).values == r.min(dim=1).values).tolist()
            zero_std_groups += sum(flat)
            total_groups += len(flat)
            for i in range(len(picked)):
                if cfg.dynamic_sampling and flat[i]:
                    continue
                batch_rows.append(picked[i])
                comps.append(c[i])
                verdicts.append(v[i])
                rewards.append(r[i])
            if len(batch_rows) >= share or not cfg.dynamic_sampling:
                break
        local_rewards = torch.stack(rewards) if rewards else torch.zeros(0, cfg.group_size)  # (B_rank, G)
        if dist.active:  # metrics and advantages need every process's groups: gather them (text-free)
            gathered = dist.gather((verdicts, [[dataclasses.replace(c, text="", token_ids=(), logprobs=None) for c in cs]
                                               for cs in comps], local_rewards, (zero_std_groups, total_groups, t_gen, t_score)))
            rewards_by_rank = [g[2] for g in gathered]
            all_verdicts, all_comps = [v for g in gathered for v in g[0]], [c for g in gathered for c in g[1]]
            all_rewards = [row for g in gathered for row in g[2]]
            zero_std_groups, total_groups = sum(g[3][0] for g in gathered), sum(g[3][1] for g in gathered)
            t_gen, t_score = max(g[3][2] for g in gathered), max(g[3][3] for g in gathered)
        else:
            rewards_by_rank, all_verdicts, all_comps, all_rewards = [local_rewards], verdicts, comps, rewards
        metrics = rollout_metrics(all_verdicts, all_comps, all_rewards, cfg, zero_std_groups / max(1, total_groups))
        metrics.update({"time/generation": t_gen, "time/scoring": t_score})
        if not all_rewards:  # every group was flat: nothing to learn from this step
            metrics.update({"train/skipped": 1.0, "time/training": 0.0})
            history.append(metrics)
            ctx.log_metrics(metrics, step=step + 1)
            bar.update(1)
            done = step + 1
            if budget_spent(done):
                save_checkpoint(ctx.checkpoint_dir, done, model, optimizer,
                                {"step": done, "history": history, "ref_is_policy": bool(
                                    cfg.ref_refresh_every and done >= cfg.ref_refresh_every)}, cfg.keep_checkpoints, dist)
                break
            continue

        # ---- advantages and training tensors (a process left without groups still joins every gradient sum)
        t0 = time.perf_counter()
        adv = rl.sharded_group_advantages(rewards_by_rank, dist.rank, cfg.advantage, cfg.std).reshape(-1)  # (B*G,)
        n = adv.numel()  # this process's sequences
        if n:
            prompt_texts = render_prompts(tokenizer, [r["messages"] for r in batch_rows], cfg.generation.prefill)
            prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
            flat_prompt_ids = [p for p in prompt_ids for _ in range(cfg.group_size)]
            flat_comps = [c for cs in comps for c in cs]
            keep = [not (cfg.mask_truncated and c.finish_reason == "length") for c in flat_comps]
            batch = build_batch(flat_prompt_ids, [list(c.token_ids) for c in flat_comps], pad_id, keep)
            prompt_lens = [len(p) for p in flat_prompt_ids]
            width = batch["input_ids"].shape[1]
            if cfg.process_coef > 0:
                t_ps = time.perf_counter()
                step_adv, ps_metrics = process_advantages(scorer, tokenizer, batch_rows, comps, cfg.step_delimiter)
                metrics.update(ps_metrics)
                adv = adv[:, None] + cfg.process_coef * place(step_adv, prompt_lens, width)  # (B*G, L-1)
                t_score += time.perf_counter() - t_ps
                metrics["time/scoring"] = t_score
            model.train()
            # the prompt runs once per group through a KV cache or packed with its completions (either where both
            # can, by cost); under gradient checkpointing there is no cache: packed if the model can be
            cached = logprobs.can_share_prefix(model)
            shared = cfg.prefix_sharing and (cached or logprobs.can_pack_prefix(model))
            rollout_batch = RolloutBatch(batch, prompt_ids, [list(c.token_ids) for c in flat_comps], cfg.group_size,
                                         pad_id, shared, ctx.device, cfg.logprob_chunk, None if cached else True)

            sampler_logp = tis_w = None
            # The old policy's log-probs are the first epoch's own forward pass (filled below): the
            # parameters change only after an epoch's last mini-batch, so they are exact, and no
            # separate no-grad pass over the batch is needed.
            old_logp = torch.zeros_like(batch["loss_mask"])
            if cfg.old_logprobs == "sampler":
                sampler_logp = place([list(c.logprobs or ()) for c in flat_comps], prompt_lens, width)
                tis_w = torch.zeros_like(sampler_logp)
            ref_logp = None
            if cfg.beta > 0:
                ref_logp = torch.zeros_like(batch["loss_mask"])
                # LoRA: the reference is the base, the adapter disabled; under fsdp in the unsharded sampling
                # copy, which holds this step's weights, so no rank's reference pass is a collective
                base = sampler if sampler is not None else model
                with torch.no_grad(), (base.disable_adapter() if is_lora else contextlib.nullcontext()):
                    for idx in minibatch_rows(n, cfg.group_size, cfg.minibatch_size, shared, torch.Generator()):
                        ref_logp[idx] = rollout_batch.logprobs(base if is_lora else ref, idx)[0].float().cpu()

        # ---- mu epochs; each accumulates all mini-batches into one optimizer step
        lr = set_lr(optimizer, cfg.learning_rate * lr_factor(step, cfg.steps, warmup, "constant"))
        # normalisers of the whole step (every process's sequences and tokens)
        n_all, total_tokens = dist.sum([n, float(batch["loss_mask"].sum()) if n else 0.0])
        total_tokens = max(1.0, total_tokens)
        train_stats: dict[str, list[float]] = {"loss": [], "clip_low": [], "clip_high": [], "kl": [], "entropy": [],
                                               "gap": [], "mismatch_kl": [], "weight_mean": [], "clipped": []}
        for epoch in range(cfg.mu):
            generator = torch.Generator().manual_seed(ctx.seed + step * 31 + epoch)
            for idx in even_passes(minibatch_rows(n, cfg.group_size, cfg.minibatch_size, n > 0 and shared, generator),
                                   dist):
                if idx is None:  # fsdp: a weight-0 pass, so every rank runs as many forwards and backwards
                    filler_backward(model, pad_id, ctx.device)
                    continue
                mask = batch["loss_mask"][idx].to(ctx.device)
                with torch.autocast(device_type=ctx.device.split(":")[0], dtype=autocast_dtype or torch.float32,
                                    enabled=autocast_dtype is not None):
                    logp, entropy = rollout_batch.logprobs(model, idx, with_entropy=True)
                if epoch == 0:  # params unchanged within an epoch: exact old log-probs
                    old_logp[idx] = logp.detach().float().cpu()
                if sampler_logp is not None and epoch == 0:
                    w, tis_stats = rl.tis_weights(old_logp[idx], sampler_logp[idx], batch["loss_mask"][idx], cfg.tis_cap)
                    tis_w[idx] = w
                    for k, val in tis_stats.items():
                        train_stats[k].append(float(val))
                per_token, stats = rl.policy_loss(logp, old_logp[idx].to(ctx.device), adv[idx].to(ctx.device), mask,
                                                  cfg.policy_loss, cfg.epsilon_low, cfg.epsilon_high)
                if tis_w is not None:
                    per_token = per_token * tis_w[idx].to(ctx.device)
                if ref_logp is not None:
                    kl = kl_fn(logp, ref_logp[idx].to(ctx.device)) * mask
                    per_token = per_token + cfg.beta * kl
                    train_stats["kl"].append(float(kl.detach().sum() / mask.sum().clamp(min=1)))
                loss = rl.aggregate(per_token, mask, cfg.aggregation, max_tokens=cfg.generation.max_new_tokens)
                weight = float(mask.sum()) / total_tokens if cfg.aggregation == "token_mean" else len(idx) / n_all
                (loss * weight).backward()
                train_stats["loss"].append(float(loss.detach()) * weight)
                train_stats["clip_low"].append(float(stats["clip_low"]))
                train_stats["clip_high"].append(float(stats["clip_high"]))
                train_stats["entropy"].append(float((entropy * mask).sum() / mask.sum().clamp(min=1)))
            dist.sync_gradients(trainable)
            grad_norm = clip_grad_norm(trainable, cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if ref is not None and cfg.ref_refresh_every and (step + 1) % cfg.ref_refresh_every == 0:
            dist.copy_weights(model, ref)
        totals = stat_totals(train_stats, dist)  # key -> (sum, count) over every process's mini-batches
        metrics.update({
            "train/loss": totals["loss"][0] / cfg.mu,
            **{f"train/{k}": totals[k][0] / totals[k][1] for k in ("clip_low", "clip_high", "entropy")},
            "train/grad_norm": grad_norm, "train/lr": lr, "time/training": time.perf_counter() - t0,
            "time/step": time.perf_counter() - t_step,
        })
        if totals["kl"][1]:
            metrics["train/kl"] = totals["kl"][0] / totals["kl"][1]
        if totals["gap"][1]:
            metrics.update({f"train/{name}": totals[k][0] / totals[k][1] for name, k in (
                ("logprob_gap", "gap"), ("mismatch_kl", "mismatch_kl"), ("tis_weight_mean", "weight_mean"),
                ("tis_clipped", "clipped"))})
        done = step + 1
        out_of_time = budget_spent(done)
        if cfg.eval_every and held_out and done % cfg.eval_every == 0:
            sync_sampler(done)  # every rank (a collective under fsdp); rank 0 evaluates
            if dist.is_main:
                if engine:
                    backend.sync(model, done)
                metrics.update(held_out_eval(backend, held_out, cfg, ctx.seed))
        history.append(metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or out_of_time:  # every rank: gathered under fsdp
            save_checkpoint(ctx.checkpoint_dir, done, model, optimizer,
                            {"step": done, "history": history,
                             "ref_is_policy": bool(cfg.ref_refresh_every and done >= cfg.ref_refresh_every)},
                            cfg.keep_checkpoints, dist)
        ctx.log_metrics(metrics, step=done)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        bar.update(1)
        if out_of_time:
            ctx.log.info("grpo: the %.4g-minute budget is spent after step %d of %d; saving the model as it is",
                         cfg.max_minutes, done, cfg.steps)
            break
    bar.close()

    out, model_dir = model_output_dir(ctx, "model")
    merge = cfg.lora.merge or merged_input
    sync_sampler(done)  # fsdp: the final weights, whole, in the sampling copy (a collective)
    if dist.is_main:
        models.save_model(sampler if sampler is not None else model, tokenizer, model_dir, merge=merge)
    is_adapter = is_lora and not merge
    summary = summarize(history)
    ctx.log_metrics(summary)
    extra = {"base_fingerprint": inputs["model"].fingerprint} if is_adapter else {}
    return {"model": Output("model", "adapter" if is_adapter else "model", out, metrics=summary, extra=extra)}


def rollout_metrics(verdicts, comps, rewards, cfg: GRPOConfig, zero_std_frac: float) -> dict[str, float]:
    flat_v = [v for vs in verdicts for v in vs]
    flat_c = [c for cs in comps for c in cs]
    r = torch.stack(rewards) if rewards else torch.zeros(0, cfg.group_size)
    m: dict[str, float] = {
        "reward/mean": float(r.mean()) if r.numel() else 0.0,
        "reward/std": float(r.std(unbiased=False)) if r.numel() else 0.0,
        "reward/zero_std_groups": zero_std_frac,
        "reward/unscored": float(sum(v.reward is None for v in flat_v)),
    }
    if flat_v:
        scored = [v.correct for v in flat_v if v.correct is not None]
        m["reward/accuracy"] = float(np.mean(scored)) if scored else 0.0
        m["reward/format_rate"] = float(np.mean([v.format_ok for v in flat_v]))
        for name in sorted({k for v in flat_v for k in v.components}):
            m[f"reward/{name}"] = float(np.mean([v.components.get(name, 0.0) for v in flat_v]))
        lengths = [c.num_tokens for c in flat_c]
        m["completion/mean_length"] = float(np.mean(lengths))
        m["completion/max_length"] = float(np.max(lengths))
        m["completion/truncated_frac"] = float(np.mean([c.finish_reason == "length" for c in flat_c]))
    return m


def held_out_eval(backend, rows: list[dict], cfg: GRPOConfig, seed: int) -> dict[str, float]:
    """Greedy accuracy and format rate on held-out prompts, scored as the eval stage scores."""
    spec = GenerationSpec(max_new_tokens=cfg.generation.max_new_tokens, temperature=0.0, prefill=cfg.generation.prefill,
                          batch_size=cfg.generation.batch_size)
    comps, _ = backend.generate([r["messages"] for r in rows], spec, seed=seed, progress=False)
    verdicts = [score(r, cs[0].text) for r, cs in zip(rows, comps, strict=True)]
    scored = [v.correct for v in verdicts if v.correct is not None]
    return {"eval/accuracy": float(np.mean(scored)) if scored else 0.0,
            "eval/format_rate": float(np.mean([v.format_ok for v in verdicts]))}


def summarize(history: list[dict]) -> dict[str, float]:
    """First/last-tenth reward means, so a run's improvement is one number in the summary table."""
    rewards = [h["reward/mean"] for h in history]
    k = max(1, len(rewards) // 10)
    out = {"steps": float(len(history)), "reward_first": float(np.mean(rewards[:k])),
           "reward_last": float(np.mean(rewards[-k:]))}
    evals = [h for h in history if "eval/accuracy" in h]
    if evals:
        out["eval_accuracy_last"] = evals[-1]["eval/accuracy"]
        out["eval_format_rate_last"] = evals[-1]["eval/format_rate"]
    out["time_per_step"] = float(np.mean([h.get("time/step", 0.0) for h in history])) if history else 0.0
    return out

