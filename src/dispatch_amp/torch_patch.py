"""``patch_torch``: let code that calls ``torch.autocast`` / ``torch.amp.GradScaler`` use ours.

For recipe code with many ``torch.autocast(...)`` call sites that you would rather not
edit. The patch is explicit and undoes itself: nothing is patched when dispatch_amp is
imported, and leaving the ``with`` block (or ``stop()``) puts back the very objects that
were there before.

What it replaces, for as long as it is active (attributes that this torch build no
longer has are left out):

* ``torch.autocast`` and ``torch.amp.autocast``: ``dispatch_amp.autocast`` with torch's
  signature. ``cache_enabled=None`` means True (torch's default); a dtype our autocast
  does not support disables the region with torch's warning, as torch does; device types
  other than ``"cpu"`` and ``"cuda"`` get torch's own autocast.
* ``torch.cpu.amp.autocast`` / ``torch.cuda.amp.autocast`` (deprecated in torch): ours,
  for the device the name says.
* ``torch.amp.GradScaler``: ``dispatch_amp.GradScaler``; ``torch.cpu.amp.GradScaler`` /
  ``torch.cuda.amp.GradScaler``: ours, for the device the name says.

What it cannot reach: a name bound before the patch started (``from torch import
autocast`` at the top of a module, a default argument, an attribute stored on an object),
torch's own ``torch.amp.autocast_mode.autocast`` (which ``torch.amp.custom_fwd`` uses), and
C++ code. Bind late (``torch.autocast(...)`` at the call) or start the patch before
importing the code you want to reach.

A patch that reached nothing says so: when it stops (not by an exception leaving its
``with`` block) and, while it was active, no region was entered through the patched
autocast names (as a context manager or a decorator, enabled or switched off by the
caller's ``enabled=False``; a region that disabled itself, ``"cuda"`` on a machine without
CUDA or an unsupported dtype, ran nothing and does not count) and no enabled
GradScaler made through the patched names ran ``scale()`` or ``step()``, it warns
(``AmpNumericsWarning``): nothing ran in mixed precision. Code that picks its own context
(``contextlib.nullcontext()`` on CPU, say) or bound ``torch.autocast`` earlier is the
usual cause.

Example::

    >>> import torch
    >>> with patch_torch():
    ...     with torch.autocast("cpu"):
    ...         y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    >>> y.dtype, torch.autocast.__module__
    (torch.bfloat16, 'torch.amp.autocast_mode')
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref

import torch
import torch.amp.autocast_mode

from .autocast.context import _usable, _with_fp8, autocast
from .autocast.policy import BUILTIN_DEVICES, Policy
from .fp8.recipes import Recipe
from .scaler.grad_scaler import GradScaler as _OurGradScaler
from .warning_types import AmpNumericsWarning

__all__ = ["patch_torch", "TorchPatch"]

# Marks the classes a patch installs, so a second patch can see that one is active by
# looking at torch itself rather than at a flag of ours.
_MARK = "_dispatch_amp_patch"

# Held while a patch checks and swaps torch's attributes (start and stop).
_SWAP_LOCK = threading.Lock()


class _Uses:
    """What ran through one started patch's names, so that a patch that reached nothing
    can say so when it stops: how many regions were entered, and the scalers made.

    ``regions`` has no lock: it only ever grows, so whether it is nonzero, all that is
    read, does not depend on a lost increment between threads. A plain attribute write
    also keeps a region's ``__enter__`` traceable by Dynamo (a side effect it replays),
    where a lock would break the graph.
    """

    __slots__ = ("regions", "scalers", "disabled")

    def __init__(self) -> None:
        # Regions entered that ran (enabled, or switched off by the caller's enabled=False).
        self.regions = 0
        self.scalers: weakref.WeakSet = weakref.WeakSet()
        # Why the last region entered that disabled itself did so (no CUDA for "cuda", an
        # unsupported dtype); such a region ran nothing in mixed precision and is not counted.
        self.disabled: str | None = None

    def reached_anything(self) -> bool:
        # A scaler's scale tensor exists from its first scale() on. A disabled scaler's
        # scale() and step() are the plain backward and optimizer step: code that builds
        # one unconditionally (GradScaler(enabled=dtype == float16)) and runs in bfloat16
        # or float32 has not chosen mixed precision by stepping it.
        return bool(self.regions) or any(
            s.is_enabled() and s.scale_tensor() is not None for s in list(self.scalers)
        )


# The uses of the patch now active, None while none is. The scaler classes are shared by
# every patch (pickle needs them at module level), so a new scaler registers here; each
# patch's autocast class holds its own patch's uses.
_ACTIVE_USES: _Uses | None = None

# torch.autocast for these device types becomes ours; for the others it stays torch's.
_OUR_DEVICES = BUILTIN_DEVICES
_LOW_DTYPES = (torch.float16, torch.bfloat16)


def _torch_class(module, name: str, default: type) -> type:
    return getattr(getattr(module, "amp", None), name, default)


class _TorchsObjectsPass(type):
    """Metaclass of the classes a patch puts in torch's place.

    ``isinstance(obj, torch.amp.GradScaler)`` must stay True under the patch for torch's
    own objects, made before it started or by code holding torch's class; so the class
    installed under torch's name accepts instances and subclasses of the class it
    replaces (``_replaces``). The other way, objects made under the patch are ours, and
    after it stops torch's class does not count them as its own (docs/integrations.md says so).
    """

    def __instancecheck__(cls, obj) -> bool:
        return type.__instancecheck__(cls, obj) or isinstance(obj, cls._replaces)

    def __subclasscheck__(cls, sub) -> bool:
        return type.__subclasscheck__(cls, sub) or issubclass(sub, cls._replaces)


class GradScaler(_OurGradScaler, metaclass=_TorchsObjectsPass):
    # What the patch installs as torch.amp.GradScaler. Defined here, at module level, so
    # that pickle finds the class of a scaler made under the patch (torch.save of a whole
    # scaler, as with torch's), also after the patch stopped.
    __doc__ = _OurGradScaler.__doc__
    _replaces = torch.amp.grad_scaler.GradScaler

    # Registered in __new__, not by wrapping scale()/step() or __init__: a wrapper frame
    # would move the location the scaler's own warnings point at (their stacklevel counts
    # from the user's call) into this module.
    def __new__(cls, *args, **kwargs):
        scaler = super().__new__(cls)
        uses = _ACTIVE_USES
        if uses is not None:
            uses.scalers.add(scaler)
        return scaler


setattr(GradScaler, _MARK, True)


def _device_scaler_class(device_type: str) -> type:
    """The deprecated ``torch.<device>.amp.GradScaler(init_scale, ...)`` without a device."""

    class device_scaler(GradScaler):
        _replaces = _torch_class(getattr(torch, device_type, None), "GradScaler", GradScaler._replaces)
        _init_frames = 1  # this __init__: the scaler's warnings point at the caller's line

        def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000, enabled=True):
            super().__init__(device_type, init_scale, growth_factor, backoff_factor,
                             growth_interval, enabled)

    device_scaler.__name__ = device_scaler.__qualname__ = f"{device_type}_GradScaler"
    return device_scaler


# Module-level names equal to their __qualname__: pickle finds them.
cpu_GradScaler = _device_scaler_class("cpu")
cuda_GradScaler = _device_scaler_class("cuda")
_DEVICE_SCALERS = {"cpu": cpu_GradScaler, "cuda": cuda_GradScaler}


def _autocast_class(policy: Policy | None, fp8: Recipe | None = None, uses: _Uses | None = None) -> type:
    """``dispatch_amp.autocast`` that takes exactly what ``torch.autocast`` takes; every
    region entered through it counts in ``uses``."""
    uses = _Uses() if uses is None else uses

    class autocast_with_torch_signature(autocast, metaclass=_TorchsObjectsPass):
        __doc__ = autocast.__doc__
        _replaces = torch.amp.autocast_mode.autocast
        # Why the region disabled itself, set by _torch_init (here for a copy made without
        # __init__): None, it did not.
        _disabled_itself: str | None = None

        def __new__(cls, device_type, dtype=None, enabled=True, cache_enabled=None):
            if isinstance(device_type, str) and device_type not in _OUR_DEVICES:
                # Returning torch's object skips our __init__: its device is not ours. Its
                # entry cannot be seen, so making it counts: the code chose autocast.
                uses.regions += 1
                return torch.amp.autocast_mode.autocast(device_type, dtype, enabled, cache_enabled)
            return super().__new__(cls)

        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            self._torch_init(device_type, dtype, enabled, cache_enabled, stacklevel=3)

        def _torch_init(self, device_type, dtype, enabled, cache_enabled, stacklevel):
            # ``stacklevel``: the caller's frame as seen from here, so that the warnings
            # point at the user's line through torch.autocast and torch.cuda.amp.autocast
            # alike (the latter's __init__ is one frame more).
            # Why the region disabled itself (None: it did not): such a region is not one
            # that ran, for the patch's closing check.
            self._disabled_itself = None
            if dtype is not None and dtype not in _LOW_DTYPES and enabled:
                # torch's own reaction to an unsupported dtype: warn, then run disabled
                # (torch still reports that dtype inside the region).
                name = device_type.upper()
                warnings.warn(
                    f"In {name} autocast, but the target dtype is not supported. Disabling "
                    f"autocast.\n{name} Autocast only supports dtypes of "
                    f"{', '.join(map(str, _LOW_DTYPES[::-1]))} currently.",
                    stacklevel=stacklevel,
                )
                enabled = False
                self._disabled_itself = f"dtype {dtype} is not an autocast dtype"
            elif enabled and device_type in _OUR_DEVICES:
                # The base class would warn from its own __init__, pointing at this frame:
                # warn here, so the warning points at the user's line.
                reason = _usable(device_type, torch.get_autocast_dtype(device_type) if dtype is None else dtype)
                if reason is not None:
                    warnings.warn(reason, stacklevel=stacklevel)
                    enabled = False
                    self._disabled_itself = reason
            super().__init__(
                device_type,
                dtype,
                enabled,
                True if cache_enabled is None else cache_enabled,
                policy,
                fp8,
            )

        def __enter__(self):
            if self._disabled_itself is None:
                uses.regions += 1
            else:
                uses.disabled = self._disabled_itself
            return super().__enter__()

        def __call__(self, func):
            if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
                # torch.autocast decorates these as any function: its region covers the
                # call that makes the generator or coroutine, not the body run later.
                # dispatch_amp.autocast refuses them; code written for torch gets torch's
                # behaviour.
                @functools.wraps(func)
                def decorated(*args, **kwargs):
                    with self:
                        return func(*args, **kwargs)

                return decorated
            # The base decorator opens a plain dispatch_amp.autocast per call, which does
            # not pass through __enter__ above: count the call here.
            in_region = super().__call__(func)

            @functools.wraps(func)
            def counted(*args, **kwargs):
                if self._disabled_itself is None:
                    uses.regions += 1
                else:
                    uses.disabled = self._disabled_itself
                return in_region(*args, **kwargs)

            return counted

    setattr(autocast_with_torch_signature, _MARK, True)
    # The engine reads it: torch's checkpoint reopens torch.amp.autocast, this class, for
    # its recomputation, so under this policy that recomputation is ours.
    autocast_with_torch_signature._patch_policy = policy
    autocast_with_torch_signature._patch_fp8 = fp8
    return autocast_with_torch_signature


def _device_autocast_class(base: type, device_type: str, default_dtype: torch.dtype) -> type:
    """The deprecated ``torch.<device>.amp.autocast(enabled, dtype, cache_enabled)``."""

    class device_autocast(base):
        _replaces = _torch_class(getattr(torch, device_type, None), "autocast", base._replaces)

        def __new__(cls, enabled=True, dtype=default_dtype, cache_enabled=True):
            return super().__new__(cls, device_type)

        def __init__(self, enabled=True, dtype=default_dtype, cache_enabled=True):
            # Not through the base's __init__: one frame fewer, so its warnings point at
            # the caller's line (stacklevel 3: _torch_init, this, the caller).
            self._torch_init(device_type, dtype, enabled, cache_enabled, stacklevel=3)

    device_autocast.__name__ = device_autocast.__qualname__ = f"{device_type}_autocast"
    return device_autocast


def _replacements(
    policy: Policy | None, fp8: Recipe | None = None, uses: _Uses | None = None
) -> list[tuple[object, str, object]]:
    """(module, attribute, replacement) for every attribute a patch touches, in order."""
    ours = _autocast_class(policy, fp8, uses)
    table: list[tuple[object, str, object]] = [
        (torch, "autocast", ours),
        (torch.amp, "autocast", ours),
        (torch.amp, "GradScaler", GradScaler),
    ]
    for device_type, default in (("cpu", torch.bfloat16), ("cuda", torch.float16)):
        module = getattr(torch, device_type, None)
        amp_module = getattr(module, "amp", None)
        if amp_module is None:
            continue
        if hasattr(amp_module, "autocast"):
            table.append((amp_module, "autocast", _device_autocast_class(ours, device_type, default)))
        if hasattr(amp_module, "GradScaler"):
            table.append((amp_module, "GradScaler", _DEVICE_SCALERS[device_type]))
    return table


class TorchPatch:
    """One reversible patch of torch's AMP names; made by :func:`patch_torch`.

    ``start()`` replaces the names, ``stop()`` restores the exact objects that were there;
    also a context manager. One patch can be active at a time. Stopping a patch through
    which nothing ran in mixed precision warns (see :meth:`stop`).

    Example::

        >>> patch = patch_torch()
        >>> patch.start().active
        True
        >>> with torch.autocast("cpu"):
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> patch.stop(); patch.active, y.dtype
        (False, torch.bfloat16)
    """

    def __init__(self, policy: Policy | None = None, fp8: Recipe | None = None) -> None:
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a dispatch_amp.Policy or None, got {type(policy).__name__}")
        if fp8 is not None and not isinstance(fp8, Recipe):
            raise TypeError(f"fp8 must be a dispatch_amp.fp8 recipe or None, got {type(fp8).__name__}")
        if policy is not None and fp8 is None:
            # Refused here, as autocast refuses it, not at the user's first torch.autocast.
            _with_fp8(policy, None)
        self.policy = policy
        self.fp8 = fp8
        self._saved: list[tuple[object, str, object]] | None = None
        self._uses = _Uses()

    @property
    def active(self) -> bool:
        """Whether this patch is started and not yet stopped.

        Example::

            >>> patch_torch().active
            False
        """
        return self._saved is not None

    def start(self) -> TorchPatch:
        """Replace torch's AMP names with ours; returns the patch.

        Example::

            >>> with patch_torch() as patch, torch.autocast("cpu"):
            ...     torch.amp.GradScaler.__module__
            'dispatch_amp.torch_patch'
        """
        global _ACTIVE_USES
        uses = _Uses()  # each start counts afresh
        table = _replacements(self.policy, self.fp8, uses)
        # One lock for every patch: the check and the writes of one start() or stop() must
        # not interleave with another thread's, or a patch saves another's replacements
        # as torch's originals and torch stays patched after both stop.
        with _SWAP_LOCK:
            if self._saved is not None:
                raise RuntimeError("this patch is already started; call stop() before starting it again")
            for module, name, _ in table:
                if getattr(getattr(module, name), _MARK, False):
                    raise RuntimeError(
                        f"{module.__name__}.{name} is already patched by another "
                        "dispatch_amp.patch_torch(); stop that patch (patch.stop() or leave its "
                        "with-block) before starting a new one"
                    )
            saved = [(module, name, getattr(module, name)) for module, name, _ in table]
            for module, name, replacement in table:
                setattr(module, name, replacement)
            self._saved = saved
            self._uses = uses
            _ACTIVE_USES = uses
        return self

    def stop(self) -> None:
        """Put back every attribute exactly as it was before ``start()``.

        Warns (``AmpNumericsWarning``) when nothing ran in mixed precision through the
        patch: no region entered through the patched autocast names (a region that
        disabled itself, ``"cuda"`` without CUDA, does not count), and no enabled
        scaler made through the patched names ran ``scale()`` or ``step()``.

        Example::

            >>> patch = patch_torch().start()
            >>> with torch.autocast("cpu", enabled=False):   # entered: the code chose autocast
            ...     pass
            >>> patch.stop()
            >>> torch.autocast is torch.amp.autocast_mode.autocast
            True
        """
        self._stop(propagating=False)

    def _stop(self, propagating: bool) -> None:
        """``stop()``'s work; ``propagating``: an exception is leaving the with-block.
        Called from ``stop()`` or ``__exit__`` only: the warnings' stacklevel 3 is their caller."""
        global _ACTIVE_USES
        with _SWAP_LOCK:
            if self._saved is None:
                raise RuntimeError("stop() was called on a patch that is not started; call start() first")
            installed = torch.amp.autocast
            for module, name, original in reversed(self._saved):
                setattr(module, name, original)
            self._saved = None
            if _ACTIVE_USES is self._uses:
                _ACTIVE_USES = None
        uses = self._uses
        # With an exception on its way out the user has a bigger problem than this one,
        # and the run may have ended before its first forward.
        if not propagating and not uses.reached_anything() and uses.disabled is not None:
            warnings.warn(
                "patch_torch() stopped with every torch.autocast region entered under it disabled "
                f"by itself ({uses.disabled}) and no enabled torch.amp.GradScaler stepped: nothing "
                "ran in mixed precision. Name a device this machine has (torch.autocast('cpu') "
                "where there is no GPU) and a float16/bfloat16 dtype.",
                AmpNumericsWarning,
                stacklevel=3,
            )
        elif not propagating and not uses.reached_anything():
            warnings.warn(
                "patch_torch() stopped without any torch.autocast region entered or any enabled "
                "torch.amp.GradScaler stepped under it: nothing ran in mixed precision. The code "
                "may choose its own context (contextlib.nullcontext() on CPU, say) or have bound "
                "torch.autocast before the patch started; open dispatch_amp.autocast(...) around "
                "the forward, make the code take its torch.autocast branch, or start the patch "
                "before importing that code.",
                AmpNumericsWarning,
                stacklevel=3,
            )
        if getattr(installed, "_checkpointed_under_policy", False):
            warnings.warn(
                f"torch.utils.checkpoint ran under this patch with "
                f"{_what_the_patch_applies(self)}: its recomputation reopens torch.amp.autocast, which "
                f"is dispatch_amp's only while the patch is active. A backward() run after "
                f"stop() would recompute under native torch.autocast, with other casts than "
                f"the forward's. Run backward inside the patch, or use dispatch_amp.checkpoint.",
                AmpNumericsWarning,
                stacklevel=3,
            )

    def __enter__(self) -> TorchPatch:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop(propagating=exc_type is not None)

    def __repr__(self) -> str:
        fp8 = "" if self.fp8 is None else f", fp8={self.fp8!r}"
        return f"TorchPatch(active={self.active}, policy={self.policy and self.policy.name!r}{fp8})"


