"""Reward-hacking alarms (issue 63 item 2): each rule of stages/math/alarms.py on hand-made histories (one that fires,
one that does not, at the boundary), the StepLoop's warning, tag, metric and stop on a toy module, the report's
marker, and a GRPO run through the CLI on the tiny profile whose reward pays for length."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from schemas.configs import GRPOConfig
from stages.base import LocalContext
from stages.math import alarms
from stages.math.alarms import (
    Alarm,
    accuracy_drop_interval,
    entropy_alarm,
    format_alarm,
    held_out_alarm,
    kl_alarm,
    length_alarm,
    repetition_alarm,
    wilson_interval,
)


def history(key: str, values: list[float], **more: list[float]) -> list[dict[str, float]]:
    """One dict per step: `key` and each of `more` (a list per key, None: not logged that step)."""
    rows = [{key: v} for v in values]
    for k, vs in more.items():
        for row, v in zip(rows, vs, strict=True):
            if v is not None:
                row[k] = v
    return rows


# ---------------------------------------------------------------------------- the per-step rules


def test_length_fires_at_twice_its_baseline_for_two_steps():
    # baseline (10 + 12 + 14) / 3 = 12; 2 x 12 = 24: steps 4 (24, on the boundary) and 5 (25) are both bad
    a = length_alarm(history(alarms.LENGTH, [10, 12, 14, 24, 25]))
    assert a == Alarm("length", 5, 4, 2, "completion/mean_length at least 2x its baseline: 24, 25 at steps 4-5, its "
                      "baseline (the mean of its first values) 12")
    assert length_alarm(history(alarms.LENGTH, [10, 12, 14, 23.9, 25])) is None  # one bad step: patience 2
    assert length_alarm(history(alarms.LENGTH, [10, 12, 14, 24, 25, 20])) is None  # only the latest step fires
    assert length_alarm(history(alarms.LENGTH, [10, 12, 14, 24])) is None  # too few steps after the baseline


def test_length_fires_when_completions_pile_up_at_max_new_tokens():
    # a length near the cap cannot double: the share cut at max_new_tokens rises 0.25 above its baseline 0.25 instead
    h = history(alarms.LENGTH, [30, 30, 30, 32, 32], **{alarms.TRUNCATED: [0.25, 0.25, 0.25, 0.5, 0.5]})
    a = length_alarm(h, truncated_rise=0.25)
    assert (a.rule, a.step, a.began, a.last_good) == ("length", 5, 4, 2)
    assert a.message.startswith("completion/truncated_frac (completions cut at max_new_tokens) at least 0.25 above "
                                "its baseline: 0.5, 0.5 at steps 4-5")
    h[3][alarms.TRUNCATED] = 0.49
    assert length_alarm(h, truncated_rise=0.25) is None


def test_repetition_reads_the_penalty_as_a_share_of_repeated_ngrams():
    # max_penalty -0.5: -0.0625 is a share of 0.125, -0.1875 one of 0.375 = 0.125 + 0.25 (the boundary)
    h = history(alarms.REPETITION, [-0.0625, -0.0625, -0.0625, -0.1875, -0.25])
    a = repetition_alarm(h, max_penalty=-0.5, rise=0.25)
    assert (a.rule, a.step, a.began, a.last_good) == ("repetition", 5, 4, 2)
    assert "0.375, 0.5 at steps 4-5" in a.message and "0.125" in a.message
    h[3][alarms.REPETITION] = -0.18
    assert repetition_alarm(h, max_penalty=-0.5, rise=0.25) is None
    assert repetition_alarm(history(alarms.REPETITION, [0.0] * 5), max_penalty=0.0) is None  # no penalty: no signal


def test_format_fires_when_the_rate_falls_by_drop():
    h = history(alarms.FORMAT, [0.75, 0.75, 0.75, 0.25, 0.25, 0.0])
    a = format_alarm(h, drop=0.5)
    assert (a.rule, a.step, a.began, a.last_good) == ("format", 6, 4, 2)  # the whole bad run: 3 steps
    assert format_alarm(history(alarms.FORMAT, [0.75, 0.75, 0.75, 0.5, 0.25]), drop=0.5) is None


def test_entropy_fires_at_a_tenth_of_its_baseline():
    assert entropy_alarm(history(alarms.ENTROPY, [4, 4, 4, 0.5, 0.4]), fraction=0.125).step == 5  # 0.5 = 4/8
    assert entropy_alarm(history(alarms.ENTROPY, [4, 4, 4, 0.6, 0.4]), fraction=0.125) is None


def test_kl_fires_above_its_limit():
    assert kl_alarm(history(alarms.KL, [0.0, 0.1, 0.1, 1.0, 2.0]), limit=1.0).began == 4
    assert kl_alarm(history(alarms.KL, [0.0, 0.1, 0.1, 0.99, 2.0]), limit=1.0) is None
    # grpo without a KL term logs no train/kl: no alarm, whatever else is logged
    assert kl_alarm(history(alarms.LENGTH, [1.0] * 6)) is None


# ---------------------------------------------------------------------------- held-out accuracy beyond its noise


def test_wilson_and_newcombe_intervals_match_the_published_numbers():
    """Wilson's 95% interval of 50/100 is 0.5 -/+ 0.0962 (centre 0.5 by symmetry; half-width
    1.96 / (1 + 1.96^2/100) * sqrt(0.25/100 + 1.96^2/40000) = 0.09617). Newcombe 1998 (Statistics in Medicine 17:873),
    Table II, example (a): 56/70 - 48/80 = 0.2, method 10: 0.0524 to 0.3339."""
    low, high = wilson_interval(0.5, 100)
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)
    low, high = accuracy_drop_interval(56 / 70, 70, 48 / 80, 80)
    assert (round(low, 4), round(high, 4)) == (0.0524, 0.3339)


def evals(acc: dict[int, float], rewards: list[float]) -> list[dict[str, float]]:
    return history(alarms.REWARD, rewards, **{alarms.HELD_OUT: [acc.get(s + 1) for s in range(len(rewards))]})


def test_held_out_fires_when_accuracy_falls_beyond_its_noise_while_reward_rises():
    rising = [0.1, 0.2, 0.3, 0.5, 0.6, 0.7]
    # best earlier eval 0.5 at step 2 (step 4's 0.5 ties later); 0.25 at step 6 on 100 prompts: the drop's
    # interval is (0.116, 0.372) > 0; the reward of steps 4-6 (0.6) is above that of steps 1-2 (0.15)
    a = held_out_alarm(evals({2: 0.5, 4: 0.5, 6: 0.25}, rising), n_prompts=100)
    assert (a.rule, a.step, a.began, a.last_good) == ("held_out", 6, 3, 2)
    assert a.message == ("eval/accuracy fell from 0.5 at step 2 to 0.25 at step 6 on 100 held-out prompts (the drop's "
                         "interval starts at 0.116 > 0) while reward/mean rose from 0.15 to 0.6")
    # 0.45: within the noise of 100 prompts (interval -0.087 to 0.184)
    assert held_out_alarm(evals({2: 0.5, 6: 0.45}, rising), n_prompts=100) is None
    # the same drop on 8 prompts is noise too (interval starts below 0)
    assert held_out_alarm(evals({2: 0.5, 6: 0.25}, rising), n_prompts=8) is None
    # the reward did not rise: a harder task, not reward hacking
    assert held_out_alarm(evals({2: 0.5, 6: 0.25}, [0.5] * 6), n_prompts=100) is None
    # only at an eval step
    assert held_out_alarm(evals({2: 0.5, 5: 0.25}, rising), n_prompts=100) is None


def test_raised_runs_the_configured_rules_once_each():
    cfg = GRPOConfig(alarms={"rules": ["length", "format"]}).alarms
    h = history(alarms.LENGTH, [10, 10, 10, 30, 30], **{alarms.FORMAT: [1, 1, 1, 0, 0]})
    assert [a.rule for a in alarms.raised(h, cfg, 0, -1.0, set())] == ["length", "format"]
    assert [a.rule for a in alarms.raised(h, cfg, 0, -1.0, {"length"})] == ["format"]
    only = GRPOConfig(alarms={"rules": ["entropy"]}).alarms
    assert alarms.raised(h, only, 0, -1.0, set()) == []


def test_the_alarms_block_stays_out_of_the_dump_while_default_and_stop_refuses_fsdp():
    assert "alarms" not in GRPOConfig().model_dump(mode="json")  # so no existing cache key changes
    assert GRPOConfig(alarms={"on_alarm": "stop"}).model_dump(mode="json")["alarms"]["on_alarm"] == "stop"
    with pytest.raises(ValueError, match="alarms.on_alarm=stop with resources.distributed_type=fsdp is not built"):
        GRPOConfig(alarms={"on_alarm": "stop"}, resources={"distributed_type": "fsdp"})


# ---------------------------------------------------------------------------- the step loop, on a toy module


def toy_loop(tmp_path, **alarm_cfg):
    from stages.runtime import distributed
    from stages.training.rl_loop import StepLoop

    cfg = GRPOConfig(steps=8, checkpoint_every=1, keep_checkpoints=8, alarms={"rules": ["length"], **alarm_cfg})
    ctx = LocalContext(tmp_path, seed=0)
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return StepLoop("grpo", cfg, ctx, distributed.SINGLE, {"step": 0}, module, optimizer, []), ctx, module


def drive(loop, module, lengths: list[float]) -> list[int]:
    """Step the loop with these lengths, the module's weight set to the step number after each step; the steps run."""
    done = []
    for step, length in enumerate(lengths, 1):
        with torch.no_grad():
            module.weight.fill_(float(step))
        done.append(step)
        if loop.end_step({alarms.LENGTH: length}, step, lambda d: {}):
            break
    return done


