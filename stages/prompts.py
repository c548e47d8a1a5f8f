"""`prompts` stage: verifiable prompt sets from reasoning-gym tasks and users' files.

Each reasoning-gym task is generated with a seed derived from (stage seed, task name), so adding a
task never changes the prompts of another. Ids are content hashes of (task, question): the
train/eval split is a seeded permutation per task, so the same config always gives the same split.

A task named `NAME-LABEL` is reasoning-gym's NAME under a name of its own (`basic_arithmetic-phrased: {format_style:
natural}`): its own seed, ids and per-task metrics, so a variant of a trained task (new phrasings, a wider number
range) can be held out in `eval_tasks` beside the task itself. An `eval_tasks` question that is also a question of the
train split is dropped: held-out-only means no stage trains on it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from schemas.configs import PromptsConfig
from schemas.datasets import from_rows
from schemas.errors import ConfigError, SchemaError
from stages.base import Output, StageContext, json_type_name, read_user_table, record_where, write_dataset
from stages.rewards.answers import R1_SYSTEM_PROMPT
from stages.rewards.verifiers import VERIFIERS

VERSION = "1"  # history: CHANGELOG.md
CONFIG = PromptsConfig
INPUTS: dict[str, str] = {}
OUTPUTS = {"prompts": "prompts"}


def stable_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("\0".join(map(str, parts)).encode()).digest()[:4], "little")


def prompt_id(task: str, question: str) -> str:
    return hashlib.sha256(f"{task}\0{question}".encode()).hexdigest()[:16]


def generator(task: str) -> str:
    """The reasoning-gym dataset a task name generates from: `NAME-LABEL` (a variant under its own name) is NAME."""
    return task.split("-", 1)[0]


def check(cfg: PromptsConfig, node: str = "prompts") -> None:
    """Fail before any compute on unknown tasks, bad options, missing files or over-long prompts in them.

    `node`: the recipe node's name, for the `--set NODE.max_prompt_chars=N` an over-long prompt's error names.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    for section, tasks in (("tasks", cfg.tasks), ("eval_tasks", cfg.eval_tasks)):
        for name, opts in tasks.items():
            if generator(name) not in DATASETS:
                close = [d for d in DATASETS if generator(name).split("_")[0] in d][:5]
                raise ConfigError(
                    f"prompts.{section}: unknown reasoning-gym task {name!r}"
                    + (f" (did you mean: {', '.join(close)}?)" if close else "")
                )
            try:
                reasoning_gym.create_dataset(generator(name), size=1, seed=0, **opts)
            except Exception as e:  # the library raises assorted types for bad options
                raise ConfigError(f"prompts.{section}.{name}: invalid options {opts}: {e}") from None
    for f in cfg.files:
        p = Path(f)
        if not p.exists():
            raise ConfigError(f"prompts.files: {f} does not exist")
        if p.suffix not in (".parquet", ".jsonl", ".json"):
            raise ConfigError(f"prompts.files: {f}: expected .parquet or .jsonl")
        # schema errors name the file, row and column now; an over-long prompt its line, length and the limit
        file_rows(p, cfg.system_prompt or R1_SYSTEM_PROMPT, cfg.max_prompt_chars, node)


def cache_salt(cfg: PromptsConfig) -> str:
    """User files are inputs too: their content is part of the cache key."""
    h = hashlib.sha256()
    for f in cfg.files:
        h.update(Path(f).read_bytes())
    return h.hexdigest() if cfg.files else ""


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def prompt_chars(messages: list[dict[str, str]]) -> int:
    """A prompt's length as `max_prompt_chars` counts it: every message's content (system prompt included)."""
    return sum(len(m["content"]) for m in messages)


def _too_long(where: str, chars: int, limit: int, node: str, more: int = 0) -> str:
    return (f"{where}: the prompt is {chars:,} characters, over the limit of {limit:,} ({node}.max_prompt_chars, "
            f"counting every message's content, the system prompt included)"
            + (f"; {more} more row(s) of this file are over it too" if more else "")
            + f". Shorten or drop it, or raise the limit with --set {node}.max_prompt_chars={chars}")


