"""Which checkpointed forward a recomputation replays: delayed scaling's scales per checkpoint.

A forward under activation checkpointing quantizes with the scales in force then; its
recomputation, during backward, must quantize with the same ones, although other calls
have advanced the histories since, and must record nothing. The scales are kept on the
object that torch's checkpoint itself keeps for that one checkpointed call, so they live
exactly as long as a recomputation can still come:

* non-reentrant ``torch.utils.checkpoint`` (and ``dispatch_amp.checkpoint``): its frame
  object, reached from the saved-tensor hooks it installs for the forward (``frame``) and
  for the recomputation (``target_frame_ref``);
* reentrant: the ``CheckpointFunction`` context, an argument of its ``forward`` and
  ``backward`` on the Python stack.

A forward under ``no_grad`` (an evaluation), or whose loss is dropped, leaves nothing
behind: torch keeps no frame for it, or frees the frame with its graph. Recomputations
of one frame replay its calls in order; a second backward through a retained graph
replays them again (a cursor per graph task).
"""

from __future__ import annotations

import sys

import torch

from .. import _torch_compat

__all__ = ["checkpoint_key", "remember", "replayed", "forward_scales"]

_ATTR = "_dispatch_amp_fp8_replays"
_REENTRANT = _torch_compat.reentrant_checkpoint_function
_REENTRANT_CODES = (_REENTRANT.forward.__code__, _REENTRANT.backward.__code__)
# Frames searched for the reentrant variant's context, from the fp8 call up.
_MAX_DEPTH = 64


def _closure(fn, name):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def checkpoint_key():
    """The object torch keeps for the innermost checkpointed call running now (its
    forward or its recomputation), or None."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        if frame.f_code in _REENTRANT_CODES:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    hooks = _torch_compat.top_saved_tensors_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    if getattr(pack, "__module__", None) != "torch.utils.checkpoint":
        return None
    for _ in range(4):  # the recomputation's hook is wrapped (torch._dynamo.disable)
        inner = getattr(pack, "__wrapped__", None) or _closure(pack, "fn")
        if inner is None:
            break
        pack = inner
    found = _closure(pack, "frame")
    if found is not None:
        return found
    ref = _closure(pack, "target_frame_ref")
    return None if ref is None else ref()


class _Replays:
    __slots__ = ("calls", "cursors")

    def __init__(self) -> None:
        self.calls: dict = {}  # site -> [scales of each call, in order]
        self.cursors: dict = {}  # (graph task, site) -> next call to replay


def forward_scales(site, phase: str, stateful: bool):
    """``((input scale, weight scale), record, key)`` of a forward call: scales of None are
    the rule's own (a recomputation's are the forward's it replays); ``record``: whether
    the call records statistics (a recomputation does not); ``key``: where to keep the
    scales the forward uses, for its recomputation. Only a rule with state (delayed
    scaling) replays: a stateless one gives the same scales again by itself."""
    if not stateful or site is None:
        return (None, None), phase != "recompute", None
    key = checkpoint_key() if phase != "forward" else None
    if phase == "recompute" and key is not None:
        scales = replayed(key, site)
        if scales is not None:
            return scales, False, None
    return (None, None), True, (key if phase == "checkpointed" else None)


def remember(key, site, scales) -> None:
    """Keeps the scales a checkpointed forward's call of ``site`` used."""
    replays = getattr(key, _ATTR, None)
    if replays is None:
        replays = _Replays()
        setattr(key, _ATTR, replays)
    replays.calls.setdefault(site, []).append(scales)


def replayed(key, site):
    """The scales of the forward call a recomputation's call of ``site`` replays, or None."""
    replays = getattr(key, _ATTR, None)
    if replays is None:
        return None
    calls = replays.calls.get(site)
    cursor = (torch._C._current_graph_task_id(), site)
    i = replays.cursors.get(cursor, 0)
    if calls is None or i >= len(calls):
        return None
    replays.cursors[cursor] = i + 1
    return calls[i]