def test_warn_logs_one_line_a_tag_and_the_metric_once(tmp_path, caplog):
    loop, ctx, module = toy_loop(tmp_path)
    with caplog.at_level(logging.WARNING, logger="r1flow.stage"):
        assert drive(loop, module, [10, 10, 10, 30, 30, 40, 50]) == [1, 2, 3, 4, 5, 6, 7]  # warn: trains on
    [line] = [r.getMessage() for r in caplog.records if "alarm" in r.getMessage()]
    assert line.startswith("grpo: alarm length at step 5: completion/mean_length at least 2x its baseline: 30, 30 ")
    assert ctx.tags == {"r1flow.alarm.length": "step 5: " + line.split("step 5: ", 1)[1]}
    assert [(s, m["alarm/length"]) for s, m in ctx.metrics if "alarm/length" in m] == [(5, 1.0)]


def test_stop_ends_the_loop_with_the_last_good_checkpoint_in_the_module(tmp_path, caplog):
    loop, ctx, module = toy_loop(tmp_path, on_alarm="stop")
    with caplog.at_level(logging.WARNING, logger="r1flow.stage"):
        assert drive(loop, module, [10, 10, 10, 10, 30, 30, 40]) == [1, 2, 3, 4, 5, 6]
    # bad from step 5, whose rollouts the policy after step 4 sampled: the policy after step 3 is the last good one
    assert loop.published_step == 3 and module.weight.tolist() == [[3.0, 3.0]]
    assert ("grpo: alarms.on_alarm=stop: stopping after step 6 of 8 and publishing the checkpoint of step 3, the last "
            "before the steps that set the alarm off") in caplog.text


