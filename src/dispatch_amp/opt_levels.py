"""Apex-style optimization levels: ``initialize(model, optimizer, opt_level)`` and ``scale_loss``.

Example::

    import dispatch_amp as amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")   # "O0".."O3"
    for x, y in data:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

The levels (``dtype`` is float16 or bfloat16, by default the device's autocast default)::

    level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
    O0     torch.float32    False                  None                 False           1.0
    O1     None             True                   None                 None            "dynamic"
    O2     dtype            False                  True                 True            "dynamic"
    O3     dtype            False                  False                False           1.0

Note: per-instance state, nothing global
----------------------------------------
Apex patched torch functions at import and kept module-level state. Here ``initialize``
changes only the objects it is given, and the state lives on them:

* model: parameters and buffers are cast in place (``p.data = ...``, so every reference
  to the ``Parameter``, the optimizer's included, stays valid); ``model.forward`` becomes
  an instance attribute, a :class:`_Forward` that casts inputs, enters
  ``dispatch_amp.autocast`` (O1's "patch_torch_functions") and casts outputs; a
  ``with`` block inside the wrapper closes the context also when the forward raises
  (a pre-hook/hook pair would leave it open). A cast model also gets a ``state_dict``
  post-hook (checkpoints hold fp32 values, the exact master weights where they exist)
  and a ``load_state_dict`` pre-hook (loaded fp32 values go into the master weights
  unrounded).
* optimizer: still the user's class and instance. At O2 its ``param_groups`` hold fp32
  master copies of the low-precision weights, so its state is keyed by (and in the dtype
  of) the master weights. ``optimizer.step`` becomes an instance attribute, a method
  bound to the optimizer (see "Note: skipping a step").
* ``model._dispatch_amp`` / ``optimizer._dispatch_amp`` hold the rest (one
  :class:`GradScaler` per loss id, shared by the optimizers of one ``initialize`` call).

Note: skipping a step
---------------------
``scale_loss`` decides on exit whether the gradients overflowed, but the user calls
``optimizer.step()`` afterwards, and a torch step pre-hook cannot cancel a step.
Restoring weights and optimizer state from a snapshot after the fact would cost a copy
of everything per step. So ``initialize`` sets ``optimizer.step`` on the instance to a
method bound to it (``types.MethodType``, as Apex did for one call, but permanently
and documented): it reads the overflow flag recorded by ``scale_loss`` (one host sync,
as ``GradScaler.step`` takes) and, on overflow, returns ``None`` without calling the
class's ``step``; otherwise it runs the class's ``step`` (pre/post hooks included) and,
at O2, copies the master weights into the model. Being a bound method matters: LR
schedulers wrap ``optimizer.step`` by taking its ``__func__`` and re-binding it, which
works on a bound method, so schedulers keep counting steps and never warn. A skipped
step never touches weights or optimizer state, so they stay bit-identical.
The flag of a static loss scale (``loss_scale=128.0``) is checked too: a step with
inf/nan gradients is skipped whatever the scale (Apex did the same); only the scale stays.
``loss_scale=1.0`` without master weights (O0, O3) means no scaler at all, as in Apex:
plain training, no check, no sync.

Note: one scaler iteration per scale_loss
-----------------------------------------
Each ``scale_loss`` block is one full :class:`GradScaler` iteration: ``scale`` on entry;
on exit (O2: model gradients copied into fp32 master gradients first) ``unscale_`` and
``update`` (the scale backs off or grows right away, as in Apex). Gradients that the
optimizer's parameters already hold on entry (accumulation over several losses or
micro-batches, or zeros from ``zero_grad(set_to_none=False)``) are set aside on entry and
added back after the unscale, so every gradient is unscaled exactly once, by its own
loss's scale. With ``zero_grad()``'s default (``set_to_none=True``) nothing is set aside.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
import weakref
from collections import abc
from dataclasses import dataclass

import torch
from torch import nn

from .autocast.context import autocast, device_dtypes
from .scaler.config import is_real
from .scaler.grad_scaler import GradScaler

__all__ = ["OptLevelProperties", "initialize", "scale_loss", "master_params", "loss_scalers", "state_dict", "load_state_dict"]

_LEVELS = ("O0", "O1", "O2", "O3")
_LOW = (torch.float16, torch.bfloat16)
# Floating dtypes initialize may cast; float64 is never cast (as in autocast).
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
_DYNAMIC = "dynamic"
_APEX_MAX_LOSS_SCALE = 2.0**24  # Apex's default ceiling for the dynamic scale
_UNSET = object()

# opt_level -> level defaults; "dtype" stands for the chosen low-precision dtype.
_TABLE = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=None, loss_scale=_DYNAMIC),
    "O2": dict(cast_model_type="dtype", patch_torch_functions=False, keep_batchnorm_fp32=True, master_weights=True, loss_scale=_DYNAMIC),
    "O3": dict(cast_model_type="dtype", patch_torch_functions=False, keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}
_LEVEL_HELP = (
    "'O0' (fp32 baseline), 'O1' (autocast around the forward), "
    "'O2' (low-precision model, fp32 master weights), 'O3' (everything low precision)"
)


# ----------------------------------------------------------------------------------------
# resolving a level's properties (OptLevelProperties.for_level)
# ----------------------------------------------------------------------------------------


def _level_default(opt_level: str, name: str, override):
    """``override``, or the level's table entry ``name`` where it is ``None``."""
    return _TABLE[opt_level][name] if override is None else override


