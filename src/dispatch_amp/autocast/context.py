"""``autocast``: run a region in mixed precision, with native ``torch.autocast`` semantics.

Example::

    import torch, dispatch_amp as amp

    model = torch.nn.Linear(8, 8)
    with amp.autocast("cpu"):                 # bfloat16 on CPU, float16 on CUDA
        out = model(torch.randn(4, 8))        # out.dtype == torch.bfloat16
        loss = out.float().pow(2).mean()
    loss.backward()                           # outside the context, as with native AMP

How it works is in ``_engine.py`` ("Note: cast where native casts").
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings

import torch

from .. import _torch_compat
from ..fp8._rules import ALL_FP8_DTYPES as _FP8_DTYPES
from ..fp8.recipes import Recipe
from ..warning_types import CompileFallbackWarning
from . import _engine
from .op_tables import FP8
from .policy import Policy, policy_with_fp8_ops

__all__ = ["autocast", "is_autocast_enabled", "get_autocast_dtype", "clear_autocast_cache", "CompileFallbackWarning"]


# "Not done yet" for the values __enter__/__exit__ clean up after an exception.
_NOTHING = object()
_is_compiling = torch.compiler.is_dynamo_compiling
_disarm_dynamo = _torch_compat.disarm_dynamo
_rearm_dynamo = _torch_compat.rearm_dynamo
_WARNED_COMPILED: set = set()
_get_ident = threading.get_ident
# The whole package (dispatch_amp/, not autocast/): the frames skipped below include the
# callers of autocast elsewhere in the package (torch_patch, opt_levels, integrations).
_PACKAGE_DIR = __file__.rsplit("/", 2)[0]
_MODULE_CALL_FILE = torch.nn.Module.__call__.__code__.co_filename


def _warn_if_inside_compiled() -> None:
    """Warns once per compiled function when a region is entered eagerly while it runs
    (called only when Dynamo's frame hook is armed)."""
    frame = sys._getframe(1)
    # Our frames (and torch.compiler.disable's wrapper, if any) come first.
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or frame.f_code.co_filename == _torch_compat.DYNAMO_EVAL_FRAME_FILE
    ):
        frame = frame.f_back
    caller, compiled = frame, None
    for _ in range(64):
        if frame is None:
            return
        code = frame.f_code
        if code.co_filename == _torch_compat.DYNAMO_EVAL_FRAME_FILE:
            # torch.compile's wrapper: we run inside a compiled function. Any other
            # wrapper there is torch.compiler.disable's: compiling was switched off.
            if code.co_name != "compile_wrapper":
                return
            break
        if code.co_filename != _MODULE_CALL_FILE:  # name a module's forward, not its __call__
            compiled = code
        frame = frame.f_back
    else:
        return
    if compiled is None or compiled in _WARNED_COMPILED:
        return
    _WARNED_COMPILED.add(compiled)
    warnings.warn_explicit(
        f"dispatch_amp.autocast entered inside the torch.compile'd {compiled.co_name} "
        f"({compiled.co_filename}:{compiled.co_firstlineno}) ran eagerly: a region with a "
        f"policy of its own cannot be traced there (or Dynamo broke the graph inside the "
        f"region), so the graph breaks, and a function that opens the region in a `with` "
        f"block runs eagerly. The numbers are right (our casts run). To compile it, open "
        f"the region around the compiled call: `with amp.autocast(...): compiled(x)`.",
        CompileFallbackWarning,
        caller.f_code.co_filename,
        caller.f_lineno,
    )


class _EnteredRegions(threading.local):
    def __init__(self):
        # (device type, dtype) -> enabled regions entered so far on this thread.
        self.counts: dict[tuple[str, torch.dtype], int] = {}


_ENTERED = _EnteredRegions()


def regions_entered(device_type: str, dtype: torch.dtype) -> int:
    """How many enabled ``autocast(device_type, dtype)`` regions this thread has entered.

    A running count: GradScaler compares two readings to tell whether bfloat16 autocast
    ran in between (a scaler is not needed there).

    Example::

        before = regions_entered("cpu", torch.bfloat16)
        with amp.autocast("cpu"):
            assert regions_entered("cpu", torch.bfloat16) == before + 1
    """
    return _ENTERED.counts.get((device_type, dtype), 0)

