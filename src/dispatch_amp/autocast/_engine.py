"""The casting engine behind ``autocast``: regions, and kernels in the dispatcher.

Note: the engine lives in the dispatcher
-----------------------------------------
Native autocast decides in the dispatcher, at its Autocast keys: above autograd (so
autograd records the casts and saves the low-precision copies), at composite ops before
they decompose (``linear``, ``conv2d``, ``layer_norm``) and at every op called from
inside C++ kernels and Python composites alike, with C++ kernels: an op it does not
cast costs nothing. Our engine sits at the same place. Its kernels are Python functions
registered with ``torch.library`` at ``AutocastPrivateUse1`` (``_dispatch_key.py``), the
autocast key of highest priority, so each runs before native's key would:

- a kernel is registered only for the ops some policy in use casts (and, under a policy
  of our own, the ops native registers, so that native never casts a call in our
  region); every other op passes our key through a fallthrough, in C++;
- the key is on only for threads inside an enabled region of ours (the thread's
  included dispatch keys), so nothing changes anywhere else;
- a kernel reads the innermost context, casts as its policy says (``_handlers.py``, one
  handler per cast kind, following native's wrappers) and calls the op again with every
  autocast key excluded inside it, as native's wrappers do; an op the policy does not
  cast goes on past the autocast keys for that call only (its insides still reach our
  kernels).

So only calls that need a cast run Python; calls made inside C++ kernels and inside
torch's Python composites reach the same kernels; and a compiled graph never calls back:
while it runs torch excludes every autocast key, ours included, and its casts were
traced from our kernels when AOTAutograd traced the graph.

Note: torch sees our state as native state
------------------------------------------
Code written for torch asks torch, not us, whether autocast is on
(``torch.is_autocast_enabled``, ``torch.get_autocast_dtype``, ``custom_fwd``,
``torch.utils.checkpoint``, nn modules' fast paths, library float32 islands). So entering
``autocast`` sets torch's own thread-local autocast state exactly as ``torch.autocast``
would (enabled, dtype, cache flag, nesting counter) and exiting restores it. In torch that
state is also the switch of native casting: native's key for the device type is on while
autocast is enabled. Native's kernels never act in our region all the same: every op
native casts has a kernel of ours, above native's, which decides it and runs it with
the autocast keys excluded.

What torch reports differently: autocast for the device type "privateuseone" reads as
enabled inside our regions (it is our key's state), and its autocast dtype carries which
policies are in force (``_tokens.py``). Code on a machine without a PrivateUse1 backend
has no reason to ask; a process where such a backend is loaded is refused at region
entry (``_dispatch_key.KeyTaken``).

A native ``torch.autocast`` region opened inside ours raises torch's nesting counter
above the value our innermost context recorded; under a policy of one's own or an fp8
recipe our kernels then pass every call on to native's key, which gives native's rule
for any nesting order: the innermost region wins. Under a built-in policy without a
recipe the kernels skip that check (two reads of torch's state per call): the native
region's table is ours, its dtype and enabled state are torch's state, which the kernels
follow per call, and torch's cache flag is read per cast, so ours casts there exactly as
native would.

Note: torch.compile
-------------------
- Our casts are in the graph: Dynamo runs each op it traces on fake tensors through the
  dispatcher (our kernels included), and AOTAutograd traces the aten graph through them,
  so the casts our kernels make become graph nodes. While the compiled graph runs, torch
  excludes every autocast key: nothing is cast twice and nothing calls our Python.
- Guards: Dynamo guards every device type's autocast enabled flag and dtype, and each
  input tensor's dispatch keys with the thread's included keys applied; our key and our
  token ("privateuseone"'s dtype, one per configuration of policies of one's own) are
  both seen, so a graph is reused only under the same dtype, enabled state and policies,
  never outside our region or inside a native one. Not guarded: a native region with the
  same dtype and enabled state opened inside ours *outside* the compiled function (torch
  gives its nesting counter no guard); a graph traced without it is reused inside it.
- AOTAutograd traces the backward under the forward's ambient autocast unless told
  otherwise; under a policy of our own that would cast the backward, which eagerly runs
  outside the region, so our region sets it to ``"off"`` while open.
- AOTAutograd's cache keys a traced graph by the code Dynamo captured and torch's
  autocast state; under a policy of our own a configuration's token is reused across
  processes, so compiles under one skip that cache (inductor's, keyed on the traced aten
  graph with our casts in it, stays on). See ``_compile_hooks``.
- fp8: while Dynamo traces, the fp8 path runs above the dispatcher (``_Fp8Level`` below,
  a function mode on torch's stack only while an fp8 region is open), so Dynamo traces it
  as Python and its state updates become graph.
- A region entered inside a compiled function: under a built-in policy
  ``autocast.__enter__``/``__exit__`` trace as torch.autocast's own enter and exit (the
  region is native autocast with the same dtype and table). Under a policy of our own
  entering is a graph break (a ``torch.compiler.disable``'d call), Dynamo cannot resume
  inside a ``with`` of a context manager it does not know, so the function runs eagerly,
  and ``autocast`` warns once per compiled function (``CompileFallbackWarning``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from . import _cast_cache, _compiled_engine, _dispatch_key
from ._state import STATE, DeviceContext, Region, ThreadState, View
from ._tokens import BUILTIN_TOKEN, pin_current, release_pins, token_for
from ._tracing_path import trace_call

_NATIVE_CLEAR = torch.clear_autocast_cache  # the genuine one, before anyone replaces it

_is_compiling = torch.compiler.is_dynamo_compiling
_functorch_config = torch._functorch.config
_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_set_native_enabled = torch.set_autocast_enabled
_is_native_enabled = torch.is_autocast_enabled
_get_dtype = torch.get_autocast_dtype
_set_dtype = torch.set_autocast_dtype
_is_cache_enabled = torch.is_autocast_cache_enabled
_set_cache_enabled = torch.set_autocast_cache_enabled
_include_key = _torch_compat.set_dispatch_key_included
_exclude_key = _torch_compat.set_dispatch_key_excluded
_KEY = _dispatch_key.KEY
_ENGINE = _compiled_engine.ENGINE
_PU1 = "privateuseone"
_new_tuple = tuple.__new__


# -- entering and leaving a context -----------------------------------------------------
class NativeState(NamedTuple):
    """torch's autocast state for one device type, as an entered context found it.

    A named tuple rather than a frozen dataclass: one is made at every region's entry,
    and a tuple is made several times faster."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool
    # AOTAutograd's autocast for the backward it traces, when the context changed it (a
    # policy of our own, see "Note: torch.compile"); None otherwise.
    backward_autocast: object = None


