"""Run reports (markdown + PNG plots, published to MLflow and Prefect) and the model registry
scheme, on fake stage results against a real sqlite MLflow store."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from flows.plan.recipes import load_plan
from flows.plan.results import StageResult
from flows.report.comparison import comparison_rows, previous_comparison
from flows.report.plots import panel_figure, training_panels
from flows.report.registry import (
    CHAMPION_ALIAS,
    FINAL_ALIAS,
    evaluated_models,
    final_model_nodes,
    register_models,
    registered_model_name,
)
from flows.report.report import artifact_key, build_report, publish_report
from flows.report.tables import read_tables
from flows.store.artifacts import ArtifactStore
from flows.track.tracking import Tracker

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
    """A first run of sft-eval: every stage ran; sft logged a loss curve (unless loss is None).
    eval_sft logged its accuracy's interval (acc_sft ± 0.1) and eval size; eval_base did not, as an
    eval from before intervals."""
    ev = {"eval_base": {"accuracy": acc_base, "format_rate": 0.1},
          "eval_sft": {"accuracy": acc_sft, "accuracy_ci_low": acc_sft - 0.1, "accuracy_ci_high": acc_sft + 0.1,
                       "format_rate": 0.9, "prompts": 64.0, "contamination/prompts": 2.0,
                       "contamination/share": 2 / 64, "contaminated": 1.0}}
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
    """The stage table (the first table) by node: node, stage, status, seconds, key metrics (from the list under the
    table), MLflow run (whatever the column order of the table)."""
    rows, header = {}, None
    first = markdown.split("\n## ")[0]
    metrics = dict(line[2:].split(": ", 1) for line in first.split("Key metrics:")[1].splitlines() if line.startswith("- "))
    for line in first.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] == "---":
            continue
        if cells[0] == "stage (kind)":
            header = cells
            continue
        by = dict(zip(header, cells, strict=True))
        node, _, stage = by["stage (kind)"].partition(" (")
        rows[node] = [node, stage.rstrip(")"), by["status"], by["s"], metrics.get(node, ""), by["MLflow run"]]
    return rows


def test_the_stage_tables_mlflow_links_come_before_the_long_cells(tracker):
    """The report's MLflow column was off-screen (a 1269 px table in an 868 px pane): the stage table puts each
    stage's link, and a cached stage's source run, right after the node's name, and the metrics, in a table cell
    that never wraps in Prefect's pane, moved to a list under it (issue 59). What precedes the source run's link in
    a row is the node, its kind and the link's 8-character label: within the first 60 characters (about 420 px of
    text) of the row as shown."""
    import re

    plan = load_plan("sft-eval", "tiny")
    first = sft_eval_results(tracker, tracker.start_run("parent-1", {}))
    parent = tracker.start_run("parent-2", {})
    report = build_report(plan, cached_rerun(tracker, parent, first), tracker, parent)
    table = [line for line in report.markdown.split("\n## ")[0].splitlines() if line.startswith("| ")]
    assert table[0] == "| stage (kind) | MLflow run | status | s |"
    for line in table[2:]:
        shown = re.sub(r"\]\([^)]*\)", "]", line)  # a link shows as its label
        assert shown.index("(from [") < 60, shown


def test_the_stage_table_shows_each_slices_accuracy_with_its_interval(tracker):
    """An eval with trained and transfer slices (stages.eval.slice_metrics) shows both slices' accuracies among its key
    metrics, each with its interval; the slice's interval bounds and prompt count stay out of the list."""
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    results = sft_eval_results(tracker, parent)
    ev = next(r for r in results if r.node == "eval_sft")
    ev.metrics.update({"slice/trained/accuracy": 0.6, "slice/trained/accuracy_ci_low": 0.5,
                       "slice/trained/accuracy_ci_high": 0.7, "slice/trained/prompts": 256.0,
                       "slice/transfer/accuracy": 0.125, "slice/transfer/accuracy_ci_low": 0.0625,
                       "slice/transfer/accuracy_ci_high": 0.1875, "slice/transfer/prompts": 128.0})
    shown = table_rows(build_report(plan, results, tracker, parent).markdown)["eval_sft"][4]
    assert "slice/trained/accuracy=0.600 [0.500, 0.700]" in shown
    assert "slice/transfer/accuracy=0.125 [0.062, 0.188]" in shown
    assert "ci_low=" not in shown and "prompts=" not in shown.replace("contamination/prompts=", "")
    assert "slice/" not in table_rows(build_report(plan, results, tracker, parent).markdown)["eval_base"][4]


