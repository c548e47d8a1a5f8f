"""Arrow schemas of every dataset kind (docs/design.md §2) and `validate(table, kind)`.

Chat turns are `list<struct<role: string, content: string>>`. `metadata` columns hold a JSON
string so that heterogeneous per-task details survive Arrow's fixed schema.
"""

from __future__ import annotations

import json
from typing import Literal

import pyarrow as pa

from schemas.errors import SchemaError

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
MESSAGES = pa.list_(MESSAGE)
ROLES = ("system", "user", "assistant")

DatasetKind = Literal["prompts", "sft", "samples", "preferences", "unpaired", "eval", "ref_logprobs", "steps"]


def _f(name: str, type_: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


SCHEMAS: dict[str, pa.Schema] = {
    "prompts": pa.schema([
        _f("id", pa.string()),
        _f("messages", MESSAGES),
        _f("answer", pa.string(), nullable=True),
        _f("task", pa.string()),
        _f("verifier", pa.string()),
        _f("split", pa.string()),
        _f("metadata", pa.string()),
    ]),
    "sft": pa.schema([
        _f("id", pa.string()),
        _f("messages", MESSAGES),
        _f("source", pa.string()),
        _f("metadata", pa.string()),
    ]),
    "samples": pa.schema([
        _f("prompt_id", pa.string()),
        _f("messages", MESSAGES),
        _f("completion", pa.string()),
        _f("sample_index", pa.int32()),
        _f("reward", pa.float64(), nullable=True),
        _f("reward_components", pa.string()),
        _f("correct", pa.bool_(), nullable=True),
        _f("num_tokens", pa.int32()),
        _f("finish_reason", pa.string()),
        _f("metadata", pa.string()),
    ]),
    "preferences": pa.schema([
        _f("id", pa.string()),
        _f("messages", MESSAGES),
        _f("chosen", pa.string()),
        _f("rejected", pa.string()),
        _f("chosen_score", pa.float64(), nullable=True),
        _f("rejected_score", pa.float64(), nullable=True),
        _f("source", pa.string()),
    ]),
    "unpaired": pa.schema([
        _f("id", pa.string()),
        _f("messages", MESSAGES),
        _f("completion", pa.string()),
        _f("label", pa.bool_()),
    ]),
    # Reference-model log-probs of every completion of a preference dataset (preference_optimization):
    # one row per (pair id, role); role chosen | rejected (pairs), desirable | undesirable (unpaired
    # rows), kl (the completion of the next row under this row's prompt: KTO's reference point).
    "ref_logprobs": pa.schema([
        _f("id", pa.string()),
        _f("role", pa.string()),
        _f("logp", pa.float64()),
        _f("tokens", pa.int32()),
    ]),
    "eval": pa.schema([
        _f("prompt_id", pa.string()),
        _f("task", pa.string()),
        _f("mode", pa.string()),  # "greedy" or "sampled"
        _f("sample_index", pa.int32()),
        _f("completion", pa.string()),
        _f("extracted", pa.string(), nullable=True),
        _f("answer", pa.string(), nullable=True),
        _f("correct", pa.bool_(), nullable=True),  # null: the verifier could not score
        _f("correct_lenient", pa.bool_(), nullable=True),  # answer may come from outside the answer block
        _f("format_ok", pa.bool_()),
        _f("num_tokens", pa.int32()),
        _f("finish_reason", pa.string()),
    ]),
    # A step-labelled solution (process reward models): the prompt turns, the solution cut into
    # steps, one label per step in [0, 1] (1: the step is right / leads to a verified answer; a soft
    # Monte-Carlo label is the share of rollouts from the step that do), and where the labels came from.
    "steps": pa.schema([
        _f("id", pa.string()),
        _f("messages", MESSAGES),
        _f("steps", pa.list_(pa.string())),
        _f("labels", pa.list_(pa.float64())),
        _f("source", pa.string()),
        _f("metadata", pa.string()),
    ]),
}

# Columns a dataset of the kind may carry and older readers and writers lack: kept by `validate` when present,
# never required. An eval sampled with a tool environment records each trajectory's model turns, the tool calls
# whose output it read, and how many of those failed; a single_turn eval writes none of them (its files, and so
# its fingerprints, are what they were).
OPTIONAL_COLUMNS: dict[str, pa.Schema] = {
    "eval": pa.schema([
        _f("turns", pa.int32(), nullable=True),
        _f("tool_calls", pa.int32(), nullable=True),
        _f("tool_errors", pa.int32(), nullable=True),
    ]),
}

JSON_COLUMNS = {"metadata", "reward_components"}
VALUE_SETS = {
    ("prompts", "split"): {"train", "eval"},
    ("eval", "mode"): {"greedy", "sampled"},
    ("samples", "finish_reason"): {"stop", "length"},
    ("eval", "finish_reason"): {"stop", "length"},
    ("ref_logprobs", "role"): {"chosen", "rejected", "desirable", "undesirable", "kl"},
}


def schema_for(kind: str) -> pa.Schema:
    try:
        return SCHEMAS[kind]
    except KeyError:
        raise SchemaError(f"unknown dataset kind {kind!r}; known kinds: {', '.join(SCHEMAS)}") from None


def _family(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def _types_compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Same logical type up to width/representation (`validate` casts to the exact one)."""
    if actual.equals(expected):
        return True
    fa, fe = _family(actual), _family(expected)
    if fa == "null":  # an all-null column: nullability decides
        return True
    if fe == "float" and fa == "int":
        return True
    if fa != fe:
        return False
    if fe == "list":
        item = expected.value_type
        got = actual.value_type
        if pa.types.is_null(got):  # only empty lists
            return True
        if pa.types.is_struct(item):
            if not pa.types.is_struct(got):
                return False
            got_fields = {got.field(i).name: got.field(i).type for i in range(got.num_fields)}
            return all(
                f.name in got_fields and _types_compatible(got_fields[f.name], f.type) for f in item
            )
        return _types_compatible(got, item)
    return True


def validate(table: pa.Table, kind: str, where: str = "dataset") -> pa.Table:
    """Check `table` against the schema of `kind`; return it cast to the exact schema.

    Raises SchemaError naming `where` (an artifact or file), the column and the problem.
    Extra columns are dropped (users' files often carry more), missing ones are errors; the kind's
    `OPTIONAL_COLUMNS` are kept where present.
    """
    names = set(table.column_names)
    schema = _with_optional(schema_for(kind), kind, names)
    for field in schema:
        if field.name not in names:
            raise SchemaError(
                f"{where}: missing column {field.name!r} required by kind {kind!r} "
                f"(has: {', '.join(table.column_names) or 'no columns'})"
            )
        col = table.column(field.name)
        if not _types_compatible(col.type, field.type):
            raise SchemaError(f"{where}: column {field.name!r} has type {col.type}, expected {field.type}")
        if not field.nullable and col.null_count:
            raise SchemaError(f"{where}: column {field.name!r} has {col.null_count} null value(s); it is required")
    try:
        out = table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise SchemaError(f"{where}: cannot cast to kind {kind!r}: {e}") from None
    _check_values(out, kind, where)
    return out


def _with_optional(schema: pa.Schema, kind: str, names: set[str] | list[str]) -> pa.Schema:
    """`schema` and, after it, those of the kind's optional columns that are among `names`."""
    extra = [f for f in OPTIONAL_COLUMNS.get(kind, pa.schema([])) if f.name in names]
    return pa.schema(list(schema) + extra) if extra else schema


def _check_values(table: pa.Table, kind: str, where: str) -> None:
    if "messages" in table.column_names:
        for i, msgs in enumerate(table.column("messages").to_pylist()):
            if not msgs:
                raise SchemaError(f"{where}: column 'messages' row {i}: empty conversation")
            for turn in msgs:
                if turn["role"] not in ROLES:
                    raise SchemaError(
                        f"{where}: column 'messages' row {i}: role {turn['role']!r} is not one of {ROLES}"
                    )
                if turn["content"] is None:
                    raise SchemaError(f"{where}: column 'messages' row {i}: a turn has null content")
            if kind == "sft" and msgs[-1]["role"] != "assistant":
                raise SchemaError(f"{where}: column 'messages' row {i}: an sft conversation must end with an assistant turn")
            if kind in ("prompts", "samples", "preferences", "unpaired", "steps") and msgs[-1]["role"] == "assistant":
                raise SchemaError(f"{where}: column 'messages' row {i}: a prompt must not end with an assistant turn")
    for name in JSON_COLUMNS & set(table.column_names):
        for i, value in enumerate(table.column(name).to_pylist()):
            try:
                json.loads(value)
            except (TypeError, json.JSONDecodeError) as e:
                raise SchemaError(f"{where}: column {name!r} row {i}: not valid JSON ({e})") from None
    for (k, col), allowed in VALUE_SETS.items():
        if k == kind:
            bad = set(table.column(col).to_pylist()) - allowed
            if bad:
                raise SchemaError(f"{where}: column {col!r} has value(s) {sorted(bad)}; allowed: {sorted(allowed)}")
    for key_col in ("id",):
        if key_col in table.column_names and kind in ("prompts", "sft", "preferences", "unpaired", "steps"):
            seen: set = set()
            for dup in table.column(key_col).to_pylist():
                if dup in seen:
                    raise SchemaError(f"{where}: column {key_col!r} has duplicate value {dup!r}")
                seen.add(dup)
    if kind == "steps":
        _check_steps(table, where)


def _check_steps(table: pa.Table, where: str) -> None:
    """Per row: at least one step, no blank step, one label per step, every label in [0, 1]."""
    for i, (steps, labels) in enumerate(zip(table.column("steps").to_pylist(), table.column("labels").to_pylist(),
                                            strict=True)):
        problem = _steps_problem(steps, labels)
        if problem:
            raise SchemaError(f"{where}: row {i}: column {problem[0]!r}: {problem[1]}")


def _steps_problem(steps: list, labels: list) -> tuple[str, str] | None:
    """(field, problem) of a row's steps and labels (already lists), or None when they are valid."""
    if not steps:
        return "steps", "no steps (a solution needs at least one)"
    for j, step in enumerate(steps):
        if not isinstance(step, str) or not step.strip():
            return "steps", f"step {j} is {'blank' if isinstance(step, str) else type(step).__name__}"
    if len(labels) != len(steps):
        return "labels", f"{len(labels)} value(s) for {len(steps)} step(s); one per step"
    for j, label in enumerate(labels):
        if label is None or not 0.0 <= label <= 1.0:  # NaN fails both comparisons
            return "labels", f"label {j} is {label}; labels are in [0, 1]"
    return None


def from_rows(rows: list[dict], kind: str, where: str = "dataset") -> pa.Table:
    """Build a validated table of `kind` from python dicts."""
    if not rows:
        return schema_for(kind).empty_table()
    schema = _with_optional(schema_for(kind), kind, rows[0])
    missing = [f.name for f in schema if f.name not in rows[0]]
    if missing:
        raise SchemaError(f"{where}: row 0 lacks field(s) {missing} required by kind {kind!r}")
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)
    return validate(table, kind, where)


# ---------------------------------------------------------------------------- step files

PRM800K_RATINGS = {1: 1.0, -1: 0.0}  # PRM800K's step ratings: +1 good, -1 bad; 0 (neutral) -> `neutral`


def read_steps_jsonl(path, neutral: float = 1.0) -> pa.Table:
    """A validated `steps` table from a user's JSON-lines file of step-labelled solutions.

    One JSON object per line (blank lines are skipped); keys (others are ignored):
      prompt    string: the question, one user turn              } exactly one of the two
      messages  list of {role, content} not ending with an assistant turn
      steps     non-empty list of non-blank strings, the solution's steps in order
      labels    one per step: true/false or a number in [0, 1]    } exactly one of the two
      ratings   one per step, PRM800K style: 1 (good) -> 1.0, -1 (bad) -> 0.0, 0 (neutral) -> `neutral`
      id        optional string, unique in the file (default "<file stem>-<line>")
      source    optional string (default "file:<file name>")
      metadata  optional object, kept as JSON
    e.g. {"prompt": "2+3*4?", "steps": ["3*4 = 12", "2 + 12 = 14"], "ratings": [1, 1]}

    The first problem raises ONE SchemaError naming the file, the line and the field. `neutral`
    defaults to 1.0: a neutral PRM800K step contains no mistake.
    """
    from pathlib import Path

    if not 0.0 <= neutral <= 1.0:
        raise ValueError(f"read_steps_jsonl: neutral={neutral} is not in [0, 1]")
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SchemaError(f"{path}: cannot read ({e})") from None
    rows, seen = [], set()
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}: line {n}"
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SchemaError(f"{where}: not UTF-8 text ({e})") from None
        except json.JSONDecodeError as e:
            raise SchemaError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise SchemaError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        row = _steps_record(rec, where, f"{path.stem}-{n}", f"file:{path.name}", neutral)
        if row["id"] in seen:
            raise SchemaError(f"{where}: field 'id': duplicate value {row['id']!r}")
        seen.add(row["id"])
        rows.append(row)
    if not rows:
        raise SchemaError(f"{path}: no step-labelled solutions (an empty file)")
    return from_rows(rows, "steps", where=str(path))


def _steps_record(rec: dict, where: str, default_id: str, default_source: str, neutral: float) -> dict:
    """One line of a step file as a `steps` row, or a SchemaError naming `where` and the field."""
    def bad(fld: str, problem: str) -> SchemaError:
        return SchemaError(f"{where}: field {fld!r}: {problem}")

    if ("prompt" in rec) == ("messages" in rec):
        raise bad("prompt", "give exactly one of 'prompt' (a string) or 'messages' (chat turns)")
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
            raise bad("prompt", "must be a non-blank string")
        messages = [{"role": "user", "content": rec["prompt"]}]
    else:
        messages = rec["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of {role, content} objects")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise bad("messages", f"turn {j} must be an object with a role in {ROLES} and string content")
        if messages[-1]["role"] == "assistant":
            raise bad("messages", "must not end with an assistant turn (the steps are the answer)")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    steps = rec.get("steps")
    if not isinstance(steps, list):
        raise bad("steps", f"must be a list of strings, got {type(steps).__name__ if 'steps' in rec else 'nothing'}")
    if ("labels" in rec) == ("ratings" in rec):
        raise bad("labels", "give exactly one of 'labels' (bool or [0, 1] per step) or 'ratings' (-1/0/1 per step)")
    fld = "labels" if "labels" in rec else "ratings"
    values = rec[fld]
    if not isinstance(values, list):
        raise bad(fld, f"must be a list, one per step, got {type(values).__name__}")
    labels = []
    for j, v in enumerate(values):
        if fld == "labels":
            ok = isinstance(v, bool) or (isinstance(v, int | float) and 0.0 <= v <= 1.0)
            if not ok:
                raise bad(fld, f"label {j} is {v!r}; expected true/false or a number in [0, 1]")
            labels.append(float(v))
        else:
            if isinstance(v, bool) or v not in (-1, 0, 1):
                raise bad(fld, f"rating {j} is {v!r}; expected -1, 0 or 1")
            labels.append(PRM800K_RATINGS.get(int(v), neutral))
    problem = _steps_problem(steps, labels)
    if problem:
        raise bad(fld if problem[0] == "labels" else "steps", problem[1])
    for key in ("id", "source"):
        if key in rec and not (isinstance(rec[key], str) and rec[key]):
            raise bad(key, "must be a non-empty string")
    meta = rec.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad("metadata", f"must be an object, got {type(meta).__name__}")
    return {"id": rec.get("id", default_id), "messages": messages, "steps": list(steps), "labels": labels,
            "source": rec.get("source", default_source), "metadata": json.dumps(meta, sort_keys=True, default=str)}
