"""``MixedPrecision``: Lightning Fabric's AMP plugin, running dispatch_amp's autocast and GradScaler.

The one-line change from Fabric's own plugin is the import::

    # from lightning.fabric.plugins import MixedPrecision
    from dispatch_amp.integrations.fabric import MixedPrecision

    fabric = L.Fabric(accelerator="cpu", plugins=[MixedPrecision("bf16-mixed", "cpu")])

It subclasses Fabric's ``MixedPrecision``: inputs are cast to the low dtype and outputs back
to float32 as before, ``fabric.backward`` scales the loss and ``fabric.clip_gradients``
unscales first; only the autocast (``fabric.autocast()`` and the forward of modules from
``fabric.setup``) is ours, and for ``"16-mixed"`` the default scaler.

Checkpoints: Fabric saves only what you put in the state, so save the plugin's state
(``fabric.strategy.precision.state_dict()``, the scaler's state dict) there; it has the same
keys as with Fabric's plugin and loads into either. An fp8 recipe's state needs nothing:
it rides in the state dict of the model ``fabric.setup`` gave the plugin, as the entry
``"_dispatch_amp_fp8_state"``, which ``fabric.load`` puts back (load such a state dict into
a model outside Fabric with ``strict=False``, or drop that entry). A precision plan bound to
that model rides the same way (entry ``"dispatch_amp_plan"``, with its fp8 recipes'
states; ``MixedPrecision`` only), and loading it back runs that plan.

:class:`HalfPrecision` does the same for ``"16-true"`` / ``"bf16-true"`` (weights in 16 bits),
with our opt levels' options (float32 batch norms, float32 master weights and a loss
scale, a policy or fp8 recipe for the forward)::

    fabric = L.Fabric(plugins=[HalfPrecision("16-true", "cuda", opt_level="O2")])

Or keep ``Fabric(precision="16-mixed")`` as written, with :class:`Fabric` from here::

    # from lightning.fabric import Fabric
    from dispatch_amp.integrations.fabric import Fabric

Importing this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric as _LightningFabric
from lightning.fabric.plugins.precision import HalfPrecision as _FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as _FabricPrecision

from ..autocast.context import autocast
from . import _fp8_state, _plan_state
from ._half import LevelPrecision, grads_to_masters, swap_masters_into
from ._modes import PolicyPrecision
from ._precision_flags import refuse_missing_device, route

__all__ = ["MixedPrecision", "HalfPrecision", "Fabric"]


class MixedPrecision(PolicyPrecision, _FabricMixedPrecision):
    """Lightning Fabric precision plugin: ``dispatch_amp.autocast`` for the forward, our GradScaler.

    Args:
        precision: ``"16-mixed"`` (float16 with a loss scaler) or ``"bf16-mixed"``.
        device: the autocast device type: ``"cpu"``, ``"cuda"``, ``"xpu"`` or ``"mps"``.
        scaler: a GradScaler for ``"16-mixed"``; default ``dispatch_amp.GradScaler(device)``.
        policy: the ``dispatch_amp.Policy`` to apply; default the device's.
        scaler_options: keyword arguments for the default GradScaler, instead of ``scaler``.

    Example::

        >>> plugin = MixedPrecision("bf16-mixed", "cpu")
        >>> with plugin.forward_context():
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype, plugin.scaler
        (torch.bfloat16, None)

        fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    """

    def forward_context(self) -> autocast:
        """A fresh ``dispatch_amp.autocast`` for one forward (what ``fabric.autocast()`` returns).

        Example::

            >>> MixedPrecision("16-mixed", "cpu").forward_context()
            autocast('cpu', dtype=torch.float16, enabled=True, cache_enabled=True, policy='cpu')
        """
        return self._region()

    def _region(self) -> autocast:
        return autocast(self.device, self._desired_input_dtype, policy=self.policy, fp8=self.fp8)

    def convert_module(self, module):
        """Fabric's conversion; the module's state dict then carries the fp8 recipe's state
        and the precision plan bound to it (with its recipes' states)."""
        module = super().convert_module(module)
        _fp8_state.carry_in_state_dict(module, self.fp8)
        _plan_state.carry_in_state_dict(module)
        return module


class HalfPrecision(LevelPrecision, _FabricHalfPrecision):
    """Lightning Fabric plugin for ``"16-true"`` / ``"bf16-true"``, carried by an opt level.

    Args:
        precision: ``"16-true"`` (float16 weights) or ``"bf16-true"`` (bfloat16 weights).
        device: the device type of the loss scaler and autocast; default: the machine's CUDA or MPS
            device, as Lightning picks it (``torch.accelerator``), else cpu.
        opt_level: ``"O3"`` (default: every weight in 16 bits, no loss scale: Fabric's own
            ``HalfPrecision``, bit for bit) or ``"O2"`` (batch norms float32, float32 master
            weights, dynamic loss scale).
        keep_batchnorm_fp32, master_weights, loss_scale, min_loss_scale, max_loss_scale,
        patch_torch_functions: the opt level's overrides, as in ``amp.initialize``.
        policy, fp8: a ``Policy`` or fp8 recipe for the forward, which then runs inside
            ``dispatch_amp.autocast``.

    With master weights, ``fabric.setup(model, optimizer)`` gives the model new 16-bit
    parameters and leaves the optimizer (made before, from the float32 parameters) stepping
    those float32 parameters as masters; ``fabric.backward`` scales the loss,
    ``fabric.clip_gradients`` clips the unscaled master gradients, a step with inf/nan
    gradients is skipped, and ``model.state_dict()`` holds the masters. Save
    ``fabric.strategy.precision.state_dict()`` (the loss scaler) beside them.

    Example::

        >>> plugin = HalfPrecision("bf16-true", "cpu", master_weights=True)
        >>> plugin.props.opt_level, plugin.props.master_weights, plugin.props.loss_scale
        ('O3', True, 1.0)

        fabric = L.Fabric(accelerator="cuda", plugins=[HalfPrecision("16-true", "cuda", opt_level="O2")])
        model, optimizer = fabric.setup(model, optimizer)
    """

    def forward_context(self):
        """Fabric's default-dtype switch, inside ``dispatch_amp.autocast`` when the level patches."""
        return self._level_forward(super().forward_context())

    def convert_module(self, module):
        """The level's cast; the module's state dict then carries the fp8 recipe's state."""
        module = super().convert_module(module)
        _fp8_state.carry_in_state_dict(module, self.fp8)
        return module

    def backward(self, tensor, model, *args, **kwargs) -> None:
        """Backward of the loss times the loss scale, when the level has one."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def _gradients_to_masters(self, optimizer) -> None:
        swap_masters_into(optimizer, self._pairs)  # an optimizer made after fabric.setup_module()
        grads_to_masters(self._pairs)

    def unscale_gradients(self, optimizer) -> None:
        """Moves the gradients into the float32 masters and unscales them (before clipping)."""
        self._gradients_to_masters(optimizer)
        if self.scaler is not None:
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                raise NotImplementedError(
                    f"{type(optimizer).__qualname__} unscales its gradients inside step() (fused), so they "
                    "cannot be clipped first; use a non-fused optimizer or no gradient clipping"
                )
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, **kwargs):
        """The step on the masters, skipped after inf/nan gradients; the model gets their rounded copies."""
        self._gradients_to_masters(optimizer)
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        return self._scaled_step(optimizer, **kwargs)


class Fabric(_LightningFabric):
    """``lightning.fabric.Fabric`` whose 16-bit precisions run dispatch_amp, as our Lightning ``Trainer``.

    ``precision="16-mixed"`` / ``"bf16-mixed"`` (and ``16``, ``"16"``, ``"bf16"``) become
    ``plugins=[MixedPrecision(precision, device)]``, and ``"16-true"`` / ``"bf16-true"``
    ``plugins=[HalfPrecision(precision, device)]``, the device taken from ``accelerator``
    (a name or an accelerator object); every other precision is Fabric's own. Extra
    keywords, all optional: ``amp_policy``, ``amp_fp8`` (both plugins' ``policy``,
    ``fp8``), ``amp_scaler_options`` (mixed: the scaler's), ``amp_opt_level`` and
    ``amp_opt_overrides`` (true: ``opt_level`` and a dict of the level's overrides).

    Where it differs from Lightning's Fabric, it says so: ``"16-mixed"`` on CPU trains in
    float16 with our GradScaler and warns that Lightning's would use bfloat16 there;
    ``precision=`` beside a precision plugin is taken when both name the same precision
    (else a ``ValueError`` says which to drop). An accelerator this machine lacks gets
    Lightning's own error, with no plugin built first.

    Example::

        >>> fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
        >>> type(fabric.strategy.precision).__name__, fabric.strategy.precision.precision
        ('MixedPrecision', 'bf16-mixed')

        # from lightning.fabric import Fabric
        from dispatch_amp.integrations.fabric import Fabric

        fabric = Fabric(accelerator="cuda", precision="16-mixed")
    """

    def __init__(self, *, precision: Any = None, plugins: Any = None, amp_policy: Any = None,
                 amp_scaler_options: Any = None, amp_fp8: Any = None, amp_opt_level: str | None = None,
                 amp_opt_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        amp = {"amp_policy": amp_policy, "amp_fp8": amp_fp8, "amp_scaler_options": amp_scaler_options,
               "amp_opt_level": amp_opt_level, "amp_opt_overrides": amp_opt_overrides}

        precision, plugins, device_missing = route("Fabric", precision, plugins, kwargs, _FabricPrecision,
                                                       (MixedPrecision, HalfPrecision), amp)
        super().__init__(precision=precision, plugins=plugins or None, **kwargs)
        if device_missing:
            refuse_missing_device("Fabric", kwargs.get("accelerator"))