def enter(ctx: DeviceContext) -> dict[str, DeviceContext]:
    """Opens ``ctx`` on this thread; returns the region's frame, which :func:`leave` takes.

    torch's state is set as ``torch.autocast.__enter__`` sets it (see "Note: torch sees
    our state as native state"), then the frame is pushed. An exception part-way (an
    interrupt, see "Note: interrupts") undoes what was done: the region is not open.
    """
    st = STATE
    d = st.__dict__  # the thread's attributes, read as dict items (see _refresh)
    device_type = ctx.device_type
    if ctx.enabled:
        if ctx.plan not in _PREPARED:
            _prepare(ctx)
        # Again after torch._dynamo.reset(), which drops callbacks (install's own test, first
        # here: a call less per region).
        if not _torch_compat.compile_callback_registered(_compile_hooks.start):
            _compile_hooks.install()
        changes_backward = ctx.custom  # a config read and write cost microseconds
    else:
        changes_backward = False
    # NativeState(...) and Region(...) below, made as tuple.__new__ makes them: a named
    # tuple's own __new__ is a Python function, a call more at every entry.
    saved = _new_tuple(NativeState, (
        device_type, _is_native_enabled(device_type), _get_dtype(device_type), _is_cache_enabled(),
        _functorch_config.backward_pass_autocast if changes_backward else None,
    ))
    regions = d["regions"]
    below = len(regions)
    depth = None
    try:
        if changes_backward:
            _functorch_config.backward_pass_autocast = "off"
        _set_native_enabled(device_type, ctx.enabled)
        _set_dtype(device_type, ctx.dtype)
        depth = _increment_nesting()
        _set_cache_enabled(ctx.cache_enabled)
        if regions:
            frame = dict(regions[-1].frame)
            frame[device_type] = ctx
            view = _view(frame, depth)
        else:  # the outermost region: _view's one-context case, without the call
            frame = {device_type: ctx}
            views = ctx.views
            view = (views is not None and views.get(depth)) or _view(frame, depth)
        _push_frame(st, _new_tuple(Region, (frame, depth, ctx, saved, view)), d)
        return frame
    except BaseException:
        del st.regions[below:]
        _uninstall(st, below)
        _refresh(st)
        _restore_native(saved, None if depth is None else _decrement_nesting())
        raise


