"""Data parallelism inside a training stage: who am I, which share of the batch is mine, sum the gradients.

A stage asks `of(ctx)` for a `Dist`. In a normal (single-process) run that is `SINGLE`: rank 0 of 1,
every method the identity, no torch.distributed anywhere, so the code path is today's. Under
`stages.training.launch` every process gets a `Dist` over an initialised process group.

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

With `fsdp` (resources.distributed_type: fsdp) the model is sharded instead of replicated (FSDP2
`fully_shard` on every decoder layer and on the root: parameters, gradients and optimizer state
split across the processes, ZeRO-3 style). The invariant is kept the same way: FSDP's
reduce-scatter *sums* (divide factor 1) in every backward, so `sync_gradients` has nothing left to
do. What changes for a stage:
- every rank must run the same forward passes (each one all-gathers parameters): a rank whose part
  of a micro-batch is empty runs a filler example with weight 0 (`part_or_filler`);
- rank-0-only work on the model (held-out evaluation, saving) goes through `full_model`, a
  collective that hands rank 0 an ordinary unsharded copy;
- a stage that samples from the model it trains (GRPO) keeps an unsharded sampling copy on every
  rank and refreshes it with `copy_weights` (a collective) before each rollout: decoding token by
  token through the sharded model would all-gather every layer at every token;
- checkpoints hold the full trainable weights and the full optimizer state, gathered collectively
  (`checkpoint_state`) and loaded by every rank (`load_checkpoint_state`), so a sharded run resumes
  from its own checkpoints.
The sampling copy costs one model's weights per process during training, beside the 1/N shard of
weights, gradients and Adam moments (DDP holds all four whole); with LoRA the reference is that
copy with the adapter disabled. On-policy distillation samples the same way. DeepSpeed ZeRO is not
supported: FSDP2 is its in-PyTorch equivalent. Tested on CPU (gloo) against one process and against
ddp; the results are in benchmarks/RESULTS.md ("Data parallel", "FSDP against DDP").
"""

from __future__ import annotations

