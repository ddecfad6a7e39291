"""The handler of ``linear`` under a policy that marks it fp8: the fp8 path, in the dispatcher.

Eagerly every ``linear`` call reaches our kernel for it, the ones made inside torch's
Python composites (``F.multi_head_attention_forward``) and C++ composites included: an
eligible call (``fp8/_eligibility.py``) runs as scaled fp8 gemms under the region's
recipe, with autocast off inside the fp8 path (its own quantizing and statistics ops are
not autocast); an ineligible one is cast to the region's dtype, as ``lower`` casts it.
While torch.compile traces, the fp8 level above the dispatcher traces the same path as
Python (``_tracing_path.py``): Dynamo must see its statistics updates.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from ..fp8 import fp8_linear
from ..fp8._eligibility import fp8_eligible, linear_arguments
from ._handlers import lower
from ._torch_checkpoint import inside_torch_checkpoint

__all__ = ["fp8"]

_DisableAutocast = torch._C._DisableAutocast
_graph_task_id = torch._C._current_graph_task_id


def fp8(ctx, st, op, keyset, args, kwargs):
    """The fp8 path for an eligible ``linear`` call, else ``lower``."""
    x, weight, bias = linear_arguments(args, kwargs)
    recipe = ctx.fp8
    if recipe is None or not fp8_eligible(recipe, ctx.device_type, x, weight, bias):
        return lower(ctx, st, op, keyset, args, kwargs)
    # A forward call made while a backward runs is activation checkpointing recomputing
    # the forward; one made under a checkpoint will be recomputed. Recipes with state
    # replay the first's scales for the second (DelayedScaling); only they need to know
    # the second, which costs a walk up the stack.
    if _graph_task_id() != -1:
        phase = "recompute"
    elif recipe.stateful and (st.own_checkpoint or inside_torch_checkpoint()):
        phase = "checkpointed"
    else:
        phase = "forward"
    with _DisableAutocast():
        return fp8_linear(x, weight, bias, recipe, ctx.dtype, recipe._site(weight), phase)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
