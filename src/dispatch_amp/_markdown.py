"""Markdown tables: the one way the package, the benchmarks and the scripts print one.

``table`` gives the whole table; ``header`` and ``row`` give its lines one at a time, for
output printed as it is measured (the demo prints each run's row as the run finishes).
Cells are written with ``str``; a ``|`` inside a cell is escaped and a line break becomes a
space, so no cell can break the table.

Only the standard library is imported, so the shell scripts print their tables through
this file without the package or torch installed::

    printf 'torch\\tresult\\n2.13.0\\t1 passed\\n' | python3 src/dispatch_amp/_markdown.py --align lr

Example::

    >>> print(table(["run", "ms"], [["fp32", "1.5"], ["ours", "1.1"]], align="lr"))
    | run | ms |
    |---|---:|
    | fp32 | 1.5 |
    | ours | 1.1 |
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

__all__ = ["table", "header", "row"]

_RULES = {"l": "---", "r": "---:", "c": ":---:"}


def _cell(value: object) -> str:
    return " ".join(str(value).splitlines()).replace("|", "\\|")


def row(cells: Iterable[object]) -> str:
    """One table line: ``| a | b |``.

    Example::

        >>> print(row(["fp32", 1.5, "a|b"]))
        | fp32 | 1.5 | a\\|b |
    """
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def header(names: Sequence[object], align: str | None = None) -> str:
    """The header line and the rule under it. ``align``: one letter per column, ``l``
    (left), ``r`` (right) or ``c`` (centred); None leaves every column to the renderer
    (``---``).

    Example::

        >>> print(header(["run", "ms"], align="lr"))
        | run | ms |
        |---|---:|
    """
    if align is None:
        align = "l" * len(names)
    if len(align) != len(names) or set(align) - set(_RULES):
        raise ValueError(
            f"align={align!r} must give one of l, r, c for each of the {len(names)} columns {list(names)}"
        )
    return row(names) + "\n|" + "|".join(_RULES[a] for a in align) + "|"


def table(names: Sequence[object], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A Markdown table of ``rows`` under the column ``names``; see ``header`` for ``align``.
    Every row must have one cell per column.

    Example::

        >>> print(table(["op", "calls"], [["mm", 3]], align="lr"))
        | op | calls |
        |---|---:|
        | mm | 3 |
    """
    lines = [header(names, align)]
    for i, cells in enumerate(rows):
        cells = list(cells)
        if len(cells) != len(names):
            raise ValueError(f"row {i} has {len(cells)} cells for the {len(names)} columns {list(names)}: {cells}")
        lines.append(row(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints tab-separated lines from stdin as a table: the first line names the columns."""
    parser = argparse.ArgumentParser(description="Print tab-separated stdin as a Markdown table.")
    parser.add_argument("--align", help="one of l, r, c per column (default: all l)")
    args = parser.parse_args(argv)
    lines = [line.rstrip("\n").split("\t") for line in sys.stdin if line.strip()]
    if not lines:
        parser.error("no lines on stdin: the first line names the columns")
    try:
        print(table(lines[0], lines[1:], args.align))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
