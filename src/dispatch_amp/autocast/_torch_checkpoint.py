"""torch.utils.checkpoint under a policy that is not native's: refused, with the way out.

torch's checkpoint records torch's autocast state at the forward and recomputes under
``torch.autocast`` with it during backward. Under a built-in policy that is our state
(the same dtype and the same table), so the recomputation equals the forward. Under a
policy whose kind for an op differs from native's, the recomputation would cast that op
differently: the handler of such an op refuses, and names ``dispatch_amp.checkpoint``,
which recomputes under ours. Except under ``patch_torch`` with this very policy:
``torch.amp.autocast`` is then ours, and the recomputation too (the patch warns when it
stops if a backward could come after it).
"""

from __future__ import annotations

import sys

import torch

from .. import _torch_compat
from .op_tables import FP8
from .policy import Policy, policy_with_fp8_ops

__all__ = ["refusing_torch_checkpoint", "refuse_inside_torch_checkpoint", "inside_torch_checkpoint"]

_REENTRANT_CHECKPOINT_CODE = _torch_compat.reentrant_checkpoint_function.forward.__code__


def refusing_torch_checkpoint(handler, kind, native_kind):
    """``handler`` for an op this policy casts as ``kind`` where native's table says
    ``native_kind``: it refuses to run inside torch's checkpoint (see the module
    docstring)."""

    def refusing(ctx, st, op, keyset, args, kwargs):
        refuse_inside_torch_checkpoint(ctx, st, op.overloadpacket.__name__, kind, native_kind)
        return handler(ctx, st, op, keyset, args, kwargs)

    refusing.__wrapped__ = handler
    # The compiled engine reads the rule of `handler` and runs it itself wherever torch's
    # checkpoint cannot be running (autocast/_compiled_engine.py, rule_of).
    refusing.refuses_torch_checkpoint = handler
    return refusing


def refuse_inside_torch_checkpoint(ctx, st, name: str, kind, native_kind) -> None:
    """Raises if the calling code runs inside torch's checkpoint (see the module
    docstring): op ``name`` is cast as ``kind`` where native's table says ``native_kind``."""
    if not st.own_checkpoint and inside_torch_checkpoint() and not _recomputes_under_patch(ctx):
        raise RuntimeError(
            f"torch.utils.checkpoint inside dispatch_amp.autocast with policy "
            f"{ctx.policy.name!r}: this policy casts {name} as {kind!r} where native "
            f"autocast's {ctx.device_type} table says {native_kind!r}, and torch's "
            f"checkpoint recomputes the region during backward under native torch.autocast, "
            f"so the recomputed activations would differ from the forward's. Use "
            f"dispatch_amp.checkpoint (same arguments), which recomputes under this policy."
        )


def _recomputes_under_patch(ctx) -> bool:
    """Whether torch's checkpoint would recompute under ``ctx``'s policy: patch_torch is
    active with it, so the torch.amp.autocast that torch reopens is ours."""
    opened_by = torch.amp.autocast
    if not getattr(opened_by, "_dispatch_amp_patch", False):
        return False
    policy = getattr(opened_by, "_patch_policy", None) or Policy.for_device(ctx.device_type)
    recipe = getattr(opened_by, "_patch_fp8", None)
    if recipe is not ctx.fp8:
        return False
    if recipe is not None and not policy.ops(FP8):
        policy = policy_with_fp8_ops(policy)
    if policy != ctx.policy:
        return False
    opened_by._checkpointed_under_policy = True  # read by TorchPatch.stop()
    return True


def inside_torch_checkpoint() -> bool:
    """Whether the calling code runs inside torch.utils.checkpoint's function (a forward
    that will be recomputed, or the recomputation)."""
    hooks = _torch_compat.top_saved_tensors_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        return True  # the non-reentrant variant packs saved tensors with its own hooks
    frame = sys._getframe(1)
    while frame is not None:  # the reentrant variant runs the function in its forward
        if frame.f_code is _REENTRANT_CHECKPOINT_CODE:
            return True
        frame = frame.f_back
    return False


_torch_compat.keep_out_of_dynamo(globals(), __name__)
