"""cuDNN's RNN under autocast: native's cast-and-reflatten rule, made by our engine.

CUDA builds of torch register one autocast wrapper by hand, for ``aten::_cudnn_rnn``
(ATen's ``cudnn/AutocastRNN.cpp``): cuDNN reads an RNN's weights from one flat buffer, so
the wrapper casts every weight to float16 into a new flat buffer (autograd-recorded, so
the gradients reach the float32 weights) and the input and states to float16, whatever
the region's dtype, then calls the op with autocast excluded. The handler here does the
same: each weight cast to float16 (the cast autograd records), the casts laid out in one
flat buffer by ``torch._cudnn_rnn_flatten_weight`` (the layout cuDNN expects), the input,
``hx`` and ``cx`` cast to float16 where eligible. Its rule is that of the op's cast kind
``lower`` in the CUDA table (``op_tables.py``), which native applies in float16 for this
op alone.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from ._casting import cast_one, eligible
from ._handlers import run_without_autocast

__all__ = ["cudnn_rnn"]

_half = torch.float16
_flatten = torch._cudnn_rnn_flatten_weight
# Native casts these three inside its call of the op, in its argument order
# (``_casting.arg_order``), after the weights.
_STATE_ORDER = ("cx", "hx", "input") if _torch_compat.CASTS_LAST_ARGUMENT_FIRST else ("input", "hx", "cx")


def cudnn_rnn(ctx, st, op, keyset, args, kwargs):
    """The handler of ``aten::_cudnn_rnn`` (see the module docstring)."""
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    weight, weight_buf = values["weight"], values["weight_buf"]
    first = weight[0]
    if any(w.dtype != first.dtype for w in weight):
        raise RuntimeError("_cudnn_rnn under autocast: weight scalar types do not match")
    probe = weight_buf if weight_buf is not None else first
    if eligible(probe, ctx.device_type) and probe.dtype is not _half:
        cast = [w.half() for w in weight]
        with torch.no_grad():
            # Re-points each cast into one flat float16 buffer in cuDNN's layout (the
            # values are the casts'; autograd's record of each cast stays).
            weight_buf = _flatten(
                cast, values["weight_stride0"], values["input"].size(-1), values["mode"],
                values["hidden_size"], values["proj_size"], values["num_layers"],
                values["batch_first"], values["bidirectional"],
            )
        values["weight"], values["weight_buf"] = cast, weight_buf
    for name in _STATE_ORDER:
        t = values[name]
        if t is not None:
            values[name] = cast_one(t, _half, ctx, st)
    return run_without_autocast(op, tuple(values[name] for name in names), {})


_torch_compat.keep_out_of_dynamo(globals(), __name__)
