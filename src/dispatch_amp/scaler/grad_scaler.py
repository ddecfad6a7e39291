"""GradScaler: dynamic loss scaling, a drop-in for ``torch.amp.GradScaler``.

Per optimizer, a small state machine runs between two ``update()`` calls::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()------> STEPPED   (step() unscales first)

Each optimizer's gradients are unscaled and checked by one fused call per device
(:func:`dispatch_amp.kernels.unscale_check_`), and each optimizer skips its step on its own
overflow, exactly as in torch. What differs is when the host looks at the flags:

Note: host syncs
----------------
``step()`` must know on the host whether the flag is set (a skipped ``optimizer.step()``
cannot be decided on the device for an ordinary optimizer). Torch reads each optimizer's
flag with its own ``.item()``. Here ``step()`` reads, in ONE sync, the flags of every
optimizer already unscaled and not yet read (packed into one integer on the device), and
keeps the answers; later ``step()`` calls in the same iteration then cost no sync. So::

    scaler.unscale_(opt1, opt2)   # or two unscale_() calls, e.g. before clipping
    scaler.step(opt1)             # the one sync of this iteration
    scaler.step(opt2)             # no sync

An optimizer that is still READY when another steps is NOT unscaled early: its gradients
may not be final yet (a later backward may add to them), and an early unscale would make
a later explicit ``unscale_()`` raise. Optimizers with ``_step_supports_amp_scaling``
(torch's fused Adam/AdamW/SGD) get ``grad_scale`` and ``found_inf`` and never sync;
``update()`` never syncs (except to read a tensor ``new_scale``, to check it);
``get_scale()``, ``state_dict()`` and :attr:`skipped_steps` read the device on demand.

Under torch.distributed with sharded gradients (FSDP2, DTensors) the flags are reduced
across ranks (``MAX``) asynchronously, and waited for just before the read above, so
the count of syncs stays the same; see "Note: found_inf across ranks" in
:mod:`dispatch_amp.scaler.distributed`.
"""

from __future__ import annotations

import collections
import inspect
import warnings
from collections import abc
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ..kernels.scale_update import ScaleState, _update_scale
from ..kernels.unscale import BACKENDS, _check_finite, _unscale_check, uses_triton
from . import distributed as _dist
from .collection import collect_grads
from .config import FP32_TINY, ScalerConfig, as_number, check_scale, is_real, parse_state_dict
from .diagnostics import AmpNumericsWarning, OverflowReport, ScalerDiagnostics
from .flag_read import read_flags


__all__ = ["GradScaler", "OptState"]


class OptState(Enum):
    """Where one optimizer is in the current iteration (reset to READY by ``update()``).

    Example::

        >>> OptState.READY.name
        'READY'
    """

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptRecord:
    stage: OptState = OptState.READY
    # device -> fp32 0-d flag, nonzero when this optimizer's gradients overflowed
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    # The flag as read on the host, once read (None: not read yet).
    found_inf_host: bool | None = None
    # Work handle of the cross-rank all_reduce of the flag, until waited on.
    work: Any = None
    # device -> (parameters, the gradient tensors checked, per-gradient flags or None), kept
    # for the overflow report of a skipped step (see diagnostics.py).
    checked_per_device: dict[torch.device, tuple[list, list, Any]] = field(default_factory=dict)
    # device -> the per-gradient flags as read on the host with found_inf (Triton path only).
    nonfinite_host: dict[torch.device, list[int]] = field(default_factory=dict)
    # Whether the optimizer steps through grad_scale/found_inf (fused): it skips on the
    # device, so its per-gradient flags are the only count of its overflow.
    fused: bool = False


