"""Every table that names stages, losses or estimators agrees with the one place it comes from.

A stage is declared once: its module (`stages/<name>.py`) and its row in `stages.STAGES` (module, config class,
summary, key metrics, report panels); `STAGE_MODULES`, `STAGE_CONFIGS`, `KEY_METRICS` and `TRAINING_PANELS` derive
from the rows. Loss and estimator names are written twice because of the layers (`schemas/` may not import
`stages.math`): the config's `Literal[...]` and the table of functions in `stages/math/`. This test finds the entry a
newcomer forgot before a KeyError does.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from flows.plan.results import KEY_METRICS
from flows.report.plots import RL_STAGES, TRAINING_PANELS
from schemas.configs import (
    ASYNC_POLICY_LOSSES,
    DEFAULT_EPSILON_LOW,
    GRPOConfig,
    PPOConfig,
    PreferenceOptimizationConfig,
    RLConfig,
)
from stages import STAGE_CONFIGS, STAGE_MODULES, STAGES
from stages.math import preference, rl

ROOT = Path(__file__).resolve().parents[1]


def _choices(config: type, field: str) -> list[str]:
    return list(get_args(config.model_fields[field].annotation))


def _module_constants(path: Path) -> dict[str, ast.expr]:
    """The module-level assignments of a stage module, read without importing it (no torch)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id: node.value for t in targets if isinstance(t, ast.Name)}
    return out


def test_every_stage_module_is_one_registry_row_and_the_derived_tables_follow_it():
    """Stage names: every module directly under stages/ that defines `run` and `VERSION` has a row, every row names
    `stages.<its name>`, and the module's `CONFIG` is the row's config class. Derived tables hold no other name."""
    modules = {p.stem: _module_constants(p) for p in sorted((ROOT / "stages").glob("*.py"))
               if not p.name.startswith("_")}
    defined = {name for name, consts in modules.items() if "VERSION" in consts}
    assert defined == set(STAGES), f"modules without a row: {sorted(defined - set(STAGES))}; rows without a module: " \
                                   f"{sorted(set(STAGES) - defined)}"
    for name, row in STAGES.items():
        assert row.module == f"stages.{name}", name
        config = modules[name].get("CONFIG")
        assert isinstance(config, ast.Name) and config.id == row.config.__name__, \
            f"stages/{name}.py: CONFIG is {ast.unparse(config) if config else None}, its row says {row.config.__name__}"
        assert row.summary and "\n" not in row.summary, name
    assert list(STAGE_MODULES) == list(STAGES) and list(STAGE_CONFIGS) == list(STAGES)
    assert set(KEY_METRICS) <= set(STAGES) and set(TRAINING_PANELS) <= set(STAGES) and set(RL_STAGES) <= set(STAGES)
    assert len({row.config for row in STAGES.values()}) == len(STAGES), "two stages share a config class"


def test_loss_and_estimator_names_agree_between_the_configs_and_the_tables_of_functions():
    """Preference losses, policy losses (with their lower clip defaults and the asynchronous subset), advantage
    estimators, aggregations, std estimators and KL estimators: the config's Literal, in the table's order."""
    assert _choices(PreferenceOptimizationConfig, "loss") == list(preference.LOSSES)
    assert _choices(GRPOConfig, "policy_loss") == list(rl.POLICY_LOSSES) == list(DEFAULT_EPSILON_LOW)
    assert set(ASYNC_POLICY_LOSSES) <= set(rl.POLICY_LOSSES), ASYNC_POLICY_LOSSES
    assert _choices(GRPOConfig, "advantage") == list(rl.ADVANTAGES)
    assert _choices(GRPOConfig, "aggregation") == list(rl.AGGREGATIONS)
    assert _choices(GRPOConfig, "std") == list(rl._STD)
    for config in (RLConfig, GRPOConfig, PPOConfig):
        assert _choices(config, "kl_estimator") == list(rl.KL_ESTIMATORS), config.__name__