def test_report_has_one_row_per_stage_with_status_and_link_and_plots_with_data(tracker):
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    results = sft_eval_results(tracker, parent)
    report = build_report(plan, results, tracker, parent)
    rows = table_rows(report.markdown)
    assert set(rows) == {"base", "prompts", "sft", "eval_base", "eval_sft"}
    for r in results:
        assert rows[r.node][2] == "run"
        assert f"(#/experiments/{tracker.experiment_id}/runs/{r.mlflow_run_id}?workflowType=machine_learning)" \
            in rows[r.node][5]
    assert "final_loss=1" in rows["sft"][4] and "accuracy=0.500 [0.400, 0.600], format_rate" in rows["eval_sft"][4]
    assert "accuracy=0.250, format_rate" in rows["eval_base"][4]  # no interval logged: the accuracy alone
    # held-out prompts in the model's training data: a key metric where there are any
    assert "contamination/prompts=2" in rows["eval_sft"][4] and "contamination" not in rows["eval_base"][4]
    assert len(rows["sft"]) == 6  # four columns and the metrics' list: fits the page; the fingerprints have their own table
    outputs = report.markdown.split("## Outputs")[1].split("\n## ")[0]
    for r in results:
        for name, fingerprint in r.outputs.items():
            assert f"| {r.node} | {name} | `{fingerprint[:16]}` |" in outputs
    assert "r1flow ui" in report.markdown and "mlflow ui" not in report.markdown  # local store: how to open the links (a command that works)
    # the comparison table names the model and its fingerprint, the accuracy with its interval and the
    # eval size; unlogged metrics are dashes
    # (in tables that fit Prefect's pane, read here as one: flows/report/tables.py)
    compared = read_tables(report.markdown.split("## Model comparison")[1])
    assert list(compared[0]) == ["eval", "model", "model fp", "accuracy [95% CI]", "prompts", "lenient acc", "pass@k",
                                 "format rate", "mean length", "tokens/s †", "contaminated ‡"]
    assert [list(r.values()) for r in compared] == [
        ["eval_base", "base", fp("base")[:8], "0.250", "—", "—", "—", "0.100", "—", "—", "—"],
        ["eval_sft", "sft", fp("sft-1")[:8], "0.500 [0.400, 0.600]", "64", "—", "—", "0.900", "—", "—",
         "2 (3.1%) contaminated"]]
    assert "‡ contaminated: held-out prompts found in the evaluated model's training data" in report.markdown
    assert "95% percentile bootstrap interval" in report.markdown and "eval size" in report.markdown
    assert "↳ previous" not in report.markdown and "Compared with run" not in report.markdown  # no earlier run
    names = [n for n, _ in report.images]
    assert names == ["training_loss.png", "eval.png", "train_sft.png"]  # no GRPO stage: no GRPO plot
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
    assert f"(from [{sft_source[:8]}]" in rows["sft"][5]
    # curves read from the source run
    assert [n for n, _ in report.images] == ["training_loss.png", "eval.png", "train_sft.png"]


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


# one GRPO node's per-step history as stages/grpo.py logs it: its loss is ~1e-7 (group-centred advantages)
GRPO_HISTORY = {"train/loss": [1e-7, -2e-7, 5e-8], "reward/mean": [0.1, 0.3, 0.4], "reward/std": [0.4, 0.4, 0.3],
                "reward/zero_std_groups": [0.5, 0.0, 0.0], "reward/accuracy": [0.0, 0.25, 0.5],
                "reward/format": [0.5, 0.75, 1.0], "reward/math": [0.0, 0.25, 0.5], "train/kl": [0.0, 0.01, 0.02],
                "train/entropy": [1.2, 1.1, 1.0], "completion/mean_length": [50, 40, 30],
                "train/clip_low": [0.0, 0.0, 0.01], "train/clip_high": [0.0, 0.02, 0.01]}