def _check_opt_level(opt_level) -> None:
    if opt_level not in _LEVELS:
        hint = " (the letter O, not the digit 0)" if isinstance(opt_level, str) and opt_level[:1] == "0" else ""
        raise ValueError(f"unknown opt_level {opt_level!r}{hint}; valid levels: {_LEVEL_HELP}")


def _device_default_dtype(device_type: str, dtype, cast_model_outputs) -> torch.dtype:
    """The device's default low precision, after checking ``dtype`` and ``cast_model_outputs`` against it."""
    try:
        default_dtype, supported = device_dtypes(device_type)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"unsupported device type {device_type!r} for opt levels: {e}") from None
    for name, value in (("dtype", dtype), ("cast_model_outputs", cast_model_outputs)):
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype or None, got {type(value).__name__}")
    if dtype is not None and dtype not in supported:
        raise ValueError(f"dtype must be one of {list(supported)} on {device_type!r}, got {dtype}")
    if cast_model_outputs is not None and not cast_model_outputs.is_floating_point:
        raise ValueError(f"cast_model_outputs must be a floating dtype, got {cast_model_outputs}")
    return default_dtype


def _resolve_cast_model_type(opt_level: str, cast_model_type, dtype, default_dtype: torch.dtype):
    """``(cast_model_type, dtype)``: what the weights are cast to (``None``: not cast), and the low precision."""
    # None keeps the level's default; False and torch.float32 mean "do not cast".
    if cast_model_type is False:
        cast = None
    elif cast_model_type is None or cast_model_type is torch.float32:
        cast = cast_model_type
    elif cast_model_type in _LOW:
        if dtype is not None and dtype != cast_model_type:
            raise ValueError(
                f"cast_model_type={cast_model_type} contradicts dtype={dtype}: pass one of them "
                "(cast_model_type defaults to dtype at O2/O3)"
            )
        dtype = cast_model_type
        cast = cast_model_type
    else:
        raise ValueError(
            f"cast_model_type must be None, False, torch.float32, torch.float16 or torch.bfloat16, got {cast_model_type!r}"
        )
    dtype = default_dtype if dtype is None else dtype
    if cast_model_type is None:
        default = _TABLE[opt_level]["cast_model_type"]
        cast = dtype if default == "dtype" else default
    return cast, dtype


def _refuse_o1_overrides(cast, keep_batchnorm_fp32, master_weights) -> None:
    # Apex's checks: O1 casts around ops, never the weights themselves.
    if cast in _LOW:
        raise ValueError(
            f"cast_model_type={cast} makes no sense for opt_level 'O1': O1 keeps the model's "
            "weights fp32 and casts inside the forward (autocast). To cast the weights, use O2 or O3."
        )
    if keep_batchnorm_fp32 is not None:
        raise ValueError(
            f"keep_batchnorm_fp32={keep_batchnorm_fp32} makes no sense for opt_level 'O1': O1 does "
            "not cast the model, so its batch norms stay fp32 anyway (autocast picks each op's "
            "precision). Leave it None, or use O2/O3 to cast the model."
        )
    if master_weights:
        raise ValueError(
            "master_weights=True makes no sense for opt_level 'O1': O1 keeps the model's weights "
            "fp32, so they are their own master weights. For a low-precision model with fp32 "
            "master weights, use opt_level='O2'."
        )


def _check_bool_overrides(**overrides) -> None:
    for name, value in overrides.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r}")


def _resolve_keep_batchnorm_and_masters(opt_level: str, casts: bool, keep_batchnorm_fp32, master_weights):
    """``(keep_batchnorm_fp32, master_weights)``: both only mean something for a cast model."""
    if casts:
        keep_bn = bool(_level_default(opt_level, "keep_batchnorm_fp32", keep_batchnorm_fp32))
        return keep_bn, bool(_level_default(opt_level, "master_weights", master_weights))
    if keep_batchnorm_fp32 is not None:
        raise ValueError(
            f"keep_batchnorm_fp32={keep_batchnorm_fp32} makes no sense for opt_level {opt_level!r} "
            "with fp32 weights: no weight is cast, batch norms included. It applies to O2/O3."
        )
    if master_weights:
        raise ValueError(
            f"master_weights=True makes no sense for opt_level {opt_level!r} with fp32 weights: "
            "master weights are fp32 copies of low-precision weights. Use O2 (or cast_model_type=dtype)."
        )
    return None, False


