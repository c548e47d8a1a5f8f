"""The pipeline end to end through the CLI on the tiny profile: Prefect (one test server for the
module), MLflow (sqlite), caching, selective re-runs, artifact loss, one-line errors."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from flows.cli.app import main
from tests.conftest import harness_home

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    import flows.run.pipeline  # noqa: F401  (Prefect configures logging once, on import: before caplog sets a level)

    with harness_home(tmp_path_factory.mktemp("flow-home")) as path:
        yield path


def node_lines(caplog) -> list[str]:
    """The per-node lines of the run (pipeline.NodeProgress, INFO on the flow run's logger; the tests run Prefect at
    WARNING, so each test that reads them sets INFO there)."""
    return [r.getMessage() for r in caplog.records if r.name == "prefect.flow_runs" and r.getMessage().startswith("[")]


def run(home: Path, *args: str) -> dict:
    out = home / "last-run.json"
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--json", str(out), *args]) == 0
    result = json.loads(out.read_text())
    return result


def statuses(result: dict) -> dict[str, str]:
    return {s["node"]: s["status"] for s in result["stages"]}


def test_first_run_runs_every_stage_and_tracks_it(home, caplog, recwarn):
    from mlflow.tracking import MlflowClient

    caplog.set_level(logging.INFO, logger="prefect.flow_runs")
    result = run(home)
    assert statuses(result) == dict.fromkeys(["base", "prompts", "sft", "eval_base", "eval_sft"], "run")
    # none of our calls into transformers is deprecated (the stages one by one: tests/test_progress.py)
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
    lines = node_lines(caplog)  # each node's start and end line, once each
    nodes = [("base", "import_model"), ("prompts", "prompts"), ("sft", "sft"), ("eval_base", "eval"),
             ("eval_sft", "eval")]
    assert len(lines) == 2 * len(nodes), lines
    for i, (node, stage) in enumerate(nodes):
        assert lines[2 * i].startswith(f"[{i + 1}/5] {node} ({stage}) ... (elapsed ")
        assert lines[2 * i + 1].startswith(f"[{i + 1}/5] {node} ({stage}) run in ")
    assert lines[-1].endswith("; 5 run, 0 cached)")
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["recipe"] == "sft-eval"
    assert "sft/final_loss" in parent.data.metrics and "eval_sft/accuracy" in parent.data.metrics
    children = client.search_runs([result["experiment_id"]],
                                  f"tags.mlflow.parentRunId = '{result['parent_run_id']}'")
    by_node = {r.data.tags["r1flow.node"]: r for r in children}
    assert set(by_node) == {"base", "prompts", "sft", "eval_base", "eval_sft"}
    for node, r in by_node.items():
        assert r.info.status == "FINISHED" and r.data.tags["r1flow.cache_hit"] == "false"
        assert any(k.startswith("config.") for k in r.data.params), node
        assert "stage_seconds" in r.data.metrics
        arts = [a.path for a in client.list_artifacts(r.info.run_id, "outputs")]
        assert arts, node
    sft = by_node["sft"]
    assert sft.data.params["config.learning_rate"] == "0.003"
    assert len(client.get_metric_history(sft.info.run_id, "train/loss")) == 120
    assert client.list_artifacts(by_node["eval_sft"].info.run_id, "outputs/results")  # eval data logged
    results_fp = next(s for s in result["stages"] if s["node"] == "eval_sft")["outputs"]["results"]
    manifest = json.loads((home / "artifacts" / results_fp / "manifest.json").read_text())
    assert manifest["schema"] == "eval" and manifest["producer"]["node"] == "eval_sft"
    assert "accuracy" in manifest["metrics"] and manifest["parents"]
    # the run report (MLflow and Prefect) and the model registry (flows/report/report.py, flows/report/registry.py)
    report = {a.path for a in client.list_artifacts(result["parent_run_id"], "report")}
    assert report == {"report/report.md", "report/training_loss.png", "report/eval.png", "report/train_sft.png",
                      "report/comparison.json", "report/comparison.csv"}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect_client:
        # a raw filter: the client sends nulls for unset filters, which this server refuses (422), and
        # an empty task-run filter would exclude flow-level artifacts
        artifacts = prefect_client.request("POST", "/artifacts/filter", json={"artifacts": {
            "key": {"any_": ["r1flow-report-sft-eval"]}, "flow_run_id": {"any_": [result["flow_run_id"]]}}}).json()
    assert len(artifacts) == 1 and re.search(r"\| eval_sft \(eval\) \| \[[0-9a-f]{8}\]\([^)]*\) \| run \|",
                                             artifacts[0]["data"]), artifacts[0]["data"][-3000:]
    final = client.get_model_version_by_alias("r1flow-sft-eval", "final")
    sft_fp = next(s for s in result["stages"] if s["node"] == "sft")["outputs"]["model"]
    assert final.tags["r1flow.node"] == "sft" and final.tags["r1flow.fingerprint"] == sft_fp
    assert client.get_model_version_by_alias("r1flow-sft-eval", "champion").tags["r1flow.node"] in ("base", "sft")
    # decontamination: eval_sft checked its 16 held-out prompts against the prompts' train split (sft's data, the
    # one dataset among its model's ancestors) and found none; the base model has no ancestors to check
    rows = {r["eval"]: r for r in result["comparison"]["rows"]}
    assert [(rows[e]["contamination/prompts"], rows[e]["contaminated"]) for e in ("eval_base", "eval_sft")] == [
        (0.0, 0.0), (0.0, 0.0)]
    assert by_node["eval_sft"].data.metrics["contamination/datasets"] == 1.0
    assert by_node["eval_base"].data.metrics["contamination/datasets"] == 0.0
    prompts_fp = next(s for s in result["stages"] if s["node"] == "prompts")["outputs"]["prompts"]
    assert by_node["eval_sft"].data.tags[f"r1flow.input.lineage.{prompts_fp[:12]}"] == prompts_fp
    assert "contaminated ‡" in artifacts[0]["data"]


def test_second_run_is_fully_cached(home, caplog):
    from mlflow.tracking import MlflowClient

    caplog.set_level(logging.INFO, logger="prefect.flow_runs")
    result = run(home)
    assert set(statuses(result).values()) == {"cached"}
    lines = node_lines(caplog)  # an end line per node, no start lines
    assert [line.split(" in ")[0] for line in lines] == [f"[{i}/5] {n} cached" for i, n in enumerate(
        ["base (import_model)", "prompts (prompts)", "sft (sft)", "eval_base (eval)", "eval_sft (eval)"], 1)]
    assert lines[-1].endswith("; 0 run, 5 cached)")
    assert {s["prefect_state"] for s in result["stages"]} == {"Cached"}
    assert sum(s["seconds"] for s in result["stages"]) < 15
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    assert len(client.search_model_versions("name='r1flow-sft-eval'")) == 2  # base and sft: no new versions
    assert client.list_artifacts(result["parent_run_id"], "report")


def run_graph(flow_run_id: str) -> dict[str, dict[str, set[str]]]:
    """What Prefect's run graph draws for a flow run (`/flow_runs/<id>/graph-v2`, the UI's source): each task run's
    upstream task runs, by name; and the task runs' recorded `task_inputs`, by parameter, as names."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        graph = client.request("GET", f"/flow_runs/{flow_run_id}/graph-v2").json()
        task_runs = client.request("POST", "/task_runs/filter",
                                   json={"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()
    names = {node_id: node["label"] for node_id, node in graph["nodes"]}
    drawn = {node["label"]: {names[p["id"]] for p in node["parents"]} for _, node in graph["nodes"]}
    recorded = {r["name"]: {k: {names[i["id"]] for i in v} for k, v in r["task_inputs"].items() if v}
                for r in task_runs}
    return {"drawn": drawn, "recorded": recorded}


@pytest.mark.parametrize("parallel", [[], ["--parallel", "2"]], ids=["in-order", "parallel"])
def test_the_run_graph_is_the_recipes_dag(home, parallel):
    """Issue 59 item 6: Prefect's run graph of a sft-eval run is the recipe's DAG: each stage's task run records
    its upstream nodes' task runs under its `inputs` parameter, and nothing else (before, nothing was recorded
    but a false edge: Prefect links a task's result to its run by id(), and a later task's config dict reused
    the address of sft's freed result, so eval_base drew sft -> eval_base under `config`). In order and with
    --parallel (a task runner), cached or not."""
    result = run(home, *parallel)
    graph = run_graph(result["flow_run_id"])
    dag = {"base": set(), "prompts": set(), "sft": {"base", "prompts"}, "eval_base": {"base", "prompts"},
           "eval_sft": {"sft", "prompts"}}
    assert graph["drawn"] == dag, graph
    assert graph["recorded"] == {node: {"inputs": ups} if ups else {} for node, ups in dag.items()}, graph


def test_changing_sft_learning_rate_reruns_sft_and_its_eval_only(home):
    result = run(home, "--set", "sft.learning_rate=1e-3")
    assert statuses(result) == {"base": "cached", "prompts": "cached", "sft": "run", "eval_base": "cached",
                                "eval_sft": "run"}


def test_sft_data_holding_held_out_prompts_shows_them_as_contaminated(home, tmp_path, capsys):
    """Issue 63 item 1, through the CLI: a user's prompt file puts "What is 17 + 25?" (answer 42) in both splits, so
    sft's data (the train split's gold answers) holds a held-out prompt with its answer. eval_sft finds it (exact
    question, answer leaked) among its 4 held-out prompts: 1, 25%, contaminated (threshold 0), in its MLflow run and
    the report's column (the clean default: the first test). With fail_on_contamination the eval stops, one line.
    Cheap: sft trains 2 steps, eval_sft samples no pass@k (the check needs no trained model), eval_base is left out
    (--only; base is cached)."""
    from mlflow.tracking import MlflowClient

    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "leak-train", "question": "What is 17 + 25?", "answer": "42", "split": "train"},
        {"id": "leak-eval", "question": "What is 17 + 25?", "answer": "42", "split": "eval"},
        {"id": "clean-eval", "question": "What is 18 + 26?", "answer": "44", "split": "eval"}]))
    small = ["--set", f"prompts.files=[{mine}]", "--set", "sft.max_steps=2", "--set", "eval_sft.max_prompts=4",
             "--set", "eval_sft.pass_k=0"]
    result = run(home, *small, "--only", "prompts", "--only", "sft", "--only", "eval_sft")
    rows = {r["eval"]: r for r in result["comparison"]["rows"]}
    assert list(rows) == ["eval_sft"]
    assert (rows["eval_sft"]["contamination/prompts"], rows["eval_sft"]["contamination/share"],
            rows["eval_sft"]["contaminated"]) == (1.0, 0.25, 1.0)
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    sft_eval = client.get_run(rows["eval_sft"]["mlflow_run_id"]).data.metrics
    assert {k: sft_eval[k] for k in ("contamination/exact", "contamination/ngram", "contamination/answer_leak")} == {
        "contamination/exact": 1.0, "contamination/ngram": 0.0, "contamination/answer_leak": 1.0}
    manifest = json.loads((home / "artifacts" / rows["eval_sft"]["eval_fingerprint"] / "manifest.json").read_text())
    [example] = manifest["extra"]["contamination"]["examples"]
    assert example["prompt_id"] == "leak-eval" and set(example["matches"]) == {"exact", "answer_leak"}
    report = client.download_artifacts(result["parent_run_id"], "report/report.md", str(tmp_path))
    assert "| 1 (25.0%) contaminated |" in Path(report).read_text()
    capsys.readouterr()
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", *small, "--only", "eval_sft",
                 "--set", "eval_sft.fail_on_contamination=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval: 1 of 4 held-out prompts (25.0%) are in the model's training data" in err[0], err