def test_training_panels_pick_what_each_stage_watches_among_the_logged_keys():
    """GRPO: reward, its components (not the summary keys under reward/), accuracy, KL, entropy,
    length, clipping, flat groups, in that order, never train/loss; a panel appears only when one
    of its metrics was logged, and only the logged lines are in it."""
    logged = set(GRPO_HISTORY) | {"eval/accuracy", "time/step", "reward_first"}
    panels = training_panels("grpo", logged)
    assert [[k for k, _ in lines] for _, lines in panels] == [
        ["reward/mean"], ["reward/format", "reward/math"], ["reward/accuracy", "eval/accuracy"], ["train/kl"],
        ["train/entropy"], ["completion/mean_length"], ["train/clip_low", "train/clip_high"],
        ["reward/zero_std_groups"]]
    assert [label for _, label in panels[1][1]] == ["format", "math"]  # components by name
    assert [p.title for p, _ in panels][:5] == ["mean reward", "reward components", "accuracy", "KL to the reference",
                                                "policy entropy"]
    assert [(p.title, lines) for p, lines in training_panels("sft", {"train/loss", "final_loss"})] == [
        ("train loss", [("train/loss", "train batch")])]
    assert [p.title for p, _ in training_panels("reward_model", {"train/loss", "train/accuracy", "train/lr"})] == [
        "Bradley-Terry loss", "pairwise accuracy", "learning rate"]
    po = training_panels("preference_optimization", {"train/loss", "train/rewards/accuracy", "train/rewards/margin",
                                                     "eval/accuracy", "eval/kl"})
    assert [[k for k, _ in lines] for _, lines in po] == [
        ["train/loss"], ["train/rewards/accuracy", "eval/accuracy"], ["train/rewards/margin"], ["eval/kl"]]
    assert training_panels("grpo", {"reward_first", "time_per_step"}) == []  # summary metrics only: no plot
    assert training_panels("eval", {"accuracy"}) == []
    ppo = training_panels("ppo", {"reward/mean", "train/loss", "train/value_loss", "train/explained_variance",
                                  "train/clip_high", "train/value_clipfrac", "train/approx_kl"})
    assert [p.title for p, _ in ppo] == ["mean reward", "value loss", "explained variance", "clip fractions",
                                         "approximate KL between updates"]  # what a PPO user watches, never the loss
    assert [k for k, _ in ppo[3][1]] == ["train/clip_high", "train/value_clipfrac"]


def test_async_runs_get_staleness_weight_and_idle_panels_and_synchronous_runs_none():
    """Issue 60: an asynchronous grpo or ppo run's report plots its staleness histogram, the importance weights
    (mean, ESS, share truncated) and the idle and overlap shares per step; a synchronous run logs none of them and
    gets no such panel."""
    logged = {"reward/mean", "async/staleness_0", "async/staleness_1", "async/staleness_mean", "async/staleness_max",
              "async/policy_version", "async/is_weight_mean", "async/is_weight_ess", "async/is_truncated",
              "async/generation_idle", "async/training_idle", "async/overlap", "async/worker_restarts"}
    for stage in ("grpo", "ppo"):
        panels = {p.title: lines for p, lines in training_panels(stage, logged) if p.title.startswith("async")}
        assert panels == {
            "async: groups by staleness": [("async/staleness_0", "staleness_0"), ("async/staleness_1", "staleness_1")],
            "async: importance weights min(pi_prox / mu, C)": [
                ("async/is_weight_mean", "mean"), ("async/is_weight_ess", "effective sample size (share)"),
                ("async/is_truncated", "share truncated at C")],
            "async: who waits": [("async/overlap", "both busy"), ("async/generation_idle", "generation idle"),
                                 ("async/training_idle", "training idle")]}, stage
        assert not any(p.title.startswith("async") for p, _ in training_panels(stage, {"reward/mean", "train/kl"}))


def test_sampler_logprob_drift_gets_two_panels_where_logged_and_none_elsewhere():
    """Issue 61: a grpo run with old_logprobs: sampler, or an asynchronous grpo or ppo run, plots the sampler/trainer
    log-prob drift per step: |delta| mean, p99 and max in nats on one panel, the share of tokens above 0.1 nats on
    another; the keys are the ones the stages log (`rollouts.drift_metrics`). A run that logs none gets neither."""
    import torch

    from stages.runtime.distributed import SINGLE
    from stages.training.rollouts import drift_metrics

    logged = {"reward/mean", *drift_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), SINGLE)}
    titles = ("sampler vs trainer log-probs", "tokens where sampler and trainer disagree")
    for stage in ("grpo", "ppo"):
        panels = {p.title: lines for p, lines in training_panels(stage, logged) if p.title in titles}
        assert panels == {
            titles[0]: [("sampler/logprob_delta_mean", "mean"), ("sampler/logprob_delta_p99", "p99"),
                        ("sampler/logprob_delta_max", "max")],
            titles[1]: [("sampler/logprob_delta_share_above_0.1", "|delta| > 0.1 nats")]}, stage
        assert not any(p.title in titles for p, _ in training_panels(stage, {"reward/mean", "train/kl"}))


