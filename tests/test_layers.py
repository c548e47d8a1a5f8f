"""The architecture, enforced: stage modules never import each other, each layer under `stages/`
imports only the layers beneath it, each package of flows/ only the packages beneath it (an import inside a
function there says why it is not at the top), flows/, stages/, schemas/ and benchmarks/ have no import cycles,
and nothing beneath benchmarks/ imports it (docs/design.md, "Layers").

Imports are read from the source (every import statement, also inside functions), not by importing,
so a lazy import counts like a top-level one. Imports under `if TYPE_CHECKING:` are annotations
only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stages import STAGE_MODULES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "stages", "flows", "benchmarks")

# What each layer under stages/ may import (besides the standard library, third-party packages and
# itself). The stage API, stages.base, sits between sampling and training.
LAYERS: dict[str, set[str]] = {
    "schemas": set(),
    "stages.math": {"schemas"},
    "stages.rewards": {"schemas"},
    "stages.environments": {"schemas", "stages.rewards"},
    "stages.runtime": {"schemas"},
    "stages.modeling": {"schemas", "stages.math", "stages.runtime"},
    "stages.sampling": {"schemas", "stages.math", "stages.runtime", "stages.modeling", "stages.rewards",
                        "stages.environments"},
    "stages.base": {"schemas", "stages.modeling"},
    "stages.training": {"schemas", "stages.math", "stages.rewards", "stages.runtime", "stages.modeling",
                        "stages.sampling", "stages.base", "stages.environments"},
}

# What each package of flows/ may import of flows/ (besides itself), bottom to top; docs/design.md §1 says why.
FLOWS_LAYERS: dict[str, set[str]] = {
    "flows.plan": set(),
    "flows.servers": set(),
    "flows.store": {"flows.servers"},
    "flows.track": {"flows.plan", "flows.servers", "flows.store"},
    "flows.report": {"flows.plan", "flows.servers", "flows.store", "flows.track"},
    "flows.run": {"flows.plan", "flows.servers", "flows.store", "flows.track", "flows.report"},
    "flows.cli": {"flows.plan", "flows.servers", "flows.store", "flows.track", "flows.report", "flows.run"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports: `from stages import grpo` names stages.grpo, `from stages.x
    import f` names stages.x (f being a function), `import a.b` names a.b."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def layer_of(module: str) -> str | None:
    """The layer a module belongs to: 'schemas', 'stages.math', ..., 'stages.base', or None (a stage
    module, the stages package itself, or flows)."""
    if module.startswith("schemas"):
        return "schemas"
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def stage_modules(modules: dict[str, Path]) -> set[str]:
    """The registered stages and every other module directly under stages/ that is not the stage API."""
    direct = {m for m, p in modules.items() if m.count(".") == 1 and m.startswith("stages.") and m != "stages.base"
              and p.name != "__init__.py"}
    return set(STAGE_MODULES.values()) | {m for m in direct if not m.split(".")[1].startswith("_")}


MODULES = all_modules()
KNOWN = set(MODULES)
GRAPH = {m: imports_of(p, KNOWN) - {m} for m, p in MODULES.items()}
STAGES = stage_modules(MODULES)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_module_imports_no_other_stage_module(stage):
    others = sorted((GRAPH[stage] & STAGES) - {stage})
    assert not others, f"{stage} imports the stage module(s) {others}: move what it needs beneath the stages"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) and layer_of(m) != "schemas"))
def test_each_layer_imports_only_the_layers_beneath_it(module):
    layer = layer_of(module)
    wrong = sorted(dep for dep in GRAPH[module] if dep.startswith("flows") or dep in STAGES
                   or (layer_of(dep) not in (None, layer) and layer_of(dep) not in LAYERS[layer])
                   or (dep == "stages"))
    assert not wrong, f"{module} (layer {layer}) may import {sorted(LAYERS[layer])}, not {wrong}"


def test_schemas_import_nothing_of_stages_or_flows():
    wrong = {m: sorted(d for d in deps if not d.startswith("schemas"))
             for m, deps in GRAPH.items() if m.startswith("schemas")}
    assert not {m: d for m, d in wrong.items() if d}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_nothing_beneath_benchmarks_imports_them():
    wrong = {m: sorted(d for d in deps if d.startswith("benchmarks"))
             for m, deps in GRAPH.items() if not m.startswith("benchmarks")}
    assert not {m: d for m, d in wrong.items() if d}


def test_no_import_cycles():
    # a package's __init__ re-exporting its own modules is not a cycle of design
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_checker_sees_a_stage_importing_a_stage_and_a_cycle(tmp_path):
    """The rules above could pass by reading nothing: the reader finds both kinds of violation here."""
    fake = {"stages.grpo": {"stages.sft", "stages.training.optim"}, "stages.sft": set(),
            "flows.a": {"flows.b"}, "flows.b": {"flows.a"}}
    assert sorted((fake["stages.grpo"] & {"stages.grpo", "stages.sft"}) - {"stages.grpo"}) == ["stages.sft"]
    assert _cycles(fake) == [["flows.a", "flows.b"]]
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stages.base import Input\n"
                   "def f():\n    from stages import sft, grpo\n    import flows.report.report\n")
    assert imports_of(src, KNOWN) == {"stages.sft", "stages.grpo", "flows.report.report"}


def flows_package(module: str) -> str | None:
    """The package of flows/ a module belongs to ('flows.run', ...); None for `flows` itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "flows" and len(parts) > 1 else None


