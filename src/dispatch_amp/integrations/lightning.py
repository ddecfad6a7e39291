"""``MixedPrecision``: the Lightning Trainer's AMP plugin, running dispatch_amp's autocast and GradScaler.

The one-line change from Lightning's own plugin is the import::

    # from lightning.pytorch.plugins import MixedPrecision
    from dispatch_amp.integrations.lightning import MixedPrecision

    trainer = L.Trainer(plugins=[MixedPrecision("bf16-mixed", "cpu")])

It subclasses Lightning's ``MixedPrecision``, so everything Lightning does for that plugin
(unscaling before gradient clipping, skipping steps on overflow, strategy checks) applies
unchanged; only the autocast is ours, and for ``"16-mixed"`` the default scaler.

Checkpoints: Lightning files a plugin's state under the plugin class's name. This plugin
files and reads its scaler state under the name Lightning's own plugin uses, also from a
subclass, so a checkpoint moves between the two with its loss scale kept.

Importing this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision

from ..autocast import autocast
from ._modes import PolicyPrecision, precision_dtype

__all__ = ["MixedPrecision"]

# Where Lightning's own plugin keeps its scaler state in a checkpoint.
STOCK_CHECKPOINT_KEY = _LightningMixedPrecision.__qualname__


class MixedPrecision(PolicyPrecision, _LightningMixedPrecision):
    """Lightning Trainer precision plugin: ``dispatch_amp.autocast`` around each step, our GradScaler.

    Args:
        precision: ``"16-mixed"`` (float16 with a loss scaler) or ``"bf16-mixed"``.
        device: the autocast device type: ``"cpu"``, ``"cuda"``, ``"xpu"`` or ``"mps"``.
        scaler: a GradScaler for ``"16-mixed"``; default ``dispatch_amp.GradScaler(device)``.
        policy: the ``dispatch_amp.Policy`` to apply; default the device's.
        scaler_options: keyword arguments for the default GradScaler (``init_scale``,
            ``growth_interval``, ``hysteresis``, ...), instead of ``scaler``.

    As in Lightning's plugin, the weight cast cache is off (``cache_enabled=False``).

    Example::

        >>> plugin = MixedPrecision("16-mixed", "cpu", scaler_options={"init_scale": 1024.0})
        >>> with plugin.forward_context():
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype, plugin.scaler.get_scale()
        (torch.float16, 1024.0)

        trainer = L.Trainer(accelerator="cpu", plugins=[plugin])
    """

    def autocast_context_manager(self) -> autocast:
        """A fresh ``dispatch_amp.autocast`` for one forward (Lightning enters it per step).

        Example::

            >>> MixedPrecision("bf16-mixed", "cpu").autocast_context_manager()
            autocast('cpu', dtype=torch.bfloat16, enabled=True, cache_enabled=False, policy='cpu')
        """
        return self._region()

    def _region(self) -> autocast:
        return autocast(self.device, precision_dtype(self.precision), cache_enabled=False, policy=self.policy,
                        fp8=self.fp8)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Moves the scaler state from this class's name to the stock plugin's.

        Example::

            >>> ckpt = {"MyAmp": {"scale": 8.0}}
            >>> type("MyAmp", (MixedPrecision,), {})("16-mixed", "cpu").on_save_checkpoint(ckpt)
            >>> ckpt
            {'MixedPrecision': {'scale': 8.0}}
        """
        super().on_save_checkpoint(checkpoint)
        own = type(self).__qualname__
        if own != STOCK_CHECKPOINT_KEY and own in checkpoint:
            checkpoint[STOCK_CHECKPOINT_KEY] = checkpoint.pop(own)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Loads the scaler state filed under the stock plugin's name (Lightning reads only ours).

        Example::

            >>> plugin = type("MyAmp", (MixedPrecision,), {})("16-mixed", "cpu")
            >>> plugin.on_load_checkpoint({"MixedPrecision": MixedPrecision(
            ...     "16-mixed", "cpu", scaler_options={"init_scale": 8.0}).state_dict()})
            >>> plugin.scaler.get_scale()
            8.0
        """
        super().on_load_checkpoint(checkpoint)
        own = type(self).__qualname__
        if own != STOCK_CHECKPOINT_KEY and own not in checkpoint and STOCK_CHECKPOINT_KEY in checkpoint:
            self.load_state_dict(checkpoint[STOCK_CHECKPOINT_KEY])


