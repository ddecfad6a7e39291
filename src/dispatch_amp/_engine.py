"""The casting engine behind ``autocast``: per-thread state, two interception levels.

Note: cast where native casts
-----------------------------
Native autocast decides above autograd, at composite ops before they decompose and at
primitive aten ops, so autograd records the casts and saves the low-precision copies.
A ``TorchDispatchMode`` alone sits below autograd and after decomposition, and cannot do
that: autograd would record nothing of its casts. So the engine has two levels that read
one ``Policy``:

- ``_FunctionLevel`` (a ``TorchFunctionMode``, above autograd) casts every call whose
  aten name is in the policy: ``F.linear``, ``torch.mm``, ``F.cross_entropy`` whole.
  Python composites from torch (``F.multi_head_attention_forward``, ``F.interpolate``)
  are run with the level still active so the calls inside them are seen too.
- ``_AtenLevel`` (a ``TorchDispatchMode``, below autograd) sees every aten op after
  decomposition. It applies the policy where that is safe without autograd's help, i.e.
  when autograd records nothing for the op (``no_grad``, ``inference_mode``, inputs that
  need no grad) and the op is not already inside one cast by the function level (native
  excludes autocast inside an op it handled). For ops outside the tables it is one dict
  lookup and a call. It is needed only under a policy of our own: under a built-in
  policy native autocast casts those ops (next note), so the level is not installed.
  It is on torch's dispatch stack only while a call it covers runs (``_call_aside``):
  a call the function level lets through uncast while grad mode is off.

The function level is installed once per thread by the outermost enabled ``autocast``,
the aten level by the outermost one whose policy is not built in; both read the
innermost context from ``STATE``; nested contexts only push and pop frames.

Note: torch sees our state as native state
------------------------------------------
Code written for torch asks torch, not us, whether autocast is on
(``torch.is_autocast_enabled``, ``torch.get_autocast_dtype``, ``custom_fwd``,
``torch.utils.checkpoint``, nn modules' fast paths, library float32 islands). So entering
``autocast`` sets torch's own thread-local autocast state exactly as ``torch.autocast``
would (enabled, dtype, cache flag, nesting counter) and exiting restores it. In torch that
state *is* the switch of native casting (the Autocast dispatch key is on while enabled),
so native autocast casts too, with its own table, wherever it sees an op:

- Under a built-in policy (``Policy.for_device(device_type)``, native's own table) that
  is harmless, and needed. The function level casts every call in the table before
  native sees it (a tensor already in the right dtype is not cast again), and native
  casts what no Python level can see: ops that C++ kernels call inside other ops.
- Under any other policy native's table would contradict ours, so every call the
  function level lets through runs with native autocast switched off for that device
  type (``_call_aside``, ``_lower``), and switched back on before Python code outside the
  call runs again. Ops called from inside C++ kernels then follow our aten level (under
  ``no_grad``) or run as given.

A native ``torch.autocast`` region opened inside ours raises torch's nesting counter
above the value our innermost context recorded; there native rules and both levels
stand aside, which gives native's rule for any nesting order: the innermost context wins.

Note: torch.compile
-------------------
Dynamo traces a ``TorchFunctionMode`` on the stack by inlining its ``__torch_function__``
(what that code does to tensors becomes graph), and refuses to trace at all while a
(non-infra) ``TorchDispatchMode`` is on the stack; a frame it skipped for that reason
stays skipped for the rest of the process. So the aten level is never on the stack
between calls, only inside a call it covers, and the function level has a tracing path
(``_trace_call``):

- Under built-in policies it calls the op as given: torch's autocast state is ours
  (previous note), so AOTAutograd records native's casts in the graph, and native's
  table is the policy. The graph is the one ``torch.autocast`` would give.
- Under a policy of our own it casts the arguments with tensor casts that become graph
  nodes, and runs the call inside ``torch.autocast(device, enabled=False)`` (graph nodes
  too) so native's table adds nothing: the casts eager dispatch_amp makes. How to cast a
  call is decided once, at trace time, by reading our thread state
  (``_trace_plan``, run through Dynamo's ``assume_constant_result``). AOTAutograd traces
  the backward under the forward's ambient autocast unless told otherwise; under a
  policy of our own that would apply native's table to the backward, so our region
  switches that off (``torch._functorch.config.backward_pass_autocast``) while it is
  open: eagerly, the backward runs outside the region.
- Guards: Dynamo guards on torch's autocast state (enabled, dtype per device) and on the
  mode stack; the function level's ``trace_key`` names the policies of our own in force,
  and Dynamo guards on it because the tracing path reads it. A graph is reused only
  under the same dtype, enabled state and policies. One function level object per
  thread keeps the mode-stack guard stable from region to region. Not guarded: a native
  region with the same dtype and enabled state opened inside ours *outside* the compiled
  function (torch gives its nesting counter no guard); a graph traced without it is
  reused inside it.
- While a compiled graph runs, torch excludes the Autocast dispatch key (the casts are
  in the graph), but the graph's Python-level calls (aot_eager's aten ops, inductor's
  extern kernels) still reach our function level: under a policy of our own it runs
  them as given when it finds the key excluded.
- Not in the graph: under ``no_grad`` a policy of our own also casts ops that C++
  composites call inside themselves (the aten level); Dynamo sees only the calls, so
  compiled inference under such a policy warns once per policy.
- A region entered inside a compiled function: under a built-in policy
  ``autocast.__enter__``/``__exit__`` trace as torch.autocast's own enter and exit (the
  region is native autocast with the same dtype). Under a policy of our own the engine's
  thread state and mode stacks are bookkeeping, not graph: entering is a graph break
  (a ``torch.compiler.disable``'d call), Dynamo cannot resume inside a ``with`` of a
  context manager it does not know, so the function runs eagerly, and ``autocast``
  warns once per compiled function (``CompileFallbackWarning``).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload as _OpOverload
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _torch_compat
from .composites import NOT_HANDLED
from .op_tables import BANNED, FP32, FP32_UNLESS_DTYPE, LOWER, PROMOTE, CastKind
from ._routing import EXPAND, GETTER, Routes, is_torch_python_function, routes_for
from .policy import Policy

_Tensor = torch.Tensor

# Note: Dynamo and our frames
# Dynamo stays armed for every frame that runs eagerly below a compiled function (after a
# graph break). Frames of ours must not be compiled: every function of this module is
# marked as skipped (_keep_out_of_dynamo). Frames that run while the aten level is on the
# dispatch stack must not reach Dynamo either: it would skip them for good (see "Note:
# torch.compile"). So the function level disarms Dynamo's frame hook around its calls
# and the aten level around its handler (two C calls, what torch._dynamo.disable does),
# which also replaces torch's heavier default shim around __torch_dispatch__.
_set_eval_frame = _torch_compat.set_eval_frame
_skip_code = _torch_compat.skip_code
# A partial is called from C: cheaper than a lambda on a path that runs for every cast op.
_disarm_dynamo = functools.partial(_set_eval_frame, None)
_rearm_dynamo = _set_eval_frame
_float32 = torch.float32
# True only while Dynamo traces (it folds the call to a constant); one trivial Python call
# eagerly, where torch.compiler.is_compiling makes two.
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
# torch hands handlers kwargs=None or {}; calling with **{} costs what calling without
# costs, so every call site passes kwargs through as this. Never mutated.
_NO_KWARGS: dict = {}
_enable_grad = torch.enable_grad
_inference_mode_on = torch.is_inference_mode_enabled
_is_view = _torch_compat.tensor_is_view
_float64 = torch.float64
_functorch_config = torch._functorch.config


@dataclass(frozen=True)
class DeviceContext:
    """What one ``autocast`` says for one device type."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    policy: Policy
    cache_enabled: bool
    # t -> whether t lives on this device type; resolved once, used for every tensor cast.
    on_device: Callable[[torch.Tensor], bool] = field(init=False, repr=False, compare=False)
    # Whether the policy is not native autocast's table for this device type.
    custom: bool = field(init=False, repr=False, compare=False)
    # How the engine handles each call under the policy (see _routing.py).
    routes: Routes = field(init=False, repr=False, compare=False)
    # Native autocast's dispatch key for this device type (None for one torch lacks).
    autocast_key: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        test = _DEVICE_TESTS.get(self.device_type)
        device_type = self.device_type
        object.__setattr__(self, "on_device", test if test is not None else (lambda t: t.device.type == device_type))
        native = Policy.for_device(device_type)
        object.__setattr__(self, "custom", self.policy is not native and self.policy != native)
        object.__setattr__(self, "routes", routes_for(self.policy))
        object.__setattr__(self, "autocast_key", _torch_compat.AUTOCAST_KEYS.get(device_type))


