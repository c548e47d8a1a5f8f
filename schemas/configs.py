"""Pydantic configs: one per stage, one for a recipe, one for a profile.

The recipe YAML, the CLI's `--set` and the Prefect UI forms all validate through these models,
so a field is declared (with its default and description) exactly once. Unknown keys are errors.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------------------- shared pieces


class LoraSpec(Strict):
    """LoRA adapter settings (peft). `r = 0` means full fine-tuning."""

    r: int = Field(16, ge=0, description="LoRA rank; 0 trains all weights (full fine-tuning).")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )
    merge: bool = Field(
        False,
        description="Save merged full weights instead of an adapter (adapter artifacts are smaller "
        "and record the base model's fingerprint).",
    )


class GenerationSpec(Strict):
    """How completions are sampled."""

    max_new_tokens: int = Field(128, ge=1, description="Maximum tokens generated per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables.")
    batch_size: int = Field(16, ge=1, description="Prompts per generate() call.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always stops).")


Precision = Literal["auto", "fp32", "bf16", "fp16"]


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
        None, description="System prompt; default: the R1 format instruction (<think>…</think><answer>…</answer>)."
    )


class SFTConfig(Strict):
    """`sft` stage: supervised fine-tuning with loss on assistant tokens only."""

    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of steps with linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_length: int = Field(512, ge=8, description="Tokens per sequence; longer examples are truncated.")
    packing: bool = Field(False, description="Concatenate examples into max_length blocks.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings; lora.r=0 is full fine-tuning.")
    precision: Precision = Field("auto", description="auto: bf16 on GPUs that support it, else fp32.")
    checkpoint_every: int = Field(25, ge=1, description="Save a resumable checkpoint every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    gold_think: str = Field(
        "Let me work this out step by step and check the result.",
        description="Only for `prompts` input: the <think> text of targets built from gold answers.",
    )


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


STAGE_CONFIGS: dict[str, type[Strict]] = {
    "import_model": ModelConfig,
    "prompts": PromptsConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
}


# ---------------------------------------------------------------------------- recipes


class NodeSpec(Strict):
    """One node of a recipe DAG: a stage, where its inputs come from, and its config."""

    stage: str = Field(description="Stage name (see `r1flow stages`).")
    inputs: dict[str, str] = Field(
        default_factory=dict, description="Stage input name -> 'node.output' of an upstream node."
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Overrides of the stage config.")
    seed: int | None = Field(None, description="Seed for this node (default: the recipe seed).")


class RecipeConfig(Strict):
    """A recipe: named nodes in any order; edges come from `inputs`."""

    name: str
    description: str = ""
    model: str = Field("smollm2-135m-instruct", description="Base model reference used by `import_model` nodes (`${model}` in a node config).")
    seed: int = Field(0, description="Default seed of every node.")
    nodes: dict[str, NodeSpec]

    @model_validator(mode="after")
    def _edges_point_somewhere(self) -> RecipeConfig:
        for name, node in self.nodes.items():
            for inp, src in node.inputs.items():
                if "." not in src:
                    raise ValueError(f"node {name!r} input {inp!r}: {src!r} must look like 'node.output'")
                up = src.split(".", 1)[0]
                if up not in self.nodes:
                    raise ValueError(f"node {name!r} input {inp!r}: unknown upstream node {up!r}")
        return self


class ProfileConfig(Strict):
    """A profile overlays sizes on any recipe: by stage type, then by node name."""

    name: str
    description: str = ""
    model: str | None = Field(None, description="Replaces the recipe's base model when set.")
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Stage type -> config overlay.")
    nodes: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Node name -> config overlay.")
