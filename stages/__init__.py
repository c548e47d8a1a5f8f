"""Stages: one module per stage, each with VERSION, CONFIG, INPUTS, OUTPUTS and run(); `SAMPLES = True` where
its results depend on what the samplers draw (`stage_version`).

Modules are imported lazily so that listing stages or validating a recipe stays fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from schemas.errors import ConfigError
from stages import sampling

STAGE_MODULES = {
    "import_model": "stages.import_model",
    "prompts": "stages.prompts",
    "sft": "stages.sft",
    "eval": "stages.eval",
    "rejection_sampling": "stages.rejection_sampling",
    "preference_data": "stages.preference_data",
    "reward_model": "stages.reward_model",
    "grpo": "stages.grpo",
    "ppo": "stages.ppo",
    "reference_logprobs": "stages.reference_logprobs",
    "preference_optimization": "stages.preference_optimization",
    "distill_traces": "stages.distill_traces",
    "make_student": "stages.make_student",
    "distill": "stages.distill",
    "step_labels": "stages.step_labels",
    "prm": "stages.prm",
    "tool_demos": "stages.tool_demos",
}

STAGE_SUMMARIES = {
    "import_model": "import a model reference (builtin, local dir, hub name) as a model artifact",
    "prompts": "verifiable prompts from reasoning-gym tasks and user files, with a train/eval split",
    "sft": "supervised fine-tuning (LoRA or full), loss on assistant tokens, resumable",
    "eval": "greedy pass@1 and sampled pass@k on held-out prompts, format rate, length",
    "rejection_sampling": "K scored samples per prompt; keep up to M verified ones as an sft dataset",
    "preference_data": "chosen/rejected pairs from scored samples (and user files), plus unpaired rows for KTO",
    "reward_model": "Bradley-Terry reward model (scalar head on a causal LM), held-out pairwise accuracy",
    "grpo": "GRPO with verifiable rewards; Dr. GRPO, DAPO, GSPO, CISPO, RLOO variants by config",
    "ppo": "PPO with a critic (value head on a policy copy or the reward model), KL-penalised rewards, GAE",
    "reference_logprobs": "the reference model's log-probs of every preference completion, computed once and cached",
    "preference_optimization": "DPO, cDPO, IPO, SimPO, KTO, ORPO on preference pairs (or unpaired rows for KTO)",
    "distill_traces": "n teacher traces per prompt, filtered by the verifier, as a re-usable sft dataset",
    "make_student": "a smaller student cut from the teacher by keeping a subset of its layers (weights copied)",
    "distill": "train a student on a teacher: SFT on its traces, logit KD (KL at temperature T), or on-policy GKD",
    "step_labels": "Math-Shepherd step labels: K rollouts from every step prefix of sampled solutions, soft or hard",
    "tool_demos": "python-tool demonstrations from gold answers of arithmetic prompts, each checked in the sandbox",
    "prm": "process reward model: a head at every step's last token, BCE on step labels, step accuracy and AUROC",
}


def get_stage(name: str) -> ModuleType:
    if name not in STAGE_MODULES:
        raise ConfigError(f"unknown stage {name!r}; known stages: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name])


@dataclass(frozen=True)
class StageDescription:
    """What `r1flow stages` and the stage reference pages (docs/hooks/reference.py) show of a stage."""

    name: str
    version: str
    summary: str
    inputs: dict[str, str]  # name -> kind; `a|b` either kind, a trailing `?` optional
    outputs: dict[str, str]
    config: type
    doc: str  # the module's docstring


def describe_stage(name: str) -> StageDescription:
    module = get_stage(name)
    return StageDescription(name, module.VERSION, STAGE_SUMMARIES[name], dict(module.INPUTS), dict(module.OUTPUTS),
                            module.CONFIG, module.__doc__ or "")

# The sampler version the keys of sampling stages were computed under before it entered them: at this version
# a key is what it was, so bringing the sampler in moved no cache entry.
SAMPLER_BASELINE = "1"


def stage_version(module: ModuleType) -> str:
    """The version that enters a stage's cache key: its VERSION, and for a stage that samples (`SAMPLES`) the
    sampler's version (`sampling.SAMPLER_VERSION`) once it has moved past `SAMPLER_BASELINE`."""
    if getattr(module, "SAMPLES", False) and sampling.SAMPLER_VERSION != SAMPLER_BASELINE:
        return f"{module.VERSION}+sampler{sampling.SAMPLER_VERSION}"
    return module.VERSION
