"""What the engine's kernels do with one call, per cast kind: native autocast's wrappers.

A handler is called by a kernel (``_kernels.py``) once the call is known to be ours to
decide (our region in force, no native region inside it, the op's device type ours). It
gets ``(ctx, st, op, keyset, args, kwargs)``: the region's context, the thread state, the
aten overload, the dispatch keys of the call, and the call's arguments as the dispatcher
hands them to Python (trailing defaults left out, keyword-only arguments as keywords).

Each follows the wrapper native autocast registers for that kind (ATen's
``autocast_mode.h``): cast the eligible arguments, in native's order (``_casting.py``),
then call the op again with every autocast key excluded, so the ops it runs inside are
not cast again, as native excludes its key inside the ops it handles. Ops a policy does
not cast run as given: redispatched past the autocast keys for this call only, so the
ops they run inside still reach our kernels (what a fallthrough would do).

Handlers are made per (policy, device type, op) by ``_routing.py``; the values they need
from the op's schema (where its ``dtype`` argument is, the overload that takes one) are
read once then.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey

from .. import _torch_compat
from . import _cast_cache
from ._casting import (
    CAST_METHODS, ORDERS, arg_order, banned_message, cast_arguments, cast_one, eligible, holds_tensors,
    map_kwargs, map_tensors, promote_dtype,
)

__all__ = [
    "lower", "fp32", "promote", "given", "banned", "fp32_set_opt_dtype", "fp32_append_dtype",
    "run_without_autocast", "BELOW_AUTOCAST",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_float32 = torch.float32
_float64 = torch.float64
_scope_store = _cast_cache.SCOPE.get  # the open cast_cache's store, or None
_STEPS = _cast_cache.STEPS
_REGION = _cast_cache.REGION
_insert = _cast_cache.insert
_no_entries: dict = {}  # what a call sees while torch's cache flag is off: never written
_is_view = _torch_compat.tensor_is_view
_is_cached_tensor = _torch_compat.is_cached_tensor
_cache_on = torch.is_autocast_cache_enabled
_inference_mode_on = torch.is_inference_mode_enabled
_ExcludeKeys = torch._C._ExcludeDispatchKeyGuard
_AUTOCAST_KEYS = _torch_compat.AUTOCAST_KEYS
_LAST_FIRST = _torch_compat.CASTS_LAST_ARGUMENT_FIRST
# Guards excluding every autocast key, not in use. torch's _DisableAutocast is a new
# Python object per use, which pybind registers and unregisters in a process-wide table
# (about 1 us per cast call inside a forward); an _ExcludeDispatchKeyGuard can be entered
# again once exited, so these are reused: one per call in progress (calls nest, threads
# share the list; its pop and append are atomic).
_idle_guards: list = []
# The keys below every autocast key. torch's keyset arithmetic counts PythonDispatcher
# as "after" the autocast keys, which it is not: it is dropped here, or a redispatch with
# the python dispatcher on would re-enter it.
BELOW_AUTOCAST = torch._C._dispatch_keyset_full_after(DispatchKey.AutocastCPU).remove(
    DispatchKey.PythonDispatcher
)


def run_without_autocast(op, args, kwargs):
    """``op(*args, **kwargs)`` with every autocast key excluded inside it (ours and
    native's): as native's wrappers call the op they handle, so that the ops it runs
    inside are not cast again."""
    try:
        guard = _idle_guards.pop()
    except IndexError:
        guard = _ExcludeKeys(_AUTOCAST_KEYS)
    try:
        with guard:
            return op._op(*args, **kwargs)
    finally:
        _idle_guards.append(guard)


def lower(ctx, st, op, keyset, args, kwargs):
    """Every eligible argument to the region's lower precision (matmuls, convolutions).

    The hot path of the engine (every matmul and convolution of a forward): cast_one's
    tests are inlined for the arguments most calls have: one already in the dtype or not
    a tensor (no cast), an activation (never cached: native caches leaves only), a weight
    whose cast is cached, and a list of ints (a convolution's stride, padding and
    dilation).
    """
    dtype = ctx.dtype
    if kwargs and _LAST_FIRST:  # keyword-only arguments come last in the schema
        kwargs = map_kwargs(kwargs, dtype, ctx, st)
    cast = None
    entries = None  # the weight casts this call may use, read at its first weight
    n = len(args)
    for i in ORDERS[n] if n < 64 else arg_order(n):  # native's order (_casting.arg_order)
        a = args[i]
        cls = a.__class__
        if cls is _Tensor or cls is _Parameter or isinstance(a, _Tensor):
            a_dtype = a.dtype
            if a_dtype is dtype:
                continue
            if a.is_leaf:
                # A weight's cast made earlier in the region (or kept by cast_cache):
                # _cast_cache._fresh's test, inlined (an eval loop under cast_cache is
                # mostly these); a weight without one: cast_one's caching rule, inlined
                # (every weight of a training forward); any other leaf: cast_one. The entry
                # holds the weight (so its id is not reused) and the storage it was cast
                # from (so `is` tells that storage from any other). Entries are read by
                # index: _cast_cache.WEIGHT ... CAST (1 dtype, 2 version, 3 storage,
                # 4 address, 5 shape and 6 strides (None until the first use, then the
                # cast's), 7 generation, 8 the cast).
                if entries is None:  # once per call (a linear has two weights)
                    store = _scope_store()
                    if store is None:
                        store = _REGION
                    # No entry is used or made while torch's cache flag is off or
                    # inference mode is on (cast_one's rule).
                    entries = store.entries if _cache_on() and not _inference_mode_on() else _no_entries
                hit = entries.get(id(a))
                if (
                    hit is not None and hit[1] is dtype and hit[2] == a._version and a_dtype is _float32
                    and a.requires_grad
                ):
                    try:
                        same = a.untyped_storage() is hit[3]
                    except RuntimeError:  # no storage of its own (torch.func's wrappers)
                        same = False
                    if same and hit[4] == a.data_ptr() and hit[7] == _STEPS.generation:
                        shape = hit[5]
                        if shape is None:  # its first use: the weight's were its cast's
                            shape = hit[5] = hit[8].shape  # no local holds the cast (insert)
                            hit[6] = hit[8].stride()
                        if shape == a.shape and hit[6] == a.stride():
                            b = hit[8]
                        else:  # a slice, reshape or transpose of the same storage
                            hit = None  # the stale cast goes before the new one is made (insert)
                            b = cast_one(a, dtype, ctx, st)
                    else:  # other data, or an optimizer step, since: cast_one tests it all
                        hit = None
                        b = cast_one(a, dtype, ctx, st)
                elif (
                    # A weight seen first in this region (or scope): cast_one's caching
                    # rule, inlined, the tests lower has made already left out.
                    a_dtype is _float32 and a.requires_grad and entries is not _no_entries
                    and (cls is _Parameter or cls is _Tensor) and ctx.on_device(a) and not _is_view(a)
                    and not a.is_inference() and not _is_cached_tensor(a)
                ):
                    hit = None
                    b = _insert(store, a, dtype, CAST_METHODS.get(dtype))
                else:
                    hit = None
                    b = cast_one(a, dtype, ctx, st)
            elif a_dtype is _float64 or not a.is_floating_point() or not ctx.on_device(a):
                continue
            else:
                to = CAST_METHODS.get(dtype)
                b = to(a) if to is not None else a.to(dtype)
        elif isinstance(a, (list, tuple)):
            if not holds_tensors(a):
                continue
            b = map_tensors((a,), dtype, ctx, st)[0]
        else:
            continue
        if b is not a:
            if cast is None:
                cast = list(args)
            cast[i] = b
    if kwargs and not _LAST_FIRST:
        kwargs = map_kwargs(kwargs, dtype, ctx, st)
    return run_without_autocast(op, args if cast is None else cast, kwargs)


def fp32(ctx, st, op, keyset, args, kwargs):
    """Every eligible argument to float32 (ops that need range or precision)."""
    args, kwargs = cast_arguments(args, kwargs, _float32, ctx, st)
    return run_without_autocast(op, args, kwargs)


def promote(ctx, st, op, keyset, args, kwargs):
    """Every eligible argument to the widest floating dtype among them and the region's."""
    dtype = promote_dtype(ctx.dtype, ctx.device_type, args, kwargs, op)
    args, kwargs = cast_arguments(args, kwargs, dtype, ctx, st)
    return run_without_autocast(op, args, kwargs)


def given(ctx, st, op, keyset, args, kwargs):
    """As given: past the autocast keys for this call only (not a cast of the policy, nor
    native's: the ops it runs inside still reach our kernels)."""
    return op._handle.redispatch_boxed(keyset & BELOW_AUTOCAST, *args, **kwargs)


def banned(ctx, st, op, keyset, args, kwargs):
    raise RuntimeError(banned_message(op.overloadpacket.__name__))


def fp32_set_opt_dtype(position: int | None):
    """Native's fp32_set_opt_dtype wrapper for an op whose optional ``dtype`` argument is
    at ``position`` (None: keyword-only) (softmax, sums, cumulative ops, vector norms): an
    explicit dtype is respected; otherwise, if the first argument is eligible, the op runs
    with ``dtype=torch.float32`` (its own mixed-dtype kernel and backward, not a cast
    input); an ineligible call runs as given."""
    if position is None:
        position = 1 << 30  # never among the positional arguments

    def handler(ctx, st, op, keyset, args, kwargs):
        positional = len(args) > position
        given_dtype = args[position] if positional else kwargs.get("dtype")
        if given_dtype is None and args and eligible(args[0], ctx.device_type):
            if positional:
                args = (*args[:position], _float32, *args[position + 1:])
            else:
                kwargs = {**kwargs, "dtype": _float32}
        return run_without_autocast(op, args, kwargs)

    return handler


def fp32_append_dtype(with_dtype, names: tuple[str, ...], defaults: tuple):
    """Native's fp32_append_dtype wrapper for an overload without a dtype argument whose
    sibling ``with_dtype`` takes one (``norm.Scalar`` -> ``norm.ScalarOpt_dtype``): the
    sibling is called with the same arguments and ``dtype`` float32 (the first argument's
    own dtype when it is not eligible). ``names``/``defaults``: the overload's arguments
    and their defaults, filled in where the call left them out."""

    def handler(ctx, st, op, keyset, args, kwargs):
        full = list(args) + [kwargs.get(name, default) for name, default in zip(names[len(args):], defaults[len(args):])]
        first = args[0]
        dtype = _float32 if eligible(first, ctx.device_type) else first.dtype
        return run_without_autocast(with_dtype, full, {"dtype": dtype})

    return handler


_torch_compat.keep_out_of_dynamo(globals(), __name__)
