"""GradScaler's configuration and its checkpoint form: validated once, in one place.

``ScalerConfig`` holds the growth/backoff rule (frozen; a change makes a new one, checked
again). :func:`parse_state_dict` reads a ``state_dict()`` (ours or torch's) into a
:class:`LoadedState` and raises before anything is applied, so a failed load changes
nothing. Every value that becomes the scale is checked as the float32 the scale tensor
holds (docs/design.md, "Loss scaling").
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections import abc
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..kernels.scale_update import round_to_float32

__all__ = [
    "ScalerConfig", "LoadedState", "parse_state_dict", "as_number", "check_scale", "usable_scale", "FP32_TINY",
    "EmptyStateDictError", "MissingStateKeyError", "StateTensorShapeError",
]

# The smallest normal float32: below it a scale is subnormal or rounds to 0, and 1/scale
# overflows to inf or unscales gradients to nan.
FP32_TINY = torch.finfo(torch.float32).tiny
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


# The errors of a refused load where torch's scaler raises another built-in type: each is
# a subclass of both, so code written for torch's (``except RuntimeError``/``KeyError``)
# still catches ours, and code written for ours (``except ValueError``/``TypeError``) too.


class EmptyStateDictError(ValueError, RuntimeError):
    """``load_state_dict({})``: torch's scaler raises ``RuntimeError`` there, ours this
    subclass of both ``ValueError`` and ``RuntimeError``.

    Example::

        >>> issubclass(EmptyStateDictError, RuntimeError), issubclass(EmptyStateDictError, ValueError)
        (True, True)
    """


class MissingStateKeyError(ValueError, KeyError):
    """A state dict without one of torch's keys: torch's scaler raises ``KeyError`` there,
    ours this subclass of both ``ValueError`` and ``KeyError``.

    Example::

        >>> str(MissingStateKeyError("state_dict is missing the key 'scale'."))
        "state_dict is missing the key 'scale'."
    """

    # KeyError's str() is the repr of its argument; this one is a sentence.
    __str__ = ValueError.__str__


class StateTensorShapeError(TypeError, RuntimeError):
    """A tensor of more than one element where a number is loaded: torch's scaler raises
    ``RuntimeError`` from ``fill_`` there, ours this subclass of both ``TypeError`` and
    ``RuntimeError``.

    Example::

        >>> issubclass(StateTensorShapeError, RuntimeError), issubclass(StateTensorShapeError, TypeError)
        (True, True)
    """


def is_real(x: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def usable_scale(value: float) -> bool:
    """Whether ``value`` stored as the float32 scale is finite, normal and > 0.

    Example::

        >>> usable_scale(65536.0), usable_scale(1e-40), usable_scale(1e39)
        (True, False, False)
    """
    stored = round_to_float32(float(value))
    return math.isfinite(stored) and stored >= FP32_TINY


def as_number(name: str, value: Any) -> Any:
    """``value`` as it is, or the number a 0-d real tensor holds (torch's scaler takes those
    for ``init_scale``); ``TypeError`` naming ``name`` for any other tensor.

    Example::

        >>> as_number("init_scale", torch.tensor(1024.0)), as_number("init_scale", 8)
        (1024.0, 8)
    """
    if not isinstance(value, torch.Tensor):
        return value
    number = _number(value)
    if isinstance(number, torch.Tensor):
        raise TypeError(
            f"{name} must be a number or a 0-d real tensor, got a tensor of shape "
            f"{tuple(value.shape)} and dtype {value.dtype}; pass a float (tensor.item())."
        )
    return number


def check_scale(name: str, value) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a usable float32 scale.

    Example::

        >>> check_scale("init_scale", 1024.0)
    """
    if not is_real(value) or not usable_scale(value):
        raise ValueError(
            f"{name} must be a finite number in float32's normal range "
            f"[{FP32_TINY:.4g}, {torch.finfo(torch.float32).max:.4g}] (the scale is stored in "
            f"float32), got {value!r}."
        )


@dataclass(frozen=True)
class ScalerConfig:
    """The scale's update rule; validated when made.

    Example::

        >>> ScalerConfig(growth_interval=100).growth_interval
        100
        >>> ScalerConfig().replace(backoff_factor=0.25).backoff_factor
        0.25
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self):
        g, b = self.growth_factor, self.backoff_factor
        if not is_real(g) or not (math.isfinite(g) and g > 1.0):
            raise ValueError(f"growth_factor must be a finite float > 1.0, got {g!r}.")
        if not is_real(b) or not (0.0 < b < 1.0):
            raise ValueError(f"backoff_factor must be a float in (0, 1), got {b!r}.")
        if not is_int(self.growth_interval) or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}.")
        if not is_int(self.hysteresis) or self.hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}.")
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                check_scale(name, getattr(self, name))
        lo, hi = self.min_scale, self.max_scale
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_scale ({lo}) must not exceed max_scale ({hi}).")
        # Stored as plain Python numbers whatever numeric type came in.
        for name, cast in (("growth_factor", float), ("backoff_factor", float), ("growth_interval", int), ("hysteresis", int)):
            object.__setattr__(self, name, cast(getattr(self, name)))
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))

    def replace(self, **changes) -> ScalerConfig:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def check_within_bounds(self, name: str, scale: float) -> None:
        """Raise ``ValueError`` if ``scale`` lies outside ``[min_scale, max_scale]``."""
        lo, hi = self.min_scale, self.max_scale
        if (lo is not None and scale < lo) or (hi is not None and scale > hi):
            raise ValueError(f"{name} ({scale}) lies outside [min_scale, max_scale] = [{lo}, {hi}].")

    def state_dict(self) -> dict[str, Any]:
        """The configuration's keys of a scaler ``state_dict()``."""
        return dataclasses.asdict(self)


