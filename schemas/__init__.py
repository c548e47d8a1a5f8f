"""Data contracts of r1flow: dataset schemas, artifact manifest, stage and recipe configs."""

from schemas.configs import LoraSpec, ProfileConfig, RecipeConfig
from schemas.datasets import SCHEMAS, from_rows, schema_for, validate
from schemas.errors import ArtifactError, ConfigError, ModelError, R1FlowError, SchemaError

__all__ = [
    "SCHEMAS", "ArtifactError", "ConfigError", "LoraSpec", "ModelError",
    "ProfileConfig", "R1FlowError", "RecipeConfig", "SchemaError", "from_rows", "schema_for", "validate",
]
