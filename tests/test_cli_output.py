"""What the terminal shows: the end of `r1flow run` (stage table, model comparison, report path,
the command that opens the MLflow UI, the parent run's URL) within 100 columns (rendered here; a real tiny `r1` run's
end in tests/test_r1.py, whose first run goes through the CLI); `r1flow ui`; and
the small defects of issue 29 (a closed pipe, `r1flow models` wording, `r1flow artifacts` columns
with a long node name, "did you mean" for an unknown config key)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from flows.cli.app import main
from flows.cli.output import prefect_start_failure, print_summary
from flows.plan.recipes import load_plan
from flows.store.artifacts import ArtifactStore
from schemas.artifacts import Producer
from schemas.errors import ConfigError
from stages.runtime import lifetime
from tests.conftest import read_until

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100
ACCURACY = re.compile(r"\d(?:\.\d{3})? \[\d\.\d{3}, \d\.\d{3}\]")  # `0.250 [0.125, 0.500]`, `0 [0.000, 0.000]`
EVALUATED = {"eval_base": "base", "eval_sft_cold": "sft_cold", "eval_grpo_reasoning": "grpo_reasoning",
             "eval_sft": "sft", "eval_dpo": "dpo", "eval_grpo_final": "grpo_final", "eval_student": "distill"}


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, R1FLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), PYTHONPATH=str(ROOT), **extra)
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", lifetime.TOKEN_VAR, lifetime.PARENT_VAR):
        env.pop(key, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _too_wide(lines: list[str]) -> list[str]:
    """Lines wider than WIDTH, except a path or URL alone on its line and the UI command (`R1FLOW_HOME=<path>
    .../r1flow ui`), each printed whole so it can be copied (a long home path makes the command long)."""
    return [line for line in lines if len(line.rstrip()) > WIDTH and " " in line.strip()
            and not (line.startswith("R1FLOW_HOME=") and line.rstrip().endswith(" ui"))]


# ---------------------------------------------------------------------------- the end of a run, rendered
def _eval_metrics(acc: float, low: float, high: float) -> dict[str, float]:
    return {"accuracy": acc, "accuracy_ci_low": low, "accuracy_ci_high": high, "accuracy_lenient": acc,
            "format_rate": 0.99, "pass_at_4": 0.5, "mean_length": 31.0, "tokens_per_s": 120.0, "prompts": 288}


def _row(eval_node: str, model: str, fp: str, acc: float) -> dict:
    return {"eval": eval_node, "model": model, "model_output": "model", "model_fingerprint": fp * 8,
            "eval_fingerprint": "e" * 64, "status": "run", "mlflow_run_id": "r" * 32, "pass_k": 4, "pass_at_k": 0.5,
            "accuracy": acc, "accuracy_ci_low": max(0.0, acc - 0.05), "accuracy_ci_high": acc + 0.05, "accuracy_lenient": acc,
            "format_rate": 0.99, "mean_length": 31.0, "tokens_per_s": 120.0, "prompts": 288.0,
            "basic_arithmetic/accuracy": acc, "basic_arithmetic/accuracy_ci_low": max(0.0, acc - 0.06),
            "basic_arithmetic/accuracy_ci_high": acc + 0.06, "chain_sum/accuracy": 0.094,
            "chain_sum/accuracy_ci_low": 0.0, "chain_sum/accuracy_ci_high": 0.219,
            "contamination/prompts": 0.0, "contamination/share": 0.0, "contaminated": 0.0}


def _result(long_node: str = "grpo_reasoning") -> dict:
    """A run summary as run_plan returns it: 23 stages (one with a long node name), seven evals,
    previous rows for the two evals whose model changed."""
    stages = []
    for i in range(23):
        node, stage = (long_node, "grpo") if i == 5 else (f"node_{i}", "sft")
        metrics = {"final_loss": 3.14159, "trained_steps": 40, "train_rows": 1234}
        if i % 3 == 0:
            node, stage, metrics = f"eval_{i}", "eval", _eval_metrics(0.427, 0.372, 0.483)
        stages.append({"node": node, "stage": stage, "status": ["run", "cached", "skipped"][i % 3], "seconds": 12.5,
                       "prefect_state": "", "outputs": {"model": "f" * 64, "data": "d" * 64}, "metrics": metrics,
                       "mlflow_run_id": "r" * 32})
    rows = [_row(ev, model, str(i), 0.2 + i / 20) for i, (ev, model) in enumerate(EVALUATED.items())]
    previous = {"parent_run_id": "0123456789abcdef" * 2,
                "rows": [_row("eval_dpo", "dpo", "a", 0.31), _row("eval_student", "distill", "b", 0.0)]}
    return {"recipe": "r1", "profile": "cpu", "parent_run_id": "9" * 32, "experiment_id": "1", "flow_run_id": None,
            "link": "mlflow ui ...", "stages": stages,
            "comparison": {"recipe": "r1", "profile": "cpu", "parent_run_id": "9" * 32, "rows": rows,
                           "previous": previous},
            "report": {"uri": "/h/mlartifacts/9/artifacts/report/report.md", "path": "/h/mlartifacts/9/artifacts/"
                       "report/report.md", "files": ["report/comparison.csv", "report/comparison.json",
                                                     "report/eval.png", "report/grpo.png"]}}


def _render(result: dict, width: int) -> list[str]:
    buf = io.StringIO()
    print_summary(result, total=300.0, before_flow=10.0, console=Console(file=buf, width=width, highlight=False))
    return buf.getvalue().splitlines()


@pytest.mark.parametrize(("width", "long_node"), [(WIDTH, "grpo_reasoning_with_a_much_longer_node_name_x"),
                                                 (80, "grpo_reasoning")])
def test_end_of_run_fits_the_width_without_cutting_a_cell(width, long_node):
    lines = _render(_result(long_node), width)
    assert [line for line in lines if len(line.rstrip()) > width and " " in line.strip()] == []
    text = "\n".join(lines)
    assert "…" not in text  # nothing truncated
    assert long_node in text  # whole, on one line
    start = next(i for i, line in enumerate(lines) if line.startswith("model comparison"))
    # every eval in plan order, its model, the accuracy with its interval in one cell, and n
    current = [line.split()[:2] for line in lines[start:] if line.strip().startswith("eval_")]
    assert current == [[ev, model] for ev, model in EVALUATED.items()]
    for line in lines[start:]:
        if line.strip().startswith(("eval_", "↳")):
            assert ACCURACY.search(line) and re.search(r"\]\s+288\b", line), line
    # the previous run's row right under the row of its eval node
    labels = [line.split()[0] for line in lines[start:] if line.strip().startswith(("eval_", "↳"))]
    assert labels[labels.index("eval_dpo") + 1] == "↳" and labels[labels.index("eval_student") + 1] == "↳"
    assert sum(1 for label in labels if label == "↳") == 2
    assert "previous (run 01234567)" in text
    # then the report, the UI command and the parent run's URL, each path/URL alone on its line
    tail = [line for line in lines if line.strip()]
    assert tail[-1] == f"http://127.0.0.1:5000/#/experiments/1/runs/{'9' * 32}?workflowType=machine_learning"
    assert tail[-3].endswith("r1flow ui")
    assert "/h/mlartifacts/9/artifacts/report/report.md" in lines
    assert "  beside it: comparison.csv, comparison.json, 2 PNG plots" in lines


def test_a_wide_terminal_shows_the_contamination_column():
    """The held-out prompts found in each model's training data, after the format rate: 0 for a clean eval, count and
    share (and `contaminated` past its threshold) for one that is not; — for a row from before the check."""
    result = _result()
    rows = result["comparison"]["rows"]
    rows[1].update({"contamination/prompts": 3.0, "contamination/share": 3 / 288, "contaminated": 1.0})
    for previous in result["comparison"]["previous"]["rows"]:
        for key in ("contamination/prompts", "contamination/share", "contaminated"):
            del previous[key]
    lines = _render(result, 220)
    start = next(i for i, line in enumerate(lines) if line.startswith("model comparison"))
    header = next(line for line in lines[start:] if line.strip().startswith("eval "))
    end = header.index("contaminated") + len("contaminated")  # a right-justified column ends there
    cells = {line.split()[0]: line[end - 21:end].split() for line in lines[start:]
             if line.strip().startswith(("eval_", "↳"))}
    assert cells[rows[0]["eval"]] == ["0"] and cells[rows[1]["eval"]] == ["3", "(1.0%)", "contaminated"]
    assert cells["↳"] == ["—"]


def test_a_tracking_server_gets_its_url_and_no_ui_command():
    result = _result()
    result["link"] = f"http://127.0.0.1:5555/#/experiments/1/runs/{'9' * 32}?workflowType=machine_learning"
    page = f"http://127.0.0.1:5555/#/experiments/1/runs/{'9' * 32}/artifacts/report/report.md?workflowType=machine_learning"
    result["report"] = {"uri": f"mlflow-artifacts:/1/{'9' * 32}/artifacts/report/report.md", "path": None, "url": page,
                        "files": []}
    lines = [line for line in _render(result, WIDTH) if line.strip()]
    assert lines[-1] == result["link"]
    assert not any(line.endswith(" ui") for line in lines)
    # the report as a page that opens (issue 59), not its mlflow-artifacts: URI, which nothing opens
    assert page in lines and not any("mlflow-artifacts:" in line for line in lines)


def test_a_run_without_evals_says_so():
    result = {**_result(), "comparison": None}
    assert any("model comparison: none" in line for line in _render(result, WIDTH))


def test_stages_that_overlapped_get_no_negative_start_up_overhead():
    """23 stages of 12.5 s summed (287.5 s) within a 300 s run whose flow took 290 s: 12.5 s of overhead. Run side by
    side, the same stages take 140 s of the flow: no overhead can be told apart, and none is printed below 0."""
    def timing(result, total):
        buf = io.StringIO()
        print_summary(result, total=total, before_flow=10.0, console=Console(file=buf, width=200, highlight=False))
        return next(line for line in buf.getvalue().splitlines() if line.startswith("stage work"))

    assert timing(_result(), 300.0) == ("stage work 287.5 s; fixed start-up overhead 12.5 s (imports and validation "
                                        "10.0 s, the rest Prefect/MLflow); total 300.0 s")
    assert timing(_result(), 150.0) == ("stage work 287.5 s, summed over stages that ran side by side within the "
                                        "flow's 140.0 s; imports and validation 10.0 s; total 150.0 s")


def test_a_resumed_stage_shows_its_steps_and_where_it_resumed():
    """An sft of 400 steps resumed at step 120 trained 280 here: the table says steps=400, resumed_from_step=120 (not
    trained_steps=280, which reads as a short stage); from step 0 it says steps=400 alone."""
    result = _result()
    result["stages"] = [{**result["stages"][1], "node": "sft", "stage": "sft", "status": "run",
                         "metrics": {"final_loss": 2.5, "steps": 400.0, "trained_steps": 280.0,
                                     "resumed_from_step": 120.0}},
                        {**result["stages"][1], "node": "sft_fresh", "stage": "sft", "status": "run",
                         "metrics": {"final_loss": 2.5, "steps": 400.0, "trained_steps": 400.0,
                                     "resumed_from_step": 0.0}}]
    lines = _render(result, 200)
    assert "final_loss=2.500, steps=400, resumed_from_step=120" in next(x for x in lines if x.strip().startswith("sft "))
    fresh = next(x for x in lines if x.strip().startswith("sft_fresh"))
    assert "final_loss=2.500, steps=400" in fresh and "resumed" not in fresh and "trained_steps" not in fresh


# ---------------------------------------------------------------------------- r1flow ui
@pytest.mark.slow
def test_r1flow_ui_serves_this_homes_runs_on_127_0_0_1_until_sigint(tmp_path):
    from mlflow.tracking import MlflowClient

    home = tmp_path / "home"
    home.mkdir()
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    run = client.create_run(client.create_experiment("r1flow/ui-test", artifact_location=str(home / "mlartifacts")))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], cwd=tmp_path,
                            env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        # the experiment's runs table (the list's links open MLflow 3's GenAI view)
        pattern = re.compile("r1flow/ui-test: " + re.escape(url) + r"/#/experiments/\d+/runs\?workflowType=machine_learning")
        lines = read_until(proc, pattern.fullmatch, 180, f"a line matching {pattern.pattern}")
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert r.status == 200
        api = f"{url}/ajax-api/2.0/mlflow/runs/get?run_id={run.info.run_id}"
        with urllib.request.urlopen(api, timeout=30) as r:  # this home's store, not another
            assert json.loads(r.read())["run"]["info"]["run_id"] == run.info.run_id
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert any(str(home) in line for line in lines)
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # the server is gone with it
        s.connect(("127.0.0.1", port))


def test_r1flow_ui_with_a_tracking_server_prints_its_url(monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert main(["ui"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "http://127.0.0.1:9/#/experiments?workflowType=machine_learning" in out


def test_r1flow_ui_without_runs_says_what_to_do(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["ui"]) == 2
    assert "nothing has run with R1FLOW_HOME=" in capsys.readouterr().err
    assert not (tmp_path / "empty" / "mlflow.db").exists()


# ---------------------------------------------------------------------------- small defects
@pytest.mark.parametrize("args", [["stages", "-v"], ["recipes"]])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path, args):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails (EPIPE)
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=_env(tmp_path / "home"),
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr


def test_stages_v_piped_to_head_prints_its_first_line_and_no_traceback(tmp_path):
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m flows.cli stages -v | head -1"], cwd=ROOT,
                          env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("import_model (v") and proc.stdout.count("\n") == 1
    assert proc.stderr == ""


def _publish(store: ArtifactStore, node: str, kind: str, schema: str, content: str, **kw):
    d = store.new_staging_dir()
    (d / "f.txt").write_text(content)
    return store.publish(d, kind=kind, schema=schema, parents=[],
                         producer=Producer(stage="sft", node=node, stage_version="1", config_hash="h"), **kw)


def test_models_names_an_adapters_base_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    store = ArtifactStore(str(tmp_path), home=str(tmp_path))
    base = _publish(store, "base", "model", "model", "weights")
    adapter = _publish(store, "sft", "model", "adapter", "lora", extra={"base_fingerprint": base.fingerprint})
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith(adapter.fingerprint[:12]))
    assert f"adapter on base model {base.fingerprint[:12]} from node sft" in line
    assert "adapter adapter" not in out


def test_artifacts_columns_stay_aligned_with_a_long_node_name(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    store = ArtifactStore(str(tmp_path), home=str(tmp_path))
    long_node = "preference_optimization_with_a_very_long_node_name_indeed"
    _publish(store, long_node, "dataset", "preferences", "a", rows=123456)
    _publish(store, "sft", "model", "model", "b")
    assert main(["artifacts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0], lines[1:3]
    assert header.split() == ["fingerprint", "kind", "schema", "rows", "created", "node"]
    for column in ("kind", "schema", "created", "node"):  # each column starts at the same offset on every line
        at = header.index(column)
        assert all(row[at - 1] == " " and row[at] != " " for row in rows), (column, lines)
    assert rows[0].endswith(long_node) or rows[1].endswith(long_node)


@pytest.mark.parametrize(("key", "hint"), [("sft.learnin_rate", "learning_rate"), ("sft.lora.alph", "alpha")])
def test_an_unknown_config_key_suggests_the_closest_field(key, hint):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: unknown key \(did you mean {hint}\?\)"):
        load_plan("r1", "tiny", [f"{key}=1"])


def test_the_cli_and_a_single_stage_run_say_did_you_mean(capsys):
    assert main(["run", "--profile", "tiny", "--set", "sft.learnin_rate=1"]) == 2
    assert "sft.learnin_rate: unknown key (did you mean learning_rate?)" in capsys.readouterr().err
    assert main(["stage", "sft", "--set", "learnin_rate=1"]) == 2
    assert "sft.learnin_rate: unknown key (did you mean learning_rate?)" in capsys.readouterr().err


PREFECT_TIMEOUT_ERROR = ("Timed out while attempting to connect to ephemeral Prefect API server. Ephemeral server "
                         "process exited with code 3. stdout: INFO:     Started server process [4242]\nINFO: ... "
                         "stderr: Traceback (most recent call last):\n  File \"uvicorn\", line 1\nOSError: boom")


def test_a_prefect_start_timeout_reads_as_one_line_with_its_exit_code():
    line = prefect_start_failure(RuntimeError(PREFECT_TIMEOUT_ERROR), "90")
    assert line == ("r1flow: error: the temporary Prefect server did not answer within 90 s (its process exited with "
                    "code 3); on a busy machine raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or start the "
                    "servers once with `r1flow up`")
    try:  # found as the cause of what the flow call raised
        try:
            raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert prefect_start_failure(outer, None) == (
            "r1flow: error: the temporary Prefect server did not answer; on a busy machine raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or start the servers once with `r1flow up`")
    assert prefect_start_failure(RuntimeError("Timed out reading a file"), "90") is None
    assert prefect_start_failure(OSError(PREFECT_TIMEOUT_ERROR), "90") is None


def test_the_cli_prints_a_prefect_start_timeout_as_its_one_line_and_other_errors_with_their_traceback(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

    def timed_out(args):
        raise RuntimeError(PREFECT_TIMEOUT_ERROR)

    monkeypatch.setattr("flows.cli.app.cmd_stages", timed_out)
    assert main(["stages"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [prefect_start_failure(RuntimeError(PREFECT_TIMEOUT_ERROR), "90")]
    assert "Traceback" not in err and "uvicorn" not in err

    def other(args):
        raise RuntimeError("something else")

    monkeypatch.setattr("flows.cli.app.cmd_stages", other)
    with pytest.raises(RuntimeError, match="something else"):
        main(["stages"])
