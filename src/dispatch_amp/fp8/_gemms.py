"""The fp8 linear's gemms: ``mm`` (one scaled gemm, bias in its epilogue) and the first-order
backward from the operands the forward saved (``_linear.py`` says which)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat

from ._quantize import quantize
from ._rules import bias_grad

__all__ = ["Meta", "mm", "inverse", "first_order_grads"]

_float32 = torch.float32
_scaled_mm = torch._scaled_mm


@dataclass
class Meta:
    """What the fp8 backward needs besides saved tensors."""

    recipe: object
    site: object
    out_dtype: torch.dtype
    x_shape: torch.Size
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    bias_dtype: torch.dtype | None


def inverse(sc: torch.Tensor) -> torch.Tensor:
    """The inverse scale of a quantizer's ``sc = [scale, 1 / scale]`` pair, as the gemm
    reads it.

    cuBLASLt reads a tensorwise scale through a pointer it wants 16-byte aligned, and
    element 1 of the pair is not (seen on an H100: CUBLAS_STATUS_NOT_SUPPORTED for every
    tensorwise gemm given that view), so eager calls get a copy there. A compiled graph
    takes ``1 / scale`` from element 0 instead: the same value (the quantizers computed
    element 1 so), in the form torch.compile's own fp8 recipes hand its scaled-gemm
    lowerings, which then decide the layout themselves.
    """
    if torch.compiler.is_compiling():
        return sc[0].reciprocal()
    inv = sc[1]
    return inv.clone() if inv.storage_offset() % 4 else inv


def mm(a: torch.Tensor, b_rows: torch.Tensor, a_inv, b_inv, out_dtype, bias=None) -> torch.Tensor:
    """``a @ b_rows.T (+ bias)`` for fp8 ``a`` (M, K) and ``b_rows`` (N, K), both laid out
    along K; ``bias`` in ``out_dtype`` (or float32) is added to the float32 accumulator.

    cuBLAS takes the first operand row-major and the second column-major, and so do
    torch.compile's lowerings: ``b_rows.T`` of a contiguous ``b_rows`` is exactly that.
    The gemm's epilogue takes a bias in its output dtype only, and none for float32 out.
    """
    if a_inv.numel() > 1 and a.device.type == "cpu" and not _torch_compat.SCALED_MM_ROWWISE_ON_CPU:
        # The gemm's own rule, written out: dequantize, multiply in float32, cast.
        y = (a.float() * a_inv) @ (b_rows.float() * b_inv.t()).t()
        return (y if bias is None else y + bias.to(_float32)).to(out_dtype)
    if bias is not None and out_dtype == _float32:
        y = _scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=_float32)
        return y + bias.to(_float32)
    return _scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=a_inv, scale_b=b_inv, bias=bias,
                      out_dtype=out_dtype)


def first_order_grads(meta, dy: torch.Tensor, saved, needs):
    """``(dx, dw, db)`` of one fp8 linear from its saved operands (None where not needed)."""
    recipe, site = meta.recipe, meta.site
    need_x, need_w, need_b = needs
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    fmt = recipe.grad_format
    if recipe.rowwise:
        x2, weight = saved[0], saved[1]
        if need_x:
            dyq, dy_inv = recipe._quantize_rows(dy2, "grad_output", fmt, site, True)
            wtq, wt_inv = recipe._quantize_rows(weight.t(), "weight", recipe.forward_format, None, False)
            dx = mm(dyq, wtq, dy_inv, wt_inv.t(), meta.x_dtype)
        if need_w:
            if recipe.weight_grad_high_precision:
                low = meta.out_dtype
                dw = torch.mm(dy2.t().to(low), x2.to(low)).to(meta.weight_dtype)
            else:
                dytq, dyt_inv = recipe._quantize_rows(dy2.t(), "grad_output", fmt, site, not need_x)
                xtq, xt_inv = recipe._quantize_rows(x2.t(), "input", recipe.forward_format, None, False)
                dw = mm(dytq, xtq, dyt_inv, xt_inv.t(), meta.weight_dtype)
    elif need_x or need_w:
        xq_t, x_sc, wq_t, w_sc = saved[:4]
        # dx = dy @ w contracts along N: w.T's rows (wq_t); dw = dy.T @ x along M: the rows
        # of dy.T and x.T (dyq_t, xq_t). The bias gradient comes from the same read of dy.
        dyq, dyq_t, dy_sc, db = quantize(recipe, dy2, "grad_output", fmt, site, True, need_q=need_x,
                                         need_qt=need_w, dbias=need_b)
        if need_x:
            dx = mm(dyq, wq_t, inverse(dy_sc), inverse(w_sc), meta.x_dtype)
        if need_w:
            # grad_weight keeps the weight parameter's dtype (its .grad)
            dw = mm(dyq_t, xq_t, inverse(dy_sc), inverse(x_sc), meta.weight_dtype)
    if need_b:
        db = (bias_grad(dy2) if db is None else db).to(meta.bias_dtype)
    if dx is not None:
        dx = dx.reshape(meta.x_shape)
    return dx, dw, db


_torch_compat.keep_out_of_dynamo(globals(), __name__)
