"""A backward of the fp8 backward: gradient penalties through fp8 linears.

With ``create_graph=True`` (``torch.autograd.grad(loss, x, create_graph=True)``, then a
penalty on those gradients) the fp8 backward's results must themselves be differentiable.
They are computed as before, in fp8, by an autograd Function whose own backward is the
derivative of::

    dx = dy @ w        dw = dy.T @ x        db = dy.sum(0)

with respect to ``dy``, ``w`` and ``x``, in float32, from the operands the fp8 backward
used: ``dy`` itself and the dequantized fp8 copies of ``x`` and ``w`` (what the fp8
gemms multiplied), or, with row-wise scaling, the saved ``x`` and ``w``. The quantization
is treated as the identity, as everywhere in fp8 training.

The one term not available: with one scale per tensor the forward keeps no
full-precision input, so a penalty that depends on the *weight* gradient cannot send its
second-order term to the input (``d(dw)/dx``); that raises, naming the ways out, instead
of dropping the term.
"""

from __future__ import annotations

import torch

from .. import _torch_compat

from ._gemms import Meta, first_order_grads

__all__ = ["differentiable_grads"]

_float32 = torch.float32


def _dequantized(q_t: torch.Tensor | None, sc: torch.Tensor) -> torch.Tensor | None:
    # The transposed fp8 copy, back in float32 and in its forward layout.
    return None if q_t is None else (q_t.float() * sc[1]).t()


class _Fp8LinearGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dy, weight, x2, meta, saved, needs):
        ctx.set_materialize_grads(False)
        ctx.meta, ctx.needs = meta, needs
        ctx.x_requires_grad = needs[0] if x2 is None else x2.requires_grad
        if _rowwise(meta):
            ctx.save_for_backward(dy, saved[1], saved[0])
        else:
            xq_t, x_sc, wq_t, w_sc = saved[:4]
            ctx.save_for_backward(dy, None, None, xq_t, x_sc, wq_t, w_sc)
        dx, dw, db = first_order_grads(meta, dy, saved, needs)
        return dx, dw, db

    @staticmethod
    def backward(ctx, g_dx, g_dw, g_db):
        meta = ctx.meta
        if _rowwise(meta):
            dy, w, x2 = ctx.saved_tensors
            w, x = w.float(), x2.float()
        else:
            dy, _, _, xq_t, x_sc, wq_t, w_sc = ctx.saved_tensors
            x, w = _dequantized(xq_t, x_sc), _dequantized(wq_t, w_sc)
        dy2 = dy.reshape(-1, dy.shape[-1]).float()
        g_dy = g_w = g_x = None

        def add(total, term):
            return term if total is None else total + term

        if g_dx is not None:
            g_dx2 = g_dx.reshape(-1, g_dx.shape[-1]).float()
            g_dy = add(g_dy, g_dx2 @ w.t())
            g_w = dy2.t() @ g_dx2
        if g_dw is not None:
            g_dw = g_dw.float()
            if ctx.x_requires_grad:
                if not _rowwise(meta):
                    raise RuntimeError(
                        "a double backward (create_graph=True) through an fp8 linear's weight gradient needs the "
                        "layer's input in full precision, which the fp8 forward does not keep with one scale per "
                        "tensor; leave this layer out of fp8 (filter_fn), use RowwiseScaling (which keeps it), or "
                        "compute the penalty from the input gradients only"
                    )
                g_x = dy2 @ g_dw
            g_dy = add(g_dy, x @ g_dw.t())
        if g_db is not None:
            g_dy = add(g_dy, g_db.float().expand_as(dy2))
        if g_dy is not None:
            g_dy = g_dy.to(dy.dtype).reshape(dy.shape)
        if g_w is not None:
            g_w = g_w.to(meta.weight_dtype)
        if g_x is not None:
            g_x = g_x.to(meta.x_dtype)
        return g_dy, g_w, g_x, None, None, None


def _rowwise(meta: Meta) -> bool:
    # Many scales along the contraction dimension: the forward saved x and w themselves.
    return meta.recipe.state.rule.granularity != "tensor"


def differentiable_grads(meta: Meta, dy: torch.Tensor, saved, needs):
    """The fp8 backward's ``(dx, dw, db)``, differentiable with respect to ``dy``, the
    weight and (row-wise) the input."""
    weight = saved[1] if _rowwise(meta) else saved[4]
    x2 = saved[0] if _rowwise(meta) else None
    return _Fp8LinearGrad.apply(dy, weight, x2, meta, tuple(saved), needs)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
