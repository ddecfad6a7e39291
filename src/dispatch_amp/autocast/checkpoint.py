"""``checkpoint``: ``torch.utils.checkpoint.checkpoint`` that recomputes under our autocast.

Activation checkpointing reruns the forward during ``backward()``. PyTorch's checkpoint
records torch's autocast state and reruns under ``torch.autocast`` with it. Inside our
context torch reports our dtype, so under a built-in policy (native's own table) torch's
checkpoint recomputes exactly what the forward computed and needs nothing from us. Under
any other policy native's table would decide the rerun's casts, so the engine refuses
torch's checkpoint there with an error naming this function, which records our state at
the forward and reopens it for the rerun, for both variants.

Example::

    with amp.autocast("cpu"):
        y = amp.checkpoint(block, x, use_reentrant=False)
    y.float().sum().backward()
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

from . import _engine
from .context import autocast

__all__ = ["checkpoint"]


def _reopen(frame: dict):
    """A context that reinstates the autocast frame recorded at the forward."""
    contexts = [
        autocast(ctx.device_type, ctx.dtype, ctx.enabled, ctx.cache_enabled, ctx.policy, ctx.fp8)
        for ctx in frame.values()
    ]

    class _Frame:
        def __enter__(self):
            for c in contexts:
                c.__enter__()

        def __exit__(self, *exc):
            for c in reversed(contexts):
                c.__exit__(*exc)

    return _Frame()


def checkpoint(function, *args, use_reentrant: bool | None = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` whose recomputation reopens our autocast state.

    Takes the same arguments as ``torch.utils.checkpoint.checkpoint``; ``use_reentrant``
    must be given explicitly, as torch requires.

    Example::

        with amp.autocast("cpu"):
            h = amp.checkpoint(layer, h, use_reentrant=False)
    """
    frame = dict(_engine.current_frame())

    @functools.wraps(function)
    def rerun_under_forward_state(*inner_args, **inner_kwargs):
        # The first call is the forward itself, inside the caller's context; later calls
        # are recomputations during backward, where the caller's context is usually
        # closed, and where torch runs the recomputation with its function-mode stack
        # emptied even inside it: reopening the recorded regions puts back what an fp8
        # region needs there (its fp8 level). The function runs marked as ours: the
        # engine's refusal of torch's checkpoint under a policy that is not native's
        # does not apply to this one.
        state = _engine.STATE
        state.own_checkpoint += 1
        try:
            recomputing = torch._C._current_graph_task_id() != -1
            if _engine.current_frame() == frame and not recomputing:
                return function(*inner_args, **inner_kwargs)
            with _reopen(frame):
                return function(*inner_args, **inner_kwargs)
        finally:
            state.own_checkpoint -= 1

    return torch.utils.checkpoint.checkpoint(
        rerun_under_forward_state, *args, use_reentrant=use_reentrant, **kwargs
    )
