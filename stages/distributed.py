"""Data parallelism inside a training stage: who am I, which share of the batch is mine, sum the gradients.

A stage asks `of(ctx)` for a `Dist`. In a normal (single-process) run that is `SINGLE`: rank 0 of 1,
every method the identity, no torch.distributed anywhere, so the code path is today's. Under
`stages.launch` every process gets a `Dist` over an initialised process group.

How a step stays the single-process step (the invariant the distributed tests pin):
- batch sizes in the config are global; `shard` hands each rank a contiguous, equal slice of every
  global micro-batch (or of each step's prompts, GRPO: whole groups, never split);
- every rank normalises its *summed* loss by the *global* denominator (tokens, pairs or sequences
  of the whole optimizer step), and `sync_gradients` all-reduces the gradient **sum**; so the
  result is d(global loss)/dθ, not a mean of per-rank means. (torch DDP averages instead; with its
  1/world it would need the loss multiplied by world, and it syncs only through the wrapped
  module's forward, which the reward model and the no-grad reference passes go around.)
- gradients are summed once per optimizer step (after all micro-batches), which is what DDP's
  `no_sync` achieves; communication does not overlap the backward pass (a GPU cost, not a
  correctness one).
Only rank 0 writes checkpoints and artifacts and logs metrics; the others compute.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_BUCKET_ELEMENTS = 1 << 24  # 16M elements (64 MiB of fp32) per all-reduce


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items; n must divide evenly (configs check it)."""
    if n % world:
        raise ValueError(f"cannot split {n} items evenly among {world} processes")
    k = n // world
    return rank * k, (rank + 1) * k


def part_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous part of n items when they need not split evenly: the first
    n % world ranks take one more."""
    k, extra = divmod(n, world)
    start = rank * k + min(rank, extra)
    return start, start + k + (rank < extra)


@dataclass(frozen=True)
class Dist:
    """One process's view of the process group: rank, world size, and the collectives stages use."""

    rank: int = 0
    world: int = 1
    comm_device: str = "cpu"  # where small tensors for collectives live (cuda under nccl)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of a global batch (all of it on one process)."""
        start, end = shard_bounds(len(items), self.rank, self.world)
        return list(items[start:end])

    def part(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous part of work that need not split evenly (e.g. a scoring pass);
        `gather_list` of the per-part results restores the order."""
        start, end = part_bounds(len(items), self.rank, self.world)
        return list(items[start:end])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks of a few floats (token counts, loss sums), in float64."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.comm_device)
        torch.distributed.all_reduce(t)
        return t.cpu().tolist()

    def max(self, value: float) -> float:
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.cpu())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather_list(self, items: list[T]) -> list[T]:
        """The concatenation of every rank's list in rank order: undoes `shard` and `part`."""
        return [x for part in self.gather(items) for x in part]

    def sync_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks, in place (call once per optimizer step).

        A parameter that got no gradient on this rank (None) contributes zeros, so every rank
        calls the same collectives even when its share of a batch was empty.
        """
        if not self.active:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel()
            if size >= _BUCKET_ELEMENTS:
                _all_reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_bucket(bucket)

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        torch.distributed.all_reduce(flat)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


SINGLE = Dist()


def of(ctx: Any) -> Dist:
    """The context's Dist; SINGLE for contexts that have none (LocalContext, FlowContext, tests)."""
    return getattr(ctx, "dist", None) or SINGLE


def init_from_env(backend: str = "auto", cuda: bool = True) -> tuple[Dist, str]:
    """Join the process group torchrun / `accelerate launch` described in the environment.

    Returns the Dist and this process's device: cuda:LOCAL_RANK when `cuda` is asked for and there
    is a device for every local rank, else cpu. backend auto: nccl on CUDA, gloo on CPU.
    """
    from datetime import timedelta

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = cuda and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    # Rank 0 alone runs the final held-out evaluation and saves the model; the others wait at most this long.
    torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(hours=2))
    return Dist(rank=rank, world=world, comm_device=device if backend == "nccl" else "cpu"), device