def test_grpo_plots_reward_kl_entropy_and_length_not_its_loss(tracker, monkeypatch):
    """A GRPO node gets train_grpo.png with the curves of its history (reward, components, accuracy
    on rollouts and held-out, KL, entropy, length, clipping) and a column in grpo.png; its ~1e-7
    loss is in no plot, and no training_loss.png is drawn for it."""
    from flows.report import report as report_module

    drawn: dict[str, list] = {}
    real = report_module.plot_panels

    marked: dict[str, dict | None] = {}

    def recording(panels, title, alarms=None):  # the real plot, with what it was asked to draw kept for the asserts
        drawn[title], marked[title] = panels, alarms
        return real(panels, title, alarms)

    monkeypatch.setattr(report_module, "plot_panels", recording)
    plan = load_plan("r1-zero", "tiny")
    parent = tracker.start_run("parent", {})
    grpo = stage_run(tracker, parent, "grpo", GRPO_HISTORY, {"reward_first": 0.1})
    tracker.log_metrics(grpo, {"eval/accuracy": 0.5}, step=2)  # evaluated during training at step 2 only
    tracker.log_metrics(grpo, {"alarm/length": 1.0}, step=3)  # a reward-hacking alarm (docs/guides/alarms.md)
    results = [StageResult("grpo", "grpo", "run", 3.0, "Completed", {"model": fp("g")}, {"reward_first": 0.1}, grpo)]
    report = build_report(plan, results, tracker, parent)

    assert [n for n, _ in report.images] == ["grpo.png", "train_grpo.png"]
    assert [m for t, m in marked.items() if t.startswith("grpo: training curves")] == [{3: "length"}]  # its marker
    assert all(png.startswith(PNG_MAGIC) for _, png in report.images)
    assert "train_grpo.png" in report.markdown and "training_loss.png" not in report.markdown
    (title, panels), = [(t, p) for t, p in drawn.items() if t.startswith("grpo: training curves")]
    assert f"MLflow run {grpo[:8]}" in title
    by_title = {t: (ylabel, lines) for t, ylabel, lines in panels}
    assert list(by_title) == ["grpo: mean reward per step", "grpo: reward components per step",
                              "grpo: accuracy per step", "grpo: KL to the reference per step",
                              "grpo: policy entropy per step", "grpo: completion length per step",
                              "grpo: clip fraction per step", "grpo: groups with equal rewards (no signal) per step"]
    assert by_title["grpo: mean reward per step"][1] == [("rollouts", ([1, 2, 3], [0.1, 0.3, 0.4]))]
    assert by_title["grpo: accuracy per step"][1] == [("rollouts (sampled)", ([1, 2, 3], [0.0, 0.25, 0.5])),
                                                      ("held-out (greedy)", ([2], [0.5]))]
    assert by_title["grpo: KL to the reference per step"] == ("KL estimate per token (nats)",
                                                              [("KL(policy || ref)", ([1, 2, 3], [0.0, 0.01, 0.02]))])
    assert by_title["grpo: policy entropy per step"][1] == [("entropy", ([1, 2, 3], [1.2, 1.1, 1.0]))]
    plotted = [v for _, _, lines in (p for ps in drawn.values() for p in ps) for _, (_, vs) in lines for v in vs]
    assert 1e-7 not in plotted and -2e-7 not in plotted  # the loss is nowhere
    assert not any("loss" in t for ps in drawn.values() for t, _, _ in ps)
    (overview,) = [p for t, p in drawn.items() if t.startswith("RL nodes")]  # GRPO and PPO nodes side by side
    assert [t for t, _, _ in overview] == ["RL: mean reward per step", "RL: held-out accuracy (greedy) per step",
                                           "RL: KL to the reference per token (nats) per step",
                                           "RL: mean completion length (tokens) per step"]


def test_step_axes_tick_whole_steps_only_and_empty_panels_are_dropped():
    """Three steps (a default locator ticks 1.0, 1.25, ...) and a metric logged once, at step 6 (even
    a plain integer locator falls back to 5.8, 5.9, ... there): every tick in view is a whole step.
    A panel whose metric has no point is not drawn."""
    fig = panel_figure([("a: three steps", "y", [("", ([1, 2, 3], [0.1, 0.2, 0.3]))]),
                        ("b: nothing logged", "y", [("", ([], []))]),
                        ("c: one point", "nats", [("kl", ([6], [1.7]))])], "figure")
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["a: three steps", "c: one point"]
    for ax in axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        assert ax.get_xlabel() == "optimizer step"
    assert axes[1].get_ylabel() == "nats"
    with pytest.raises(ValueError, match="no curve"):
        panel_figure([("b: nothing logged", "y", [("", ([], []))])], "figure")


