"""Configs of the on-policy RL stages: what grpo and ppo share (`RLConfig`, one name per idea) and what each adds.
`schemas.configs` re-exports them.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from schemas.specs import (
    EnvironmentSpec,
    GenerationSpec,
    LoraSpec,
    MemoryOptions,
    Precision,
    ResourcesSpec,
    RewardSpec,
    StepDelimiter,
    Strict,
    environment_field,
    publish_checkpoints_field,
)

# The clip range below 1 each policy loss uses when epsilon_low is unset: PPO's 0.2 for the ratio-clipping
# kinds; none for CISPO, whose paper (MiniMax-M1) bounds the importance weight from above only.
DEFAULT_EPSILON_LOW: dict[str, float | None] = {"token": 0.2, "gspo": 0.2, "cispo": None}

# The policy losses the decoupled off-policy objective composes with (`stages.math.offpolicy`): a per-token weight
# times a per-token loss. gspo's ratio is one per sequence; a per-token weight inside it is neither GSPO nor AReaL.
ASYNC_POLICY_LOSSES: tuple[str, ...] = ("token", "cispo")

# How many dead rollout workers a stage's run replaces by default (`AsyncConfig.worker_restarts`).
DEFAULT_WORKER_RESTARTS = 2


def _renamed(data: Any, stage: str, renamed: dict[str, str]) -> Any:
    """A config dict with its deprecated field names replaced by the current ones, each with a FutureWarning
    (where both names of one field are set, the current one's value stands)."""
    if not isinstance(data, dict) or not any(old in data for old in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        value = data.pop(old)
        if new in data:  # e.g. a profile's old name under a --set of the new one: the new name wins
            warnings.warn(f"{stage}.{old}={value!r} is ignored: {stage}.{new}={data[new]!r} is set (the same "
                          f"setting, its current name)", FutureWarning, stacklevel=2)
            continue
        warnings.warn(f"{stage}.{old} is deprecated: it is now {stage}.{new} (the same setting); rename it in the "
                      "recipe or profile", FutureWarning, stacklevel=2)
        data[new] = value
    return data


class WorkerResources(Strict):
    """Where asynchronous RL's rollout workers run when the stage runs on a Ray cluster: the Ray resources each
    worker actor reserves. Placement, like a node's `resources:`: not part of the stage's cache key
    (`placement_free`); on one machine (local worker processes) it is not read."""

    cpus: float = Field(1, ge=0, description="CPU cores each rollout worker actor reserves (Ray num_cpus).")
    gpus: float = Field(0, ge=0, description="GPUs each rollout worker actor reserves (Ray num_gpus); above 0 the "
                        "worker samples on CUDA.")
    memory_gb: float | None = Field(None, gt=0, description="Memory each rollout worker actor reserves, in GiB (Ray "
                                    "memory); unset: no reservation.")
    labels: dict[str, float] = Field(default_factory=dict, description="Custom resources the worker's machine must "
                                     "offer, e.g. {gen: 1} for machines started with `ray start --resources='{\"gen\": "
                                     "1}'`; the learner (the stage's task) goes where the node's `resources:` say.")


class AsyncConfig(Strict):
    """Asynchronous RL (generate while training, AReaL-style bounded staleness): rollout workers sample groups with
    the policy version they hold while the learner trains; the learner consumes a group at most `max_staleness`
    versions old, with the decoupled PPO objective (`stages.math.offpolicy`). The default is the synchronous loop,
    and a config's dump (and so its cache key) leaves the block out while it is the default."""

    max_staleness: int = Field(0, ge=0, description="K: how many policy versions older than the learner's a consumed "
                               "group may be. 0: the synchronous loop (sample, then train; as before). K >= 1 (grpo "
                               "or ppo, one learner process): step s's groups are sampled by worker processes with the "
                               "weights after step max(0, s - K), so generation runs up to K steps ahead of training.")
    rollout_workers: int = Field(1, ge=1, description="Processes generating groups beside the learner when "
                                 "max_staleness >= 1 (worker i takes the steps s with s % N == i); each loads its own "
                                 "copy of the policy, and the cores are split evenly among them and the learner.")
    importance_cap: float = Field(2.0, gt=1, description="C: each token's loss is weighted by min(pi_prox / mu, C), "
                                  "pi_prox the learner's policy when the group is consumed, mu the policy that sampled "
                                  "it (AReaL's truncated importance weight; 1 when K = 0).")
    sync_timeout_s: float = Field(300.0, gt=0, description="Seconds a weight sync or a rollout worker may stay silent "
                                  "before the stage fails, naming the worker, its node and the policy version.")
    worker_resources: WorkerResources = Field(
        default_factory=WorkerResources, exclude_if=lambda v: v == WorkerResources(),
        description="On a Ray cluster (`r1flow run --cluster`) the rollout workers are Ray actors reserving these "
        "resources (placement: not in the cache key); on one machine they are local processes and this is not read.")
    worker_restarts: int = Field(
        DEFAULT_WORKER_RESTARTS, ge=0, exclude_if=lambda v: v == DEFAULT_WORKER_RESTARTS,
        description="How many times in a stage's run a rollout worker that dies (killed, out of memory, its Ray node "
        "lost) is replaced: the new worker resumes at the first step whose groups the learner has not received, "
        "with that step's policy version, so the outputs are the same; one death more fails the stage in one line. "
        "A worker that raises an error or stays silent past sync_timeout_s is not replaced. Operational, like "
        "worker_resources: not in the cache key.")


# The `async` settings that do not change what a run computes: where the rollout workers run (placement, like a
# node's `resources:`) and how often a dead one is replaced (a replacement delivers the same groups).
OPERATIONAL_ASYNC_FIELDS: tuple[str, ...] = ("worker_resources", "worker_restarts")


def placement_free(config: dict[str, Any]) -> dict[str, Any]:
    """A stage config's dump as its cache key reads it: without the operational `async` settings
    (OPERATIONAL_ASYNC_FIELDS: `worker_resources`, `worker_restarts`), and without the `async` block when the rest of
    it is the default (as the dump leaves it out then). Any other config is returned as it is."""
    block = config.get("async")
    if not isinstance(block, dict) or not any(k in block for k in OPERATIONAL_ASYNC_FIELDS):
        return config
    out = {k: v for k, v in config.items() if k != "async"}
    rest = {k: v for k, v in block.items() if k not in OPERATIONAL_ASYNC_FIELDS}
    if rest != AsyncConfig().model_dump(mode="json"):
        out["async"] = rest
    return out


ALARM_RULES = ("length", "repetition", "format", "entropy", "kl", "held_out")


class AlarmsConfig(Strict):
    """Reward-hacking alarms (`stages.math.alarms`, docs/guides/alarms.md): rules over the step metrics, checked
    after every step. An alarm is a warning line, an MLflow tag `r1flow.alarm.<rule>` and the metric
    `alarm/<rule>` = 1 at its step; with on_alarm: stop the stage also ends there and publishes its last good
    checkpoint. A config's dump (and so its cache key) leaves the block out while it is the default."""

    rules: list[Literal["length", "repetition", "format", "entropy", "kl", "held_out"]] = Field(
        default_factory=lambda: list(ALARM_RULES), description="The rules checked (each fires once a run): length, "
        "repetition, format, entropy, kl, held_out (needs eval_every > 0). [] checks none.")
    on_alarm: Literal["warn", "stop"] = Field(
        "warn", description="warn: log the alarm and train on. stop: end the stage at the step it fires and publish "
        "the newest checkpoint from before the steps that set it off (checkpoint_every and keep_checkpoints must "
        "leave one; else the stage fails in one line, nothing published).")
    baseline_steps: int = Field(3, ge=1, description="The first N steps' mean of a metric is its baseline.")
    patience: int = Field(2, ge=1, description="A per-step rule fires when its metric is bad for N steps in a row.")
    length_factor: float = Field(2.0, gt=1, description="length: completion/mean_length at least this many times "
                                 "its baseline.")
    truncated_rise: float = Field(0.3, gt=0, le=1, description="length, too: completion/truncated_frac (the share "
                                  "cut at max_new_tokens) at least this far above its baseline.")
    repetition_rise: float = Field(0.3, gt=0, le=1, description="repetition: the share of repeated n-grams "
                                   "(reward/repetition / reward.repetition_max_penalty) at least this far above its "
                                   "baseline.")
    format_drop: float = Field(0.3, gt=0, le=1, description="format: reward/format_rate at least this far below its "
                               "baseline.")
    entropy_fraction: float = Field(0.1, gt=0, lt=1, description="entropy: train/entropy at most this fraction of its "
                                    "baseline.")
    kl_limit: float = Field(1.0, gt=0, description="kl: train/kl (per token, nats) at least this.")
    held_out_z: float = Field(1.96, gt=0, description="held_out: the normal quantile of the interval of the held-out "
                              "accuracy's drop from its best earlier eval (1.96: 95%); it fires when the interval "
                              "is above 0 while the training reward rose.")
    reward_window: int = Field(3, ge=1, description="held_out: steps whose mean training reward is compared.")


class RLConfig(MemoryOptions):
    """What the on-policy RL stages (grpo, ppo) share, one name per idea: the rollout (steps, prompts, samples
    per prompt, sampling, reward), the KL anchor, the epochs over a rollout, the optimizer, checkpoints, the
    held-out eval and the budget. The stages add their advantage estimator and, for ppo, the critic."""

    steps: int = Field(50, ge=1, description="Rollout steps (each: sample, score, advantages, mu epochs of updates).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per rollout batch (global; each process rolls out "
                                  "prompts_per_step / processes).")
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt.")
    generation: GenerationSpec = Field(
        default_factory=lambda: GenerationSpec(temperature=1.0, max_new_tokens=128), description="Rollout sampling."
    )
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How completions are scored (routed per "
                               "prompt by its verifier).")
    environment: EnvironmentSpec = environment_field("What answers the policy's turns in a rollout (single_turn: "
                                                     "none; python: a tool; the loss covers the model's tokens only).")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference; 0 drops the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")
    mu: int = Field(1, ge=1, description="Optimisation epochs over each rollout batch (GRPO's mu, PPO's epochs).")
    learning_rate: float = Field(1e-5, gt=0, description="Peak learning rate (of the policy).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of steps with linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings of the policy; lora.r=0 is full "
                           "fine-tuning (the reference is then a frozen copy, else the adapter disabled).")
    precision: Precision = Field("auto", description="auto: bf16 on GPUs that support it, else fp32.")
    checkpoint_every: int = Field(10, ge=1, description="Save a resumable checkpoint every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    publish_checkpoints_every: int = publish_checkpoints_field()
    eval_every: int = Field(0, ge=0, description="Greedy held-out eval every N steps (0: off).")
    eval_prompts: int = Field(32, ge=1, description="Held-out prompts for the periodic eval.")
    split: Literal["train", "eval"] = Field("train", description="Prompts split to train on.")
    max_minutes: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Wall-clock budget of the training loop in minutes (0: none): "
        "once a step ends past it, no further step starts; that step is checkpointed and the model saved, so "
        "`steps` becomes a maximum. Counted from the first step of this attempt (a resumed run gets the budget "
        "afresh); the number of steps done, and so the output, then depends on the machine's speed.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Processes to train on; each takes "
                                     "prompts_per_step / num_processes prompts per step.")
    # `async` is a Python keyword: the attribute is async_, the name in recipes, --set, dumps and the UI is `async`
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", exclude_if=lambda v: v == AsyncConfig(),
                                description="Asynchronous RL: generate while training, with bounded staleness "
                                "(max_staleness 0, the default: the synchronous loop).")

    alarms: AlarmsConfig = Field(default_factory=AlarmsConfig, exclude_if=lambda v: v == AlarmsConfig(),
                                 description="Reward-hacking alarms over the step metrics (docs/guides/alarms.md): "
                                 "warn, or stop with the last good checkpoint published.")

    model_config = ConfigDict(validate_by_alias=True, validate_by_name=True, serialize_by_alias=True)

    @model_validator(mode="after")
    def _stop_without_fsdp(self) -> RLConfig:
        if self.alarms.on_alarm == "stop" and self.resources.distributed_type == "fsdp":
            raise ValueError("alarms.on_alarm=stop with resources.distributed_type=fsdp is not built (the last good "
                             "checkpoint would have to reach the unsharded copy the stage publishes): use ddp, or "
                             "on_alarm: warn")
        return self


class GRPOConfig(RLConfig):
    """`grpo` stage: group-relative policy optimisation with verifiable rewards (and variants)."""

    group_size: int = Field(8, ge=2, description="G: completions per prompt, the group whose rewards set the "
                            "baseline.")
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch"] = Field(
        "grpo", description="grpo: (r-mean)/std per group; dr_grpo: r-mean; rloo: r-mean of the others; "
        "batch: r-group mean scaled by the batch std."
    )
    std: Literal["population", "sample"] = Field("population", description="Std estimator for grpo advantages.")
    policy_loss: Literal["token", "gspo", "cispo"] = Field(
        "token", description="token: PPO-clipped token ratios; gspo: sequence-level ratio; cispo: clipped IS weights."
    )
    aggregation: Literal["seq_mean", "token_mean", "constant"] = Field(
        "seq_mean", description="seq_mean (GRPO), token_mean (DAPO), constant normaliser (Dr. GRPO)."
    )
    epsilon_low: float | None = Field(
        None, ge=0, description="Clip range below 1. Unset: 0.2 for token and gspo; no lower bound for cispo "
        "(MiniMax-M1 clips its IS weights from above only; set a number to clip them below at 1 - epsilon_low).")
    epsilon_high: float = Field(0.2, ge=0, description="Clip range above 1 (DAPO clip-higher when > epsilon_low).")
    minibatch_size: int = Field(16, ge=1, description="Sequences per forward/backward pass (per process; bounds "
                                "memory only: the mini-batches of an epoch accumulate into one optimizer step). With "
                                "prefix_sharing, whole groups: max(1, minibatch_size // group_size) prompts.")
    prefix_sharing: bool = Field(
        True, description="Training passes run each group's prompt through the decoder once: the same values and "
        "gradients at about (P + G*C) / (G*(P+C)) of the decoder's cost for prompt length P and completion length "
        "C. Llama/Mistral/Qwen2 models (full attention, sdpa attention) pack the prompts and their completions in one "
        "decoder call under a mask that keeps the completions apart, where that costs less than running the G "
        "completions against the prompt's KV cache (gradients flow through the cache), which other models with a "
        "plain output head do; with gradient_checkpointing (no KV cache) only packing shares, other models run "
        "whole rows. What every prompt of a mini-batch starts with (system prompt, chat template; at least 32 "
        "tokens) runs once for all of them. "
        "(Rollout generation always prefills each prompt once for its G samples, and a batch's common part once.)")
    old_logprobs: Literal["trainer", "sampler"] = Field(
        "trainer", description="trainer: recompute old log-probs with the trainer's forward pass before the update; "
        "sampler: take the sampler's log-probs, read the trainer's from the first epoch's own pass (no extra pass) "
        "and correct the mismatch by truncated importance sampling, logging how far the two are apart per step "
        "(sampler/logprob_delta_*: mean, p99, max, share above 0.1 nats)."
    )
    tis_cap: float = Field(2.0, gt=0, description="Truncated importance sampling cap C (old_logprobs: sampler).")
    process_coef: float = Field(
        0.0, ge=0, description="Weight of process supervision: step rewards, normalised per group, are accumulated "
        "to the tokens before them and added to the outcome advantage (0: outcome only). The process_reward_model "
        "input (a prm stage's model) scores every step of a completion in one pass, at its own step delimiter; "
        "without it the reward_model input scores the completion prefix at the end of each step (step_delimiter)."
    )
    step_delimiter: StepDelimiter = Field(
        "newline", description="Where a reasoning step ends for process supervision by the reward model: newline "
        "(every non-blank line is a step), blank_line, step_k (before each 'Step k:' marker); as the step_labels and "
        "prm stages cut steps.")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal (DAPO).")
    mask_truncated: bool = Field(False, description="Exclude completions cut at max_new_tokens from the loss.")
    ref_refresh_every: int = Field(0, ge=0, description="Copy the policy into the reference every N steps (0: never).")
    max_refill_rounds: int = Field(2, ge=0, description="Dynamic sampling: extra rollouts to refill dropped groups.")

    @model_validator(mode="before")
    @classmethod
    def _delimiter_by_name(cls, data: Any) -> Any:
        # step_delimiter used to be the raw text; the two texts it could usefully be are the named delimiters now
        raw = {"\n": "newline", "\n\n": "blank_line"}
        if isinstance(data, dict) and data.get("step_delimiter") in raw:
            name = raw[data["step_delimiter"]]
            warnings.warn(f"grpo.step_delimiter {data['step_delimiter']!r} is deprecated: name it {name!r}",
                          FutureWarning, stacklevel=2)
            data = {**data, "step_delimiter": name}
        return data

    @model_validator(mode="after")
    def _eps_low_of_the_policy_loss(self) -> GRPOConfig:
        # filled in (not left None) for token/gspo so their configs, and cache keys, read as before
        default = DEFAULT_EPSILON_LOW[self.policy_loss]
        if self.epsilon_low is None and default is not None:  # (assigning re-runs this validator)
            self.epsilon_low = default
        return self

    @model_validator(mode="after")
    def _prompts_divide_among_processes(self) -> GRPOConfig:
        n = self.resources.world_size
        if self.prompts_per_step % n:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} does not split evenly among the {n} processes "
                             f"(resources.nodes x num_processes): every process rolls out whole groups for an equal share")
        if self.generation.backend == "vllm" and self.resources.distributed_type == "fsdp":
            raise ValueError("generation.backend=vllm with resources.distributed_type=fsdp is not built (the engine "
                             "would need the sharded weights gathered for every sync): use ddp, or the transformers "
                             "backend")
        return self


