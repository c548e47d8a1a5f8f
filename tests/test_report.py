"""Run reports (markdown + PNG plots, published to MLflow and Prefect) and the model registry
scheme, on fake stage results against a real sqlite MLflow store."""

from __future__ import annotations

import dataclasses

import pytest

from flows.pipeline import StageResult
from flows.recipes import load_plan
from flows.report import (
    CHAMPION_ALIAS,
    FINAL_ALIAS,
    artifact_key,
    build_report,
    evaluated_models,
    final_model_nodes,
    publish_report,
    register_models,
    registered_model_name,
)
from flows.store import ArtifactStore
from flows.tracking import Tracker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("report-mlflow")  # one sqlite store: creating one costs seconds


@pytest.fixture()
def tracker(db, request):
    return Tracker(f"sqlite:///{db}/mlflow.db", f"r1flow/{request.node.name}", str(db / "mlartifacts"))


def plan_named(recipe: str, name: str):
    """A tiny plan of `recipe` under another name: its own registered model in the shared store."""
    return dataclasses.replace(load_plan(recipe, "tiny"), recipe=name)


def stage_run(tracker: Tracker, parent: str, node: str, curves: dict[str, list[float]] | None = None,
              metrics: dict[str, float] | None = None) -> str:
    run_id = tracker.start_run(node, {"r1flow.node": node, "r1flow.cache_hit": "false"}, parent)
    for key, values in (curves or {}).items():
        for step, v in enumerate(values, 1):
            tracker.log_metrics(run_id, {key: v}, step=step)
    tracker.log_metrics(run_id, metrics or {})
    tracker.end(run_id)
    return run_id


def cache_hit_run(tracker: Tracker, parent: str, node: str, source: str, metrics: dict[str, float]) -> str:
    run_id = tracker.start_run(node, {"r1flow.node": node, "r1flow.cache_hit": "true",
                                      "r1flow.source_run_id": source}, parent)
    tracker.log_metrics(run_id, metrics)
    tracker.end(run_id)
    return run_id


def fp(name: str) -> str:
    return (name.encode().hex() * 64)[:64]


def sft_eval_results(tracker: Tracker, parent: str, *, sft_fp: str = "sft-1", acc_base: float = 0.25,
                     acc_sft: float = 0.5, loss: list[float] | None = (2.0, 1.5, 1.2, 1.0)) -> list[StageResult]:
    """A first run of sft-eval: every stage ran; sft logged a loss curve (unless loss is None)."""
    ev = {"eval_base": {"accuracy": acc_base, "format_rate": 0.1}, "eval_sft": {"accuracy": acc_sft, "format_rate": 0.9}}
    out = []
    for node, stage, outputs in [("base", "import_model", {"model": fp("base")}),
                                 ("prompts", "prompts", {"prompts": fp("prompts")}),
                                 ("sft", "sft", {"model": fp(sft_fp)}),
                                 ("eval_base", "eval", {"results": fp("eval_base" + sft_fp)}),
                                 ("eval_sft", "eval", {"results": fp("eval_sft" + sft_fp)})]:
        metrics = ev.get(node, {"final_loss": 1.0} if node == "sft" else {})
        curves = {"train/loss": list(loss)} if node == "sft" and loss else None
        run_id = stage_run(tracker, parent, node, curves, metrics)
        out.append(StageResult(node, stage, "run", 1.5, "Completed", outputs, metrics, run_id))
    return out


def cached_rerun(tracker: Tracker, parent: str, first: list[StageResult]) -> list[StageResult]:
    """What run_plan returns for a fully cached re-run: fresh cache-hit runs naming their sources."""
    return [StageResult(r.node, r.stage, "cached", 0.01, "Cached", r.outputs, r.metrics,
                        cache_hit_run(tracker, parent, r.node, r.mlflow_run_id, r.metrics)) for r in first]