def _resolve_loss_scale(opt_level: str, loss_scale, min_loss_scale, max_loss_scale):
    """``(loss_scale, max_loss_scale)``: a static scale as a float, or ``"dynamic"`` with Apex's ceiling by default."""
    scale = _level_default(opt_level, "loss_scale", loss_scale)
    if scale != _DYNAMIC:
        if not is_real(scale) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss_scale must be 'dynamic' or a finite float > 0, got {scale!r}")
        scale = float(scale)
        if min_loss_scale is not None or max_loss_scale is not None:
            raise ValueError(
                f"min_loss_scale/max_loss_scale bound a dynamic loss scale; loss_scale={scale} is static. "
                "Pass loss_scale='dynamic' or drop the bounds."
            )
    elif max_loss_scale is None:
        max_loss_scale = _APEX_MAX_LOSS_SCALE
    return scale, max_loss_scale


def _refuse_fp16_grads_without_masters(cast, master: bool, scale) -> None:
    if cast is torch.float16 and not master and (scale == _DYNAMIC or scale != 1.0):
        raise ValueError(
            f"loss_scale={scale!r} with float16 weights and no master weights: the gradients would "
            "be float16, and GradScaler (like torch's) refuses to unscale float16 gradients in place. "
            "Use master_weights=True (O2), loss_scale=1.0, or dtype=torch.bfloat16."
        )


@dataclass(frozen=True)
class OptLevelProperties:
    """The resolved properties of one optimization level (frozen; built by :meth:`for_level`).

    Fields follow Apex's names: ``cast_model_type`` (``None``/``torch.float32``: weights
    stay fp32; a low-precision dtype: weights are cast), ``patch_torch_functions`` (run
    the forward inside ``dispatch_amp.autocast``), ``keep_batchnorm_fp32`` (``None`` when
    the model is not cast), ``master_weights``, ``loss_scale`` (``"dynamic"`` or a
    float), plus ``dtype`` (the low precision), ``cast_model_outputs`` (``None``: fp32
    outputs when the model is cast, unchanged otherwise) and the dynamic scale's bounds.

    Example::

        >>> p = OptLevelProperties.for_level("O2", device_type="cpu")
        >>> p.cast_model_type, p.master_weights, p.loss_scale
        (torch.bfloat16, True, 'dynamic')
    """

    opt_level: str
    device_type: str
    dtype: torch.dtype
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: float | str
    cast_model_outputs: torch.dtype | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None

    def __post_init__(self) -> None:
        # for_level() resolves and explains; this only refuses inconsistent direct construction.
        if self.opt_level not in _LEVELS or self.dtype not in _LOW:
            raise ValueError(f"opt_level must be one of {_LEVELS} and dtype one of {_LOW}; use OptLevelProperties.for_level()")
        if self.cast_model_type not in (None, torch.float32, *_LOW):
            raise ValueError(f"cast_model_type must be None, torch.float32 or one of {_LOW}, got {self.cast_model_type}")
        if self.master_weights and not self.casts_model:
            raise ValueError("master_weights=True needs a low-precision cast_model_type; use OptLevelProperties.for_level()")

    @property
    def casts_model(self) -> bool:
        """Whether the model's weights are cast to ``dtype`` (O2, O3)."""
        return self.cast_model_type in _LOW

    @property
    def uses_scaler(self) -> bool:
        """Whether ``scale_loss`` runs a GradScaler (anything but a plain static 1.0)."""
        return self.loss_scale == _DYNAMIC or self.loss_scale != 1.0 or self.master_weights

    @classmethod
    def for_level(
        cls,
        opt_level: str = "O1",
        *,
        device_type: str = "cpu",
        dtype: torch.dtype | None = None,
        cast_model_type=None,
        patch_torch_functions: bool | None = None,
        keep_batchnorm_fp32: bool | None = None,
        master_weights: bool | None = None,
        loss_scale: float | str | None = None,
        cast_model_outputs: torch.dtype | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
    ) -> OptLevelProperties:
        """The level's table row with the given overrides applied; ``None`` keeps the default.

        Raises ``ValueError`` for an unknown level and for an override that makes no
        sense for the level, naming why and what to do instead.

        Example::

            >>> OptLevelProperties.for_level("O1", loss_scale=128.0).loss_scale
            128.0
            >>> OptLevelProperties.for_level("O1", master_weights=True)
            Traceback (most recent call last):
            ...
            ValueError: master_weights=True makes no sense for opt_level 'O1': ...
        """
        _check_opt_level(opt_level)
        default_dtype = _device_default_dtype(device_type, dtype, cast_model_outputs)
        cast, dtype = _resolve_cast_model_type(opt_level, cast_model_type, dtype, default_dtype)
        if opt_level == "O1":
            _refuse_o1_overrides(cast, keep_batchnorm_fp32, master_weights)
        _check_bool_overrides(
            patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights
        )
        keep_bn, master = _resolve_keep_batchnorm_and_masters(opt_level, cast in _LOW, keep_batchnorm_fp32, master_weights)
        scale, max_loss_scale = _resolve_loss_scale(opt_level, loss_scale, min_loss_scale, max_loss_scale)
        _refuse_fp16_grads_without_masters(cast, master, scale)
        return cls(
            opt_level=opt_level,
            device_type=device_type,
            dtype=dtype,
            cast_model_type=cast,
            patch_torch_functions=_level_default(opt_level, "patch_torch_functions", patch_torch_functions),
            keep_batchnorm_fp32=keep_bn,
            master_weights=master,
            loss_scale=scale,
            cast_model_outputs=cast_model_outputs,
            min_loss_scale=None if min_loss_scale is None else float(min_loss_scale),
            max_loss_scale=None if max_loss_scale is None else float(max_loss_scale),
        )

    def make_scaler(self) -> GradScaler | None:
        """A fresh GradScaler for one loss id, or ``None`` where the level needs none.

        Example::

            >>> OptLevelProperties.for_level("O2").make_scaler().get_scale()
            65536.0
        """
        if not self.uses_scaler:
            return None
        # The level's table gives it a loss scale whatever the dtype: choosing the level
        # chose the scaler, so the "not needed with bfloat16" warning would only be noise.
        if self.loss_scale == _DYNAMIC:
            return GradScaler(self.device_type, min_scale=self.min_loss_scale, max_scale=self.max_loss_scale, warn_bf16=False)
        # Static: the scale is reset by update(new_scale=...) after every scale_loss.
        return GradScaler(self.device_type, init_scale=self.loss_scale, warn_bf16=False)


