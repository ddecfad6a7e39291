"""How the arguments of one call are cast: native autocast's rules, in Python.

Only floating tensors of the context's device are cast, float64 never; lower-precision
casts of float32 leaves that require grad (weights) are cached for the outermost region,
as native caches them; promote looks inside list arguments. ``cast_arguments`` applies
one ``CastKind``; the levels in ``_engine.py`` decide which.
"""

from __future__ import annotations

import torch

from . import _torch_compat
from ._state import DeviceContext, ThreadState
from .op_tables import BANNED, FP8, FP32, FP32_UNLESS_DTYPE, LOWER, PROMOTE, CastKind

_Tensor = torch.Tensor
_float32 = torch.float32
_float64 = torch.float64
_grad_enabled = torch.is_grad_enabled
_enable_grad = torch.enable_grad
_inference_mode_on = torch.is_inference_mode_enabled
_is_view = _torch_compat.tensor_is_view


def first_tensor(args, kwargs):
    """The first tensor among the arguments (one level inside lists), or None."""
    return next(iter_tensors(args, kwargs), None)


def context_for(st: ThreadState, args, kwargs) -> DeviceContext | None:
    """The context governing an op when several device types have one open."""
    t = first_tensor(args, kwargs)
    if t is None:
        return None
    device_type = t.device.type
    for ctx in st.active:
        if ctx.device_type == device_type:
            return ctx
    return None


# Tensor.float()/.half()/.bfloat16() parse their arguments faster than .to(dtype) and
# record the same cast for autograd.
_CAST_METHODS = {
    torch.float32: _Tensor.float,
    torch.float16: _Tensor.half,
    torch.bfloat16: _Tensor.bfloat16,
}


def cast_one(t: _Tensor, dtype: torch.dtype, ctx: DeviceContext, st: ThreadState):
    # Native rule: only floating tensors of the context's device, never float64.
    t_dtype = t.dtype
    if t_dtype is dtype or t_dtype is _float64 or not t.is_floating_point() or not ctx.on_device(t):
        return t
    to = _CAST_METHODS.get(dtype)
    # Native caches lower-precision casts of fp32 leaves that require grad (weights), and
    # makes each such cast with grad mode on, so one cached cast serves no_grad and grad
    # mode alike and has requires_grad=True in both (matmul's path choice reads it).
    # Inference tensors have no version counter, and a cast made under inference_mode is
    # one: neither is cached (native does not reuse those either).
    if (
        ctx.cache_enabled
        and t.requires_grad
        and t_dtype is _float32
        and dtype is ctx.dtype
        and t.is_leaf
        and not _is_view(t)
        and not t.is_inference()
        and not _inference_mode_on()
    ):
        key = (id(t), dtype)
        hit = st.cache.get(key)
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        if _grad_enabled():  # the common case: no context manager to pay for
            out = to(t) if to is not None else t.to(dtype)
        else:
            with _enable_grad():
                out = to(t) if to is not None else t.to(dtype)
        st.cache[key] = (t, t._version, out)
        return out
    return to(t) if to is not None else t.to(dtype)


def map_tensors(args, dtype, ctx, st):
    """Casts the tensors in args, looking one level inside lists and tuples."""
    out = None
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            b = cast_one(a, dtype, ctx, st)
        elif isinstance(a, (list, tuple)) and a and any(isinstance(x, _Tensor) for x in a):
            b = type(a)(cast_one(x, dtype, ctx, st) if isinstance(x, _Tensor) else x for x in a)
        else:
            continue
        if b is not a:
            if out is None:
                out = list(args)
            out[i] = b
    return args if out is None else tuple(out)


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


def promote_dtype(low: torch.dtype, device_type: str, args, kwargs) -> torch.dtype:
    """Widest floating dtype among ``low`` and the inputs on ``device_type``; float64 is
    left out."""
    widest = low
    for t in iter_tensors(args, kwargs):
        d = t.dtype
        if d is widest or d is _float64 or not t.is_floating_point():
            continue
        if t.device.type != device_type:
            continue
        widest = torch.promote_types(widest, d)
    return widest


def target_dtype(kind: CastKind, low: torch.dtype, device_type: str, args, kwargs) -> torch.dtype | None:
    """The dtype ``kind`` casts a call's floating inputs to (None: run as given), with
    ``low`` the region's lower precision. Eager casting and the tracing path both ask
    this; BANNED is the caller's to refuse."""
    if kind is LOWER or kind is FP8:
        # fp8 calls the fp8 path does not take (ineligible shapes, the aten level, calls
        # made inside C++ kernels) run in the region's dtype.
        return low
    if kind is FP32:
        return _float32
    if kind is FP32_UNLESS_DTYPE:
        # An explicit dtype argument already says how to accumulate: run as given.
        if (kwargs and kwargs.get("dtype") is not None) or any(isinstance(a, torch.dtype) for a in args):
            return None
        return _float32
    if kind is PROMOTE:
        return promote_dtype(low, device_type, args, kwargs)
    raise AssertionError(f"not a casting CastKind member: {kind!r}")  # pragma: no cover


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


# The fp32-unless-dtype functions whose every Python form takes ``dtype=`` as a keyword.
# (``norm``'s raw overloads do not: ``_VF.norm(x, p, dim)`` has no dtype form without
# ``keepdim``; it keeps the cast, which matched native's bits on an H100.)
_TAKE_DTYPE = frozenset({"softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum",
                         "linalg_vector_norm", "vector_norm", "linalg_matrix_norm", "matrix_norm"})


def float32_dtype_kwargs(func, device_type: str, args, kwargs):
    """The keyword arguments of an fp32-unless-dtype call made as native makes it, or None.

    Native autocast does not cast the input of these ops (softmax, sums, norms): when the
    first argument is an eligible floating tensor and no dtype is given, it calls the op
    with ``dtype=torch.float32``, so the op's own dtype path runs, backward included (for
    ``linalg_vector_norm`` that gradient differs in the last bit from a cast's, measured on
    an H100). Aten overloads (the aten level, ``_softmax``), ``norm`` and calls with
    ``out=`` keep the cast. None: not such a call here, cast as ``target_dtype`` says.
    """
    if getattr(func, "__name__", None) not in _TAKE_DTYPE or isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    if kwargs.get("out") is not None:
        return None
    first = first_tensor(args, kwargs)
    if first is None or not first.is_floating_point() or first.dtype is _float64 or first.device.type != device_type:
        return kwargs  # not eligible: native runs it as given
    return {**kwargs, "dtype": _float32}


def cast_arguments(kind: CastKind, ctx: DeviceContext, args, kwargs, st: ThreadState, func):
    """Returns (args, kwargs) cast per ``kind``; raises for banned ops."""
    if kind is BANNED:
        raise RuntimeError(banned_message(op_name(func)))
    dtype = target_dtype(kind, ctx.dtype, ctx.device_type, args, kwargs)
    if dtype is None:
        return args, kwargs
    if kind is FP32_UNLESS_DTYPE:
        with_dtype = float32_dtype_kwargs(func, ctx.device_type, args, kwargs)
        if with_dtype is not None:
            return args, with_dtype
    args = map_tensors(args, dtype, ctx, st)
    if kwargs:
        values = tuple(kwargs.values())
        new_values = map_tensors(values, dtype, ctx, st)
        if new_values is not values:
            kwargs = dict(zip(kwargs.keys(), new_values))
    return args, kwargs


def op_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