class PPOConfig(RLConfig):
    """`ppo` stage: PPO with a learned critic and GAE (InstructGPT-style RLHF; GRPO is PPO without the critic)."""

    group_size: int = Field(1, ge=1, description="Completions sampled per prompt (formerly samples_per_prompt). PPO "
                            "needs no groups (the critic is the baseline); more samples per prompt only widen the batch.")
    critic: Literal["policy_copy", "reward_model"] = Field(
        "policy_copy", description="What the value head sits on. policy_copy: a copy of the input model's decoder "
        "with a fresh Linear(hidden, 1) head at zero (values start at 0); reward_model: the "
        "reward_model input (its trained head as the value head's start, InstructGPT's choice). The head reads the last "
        "hidden state at every token.")
    critic_lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings of the critic (the value head "
                                  "always trains in full); critic_lora.r=0 trains every critic weight.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount gamma of GAE (1: undiscounted, as in LM RLHF).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda: 1 is the Monte-Carlo return minus V, 0 the one-step "
                       "TD error. 1 by default (verl's default): the score sits on the last token, and below 1 an "
                       "untrained critic passes it back decayed by lambda per token (0.95^60 = 0.05), so the early "
                       "tokens of a long completion learn nothing (VAPO, Yue et al. 2025); InstructGPT and TRL use 0.95.")
    epsilon: float = Field(0.2, gt=0, description="Policy clip range: the ratio is clipped to [1-epsilon, 1+epsilon] "
                           "(the same clipped surrogate grpo uses, `rl.policy_loss` kind token).")
    value_clip: float | None = Field(0.2, gt=0, description="Value clip range around the rollout's values (PPO's "
                                     "clipped value loss); null: plain squared error.")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss beside the policy loss (one backward over "
                           "both). The critic shares no weights with the policy, so this only scales the critic's "
                           "gradient: under AdamW that matters little (through max_grad_norm and Adam's epsilon); "
                           "critic_learning_rate is the knob of the critic's pace.")
    beta: float = Field(0.05, ge=0, description="KL penalty coefficient in the per-token rewards (-beta * KL_t on "
                        "every completion token, InstructGPT); 0 drops the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator in the rewards "
                                                     "(k1 = log pi/pi_ref, as InstructGPT and TRL).")
    whiten_advantages: bool = Field(True, description="Whiten the advantages over the step's valid tokens.")
    mu: int = Field(2, ge=1, description="Epochs over each rollout batch (formerly ppo_epochs).")
    critic_warmup_steps: int = Field(
        0, ge=0, description="The first N steps train only the critic (the policy's loss is left out and its learning "
        "rate is 0), so a fresh value head fits the returns before its advantages move the policy (OpenRLHF's "
        "freezing_actor_steps). They count toward `steps`.")
    minibatch_size: int = Field(8, ge=1, description="Sequences per mini-batch (global); every mini-batch is one "
                                "optimizer step, as in PPO (Schulman et al. 2017), so clipping matters from the "
                                "second mini-batch on.")
    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per forward and backward pass on each "
                                         "process (null: the whole mini-batch); the mini-batch's gradient is "
                                         "accumulated over them, so only memory changes.")
    critic_learning_rate: float | None = Field(None, gt=0, description="Peak learning rate of the critic (null: "
                                               "learning_rate).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm, applied to the policy and the critic "
                                 "separately.")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return _renamed(data, "ppo", {"ppo_epochs": "mu", "samples_per_prompt": "group_size"})

    @model_validator(mode="after")
    def _batches_divide_among_processes(self) -> PPOConfig:
        n = self.resources.world_size
        if self.prompts_per_step % n or self.minibatch_size % n:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} and minibatch_size={self.minibatch_size} must "
                             f"split evenly among the {n} processes (resources.nodes x num_processes)")
        if self.resources.distributed_type == "fsdp" and n > 1:
            raise ValueError("ppo with resources.distributed_type=fsdp is not built (policy and critic would both need "
                             "sharding and an unsharded sampling copy): use ddp")
        return self
