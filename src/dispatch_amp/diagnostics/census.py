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

Given the model (``PrecisionCensus(model=model)``), it also counts per module: the ops each
module's forward ran itself (not those of its submodules), by dtype, the casts they made,
whether fp8 gemms ran there, and what its backward ran; ``module_table()`` prints it, ``module_csv(path)`` writes
it. That is how to check that a ``PrecisionPlan`` took effect::

    with amp.PrecisionCensus(model=model) as census, amp.autocast("cpu"):
        model(x)
    print(census.module_table())   # module | compute dtype | calls | FLOPs by dtype | casts | fp8

The census observes; it changes no dtype. It runs beside ``autocast`` (enter it inside
or outside) and also without it. Each op costs a Python call while it is active, so use
it for a few steps, not for a whole run.
"""

from __future__ import annotations

import csv
import io
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .. import _markdown
from .._compiled import engine as _process_engine
from ..fp8._rules import ALL_FP8_DTYPES as _FP8_DTYPES

__all__ = ["PrecisionCensus", "OpCount", "ModuleCount", "NO_MODULE"]

#: The module name ops run outside every module's forward and backward are counted under
#: (the loss and its backward, the optimizer).
NO_MODULE = "(no module)"

_CAST_OPS = {torch.ops.aten._to_copy.default}
_graph_task_id = torch._C._current_graph_task_id


@dataclass
class OpCount:
    """Counts for one (op, dtype) pair: calls, FLOPs, bytes written by casts."""

    calls: int = 0
    flops: int = 0
    cast_bytes: int = 0


@dataclass
class ModuleCount:
    """What one module's forward ran itself (its submodules' ops are theirs): calls and
    FLOPs per compute dtype, the dtype casts it made and their bytes, its fp8 gemms; and
    the calls, FLOPs and cast bytes of its backward (``backward_calls``,
    ``backward_flops``, ``backward_cast_bytes``).

    Example::

        >>> m = ModuleCount({torch.bfloat16: 3}, {torch.bfloat16: 96})
        >>> m.compute_dtype, m.fp8
        (torch.bfloat16, False)
    """

    calls: dict = field(default_factory=dict)
    flops: dict = field(default_factory=dict)
    casts: int = 0
    cast_bytes: int = 0
    fp8_gemms: int = 0
    #: The backward of its forward: calls and FLOPs per compute dtype (the gradient
    #: gemms of its own linears, say), counted apart from the forward's.
    backward_calls: dict = field(default_factory=dict)
    backward_flops: dict = field(default_factory=dict)
    #: Bytes its backward's casts wrote (gradients cast back to their weight's dtype).
    backward_cast_bytes: int = 0

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype of most of its FLOPs; without FLOPs, of most of its floating calls."""
        if self.flops:
            return max(self.flops.items(), key=lambda kv: kv[1])[0]
        floating = {d: c for d, c in self.calls.items() if d is not None and d.is_floating_point}
        return max(floating.items(), key=lambda kv: kv[1])[0] if floating else None

    @property
    def fp8(self) -> bool:
        """Whether an fp8 gemm ran in it."""
        return self.fp8_gemms > 0


def _inside(name: str, parent: str) -> bool:
    """Whether module ``name`` lies inside module ``parent`` (names as the census gives them)."""
    return name != parent and (parent == "<root>" or name.startswith(parent + "."))


def _dtype_name(dtype) -> str:
    return "-" if dtype is None else str(dtype).replace("torch.", "")


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
    def __init__(self, counts, modules=None, stack=None, backward_stack=None):
        super().__init__()
        self.counts = counts
        # Per module (None: no model given): name -> ModuleCount; the names of the
        # forwards running, innermost last; the names of the modules whose backward is
        # running, innermost last.
        self.modules = modules
        self.stack = stack
        self.backward_stack = backward_stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dtype = _compute_dtype(args, out)
        entry = self.counts[(func.overloadpacket.__name__, dtype)]
        entry.calls += 1
        flops = cast_bytes = 0
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            entry.flops += flops
        cast = func in _CAST_OPS and isinstance(out, torch.Tensor) and dtype is not out.dtype
        if cast:
            cast_bytes = out.numel() * out.element_size()
            entry.cast_bytes += cast_bytes
        if self.modules is not None:
            # A forward running (also one recomputed by activation checkpointing inside a
            # backward) owns the op; else, inside a backward, the module whose backward runs.
            backward = not self.stack and _graph_task_id() != -1
            if self.stack:
                name = self.stack[-1]
            else:
                name = self.backward_stack[-1] if backward and self.backward_stack else NO_MODULE
            m = self.modules.get(name)
            if m is None:
                m = self.modules[name] = ModuleCount()
            calls_of, flops_of = (m.backward_calls, m.backward_flops) if backward else (m.calls, m.flops)
            calls_of[dtype] = calls_of.get(dtype, 0) + 1
            if flops:
                flops_of[dtype] = flops_of.get(dtype, 0) + flops
                if dtype in _FP8_DTYPES and not backward:  # the backward's show in its FLOPs by dtype
                    m.fp8_gemms += 1
            if cast and backward:
                m.backward_cast_bytes += cast_bytes
            elif cast:
                m.casts += 1
                m.cast_bytes += cast_bytes
        return out


@dataclass
class PrecisionCensus:
    """Counts aten ops per op and per dtype while active: calls, FLOPs, cast bytes; with
    ``model``, per module of it too (``by_module()``, ``module_table()``, ``module_csv()``).

    Example::

        with amp.PrecisionCensus(model=model) as census, amp.autocast("cpu"):
            model(x)
        census.matmul_flops_fraction(torch.bfloat16)   # e.g. 1.0
        census.as_dict()["cast_bytes"]
        print(census.module_table())
    """

    counts: dict = field(default_factory=lambda: defaultdict(OpCount))
    #: The model whose modules the per-module view names (None: no per-module view).
    model: torch.nn.Module | None = field(default=None, kw_only=True, repr=False)

    def __post_init__(self):
        self._mode: _CensusMode | None = None
        if self.model is not None and not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(self.model).__name__}")
        # Module name -> ModuleCount, in the order the modules first ran.
        self.modules: dict[str, ModuleCount] = {}
        self._stack: list[str] = []
        self._backward_stack: list[str] = []
        self._clear_queued = False
        self._hooks: list = []

    def __enter__(self) -> PrecisionCensus:
        if self._mode is not None:
            raise RuntimeError("this PrecisionCensus is already active; use a new one to nest")
        if self.model is not None:
            self._watch(self.model)
        self._mode = _CensusMode(self.counts, self.modules if self.model is not None else None, self._stack,
                                 self._backward_stack)
        try:
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            self._unwatch()
            raise
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(*exc)
        finally:
            self._unwatch()

    def _watch(self, model: torch.nn.Module) -> None:
        """Hooks on every module's forward: its name is the innermost while it runs (the
        post hook runs also when the forward raises). And on its backward, as torch's
        ``ModuleTracker`` finds it: the module's backward starts when the gradients of all
        its outputs are ready and ends when those of its inputs are (a module whose inputs
        need no gradient, the first layer, ends with the backward itself)."""
        stack, modules, grad_hooks = self._stack, self.modules, self._grad_hooks
        for name, module in model.named_modules():
            label = name or "<root>"

            def enter(module, args, label=label):
                stack.append(label)
                if label not in modules:  # listed in the order modules first run
                    modules[label] = ModuleCount()
                grad_hooks(args, self._backward_leaves(label))

            def leave(module, args, output, label=label):
                if stack and stack[-1] == label:
                    stack.pop()
                grad_hooks(output, self._backward_enters(label))

            self._hooks.append(module.register_forward_pre_hook(enter))
            self._hooks.append(module.register_forward_hook(leave, always_call=True))

    def _grad_hooks(self, value, fn) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._hooks.append(torch.autograd.graph.register_multi_grad_hook(tensors, fn))

    def _backward_enters(self, label: str):
        def fn(grads) -> None:
            if self._mode is None:
                return
            if not self._clear_queued:
                # Modules whose backward never ends by a hook (inputs without gradients)
                # leave when the backward does.
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._clear_queued = True
            # A module and its last child share an output, whose hooks run in the order
            # they were made: the child's first. The parent goes below its descendants.
            stack = self._backward_stack
            at = len(stack)
            while at and _inside(stack[at - 1], label):
                at -= 1
            stack.insert(at, label)
        return fn

    def _backward_leaves(self, label: str):
        def fn(grads) -> None:
            stack = self._backward_stack
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] == label:
                    del stack[i]
                    break
        return fn

    def _backward_done(self) -> None:
        self._backward_stack.clear()
        self._clear_queued = False

    def _unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stack.clear()
        self._backward_done()

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
        """Plain numbers for logging: totals and a per-op list (and, with a model, a
        per-module list)."""
        out = {
            "engine": _engine_name(),
            "calls": self.calls,
            "cast_bytes": self.cast_bytes,
            "flops_by_dtype": {str(d): f for d, f in self.flops_by_dtype().items()},
            "ops": [
                {"op": op, "dtype": str(dtype), "calls": c.calls, "flops": c.flops,
                 "cast_bytes": c.cast_bytes}
                for (op, dtype), c in sorted(self.counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
            ],
        }
        if self.model is not None:
            out["modules"] = [
                {"module": name, "compute_dtype": str(m.compute_dtype),
                 "calls": {str(d): c for d, c in m.calls.items()}, "flops": {str(d): f for d, f in m.flops.items()},
                 "casts": m.casts, "cast_bytes": m.cast_bytes, "fp8_gemms": m.fp8_gemms,
                 "backward_calls": {str(d): c for d, c in m.backward_calls.items()},
                 "backward_flops": {str(d): f for d, f in m.backward_flops.items()},
                 "backward_cast_bytes": m.backward_cast_bytes}
                for name, m in self.by_module().items()
            ]
        return out

    # -- per module -------------------------------------------------------------------------
    def by_module(self) -> dict[str, ModuleCount]:
        """Module name (``"<root>"``: the model's own forward) -> what its forward ran
        itself, and what its backward ran, for every module that ran, in the order they
        first ran; ops outside every forward and every module's backward (the loss and its
        backward, the optimizer) under ``NO_MODULE``. Needs ``PrecisionCensus(model=...)``.

        Example::

            census.by_module()["head"].compute_dtype     # torch.float32 under a plan that says so
        """
        if self.model is None:
            raise RuntimeError("the per-module view needs the model: PrecisionCensus(model=model)")
        rows = {n: m for n, m in self.modules.items() if n != NO_MODULE}
        if NO_MODULE in self.modules:
            rows[NO_MODULE] = self.modules[NO_MODULE]
        return rows

    _MODULE_HEAD = ["module", "compute dtype", "calls", "FLOPs by dtype", "casts", "cast bytes", "fp8 gemms",
                    "backward calls", "backward FLOPs by dtype", "backward cast bytes"]

    def _module_rows(self, human: bool) -> list[list]:
        def flops_text(flops: dict) -> str:
            if human:
                return ", ".join(f"{_dtype_name(d)} {_human_count(f)}" for d, f in flops.items())
            return ";".join(f"{_dtype_name(d)}:{f}" for d, f in flops.items())

        rows = []
        for name, m in self.by_module().items():
            backward_calls = sum(m.backward_calls.values())
            if human:
                rows.append([name, _dtype_name(m.compute_dtype), sum(m.calls.values()), flops_text(m.flops), m.casts,
                             _human_bytes(m.cast_bytes) if m.cast_bytes else "", m.fp8_gemms or "",
                             backward_calls or "", flops_text(m.backward_flops),
                             _human_bytes(m.backward_cast_bytes) if m.backward_cast_bytes else ""])
            else:
                rows.append([name, _dtype_name(m.compute_dtype), sum(m.calls.values()), flops_text(m.flops), m.casts,
                             m.cast_bytes, m.fp8_gemms, backward_calls, flops_text(m.backward_flops),
                             m.backward_cast_bytes])
        return rows

    def module_table(self) -> str:
        """The per-module view as a Markdown table: per module, the compute dtype of its
        ops (that of most of its FLOPs, else of most of its calls), its calls, FLOPs per
        dtype, the dtype casts it made, its fp8 gemms, and its backward's calls, FLOPs per
        dtype and cast bytes.

        Example::

            print(census.module_table())
        """
        return _markdown.table(self._MODULE_HEAD, self._module_rows(human=True), align="llrlrrrrlr")

    def module_csv(self, path_or_file) -> None:
        """Writes the per-module view as CSV (a header row, then one row per module; FLOPs
        as ``dtype:flops`` pairs joined by ``;``) to a path or an open text file.

        Example::

            census.module_csv("census_by_module.csv")
        """
        rows = [self._MODULE_HEAD] + self._module_rows(human=False)
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(path_or_file, "w", newline="") as f:
                csv.writer(f).writerows(rows)
        elif isinstance(path_or_file, io.TextIOBase) or hasattr(path_or_file, "write"):
            csv.writer(path_or_file).writerows(rows)
        else:
            raise TypeError(f"module_csv takes a path or an open text file, got {type(path_or_file).__name__}")

    def table(self, limit: int | None = 20) -> str:
        """A Markdown table of the ops with the most FLOPs, then the most calls."""
        rows = sorted(self.counts.items(), key=lambda kv: (-kv[1].flops, -kv[1].calls, kv[0][0]))
        if limit is not None:
            rows = rows[:limit]
        cells = [
            [op, str(dtype).replace("torch.", "") if dtype is not None else "-", c.calls,
             _human_count(c.flops) if c.flops else "", _human_bytes(c.cast_bytes) if c.cast_bytes else ""]
            for (op, dtype), c in rows
        ]
        head = ["op", "dtype", "calls", "FLOPs", "cast bytes"]
        return (_markdown.table(head, cells, align="llrrr") + "\n\n" + self.summary()
                + f"\n\nEngine of this process: {_engine_name()}.")


def _engine_name() -> str:
    """The engine of this process's regions (``dispatch_amp.engine()``). The calls a
    census sees ran through the Python kernels whichever it is: under a dispatch mode the
    compiled kernels hand every call to them (the same casts, docs/design.md)."""
    return _process_engine()
