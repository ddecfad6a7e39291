"""What Dynamo said while a step compiled: ``TORCH_LOGS=recompiles,guards`` captured in process.

Example::

    with DynamoLog() as log:
        compiled_step()          # compiles
        compiled_step()          # runs (or recompiles: each recompile is counted)
    log.row()["recompiles"], log.text

Inside the context torch's ``recompiles``, ``guards`` and ``graph_breaks`` logs are on
(``torch._logging.set_logs``, what ``TORCH_LOGS=recompiles,guards,graph_breaks`` turns
on) and go to this object instead of stderr; on exit torch's logging is set back to its
defaults. Read from the records: recompiles and their guard failure reasons, guards per
compiled frame (the kinds in the guard tree: TENSOR_MATCH, ID_MATCH, ...) and Dynamo's
own "Guard eval latency" (the host time of one guard check when the frame compiled);
from ``torch._dynamo.utils.counters``: frames compiled, graphs and graph breaks.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import torch._dynamo
import torch._logging
from torch._dynamo.utils import counters

_GUARD_KIND = re.compile(r"\+- ([A-Z][A-Z_]+)(?::|$)")
_FAILURE = re.compile(r"^\s*- \d+/\d+: (.*)$")
_LATENCY = re.compile(r"Guard eval latency = ([0-9.]+) us")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _snapshot() -> dict:
    return {key: Counter(value) for key, value in counters.items()}


class DynamoLog:
    """A context that captures Dynamo's recompile, guard and graph-break logs; see the
    module's docstring."""

    LOGGER = "torch._dynamo"

    def __enter__(self) -> DynamoLog:
        torch._logging.set_logs(recompiles=True, guards=True, graph_breaks=True)
        self._logger = logging.getLogger(self.LOGGER)
        self._saved = list(self._logger.handlers)  # torch's stderr handler: out while we capture
        for h in self._saved:
            self._logger.removeHandler(h)
        self._capture = _Capture()
        self._logger.addHandler(self._capture)
        self._before = _snapshot()
        return self

    def __exit__(self, *exc) -> bool:
        after = _snapshot()
        self._logger.removeHandler(self._capture)
        for h in self._saved:
            self._logger.addHandler(h)
        torch._logging.set_logs()
        self.counts = {key: after.get(key, Counter()) - self._before.get(key, Counter()) for key in after}
        return False

    @property
    def text(self) -> str:
        """Every captured message, each headed by its logger's artifact name."""
        return "\n".join(f"[{r.name.rsplit('.', 1)[-1]}] {r.getMessage()}" for r in self._capture.records)

    def _messages(self, artifact: str) -> list[str]:
        return [r.getMessage() for r in self._capture.records if r.name.endswith("__" + artifact)]

    def failure_reasons(self) -> Counter:
        """Guard failure reason -> how often it triggered a recompile."""
        reasons = Counter()
        for message in self._messages("recompiles"):
            for line in message.splitlines():
                m = _FAILURE.match(line)
                if m:
                    reasons[m.group(1).split("  #")[0].strip()] += 1
        return reasons

    def guard_kinds(self) -> Counter:
        """Guard kind -> count over every compiled frame's guard tree."""
        kinds = Counter()
        for message in self._messages("guards"):
            if "TREE_GUARD_MANAGER" in message:
                kinds.update(m.group(1) for m in map(_GUARD_KIND.search, message.splitlines()) if m)
        return kinds

    def row(self) -> dict:
        """Frames, graphs, recompiles, graph breaks, guards and their reasons, for a table."""
        kinds = self.guard_kinds()
        latencies = [float(m.group(1)) for msg in self._messages("guards") for m in [_LATENCY.search(msg)] if m]
        reasons = self.failure_reasons()
        breaks = self.counts.get("graph_break", Counter())
        return {
            "frames": self.counts.get("frames", Counter()).get("ok", 0),
            "graphs": self.counts.get("stats", Counter()).get("unique_graphs", 0),
            "recompiles": len(self._messages("recompiles")),
            "graph_breaks": sum(breaks.values()),
            "guards": sum(kinds.values()),
            "guard_eval_us": max(latencies) if latencies else None,
            "top_guards": ", ".join(f"{k} {n}" for k, n in kinds.most_common(4)),
            "reasons": "; ".join(f"{r} (x{n})" for r, n in reasons.most_common(3)) or "-",
            "break_reasons": "; ".join(f"{r[:80]} (x{n})" for r, n in breaks.most_common(3)) or "-",
        }