_PREPARED: set = set()


def _prepare(ctx: DeviceContext) -> None:
    """Makes sure the kernels ``ctx``'s plan needs are registered (once per plan).

    No lock is held here: a region opened by a signal handler while this thread
    registers must not wait for the frame it interrupted (``ensure_kernels`` says how
    registering stays safe); a plan recorded twice is recorded once.
    """
    plan = ctx.plan
    if plan in _PREPARED:
        return
    _dispatch_key.ensure_kernels(plan.registered)
    _compiled_engine.prepare(plan)  # the plan's rules, written into the compiled kernels
    _PREPARED.add(plan)


def leave(frame: dict[str, DeviceContext]) -> None:
    """Closes the region whose :func:`enter` returned ``frame``.

    That is the innermost region, except when regions are left out of order (a
    generator that opened one is finished inside a region its caller opened later):
    then exactly that region goes, wherever it is ("Note: regions left out of order").
    An exception part-way (an interrupt) finishes closing before it propagates.
    """
    st = STATE
    d = st.__dict__  # the thread's attributes, read as dict items (see _refresh)
    regions = d["regions"]
    index = len(regions) - 1
    if index < 0 or regions[index].frame is not frame:
        for index in range(len(regions) - 2, -1, -1):
            if regions[index].frame is frame:
                _remove_frame(st, index)
                return
        raise RuntimeError("this autocast region is not open on this thread; exit each region once")
    saved = regions[index].saved
    remaining = None
    try:
        del regions[index]  # _drop(st, index)
        _uninstall(st, index)
        _refresh(st, d)
        remaining = _decrement_nesting()
        _restore_native(saved, remaining)
    except BaseException:
        # Every step below is safe to repeat; only the nesting counter is counted.
        if index < len(regions) and regions[index].frame is frame:
            _drop(st, index)
        _uninstall(st, index)
        _refresh(st)
        if remaining is None:
            remaining = _decrement_nesting()
        _restore_native(saved, remaining)
        raise


def is_open(frame: dict[str, DeviceContext]) -> bool:
    """Whether the region whose :func:`enter` returned ``frame`` is open on this thread."""
    return any(region.frame is frame for region in STATE.regions)


# Note: interrupts
# ----------------
# A KeyboardInterrupt can arrive between any two lines of Python. enter() and leave()
# therefore change state in an order they can undo or finish: enter() records what it
# is about to install before installing it (a level recorded but not yet pushed is
# taken off as a no-op) and rolls everything back on any exception; leave() marks each
# step done only after doing it, and on an exception repeats the steps not marked done
# before letting the exception go on; _refresh, which sets our key and token from the
# innermost region's view (derived from its frame when its record was made), can run
# any number of times. So one interrupt leaves a region fully open or
# fully closed, never torch's state half restored (the autocast object does the same
# for its own bookkeeping). tests/autocast/test_context.py interrupts every line of both.
def _restore_native(saved: NativeState, remaining: int | None) -> None:
    """Puts back torch's state as ``saved`` holds it; ``remaining``: the nesting counter
    after this region's decrement (0 clears native's cast cache, as torch does)."""
    if remaining == 0:
        torch.clear_autocast_cache()  # looked up per call: code may replace it (see _uninstall)
    device_type = saved.device_type
    _set_native_enabled(device_type, saved.enabled)
    _set_dtype(device_type, saved.dtype)
    _set_cache_enabled(saved.cache_enabled)
    if saved.backward_autocast is not None:
        _functorch_config.backward_pass_autocast = saved.backward_autocast


