"""An artifact's lineage in the store: the datasets among its ancestors, read from the manifests' `parents`.

A stage that declares `LINEAGE_OF = "<input>"` (the eval, for its decontamination) gets those datasets as inputs named
`lineage.<fingerprint[:12]>` (`stages.base.LINEAGE_INPUT_PREFIX`), added where a node's cache key is made (the
pipeline's `node_key`, a single-stage run): the key then holds their fingerprints, so a check is reused exactly when
the model, its prompts and every dataset it descends from are the same.
"""

from __future__ import annotations

from types import ModuleType

from flows.store.artifacts import ArtifactStore
from schemas.errors import ArtifactError
from stages.base import LINEAGE_INPUT_PREFIX
from stages.math.contamination import TEXT_KINDS


def ancestor_datasets(store: ArtifactStore, fingerprint: str) -> list[str]:
    """The fingerprints of the datasets with text (`TEXT_KINDS`) among the ancestors of `fingerprint`, sorted: its
    manifest's parents, theirs, and so on (manifests only; no file is read). A parent missing from the store is one
    ArtifactError naming it and the artifact that names it."""
    seen: set[str] = set()
    found: list[str] = []
    todo = [fingerprint]
    while todo:
        child = todo.pop()
        for parent in store.read_manifest(child).parents:
            if parent in seen:
                continue
            seen.add(parent)
            try:
                manifest = store.read_manifest(parent)
            except ArtifactError as e:
                raise ArtifactError(f"the lineage of artifact {fingerprint[:12]}: {parent[:12]}, a parent of "
                                    f"{child[:12]}, cannot be read ({e}); its training data cannot be checked") from None
            if manifest.kind == "dataset" and manifest.schema_name in TEXT_KINDS:
                found.append(parent)
            todo.append(parent)
    return sorted(found)


def with_lineage(module: ModuleType, inputs: dict[str, str], store: ArtifactStore) -> dict[str, str]:
    """`inputs` plus, for a stage with `LINEAGE_OF`, the datasets among that input's ancestors as `lineage.*` inputs;
    `inputs` itself for any other stage."""
    of = getattr(module, "LINEAGE_OF", None)
    if of is None or of not in inputs:
        return inputs
    return {**inputs, **{f"{LINEAGE_INPUT_PREFIX}{fp[:12]}": fp for fp in ancestor_datasets(store, inputs[of])}}
