"""The function level's handler while Dynamo traces: what it does becomes graph.

Dynamo inlines ``__torch_function__`` for every call it traces under our mode (see "Note:
torch.compile" in ``_engine.py``). Under built-in policies nothing is done: torch's
autocast state is ours and AOTAutograd records native's casts, which are ours. Under a
policy of our own the casts are made here, as tensor casts in the graph, and the call
runs inside ``torch.autocast(enabled=False)`` for our devices, so native's table adds
nothing.
"""

from __future__ import annotations

import types
import warnings

import torch
from torch.overrides import TorchFunctionMode

from . import _torch_compat
from ._casting import banned_message, first_tensor, float32_dtype_kwargs, op_name, target_dtype
from ._routing import EXPAND, GETTER, clone_without_dispatch_check
from ._state import STATE, DeviceContext, native_nesting
from .composites import DECOMPOSITIONS, NOT_HANDLED
from .op_tables import BANNED, FP32_UNLESS_DTYPE, CastKind
from .fp8 import fp8_linear
from .fp8._eligibility import fp8_eligible, linear_arguments
from .warning_types import AmpNumericsWarning


_Tensor = torch.Tensor
_float64 = torch.float64
_TRACE_TOKENS: dict = {}
# One token per fp8 recipe object seen (recipes are mutable: identity is what counts).
_FP8_TOKENS: dict = {}


def trace_key_for(active: tuple[DeviceContext, ...]) -> str | None:
    """What tracing depends on besides torch's autocast state: the policies of our own in
    force, one token per distinct policy (None: built-in policies only)."""
    parts = [
        f"{ctx.device_type}:{_TRACE_TOKENS.setdefault(ctx.policy, len(_TRACE_TOKENS))}"
        + ("" if ctx.fp8 is None else f":fp8-{_FP8_TOKENS.setdefault(id(ctx.fp8), len(_FP8_TOKENS))}")
        for ctx in active
        if ctx.custom
    ]
    return ";".join(parts) if parts else None


# How the tracing path handles one call; trace_plan returns (action, detail, devices), where
# a "cast" action's detail is (the CastKind's value, the region's lower precision): Dynamo
# takes strings and dtypes back from assume_constant_result, and reads the member from
# _KINDS, where it can guard it.
_KINDS = {kind.value: kind for kind in CastKind}
_PASS = ("pass", None, ())


def trace_plan(trace_key: str, func, device_type: str | None):
    """How to trace ``func`` under the contexts in force (run by Dynamo at trace time, its
    result baked into the graph; ``trace_key`` is what Dynamo guards on)."""
    st = STATE
    ctx = st.primary
    if ctx is None:
        ctx = next((c for c in st.active if c.device_type == device_type), None)
    if ctx is None or not ctx.custom or native_nesting() > st.native_depth:
        return _PASS
    kind = ctx.routes.function_route(func)
    devices = st.native_devices
    if kind is GETTER:
        return _PASS
    if kind is None:
        if not torch.is_grad_enabled():
            _warn_inference_trace(ctx)
        return ("aside", None, devices)
    if kind is EXPAND:
        return ("expand", _clone_name(func), devices)
    if kind.__class__ is not CastKind:
        # By name: the traced code looks the function up in DECOMPOSITIONS, a global Dynamo
        # can guard on (a function carried in this constant result has no source to guard).
        return ("decompose", next(name for name, f in DECOMPOSITIONS.items() if f is kind), devices)
    if kind is BANNED:
        return ("banned", banned_message(op_name(func)), devices)
    return ("cast", (kind.value, ctx.dtype), devices)


_WARNED_INFERENCE_TRACE: set = set()


def _warn_inference_trace(ctx: DeviceContext) -> None:
    """Once per policy: compiled inference cannot apply the aten level's casts."""
    if ctx.policy in _WARNED_INFERENCE_TRACE:
        return
    _WARNED_INFERENCE_TRACE.add(ctx.policy)
    warnings.warn(
        f"torch.compile under no_grad/inference_mode with policy {ctx.policy.name!r}: the "
        f"compiled graph applies the policy to the calls it traces (F.linear, torch.mm, "
        f"F.layer_norm, ...) but not to the ops that C++ composites such as "
        f"F.pairwise_distance run inside themselves, which eager dispatch_amp casts with its "
        f"aten level; such ops may give other dtypes than the same code run eagerly. Under a "
        f"built-in policy (Policy.for_device) compiled inference matches native exactly.",
        AmpNumericsWarning,
        stacklevel=2,
    )