def test_pass_at_k_names_its_prompts_and_throughput_its_machine_load(tracker):
    """sft-eval's evals sample pass@2 on their first 4 prompts (tiny profile): the comparison header
    says `pass@2 (4 prompts)` and the stage table `pass_at_2=... (4 prompts)`; tokens/s carries †
    and report.md says what it depends on. Evals on different prompt counts (an eval smaller than
    pass_k_prompts; one that logged its count) say theirs per cell."""
    plan = load_plan("sft-eval", "tiny")
    assert {(plan.node(n).config.pass_k, plan.node(n).config.pass_k_prompts) for n in ("eval_base", "eval_sft")} == {
        (2, 4)}
    parent = tracker.start_run("parent", {})
    ev = {"eval_base": {"accuracy": 0.25, "pass_at_2": 0.5, "prompts": 16.0, "tokens_per_s": 80.0},
          "eval_sft": {"accuracy": 0.5, "pass_at_2": 0.75, "prompts": 16.0, "tokens_per_s": 90.0}}
    results = [StageResult(node, "eval", "run", 1.0, "Completed", {"results": fp(node)}, m,
                           stage_run(tracker, parent, node, None, m)) for node, m in ev.items()]
    report = build_report(plan, results, tracker, parent)
    header = read_tables(report.markdown.split("## Model comparison")[1])[0]
    assert "pass@2 (4 prompts)" in header and "tokens/s †" in header
    assert "pass_at_2=0.750 (4 prompts)" in table_rows(report.markdown)["eval_sft"][4]
    assert report.markdown.count("depends on the machine") == 2  # under the stage table and the comparison

    ev["eval_base"]["prompts"] = 3.0  # fewer prompts than pass_k_prompts: pass@k saw those 3
    ev["eval_sft"]["pass_k_prompts"] = 2.0  # a count the eval logged wins over the config's
    rows = comparison_rows(plan, [dataclasses.replace(r, metrics=ev[r.node]) for r in results])
    assert [r["pass_k_prompts"] for r in rows] == [3, 2]
    from flows.report.comparison import comparison_markdown, comparison_payload

    md = "\n".join(comparison_markdown(comparison_payload(plan, parent, rows, None), tracker))
    assert "| pass@k |" in md and "| 0.500 (k=2, 3 prompts) |" in md and "| 0.750 (k=2, 2 prompts) |" in md


def test_publish_logs_report_and_pngs_to_mlflow_outside_prefect(tracker, tmp_path):
    plan = load_plan("sft-eval", "tiny")
    parent = tracker.start_run("parent", {})
    report = build_report(plan, sft_eval_results(tracker, parent), tracker, parent)
    out = publish_report(report, tracker, parent)
    assert out["prefect_artifact_id"] is None  # not inside a flow run
    logged = {a.path for a in tracker.client.list_artifacts(parent, "report")}
    assert logged == {"report/report.md", "report/training_loss.png", "report/eval.png", "report/train_sft.png",
                      "report/comparison.json", "report/comparison.csv"}
    assert sorted(out["mlflow_artifacts"]) == sorted(logged)
    path = tracker.client.download_artifacts(parent, "report/eval.png", str(tmp_path))
    assert open(path, "rb").read().startswith(PNG_MAGIC)

    data = json.loads(open(tracker.client.download_artifacts(parent, "report/comparison.json", str(tmp_path))).read())
    assert (data["recipe"], data["profile"], data["parent_run_id"]) == ("sft-eval", "tiny", parent)
    assert data["previous"] is None
    assert [(r["eval"], r["model"], r["model_fingerprint"], r["accuracy"], r["accuracy_ci_low"], r["accuracy_ci_high"],
             r["prompts"]) for r in data["rows"]] == [
        ("eval_base", "base", fp("base"), 0.25, None, None, None), ("eval_sft", "sft", fp("sft-1"), 0.5, 0.4, 0.6, 64.0)]
    with open(tracker.client.download_artifacts(parent, "report/comparison.csv", str(tmp_path))) as f:
        lines = list(csv.DictReader(f))
    assert [(r["parent_run_id"], r["eval"], r["model_fingerprint"], r["accuracy"], r["accuracy_ci_low"],
             r["accuracy_ci_high"], r["format_rate"], r["pass_at_k"], r["prompts"]) for r in lines] == [
        (parent, "eval_base", fp("base"), "0.25", "", "", "0.1", "", ""),
        (parent, "eval_sft", fp("sft-1"), "0.5", "0.4", "0.6", "0.9", "", "64.0")]


