"""The pieces stage configs share: the strict base model, LoRA, sampling, processes, rewards, the memory options
and the supervised training loop's fields. `schemas.configs` re-exports every name, so a config is imported from
there wherever it is declared.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_serializer, model_validator


class Strict(BaseModel):
    # allow_inf_nan=False: `--set sft.learning_rate=.inf` is a config error, not a run that trains to NaN
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
    backend: Literal["transformers", "vllm", "auto"] = Field(
        "transformers", description="Generation backend; vllm needs vLLM installed (the `vllm` extra on CUDA; on a "
        "CPU machine its CPU build, docs/guides/vllm.md). grpo, ppo and distill on_policy run it colocated (in the "
        "trainer's process, the trained weights pushed into it in place before every rollout, each push timed). auto: "
        "chosen when the run is planned, vllm where it is installed and can serve the node, else transformers."
    )
    sync_timeout_s: float = Field(
        600.0, gt=0, description="backend vllm, colocated: a push of the trained weights into the engine that takes "
        "longer ends the stage with one line naming the step (left out of the config's dump, and so of cache keys, "
        "while 600)."
    )
    prefill: str = Field(
        "", description="Text the assistant turn starts with, e.g. `<think>\\n` (R1-Zero's template ends the prompt "
        "there). Part of the prompt, never trained; completions are returned and scored as prefill + generated text."
    )
    cache: Literal["dynamic", "static", "graph"] = Field(
        "dynamic", description="KV cache and decode loop. dynamic: r1flow's decode loop (finished rows dropped). "
        "static: transformers' generate() with its static cache; on a GPU transformers compiles the decode step; "
        "prompts are then left-padded to a multiple of 64 tokens so few shapes compile. graph: r1flow's decode step "
        "over preallocated KV buffers with fixed shapes, captured once per batch as a CUDA graph and replayed for "
        "every token (Llama, Mistral, Qwen2 with sdpa; other models use dynamic; on CPU it runs eagerly, correct but "
        "not faster). Same tokens either way, up to float rounding.",
    )

    @model_serializer(mode="wrap")
    def _sync_timeout_while_default(self, handler):
        """`sync_timeout_s` is left out while it is the default: the configs (and cache keys) of every stage stay
        what they were before it existed."""
        data = handler(self)
        if self.sync_timeout_s == 600.0 and isinstance(data, dict):
            data.pop("sync_timeout_s", None)
        return data


Precision = Literal["auto", "fp32", "bf16", "fp16"]


class ResourcesSpec(Strict):
    """How many processes a training stage runs on (data parallel), on one machine or several.

    With num_processes > 1 (and nodes 1) the pipeline launches the stage under `accelerate launch`
    (torchrun underneath) on its own machine. With nodes > 1 it runs nodes × num_processes ranks as
    Ray actors, num_processes on each of `nodes` machines of a Ray cluster (a STRICT_SPREAD placement
    group; needs `r1flow run --cluster ADDRESS` or RAY_ADDRESS, and R1FLOW_HOME on a filesystem every
    machine shares); the ranks run the same code and join one torch.distributed group (gloo on CPU,
    nccl on GPU). Either way every process loads the model, takes its share of each micro-batch (or of
    each step's prompts, GRPO) and the gradients are summed across processes before every optimizer
    step, normalised by the global batch, so the update is the single-process one. Batch sizes in the
    stage config stay *global*: the same config trains the same way on 1 or N processes, on one machine
    or several. With distributed_type fsdp each process holds 1/N of the model instead of all of it
    (same updates).
    """

    nodes: int = Field(1, ge=1, description="Machines to train across. 1: this machine, as before. More: the stage's "
                       "ranks run as Ray actors, num_processes on each of this many machines of the Ray cluster "
                       "(`r1flow run --cluster ADDRESS`), which need R1FLOW_HOME on a shared filesystem.")
    num_processes: int = Field(1, ge=1, validation_alias=AliasChoices("num_processes", "processes_per_node"),
                               description="Processes on each machine (one per GPU; on CPU, gloo processes); also "
                               "accepted as processes_per_node. The stage trains on nodes × num_processes processes. "
                               "1 with nodes 1 runs the stage inside the pipeline's own process, as before.")
    distributed_type: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every process holds the whole model; gradients are all-reduced once per optimizer "
        "step. fsdp: the model is sharded (torch FSDP2 fully_shard per decoder layer, ZeRO-3 style: parameters, "
        "gradients and optimizer state split across the processes), for models that do not fit one device; the "
        "same updates as ddp. Supported by every training stage; grpo and distill on_policy sample from an unsharded "
        "copy per process, refreshed from the shards before each rollout. DeepSpeed is not supported."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto: nccl when every process gets a CUDA device, else gloo."
    )

    @property
    def world_size(self) -> int:
        """All processes the stage trains on: nodes × num_processes."""
        return self.nodes * self.num_processes

    @model_serializer(mode="wrap")
    def _one_machine_as_before(self, handler):
        """`nodes` is left out while it is 1: configs (and so cache keys) of every stage trained on one machine stay
        what they were before multi-machine training existed."""
        data = handler(self)
        if self.nodes == 1 and isinstance(data, dict):
            data.pop("nodes", None)
        return data


class SandboxLimits(Strict):
    """Limits of the sandboxed subprocess that runs untrusted code (code-task rewards)."""

    wall_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit for one program run.")
    cpu_time_s: int = Field(5, ge=1, description="RLIMIT_CPU seconds.")
    memory_mb: int = Field(512, ge=32, description="RLIMIT_AS address-space limit in MiB.")
    max_output_bytes: int = Field(65536, ge=1024, description="Stdout/stderr kept; more is a failure.")
    max_processes: int = Field(1, ge=1, description="Extra processes the program may create (fork bombs stop here).")


class EnvironmentSpec(Strict):
    """What answers a model's turn during sampling (stages/environments): `single_turn` (one completion, no tool:
    what every sampling stage did before environments) or `python` (the model writes a program in r1flow's python
    tags, or as its chat template's tool call with `syntax: chat_template`, the program runs in the sandbox and its
    output comes back in output tags or as the template's tool message, for up to `max_turns` turns),
    or the path of a Python file defining `environment(reward, **options)` (stages/environments/registry.py: the
    stage's `reward:` is passed to it). A stage's config leaves it out of its cache key while it is the default, so
    `single_turn` runs keep their keys."""

    name: str = Field("single_turn", min_length=1, description="single_turn | python | path/to/env.py (a file "
                      "defining environment(reward, **options), given the stage's reward: settings to score with; "
                      "relative to the working directory; its bytes enter the cache key).")
    max_turns: int = Field(4, ge=1, description="Model turns per trajectory (python: at most max_turns - 1 programs "
                           "run; a user file ends its own trajectories, and this only sizes their token budget).")
    timeout_s: float = Field(5.0, gt=0, description="Each program's wall-clock deadline (python).")
    max_output_chars: int = Field(512, ge=1, description="A program's output shown to the model is cut to this.")
    syntax: Literal["tags", "chat_template"] = Field(
        "tags", exclude_if=lambda v: v == "tags",
        description="python: how a call and its output are written. tags: r1flow's `<python>`/`<output>` (what "
        "tool_demos teaches); chat_template: the model's own template, a `<tool_call>` JSON or a fenced python block "
        "ending the assistant turn, the output as the template's tool message (for a model taught its template's "
        "tool calls).")
    max_total_tokens: int | None = Field(None, ge=1, description="Tokens after the prompt over all turns, sampled "
                                         "and observation tokens alike (None: max_turns x generation.max_new_tokens).")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for a user "
                                    "environment file's environment(reward, **options) (not `reward`).")

    @model_validator(mode="after")
    def _syntax_is_the_python_tools(self):
        if self.syntax != "tags" and self.name != "python":
            raise ValueError(f"syntax {self.syntax!r} is the python environment's; {self.name!r} takes its own "
                             f"options (options:)")
        return self

    @property
    def is_single_turn(self) -> bool:
        return self.name == "single_turn"

    def token_budget(self, max_new_tokens: int) -> int:
        """Tokens after the prompt over all turns: `max_total_tokens`, else max_turns x the per-turn max_new_tokens."""
        return self.max_total_tokens or self.max_turns * max_new_tokens


def publish_checkpoints_field() -> Any:
    """A training stage's `publish_checkpoints_every`: absent from the config's dump (and so its cache key) while 0."""
    return Field(0, ge=0, exclude_if=lambda v: v == 0, description="Publish the model every N steps (not the last: "
                 "that is the stage's output) as an artifact of its own, evaluated beside the training by the recipe's "
                 "eval node of this node's model; the held-out curve goes to MLflow and the report "
                 "(docs/guides/checkpoint-evals.md). 0: off.")


def environment_field(description: str = "What answers the model's turns while sampling (single_turn: none).") -> Any:
    """A stage config's `environment` field: absent from the config's dump (and so its cache key) while default."""
    return Field(default_factory=EnvironmentSpec, exclude_if=lambda v: v == EnvironmentSpec(), description=description)


class RewardSpec(Strict):
    """How a completion is scored: weighted components, routed per prompt by its `verifier`.

    Components: accuracy (1/0 from the verifier), format (R1 tags well formed), tags (0.25 per R1
    tag present exactly once: partial format credit), overlong (DAPO's
    soft overlong punishment, ≤ 0), repetition (n-gram repetition penalty, ≤ 0), cosine (accuracy
    scaled by length, Demystifying Long CoT), language (share of the thinking's words written in
    `language_script`: R1's language-consistency reward, §2.3.2), reward_model (score of a trained
    reward model).
    """

    weights: dict[str, float] = Field(
        default_factory=lambda: {"accuracy": 1.0, "format": 0.2},
        description="Component name -> weight. Known: accuracy, format, tags, overlong, repetition, cosine, "
        "language, reward_model, or a verifier's raw score by its name (e.g. reasoning_gym).",
    )
    strict_answer: bool = Field(
        False,
        description="Reward-hacking guard for answer verifiers (all but code): accuracy counts only an answer given "
        "in exactly one `<answer>…</answer>` block outside the thinking; no \\boxed{} fallback, and several answer "
        "blocks (hedging) score as no answer. Lenient (evaluation) correctness is unaffected.",
    )
    # The scripts of stages.rewards.verifiers.LANGUAGE_SCRIPTS (tests check the two agree).
    language_script: Literal["latin", "cyrillic", "greek", "arabic", "cjk"] = Field(
        "latin",
        description="Target script of the language component (R1 §2.3.2 language consistency): the share of the "
        "thinking's words all of whose letters are in it. latin, cyrillic, greek, arabic, or cjk (Han ideographs, "
        "kana and hangul together: Chinese, Japanese, Korean).",
    )
    overlong_max_tokens: int = Field(512, ge=1, description="DAPO L_max: completions longer are penalised fully.")
    overlong_buffer: int = Field(128, ge=0, description="DAPO L_cache: the soft penalty ramps over this many tokens.")
    repetition_ngram: int = Field(3, ge=1, description="n of the n-gram repetition penalty.")
    repetition_max_penalty: float = Field(-1.0, le=0, description="Penalty when every n-gram repeats.")
    cosine_max_len: int = Field(512, ge=1, description="Length at which the cosine schedule ends.")
    cosine_min_value_wrong: float = Field(-0.5, description="Cosine reward of a wrong answer at length 0.")
    cosine_max_value_wrong: float = Field(0.0, description="Cosine reward of a wrong answer at max length.")
    cosine_min_value_correct: float = Field(0.5, description="Cosine reward of a correct answer at max length.")
    cosine_max_value_correct: float = Field(1.0, description="Cosine reward of a correct answer at length 0.")
    math_timeout_s: float = Field(5.0, gt=0, description="Deadline for one math-verify check (process pool).")
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits, description="Limits for code rewards.")


class MemoryOptions(Strict):
    """Memory-for-compute trades shared by every training loop (the supervised ones and GRPO)."""

    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory for longer sequences or bigger "
        "batches, ~30% more compute (sft, preference_optimization, grpo, distill; not reward_model yet).")
    logprob_chunk: int = Field(
        4096, ge=0, description="Token positions whose logits exist at once when computing log-probs (up to one "
        "chunk of scored positions the logits are kept for the backward pass; beyond that the output head is "
        "recomputed per chunk in it); 0 materialises the full [batch, seq, vocab] logits. "
        "sft, preference_optimization and grpo; distill's KD needs whole distributions and reward_model scores "
        "with a scalar head, so they ignore it.")


class TrainingConfig(MemoryOptions):
    """The fields of a supervised training loop, shared by the stages that run one (sft, reward_model)."""

    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of steps with linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_length: int = Field(512, ge=8, description="Tokens per sequence; longer examples are truncated.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings; lora.r=0 is full fine-tuning.")
    precision: Precision = Field("auto", description="auto: bf16 on GPUs that support it, else fp32.")
    checkpoint_every: int = Field(25, ge=1, description="Save a resumable checkpoint every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Processes to train on; batch_size "
                                     "is global and must divide evenly among them.")

    @model_validator(mode="after")
    def _batch_divides_among_processes(self) -> TrainingConfig:
        n = self.resources.world_size
        if self.batch_size % n:
            raise ValueError(f"batch_size={self.batch_size} does not split evenly among the {n} processes "
                             f"(resources.nodes x num_processes): every process takes batch_size / {n} of each micro-batch")
        return self


# Where a solution is cut into reasoning steps (`stages.math.steps.DELIMITERS`)
StepDelimiter = Literal["blank_line", "newline", "step_k"]
