"""Device-side loss-scale update: growth/backoff, opt-in hysteresis and bounds, skip counting.

One call of :func:`update_scale_` is the end of one training step. It reads the step's
``found_inf`` (the sum of every optimizer's flag; any nonzero value, nan included, means
an overflow) and rewrites the scale state in place, on the device, without a host sync.

Rule (``hysteresis=1`` and no bounds is exactly ``torch._amp_update_scale_``)::

    overflow:  growth_tracker = 0
               skipped_steps += 1
               hysteresis_tracker = max(hysteresis_tracker - 1, 0)
               if hysteresis_tracker == 0:            # N consecutive overflows
                   scale = scale * backoff_factor      # not below min_scale; floor_hits += 1 if clamped
    clean:     hysteresis_tracker = hysteresis         # "consecutive": one clean step resets it
               growth_tracker += 1
               if growth_tracker == growth_interval:
                   growth_tracker = 0
                   new = min(scale * growth_factor, max_scale)
                   if new is finite: scale = new       # never grow to inf

Products are formed in fp64 and rounded once to fp32, as torch's kernels do (its CUDA
kernel takes the factors as doubles too: bit-equal on an H100 with non-power-of-two
factors, tests/cuda/test_kernels_cuda.py).
Hysteresis follows Megatron-LM/DeepSpeed: the tracker is not refilled by a backoff, so once
N overflows in a row have happened, each further overflow in the run backs off again.
"""

from __future__ import annotations

import math
import os
import struct

import torch

from .unscale import BACKENDS

_FP32_TINY = torch.finfo(torch.float32).tiny

try:  # Triton is optional: the torch path below works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["update_scale_", "update_scale_reference", "ScaleState"]


if triton is not None:

    @triton.jit
    def _update_scale_kernel(
        scale_ptr,  # fp32 scalar, updated in place
        growth_tracker_ptr,  # int32 scalar: consecutive clean steps since the last growth/overflow
        found_inf_ptr,  # fp32 scalar: nonzero (or nan) means this step overflowed
        hysteresis_tracker_ptr,  # int32 scalar: overflows still tolerated before a backoff
        skipped_ptr,  # int64 scalar: running count of overflowing steps
        floor_hits_ptr,  # int64 scalar: backoffs clamped at min_scale
        factors_ptr,  # fp64 [growth_factor, backoff_factor, min_scale, max_scale]
        growth_interval,  # int
        hysteresis,  # int >= 1
        HAS_MIN: tl.constexpr,
        HAS_MAX: tl.constexpr,
    ):
        scale = tl.load(scale_ptr)
        tracker = tl.load(growth_tracker_ptr)
        found = tl.load(found_inf_ptr) != 0.0  # nan != 0 is True: nan counts as an overflow
        hyst = tl.load(hysteresis_tracker_ptr)
        growth = tl.load(factors_ptr)
        backoff = tl.load(factors_ptr + 1)

        hyst_after = tl.where(found, tl.maximum(hyst - 1, 0), hysteresis)
        back_off = found & (hyst_after <= 0)
        backed = (scale.to(tl.float64) * backoff).to(tl.float32)
        hit = found != found  # all False; becomes a real test when there is a floor
        if HAS_MIN:
            floor = tl.load(factors_ptr + 2).to(tl.float32)
            hit = back_off & (backed < floor)
            backed = tl.where(backed < floor, floor, backed)

        succ = tracker + 1
        grow = (~found) & (succ == growth_interval)
        grown = (scale.to(tl.float64) * growth).to(tl.float32)
        if HAS_MAX:
            ceiling = tl.load(factors_ptr + 3).to(tl.float32)
            grown = tl.where(grown > ceiling, ceiling, grown)
        grown_ok = tl.abs(grown) < float("inf")

        new_scale = tl.where(back_off, backed, tl.where(grow & grown_ok, grown, scale))
        tl.store(scale_ptr, new_scale)
        tl.store(growth_tracker_ptr, tl.where(found | grow, 0, succ).to(tl.int32))
        tl.store(hysteresis_tracker_ptr, hyst_after.to(tl.int32))
        tl.store(skipped_ptr, tl.load(skipped_ptr) + found.to(tl.int64))
        tl.store(floor_hits_ptr, tl.load(floor_hits_ptr) + hit.to(tl.int64))