def test_comparison_rows_on_literal_results():
    """pass@k is the logged pass_at_<k> (not pass_at_1_sampled), tasks are the union over rows,
    NaN is missing, and skipped evals or evals without accuracy get no row."""
    plan = load_plan("sft-eval", "tiny")
    base = {"accuracy": 0.25, "accuracy_lenient": float("nan"), "format_rate": 0.5, "mean_length": 40.0,
            "tokens_per_s": 120.0, "arith/accuracy": 0.2, "arith/accuracy_lenient": 0.3, "arith/pass_at_4": 0.9}
    sft = {"accuracy": 0.5, "accuracy_ci_low": 0.2, "accuracy_ci_high": 0.8, "accuracy_lenient": 0.6,
           "pass_at_4": 0.75, "pass_at_1_sampled": 0.3, "format_rate": 1.0, "mean_length": 30.0, "tokens_per_s": 100.0,
           "arith/accuracy": 0.4, "arith/accuracy_ci_low": 0.0, "arith/accuracy_ci_high": 0.8,
           "count/accuracy": 0.8, "count/accuracy_ci_low": float("nan"), "count/accuracy_ci_high": float("nan"),
           "prompts": 10.0, "contamination/prompts": 0.0, "contamination/share": 0.0, "contaminated": 0.0}
    results = [StageResult("base", "import_model", "cached", 0.0, "", {"model": fp("base")}, {}, "r0"),
               StageResult("prompts", "prompts", "cached", 0.0, "", {"prompts": fp("prompts")}, {}, "r1"),
               StageResult("sft", "sft", "run", 1.0, "", {"model": fp("sft")}, {}, "r2"),
               StageResult("eval_base", "eval", "cached", 0.0, "", {"results": fp("eb")}, base, "r3"),
               StageResult("eval_sft", "eval", "run", 1.0, "", {"results": fp("es")}, sft, "r4")]
    rows = comparison_rows(plan, results)
    assert [r["eval"] for r in rows] == ["eval_base", "eval_sft"]
    b, s = rows
    assert (b["model"], b["model_output"], b["model_fingerprint"], b["eval_fingerprint"], b["status"]) == (
        "base", "model", fp("base"), fp("eb"), "cached")
    assert (s["model"], s["model_fingerprint"], s["eval_fingerprint"], s["status"], s["mlflow_run_id"]) == (
        "sft", fp("sft"), fp("es"), "run", "r4")
    assert (s["pass_k"], s["pass_at_k"]) == (4, 0.75) and (b["pass_k"], b["pass_at_k"]) == (None, None)
    assert (b["accuracy"], b["accuracy_lenient"], b["format_rate"], b["mean_length"], b["tokens_per_s"]) == (
        0.25, None, 0.5, 40.0, 120.0)
    assert (b["arith/accuracy"], b["count/accuracy"], s["arith/accuracy"], s["count/accuracy"]) == (0.2, None, 0.4, 0.8)
    # intervals: beside their accuracy; an eval logged without them (base) or with NaN ones (count) has None
    assert (s["accuracy_ci_low"], s["accuracy_ci_high"], b["accuracy_ci_low"], b["accuracy_ci_high"]) == (
        0.2, 0.8, None, None)
    assert (s["arith/accuracy_ci_low"], s["arith/accuracy_ci_high"], s["count/accuracy_ci_low"]) == (0.0, 0.8, None)
    assert (s["prompts"], b["prompts"]) == (10.0, None)
    # decontamination: a clean eval's 0 is a number; an eval from before the check has none
    assert [(r["contamination/prompts"], r["contamination/share"], r["contaminated"]) for r in rows] == [
        (None, None, None), (0.0, 0.0, 0.0)]
    assert list(s)[list(s).index("accuracy"):][:3] == ["accuracy", "accuracy_ci_low", "accuracy_ci_high"]
    assert set(b) == set(s) and not any(k.endswith(("accuracy_lenient", "pass_at_4")) and "/" in k for k in b)

    skipped = [dataclasses.replace(r, status="skipped") if r.node == "eval_base" else r for r in results]
    no_accuracy = [dataclasses.replace(r, metrics={"format_rate": 1.0}) if r.node == "eval_sft" else r for r in results]
    assert [r["eval"] for r in comparison_rows(plan, skipped)] == ["eval_sft"]
    assert [r["eval"] for r in comparison_rows(plan, no_accuracy)] == ["eval_base"]
    assert comparison_rows(plan, results[:3]) == []


def parent_run(tracker: Tracker, plan, name: str) -> str:
    """A parent run as run_plan starts it: tagged with recipe and profile, no mlflow.parentRunId."""
    return tracker.start_run(name, {"r1flow.recipe": plan.recipe, "r1flow.profile": plan.profile})


def comparison_table(markdown: str) -> list[list[str]]:
    """The model comparison's rows, its split tables joined (flows/report/tables.py), in the columns' order."""
    return [list(row.values()) for row in read_tables(markdown.split("## Model comparison")[1].split("\n## ")[0])]


