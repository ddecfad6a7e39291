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
keys as with Fabric's plugin and loads into either.

Importing this module imports ``lightning``.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision

from ..autocast import autocast
from ._modes import PolicyPrecision

__all__ = ["MixedPrecision"]


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