class _ThreadState(threading.local):
    def __init__(self):
        # frames[i] maps device type -> DeviceContext; the last frame is in force.
        self.frames: list[dict[str, DeviceContext]] = []
        # depths[i]: torch's autocast nesting counter right after frame i was entered.
        self.depths: list[int] = []
        # Enabled contexts of the innermost frame; `primary` is set when there is exactly
        # one (the common case), so the hot path needs no device lookup.
        self.active: tuple[DeviceContext, ...] = ()
        self.primary: DeviceContext | None = None
        # Device types of `active` whose policy is not native's: native autocast is
        # switched off for them around calls (see "Note: torch sees our state...").
        self.native_devices: tuple[str, ...] = ()
        # depths[-1]: a deeper nesting counter means a native region inside our innermost.
        self.native_depth: int = -1
        # The installed levels (None: not installed) and the frame index that installed
        # each. The function level is installed (on torch's function-mode stack) by the
        # outermost enabled region. The aten level is installed only by a region with a
        # policy of its own (see "Note: torch sees our state as native state": under a
        # built-in policy native autocast casts what the aten level would); it goes on
        # the dispatch stack only around the calls where it has work (_call_aside). One
        # function level object per thread, pushed again each time, so torch.compile sees
        # the same mode on the stack from region to region.
        self.function_level: _FunctionLevel | None = None
        self.function_installer: int = -1
        self.aten_level: _AtenLevel | None = None
        self.aten_installer: int = -1
        self.function_mode: _FunctionLevel | None = None  # made on first use
        # Weight-cast cache: (id(src), dtype) -> (src, src._version, cast).
        self.cache: dict = {}
        # Python composites currently being expanded (guards against re-dispatch loops).
        self.expanding: set = set()
        # >0 while dispatch_amp.checkpoint runs its function: it recomputes under our state.
        self.own_checkpoint: int = 0


