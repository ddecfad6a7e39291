"""The fp8 linear's gemms: ``mm`` (one scaled gemm, bias in its epilogue) and the first-order
backward from the operands the forward saved (``_linear.py`` says which).

On CUDA (and every device but the CPU) a gemm is ``torch._scaled_mm``. On the CPU it is
computed by its rule (docs/fp8.md, "Gemm"): dequantize, a float32 matmul, the bias added
in float32, the cast to the output dtype. That is what torch's CPU ``_scaled_mm`` computes
too (the same bits where we compared, up to 256 x 256 x 256 products), but its kernel is
orders of magnitude slower than the float32 matmul on some x86 CPUs (on an Intel Xeon with
AVX-512 and AMX: 1.7 s for one 256 x 256 x 256 product, against 2.4 ms by rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from .. import _torch_compat

from ._gathered import columns
from ._quantize import quantize
from ._rules import bias_grad

__all__ = ["Meta", "mm", "by_rule", "inverse", "first_order_grads"]

_float32 = torch.float32
_scaled_mm = torch._scaled_mm

# The device types whose gemms are computed by rule, not by ``_scaled_mm``.
# benchmarks/fp8_kernel_count.py empties it to run the CUDA path's sequence on a CPU.
BY_RULE_ON = frozenset({"cpu"})


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
    On the devices of ``BY_RULE_ON`` (the CPU) the gemm is computed by rule (``by_rule``).
    """
    device = a.device.type
    if device in BY_RULE_ON or (
            a_inv.numel() > 1 and device == "cpu" and not _torch_compat.SCALED_MM_ROWWISE_ON_CPU):
        return _scaled_mm_by_rule(a, b_rows, a_inv, b_inv, out_dtype, bias)
    if bias is not None and out_dtype == _float32:
        y = _scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=_float32)
        return y + bias.to(_float32)
    return _scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=a_inv, scale_b=b_inv, bias=bias,
                      out_dtype=out_dtype)


def by_rule(a: torch.Tensor, b_rows: torch.Tensor, a_inv, b_inv, out_dtype, bias=None) -> torch.Tensor:
    """``mm`` computed by the gemm's rule, as torch's CPU ``_scaled_mm`` computes it:
    ``(a.float() * a_inv) @ (b_rows.float() * b_inv.T).T``, the bias (any dtype) added to
    the float32 result, then the cast to ``out_dtype``. Scales are 0-dim (tensorwise) or
    ``(M, 1)`` and ``(1, N)`` (rowwise).

    The operands are made contiguous first, as for ``_scaled_mm``: the matmul then sees
    the layouts ``_scaled_mm``'s own float32 matmul sees.

    Example::

        a = torch.randn(16, 32).to(torch.float8_e4m3fn)
        b = torch.randn(8, 32).to(torch.float8_e4m3fn)
        y = by_rule(a, b, torch.tensor(1.0), torch.tensor(1.0), torch.bfloat16)  # (16, 8)
    """
    y = (a.contiguous().float() * a_inv) @ (b_rows.contiguous().float() * b_inv.t()).t()
    if bias is not None:
        y = y + bias.to(_float32)
    return y.to(out_dtype)


# One op for the whole rule: the census (diagnostics/census.py) and torch's FlopCounterMode
# count it as one fp8 gemm of its first operand's format, as they count ``_scaled_mm``, and a
# compiled graph holds it as one node.
@torch.library.custom_op("dispatch_amp::scaled_mm", mutates_args=())
def _scaled_mm_by_rule(a: torch.Tensor, b_rows: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    return by_rule(a, b_rows, a_inv, b_inv, out_dtype, bias)


@_scaled_mm_by_rule.register_fake
def _(a, b_rows, a_inv, b_inv, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b_rows.shape[0]), dtype=out_dtype)


@register_flop_formula(torch.ops.dispatch_amp.scaled_mm)
def _scaled_mm_flops(a_shape, b_rows_shape, *args, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_rows_shape[0]


def first_order_grads(meta, dy: torch.Tensor, saved, needs):
    """``(dx, dw, db)`` of one fp8 linear from its saved operands (None where not needed)."""
    recipe, site = meta.recipe, meta.site
    owner = recipe.state
    need_x, need_w, need_b = needs
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    if owner.rule.granularity != "tensor":
        # Scales along the contraction dimension: each gemm contracts along another one,
        # so each operand is quantized again, from the saved input and weight.
        x2, weight = saved[0], saved[1]
        if need_x:
            dyq, dy_inv = _rows(quantize(owner, dy2, "grad_output", site, True))
            gathered = columns(weight)  # all-gathered in fp8 for this gemm (fp8/all_gather/)
            if gathered is not None:
                wtq, wt_inv_t = gathered
            else:
                wtq, wt_inv = _rows(quantize(owner, weight.t(), "weight", None, False))
                wt_inv_t = wt_inv.t()
            dx = mm(dyq, wtq, dy_inv, wt_inv_t, meta.x_dtype)
        if need_w:
            if getattr(recipe, "weight_grad_high_precision", False):
                low = meta.out_dtype
                dw = torch.mm(dy2.t().to(low), x2.to(low)).to(meta.weight_dtype)
            else:
                dytq, dyt_inv = _rows(quantize(owner, dy2.t(), "grad_output", site, not need_x))
                xtq, xt_inv = _rows(quantize(owner, x2.t(), "input", None, False))
                dw = mm(dytq, xtq, dyt_inv, xt_inv.t(), meta.weight_dtype)
    elif need_x or need_w:
        xq_t, x_sc, wq_t, w_sc = saved[:4]
        # dx = dy @ w contracts along N: w.T's rows (wq_t); dw = dy.T @ x along M: the rows
        # of dy.T and x.T (dyq_t, xq_t). The bias gradient comes from the same read of dy.
        dyq, dyq_t, dy_sc, db = quantize(owner, dy2, "grad_output", site, True, need_q=need_x, need_qt=need_w,
                                         dbias=need_b)
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


def _rows(quantized):
    # A quantize along K's (q, None, 1 / scales, None), for the gemm: (q, 1 / scales).
    q, _, inv, _ = quantized
    return q, inv


_torch_compat.keep_out_of_dynamo(globals(), __name__)