def test_rerun_with_changed_model_shows_the_previous_row_for_that_eval_only(tracker, tmp_path, monkeypatch):
    plan = load_plan("sft-eval", "tiny")
    p1 = parent_run(tracker, plan, "run-1")
    publish_report(build_report(plan, sft_eval_results(tracker, p1, acc_base=0.25, acc_sft=0.5), tracker, p1),
                   tracker, p1)
    tracker.end(p1)
    # runs that must be passed over: newer, but failed / another profile / without evals (no comparison.json)
    failed = parent_run(tracker, plan, "failed")
    publish_report(build_report(plan, sft_eval_results(tracker, failed, sft_fp="x"), tracker, failed), tracker, failed)
    tracker.end(failed, ok=False)
    other = tracker.start_run("cpu", {"r1flow.recipe": plan.recipe, "r1flow.profile": "cpu"})
    publish_report(build_report(plan, sft_eval_results(tracker, other, sft_fp="y"), tracker, other), tracker, other)
    tracker.end(other)
    no_evals = parent_run(tracker, plan, "only-prompts")
    results = [r if r.node in ("base", "prompts") else StageResult(r.node, r.stage, "skipped", 0.0)
               for r in sft_eval_results(tracker, no_evals, loss=None)]
    publish_report(build_report(plan, results, tracker, no_evals), tracker, no_evals)
    tracker.end(no_evals)
    assert "report/comparison.json" not in {a.path for a in tracker.client.list_artifacts(no_evals, "report")}

    # sft.learning_rate changed: sft and eval_sft re-ran on a new sft model; eval_base's model is unchanged
    p2 = parent_run(tracker, plan, "run-2")
    second = sft_eval_results(tracker, p2, sft_fp="v2-sft", acc_base=0.25, acc_sft=0.1)
    assert previous_comparison(tracker, plan, p2)["parent_run_id"] == p1
    report = build_report(plan, second, tracker, p2)
    assert fp("v2-sft")[:8] != fp("sft-1")[:8]
    table = comparison_table(report.markdown)
    assert [row[:4] for row in table] == [
        ["eval_base", "base", fp("base")[:8], "0.250"],
        ["eval_sft", "sft", fp("v2-sft")[:8], "0.100 [0.000, 0.200]"],
        [f"↳ previous (run {p1[:8]})", "sft", fp("sft-1")[:8], "0.500 [0.400, 0.600]"]]  # the old numbers, right below
    assert table[2][7] == "0.900"  # format rate of the old sft
    assert f"the same eval node in run [{p1[:8]}](" in report.markdown and "changed upstream config" in report.markdown
    prev = report.comparison["previous"]
    assert prev["parent_run_id"] == p1 and [(r["eval"], r["model_fingerprint"], r["accuracy"]) for r in prev["rows"]] == [
        ("eval_sft", fp("sft-1"), 0.5)]

    publish_report(report, tracker, p2)
    tracker.end(p2)
    data = json.loads(open(tracker.client.download_artifacts(p2, "report/comparison.json", str(tmp_path))).read())
    assert data["previous"] == json.loads(json.dumps(prev))
    with open(tracker.client.download_artifacts(p2, "report/comparison.csv", str(tmp_path))) as f:
        lines = list(csv.DictReader(f))
    assert [(r["parent_run_id"], r["eval"], r["model_fingerprint"], r["accuracy"]) for r in lines] == [
        (p2, "eval_base", fp("base"), "0.25"), (p2, "eval_sft", fp("v2-sft"), "0.1"),
        (p1, "eval_sft", fp("sft-1"), "0.5")]

    # a fully cached re-run of run 2: every fingerprint as in run 2, so no previous rows
    p3 = parent_run(tracker, plan, "run-3")
    report = build_report(plan, cached_rerun(tracker, p3, second), tracker, p3)
    assert [row[0] for row in comparison_table(report.markdown)] == ["eval_base", "eval_sft"]
    assert f"Compared with run [{p2[:8]}](" in report.markdown and "↳ previous" not in report.markdown
    assert report.comparison["previous"] == {"parent_run_id": p2, "rows": []}

    # a handful at most: with one try, run 3 only reaches run 2 (passing over nothing)
    import flows.report.comparison as comparison_mod

    monkeypatch.setattr(comparison_mod, "MAX_PREVIOUS_RUNS", 1)
    assert previous_comparison(tracker, plan, p3)["parent_run_id"] == p2
    p4 = parent_run(tracker, plan, "run-4")
    tracker.end(p4)  # finished without evals: the one try is spent on it
    assert previous_comparison(tracker, plan, parent_run(tracker, plan, "run-5")) is None


