"""References a reader can follow: the code cites the design as `docs/design.md §N`, a file in the repository,
and every section it cites exists there."""

from __future__ import annotations

import re
from pathlib import Path

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
