"""Regressions fail the nightly run (issue 63 item 4; docs/guides/regressions.md): the verdict on two evals paired by
prompt id (hand-worked numbers), what a deployment registers, and, against real servers, a scheduled deployment
whose runs of the same model pass and whose run of a worse model fails naming the drop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.report.regressions import paired_regression, regression_line, regressions_markdown
from flows.run.regressions import RegressionPolicy, final_state
from flows.servers.settings import PREFECT_HOME_FILES

ROOT = Path(__file__).resolve().parent.parent
R1FLOW = [sys.executable, "-m", "flows.cli"]
BEFORE, AFTER = {"id": "0192aa10-0000-7000-8000-00001111abcd", "name": "calm-otter"}, {
    "id": "0192aa10-0000-7000-8000-00003333ef01", "name": "brave-fox"}


# ---------------------------------------------------------------------------- the verdict (pure)


def test_every_prompt_lost_is_a_regression_of_100_points():
    """4 prompts right before, all wrong after: every per-prompt difference is -1, so every bootstrap resample's
    mean is -1 and the interval is [-1, -1]: a drop of 100 points [100, 100], wholly below 0."""
    row = paired_regression({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0})
    assert (row["gain"], row["ci_low"], row["ci_high"], row["prompts"]) == (-1.0, -1.0, -1.0, 4)
    assert row["regression"] is True
    assert regression_line("eval_sft", row, BEFORE, AFTER) == (
        "eval_sft: accuracy dropped 100.0 points [100.0, 100.0] from run calm-otter (1111abcd) to run brave-fox (3333ef01)")


def test_the_same_answers_are_no_regression_and_prompts_pair_by_id_not_order():
    """The same scores listed in another order: every difference is 0, the interval [0, 0], not below 0."""
    row = paired_regression({"a": 1.0, "b": 0.0, "c": 1.0}, {"c": 1.0, "b": 0.0, "a": 1.0})
    assert (row["gain"], row["ci_low"], row["ci_high"], row["regression"]) == (0.0, 0.0, 0.0, False)


def test_a_drop_within_the_noise_is_not_a_regression():
    """2 prompts, one lost (differences -1 and 0): the mean drops 50 points, but a resample of 2 draws is both -1
    (mean -1) with chance 1/4 and both 0 (mean 0) with chance 1/4, far more than the 2.5% in each tail: the 95%
    interval is [-1, 0], whose upper bound is not below 0."""
    row = paired_regression({"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 1.0})
    assert (row["gain"], row["ci_low"], row["ci_high"], row["regression"]) == (-0.5, -1.0, 0.0, False)


def test_the_tolerance_is_in_accuracy_points_and_the_whole_interval_must_lie_beyond_it():
    """The 100-point drop of [100, 100]: a tolerance of 99.9 points fails it, one of 100 does not (the interval's
    upper bound -1.0 is not below -1.0)."""
    before, after = dict.fromkeys("abcd", 1.0), dict.fromkeys("abcd", 0.0)
    assert paired_regression(before, after, tolerance_points=99.9)["regression"] is True
    assert paired_regression(before, after, tolerance_points=100)["regression"] is False
    with pytest.raises(ValueError, match="tolerance_points must be >= 0"):
        paired_regression(before, after, tolerance_points=-1)


def test_evals_of_different_prompts_are_not_compared():
    row = paired_regression({"a": 1.0, "b": 1.0}, {"a": 0.0, "c": 0.0})
    assert row["gain"] is None and row["regression"] is False
    assert row["note"] == "not compared: 2 prompt(s) scored by one eval only"


def _check(lines: list[str], fail: bool = True) -> dict:
    current = {"eval": "eval_base", "model_fingerprint": "ab" * 32, "accuracy": 0.0, "accuracy_ci_low": 0.0,
               "accuracy_ci_high": 0.0, "prompts": 16.0}
    previous = {**current, "model_fingerprint": "cd" * 32, "accuracy": 1.0, "accuracy_ci_low": 1.0,
                "accuracy_ci_high": 1.0}
    row = {"eval": "eval_base", "current": current, "previous": previous,
           **paired_regression(dict.fromkeys("ab", 1.0), dict.fromkeys("ab", 0.0))}
    return {"run": AFTER, "baseline": {**BEFORE, "parent_run_id": "p"}, "rows": [row], "lines": lines,
            "tolerance_points": 0.0, "fail": fail, "note": "Baseline: calm-otter (1111abcd)."}


def test_the_report_shows_both_rows_and_a_run_without_a_baseline_says_so():
    from flows.report.tables import read_tables

    md = "\n".join(regressions_markdown(_check(["x"])))
    assert read_tables(md) == [
        {"eval": "eval_base", "flow run": "brave-fox (3333ef01)", "model fp": "abababab",
         "accuracy [95% CI]": "0 [0.000, 0.000]", "prompts": "16", "change, points [95% CI]": "-100.0 [-100.0, -100.0]",
         "regression": "regression"},
        {"eval": "↳ baseline", "flow run": "calm-otter (1111abcd)", "model fp": "cdcdcdcd",
         "accuracy [95% CI]": "1 [1.000, 1.000]", "prompts": "16", "change, points [95% CI]": "", "regression": ""}]
    assert "a regression when the whole interval is below 0. Baseline: calm-otter (1111abcd)." in md
    first = {"run": AFTER, "baseline": None, "rows": [], "lines": [], "note": "No earlier successful run of "
             "deployment 'nightly': nothing to compare; this run is the next one's baseline."}
    assert "No earlier successful run of deployment 'nightly'" in "\n".join(regressions_markdown(first))


def test_a_regression_fails_the_flow_run_with_one_line_each_unless_the_policy_is_off():
    lines = ["eval_a: accuracy dropped 10.0 points [2.0, 18.0] from run x to run y", "eval_b: accuracy dropped ..."]
    state = final_state({"regressions": _check(lines)})
    assert state.is_failed() and state.message == "\n".join(lines)
    assert final_state({"regressions": _check(lines, fail=False)}) == {"regressions": _check(lines, fail=False)}
    assert final_state({"regressions": None}) == {"regressions": None}  # not a deployment's run
    assert RegressionPolicy() == RegressionPolicy(fail=True, tolerance_points=0.0)  # on by default


def test_one_eval_is_compared_by_prompt_id_and_a_baseline_that_cannot_be_read_is_said_not_failed():
    from flows.run.regressions import compare_eval
    from schemas.errors import ArtifactError

    def greedy(scores: dict[str, int]) -> list[dict]:
        return [{"prompt_id": k, "mode": "greedy", "correct": bool(v)} for k, v in scores.items()] + [
            {"prompt_id": "a", "mode": "sampled", "correct": False}]  # pass@k samples are not the accuracy

    evals = {"fp-before": greedy({"a": 1, "b": 1, "c": 1}), "fp-after": greedy({"c": 0, "a": 0, "b": 0})}

    def read_eval(fingerprint: str) -> list[dict]:
        if fingerprint not in evals:
            raise ArtifactError(f"artifact {fingerprint}: not in the store")
        return evals[fingerprint]

    now, before = {"eval": "eval_sft", "eval_fingerprint": "fp-after"}, {"eval": "eval_sft", "eval_fingerprint": "fp-before"}
    row = compare_eval(now, before, read_eval, RegressionPolicy())
    assert (row["gain"], row["ci_high"], row["regression"], row["current"], row["previous"]) == (-1.0, -1.0, True, now, before)
    gone = compare_eval(now, {**before, "eval_fingerprint": "fp-gone"}, read_eval, RegressionPolicy())
    assert gone["regression"] is False and gone["gain"] is None
    assert gone["note"] == "not compared: the baseline's eval output fp-gone cannot be read (artifact fp-gone: not in the store)"
    assert compare_eval(now, None, read_eval, RegressionPolicy())["note"] == "not compared: the baseline run has no such eval"


def test_deploy_registers_the_regression_settings_only_where_not_the_default():
    from flows.cli.app import build_parser
    from flows.run.deploy import deployment_specs
    from schemas.errors import ConfigError

    default = deployment_specs(["eval"], [], "tiny", [])[0]["parameters"]
    assert default == {"recipe": "eval", "profile": "tiny", "overrides": []}
    args = build_parser().parse_args(["deploy", "--recipe", "eval", "--no-fail-on-regression",
                                      "--regression-tolerance", "2.5"])
    assert (args.fail_on_regression, args.regression_tolerance) == (False, 2.5)
    off = deployment_specs(["eval"], [], "tiny", [], fail_on_regression=False, regression_tolerance=2.5)
    assert off[0]["parameters"] == {**default, "fail_on_regression": False, "regression_tolerance": 2.5}
    with pytest.raises(ConfigError, match="--regression-tolerance -1: a drop in accuracy points, >= 0"):
        deployment_specs(["eval"], [], "tiny", [], regression_tolerance=-1)


# ---------------------------------------------------------------------------- a scheduled deployment, real servers


def _sevens_file(path: Path) -> Path:
    """64 questions whose answer is 7 (48 train, 16 eval), ids q0..q63: a skill the tiny model learns in 70 SFT steps
    (16 of 16 held-out right) and never shows untrained (0 of 16)."""
    rows = []
    for i in range(64):
        a = i % 8
        question = f"What is {a} + {7 - a}?" if i % 2 else f"What is {a + 7} - {a}?"
        rows.append({"id": f"q{i}", "question": f"{question} (#{i})", "answer": "7", "verifier": "exact",
                     "split": "train" if i < 48 else "eval"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _good_model(root: Path, prompts_file: Path, untrained) -> Path:
    """The untrained tiny model after 70 SFT steps on the file's train split, as the prompts stage renders it."""
    from schemas.artifacts import MODEL_DIR
    from schemas.configs import LoraSpec, PromptsConfig, SFTConfig
    from stages import prompts, sft
    from stages.base import LocalContext
    from tests.conftest import fake_input

    data = prompts.run(PromptsConfig(tasks={}, files=[str(prompts_file)]), {}, LocalContext(root / "p"))["prompts"]
    cfg = SFTConfig(max_steps=70, batch_size=8, learning_rate=3e-3, warmup_ratio=0.1, max_length=256,
                    lora=LoraSpec(r=0), gold_think="ok", checkpoint_every=1000)
    out = sft.run(cfg, {"model": untrained, "data": fake_input(data.path, "dataset", "prompts")}, LocalContext(root / "sft"))
    return out["model"].path / MODEL_DIR