def _push_frame(st: ThreadState, region: Region, d: dict | None = None) -> None:
    if d is None:  # the thread's attributes, read as dict items (see _refresh)
        d = st.__dict__
    if d["fp8_mode"] is None:
        st.fp8_mode = _Fp8Level()
    # One append: a region opened and closed at any point of this function (a signal
    # handler's) finds the stack with this region whole or without it.
    d["regions"].append(region)
    _refresh(st, d)
    if region.view.fp8_recipe is None:  # no active context has an fp8 recipe
        return
    index = len(st.regions) - 1
    # The fp8 level is recorded before it goes on torch's stack (see "Note: interrupts").
    if st.fp8_level is None:
        st.fp8_level, st.fp8_installer = st.fp8_mode, index
        _torch_compat.push_function_stack(st.fp8_mode)
    elif not _on_function_stack(st.fp8_level):
        # torch runs an autograd Function's backward with the function-mode stack
        # emptied: a region opened there (custom_bwd, a backward that re-enters
        # autocast) puts the level back for its own span.
        st.fp8_repushers.append(index)
        _torch_compat.push_function_stack(st.fp8_level)


def _drop(st: ThreadState, index: int) -> None:
    del st.regions[index]


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
# one would have, and the fp8 level it installed passes to the next region above that
# needs it, or leaves torch's mode stack from wherever it is.
def _remove_frame(st: ThreadState, index: int) -> None:
    regions = st.regions
    own, saved = regions[index].own, regions[index].saved
    top = len(regions) - 1

    def set_saved(j: int, new_saved: NativeState) -> None:
        regions[j] = regions[j]._replace(saved=new_saved)  # one record, replaced in one step

    same_device = next(
        (j for j in range(index + 1, top + 1) if regions[j].own.device_type == own.device_type), None
    )
    if same_device is None:  # nothing above sets this device's state: it returns now
        _set_native_enabled(own.device_type, saved.enabled)
        torch.set_autocast_dtype(own.device_type, saved.dtype)
    else:
        set_saved(same_device, saved._replace(
            backward_autocast=regions[same_device].saved.backward_autocast
        ))
    set_saved(index + 1, regions[index + 1].saved._replace(cache_enabled=saved.cache_enabled))
    if saved.backward_autocast is not None:
        changed_too = next(
            (j for j in range(index + 1, top + 1) if regions[j].saved.backward_autocast is not None), None
        )
        if changed_too is None:
            _functorch_config.backward_pass_autocast = saved.backward_autocast
        else:
            set_saved(changed_too, regions[changed_too].saved._replace(
                backward_autocast=saved.backward_autocast
            ))
    _decrement_nesting()  # a region above is still open: never the outermost
    _drop(st, index)
    for j in range(index, len(regions)):
        region = regions[j]
        frame = region.frame  # rebuilt in place: it is also that region's handle
        frame.clear()
        if j:
            frame.update(regions[j - 1].frame)
        frame[region.own.device_type] = region.own
        regions[j] = region._replace(depth=region.depth - 1, view=_view(frame, region.depth - 1))
    if index in st.fp8_repushers:
        _take_off_function_stack(st.fp8_mode)
        st.fp8_repushers.remove(index)
    st.fp8_repushers[:] = [j - 1 if j > index else j for j in st.fp8_repushers]
    if st.fp8_installer > index:
        st.fp8_installer -= 1
    elif st.fp8_installer == index:
        heir = next(
            (j for j in range(index, len(regions)) if any(c.fp8 is not None and c.enabled for c in regions[j].frame.values())),
            None,
        )
        if heir is not None:
            st.fp8_installer = heir
        else:
            _uninstall(st, index)
    _refresh(st)