def _what_the_patch_applies(patch: TorchPatch) -> str:
    parts = [] if patch.policy is None else [f"policy {patch.policy.name!r}"]
    if patch.fp8 is not None:
        parts.append(f"fp8={type(patch.fp8).__name__}")
    return " and ".join(parts)


def patch_torch(policy: Policy | None = None, fp8: Recipe | None = None) -> TorchPatch:
    """A patch that makes torch's AMP names (``torch.autocast``, ``torch.amp.GradScaler``, ...) ours.

    Use it as ``with amp.patch_torch(): ...`` or ``patch.start()`` / ``patch.stop()``.
    ``policy``: the op table the patched autocast applies (default: the device's).
    ``fp8``: an fp8 recipe every patched region applies (``autocast(..., fp8=)``); torch's
    checkpoint then recomputes in fp8 too.
    The module docstring lists exactly which attributes change and what cannot be reached.

    Stopping a patch through which nothing ran in mixed precision warns (``TorchPatch.stop``).

    Example::

        >>> import torch
        >>> with patch_torch():
        ...     scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         loss = torch.nn.Linear(4, 1)(torch.randn(2, 4)).float().sum()
        ...     scaler.scale(loss).backward()
        >>> type(scaler).__mro__[1].__module__, scaler.get_scale()
        ('dispatch_amp.scaler.grad_scaler', 8.0)
    """
    return TorchPatch(policy, fp8)
