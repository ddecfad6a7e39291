"""The exact fp8 rules: formats, scales from amaxes, the saturating cast.

Every number the fp8 path produces follows from these functions; docs/fp8.md, "The rules",
states them in words and ``tests/fp8/test_linear.py`` re-implements them from that page as
its oracle. All arithmetic is float32. Nothing here reads a tensor on the host, so a
training step makes no device synchronization.
"""

from __future__ import annotations

import enum

import torch

from .. import _torch_compat
from ..kernels import fp8_cast as _kernels
from ..kernels import fp8_quantize as _quantize_kernels
from ..kernels import fp8_scale as _scale_kernels
from ..kernels.fp8_scale import FLOAT32_MAX, floor_power_of_two

__all__ = ["Format", "FORMATS", "fp8_max", "check_format", "amax", "scale_from_amax", "cast", "kernels_in_use",
           "floor_power_of_two", "FLOAT32_MAX", "bias_grad", "gemm_shapes_ok"]

class Format(enum.Enum):
    """The fp8 formats a recipe quantizes to: ``E4M3`` (``torch.float8_e4m3fn``, largest
    value 448, 3 mantissa bits: forward operands) and ``E5M2`` (``torch.float8_e5m2``,
    largest value 57344, 2 mantissa bits: gradients by default).

    Recipes take a member or its torch dtype (``Format.of``); a member equals its dtype.

    Example::

        >>> Format.of(torch.float8_e5m2) is Format.E5M2, Format.E4M3 == torch.float8_e4m3fn
        (True, True)
        >>> Format.E4M3.max
        448.0
    """

    E4M3 = "float8_e4m3fn"
    E5M2 = "float8_e5m2"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the format."""
        return getattr(torch, self.value)

    @property
    def max(self) -> float:
        """The format's largest finite value."""
        return FORMATS[self.dtype]

    @classmethod
    def of(cls, value, what: str = "format") -> Format:
        """``value`` (a member, its torch dtype or its name) as a member, else a ValueError
        naming ``what`` and the formats there are."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.dtype or value == member.value:
                return member
        raise ValueError(f"{what} must be torch.float8_e4m3fn or torch.float8_e5m2 (or fp8.Format.E4M3 / "
                         f"fp8.Format.E5M2), got {value!r}")

    def __eq__(self, other) -> bool:
        if isinstance(other, torch.dtype):
            return other == self.dtype
        return self is other

    def __hash__(self) -> int:
        return hash(self.dtype)

    def __repr__(self) -> str:
        return f"Format.{self.name}"


# The largest finite value of each format.
FORMATS: dict[torch.dtype, float] = {dt: _kernels.fp8_max(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}
# Every fp8 dtype torch has, the ones the fp8 path does not produce (the "fnuz" variants)
# included: none of them is an autocast dtype, and a gemm in any of them is an fp8 gemm.
ALL_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# A scaled value saturates when the clamp moves it to another fp8 value: beyond the
# midpoint between fp8_max and the format's next step (480 for e4m3fn, 65536 for e5m2).
# A value just above fp8_max (the scale's own rounding, amax * (fp8_max / amax)) does not.
SATURATES_ABOVE: dict[torch.dtype, float] = _kernels.SATURATES_ABOVE

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
    return Format.of(fp8_dtype, what).dtype


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


def gemm_shapes_ok(input_shape, weight_shape) -> bool:
    """Whether a ``linear`` with these shapes can be fp8 gemms: a 2-D weight whose input
    features are the input's last dimension, and every gemm dimension (the rows of the
    flattened input, the input features, the output features) a multiple of 16, as
    cuBLAS's fp8 gemms need.

    Example::

        >>> gemm_shapes_ok((4, 16, 32), (48, 32)), gemm_shapes_ok((8, 32), (48, 32))
        (True, False)
    """
    if len(weight_shape) != 2 or len(input_shape) < 1 or input_shape[-1] != weight_shape[1]:
        return False
    rows = 1
    for d in input_shape[:-1]:
        rows *= d
    return not (rows == 0 or rows % 16 or weight_shape[0] % 16 or weight_shape[1] % 16)


#: ``max|t|`` in float32 (0-d, or ``(rows, 1)`` with ``rowwise``): ``kernels/fp8_quantize.py``.
amax = _quantize_kernels.amax_reference
#: The saturating cast, ``(q, saturated)``: ``kernels/fp8_quantize.py`` states it.
cast = _quantize_kernels.cast_reference
#: The bias gradient of a linear from its 2-D ``grad_output`` (kernel or torch rule).
bias_grad = _quantize_kernels.bias_grad
#: Whether the per-tensor quantize of a tensor runs the Triton kernels.
kernels_in_use = _quantize_kernels.kernels_in_use


_torch_compat.keep_out_of_dynamo(globals(), __name__)
