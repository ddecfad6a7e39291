"""``checkpoint``: ``torch.utils.checkpoint.checkpoint`` that recomputes under our autocast.

Activation checkpointing reruns the forward during ``backward()``. PyTorch's checkpoint
records the *native* autocast state and restores it for the rerun; it cannot know about
``dispatch_amp.autocast``, so inside our context a plain ``torch.utils.checkpoint``
reruns the forward without casts: the non-reentrant variant raises ``CheckpointError``
(the recomputed tensors have other dtypes) and the reentrant one computes the backward
from float32 activations instead of native's low-precision ones. This wrapper records
our state at the forward and reopens it for the rerun, for both variants.

Example::

    with amp.autocast("cpu"):
        y = amp.checkpoint(block, x, use_reentrant=False)
    y.float().sum().backward()
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint

from . import _engine
from .autocast import autocast

__all__ = ["checkpoint"]


def _reopen(frame: dict):
    """A context that reinstates the autocast frame recorded at the forward."""
    contexts = [
        autocast(ctx.device_type, ctx.dtype, ctx.enabled, ctx.cache_enabled, ctx.policy)
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
        # are recomputations during backward, where the caller's context is closed.
        if _engine.current_frame() == frame:
            return function(*inner_args, **inner_kwargs)
        with _reopen(frame):
            return function(*inner_args, **inner_kwargs)

    return torch.utils.checkpoint.checkpoint(
        rerun_under_forward_state, *args, use_reentrant=use_reentrant, **kwargs
    )