def table_rows(markdown: str) -> dict[str, list[str]]:
    """The stage table (the first table) by node."""
    rows = {}
    for line in markdown.split("\n## ")[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("stage", "---"):
            rows[cells[0]] = cells
    return rows


def test_report_has_one_row_per_stage_with_status_and_link_and_plots_with_data(tracker):
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    results = sft_eval_results(tracker, parent)
    report = build_report(plan, results, tracker, parent)
    rows = table_rows(report.markdown)
    assert set(rows) == {"base", "prompts", "sft", "eval_base", "eval_sft"}
    for r in results:
        assert rows[r.node][2] == "run"
        assert f"(#/experiments/{tracker.experiment_id}/runs/{r.mlflow_run_id})" in rows[r.node][5]
    assert "final_loss=1" in rows["sft"][4] and "accuracy=0.500" in rows["eval_sft"][4]
    assert "mlflow ui --backend-store-uri" in report.markdown  # local store: how to open the links
    assert "| eval_sft | sft | 0.500 | 0.900 |" in report.markdown  # evaluation table names the model
    names = [n for n, _ in report.images]
    assert names == ["training_loss.png", "eval.png"]  # no GRPO stage: no GRPO plot
    assert all(png.startswith(PNG_MAGIC) and len(png) > 1000 for _, png in report.images)
    assert report.key == "r1flow-report-sft-eval"


def test_cached_stage_links_its_source_run_and_plots_its_curves(tracker):
    plan = load_plan("sft-eval", "tiny")
    first = sft_eval_results(tracker, tracker.start_run("parent-1", {}))
    parent = tracker.start_run("parent-2", {})
    report = build_report(plan, cached_rerun(tracker, parent, first), tracker, parent)
    rows = table_rows(report.markdown)
    assert {cells[2] for cells in rows.values()} == {"cached"}
    sft_source = next(r.mlflow_run_id for r in first if r.node == "sft")
    assert f"produced by [{sft_source[:8]}]" in rows["sft"][5]
    assert [n for n, _ in report.images] == ["training_loss.png", "eval.png"]  # curves read from the source run


def test_plots_only_when_there_is_data(tracker):
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    results = sft_eval_results(tracker, parent, loss=None)
    for r in results:  # --only prompts: the rest skipped
        if r.node not in ("base", "prompts"):
            r.status, r.outputs, r.metrics, r.mlflow_run_id = "skipped", {}, {}, None
    report = build_report(plan, results, tracker, parent)
    assert report.images == []
    assert "No training curves or eval results" in report.markdown
    assert table_rows(report.markdown)["sft"][2:6:3] == ["skipped", "—"]


def test_grpo_plot_has_reward_and_length(tracker):
    plan = load_plan("r1-zero", "tiny")
    parent = tracker.start_run("parent", {})
    grpo = stage_run(tracker, parent, "grpo", {"reward/mean": [0.1, 0.3, 0.4], "completion/mean_length": [50, 40, 30],
                                               "train/loss": [0.01, -0.02, 0.0]}, {"reward_first": 0.1})
    results = [StageResult("grpo", "grpo", "run", 3.0, "Completed", {"model": fp("g")}, {"reward_first": 0.1}, grpo)]
    report = build_report(plan, results, tracker, parent)
    assert [n for n, _ in report.images] == ["training_loss.png", "grpo.png"]
    assert "grpo.png" in report.markdown


def test_publish_logs_report_and_pngs_to_mlflow_outside_prefect(tracker, tmp_path):
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    report = build_report(plan, sft_eval_results(tracker, parent), tracker, parent)
    out = publish_report(report, tracker, parent)
    assert out["prefect_artifact_id"] is None  # not inside a flow run
    logged = {a.path for a in tracker.client.list_artifacts(parent, "report")}
    assert logged == {"report/report.md", "report/training_loss.png", "report/eval.png"}
    path = tracker.client.download_artifacts(parent, "report/eval.png", str(tmp_path))
    assert open(path, "rb").read().startswith(PNG_MAGIC)


def test_prefect_artifact_failure_only_warns(tracker, monkeypatch, caplog):
    import prefect.artifacts

    import flows.report as report_mod

    def boom(**kwargs):
        raise RuntimeError("api down")

    monkeypatch.setattr(report_mod, "_in_prefect_run", lambda: True)
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", boom)
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    report = build_report(plan, sft_eval_results(tracker, parent, loss=None), tracker, parent)
    with caplog.at_level("WARNING", logger="r1flow"):
        out = publish_report(report, tracker, parent)
    assert out["prefect_artifact_id"] is None and "api down" in caplog.text
    assert tracker.client.list_artifacts(parent, "report")


def test_names_and_keys_are_sanitised():
    assert artifact_key("My Recipe_v2") == "r1flow-report-my-recipe-v2"
    assert registered_model_name("r1-zero") == "r1flow-r1-zero"


@pytest.mark.parametrize("recipe, finals", [("sft-eval", ["sft"]), ("rlhf", ["reward_model", "dpo"]),
                                             ("rejection-rounds", ["sft_round2"]), ("r1-zero", ["grpo"]),
                                             ("eval", ["base"])])
def test_final_model_nodes(recipe, finals):
    assert final_model_nodes(load_plan(recipe, "tiny")) == finals


def test_registry_versions_aliases_and_cached_rerun(tracker, tmp_path):
    plan = plan_named("sft-eval", "sft-eval-a")
    assert evaluated_models(plan) == {"eval_base": ("base", "model"), "eval_sft": ("sft", "model")}
    store = ArtifactStore(tmp_path / "store")
    client, name = tracker.client, "r1flow-sft-eval-a"

    first = sft_eval_results(tracker, tracker.start_run("p1", {}), acc_base=0.25, acc_sft=0.5)
    reg = register_models(plan, first, tracker, store=store)
    assert reg.name == name and reg.versions == {"base.model": "1", "sft.model": "2"} and reg.created == ["1", "2"]
    final = client.get_model_version_by_alias(name, FINAL_ALIAS)
    assert str(final.version) == "2" and final.tags["r1flow.node"] == "sft" and final.tags["r1flow.final"] == "true"
    assert final.tags["r1flow.fingerprint"] == fp("sft-1")
    assert final.source == str((tmp_path / "store" / "artifacts" / fp("sft-1")).resolve())
    assert final.run_id == next(r.mlflow_run_id for r in first if r.node == "sft")
    assert final.tags["r1flow.eval.eval_sft.accuracy"] == "0.5"
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == "2"

    # a fully cached re-run: same fingerprints, no new versions
    p2 = tracker.start_run("p2", {})
    reg = register_models(plan, cached_rerun(tracker, p2, first), tracker, store=store)
    assert reg.created == [] and reg.versions == {"base.model": "1", "sft.model": "2"}
    assert len(client.search_model_versions(f"name='{name}'")) == 2
    assert "version 2 (@final, @champion)" in build_report(plan, first, tracker, p2, reg).markdown

    # a new sft that evaluates worse than the base: one new version, final moves, champion is the base
    second = sft_eval_results(tracker, tracker.start_run("p3", {}), sft_fp="sft-2", acc_base=0.25, acc_sft=0.1)
    reg = register_models(plan, second, tracker, store=store)
    assert reg.created == ["3"] and reg.aliases == {FINAL_ALIAS: "3", CHAMPION_ALIAS: "1"}
    assert str(client.get_model_version_by_alias(name, FINAL_ALIAS).version) == "3"
    champion = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert str(champion.version) == "1" and champion.tags["r1flow.node"] == "base"
    assert len(client.search_model_versions(f"name='{name}'")) == 3


def test_registry_skips_skipped_nodes_and_keeps_aliases(tracker, tmp_path):
    plan = plan_named("sft-eval", "sft-eval-b")
    first = sft_eval_results(tracker, tracker.start_run("p1", {}))
    register_models(plan, first, tracker)
    only_base = [r if r.node in ("base", "prompts", "eval_base") else
                 StageResult(r.node, r.stage, "skipped", 0.0) for r in first]
    reg = register_models(plan, only_base, tracker)
    assert reg.versions == {"base.model": "1"} and reg.created == []
    assert reg.aliases == {}  # no final node ran, eval_sft did not: both aliases stay where they were
    for alias in (FINAL_ALIAS, CHAMPION_ALIAS):
        assert str(tracker.client.get_model_version_by_alias("r1flow-sft-eval-b", alias).version) == "2"
    nothing = [StageResult(r.node, r.stage, "skipped", 0.0) for r in first]
    assert register_models(plan, nothing, tracker) is None
