"""`eval` stage: greedy pass@1 and sampled pass@k on held-out prompts, scored by each row's verifier.

Writes one `eval` dataset (a row per completion) and summary metrics: accuracy (greedy; the answer
must be in the <answer> block or a \\boxed{}), accuracy_lenient (else the last number counts, so a
base model that has not learnt the format is measured fairly), pass@k
(unbiased estimator over the sampled completions), format rate, mean completion length,
generation throughput, and the same per task; per slice (`task_slices`: tasks trained on vs held out only, i.e.
transfer) the accuracy with its interval. Each accuracy comes with a 95% percentile bootstrap
interval over the scored greedy prompts (`accuracy_ci_low`, `accuracy_ci_high`, and per task;
`stages.math.stats.bootstrap_ci`, seed `CI_SEED`), so a reader can tell a gain from eval noise.

With `rerank` set, the pass@k samples also answer best-of-N at test time (`stages.math.rerank`):
each prompt's N samples are reduced to one by majority vote, and, with a `scorer` input, by an
outcome reward model's reward (`orm`) or a process reward model's aggregated step scores (`prm`);
`rerank/*` metrics put them beside pass@1 of the same samples. The policy is freed before the
scorer loads, so the two never share memory.

With `environment:` other than single_turn (e.g. python, the tool in the sandbox), the answers are
multi-turn trajectories (`stages.sampling.multiturn`) scored on the model's own text; rows record
turns, tool_calls and tool_errors, and the metrics add tool calls per answer, the tool error rate,
turns, and accuracy by the number of calls (`tool_metrics`). single_turn takes generate()'s path as
before: same rows, same files, same keys; with `backend: vllm` a vLLM engine (`stages.sampling.vllm_backend`),
started once for both passes and shut down before the scorer loads, answers instead.

Decontamination (`stages.math.contamination`, docs/guides/decontamination.md): before the model loads, the held-out
prompts are checked against every dataset among the evaluated model's ancestors (`LINEAGE_OF`: the runner hands them
as `lineage.*` inputs): exact question, 13-word overlap, answer leakage. `contamination/*` metrics (count, share, by
check), `contaminated` (1 above `contamination_threshold`), examples in the output manifest's `extra` and the run's
`contamination.json`; `fail_on_contamination` fails the eval there, one line.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from schemas.configs import EvalConfig, GenerationSpec
from schemas.datasets import from_rows
from schemas.errors import SchemaError, StageError
from stages.base import LINEAGE_INPUT_PREFIX, Input, Output, StageContext, seed_everything, write_dataset
from stages.environments.registry import environment_from_spec, environment_salt
from stages.math import contamination
from stages.math.rerank import best_pick, majority_pick, rerank_accuracy
from stages.math.stats import bootstrap_ci
from stages.modeling import heads
from stages.rewards.verifiers import pass_at_k, score
from stages.sampling.generation import auto_precision, generate, make_backend
from stages.sampling.multiturn import sample_trajectories

VERSION = "7"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = EvalConfig
INPUTS = {"model": "model", "prompts": "prompts", "scorer": "model?"}
LINEAGE_OF = "model"  # the datasets among its ancestors come as `lineage.*` inputs (stages.base.LINEAGE_INPUT_PREFIX)
OUTPUTS = {"results": "eval"}
CI_CONFIDENCE = 0.95
CI_SEED = 0  # fixed, not the run's seed: the same rows always give the same interval
TOOL_COLUMNS = ("turns", "tool_calls", "tool_errors")  # optional eval columns (schemas.datasets.OPTIONAL_COLUMNS)
TOOL_CALL_BINS = (("calls_0", 0, 0), ("calls_1", 1, 1), ("calls_2plus", 2, 1 << 30))
SLICES = ("trained", "transfer")  # `task_slices`: the kind the recipe trains on, and held-out-only tasks
SLICE_PREFIX = "slice/"  # `slice/<slice>/accuracy` ...: an eval's accuracy per slice, where it has both
PER_SLICE = ("accuracy", "accuracy_ci_low", "accuracy_ci_high")
PER_TASK = ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "accuracy_lenient", "format_rate", "mean_length",
            "tool_calls_per_answer", "tool_error_rate", "turns")


def round_robin_prompts(table: pa.Table, split: str, max_prompts: int) -> list[dict]:
    """Rows of `split`, round-robin over tasks so every task is represented in the first N."""
    rows = [r for r in table.to_pylist() if r["split"] == split]
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    picked, queues = [], [by_task[t] for t in sorted(by_task)]
    while len(picked) < max_prompts and any(queues):
        for q in queues:
            if q and len(picked) < max_prompts:
                picked.append(q.pop(0))
    return picked


def task_slices(prompt_rows: list[dict]) -> dict[str, str]:
    """(pure) task -> "trained" where the prompts have a train-split row of it (the kind a recipe trains on), else
    "transfer": held out only (`eval_tasks`, a task of a user file's eval split), so no stage can have trained on it."""
    trained = {r["task"] for r in prompt_rows if r["split"] == "train"}
    return {r["task"]: SLICES[r["task"] not in trained] for r in prompt_rows}


def slice_metrics(rows: list[dict], slices: dict[str, str], k: int) -> dict[str, float]:
    """(pure) `<task>/transfer` (1 for a transfer task, 0 for a trained one) for every task of the rows and, where the
    rows have both slices, each slice's accuracy with its 95% interval and its greedy prompts
    (`slice/<slice>/accuracy`, ..., `slice/<slice>/prompts`)."""
    tasks = sorted({r["task"] for r in rows})
    out = {f"{t}/transfer": float(slices[t] == "transfer") for t in tasks}
    if len({slices[t] for t in tasks}) < 2:
        return out
    for name in SLICES:
        part = [r for r in rows if slices[r["task"]] == name]
        out.update({f"{SLICE_PREFIX}{name}/{m}": v for m, v in summarize(part, k).items() if m in PER_SLICE})
        out[f"{SLICE_PREFIX}{name}/prompts"] = float(sum(r["mode"] == "greedy" for r in part))
    return out


def summarize(rows: list[dict], k: int) -> dict[str, float]:
    """Summary metrics over eval rows (pure: tested on literal rows)."""
    greedy = [r for r in rows if r["mode"] == "greedy"]
    scored = [r for r in greedy if r["correct"] is not None]
    out: dict[str, float] = {}
    if greedy:
        out["accuracy"] = float(np.mean([r["correct"] for r in scored])) if scored else float("nan")
        out["accuracy_ci_low"], out["accuracy_ci_high"] = bootstrap_ci(  # (nan, nan) when nothing was scored
            [float(r["correct"]) for r in scored], confidence=CI_CONFIDENCE, seed=CI_SEED)
        out["accuracy_lenient"] = float(np.mean([r["correct_lenient"] for r in scored])) if scored else float("nan")
        out["format_rate"] = float(np.mean([r["format_ok"] for r in greedy]))
        out["mean_length"] = float(np.mean([r["num_tokens"] for r in greedy]))
        out["truncated_rate"] = float(np.mean([r["finish_reason"] == "length" for r in greedy]))
        out["unscored"] = float(len(greedy) - len(scored))
        if greedy[0].get("tool_calls") is not None:
            out.update(answer_tool_metrics(greedy))
    sampled: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["mode"] == "sampled" and r["correct"] is not None:
            sampled[r["prompt_id"]].append(r)
    if sampled and k:
        out[f"pass_at_{k}"] = float(np.mean([pass_at_k(len(v), sum(x["correct"] for x in v), k) for v in sampled.values()]))
        out["pass_at_1_sampled"] = float(np.mean([pass_at_k(len(v), sum(x["correct"] for x in v), 1) for v in sampled.values()]))
    return out


def answer_tool_metrics(rows: list[dict]) -> dict[str, float]:
    """Over greedy rows sampled with a tool environment (pure: tested on literal rows): tool calls per answer, the
    share of calls that failed (nan without calls, not 0), model turns per answer, and accuracy (with the share of
    answers) by the number of calls an answer made: 0, 1, 2 or more (`calls_2plus`)."""
    calls = sum(r["tool_calls"] for r in rows)
    out = {"tool_calls_per_answer": calls / len(rows),
           "tool_error_rate": sum(r["tool_errors"] for r in rows) / calls if calls else float("nan"),
           "turns": float(np.mean([r["turns"] for r in rows]))}
    for name, lo, hi in TOOL_CALL_BINS:
        group = [r for r in rows if lo <= r["tool_calls"] <= hi]
        scored = [r["correct"] for r in group if r["correct"] is not None]
        out[f"{name}/share"] = len(group) / len(rows)
        out[f"{name}/accuracy"] = float(np.mean(scored)) if scored else float("nan")
    return out


def rerank_metrics(rows: list[dict], scores: list[float] | None, method: str) -> dict[str, float]:
    """`rerank/*` over the sampled rows (pure: tested on literal rows): pass@1 of the samples, majority vote and,
    with `scores` (one per sampled row, in row order), best-of-N by the scorer."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r["mode"] == "sampled":
            groups[r["prompt_id"]].append(i)
    if not groups:
        return {}
    sampled = [i for idx in groups.values() for i in idx]
    by_row = dict(zip(sampled, scores, strict=True)) if scores is not None else {}
    correct = [[rows[i]["correct"] for i in idx] for idx in groups.values()]
    out = {"rerank/prompts": float(len(groups)), "rerank/samples": float(np.mean([len(c) for c in correct])),
           "rerank/pass_at_1": float(np.mean([np.mean([bool(x) for x in c]) for c in correct])),
           "rerank/majority_accuracy": rerank_accuracy(
               correct, [majority_pick([rows[i]["extracted"] for i in idx]) for idx in groups.values()])}
    if by_row:
        out[f"rerank/{method}_accuracy"] = rerank_accuracy(
            correct, [best_pick([by_row[i] for i in idx]) for idx in groups.values()])
    return out


def check_scorer(cfg: EvalConfig, inputs: dict[str, Input]) -> None:
    """Before any compute: rerank=orm/prm needs a `scorer` input of the matching kind; a scorer with no use is an error too."""
    scorer = inputs.get("scorer")
    if cfg.rerank in ("orm", "prm") and scorer is None:
        raise SchemaError(f"eval: rerank={cfg.rerank!r} needs the input `scorer` (a "
                          f"{'reward model' if cfg.rerank == 'orm' else 'process reward model'} artifact)")
    if scorer is not None and cfg.rerank not in ("orm", "prm"):
        raise SchemaError(f"eval: the input `scorer` ({scorer.label}) is used only with rerank=orm or rerank=prm, "
                          f"not {cfg.rerank!r}")
    if scorer is not None:
        want = heads.REWARD_MODEL_SCHEMA if cfg.rerank == "orm" else heads.PRM_SCHEMA
        if scorer.manifest.schema_name != want:
            raise SchemaError(f"eval: rerank={cfg.rerank!r} needs a {want!r} artifact as `scorer`; "
                              f"{scorer.label} is {scorer.manifest.schema_name!r}")


def sampled_scores(cfg: EvalConfig, rows: list[dict], prompts: list[dict], scorer: Input, device: str) -> list[float]:
    """The scorer's score of every sampled row, in row order: a reward (orm) or aggregated step scores (prm)."""
    by_id = {p["id"]: p["messages"] for p in prompts}
    sampled = [r for r in rows if r["mode"] == "sampled"]
    convs, texts = [by_id[r["prompt_id"]] for r in sampled], [r["completion"] for r in sampled]
    if cfg.rerank == "orm":
        return heads.RewardScorer.from_input(scorer, device).score(convs, texts)
    return heads.StepScorer.from_input(scorer, device).score(convs, texts, aggregation=cfg.rerank_aggregate)


def check(cfg: EvalConfig) -> None:
    """Before any compute: the environment loads (a user file exists and defines one)."""
    environment_from_spec(cfg.environment)


def cache_salt(cfg: EvalConfig) -> str:
    """A user environment file's bytes; nothing for a built-in (its code moves with VERSION)."""
    return environment_salt(cfg.environment)


def answer_prompts(cfg: EvalConfig, model, tokenizer, prompts: list[dict], spec: GenerationSpec, n: int, seed: int,
                   desc: str, engine=None) -> tuple[list[list[dict]], float, int]:
    """n answers per prompt as partial eval rows, with the seconds and sampled tokens it took. single_turn: generate()'s
    completions, as always, or `engine`'s (a vLLM backend, `backend: vllm`). Otherwise the environment's trajectories
    (r1flow's loop, or the engine's `trajectories`: token ids turn after turn): `completion` is the transcript (the tool's
    output included, so a reader sees what the model saw), scored on the model's own text (`Environment.score`),
    with turns, tool_calls and tool_errors."""
    autocast_dtype = auto_precision(str(next(model.parameters()).device))  # bf16 on a GPU, fp32 on the CPU
    if cfg.environment.is_single_turn:
        convs = [p["messages"] for p in prompts]
        comps, stats = (engine.generate(convs, spec, n=n, seed=seed, desc=desc) if engine is not None else
                        generate(model, tokenizer, convs, spec, n=n, seed=seed, desc=desc, autocast_dtype=autocast_dtype))
        return [[{"completion": c.text, "num_tokens": c.num_tokens, "finish_reason": c.finish_reason,
                  "verdict": score(p, c.text)} for c in cs] for p, cs in zip(prompts, comps, strict=True)], \
            stats.seconds, stats.new_tokens
    env, budget = environment_from_spec(cfg.environment), cfg.environment.token_budget(spec.max_new_tokens)
    trajs, stats = (engine.trajectories(prompts, env, spec, n=n, seed=seed, max_total_tokens=budget)
                    if engine is not None else
                    sample_trajectories(model, tokenizer, prompts, env, spec, n=n, seed=seed, max_total_tokens=budget,
                                        autocast_dtype=autocast_dtype))
    return [[{"completion": t.transcript, "num_tokens": t.num_tokens, "finish_reason": t.finish_reason,
              "verdict": env.score(p, t.text, t.num_tokens), "turns": t.turns, "tool_calls": t.tool_calls,
              "tool_errors": t.tool_errors} for t in ts] for p, ts in zip(prompts, trajs, strict=True)], \
        stats.seconds, stats.new_tokens


def eval_rows(mode: str, prompts: list[dict], answers: list[list[dict]]) -> list[dict]:
    """`eval` rows of one mode's answers (tool columns only where the answers have them)."""
    rows = []
    for prompt, group in zip(prompts, answers, strict=True):
        for i, a in enumerate(group):
            v = a["verdict"]
            rows.append({
                "prompt_id": prompt["id"], "task": prompt["task"], "mode": mode, "sample_index": i,
                "completion": a["completion"], "extracted": v.extracted, "answer": prompt["answer"],
                "correct": v.correct, "correct_lenient": v.correct_lenient, "format_ok": v.format_ok,
                "num_tokens": a["num_tokens"], "finish_reason": a["finish_reason"],
                **{k: a[k] for k in TOOL_COLUMNS if k in a},
            })
    return rows


def check_contamination(cfg: EvalConfig, prompts: list[dict], inputs: dict[str, Input],
                        ctx: StageContext) -> tuple[dict[str, float], dict]:
    """The held-out prompts against the `lineage.*` datasets: (metrics, the manifest's `extra` record), the record
    also logged as `contamination.json`. Above the threshold `contaminated` is 1, a warning says so, and with
    `fail_on_contamination` the eval stops here with one line."""
    lineage = sorted((k for k in inputs if k.startswith(LINEAGE_INPUT_PREFIX)), key=lambda k: inputs[k].fingerprint)
    held = [contamination.HeldOut(p["id"], contamination.user_text(p["messages"]), p["answer"]) for p in prompts]
    training = (row for k in lineage for row in contamination.training_rows(
        inputs[k].manifest.schema_name, inputs[k].table().to_pylist(), inputs[k].label, cfg.split))
    findings = contamination.find_contamination(held, training)
    datasets = [inputs[k].fingerprint for k in lineage]
    metrics = contamination.contamination_metrics(findings, len(datasets))
    metrics["contaminated"] = float(metrics["contamination/share"] > cfg.contamination_threshold)
    record = {"datasets": datasets, "examples": contamination.examples(findings)}
    with tempfile.TemporaryDirectory(prefix="r1flow-contamination-") as tmp:
        path = Path(tmp) / "contamination.json"
        path.write_text(contamination.report_json(findings, datasets))
        ctx.log_file(path)
    if metrics["contaminated"]:
        first = record["examples"][0]
        what = (f"{metrics['contamination/prompts']:.0f} of {len(prompts)} held-out prompts "
                f"({metrics['contamination/share']:.1%}) are in the model's training data, above "
                f"contamination_threshold {cfg.contamination_threshold:g}; e.g. {first['prompt_id']!r}: "
                + ", ".join(f"{k} in {v}" for k, v in first["matches"].items()))
        if cfg.fail_on_contamination:
            raise StageError(f"eval: {what} (fail_on_contamination)")
        ctx.log.warning("eval: contaminated: %s", what)
    return metrics, record


def run(cfg: EvalConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    prompt_table = inputs["prompts"].table("prompts")
    prompts = round_robin_prompts(prompt_table, cfg.split, cfg.max_prompts)
    if not prompts:
        raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r} to evaluate")
    check_scorer(cfg, inputs)
    contamination_metrics, contamination_record = check_contamination(cfg, prompts, inputs, ctx)
    seed_everything(ctx.seed)
    model, tokenizer = inputs["model"].load_model()
    model.to(ctx.device)
    greedy_spec = GenerationSpec(max_new_tokens=cfg.max_new_tokens, temperature=0.0, batch_size=cfg.batch_size,
                                 prefill=cfg.prefill)
    engine = (make_backend(GenerationSpec(backend="vllm"), model, tokenizer, inputs["model"], seed=ctx.seed)
              if cfg.backend == "vllm" else None)
    greedy, seconds, new_tokens = answer_prompts(cfg, model, tokenizer, prompts, greedy_spec, 1, ctx.seed,
                                                 "eval greedy", engine)
    rows = eval_rows("greedy", prompts, greedy)
    if cfg.pass_k and cfg.pass_k_prompts:
        sub = prompts[: cfg.pass_k_prompts]
        spec = GenerationSpec(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              prefill=cfg.prefill,
                              batch_size=max(1, cfg.batch_size // cfg.pass_k))
        sampled, s_seconds, s_tokens = answer_prompts(cfg, model, tokenizer, sub, spec, cfg.pass_k, ctx.seed + 1,
                                                      f"eval pass@{cfg.pass_k}", engine)
        rows += eval_rows("sampled", sub, sampled)
        seconds, new_tokens = seconds + s_seconds, new_tokens + s_tokens

    if engine is not None:
        engine.close()
    del model  # the scorer, if any, loads next
    metrics = summarize(rows, cfg.pass_k)
    for task in sorted({r["task"] for r in rows}):
        for name, value in summarize([r for r in rows if r["task"] == task], cfg.pass_k).items():
            if name in PER_TASK or name.startswith("pass_at_"):
                metrics[f"{task}/{name}"] = value
    metrics.update(slice_metrics(rows, task_slices(prompt_table.select(["task", "split"]).to_pylist()), cfg.pass_k))
    metrics["tokens_per_s"] = new_tokens / seconds if seconds else 0.0
    if cfg.rerank != "none":
        scored = cfg.rerank in ("orm", "prm")  # check_scorer made sure the scorer is wired then
        scores = sampled_scores(cfg, rows, prompts, inputs["scorer"], ctx.device) if scored else None
        metrics.update(rerank_metrics(rows, scores, cfg.rerank))
    metrics["prompts"] = float(len(prompts))
    metrics.update(contamination_metrics)
    ctx.log_metrics({k: v for k, v in metrics.items() if v == v})  # MLflow rejects NaN
    ctx.log.info("eval: accuracy %.3f, format rate %.3f, %.1f tokens/s",
                 metrics.get("accuracy", float("nan")), metrics.get("format_rate", float("nan")), metrics["tokens_per_s"])
    table = from_rows(rows, "eval", where="eval output")
    results = write_dataset(ctx, "results", table, "eval", metrics)
    results.extra["contamination"] = contamination_record
    return {"results": results}
