"""The token draw every transformers-backend sample goes through: transformers' temperature / top-k /
top-p warpers, then a two-level exponential race (`BlockRaceSampler`).

Why races rather than an inverse CDF: an inverse CDF's boundaries move with every probability's
rounding, so runs whose weights differ in the last bits (DDP against FSDP) would draw different
tokens; the races do not (tested against hand-computed distributions and the model's own softmax).
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


class BlockRaceSampler(LogitsProcessor):
    """Draws each row's next token from softmax(scores) in two exponential races: `draw` returns the
    token ids (`decode_rows`); as a logits processor it returns scores that are 0 at the drawn token
    and -inf elsewhere, so `generate(do_sample=False)`'s argmax takes it.

    The vocabulary is cut into blocks of `block` tokens (default ceil(sqrt(V)), which makes the
    count below smallest). A race over the blocks' masses, argmax of mass / Exp(1), picks block k
    with probability mass_k; a race inside it picks token j with probability p_j / mass_k: p_j
    overall, the distribution `do_sample=True` samples from (after the same temperature / top-k /
    top-p warpers, which run before this in the list). It draws ~V/block + block exponentials per
    row where `torch.multinomial` draws one per vocabulary entry (27 -> 4 ms a decode step on CPU
    for 16 rows of SmolLM2's 49,152 tokens; torch draws exponentials one at a time, ~10 ns each). Races, not an
    inverse CDF: a race's winner changes only when a float-rounding change of the probabilities
    reorders the top two ratios, while an inverse CDF moves every boundary by the rounding summed
    over the tokens before it, so two runs whose weights differ in the last bits (DDP against
    FSDP) would sample differently far more often. Exponentials come from torch's global
    generator, which the backend seeds per batch.
    """

    def __init__(self, block: int | None = None):
        self.block = block

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token = self.draw(scores)[:, None]
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    def draw(self, scores: torch.Tensor, live: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor:
        """One token id per row of `scores`. With `live` (row indices into a batch of `total` rows) the
        exponentials are drawn for all `total` rows and row i of `scores` takes those of live[i]: what
        a call with the whole batch would draw for that row (`decode_rows` after finished rows left)."""
        rows, vocab = scores.shape
        block = self.block or math.isqrt(max(vocab - 1, 0)) + 1  # ceil(sqrt(vocab))
        n_blocks = -(-vocab // block)
        probs = torch.nn.functional.pad(torch.softmax(scores.float(), dim=-1), (0, n_blocks * block - vocab))
        blocks = probs.view(rows, n_blocks, block)
        mass = blocks.sum(-1)
        k = (mass / self._exponentials(mass, live, total)).argmax(-1)
        inner = blocks[torch.arange(rows, device=scores.device), k]
        j = (inner / self._exponentials(inner, live, total)).argmax(-1)
        return (k * block + j).clamp_(max=vocab - 1)

    @staticmethod
    def _exponentials(like: torch.Tensor, live: torch.Tensor | None, total: int | None) -> torch.Tensor:
        if live is None:
            return torch.empty_like(like).exponential_()
        return like.new_empty(total, like.shape[1]).exponential_().index_select(0, live)


def sampling_processors(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' warpers in generate()'s own order, then the draw (`BlockRaceSampler`)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p))
    procs.append(BlockRaceSampler())
    return procs
