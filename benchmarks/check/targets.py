"""The targets of the GPU check: each measured value beside its target, gathered over the parts.

Parts yield ``Target`` records beside their tables; the runner writes them to
``PART.targets.csv`` and ``targets_table`` prints those of every part as one table.

Example::

    t = Target("train", "GPT-2 small eager ours/native", 1.021, "<= 1.03", "met")
    write_targets(Path("out/train.targets.csv"), [t])
    print(targets_table(read_targets(Path("out"), ["train"])).markdown())
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from benchmarks.suites.common import Table


@dataclass(frozen=True)
class Target:
    """One target: the part that measured it, what, the value, the target and the verdict
    (``common.verdict``'s "met", "missed", "smoke test", or why there is no value)."""

    part: str
    measure: str
    value: float | str | None
    target: str
    met: str


def write_targets(path: Path, targets: list[Target]) -> None:
    """Writes ``targets`` as CSV (a header even when there are none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[f.name for f in fields(Target)])
        w.writeheader()
        w.writerows(asdict(t) for t in targets)


def read_targets(folder: Path, parts: list[str]) -> list[dict]:
    """The rows of ``PART.targets.csv`` in ``folder`` for each of ``parts`` that wrote one."""
    rows = []
    for part in parts:
        path = folder / f"{part}.targets.csv"
        if path.exists():
            with path.open(newline="") as f:
                rows += list(csv.DictReader(f))
    return rows


def _number(value: str):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def targets_table(rows: list[dict]) -> Table:
    """Every target with its value and verdict, in the order the parts ran."""
    table = Table("Targets: every part's measured value against its target", [
        ("part", "part", "{}"), ("measure", "measure", "{}"), ("value", "value", "{:.3f}"),
        ("target", "target", "{}"), ("met", "met?", "{}"),
    ], note="Values are medians of per-round ratios unless the measure says otherwise; nothing here is asserted.")
    table.rows = [{**r, "value": _number(r["value"])} for r in rows]
    return table
