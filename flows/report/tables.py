"""Markdown tables of the report that fit the panes they are read in.

Prefect's artifact pane renders a markdown table with cells that never wrap, in a box about 700 px wide at a
1280 px window (14 px text, 12 px padding each side of a cell: about 7.6 px a character, 3 characters a cell's
padding), and cuts what is wider (issue 59: the stage table's metrics, the model comparison's right half).
`markdown_tables` estimates a table's width from its visible characters and splits its columns into several
tables, each repeating the key column, so that each fits PANE_CHARS. Long texts (a stage's key metrics) belong
in lists, which wrap.
"""

from __future__ import annotations

import re

PANE_CHARS = 84  # the budget of one table in characters, cell padding included (92 fit 700 px; a margin for wide glyphs)
CELL_PADDING = 3  # characters a cell's padding takes
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def shown_width(cell: str) -> int:
    """The characters a markdown cell shows: a link its text, code its content and a character a side of its box."""
    return len(LINK.sub(r"\1", cell))


def _column_width(cells: list[str]) -> int:
    return max(map(shown_width, cells)) + CELL_PADDING


def column_groups(headers: list[str], rows: list[list[str]], keys: int = 1, width: int = PANE_CHARS) -> list[list[int]]:
    """(pure) The columns of each table (indices, the first `keys` in every one): consecutive columns while the
    table fits `width`; a column too wide on its own gets a table of its own."""
    widths = [_column_width([h, *(r[i] for r in rows)]) for i, h in enumerate(headers)]
    key_width = sum(widths[:keys])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in range(keys, len(headers)):
        if current and key_width + sum(widths[j] for j in current) + widths[i] > width:
            groups.append(current)
            current = []
        current.append(i)
    if current or not groups:
        groups.append(current)
    return [list(range(keys)) + g for g in groups]


def markdown_tables(headers: list[str], rows: list[list[str]], keys: int = 1, width: int = PANE_CHARS) -> list[str]:
    """The markdown lines of the table, as one table or, when wider than `width`, several (column_groups) separated
    by a blank line."""
    lines: list[str] = []
    for cols in column_groups(headers, rows, keys, width):
        if lines:
            lines.append("")
        lines += ["| " + " | ".join(headers[c] for c in cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return lines


def read_tables(text: str) -> list[dict[str, str]]:
    """(pure) The rows of the consecutive markdown tables at the start of `text` (after leading text), read back
    as one table: a row's cells of every split table by header (what markdown_tables split, joined)."""
    blocks: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif (current or blocks) and line.strip():  # text after the tables ends them
            break
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    rows: list[dict[str, str]] = []
    for header, _, *cells in blocks:
        for i, row in enumerate(cells):
            if i == len(rows):
                rows.append({})
            rows[i].update(zip(header, row, strict=True))
    return rows
