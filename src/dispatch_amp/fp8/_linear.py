"""The fp8 ``linear``: an autograd Function with three scaled gemms.

``torch._scaled_mm`` multiplies two fp8 matrices, each with its inverse scale, and
accumulates in float32; it has no autograd formula, so the gradient gemms are written
here::

    forward       y  = x  @ w.T     input (e4m3) x weight (e4m3)
    grad_input    dx = dy @ w       grad_output (e5m2) x weight
    grad_weight   dw = dy.T @ x     grad_output x input

With one scale per tensor the forward's fp8 copies of the input and the weight are what
the backward saves and reuses (each in the other layout its gemm needs). The bias is added
to the float32 accumulator before the cast to the region's dtype, and its gradient is
summed in float32. Gradients come back in the dtypes of the tensors they belong to.
"""

from __future__ import annotations

import torch

from .. import _torch_compat

from .recipes import Recipe

__all__ = ["fp8_linear"]

_float32 = torch.float32
_scaled_mm = torch._scaled_mm


def _transposed(q: torch.Tensor, q_t: torch.Tensor | None) -> torch.Tensor:
    # q.t().contiguous(): made with q by the cast kernel on CUDA, else here.
    return q.t().contiguous() if q_t is None else q_t


def _mm(a: torch.Tensor, b_rows: torch.Tensor, a_inv, b_inv, out_dtype) -> torch.Tensor:
    """``a @ b_rows.T`` for fp8 ``a`` (M, K) and ``b_rows`` (N, K), both laid out along K.

    cuBLAS takes the first operand row-major and the second column-major, and so do
    torch.compile's lowerings: ``b_rows.T`` of a contiguous ``b_rows`` is exactly that.
    """
    if a_inv.numel() > 1 and a.device.type == "cpu" and not _torch_compat.SCALED_MM_ROWWISE_ON_CPU:
        # The gemm's own rule, written out: dequantize, multiply in float32, cast.
        return ((a.float() * a_inv) @ (b_rows.float() * b_inv.t()).t()).to(out_dtype)
    return _scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    # Takes the forward's fp8 operands ready-made (``fp8_linear`` quantizes them, outside
    # the Function, where recording statistics and advancing delayed scaling's history are
    # ordinary side effects for torch.compile); the backward only updates tensors in place.
    # Both passes run with native autocast off for the device: under an enabled native
    # region (a backward called inside torch.autocast, say) _scaled_mm's inner matmul
    # would be cast again.
    @staticmethod
    def forward(ctx, x, weight, bias, xq, x_inv, xq_t, wq, w_inv, wq_t, recipe: Recipe, site,
                out_dtype: torch.dtype):
        with torch.autocast(x.device.type, enabled=False):
            y = _mm(xq, wq, x_inv, w_inv.t() if recipe.rowwise else w_inv,
                    out_dtype if bias is None else _float32)
            if bias is not None:
                y = (y + bias.to(_float32)).to(out_dtype)
        if recipe.rowwise:
            # The backward contracts along other dimensions: it quantizes again from these.
            ctx.save_for_backward(x.reshape(-1, weight.shape[1]), weight)
        else:
            ctx.save_for_backward(xq, wq, x_inv, w_inv, xq_t, wq_t)
        ctx.recipe, ctx.site, ctx.out_dtype = recipe, site, out_dtype
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        with torch.autocast(dy.device.type, enabled=False):
            return _Fp8Linear._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        recipe, site = ctx.recipe, ctx.site
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        fmt = recipe.grad_format
        if recipe.rowwise:
            x2, weight = ctx.saved_tensors
            w_dtype = ctx.weight_dtype
            if need_x:
                dyq, dy_inv, _ = recipe._quantize(dy2, "grad_output", fmt, site, True)
                wtq, wt_inv, _ = recipe._quantize(weight.t(), "weight", recipe.forward_format, None, False)
                dx = _mm(dyq, wtq, dy_inv, wt_inv.t(), ctx.x_dtype)
            if need_w:
                if recipe.weight_grad_high_precision:
                    low = ctx.out_dtype
                    dw = torch.mm(dy2.t().to(low), x2.to(low)).to(w_dtype)
                else:
                    dytq, dyt_inv, _ = recipe._quantize(dy2.t(), "grad_output", fmt, site, not need_x)
                    xtq, xt_inv, _ = recipe._quantize(x2.t(), "input", recipe.forward_format, None, False)
                    dw = _mm(dytq, xtq, dyt_inv, xt_inv.t(), w_dtype)
        else:
            xq, wq, x_inv, w_inv, xq_t, wq_t = ctx.saved_tensors
            if need_x or need_w:
                # dx = dy @ w contracts along N: w.T's rows; dw = dy.T @ x along M: the
                # rows of dy.T and x.T. Each transposed copy is the cast kernel's (CUDA).
                dyq, dy_inv, dyq_t = recipe._quantize(dy2, "grad_output", fmt, site, True, transpose=need_w)
                if need_x:
                    dx = _mm(dyq, _transposed(wq, wq_t), dy_inv, w_inv, ctx.x_dtype)
                if need_w:
                    # grad_weight keeps the weight parameter's dtype (its .grad)
                    dw = _mm(_transposed(dyq, dyq_t), _transposed(xq, xq_t), dy_inv, x_inv, ctx.weight_dtype)
        if need_b:
            db = dy2.to(_float32).sum(0).to(ctx.bias_dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
               out_dtype: torch.dtype, site=None, phase: str = "forward") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as fp8 gemms under ``recipe``, output in ``out_dtype``.

    ``site`` is the recipe's state for this weight (``recipe._site(weight)``); without one
    no statistics are recorded (a stateful recipe needs one). ``phase``: ``"forward"``,
    ``"checkpointed"`` (a forward activation checkpointing will recompute) or
    ``"recompute"``.

    Example::

        >>> from dispatch_amp.fp8 import CurrentScaling
        >>> x, w = torch.randn(16, 32), torch.randn(16, 32)
        >>> fp8_linear(x, w, None, CurrentScaling(), torch.bfloat16).dtype
        torch.bfloat16
    """
    if site is not None:
        recipe._prepare(site, x.device)
    x2 = x.reshape(-1, weight.shape[1])
    record = phase != "recompute"
    fmt = recipe.forward_format
    (x_scale, w_scale), (x_amax, w_amax) = (
        recipe._forward_scales(site, x2, weight, phase) if site is not None else ((None, None), (None, None)))
    # The transposed copies serve the backward's gemms (the weight's for grad_input, the
    # input's for grad_weight); made only when that gradient will be asked for.
    grad = torch.is_grad_enabled()
    xq, x_inv, xq_t = recipe._quantize(x2, "input", fmt, site, record, x_scale,
                                       transpose=grad and weight.requires_grad, known_amax=x_amax)
    wq, w_inv, wq_t = recipe._quantize(weight, "weight", fmt, site, record, w_scale,
                                       transpose=grad and x.requires_grad, known_amax=w_amax)
    return _Fp8Linear.apply(x, weight, bias, xq, x_inv, xq_t, wq, w_inv, wq_t, recipe, site, out_dtype)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
