"""Per-thread state of the open regions, and torch's autocast nesting counter.

``autocast`` pushes a frame (device type -> ``DeviceContext``) per region; the kernels of
``_kernels.py`` read the innermost one from ``STATE``. See "Note: the engine lives in the
dispatcher" in ``_engine.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch._C import DispatchKey
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from ._routing import Plan, plan_for
from .policy import Policy

_Tensor = torch.Tensor
# The cheap per-device test (t.is_cpu is several times faster than t.device.type).
_DEVICE_TESTS = {
    "cpu": _Tensor.is_cpu.__get__, "cuda": _Tensor.is_cuda.__get__,
    "xpu": _Tensor.is_xpu.__get__, "mps": _Tensor.is_mps.__get__,
}
# Native autocast's dispatch key per device type: torch.set_autocast_enabled(device_type,
# False) excludes it on the thread, which the kernels read to follow that switch.
_NATIVE_KEYS = {
    "cpu": DispatchKey.AutocastCPU, "cuda": DispatchKey.AutocastCUDA,
    "xpu": DispatchKey.AutocastXPU, "mps": DispatchKey.AutocastMPS,
}


@dataclass(frozen=True)
class DeviceContext:
    """What one ``autocast`` says for one device type."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    policy: Policy
    cache_enabled: bool
    # The fp8 recipe of the region (dispatch_amp.fp8), for the calls the policy marks fp8.
    fp8: object = None
    # Whether the context is kept for many regions (autocast's kept contexts): only such a
    # one keeps its views (below), which refer back to it; any other is freed, with its
    # recipe, as soon as its last region is.
    kept: bool = field(default=False, repr=False, compare=False)
    # t -> whether t lives on this device type; resolved once, used for every tensor cast.
    on_device: Callable[[torch.Tensor], bool] = field(init=False, repr=False, compare=False)
    # Whether the policy is not native autocast's table for this device type.
    custom: bool = field(init=False, repr=False, compare=False)
    # What the kernels do with each op under this policy on this device type (_routing.py).
    plan: Plan = field(init=False, repr=False, compare=False)
    # plan.handlers, read directly on the hot path.
    handlers: dict = field(init=False, repr=False, compare=False)
    # Native autocast's dispatch key for the device type (excluded on a thread where
    # torch.set_autocast_enabled switched it off).
    native_key: DispatchKey = field(init=False, repr=False, compare=False)
    # dtype -> this context with that dtype: what a region is where torch's dtype for
    # its device type was set to another by hand (_kernels.as_torch_says).
    by_dtype: dict = field(init=False, repr=False, compare=False)
    # nesting counter -> the View of a frame holding only this context (_engine._view):
    # everything in it follows from the context and the counter. None unless kept.
    views: dict | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        test = _DEVICE_TESTS.get(self.device_type)
        device_type = self.device_type
        object.__setattr__(self, "on_device", test if test is not None else (lambda t: t.device.type == device_type))
        native = Policy.for_device(device_type)
        object.__setattr__(self, "custom", self.policy is not native and self.policy._key != native._key)
        plan = plan_for(self.policy, device_type)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "handlers", plan.handlers)
        object.__setattr__(self, "native_key", _NATIVE_KEYS[self.device_type])
        object.__setattr__(self, "by_dtype", {})
        object.__setattr__(self, "views", {} if self.kept else None)


class View(NamedTuple):
    """What ``_engine._refresh`` writes into ``ThreadState`` while a region is innermost:
    everything it used to derive from the frame at every entry and exit, derived once."""

    # Enabled contexts of the frame, in frame order, and the one of them when it is alone.
    active: tuple
    primary: DeviceContext | None
    # The region's nesting counter (-1: no region).
    depth: int
    # ThreadState.top (see there), and the compiled engine's copy of it: set_top's arguments.
    top: tuple | None
    compiled_top: tuple
    # Whether the token must be looked up (a policy of one's own or an fp8 recipe active);
    # otherwise it is the built-in token.
    custom: bool
    # The fp8 recipe of the first active context that has one, or None.
    fp8_recipe: object


class Region(NamedTuple):
    """One open region, kept as one record so that it is pushed and popped in one step:
    a region opened in between (a signal handler, a finalizer) sees the stack either
    without it or with all of it, never with some of its parts."""

    # Device type -> DeviceContext in force in this region (the region's handle, too).
    frame: dict[str, DeviceContext]
    # torch's autocast nesting counter right after the region was entered.
    depth: int
    # The context the region itself opened.
    own: DeviceContext
    # What torch's state was before it (_engine.NativeState), restored when it closes.
    saved: object
    # What the kernels read while this region is innermost (derived from frame and depth
    # when the record is made, so that entering and leaving only copy it out).
    view: View


class ThreadState(threading.local):
    def __init__(self):
        # The open regions, outermost first; the last one's frame is in force.
        self.regions: list[Region] = []
        # Enabled contexts of the innermost frame; `primary` is set when there is exactly
        # one (the common case), so the hot path needs no device lookup.
        self.active: tuple[DeviceContext, ...] = ()
        self.primary: DeviceContext | None = None
        # regions[-1].depth: a deeper nesting counter means a native region inside our innermost.
        self.native_depth: int = -1
        # What the kernels read per call, in one read: (primary, native_depth, primary's
        # native key, device type, dtype and handlers) while there is a primary, else None.
        self.top: tuple | None = None
        # Whether this thread's dispatch-key state has our key switched on (_dispatch_key),
        # and what torch's "privateuseone" autocast dtype was before we first set it.
        self.key_on: bool = False
        self.token_saved = None
        # The fp8 function level (a TorchFunctionMode, only while a region with an fp8
        # recipe is in force: see _engine._Fp8Level) and the frame index that installed
        # it; frames that pushed it again where torch emptied the function-mode stack (an
        # autograd Function's backward), each taking it off when it closes.
        self.fp8_level: TorchFunctionMode | None = None
        self.fp8_installer: int = -1
        self.fp8_mode: TorchFunctionMode | None = None  # made on first use
        self.fp8_repushers: list[int] = []
        # >0 while dispatch_amp.checkpoint runs its function: it recomputes under our state.
        self.own_checkpoint: int = 0


STATE = ThreadState()


_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting


def native_nesting() -> int:
    # torch exposes the nesting counter only through increment/decrement.
    _increment_nesting()
    return _decrement_nesting()


def inside_native_region(st: ThreadState) -> bool:
    return native_nesting() > st.native_depth


_torch_compat.keep_out_of_dynamo(globals(), __name__)