def _split(n: int, eval_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask: True = eval. A seeded permutation, exactly round(n * fraction) eval rows."""
    n_eval = int(round(n * eval_fraction))
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(seed).permutation(n)[:n_eval]] = True
    return mask


def reasoning_gym_rows(task: str, opts: dict, size: int, seed: int, system: str,
                       max_chars: int | None = None, where: str = "", node: str = "prompts") -> list[dict]:
    """`where` (e.g. "prompts.tasks.chain_sum") names the task in the error of a prompt over `max_chars`."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(generator(task), size=size, seed=stable_seed(seed, task), **opts)
    rows, seen = [], set()
    for item, entry in enumerate(ds):
        pid = prompt_id(task, entry["question"])
        if pid in seen:  # procedural generators repeat easy items; keep ids unique
            continue
        seen.add(pid)
        messages = _messages(system, entry["question"])
        if max_chars is not None and prompt_chars(messages) > max_chars:  # never at the built-in tasks' defaults
            raise ConfigError(_too_long(f"{where or task}: generated item {item}", prompt_chars(messages), max_chars,
                                        node))
        meta = dict(entry.get("metadata") or {}, question=entry["question"])
        if task != generator(task):  # the verifier scores with metadata's source_dataset, else the row's task
            meta.setdefault("source_dataset", generator(task))
        rows.append({
            "id": pid,
            "messages": messages,
            "answer": None if entry.get("answer") is None else str(entry["answer"]),
            "task": task,
            "verifier": "reasoning_gym",
            "metadata": json.dumps(meta, default=str, sort_keys=True),
        })
    return rows


ROLES = ("system", "user", "assistant")


def _file_messages(at: Callable[[], str], value: Any) -> list[dict[str, str]]:
    """A row's `messages` as the chat template takes them, or a SchemaError naming file, line (`at()`) and column."""
    def bad(problem: str) -> SchemaError:
        return SchemaError(f"{at()}: column 'messages'{problem}")

    if not isinstance(value, list):
        raise bad(f" must be a list of {{role, content}} objects, got {json_type_name(value)}: {str(value)[:60]!r}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise bad(f"[{j}] must be an object with string 'role' and 'content', got {str(m)[:60]!r}")
        if m["role"] not in ROLES:
            raise bad(f"[{j}]: role {m['role']!r} unknown; known: {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise bad(" has no user message")
    return out


def _raw_chars(rec: dict, system: str) -> int:
    """`prompt_chars` of a record before it is validated (what is not text counts 0): the length check runs
    first, so that a file with one huge row fails at once, before its other rows are looked at."""
    if rec.get("messages"):
        value = rec["messages"]
        return sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), str)) \
            if isinstance(value, list) else 0
    question = rec.get("question")
    return len(system) + len(question) if isinstance(question, str) else 0


def check_lengths(path: Path, records: list[dict], system: str, max_chars: int, node: str = "prompts") -> None:
    """SchemaError naming the first record whose prompt is over `max_chars`: file, line, length, the key to raise."""
    over = [(i, n) for i, n in enumerate(_raw_chars(r, system) for r in records) if n > max_chars]
    if over:
        i, n = over[0]
        raise SchemaError(_too_long(record_where(path, i, len(records)), n, max_chars, node, more=len(over) - 1))


def _file_question(at: Callable[[], str], system: str, question: Any) -> list[dict[str, str]]:
    if isinstance(question, str) and question.strip():
        return _messages(system, question)
    if question is not None and not isinstance(question, str):
        raise SchemaError(f"{at()}: column 'question' must be text, got {json_type_name(question)}: "
                          f"{repr(question)[:60]}")
    raise SchemaError(f"{at()}: column 'question' is empty (and there are no 'messages')")


def file_rows(path: Path, system: str, max_chars: int | None = None, node: str = "prompts") -> list[dict]:
    """A user's prompt file as `prompts` rows; the first problem is one SchemaError naming the file, its line (row of
    a parquet file, from 1) and the column."""
    table = read_user_table(path)
    cols = set(table.column_names)
    if not {"question", "messages"} & cols:
        raise SchemaError(f"{path}: needs a 'question' or 'messages' column (has: {', '.join(sorted(cols))})")
    records = table.to_pylist()
    if max_chars is not None:
        check_lengths(path, records, system, max_chars, node)
    rows, first_seen = [], {}
    for i, rec in enumerate(records):
        at = functools.partial(record_where, path, i, len(records))  # read only for an error
        if rec.get("messages"):
            messages = _file_messages(at, rec["messages"])
        else:
            messages = _file_question(at, system, rec.get("question"))
        answer = rec.get("answer")
        if isinstance(answer, float) and not math.isfinite(answer):  # else it would become the target "nan"
            raise SchemaError(f"{at()}: column 'answer' is {answer}; leave it empty (null) for no answer")
        verifier = rec.get("verifier") or ("math" if answer is not None else "none")
        if verifier not in VERIFIERS:
            raise SchemaError(f"{at()}: column 'verifier' value {verifier!r} unknown; known: {sorted(VERIFIERS)}")
        split = rec.get("split")
        if split is not None and split not in ("train", "eval"):
            raise SchemaError(f"{at()}: column 'split' must be 'train' or 'eval', got {split!r}")
        task = rec.get("task") or f"file:{path.stem}"
        text = json.dumps(messages, sort_keys=True)
        rows.append({
            "id": str(rec["id"]) if rec.get("id") is not None else prompt_id(task, text),
            "messages": messages,
            "answer": None if answer is None else str(answer),
            "task": task,
            "verifier": verifier,
            "split": split,
            "metadata": json.dumps(rec.get("metadata") or {}, default=str, sort_keys=True),
        })
        seen = first_seen.setdefault(rows[-1]["id"], i)
        if seen != i and _content(rows[seen]) != _content(rows[-1]):
            raise SchemaError(f"{record_where(path, seen, len(records))} and {at().split(': ', 1)[1]}"
                              f": id {rows[-1]['id']!r} names two different prompts; give each its own id")
    return rows