# device type -> (default dtype, supported dtypes), the one place these facts live.
# Every device type with a built-in policy is here (tests/autocast/test_context.py checks it).
_DEVICES: dict[str, tuple[torch.dtype, tuple[torch.dtype, ...]]] = {
    "cuda": (torch.float16, (torch.float16, torch.bfloat16)),
    "cpu": (torch.bfloat16, (torch.bfloat16, torch.float16)),
    "xpu": (torch.float16, (torch.float16, torch.bfloat16)),
    "mps": (torch.float16, (torch.float16, torch.bfloat16)),
}


def _check_device_type(device_type) -> str:
    # Exception types follow torch.autocast's (ValueError for a non-string, RuntimeError
    # for an unknown device type), and each message holds torch's own words too, so code
    # that catches or matches them behaves the same.
    if not isinstance(device_type, str):
        theirs = f"Expected `device_type` of type `str`, got: `{type(device_type)}`"
        if isinstance(device_type, torch.device):
            raise ValueError(
                f"{theirs}: device_type must be a string such as 'cuda' or 'cpu', got "
                f"torch.device {str(device_type)!r}; pass device.type"
            )
        raise ValueError(f"{theirs}: device_type must be a string, one of {sorted(_DEVICES)}")
    if device_type not in _DEVICES:
        try:  # what torch says of it (making a disabled torch.autocast changes nothing)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.amp.autocast_mode.autocast(device_type, enabled=False)
            theirs = "torch.autocast supports it; use torch.autocast there"
        except (RuntimeError, ValueError) as error:
            theirs = str(error)
        raise RuntimeError(
            f"unsupported device_type {device_type!r}: dispatch_amp.autocast supports "
            f"{sorted(_DEVICES)} ({theirs})"
        )
    return device_type


def device_dtypes(device_type: str) -> tuple[torch.dtype, tuple[torch.dtype, ...]]:
    """``(default dtype, supported dtypes)`` of autocast for ``device_type`` ("cpu", "cuda",
    "xpu" or "mps").

    Example::

        >>> device_dtypes("cuda")
        (torch.float16, (torch.float16, torch.bfloat16))
    """
    return _DEVICES[_check_device_type(device_type)]


def _usable(device_type: str, dtype: torch.dtype) -> str | None:
    """Why an enabled region of this device type and dtype cannot cast here, or None.

    As torch.autocast does, such a region warns and runs disabled instead of raising.
    """
    if device_type == "cuda" and not torch.cuda.is_available():
        return "autocast('cuda') is enabled, but CUDA is not available; disabling autocast in this region"
    supported = _DEVICES[device_type][1]
    if dtype not in supported:
        names = " or ".join(str(d) for d in supported)
        return (
            f"autocast({device_type!r}) supports dtype {names}, got {dtype}; disabling "
            f"autocast in this region (pass enabled=False to run in {dtype} without this warning)"
        )
    return None




def _with_fp8(policy: Policy, fp8) -> Policy:
    """The policy a region applies: with ``fp8``, ``linear`` becomes fp8 unless the policy
    already names its fp8 ops; without, a policy that names fp8 ops is refused."""
    marked = policy.ops(FP8)
    if fp8 is None:
        if marked:
            raise ValueError(
                f"policy {policy.name!r} marks {sorted(marked)} as fp8, but no recipe was given: "
                f"pass fp8=dispatch_amp.fp8.CurrentScaling() (or DelayedScaling(), RowwiseScaling())"
            )
        return policy
    if not isinstance(fp8, Recipe):
        raise TypeError(
            f"fp8 must be a dispatch_amp.fp8 recipe (CurrentScaling(), DelayedScaling(), "
            f"RowwiseScaling()), got {type(fp8).__name__}"
        )
    return policy if marked else policy_with_fp8_ops(policy)


# (device type, enabled, dtype, cache_enabled, id(policy)) -> the DeviceContext they make,
# for regions without an fp8 recipe. A context is derived from its arguments alone (a
# policy is immutable), and making one costs more than entering a region; the entry
# holds its policy, so the id names that policy for as long as the entry lives. Bounded:
# code that makes a new policy per region starts it afresh now and then.
_CONTEXTS: dict = {}
_MAX_CONTEXTS = 256


def _context(device_type: str, enabled: bool, dtype: torch.dtype, policy: Policy, cache_enabled: bool, fp8):
    """The ``DeviceContext`` of a region with these (checked) arguments."""
    if fp8 is not None or _is_compiling():  # a recipe is mutable state; Dynamo traces the plain path
        return _engine.DeviceContext(device_type, enabled, dtype, policy, cache_enabled, fp8)
    key = (device_type, enabled, dtype, cache_enabled, id(policy))
    ctx = _CONTEXTS.get(key)
    if ctx is None or ctx.policy is not policy:
        ctx = _engine.DeviceContext(device_type, enabled, dtype, policy, cache_enabled, None, kept=True)
        if len(_CONTEXTS) >= _MAX_CONTEXTS:
            _CONTEXTS.clear()
        _CONTEXTS[key] = ctx
    return ctx


