"""Training machinery shared by the stages: optimizer, schedule and precision (`optim`),
checkpoints and exact resume (`checkpoints`), tokenized chat sequences with packing and collation
(`sequences`), preference pairs and held-out splits (`pairs`), RL rollouts shared by grpo and ppo
(`rollouts`), and the launcher that runs a stage in one or several processes (`launch`).

May import: everything below it (`schemas`, `stages.math`, `stages.rewards`, `stages.runtime`,
`stages.modeling`, `stages.sampling`, `stages.base`); never a stage module.
"""
