"""`preference_data` stage: chosen/rejected pairs from scored samples, plus users' own pairs.

Per prompt, samples are ranked by reward; pair i is (i-th best, i-th worst) while they are
distinct samples, the margin is at least `min_margin` and (with `drop_ties`) the scores differ.
Pairs are balanced per task (every task capped at the smallest task's count, seeded choice), so a
task the model finds easy does not dominate. Also emits an `unpaired` dataset (chosen → True,
rejected → False) for KTO.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from schemas.configs import PreferenceDataConfig
from schemas.datasets import from_rows
from schemas.errors import ConfigError, SchemaError
from stages.base import (
    Input,
    Output,
    StageContext,
    json_type_name,
    read_user_table,
    record_where,
    write_dataset,
)

VERSION = "1"  # history: CHANGELOG.md
CONFIG = PreferenceDataConfig
INPUTS = {"samples": "samples"}
OUTPUTS = {"preferences": "preferences", "unpaired": "unpaired"}


def check(cfg: PreferenceDataConfig) -> None:
    for f in cfg.files:
        p = Path(f)
        if not p.exists():
            raise ConfigError(f"preference_data.files: {f} does not exist")
        user_pairs(read_user_table(p), str(p))  # names the file, row and column now, before any compute


def cache_salt(cfg: PreferenceDataConfig) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in cfg.files:
        h.update(Path(f).read_bytes())
    return h.hexdigest() if cfg.files else ""


def pairs_from_samples(samples: list[dict], cfg: PreferenceDataConfig) -> list[dict]:
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        if s["reward"] is not None:
            by_prompt[s["prompt_id"]].append(s)
    pairs = []
    for pid in sorted(by_prompt):
        ranked = sorted(by_prompt[pid], key=lambda s: (-s["reward"], s["sample_index"]))
        for i in range(cfg.pairs_per_prompt):
            j = len(ranked) - 1 - i
            if i >= j:
                break
            chosen, rejected = ranked[i], ranked[j]
            margin = chosen["reward"] - rejected["reward"]
            if (cfg.drop_ties and margin == 0) or margin < cfg.min_margin:
                break  # later pairs are closer still
            if chosen["completion"] == rejected["completion"]:
                continue
            pairs.append({
                "id": f"{pid}-{i}", "messages": chosen["messages"], "chosen": chosen["completion"],
                "rejected": rejected["completion"], "chosen_score": chosen["reward"],
                "rejected_score": rejected["reward"], "source": "samples",
                "task": json.loads(chosen["metadata"]).get("task", ""),
            })
    return pairs


def balance(pairs: list[dict], seed: int) -> list[dict]:
    """Cap every task at the smallest task's pair count (seeded choice, original order kept)."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(pairs):
        by_task[p["task"]].append(i)
    if len(by_task) < 2:
        return pairs
    cap = min(len(v) for v in by_task.values())
    rng = np.random.default_rng(seed)
    keep = {i for idx in by_task.values() for i in rng.choice(idx, size=cap, replace=False).tolist()}
    return [p for i, p in enumerate(pairs) if i in keep]


def _completion(value, at: Callable[[], str], col: str) -> tuple[list[dict] | None, str]:
    """A completion given as text, or as a conversation whose last turn is the assistant's."""
    if isinstance(value, str):
        return None, value
    if isinstance(value, list) and value and value[-1].get("role") == "assistant":
        return [{"role": m["role"], "content": m["content"]} for m in value[:-1]], value[-1]["content"]
    raise SchemaError(f"{at()}: column {col!r} must be text or a conversation ending with an assistant turn, got "
                      f"{json_type_name(value)}: {repr(value)[:60]}")


def user_pairs(table: pa.Table, where: str) -> list[dict]:
    """Preference pairs from a user's file (or a dataset) `where`; the first problem is one SchemaError naming it,
    the line (a row from 1 where there are no lines) and the column."""
    cols = set(table.column_names)
    for col in ("chosen", "rejected"):
        if col not in cols:
            raise SchemaError(f"{where}: missing column {col!r} (has: {', '.join(sorted(cols))})")
    records = table.to_pylist()
    pairs = []
    for i, rec in enumerate(records):
        at = functools.partial(record_where, where, i, len(records))  # read only for an error
        conv_c, chosen = _completion(rec["chosen"], at, "chosen")
        _, rejected = _completion(rec["rejected"], at, "rejected")
        if rec.get("messages"):
            messages = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
        elif isinstance(rec.get("prompt"), str) and rec["prompt"].strip():
            messages = [{"role": "user", "content": rec["prompt"]}]
        elif conv_c:
            messages = conv_c
        else:
            raise SchemaError(f"{at()}: needs a 'prompt' or 'messages' column (or conversations in 'chosen')")
        pairs.append({"id": f"{Path(where).stem}-{i}", "messages": messages, "chosen": chosen, "rejected": rejected,
                      "chosen_score": rec.get("chosen_score"), "rejected_score": rec.get("rejected_score"),
                      "source": where, "task": f"file:{Path(where).stem}"})
    return pairs


def hf_pairs(name: str, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # hub errors come in many types
        raise ConfigError(f"preference_data.hf_dataset: cannot load {name!r} (split {split!r}): {e}") from None
    return user_pairs(ds.data.table if hasattr(ds.data, "table") else ds.to_arrow(), f"hf:{name}")


def run(cfg: PreferenceDataConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    samples = inputs["samples"].table("samples").to_pylist()
    pairs = pairs_from_samples(samples, cfg)
    if cfg.balance_tasks:
        pairs = balance(pairs, ctx.seed)
    for f in cfg.files:
        pairs += user_pairs(read_user_table(Path(f)), f)
    if cfg.hf_dataset:
        pairs += hf_pairs(cfg.hf_dataset, cfg.hf_split)
    if not pairs:
        raise SchemaError(f"{inputs['samples'].label}: no preference pairs: every prompt's samples scored within "
                          f"min_margin={cfg.min_margin} of each other (lower it, or sample more per prompt)")
    unpaired = [u for p in pairs for u in (
        {"id": f"{p['id']}-c", "messages": p["messages"], "completion": p["chosen"], "label": True},
        {"id": f"{p['id']}-r", "messages": p["messages"], "completion": p["rejected"], "label": False})]
    margins = [p["chosen_score"] - p["rejected_score"] for p in pairs
               if p["chosen_score"] is not None and p["rejected_score"] is not None]
    metrics = {"pairs": float(len(pairs)), "prompts_with_samples": float(len({s["prompt_id"] for s in samples})),
               "mean_margin": float(np.mean(margins)) if margins else 0.0}
    for task in sorted({p["task"] for p in pairs}):
        metrics[f"{task}/pairs"] = float(sum(p["task"] == task for p in pairs))
    ctx.log_metrics(metrics)
    prefs = from_rows([{k: v for k, v in p.items() if k != "task"} for p in pairs], "preferences")
    return {"preferences": write_dataset(ctx, "preferences", prefs, "preferences", metrics),
            "unpaired": write_dataset(ctx, "unpaired", from_rows(unpaired, "unpaired"), "unpaired", metrics)}
