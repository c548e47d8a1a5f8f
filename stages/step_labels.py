"""`step_labels` stage: automatic step labels for process reward models, Math-Shepherd style.

Wang et al. 2024, "Math-Shepherd", https://arxiv.org/abs/2312.08935, §3.3: take sampled solutions,
cut each into steps, roll out K completions with the policy from the prefix that ends at every step,
verify their answers, and label the step by the share that reach a verified answer (soft
estimation) or by whether any does (hard estimation). The labels (`stages.math.steps.mc_labels`)
make a `steps` dataset for the `prm` stage.

Solutions come from the `solutions` input (a `samples` dataset, e.g. rejection_sampling's scored
samples, right and wrong; or an `sft` dataset whose last turn is the solution), else they are
sampled here from the model, `solutions_per_prompt` per prompt. Either way each solution is
re-verified against its prompts row (matched by prompt id, else by its prompt turns).

Departures from the paper, on purpose:
- the last step of a solution that ended on its own (EOS or a stop string) is labelled by the
  solution's own verdict instead of K rollouts (nothing is left to roll out: the answer is there);
- steps beyond `max_steps` are folded into the last kept step (`cap_spans`), so the solution's end,
  where its outcome is known, is always a step end;
- rollouts the verifier cannot score are left out of the share; a step none of whose rollouts
  could be scored ends the solution's labelled steps there (a label is never a silent 0).

With `environment:` other than single_turn (the python tool, a user's file), solutions and rollouts are
multi-turn trajectories (`sampling.multiturn`, r1flow's decode loop): a solution's steps are cut from its
transcript, the tool's output included, so a step may end inside an observation and its rollouts then
continue it as the model's own text; each rollout continues its transcript prefix with the tool (the
prefix is prefilled as text, its earlier turns do not count against `max_turns`). Verdicts judge the
model's own text only (`Sampled.own`; a rollout's prefix without the tool's answers, `without_observations`):
an answer a program printed earns no label. Solutions from a `solutions` input carry no record of their
observations and are verified as written.

Cost: rollouts = K x (steps - 1) per solution at most. The prefixes of several solutions are rolled
out in one generate call (a prefill per prompt), each prompt (chat template + prefix) prefilled once
for its K samples, so the decode runs `generation.batch_size` prefixes x K rows at a time. Each
group of solutions is journaled when labelled (`Journal`): a killed run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from schemas.configs import StepLabelsConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, seed_everything, write_dataset
from stages.environments.registry import check_sampling_environment, environment_from_spec, environment_salt
from stages.math.steps import cap_spans, mc_labels, step_spans
from stages.rewards.verifiers import score
from stages.runtime.seeds import seed_stream
from stages.sampling.generation import make_backend, release
from stages.sampling.multiturn import sample_trajectories
from stages.training.checkpoints import replace_synced
from stages.training.optim import resolve_precision

VERSION = "3"  # history: CHANGELOG.md
SAMPLES = True  # its outputs depend on what the samplers draw: SAMPLER_VERSION is in its key
CONFIG = StepLabelsConfig
INPUTS = {"model": "model", "prompts": "prompts", "solutions": "samples|sft?"}
OUTPUTS = {"steps": "steps"}


@dataclass(frozen=True)
class Solution:
    prompt: dict  # its prompts row (answer, verifier)
    text: str  # the completion, prefill included (with a tool: the transcript, observations included)
    finish_reason: str  # "stop" | "length"
    index: int  # which solution of this prompt
    own: str | None = None  # what is verified, when not `text`: the model's own text (no observations)
    observations: tuple[str, ...] = ()  # a tool's answers in `text`, in order (sampled here with an environment)


def verdict(prompt: dict, text: str, cfg: StepLabelsConfig) -> bool | None:
    """Whether `text` reaches the verified answer (None: the verifier could not score it)."""
    v = score(prompt, text, cfg.reward)
    return v.correct if cfg.correctness == "strict" else v.correct_lenient


def check(cfg: StepLabelsConfig) -> None:
    """Before any compute: the environment loads; only r1flow's decode loop runs multi-turn rollouts."""
    check_sampling_environment("step_labels", cfg.environment, cfg.reward, cfg.generation.backend)


