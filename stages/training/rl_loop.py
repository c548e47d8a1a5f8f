"""The step loop of the on-policy RL stages (`grpo`, `ppo`): everything around a step that both do alike.

`StepLoop` replays a resumed run's history into the metrics log, keeps the progress bar and the
max_minutes budget, and ends every step the same way (`end_step`: the held-out eval when due, the
checkpoint, the log, the bar; a step that trained nothing: `skipped_step`); `finish` saves the policy
(`training.loop.save_policy`, the one the supervised stages use) with the run's summary (`summarize_curves`).
The stages differ only in what a step does.

May import: `schemas`, `stages.base`, `stages.rewards`, `stages.runtime`, and the rest of `stages.training`;
never a stage module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas.configs import ASYNC_POLICY_LOSSES, GenerationSpec
from schemas.errors import ConfigError, StageError
from stages.base import Input, Output, StageContext
from stages.math import alarms
from stages.rewards.verifiers import score
from stages.runtime import distributed, threads
from stages.training.checkpoints import complete_checkpoints, load_checkpoint, save_checkpoint
from stages.training.loop import policy_output, save_policy

if TYPE_CHECKING:
    from schemas.configs import RLConfig


def check_async(node: str, cfg: RLConfig) -> None:
    """Plan-time refusals of the `async` block (the stages' `check`; `StepLoop` asks again): a policy loss the
    per-token off-policy weight does not compose with, and what the asynchronous loop does not do yet: more
    than one learner process or machine, fsdp (a run asked to overlap generation and training must not silently
    alternate them). A vLLM backend samples in the workers (each its own engine, every version pushed in place). `node`: the recipe node's name
    (the stage's where none is known), for the `--set` an error names."""
    k = cfg.async_.max_staleness
    loss = getattr(cfg, "policy_loss", "token")  # ppo's surrogate is the token one
    if k and loss not in ASYNC_POLICY_LOSSES:
        raise ConfigError(f"{node}.policy_loss: {loss} does not go with async.max_staleness={k} (the off-policy "
                          f"weight is per token, {loss}'s ratio per sequence); use --set {node}.policy_loss="
                          f"{' or '.join(ASYNC_POLICY_LOSSES)}, or --set {node}.async.max_staleness=0")
    if not k:
        return
    off = f"or --set {node}.async.max_staleness=0 (the synchronous loop)"
    for field, value, allowed in (("resources.nodes", cfg.resources.nodes, 1),
                                  ("resources.num_processes", cfg.resources.num_processes, 1),
                                  ("resources.distributed_type", cfg.resources.distributed_type, "ddp")):
        if value != allowed:  # a learner on several processes or machines: not built yet
            raise ConfigError(f"{node}.{field}: {value} does not go with async.max_staleness={k} yet (the rollout "
                              f"workers feed one learner process); use --set {node}.{field}="
                              f"{allowed}, {off}")


def eval_due(cfg: RLConfig, held_out: list[dict], done: int) -> bool:
    """Whether the held-out prompts are evaluated after step `done` (every eval_every steps, if there are any)."""
    return bool(cfg.eval_every and held_out and done % cfg.eval_every == 0)


def held_out_eval(backend, rows: list[dict], generation: GenerationSpec, seed: int) -> dict[str, float]:
    """Greedy accuracy and format rate on held-out prompts, scored as the eval stage scores."""
    spec = GenerationSpec(max_new_tokens=generation.max_new_tokens, temperature=0.0, prefill=generation.prefill,
                          batch_size=generation.batch_size)
    comps, _ = backend.generate([r["messages"] for r in rows], spec, seed=seed, progress=False)
    verdicts = [score(r, cs[0].text) for r, cs in zip(rows, comps, strict=True)]
    scored = [v.correct for v in verdicts if v.correct is not None]
    return {"eval/accuracy": float(np.mean(scored)) if scored else 0.0,
            "eval/format_rate": float(np.mean([v.format_ok for v in verdicts]))}


def summarize_curves(history: list[dict], curves: dict[str, str]) -> dict[str, float]:
    """First/last-tenth means of each curve (`curves`: summary name -> metric), so a run's progress is a few
    numbers in the summary table: `<name>_first`, `<name>_last`; and the last held-out eval, the time per step."""
    k = max(1, len(history) // 10)
    out = {"steps": float(len(history))}
    for name, key in curves.items():
        xs = [h[key] for h in history if key in h]
        out[f"{name}_first"], out[f"{name}_last"] = (float(np.mean(xs[:k])), float(np.mean(xs[-k:]))) if xs else (0.0, 0.0)
    evals = [h for h in history if "eval/accuracy" in h]
    if evals:
        out["eval_accuracy_last"] = evals[-1]["eval/accuracy"]
        out["eval_format_rate_last"] = evals[-1]["eval/format_rate"]
    out["time_per_step"] = float(np.mean([h.get("time/step", 0.0) for h in history])) if history else 0.0
    return out


class StepLoop:
    """The bookkeeping around a run's steps. `state`: what `checkpoints.resume` returned; `module` and `optimizer`:
    what a checkpoint holds (every trained model as one module); `held_out`: the prompts of the periodic eval;
    `publish`: a `training.loop.CheckpointPublisher`, called after each step that trained."""

    def __init__(self, stage: str, cfg: RLConfig, ctx: StageContext, dist: distributed.Dist, state: dict,
                 module: torch.nn.Module, optimizer: torch.optim.Optimizer, held_out: list[dict],
                 publish: Callable[[int], None] | None = None) -> None:
        check_async(stage, cfg)
        self.stage, self.cfg, self.ctx, self.dist, self.publish = stage, cfg, ctx, dist, publish
        self.module, self.optimizer, self.held_out = module, optimizer, held_out
        self.start: int = state["step"]
        self.history: list[dict] = state.get("history", [])
        self.fired = {k.removeprefix("alarm/") for m in self.history for k in m if k.startswith("alarm/")}
        self.published_step: int | None = None  # on_alarm: stop: the step of the checkpoint published
        for i, m in enumerate(self.history):
            ctx.log_metrics(m, step=i + 1)
        if state.get("alarm_last_good") is not None and cfg.alarms.on_alarm == "stop":
            # the run stopped on an alarm, wrote the alarm step's checkpoint and crashed before publishing: it
            # publishes the same last good checkpoint now, and trains no further step
            ctx.log.warning("%s: resumed at step %d, where an alarm stopped the run before it published", stage,
                            self.start)
            self.restore(int(state["alarm_last_good"]), self.start)
        self.bar = tqdm(total=cfg.steps, initial=self.start, desc=stage, unit="step", disable=not dist.is_main)
        self.t_loop = time.perf_counter()

    @property
    def steps(self) -> range:
        """The steps left to train: none where a resumed run had already stopped on an alarm."""
        return range(self.start, self.start if self.published_step is not None else self.cfg.steps)

    def out_of_time(self, done: int) -> bool:
        """max_minutes: whether no further step may start; every process stops after the same step."""
        if not self.cfg.max_minutes or done >= self.cfg.steps:
            return False
        return self.dist.sum([float(time.perf_counter() - self.t_loop >= 60.0 * self.cfg.max_minutes)])[0] > 0

    def checkpoint(self, done: int, extra: dict | None = None) -> None:
        """Every process (gathered under fsdp): weights, optimizer, RNG, the step and the history so far."""
        save_checkpoint(self.ctx.checkpoint_dir, done, self.module, self.optimizer,
                        {"step": done, "history": self.history, **(extra or {})}, self.cfg.keep_checkpoints, self.dist)

    def end_step(self, metrics: dict[str, float], done: int, evaluate: Callable[[int], dict[str, float]],
                 extra: dict | None = None, **postfix: str) -> bool:
        """After step `done`: `evaluate(done)`'s held-out metrics when due (every process calls it; it returns {}
        where it does not evaluate), history, checkpoint (every checkpoint_every steps, the last one, and the one
        that spends the budget), log, progress bar; whether the run stops here (the budget is spent)."""
        out_of_time = self.out_of_time(done)
        threads.rebalance()  # this stage's share of the cores, if another r1flow run started or ended
        if eval_due(self.cfg, self.held_out, done):
            t_eval = time.perf_counter()
            metrics.update(evaluate(done))
            metrics["time/held_out_eval"] = time.perf_counter() - t_eval
        last_good = self.check_alarms(metrics, done)
        self.history.append(metrics)
        if last_good is not None:  # a crash before the publish resumes here and publishes the same checkpoint (a
            # checkpoint not due is not written: it could prune the last good one; a resume there retrains the steps)
            extra = {**(extra or {}), "alarm_last_good": last_good}
        if done % self.cfg.checkpoint_every == 0 or done == self.cfg.steps or out_of_time:
            self.checkpoint(done, extra)
        if self.publish is not None:  # a CheckpointPublisher: the model after this step, evaluated beside the training
            self.publish(done)
        self.ctx.log_metrics(metrics, step=done)
        self.bar.set_postfix(**postfix)
        self.bar.update(1)
        if last_good is not None:
            self.restore(last_good, done)
            return True
        if out_of_time:
            self.ctx.log.info(f"{self.stage}: the %.4g-minute budget is spent after step %d of %d; saving the model "
                              "as it is", self.cfg.max_minutes, done, self.cfg.steps)
        return out_of_time

    def check_alarms(self, metrics: dict[str, float], done: int) -> int | None:
        """The `alarms` rules over the history and step `done`'s `metrics` (`stages.math.alarms`, on rank 0, whose
        history holds the held-out evals): each new alarm is a warning line, an MLflow tag `r1flow.alarm.<rule>` and
        `alarm/<rule>` = 1 in `metrics`. With on_alarm: stop, the step of the newest policy the alarms do not
        implicate when one fired (every process gets rank 0's answer), else None."""
        found = alarms.raised([*self.history, metrics], self.cfg.alarms, len(self.held_out),
                              self.cfg.reward.repetition_max_penalty, self.fired) if self.dist.is_main else []
        for a in found:
            self.fired.add(a.rule)
            metrics[f"alarm/{a.rule}"] = 1.0
            self.ctx.log.warning("%s: alarm %s at step %d: %s", self.stage, a.rule, done, a.message)
            self.ctx.set_tags({f"r1flow.alarm.{a.rule}": f"step {a.step}: {a.message}"})
        if self.cfg.alarms.on_alarm != "stop":
            return None
        fired, last_good = self.dist.sum([float(bool(found)), float(min((a.last_good for a in found), default=0))])
        return int(last_good) if fired else None

    def restore(self, last_good: int, done: int) -> None:
        """on_alarm: stop after step `done`: the newest checkpoint of step `last_good` or before into the module (on
        every process), so that `finish` publishes it; none left is one StageError line."""
        kept = [p for p in complete_checkpoints(self.ctx.checkpoint_dir) if int(p.name.split("-")[1]) <= last_good]
        if not kept:
            raise StageError(f"{self.stage}: an alarm at step {done} with alarms.on_alarm=stop, and no checkpoint of "
                             f"step {last_good} or before is left (checkpoint_every={self.cfg.checkpoint_every}, "
                             f"keep_checkpoints={self.cfg.keep_checkpoints}); nothing was published: set "
                             "checkpoint_every lower or keep_checkpoints higher")
        self.published_step = load_checkpoint(kept[0], self.module, self.optimizer, self.dist)["step"]
        self.ctx.log.warning("%s: alarms.on_alarm=stop: stopping after step %d of %d and publishing the checkpoint "
                             "of step %d, the last before the steps that set the alarm off", self.stage, done,
                             self.cfg.steps, self.published_step)

    def skipped_step(self, metrics: dict[str, float], done: int, extra: dict | None = None) -> bool:
        """A step that trained nothing: logged, not checkpointed unless it spends the budget; whether to stop."""
        self.history.append(metrics)
        self.ctx.log_metrics(metrics, step=done)
        self.bar.update(1)
        if self.out_of_time(done):
            self.checkpoint(done, extra)
            return True
        return False

    def finish(self, inputs: dict[str, Input], policy: torch.nn.Module, tokenizer, merged_input: bool,
               curves: dict[str, str]) -> dict[str, Output]:
        """The trained policy (`policy`: whole, unsharded) as the stage's `model` output with the run's summary of
        `curves` (`summarize_curves`), logged with it."""
        self.bar.close()
        summary = summarize_curves(self.history, curves)
        if self.published_step is not None:  # on_alarm: stop
            summary["alarm_published_step"] = float(self.published_step)
        out, is_adapter = save_policy(self.ctx, self.dist, policy, tokenizer, self.cfg.lora, merged_input)
        self.ctx.log_metrics(summary)
        return {"model": policy_output(out, is_adapter, inputs["model"], summary)}
