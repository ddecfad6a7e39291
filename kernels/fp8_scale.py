"""fp8 scales and statistics: the scale of an amax, and what a call records.

Public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`scale_from_amax_reference`: ``fp8_max / amax / 2**margin``, clamped to float32's
  largest value, optionally rounded down to a power of two; 1 for an amax of 0.
* :func:`record_reference`: a call's statistics and, for delayed scaling, its history
  update, on one role's state (layout below), as new tensors.

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

__all__ = ["F_SCALE", "F_AMAX", "F_SHOWN", "F_INIT", "F_PENDING", "F_HISTORY", "I_SATURATED", "I_CALLS",
           "I_ACC_SATURATED", "NO_PENDING", "FLOAT32_MAX", "floor_power_of_two", "scale_from_amax_reference",
           "record_reference", "advance_reference"]

F_SCALE, F_AMAX, F_SHOWN, F_INIT, F_PENDING, F_HISTORY = 0, 1, 2, 3, 4, 5
I_SATURATED, I_CALLS, I_ACC_SATURATED = 0, 1, 2
# A pending amax of -1: nothing recorded since the last cross-rank reduction.
NO_PENDING = -1.0
FLOAT32_MAX = torch.finfo(torch.float32).max
_float32 = torch.float32


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