def test_a_stopped_run_that_crashed_before_publishing_publishes_the_same_checkpoint_when_resumed(tmp_path, caplog):
    """The alarm step's checkpoint records the last good step: a run that stopped, wrote it and crashed before
    publishing resumes there, loads that same checkpoint and trains no further step (it used to train on, its
    alarm silent in the history)."""
    from stages.training.checkpoints import resume
    from stages.training.rl_loop import StepLoop

    loop, ctx, module = toy_loop(tmp_path, on_alarm="stop")
    assert drive(loop, module, [10, 10, 10, 10, 30, 30, 40]) == [1, 2, 3, 4, 5, 6] and loop.published_step == 3
    # the crash: a fresh process, a fresh module, and the newest checkpoint on disk (step 6)
    module2 = torch.nn.Linear(2, 1)
    optimizer2 = torch.optim.SGD(module2.parameters(), lr=0.1)
    state = resume(ctx, module2, optimizer2, "grpo", 8)
    assert state["step"] == 6 and module2.weight.tolist() == [[6.0, 6.0]]
    with caplog.at_level(logging.WARNING, logger="r1flow.stage"):
        again = StepLoop("grpo", loop.cfg, ctx, loop.dist, state, module2, optimizer2, [])
    assert again.published_step == 3 and module2.weight.tolist() == [[3.0, 3.0]] and list(again.steps) == []
    assert "grpo: resumed at step 6, where an alarm stopped the run before it published" in caplog.text
    # warn mode, or a run that never stopped, resumes and trains on
    plain = toy_loop(tmp_path / "warn")[0]
    assert list(plain.steps) == list(range(8))


