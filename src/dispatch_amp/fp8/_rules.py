"""The exact fp8 rules: formats, scales from amaxes, the saturating cast.

Every number the fp8 path produces follows from these functions; docs/fp8.md, "The rules",
states them in words and ``tests/fp8/test_linear.py`` re-implements them from that page as
its oracle. All arithmetic is float32. Nothing here reads a tensor on the host, so a
training step makes no device synchronization.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from ..kernels import fp8_cast as _kernels
from ..kernels import fp8_scale as _scale_kernels
from ..kernels.fp8_scale import FLOAT32_MAX, floor_power_of_two

__all__ = ["FORMATS", "fp8_max", "check_format", "amax", "scale_from_amax", "cast", "cast_with_amax",
           "cast_transpose", "kernels_in_use", "floor_power_of_two", "FLOAT32_MAX", "bias_grad"]

# The largest finite value of each format.
FORMATS: dict[torch.dtype, float] = {dt: _kernels.fp8_max(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}
# Every fp8 dtype torch has, the ones the fp8 path does not produce (the "fnuz" variants)
# included: none of them is an autocast dtype, and a gemm in any of them is an fp8 gemm.
ALL_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# A scaled value saturates when the clamp moves it to another fp8 value: beyond the
# midpoint between fp8_max and the format's next step (480 for e4m3fn, 65536 for e5m2).
# A value just above fp8_max (the scale's own rounding, amax * (fp8_max / amax)) does not.
SATURATES_ABOVE: dict[torch.dtype, float] = _kernels.SATURATES_ABOVE

# Which implementation of the per-tensor casts runs: "auto" is the Triton kernels on CUDA
# and torch elsewhere (kernels/fp8_cast.py, where both follow the same rule bit for bit).
# Tests set "triton" to run the kernels through Triton's interpreter on CPU tensors.
_BACKEND = "auto"

_float32 = torch.float32


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of ``fp8_dtype``.

    Example::

        >>> fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)
        (448.0, 57344.0)
    """
    return FORMATS[check_format(fp8_dtype, "fp8_dtype")]


def check_format(fp8_dtype, what: str) -> torch.dtype:
    """``fp8_dtype`` if it is a format the fp8 path takes, else a ValueError naming ``what``."""
    if fp8_dtype not in FORMATS:
        raise ValueError(
            f"{what} must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
        )
    return fp8_dtype


def amax(t: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
    """``max|t|`` in float32: a 0-d tensor, or one per row (shape ``(rows, 1)``) with
    ``rowwise``. A nan anywhere gives nan (torch's amax propagates it).

    ``|t|`` is exact in ``t``'s own dtype, so the maximum is taken there and only the
    result is widened: no float32 copy of ``t`` is made.
    """
    a = t.detach().abs()
    a = a.amax(dim=-1, keepdim=True) if rowwise else a.amax()
    return a.to(_float32)


def scale_from_amax(
    amax_: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0, power_of_two: bool = False
) -> torch.Tensor:
    """``scale = fp8_max / amax / 2**margin`` in float32, elementwise; an amax of 0 gives 1.

    The scale is clamped to float32's largest finite value (an amax below about
    ``fp8_max / 3.4e38`` would make it inf, and ``0 * inf`` is nan). With
    ``power_of_two`` it is then rounded down to a power of two by clearing its mantissa
    bits (exact, unlike ``exp2(floor(log2(s)))``, which can round up just below a power
    of two), so that multiplying by it is exact. An inf amax gives a scale of 0 and a nan
    amax a nan scale: the cast then turns every value into 0 or nan and the gemm's result
    is nan, so a non-finite input is never hidden. (``kernels/fp8_scale.py`` states the
    rule; this is it for an fp8 format.)

    Example::

        >>> scale_from_amax(torch.tensor(2.0), torch.float8_e4m3fn)
        tensor(224.)
    """
    return _scale_kernels.scale_from_amax_reference(amax_, FORMATS[fp8_dtype], margin, power_of_two)


def cast(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The saturating cast: ``(q, saturated)``.

    ``q = clamp(t.float() * scale, -fp8_max, fp8_max).to(fp8_dtype)`` for finite elements
    of ``t``; every inf or nan element becomes nan (torch's own cast would saturate inf to
    fp8_max and hide it). ``saturated`` (int64, 0-d) counts the finite elements with
    ``|t * scale|`` above ``SATURATES_ABOVE`` (464 for e4m3fn, 61440 for e5m2). ``scale`` is 0-d or broadcasts along rows (``(rows, 1)``).
    """
    limit = FORMATS[fp8_dtype]
    x = t.detach().to(_float32)
    y = x * scale
    finite = torch.isfinite(x)
    saturated = (finite & (y.abs() > SATURATES_ABOVE[fp8_dtype])).sum()
    q = torch.where(finite, y.clamp(-limit, limit), torch.full_like(y, float("nan"))).to(fp8_dtype)
    return q, saturated


def bias_grad(dy2: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a linear from its 2-D ``grad_output``: column sums in float32,
    in the fixed order of ``kernels/fp8_cast.py`` (blocks of 64 rows, each a pairwise tree,
    added in order), so that the kernel and the torch rule agree bit for bit."""
    if kernels_in_use(dy2):
        return _kernels.bias_grad(dy2.contiguous(), backend="triton")
    return _kernels.bias_grad_reference(dy2)


def _backend() -> str:
    # While torch.compile traces, the torch rule: the compiler fuses it itself.
    return "torch" if torch.compiler.is_compiling() else _BACKEND


def kernels_in_use(t: torch.Tensor) -> bool:
    """Whether the per-tensor casts of ``t`` run the Triton kernels."""
    backend = _backend()
    return backend == "triton" or (backend == "auto" and t.is_cuda and _kernels.triton is not None)


def cast_with_amax(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype):
    """``cast`` with a 0-d scale, plus ``amax(t)``: ``(q, amax, saturated)`` in one pass
    over ``t`` where the kernels run (delayed scaling's step)."""
    if not kernels_in_use(t):
        q, saturated = cast(t, scale, fp8_dtype)
        return q, amax(t), saturated
    return _kernels.amax_and_cast(t.contiguous(), scale, fp8_dtype, backend="triton")


def cast_transpose(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype):
    """``cast_with_amax`` of a 2-D ``t`` plus ``q.t().contiguous()``: ``(q, q_t, amax,
    saturated)``, both layouts from one read where the kernels run (the backward gemms
    take each fp8 operand in the other layout)."""
    return _kernels.cast_transpose(t.contiguous(), scale, fp8_dtype, backend="triton")


_torch_compat.keep_out_of_dynamo(globals(), __name__)