STATE = _ThreadState()


_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_set_native_enabled = torch.set_autocast_enabled


def _native_nesting() -> int:
    # torch exposes the nesting counter only through increment/decrement.
    _increment_nesting()
    return _decrement_nesting()


def _inside_native_region(st: _ThreadState) -> bool:
    return _native_nesting() > st.native_depth


# -- entering and leaving a context -----------------------------------------------------
@dataclass(frozen=True)
class NativeState:
    """torch's autocast state for one device type, as an entered context found it."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool
    # AOTAutograd's autocast for the backward it traces, when the context changed it (a
    # policy of our own, see "Note: torch.compile"); None otherwise.
    backward_autocast: object = None

    @classmethod
    def read(cls, device_type: str, backward_autocast: object = None) -> NativeState:
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
            backward_autocast,
        )


def enter(ctx: DeviceContext) -> NativeState:
    """Opens ``ctx`` on this thread; returns what :func:`leave` restores.

    torch's state is set as ``torch.autocast.__enter__`` sets it (see "Note: torch sees
    our state as native state"), then the frame is pushed.
    """
    backward_autocast = None
    if ctx.enabled and ctx.custom:  # a config read and write cost microseconds: only here
        backward_autocast = _functorch_config.backward_pass_autocast
        _functorch_config.backward_pass_autocast = "off"
    saved = NativeState.read(ctx.device_type, backward_autocast)
    _set_native_enabled(ctx.device_type, ctx.enabled)
    torch.set_autocast_dtype(ctx.device_type, ctx.dtype)
    depth = _increment_nesting()
    torch.set_autocast_cache_enabled(ctx.cache_enabled)
    frame = dict(current_frame())
    frame[ctx.device_type] = ctx
    try:
        _push_frame(frame, depth)
    except BaseException:
        _restore_native(saved)
        raise
    return saved


def leave(saved: NativeState) -> None:
    """Closes the innermost context opened by :func:`enter` on this thread."""
    try:
        _pop_frame()
    finally:
        _restore_native(saved)


def _restore_native(saved: NativeState) -> None:
    if _decrement_nesting() == 0:
        torch.clear_autocast_cache()
    _set_native_enabled(saved.device_type, saved.enabled)
    torch.set_autocast_dtype(saved.device_type, saved.dtype)
    torch.set_autocast_cache_enabled(saved.cache_enabled)
    if saved.backward_autocast is not None:
        _functorch_config.backward_pass_autocast = saved.backward_autocast


def _push_frame(frame: dict[str, DeviceContext], depth: int) -> None:
    st = STATE
    if st.function_mode is None:
        st.function_mode = _FunctionLevel()
    st.frames.append(frame)
    st.depths.append(depth)
    _refresh(st)
    index = len(st.frames) - 1
    try:
        if st.function_level is None and st.active:
            st.function_mode.__enter__()
            st.function_level, st.function_installer = st.function_mode, index
        if st.aten_level is None and st.native_devices:
            st.aten_level, st.aten_installer = _AtenLevel(), index
    except BaseException:
        _uninstall(st, index)
        st.frames.pop()
        st.depths.pop()
        _refresh(st)
        raise


def _pop_frame() -> None:
    st = STATE
    index = len(st.frames) - 1
    st.frames.pop()
    st.depths.pop()
    try:
        _uninstall(st, index)
    finally:
        _refresh(st)


def _uninstall(st: _ThreadState, index: int) -> None:
    """Takes off the levels that the region at frame ``index`` installed."""
    if st.aten_installer == index:
        st.aten_level, st.aten_installer = None, -1
    function_level = st.function_level if st.function_installer == index else None
    if function_level is not None:
        st.function_level, st.function_installer = None, -1
        st.cache.clear()
        function_level.__exit__(None, None, None)


def current_frame() -> dict[str, DeviceContext]:
    frames = STATE.frames
    return frames[-1] if frames else {}


def _refresh(st: _ThreadState) -> None:
    frame = st.frames[-1] if st.frames else {}
    st.active = tuple(ctx for ctx in frame.values() if ctx.enabled)
    st.primary = st.active[0] if len(st.active) == 1 else None
    st.native_devices = tuple(ctx.device_type for ctx in st.active if ctx.custom)
    st.native_depth = st.depths[-1] if st.depths else -1
    if st.function_mode is not None:
        st.function_mode.trace_key = _trace_key(st.active)


def clear_cache() -> None:
    STATE.cache.clear()


# -- casting ----------------------------------------------------------------------------
def _first_tensor(args, kwargs):
    for a in args:
        if isinstance(a, _Tensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Tensor):
                    return b
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, _Tensor):
                return a
    return None


def _context_for(st: _ThreadState, args, kwargs) -> DeviceContext | None:
    """The context governing an op when several device types have one open."""
    t = _first_tensor(args, kwargs)
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
# The cheap per-device test (t.is_cpu is several times faster than t.device.type).
_DEVICE_TESTS = {"cpu": _Tensor.is_cpu.__get__, "cuda": _Tensor.is_cuda.__get__}


def _cast_one(t: _Tensor, dtype: torch.dtype, ctx: DeviceContext, st: _ThreadState):
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


def _map_tensors(args, dtype, ctx, st):
    """Casts the tensors in args, looking one level inside lists and tuples."""
    out = None
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            b = _cast_one(a, dtype, ctx, st)
        elif isinstance(a, (list, tuple)) and a and any(isinstance(x, _Tensor) for x in a):
            b = type(a)(_cast_one(x, dtype, ctx, st) if isinstance(x, _Tensor) else x for x in a)
        else:
            continue
        if b is not a:
            if out is None:
                out = list(args)
            out[i] = b
    return args if out is None else tuple(out)


def _iter_tensors(args, kwargs):
    for a in args:
        if isinstance(a, _Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Tensor):
                    yield b
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, _Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _Tensor):
                        yield b


def _promote_dtype(ctx: DeviceContext, args, kwargs) -> torch.dtype:
    """Widest floating dtype among the context-device inputs; float64 is left out."""
    widest = ctx.dtype
    for t in _iter_tensors(args, kwargs):
        d = t.dtype
        if d is widest or d is _float64 or not t.is_floating_point():
            continue
        if t.device.type != ctx.device_type:
            continue
        widest = torch.promote_types(widest, d)
    return widest


_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
    "their input is usually the output of a sigmoid, and in 16-bit precision the log of "
    "a value rounded to 0 or 1 overflows. Use torch.nn.functional."
    "binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which fuse the sigmoid "
    "and are safe to autocast; or run this op with the policy's 'banned' entry removed "
    "(Policy.without_ops('binary_cross_entropy')) or outside autocast, on float32 inputs."
)


def _banned_message(name: str) -> str:
    if "binary_cross_entropy" in name:
        return _BCE_MESSAGE
    return (
        f"{name} is banned under this autocast policy; run it outside autocast or derive "
        f"a policy without it (Policy.without_ops({name!r}))"
    )


def cast_arguments(kind: CastKind, ctx: DeviceContext, args, kwargs, st: _ThreadState, func):
    """Returns (args, kwargs) cast per ``kind``; raises for banned ops."""
    if kind is LOWER:
        dtype = ctx.dtype
    elif kind is FP32:
        dtype = _float32
    elif kind is FP32_UNLESS_DTYPE:
        # An explicit dtype argument already says how to accumulate: run as given.
        if (kwargs and kwargs.get("dtype") is not None) or any(
            isinstance(a, torch.dtype) for a in args
        ):
            return args, kwargs
        dtype = _float32
    elif kind is PROMOTE:
        dtype = _promote_dtype(ctx, args, kwargs)
    elif kind is BANNED:
        raise RuntimeError(_banned_message(_op_name(func)))
    else:  # pragma: no cover - a policy's rules hold CastKind members only
        raise AssertionError(f"not a CastKind member: {kind!r}")
    args = _map_tensors(args, dtype, ctx, st)
    if kwargs:
        values = tuple(kwargs.values())
        new_values = _map_tensors(values, dtype, ctx, st)
        if new_values is not values:
            kwargs = dict(zip(kwargs.keys(), new_values))
    return args, kwargs


def _op_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


# -- the function level (above autograd) ------------------------------------------------
def _never(*args, **kwargs) -> bool:
    return False


_CLONES: dict = {}
_CLONING: set = set()


def _clone_without_dispatch_check(func: types.FunctionType) -> types.FunctionType:
    """A copy of a torch Python composite whose ``has_torch_function*`` checks say False.

    Torch's Python functions start with ``if has_torch_function(...): return
    handle_torch_function(...)``, which sends them to our mode instead of running their
    body. The copy shares the code and closure but reads those three names from a
    private globals dict, so its body runs with our mode active and every call inside it
    is seen. Nothing in torch is modified.
    """
    clone = _CLONES.get(func)
    if clone is None:
        scope = dict(func.__globals__)
        scope["has_torch_function"] = _never
        scope["has_torch_function_unary"] = _never
        scope["has_torch_function_variadic"] = _never
        closure = func.__closure__
        if closure:
            # Wrappers such as torch's boolean_dispatch (torch.lu, F.max_pool2d) hold the
            # real function in their closure; it checks again, so it is cloned too
            # (except a cell holding a function being cloned: wrappers refer to themselves).
            _CLONING.add(func)
            try:
                closure = tuple(
                    types.CellType(_clone_without_dispatch_check(cell.cell_contents))
                    if is_torch_python_function(cell.cell_contents)
                    and cell.cell_contents not in _CLONING
                    else cell
                    for cell in closure
                )
            finally:
                _CLONING.discard(func)
        clone = types.FunctionType(
            func.__code__, scope, func.__name__, func.__defaults__, closure
        )
        clone.__kwdefaults__ = func.__kwdefaults__
        _CLONES[func] = clone
    return clone


class _FunctionLevel(TorchFunctionMode):
    # What tracing depends on beyond torch's autocast state, which Dynamo guards itself:
    # the policies of our own in force (see "Note: torch.compile"). Dynamo guards on it
    # because the tracing path reads it.
    trace_key: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return _trace_call(self, func, args, kwargs or {})
        kwargs = kwargs or _NO_KWARGS
        st = STATE
        if func.__class__ is _OpOverload and not st.native_devices:
            # An aten overload called as such: the ops of a compiled graph, or torch.ops.
            # Under a built-in policy native autocast casts it in the dispatcher, as it
            # would without us (see "Note: torch sees our state as native state").
            return func(*args, **kwargs)
        ctx = st.primary
        if ctx is None:
            if not st.active:  # our innermost context is disabled, and so is native autocast
                return func(*args, **kwargs)
            ctx = _context_for(st, args, kwargs)
            if ctx is None:
                if _inside_native_region(st):
                    return func(*args, **kwargs)
                return _call_aside(st, func, args, kwargs)
        try:  # the routes' memo, read directly: this runs for every torch call
            kind = ctx.routes.function[func]
        except (KeyError, TypeError):
            kind = ctx.routes.function_route(func)
        if ctx.custom:
            if _key_excluded(ctx.autocast_key):
                # torch has switched autocast off below Python: a compiled graph is
                # running, its casts already in it (see "Note: torch.compile").
                return func(*args, **kwargs)
            if not st.own_checkpoint:
                _refuse_torch_checkpoint(ctx, func, kind)
        if kind is None:
            # Not cast. Under built-in policies native autocast stays on and there is
            # nothing else to do; otherwise native is switched off around the call, unless
            # a native region inside ours rules.
            if not st.native_devices or _inside_native_region(st):
                return func(*args, **kwargs)
            return _call_aside(st, func, args, kwargs)
        if kind is LOWER and not kwargs:
            return self._lower(st, ctx, func, args)
        if kind is GETTER:
            return func(*args, **kwargs)
        if kind is EXPAND:
            return self._expand(st, func, args, kwargs)
        if kind.__class__ is not CastKind:  # a decomposition (composites.py)
            return self._decompose(kind, func, args, kwargs)
        # Inside a native torch.autocast region (enabled or not) native rules.
        if _inside_native_region(st):
            return func(*args, **kwargs)
        # Python wrappers such as torch.tensordot forward out=None explicitly; a real out=
        # is never cast (native does not cast out= overloads either).
        if kwargs and kwargs.get("out") is not None:
            kind = None
        return _call_aside(st, func, args, kwargs, kind, ctx)

    @staticmethod
    def _lower(st, ctx, func, args):
        """The common cast (matmuls, convolutions, no kwargs): ``_call_aside``, inlined.

        Same steps (native-region check, casts, native autocast off around the call under
        a policy of our own), written out because on tiny ops every Python call shows
        (``python -m benchmarks --suite dispatch-overhead``, ``mm 8x8``).
        """
        _increment_nesting()
        if _decrement_nesting() > st.native_depth:
            return func(*args)
        dtype = ctx.dtype
        cast = []
        for a in args:
            # _cast_one's first test, inlined: most arguments need no cast at all
            # (already dtype, or not a tensor), and the rest go through it.
            if a.__class__ is _Tensor or isinstance(a, _Tensor):
                if a.dtype is not dtype:
                    a = _cast_one(a, dtype, ctx, st)
            elif isinstance(a, (list, tuple)):
                a = _map_tensors((a,), dtype, ctx, st)[0]
            cast.append(a)
        devices = st.native_devices
        if not devices:
            return func(*cast)
        for device in devices:
            _set_native_enabled(device, False)
        try:
            return func(*cast)
        finally:
            for device in devices:
                _set_native_enabled(device, True)

    def _decompose(self, decomposition, func, args, kwargs):
        with self:
            out = decomposition(*args, **kwargs)
        return func(*args, **kwargs) if out is NOT_HANDLED else out

    def _expand(self, st, func, args, kwargs):
        if func in st.expanding:
            # The clone's body reached handle_torch_function by another path: run the
            # original as the mode would without expansion, rather than loop.
            return func(*args, **kwargs)
        clone = _clone_without_dispatch_check(func)
        st.expanding.add(func)
        try:
            with self:
                return clone(*args, **kwargs)
        finally:
            st.expanding.discard(func)


# -- the function level while Dynamo traces ---------------------------------------------
# Dynamo inlines __torch_function__ for every call it traces under our mode (see "Note:
# torch.compile"); what it runs here becomes graph. Under built-in policies nothing is
# done: torch's autocast state is ours and AOTAutograd records native's casts, which are
# ours. Under a policy of our own the casts are made here, as tensor casts in the graph,
# and the call runs inside torch.autocast(enabled=False) for our devices, so native's
# table adds nothing.
_TRACE_TOKENS: dict = {}


def _trace_key(active: tuple[DeviceContext, ...]) -> str | None:
    """What tracing depends on besides torch's autocast state: the policies of our own in
    force, one token per distinct policy (None: built-in policies only)."""
    parts = [
        f"{ctx.device_type}:{_TRACE_TOKENS.setdefault(ctx.policy, len(_TRACE_TOKENS))}"
        for ctx in active
        if ctx.custom
    ]
    return ";".join(parts) if parts else None


# How the tracing path handles one call; _trace_plan returns (action, detail, devices).
_PASS = ("pass", None, ())


def _trace_plan(trace_key: str, func, device_type: str | None):
    """How to trace ``func`` under the contexts in force (run by Dynamo at trace time, its
    result baked into the graph; ``trace_key`` is what Dynamo guards on)."""
    st = STATE
    ctx = st.primary
    if ctx is None:
        ctx = next((c for c in st.active if c.device_type == device_type), None)
    if ctx is None or not ctx.custom or _native_nesting() > st.native_depth:
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
        return ("decompose", kind, devices)
    if kind is BANNED:
        return ("banned", _banned_message(_op_name(func)), devices)
    return (kind.value, ctx.dtype, devices)


_WARNED_INFERENCE_TRACE: set = set()


def _warn_inference_trace(ctx: DeviceContext) -> None:
    """Once per policy: compiled inference cannot apply the aten level's casts."""
    if ctx.policy in _WARNED_INFERENCE_TRACE:
        return
    _WARNED_INFERENCE_TRACE.add(ctx.policy)
    from .scaler_diagnostics import AmpNumericsWarning

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


