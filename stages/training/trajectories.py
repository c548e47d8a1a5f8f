"""Trainer batches from multi-turn trajectories: the sampler's token ids as they are (never re-tokenized),
a loss mask over the model's tokens only, and the sampler's log-probs in the same layout."""

from __future__ import annotations

import torch

from stages.math.masking import predicted_token_mask
from stages.modeling import logprobs
from stages.sampling.multiturn import Trajectory


def trajectory_batch(trajectories: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of the trajectories' token ids, and per position t < L-1 (the prediction of token t+1,
    the layout of `logprobs.token_logprobs`): loss_mask (N, L-1), 1 where token t+1 was sampled, and
    sampler_logprobs (N, L-1), the sampler's log-prob of that token (0 elsewhere)."""
    ids, attention = logprobs.right_padded([list(t.token_ids) for t in trajectories], pad_id)
    width = ids.shape[1]
    model_mask = torch.zeros((len(trajectories), width), dtype=torch.long)
    sampled = torch.zeros((len(trajectories), width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        model_mask[i, : len(t.token_ids)] = torch.tensor(t.model_mask)
        sampled[i, : len(t.token_ids)] = torch.tensor(t.logprobs)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": predicted_token_mask(model_mask),
            "sampler_logprobs": sampled[:, 1:]}