class autocast:
    """Context manager and decorator that runs ops in mixed precision.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ``"xpu"`` (Intel GPUs) or ``"mps"`` (Apple
            GPUs); only floating tensors on this device type are cast. Other device types
            torch.autocast knows (``"hpu"``, ``"xla"``...) raise RuntimeError, as torch
            does for one it does not know.
        dtype: the lower precision, ``torch.float16`` or ``torch.bfloat16``; ``None``
            means ``torch.get_autocast_dtype(device_type)`` when the context is made (the
            device's default, cpu: bfloat16, others: float16, unless a region changed it).
            As with ``torch.autocast``, an enabled region with another dtype, or a
            ``"cuda"`` region without CUDA, warns and runs disabled.
        enabled: ``False`` turns autocast off inside this region (also inside an outer
            enabled region, ours or native).
        cache_enabled: cache the lower-precision copy of each weight (a leaf tensor that
            requires grad) for the outermost enabled region, so a weight used several
            times is cast once; ``None`` means ``torch.is_autocast_cache_enabled()``.
        policy: the op table to apply; ``None`` means ``Policy.for_device(device_type)``.
            ``Policy.for_device("cuda")`` with ``device_type="cpu"`` applies the CUDA
            table to CPU tensors.
        fp8: an fp8 recipe (``dispatch_amp.fp8.CurrentScaling()``, ``DelayedScaling()``,
            ``RowwiseScaling()``): the calls the policy marks ``fp8`` (by default
            ``linear``) run as scaled fp8 gemms, outputs in ``dtype``. docs/fp8.md.

    Contexts nest, with each other and with ``torch.autocast``: the innermost one wins,
    and the outer state returns on exit, also when an exception escapes. State is per
    thread, like native autocast. Inside the region torch reports it as native autocast
    (``torch.is_autocast_enabled``, ``torch.get_autocast_dtype``), so code written for
    torch behaves as it would under ``torch.autocast``. As with native AMP,
    run the forward pass and the loss inside the context and ``backward()`` outside.

    Example::

        with amp.autocast("cpu"):
            y = model(x)                          # matmuls in bfloat16
            with amp.autocast("cpu", enabled=False):
                z = torch.mm(y.float(), w)        # float32 here
        @amp.autocast("cpu")
        def forward(x): ...
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        policy: Policy | None = None,
        fp8: Recipe | None = None,
    ):
        if device_type.__class__ is not str or device_type not in _DEVICES:
            device_type = _check_device_type(device_type)  # raises, or passes a str subclass
        if dtype in _FP8_DTYPES:
            raise ValueError(
                f"dtype={dtype} cannot be an autocast dtype: torch's autocast state holds the "
                f"region's float16/bfloat16, and fp8 runs as scaled gemms beside it. Pass "
                f"dtype=torch.bfloat16 (or float16) and fp8=dispatch_amp.fp8.CurrentScaling() "
                f"(or DelayedScaling(), RowwiseScaling())"
            )
        if dtype is None:
            # As native: the dtype torch reports now (the device's default, or that of an
            # enclosing region), read when the context is made.
            dtype = torch.get_autocast_dtype(device_type)
        elif not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled()
        elif not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be a bool or None, got {type(cache_enabled).__name__}")
        if policy is None:
            policy = Policy.for_device(device_type)
        elif not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a dispatch_amp.Policy (e.g. Policy.for_device('cuda')), "
                f"got {type(policy).__name__}"
            )
        ctx = None
        if fp8 is None and not _is_compiling():
            # Made before from this policy object: its fp8 check passed then (_with_fp8
            # returns the policy itself), and it would now.
            ctx = _CONTEXTS.get((device_type, enabled, dtype, cache_enabled, id(policy)))
            if ctx is not None and ctx.policy is not policy:
                ctx = None
        if ctx is None:
            policy = _with_fp8(policy, fp8)
        # _usable's answer is None for a supported dtype off CUDA: asked only where it may not be.
        if enabled and (device_type == "cuda" or dtype not in _DEVICES[device_type][1]):
            reason = _usable(device_type, dtype)
            if reason is not None:
                warnings.warn(reason, stacklevel=2)
                enabled = False
                ctx = None
        self.device_type = device_type
        self.fast_dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.policy = policy
        self.fp8 = fp8
        # What the engine opens (frozen: the arguments are checked and never change).
        self._ctx = ctx if ctx is not None else _context(device_type, enabled, dtype, policy, cache_enabled, fp8)
        # The key of this object's regions in _ENTERED.counts.
        self._entered = (device_type, dtype)
        # thread id -> the frame of each open entry of this object (innermost last)
        self._open: dict[int, list[dict]] = {}
        # Regions entered while Dynamo traced: native regions held open, innermost last.
        self._traced: list = []

    # Entering and leaving a region inside a torch.compile'd function: Dynamo inlines
    # these two (see "Note: torch.compile" in _engine.py). Under a built-in policy the
    # region is native autocast with the same dtype, so it is traced as torch.autocast's
    # own enter and exit (graph nodes). Under a policy of our own the engine's bookkeeping
    # (thread state, mode stacks) cannot be traced: a graph break (_enter_eagerly is
    # torch.compiler.disable'd), and the code runs eagerly. Eagerly Dynamo's frame hook
    # is disarmed meanwhile, as the engine does for its own calls.
    def __enter__(self) -> autocast:
        if _is_compiling():
            if not self._ctx.custom:
                region = _native_region(self.device_type, self.fast_dtype, self.enabled, self.cache_enabled)
                next(region)
                self._traced.append(region)
                return self
            return self._enter_eagerly()
        # Any exception from here on (an interrupt too, see "Note: interrupts" in
        # _engine.py) leaves the region closed: `with` runs neither the body nor __exit__.
        dynamo_hook = frame = _NOTHING
        try:
            dynamo_hook = _disarm_dynamo()
            if dynamo_hook is not None:  # eager code of a compiled function
                _warn_if_inside_compiled()
            frame = _engine.enter(self._ctx)
            thread = _get_ident()
            entries = self._open.get(thread)
            if entries is None:
                self._open[thread] = [frame]
            else:
                entries.append(frame)
            if self.enabled:
                counts, key = _ENTERED.counts, self._entered
                counts[key] = counts.get(key, 0) + 1
            if dynamo_hook is not None:  # None: nothing was armed, nothing to put back
                _rearm_dynamo(dynamo_hook)
            return self
        except BaseException:
            if frame is not _NOTHING:
                self._forget(frame)
                if _engine.is_open(frame):
                    _engine.leave(frame)
            if dynamo_hook is not _NOTHING:
                _rearm_dynamo(dynamo_hook)
            raise

    @torch.compiler.disable
    def _enter_eagerly(self) -> autocast:
        return self.__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        # The region this exit closes, once chosen (None once closed): after an exception
        # part-way (an interrupt), closing goes on to the end before it propagates.
        closing = dynamo_hook = _NOTHING
        try:
            if _is_compiling():
                if self._traced:
                    next(self._traced.pop(), None)  # leaves the native region
                    return None
                return self._exit_eagerly(exc_type, exc, tb)
            dynamo_hook = _disarm_dynamo()
            thread = _get_ident()
            entries = self._open.get(thread)
            closing = entries[-1] if entries else self._innermost_entry()
            _engine.leave(closing)
            # self._forget(closing), its common cases inline.
            if entries[-1] is not closing:
                self._forget(closing)
            elif len(entries) > 1:
                del entries[-1]
            else:
                self._open.pop(thread, None)
            closing = None
            if dynamo_hook is not None:  # None: nothing was armed, nothing to put back
                _rearm_dynamo(dynamo_hook)
            return None
        except BaseException:
            if closing is _NOTHING and not _is_compiling():
                closing = self._innermost_entry(missing=None)
            if closing is not None and closing is not _NOTHING:
                if _engine.is_open(closing):
                    _engine.leave(closing)
                self._forget(closing)
            if dynamo_hook is not _NOTHING:
                _rearm_dynamo(dynamo_hook)
            raise

    @torch.compiler.disable
    def _exit_eagerly(self, exc_type, exc, tb) -> None:
        frame = self._innermost_entry()
        _engine.leave(frame)
        self._forget(frame)

    def _innermost_entry(self, missing=_NOTHING):
        """The frame of this object's innermost open entry in this thread; without one,
        ``missing`` if given, else an error that says where it is open."""
        thread = _get_ident()
        entries = self._open.get(thread)
        if entries:
            return entries[-1]
        if missing is not _NOTHING:
            return missing
        elsewhere = sorted(t for t, e in self._open.items() if e)
        where = f"it is open in thread(s) {elsewhere}" if elsewhere else "it is not open in any thread"
        raise RuntimeError(
            f"autocast.__exit__ called in thread {thread} without a matching __enter__ "
            f"in that thread ({where}). Autocast state is per thread: exit a context in "
            f"the thread that entered it, and open one with `with autocast(...)` in each thread."
        )

    def _forget(self, frame: dict) -> None:
        """Drops ``frame`` from this object's open entries in this thread, if it is there."""
        thread = _get_ident()
        entries = self._open.get(thread)
        if not entries:
            self._open.pop(thread, None)
            return
        if entries[-1] is frame:  # the common case: the innermost
            del entries[-1]
        else:
            for i in range(len(entries) - 2, -1, -1):
                if entries[i] is frame:
                    del entries[i]
                    break
        if not entries:
            self._open.pop(thread, None)

    def __call__(self, func):
        """Decorates ``func`` to run inside this context (generator functions are refused)."""
        if not callable(func):
            # torch's own words first (code matches on them), then ours.
            raise TypeError(
                f"autocast()(func) requires a callable, but got {type(func).__name__}. Did you "
                f"mean to use autocast as a context manager? To run code in the region: "
                f"`with dispatch_amp.autocast(device_type=...): output = model(input)`"
            )
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
            raise TypeError(
                "autocast cannot decorate a generator or coroutine function: the context "
                "would be open while the caller runs between yields; open it inside instead"
            )

        @functools.wraps(func)
        def decorated(*args, **kwargs):
            with autocast(
                self.device_type, self.fast_dtype, self.enabled, self.cache_enabled, self.policy, self.fp8
            ):
                return func(*args, **kwargs)

        return decorated

    # torch.autocast's attribute names, which code written for torch reads.
    @property
    def device(self) -> str:
        """The device type, under ``torch.autocast``'s attribute name."""
        return self.device_type

    @property
    def _enabled(self) -> bool:
        return self.enabled

    @property
    def _cache_enabled(self) -> bool:
        return self.cache_enabled

    def __repr__(self) -> str:
        return (
            f"autocast({self.device_type!r}, dtype={self.fast_dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}, policy={self.policy.name!r}"
            + ("" if self.fp8 is None else f", fp8={self.fp8!r}") + ")"
        )