def cache_salt(cfg: StepLabelsConfig) -> str:
    """A user environment file's bytes; nothing for a built-in (its code moves with VERSION)."""
    return environment_salt(cfg.environment)


@dataclass(frozen=True)
class Sampled:
    """One sampled continuation: `text` (prefill included; with a tool, the transcript), `own` (what is
    verified: the prefill and the model's own turns, the same as `text` without a tool) and the tool's answers."""

    text: str
    own: str
    finish_reason: str
    observations: tuple[str, ...] = ()


def without_observations(text: str, observations: tuple[str, ...], end: int | None = None) -> str:
    """`text[:end]` with each observation of `text` cut out (found in order, each after the previous one; one
    that `end` cuts through is cut as far as it goes); an observation not in `text` as written (a template's
    special tokens, which decoding drops) stays.

    >>> without_observations("a<o>1</o>b<o>2</o>c", ("<o>1</o>", "<o>2</o>"))
    'abc'
    >>> without_observations("a<o>1</o>b<o>2</o>c", ("<o>1</o>", "<o>2</o>"), end=12)
    'ab'
    """
    end = len(text) if end is None else end
    out, pos = [], 0
    for obs in observations:
        i = text.find(obs, pos)
        if i < 0:
            continue
        if i >= end:
            break
        out.append(text[pos:i])
        pos = i + len(obs)
    return "".join(out) + text[pos:end] if pos < end else "".join(out)


class Sampler:
    """Samples `n` continuations of each prompts row, single-turn (a generation backend) or with an environment
    (multi-turn trajectories on the model's KV cache)."""

    def __init__(self, backend=None, env=None, model=None, tokenizer=None, max_total_tokens=None, autocast_dtype=None):
        self.backend, self.env, self.model, self.tokenizer = backend, env, model, tokenizer
        self.max_total_tokens, self.autocast_dtype = max_total_tokens, autocast_dtype

    def sample(self, rows: list[dict], spec, n: int, seed: int, prefills: list[str] | None = None,
               desc: str = "", progress: bool = True) -> list[list[Sampled]]:
        if self.env is None:
            comps, _ = self.backend.generate([r["messages"] for r in rows], spec, n=n, seed=seed, progress=progress,
                                             prefills=prefills, **({"desc": desc} if desc else {}))
            return [[Sampled(c.text, c.text, c.finish_reason) for c in cs] for cs in comps]
        trajs, _ = sample_trajectories(self.model, self.tokenizer, rows, self.env, spec, n=n, seed=seed,
                                       max_total_tokens=self.max_total_tokens, autocast_dtype=self.autocast_dtype,
                                       prefills=prefills)
        return [[Sampled(t.transcript, t.text, t.finish_reason, t.observations) for t in ts] for ts in trajs]


def _prompt_key(messages: list[dict]) -> str:
    return json.dumps([[m["role"], m["content"]] for m in messages])


def solutions_from_input(data: Input, prompts: list[dict]) -> list[Solution]:
    """The solutions of a `samples` or `sft` dataset, each matched to its prompts row."""
    by_id = {p["id"]: p for p in prompts}
    by_turns = {_prompt_key(p["messages"]): p for p in prompts}
    kind = data.manifest.schema_name
    out, seen = [], {}
    for i, row in enumerate(data.table(kind).to_pylist()):
        if kind == "samples":
            turns, text, finish = row["messages"], row["completion"], row["finish_reason"]
            prompt = by_id.get(row["prompt_id"]) or by_turns.get(_prompt_key(turns))
        else:  # sft: the last (assistant) turn is the solution
            turns, text, finish = row["messages"][:-1], row["messages"][-1]["content"], "stop"
            pid = json.loads(row["metadata"]).get("prompt_id")
            prompt = by_id.get(pid) or by_turns.get(_prompt_key(turns))
        if prompt is None:
            raise SchemaError(f"{data.label}: row {i}: its prompt is not in the prompts input (matched by prompt id, "
                              "then by the prompt turns); label solutions of the prompts they were sampled from")
        seen[prompt["id"]] = seen.get(prompt["id"], -1) + 1
        out.append(Solution(prompt, text, finish, seen[prompt["id"]]))
    return out


