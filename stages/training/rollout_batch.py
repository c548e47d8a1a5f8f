"""A step's rollouts as training tensors, and the order the update walks them in.

- `place`: per-completion-token values (sampler log-probs, token advantages) in the (N, L-1) layout of a
  `rollouts.build_batch` loss mask;
- `RolloutBatch`: the rows of a step and their log-probs under a model, each group's prompt run once
  (`prefix_sharing.shared_prefix_rows`) or every row whole (`logprobs.bucketed_token_logprobs`);
- `minibatch_rows`: an epoch's shuffled mini-batches (of rows, or of whole groups for prefix sharing);
  `signal_rows`: the rows of the groups whose advantages are not all zero (the others add nothing to the loss);
  `even_passes` and `filler_backward`: as many forward and backward passes on every rank under fsdp.

May import: `schemas`, `stages.modeling`, `stages.runtime`; never a stage module.
"""

from __future__ import annotations

import dataclasses

import torch

from stages.modeling import logprobs, prefix_sharing
from stages.runtime import distributed


def place(values: list[list[float]], prompt_lens: list[int], width: int) -> torch.Tensor:
    """Per-completion-token values laid out like `loss_mask`.

    Row i's value j lands at position prompt_lens[i] - 1 + j, the position that predicts completion
    token j. Returns (N, width - 1), 0 elsewhere.
    """
    out = torch.zeros((len(values), width - 1), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompt_lens, strict=True)):
        if len(v):
            out[i, p - 1 : p - 1 + len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


@dataclasses.dataclass
class RolloutBatch:
    """One step's rollouts as training tensors: `batch` (build_batch's whole rows: input_ids, attention_mask (N, L),
    loss_mask (N, L-1)), the groups' prompt ids (one per group, K = N / group_size) and each row's completion ids,
    for the shared-prefix path."""

    batch: dict[str, torch.Tensor]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    group_size: int
    pad_id: int
    shared: bool  # each group's prompt runs once; `idx` passed to `logprobs` is then whole groups
    device: str
    chunk: int  # logit positions at once (`logprobs.bucketed_token_logprobs`)
    pack: bool | None = None  # True: only packing can share (no KV cache under gradient checkpointing)

    def logprobs(self, net, idx: torch.Tensor, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(len(idx), L-1) log p(token t+1 | tokens <= t) of rows `idx` under `net`, 0 where token t+1 is padding,
        and the entropy there if asked."""
        width = self.batch["input_ids"].shape[1]
        if self.shared:
            groups = (idx[:: self.group_size] // self.group_size).tolist()
            prompt_of_row = [k for k in range(len(groups)) for _ in range(self.group_size)]
            return prefix_sharing.shared_prefix_rows(net, [self.prompt_ids[g] for g in groups],
                                               [self.completion_ids[r] for r in idx.tolist()], prompt_of_row,
                                               self.pad_id, width, self.device, chunk_tokens=self.chunk,
                                               with_entropy=with_entropy, pack=self.pack)
        return logprobs.bucketed_token_logprobs(net, self.batch["input_ids"][idx].to(self.device),
                                                self.batch["attention_mask"][idx].to(self.device),
                                                chunk_tokens=self.chunk, with_entropy=with_entropy)


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


def signal_rows(adv: torch.Tensor, loss_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Ascending row indices of the whole groups in which some row has a non-zero advantage at a completion token.

    adv: (N,) per sequence, or (N, L-1) per token (process supervision); loss_mask: (N, L-1). Every policy loss is
    linear in the advantage (`rl.POLICY_LOSSES`), so a row whose advantage is 0 at every masked token contributes
    exactly 0 to the loss and its gradient when no KL term is added (beta = 0): a group of equal rewards (all 0
    advantages) can skip its forward and backward passes without changing the update, as long as the step's
    normalisers still count it. Whole groups, so prefix-shared mini-batches keep their layout.
    """
    if adv.dim() == 1:
        live = adv != 0
    else:
        live = ((adv != 0) & (loss_mask > 0)).any(dim=1)
    groups = live.reshape(-1, group_size).any(dim=1).nonzero().flatten()
    return (groups[:, None] * group_size + torch.arange(group_size)[None, :]).reshape(-1)


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
    logp, _ = logprobs.bucketed_token_logprobs(model, ids, torch.ones_like(ids))
    (logp.sum() * 0.0).backward()