def _native_region(device_type, dtype, enabled, cache_enabled):
    """torch.autocast held open across our __enter__ and __exit__ while Dynamo traces.

    A with-block inside a generator is the form every supported torch's Dynamo turns
    into its own enter and exit graph nodes: calling ``torch.autocast``'s ``__enter__``
    by hand is an unsupported call, and before torch 2.13 a direct call of torch's
    ``_enter_autocast`` leaves the trace with autocast state it refuses.
    """
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        yield


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast is enabled for ``device_type`` here: ours or native, the innermost wins.

    The same answer as ``torch.is_autocast_enabled(device_type)``, which reports our
    regions too.

    Example::

        with amp.autocast("cpu"):
            assert amp.is_autocast_enabled("cpu") and not amp.is_autocast_enabled("cuda")
    """
    return torch.is_autocast_enabled(_check_device_type(device_type))


def get_autocast_dtype(device_type: str = "cuda") -> torch.dtype:
    """The lower-precision dtype in force for ``device_type`` (its default outside any region).

    The same answer as ``torch.get_autocast_dtype(device_type)``.

    Example::

        amp.get_autocast_dtype("cpu")               # torch.bfloat16
        with amp.autocast("cpu", dtype=torch.float16):
            amp.get_autocast_dtype("cpu")           # torch.float16
    """
    return torch.get_autocast_dtype(_check_device_type(device_type))


def clear_autocast_cache() -> None:
    """Drop the cached weight casts: ours and native's (each region's cache, shared by
    the process as native's is, and those of the ``cast_cache`` open in this thread).

    ``torch.clear_autocast_cache()`` reaches only native's cache (torch offers no hook
    for it). Call this one after changing weights in a way the cache cannot see (in place
    through ``.data``, a fused optimizer kernel called directly, a collective), or to free
    the casts early.

    Example::

        with amp.autocast("cpu"):
            y = model(x)
            amp.clear_autocast_cache()      # the next forward casts the weights again
    """
    torch.clear_autocast_cache()
    _engine.clear_cache()


# Dynamo must never compile these as frames of their own (eager code of a compiled
# function calls them with its frame hook armed); it still inlines them when it traces.
for _method in (autocast.__enter__, autocast.__exit__, autocast._innermost_entry, autocast._forget):
    _torch_compat.skip_code(_method.__code__)
del _method