def _on_function_stack(mode: TorchFunctionMode) -> bool:
    stack_at = _torch_compat.function_stack_at
    return any(stack_at(i) is mode for i in range(_torch_compat.len_function_stack()))


def _uninstall(st: ThreadState, index: int) -> None:
    """Takes off what the region at frame ``index`` installed (the fp8 level), and the
    weight-cast cache once no region is open.

    Safe to repeat after an interruption: each record is cleared after its level is off.
    """
    d = st.__dict__  # the thread's attributes, read as dict items (see _refresh)
    if d["fp8_repushers"] and index in st.fp8_repushers:
        _take_off_function_stack(st.fp8_mode)
        st.fp8_repushers.remove(index)
    if d["fp8_installer"] == index:
        _take_off_function_stack(st.fp8_level)
        st.fp8_level, st.fp8_installer = None, -1
    # This thread's outermost region closed: native drops its casts here, by calling
    # torch.clear_autocast_cache. Code that replaces that function to keep native's casts
    # for a backward run after the region (torch's own tests of its global cache do) keeps
    # ours too: only the genuine function drops them.
    if not d["regions"]:
        compiled = _ENGINE.module
        if compiled is not None:  # its batched casts: unused ones cut off, the next plan made
            compiled.region_closed()
        if torch.clear_autocast_cache is _NATIVE_CLEAR:
            _cast_cache.region_closed()


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
    regions = STATE.regions
    return regions[-1].frame if regions else {}


# No region open: nothing active, the compiled kernels told there is no context.
_NO_REGION = View((), None, -1, None, (False, -1, "cpu", None, -1), False, None)


def _view(frame: dict[str, DeviceContext], depth: int) -> View:
    """What the kernels read while the region of ``frame`` (nesting counter ``depth``) is
    innermost; ``_refresh`` copies it into the thread's state."""
    if len(frame) == 1:  # the common case, one device type: made once per kept context and depth
        (ctx,) = frame.values()
        views = ctx.views
        if views is None:
            return _make_view((ctx,) if ctx.enabled else (), depth)
        view = views.get(depth)
        if view is None:
            view = views[depth] = _make_view((ctx,) if ctx.enabled else (), depth)
        return view
    return _make_view(tuple(ctx for ctx in frame.values() if ctx.enabled), depth)


def _make_view(active: tuple, depth: int) -> View:
    if not active:
        return View((), None, depth, None, _NO_REGION.compiled_top, False, None)
    custom = any(ctx.custom or ctx.fp8 is not None for ctx in active)
    fp8_recipe = next((ctx.fp8 for ctx in active if ctx.fp8 is not None), None)
    primary = active[0] if len(active) == 1 else None
    # The kernels' fast path. Its depth is None under a built-in policy without an fp8
    # recipe: there a native region opened inside ours would cast as ours does (the same
    # table; its dtype and enabled state are followed as a hand switch is), so the kernel
    # skips the nesting counter's two reads ("Note: torch sees our state as native state").
    top = None if primary is None else (
        primary, depth if primary.custom or primary.fp8 is not None else None,
        primary.native_key, primary.device_type, primary.dtype, primary.handlers,
    )
    # Every enabled context was prepared when its region was entered, so its plan's
    # number for the compiled side is fixed by now.
    return View(active, primary, depth, top, _compiled_engine.set_top_arguments(top), custom, fp8_recipe)