class GradScaler:
    """Dynamic loss scaling; same arguments, defaults and methods as ``torch.amp.GradScaler``.

    ``scale(loss)`` multiplies the loss by the scale; ``step(opt)`` unscales the gradients,
    checks them for inf/nan and skips ``opt.step()`` if any; ``update()`` halves the scale
    after an overflowing step and doubles it after ``growth_interval`` clean steps in a
    row. Opt-in extras (the defaults keep torch's behaviour):

    * ``hysteresis=N``: back off only after N consecutive overflowing steps (Megatron-LM /
      DeepSpeed style); one clean step resets the count.
    * ``min_scale`` / ``max_scale``: bounds for the scale. A backoff that would go below
      ``min_scale`` stops at it and a warning is raised when the host next reads the flags.
    * :attr:`skipped_steps`: running count of steps skipped for overflow, kept on the device.
    * Diagnostics: :meth:`scale_history` (``(step, scale, skipped)`` per step, recorded on
      the device, ``history_size`` steps kept), :meth:`last_overflow` (which gradients held
      inf/nan on the last skipped step, by parameter name after :meth:`name_parameters`),
      and warnings of category :class:`AmpNumericsWarning` after ``warn_consecutive_skips``
      skipped steps in a row (None: never) and when the scale is used with bfloat16
      autocast, which does not need it (``warn_bf16=False``: never). Each skipped step is also logged at INFO level on
      the ``"dispatch_amp"`` logger.
    * ``backend``: kernel backend for unscale and update (``"auto"``, ``"triton"``, ``"torch"``).
    * ``process_group``: for torch.distributed, the group over which each optimizer's
      found_inf is reduced (``MAX``) so that every rank skips together. ``None`` (default):
      the world group when torch.distributed is initialized and the optimizer has DTensor
      parameters (FSDP2), else no reduction (single process, DDP: gradients are already
      identical on every rank). A ``ProcessGroup``: always reduce over it. ``False``: never.

    See "Note: host syncs" in this module for when the host waits for the device.

    Example::

        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler("cpu", init_scale=1024.0)
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.skipped_steps
        (1024.0, 0)
    """

    # Frames a subclass's __init__ puts between the caller and this one (the deprecated
    # torch.cuda.amp.GradScaler of patch_torch): the warning below points at the caller.
    _init_frames = 0

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | torch.Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        backend: str = "auto",
        process_group: Any = None,
        history_size: int = 10_000,
        warn_consecutive_skips: int | None = 10,
        warn_bf16: bool = True,
    ) -> None:
        self._device = device
        self._enabled = enabled
        self._diagnostics = ScalerDiagnostics(history_size, warn_consecutive_skips)
        self._diagnostics.warn_bf16 = bool(warn_bf16)
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("GradScaler is enabled for 'cuda', but CUDA is not available. Disabling.", stacklevel=2 + self._init_frames)
            self._enabled = False
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        self._backend = backend
        _dist.check_process_group_arg(process_group)
        self._process_group = process_group
        if not self._enabled:
            return
        self._config = ScalerConfig(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        # torch's scaler takes a 0-d tensor too (it fills the scale with it); taken by its value.
        init_scale = as_number("init_scale", init_scale)
        check_scale("init_scale", init_scale)
        self._config.check_within_bounds("init_scale", init_scale)
        self._init_scale = float(init_scale)
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._config.hysteresis
        self._init_skipped_steps = 0
        self._state: ScaleState | None = None  # created on the loss's device by scale()
        self._floor_hits_seen = 0
        self._records: dict[int, _OptRecord] = {}

    # ----------------------------------------------------------------------------------
    # internals
    # ----------------------------------------------------------------------------------

    def _record(self, optimizer) -> _OptRecord:
        rec = self._records.get(id(optimizer))
        if rec is None:
            rec = self._records[id(optimizer)] = _OptRecord()
        return rec

    def _require_state(self, funcname: str) -> ScaleState:
        if self._state is None:
            raise RuntimeError(
                f"{funcname}() was called before scale(): the scale does not exist yet. "
                "Call scaler.scale(loss).backward() earlier in the iteration."
            )
        return self._state

    def _lazy_init(self, device: torch.device) -> ScaleState:
        if self._state is None:
            self._state = ScaleState.create(
                device,
                self._init_scale,
                growth_tracker=self._init_growth_tracker,
                hysteresis=self._config.hysteresis,
                hysteresis_tracker=self._init_hysteresis_tracker,
                skipped_steps=self._init_skipped_steps,
            )
        return self._state

    @staticmethod
    def _check_optimizer(optimizer, funcname: str) -> None:
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"{funcname}() expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")

    def _unscale_grads_(
        self,
        optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
        *,
        check_only: bool = False,
        collected=None,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale (or only check) one optimizer's gradients; one fused call per device.

        The positional signature is torch's (``allow_fp16=False`` refuses fp16 gradients,
        as torch's ``unscale_`` does), since code written against torch's scaler calls it.
        ``check_only``: read the gradients without writing them (fused optimizers).
        ``collected``: the optimizer's :meth:`_collect_grads`, when the caller already has it.
        """
        per_device = collect_grads(optimizer, refuse_fp16=not allow_fp16) if collected is None else collected
        flags: dict[torch.device, torch.Tensor] = {}
        checked: dict[torch.device, tuple[list, list, Any]] = {}
        # A fused optimizer skips on the device: its per-gradient flags are the only count
        # of its overflow, so it gets them on every path (diagnostics.py).
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        with torch.no_grad():
            for device, (params, grads) in per_device.items():
                flag = found_inf if device == found_inf.device else torch.zeros((), dtype=torch.float32, device=device)
                # Otherwise per-gradient flags only where the kernel sets them in its one
                # launch; the torch path would pay a call per gradient on every step.
                want = fused or uses_triton(device, self._backend)
                nonfinite = torch.zeros(len(grads), dtype=torch.int32, device=device) if want else None
                if check_only:
                    _check_finite(grads, flag, self._backend, nonfinite=nonfinite, trusted=True)
                else:
                    inv = inv_scale if device == inv_scale.device else inv_scale.to(device, non_blocking=True)
                    _unscale_check(grads, inv, flag, self._backend, nonfinite=nonfinite, trusted=True)
                flags[device] = flag
                checked[device] = (params, grads, nonfinite)
        self._record(optimizer).checked_per_device = checked
        return flags

    def _read_pending_flags(self) -> None:
        """One host sync: read the flags of every unscaled, unread optimizer (see "Note: host syncs")."""
        state = self._require_state("step")
        pending = [rec for rec in self._records.values() if rec.stage is OptState.UNSCALED and rec.found_inf_host is None]
        _dist.wait_reductions(pending)
        floor_seen = None if self._config.min_scale is None else self._floor_hits_seen
        if read_flags(pending, state, floor_seen):
            self._warn_floor()

    def _reduce_found_inf_(self, optimizers) -> None:
        """Start the cross-rank MAX of these optimizers' flags (see distributed.py); no wait."""
        records = [(_dist.resolve_process_group(self._process_group, opt), self._record(opt)) for opt in optimizers]
        _dist.reduce_found_inf_async(records, self._state.scale.device)

    def _warn_floor(self) -> None:
        state = self._state
        hits = int(state.floor_hits.item()) if state is not None else 0
        if hits > self._floor_hits_seen:
            self._floor_hits_seen = hits
            warnings.warn(
                f"GradScaler: the loss scale hit min_scale={self._config.min_scale} ({hits} time(s) so far); "
                "gradients keep overflowing at the smallest allowed scale. Check the model for "
                "inf/nan in the forward pass, or lower min_scale.",
                AmpNumericsWarning,
                stacklevel=3,
            )

    # ----------------------------------------------------------------------------------
    # public API
    # ----------------------------------------------------------------------------------

    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples of tensors, by the current scale.

        Creates the scale on the first tensor's device the first time. Returns ``outputs``
        unchanged when the scaler is disabled.

        Example::

            >>> scaler = GradScaler("cpu", init_scale=8.0)
            >>> scaler.scale([torch.ones(2), (torch.ones(1),)])
            [tensor([8., 8.]), (tensor([8.]),)]
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._check_scalable(outputs)
            self._diagnostics.on_scale(outputs.device.type)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val):
            if isinstance(val, torch.Tensor):
                self._check_scalable(val)
                state = self._lazy_init(val.device)
                scale = per_device.get(val.device)
                if scale is None:
                    scale = per_device[val.device] = state.scale.to(val.device, non_blocking=True)
                return val * scale
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise TypeError(f"scale() expects a Tensor or an iterable of Tensors, got {type(val).__name__}.")

        return apply(outputs)

    @staticmethod
    def _check_scalable(t: torch.Tensor) -> None:
        if t.device.type == "meta":
            raise ValueError(
                "scale() got a tensor on the meta device: it has no values, so there is no "
                "loss to scale and no device to keep the scale on. Compute the loss on the "
                "device the model runs on (meta tensors are for shape-only tracing)."
            )

    def unscale_(self, optimizer, *optimizers) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record inf/nan.

        Optional: ``step()`` unscales on its own. Call it to work on true gradients before
        ``step()`` (e.g. ``clip_grad_norm_``). At most once per optimizer per iteration.
        Several optimizers may be passed at once; unscaling every optimizer before the
        first ``step()`` lets one host sync serve the whole iteration. Never synchronizes.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=1.0)
            >>> scaler = GradScaler("cpu", init_scale=4.0)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.unscale_(opt)
            >>> model.bias.grad.item()
            1.0
        """
        if not self._enabled:
            return
        opts = (optimizer, *optimizers)
        state = self._require_state("unscale_")
        for opt in opts:
            self._check_optimizer(opt, "unscale_")
            stage = self._record(opt).stage
            if stage is OptState.UNSCALED:
                raise RuntimeError("unscale_() has already been called on this optimizer since the last update(). Call it at most once per iteration.")
            if stage is OptState.STEPPED:
                raise RuntimeError("unscale_() is being called after step() for this optimizer (state STEPPED); call update() to start the next iteration first.")
        if len({id(o) for o in opts}) != len(opts):
            raise RuntimeError("unscale_() got the same optimizer twice; pass each optimizer once.")
        # Every optimizer's gradients are collected (and fp16 ones refused) before any is
        # unscaled, so a refused call changes nothing.
        collected = [collect_grads(opt, refuse_fp16=True) for opt in opts]
        # Computed in fp64, then rounded once to fp32: a float reciprocal of a large scale
        # could round differently from torch's and desynchronize the two scalers.
        inv_scale = state.scale.double().reciprocal().float()
        for opt, grads in zip(opts, collected):
            found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
            rec = self._record(opt)
            rec.found_inf_per_device = self._unscale_grads_(opt, inv_scale, found_inf, collected=grads)
            rec.found_inf_host = None
            rec.stage = OptState.UNSCALED
        self._reduce_found_inf_(opts)

    def step(self, optimizer, *args, **kwargs):
        """Unscale if needed, then run ``optimizer.step(*args, **kwargs)`` unless gradients overflowed.

        Returns what ``optimizer.step`` returned, or None when the step was skipped. Closures
        are not supported. For optimizers with ``_step_supports_amp_scaling`` the optimizer
        receives ``grad_scale`` / ``found_inf`` and skips on the device (no sync).

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=1.0)
            >>> scaler = GradScaler("cpu")
            >>> scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
            >>> scaler.step(opt) is None   # skipped: the gradients hold inf/nan
            True
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported when GradScaler is enabled: compute the loss, scale(loss).backward(), then step().")
        self._check_optimizer(optimizer, "step")
        state = self._require_state("step")
        rec = self._record(optimizer)
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update() for this optimizer (state STEPPED); call update() first.")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, rec, state, args, kwargs)

        if rec.stage is OptState.READY:
            self.unscale_(optimizer)
        if not rec.found_inf_per_device:
            raise RuntimeError(
                "step(): no inf checks were recorded for this optimizer, because none of its "
                "parameters has a gradient (.grad is None for all), so whether its step is safe "
                "cannot be decided. Run backward() on a loss that reaches its parameters before "
                "step(), or do not step this optimizer in this iteration; update() then starts "
                "the next one."
            )
        if rec.found_inf_host is None:
            self._read_pending_flags()
        if rec.found_inf_host:
            self._diagnostics.on_skip(optimizer, self._state.scale, rec.checked_per_device, rec.nonfinite_host)
            retval = None
        else:
            retval = optimizer.step(*args, **kwargs)
        rec.stage = OptState.STEPPED
        return retval

    def _fused_step(self, optimizer, rec: _OptRecord, state: ScaleState, args, kwargs):
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler passes itself as `grad_scaler` only for backward compatibility; optimizers "
                "should read `grad_scale` and `found_inf` attributes instead.",
                FutureWarning,
                stacklevel=3,
            )
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            rec.stage = OptState.STEPPED
            return retval
        rec.fused = True
        if rec.stage is OptState.READY:
            found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
            rec.found_inf_per_device = self._unscale_grads_(optimizer, state.scale, found_inf, check_only=True)
            self._reduce_found_inf_([optimizer])
        _dist.wait_reductions([rec])
        flags = [f.to(state.scale.device, non_blocking=True) for f in rec.found_inf_per_device.values()]
        found_inf = torch.stack(flags).sum() if flags else torch.zeros((), dtype=torch.float32, device=state.scale.device)
        # After an explicit unscale_() the gradients are true gradients: the optimizer must
        # not divide again, so it keeps whatever grad_scale it had (normally none).
        if rec.stage is OptState.UNSCALED:
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
        else:
            optimizer.grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
        optimizer.found_inf = found_inf
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        rec.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off after an overflow, grow after ``growth_interval`` clean steps.

        ``new_scale`` (a float or a 1-element tensor) sets the scale instead. It is checked
        as ``init_scale`` is: finite, > 0, in float32's normal range and within
        ``[min_scale, max_scale]``, else ``ValueError`` and the scaler is left as it was
        (this iteration's flags included, so ``update()`` can be called again). Never
        syncs, except that a tensor ``new_scale`` is read on the host to be checked: one
        sync, only in a call that passes one.

        Example::

            >>> scaler = GradScaler("cpu", init_scale=4.0)
            >>> _ = scaler.scale(torch.ones(()))
            >>> scaler.update(new_scale=16.0)
            >>> scaler.get_scale()
            16.0
        """
        if not self._enabled:
            return
        state = self._require_state("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                reason = "new_scale must be a float or a 1-element tensor on the scaler's device type with requires_grad=False"
                if new_scale.device.type != state.scale.device.type:
                    raise ValueError(f"{reason}; got a tensor on {new_scale.device}.")
                if new_scale.numel() != 1:
                    raise ValueError(f"{reason}; got {new_scale.numel()} elements.")
                if new_scale.requires_grad:
                    raise ValueError(f"{reason}; got one that requires grad.")
                if not new_scale.is_floating_point():
                    raise TypeError(f"{reason}; got dtype {new_scale.dtype}.")
                # Checked on the host: only a read can refuse it before it becomes the
                # scale (a device-side check could only clamp or ignore it silently).
                value = new_scale.detach().reshape(()).item()
            elif is_real(new_scale):
                value = new_scale
            else:
                raise TypeError(f"new_scale must be a float or a 1-element tensor, got {type(new_scale).__name__}.")
            check_scale("new_scale", value)
            self._config.check_within_bounds("new_scale", float(value))
        _dist.wait_reductions(self._records.values())
        device = state.scale.device
        found_infs = [
            f if f.device == device else f.to(device, non_blocking=True)
            for rec in self._records.values()
            for f in rec.found_inf_per_device.values()
        ]
        if new_scale is None and not found_infs:
            # The iteration cannot end normally, but it is over: forget its per-optimizer
            # state so the next one can unscale and step again.
            self._records = {}
            raise RuntimeError(
                "update() found no inf checks since the last update(): no optimizer stepped "
                "with gradients. Call scaler.step(optimizer) (or unscale_) for at least one "
                "optimizer whose parameters have gradients first. The scale is unchanged and "
                "this iteration's per-optimizer state was reset."
            )
        combined = (torch.stack(found_infs).sum() if len(found_infs) > 1 else found_infs[0]) if found_infs else None
        # The scale this step ran with, before it changes.
        # Without any check (update(new_scale) alone) the step counts as clean.
        self._diagnostics.history.record(state.scale, combined if combined is not None else torch.zeros_like(state.scale))
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                state.scale.copy_(new_scale.reshape(()))
            else:
                state.scale.fill_(float(new_scale))
            if combined is not None:  # the step was still skipped; keep the count honest
                state.skipped_steps.add_(combined != 0)
        else:
            _update_scale(
                state,
                combined,
                self._config.growth_factor,
                self._config.backoff_factor,
                self._config.growth_interval,
                hysteresis=self._config.hysteresis,
                # Without a min_scale the scale still stops at the smallest normal
                # float32: halving on into subnormals reaches 0 after ~150 overflows in a
                # row, and a zero scale turns the next clean step's gradients into nan.
                min_scale=self._config.min_scale if self._config.min_scale is not None else FP32_TINY,
                max_scale=self._config.max_scale,
                backend=self._backend,
            )
        seen = [rec.found_inf_host for rec in self._records.values() if rec.found_inf_host is not None]
        fused_flags = [
            nonfinite
            for rec in self._records.values() if rec.fused
            for _, _, nonfinite in rec.checked_per_device.values() if nonfinite is not None
        ]
        self._diagnostics.on_update(seen, self.get_scale, combined, fused_flags)
        self._records = {}

    # ----------------------------------------------------------------------------------
    # accessors
    # ----------------------------------------------------------------------------------

    def scale_tensor(self) -> torch.Tensor | None:
        """The scale as a 0-d float32 tensor on its device (no sync), None before the first :meth:`scale`.

        Example::

            >>> scaler = GradScaler("cpu", init_scale=8.0)
            >>> _ = scaler.scale(torch.ones(()))
            >>> scaler.scale_tensor()
            tensor(8.)
        """
        return None if self._state is None else self._state.scale

    def found_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        """The inf/nan flags recorded for ``optimizer`` this iteration (no sync).

        ``device -> 0-d float32 tensor``, nonzero where that device's gradients held an
        inf or nan; empty before :meth:`unscale_` or :meth:`step` of this optimizer.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu")
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.unscale_(opt)
            >>> [flag.item() for flag in scaler.found_inf_per_device(opt).values()]
            [0.0]
        """
        rec = self._records.get(id(optimizer))
        if rec is None:
            return {}
        _dist.wait_reductions([rec])
        return rec.found_inf_per_device

    def _get_scale_async(self) -> torch.Tensor | None:
        return self.scale_tensor()

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device.

        Example::

            >>> GradScaler("cpu", init_scale=32.0).get_scale()
            32.0
        """
        if not self._enabled:
            return 1.0
        if self._state is None:
            return self._init_scale
        if self._config.min_scale is not None:
            self._warn_floor()
        return float(self._state.scale.item())

    def metrics(self) -> dict[str, float | int]:
        """The scaler's numbers for a training log, read with one host sync.

        ``loss_scale`` (what the next step's loss is multiplied by), ``skipped_steps`` and
        ``steps`` (``update()`` calls) so far, ``last_step_skipped`` (0 or 1) and
        ``overflow_params``: how many gradients held inf/nan on that step (0 when it was
        not skipped), fused optimizers included: they skip on the device, and their
        per-gradient flags are read here, in the same sync. The counts are of this
        process's gradients. Pickling keeps all five; ``state_dict()`` keeps the scale,
        ``steps`` and ``skipped_steps`` (a loaded state starts with no last step). A
        disabled scaler reports a scale of 1.0 and no steps. Call it only when a log is
        written: the integrations' metric callbacks do.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu", init_scale=8.0)
            >>> scaler.scale(model(torch.tensor([[1.0, float("inf")]])).sum()).backward()
            >>> _ = scaler.step(opt); scaler.update()
            >>> scaler.metrics()
            {'loss_scale': 4.0, 'skipped_steps': 1, 'steps': 1, 'last_step_skipped': 1, 'overflow_params': 1}
        """
        if not self._enabled:
            return {"loss_scale": 1.0, "skipped_steps": 0, "steps": 0, "last_step_skipped": 0, "overflow_params": 0}
        steps = self._diagnostics.history.steps
        outcome = self._diagnostics.outcome
        if self._state is None:
            # Before the first scale(), after pickling or loading: the outcome (if any) is
            # on the host already.
            skipped_now, overflowing = outcome.read() if outcome is not None else (False, 0)
            scale, skipped = float(self._init_scale), int(self._init_skipped_steps)
        else:
            state = self._state
            device = state.scale.device
            parts = [state.scale.reshape(1).double(), state.skipped_steps.reshape(1).double()]
            unread = outcome is not None and not outcome.is_read
            if unread:
                parts.append(outcome.device_values(device))
            values = torch.cat(parts).tolist()  # the one sync
            scale, skipped = values[0], int(values[1])
            if unread:
                skipped_now, overflowing = outcome.take(values[2:4])
            else:
                skipped_now, overflowing = outcome.read() if outcome is not None else (False, 0)
        return {"loss_scale": scale, "skipped_steps": skipped, "steps": steps,
                "last_step_skipped": int(skipped_now), "overflow_params": overflowing}

    def get_growth_factor(self) -> float:
        """The growth factor. Example: ``GradScaler("cpu").get_growth_factor() == 2.0``."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (must be > 1). Example: ``scaler.set_growth_factor(4.0)``."""
        self._config = self._config.replace(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor. Example: ``GradScaler("cpu").get_backoff_factor() == 0.5``."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Example: ``scaler.set_backoff_factor(0.25)``."""
        self._config = self._config.replace(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval. Example: ``GradScaler("cpu").get_growth_interval() == 2000``."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (int >= 1). Example: ``scaler.set_growth_interval(100)``."""
        self._config = self._config.replace(growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._state is None else int(self._state.growth_tracker.item())

    def is_enabled(self) -> bool:
        """Whether scaling is on. Example: ``GradScaler("cpu", enabled=False).is_enabled() is False``."""
        return self._enabled

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan gradients so far (counted on the device; reading it syncs).

        Example::

            >>> GradScaler("cpu").skipped_steps
            0
        """
        if not self._enabled:
            return 0
        if self._state is None:
            return self._init_skipped_steps
        return int(self._state.skipped_steps.item())

    @property
    def hysteresis(self) -> int:
        """Consecutive overflowing steps tolerated before a backoff (1: torch's behaviour)."""
        return self._config.hysteresis if self._enabled else 1

    # ----------------------------------------------------------------------------------
    # diagnostics
    # ----------------------------------------------------------------------------------

    def scale_history(self, last: int | None = None) -> list[tuple[int, float, bool]]:
        """``[(step, scale, skipped), ...]`` for the last ``history_size`` steps (or ``last``), oldest first.

        ``step`` counts ``update()`` calls from 0; ``scale`` is the scale that step's loss
        was multiplied by (before ``update()`` changed it); ``skipped`` whether any
        gradient held inf/nan. Recorded on the device by ``update()``; reading it is one
        sync. Empty when disabled.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu", init_scale=8.0)
            >>> for x in (torch.ones(1, 2), torch.full((1, 2), float("inf"))):
            ...     opt.zero_grad()
            ...     scaler.scale(model(x).sum()).backward()
            ...     _ = scaler.step(opt); scaler.update()
            >>> scaler.scale_history()
            [(0, 8.0, False), (1, 8.0, True)]
        """
        if not self._enabled:
            return []
        return self._diagnostics.history.read(last)

    def name_parameters(self, source) -> None:
        """Give parameters names for :meth:`last_overflow`, warnings and logs.

        ``source``: an ``nn.Module`` or ``(name, parameter)`` pairs (``model.named_parameters()``);
        several calls add up. Without names, gradients are named by their place in the
        optimizer (``"SGD.param_groups[0][3]"``). Holds no parameter alive.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> scaler = GradScaler("cpu")
            >>> scaler.name_parameters(model)
        """
        self._diagnostics.add_names(source)

    def last_overflow(self, model=None) -> OverflowReport | None:
        """Which gradients held inf/nan on the most recent skipped step (None if none was seen).

        Counted on the device when ``step()`` decides to skip, read on the first call
        (one sync). It covers optimizers whose flag the host reads (ordinary optimizers);
        a fused optimizer (``_step_supports_amp_scaling``) skips on the device and is not
        reported. ``model`` (a module or
        ``named_parameters()`` pairs) names the parameters for this call. Counts are of
        this process's gradient values (a shard under FSDP2).

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu")
            >>> scaler.scale(model(torch.tensor([[1.0, float("inf")]])).sum()).backward()
            >>> _ = scaler.step(opt); scaler.update()
            >>> scaler.last_overflow(model).names
            ['weight']
        """
        return self._diagnostics.report(model)

    # ----------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state; loads into ``torch.amp.GradScaler`` too (it ignores our extra keys).

        Torch's keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``. Ours in addition: ``hysteresis``, ``min_scale``, ``max_scale``,
        ``_hysteresis_tracker``, ``_skipped_steps`` and ``_steps`` (``update()`` calls, the
        ``steps`` of :meth:`metrics`). Empty when disabled. Call it after ``update()``. One sync.

        Example::

            >>> sorted(GradScaler("cpu").state_dict())[:3]
            ['_growth_tracker', '_hysteresis_tracker', '_skipped_steps']
        """
        if not self._enabled:
            return {}
        if self._state is None:
            scale, tracker, hyst, skipped = self._init_scale, self._init_growth_tracker, self._init_hysteresis_tracker, self._init_skipped_steps
        else:
            st = self._state
            # One read for all four values (each fits a float64 exactly).
            values = torch.stack([st.scale.double(), st.growth_tracker.double(), st.hysteresis_tracker.double(), st.skipped_steps.double()]).tolist()
            scale, tracker, hyst, skipped = values[0], int(values[1]), int(values[2]), int(values[3])
        return {
            "scale": scale,
            **self._config.state_dict(),
            "_growth_tracker": tracker,
            "_hysteresis_tracker": hyst,
            "_skipped_steps": skipped,
            "_steps": self._diagnostics.history.steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (ours or ``torch.amp.GradScaler``'s).

        Takes what torch's scaler takes: numbers, 0-d tensors (``scale``, ``_growth_tracker``)
        and integral floats for the int fields. Everything is validated before anything
        changes: a missing key, a wrong type or an impossible value (scale <= 0 or not
        finite, growth_factor <= 1, ...) raises ``ValueError``/``TypeError`` naming the key,
        and the scaler keeps its state. Keys of
        ours that torch's dict lacks keep this scaler's configuration (hysteresis, bounds)
        and start their trackers fresh (``_steps``: at ``_skipped_steps``, the fewest
        steps that many skips took). The step count of :meth:`metrics` and
        :meth:`scale_history` continue from the loaded ``_steps``; the history itself, the
        last overflow report and the last step's flags are not in a state dict and start
        empty. A no-op when disabled.

        Example::

            >>> a = GradScaler("cpu", init_scale=8.0); b = GradScaler("cpu")
            >>> b.load_state_dict(a.state_dict()); b.get_scale()
            8.0
        """
        if not self._enabled:
            return
        loaded = parse_state_dict(state_dict, self._config)  # raises before anything changes
        self._config = loaded.config
        self._init_scale, self._init_growth_tracker = loaded.scale, loaded.growth_tracker
        self._init_hysteresis_tracker, self._init_skipped_steps = loaded.hysteresis_tracker, loaded.skipped_steps
        self._diagnostics.restart(loaded.steps)
        if self._state is not None:
            self._state.scale.fill_(loaded.scale)
            self._state.growth_tracker.fill_(loaded.growth_tracker)
            self._state.hysteresis_tracker.fill_(loaded.hysteresis_tracker)
            self._state.skipped_steps.fill_(loaded.skipped_steps)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._records:
                raise RuntimeError("A GradScaler can be pickled only between iterations: before scale() or right after update().")
            sd = self.state_dict()
            state["_init_scale"] = sd["scale"]
            state["_init_growth_tracker"] = sd["_growth_tracker"]
            state["_init_hysteresis_tracker"] = sd["_hysteresis_tracker"]
            state["_init_skipped_steps"] = sd["_skipped_steps"]
            state["_state"] = None
        if state.get("_process_group") not in (None, False):
            # A ProcessGroup does not pickle and belongs to one run: the copy uses the default rule.
            state["_process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "_growth_factor" in state and "_config" not in state:  # pickled before ScalerConfig
            state["_config"] = ScalerConfig(
                *(state.pop(f"_{k}") for k in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale"))
            )
        self.__dict__.update(state)
        self.__dict__.setdefault("_process_group", None)  # pickled before the argument existed

    # ----------------------------------------------------------------------------------
    # torch.amp.GradScaler's private members, with torch 2.13's meaning
    # ----------------------------------------------------------------------------------
    # Code written for torch's scaler reads these (accelerate calls
    # _lazy_init_scale_growth_tracker when it loads FSDP2 checkpoints; PyTorch's own
    # grad-scaling tests, FSDP's sharded scaler and others read _scale, _growth_tracker,
    # _per_optimizer_states, _unscale_grads_). We keep the names instead of subclassing
    # torch.amp.GradScaler: a subclass overriding every method would share only the class
    # name, and would silently inherit, with torch's state layout, any method a later torch
    # adds. isinstance(scaler, torch.amp.GradScaler) is therefore False; code that checks
    # it needs our scaler accepted explicitly (dispatch_amp.integrations does that).

    @property
    def _growth_factor(self) -> float:
        return self._config.growth_factor

    @property
    def _backoff_factor(self) -> float:
        return self._config.backoff_factor

    @property
    def _growth_interval(self) -> int:
        return self._config.growth_interval

    @property
    def _scale(self) -> torch.Tensor | None:
        """The scale tensor (0-d float32), or None before the first :meth:`scale`."""
        return None if self._state is None else self._state.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """Clean steps since the last change of scale (0-d int32), or None before the first :meth:`scale`."""
        return None if self._state is None else self._state.growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev) -> None:
        """Create the scale on ``dev`` now instead of at the first :meth:`scale` (as torch's)."""
        if self._state is not None:
            raise RuntimeError(f"_lazy_init_scale_growth_tracker: the scale already exists on {self._state.scale.device}.")
        self._lazy_init(torch.device(dev))

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        """``id(optimizer) -> {"stage": torch.amp.grad_scaler.OptState, "found_inf_per_device": {...}}``.

        A snapshot in torch's form; optimizers not seen this iteration read as READY.
        """
        from torch.amp.grad_scaler import OptState as TorchOptState

        states: dict[int, dict[str, Any]] = collections.defaultdict(
            lambda: {"stage": TorchOptState.READY, "found_inf_per_device": {}}
        )
        for key, rec in self._records.items():
            states[key] = {"stage": TorchOptState[rec.stage.name], "found_inf_per_device": rec.found_inf_per_device}
        return states

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        return self.found_inf_per_device(optimizer)

    def _check_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        state = self._require_state("_check_inf_per_device")
        found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
        rec = self._record(optimizer)
        rec.found_inf_per_device = self._unscale_grads_(optimizer, state.scale, found_inf, check_only=True)
        return rec.found_inf_per_device
