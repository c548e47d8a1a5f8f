"""Stages: one module per stage (`stages/<name>.py`: VERSION, CONFIG, INPUTS, OUTPUTS and run(); `SAMPLES = True`
where its results depend on what the samplers draw, `stage_version`), and `STAGES`, the one registry row per stage:
its module, config class, summary, the key metrics of a run's table and the panels of its training plot. Every
other table of stages derives from `STAGES` (`STAGE_MODULES`, `STAGE_CONFIGS`, `flows.plan.results.KEY_METRICS`,
`flows.report.plots.TRAINING_PANELS`); `tests/test_stage_tables.py` checks that they agree with the modules.

The registry imports no stage module (only `schemas/`): listing stages, validating a recipe, a run's table and the
report stay fast. Modules are imported lazily, by `get_stage`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from schemas.configs import (
    DistillConfig,
    DistillTracesConfig,
    EvalConfig,
    GRPOConfig,
    MakeStudentConfig,
    ModelConfig,
    PPOConfig,
    PreferenceDataConfig,
    PreferenceOptimizationConfig,
    PRMConfig,
    PromptsConfig,
    ReferenceLogprobsConfig,
    RejectionSamplingConfig,
    RewardModelConfig,
    SFTConfig,
    StepLabelsConfig,
    Strict,
    ToolDemosConfig,
)
from schemas.errors import ConfigError
from stages import sampling


@dataclass(frozen=True)
class Panel:
    """One panel of a stage's training plot in the report (flows/report/plots.py draws it): the metrics its users
    watch that share a y axis, from the keys the stage logs per step (`ctx.log_metrics(..., step=)`).

    lines: (metric key, legend label); a key ending in `/*` stands for every logged key under that
    prefix except `exclude`, each labelled by the rest of its name (GRPO's reward components)."""

    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class StageEntry:
    """A stage's row in `STAGES`.

    key_metrics: the metrics a run's stage table shows (fnmatch patterns, e.g. `pass_at_[0-9]`).
    panels: its training plot in the report; the first panel of a loss-trained stage (train/loss) is its panel in
    the overview training_loss.png."""

    module: str  # stages.<name>, whose CONFIG is `config`
    config: type[Strict]
    summary: str  # one line: `r1flow stages`, the reference pages, the Prefect deployments
    key_metrics: tuple[str, ...] = ()
    panels: tuple[Panel, ...] = ()


_LR = Panel("learning rate", "learning rate", (("train/lr", "learning rate"),))

_GRAD = Panel("gradient norm before clipping", "global L2 norm", (("train/grad_norm", "grad norm"),))

# asynchronous grpo and ppo (`async.max_staleness` >= 1; a synchronous run logs none of these, so none is drawn)
_ASYNC_NOT_STALENESS = frozenset({"async/staleness_mean", "async/staleness_max", "async/policy_version",
                                  "async/is_weight_mean", "async/is_weight_ess", "async/is_truncated",
                                  "async/generation_idle", "async/training_idle", "async/overlap",
                                  "async/worker_restarts"})
_ASYNC = (
    Panel("async: groups by staleness", "groups a step", (("async/*", ""),), _ASYNC_NOT_STALENESS),
    Panel("async: importance weights min(pi_prox / mu, C)", "per token", (
        ("async/is_weight_mean", "mean"), ("async/is_weight_ess", "effective sample size (share)"),
        ("async/is_truncated", "share truncated at C"))),
    Panel("async: who waits", "share of the wall-clock", (
        ("async/overlap", "both busy"), ("async/generation_idle", "generation idle"),
        ("async/training_idle", "training idle"))),
)

# grpo with old_logprobs: sampler, async grpo and ppo: |log p_trainer - log p_sampler| of the step's trained tokens
# (`stages.training.rollouts.drift_metrics`; asynchronous, the policy's change since the worker's version too)
_DRIFT = (
    Panel("sampler vs trainer log-probs", "|delta log-prob| per token (nats)", (
        ("sampler/logprob_delta_mean", "mean"), ("sampler/logprob_delta_p99", "p99"),
        ("sampler/logprob_delta_max", "max"))),
    Panel("tokens where sampler and trainer disagree", "share of tokens",
          (("sampler/logprob_delta_share_above_0.1", "|delta| > 0.1 nats"),)),
)

STAGES: dict[str, StageEntry] = {
    "import_model": StageEntry(
        "stages.import_model", ModelConfig,
        "import a model reference (builtin, local dir, hub name) as a model artifact",
        key_metrics=("parameters",)),
    "prompts": StageEntry(
        "stages.prompts", PromptsConfig,
        "verifiable prompts from reasoning-gym tasks and user files, with a train/eval split",
        key_metrics=("train_rows", "eval_rows")),
    "sft": StageEntry(
        "stages.sft", SFTConfig,
        "supervised fine-tuning (LoRA or full), loss on assistant tokens, resumable",
        key_metrics=("final_loss", "steps", "resumed_from_step"),
        panels=(Panel("train loss", "NLL per target token (nats)", (("train/loss", "train batch"),)), _LR, _GRAD)),
    "eval": StageEntry(
        "stages.eval", EvalConfig,
        "greedy pass@1 and sampled pass@k on held-out prompts, format rate, length; held-out prompts in the "
        "model's training data",
        key_metrics=("accuracy", "accuracy_lenient", "format_rate", "pass_at_[0-9]", "pass_at_[0-9][0-9]", "mean_length",
                     "slice/*/accuracy", "contamination/prompts")),
    "rejection_sampling": StageEntry(
        "stages.rejection_sampling", RejectionSamplingConfig,
        "K scored samples per prompt; keep up to M verified ones as an sft dataset",
        key_metrics=("acceptance_rate", "accepted_rows", "sample_accuracy")),
    "preference_data": StageEntry(
        "stages.preference_data", PreferenceDataConfig,
        "chosen/rejected pairs from scored samples (and user files), plus unpaired rows for KTO",
        key_metrics=("pairs", "mean_margin")),
    "reward_model": StageEntry(
        "stages.reward_model", RewardModelConfig,
        "Bradley-Terry reward model (scalar head on a causal LM), held-out pairwise accuracy",
        key_metrics=("eval_accuracy", "eval_margin"),
        panels=(
            Panel("Bradley-Terry loss", "loss per pair", (("train/loss", "train batch"),)),
            Panel("pairwise accuracy", "fraction of pairs, chosen > rejected", (("train/accuracy", "train batch"),)),
            _LR, _GRAD)),
    "grpo": StageEntry(
        "stages.grpo", GRPOConfig,
        "GRPO with verifiable rewards; Dr. GRPO, DAPO, GSPO, CISPO, RLOO variants by config",
        key_metrics=("reward_first", "reward_last", "eval_accuracy_last", "time_per_step"),
        panels=(
            Panel("mean reward", "reward (weighted sum)", (("reward/mean", "rollouts"),)),
            Panel("reward components", "mean per completion (unweighted)", (("reward/*", ""),),
                  frozenset({"reward/mean", "reward/std", "reward/zero_std_groups", "reward/unscored", "reward/accuracy",
                             "reward/format_rate", "reward/process_mean", "reward/steps_per_completion"})),
            Panel("accuracy", "fraction correct", (("reward/accuracy", "rollouts (sampled)"),
                                                   ("eval/accuracy", "held-out (greedy)"))),
            Panel("format rate", "fraction well-formed", (("reward/format_rate", "rollouts (sampled)"),
                                                          ("eval/format_rate", "held-out (greedy)"))),
            Panel("KL to the reference", "KL estimate per token (nats)", (("train/kl", "KL(policy || ref)"),)),
            Panel("policy entropy", "nats per token", (("train/entropy", "entropy"),)),
            Panel("completion length", "tokens", (("completion/mean_length", "mean"), ("completion/max_length", "max"))),
            Panel("completions cut at max_new_tokens", "fraction of completions", (("completion/truncated_frac", "cut"),)),
            Panel("clip fraction", "fraction of tokens clipped", (("train/clip_low", "ratio below 1 - eps_low"),
                                                                  ("train/clip_high", "ratio above 1 + eps_high"))),
            Panel("groups with equal rewards (no signal)", "fraction of groups", (("reward/zero_std_groups", "groups"),)),
            Panel("process reward", "mean step score", (("reward/process_mean", "process reward"),)),
            Panel("sampler / trainer mismatch", "KL per token (nats)", (("train/mismatch_kl", "mismatch KL"),)),
            *_DRIFT, _GRAD, *_ASYNC)),
    "ppo": StageEntry(
        "stages.ppo", PPOConfig,
        "PPO with a critic (value head on a policy copy or the reward model), KL-penalised rewards, GAE",
        key_metrics=("reward_first", "reward_last", "explained_variance_last", "eval_accuracy_last", "time_per_step"),
        panels=(
            Panel("mean reward", "score per completion", (("reward/mean", "rollouts"),
                                                          ("reward/kl_penalized", "score - beta * KL (the return)"))),
            Panel("accuracy", "fraction correct", (("reward/accuracy", "rollouts (sampled)"),
                                                   ("eval/accuracy", "held-out (greedy)"))),
            Panel("KL to the reference", "KL estimate per token (nats)", (("train/kl", "KL(policy || ref)"),)),
            Panel("value loss", "clipped squared error / 2", (("train/value_loss", "value loss"),)),
            Panel("explained variance", "1 - Var(R - V) / Var(R)", (("train/explained_variance", "critic"),)),
            Panel("clip fractions", "fraction of tokens clipped", (("train/clip_low", "policy, ratio below 1 - eps"),
                                                                   ("train/clip_high", "policy, ratio above 1 + eps"),
                                                                   ("train/value_clipfrac", "value"))),
            Panel("approximate KL between updates", "k3 per token (nats)", (("train/approx_kl", "new || old"),)),
            Panel("policy entropy", "nats per token", (("train/entropy", "entropy"),)),
            Panel("completion length", "tokens", (("completion/mean_length", "mean"), ("completion/max_length", "max"))),
            Panel("gradient norms before clipping", "global L2 norm", (("train/grad_norm", "policy"),
                                                                        ("train/critic_grad_norm", "critic"))),
            *_DRIFT, *_ASYNC,
        )),
    "reference_logprobs": StageEntry(
        "stages.reference_logprobs", ReferenceLogprobsConfig,
        "the reference model's log-probs of every preference completion, computed once and cached",
        key_metrics=("completions", "sequences_per_s")),
    "preference_optimization": StageEntry(
        "stages.preference_optimization", PreferenceOptimizationConfig,
        "DPO, cDPO, IPO, SimPO, KTO, ORPO on preference pairs (or unpaired rows for KTO)",
        key_metrics=("eval_accuracy", "eval_margin", "eval_kl", "units_per_s"),
        panels=(
            Panel("preference loss", "loss per pair (or example)", (("train/loss", "train batch"), ("eval/loss", "held-out"))),
            Panel("reward accuracy", "fraction of pairs, chosen > rejected",
                  (("train/rewards/accuracy", "train batch"), ("eval/accuracy", "held-out"))),
            Panel("implicit reward margin", "chosen - rejected", (("train/rewards/margin", "train batch"),
                                                                  ("eval/margin", "held-out"))),
            Panel("implicit rewards", "beta * log-ratio to the reference",
                  (("train/rewards/chosen", "chosen, train"), ("train/rewards/rejected", "rejected, train"),
                   ("eval/chosen", "chosen, held-out"), ("eval/rejected", "rejected, held-out"))),
            Panel("KL to the reference (held-out prompts)", "nats per completion", (("eval/kl", "KL(policy || ref)"),)),
            _LR, _GRAD)),
    "distill_traces": StageEntry(
        "stages.distill_traces", DistillTracesConfig,
        "n teacher traces per prompt, filtered by the verifier, as a re-usable sft dataset",
        key_metrics=("traces", "keep_rate", "sample_accuracy", "sample_accuracy_lenient")),
    "make_student": StageEntry(
        "stages.make_student", MakeStudentConfig,
        "a smaller student cut from the teacher by keeping a subset of its layers (weights copied)",
        key_metrics=("parameters", "teacher_parameters", "layers")),
    "distill": StageEntry(
        "stages.distill", DistillConfig,
        "train a student on a teacher: SFT on its traces, logit KD (KL at temperature T), or on-policy GKD",
        key_metrics=("student_parameters", "teacher_parameters", "heldout_nll_before", "heldout_nll_after", "heldout_nll_teacher"),
        panels=(
            Panel("distillation loss", "loss per target token", (("train/loss", "train batch"),)),
            Panel("student NLL of the training tokens", "NLL per target token (nats)", (("train/nll", "train batch"),)),
            Panel("student sample length (on-policy)", "tokens", (("train/sample_length", "mean"),)),
            _LR, _GRAD)),
    "step_labels": StageEntry(
        "stages.step_labels", StepLabelsConfig,
        "Math-Shepherd step labels: K rollouts from every step prefix of sampled solutions, soft or hard"),
    "prm": StageEntry(
        "stages.prm", PRMConfig,
        "process reward model: a head at every step's last token, BCE on step labels, step accuracy and AUROC"),
    "tool_demos": StageEntry(
        "stages.tool_demos", ToolDemosConfig,
        "python-tool demonstrations from gold answers of arithmetic prompts, each checked in the sandbox"),
}

STAGE_MODULES: dict[str, str] = {name: s.module for name, s in STAGES.items()}
STAGE_CONFIGS: dict[str, type[Strict]] = {name: s.config for name, s in STAGES.items()}


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
    return StageDescription(name, module.VERSION, STAGES[name].summary, dict(module.INPUTS), dict(module.OUTPUTS),
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