def _refresh(st: ThreadState, d: dict | None = None) -> None:
    """Sets everything the kernels read from the innermost region's view: the contexts in
    force, our key's state and our token (see "Note: the engine lives in the dispatcher").

    ``d``: ``st.__dict__`` where the caller has it."""
    # The thread's attributes as its dict: a threading.local's attribute costs several
    # times a dict item, and this runs twice per region.
    if d is None:
        d = st.__dict__
    regions = d["regions"]
    view = regions[-1].view if regions else _NO_REGION
    active = d["active"] = view.active
    d["primary"] = view.primary
    d["native_depth"] = view.depth
    d["top"] = view.top
    compiled = _ENGINE.module
    if compiled is not None:  # the compiled kernels' copy of it (set as often as st.top)
        compiled.set_top(*view.compiled_top)
    # Each step is recorded before it is taken and every call sets the key's state anew,
    # so a repeat after an interrupt finishes the job (see "Note: interrupts").
    if active:
        if not d["key_on"]:
            # Read, then look again: a region opened after the read (a signal handler's)
            # turns the key on and leaves our token in torch's state, which must not be
            # what is restored.
            token_saved = _get_dtype(_PU1)
            if not d["key_on"]:
                d["token_saved"] = token_saved
                d["key_on"] = True
        _exclude_key(_KEY, False)  # _dispatch_key.switch(True), without the call
        _include_key(_KEY, True)
        token = token_for(active) if view.custom else BUILTIN_TOKEN
        if _get_dtype(_PU1) is not token:
            _set_dtype(_PU1, token)
    else:
        _include_key(_KEY, False)  # _dispatch_key.switch(False)
        _exclude_key(_KEY, True)
        if d["key_on"]:
            token_saved = d["token_saved"]
            _set_dtype(_PU1, token_saved if token_saved is not None else BUILTIN_TOKEN)
            d["key_on"] = False
    mode = d["fp8_mode"]
    if mode is not None:
        mode.fp8_recipe = view.fp8_recipe


def clear_cache() -> None:
    _cast_cache.clear()


# -- fp8 (above the dispatcher) -----------------------------------------------------------
class _Fp8Level(TorchFunctionMode):
    """Traces the fp8 path while Dynamo traces (see "Note: torch.compile"): an fp8 call's
    quantizing, statistics and delayed scaling's history updates must be Python that
    Dynamo sees. Eagerly it passes every call on: our kernel for ``linear`` takes the fp8
    calls in the dispatcher (``_fp8_handler.py``), the ones made inside torch's composites
    too. On torch's stack only while a region with an fp8 recipe is open."""

    # The fp8 recipe of the innermost region (None: none there), read by the tracing path;
    # Dynamo guards on it because the tracing path reads it.
    fp8_recipe = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_compiling():
            return trace_call(self, func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class _CompileHooks:
    """Dynamo's compile-start and -end callbacks, installed with the first region.

    At the start of a compile under a policy of our own: the token in force is recorded
    as one a graph was traced under (``_tokens.pin_current``), and AOTAutograd's cache is
    switched off until the compile ends (its key cannot tell our configurations apart:
    across processes a token names another configuration, and before torch 2.13 the key
    holds no autocast state but whether any is on: "Note: torch.compile"). The cache flag
    is put back as it was.
    """

    def __init__(self):
        self.saved_cache_flag = None
        self.start = self._start  # one bound method, looked for at every region's entry

    def install(self) -> None:
        """Registers the callbacks unless they are registered (``torch._dynamo.reset()``
        drops every callback: each region's entry checks). Found dropped, the reset also
        dropped every compiled graph: no token is held by one any more."""
        if not _torch_compat.compile_callback_registered(self.start):
            release_pins()
            _torch_compat.on_compile_start(self.start)
            _torch_compat.on_compile_end(self._end)

    def _start(self, *args) -> None:
        if _dispatch_key.is_on() and pin_current():
            self.saved_cache_flag = _functorch_config.enable_autograd_cache
            _functorch_config.enable_autograd_cache = False

    def _end(self, *args) -> None:
        if self.saved_cache_flag is not None:
            _functorch_config.enable_autograd_cache = self.saved_cache_flag
            self.saved_cache_flag = None


_compile_hooks = _CompileHooks()

_torch_compat.keep_out_of_dynamo(globals(), __name__)
