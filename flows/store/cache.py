"""Cache keys (docs/design.md §2): sha256 of stage name, VERSION, canonical config, input fingerprints, seed
and salt."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from schemas.configs import placement_free

if TYPE_CHECKING:
    from flows.store.artifacts import ArtifactStore, CacheRecord


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def cache_key(stage: str, version: str, config: dict[str, Any], inputs: dict[str, str], seed: int, salt: str = "") -> str:
    """`salt` carries content the config only names (a user's file, a local model directory)."""
    payload = {"stage": stage, "version": version, "config": placement_free(config), "inputs": dict(sorted(inputs.items())), "seed": seed}
    if salt:
        payload["salt"] = salt
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def reusable_record(store: ArtifactStore, key: str, node: str, log: Callable[[str], Any] = print) -> CacheRecord | None:
    """The cache record of `key` if its outputs verify (`ArtifactStore.lookup`). A record whose output is damaged
    (a file edited, missing or added, an edited manifest) is not reused: the node computes again, and one line per
    damaged output says so, naming the node, the output, the artifact and why."""
    damaged: list[tuple[str, str]] = []
    record = store.lookup(key, damaged)
    for output, why in damaged:
        log(f"r1flow: {node}: its cached output {output!r} cannot be reused ({why}); computing {node} again")
    return record
