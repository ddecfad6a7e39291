"""``custom_fwd`` / ``custom_bwd``: mixed precision for custom ``torch.autograd.Function``s.

Native semantics (``torch.amp.custom_fwd``), applied to ``dispatch_amp.autocast``:
``custom_fwd`` records the autocast state ``forward`` ran under, and ``custom_bwd`` runs
``backward`` under the same state, so a backward called outside the context (the usual
place) computes in the precision the forward used.

Example::

    class Square(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, x):                 # runs in float32 with autocast off
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_map_only

from .context import _check_device_type, autocast, get_autocast_dtype, is_autocast_enabled

__all__ = ["custom_fwd", "custom_bwd"]

# Names of the attributes stored on the autograd ctx (prefixed: the ctx is the user's).
_USED_AUTOCAST = "_dispatch_amp_fwd_used_autocast"
_DTYPE = "_dispatch_amp_dtype"


def _cast_inputs(value, device_type: str, dtype: torch.dtype):
    """``value`` with its floating tensors on ``device_type`` (not float64) cast to
    ``dtype``, looking inside lists, tuples and dicts as torch's custom_fwd does."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = t.is_floating_point() and t.device.type == device_type and t.dtype is not torch.float64
        return t.to(dtype) if eligible else t

    return tree_map_only(torch.Tensor, cast, value)


def custom_fwd(fwd=None, *, device_type: str, cast_inputs: torch.dtype | None = None):
    """Decorates the ``forward`` of a custom autograd Function for ``dispatch_amp.autocast``.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ``"xpu"`` or ``"mps"``, the autocast region
            this forward follows.
        cast_inputs: if set and ``forward`` runs inside an enabled region, its floating
            inputs on ``device_type`` (not float64) are cast to this dtype and ``forward``
            runs with autocast off. If None, the ops inside ``forward`` follow the current
            autocast state. Outside an enabled region this decorator changes nothing.

    Example::

        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, x, w): ...
    """
    _check_device_type(device_type)
    if cast_inputs is not None and not isinstance(cast_inputs, torch.dtype):
        raise TypeError(f"cast_inputs must be a torch.dtype or None, got {cast_inputs!r}")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        setattr(ctx, _DTYPE, get_autocast_dtype(device_type))
        enabled = is_autocast_enabled(device_type)
        if cast_inputs is None:
            setattr(ctx, _USED_AUTOCAST, enabled)
            return fwd(ctx, *args, **kwargs)
        setattr(ctx, _USED_AUTOCAST, False)
        if not enabled:
            return fwd(ctx, *args, **kwargs)
        with autocast(device_type, enabled=False):
            return fwd(
                ctx,
                *_cast_inputs(args, device_type, cast_inputs),
                **_cast_inputs(kwargs, device_type, cast_inputs),
            )

    return decorate_fwd


def custom_bwd(bwd=None, *, device_type: str):
    """Decorates the ``backward`` of a custom autograd Function for ``dispatch_amp.autocast``.

    ``backward`` runs under the autocast state its ``forward`` (decorated with
    ``custom_fwd``) ran under, wherever ``backward()`` is called from.

    Example::

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad): ...
    """
    _check_device_type(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *args, **kwargs):
        if not hasattr(ctx, _USED_AUTOCAST):
            raise RuntimeError(
                "custom_bwd found no autocast state on ctx: decorate the Function's forward "
                "with dispatch_amp.custom_fwd(device_type=...) as well"
            )
        with autocast(device_type, dtype=getattr(ctx, _DTYPE), enabled=getattr(ctx, _USED_AUTOCAST)):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd
