"""How the arguments of one call are cast: native autocast's rules, in Python.

Only floating tensors of the context's device are cast, float64 never; lower-precision
casts of float32 leaves that require grad (weights) are cached, as native caches them
(``cast_one``); promote looks inside list arguments. The handlers of ``_handlers.py`` (and
the cuDNN RNN handler) apply these per cast kind.

Arguments are cast in native's order (``arg_order``): native casts them all inside one
C++ call expression, whose evaluation order its compiler chose (last argument first in
GCC builds, torch's Linux wheels), and a list argument's elements first to last. The
order is not numerics (each cast is the same either way) but it is what a dispatch mode
sees and what torch.compile captures: the same order gives the same graphs as native's,
so compiled code and its caches are shared with native's.

Functions here take the region's context and thread state as plain objects (duck typed):
``ctx.dtype`` and ``ctx.on_device``; the cache itself is ``_cast_cache.py``.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from . import _cast_cache

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_float32 = torch.float32
_float64 = torch.float64
_inference_mode_on = torch.is_inference_mode_enabled
_cache_on = torch.is_autocast_cache_enabled
_is_view = _torch_compat.tensor_is_view
_is_cached_tensor = _torch_compat.is_cached_tensor
_LAST_FIRST = _torch_compat.CASTS_LAST_ARGUMENT_FIRST


def _positions(n: int) -> tuple[int, ...]:
    return tuple(range(n - 1, -1, -1)) if _LAST_FIRST else tuple(range(n))


# arg_order(n) for the argument counts ops have, looked up by the handlers' hot path.
ORDERS = tuple(_positions(n) for n in range(64))


def arg_order(n: int) -> tuple[int, ...]:
    """The positions of ``n`` positional arguments in the order native casts them.

    Keyword arguments (an op's keyword-only ones, after every positional one in its
    schema) come before the positional ones when native casts the last argument first
    (``cast_arguments``).
    """
    return ORDERS[n] if n < 64 else _positions(n)


def first_tensor(args, kwargs):
    """The first tensor among the arguments (one level inside lists), or None."""
    return next(iter_tensors(args, kwargs), None)


def context_for(active, args, kwargs):
    """The context (of ``active``) governing an op when several device types have one
    open: the one of the first tensor's device type, or None."""
    t = first_tensor(args, kwargs)
    if t is None:
        return None
    device_type = t.device.type
    for ctx in active:
        if ctx.device_type == device_type:
            return ctx
    return None


# Tensor.float()/.half()/.bfloat16() parse their arguments faster than .to(dtype) and
# record the same cast for autograd.
CAST_METHODS = {
    torch.float32: _Tensor.float,
    torch.float16: _Tensor.half,
    torch.bfloat16: _Tensor.bfloat16,
}


def cast_one(t: _Tensor, dtype: torch.dtype, ctx, st):
    """``t`` cast to ``dtype`` if native autocast would cast it, else ``t`` itself."""
    # Native rule: only floating tensors of the context's device, never float64.
    t_dtype = t.dtype
    if t_dtype is dtype or t_dtype is _float64 or not t.is_floating_point() or not ctx.on_device(t):
        return t
    to = CAST_METHODS.get(dtype)
    # Native caches lower-precision casts of fp32 leaves that require grad (weights), and
    # makes each such cast with grad mode on, so one cached cast serves no_grad and grad
    # mode alike and has requires_grad=True in both (matmul's path choice reads it).
    # Inference tensors have no version counter, and a cast made under inference_mode is
    # one: neither is cached (native does not reuse those either). Only plain tensors:
    # while torch.compile traces, the arguments are fake or functional tensors (and
    # make_fx switches torch's cache flag off, which is read here as native reads it).
    # Nor a tensor torch keeps itself (CUDA graph trees register the tensors their
    # graphs own with torch._C._add_cached_tensor; native's cache leaves them out too).
    if (
        t.requires_grad
        and t.is_leaf
        and t_dtype is _float32
        and dtype is ctx.dtype
        and (t.__class__ is _Parameter or t.__class__ is _Tensor)
        and not _is_view(t)
        and not t.is_inference()
        and not _inference_mode_on()
        and _cache_on()
        and not _is_cached_tensor(t)
    ):
        return _cast_cache.lookup(t, dtype, to)
    return to(t) if to is not None else t.to(dtype)


def holds_tensors(seq) -> bool:
    """Whether a list argument may hold tensors. An op's schema types each list: ints,
    floats or bools (a convolution's stride) never hold one, and ``Tensor[]``/``Tensor?[]``
    hold only tensors and None, so the first element tells."""
    return bool(seq) and (seq[0] is None or isinstance(seq[0], _Tensor))


def map_tensors(args, dtype, ctx, st):
    """Casts the tensors in args, looking one level inside lists and tuples, in native's
    order (``arg_order``)."""
    out = None
    n = len(args)
    for i in ORDERS[n] if n < 64 else arg_order(n):
        a = args[i]
        if isinstance(a, _Tensor):
            b = cast_one(a, dtype, ctx, st)
        elif isinstance(a, (list, tuple)) and holds_tensors(a):
            b = type(a)(cast_one(x, dtype, ctx, st) if isinstance(x, _Tensor) else x for x in a)
        else:
            continue
        if b is not a:
            if out is None:
                out = list(args)
            out[i] = b
    return args if out is None else tuple(out)


def map_kwargs(kwargs, dtype, ctx, st):
    """``map_tensors`` for keyword arguments (returns ``kwargs`` itself when nothing changed)."""
    if not kwargs:
        return kwargs
    values = tuple(kwargs.values())
    new_values = map_tensors(values, dtype, ctx, st)
    return kwargs if new_values is values else dict(zip(kwargs.keys(), new_values))


def cast_arguments(args, kwargs, dtype, ctx, st):
    """``(args, kwargs)`` with their tensors cast (``map_tensors``), in native's order:
    an op's keyword-only arguments follow its positional ones in its schema, so they are
    cast first where native casts the last argument first."""
    if not kwargs:
        return map_tensors(args, dtype, ctx, st), kwargs
    if _LAST_FIRST:
        kwargs = map_kwargs(kwargs, dtype, ctx, st)
        return map_tensors(args, dtype, ctx, st), kwargs
    args = map_tensors(args, dtype, ctx, st)
    return args, map_kwargs(kwargs, dtype, ctx, st)


def iter_tensors(args, kwargs):
    """The tensors among the arguments, looking one level inside lists and tuples."""
    for group in (args, kwargs.values()) if kwargs else (args,):
        for a in group:
            if isinstance(a, _Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _Tensor):
                        yield b


def promote_dtype(low: torch.dtype, device_type: str, args, kwargs, op=None) -> torch.dtype:
    """Native's promote rule (``prioritize`` in ATen's autocast): float32 if any eligible
    input is float32, else ``low``; float64 inputs are left out. An eligible input of
    another floating dtype (float16 in a bfloat16 region, a float8 tensor) raises, as
    native does (naming ``op``, an aten overload, when given). No aten call: the dtypes are
    compared in Python."""
    widest = low
    for t in iter_tensors(args, kwargs):
        d = t.dtype
        if d is widest or d is _float64 or not t.is_floating_point() or t.device.type != device_type:
            continue
        if d is _float32 or widest is _float32:
            widest = _float32
        else:
            raise RuntimeError(
                f"{op._schema.name if op is not None else 'this op'} under autocast: its inputs mix {low} and {d}; autocast promotes "
                f"among the region's dtype ({low}) and float32 only (native autocast raises "
                f"here too, 'Unexpected floating ScalarType'). Cast the {d} input to {low} "
                f"or float32 before the call."
            )
    return widest


def eligible(t, device_type: str) -> bool:
    """Native's test for an argument autocast may cast: a floating tensor of the region's
    device type, not float64."""
    return (
        isinstance(t, _Tensor) and t.is_floating_point() and t.dtype is not _float64
        and t.device.type == device_type
    )


_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
    "their input is usually the output of a sigmoid, and in 16-bit precision the log of "
    "a value rounded to 0 or 1 overflows. Use torch.nn.functional."
    "binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which fuse the sigmoid "
    "and are safe to autocast; or run this op with the policy's 'banned' entry removed "
    "(Policy.without_ops('binary_cross_entropy')) or outside autocast, on float32 inputs."
)


def banned_message(name: str) -> str:
    if "binary_cross_entropy" in name:
        return _BCE_MESSAGE
    return (
        f"{name} is banned under this autocast policy; run it outside autocast or derive "
        f"a policy without it (Policy.without_ops({name!r}))"
    )


def op_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