def test_stop_without_a_checkpoint_left_is_one_line(tmp_path):
    from schemas.errors import StageError

    loop, ctx, module = toy_loop(tmp_path, on_alarm="stop")
    loop.cfg = loop.cfg.model_copy(update={"checkpoint_every": 4, "keep_checkpoints": 1})
    with pytest.raises(StageError) as e:  # step 4's checkpoint is the only one kept at step 6: 4 > 3
        drive(loop, module, [10, 10, 10, 10, 30, 30])
    assert str(e.value) == ("grpo: an alarm at step 6 with alarms.on_alarm=stop, and no checkpoint of step 3 or before "
                            "is left (checkpoint_every=4, keep_checkpoints=1); nothing was published: set "
                            "checkpoint_every lower or keep_checkpoints higher")


def test_a_stopped_grpo_run_publishes_the_checkpoints_weights(tmp_path, tiny_model_input, digit_prompts):
    """grpo paid for length (L / 128) with on_alarm: stop, by hand: the model it publishes holds exactly the weights of
    the checkpoint it names, not those of the step where it stopped (which were written too, and differ)."""
    from safetensors.torch import load_file

    from schemas.configs import GenerationSpec, LoraSpec, RewardSpec
    from stages import grpo

    cfg = GRPOConfig(steps=10, prompts_per_step=4, group_size=4, learning_rate=1e-2, lora=LoraSpec(r=0),
                     generation=GenerationSpec(max_new_tokens=128, temperature=1.0, batch_size=16), minibatch_size=16,
                     reward=RewardSpec(weights={"overlong": -1.0}, overlong_max_tokens=128, overlong_buffer=128),
                     checkpoint_every=1, keep_checkpoints=10, alarms={"on_alarm": "stop"})
    ctx = LocalContext(tmp_path / "run", seed=0)
    out = grpo.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, ctx)["model"]
    stopped, published = int(out.metrics["steps"]), int(out.metrics["alarm_published_step"])
    assert published < stopped < 10 and "r1flow.alarm.length" in ctx.tags
    saved = load_file(out.path / "model" / "model.safetensors")
    good = load_file(ctx.checkpoint_dir / f"step-{published:06d}" / "trainable.safetensors")
    last = load_file(ctx.checkpoint_dir / f"step-{stopped:06d}" / "trainable.safetensors")
    shared = sorted(set(saved) & set(good))
    assert len(shared) >= len(saved) - 1  # every saved tensor (a tied output head may be saved once)
    assert all(torch.equal(saved[k], good[k]) for k in shared)
    assert not all(torch.equal(saved[k], last[k]) for k in shared)


# ---------------------------------------------------------------------------- the report's marker


