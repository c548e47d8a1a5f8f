"""MkDocs hook: the reference pages, written from the code at every build so that they cannot drift from it.

- stages: one page each, from `stages.describe_stage` and `schemas.config_fields` (what `r1flow stages -v`
  prints): summary, version, inputs and outputs, every config field (nested ones dotted) with its type, default
  and description, and the module's docstring;
- recipes and profiles: from the YAML in flows/recipes and flows/profiles, read as the planner reads them;
- rewards, verifiers and environments; preference losses, advantage estimators, policy losses, aggregations:
  from their registries;
- the CLI: every subcommand and option of `flows.cli.app.build_parser()` with its help.

`on_config` lists the stage pages in the navigation under the entry whose page is `reference/stages/index.md`;
`on_files` adds the pages. `pages()` is the whole output, for tests.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

# The repository whose code is documented (not where this file is: a test builds a copy of docs/ elsewhere).
ROOT = Path(importlib.util.find_spec("stages").origin).resolve().parents[1]
STAGES_INDEX = "reference/stages/index.md"
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


# ---------------------------------------------------------------------------- markdown helpers


def text(s: str) -> str:
    """Prose from a docstring or a description for one table cell or paragraph: `<`, `>` and `|` escaped outside
    code spans (an `<answer>` tag would otherwise vanish as HTML, a `|` split the cell), lines joined."""
    out, last = [], 0
    for m in _CODE_SPAN.finditer(s):
        out.append(_escape(s[last:m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(_escape(s[last:]))
    return " ".join("".join(out).split())


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", r"\|").replace("*", r"\*")


def code(s: str) -> str:
    fence = "``" if "`" in s else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def docstring(obj: Any) -> str:
    """A docstring as markdown: paragraphs kept, escaped, and a list that follows a line of prose given the blank
    line markdown needs before it."""
    doc = inspect.cleandoc(obj if isinstance(obj, str) else (inspect.getdoc(obj) or ""))
    paragraphs = []
    for block in doc.split("\n\n"):
        items = re.split(r"\n(?=[-*] )", block)
        head, rest = items[0], items[1:]
        if head.startswith(("- ", "* ")):
            rest, head = [head, *rest], ""
        lines = [text(head)] if head else []
        if rest:
            lines += ([""] if head else []) + ["- " + text(item[2:]) for item in rest]
        paragraphs.append("\n".join(lines))
    return "\n\n".join(p for p in paragraphs if p)


def first_paragraph(obj: Any) -> str:
    return text((inspect.getdoc(obj) or "").split("\n\n")[0])


def table(headers: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def value(v: Any) -> str:
    """A default as a recipe writes it (YAML/JSON: null, true, "text", {a: 1}) in a code span."""
    from pydantic_core import PydanticUndefined

    if v is PydanticUndefined:
        return "required"
    if isinstance(v, BaseModel):
        return "(below)"
    try:
        return code(json.dumps(v, ensure_ascii=False))
    except TypeError:
        return code(repr(v))


def fields_table(cls: type[BaseModel], nested: bool = True) -> str:
    from schemas.config_fields import config_fields

    rows = [[code(f.name), code(f.type), value(f.default), text(f.description)]
            for f in config_fields(cls, nested=nested)]
    return table(["field", "type", "default", "description"], rows)


def source_of(obj: Any) -> str:
    """`path/of/module.py` of a class or function, relative to the repository."""
    return Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT).as_posix()


def yaml_block(path: Path, title: str) -> str:
    body = "\n".join("    " + line if line else "" for line in path.read_text().splitlines())
    return f'??? example "{title}"\n\n    ```yaml\n{body}\n    ```'


def flow_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=10_000).strip()


# ---------------------------------------------------------------------------- stages


def _kind(kind: str) -> tuple[str, str]:
    optional = kind.endswith("?")
    kinds = kind.rstrip("?").split("|")
    return " or ".join(code(k) for k in kinds), "optional" if optional else "required"


def stage_page(name: str) -> str:
    from stages import describe_stage

    s = describe_stage(name)
    module = f"stages/{name}.py"
    lines = [
        f"# {name}",
        "",
        f"{text(s.summary[:1].upper() + s.summary[1:])}.",
        "",
        f"Module {code(module)}, version {code(s.version)}; config class {code(s.config.__name__)} "
        f"({code(source_of(s.config))}). Generated from the code (`r1flow stages -v` prints the same fields).",
        "",
        "## Inputs and outputs",
        "",
        table(["input", "kind", ""], [[code(k), *_kind(v)] for k, v in s.inputs.items()]) if s.inputs
        else "No inputs.",
        "",
        table(["output", "kind"], [[code(k), _kind(v)[0]] for k, v in s.outputs.items()]),
        "",
        "## Config",
        "",
        first_paragraph(s.config),
        "",
        "Set in a recipe node's `config:`, a profile, or `--set NODE.FIELD=VALUE`; a nested field is dotted "
        "(`--set NODE.lora.r=0`).",
        "",
        fields_table(s.config),
        "",
        "## How it works",
        "",
        docstring(s.doc),
        "",
    ]
    return "\n".join(lines)


def stages_index() -> str:
    from stages import STAGE_MODULES, describe_stage

    rows = []
    for name in STAGE_MODULES:
        s = describe_stage(name)
        ins = ", ".join(f"{code(k)} ({v})" for k, v in s.inputs.items()) or "—"
        outs = ", ".join(f"{code(k)} ({v})" for k, v in s.outputs.items())
        rows.append([f"[{name}]({name}.md)", ins, outs, text(s.summary)])
    return "\n".join([
        "# Stages",
        "",
        "Every stage, generated from the code (`r1flow stages` lists the same). An input kind `a|b` accepts either "
        "kind; `?` marks an optional input. Each page lists the stage's config fields with their types, defaults "
        "and descriptions.",
        "",
        table(["stage", "inputs", "outputs", "what it does"], rows),
        "",
    ])


# ---------------------------------------------------------------------------- recipes and profiles


def _names(directory: Path) -> list[str]:
    from flows.plan.recipes import available

    return available(directory)


def recipe_section(name: str) -> str:
    """One recipe from its YAML as written (options and `when` before substitution), and the nodes each profile's
    plan runs, as `load_plan` makes them."""
    from flows.plan.recipes import DEFAULT_RECIPE, PROFILE_DIR, RECIPE_DIR, load_plan

    path = RECIPE_DIR / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    mark = " (default)" if name == DEFAULT_RECIPE else ""
    lines = [f"## {name}{mark} {{ #{name} }}", "", text(raw.get("description", "")), "",
             f"File {code(path.relative_to(ROOT).as_posix())}; base model {code(raw.get('model', 'smollm2-135m-instruct'))}"
             f", seed {raw.get('seed', 0)}.", ""]
    if raw.get("options"):
        lines += ["Options (`--set options.NAME=VALUE`):", "",
                  table(["option", "default"], [[code(k), value(v)] for k, v in raw["options"].items()]), ""]
    rows = []
    for node, spec in raw["nodes"].items():
        ins = ", ".join(f"{code(k)} ← {code(v if isinstance(v, str) else ' or '.join(v))}"
                        for k, v in (spec.get("inputs") or {}).items())
        when = code(flow_yaml(spec["when"])) if "when" in spec else ""
        rows.append([code(node), f"[{spec['stage']}](stages/{spec['stage']}.md)" if "$" not in spec["stage"]
                     else code(spec["stage"]), ins or "—", when])
    lines += ["Nodes (a node whose `when` is false is dropped; `${NAME}` is an option's value):", "",
              table(["node", "stage", "inputs", "when"], rows), ""]
    lines += ["Run order under each profile:", ""]
    for profile in _names(PROFILE_DIR):
        plan = load_plan(name, profile, run_checks=False)
        lines.append(f"- `{profile}` ({len(plan.nodes)} nodes): " + " → ".join(n.name for n in plan.nodes))
    lines += [""]
    if raw.get("compare"):
        lines += ["Compared in the report: " + "; ".join(f"{code(c['eval'])} over {code(c['over'])} ({text(c['label'])})"
                                                        for c in raw["compare"]), ""]
    lines += [yaml_block(path, path.relative_to(ROOT).as_posix()), ""]
    return "\n".join(lines)


def recipes_page() -> str:
    from flows.plan.recipes import RECIPE_DIR
    from schemas.configs import NodeSpec, RecipeConfig

    names = _names(RECIPE_DIR)
    return "\n".join([
        "# Recipes",
        "",
        "Every recipe in `flows/recipes/`, generated from its YAML at each build of this site (`r1flow recipes` "
        "lists them too). Run one with `r1flow run --recipe NAME`, or your own file with `--recipe path/to/it.yaml`; "
        "how recipes and profiles become a plan: [design §3](../design.md#3-recipes-profiles-and-the-default-recipe).",
        "",
        "Recipes: " + ", ".join(f"[{n}](#{n})" for n in names) + ".",
        "",
        "## The recipe format",
        "",
        first_paragraph(RecipeConfig),
        "",
        fields_table(RecipeConfig, nested=False),
        "",
        "A node (`nodes.NAME`):",
        "",
        fields_table(NodeSpec, nested=False),
        "",
        *[recipe_section(n) for n in names],
    ])


def profile_section(name: str) -> str:
    from flows.plan.recipes import PROFILE_DIR
    from schemas.configs import ProfileConfig

    path = PROFILE_DIR / f"{name}.yaml"
    prof = ProfileConfig.model_validate(yaml.safe_load(path.read_text()))
    lines = [f"## {name} {{ #{name} }}", "", text(prof.description), "",
             f"File {code(path.relative_to(ROOT).as_posix())}" + (f"; model {code(prof.model)}" if prof.model else "")
             + ".", ""]
    groups = [("Every node of a stage type (`stages:`)", "stage", prof.stages),
              ("Named nodes (`nodes:`)", "node", prof.nodes),
              ("Where nodes run on a cluster (`resources:`)", "stage or node", prof.resources)]
    for title, key, overlay in groups:
        if overlay:
            lines += [f"{title}:", "", table([key, "settings"], [[code(k), code(flow_yaml(v))] for k, v in overlay.items()]),
                      ""]
    if prof.recipes:
        rows = []
        for recipe, ov in prof.recipes.items():
            parts = [f"{what} {code(flow_yaml(v))}" for what, v in (("options", ov.options), ("stages", ov.stages),
                                                                      ("nodes", ov.nodes)) if v]
            rows.append([code(recipe), "; ".join(parts)])
        lines += ["For one recipe only (`recipes:`):", "", table(["recipe", "overlay"], rows), ""]
    lines += [yaml_block(path, path.relative_to(ROOT).as_posix()), ""]
    return "\n".join(lines)


def profiles_page() -> str:
    from flows.plan.recipes import PROFILE_DIR
    from schemas.configs import ProfileConfig

    return "\n".join([
        "# Profiles",
        "",
        "Every profile in `flows/profiles/`, generated from its YAML. A profile overlays sizes on any recipe "
        "(`r1flow run --profile NAME`; default `gpu` where CUDA is available, else `cpu`). Precedence, later wins: "
        "stage defaults < recipe node config < profile `stages.<type>` < profile `nodes.<name>` < profile "
        "`recipes.<recipe>.stages.<type>` < profile `recipes.<recipe>.nodes.<name>` < `--set`.",
        "",
        "Profiles: " + ", ".join(f"[{n}](#{n})" for n in _names(PROFILE_DIR)) + ".",
        "",
        "## The profile format",
        "",
        fields_table(ProfileConfig, nested=False),
        "",
        *[profile_section(n) for n in _names(PROFILE_DIR)],
    ])


# ---------------------------------------------------------------------------- registries


def _registry_table(headers: list[str], registry: dict[str, Any], *cells: Callable[[str, Any], str]) -> str:
    return table(headers, [[code(k), *(c(k, v) for c in cells)] for k, v in registry.items()])


def rewards_page() -> str:
    from schemas.configs import EnvironmentSpec, RewardSpec
    from stages.environments.registry import ENVIRONMENTS
    from stages.rewards.verifiers import COMPONENTS, VERIFIERS

    return "\n".join([
        "# Rewards, verifiers and environments",
        "",
        "Generated from the code: the reward components (`stages/rewards/verifiers.py`, `COMPONENTS`), the "
        "verifiers (`VERIFIERS`), the environments (`stages/environments/registry.py`, `ENVIRONMENTS`) and the "
        "config classes every sampling stage's `reward:` and `environment:` validate through.",
        "",
        "## Reward components",
        "",
        docstring(RewardSpec),
        "",
        "Components a weight may name (`reward.weights`): " + ", ".join(code(c) for c in COMPONENTS)
        + ", or a verifier's raw score by its name.",
        "",
        "## Verifiers",
        "",
        "Each prompt's `verifier` column picks how its `accuracy` is judged:",
        "",
        _registry_table(["verifier", "what it returns", "function"], VERIFIERS,
                        lambda k, f: first_paragraph(f), lambda k, f: code(f"{f.__module__}.{f.__name__}")),
        "",
        "## `reward:` fields",
        "",
        fields_table(RewardSpec),
        "",
        "## Environments",
        "",
        "What answers a model's turn while sampling (`environment: {name: ...}` in eval, rejection_sampling, "
        "step_labels, grpo and ppo). Besides these, the path of your own Python file "
        "([guide](../guides/environment.md)).",
        "",
        _registry_table(["environment", "what it is", "class"], ENVIRONMENTS,
                        lambda k, c: first_paragraph(c), lambda k, c: code(f"{c.__module__}.{c.__name__}")),
        "",
        "## `environment:` fields",
        "",
        fields_table(EnvironmentSpec),
        "",
    ])


def losses_page() -> str:
    from schemas.configs import ASYNC_POLICY_LOSSES, DEFAULT_EPSILON_LOW
    from stages.math import distill, preference, rl

    def pref_row(k: str, spec: Any) -> list[str]:
        reduction = "mean per token" if spec.average else "sum"
        return [code(k), first_paragraph(spec.fn), ", ".join(code(i) for i in spec.inputs),
                ", ".join(code(p) for p in spec.params), reduction, "yes" if k in preference.NEEDS_REFERENCE else "no"]

    def fn_cell(k: str, f: Any) -> str:
        return code(f"{f.__module__}.{f.__name__}")

    policy_rows = [[code(k), first_paragraph(f), code(json.dumps(DEFAULT_EPSILON_LOW.get(k))),
                    "yes" if k in ASYNC_POLICY_LOSSES else "no", fn_cell(k, f)] for k, f in rl.POLICY_LOSSES.items()]
    return "\n".join([
        "# Losses and estimators",
        "",
        "Every variant is a row of a table in `stages/math/`, picked by name from a stage's config; generated from "
        "those tables. Adding one: [a new preference loss](../guides/preference-loss.md), "
        "[a new RL policy loss or advantage estimator](../guides/rl-loss.md).",
        "",
        "## Preference losses (`preference_optimization`'s `loss`)",
        "",
        "`stages/math/preference.py`, `LOSSES`:",
        "",
        table(["loss", "what", "inputs", "hyperparameters", "log-probs", "needs a reference"],
              [pref_row(k, s) for k, s in preference.LOSSES.items()]),
        "",
        "## Advantage estimators (`grpo`'s `advantage`)",
        "",
        "`stages/math/rl.py`, `ADVANTAGES`:",
        "",
        _registry_table(["advantage", "what", "function"], rl.ADVANTAGES, lambda k, f: first_paragraph(f), fn_cell),
        "",
        "## Policy losses (`grpo`'s `policy_loss`)",
        "",
        "`stages/math/rl.py`, `POLICY_LOSSES`; the clip below 1 when `epsilon_low` is unset comes from "
        "`DEFAULT_EPSILON_LOW` (`schemas/rl_configs.py`), and only the per-token losses of `ASYNC_POLICY_LOSSES` "
        "compose with asynchronous RL's off-policy weights:",
        "",
        table(["policy loss", "what", "default epsilon_low", "asynchronous RL", "function"], policy_rows),
        "",
        "## Loss aggregation (`aggregation`)",
        "",
        _registry_table(["aggregation", "what", "function"], rl.AGGREGATIONS, lambda k, f: first_paragraph(f), fn_cell),
        "",
        "## KL estimators (`kl_estimator`)",
        "",
        _registry_table(["estimator", "what", "function"], rl.KL_ESTIMATORS, lambda k, f: first_paragraph(f), fn_cell),
        "",
        "## Distillation divergences (`distill`'s `divergence`)",
        "",
        "`stages/math/distill.py`, `DIVERGENCES`: " + ", ".join(code(k) for k in distill.DIVERGENCES) + ".",
        "",
    ])


# ---------------------------------------------------------------------------- CLI


def _option_row(action: argparse.Action) -> list[str]:
    if action.option_strings:
        name = ", ".join(code(o) for o in action.option_strings)
    else:
        name = code(action.metavar or action.dest)
    if action.nargs == 0:
        arg = ""
    elif action.choices:
        arg = " \\| ".join(code(str(c)) for c in action.choices)
    else:
        arg = code(action.metavar or action.dest.upper()) if action.option_strings else ""
    default = "" if action.default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0 else \
        code(str(action.default))
    repeat = " (repeatable)" if isinstance(action, argparse._AppendAction) else ""
    return [name, arg, default, text(action.help or "") + repeat]


def cli_page() -> str:
    from flows.cli.app import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    lines = ["# CLI", "", f"`r1flow`: {text(parser.description or '')} Generated from the parser "
             "(`flows/cli/app.py` `build_parser`); `r1flow COMMAND --help` prints the same.", "",
             "Commands: " + ", ".join(f"[{n}](#r1flow-{n})" for n in sub.choices) + ".", ""]
    for name, p in sub.choices.items():
        p.formatter_class = functools.partial(argparse.HelpFormatter, width=110)
        usage = p.format_usage().removeprefix("usage: ").strip()
        lines += [f"## r1flow {name}", "", text(helps.get(name, "")), "", "```", usage, "```", ""]
        actions = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            lines += [table(["option", "argument", "default", "what"], [_option_row(a) for a in actions]), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the hook


def pages() -> dict[str, str]:
    """Every generated page: path under docs/ -> markdown."""
    from stages import STAGE_MODULES

    out = {STAGES_INDEX: stages_index()}
    out |= {f"reference/stages/{name}.md": stage_page(name) for name in STAGE_MODULES}
    out |= {"reference/recipes.md": recipes_page(), "reference/profiles.md": profiles_page(),
            "reference/rewards.md": rewards_page(), "reference/losses.md": losses_page(), "reference/cli.md": cli_page()}
    return out


def _with_stage_pages(nav: Any) -> Any:
    from stages import STAGE_MODULES

    if isinstance(nav, list):
        return [_with_stage_pages(item) for item in nav]
    if isinstance(nav, dict):
        return {k: ([v, *({n: f"reference/stages/{n}.md"} for n in STAGE_MODULES)] if v == STAGES_INDEX
                    else _with_stage_pages(v)) for k, v in nav.items()}
    return nav


def on_config(config):
    config.nav = _with_stage_pages(config.nav)
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
