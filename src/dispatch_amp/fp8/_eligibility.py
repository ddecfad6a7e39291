"""Which ``linear`` calls the fp8 path takes (the others run in the region's dtype)."""

from __future__ import annotations

import torch

from .. import _torch_compat

from ._rules import gemm_shapes_ok
from .all_gather._sharded import ShardedFp8Weight
from .recipes import Recipe

__all__ = ["linear_arguments", "fp8_eligible"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
# Input dtypes the fp8 path quantizes from (float64 is never cast by autocast).
_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear_arguments(args, kwargs):
    """``(input, weight, bias)`` of an ``F.linear`` call, however it was spelled."""
    names = ("input", "weight", "bias")
    values = list(args) + [None] * (3 - len(args))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values[0], values[1], values[2]


def _plain(t) -> bool:
    # Tensor subclasses (DTensor, quantized wrappers) keep their own dispatch. type(), not
    # t.__class__: Dynamo before torch 2.13 answers the latter wrongly for a Parameter.
    # A weight wrapped for fp8 all-gather (all_gather/) is its high-precision tensor here:
    # outside FSDP2's all-gathers it takes the fp8 path as the plain weight would.
    cls = type(t)
    return cls is _Tensor or cls is _Parameter or cls is ShardedFp8Weight


_LOOK_UP = object()


def fp8_eligible(recipe: Recipe, device_type: str, x, weight, bias, name=_LOOK_UP, holder=None) -> bool:
    """Whether this ``linear`` call runs as fp8 gemms under ``recipe``.

    Plain floating tensors (float32, bfloat16, float16) on the region's device type, a
    2-D weight, shapes ``recipe.eligible`` accepts (every gemm dimension a multiple of 16,
    then the recipe's ``filter_fn``, given ``name``: by default each name of the site of
    ``holder``, all of which it must accept). ``holder``: the tensor whose site the call
    uses, the weight itself unless the weight is a view of a parameter (a linear-shaped
    matmul, ``_reach.py``).

    Example::

        >>> from dispatch_amp.fp8 import CurrentScaling
        >>> fp8_eligible(CurrentScaling(), "cpu", torch.randn(16, 32), torch.randn(16, 32), None)
        True
    """
    for t in (x, weight) if bias is None else (x, weight, bias):
        if not isinstance(t, _Tensor) or not _plain(t) or t.dtype not in _SOURCE_DTYPES:
            return False
        if t.device.type != device_type:
            return False
    if weight.dim() != 2 or (bias is not None and bias.shape != (weight.shape[0],)):
        return False
    if not gemm_shapes_ok(x.shape, weight.shape):
        return False
    if name is not _LOOK_UP or recipe.filter_fn is None:
        return recipe.eligible(None if name is _LOOK_UP else name, x.shape, weight.shape)
    # filter_fn is asked for every name of the site (a tied weight's each), and must accept
    # them all; the site's weight is the parameter for a linear-shaped matmul on its
    # transpose, whose weight_shape is still that of the linear, (out, in).
    names = recipe.site_names(weight if holder is None else holder) or (None,)
    return all(recipe.eligible(n, x.shape, weight.shape) for n in names)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
