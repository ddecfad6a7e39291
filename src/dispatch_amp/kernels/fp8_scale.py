"""fp8 scales and statistics: the scale of an amax, and what a call records.

Public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`scale_from_amax_reference`: ``fp8_max / amax / 2**margin``, clamped to float32's
  largest value, optionally rounded down to a power of two; 1 for an amax of 0.
* :func:`record_reference`: a call's statistics and, for delayed scaling, its history
  update, on one role's state (layout below), as new tensors.
* :func:`record_`: the same in place, as one single-program kernel that reads the call's
  amax and saturated count from the accumulators the cast kernels filled and puts them
  back to 0 (no host read, no per-field kernels).

State layout of one role (``f`` float32, ``i`` int64; leading batch dimensions allowed)::

    f = [scale, last amax, last scale used, initialized, pending amax, history (newest first)...]
    i = [saturated values so far, calls so far, the running call's saturated count]

A call with amax ``a``, scale used ``s`` and ``k`` saturated values records ``f[1] = a``,
``f[2] = s``, ``i[0] += k``, ``i[1] += 1``, ``i[2] = 0``. With a history it also either
advances it (``history = [a] + history[:-1]``; ``ref`` = its max, or ``a`` for
``most_recent``; ``scale = scale_from_amax(ref)`` unless ``ref`` is 0, inf or nan, when
the scale stays; ``initialized = 1`` once an ``a`` was positive and finite) or, deferred
(amaxes reduced across ranks later), keeps ``pending = max(pending, a)`` (nan wins).

Rule of the scale (all float32)::

    s = fp8_max / amax
    s = s / 2**margin                          # if margin
    s = where(s > FLT_MAX, FLT_MAX, s)         # never inf; nan stays nan
    s = floor_power_of_two(s)                  # if power_of_two: mantissa bits cleared
    s = where(amax == 0, 1, s)
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch rule works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

from ._launch import launch, use_triton
from .unscale import BACKENDS

__all__ = ["record_", "pack", "F_SCALE", "F_AMAX", "F_SHOWN", "F_INIT", "F_PENDING", "F_HISTORY", "I_SATURATED", "I_CALLS",
           "I_ACC_SATURATED", "NO_PENDING", "FLOAT32_MAX", "floor_power_of_two", "scale_from_amax_reference",
           "record_reference", "advance_reference"]

F_SCALE, F_AMAX, F_SHOWN, F_INIT, F_PENDING, F_HISTORY = 0, 1, 2, 3, 4, 5
I_SATURATED, I_CALLS, I_ACC_SATURATED = 0, 1, 2
# A pending amax of -1: nothing recorded since the last cross-rank reduction.
NO_PENDING = -1.0
FLOAT32_MAX = torch.finfo(torch.float32).max
_float32 = torch.float32


def pack(history: torch.Tensor, *, scale: float = 1.0, initialized: float = 0.0) -> torch.Tensor:
    """One role's ``f`` (float32, the layout above) from its named fields: the delayed
    scale, the initialized flag and the amax history; no call recorded, no amax pending.

    Example::

        >>> pack(torch.zeros(2), scale=224.0, initialized=1.0).tolist()
        [224.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]
    """
    head = torch.zeros(F_HISTORY, dtype=_float32)
    head[F_SCALE], head[F_INIT], head[F_PENDING] = scale, initialized, NO_PENDING
    return torch.cat([head, history.detach().to("cpu", _float32).reshape(-1)])


def floor_power_of_two(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two ``<= s`` for non-negative float32 ``s``, from its bits: the
    exponent of a normal number, the highest set bit of a subnormal one; 0 stays 0, inf
    stays inf and nan stays nan.

    Example::

        >>> floor_power_of_two(torch.tensor([7.99, 8.0, 0.0])).tolist()
        [4.0, 8.0, 0.0]
    """
    bits = s.view(torch.int32)
    normal = bits & 0x7F800000
    high = bits | (bits >> 1)
    for shift in (2, 4, 8, 16):
        high = high | (high >> shift)
    subnormal = high - (high >> 1)
    out = torch.where(bits >= 0x00800000, normal, subnormal).view(_float32)
    return torch.where(torch.isnan(s), s, out)


def scale_from_amax_reference(amax: torch.Tensor, fp8_max, margin: int = 0,
                              power_of_two: bool = False) -> torch.Tensor:
    """The scale of ``amax`` (float32, elementwise) by the rule in the module docstring;
    ``fp8_max`` a float or a float32 tensor that broadcasts with ``amax``.

    Example::

        >>> scale_from_amax_reference(torch.tensor([2.0, 0.0, 1e-38]), 448.0).tolist()
        [224.0, 1.0, 3.4028234663852886e+38]
    """
    a = amax.to(_float32)
    s = (fp8_max if isinstance(fp8_max, torch.Tensor) else torch.full_like(a, fp8_max)) / a
    if margin:
        s = s / (2.0 ** margin)
    s = torch.where(s > FLOAT32_MAX, torch.full_like(s, FLOAT32_MAX), s)
    if power_of_two:
        s = floor_power_of_two(s)
    return torch.where(a == 0, torch.ones_like(s), s)


