"""Per-thread state of the open regions, and torch's autocast nesting counter.

``autocast`` pushes a frame (device type -> ``DeviceContext``) per region; the levels of
``_engine.py`` read the innermost one from ``STATE``. See "Note: cast where native casts"
in ``_engine.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _torch_compat
from ._routing import Routes, routes_for
from .policy import Policy

_Tensor = torch.Tensor
# The cheap per-device test (t.is_cpu is several times faster than t.device.type).
_DEVICE_TESTS = {
    "cpu": _Tensor.is_cpu.__get__, "cuda": _Tensor.is_cuda.__get__,
    "xpu": _Tensor.is_xpu.__get__, "mps": _Tensor.is_mps.__get__,
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
        object.__setattr__(self, "custom", self.policy is not native and self.policy._key != native._key)
        object.__setattr__(self, "routes", routes_for(self.policy))
        object.__setattr__(self, "autocast_key", _torch_compat.AUTOCAST_KEYS.get(device_type))


class ThreadState(threading.local):
    def __init__(self):
        # frames[i] maps device type -> DeviceContext; the last frame is in force.
        self.frames: list[dict[str, DeviceContext]] = []
        # depths[i]: torch's autocast nesting counter right after frame i was entered.
        self.depths: list[int] = []
        # owns[i]: the context region i itself opened; saved[i]: what torch's state was
        # before it (_engine.NativeState), restored when it closes.
        self.owns: list[DeviceContext] = []
        self.saved: list = []
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
        self.function_level: TorchFunctionMode | None = None
        self.function_installer: int = -1
        self.aten_level: TorchDispatchMode | None = None
        self.aten_installer: int = -1
        self.function_mode: TorchFunctionMode | None = None  # made on first use
        # Frames that pushed the installed function level again, where torch ran them
        # with an empty function-mode stack (see _engine._push_frame); each takes it off
        # when it closes.
        self.function_repushers: list[int] = []
        # Weight-cast cache: (id(src), dtype) -> (src, src._version, cast).
        self.cache: dict = {}
        # Python composites currently being expanded (guards against re-dispatch loops).
        self.expanding: set = set()
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