def select(solutions: list[Solution], max_solutions: int, seed: int) -> list[Solution]:
    """At most `max_solutions`, a seeded subset kept in input order."""
    if len(solutions) <= max_solutions:
        return solutions
    keep = np.random.default_rng(seed_stream(seed, "select_solutions")).permutation(len(solutions))[:max_solutions]
    return [solutions[i] for i in sorted(keep.tolist())]


@dataclass(frozen=True)
class Plan:
    """One solution's steps (character spans of its text), its own verdict, and the steps to roll out."""

    spans: list[tuple[int, int]]
    own: bool | None
    rolled: list[int]  # indices of the steps whose prefixes are rolled out (all but a finished solution's last)


def plan_solution(sol: Solution, cfg: StepLabelsConfig) -> Plan:
    """Step i < last (or the last of a solution cut by the token limit) is labelled from K rollouts of the
    prefix text[:end_i]; the last step of a finished solution by its own verdict."""
    spans = cap_spans(step_spans(sol.text, cfg.delimiter), cfg.max_steps) if sol.text.strip() else []
    last_own = sol.finish_reason == "stop"
    rolled = [i for i in range(len(spans)) if not (last_own and i == len(spans) - 1)]
    return Plan(spans, verdict(sol.prompt, sol.own if sol.own is not None else sol.text, cfg), rolled)


def label_plan(sol: Solution, plan: Plan, rollouts: dict[int, list[str]],
               cfg: StepLabelsConfig) -> tuple[list[str], list[float], dict]:
    """(steps, labels, details) of one solution from the texts of its prefixes' rollouts (`rollouts[i]`:
    prefix i + continuation, K of them); no steps when it has none or its first step has no label."""
    outcomes = [[verdict(sol.prompt, t, cfg) for t in rollouts[i]] if i in rollouts else [plan.own]
                for i in range(len(plan.spans))]
    rolled = [len(rollouts[i]) if i in rollouts else 0 for i in range(len(plan.spans))]
    labels = mc_labels(outcomes, cfg.label)
    n = next((i for i, lab in enumerate(labels) if lab is None), len(labels))  # labelled prefix of the steps
    details = {"correct": plan.own, "rollouts": rolled[:n], "rollouts_correct": [sum(x is True for x in o) for o in outcomes[:n]],
               "unlabelled_steps": len(plan.spans) - n, "rollouts_generated": sum(rolled)}
    return [sol.text[s:e] for s, e in plan.spans[:n]], [float(x) for x in labels[:n]], details


def prefix_batches(plans: list[Plan], prefixes: int) -> list[range]:
    """Consecutive solutions grouped so that each group has at least `prefixes` prefixes to roll out (the last
    group: whatever is left): one generate call per group, its prefixes batched together."""
    out, start, count = [], 0, 0
    for k, plan in enumerate(plans):
        count += len(plan.rolled)
        if count >= prefixes:
            out.append(range(start, k + 1))
            start, count = k + 1, 0
    if start < len(plans):
        out.append(range(start, len(plans)))
    return out