def flows_layer_violations(module: str, deps: set[str]) -> list[str]:
    """The modules of flows/ that `module` imports but its package may not (FLOWS_LAYERS)."""
    own = flows_package(module)
    return sorted(d for d in deps if flows_package(d) not in (None, own) and flows_package(d) not in FLOWS_LAYERS[own])


def test_every_module_of_flows_is_in_a_package_of_its_layers():
    loose = sorted(m for m in MODULES if m.startswith("flows") and m != "flows" and flows_package(m) not in FLOWS_LAYERS)
    assert not loose, f"modules of flows/ outside the packages of FLOWS_LAYERS: {loose}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if flows_package(m)))
def test_each_flows_package_imports_only_the_packages_beneath_it(module):
    wrong = flows_layer_violations(module, GRAPH[module])
    own = flows_package(module)
    assert not wrong, f"{module} ({own}) may import {sorted(FLOWS_LAYERS[own])} of flows/, not {wrong}"


def test_the_flows_checker_sees_an_import_upwards():
    assert flows_layer_violations("flows.store.cache", {"flows.run.pipeline", "flows.servers.settings"}) == \
        ["flows.run.pipeline"]
    assert flows_layer_violations("flows.plan.recipes", {"flows.plan.results", "stages.base"}) == []


def lazy_imports_without_a_reason(path: Path) -> list[int]:
    """Lines of imports inside functions (not under TYPE_CHECKING) with no `# lazy: <reason>` comment on their line
    or on the comment line right above their block of imports."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    skip = _type_checking_only(tree) | {id(n) for n in tree.body}
    missing = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
            continue
        i = node.lineno - 1
        while i > 1 and (lines[i - 1].strip().startswith(("from ", "import ")) or  # the block, its groups too
                         not lines[i - 1].strip() and lines[i - 2].strip().startswith(("from ", "import "))):
            i -= 1
        if "# lazy:" not in lines[node.lineno - 1] and not lines[i - 1].strip().startswith("# lazy:"):
            missing.append(node.lineno)
    return missing


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("flows")))
def test_an_import_inside_a_function_of_flows_says_why(module):
    """Imports belong at the top; one inside a function is there for start-up time (Prefect, MLflow, torch, ...
    loaded only by the commands that need them), an optional extra (ray, prefect-ray), or the order Prefect needs
    (its settings are fixed when it is imported), and says which."""
    missing = lazy_imports_without_a_reason(MODULES[module])
    assert not missing, f"{module}: imports inside functions at lines {missing} without a `# lazy: <reason>` comment"


def test_the_lazy_import_checker_sees_a_missing_reason(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import os\n\ndef f():\n    # lazy: start-up (torch)\n    import torch\n    import numpy\n\n"
                   "def g():\n    import json\n    return json\n")
    assert lazy_imports_without_a_reason(src) == [9]


RUN_MAX_LINES = 80  # a stage's run() reads top to bottom as a few named phases (issue 31)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_run_reads_as_a_few_phases(stage):
    tree = ast.parse(MODULES[stage].read_text())
    (run,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    length = run.end_lineno - run.lineno + 1
    assert length <= RUN_MAX_LINES, f"{stage}.run is {length} lines: split it into named phases (<= {RUN_MAX_LINES})"


MODULE_MAX_LINES = 600  # a module one reader can hold (issue 62: benchmarks/learning.py had grown to 1,192)
FUNCTION_MAX_LINES = 80  # a function that reads top to bottom; methods and nested functions count alike


def oversized(path: Path, label: str) -> list[str]:
    """What in the module at `path` is over the limits: the module's lines, then each function's."""
    text = path.read_text()
    out = []
    if (lines := len(text.splitlines())) > MODULE_MAX_LINES:
        out.append(f"{label} is {lines} lines (<= {MODULE_MAX_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if (length := node.end_lineno - node.lineno + 1) > FUNCTION_MAX_LINES:
                out.append(f"{label}:{node.lineno} {node.name} is {length} lines (<= {FUNCTION_MAX_LINES})")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_600_lines_and_no_function_over_80(package):
    found = [msg for name, path in MODULES.items() if name.split(".")[0] == package
             for msg in oversized(path, str(path.relative_to(ROOT)))]
    assert not found, "split by concern (see benchmarks/learning_*.py):\n  " + "\n  ".join(found)


def test_the_size_check_sees_a_long_module_and_a_long_method(tmp_path):
    src = tmp_path / "mod.py"
    method = "    def f(self):\n" + "        pass\n" * 80  # 81 lines
    src.write_text("class A:\n" + method + "\n" * 600)  # 1 + 81 + 600 lines
    assert oversized(src, "mod.py") == ["mod.py is 682 lines (<= 600)", "mod.py:2 f is 81 lines (<= 80)"]
    src.write_text("def g():\n" + "    pass\n" * 79)  # 80 lines: at the limit
    assert oversized(src, "mod.py") == []