def _trace_call(mode: _FunctionLevel, func, args, kwargs):
    """The function level's handler while Dynamo traces (its code becomes graph)."""
    trace_key = mode.trace_key
    if trace_key is None:
        return func(*args, **kwargs)
    first = _first_tensor(args, kwargs)
    device_type = None if first is None else first.device.type
    action, detail, devices = _trace_plan_constant(trace_key, func, device_type)
    if action == "pass":
        return func(*args, **kwargs)
    if action == "expand":
        with mode:
            return getattr(_TRACED_CLONES, detail)(*args, **kwargs)
    if action == "decompose":
        with mode:
            out = detail(*args, **kwargs)
        return func(*args, **kwargs) if out is NOT_HANDLED else out
    if action == "banned":
        raise RuntimeError(detail)
    if action != "aside" and not (kwargs and kwargs.get("out") is not None):
        dtype = _trace_cast_dtype(action, detail, device_type, args, kwargs)
        if dtype is not None:
            args = _trace_cast(args, dtype, device_type)
            kwargs = {k: _trace_cast((v,), dtype, device_type)[0] for k, v in kwargs.items()}
    return _call_native_off(devices, func, args, kwargs)


def _trace_cast_dtype(action, dtype, device_type, args, kwargs):
    """The dtype a cast kind asks for (cast_arguments' rules), None for none."""
    if action == "fp32":
        return _float32
    if action == "fp32_unless_dtype":
        if kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
            return None
        return _float32
    if action == "promote":
        widest = dtype
        for t in _iter_tensors(args, kwargs):
            if t.is_floating_point() and t.dtype != _float64 and t.device.type == device_type:
                widest = torch.promote_types(widest, t.dtype)
        return widest
    return dtype  # lower


