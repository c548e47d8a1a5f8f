"""Arrow schemas of every dataset kind (DESIGN.md §2) and `validate(table, kind)`.

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

DatasetKind = Literal["prompts", "sft", "samples", "preferences", "unpaired", "eval", "ref_logprobs"]


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
    Extra columns are dropped (users' files often carry more), missing ones are errors.
    """
    schema = schema_for(kind)
    names = set(table.column_names)
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
            if kind in ("prompts", "samples", "preferences", "unpaired") and msgs[-1]["role"] == "assistant":
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
        if key_col in table.column_names and kind in ("prompts", "sft", "preferences", "unpaired"):
            seen: set = set()
            for dup in table.column(key_col).to_pylist():
                if dup in seen:
                    raise SchemaError(f"{where}: column {key_col!r} has duplicate value {dup!r}")
                seen.add(dup)


def from_rows(rows: list[dict], kind: str, where: str = "dataset") -> pa.Table:
    """Build a validated table of `kind` from python dicts."""
    schema = schema_for(kind)
    if not rows:
        return schema.empty_table()
    missing = [f.name for f in schema if f.name not in rows[0]]
    if missing:
        raise SchemaError(f"{where}: row 0 lacks field(s) {missing} required by kind {kind!r}")
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)
    return validate(table, kind, where)
