"""The artifact manifest and the file names inside an artifact, declared once."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FILE = "manifest.json"
DATA_FILE = "data.parquet"  # dataset artifacts: one parquet file
MODEL_DIR = "model"  # model artifacts: save_pretrained output (full weights or a PEFT adapter)

ArtifactKindName = Literal["dataset", "model"]


class Producer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str
    node: str = ""
    stage_version: str
    config_hash: str
    cache_key: str = ""
    mlflow_run_id: str | None = None
    flow_run_id: str | None = None
    host: str | None = None  # the machine the stage ran on
    ray_node_id: str | None = None  # its Ray node, when the run was on a cluster


class Manifest(BaseModel):
    """`manifest.json` of an artifact. Written last: an artifact without it is incomplete."""

    model_config = ConfigDict(extra="forbid")

    kind: ArtifactKindName
    schema_: str = Field(alias="schema", description="dataset kind, or 'model' / 'adapter'")
    fingerprint: str
    files: dict[str, str] = Field(description="relative path -> sha256 of its bytes")
    rows: int | None = None
    producer: Producer
    parents: list[str] = Field(default_factory=list)
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    metrics: dict[str, float] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict, description="e.g. base model fingerprint of an adapter")
    digest: str | None = Field(None, description="sha256 of the canonical JSON of every other field, set when "
                               "published: an edited field no longer matches it (None: published before digests)")

    @property
    def schema_name(self) -> str:
        return self.schema_

    def content_digest(self) -> str:
        """sha256 of the manifest's fields but `digest`, as canonical JSON (sorted keys, no spaces)."""
        fields = self.model_dump(mode="json", by_alias=True, exclude={"digest"})
        return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def sealed(self) -> Manifest:
        """This manifest with its digest set (what is published)."""
        return self.model_copy(update={"digest": self.content_digest()})

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)
