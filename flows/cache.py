"""Cache keys (docs/design.md §2): sha256 of stage name, VERSION, canonical config, input fingerprints, seed
and salt."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def cache_key(stage: str, version: str, config: dict[str, Any], inputs: dict[str, str], seed: int, salt: str = "") -> str:
    """`salt` carries content the config only names (a user's file, a local model directory)."""
    payload = {"stage": stage, "version": version, "config": config, "inputs": dict(sorted(inputs.items())), "seed": seed}
    if salt:
        payload["salt"] = salt
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