def _content(row: dict) -> tuple:
    return row["messages"], row["answer"], row["verifier"], row["task"], row["split"], row["metadata"]


def without_repeats(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows with each id once (the first kept) and how many repeats were dropped. Repeats are the same prompt
    twice in a file (an id derives from the task and the messages, or is the file's own); file_rows has already
    refused an id that names two different prompts."""
    seen: set[str] = set()
    kept = [r for r in rows if not (r["id"] in seen or seen.add(r["id"]))]
    return kept, len(rows) - len(kept)


def build_prompts(cfg: PromptsConfig, seed: int, log: logging.Logger | logging.LoggerAdapter | None = None) -> list[dict]:
    system = cfg.system_prompt or R1_SYSTEM_PROMPT
    rows: list[dict] = []
    for task, opts in cfg.tasks.items():
        task_rows = reasoning_gym_rows(task, opts, cfg.size, seed, system, cfg.max_prompt_chars, f"prompts.tasks.{task}")
        for row, is_eval in zip(task_rows, _split(len(task_rows), cfg.eval_fraction, stable_seed(seed, task, "split")), strict=True):
            row["split"] = "eval" if is_eval else "train"
        rows += task_rows
    trained = {r["messages"][-1]["content"] for r in rows if r["split"] == "train"}
    for task, opts in cfg.eval_tasks.items():
        if task in cfg.tasks:
            raise ConfigError(f"prompts.eval_tasks: {task!r} is also a training task")
        held = reasoning_gym_rows(task, opts, cfg.eval_size, seed, system, cfg.max_prompt_chars,
                                  f"prompts.eval_tasks.{task}")
        kept = [dict(r, split="eval") for r in held if r["messages"][-1]["content"] not in trained]
        if len(kept) < len(held) and log is not None:  # a variant of a trained task can draw a trained question
            log.info("prompts: eval_tasks.%s: %d question(s) of the train split dropped", task, len(held) - len(kept))
        rows += kept
    for f in cfg.files:
        frows, repeats = without_repeats(file_rows(Path(f), system, cfg.max_prompt_chars))
        if repeats and log is not None:
            log.info("prompts: %s: %d repeated prompt(s) dropped (kept the first of each)", f, repeats)
        unsplit = [r for r in frows if r["split"] is None]
        for row, is_eval in zip(unsplit, _split(len(unsplit), cfg.eval_fraction, stable_seed(seed, f, "split")), strict=True):
            row["split"] = "eval" if is_eval else "train"
        rows += frows
    return rows


def run(cfg: PromptsConfig, inputs: dict, ctx: StageContext) -> dict[str, Output]:
    rows = build_prompts(cfg, ctx.seed, ctx.log)
    if not rows:
        raise ConfigError("prompts: the config produced no prompts (no tasks and no files)")
    table = from_rows(rows, "prompts", where="prompts output")
    metrics: dict[str, float] = {"rows": len(rows)}
    for split in ("train", "eval"):
        metrics[f"{split}_rows"] = sum(r["split"] == split for r in rows)
    for task in sorted({r["task"] for r in rows}):
        metrics[f"rows/{task}"] = sum(r["task"] == task for r in rows)
    ctx.log_metrics(metrics)
    ctx.log.info("prompts: %d rows (%d train, %d eval)", len(rows), metrics["train_rows"], metrics["eval_rows"])
    return {"prompts": write_dataset(ctx, "prompts", table, "prompts", metrics)}
