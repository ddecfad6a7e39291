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

import torch

from . import _engine
from .policy import Policy

__all__ = ["autocast", "is_autocast_enabled", "get_autocast_dtype"]

# device type -> (default dtype, supported dtypes), the one place these facts live.
_DEVICES: dict[str, tuple[torch.dtype, tuple[torch.dtype, ...]]] = {
    "cuda": (torch.float16, (torch.float16, torch.bfloat16)),
    "cpu": (torch.bfloat16, (torch.bfloat16, torch.float16)),
}


def _check_device_type(device_type) -> str:
    if isinstance(device_type, torch.device):
        raise TypeError(
            f"device_type must be a string such as 'cuda' or 'cpu', got torch.device "
            f"{str(device_type)!r}; pass device.type"
        )
    if not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a string, one of {sorted(_DEVICES)}, "
            f"got {type(device_type).__name__}"
        )
    if device_type not in _DEVICES:
        raise ValueError(
            f"unsupported device_type {device_type!r}: dispatch_amp.autocast supports "
            f"{sorted(_DEVICES)}"
        )
    return device_type


class autocast:
    """Context manager and decorator that runs ops in mixed precision.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; only floating tensors on this device type
            are cast.
        dtype: the lower precision, ``torch.float16`` or ``torch.bfloat16``; ``None``
            means the device's default (cuda: float16, cpu: bfloat16).
        enabled: ``False`` turns autocast off inside this region (also inside an outer
            enabled region).
        cache_enabled: cache the lower-precision copy of each weight (a leaf tensor that
            requires grad) for the outermost enabled region, so a weight used several
            times is cast once.
        policy: the op table to apply; ``None`` means ``Policy.for_device(device_type)``.
            ``Policy.for_device("cuda")`` with ``device_type="cpu"`` applies the CUDA
            table to CPU tensors.

    Contexts nest: the innermost one wins, and the outer state returns on exit, also when
    an exception escapes. State is per thread, like native autocast. As with native AMP,
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
    ):
        device_type = _check_device_type(device_type)
        default, supported = _DEVICES[device_type]
        if dtype is None:
            dtype = default
        elif not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        elif dtype not in supported:
            names = " or ".join(str(d) for d in supported)
            raise ValueError(
                f"autocast({device_type!r}) supports dtype {names}, got {dtype}; "
                f"to run in {dtype}, leave autocast off (enabled=False)"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be a bool, got {type(cache_enabled).__name__}")
        if policy is None:
            policy = Policy.for_device(device_type)
        elif not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a dispatch_amp.Policy (e.g. Policy.for_device('cuda')), "
                f"got {type(policy).__name__}"
            )
        self.device_type = device_type
        self.fast_dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.policy = policy
        self._entered = 0

    def _context(self) -> _engine.DeviceContext:
        return _engine.DeviceContext(
            self.device_type, self.enabled, self.fast_dtype, self.policy, self.cache_enabled
        )

    def __enter__(self) -> autocast:
        frame = dict(_engine.current_frame())
        frame[self.device_type] = self._context()
        _engine.push_frame(frame)
        self._entered += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._entered == 0:
            raise RuntimeError("autocast.__exit__ called without a matching __enter__")
        self._entered -= 1
        _engine.pop_frame()

    def __call__(self, func):
        """Decorates ``func`` (or a generator function) to run inside this context."""
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
            raise TypeError(
                "autocast cannot decorate a generator or coroutine function: the context "
                "would be open while the caller runs between yields; open it inside instead"
            )

        @functools.wraps(func)
        def decorated(*args, **kwargs):
            with autocast(
                self.device_type, self.fast_dtype, self.enabled, self.cache_enabled, self.policy
            ):
                return func(*args, **kwargs)

        return decorated

    def __repr__(self) -> str:
        return (
            f"autocast({self.device_type!r}, dtype={self.fast_dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}, policy={self.policy.name!r})"
        )


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether a ``dispatch_amp.autocast`` region is enabled for ``device_type`` here.

    Example::

        with amp.autocast("cpu"):
            assert amp.is_autocast_enabled("cpu") and not amp.is_autocast_enabled("cuda")
    """
    ctx = _engine.current_frame().get(_check_device_type(device_type))
    return bool(ctx and ctx.enabled)


def get_autocast_dtype(device_type: str = "cuda") -> torch.dtype:
    """The lower-precision dtype in force for ``device_type`` (its default outside any region).

    Example::

        amp.get_autocast_dtype("cpu")               # torch.bfloat16
        with amp.autocast("cpu", dtype=torch.float16):
            amp.get_autocast_dtype("cpu")           # torch.float16
    """
    ctx = _engine.current_frame().get(_check_device_type(device_type))
    return ctx.dtype if ctx is not None else _DEVICES[device_type][0]