class Journal:
    """The labels of each finished group of solutions, one file per group under the stage's checkpoint directory,
    so a killed run resumes at the first unfinished group. A group's rollouts are drawn from its own seed
    (`seed_stream(seed, "step_rollouts", group)`), so a resumed run labels exactly what an unbroken one does.

    Each file is written to a temporary name, fsync'ed and renamed (a kill leaves a whole file or none); it
    names its solutions (prompt id, index and a hash of the texts), and one that does not match the group, or
    cannot be read, is labelled again. The pipeline deletes the directory once the artifact is published."""

    def __init__(self, root: Path | None, log=None):
        self.root = root / "step_labels" if root is not None else None
        self.log = log
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def path(self, group: int) -> Path:
        return self.root / f"group-{group:05d}.json"

    @staticmethod
    def names(solutions: list[Solution]) -> dict:
        digest = hashlib.sha256("\0".join(s.text for s in solutions).encode()).hexdigest()
        return {"solutions": [f"{s.prompt['id']}-{s.index}" for s in solutions], "texts_sha256": digest}

    def load(self, group: int, solutions: list[Solution]) -> list | None:
        if self.root is None or not self.path(group).exists():
            return None
        try:
            saved = json.loads(self.path(group).read_text())
            if {k: saved.get(k) for k in ("solutions", "texts_sha256")} != self.names(solutions):
                raise ValueError("other solutions")
            results = [(r["steps"], r["labels"], r["details"]) for r in saved["results"]]
            if len(results) != len(solutions):
                raise ValueError(f"{len(results)} results for {len(solutions)} solutions")
            return results
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if self.log is not None:
                self.log.warning("step_labels: %s is not this group's labels (%s); labelling it again",
                                 self.path(group), e)
            return None

    def save(self, group: int, solutions: list[Solution], results: list) -> None:
        if self.root is None:
            return
        body = self.names(solutions) | {"results": [{"steps": st, "labels": lb, "details": d} for st, lb, d in results]}
        replace_synced(self.path(group), lambda p: p.write_text(json.dumps(body)))


def label_solutions(solutions: list[Solution], sampler: Sampler, cfg: StepLabelsConfig, seed: int,
                    journal: Journal | None = None) -> list[tuple[list[str], list[float], dict]]:
    """(steps, labels, details) per solution. The step prefixes of several solutions go through one generate
    call (`prefills`, one per prefix; each prefilled once for its K rollouts), so the decode runs batches of
    `generation.batch_size` prefixes x K rows rather than K rows at a time. Groups already in `journal` are
    read back, not rolled out again."""
    journal = journal or Journal(None)
    plans = [plan_solution(sol, cfg) for sol in solutions]
    out: list[tuple[list[str], list[float], dict]] = []
    bar = tqdm(total=len(solutions), desc="step_labels: rollouts", unit="solution")
    resumed = 0
    for c, group in enumerate(prefix_batches(plans, 4 * cfg.generation.batch_size)):
        sols = [solutions[k] for k in group]
        done = journal.load(c, sols)
        if done is not None:
            out.extend(done)
            resumed += len(group)
            bar.update(len(group))
            continue
        jobs = [(k, i) for k in group for i in plans[k].rolled]
        texts: list[list[str]] = []
        if jobs:
            prefixes = [solutions[k].text[: plans[k].spans[i][1]] for k, i in jobs]
            comps = sampler.sample([solutions[k].prompt for k, _ in jobs], cfg.generation, n=cfg.rollouts,
                                   seed=seed_stream(seed, "step_rollouts", c), progress=False, prefills=prefixes)
            # what is verified: the prefix without the tool's answers, then the rollout's own turns
            texts = [[without_observations(solutions[k].text, solutions[k].observations, len(prefix))
                      + x.own[len(prefix):] for x in cs] for (k, _), prefix, cs in zip(jobs, prefixes, comps, strict=True)]
        by_solution: dict[int, dict[int, list[str]]] = {k: {} for k in group}
        for (k, i), ts in zip(jobs, texts, strict=True):
            by_solution[k][i] = ts
        results = [label_plan(solutions[k], plans[k], by_solution[k], cfg) for k in group]
        journal.save(c, sols, results)
        out.extend(results)
        bar.update(len(group))
    bar.close()
    if resumed and journal.log is not None:
        journal.log.info("step_labels: resumed: %d of %d solutions were labelled before", resumed, len(solutions))
    return out