def _trace_cast(args, dtype, device_type):
    """``_map_tensors`` for tracing: the same rule, no weight-cast cache (the graph
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


_trace_plan_constant = _torch_compat.assume_constant_result(_trace_plan)
# Clones of expanded composites, by name: Dynamo guards a function it reads as an
# attribute of a known object, not one handed back by _trace_plan.
_TRACED_CLONES = types.SimpleNamespace()


def _clone_name(func) -> str:
    clone = _clone_without_dispatch_check(func)
    name = f"clone_{id(clone)}"
    setattr(_TRACED_CLONES, name, clone)
    return name


_key_excluded = _torch_compat.dispatch_key_excluded


def _call_aside(st: _ThreadState, func, args, kwargs, kind=None, ctx: DeviceContext | None = None):
    """Runs one call the function level lets through, cast per ``kind`` (None: as given).

    While it runs, native autocast is off for our devices (it would cast again with its
    own table, see "Note: torch sees our state as native state"). The aten level goes on
    the dispatch stack only for a call not cast here while grad mode is off: it acts only
    where autograd records nothing, and not inside an op cast here (native excludes
    autocast inside the ops it handles). Everywhere else it would cost a Python call per
    aten op, and between calls it would keep torch.compile from tracing (see "Note:
    torch.compile"); while it is on the stack Dynamo's frame hook is disarmed (see "Note:
    Dynamo and our frames").
    """
    if kind is not None:
        args, kwargs = cast_arguments(kind, ctx, args, kwargs, st, func)
    devices = st.native_devices
    for device in devices:
        _set_native_enabled(device, False)
    aten_level = dynamo_hook = None
    if kind is None and st.aten_level is not None and not _grad_enabled():
        dynamo_hook = _disarm_dynamo()
        aten_level = _push_aten_level(st)
    try:
        return func(*args, **kwargs)
    finally:
        if aten_level is not None:
            _pop_dispatch_stack(None)
        if dynamo_hook is not None:
            _rearm_dynamo(dynamo_hook)
        for device in devices:
            _set_native_enabled(device, True)


# -- torch.utils.checkpoint under a policy that is not native's -------------------------
# torch's checkpoint records torch's autocast state at the forward and recomputes under
# torch.autocast with it during backward. Under a built-in policy that is our state (the
# same dtype and the same table), so the recomputation equals the forward. Under a policy
# whose kind for an op differs from native's, the recomputation would cast that op
# differently: refuse, and name dispatch_amp.checkpoint, which recomputes under ours.
_REENTRANT_CHECKPOINT_CODE = _torch_compat.reentrant_checkpoint_function.forward.__code__
_DIFFERS_FROM_NATIVE: dict = {}


def _refuse_torch_checkpoint(ctx: DeviceContext, func, kind) -> None:
    if kind is EXPAND or kind is GETTER:
        return  # the calls inside are checked one by one
    key = (ctx.policy, ctx.device_type, func)
    try:
        differs = _DIFFERS_FROM_NATIVE[key]
    except KeyError:
        native = routes_for(Policy.for_device(ctx.device_type)).function_route(func)
        differs = _DIFFERS_FROM_NATIVE[key] = native is not kind and native is not EXPAND
    except TypeError:  # an unhashable callable: never in a table
        return
    if differs and _inside_torch_checkpoint():
        native = routes_for(Policy.for_device(ctx.device_type)).function_route(func)
        raise RuntimeError(
            f"torch.utils.checkpoint inside dispatch_amp.autocast with policy "
            f"{ctx.policy.name!r}: this policy casts {_op_name(func)} as {kind!r} where "
            f"native autocast's {ctx.device_type} table says {native!r}, and torch's "
            f"checkpoint recomputes the region during backward under native torch.autocast, "
            f"so the recomputed activations would differ from the forward's. Use "
            f"dispatch_amp.checkpoint (same arguments), which recomputes under this policy."
        )


def _inside_torch_checkpoint() -> bool:
    hooks = _torch_compat.top_saved_tensors_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        return True  # the non-reentrant variant packs saved tensors with its own hooks
    frame = sys._getframe(2)
    while frame is not None:  # the reentrant variant runs the function in its forward
        if frame.f_code is _REENTRANT_CHECKPOINT_CODE:
            return True
        frame = frame.f_back
    return False


# -- the aten level (below autograd) ----------------------------------------------------
_len_dispatch_stack = _torch_compat.len_dispatch_stack
_dispatch_stack_at = _torch_compat.dispatch_stack_at
_pop_dispatch_stack = _torch_compat.pop_dispatch_stack
_push_dispatch_stack = _torch_compat.push_dispatch_stack


def _push_aten_level(st: _ThreadState):
    """Puts the aten level on top of the dispatch stack; returns it, or None if it was
    already there (a call made inside another call it covers)."""
    aten_level = st.aten_level
    depth = _len_dispatch_stack()
    if depth and _dispatch_stack_at(depth - 1) is aten_level:
        return None
    _push_dispatch_stack(aten_level)
    return aten_level


def _records_autograd(args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in _iter_tensors(args, kwargs):
        if t.requires_grad:
            return True
    return False


class _AtenLevel(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # See "Note: Dynamo and our frames": we keep Dynamo out ourselves, cheaper.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dynamo_hook = _disarm_dynamo()
        try:
            return self._handle(func, args, kwargs)
        finally:
            _rearm_dynamo(dynamo_hook)

    def _handle(self, func, args, kwargs):
        kwargs = kwargs or _NO_KWARGS
        st = STATE
        ctx = st.primary
        if ctx is None:
            if not st.active:
                return func(*args, **kwargs)
            ctx = _context_for(st, args, kwargs)
            if ctx is None:
                return func(*args, **kwargs)
        kind = ctx.routes.aten_kind(func)
        if (
            kind is None
            or not ctx.custom  # native autocast casts here under a built-in policy
            or _records_autograd(args, kwargs)
            or _inside_native_region(st)
        ):
            return func(*args, **kwargs)
        args, kwargs = cast_arguments(kind, ctx, args, kwargs, st, func)
        return func(*args, **kwargs)


def _keep_out_of_dynamo() -> None:
    """Marks every function of this module as a frame Dynamo never compiles.

    Code after a graph break in a compiled function runs eagerly with Dynamo's frame hook
    armed, and our handler's frames would be compiled as user frames: specialized for
    tracing (``_is_compiling``), broken at every C call. Dynamo still inlines the
    function level's handler when it traces a call under it (see "Note: torch.compile").
    """
    for value in list(globals().values()):
        functions = [value]
        if isinstance(value, type) and value.__module__ == __name__:
            functions = [getattr(f, "__func__", f) for f in vars(value).values()]
        for f in functions:
            if isinstance(f, types.FunctionType) and f.__module__ == __name__:
                _skip_code(f.__code__)


_keep_out_of_dynamo()