def test_deleted_artifact_file_makes_its_stage_rerun(home, capsys, caplog):
    caplog.set_level(logging.INFO, logger="prefect.flow_runs")  # print() in the flow may become a log record
    first = run(home)
    prompts_fp = next(s for s in first["stages"] if s["node"] == "prompts")["outputs"]["prompts"]
    (home / "artifacts" / prompts_fp / "data.parquet").unlink()
    capsys.readouterr()
    result = run(home)
    st = statuses(result)
    assert st["prompts"] == "run"
    # prompts are deterministic: the same bytes come back, so everything downstream stays valid
    assert next(s for s in result["stages"] if s["node"] == "prompts")["outputs"]["prompts"] == prompts_fp
    assert st["sft"] == st["eval_sft"] == "cached"
    # issue 59 item 14: it was recomputed without a word; the line names the node, the output, the artifact and why
    said = capsys.readouterr().out + "\n".join(r.getMessage() for r in caplog.records)
    assert (f"r1flow: prompts: its cached output 'prompts' cannot be reused (artifact {prompts_fp[:12]}: file "
            "data.parquet is missing); computing prompts again") in said, said[-3000:]

    # an edited manifest field: not reused either, with its line (the fingerprint covers the files only)
    manifest = home / "artifacts" / prompts_fp / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"rows": ', '"rows": 1', 1))
    capsys.readouterr()
    assert statuses(run(home))["prompts"] == "run"
    said = capsys.readouterr().out + "\n".join(r.getMessage() for r in caplog.records)
    assert (f"r1flow: prompts: its cached output 'prompts' cannot be reused (artifact {prompts_fp[:12]}: "
            "manifest.json was edited after it was published") in said, said[-3000:]
    assert '"rows": 1' not in manifest.read_text()  # set aside and published again