class ScaleState:
    """The device tensors one loss scaler updates each step (all 0-d, all on one device).

    ``scale`` fp32, ``growth_tracker`` int32 (the two torch keeps), ``hysteresis_tracker``
    int32, ``skipped_steps`` and ``floor_hits`` int64.

    Example::

        >>> st = ScaleState.create(torch.device("cpu"), init_scale=1024.0, hysteresis=2)
        >>> st.scale.item(), int(st.hysteresis_tracker)
        (1024.0, 2)
    """

    __slots__ = ("scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "floor_hits")

    def __init__(self, scale, growth_tracker, hysteresis_tracker, skipped_steps, floor_hits) -> None:
        self.scale = scale
        self.growth_tracker = growth_tracker
        self.hysteresis_tracker = hysteresis_tracker
        self.skipped_steps = skipped_steps
        self.floor_hits = floor_hits

    @classmethod
    def create(cls, device, init_scale: float, growth_tracker: int = 0, hysteresis: int = 1, hysteresis_tracker: int | None = None, skipped_steps: int = 0) -> ScaleState:
        def full(value, dtype):
            return torch.full((), value, dtype=dtype, device=device)

        return cls(
            full(init_scale, torch.float32),
            full(growth_tracker, torch.int32),
            full(hysteresis if hysteresis_tracker is None else hysteresis_tracker, torch.int32),
            full(skipped_steps, torch.int64),
            full(0, torch.int64),
        )


_factor_cache: dict[tuple, torch.Tensor] = {}


def _factors(device, growth_factor, backoff_factor, min_scale, max_scale) -> torch.Tensor:
    # Triton passes Python floats as fp32; fp64 factors travel in a small cached tensor.
    key = (device, growth_factor, backoff_factor, min_scale, max_scale)
    t = _factor_cache.get(key)
    if t is None:
        values = [growth_factor, backoff_factor, min_scale or 0.0, max_scale or 0.0]
        t = torch.tensor(values, dtype=torch.float64, device=device)
        if len(_factor_cache) > 64:
            _factor_cache.clear()
        _factor_cache[key] = t
    return t


def _validate(state: ScaleState, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"update_scale_: backend must be one of {BACKENDS}, got {backend!r}.")
    if state.scale.dtype != torch.float32 or state.scale.numel() != 1:
        raise TypeError("update_scale_: scale must be a 1-element float32 tensor.")
    if state.growth_tracker.dtype != torch.int32 or state.growth_tracker.numel() != 1:
        raise TypeError("update_scale_: growth_tracker must be a 1-element int32 tensor.")
    if found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise TypeError("update_scale_: found_inf must be a 1-element float32 tensor.")
    device = state.scale.device
    for name in ScaleState.__slots__:
        if getattr(state, name).device != device:
            raise ValueError(f"update_scale_: {name} is on {getattr(state, name).device}, scale on {device}.")
    if found_inf.device != device:
        raise ValueError(f"update_scale_: found_inf is on {found_inf.device}, scale on {device}; move it first.")
    if not isinstance(hysteresis, int) or hysteresis < 1:
        raise ValueError(f"update_scale_: hysteresis must be an int >= 1, got {hysteresis!r}.")
    for name, v in (("min_scale", min_scale), ("max_scale", max_scale)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"update_scale_: {name} must be a finite positive float or None, got {v!r}.")


def _torch_update(state: ScaleState, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale) -> None:
    floor_only = min_scale is not None and min_scale <= _FP32_TINY
    if hysteresis == 1 and (min_scale is None or floor_only) and max_scale is None:
        # torch's fused op is the fastest exact path for its own rule; the trackers take
        # two more small ops (each costs microseconds on CPU, so no more than needed).
        torch._amp_update_scale_(state.scale, state.growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        if floor_only:
            # A floor at the smallest normal float32 (GradScaler's default) changes only
            # scales torch would take into subnormals or to 0: one clamp, no hit count.
            state.scale.clamp_(min=min_scale)
        # What the general rule gives for N=1: 1 after a clean step, 0 after an overflow
        # (nan == 0 is False: nan is an overflow).
        torch.eq(found_inf, 0, out=state.hysteresis_tracker)
        state.skipped_steps.add_(1).sub_(state.hysteresis_tracker)
        return
    found = found_inf != 0  # nan != 0 is True
    scale = state.scale
    hyst_after = torch.where(found, (state.hysteresis_tracker - 1).clamp_min(0), hysteresis)
    back_off = found & (hyst_after <= 0)
    backed = (scale.double() * backoff_factor).float()
    hit = torch.zeros_like(found)
    if min_scale is not None:
        floor = torch.tensor(min_scale, dtype=torch.float32, device=scale.device)
        below = backed < floor
        hit = back_off & below
        backed = torch.where(below, floor, backed)
    succ = state.growth_tracker + 1
    grow = found.logical_not() & (succ == growth_interval)
    grown = (scale.double() * growth_factor).float()
    if max_scale is not None:
        ceiling = torch.tensor(max_scale, dtype=torch.float32, device=scale.device)
        grown = torch.where(grown > ceiling, ceiling, grown)
    new_scale = torch.where(back_off, backed, torch.where(grow & torch.isfinite(grown), grown, scale))
    state.scale.copy_(new_scale)
    state.growth_tracker.copy_(torch.where(found | grow, 0, succ))
    state.hysteresis_tracker.copy_(hyst_after)
    state.skipped_steps.add_(found)
    state.floor_hits.add_(hit)


def update_scale_(
    state: ScaleState,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
    backend: str = "auto",
) -> None:
    """Advance the loss-scale state by one step, on the device, without a host sync.

    See the module docstring for the rule. With ``hysteresis=1`` and no bounds it is bit for
    bit ``torch._amp_update_scale_`` on ``state.scale`` / ``state.growth_tracker``, plus the
    skip counter. ``backend``: ``"auto"`` (Triton on CUDA when installed, else torch),
    ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Example::

        >>> st = ScaleState.create(torch.device("cpu"), init_scale=1024.0, hysteresis=2)
        >>> overflow = torch.ones(())
        >>> update_scale_(st, overflow, 2.0, 0.5, 2000, hysteresis=2)   # tolerated
        >>> update_scale_(st, overflow, 2.0, 0.5, 2000, hysteresis=2)   # second in a row
        >>> st.scale.item(), st.skipped_steps.item()
        (512.0, 2)
    """
    _validate(state, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, backend)
    _update_scale(state, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, backend)


def _update_scale(state, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, backend) -> None:
    """:func:`update_scale_` without its checks, for GradScaler: it built the state and
    checked the configuration, and this runs once per training step, where every
    microsecond shows on small models."""
    device = state.scale.device
    use_triton = backend == "triton" or (backend == "auto" and triton is not None and device.type == "cuda")
    if use_triton:
        if triton is None:
            raise RuntimeError("update_scale_: backend='triton' needs the triton package; use backend='torch'.")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise RuntimeError(
                "update_scale_: backend='triton' on CPU tensors runs only under Triton's interpreter; set "
                "TRITON_INTERPRET=1 before dispatch_amp.kernels is imported, or use backend='torch'."
            )
        _update_scale_kernel[(1,)](
            state.scale,
            state.growth_tracker,
            found_inf,
            state.hysteresis_tracker,
            state.skipped_steps,
            state.floor_hits,
            _factors(device, float(growth_factor), float(backoff_factor), min_scale, max_scale),
            int(growth_interval),
            int(hysteresis),
            HAS_MIN=min_scale is not None,
            HAS_MAX=max_scale is not None,
        )
    else:
        with torch.no_grad():
            _torch_update(state, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)


def round_to_float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest even), as a Python float; inf past its range.

    Example::

        >>> round_to_float32(0.1), round_to_float32(1e39)
        (0.10000000149011612, inf)
    """
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def update_scale_reference(
    scale: float,
    growth_tracker: int,
    found_inf: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> tuple[float, int, int, bool, bool]:
    """The update rule in plain Python: the oracle for the kernel's extensions.

    Returns ``(scale, growth_tracker, hysteresis_tracker, skipped, floor_hit)``; ``scale`` is
    an fp32 value held in a Python float.

    Example::

        >>> update_scale_reference(1024.0, 1, 0.0, 2.0, 0.5, 2)
        (2048.0, 0, 1, False, False)
    """
    f32 = round_to_float32
    found = found_inf != 0 or math.isnan(found_inf)
    if found:
        hyst = max(hysteresis_tracker - 1, 0)
        hit = False
        if hyst <= 0:
            backed = float(f32(float(f32(scale)) * backoff_factor))
            if min_scale is not None and backed < float(f32(min_scale)):
                backed, hit = float(f32(min_scale)), True
            scale = backed
        return float(f32(scale)), 0, hyst, True, hit
    succ = growth_tracker + 1
    if succ == growth_interval:
        grown = float(f32(float(f32(scale)) * growth_factor))
        if max_scale is not None:
            grown = min(grown, float(f32(max_scale)))
        if math.isfinite(grown):
            scale = grown
        succ = 0
    return float(f32(scale)), succ, hysteresis, False, False
