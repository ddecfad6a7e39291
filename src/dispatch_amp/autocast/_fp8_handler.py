"""The handler of the ops a policy marks fp8: the fp8 path, in the dispatcher.

Eagerly every ``linear`` call reaches our kernel for it, the ones made inside torch's
Python composites (``F.multi_head_attention_forward``) and C++ composites included: an
eligible call (``fp8/_eligibility.py``) runs as scaled fp8 gemms under the region's
recipe, with autocast off inside the fp8 path (its own quantizing and statistics ops are
not autocast); an ineligible one is cast to the region's dtype, as ``lower`` casts it.
``addmm``, ``mm`` and ``matmul`` calls that are a linear (``fp8/_reach.py``: the right
operand a 2-D parameter or its transpose) take the same path as that linear, with the
parameter's site; their other calls are ``lower``'s, as under a policy without fp8.
While torch.compile traces, the fp8 level above the dispatcher traces the same path as
Python (``_tracing_path.py``): Dynamo must see its statistics updates.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from ..fp8 import fp8_linear
from ..fp8._gathered import GatheredFp8Weight
from ..fp8.all_gather import gathered_linear
from ..fp8._eligibility import fp8_eligible, linear_arguments
from ..fp8._reach import linear_shaped
from ._handlers import lower
from ._torch_checkpoint import inside_torch_checkpoint, refuse_inside_torch_checkpoint
from .op_tables import FP8
from .policy import Policy

__all__ = ["fp8"]

_DisableAutocast = torch._C._DisableAutocast
_graph_task_id = torch._C._current_graph_task_id
_LINEAR = torch.ops.aten.linear.default
# The overloads whose linear-shaped calls the fp8 path takes, by their op's name.
_REACH = {torch.ops.aten.addmm.default: "aten::addmm", torch.ops.aten.mm.default: "aten::mm",
          torch.ops.aten.matmul.default: "aten::matmul"}


def fp8(ctx, st, op, keyset, args, kwargs):
    """The fp8 path for an eligible ``linear`` call or linear-shaped matmul, else ``lower``."""
    recipe = ctx.fp8
    if recipe is None:
        return lower(ctx, st, op, keyset, args, kwargs)
    gathered = False
    if op is _LINEAR:
        x, weight, bias = linear_arguments(args, kwargs)
        holder = weight
        # A weight FSDP2 all-gathered in fp8 (fp8/all_gather/) has only its fp8 form here.
        gathered = type(weight) is GatheredFp8Weight
    else:
        op_name = _REACH.get(op)
        call = None if op_name is None else linear_shaped(op_name, args, kwargs)
        if call is None:
            return lower(ctx, st, op, keyset, args, kwargs)
        x, weight, bias, holder = call
    if not gathered and not fp8_eligible(recipe, ctx.device_type, x, weight, bias, holder=holder):
        return lower(ctx, st, op, keyset, args, kwargs)
    # torch.utils.checkpoint recomputes under native autocast, which would run this call
    # in the region's dtype: refused, with the way out (dispatch_amp.checkpoint). Only
    # here: the calls that do not take the fp8 path are cast as native casts them.
    in_torch_checkpoint = not st.own_checkpoint and inside_torch_checkpoint()
    if in_torch_checkpoint:
        native_kind = Policy.for_device(ctx.device_type).rules.get(op.overloadpacket._qualified_op_name)
        refuse_inside_torch_checkpoint(ctx, st, op.overloadpacket.__name__, FP8, native_kind)
    # A forward call made while a backward runs is activation checkpointing recomputing
    # the forward; one made under a checkpoint will be recomputed. Recipes with state
    # replay the first's scales for the second (DelayedScaling).
    if _graph_task_id() != -1:
        phase = "recompute"
    elif recipe.stateful and (st.own_checkpoint or in_torch_checkpoint):
        phase = "checkpointed"
    else:
        phase = "forward"
    with _DisableAutocast():
        if gathered:
            return gathered_linear(x, weight, bias, recipe, ctx.dtype, phase)
        return fp8_linear(x, weight, bias, recipe, ctx.dtype, recipe.state.site(holder), phase)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
