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
(``_tracing_path.py``):

- Under built-in policies it calls the op as given: torch's autocast state is ours
  (previous note), so AOTAutograd records native's casts in the graph, and native's
  table is the policy. The graph is the one ``torch.autocast`` would give.
- Under a policy of our own it casts the arguments with tensor casts that become graph
  nodes, and runs the call inside ``torch.autocast(device, enabled=False)`` (graph nodes
  too) so native's table adds nothing: the casts eager dispatch_amp makes. How to cast a
  call is decided once, at trace time, by reading our thread state
  (``_tracing_path.trace_plan``, run through Dynamo's ``assume_constant_result``). AOTAutograd traces
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

import dataclasses
import sys
from dataclasses import dataclass

import torch
from torch._ops import OpOverload as _OpOverload
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _torch_compat
from ._casting import cast_arguments, cast_one, context_for, iter_tensors, map_tensors, op_name
from ._routing import EXPAND, GETTER, clone_without_dispatch_check, routes_for
from ._state import STATE, DeviceContext, ThreadState, inside_native_region
from ._tracing_path import trace_call, trace_key_for
from .composites import NOT_HANDLED
from .fp8 import fp8_linear
from .fp8._eligibility import fp8_eligible, linear_arguments
from .op_tables import FP8, LOWER, CastKind
from .policy import Policy, policy_with_fp8_ops

_Tensor = torch.Tensor

# Note: Dynamo and our frames
# Dynamo stays armed for every frame that runs eagerly below a compiled function (after a
# graph break). Frames of ours must not be compiled: every function of the engine's
# modules is marked as skipped (_torch_compat.keep_out_of_dynamo). Frames that run while
# the aten level is on the dispatch stack must not reach Dynamo either: it would skip
# them for good (see "Note: torch.compile"). So the function level disarms Dynamo's frame
# hook around the calls it puts the aten level under, and the aten level around its
# handler (two C calls, what torch._dynamo.disable does), which also replaces torch's
# heavier default shim around __torch_dispatch__.
_disarm_dynamo = _torch_compat.disarm_dynamo
_rearm_dynamo = _torch_compat.rearm_dynamo
# True only while Dynamo traces (it folds the call to a constant); one trivial Python call
# eagerly, where torch.compiler.is_compiling makes two.
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
# torch hands handlers kwargs=None or {}; calling with **{} costs what calling without
# costs, so every call site passes kwargs through as this. Never mutated.
_NO_KWARGS: dict = {}
_functorch_config = torch._functorch.config
_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_set_native_enabled = torch.set_autocast_enabled
_functorch_active = _torch_compat.functorch_transforms_active


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


def enter(ctx: DeviceContext) -> dict[str, DeviceContext]:
    """Opens ``ctx`` on this thread; returns the region's frame, which :func:`leave` takes.

    torch's state is set as ``torch.autocast.__enter__`` sets it (see "Note: torch sees
    our state as native state"), then the frame is pushed. An exception part-way (an
    interrupt, see "Note: interrupts") undoes what was done: the region is not open.
    """
    st = STATE
    changes_backward = ctx.enabled and ctx.custom  # a config read and write cost microseconds
    saved = NativeState.read(
        ctx.device_type, _functorch_config.backward_pass_autocast if changes_backward else None
    )
    below = len(st.frames)
    depth = None
    try:
        if changes_backward:
            _functorch_config.backward_pass_autocast = "off"
        _set_native_enabled(ctx.device_type, ctx.enabled)
        torch.set_autocast_dtype(ctx.device_type, ctx.dtype)
        depth = _increment_nesting()
        torch.set_autocast_cache_enabled(ctx.cache_enabled)
        frame = dict(current_frame())
        frame[ctx.device_type] = ctx
        _push_frame(st, frame, depth, ctx, saved)
        return frame
    except BaseException:
        del st.frames[below:], st.depths[below:], st.owns[below:], st.saved[below:]
        _uninstall(st, below)
        _refresh(st)
        _restore_native(saved, None if depth is None else _decrement_nesting())
        raise


def leave(frame: dict[str, DeviceContext]) -> None:
    """Closes the region whose :func:`enter` returned ``frame``.

    That is the innermost region, except when regions are left out of order (a
    generator that opened one is finished inside a region its caller opened later):
    then exactly that region goes, wherever it is ("Note: regions left out of order").
    An exception part-way (an interrupt) finishes closing before it propagates.
    """
    st = STATE
    index = len(st.frames) - 1
    if index < 0 or st.frames[index] is not frame:
        for index in range(len(st.frames) - 2, -1, -1):
            if st.frames[index] is frame:
                _remove_frame(st, index)
                return
        raise RuntimeError("this autocast region is not open on this thread; exit each region once")
    saved = st.saved[index]
    remaining = None
    try:
        _drop(st, index)
        _uninstall(st, index)
        _refresh(st)
        remaining = _decrement_nesting()
        _restore_native(saved, remaining)
    except BaseException:
        # Every step below is safe to repeat; only the nesting counter is counted.
        if index < len(st.frames) and st.frames[index] is frame:
            _drop(st, index)
        _uninstall(st, index)
        _refresh(st)
        if remaining is None:
            remaining = _decrement_nesting()
        _restore_native(saved, remaining)
        raise


def is_open(frame: dict[str, DeviceContext]) -> bool:
    """Whether the region whose :func:`enter` returned ``frame`` is open on this thread."""
    return any(f is frame for f in STATE.frames)


# Note: interrupts
# ----------------
# A KeyboardInterrupt can arrive between any two lines of Python. enter() and leave()
# therefore change state in an order they can undo or finish: enter() records what it
# is about to install before installing it (a level recorded but not yet pushed is
# taken off as a no-op) and rolls everything back on any exception; leave() marks each
# step done only after doing it, and on an exception repeats the steps not marked done
# before letting the exception go on. So one interrupt leaves a region fully open or
# fully closed, never torch's state half restored (the autocast object does the same
# for its own bookkeeping). tests/test_autocast.py interrupts every line of both.
def _restore_native(saved: NativeState, remaining: int | None) -> None:
    """Puts back torch's state as ``saved`` holds it; ``remaining``: the nesting counter
    after this region's decrement (0 clears native's cast cache, as torch does)."""
    if remaining == 0:
        torch.clear_autocast_cache()
    _set_native_enabled(saved.device_type, saved.enabled)
    torch.set_autocast_dtype(saved.device_type, saved.dtype)
    torch.set_autocast_cache_enabled(saved.cache_enabled)
    if saved.backward_autocast is not None:
        _functorch_config.backward_pass_autocast = saved.backward_autocast


def _push_frame(
    st: ThreadState, frame: dict[str, DeviceContext], depth: int, own: DeviceContext, saved: NativeState
) -> None:
    if st.function_mode is None:
        st.function_mode = _FunctionLevel()
    st.frames.append(frame)
    st.depths.append(depth)
    st.owns.append(own)
    st.saved.append(saved)
    _refresh(st)
    index = len(st.frames) - 1
    # Each level is recorded before it goes on torch's stack (see "Note: interrupts").
    if st.function_level is None and st.active:
        st.function_level, st.function_installer = st.function_mode, index
        _push_function_mode(st.function_mode)
    elif st.active and not _on_function_stack(st.function_level):
        # torch runs an autograd Function's backward with the function-mode stack
        # emptied: a region opened there (custom_bwd, a backward that re-enters
        # autocast) puts the level back for its own span, so its calls are cast by
        # the policy and share the forward's weight-cast cache, as native's do.
        st.function_repushers.append(index)
        _push_function_mode(st.function_mode)
    if st.aten_level is None and st.native_devices:
        st.aten_level, st.aten_installer = _AtenLevel(), index


def _drop(st: ThreadState, index: int) -> None:
    del st.frames[index], st.depths[index], st.owns[index], st.saved[index]


# Note: regions left out of order
# -------------------------------
# A generator that enters a region and yields hands control back with the region open;
# if the caller then opens a region of its own and finishes the generator inside it, the
# generator's region closes while the caller's is innermost. torch.autocast then restores
# its own saved state under the caller's region, and the caller's exit later restores the
# generator's state: autocast stays on after both are closed. Ours removes exactly the
# region that closes: the regions above it keep their own contexts (their frames are
# rebuilt without it), the next region above of the same device type (and the next one
# above for the global cache flag and AOTAutograd's setting) will restore what the closed
# one would have, and a level it installed passes to the next region above that needs
# it, or leaves torch's mode stack from wherever it is.
def _remove_frame(st: ThreadState, index: int) -> None:
    own, saved = st.owns[index], st.saved[index]
    top = len(st.frames) - 1
    same_device = next(
        (j for j in range(index + 1, top + 1) if st.owns[j].device_type == own.device_type), None
    )
    if same_device is None:  # nothing above sets this device's state: it returns now
        _set_native_enabled(own.device_type, saved.enabled)
        torch.set_autocast_dtype(own.device_type, saved.dtype)
    else:
        st.saved[same_device] = dataclasses.replace(
            saved, backward_autocast=st.saved[same_device].backward_autocast
        )
    st.saved[index + 1] = dataclasses.replace(st.saved[index + 1], cache_enabled=saved.cache_enabled)
    if saved.backward_autocast is not None:
        changed_too = next(
            (j for j in range(index + 1, top + 1) if st.saved[j].backward_autocast is not None), None
        )
        if changed_too is None:
            _functorch_config.backward_pass_autocast = saved.backward_autocast
        else:
            st.saved[changed_too] = dataclasses.replace(
                st.saved[changed_too], backward_autocast=saved.backward_autocast
            )
    _decrement_nesting()  # a region above is still open: never the outermost
    _drop(st, index)
    for j in range(index, len(st.frames)):
        st.depths[j] -= 1
        frame = st.frames[j]  # rebuilt in place: it is also that region's handle
        frame.clear()
        if j:
            frame.update(st.frames[j - 1])
        frame[st.owns[j].device_type] = st.owns[j]
    if index in st.function_repushers:
        _take_off_function_stack(st.function_mode)
        st.function_repushers.remove(index)
    st.function_repushers[:] = [j - 1 if j > index else j for j in st.function_repushers]
    for level in ("function", "aten"):
        installer = getattr(st, f"{level}_installer")
        if installer > index:
            setattr(st, f"{level}_installer", installer - 1)
        elif installer == index:
            needs = (lambda c: c.enabled) if level == "function" else (lambda c: c.enabled and c.custom)
            heir = next(
                (j for j in range(index, len(st.frames)) if any(needs(c) for c in st.frames[j].values())),
                None,
            )
            if heir is not None:
                setattr(st, f"{level}_installer", heir)
            else:
                _uninstall(st, index)
    _refresh(st)


def _on_function_stack(mode: TorchFunctionMode) -> bool:
    stack_at = _torch_compat.function_stack_at
    return any(stack_at(i) is mode for i in range(_torch_compat.len_function_stack()))


def _uninstall(st: ThreadState, index: int) -> None:
    """Takes off the levels that the region at frame ``index`` installed.

    Safe to repeat after an interruption: each record is cleared after its level is off.
    """
    if index in st.function_repushers:
        _take_off_function_stack(st.function_mode)
        st.function_repushers.remove(index)
    if st.aten_installer == index:
        st.aten_level, st.aten_installer = None, -1
    if st.function_installer == index:
        _take_off_function_stack(st.function_level)
        st.cache.clear()
        st.function_level, st.function_installer = None, -1


def _push_function_mode(mode: TorchFunctionMode) -> None:
    # TorchFunctionMode.__enter__ in one C call, with nothing after it to interrupt.
    _torch_compat.push_function_stack(mode)


def _take_off_function_stack(mode: TorchFunctionMode) -> None:
    """Removes ``mode`` from torch's function-mode stack wherever it is.

    A mode entered after ours and still open (``with torch.device("meta")`` around the
    end of a generator that opened our region, say) stays where it is: popping the top,
    as ``TorchFunctionMode.__exit__`` does, would remove that one instead.
    """
    above = []
    try:
        while _torch_compat.len_function_stack() > 0:
            top = _torch_compat.pop_function_stack()
            if top is mode:
                return
            above.append(top)
    finally:
        for other in reversed(above):
            _torch_compat.push_function_stack(other)


def current_frame() -> dict[str, DeviceContext]:
    frames = STATE.frames
    return frames[-1] if frames else {}


def _refresh(st: ThreadState) -> None:
    frame = st.frames[-1] if st.frames else {}
    st.active = tuple(ctx for ctx in frame.values() if ctx.enabled)
    st.primary = st.active[0] if len(st.active) == 1 else None
    st.native_devices = tuple(ctx.device_type for ctx in st.active if ctx.custom)
    st.native_depth = st.depths[-1] if st.depths else -1
    if st.function_mode is not None:
        st.function_mode.trace_key = trace_key_for(st.active)
        st.function_mode.fp8_recipe = st.primary.fp8 if st.primary is not None else None


def clear_cache() -> None:
    STATE.cache.clear()


# -- the function level (above autograd) ------------------------------------------------
class _FunctionLevel(TorchFunctionMode):
    # What tracing depends on beyond torch's autocast state, which Dynamo guards itself:
    # the policies of our own in force (see "Note: torch.compile"). Dynamo guards on it
    # because the tracing path reads it.
    trace_key: str | None = None
    # The fp8 recipe of the innermost region, read by the tracing path.
    fp8_recipe = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return trace_call(self, func, args, kwargs or {})
        kwargs = kwargs or _NO_KWARGS
        st = STATE
        if not st.native_devices and (func.__class__ is _OpOverload or _functorch_active()):
            # Under a built-in policy native autocast decides, as it would without us (see
            # "Note: torch sees our state as native state"): an aten overload called as
            # such (the ops of a compiled graph, or torch.ops) is cast in the dispatcher;
            # inside torch.func transforms (vmap, grad, jacrev) native casts some calls
            # and not others (under vmap, linear with a bias, addmm, conv1d and baddbmm
            # stay float32), so every call there is left to it.
            return func(*args, **kwargs)
        ctx = st.primary
        if ctx is None:
            if not st.active:  # our innermost context is disabled, and so is native autocast
                return func(*args, **kwargs)
            ctx = context_for(st, args, kwargs)
            if ctx is None:
                if inside_native_region(st):
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
            if not st.native_devices or inside_native_region(st):
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
        if inside_native_region(st):
            return func(*args, **kwargs)
        # Python wrappers such as torch.tensordot forward out=None explicitly; a real out=
        # is never cast (native does not cast out= overloads either).
        if kwargs and kwargs.get("out") is not None:
            kind = None
        elif kind is FP8:
            return _fp8_call(st, ctx, func, args, kwargs)
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
            # cast_one's first test, inlined: most arguments need no cast at all
            # (already dtype, or not a tensor), and the rest go through it.
            if a.__class__ is _Tensor or isinstance(a, _Tensor):
                if a.dtype is not dtype:
                    a = cast_one(a, dtype, ctx, st)
            elif isinstance(a, (list, tuple)):
                a = map_tensors((a,), dtype, ctx, st)[0]
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
        clone = clone_without_dispatch_check(func)
        st.expanding.add(func)
        try:
            with self:
                return clone(*args, **kwargs)
        finally:
            st.expanding.discard(func)


_key_excluded = _torch_compat.dispatch_key_excluded


def _call_aside(st: ThreadState, func, args, kwargs, kind=None, ctx: DeviceContext | None = None):
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


# -- fp8 ------------------------------------------------------------------------------
_graph_task_id = torch._C._current_graph_task_id


def _fp8_call(st: ThreadState, ctx: DeviceContext, func, args, kwargs):
    """A call the policy marks fp8: scaled fp8 gemms under the region's recipe when the
    call is eligible (``fp8/_eligibility.py``), else a cast to the region's dtype."""
    x, weight, bias = linear_arguments(args, kwargs)
    recipe = ctx.fp8
    if recipe is None or not fp8_eligible(recipe, ctx.device_type, x, weight, bias):
        return _call_aside(st, func, args, kwargs, LOWER, ctx)
    # A forward call made while a backward runs is activation checkpointing recomputing
    # the forward; one made under a checkpoint will be recomputed. Recipes with state
    # replay the first's scales for the second (DelayedScaling); only they need to know
    # the second, which costs a walk up the stack.
    if _graph_task_id() != -1:
        phase = "recompute"
    elif recipe.stateful and (st.own_checkpoint or _inside_torch_checkpoint()):
        phase = "checkpointed"
    else:
        phase = "forward"
    devices = st.native_devices
    for device in devices:
        _set_native_enabled(device, False)
    try:
        return fp8_linear(x, weight, bias, recipe, ctx.dtype, recipe._site(weight), phase)
    finally:
        for device in devices:
            _set_native_enabled(device, True)


# -- torch.utils.checkpoint under a policy that is not native's -------------------------
# torch's checkpoint records torch's autocast state at the forward and recomputes under
# torch.amp.autocast with it during backward. Under a built-in policy that is our state
# (the same dtype and the same table), so the recomputation equals the forward. Under a
# policy whose kind for an op differs from native's, the recomputation would cast that op
# differently: refuse, and name dispatch_amp.checkpoint, which recomputes under ours.
# Except under patch_torch with this very policy: torch.amp.autocast is then ours, and the
# recomputation too (the patch warns when it stops if a backward could come after it).
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
        if _recomputes_under_patch(ctx):
            return
        native = routes_for(Policy.for_device(ctx.device_type)).function_route(func)
        raise RuntimeError(
            f"torch.utils.checkpoint inside dispatch_amp.autocast with policy "
            f"{ctx.policy.name!r}: this policy casts {op_name(func)} as {kind!r} where "
            f"native autocast's {ctx.device_type} table says {native!r}, and torch's "
            f"checkpoint recomputes the region during backward under native torch.autocast, "
            f"so the recomputed activations would differ from the forward's. Use "
            f"dispatch_amp.checkpoint (same arguments), which recomputes under this policy."
        )


def _recomputes_under_patch(ctx: DeviceContext) -> bool:
    """Whether torch's checkpoint would recompute under ``ctx``'s policy: patch_torch is
    active with it, so the torch.amp.autocast that torch reopens is ours."""
    opened_by = torch.amp.autocast
    if not getattr(opened_by, "_dispatch_amp_patch", False):
        return False
    policy = getattr(opened_by, "_patch_policy", None) or Policy.for_device(ctx.device_type)
    recipe = getattr(opened_by, "_patch_fp8", None)
    if recipe is not ctx.fp8:
        return False
    if recipe is not None and not policy.ops(FP8):
        policy = policy_with_fp8_ops(policy)
    if policy != ctx.policy:
        return False
    opened_by._checkpointed_under_policy = True  # read by TorchPatch.stop()
    return True


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


def _push_aten_level(st: ThreadState):
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
    for t in iter_tensors(args, kwargs):
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
            ctx = context_for(st, args, kwargs)
            if ctx is None:
                return func(*args, **kwargs)
        kind = ctx.routes.aten_kind(func)
        if (
            kind is None
            or not ctx.custom  # native autocast casts here under a built-in policy
            or _records_autograd(args, kwargs)
            or inside_native_region(st)
        ):
            return func(*args, **kwargs)
        args, kwargs = cast_arguments(kind, ctx, args, kwargs, st, func)
        return func(*args, **kwargs)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
