"""Sampling: the generation backends (transformers, the lean decode loop, vLLM), samplers and
prompt rendering.

May import: `schemas`, `stages.math`, `stages.runtime`, `stages.modeling`, `stages.rewards`,
`stages.environments`.
"""

# What the samplers draw for a given seed and model. Bump it with any change under stages/sampling/ that
# changes a sampled token or log-prob; every stage that declares `SAMPLES = True` has it in its cache key
# (`stages.stage_version`), so no stage's VERSION needs a bump for it.
SAMPLER_VERSION = "3"  # history: CHANGELOG.md
