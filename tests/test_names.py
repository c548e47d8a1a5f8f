"""One name per meaning: no public top-level function name is defined in two modules of stages/, flows/,
schemas/ or benchmarks/, so a reader (or a tool) that follows a name lands on the right definition.

A name shared on purpose is an interface, listed in INTERFACES with the modules that may define it; a clash
that someone else is resolving is listed in ALLOWED, and an entry there that no longer clashes fails too.
Definitions are read from the source (top-level `def`s, not methods or imports).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from stages import STAGE_MODULES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stages", "flows", "schemas", "benchmarks")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def public_functions() -> dict[str, set[str]]:
    """name -> the modules that define a public (no leading underscore) top-level function of that name."""
    where: dict[str, set[str]] = defaultdict(set)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                    where[node.name].add(_module(path))
    return where


STAGES = set(STAGE_MODULES.values())
SCRIPTS = {_module(p) for p in (ROOT / "benchmarks").glob("*.py")} | {"stages.training.launch", "flows.cli.app",
                                                                       "flows.servers.prefect_server"}

# Interfaces: one meaning implemented by several modules, each called through its module.
INTERFACES: dict[str, set[str]] = {
    # the stage API every runner calls on a stage module (docs/design.md, "Stages")
    **dict.fromkeys(("run", "check", "cache_salt", "wire_plan"), STAGES),
    # the phases a training stage's run() reads as; a stage module never imports another (test_layers.py)
    # (the RL stages' step reads rollout, `advantages`, `update`: GRPO's and PPO's differ in exactly these)
    **dict.fromkeys(("open_session", "resume_session", "micro_batch_loss", "train_step", "evaluate", "summarize",
                     "advantages", "update"),
                    STAGES),
    "main": SCRIPTS,  # a script's or `python -m` module's entry point
    # the two sides of the speed suite, chosen as a module (`side = r1flow_side or trl_side`)
    **dict.fromkeys(("run_sft", "run_dpo", "run_grpo"), {"benchmarks.r1flow_side", "benchmarks.trl_side"}),
}

# Clashes left to the change that owns the modules involved: name -> exactly the modules that define it now.
ALLOWED: dict[str, set[str]] = {}


def clashes(where: dict[str, set[str]]) -> dict[str, set[str]]:
    """name -> its defining modules, for every name defined in two modules outside its interface (the
    modules of an interface count as one)."""
    out = {}
    for name, modules in where.items():
        allowed = INTERFACES.get(name, set())
        outside = modules - allowed
        if len(outside) + bool(modules & allowed) > 1:
            out[name] = modules
    return out


def test_no_public_function_name_is_defined_in_two_modules():
    found = clashes(public_functions())
    new = {n: sorted(m) for n, m in found.items() if n not in ALLOWED}
    assert not new, "one name per meaning; rename so the name says what differs:\n" + "\n".join(
        f"  {n}: {', '.join(m)}" for n, m in sorted(new.items()))


def test_every_allowed_clash_still_is_one():
    """An entry whose clash is gone, or whose modules changed, is removed or updated with that change."""
    where = public_functions()
    found = clashes(where)
    stale = {n: sorted(where.get(n, set()) - INTERFACES.get(n, set())) for n, m in ALLOWED.items()
             if n not in found or where[n] - INTERFACES.get(n, set()) != m}
    assert not stale, f"ALLOWED is out of date; these names are now defined (outside their interface) in: {stale}"


def test_the_check_sees_a_clash_and_spares_an_interface():
    where = {"f": {"stages.math.rl", "stages.math.steps"}, "run": {"stages.sft", "stages.grpo"},
             "summarize": {"stages.sft", "benchmarks.suite"}, "g": {"flows.report.report"}}
    assert clashes(where) == {"f": {"stages.math.rl", "stages.math.steps"},
                              "summarize": {"stages.sft", "benchmarks.suite"}}
