"""``PrecisionCensus``: what ran in which precision, and what the casts cost.

A context that counts every aten op that runs inside it, per op and per dtype: calls,
FLOPs of matmuls, convolutions and attention (with torch's own FLOP formulas), and the
bytes written by dtype casts. It answers "does my model really run in 16 bits?"::

    with amp.PrecisionCensus() as census:
        with amp.autocast("cpu"):
            loss = loss_fn(model(x), y)
        loss.backward()
    print(census.summary())     # 98.7% of matmul FLOPs ran in torch.bfloat16; 1.2 MB of casts
    print(census.table())       # per op and dtype: calls, FLOPs, cast bytes
    log(census.as_dict())       # the same numbers, for a logger

The census observes; it changes no dtype. It runs beside ``autocast`` (enter it inside
or outside) and also without it. Each op costs a Python call while it is active, so use
it for a few steps, not for a whole run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..fp8._rules import ALL_FP8_DTYPES as _FP8_DTYPES

__all__ = ["PrecisionCensus", "OpCount"]

_CAST_OPS = {torch.ops.aten._to_copy.default}


@dataclass
class OpCount:
    """Counts for one (op, dtype) pair: calls, FLOPs, bytes written by casts."""

    calls: int = 0
    flops: int = 0
    cast_bytes: int = 0


def _compute_dtype(args, out) -> torch.dtype | None:
    """The dtype an op computed in: its first floating input, else its output's."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    if isinstance(out, torch.Tensor):
        return out.dtype
    return None


def _human_count(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # pragma: no cover


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError  # pragma: no cover


class _CensusMode(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dtype = _compute_dtype(args, out)
        entry = self.counts[(func.overloadpacket.__name__, dtype)]
        entry.calls += 1
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            entry.flops += int(formula(*args, **kwargs, out_val=out))
        if func in _CAST_OPS and isinstance(out, torch.Tensor) and dtype is not out.dtype:
            entry.cast_bytes += out.numel() * out.element_size()
        return out


@dataclass
class PrecisionCensus:
    """Counts aten ops per op and per dtype while active: calls, FLOPs, cast bytes.

    Example::

        with amp.PrecisionCensus() as census, amp.autocast("cpu"):
            model(x)
        census.matmul_flops_fraction(torch.bfloat16)   # e.g. 1.0
        census.as_dict()["cast_bytes"]
    """

    counts: dict = field(default_factory=lambda: defaultdict(OpCount))

    def __post_init__(self):
        self._mode: _CensusMode | None = None

    def __enter__(self) -> PrecisionCensus:
        if self._mode is not None:
            raise RuntimeError("this PrecisionCensus is already active; use a new one to nest")
        self._mode = _CensusMode(self.counts)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    # -- reading ------------------------------------------------------------------------
    def flops_by_dtype(self) -> dict[torch.dtype, int]:
        """Matmul/convolution/attention FLOPs per compute dtype."""
        totals: dict[torch.dtype, int] = defaultdict(int)
        for (_, dtype), count in self.counts.items():
            if count.flops:
                totals[dtype] += count.flops
        return dict(totals)

    def matmul_flops_fraction(self, dtype: torch.dtype) -> float:
        """Share of all counted FLOPs that ran in ``dtype`` (0.0 when none were counted)."""
        totals = self.flops_by_dtype()
        total = sum(totals.values())
        return totals.get(dtype, 0) / total if total else 0.0

    def fp8_flops_fraction(self) -> float:
        """Share of all counted FLOPs that ran as fp8 gemms (``torch._scaled_mm`` with fp8
        operands of either format; a gemm counts under its first operand's format).

        Example::

            with amp.PrecisionCensus() as census:
                with amp.autocast("cpu", dtype=torch.bfloat16, fp8=amp.fp8.CurrentScaling()):
                    model(x)
            census.fp8_flops_fraction()   # e.g. 0.93
        """
        totals = self.flops_by_dtype()
        total = sum(totals.values())
        return sum(f for d, f in totals.items() if d in _FP8_DTYPES) / total if total else 0.0

    @property
    def cast_bytes(self) -> int:
        """Bytes written by dtype casts (``aten._to_copy`` that changed the dtype)."""
        return sum(c.cast_bytes for c in self.counts.values())

    @property
    def calls(self) -> int:
        """All aten calls counted."""
        return sum(c.calls for c in self.counts.values())

    def summary(self) -> str:
        """One line, e.g. ``98.7% of matmul FLOPs ran in torch.bfloat16; 1.2 GB of casts``."""
        totals = self.flops_by_dtype()
        total = sum(totals.values())
        if total:
            dtype, flops = max(totals.items(), key=lambda kv: kv[1])
            head = f"{100 * flops / total:.1f}% of matmul FLOPs ran in {dtype}"
            fp8_share = self.fp8_flops_fraction()
            if fp8_share:
                head += f" ({100 * fp8_share:.1f}% in fp8)"
        else:
            head = "no matmul/convolution FLOPs counted"
        return f"{head}; {_human_bytes(self.cast_bytes)} of casts ({self.calls} aten calls)"

    def as_dict(self) -> dict:
        """Plain numbers for logging: totals and a per-op list."""
        return {
            "calls": self.calls,
            "cast_bytes": self.cast_bytes,
            "flops_by_dtype": {str(d): f for d, f in self.flops_by_dtype().items()},
            "ops": [
                {"op": op, "dtype": str(dtype), "calls": c.calls, "flops": c.flops,
                 "cast_bytes": c.cast_bytes}
                for (op, dtype), c in sorted(self.counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
            ],
        }

    def table(self, limit: int | None = 20) -> str:
        """A Markdown table of the ops with the most FLOPs, then the most calls."""
        rows = sorted(self.counts.items(), key=lambda kv: (-kv[1].flops, -kv[1].calls, kv[0][0]))
        if limit is not None:
            rows = rows[:limit]
        lines = [
            "| op | dtype | calls | FLOPs | cast bytes |",
            "|---|---|---:|---:|---:|",
        ]
        for (op, dtype), c in rows:
            dtype_name = str(dtype).replace("torch.", "") if dtype is not None else "-"
            lines.append(
                f"| {op} | {dtype_name} | {c.calls} | {_human_count(c.flops) if c.flops else ''} | "
                f"{_human_bytes(c.cast_bytes) if c.cast_bytes else ''} |"
            )
        return "\n".join(lines + ["", self.summary()])
