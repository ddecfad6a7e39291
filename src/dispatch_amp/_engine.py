"""The casting engine behind ``autocast``: per-thread state, two interception levels.

Note: cast where native casts
-----------------------------
Native autocast decides above autograd, at composite ops before they decompose and at
primitive aten ops, so autograd records the casts and saves the low-precision copies.
A ``TorchDispatchMode`` alone sits below autograd and after decomposition, and cannot do
that (DESIGN.md fact 1). So the engine has two levels that read one ``Policy``:

- ``_FunctionLevel`` (a ``TorchFunctionMode``, above autograd) casts every call whose
  aten name is in the policy: ``F.linear``, ``torch.mm``, ``F.cross_entropy`` whole.
  Python composites from torch (``F.multi_head_attention_forward``, ``F.interpolate``)
  are run with the level still active so the calls inside them are seen too.
- ``_AtenLevel`` (a ``TorchDispatchMode``, below autograd) sees every aten op after
  decomposition. It applies the policy where that is safe without autograd's help, i.e.
  when autograd records nothing for the op (``no_grad``, ``inference_mode``, inputs that
  need no grad) and the op is not already inside one cast by the function level (native
  excludes autocast inside an op it handled). For ops outside the tables it is one dict
  lookup and a call. It is also where later features observe every kernel.

Both levels are installed once per thread by the outermost enabled ``autocast`` and
read the innermost context from ``_STATE``; nested contexts only push and pop frames.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .composites import NOT_HANDLED
from .op_tables import BANNED, FP32, FP32_UNLESS_DTYPE, LOWER, PROMOTE
from .policy import EXPAND, GETTER, Policy

_Tensor = torch.Tensor

# Note: Dynamo and our frames
# A torch.compile'd function called inside autocast runs eagerly: Dynamo skips a frame
# while a (non-infra) dispatch mode is on the stack. But Dynamo stays armed for every
# frame that runs below it, and two kinds of our frames run with our dispatch mode off
# the stack: the aten level's handler (torch pops a mode while it handles an op) and an
# op cast by the function level (we pop the aten level, see _pop_aten_level). Dynamo
# would compile those frames, our casting logic included. We disarm its frame hook for
# those spans (two C calls, what torch._dynamo.disable does) and mark the aten handler's
# own code as skipped, which replaces torch's heavier default shim around
# __torch_dispatch__.
try:
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
    from torch._dynamo.eval_frame import skip_code as _skip_code
except ImportError:  # pragma: no cover - depends on the torch version
    _set_eval_frame = _skip_code = None


def _no_dynamo_hook():
    return None


# A partial is called from C: cheaper than a lambda on a path that runs for every cast op.
_disarm_dynamo = functools.partial(_set_eval_frame, None) if _set_eval_frame else _no_dynamo_hook
_rearm_dynamo = _set_eval_frame or (lambda hook: None)
_float32 = torch.float32
_float64 = torch.float64


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

    def __post_init__(self):
        test = _DEVICE_TESTS.get(self.device_type)
        device_type = self.device_type
        object.__setattr__(self, "on_device", test if test is not None else (lambda t: t.device.type == device_type))


class _ThreadState(threading.local):
    def __init__(self):
        # frames[i] maps device type -> DeviceContext; the last frame is in force.
        self.frames: list[dict[str, DeviceContext]] = []
        # Enabled contexts of the innermost frame; `primary` is set when there is exactly
        # one (the common case), so the hot path needs no device lookup.
        self.active: tuple[DeviceContext, ...] = ()
        self.primary: DeviceContext | None = None
        # The installed pair of modes and the frame index that installed them.
        self.modes: tuple | None = None
        self.installer: int = -1
        # Weight-cast cache: (id(src), dtype, grad_mode) -> (src, src._version, cast).
        self.cache: dict = {}
        # >0 while an op cast by the function level runs: the aten level stands aside.
        self.depth: int = 0
        # Native autocast nesting when our modes were installed; a deeper value means a
        # native `torch.autocast(...)` region was entered inside ours.
        self.native_nesting: int = 0
        # Python composites currently being expanded (guards against re-dispatch loops).
        self.expanding: set = set()
        # (device type, dtype) -> enabled contexts entered so far on this thread; GradScaler
        # compares counts to tell whether bfloat16 autocast ran since it last looked.
        self.entries: dict[tuple[str, torch.dtype], int] = {}


STATE = _ThreadState()


_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting


def _native_nesting() -> int:
    # torch exposes the nesting counter only through increment/decrement.
    _increment_nesting()
    return _decrement_nesting()


def _inside_native_region(st: _ThreadState) -> bool:
    return _native_nesting() > st.native_nesting


# -- frames -----------------------------------------------------------------------------
def push_frame(frame: dict[str, DeviceContext]) -> None:
    st = STATE
    st.frames.append(frame)
    _refresh(st)
    for ctx in st.active:
        key = (ctx.device_type, ctx.dtype)
        st.entries[key] = st.entries.get(key, 0) + 1
    if st.modes is None and st.active:
        st.native_nesting = _native_nesting()
        function_level, aten_level = _FunctionLevel(), _AtenLevel()
        function_level.__enter__()
        try:
            aten_level.__enter__()
        except BaseException:
            function_level.__exit__(None, None, None)
            raise
        st.modes = (function_level, aten_level)
        st.installer = len(st.frames) - 1


def pop_frame() -> None:
    st = STATE
    index = len(st.frames) - 1
    st.frames.pop()
    if st.modes is not None and index == st.installer:
        function_level, aten_level = st.modes
        st.modes = None
        st.installer = -1
        st.cache.clear()
        try:
            aten_level.__exit__(None, None, None)
        finally:
            function_level.__exit__(None, None, None)
    _refresh(st)


def autocast_entries(device_type: str, dtype: torch.dtype) -> int:
    """How many enabled ``autocast(device_type, dtype)`` contexts this thread has entered so far."""
    return STATE.entries.get((device_type, dtype), 0)


def current_frame() -> dict[str, DeviceContext]:
    frames = STATE.frames
    return frames[-1] if frames else {}


def _refresh(st: _ThreadState) -> None:
    frame = st.frames[-1] if st.frames else {}
    st.active = tuple(ctx for ctx in frame.values() if ctx.enabled)
    st.primary = st.active[0] if len(st.active) == 1 else None


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
    # Native caches lower-precision casts of fp32 leaves that require grad (weights).
    # The grad mode is part of the key: a cast made under no_grad has no history and
    # must not be handed to a later op that records one.
    # Inference tensors have no version counter, so they are never cached.
    if (
        ctx.cache_enabled
        and dtype is ctx.dtype
        and t.requires_grad
        and t.is_leaf
        and not t.is_inference()
    ):
        key = (id(t), dtype, torch.is_grad_enabled())
        hit = st.cache.get(key)
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
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


def cast_arguments(kind: str, ctx: DeviceContext, args, kwargs, st: _ThreadState, func):
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
    else:  # pragma: no cover - kinds are validated when the policy is built
        raise AssertionError(kind)
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
                    if _is_torch_python_function(cell.cell_contents)
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


def _is_torch_python_function(obj) -> bool:
    try:
        return isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith("torch")
    except ValueError:  # an empty closure cell
        return False


class _FunctionLevel(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        st = STATE
        ctx = st.primary
        if ctx is None:
            if not st.active:
                return func(*args, **kwargs) if kwargs else func(*args)
            ctx = _context_for(st, args, kwargs)
            if ctx is None:
                return func(*args, **kwargs) if kwargs else func(*args)
        try:  # the policy's memo, read directly: this runs for every torch call
            kind = ctx.policy._function_kinds[func]
        except (KeyError, TypeError):
            kind = ctx.policy.function_kind(func)
        if kind is LOWER and not kwargs:
            return self._lower(st, ctx, func, args)
        if kind is None:
            # Not cast. With grad enabled the aten level has nothing to do inside (it only
            # acts where autograd records nothing), but its presence costs a Python call
            # per aten op and sends some C++ composites down slower paths (an active
            # dispatch mode makes every tensor look like a subclass), so it steps aside.
            if torch.is_grad_enabled():
                return _call_without_aten_level(st, func, args, kwargs)
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind is GETTER:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind is EXPAND:
            return self._expand(st, func, args, kwargs)
        if kind.__class__ is not str:
            return self._decompose(kind, func, args, kwargs)
        # Python wrappers such as torch.tensordot forward out=None explicitly; inside a
        # native torch.autocast region (enabled or not) native rules.
        if (kwargs and kwargs.get("out") is not None) or _inside_native_region(st):
            return func(*args, **kwargs) if kwargs else func(*args)
        # The op and its casts run with the aten level off the dispatch stack: it would
        # stand aside inside an op cast here anyway (native excludes autocast inside the
        # ops it handles), and every aten op it sees costs a Python call.
        dynamo_hook = _disarm_dynamo()
        aten_level = _pop_aten_level(st)
        st.depth += 1
        try:
            args, kwargs = cast_arguments(kind, ctx, args, kwargs, st, func)
            return func(*args, **kwargs) if kwargs else func(*args)
        finally:
            st.depth -= 1
            if aten_level is not None:
                _push_dispatch_stack(aten_level)
            _rearm_dynamo(dynamo_hook)

    @staticmethod
    def _lower(st, ctx, func, args):
        """The common cast (matmuls, convolutions, no kwargs): the path below, trimmed.

        Same steps as the general path in __torch_function__ (native-region check, Dynamo
        and the aten level out of the way, casts, call), with _inside_native_region and
        _pop_aten_level inlined because on tiny ops every Python call shows.
        """
        _increment_nesting()
        if _decrement_nesting() > st.native_nesting:
            return func(*args)
        dynamo_hook = _disarm_dynamo()
        aten_level = st.modes[1]
        depth = _len_dispatch_stack()
        popped = _pop_dispatch_stack(None) if depth and _dispatch_stack_at(depth - 1) is aten_level else None
        if popped is None:  # another mode sits above ours: tell the aten level to stand aside
            st.depth += 1
        try:
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
            return func(*cast)
        finally:
            if popped is None:
                st.depth -= 1
            else:
                _push_dispatch_stack(popped)
            _rearm_dynamo(dynamo_hook)

    def _decompose(self, decomposition, func, args, kwargs):
        kwargs = kwargs or {}
        with self:
            out = decomposition(*args, **kwargs)
        return func(*args, **kwargs) if out is NOT_HANDLED else out

    def _expand(self, st, func, args, kwargs):
        kwargs = kwargs or {}
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


def _call_without_aten_level(st: _ThreadState, func, args, kwargs):
    dynamo_hook = _disarm_dynamo()
    aten_level = _pop_aten_level(st)
    try:
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        if aten_level is not None:
            _push_dispatch_stack(aten_level)
        _rearm_dynamo(dynamo_hook)


# -- the aten level (below autograd) ----------------------------------------------------
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_dispatch_stack_at = torch._C._get_dispatch_stack_at
_pop_dispatch_stack = torch._C._pop_torch_dispatch_stack
_push_dispatch_stack = torch._C._push_on_torch_dispatch_stack


def _pop_aten_level(st: _ThreadState):
    """Takes our aten level off the dispatch stack if it is on top; returns it or None."""
    aten_level = st.modes[1]
    depth = _len_dispatch_stack()
    if depth and _dispatch_stack_at(depth - 1) is aten_level:
        return _pop_dispatch_stack(None)
    return None


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
        return _skip_code is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dynamo_hook = _disarm_dynamo()
        try:
            return self._handle(func, args, kwargs)
        finally:
            _rearm_dynamo(dynamo_hook)

    def _handle(self, func, args, kwargs):
        st = STATE
        ctx = st.primary
        if ctx is None:
            if not st.active:
                return func(*args, **kwargs) if kwargs else func(*args)
            ctx = _context_for(st, args, kwargs)
            if ctx is None:
                return func(*args, **kwargs) if kwargs else func(*args)
        kind = ctx.policy.aten_kind(func)
        if (
            kind is None
            or st.depth
            or _records_autograd(args, kwargs)
            or _inside_native_region(st)
        ):
            return func(*args, **kwargs) if kwargs else func(*args)
        args, kwargs = cast_arguments(kind, ctx, args, kwargs, st, func)
        return func(*args, **kwargs) if kwargs else func(*args)


if _skip_code is not None:
    _skip_code(_AtenLevel.__torch_dispatch__.__code__)
