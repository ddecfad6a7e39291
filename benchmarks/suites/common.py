"""Shared pieces of the suites: tables, targets, interleaved timing, quantiles."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # children run `python -m benchmarks.run` from here


@dataclass
class Table:
    """One printed Markdown table; every row also becomes a CSV row.

    ``columns`` is a list of (row key, header, format); rows are dicts that may hold more
    keys than are printed (all of them go to the CSV).
    """

    title: str
    columns: list
    rows: list = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        heads = [h for _, h, _ in self.columns]
        out = [f"### {self.title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for r in self.rows:
            cells = []
            for key, _, fmt in self.columns:
                v = r.get(key)
                if v is None or v == "":
                    cells.append("-")
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    cells.append(fmt.format(v))
                else:
                    cells.append(str(v))
            out.append("| " + " | ".join(cells) + " |")
        if self.note:
            out += ["", self.note]
        return "\n".join(out)


# Set by the runner for --quick: tiny sizes measure nothing worth a verdict.
SMOKE_TEST = False


def verdict(value, limit, *, at_most: bool = True) -> str:
    """'met' / 'missed' against a target (information only: never asserted); with
    ``--quick``, "smoke test"."""
    if value is None:
        return "-"
    if SMOKE_TEST:
        return "smoke test"
    ok = value <= limit if at_most else value >= limit
    return "met" if ok else "missed"


def quantile(values, q: float) -> float:
    """Linear-interpolated quantile, q in [0, 1]."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def rotations(items, rounds):
    """Per round, the items in rotated order (A B C, B C A, ...): interleaved, and none is
    always first or always after the same other one (docs/design.md, "Performance method")."""
    items = list(items)
    for r in range(rounds):
        k = r % len(items)
        yield items[k:] + items[:k]


def interleaved(fns: dict, rounds: int, warmup: int = 1, setup=None) -> dict:
    """Seconds per call of each fn, interleaved over ``rounds``; ``setup(name)`` runs
    untimed before each call. Returns name -> list of samples (one per round)."""
    for name, fn in fns.items():
        for _ in range(warmup):
            if setup:
                setup(name)
            fn()
    samples = {name: [] for name in fns}
    for order in rotations(fns, rounds):
        for name in order:
            if setup:
                setup(name)
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return samples


def ratio_stats(num: list, den: list) -> dict:
    """Median, min and max of the per-round ratios num/den."""
    r = [a / b for a, b in zip(num, den)]
    return {"ratio": statistics.median(r), "ratio_min": min(r), "ratio_max": max(r)}


def status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field in kB (e.g. ``"VmHWM"``: peak RSS), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
