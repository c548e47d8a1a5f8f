"""Rewards: the verifiers that score a completion (math, reasoning-gym tasks, code in the sandbox,
format and length shaping) and the sandbox that runs untrusted code.

No models here: a learned reward model's scorer lives in `stages.modeling.heads`. May import:
`schemas`, the standard library, math-verify and reasoning-gym.
"""
