"""The sampler's version in the cache keys of the stages that sample (`stages.stage_version`): a bump of
`SAMPLER_VERSION` moves the key of every sampling node and of no other, and at today's version every key is
what the stage's VERSION alone made it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from flows.plan.recipes import load_plan
from flows.run import pipeline
from flows.store.cache import cache_key
from stages import SAMPLER_BASELINE, STAGE_MODULES, get_stage, sampling, stage_version

ROOT = Path(__file__).resolve().parent.parent


def _keys(plan) -> dict[str, str]:
    upstream = defaultdict(lambda: defaultdict(lambda: "f" * 64))  # any upstream output: one fingerprint
    return {n.name: pipeline.node_key(n, upstream)[0] for n in plan.nodes}


def test_a_sampler_bump_moves_the_keys_of_sampling_nodes_only(monkeypatch):
    plan = load_plan("rlhf", "tiny")
    before = _keys(plan)
    monkeypatch.setattr(sampling, "SAMPLER_VERSION", str(int(sampling.SAMPLER_VERSION) + 1))
    after = _keys(plan)
    moved = {n.name for n in plan.nodes if before[n.name] != after[n.name]}
    sampling_nodes = {n.name for n in plan.nodes if getattr(get_stage(n.stage), "SAMPLES", False)}
    assert sampling_nodes and sampling_nodes != {n.name for n in plan.nodes}  # both kinds in the recipe
    assert moved == sampling_nodes


def test_at_the_baseline_the_key_is_the_stage_versions_alone(monkeypatch):
    """At the baseline a sampling stage's key is what its VERSION alone made it (the keys from before the sampler
    had a version); past it, `<VERSION>+sampler<N>`; a stage that does not sample never carries it."""
    node = next(n for n in load_plan("rlhf", "tiny").nodes if n.stage == "rejection_sampling")
    upstream = defaultdict(lambda: defaultdict(lambda: "f" * 64))
    module = get_stage(node.stage)
    for version in (SAMPLER_BASELINE, "7"):
        monkeypatch.setattr(sampling, "SAMPLER_VERSION", version)
        key, inputs, salt = pipeline.node_key(node, upstream)
        expected = module.VERSION if version == SAMPLER_BASELINE else f"{module.VERSION}+sampler7"
        assert stage_version(module) == expected
        assert key == cache_key(node.stage, expected, node.config_dict, inputs, node.seed, salt)
        assert stage_version(get_stage("sft")) == get_stage("sft").VERSION


def test_every_stage_that_imports_a_sampler_declares_it():
    """A stage module that imports stages.sampling or the rollouts (which sample) says SAMPLES = True."""
    for name, module in STAGE_MODULES.items():
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        samples = any(m.startswith(("stages.sampling", "stages.training.rollouts")) for m in imported)
        assert samples == getattr(get_stage(name), "SAMPLES", False), name