def _bare_env(home: Path) -> dict[str, str]:
    """A shell where the user exported nothing but R1FLOW_HOME (`r1flow up`'s servers are found through it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "R1FLOW_STORE", *PREFECT_HOME_FILES)}
    return {**env, "R1FLOW_HOME": str(home)}


def _wait_for(what: str, probe, timeout: float, proc=None, log: Path | None = None):
    deadline = time.time() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.time() > deadline or (proc is not None and proc.poll() is not None):
            raise AssertionError(f"{what}: not seen in {timeout:.0f} s" + (f"\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(1)


def _start_worker(pool: str, env: dict[str, str], log: Path, home: Path) -> subprocess.Popen:
    from flows.servers import servers

    with open(log, "a") as f:
        # polling every 2 s instead of Prefect's 10 picks each run up sooner (the test waits on three)
        worker = subprocess.Popen([*R1FLOW, "worker", "--pool", pool, "--limit", "1"], cwd=ROOT,
                                  env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"}, stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    _wait_for("the worker's registration", lambda: [r for r in servers.status(home).runners
                                                    if r.get("pid") == worker.pid], 120, worker, log)
    return worker


def _stop_worker(worker: subprocess.Popen) -> float:
    t0 = time.time()
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
    return time.time() - t0


def _parent(mlflow, experiment_id: str, flow_run_id):
    """The MLflow parent run of a Prefect flow run."""
    parent, = [r for r in mlflow.search_runs([experiment_id], f"tags.`r1flow.flow_run_id` = '{flow_run_id}'")
               if "mlflow.parentRunId" not in r.data.tags]
    return parent


def _report_text(mlflow, experiment_id: str, flow_run_id) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_id = _parent(mlflow, experiment_id, flow_run_id).info.run_id
        return Path(mlflow.download_artifacts(run_id, "report/report.md", tmp)).read_text()


def _regression_rows(report: str) -> list[dict[str, str]]:
    from flows.report.tables import read_tables

    section = report.split("## Regressions", 1)[1]
    return read_tables(section.split("\n", 1)[1])


@pytest.mark.slow
def test_a_scheduled_deployment_fails_when_its_model_got_worse_and_passes_on_the_same_model(
        live_servers, session_dir, tmp_path, tiny_model_input):
    """`r1flow deploy --interval` of a recipe that evaluates the model in a folder, on `r1flow up`'s servers;
    `r1flow worker` (one run at a time) runs the schedule. The first run has no baseline and passes saying so; the
    second evaluates the same model (every stage Cached) and passes with a change of 0; then, the work pool paused
    so that no run starts meanwhile, the folder gets the untrained model, and the next scheduled run fails with one line naming the eval, the drop, its interval and
    the two runs; its report shows both rows and MLflow has the drop."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.servers import servers
    from schemas.artifacts import MODEL_DIR

    info, home = live_servers, session_dir / "servers-home"
    env = _bare_env(home)
    prompts_file = _sevens_file(tmp_path / "sevens.jsonl")
    model_dir = tmp_path / "model-under-test"
    shutil.copytree(_good_model(tmp_path / "train", prompts_file, tiny_model_input), model_dir)
    recipe = tmp_path / "nightly-regress.yaml"
    recipe.write_text("name: nightly-regress\ndescription: the model in a folder on questions whose answer is 7\n"
                      "model: tiny-random\nseed: 0\nnodes:\n"
                      "  base: {stage: import_model, config: {ref: '${model}'}}\n"
                      f"  prompts: {{stage: prompts, config: {{tasks: {{}}, files: ['{prompts_file}']}}}}\n"
                      "  eval_base: {stage: eval, inputs: {model: base.model, prompts: prompts.prompts}}\n")
    out = subprocess.run([*R1FLOW, "deploy", "--recipe", str(recipe), "--profile", "tiny", "--interval", "10", "--pool",
                          "regress-pool", "--set", f"model={model_dir}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = tmp_path / "worker.log"
    mlflow = MlflowClient(info.mlflow_tracking_uri)
    with temporary_settings({PREFECT_API_URL: info.prefect_api_url}), get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("r1flow-pipeline/nightly-regress")

        def final_runs():
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
            return sorted((r for r in runs if r.state and r.state.is_final() and r.start_time), key=lambda r: r.start_time)

        def pool_paused(paused: bool) -> None:  # a paused pool hands its worker no runs: the one running finishes
            client.update_work_pool("regress-pool", WorkPoolUpdate(is_paused=paused))

        def second_started():
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
            return (any(r.state.is_completed() for r in runs if r.state)
                    and any(r.state.type.value in ("PENDING", "RUNNING") for r in runs if r.state))

        worker = _start_worker("regress-pool", env, log, home)
        try:
            _wait_for("the first scheduled run finished and the second started", second_started, 600, worker, log)
            pool_paused(True)  # no third run until the model changes
            done = _wait_for("two scheduled runs finished", lambda: (d if len(d := final_runs()) >= 2 else None),
                             600, worker, log)
            first, second = done
            assert first.state.is_completed() and second.state.is_completed(), [(r.name, r.state.message) for r in done]
            assert first.auto_scheduled and second.auto_scheduled  # fired by the schedule, not by hand
            tasks = [{t.name: t.state.name for t in client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[r.id])))} for r in (first, second)]
            assert tasks[0]["eval_base"] == "Completed", tasks[0]  # a config no other run had: computed
            assert set(tasks[1]) == {"base", "prompts", "eval_base"} and set(tasks[1].values()) == {"Cached"}, tasks[1]
            exp = mlflow.get_experiment_by_name("r1flow/nightly-regress").experiment_id
            report = {r.id: _report_text(mlflow, exp, r.id) for r in (first, second)}
            assert ("No earlier successful run of deployment 'nightly-regress': nothing to compare; this run is the "
                    "next one's baseline.") in report[first.id]
            same = _regression_rows(report[second.id])
            assert same[0]["change, points [95% CI]"] == "+0.0 [+0.0, +0.0]" and same[0]["regression"] == "no", same
            storage = home / "prefect" / "storage"  # PREFECT_HOME under R1FLOW_HOME, results included
            assert storage.is_dir() and any(storage.iterdir())

            shutil.rmtree(model_dir)  # a worse checkpoint lands where the deployment looks
            shutil.copytree(tiny_model_input.path / MODEL_DIR, model_dir)
            swapped = time.time()
            pool_paused(False)
            worse = _wait_for("a scheduled run of the worse model finished", lambda: next(
                (r for r in final_runs() if r.start_time.timestamp() > swapped), None), 600, worker, log)
            client.pause_deployment(dep.id)
        finally:
            stopped_in = _stop_worker(worker)
        # a worker stops within seconds, a flow run in progress (the schedule may have fired another) Crashed with it
        assert stopped_in < 15, f"r1flow worker took {stopped_in:.1f} s to stop on SIGTERM"
        assert not [r for r in servers.status(home).runners if r.get("name") == "worker regress-pool"]
        baseline = [r for r in final_runs() if r.state.is_completed() and r.start_time < worse.start_time][-1]
        assert worse.state.is_failed() and worse.auto_scheduled, (worse.state.name, worse.state.message)
        assert worse.state.message == (
            f"eval_base: accuracy dropped 100.0 points [100.0, 100.0] from run {baseline.name} ({str(baseline.id)[-8:]}) "
            f"to run {worse.name} ({str(worse.id)[-8:]})"), worse.state.message
    parent = _parent(mlflow, exp, worse.id)
    assert parent.info.status == "FAILED"
    assert parent.data.metrics["eval_base/regression"] == 1.0
    assert parent.data.metrics["eval_base/regression/change"] == -1.0
    worse_report = _report_text(mlflow, exp, worse.id)
    rows = _regression_rows(worse_report)
    # the worse model is registered, but @final and @champion stay on the last good run's model
    assert "No alias moved: this run regressed (Regressions above)." in worse_report
    good_fp, worse_fp = rows[1]["model fp"], rows[0]["model fp"]
    assert good_fp != worse_fp and worse_fp in worse_report.split("## Model registry", 1)[0]
    for alias in ("final", "champion"):
        assert mlflow.get_model_version_by_alias("r1flow-nightly-regress", alias).tags["r1flow.fingerprint"].startswith(
            good_fp), alias
    assert [(r["eval"], r["flow run"], r["accuracy [95% CI]"], r["regression"]) for r in rows] == [
        ("eval_base", f"{worse.name} ({str(worse.id)[-8:]})", "0 [0.000, 0.000]", "regression"),
        ("↳ baseline", f"{baseline.name} ({str(baseline.id)[-8:]})", "1 [1.000, 1.000]", "")]