def test_previous_rows_from_before_intervals_show_the_accuracy_alone(tracker):
    """A previous run's comparison.json written before intervals and the eval size existed has no
    accuracy_ci_*, <task>/accuracy_ci_* or prompts keys: its row renders with the accuracy alone,
    and the CSV leaves those cells empty."""
    now = {"eval": "eval_sft", "model": "sft", "model_fingerprint": fp("new"), "accuracy": 0.5,
           "accuracy_ci_low": 0.375, "accuracy_ci_high": 0.625, "accuracy_lenient": None, "pass_k": 4,
           "pass_at_k": 0.75, "format_rate": 0.9, "mean_length": 30.0, "tokens_per_s": 100.0, "prompts": 64.0,
           "arith/accuracy": 0.25, "arith/accuracy_ci_low": 0.125, "arith/accuracy_ci_high": 0.375}
    old = {"eval": "eval_sft", "model": "sft", "model_fingerprint": fp("old"), "accuracy": 0.375,
           "accuracy_lenient": 0.5, "pass_k": 4, "pass_at_k": 0.5, "format_rate": 0.8, "mean_length": 40.0,
           "tokens_per_s": 90.0, "arith/accuracy": 0.125}
    payload = {"recipe": "sft-eval", "profile": "tiny", "parent_run_id": "p2" * 16, "rows": [now],
               "previous": {"parent_run_id": "p1" * 16, "rows": [old]}}
    from flows.report.comparison import comparison_csv, comparison_markdown

    md = "\n".join(comparison_markdown(payload, tracker))
    rows = read_tables(md.split("## Model comparison")[1])
    # neither row says on how many prompts: the header cannot either
    assert list(rows[0]) == ["eval", "model", "model fp", "accuracy [95% CI]", "prompts", "lenient acc", "pass@4",
                             "format rate", "mean length", "tokens/s †", "contaminated ‡", "acc: arith"]
    assert list(rows[0].values()) == ["eval_sft", "sft", fp("new")[:8], "0.500 [0.375, 0.625]", "64", "—", "0.750",
                                      "0.900", "30", "100", "—", "0.250 [0.125, 0.375]"]
    assert list(rows[1].values()) == ["↳ previous (run p1p1p1p1)", "sft", fp("old")[:8], "0.375", "—", "0.500", "0.500",
                                      "0.800", "40", "90", "—", "0.125"]
    lines = list(csv.DictReader(comparison_csv(payload).splitlines()))
    assert [(r["accuracy"], r["accuracy_ci_low"], r["accuracy_ci_high"], r["prompts"], r["arith/accuracy_ci_low"])
            for r in lines] == [("0.5", "0.375", "0.625", "64.0", "0.125"), ("0.375", "", "", "", "")]


def test_prefect_artifact_failure_only_warns(tracker, monkeypatch, caplog):
    import flows.report.report as report_mod

    def boom(**kwargs):
        raise RuntimeError("api down")

    monkeypatch.setattr(report_mod, "_in_prefect_run", lambda: True)
    monkeypatch.setattr(report_mod, "create_markdown_artifact", boom)
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
    assert (final.tags["r1flow.eval.eval_sft.accuracy_ci_low"], final.tags["r1flow.eval.eval_sft.accuracy_ci_high"]) == (
        "0.4", "0.6")
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


def test_the_tool_use_section_shows_each_tool_evals_calls_errors_turns_and_accuracy_by_calls():
    """Only evals that logged tool metrics get a row (a plain eval and a skipped one do not); a bin with no answers
    shows — for its accuracy; no tool eval at all: no section."""
    from flows.report.comparison import tool_use_markdown

    tool = {"accuracy": 0.75, "accuracy_ci_low": 0.5, "accuracy_ci_high": 1.0, "tool_calls_per_answer": 1.25,
            "tool_error_rate": 0.2, "turns": 2.25, "calls_0/accuracy": float("nan"), "calls_0/share": 0.0,
            "calls_1/accuracy": 1.0, "calls_1/share": 0.75, "calls_2plus/accuracy": 0.0, "calls_2plus/share": 0.25}
    results = [StageResult("eval_plain", "eval", "run", 1.0, metrics={"accuracy": 0.1}),
               StageResult("eval_python", "eval", "cached", 1.0, metrics=tool),
               StageResult("eval_gone", "eval", "skipped", 0.0, metrics=tool)]
    md = tool_use_markdown(results)
    rows = read_tables("\n".join(md))
    assert [list(r.values()) for r in rows] == [
        ["eval_python", "1.250", "0.200", "2.250", "0.750 [0.500, 1.000]", "— (0)", "1 (0.750)", "0 (0.250)"]]
    assert tool_use_markdown(results[:1]) == []