def advance_reference(f: torch.Tensor, amax: torch.Tensor, fp8_max, margin: int = 0,
                      power_of_two: bool = False, most_recent: bool = False) -> torch.Tensor:
    """``f`` with ``amax`` pushed into its history, the scale and the initialized flag
    updated (statistics and pending amax untouched). Batched over leading dimensions."""
    a = amax.to(_float32)
    scale, init, history = f[..., F_SCALE], f[..., F_INIT], f[..., F_HISTORY:]
    history = torch.cat([a.unsqueeze(-1), history[..., :-1]], -1)
    ref = a if most_recent else history.amax(-1)
    keep = (ref == 0) | ~torch.isfinite(ref)
    scale = torch.where(keep, scale, scale_from_amax_reference(ref, fp8_max, margin, power_of_two))
    init = torch.where((a > 0) & torch.isfinite(a), torch.ones_like(init), init)
    head = torch.stack([scale, f[..., F_AMAX], f[..., F_SHOWN], init, f[..., F_PENDING]], -1)
    return torch.cat([head, history], -1)


def record_reference(f: torch.Tensor, i: torch.Tensor, amax: torch.Tensor, scale_used: torch.Tensor,
                     saturated: torch.Tensor, *, history: bool, fp8_max: float = 448.0, margin: int = 0,
                     power_of_two: bool = False, most_recent: bool = False,
                     defer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(f, i)`` after a call, by the rule in the module docstring.

    Example::

        >>> f = torch.tensor([1.0, 0, 0, 0, -1, 0, 0]); i = torch.zeros(3, dtype=torch.int64)
        >>> f, i = record_reference(f, i, torch.tensor(2.0), torch.tensor(1.0), torch.tensor(0), history=True)
        >>> f.tolist(), i.tolist()
        ([224.0, 2.0, 1.0, 1.0, -1.0, 2.0, 0.0], [0, 1, 0])
    """
    a = amax.to(_float32)
    pending = f[..., F_PENDING]
    if history and defer:
        pending = torch.maximum(pending, a)
    head = torch.stack([f[..., F_SCALE], a, scale_used.to(_float32), f[..., F_INIT], pending], -1)
    f = torch.cat([head, f[..., F_HISTORY:]], -1)
    if history and not defer:
        f = advance_reference(f, a, fp8_max, margin, power_of_two, most_recent)
    i = torch.stack([i[..., I_SATURATED] + saturated, i[..., I_CALLS] + 1, torch.zeros_like(i[..., I_CALLS])], -1)
    return f, i


# --------------------------------------------------------------------------------------
# The Triton kernel
# --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def scale_of(a, FP8_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr):
        """scale_from_amax_reference of a float32 scalar amax, bit for bit. div_rn: the
        division rounded as torch's (a GPU's plain division may be approximate)."""
        s = tl.math.div_rn(tl.zeros_like(a) + FP8_MAX, a)
        if MARGIN_MUL != 1.0:
            s = s * MARGIN_MUL  # a power of two: the same rounding as torch's division by 2**margin
        s = tl.where(s > 3.4028234663852886e38, 3.4028234663852886e38, s)  # nan stays nan
        if POW2:
            bits = s.to(tl.int32, bitcast=True)
            high = bits | (bits >> 1)
            high = high | (high >> 2)
            high = high | (high >> 4)
            high = high | (high >> 8)
            high = high | (high >> 16)
            low = tl.where(bits >= 0x00800000, bits & 0x7F800000, high - (high >> 1)).to(tl.float32, bitcast=True)
            s = tl.where(s != s, s, low)
        return tl.where(a == 0, 1.0, s)

    @triton.jit
    def _record_kernel(
        f_ptr, i_ptr,  # the role's state (module docstring)
        acc_ptr,  # int32: the call's amax as float32 bits
        sat_ptr,  # int64: the call's saturated count
        sc_ptr,  # float32: the scale the call used
        snap_ptr,  # int64 [2]: receives (amax bits, count) when SNAPSHOT
        L,  # history length
        # The layout's offsets (F_* and I_* above, the one place they are defined).
        O_SCALE: tl.constexpr, O_AMAX: tl.constexpr, O_SHOWN: tl.constexpr, O_INIT: tl.constexpr,
        O_PENDING: tl.constexpr, O_HISTORY: tl.constexpr, O_SATURATED: tl.constexpr, O_CALLS: tl.constexpr,
        HISTORY: tl.constexpr, DEFER: tl.constexpr, MOST_RECENT: tl.constexpr, FP8_MAX: tl.constexpr,
        MARGIN_MUL: tl.constexpr, POW2: tl.constexpr, RESET: tl.constexpr, SNAPSHOT: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        a_bits = tl.load(acc_ptr)
        a = a_bits.to(tl.float32, bitcast=True)
        sat = tl.load(sat_ptr)
        if SNAPSHOT:
            tl.store(snap_ptr, a_bits.to(tl.int64))
            tl.store(snap_ptr + 1, sat)
        if RESET:  # ready for the next call's kernels
            tl.store(acc_ptr, tl.zeros_like(a_bits))
            tl.store(sat_ptr, tl.zeros_like(sat))
        tl.store(f_ptr + O_AMAX, a)
        tl.store(f_ptr + O_SHOWN, tl.load(sc_ptr))
        tl.store(i_ptr + O_SATURATED, tl.load(i_ptr + O_SATURATED) + sat)
        tl.store(i_ptr + O_CALLS, tl.load(i_ptr + O_CALLS) + 1)
        if HISTORY:
            if DEFER:
                p = tl.load(f_ptr + O_PENDING)
                tl.store(f_ptr + O_PENDING, tl.where(a != a, a, tl.where(p != p, p, tl.maximum(p, a))))
            else:
                j = tl.arange(0, BLOCK_L)
                older = tl.load(f_ptr + O_HISTORY - 1 + j, mask=(j > 0) & (j < L), other=0.0)
                history = tl.where(j == 0, a, older)
                tl.debug_barrier()  # every old entry read before any is overwritten
                tl.store(f_ptr + O_HISTORY + j, history, mask=j < L)
                if MOST_RECENT:
                    ref = a
                else:  # amaxes are >= 0 or nan: the integer max of the bits is the max, nan winning
                    ref = tl.max(history.to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
                keep = (ref == 0) | ~(tl.abs(ref) < float("inf"))
                scale = tl.load(f_ptr + O_SCALE)
                tl.store(f_ptr + O_SCALE, tl.where(keep, scale, scale_of(ref, FP8_MAX, MARGIN_MUL, POW2)))
                init = tl.load(f_ptr + O_INIT)
                tl.store(f_ptr + O_INIT, tl.where((a > 0) & (a < float("inf")), 1.0, init))


def record_(f: torch.Tensor, i: torch.Tensor, amax_acc: torch.Tensor, saturated_acc: torch.Tensor,
            scale_used: torch.Tensor, *, history: bool, fp8_max: float = 448.0, margin: int = 0,
            power_of_two: bool = False, most_recent: bool = False, defer: bool = False, reset: bool = True,
            snapshot: torch.Tensor | None = None, backend: str = "auto") -> None:
    """:func:`record_reference` in place: the call's amax (float32 bits in the one-element
    int32 ``amax_acc``), saturated count (one-element int64 ``saturated_acc``) and scale
    (the first element of the float32 ``scale_used``) go into one role's ``f``/``i``; with
    ``reset`` both accumulators go back to 0; ``snapshot`` (int64, 2 elements) receives
    them first. One launch; never synchronizes.

    Example::

        >>> f = torch.tensor([1.0, 0, 0, 0, -1, 0, 0]); i = torch.zeros(3, dtype=torch.int64)
        >>> acc = torch.tensor([2.0]).view(torch.int32).clone()
        >>> record_(f, i, acc, i[2:], torch.tensor(1.0), history=True)
        >>> f.tolist(), acc.item()
        ([224.0, 2.0, 1.0, 1.0, -1.0, 2.0, 0.0], 0)
    """
    if backend not in BACKENDS:
        raise ValueError(f"record_: backend must be one of {BACKENDS}, got {backend!r}.")
    if use_triton(backend, f.device, "record_"):
        n = f.numel() - F_HISTORY
        with torch.no_grad():
            launch(_record_kernel, (1,), f, i, amax_acc, saturated_acc, scale_used,
                   snapshot if snapshot is not None else i, n, O_SCALE=F_SCALE, O_AMAX=F_AMAX, O_SHOWN=F_SHOWN,
                   O_INIT=F_INIT, O_PENDING=F_PENDING, O_HISTORY=F_HISTORY, O_SATURATED=I_SATURATED,
                   O_CALLS=I_CALLS, HISTORY=bool(history), DEFER=bool(defer),
                   MOST_RECENT=bool(most_recent), FP8_MAX=float(fp8_max), MARGIN_MUL=2.0 ** -margin,
                   POW2=bool(power_of_two), RESET=bool(reset), SNAPSHOT=snapshot is not None,
                   BLOCK_L=max(16, triton.next_power_of_2(max(n, 1))), num_warps=1)
        return
    with torch.no_grad():
        a = amax_acc.view(torch.float32).reshape(())
        sat = saturated_acc.reshape(())
        if snapshot is not None:
            snapshot.copy_(torch.stack([amax_acc.reshape(()).to(torch.int64), sat]))
        new_f, new_i = record_reference(f, i, a, scale_used.reshape(-1)[0], sat, history=history, fp8_max=fp8_max, margin=margin,
                                        power_of_two=power_of_two, most_recent=most_recent, defer=defer)
        if reset:
            amax_acc.zero_()
            saturated_acc.zero_()
        f.copy_(new_f)
        i.copy_(new_i)
