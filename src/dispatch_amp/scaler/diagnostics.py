"""What a GradScaler remembers for diagnosis: scale history, overflow reports, parameter names.

Everything here is cheap on the steps that matter: the history is written on the device
(one small op per ``update()``, no host sync, read on demand), and an overflow report is
built only on a step the scaler has already decided to skip, after the host read that
decision needed anyway. :class:`ScalerDiagnostics` holds it all for one scaler and
raises the numerics warnings (:class:`AmpNumericsWarning`).

Note: where the per-gradient flags come from
--------------------------------------------
On the Triton path the unscale kernel marks each gradient that held an inf/nan in the
same pass that unscales it (``unscale_check_(..., nonfinite=flags)``); the host reads
those flags in the one read that decides the step, so a skipped step then counts inf/nan
over the marked gradients only. torch's fused op (the CPU path) returns one flag for all
gradients; there, on a skipped step, the scaler counts inf/nan over every gradient of
the optimizer: one extra pass, paid only when a step is skipped, never on a clean one.
Either way the counts stay on the device until a report is asked for
(:class:`PendingOverflow`): skipping costs no extra host sync.

A fused optimizer (``_step_supports_amp_scaling``) skips on the device, and the host
never learns of it during the step. For those the scaler asks the check for per-gradient
flags on every path (they come from the pass that checks each gradient, see
``dispatch_amp.kernels.uses_triton``), and keeps them, with the step's combined flag,
as the step's :class:`StepOutcome`: ``GradScaler.metrics()`` reads whether the step was
skipped and how many gradients overflowed in its one sync. They name no gradient, so
:meth:`GradScaler.last_overflow` still covers only the optimizers the host skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..autocast.context import regions_entered
from ..warning_types import AmpNumericsWarning

__all__ = [
    "AmpNumericsWarning",
    "NonFiniteGradient",
    "OverflowReport",
    "PendingOverflow",
    "ScaleHistory",
    "StepOutcome",
    "ParameterNames",
    "ScalerDiagnostics",
]

_log = logging.getLogger("dispatch_amp")


@dataclass(frozen=True)
class NonFiniteGradient:
    """One gradient that held inf/nan on a skipped step (counts on this process's values).

    ``name`` is the parameter's name when known (``GradScaler.name_parameters`` or the
    ``model`` passed to ``GradScaler.last_overflow``), else its place in the optimizer,
    e.g. ``"SGD.param_groups[0][3]"``.

    Example::

        >>> g = NonFiniteGradient("fc.weight", (4, 2), torch.float32, num_inf=1, num_nan=0)
        >>> str(g)
        'fc.weight: 1 inf, 0 nan of 8 values (torch.float32, shape (4, 2))'
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_inf: int
    num_nan: int
    _param: Any = field(default=None, repr=False, compare=False)  # weakref to the parameter

    @property
    def numel(self) -> int:
        """Number of values in the gradient."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __str__(self) -> str:
        return f"{self.name}: {self.num_inf} inf, {self.num_nan} nan of {self.numel} values ({self.dtype}, shape {self.shape})"


@dataclass(frozen=True)
class OverflowReport:
    """Which gradients held inf/nan on one skipped step.

    ``step`` counts ``update()`` calls from 0 (the same numbering as
    ``GradScaler.scale_history()``); ``scale`` is the loss scale the step ran with.

    Example::

        >>> r = OverflowReport(step=7, scale=65536.0, gradients=(
        ...     NonFiniteGradient("fc.weight", (2,), torch.float32, 2, 0),))
        >>> r.names
        ['fc.weight']
        >>> print(r)
        step 7 skipped at scale 65536.0: 1 gradient(s) held inf/nan
          fc.weight: 2 inf, 0 nan of 2 values (torch.float32, shape (2,))
    """

    step: int
    scale: float
    gradients: tuple[NonFiniteGradient, ...]

    @property
    def names(self) -> list[str]:
        """Names of the non-finite gradients, in optimizer order."""
        return [g.name for g in self.gradients]

    def __str__(self) -> str:
        lines = [f"step {self.step} skipped at scale {self.scale}: {len(self.gradients)} gradient(s) held inf/nan"]
        lines += [f"  {g}" for g in self.gradients]
        return "\n".join(lines)

    def summary(self, limit: int = 3) -> str:
        """One line naming the first ``limit`` gradients, for warnings and logs."""
        shown = ", ".join(self.names[:limit])
        more = len(self.gradients) - limit
        return shown + (f" and {more} more" if more > 0 else "")


class ParameterNames:
    """Parameter -> name, from a module or ``named_parameters()`` pairs; holds no parameter alive.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> names = ParameterNames.of(model)
        >>> names.get(model.bias)
        'bias'
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}

    @classmethod
    def of(cls, source: Any) -> ParameterNames:
        """Names from an ``nn.Module`` or an iterable of ``(name, parameter)`` pairs."""
        names = cls()
        if isinstance(source, torch.nn.Module):
            pairs: Iterable = source.named_parameters()
        elif isinstance(source, Iterable) and not isinstance(source, (str, bytes, torch.Tensor)):
            pairs = source
        else:
            raise TypeError(
                f"Parameter names come from an nn.Module or an iterable of (name, parameter) pairs "
                f"(model.named_parameters()), got {type(source).__name__}."
            )
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"Expected (name, parameter) pairs as from model.named_parameters(), got {item!r:.80}.")
            name, param = item
            names._by_id.setdefault(id(param), (weakref.ref(param), name))
        return names

    def get(self, param: torch.Tensor) -> str | None:
        """The parameter's name, or None when unknown (or when its id now belongs to another tensor)."""
        entry = self._by_id.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_id)

    def update(self, other: ParameterNames) -> None:
        """Add ``other``'s names; a parameter named in both takes ``other``'s name."""
        self._by_id.update(other._by_id)