import copy
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
    fsdp: bool = False  # shard the model (FSDP2) instead of replicating it; only with world > 1

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

    @property
    def sharded(self) -> bool:
        """Whether models prepared by this Dist are FSDP-sharded."""
        return self.fsdp and self.active

    def load_device(self, device: str) -> str:
        """Where to load a model this Dist will `prepare`: the CPU when sharded (see `prepare`), else `device`."""
        return "cpu" if self.sharded else device

    def part_or_filler(self, items: Sequence[T]) -> tuple[list[T], bool]:
        """`part(items)`, and whether it is real. Sharded, a rank whose part is empty gets `items[:1]`
        to run with weight 0, so that every rank runs the same forward passes; not sharded, an
        empty part stays empty (the caller skips it)."""
        mine = self.part(items)
        if not mine and self.sharded and len(items):
            return list(items[:1]), False
        return mine, True

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
        if not self.active or self.sharded:  # FSDP reduce-scattered (summed) them in every backward
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

    # ------------------------------------------------------------------------ FSDP

    def prepare(self, model: torch.nn.Module, ctx: Any = None) -> torch.nn.Module:
        """Shard a freshly loaded trainable model when `sharded` (in place; the same object back) and
        log `parameters_per_process` to `ctx`; unchanged otherwise. Call on every rank before the
        optimizer is built. Load the model on the CPU (`load_device`): fully_shard moves each shard
        to this process's device, so no device ever holds the whole model."""
        if not self.sharded or is_sharded(model):
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"fsdp: found no decoder layers in {type(model).__name__} (its _no_split_modules)")
        skeleton = _meta_copy(model) if self.is_main else None  # for `full_model`: the module tree, no storage
        mesh = init_device_mesh(self.comm_device.split(":")[0], (self.world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum over ranks: losses are normalised by the global batch
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        model.__dict__["_r1flow_skeleton"] = skeleton  # not a submodule
        if ctx is not None:
            ctx.log_params({"parameters_per_process": self.local_parameters(model)})
        return model

    def local_parameters(self, model: torch.nn.Module) -> int:
        """Parameter elements this process holds (its shards when sharded)."""
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (None on the others); a collective when sharded."""
        if not self.sharded:
            return model.state_dict() if self.is_main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_main else None

    def full_model(self, model: torch.nn.Module, device: str) -> torch.nn.Module | None:
        """For rank-0-only work: the model itself when not sharded; when sharded (a collective: every
        rank calls it) an unsharded copy on rank 0 and None on the others."""
        if not self.sharded:
            return model if self.is_main else None
        state = self.full_state_dict(model)
        if not self.is_main:
            return None
        # the gathered tensors become the copy's parameters (assign: no second copy), on the skeleton
        plain = copy.deepcopy(model.__dict__["_r1flow_skeleton"])
        _, unexpected = plain.load_state_dict(state, strict=False, assign=True)
        del state
        _retie(plain)  # tied weights (embeddings and head) share one tensor again
        still_meta = [n for n, p in plain.named_parameters() if p.is_meta]
        if still_meta or unexpected:
            raise RuntimeError(f"fsdp: gathered state does not fit the model (missing {still_meta[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]})")
        for name, buf in model.named_buffers():  # not sharded; non-persistent ones (rotary tables) are not in the state
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner)._buffers[leaf] = buf.detach().clone()
        plain.to(device)
        return plain.train(model.training)

    def copy_weights(self, model: torch.nn.Module, into: torch.nn.Module) -> None:
        """Every rank: copy `model`'s weights into `into`, an unsharded module of the same structure (a
        sampling copy, a reference to refresh). Sharded, a collective: each rank gathers the whole
        state (its own full copy for the moment of the load)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        else:
            state = model.state_dict()
        missing, unexpected = into.load_state_dict(state, strict=False)
        if unexpected or [n for n in missing if n in dict(into.named_parameters())]:
            raise RuntimeError(f"copy_weights: the models differ (missing {missing[:5]}, unexpected {unexpected[:5]})")

    def checkpoint_state(self, model: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Full trainable weights and full optimizer state (keyed by parameter name) on rank 0, None
        on the others: a collective (sharded only)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, optimizer, options=options)
        if not self.is_main:
            return None
        return {n: t.contiguous() for n, t in weights.items() if n in trainable}, optim

    def load_checkpoint_state(self, model: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                              optim: dict) -> None:
        """Every rank: load full trainable weights and optimizer state (from `checkpoint_state`) into its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, optim, options=StateDictOptions(full_state_dict=True))


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers are on the meta device, made without
    copying any data (the originals are swapped out for meta stand-ins while copying)."""
    stand_in: dict[int, torch.Tensor] = {}
    swapped = []
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in stand_in:
                    meta = t.detach().to("meta")
                    stand_in[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
                swapped.append((store, name, t))
                store[name] = stand_in[id(t)]
    try:
        return copy.deepcopy(model)
    finally:
        for store, name, t in swapped:
            store[name] = t


def _retie(model: torch.nn.Module) -> None:
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            m.tie_weights()
            return


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (the classes its `_no_split_modules` names), the
    units FSDP shards one at a time."""
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def inner_output(model: torch.nn.Module, inner: torch.nn.Module, root_kwargs: dict | None = None, **kwargs):
    """`inner(**kwargs)`, a submodule of `model` (the decoder, a reward model's backbone) whose output a
    stage combines with a head of its own choosing.

    Under FSDP `model`'s own forward runs instead (with `root_kwargs` added, e.g. one logit position)
    and a hook takes the submodule's output: the root all-gathers its parameters (embeddings, final
    norm, head) in its forward and keeps them gathered until backward, which calling the submodule
    directly would skip.
    """
    if not is_sharded(model):
        return inner(**kwargs)
    captured: list = []
    handle = inner.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model(**kwargs, **(root_kwargs or {}))
    finally:
        handle.remove()
    return captured[-1]


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
