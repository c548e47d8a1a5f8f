"""Every module imports, and the layering of docs/design.md §1 holds: schemas/ and stages/ never
import Prefect or MLflow (so stages run by hand, in tests, and on GPU boxes without them)."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for pkg in ("schemas", "stages", "flows")
    for p in (ROOT / pkg).rglob("*.py")
)
FORBIDDEN = {"schemas": {"prefect", "mlflow", "torch", "transformers", "stages", "flows"},
             "stages": {"prefect", "mlflow", "flows"}}


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module):
    importlib.import_module(module.removesuffix(".__init__"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_do_not_import_upwards(layer):
    for path in (ROOT / layer).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN[layer], f"{path.relative_to(ROOT)} imports {name}"