def positional_names(optimizer) -> dict[int, str]:
    """``id(param) -> "<OptimizerClass>.param_groups[g][i]"`` for every parameter of ``optimizer``."""
    cls = type(optimizer).__name__
    return {id(p): f"{cls}.param_groups[{g}][{i}]" for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}


class PendingOverflow:
    """The overflow report of one skipped step, with its numbers still on the device.

    Built when ``step()`` skips: the inf/nan counts are launched on the device at once
    (the gradients may be freed right after the step) and read on the host only when
    the report is first asked for, so a skipped step costs no extra host sync.

    Example::

        >>> p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.tensor([1.0, float("inf"), float("nan")])
        >>> pending = PendingOverflow(step=4, scale=torch.tensor(1024.0))
        >>> pending.add(p, "SGD.param_groups[0][0]", p.grad)
        >>> print(pending.report(ParameterNames()))
        step 4 skipped at scale 1024.0: 1 gradient(s) held inf/nan
          SGD.param_groups[0][0]: 1 inf, 1 nan of 3 values (torch.float32, shape (3,))
    """

    def __init__(self, step: int, scale: torch.Tensor) -> None:
        self.step = step
        self._scale = scale.detach().clone()
        self._rows: list[tuple[weakref.ref, str, tuple[int, ...], torch.dtype]] = []
        self._counts: list[torch.Tensor] = []
        self._report: OverflowReport | None = None

    def add(self, param: torch.Tensor, fallback_name: str, grad: torch.Tensor) -> None:
        """Count (on the device) the inf and nan values of one candidate gradient."""
        with torch.no_grad():
            counts = torch.stack([grad.isinf().sum(), grad.isnan().sum()])
        self._rows.append((weakref.ref(param), fallback_name, tuple(grad.shape), grad.dtype))
        self._counts.append(counts.to(self._scale.device, non_blocking=True))

    def counts(self) -> list[torch.Tensor]:
        """Per candidate gradient, its ``[n_inf, n_nan]`` on the device (no sync)."""
        return list(self._counts)

    def report(self, names: ParameterNames) -> OverflowReport:
        """The report, read from the device on first use (one sync) and kept."""
        if self._report is None:
            self._report = self.read(names)
        return self._report

    def read(self, names: ParameterNames) -> OverflowReport:
        """Read the report from the device now (one sync), without keeping it."""
        parts = [self._scale.reshape(1).double()] + [c.double() for c in self._counts]
        values = torch.cat(parts).tolist()
        gradients = []
        for k, (ref, fallback, shape, dtype) in enumerate(self._rows):
            n_inf, n_nan = int(values[1 + 2 * k]), int(values[2 + 2 * k])
            if n_inf or n_nan:  # candidates without the flag path include clean gradients
                param = ref()
                name = (names.get(param) if param is not None else None) or fallback
                gradients.append(NonFiniteGradient(name, shape, dtype, n_inf, n_nan, ref))
        return OverflowReport(self.step, values[0], tuple(gradients))


