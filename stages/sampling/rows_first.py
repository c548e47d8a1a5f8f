"""fp32 CPU linears over few rows computed as W @ xᵀ where this CPU's sgemm is faster for that layout
(`rows_first_linears`), by a fixed rule per torch CPU kernel level (`ROWS_FIRST_RULES`), never timed at
run time, so samples do not depend on timing.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowsFirstRule:
    """Which no-grad fp32 CPU linears `rows_first_linears` runs as W @ xᵀ: those over min_rows..max_rows
    rows, and with `reducing_only` only layers with more inputs than outputs (an MLP's down projection)."""

    min_rows: int
    max_rows: int
    reducing_only: bool = False


# Per torch CPU kernel level (torch.backends.cpu.get_cpu_capability()), from MKL sgemm timings of
# SmolLM2's decode shapes on two machines (2 threads, weights of 30 layers streamed from memory):
# AMD EPYC, AVX2: every linear faster as W @ xᵀ (head on 16 rows 53 -> 25 ms, MLP 1.4-1.6x; a 16-row
#   decode step 219 -> 169 ms);
# Intel Xeon, AVX-512: only the down projection (1536 -> 576), at 12-48 rows (16 rows: 8.7 -> 4.3 ms
#   for 30 layers); at 2-8 rows, for the other shapes and the head, W @ xᵀ is up to 2x slower.
# Other kernel levels (ARM, no AVX) were not measured: F.linear as it is.
ROWS_FIRST_RULES: dict[str, RowsFirstRule] = {
    "AVX2": RowsFirstRule(2, 64),
    "AVX512": RowsFirstRule(12, 48, reducing_only=True),
}


def default_rows_first_rule() -> RowsFirstRule | None:
    """The rule for this machine's torch CPU kernel level, or None (no layer changed)."""
    return ROWS_FIRST_RULES.get(torch.backends.cpu.get_cpu_capability())


def _rows_first_forward(rule: RowsFirstRule):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not rule.min_rows <= rows <= rule.max_rows or torch.is_grad_enabled() or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], -1)

    forward.same_as_linear = True  # nn.Linear's function in another layout: lean_decode may fuse such layers
    return forward


@contextlib.contextmanager
def rows_first_linears(model: torch.nn.Module, rule: RowsFirstRule | None | str = "auto"):
    """fp32 CPU `nn.Linear`s compute W @ xᵀ (then transpose) instead of x @ Wᵀ in no-grad decode,
    where `rule` says (default: `ROWS_FIRST_RULES` for this machine's CPU kernel level; None: none).

    MKL's sgemm picks other kernels for the two layouts, and on decode shapes (a few rows against a
    large weight) one is up to 2x faster than the other, which one depending on the CPU
    (`ROWS_FIRST_RULES`). Same values up to float rounding (another summation order); the choice is
    a fixed function of the machine, never timed at run time, so a run's samples do not depend on
    timing. Only plain `nn.Linear`s of fp32 CPU weights are touched (a LoRA layer's base and
    adapters are such), none whose forward is already replaced (accelerate's offload hooks), and
    every forward is restored on exit.
    """
    rule = default_rows_first_rule() if rule == "auto" else rule
    mods = [] if rule is None else [
        m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)
        and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
        and (not rule.reducing_only or m.in_features > m.out_features)]
    forward = _rows_first_forward(rule) if mods else None
    for m in mods:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward
