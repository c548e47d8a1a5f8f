"""Which tokens of a multi-turn trajectory learn: the model's own, never the prompt's or an observation's.

A trajectory is one sequence of prompt, sampled and observation tokens (`stages.sampling.multiturn`);
`model_mask` (B, L) is 1 on the sampled ones. A trainer's forward pass scores position t's prediction
of token t+1, so its per-position tensors are (B, L-1) and the mask over them is `model_mask[:, 1:]`
(`predicted_token_mask`). Every per-token term (policy loss, KL, entropy bonus) is multiplied by it
or by `token_weights`, which spreads each trajectory's advantage over its sampled tokens only: an
observation token gets weight 0, so no gradient, no KL and no entropy term (tested through
`rl.policy_loss`). The advantage stays per trajectory, as GRPO's outcome reward is (arXiv:2402.03300
§4.1.2), whatever number of turns and observations it has.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.math import rl


def predicted_token_mask(model_mask: Tensor) -> Tensor:
    """(B, L) 1 on sampled tokens -> (B, L-1) float: 1 at the positions whose next token was sampled."""
    return model_mask[:, 1:].float()


def token_weights(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-trajectory advantages (B,) spread over the (B, T) positions where `mask` is 1, 0 elsewhere."""
    return advantages[:, None].to(mask.dtype if mask.is_floating_point() else advantages.dtype) * mask


def multiturn_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
                  ) -> tuple[Tensor, Tensor]:
    """`rl.gae` over the masked-in (sampled) positions of each row only, in order, as if the positions between
    them were not there: an observation is the environment's transition between the model's last token of a
    turn and its first of the next, not the end of the episode (which `rl.gae` would read a hole in the mask as).
    V_{t+1} of a turn's last token is the value at the next sampled position (the state after the observation).
    rewards, values, mask (B, T). Returns (advantages, returns), 0 off the mask; with a contiguous mask exactly
    `rl.gae`'s."""
    m = mask.bool()
    order = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices  # (B, T): masked positions first, in order
    adv, returns = rl.gae(rewards.gather(1, order), values.gather(1, order), m.gather(1, order), gamma, lam)
    return torch.zeros_like(adv).scatter(1, order, adv), torch.zeros_like(returns).scatter(1, order, returns)