class ScaleHistory:
    """A device-side ring buffer of ``(scale, skipped)`` per step; written without host syncs.

    ``record`` is called once per ``update()`` with the scale the step ran with and the
    step's found_inf; ``read`` copies the buffer to the host once. The step numbers live
    on the host. ``capacity=0`` keeps nothing.

    Example::

        >>> h = ScaleHistory(capacity=2)
        >>> for s, f in [(8.0, 0.0), (8.0, 1.0), (4.0, 0.0)]:
        ...     h.record(torch.tensor(s), torch.tensor(f))
        >>> h.read()                     # the last two of three steps
        [(1, 8.0, True), (2, 4.0, False)]
    """

    # The first step the buffer may hold (restart_at moves it); a class default for
    # histories pickled before it existed.
    _start = 0

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"history_size must be an int >= 0, got {capacity!r}.")
        self.capacity = capacity
        self.steps = 0  # steps recorded so far (the next step's number)
        self._buffer: torch.Tensor | None = None

    def restart_at(self, step: int) -> None:
        """Forget every record; the next step recorded is number ``step`` (a loaded checkpoint's count)."""
        self.steps = self._start = step
        self._buffer = None

    def record(self, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Store this step's scale and whether it was skipped (found_inf nonzero or nan)."""
        if self.capacity:
            buffer = self._buffer
            if buffer is None or buffer.device != scale.device:
                buffer = self._buffer = torch.zeros(self.capacity, 2, dtype=torch.float32, device=scale.device) if buffer is None else buffer.to(scale.device)
            # One kernel per step (the row view is metadata only). The raw flag is stored (a
            # sum of per-optimizer flags, maybe nan); read() turns it into skipped.
            row = buffer.select(0, self.steps % self.capacity)
            torch.stack((scale, found_inf if found_inf.device == buffer.device else found_inf.to(buffer.device)), out=row)
        self.steps += 1

    def read(self, last: int | None = None) -> list[tuple[int, float, bool]]:
        """``[(step, scale, skipped), ...]`` for the kept steps (the last ``last`` of them), oldest first. One sync."""
        kept = min(self.steps - self._start, self.capacity)
        if last is not None:
            if not isinstance(last, int) or isinstance(last, bool) or last < 0:
                raise ValueError(f"last must be an int >= 0 or None, got {last!r}.")
            kept = min(kept, last)
        if kept == 0 or self._buffer is None:
            return []
        first = self.steps - kept
        order = torch.arange(first, self.steps) % self.capacity
        rows = self._buffer[order.to(self._buffer.device)].tolist()
        return [(first + k, scale, flag != 0.0) for k, (scale, flag) in enumerate(rows)]  # nan != 0: skipped

    def to_host(self) -> ScaleHistory:
        """A copy whose buffer lives on the CPU (for pickling)."""
        copy = ScaleHistory(self.capacity)
        copy.steps, copy._start = self.steps, self._start
        copy._buffer = None if self._buffer is None else self._buffer.cpu()
        return copy


class StepOutcome:
    """What the newest ``update()`` leaves for a training log: was the step skipped, and how
    many gradients held inf/nan. Kept on the device until read; read at most once.

    ``found_inf``: the step's combined flag (nonzero or nan: skipped), or None when no
    optimizer was checked (``update(new_scale)`` alone: a clean step). ``fused_flags``:
    the int32 per-gradient flags of fused optimizers, which skip on the device.
    ``pending``: the :class:`PendingOverflow` the host built for the optimizers it
    skipped itself, or None.

    Example::

        >>> flags = torch.tensor([0, 1, 1], dtype=torch.int32)
        >>> StepOutcome(torch.tensor(1.0), [flags], None).read()
        (True, 2)
        >>> StepOutcome(None, [], None).read()
        (False, 0)
    """

    def __init__(self, found_inf: torch.Tensor | None, fused_flags: list[torch.Tensor], pending: PendingOverflow | None) -> None:
        self._found_inf = found_inf
        self._fused_flags = list(fused_flags)
        self._pending = pending
        self._host: tuple[bool, int] | None = None

    @property
    def is_read(self) -> bool:
        """Whether the numbers are on the host already (no sync to read them)."""
        return self._host is not None or (self._found_inf is None and not self._fused_flags and self._pending is None)

    def device_values(self, device: torch.device) -> torch.Tensor:
        """``[skip flag, overflowing gradients]`` as two float64 on ``device``; no sync."""
        with torch.no_grad():
            parts = [torch.zeros(1, dtype=torch.float64, device=device) if self._found_inf is None
                     else self._found_inf.reshape(1).double().to(device, non_blocking=True)]
            counted = [f.sum().reshape(1).double().to(device, non_blocking=True) for f in self._fused_flags]
            if self._pending is not None and self._pending.counts():
                hits = torch.stack([c.to(device, non_blocking=True) for c in self._pending.counts()]).ne(0).any(dim=1)
                counted.append(hits.sum().reshape(1).double())
            overflowing = torch.cat(counted).sum().reshape(1) if counted else torch.zeros(1, dtype=torch.float64, device=device)
            return torch.cat(parts + [overflowing])

    def take(self, values: list[float]) -> tuple[bool, int]:
        """Keep the numbers :meth:`device_values` held, read by the caller; returns them."""
        flag, overflowing = values
        skipped = flag != 0.0 or self._pending is not None  # nan != 0: skipped
        self._host = (bool(skipped), int(overflowing))
        self._found_inf, self._fused_flags, self._pending = None, [], None
        return self._host

    def read(self) -> tuple[bool, int]:
        """``(skipped, overflowing gradients)``; one sync the first time, unless already read."""
        if self._host is not None:
            return self._host
        tensors = ([self._found_inf] if self._found_inf is not None else []) + self._fused_flags
        if self._pending is not None and self._pending.counts():
            tensors.append(self._pending.counts()[0])
        if not tensors:
            return (False, 0)
        return self.take(self.device_values(tensors[0].device).tolist())

    def to_host(self) -> StepOutcome:
        """A copy holding the numbers only, read now (for pickling: no tensor, no reference)."""
        copy = StepOutcome(None, [], None)
        copy._host = self.read()
        return copy


def _bf16_marks() -> dict[str, int]:
    return {t: regions_entered(t, torch.bfloat16) for t in ("cpu", "cuda")}


class ScalerDiagnostics:
    """Everything one GradScaler keeps for diagnosis, and the warnings it raises.

    The scaler calls :meth:`on_scale` from ``scale()``, :meth:`on_skip` when ``step()``
    skips an optimizer, ``history.record`` and then :meth:`on_update` from ``update()``.
    Nothing here reads the device on the way, except to build a warning or a log line
    that is about to be emitted.

    Example::

        >>> diag = ScalerDiagnostics(history_size=4, warn_consecutive_skips=None)
        >>> diag.history.record(torch.tensor(8.0), torch.tensor(0.0))
        >>> diag.history.read(), diag.report()
        ([(0, 8.0, False)], None)
    """

    def __init__(self, history_size: int, warn_consecutive_skips: int | None) -> None:
        if warn_consecutive_skips is not None and (
            not isinstance(warn_consecutive_skips, int) or isinstance(warn_consecutive_skips, bool) or warn_consecutive_skips < 1
        ):
            raise ValueError(f"warn_consecutive_skips must be an int >= 1 or None, got {warn_consecutive_skips!r}.")
        self.history = ScaleHistory(history_size)
        self.warn_consecutive_skips = warn_consecutive_skips
        self.names = ParameterNames()
        self.last: PendingOverflow | None = None  # the last skipped step's report
        self._current: PendingOverflow | None = None  # the report being built this step
        self.outcome: StepOutcome | None = None  # the newest step's skip and overflow count
        self.run_of_skips = 0  # consecutive skipped steps the host has seen
        # Apex-style levels keep a dynamic scale with bf16 by definition; they turn this off.
        self.warn_bf16 = True
        self._warned_bf16 = False
        # bf16 regions entered on this thread before the scaler existed are not its business.
        self._bf16_marks = _bf16_marks()

    # -- hooks called by GradScaler ------------------------------------------------------

    def on_scale(self, device_type: str) -> None:
        """Warn, once, when the loss being scaled came from bfloat16 autocast."""
        if not self.warn_bf16 or self._warned_bf16:
            return
        # Ours: a bf16 region was entered since the scaler last looked (the usual loop
        # computes the loss inside it and scales outside). Native: only while inside one.
        entered = regions_entered(device_type, torch.bfloat16)
        ours = entered > self._bf16_marks.get(device_type, 0)
        self._bf16_marks[device_type] = entered
        native = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16
        if native or ours:
            self._warned_bf16 = True
            warnings.warn(
                "GradScaler is used with bfloat16 autocast, which does not need loss scaling: bfloat16 "
                "has float32's exponent range, so gradients do not underflow. Drop the scaler (call "
                "loss.backward() and optimizer.step() directly) or pass enabled=False.",
                AmpNumericsWarning,
                stacklevel=3,
            )

    def on_skip(self, optimizer, scale: torch.Tensor, checked: dict, host_flags: dict) -> None:
        """A step is being skipped: count inf/nan in this optimizer's suspect gradients.

        ``checked``: device -> (parameters, gradients, kernel flags or None) as unscaled;
        ``host_flags``: device -> the kernel's per-gradient flags as read on the host.
        Suspects are the flagged gradients where there are flags, else all of them (see
        "Note: where the per-gradient flags come from"). The counts stay on the device.
        """
        if self._current is None:
            self._current = PendingOverflow(self.history.steps, scale)
        pending = self._current
        fallback = positional_names(optimizer)
        for device, (params, grads, _) in checked.items():
            hits = host_flags.get(device)
            for k, (param, grad) in enumerate(zip(params, grads)):
                if hits is None or hits[k]:
                    pending.add(param, fallback.get(id(param), f"{type(optimizer).__name__}.<unlisted>"), grad)
        if _log.isEnabledFor(logging.INFO):  # reading the counts syncs; only when asked to log
            report = pending.read(self.names)  # not kept: later optimizers of this step may add more
            _log.info("GradScaler: step %d skipped (%s) at scale %s: inf/nan gradients in %s", report.step, type(optimizer).__name__, report.scale, report.summary())

    def on_update(
        self,
        host_flags_seen: list[bool],
        current_scale: Callable[[], float],
        found_inf: torch.Tensor | None = None,
        fused_flags: list[torch.Tensor] = (),
    ) -> None:
        """End of a step: keep its report and outcome, and watch for runs of skipped steps.

        ``host_flags_seen``: the skip decisions the host read this step (empty when only
        fused optimizers ran: the host never looked, so there is nothing to say).
        ``current_scale`` is called (a sync) only when a warning is emitted.
        ``found_inf`` and ``fused_flags``: the step's combined flag and the fused
        optimizers' per-gradient flags, kept as its :class:`StepOutcome` (no sync).
        """
        self.outcome = StepOutcome(found_inf, list(fused_flags), self._current)
        if self._current is not None:
            self.last, self._current = self._current, None
        if not host_flags_seen:
            return
        if not any(host_flags_seen):
            self.run_of_skips = 0
            return
        self.run_of_skips += 1
        limit, run = self.warn_consecutive_skips, self.run_of_skips
        # Warn at the limit, then at 2x, 4x, ... so a long run is not silent but not noisy.
        if limit is not None and run % limit == 0 and ((run // limit) & (run // limit - 1)) == 0:
            last = self.report()
            where = f" Last one: inf/nan gradients in {last.summary()}." if last is not None and last.gradients else ""
            warnings.warn(
                f"GradScaler: {run} steps in a row were skipped for inf/nan gradients (scale now "
                f"{current_scale()}).{where} Lowering the scale does not help when the forward pass "
                "already overflows: find the first non-finite op with dispatch_amp.NonFiniteTracer, or "
                "see scaler.last_overflow().",
                AmpNumericsWarning,
                stacklevel=3,
            )

    # -- reading -------------------------------------------------------------------------

    def restart(self, steps: int) -> None:
        """Start over at step ``steps`` (a loaded checkpoint's count): history, reports,
        the newest outcome and the run of skips are of another state and are dropped."""
        self.history.restart_at(steps)
        self.last = self._current = self.outcome = None
        self.run_of_skips = 0

    def add_names(self, source) -> None:
        """Add parameter names from a module or ``(name, parameter)`` pairs."""
        self.names.update(ParameterNames.of(source))

    def report(self, model=None) -> OverflowReport | None:
        """The last skipped step's report (one sync the first time), named by ``model`` if given."""
        if self.last is None:
            return None
        report = self.last.report(self.names)
        if model is None:
            return report
        names = ParameterNames.of(model)
        renamed = []
        for g in report.gradients:
            param = g._param() if g._param is not None else None
            name = names.get(param) if param is not None else None
            renamed.append(dataclasses.replace(g, name=name) if name else g)
        return dataclasses.replace(report, gradients=tuple(renamed))

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Weak references do not pickle: the history travels on the CPU, names stay behind,
        # and the last report is read now and kept without its parameter references.
        state = self.__dict__.copy()
        state["history"] = self.history.to_host()
        state["names"] = ParameterNames()
        state["_current"] = None
        if self.outcome is not None:
            state["outcome"] = self.outcome.to_host()
        if self.last is not None:
            report = self.report()
            done = PendingOverflow(report.step, torch.zeros(()))
            done._report = dataclasses.replace(report, gradients=tuple(dataclasses.replace(g, _param=None) for g in report.gradients))
            state["last"] = done
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("outcome", None)  # pickled before outcomes were kept
        self._bf16_marks = _bf16_marks()  # counts of this thread, not the pickling one's