def run(cfg: StepLabelsConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    all_prompts = inputs["prompts"].table("prompts").to_pylist()
    data = inputs.get("solutions")
    prompts = [p for p in all_prompts if p["split"] == cfg.split][: cfg.max_prompts]
    solutions = solutions_from_input(data, all_prompts) if data is not None else None  # validated before loading
    if data is None and not prompts:
        raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r} to sample solutions for")
    seed_everything(ctx.seed)
    model, tokenizer = inputs["model"].load_model()
    model.to(ctx.device)
    precision = resolve_precision(cfg.precision, ctx.device)
    if cfg.environment.is_single_turn:
        sampler = Sampler(make_backend(cfg.generation, model, tokenizer, inputs["model"],
                                       autocast_dtype=precision))
    else:
        sampler = Sampler(env=environment_from_spec(cfg.environment, cfg.reward), model=model, tokenizer=tokenizer,
                          max_total_tokens=cfg.environment.token_budget(cfg.generation.max_new_tokens),
                          autocast_dtype=precision)
    if solutions is None:
        comps = sampler.sample(prompts, cfg.generation, n=cfg.solutions_per_prompt, seed=ctx.seed,
                               desc="step_labels: solutions")
        solutions = [Solution(p, c.text, c.finish_reason, j, own=c.own if c.own != c.text else None,
                              observations=c.observations)
                     for p, cs in zip(prompts, comps, strict=True) for j, c in enumerate(cs)]
    solutions = select(solutions, cfg.max_solutions, ctx.seed)

    rows, dropped, n_rollouts, correct = [], 0, 0, []
    labelled = label_solutions(solutions, sampler, cfg, ctx.seed, Journal(ctx.checkpoint_dir, ctx.log))
    release(sampler.backend)
    for sol, (steps, labels, details) in zip(solutions, labelled, strict=True):
        n_rollouts += details["rollouts_generated"]
        correct.append(details["correct"])
        if not steps:
            dropped += 1
            continue
        rows.append({
            "id": f"{sol.prompt['id']}-{sol.index}", "messages": sol.prompt["messages"], "steps": steps,
            "labels": labels, "source": "step_labels",
            "metadata": json.dumps({"prompt_id": sol.prompt["id"], "task": sol.prompt["task"],
                                    "answer": sol.prompt["answer"], "finish_reason": sol.finish_reason,
                                    "label": cfg.label, "delimiter": cfg.delimiter, **details}, sort_keys=True),
        })
    if not rows:
        raise SchemaError(f"step_labels: none of {len(solutions)} solution(s) has a labelled step (no steps, or no "
                          "rollout of a first step could be scored)")
    all_labels = [x for r in rows for x in r["labels"]]
    scored = [c for c in correct if c is not None]
    metrics = {
        "solutions": float(len(rows)),
        "solutions_dropped": float(dropped),
        "solution_accuracy": float(np.mean(scored)) if scored else 0.0,
        "steps": float(len(all_labels)),
        "steps_per_solution": len(all_labels) / len(rows),
        "rollouts": float(n_rollouts),
        "label_mean": float(np.mean(all_labels)),
        "positive_step_share": float(np.mean([x >= 0.5 for x in all_labels])),
    }
    ctx.log_metrics(metrics)
    ctx.log.info("step_labels: %d solutions, %d steps (%.0f%% labelled right), %d rollouts", len(rows),
                 len(all_labels), 100 * metrics["positive_step_share"], n_rollouts)
    return {"steps": write_dataset(ctx, "steps", from_rows(rows, "steps"), "steps", metrics)}