def test_only_and_force(home):
    result = run(home, "--only", "eval_base", "--force", "eval_base")
    st = statuses(result)
    assert st["eval_base"] == "run"
    assert st["base"] == st["prompts"] == "cached"
    assert st["sft"] == st["eval_sft"] == "skipped"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--set", "sft.nope=1"], "sft.nope: unknown key"),
        (["--set", "sft.max_steps=zero"], "sft.max_steps: Input should be a valid integer"),
        (["--set", "sft.learning_rate=.inf"], "sft.learning_rate: Input should be a finite number"),
        (["--set", "sft.lora.alpha=.nan"], "sft.lora.alpha: Input should be a finite number"),
        (["--only", "dpo"], "has no stage node 'dpo'"),
        (["--profile", "huge"], "unknown profile 'huge'"),
    ],
)
def test_errors_are_one_line_before_any_compute(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "untouched"))
    argv = ["run", "--recipe", "sft-eval", "--profile", "tiny", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("r1flow: error:") and message in err[0], err
    assert not (tmp_path / "untouched").exists()  # nothing was computed or written


def test_bad_user_prompt_file_names_file_and_column(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "untouched"))
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--set", f"prompts.files=[{bad}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}: needs a 'question' or 'messages' column" in err and "\n" not in err


def _write_nan_answer_parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["2+2?", "3+3?"], "answer": [4.0, float("nan")]}), path)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("str.jsonl", json.dumps({"messages": "What is 2+2?", "answer": "4"}) + "\n",
         "line 1: column 'messages' must be a list of {role, content} objects, got text"),
        ("role.jsonl", json.dumps({"messages": [{"role": "human", "content": "2+2?"}], "answer": "4"}) + "\n",
         "line 1: column 'messages'[0]: role 'human' unknown"),
        # issue 59 item 13: the line, not pyarrow's byte position; the type, not "empty"; lines and rows from 1
        ("latin1.jsonl", b'{"question": "2+2?", "answer": "4"}\n{"question": "caf\xe9?", "answer": "4"}\n',
         "line 2: not UTF-8 text (byte 0xe9 at byte 18 of the line)"),
        ("int.jsonl", json.dumps({"question": 5, "answer": "4"}) + "\n",
         "line 1: column 'question' must be text, got a number: 5"),
        ("nan.parquet", None, "row 2: column 'answer' is nan"),
    ],
)
def test_malformed_user_prompts_are_one_error_line_naming_file_and_row(name, content, message, capsys, tmp_path,
                                                                      monkeypatch):
    bad = tmp_path / name
    if content is None:
        _write_nan_answer_parquet(bad)
    elif isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "untouched"))
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--set", f"prompts.files=[{bad}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"r1flow: error: {bad}") and message in err and "\n" not in err, err
    assert not (tmp_path / "untouched").exists()