# ----------------------------------------------------------------------------------------
# model side
# ----------------------------------------------------------------------------------------


def _cast_floating(obj, dtype: torch.dtype):
    """``obj`` with every float32/16-bit tensor in it (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype in _CASTABLE and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floating(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(v, dtype) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _cast_floating(v, dtype)) for k, v in obj.items())
    return obj


class _Forward:
    """``module.forward`` after ``initialize``: cast inputs, maybe autocast, cast outputs.

    An instance attribute of the module (``del module.forward`` restores the class's). It
    holds the module itself rather than its bound ``forward`` so that ``copy.deepcopy``
    and pickling rebind it to the copy.
    """

    def __init__(self, module: nn.Module, inner, input_dtype, output_dtype, autocast_args) -> None:
        self.module = module
        self.inner = inner  # an instance-level forward that was there before, else None
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.autocast_args = autocast_args  # (device_type, dtype) or None

    def __call__(self, *args, **kwargs):
        forward = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        if self.input_dtype is not None:
            args, kwargs = _cast_floating(args, self.input_dtype), _cast_floating(kwargs, self.input_dtype)
        if self.autocast_args is not None:
            with autocast(*self.autocast_args):
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)


class _ModelAmp:
    """What ``initialize`` attached to one model (``model._dispatch_amp``)."""

    def __init__(self, props: OptLevelProperties, masters_by_name: dict[str, nn.Parameter]) -> None:
        self.props = props
        self.masters_by_name = masters_by_name  # state_dict key (relative) -> fp32 master


def _state_dict_fp32(module, state_dict, prefix, local_metadata) -> None:
    # state_dict post-hook of a cast model: fp32 values, the exact master where it still
    # rounds to the weight (a deep copy whose weights were changed since, e.g. an EMA
    # model, falls back to the cast weight). keep_vars=True callers get the objects.
    amp = module.__dict__.get("_dispatch_amp")
    if amp is None or any(isinstance(v, nn.Parameter) for v in state_dict.values()):
        return
    for key, value in list(state_dict.items()):
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor) or value.dtype not in _LOW:
            continue
        master = amp.masters_by_name.get(key[len(prefix):])
        if master is not None and master.shape == value.shape and torch.equal(master.detach().to(value.dtype), value):
            state_dict[key] = master.detach()
        else:
            state_dict[key] = value.float()


def _load_into_masters(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    # load_state_dict pre-hook: fp32 values reach the master weights unrounded; the
    # ordinary load then rounds them into the model's weights, so the two agree.
    amp = module.__dict__.get("_dispatch_amp")
    if amp is None:
        return
    with torch.no_grad():
        for name, master in amp.masters_by_name.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == master.shape:
                master.copy_(value)


def _params_to_cast(model: nn.Module, props: OptLevelProperties):
    """(module, name, param) of every parameter that the level casts to ``props.dtype``."""
    if not props.casts_model:
        return
    for module in model.modules():
        if props.keep_batchnorm_fp32 and isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name, p in module._parameters.items():
            if p is not None and p.dtype in _CASTABLE and p.dtype != props.dtype:
                yield module, name, p


def _cast_model_(model: nn.Module, props: OptLevelProperties) -> None:
    if not props.casts_model:
        return
    with torch.no_grad():
        for _, _, p in list(_params_to_cast(model, props)):
            # .data keeps the Parameter object, so the optimizer's references stay valid.
            p.data = p.data.to(props.dtype)
            if p.grad is not None:
                p.grad = p.grad.to(props.dtype)
        for module in model.modules():
            if props.keep_batchnorm_fp32 and isinstance(module, nn.modules.batchnorm._BatchNorm):
                continue
            for name, b in module._buffers.items():
                if b is not None and b.dtype in _CASTABLE and b.dtype != props.dtype:
                    module._buffers[name] = b.to(props.dtype)


# ----------------------------------------------------------------------------------------
# optimizer side
# ----------------------------------------------------------------------------------------


class _Handle:
    """Shared by the models and optimizers of one ``initialize`` call."""

    def __init__(self, props: OptLevelProperties, num_losses: int) -> None:
        self.props = props
        self.scalers = [props.make_scaler() for _ in range(num_losses)]


class _Latest:
    """The handle of the last ``initialize`` call, as Apex's module-level state keeps it
    (a weak reference: it holds nothing alive; scripts written for Apex checkpoint it)."""

    handle = None


_LATEST = _Latest()


class _OptimizerAmp:
    """What ``initialize`` attached to one optimizer (``optimizer._dispatch_amp``)."""

    def __init__(self, handle: _Handle, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.handle = handle
        self.pairs = pairs  # (low-precision model parameter, its fp32 master) at O2
        self.model_params = [p for p, _ in pairs]
        self.masters = [m for _, m in pairs]
        self.found_inf: torch.Tensor | None = None  # overflow flag of the scale_loss calls since the last step

    def copy_grads_to_masters(self) -> None:
        # Still scaled: the scaler unscales the fp32 master gradients next (never the
        # 16-bit ones, where the unscale itself would lose precision). The model's
        # gradients are dropped, so the next backward starts from None.
        for p, m in self.pairs:
            if p.grad is not None:
                m.grad = p.grad.to(torch.float32)
                p.grad = None

    def drop_model_grads(self) -> None:
        for p in self.model_params:
            p.grad = None

    def step(self, optimizer, args, kwargs):
        closure = args[0] if args else kwargs.get("closure")
        if closure is not None and (self.pairs or self.handle.props.uses_scaler):
            raise RuntimeError(
                "optimizer.step(closure) is not supported with master weights or loss scaling: the "
                "closure's backward would run outside amp.scale_loss. Compute the loss, run its "
                "backward inside `with amp.scale_loss(loss, optimizer)`, then call optimizer.step()."
            )
        found, self.found_inf = self.found_inf, None
        if found is not None and bool(found.item()):  # one host sync, as GradScaler.step
            return None
        if any(p.grad is not None for p in self.model_params):
            raise RuntimeError(
                "optimizer.step() found gradients on the low-precision model parameters: at this "
                f"opt_level ({self.handle.props.opt_level}) the optimizer updates fp32 master weights, "
                "whose gradients are filled on exit from amp.scale_loss. Run backward inside "
                "`with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()`."
            )
        retval = type(optimizer).step(optimizer, *args, **kwargs)
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.masters)
        return retval


def _amp_step(self, *args, **kwargs):
    """``optimizer.step`` after ``amp.initialize``: skips after an overflow, copies masters back.

    Bound to the optimizer instance (see "Note: skipping a step" in dispatch_amp.opt_levels).
    """
    return self._dispatch_amp.step(self, args, kwargs)


# ----------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------


def _as_list(objs, kind, what: str):
    is_list = isinstance(objs, (list, tuple))
    items = list(objs) if is_list else [objs]
    if not items:
        raise ValueError(f"{what} must not be empty")
    for obj in items:
        if not isinstance(obj, kind):
            raise TypeError(f"{what} must be a {kind.__module__}.{kind.__qualname__} or a list of them, got {type(obj).__name__}")
    if len({id(o) for o in items}) != len(items):
        raise ValueError(f"{what} lists the same object twice")
    return items, is_list


def _device_type(models: list[nn.Module]) -> str:
    types_ = {t.device.type for m in models for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()}
    if len(types_) > 1:
        raise ValueError(f"initialize() needs every model on one device type, found {sorted(types_)}; move them first")
    return types_.pop() if types_ else "cpu"


def _as_given(items: list, is_list: bool):
    return items if is_list else items[0]


def _refuse_second_initialize(model_list: list[nn.Module], opt_list: list[torch.optim.Optimizer]) -> None:
    for m in model_list:
        if "_dispatch_amp" in m.__dict__:
            raise RuntimeError(
                f"initialize() was already called on this model ({type(m).__name__}, opt_level "
                f"{m._dispatch_amp.props.opt_level}); call it once per model, with all its optimizers."
            )
    for o in opt_list:
        if "_dispatch_amp" in o.__dict__:
            raise RuntimeError(
                f"initialize() was already called on this optimizer ({type(o).__name__}); call it once, "
                "with the models whose parameters it updates."
            )
        if "step" in o.__dict__:
            raise RuntimeError(
                f"this {type(o).__name__}'s step is already wrapped on the instance (by an LR scheduler, "
                "or another library); initialize() must wrap it first. Create LR schedulers after "
                "amp.initialize()."
            )


def _fp32_masters(
    model_list: list[nn.Module], opt_list: list[torch.optim.Optimizer], props: OptLevelProperties
) -> dict[int, nn.Parameter]:
    """``id(parameter) -> fp32 master`` for each optimizer parameter that ends up low precision.

    Empty unless the level keeps master weights. Call it before the models are cast.
    """
    masters: dict[int, nn.Parameter] = {}
    if not props.master_weights:
        return masters
    model_param_ids = {id(p) for m in model_list for p in m.parameters()}
    will_be_low = {id(p) for m in model_list for _, _, p in _params_to_cast(m, props)}
    will_be_low |= {id(p) for m in model_list for p in m.parameters() if p.dtype in _LOW}
    for i, o in enumerate(opt_list):
        for g, group in enumerate(o.param_groups):
            for p in group["params"]:
                if id(p) not in model_param_ids:
                    raise ValueError(
                        f"optimizer {i} ({type(o).__name__}), param group {g}, holds a parameter of shape "
                        f"{tuple(p.shape)} that belongs to none of the models passed to initialize(): at "
                        f"opt_level {props.opt_level} its fp32 master weight could not be kept in step with a "
                        "model. Pass every model whose parameters the optimizer updates."
                    )
                if id(p) in will_be_low and id(p) not in masters:
                    # From the fp32 values before the cast: masters start exact, not rounded.
                    masters[id(p)] = nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
    return masters


def _prepare_model(model: nn.Module, props: OptLevelProperties, masters: dict[int, nn.Parameter]) -> None:
    """Cast ``model`` in place, wrap its forward where the level needs it, hook its state_dict."""
    _cast_model_(model, props)
    by_name = {name: masters[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in masters}
    model._dispatch_amp = _ModelAmp(props, by_name)
    input_dtype = props.dtype if props.casts_model else None
    output_dtype = props.cast_model_outputs or (torch.float32 if props.casts_model else None)
    autocast_args = (props.device_type, props.dtype) if props.patch_torch_functions else None
    if input_dtype is not None or output_dtype is not None or autocast_args is not None:
        model.forward = _Forward(model, model.__dict__.get("forward"), input_dtype, output_dtype, autocast_args)
    if props.casts_model:
        model.register_state_dict_post_hook(_state_dict_fp32)
        model.register_load_state_dict_pre_hook(_load_into_masters)


def _prepare_optimizer(optimizer: torch.optim.Optimizer, handle: _Handle, masters: dict[int, nn.Parameter]) -> None:
    """Put the masters into ``optimizer``'s param groups (its state re-keyed to them) and wrap its step."""
    pairs = []
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            master = masters.get(id(p))
            if master is None:
                new_params.append(p)
                continue
            pairs.append((p, master))
            new_params.append(master)
            if p in optimizer.state:
                state = optimizer.state.pop(p)
                optimizer.state[master] = {k: v.float() if torch.is_tensor(v) and v.dtype in _LOW else v for k, v in state.items()}
        group["params"] = new_params
    optimizer._dispatch_amp = _OptimizerAmp(handle, pairs)
    optimizer.step = types.MethodType(_amp_step, optimizer)


def initialize(
    models,
    optimizers=None,
    opt_level: str = "O1",
    *,
    dtype: torch.dtype | None = None,
    cast_model_type=None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
):
    """Prepare models and optimizers for mixed-precision training at an Apex opt level.

    Args:
        models: a ``nn.Module`` or a list of them (already on their device).
        optimizers: a ``torch.optim.Optimizer``, a list of them, or ``None``.
        opt_level: ``"O0"`` (fp32 baseline), ``"O1"`` (fp32 model, forward inside
            ``dispatch_amp.autocast``, dynamic loss scale), ``"O2"`` (model in ``dtype``
            except batch norms, fp32 master weights updated by the optimizer and copied
            back after each step, inputs cast to ``dtype`` and outputs returned in fp32,
            dynamic loss scale) or ``"O3"`` (everything in ``dtype``, loss scale 1.0).
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None``: the autocast default of
            the models' device (cpu bfloat16, cuda float16).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs, min_loss_scale, max_loss_scale: per-property
            overrides as in Apex (see :class:`OptLevelProperties`); one that makes no
            sense for the level raises ``ValueError``.
        num_losses: number of losses, each with its own GradScaler (``loss_id`` of
            :func:`scale_loss`).

    Returns ``models`` (as given: one object or a list) when ``optimizers`` is ``None``,
    else ``(models, optimizers)``. The same objects, modified in place: the optimizer is
    still an instance of its own class, so LR schedulers, ``param_groups`` and
    ``state_dict`` work unchanged. Create LR schedulers after ``initialize``.

    Example::

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2")   # bf16 on CPU
        model[0].weight.dtype, model[1].weight.dtype              # bfloat16, float32
        next(amp.master_params(opt)).dtype                        # float32
    """
    model_list, models_is_list = _as_list(models, nn.Module, "models")
    if optimizers is None:
        opt_list, opts_is_list = [], False
    else:
        opt_list, opts_is_list = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    _refuse_second_initialize(model_list, opt_list)
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, got {num_losses!r}")
    props = OptLevelProperties.for_level(
        opt_level,
        device_type=_device_type(model_list),
        dtype=dtype,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )
    # Everything is validated before anything changes, so a refused call leaves the
    # objects as they were; the masters come first, from the weights before the cast.
    masters = _fp32_masters(model_list, opt_list, props)
    for m in model_list:
        _prepare_model(m, props, masters)
    handle = _Handle(props, num_losses)
    _LATEST.handle = weakref.ref(handle)
    for o in opt_list:
        _prepare_optimizer(o, handle, masters)

    if optimizers is None:
        return _as_given(model_list, models_is_list)
    return _as_given(model_list, models_is_list), _as_given(opt_list, opts_is_list)


def _optimizer_amp(optimizer, funcname: str) -> _OptimizerAmp:
    amp = getattr(optimizer, "__dict__", {}).get("_dispatch_amp")
    if amp is None:
        raise RuntimeError(
            f"{funcname}() got an optimizer ({type(optimizer).__name__}) that amp.initialize() has not "
            "prepared; pass it to amp.initialize(model, optimizer, opt_level=...) first."
        )
    return amp


def _prepared_optimizers(optimizers, loss_id) -> tuple[list, list[_OptimizerAmp], _Handle]:
    """``(optimizers, their _OptimizerAmp, their shared _Handle)``, after checking them and ``loss_id``."""
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    opts = list({id(o): o for o in opts}.values())
    if not opts:
        raise ValueError("scale_loss() needs at least one optimizer")
    amps = [_optimizer_amp(o, "scale_loss") for o in opts]
    handle = amps[0].handle
    if any(a.handle is not handle for a in amps):
        raise ValueError(
            "scale_loss() got optimizers prepared by different initialize() calls; their losses have "
            "different scalers. Use one block per initialize() call, or initialize them together."
        )
    if not isinstance(loss_id, int) or not 0 <= loss_id < len(handle.scalers):
        raise ValueError(f"loss_id must be an int in [0, {len(handle.scalers)}) (num_losses={len(handle.scalers)}), got {loss_id!r}")
    return opts, amps, handle


def _refuse_model_grads_on_entry(amps: list[_OptimizerAmp]) -> None:
    for a in amps:
        if any(p.grad is not None for p in a.model_params):
            raise RuntimeError(
                "scale_loss() found gradients on the low-precision model parameters on entry: a backward "
                "ran outside amp.scale_loss. At this opt_level every backward must run inside the block, "
                "which moves the gradients into the fp32 master weights."
            )


def _params_of(opts: list) -> abc.Iterator[torch.Tensor]:
    for o in opts:
        yield from master_params(o)


def _set_aside_grads(opts: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``id(param) -> (param, the gradient it held on entry)``; those params are left without one."""
    # Moved, not copied: they are added back after the unscale ("Note: one scaler
    # iteration per scale_loss"), so each gradient is unscaled only by its own loss's scale.
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for p in _params_of(opts):
        if p.grad is not None and id(p) not in stash:
            stash[id(p)] = (p, p.grad)
            p.grad = None
    return stash


def _restore_entry_grads(opts: list, amps: list[_OptimizerAmp], stash: dict) -> None:
    # A block that raised leaves the gradients as they were on entry; half-finished ones are dropped.
    for a in amps:
        a.drop_model_grads()
    for p in _params_of(opts):
        p.grad = None
    for p, g in stash.values():
        p.grad = g


def _unscale_and_update(scaler: GradScaler, opts: list, amps: list[_OptimizerAmp], loss_scale) -> None:
    """End the scaler iteration: unscale, update the scale, and record any overflow for the next step."""
    scaler.unscale_(*opts)
    flags = [f for o in opts for f in scaler.found_inf_per_device(o).values()]
    if loss_scale != _DYNAMIC:
        scaler.update(new_scale=loss_scale)  # static: the flag still skips the step
    elif flags:
        scaler.update()
    else:  # no parameter got a gradient: nothing to judge, keep the scale, end the iteration
        scaler.update(new_scale=scaler.scale_tensor().clone())
    if flags:
        device = flags[0].device
        found = torch.stack([f.to(device) for f in flags]).sum() if len(flags) > 1 else flags[0]
        for a in amps:
            a.found_inf = found if a.found_inf is None else a.found_inf + found


def _add_back_grads(stash: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for p, old in stash.values():
            if p.grad is not None:
                old.add_(p.grad)
            p.grad = old


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers, loss_id: int = 0):
    """Context manager yielding ``loss`` times its scale; on exit unscale and check.

    Run ``backward()`` of the yielded tensor inside the block. On exit (O2: after the
    model's gradients are copied into the fp32 master gradients) the optimizers'
    gradients are unscaled and checked for inf/nan by loss ``loss_id``'s GradScaler,
    whose scale is then updated; after an overflow the next ``optimizer.step()`` is
    skipped (see "Note: skipping a step"). Gradients are ready for clipping after the
    block (``amp.master_params(optimizer)``). Several blocks before one step accumulate.

    Args:
        loss: the loss tensor.
        optimizers: an optimizer prepared by :func:`initialize`, or a list of them (one
            overflow anywhere skips the step of all of them, as in Apex).
        loss_id: which loss's scaler to use, ``0 <= loss_id < num_losses``.

    Example::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
    """
    opts, amps, handle = _prepared_optimizers(optimizers, loss_id)
    scaler = handle.scalers[loss_id]
    _refuse_model_grads_on_entry(amps)
    stash = _set_aside_grads(opts)
    try:
        yield loss if scaler is None else scaler.scale(loss.float())
    except BaseException:
        _restore_entry_grads(opts, amps, stash)
        raise

    for a in amps:
        a.copy_grads_to_masters()
    if scaler is not None:
        _unscale_and_update(scaler, opts, amps, handle.props.loss_scale)
    _add_back_grads(stash)


def master_params(optimizer):
    """Yield the parameters the optimizer updates: the fp32 master weights at O2.

    Use it for gradient clipping after ``scale_loss`` (the gradients are unscaled then).

    Example::

        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    for group in optimizer.param_groups:
        yield from group["params"]


def loss_scalers(optimizer) -> list[GradScaler | None]:
    """The GradScalers of an initialized optimizer, one per loss id (``None``: no scaling).

    Save and restore them with the model and optimizer to resume with the same scale.

    Example::

        ckpt = {"scalers": [s.state_dict() for s in amp.loss_scalers(optimizer) if s]}
    """
    return list(_optimizer_amp(optimizer, "loss_scalers").handle.scalers)


def _latest_scalers(funcname: str) -> list[GradScaler | None]:
    handle = _LATEST.handle() if _LATEST.handle is not None else None
    if handle is None:
        raise RuntimeError(
            f"{funcname}() found no live amp.initialize() result: call amp.initialize(model, "
            f"optimizer, opt_level=...) first (it keeps the loss scalers this saves)."
        )
    return handle.scalers


def state_dict() -> dict[str, dict]:
    """The loss scalers of the last :func:`initialize`, as Apex's module-level ``amp.state_dict()``.

    ``{"loss_scaler0": {...}, ...}``, one entry per loss id (each a ``GradScaler.state_dict()``;
    levels without loss scaling save their static scale). Scripts written for Apex (timm's
    ``--apex-amp`` path among them) put this in their checkpoints and resume it with
    :func:`load_state_dict`.

    Example::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        checkpoint = {"model": model.state_dict(), "amp": amp.state_dict()}
    """
    return {
        f"loss_scaler{i}": (scaler.state_dict() if scaler is not None else {"loss_scale": 1.0})
        for i, scaler in enumerate(_latest_scalers("state_dict"))
    }


def load_state_dict(state: dict) -> None:
    """Restore :func:`state_dict` into the loss scalers of the last :func:`initialize`.

    Also takes Apex's own entries (``{"loss_scale": ..., "unskipped": ...}``: the scale, and
    the clean steps since the last change). Everything is checked before any scaler changes.

    Example::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        amp.load_state_dict(checkpoint["amp"])
    """
    scalers = _latest_scalers("load_state_dict")
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict() expects the dict amp.state_dict() returned, got {type(state).__name__}.")
    unknown = sorted(set(state) - {f"loss_scaler{i}" for i in range(len(scalers))})
    if unknown:
        raise ValueError(
            f"load_state_dict(): keys {unknown} name no loss scaler of the last initialize() "
            f"(it has {len(scalers)}: num_losses={len(scalers)})."
        )
    staged = []
    for i, scaler in enumerate(scalers):
        entry = state.get(f"loss_scaler{i}")
        if entry is None or scaler is None:
            continue
        if "loss_scale" in entry and "scale" not in entry:  # Apex's form
            sd = scaler.state_dict()
            sd.update(scale=entry["loss_scale"], _growth_tracker=entry.get("unskipped", 0))
            entry = sd
        probe = copy.deepcopy(scaler)
        probe.load_state_dict(entry)  # raises here, before any real scaler changed
        staged.append((scaler, entry))
    for scaler, entry in staged:
        scaler.load_state_dict(entry)
