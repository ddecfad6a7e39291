"""The fp8 ``linear``: an autograd Function with three scaled gemms.

``torch._scaled_mm`` multiplies two fp8 matrices, each with its inverse scale, and
accumulates in float32; it has no autograd formula, so the gradient gemms are written
here::

    forward       y  = x  @ w.T     input (e4m3) x weight (e4m3)
    grad_input    dx = dy @ w       grad_output (e5m2) x weight
    grad_weight   dw = dy.T @ x     grad_output x input

With one scale per tensor the forward quantizes the input and the weight once and makes,
besides the layouts its own gemm takes, the transposed layouts the backward's gemms take;
the backward keeps only those (and only for the gradients that will be asked for). The
bias, in the region's dtype, is added in the gemm's epilogue to the float32 accumulator,
and the result comes out in the region's dtype. Gradients come back in the dtypes of the
tensors they belong to.

A backward run with ``create_graph=True`` (a gradient penalty) is differentiable: its
gradients are an autograd Function (``_double_backward.py``) whose own backward runs in
float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import _torch_compat

from . import _double_backward, _replay
from ._block_linear import RecipeQuantizer, block_fp8_linear
from ._gemms import Meta, first_order_grads, inverse, mm
from ._quantize import quantize, quantize_bias, quantize_weight, record_quantized
from .recipes import Recipe

__all__ = ["fp8_linear", "QuantizedWeight"]


# The device types autocast knows, read once: Dynamo before torch 2.13 cannot trace
# torch.amp.is_autocast_available inside an autograd Function (a graph break there).
_AUTOCAST_DEVICES = frozenset(
    d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu") if torch.amp.is_autocast_available(d)
)


def _native_off(device_type: str):
    # Device types without autocast (meta tensors: benchmarks/fp8_kernel_count.py) have
    # nothing to switch off.
    if device_type in _AUTOCAST_DEVICES:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _Fp8Linear(torch.autograd.Function):
    # Takes the forward's fp8 operands ready-made (``fp8_linear`` quantizes them, outside
    # the Function, where recording statistics and advancing delayed scaling's history are
    # ordinary side effects for torch.compile); the backward only updates tensors in place.
    # Both passes run with native autocast off for the device: under an enabled native
    # region (a backward called inside torch.autocast, say) _scaled_mm's inner matmul
    # would be cast again.
    @staticmethod
    def forward(ctx, x, weight, bias, xq, xq_t, x_sc, wq, wq_t, w_sc, bias_lo, recipe: Recipe, site,
                out_dtype: torch.dtype):
        rowwise = recipe.state.rule.granularity != "tensor"  # scales along K: re-quantized per gemm
        with _native_off(x.device.type):
            if rowwise:
                y = mm(xq, wq, x_sc, w_sc.t(), out_dtype, bias_lo)
            else:
                y = mm(xq, wq, inverse(x_sc), inverse(w_sc), out_dtype, bias_lo)
        if rowwise:
            # The backward contracts along other dimensions: it quantizes again from these.
            ctx.save_for_backward(x.reshape(-1, weight.shape[1]), weight)
        else:
            # Only the layouts the backward's gemms take (see fp8_linear), and the weight
            # itself (a parameter: saving it costs nothing) for a backward of the backward.
            ctx.save_for_backward(xq_t, x_sc, wq_t, w_sc, weight)
        meta = Meta(recipe, site, out_dtype, x.shape, x.dtype, weight.dtype,
                                     None if bias is None else bias.dtype)
        ctx.meta = meta
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        with _native_off(dy.device.type):
            needs = ctx.needs_input_grad[:3]
            if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
                dx, dw, db = _double_backward.differentiable_grads(ctx.meta, dy, ctx.saved_tensors, needs)
            else:
                dx, dw, db = first_order_grads(ctx.meta, dy, ctx.saved_tensors, needs)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight already in fp8 (an fp8 all-gather's result), handed to :func:`fp8_linear`
    so that it is not cast again: ``data`` (the ``(out, in)`` fp8 tensor), ``sc``
    (``[scale, 1 / scale]``, float32), optionally ``data_t`` (``data.t().contiguous()``,
    which the input-gradient gemm takes; made here if missing), and the statistics the
    cast would have recorded: ``amax`` (float32, 0-d: of the whole weight) and
    ``saturated`` (int64, 0-d). With one scale per row (row-wise scaling), ``sc`` is the
    inverse scales ``(out, 1)`` and ``shown`` the smallest row scale (what the cast
    records as the scale used; with one scale per tensor, ``sc[0]``). With block scaling,
    ``sc`` is the inverse scales of the 128 x 128 blocks ``(out / 128, in / 128)``.

    Example::

        qw = QuantizedWeight(q, torch.stack([s, s.reciprocal()]), amax, saturated)
        y = fp8_linear(x, weight, bias, recipe, torch.bfloat16, site, weight_q=qw)
    """

    data: torch.Tensor
    sc: torch.Tensor
    amax: torch.Tensor
    saturated: torch.Tensor
    data_t: torch.Tensor | None = None
    shown: torch.Tensor | None = None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
               out_dtype: torch.dtype, site=None, phase: str = "forward",
               weight_q: QuantizedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as fp8 gemms under ``recipe``, output in ``out_dtype``.

    ``site`` is the recipe's state for this weight (``recipe.state.site(weight)``); without
    one no statistics are recorded (a stateful recipe needs one). ``phase``: ``"forward"``,
    ``"checkpointed"`` (a forward activation checkpointing will recompute) or
    ``"recompute"``. ``weight_q``: the weight already quantized (:class:`QuantizedWeight`,
    with the scale ``recipe.state.weight_scale_choice(weight)`` gave); its statistics are
    recorded as the cast's would have been.

    Example::

        >>> from dispatch_amp.fp8 import CurrentScaling
        >>> x, w = torch.randn(16, 32), torch.randn(16, 32)
        >>> fp8_linear(x, w, None, CurrentScaling(), torch.bfloat16).dtype
        torch.bfloat16
    """
    owner = recipe.state
    if site is not None:
        owner.prepare(site, x.device)
    if owner.rule.granularity == "block":
        quantizer = RecipeQuantizer(owner.rule, site, record_forward=phase != "recompute")
        return block_fp8_linear(x, weight, bias, out_dtype, quantizer, quantize_bias(site, bias, out_dtype),
                                weight_q=weight_q)
    x2 = x.reshape(-1, weight.shape[1])
    # The backward's gemms take the weight transposed (grad_input) and the input
    # transposed (grad_weight): made here, from the same read, only for the gradients
    # that will be asked for. Row-wise scaling quantizes again in the backward instead.
    grad = torch.is_grad_enabled()
    tensorwise = owner.rule.granularity == "tensor"
    need_dx, need_dw = grad and x.requires_grad and tensorwise, grad and weight.requires_grad and tensorwise
    (x_scale, w_scale), record, key = _replay.forward_scales(site, phase, recipe.stateful)
    xq, xq_t, x_sc, _ = quantize(owner, x2, "input", site, record, x_scale, need_qt=need_dw)
    if weight_q is not None:
        wq, w_sc = weight_q.data, weight_q.sc
        if w_scale is not None and not bool((w_scale == w_sc[0]).all()):
            # A recomputation replays its forward's weight scale; a weight quantized
            # elsewhere cannot be cast again with it. One host read, in recomputations only.
            raise RuntimeError(
                "fp8: the recomputation of a checkpointed forward needs its weight cast with that forward's scale, "
                "and the weight it was given already in fp8 (an fp8 all-gather's) has another (a delayed scale "
                "that moved between accumulated micro-batches); use reduce_amax=True, or do not checkpoint it")
        wq_t = (weight_q.data_t if weight_q.data_t is not None else wq.t().contiguous()) if need_dx else None
        if record and site is not None:
            shown = w_sc if weight_q.shown is None else weight_q.shown.reshape(1)
            record_quantized(owner, site, "weight", weight_q.amax, weight_q.saturated, shown)
    elif tensorwise:
        wq, wq_t, w_sc = quantize_weight(owner, weight, site, record, w_scale, need_qt=need_dx)
    else:  # no cache: row-wise scales are the weight's own at every call
        wq, wq_t, w_sc, _ = quantize(owner, weight, "weight", site, record)
    if key is not None:  # checkpointed: its recomputation replays these
        _replay.remember(key, site, (x_sc[0], w_sc[0]))
    bias_lo = quantize_bias(site, bias, out_dtype)
    return _Fp8Linear.apply(x, weight, bias, xq, xq_t, x_sc, wq, wq_t, w_sc, bias_lo, recipe, site, out_dtype)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