def test_only_without_cached_upstream_is_a_clear_error(home, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("R1FLOW_HOME", str(tmp_path / "fresh"))
    assert main(["run", "--recipe", "sft-eval", "--profile", "tiny", "--only", "eval_sft"]) == 2
    err = capsys.readouterr().err
    assert "upstream node 'base' has no valid cached outputs" in err


def test_rlhf_recipe_end_to_end_then_cached(home):
    """prompts → sft → rejection_sampling → preference_data → reward_model (+ eval); the nodes it
    shares with sft-eval (same stage, config, inputs, seed) are reused from the runs above."""
    out = home / "rlhf.json"
    assert main(["run", "--recipe", "rlhf", "--profile", "tiny", "--json", str(out)]) == 0
    first = json.loads(out.read_text())
    st = statuses(first)
    assert st["base"] == st["prompts"] == st["sft"] == st["eval_sft"] == "cached"
    assert st["rejection_sampling"] == st["preference_data"] == st["reward_model"] == "run"
    assert st["dpo_reference"] == st["dpo"] == st["eval_dpo"] == "run"
    by_node = {s["node"]: s for s in first["stages"]}
    assert 0 <= by_node["dpo"]["metrics"]["eval_accuracy"] <= 1 and "eval_kl" in by_node["dpo"]["metrics"]
    assert by_node["preference_data"]["metrics"]["pairs"] > 0
    assert 0 <= by_node["reward_model"]["metrics"]["eval_accuracy"] <= 1
    assert 0 < by_node["rejection_sampling"]["metrics"]["acceptance_rate"] <= 1
    assert main(["run", "--recipe", "rlhf", "--profile", "tiny", "--json", str(out)]) == 0
    assert set(statuses(json.loads(out.read_text())).values()) == {"cached"}

    # another loss and beta: only dpo and its eval re-run; the reference log-probs come from the cache
    assert main(["run", "--recipe", "rlhf", "--profile", "tiny", "--set", "dpo.loss=ipo", "--set", "dpo.beta=0.2",
                 "--json", str(out)]) == 0
    again = json.loads(out.read_text())
    st = statuses(again)
    assert {n for n, s in st.items() if s == "run"} == {"dpo", "eval_dpo"}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    runs = {r.data.tags["r1flow.node"]: r for r in client.search_runs(
        [again["experiment_id"]], f"tags.mlflow.parentRunId = '{again['parent_run_id']}'")}
    ref_run = runs["dpo_reference"]
    assert ref_run.data.tags["r1flow.cache_hit"] == "true"
    ref_fp = ref_run.data.tags["r1flow.output.logprobs"]
    assert runs["dpo"].data.tags["r1flow.input.reference"] == ref_fp
    assert runs["dpo"].data.params["config.loss"] == "ipo" and runs["dpo"].data.params["reference"] == "cached"


def test_artifacts_and_models_commands(home, capsys):
    assert main(["artifacts"]) == 0
    out = capsys.readouterr().out
    assert "prompts" in out and "eval" in out and "artifact(s)" in out
    fp = out.splitlines()[1].split()[0]
    assert main(["artifacts", fp, "--verify"]) == 0
    assert "verified: all files match" in capsys.readouterr().out
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "model artifacts" in out
    assert main(["stages", "-v"]) == 0
    assert "learning_rate" in capsys.readouterr().out
