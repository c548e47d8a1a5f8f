"""References a reader can follow: the code cites the design as `docs/design.md §N`, a file in the repository,
and every section it cites exists there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCES = ("schemas", "stages", "flows", "benchmarks", "tests", "infra")
TOP = ("README.md", "pyproject.toml", "Makefile")


def _files() -> list[Path]:
    out = [ROOT / name for name in TOP if (ROOT / name).exists()]
    for pkg in SOURCES:
        out += [p for p in sorted((ROOT / pkg).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".yml",
                                                                                              ".yaml", ".sh", ".toml")]
    return out


def test_every_cited_section_of_the_design_exists():
    sections = set(re.findall(r"^## (§\d+)", DESIGN.read_text(), flags=re.M))
    missing = []
    for path in _files():
        for cited in re.findall(r"docs/design\.md[^\n]{0,3}((?:§\d+(?:, )?)+)", path.read_text(errors="replace")):
            missing += [f"{path.relative_to(ROOT)}: {s}" for s in re.findall(r"§\d+", cited) if s not in sections]
    assert not missing, f"sections cited but not in docs/design.md ({sorted(sections)}): {missing}"


def test_nothing_cites_a_design_file_outside_the_repository():
    bare = re.compile(r"(?<![/\w])DESIGN\.md")
    found = [str(p.relative_to(ROOT)) for p in _files() if p.name != "test_docs.py" and bare.search(p.read_text(errors="replace"))]
    assert found == [], "cite docs/design.md instead"


# ---------------------------------------------------------------------------- the documentation site (issue 62)

SITE_SOURCES = ("mkdocs.yml", "docs")


def _hook():
    """docs/hooks/reference.py, the MkDocs hook that writes the reference pages, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("r1flow_docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict`, as `make docs` and CI run it."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
def test_the_site_builds_strict_with_a_page_for_every_stage(tmp_path):
    from stages import STAGE_MODULES

    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in STAGE_MODULES:
        assert (tmp_path / "site" / "reference" / "stages" / name / "index.html").is_file(), name
    for page in ("reference/cli", "reference/recipes", "reference/profiles", "reference/rewards", "reference/losses",
                 "results", "design", "guides/new-stage"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


@pytest.mark.slow
def test_a_broken_link_a_missing_anchor_and_a_page_outside_the_nav_fail_the_strict_build(tmp_path):
    """The CI check is real: a copy of the site with a link to a page that does not exist, a link to an anchor that
    does not exist, and a page the navigation leaves out fails `mkdocs build --strict`, each named."""
    for name in SITE_SOURCES:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    concepts = tmp_path / "docs" / "concepts.md"
    concepts.write_text(concepts.read_text() + "\n[gone](no-such-page.md) and [a claim](results/index.md#no-such-claim)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n\nIn no navigation.\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "contains a link 'no-such-page.md', but the target is not found" in done.stderr
    assert "does not contain an anchor '#no-such-claim'" in done.stderr
    assert "not included in the \"nav\" configuration" in done.stderr and "orphan.md" in done.stderr


def test_a_stage_page_follows_its_config_class(monkeypatch):
    """The generated reference changes with the code: a field's new description, a new field and a new default appear
    on the stage's page (and in `r1flow stages -v`'s fields, the same walk), the old text is gone."""
    from pydantic import Field

    import stages.sft
    from schemas.config_fields import config_fields
    from schemas.configs import SFTConfig

    hook = _hook()
    before = hook.stage_page("sft")
    old = SFTConfig.model_fields["packing"].description
    assert text_of(old) in before
    monkeypatch.setattr(SFTConfig.model_fields["packing"], "description", "Pack examples, as the test now says.")
    after = hook.stage_page("sft")
    assert "| `packing` | `bool` | `false` | Pack examples, as the test now says. |" in after
    assert text_of(old) not in after

    class Changed(SFTConfig):
        packing: bool = Field(True, description="On by default in this test.")
        new_knob: int | None = Field(3, description="A field added by the test.")

    monkeypatch.setattr(stages.sft, "CONFIG", Changed)
    changed = hook.stage_page("sft")
    assert "| `packing` | `bool` | `true` | On by default in this test. |" in changed
    assert "| `new_knob` | `int \\| None` | `3` | A field added by the test. |" in changed.replace("int | None", "int \\| None")
    assert [f.name for f in config_fields(Changed)][-1] == "new_knob"


def text_of(description: str) -> str:
    return _hook().text(description)


def test_nested_fields_carry_the_outer_default_and_every_field_is_on_its_page():
    """A nested field's default is the one the stage's config gives it (rejection_sampling samples at 0.8, not
    GenerationSpec's 1.0); every field of every stage config, nested ones dotted, is on the stage's page."""
    from schemas.config_fields import config_fields
    from stages import STAGE_MODULES, describe_stage

    hook = _hook()
    page = hook.stage_page("rejection_sampling")
    assert "| `generation.temperature` | `float` | `0.8` |" in page
    for name in STAGE_MODULES:
        page = hook.stage_page(name)
        missing = [f.name for f in config_fields(describe_stage(name).config, nested=True)
                   if f"| `{f.name}` |" not in page]
        assert not missing, f"{name}: {missing}"


def test_the_cli_recipes_and_profiles_pages_cover_the_parser_and_the_yaml():
    import argparse

    from flows.cli.app import build_parser
    from flows.plan.recipes import PROFILE_DIR, RECIPE_DIR, available

    hook = _hook()
    cli = hook.cli_page()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"## r1flow {name}\n" in cli, name
        for action in parser._actions:
            for option in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert f"`{option}`" in cli, f"r1flow {name} {option}"
    recipes, profiles = hook.recipes_page(), hook.profiles_page()
    assert all(f"{{ #{r} }}" in recipes for r in available(RECIPE_DIR))
    assert all(f"## {p} {{ #{p} }}" in profiles for p in available(PROFILE_DIR))


def test_what_cites_a_section_of_the_old_notebook_finds_it_on_a_results_page():
    """benchmarks/RESULTS.md moved to docs/results/ (a pointer stays): a section the code cites by its title
    (`benchmarks/RESULTS.md, "The second half reworked"`) is a heading of a results page."""
    headings = {re.sub(r" \{ #[\w-]+ \}$", "", line.lstrip("#").strip())
                for page in (ROOT / "docs" / "results").glob("*.md") for line in page.read_text().splitlines()
                if line.startswith("#")}
    cite = re.compile(r'RESULTS\.md`?[,:]?\s*\(?((?:"[^"]+"(?:,\s*)?)+)')
    cited = {(str(p.relative_to(ROOT)), " ".join(title.split())) for p in _files()
             if p.name not in ("RESULTS.md", "test_docs.py")
             for group in cite.findall(p.read_text(errors="replace")) for title in re.findall(r'"([^"]+)"', group)}
    assert cited, "the pattern finds the citations"
    missing = [(path, title) for path, title in cited if not any(h.startswith(title) for h in headings)]
    assert not missing


# ---------------------------------------------------------------------------- the README as a front door (issue 62)

README = ROOT / "README.md"
README_MAX_BYTES = 12_000  # issue 62: "README <= 12 KB"; the peers' front doors are 4-14 KB


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc both make it: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\s*\{[^}]*\}\s*$", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    found = {_slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}
    found |= set(re.findall(r'\bid="([^"]+)"', text)) | set(re.findall(r"\{[^}]*#([\w-]+)[^}]*\}", text))
    return found


def _relative_links(markdown: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)  # a code block's brackets are not links
    links = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


def test_the_readme_is_a_front_door_of_at_most_12_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move the detail into docs/ and link it"


def test_every_relative_link_in_the_readme_resolves_to_a_file_and_its_anchor():
    """The README's links are relative (they work on GitHub and in a checkout), each to a file of the repository and,
    where it names one, an anchor that page has (a heading, or a row's id on the results page)."""
    links = _relative_links(README.read_text())
    assert len(links) >= 10, links  # the README links into the docs; the pattern finds them
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve() if path else README
        if not target.is_relative_to(ROOT) or not target.is_file():
            broken.append(f"{link}: no such file")
        elif anchor and anchor not in _anchors(target):
            broken.append(f"{link}: no anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken


def test_the_readme_links_to_results_rather_than_copying_figures():
    """A measured figure lives in one row of docs/results/index.md; the README links the row (issue 62: numbers copied
    into the README drift)."""
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    figures = re.findall(r"\[[-+]?\d[\d.]*, [-+]?\d[\d.]*\]|\d[\d.]*\s?(?:%|GB|MB|min\b|minutes|hours?\b|x\b)", prose)
    assert not figures, figures
    rows = {link.partition("#")[2] for link in _relative_links(prose) if link.startswith("docs/results/index.md#")}
    assert {"default-run-time", "default-run-footprint"} <= rows, rows


def test_the_readmes_test_command_is_what_ci_runs():
    quickstart = README.read_text().split("## Quickstart", 1)[1]
    assert re.search(r"^make test\b", quickstart, flags=re.M) and re.search(r"^make run\b", quickstart, flags=re.M)
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"


def test_the_quickstarts_command_list_names_every_command_of_the_parser():
    """docs/quickstart.md's synopsis of the commands is written by hand: a command the parser gains must appear in it
    (its flags are on the generated CLI page)."""
    import argparse

    from flows.cli.app import build_parser

    block = (ROOT / "docs" / "quickstart.md").read_text().split("## The commands", 1)[1].split("```")[1]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name in sub.choices if not re.search(rf"\br1flow {re.escape(name)}\b", block)]
    assert not missing