class LoadedState(NamedTuple):
    """What :func:`parse_state_dict` read: the configuration and the counters (``steps``:
    ``update()`` calls)."""

    config: ScalerConfig
    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    skipped_steps: int
    steps: int


def _number(value: Any) -> Any:
    """A 0-d real tensor as its Python number (torch's scaler loads a tensor ``scale`` or
    ``_growth_tracker`` with ``fill_``, which takes 0-d tensors); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() \
            and value.dtype is not torch.bool:
        return value.item()
    return value


def parse_state_dict(state_dict, current: ScalerConfig) -> LoadedState:
    """Read and validate a scaler ``state_dict()`` (ours or ``torch.amp.GradScaler``'s).

    Our keys that torch's dict lacks keep ``current``'s configuration (hysteresis, bounds)
    and start their trackers fresh. Raises ``TypeError``/``ValueError`` naming the key;
    where torch's scaler raises another type for the same dict (an empty dict, a missing
    key, a tensor of several elements), the error is a subclass of both (see
    :class:`EmptyStateDictError`).

    Example::

        >>> parse_state_dict({"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        ...                   "growth_interval": 10, "_growth_tracker": 3}, ScalerConfig()).scale
        8.0
    """
    if not isinstance(state_dict, abc.Mapping):
        raise TypeError(f"load_state_dict() expects a dict, got {type(state_dict).__name__}.")
    if len(state_dict) == 0:
        raise EmptyStateDictError(
            "The state dict is empty, possibly because it was saved from a disabled GradScaler "
            "(its state_dict() is {}): load the state dict of an enabled one."
        )
    for key in _TORCH_KEYS:
        if key not in state_dict:
            raise MissingStateKeyError(f"state_dict is missing the key {key!r}.")

    def tensor_shape(key, v):
        if isinstance(v, torch.Tensor):
            raise StateTensorShapeError(
                f"state_dict[{key!r}] must be a number or a 0-d real tensor, got a tensor of "
                f"shape {tuple(v.shape)} and dtype {v.dtype}."
            )

    def real(key):
        v = _number(state_dict[key])
        tensor_shape(key, v)
        if not is_real(v):
            raise TypeError(f"state_dict[{key!r}] must be a number, got {type(v).__name__}.")
        return float(v)

    def integer(key, default, low, high):
        v = _number(state_dict.get(key, default))
        # torch's scaler loads 2000.0 for growth_interval (and fails at update()): an
        # integral float is taken as the int it is, any other float refused here.
        if is_real(v) and not is_int(v) and float(v).is_integer():
            v = int(v)
        tensor_shape(key, v)
        if not is_int(v):
            raise TypeError(f"state_dict[{key!r}] must be an int, got {type(v).__name__} {v!r}.")
        if not low <= v <= high:
            raise ValueError(f"state_dict[{key!r}] must lie in [{low}, {high}], got {v}.")
        return int(v)

    def optional_real(key, default):
        v = _number(state_dict.get(key, default))
        if v is not None and not is_real(v):
            raise TypeError(f"state_dict[{key!r}] must be a number or None, got {type(v).__name__}.")
        return None if v is None else float(v)

    scale = real("scale")
    if not usable_scale(scale):
        raise ValueError(
            f"state_dict['scale'] must be finite, > 0 and in float32's normal range "
            f"(the scale is stored in float32; >= {FP32_TINY:.4g}), got {scale}."
        )
    int32_max, int64_max = 2**31 - 1, 2**63 - 1
    try:
        config = ScalerConfig(
            growth_factor=real("growth_factor"),
            backoff_factor=real("backoff_factor"),
            growth_interval=integer("growth_interval", None, 1, int32_max),
            hysteresis=integer("hysteresis", current.hysteresis, 1, int32_max),
            min_scale=optional_real("min_scale", current.min_scale),
            max_scale=optional_real("max_scale", current.max_scale),
        )
    except ValueError as e:
        raise ValueError(f"state_dict: {e}") from None
    growth_tracker = integer("_growth_tracker", None, 0, int32_max)
    hysteresis_tracker = integer("_hysteresis_tracker", config.hysteresis, 0, config.hysteresis)
    skipped_steps = integer("_skipped_steps", 0, 0, int64_max)
    # Without the count of steps (torch's dict, or ours from before it was kept) it
    # starts at the fewest steps that many skips took.
    steps = integer("_steps", skipped_steps, 0, int64_max)
    if skipped_steps > steps:
        raise ValueError(
            f"state_dict['_skipped_steps'] ({skipped_steps}) exceeds state_dict['_steps'] ({steps}): "
            "a step is skipped at most once. The dict is corrupt; load an intact one."
        )
    config.check_within_bounds("state_dict['scale']", scale)
    return LoadedState(config, scale, growth_tracker, hysteresis_tracker, skipped_steps, steps)
