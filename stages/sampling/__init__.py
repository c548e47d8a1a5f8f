"""Sampling: the generation backends (transformers, the lean decode loop, vLLM), samplers and
prompt rendering.

May import: `schemas`, `stages.math`, `stages.runtime`, `stages.modeling`, `stages.rewards`,
`stages.environments`.
"""
