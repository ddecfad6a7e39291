"""``install_amp``: make an ``accelerate.Accelerator`` use dispatch_amp's autocast and GradScaler.

accelerate takes no other autocast: ``AutocastKwargs`` passes only ``enabled`` and
``cache_enabled`` on to ``torch.autocast``. One call after creating the Accelerator, before
``prepare()``, changes that for this Accelerator only::

    accelerator = Accelerator(mixed_precision="bf16")     # or "fp16", or "no" with dtype=
    install_amp(accelerator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

What it changes on that Accelerator object (no class, no module is touched):

* ``prepare_model`` wraps each model's forward in ``dispatch_amp.autocast`` and converts
  its outputs to float32, where accelerate would wrap it in ``torch.autocast``;
  ``unwrap_model(keep_fp32_wrapper=False)`` still removes the wrapper.
* ``autocast()`` opens ``dispatch_amp.autocast`` (honouring ``AutocastKwargs``).
* ``scaler`` is our GradScaler for float16 (None for bfloat16): ``backward`` scales with it,
  prepared optimizers step and skip through it, ``save_state``/``load_state`` keep it.
* ``unscale_gradients`` unscales with it whenever there is a scaler, so
  ``clip_grad_norm_``/``clip_grad_value_`` see true gradients also where accelerate's own
  test (``mixed_precision == "fp16"`` with native AMP) would skip the unscale, such as
  float16 on CPU.
* ``native_amp`` is set False so that accelerate's own ``torch.autocast`` stays out.
* an fp8 recipe is registered for checkpointing: ``save_state``/``load_state`` keep its state.

Importing this module imports ``accelerate``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, convert_outputs_to_fp32

from ..autocast.context import autocast
from ..autocast.policy import BUILTIN_DEVICES, Policy
from ..fp8.recipes import Recipe
from ..scaler.grad_scaler import GradScaler
from .metrics import amp_metrics

__all__ = ["install_amp", "AmpHooks", "log_amp_metrics"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_OWN_PRECISION = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


def _resolve_dtype(accelerator: Accelerator, dtype: torch.dtype | str | None) -> torch.dtype:
    configured = accelerator.mixed_precision
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: use 'fp16', 'bf16', torch.float16 or torch.bfloat16")
        dtype = _DTYPES[dtype]
    if dtype is None:
        if configured not in _DTYPES:
            raise ValueError(
                f"the Accelerator was created with mixed_precision={configured!r} and no dtype "
                "was given; create it with mixed_precision='bf16' or 'fp16', or pass "
                "install_amp(accelerator, dtype=torch.bfloat16)"
            )
        return _DTYPES[configured]
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype={dtype}: dispatch_amp autocasts to torch.float16 or torch.bfloat16")
    if configured in _DTYPES and _DTYPES[configured] is not dtype:
        raise ValueError(
            f"dtype={dtype} contradicts the Accelerator's mixed_precision={configured!r}; "
            "leave dtype out, or create the Accelerator with the matching mixed_precision"
        )
    return dtype


class AmpHooks:
    """The methods :func:`install_amp` puts on one Accelerator; reachable as ``accelerator.dispatch_amp``.

    Attributes: ``device_type``, ``dtype``, ``policy``, ``scaler``, ``fp8``. ``policy`` is read
    at each forward of a prepared model: setting it (a resume's policy) takes effect at the next.

    Example::

        >>> from accelerate import Accelerator
        >>> hooks = install_amp(Accelerator(cpu=True), dtype="bf16")
        >>> hooks.dtype, hooks.scaler
        (torch.bfloat16, None)
    """

    def __init__(self, accelerator: Accelerator, dtype: torch.dtype, policy: Policy | None, scaler: Any,
                 fp8: Recipe | None = None) -> None:
        self.accelerator = accelerator
        self.device_type = accelerator.device.type
        self.dtype = dtype
        self.policy = policy
        self.scaler = scaler
        self.fp8 = fp8
        # The unbound originals: the instance attributes set by install_amp shadow them.
        self._prepare_model = type(accelerator).prepare_model

    def make_autocast(self, autocast_handler=None) -> autocast:
        """A ``dispatch_amp.autocast`` with this Accelerator's device, dtype, policy and ``AutocastKwargs``.

        Example::

            >>> from accelerate import Accelerator
            >>> install_amp(Accelerator(cpu=True), dtype="bf16").make_autocast()
            autocast('cpu', dtype=torch.bfloat16, enabled=True, cache_enabled=True, policy='cpu')
        """
        handler = autocast_handler if autocast_handler is not None else self.accelerator.autocast_handler
        options = handler.to_kwargs() if handler is not None else {}
        cache_enabled = options.get("cache_enabled")
        return autocast(
            self.device_type,
            self.dtype,
            enabled=options.get("enabled", True),
            cache_enabled=True if cache_enabled is None else cache_enabled,
            policy=self.policy,
            fp8=self.fp8,
        )

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """``Accelerator.prepare_model``, with the forward run under our autocast.

        Example::

            >>> from accelerate import Accelerator
            >>> accelerator = Accelerator(cpu=True); _ = install_amp(accelerator, dtype="bf16")
            >>> model = accelerator.prepare_model(torch.nn.Linear(4, 4))
            >>> model(torch.randn(2, 4)).dtype     # bfloat16 inside, float32 out
            torch.float32
        """
        if not getattr(model, "_is_accelerate_prepared", False) and model not in self.accelerator._models:
            self._wrap_forward(model)
        return self._prepare_model(self.accelerator, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        # The same layering as accelerate's own wrapper (float32 conversion outside, autocast
        # inside, the function under __wrapped__), so unwrap_model(keep_fp32_wrapper=False)
        # finds the original forward again.
        in_amp = self._policy_following(self.make_autocast())
        model._original_forward = model.forward
        if hasattr(model.forward, "__func__"):
            model.forward = MethodType(convert_outputs_to_fp32(in_amp(model.forward.__func__)), model)
        else:
            model.forward = convert_outputs_to_fp32(in_amp(model.forward))

    def _policy_following(self, region: autocast):
        """``region`` as a decorator (``region(func)``), with the policy read from these hooks
        at each call: a policy set after ``prepare`` (the one a resumed checkpoint was
        trained with, which transformers' Trainer loads after preparing the model) applies."""
        hooks = self

        def decorate(func):
            @functools.wraps(func)
            def decorated(*args, **kwargs):
                with autocast(region.device_type, region.fast_dtype, region.enabled, region.cache_enabled,
                              hooks.policy, region.fp8):
                    return func(*args, **kwargs)

            return decorated

        return decorate

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        """``Accelerator.autocast``: our autocast for the block.

        Example::

            >>> from accelerate import Accelerator
            >>> accelerator = Accelerator(cpu=True); _ = install_amp(accelerator, dtype="bf16")
            >>> with accelerator.autocast():
            ...     torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype
            torch.bfloat16
        """
        with self.make_autocast(autocast_handler):
            yield

    def unscale_gradients(self, optimizer=None) -> None:
        """``Accelerator.unscale_gradients``: unscale with our scaler whenever there is one.

        ``optimizer``: one optimizer or a list; default every prepared optimizer.

        Example::

            >>> from accelerate import Accelerator
            >>> accelerator = Accelerator(cpu=True)
            >>> _ = install_amp(accelerator, dtype="fp16", scaler_options={"init_scale": 4.0})
            >>> model = torch.nn.Linear(2, 1)
            >>> model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> accelerator.backward(model(torch.ones(1, 2)).sum())
            >>> accelerator.unscale_gradients(opt); model.bias.grad.item()
            1.0
        """
        if self.scaler is None:
            return
        if optimizer is None:
            optimizers = list(self.accelerator._optimizers)
        elif isinstance(optimizer, (list, tuple)):
            optimizers = list(optimizer)
        else:
            optimizers = [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)


def install_amp(
    accelerator: Accelerator,
    dtype: torch.dtype | str | None = None,
    *,
    policy: Policy | None = None,
    scaler: Any = None,
    scaler_options: Mapping[str, Any] | None = None,
    fp8: Recipe | None = None,
) -> AmpHooks:
    """Make ``accelerator`` run dispatch_amp's autocast and (for float16) GradScaler.

    Call it once, right after creating the Accelerator and before ``prepare()``.

    Args:
        accelerator: an ``accelerate.Accelerator`` on a CPU, CUDA, XPU or MPS device.
        dtype: ``torch.float16``/``"fp16"`` or ``torch.bfloat16``/``"bf16"``; default the
            Accelerator's ``mixed_precision``. Needed when that is ``"no"``.
        policy: the ``dispatch_amp.Policy`` to apply; default the device's.
        scaler: the GradScaler for float16; default ``dispatch_amp.GradScaler(device)``.
        scaler_options: keyword arguments for the default GradScaler, instead of ``scaler``.
        fp8: an fp8 recipe (``dispatch_amp.fp8``) every forward applies.

    Returns the :class:`AmpHooks` now installed (also ``accelerator.dispatch_amp``). The
    module docstring lists everything this changes on the Accelerator.

    Example::

        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> install_amp(accelerator, dtype=torch.float16, scaler_options={"init_scale": 256.0})
        <...AmpHooks object at ...>
        >>> accelerator.scaler.get_scale()
        256.0
    """
    if getattr(accelerator, "dispatch_amp", None) is not None:
        raise RuntimeError("install_amp() was already called on this Accelerator; call it once")
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(
            "install_amp() was called after accelerator.prepare(): models and optimizers "
            "prepared before it keep accelerate's autocast and scaler; call install_amp() "
            "right after creating the Accelerator"
        )
    if accelerator.distributed_type in _OWN_PRECISION:
        raise ValueError(
            f"distributed_type {accelerator.distributed_type} manages precision itself; "
            "install_amp() supports single-process, DDP and FSDP runs"
        )
    if accelerator.device.type not in BUILTIN_DEVICES:
        raise ValueError(
            f"dispatch_amp autocasts on {', '.join(map(repr, BUILTIN_DEVICES))}, the "
            f"Accelerator runs on {accelerator.device.type!r}; keep accelerate's own mixed "
            "precision there"
        )
    dtype = _resolve_dtype(accelerator, dtype)
    if dtype is torch.bfloat16:
        if scaler is not None or scaler_options is not None:
            raise ValueError("bfloat16 uses no loss scaling; drop scaler=/scaler_options=, or use dtype='fp16'")
    elif scaler is not None and scaler_options is not None:
        raise ValueError("both scaler= and scaler_options= were given; pass one of them")
    elif scaler is None:
        scaler = GradScaler(accelerator.device.type, **dict(scaler_options or {}))

    # Every argument is checked before the Accelerator changes: a region built here
    # refuses a policy that is not a Policy, as prepare() would, only later.
    autocast(accelerator.device.type, dtype, enabled=False, policy=policy, fp8=fp8)

    hooks = AmpHooks(accelerator, dtype, policy, scaler, fp8)
    accelerator.native_amp = False
    accelerator.scaler = scaler
    accelerator.prepare_model = hooks.prepare_model
    accelerator.autocast = hooks.autocast
    accelerator.unscale_gradients = hooks.unscale_gradients
    accelerator.dispatch_amp = hooks
    if fp8 is not None:
        accelerator.register_for_checkpointing(fp8)
    return hooks


def log_amp_metrics(accelerator: Accelerator, step: int | None = None) -> dict[str, float]:
    """Logs the Accelerator's loss-scaler numbers through ``accelerator.log`` (its trackers:
    TensorBoard, W&B, ...) and returns them. Call it where you log your loss.

    Example::

        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True); _ = install_amp(accelerator, dtype="fp16")
        >>> log_amp_metrics(accelerator, step=0)
        {'amp/loss_scale': 65536.0, 'amp/skipped_steps': 0, 'amp/overflow_params': 0}
    """
    metrics = amp_metrics(getattr(accelerator, "scaler", None))
    if metrics:
        accelerator.log(metrics, step=step)
    return metrics
