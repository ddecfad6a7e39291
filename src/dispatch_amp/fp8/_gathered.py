"""The unsharded weight FSDP2 hands the module when it was all-gathered in fp8.

Its shape and dtype are the high-precision weight's (FSDP2 makes the module's parameter
of it, autograd gives its gradient in that dtype), but it holds only the fp8 weight and
its scales (``Gathered``): the fp8 gemm (``all_gather/_linear.py``) takes them as its
weight operand without casting again. Any other use would need the high-precision values, which never
arrived: it raises, naming the op and the way out, rather than compute with dequantized
values (numbers that "all-gather in high precision" would not give).

FSDP2 keeps one such parameter per weight for the whole run and refreshes it in place at
each all-gather (``fsdp_post_all_gather(out=...)``); its aliases (``detach``, the
``as_strided`` view FSDP2 makes) share one ``Gathered``, so all see the refresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat

__all__ = ["MODE_TENSOR", "MODE_ROWS", "MODE_COLUMNS", "MODE_BLOCKS", "Gathered", "GatheredFp8Weight", "gathered", "columns"]

# How a gathered weight is scaled: one scale for the tensor; one per row (the forward of a
# rowwise recipe); one per column (its backward: the input gradient contracts the weight
# along its rows); one per 128 x 128 block (block scaling, forward and backward alike).
MODE_TENSOR, MODE_ROWS, MODE_COLUMNS, MODE_BLOCKS = "tensor", "rows", "columns", "blocks"

_aten = torch.ops.aten
# Ops that make an alias of the whole weight (FSDP2 views it; nn.Parameter detaches it).
_ALIASES = {_aten.detach.default, _aten.alias.default, _aten.as_strided.default, _aten.view.default,
            _aten._unsafe_view.default}
# Ops that read only the weight's metadata, or make a fresh tensor of its shape and dtype
# (autograd compares a gradient's metadata with it; FSDP2 may zero a missing gradient).
_METADATA = {_aten.is_same_size.default, _aten.zeros_like.default, _aten.empty_like.default,
             _aten.new_zeros.default, _aten.new_empty.default, _aten.new_empty_strided.default}


@dataclass
class Gathered:
    """One all-gather's result: the fp8 weight (``rows x cols``, as the weight), how it is
    scaled (``mode``: one scale, one per row, one per column, one per block), what
    the gemm takes for its scale (``[scale, 1 / scale]``, or the inverse scales per row
    ``(rows, 1)``, per column ``(1, cols)`` or per block ``(rows / 128, cols / 128)``), and what a call records (the whole weight's
    amax, the scale shown, saturated values)."""

    plan: object
    data: torch.Tensor | None = None
    mode: str | None = None
    sc: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    shown: torch.Tensor | None = None
    saturated: torch.Tensor | None = None


class GatheredFp8Weight(torch.Tensor):
    """A weight all-gathered in fp8: the high-precision weight's shape and dtype, fp8
    contents. The fp8 gemm of ``amp.autocast(..., fp8=recipe)`` takes it; every other op
    raises.

    Example::

        # inside a forward of a model prepared with fp8.all_gather_in_fp8 and fully_shard:
        isinstance(model[0].weight, GatheredFp8Weight)   # True while FSDP2 holds it unsharded
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, gathered: Gathered, size, stride, dtype, device, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, gathered: Gathered, size, stride, dtype, device, requires_grad=False):
        self._gathered = gathered

    def __repr__(self) -> str:
        return (f"GatheredFp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"site={self._gathered.plan.name!r}, mode={self._gathered.mode!r})")

    def __tensor_flatten__(self):
        return [], (self._gathered, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        gathered, dtype = spec
        return GatheredFp8Weight(gathered, outer_size, outer_stride, dtype, gathered.data.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            src = args[0]
            size = args[1] if func is not _aten.detach.default and func is not _aten.alias.default else src.shape
            if tuple(size) == tuple(src.shape):  # the whole weight as it is; a reshape is another use
                return GatheredFp8Weight(src._gathered, src.shape, src.stride(), src.dtype, src.device)
        if func in _METADATA:
            def meta(t):
                if isinstance(t, GatheredFp8Weight):
                    return torch.empty(t.shape, dtype=t.dtype, device="meta")
                return t

            if func is _aten.is_same_size.default:
                return args[0].shape == args[1].shape
            plain = [meta(a) for a in args]
            device = next(a.device for a in args if isinstance(a, GatheredFp8Weight))
            out = func(*plain, **{**kwargs, "device": kwargs.get("device", device)})
            return out
        names = sorted({a._gathered.plan.name or "<unnamed>" for a in args if isinstance(a, GatheredFp8Weight)})
        raise RuntimeError(
            f"{func} on weight(s) {names}, which FSDP2 all-gathered in fp8 (fp8.all_gather_in_fp8): only "
            f"the fp8 gemm of amp.autocast(..., fp8=recipe) with that recipe can use them; the "
            f"high-precision values were never gathered. Run the model inside that region, keep this "
            f"weight out of all_gather_in_fp8 (its filter_fn), or turn it off (handle.remove()) for this use")


def gathered(weight) -> Gathered | None:
    """The fp8 all-gather result ``weight`` holds, or None (any other tensor)."""
    return weight._gathered if type(weight) is GatheredFp8Weight else None


def columns(weight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(w.T in fp8, inverse scales (1, cols))`` of a rowwise recipe's weight that FSDP2
    all-gathered for the backward, one scale per column; None for any other tensor.
    Raises where the weight holds the forward's layout: FSDP2 did not gather it again for
    the backward (it kept the forward's unsharded weight)."""
    box = gathered(weight)
    if box is None:
        return None
    if box.mode != MODE_COLUMNS:
        raise RuntimeError(
            f"fp8 all-gathered weight {box.plan.name!r}: the backward of RowwiseScaling takes the weight scaled per "
            f"column, which FSDP2 all-gathers at the start of the backward, but this module kept its forward's "
            f"weight (reshard_after_forward=False, or the root module, which FSDP2 does not reshard by default). "
            f"Pass fully_shard(..., reshard_after_forward=True) for the module holding it")
    return box.data.t(), box.sc


_torch_compat.keep_out_of_dynamo(globals(), __name__)
