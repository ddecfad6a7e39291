"""The engine's kernels: the Python function the dispatcher calls for an op we may cast.

One kernel per aten overload, registered at our autocast key by ``_dispatch_key.py``. The
dispatcher calls it only on a thread with the key on (inside one of our regions) and
only for the ops some policy in use casts (or native autocast would cast): every other
op passes the key in C++. On the hot path it reads the thread's innermost context, checks
that no native region is open inside ours and that torch's state for the device type is
still the context's, and hands the call to the handler its policy gives the op
(``_routing.Plan``, ``_handlers.py``).

torch's state switched by hand inside our region (``torch.set_autocast_enabled``,
``torch.set_autocast_dtype``, their legacy per-device forms) is followed, as native's
kernels follow it, so that the casts and torch's queries never disagree: autocast
switched off for the device type runs the call as given; another dtype casts to that
dtype under the region's policy. Both are read per call, cheaply: whether native's key
for the device type is excluded on this thread (what switching autocast off does), and
the device type's dtype.

Where the call is not ours to decide it goes on to native autocast, with our key
excluded for it and the ops it runs: a native ``torch.autocast`` region opened inside ours
rules (the innermost region wins, as between native regions), and so does native for a
device type none of our open contexts covers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._C import DispatchKey, DispatchKeySet

from .. import _torch_compat
from ._casting import context_for
from ._state import STATE, DeviceContext
from ._tokens import BUILTIN_TOKEN, contexts_for, current_token
from .policy import BUILTIN_DEVICES, Policy

__all__ = ["make_kernel"]

_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_ExcludeKeys = torch._C._ExcludeDispatchKeyGuard
_OURS = DispatchKeySet(DispatchKey.AutocastPrivateUse1)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_get_dtype = torch.get_autocast_dtype


def _to_native(op, args, kwargs):
    """The call as native autocast would run it: past our key, here and inside."""
    with _ExcludeKeys(_OURS):
        return op._op(*args, **kwargs)


def make_kernel(op):
    """The kernel of aten overload ``op`` (see the module docstring)."""

    key = id(op)  # plans key their handlers by it: an int hashes in C, an OpOverload in Python

    def kernel(keyset, *args, **kwargs):
        st = STATE
        top = st.top  # one read of the thread's state for the common case: one context
        if top is None:
            ctx = _context(st, args, kwargs)
            if ctx is None:
                return _to_native(op, args, kwargs)
            handlers = ctx.handlers
        else:
            ctx, depth, native_key, device_type, dtype, handlers = top
            # A native region opened inside our innermost raised torch's nesting counter
            # (depth None: a built-in policy, where native would cast as we do: _engine).
            if depth is not None:
                _increment_nesting()
                if _decrement_nesting() > depth:
                    return _to_native(op, args, kwargs)
            # torch's state switched by hand inside the region (see the module docstring).
            if _excluded(native_key) or _get_dtype(device_type) is not dtype:
                ctx = as_torch_says(ctx)
                if ctx is None:
                    return _to_native(op, args, kwargs)
                handlers = ctx.handlers
        handler = handlers.get(key)
        if handler is None:
            handler = ctx.plan.handler(op)
        return handler(ctx, st, op, keyset, args, kwargs)

    kernel.__name__ = f"dispatch_amp_kernel_{op._schema.name.replace('::', '_')}_{op._overloadname}"
    return kernel


def _context(st, args, kwargs):
    """The context of a call when the thread has no single primary one: several device
    types open (the first tensor's decides), or a thread torch started with our key on
    (no frames of ours here: the region is found from torch's state and our token)."""
    if st.regions:
        if not st.active:
            return None
        ctx = context_for(st.active, args, kwargs)
        if ctx is None:
            return None
        _increment_nesting()
        if _decrement_nesting() > st.native_depth:
            return None
        if _excluded(ctx.native_key) or _get_dtype(ctx.device_type) is not ctx.dtype:
            return as_torch_says(ctx)
        return ctx
    return _foreign_context(args, kwargs)


def as_torch_says(ctx: DeviceContext) -> DeviceContext | None:
    """``ctx`` as torch's state for its device type says now: None where autocast is
    switched off there; where its dtype was set to another, the same context with that
    dtype (made once per dtype)."""
    if _excluded(ctx.native_key):
        return None
    dtype = _get_dtype(ctx.device_type)
    if dtype is ctx.dtype:
        return ctx
    other = ctx.by_dtype.get(dtype)
    if other is None:
        other = ctx.by_dtype.setdefault(dtype, dataclasses.replace(ctx, dtype=dtype))
    return other


_FOREIGN: dict = {}


def _foreign_context(args, kwargs):
    """The context in force for this call on a thread without frames of ours, read from
    torch's autocast state (dtype, enabled, cache flag) and our token (the policy)."""
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None:
        return None
    device_type = t.device.type
    if device_type not in BUILTIN_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    token = current_token()
    policy, fp8 = Policy.for_device(device_type), None
    if token is not BUILTIN_TOKEN:
        for entry_device, entry_policy, entry_fp8 in contexts_for(token):
            if entry_device == device_type:
                policy, fp8 = entry_policy, entry_fp8
    dtype, cache = torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()
    key = (device_type, dtype, policy._key, cache)
    ctx = _FOREIGN.get(key) if fp8 is None else None  # contexts with a recipe are not kept
    if ctx is None:
        ctx = DeviceContext(device_type, True, dtype, policy, cache, fp8)
        if fp8 is None:
            _FOREIGN[key] = ctx
    return ctx


_torch_compat.keep_out_of_dynamo(globals(), __name__)
