"""``NonFiniteTracer``: find the op, and the module, where a forward pass first overflowed.

When a 16-bit forward produces inf or nan, the loss is useless and the scaler skips the
step, but nothing says where it went wrong. The tracer checks the output of every aten op
that runs inside it, and records the first op whose inputs were all finite and whose
output is not, with the path of the module that ran it and the ranges of its inputs::

    with amp.NonFiniteTracer(model) as tracer, amp.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    if tracer.first is not None:
        print(tracer.first)     # aten.mm in 'blocks.0.mlp.fc1' made inf from inputs in [-7e3, 9e3] ...

Checking every output reads it on the host, op by op: a debugging tool, for one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NonFiniteTracer", "NonFiniteEvent", "TensorRange"]


@dataclass(frozen=True)
class TensorRange:
    """What an op input looked like: shape, dtype, finite min/max, count of non-finite."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    min: float
    max: float
    nonfinite: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorRange:
        values = t.detach().float()
        finite = torch.isfinite(values)
        kept = values[finite]
        lo = kept.min().item() if kept.numel() else float("nan")
        hi = kept.max().item() if kept.numel() else float("nan")
        return cls(tuple(t.shape), t.dtype, lo, hi, int((~finite).sum().item()))

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        bad = f", {self.nonfinite} non-finite" if self.nonfinite else ""
        return f"{dtype}{list(self.shape)} in [{self.min:.4g}, {self.max:.4g}]{bad}"


@dataclass(frozen=True)
class NonFiniteEvent:
    """The first op that turned finite inputs into an inf/nan output."""

    op: str
    module: str
    inputs: tuple[TensorRange, ...]
    output: TensorRange
    index: int  # position of the op among those the tracer saw

    def __str__(self) -> str:
        where = f"in module {self.module!r}" if self.module else "outside any module"
        ins = "; ".join(str(r) for r in self.inputs) or "no tensor inputs"
        return (
            f"{self.op} {where} (op #{self.index}) produced {self.output} "
            f"from finite inputs: {ins}"
        )


def _floating_tensors(tree):
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            yield leaf


def _all_finite(tensors) -> bool:
    return all(t.device.type == "meta" or bool(torch.isfinite(t).all()) for t in tensors)


class _TraceMode(TorchDispatchMode):
    def __init__(self, tracer: NonFiniteTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracer = self.tracer
        tracer.ops_seen += 1
        if tracer.first is None and func.overloadpacket not in _IGNORED:
            outputs = list(_floating_tensors(out))
            if outputs and not _all_finite(outputs):
                inputs = list(_floating_tensors((args, kwargs)))
                if _all_finite(inputs):
                    bad = next(t for t in outputs if not _all_finite([t]))
                    tracer._record(func, inputs, bad)
        return out


# Ops that allocate uninitialised memory: their garbage is not an overflow.
_IGNORED = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
}


@dataclass
class NonFiniteTracer:
    """Records the first op whose finite inputs gave an inf/nan output, with its module.

    Args:
        model: optional module; its submodules' names label the ops they run.
        raise_on_first: raise ``FloatingPointError`` at the first such op instead of
            recording it and going on.

    Example::

        with amp.NonFiniteTracer(model) as tracer, amp.autocast("cpu", dtype=torch.float16):
            out = model(x)
        print(tracer.first or "all finite")
    """

    model: torch.nn.Module | None = None
    raise_on_first: bool = False
    first: NonFiniteEvent | None = field(default=None, init=False)
    ops_seen: int = field(default=0, init=False)

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        self._mode: _TraceMode | None = None
        self._hooks: list = []
        self._stack: list[str] = []

    def __enter__(self) -> NonFiniteTracer:
        if self._mode is not None:
            raise RuntimeError("this NonFiniteTracer is already active")
        self.first = None
        self.ops_seen = 0
        # Not torch.utils.module_tracker.ModuleTracker: it hooks every module in the process
        # (global hooks) and names them "<RootClass>.<path>", while the events name modules
        # by their path in the traced model, and a tracer must not see other models' calls.
        if self.model is not None:
            for name, module in self.model.named_modules():
                label = name or f"({type(module).__name__})"
                self._hooks.append(module.register_forward_pre_hook(self._push(label)))
                self._hooks.append(
                    module.register_forward_hook(self._pop, always_call=True)
                )
        self._mode = _TraceMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(*exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._stack.clear()

    def _push(self, name: str):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _record(self, func, inputs, bad_output) -> None:
        event = NonFiniteEvent(
            op=str(func.overloadpacket),
            module=self._stack[-1] if self._stack else "",
            inputs=tuple(TensorRange.of(t) for t in inputs),
            output=TensorRange.of(bad_output),
            index=self.ops_seen,
        )
        self.first = event
        if self.raise_on_first:
            raise FloatingPointError(f"first non-finite value: {event}")