def test_the_training_plot_marks_the_alarm_steps():
    from flows.report.plots import alarm_marks, panel_figure

    curves = {"alarm/length": ([5], [1.0]), "alarm/format": ([5], [1.0]), "alarm/kl": ([7], [1.0]),
              "reward/mean": ([1, 2], [0.0, 1.0])}
    marks = alarm_marks(curves)
    assert marks == {5: "format, length", 7: "kl"}
    fig = panel_figure([("reward per step", "reward", [("", curves["reward/mean"])])], "t", marks)
    [ax] = fig.axes
    assert sorted(line.get_xdata()[0] for line in ax.lines[1:]) == [5, 7]  # after the curve: one line per step
    assert sorted(t.get_text() for t in ax.texts) == ["alarm: format, length", "alarm: kl"]


# ---------------------------------------------------------------------------- through the CLI, into MLflow

# a GRPO run whose reward pays for length: DAPO's overlong term with weight -1 over a buffer as long as the
# completions, so the reward is L / 128 (0 at length 0, 1 at 128 tokens); the other terms off
LENGTH_PAYS = ["grpo.reward.weights.accuracy=0", "grpo.reward.weights.format=0", "grpo.reward.weights.tags=0",
               "grpo.reward.weights.overlong=-1", "grpo.reward.overlong_max_tokens=128",
               "grpo.reward.overlong_buffer=128", "grpo.generation.max_new_tokens=128", "grpo.learning_rate=1e-2"]


@pytest.mark.slow
def test_a_grpo_run_paid_for_length_raises_the_length_alarm_and_stops(tmp_path, capfd, caplog):
    """`r1flow run --recipe r1-zero --profile tiny --only base --only prompts --only grpo` with a reward that pays for
    length and `alarms.on_alarm=stop`: the tiny random model's completions pile up at max_new_tokens, the length alarm
    is a warning line, the grpo run's MLflow tag and `alarm/length` = 1 at its step, and the stage stops there with
    the checkpoint from before the steps that set it off published (checkpoint_every=1, so exactly 2 steps before
    the first bad one). Cheap: base and prompts only beside grpo (no evals), at most 10 steps of 16 completions."""
    from mlflow.tracking import MlflowClient

    from flows.cli.app import main
    from tests.conftest import harness_home

    sets = [*LENGTH_PAYS, "grpo.steps=10", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=10",
            "grpo.alarms.on_alarm=stop"]
    with harness_home(tmp_path / "home") as home:
        out = home / "run.json"
        assert main(["run", "--recipe", "r1-zero", "--profile", "tiny", "--only", "base", "--only", "prompts",
                     "--only", "grpo", *[a for s in sets for a in ("--set", s)], "--json", str(out)]) == 0
        result = json.loads(out.read_text())
    # the task run's warnings as Prefect prints them ("... WARNING | Task run 'grpo' - grpo: alarm ..."); Prefect 3.7's
    # console handler writes to the sys.stderr it found at set-up, which capfd does not see: there, its log records
    printed = [t.split(" - ", 1)[1] for t in capfd.readouterr().err.splitlines() if " | WARNING | Task run 'grpo' - " in t]
    warned = printed or [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "prefect.task_runs"]
    err = "\n".join(warned)
    [line] = [t for t in warned if t.startswith("grpo: alarm ")]
    assert line.startswith("grpo: alarm length at step "), line
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    runs = client.search_runs([result["experiment_id"]], f"tags.mlflow.parentRunId = '{result['parent_run_id']}'")
    run = next(r for r in runs if r.data.tags["r1flow.node"] == "grpo")
    fired = int(line.split()[5].rstrip(":"))
    assert run.data.tags["r1flow.alarm.length"] == f"step {fired}: " + line.split(f" at step {fired}: ", 1)[1]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "alarm/length")] == [(fired, 1.0)]
    began = int(line.split(" at steps ")[1].split("-")[0])
    assert fired < 10 and run.data.metrics["steps"] == fired  # stopped at the alarm
    assert run.data.metrics["alarm_published_step"] == began - 2
    assert f"publishing the checkpoint of step {began - 2}, the last before the steps" in err
