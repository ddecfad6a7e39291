"""The block-scaled fp8 ``linear``: an autograd Function with three block-scaled gemms.

Each gemm takes its operands quantized along the dimension it contracts (DeepSeek-V3's
recipe)::

    forward       y  = x  @ w.T     x: 1 x 128 tiles along K      w:   128 x 128 blocks
    grad_input    dx = dy @ w       dy: 1 x 128 tiles along N     w.T: the same blocks, transposed
    grad_weight   dw = dy.T @ x     dy: 128 x 1 tiles along M     x:   128 x 1 tiles along M

So the forward reads ``x`` once for two layouts (``q`` with 1 x 128 scales for its own
gemm, ``q_t`` with 128 x 1 scales kept for grad_weight), and the weight once for ``w_q``
and, when the input gradient will be asked for, ``w_q.T`` with the same block scales; the
backward reads ``dy`` once for its two layouts. The backward keeps only the fp8 layouts
(and their scales) it will use. The bias is added to the float32 accumulator; the output
is in the region's dtype and gradients in the dtypes of the tensors they belong to, the
bias gradient summed in float32 in ``kernels.bias_grad``'s fixed order.

Native autocast cannot reach inside: the gemm's rule switches it off itself
(``_block_gemm.py``), and the quantizers have no op autocast casts.

Scales come from the current tensors only (no state): the rule is ``kernels/fp8_block.py``'s,
the gemm ``_block_gemm.py``'s. A backward with ``create_graph=True`` is refused (its
gradients would need a differentiable block-scaled gemm), with the fix in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat
from ..kernels import quantize_blocks, quantize_tiles
from ..kernels import fp8_quantize as _kernels

from ._block_gemm import block_mm

__all__ = ["BlockOptions", "RecipeQuantizer", "block_fp8_linear"]

@dataclass(frozen=True)
class BlockOptions:
    """How a block-scaled linear quantizes: the formats of the forward operands and of the
    output gradient, power-of-two scales, the tile length. Its methods are the quantizers
    the linear calls (no statistics: a recipe's quantizer records them as well).

    Example::

        >>> BlockOptions().block
        128
    """

    forward_format: torch.dtype = torch.float8_e4m3fn
    grad_format: torch.dtype = torch.float8_e4m3fn
    power_of_two: bool = False
    block: int = 128

    def tiles(self, t2: torch.Tensor, role: str, rowwise: bool, colwise: bool):
        """``(q, q_inv, q_t, qt_inv)`` of an activation (``role`` "input") or an output
        gradient ("grad_output"): ``kernels.quantize_tiles``."""
        fmt = self.grad_format if role == "grad_output" else self.forward_format
        return quantize_tiles(t2, fmt, rowwise=rowwise, colwise=colwise, power_of_two=self.power_of_two,
                              block=self.block)

    def blocks(self, weight: torch.Tensor, write_qt: bool):
        """``(q, q_t, inv)`` of a weight: ``kernels.quantize_blocks``."""
        return quantize_blocks(weight, self.forward_format, write_qt=write_qt, power_of_two=self.power_of_two,
                               block=self.block)


class RecipeQuantizer:
    """The quantizer of a recipe's block-scaled call: its rule's formats and power-of-two
    choice, the torch-or-Triton choice of ``kernels.fp8_quantize``, and the call's
    statistics recorded on ``site`` (the forward's operands when ``record_forward``: a
    recomputation records nothing; the output gradient always).

    Example::

        quantizer = RecipeQuantizer(recipe.state.rule, site, record_forward=True)
    """

    def __init__(self, rule, site, record_forward: bool) -> None:
        self.rule = rule
        self.site = site
        self.record_forward = record_forward
        self.block = rule.block

    def _state(self, role: str):
        if self.site is None or (role != "grad_output" and not self.record_forward):
            return None, None
        return self.site.roles[role], self.rule.record_rule(role)

    def tiles(self, t2: torch.Tensor, role: str, rowwise: bool, colwise: bool):
        state, record = self._state(role)
        return _kernels.quantize_tiled(t2, self.rule.dtype(role), rowwise=rowwise, colwise=colwise,
                                       power_of_two=self.rule.power_of_two, state=state, record=record)

    def blocks(self, weight: torch.Tensor, write_qt: bool):
        state, record = self._state("weight")
        return _kernels.quantize_blocked(weight, self.rule.dtype("weight"), write_qt=write_qt,
                                         power_of_two=self.rule.power_of_two, state=state, record=record)

    def given_blocks(self, weight_q, write_qt: bool):
        """``blocks`` of a weight quantized elsewhere (``_linear.QuantizedWeight``: an fp8
        all-gather's), recorded as ``blocks`` records its cast: the whole weight's amax,
        the scale field as it was, nothing saturated."""
        state, record = self._state("weight")
        if state is not None:
            _kernels.record_stats(state, (weight_q.amax, weight_q.saturated), state.shown.reshape(1), record)
        q = weight_q.data
        return q, (q.t().contiguous() if write_qt else None), weight_q.sc


class _BlockFp8Linear(torch.autograd.Function):
    # Takes the forward's fp8 operands ready-made (quantized outside, where recording a
    # recipe's statistics is an ordinary side effect for torch.compile, as in _linear.py);
    # the backward quantizes the output gradient through the same quantizer.
    @staticmethod
    def forward(ctx, x, weight, bias, xq, x_inv, xq_t, xt_inv, wq, wq_t, w_inv, bias_lo, quantizer,
                out_dtype: torch.dtype):
        y = block_mm(xq, x_inv, "1x128", wq, w_inv, "128x128", out_dtype, bias_lo, quantizer.block)
        ctx.save_for_backward(xq_t, xt_inv, wq_t, w_inv)
        ctx.quantizer = quantizer
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "BlockScaling's fp8 linear has no differentiable backward: a backward with create_graph=True "
                "(a gradient penalty, say) cannot run through it. Run that step with CurrentScaling or "
                "DelayedScaling, or outside the fp8 region."
            )
        xq_t, xt_inv, wq_t, w_inv = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        quantizer = ctx.quantizer
        need_dx, need_dw, need_b = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = db = None
        if need_dx or need_dw:
            dyq, dy_inv, dyq_t, dyt_inv = quantizer.tiles(dy2, "grad_output", need_dx, need_dw)
            if need_dx:  # contracts along N: dy's rows against w.T's rows (the weight's columns)
                dx = block_mm(dyq, dy_inv, "1x128", wq_t, w_inv.t(), "128x128", x_dtype, None,
                              quantizer.block).reshape(x_shape)
            if need_dw:  # contracts along M: the rows of dy.T and x.T
                dw = block_mm(dyq_t, dyt_inv, "1x128", xq_t, xt_inv, "1x128", w_dtype, None, quantizer.block)
        if need_b:
            db = _kernels.bias_grad(dy2).to(b_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                     quantizer=BlockOptions(), bias_lo: torch.Tensor | None = None, weight_q=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as block-scaled fp8 gemms, output in ``out_dtype``.

    ``quantizer``: a :class:`BlockOptions`, or an object with its ``tiles``, ``blocks`` and
    ``block``. ``bias_lo``: the bias already in ``out_dtype`` (else cast here). ``weight_q``:
    the weight already in fp8 blocks (``_linear.QuantizedWeight``), not cast again. Only the
    layouts the gradients asked for (by grad mode and ``requires_grad``) are made.

    Example::

        >>> x, w = torch.randn(16, 32), torch.randn(8, 32)
        >>> block_fp8_linear(x, w, None, torch.bfloat16).shape
        torch.Size([16, 8])
    """
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
    x2 = x.reshape(-1, weight.shape[1]).contiguous()
    xq, x_inv, xq_t, xt_inv = quantizer.tiles(x2, "input", True, need_dw)
    if weight_q is None:
        wq, wq_t, w_inv = quantizer.blocks(weight.contiguous(), need_dx)
    else:  # already in fp8 blocks (an fp8 all-gather's): a RecipeQuantizer's given_blocks
        wq, wq_t, w_inv = quantizer.given_blocks(weight_q, need_dx)
    if bias_lo is None and bias is not None:
        bias_lo = bias.to(out_dtype)
    return _BlockFp8Linear.apply(x, weight, bias, xq, x_inv, xq_t, xt_inv, wq, wq_t, w_inv, bias_lo, quantizer,
                                 out_dtype)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