def trace_call(mode: TorchFunctionMode, func, args, kwargs):
    """The function level's handler while Dynamo traces (its code becomes graph)."""
    trace_key = mode.trace_key
    if trace_key is None:
        return func(*args, **kwargs)
    first = first_tensor(args, kwargs)
    device_type = None if first is None else first.device.type
    action, detail, devices = _trace_plan_constant(trace_key, func, device_type)
    if action == "pass":
        return func(*args, **kwargs)
    if action == "expand":
        with mode:
            return getattr(_TRACED_CLONES, detail)(*args, **kwargs)
    if action == "decompose":
        with mode:
            out = DECOMPOSITIONS[detail](*args, **kwargs)
        return func(*args, **kwargs) if out is NOT_HANDLED else out
    if action == "banned":
        raise RuntimeError(detail)
    if action == "cast" and detail[0] == "fp8":
        traced = _trace_fp8(mode, args, kwargs, device_type, detail[1], devices)
        if traced is not NOT_HANDLED:
            return traced
        detail = ("lower", detail[1])  # not taken by the fp8 path: the region's dtype
    if action == "cast" and not (kwargs and kwargs.get("out") is not None):
        kind = _KINDS[detail[0]]
        dtype = target_dtype(kind, detail[1], device_type, args, kwargs)
        with_dtype = None if dtype is None or kind is not FP32_UNLESS_DTYPE else float32_dtype_kwargs(func, device_type, args, kwargs)
        if with_dtype is not None:
            kwargs = with_dtype
        elif dtype is not None:
            args = _trace_cast(args, dtype, device_type)
            kwargs = {k: _trace_cast((v,), dtype, device_type)[0] for k, v in kwargs.items()}
    return _call_native_off(devices, func, args, kwargs)


def _trace_fp8(mode, args, kwargs, device_type, dtype, devices):
    """An fp8 call while Dynamo traces: the fp8 gemms in the graph, or NOT_HANDLED."""
    recipe = mode.fp8_recipe
    x, weight, bias = linear_arguments(args, kwargs)
    if recipe is None or not fp8_eligible(recipe, device_type, x, weight, bias):
        return NOT_HANDLED
    # The weight carries its site (fp8/recipes.py): the graph updates its statistics,
    # and delayed scaling's history, in place.
    site = recipe._lookup(weight)
    if site is None and recipe.stateful:
        _refuse_unbound_site(type(recipe).__name__)
    return _call_native_off(devices, fp8_linear, (x, weight, bias, recipe, dtype, site), {})


@_torch_compat.assume_constant_result
def _refuse_unbound_site(recipe_name: str) -> bool:
    # Runs while Dynamo traces: the error reaches the caller of the compiled function.
    raise RuntimeError(
        f"{recipe_name} under torch.compile met a weight it has no site for: a compiled graph "
        f"cannot create one. Call recipe.bind(model) before the first compiled call (or run "
        f"one step eagerly first)."
    )


def _trace_cast(args, dtype, device_type):
    """``map_tensors`` for tracing: the same rule, no weight-cast cache (the graph
    casts each weight once per call, as compiled native autocast does)."""

    def cast(t):
        if (
            isinstance(t, _Tensor)
            and t.is_floating_point()
            and t.dtype != dtype
            and t.dtype != _float64
            and t.device.type == device_type
        ):
            return t.to(dtype)
        return t

    return tuple(
        type(a)(cast(x) for x in a) if isinstance(a, (list, tuple)) else cast(a) for a in args
    )


def _call_native_off(devices, func, args, kwargs):
    if not devices:
        return func(*args, **kwargs)
    with torch.autocast(devices[0], enabled=False):
        return _call_native_off(devices[1:], func, args, kwargs)


_trace_plan_constant = _torch_compat.assume_constant_result(trace_plan)
# Clones of expanded composites, by name: Dynamo guards a function it reads as an
# attribute of a known object, not one handed back by trace_plan.
_TRACED_CLONES = types.SimpleNamespace()


def _clone_name(func) -> str:
    clone = clone_without_dispatch_check(func)
    name = f"clone_{id(clone)}"
    setattr(_TRACED_CLONES, name, clone)
    return name


_torch_compat.keep_out_of_dynamo(globals(), __name__)
