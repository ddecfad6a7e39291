"""``MixedPrecision``: the Lightning Trainer's AMP plugin, running dispatch_amp's autocast and GradScaler.

The one-line change from Lightning's own plugin is the import::

    # from lightning.pytorch.plugins import MixedPrecision
    from dispatch_amp.integrations.lightning import MixedPrecision

    trainer = L.Trainer(plugins=[MixedPrecision("bf16-mixed", "cpu")])

or, keeping ``Trainer(precision="16-mixed")`` as written::

    # from lightning.pytorch import Trainer
    from dispatch_amp.integrations.lightning import Trainer

:class:`AmpMetrics` logs the loss scale and skipped steps through Lightning's loggers.

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

import torch
from lightning.pytorch import Callback
from lightning.pytorch import Trainer as _LightningTrainer
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision

from ..autocast import autocast
from ._modes import PolicyPrecision, precision_dtype
from .metrics import amp_metrics

__all__ = ["MixedPrecision", "AmpMetrics", "Trainer"]

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




# -- the scaler's numbers in Lightning's logs -------------------------------------------------
class AmpMetrics(Callback):
    """Logs the loss scaler's numbers through ``self.log``, so every logger shows them.

    ``amp/loss_scale`` and ``amp/skipped_steps`` every ``every_n_steps`` optimizer steps
    (default: the Trainer's ``log_every_n_steps``), and ``amp/overflow_params`` (how many
    gradients held inf/nan) on a logged step that was skipped. One host sync per logged
    step. Nothing is logged without a scaler (bf16). ``prog_bar=True`` also shows the scale
    in the progress bar. Our :class:`Trainer` adds it by itself.

    Example::

        >>> AmpMetrics(every_n_steps=10, prog_bar=True).every_n_steps
        10

        trainer = L.Trainer(plugins=[MixedPrecision("16-mixed", "cuda")], callbacks=[AmpMetrics()])
    """

    def __init__(self, every_n_steps: int | None = None, prog_bar: bool = False) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        metrics = amp_metrics(getattr(trainer.precision_plugin, "scaler", None))
        for name, value in metrics.items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False,
                          prog_bar=self.prog_bar and name == "amp/loss_scale")


# -- Trainer(precision="16-mixed") ------------------------------------------------------------
# Lightning's precision strings this Trainer runs with our plugin.
_MIXED = {"16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed"}


def _autocast_device(accelerator) -> str:
    """The autocast device type of a Trainer's ``accelerator`` argument."""
    if accelerator in (None, "auto"):
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if isinstance(accelerator, str):
        name = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "mps": "mps", "xpu": "xpu"}.get(accelerator.lower())
        if name is not None:
            return name
    raise ValueError(
        f"dispatch_amp's Trainer cannot tell the autocast device of accelerator={accelerator!r}: "
        f"pass plugins=[MixedPrecision(precision, device)] to lightning.pytorch.Trainer instead"
    )


def _check_strategy(strategy) -> None:
    # Lightning's FSDP and DeepSpeed strategies take only their own precision plugins (the
    # FSDP strategy raises TypeError for any other): say so before Lightning does, with
    # the way out.
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    if name.lower().startswith(("fsdp", "deepspeed")):
        raise ValueError(
            f"strategy={strategy!r} runs only Lightning's own precision plugin for it, not "
            f"dispatch_amp's; use lightning.pytorch.Trainer with that strategy (Lightning's "
            f"AMP), or strategy='ddp' with this Trainer"
        )


class Trainer(_LightningTrainer):
    """``lightning.pytorch.Trainer`` whose mixed precisions run dispatch_amp.

    ``precision="16-mixed"`` / ``"bf16-mixed"`` (and ``16``, ``"16"``, ``"bf16"``) become
    ``plugins=[MixedPrecision(precision, device)]``, the device taken from
    ``accelerator``; every other precision is Lightning's own. :class:`AmpMetrics` is added
    to the callbacks (``amp_metrics=False`` leaves it out). Extra keywords, all optional:
    ``amp_policy``, ``amp_scaler_options``, ``amp_fp8``: the plugin's ``policy``,
    ``scaler_options``, ``fp8``.

    Example::

        >>> trainer = Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)
        >>> type(trainer.precision_plugin).__module__, trainer.precision_plugin.precision
        ('dispatch_amp.integrations.lightning', 'bf16-mixed')

        # from lightning.pytorch import Trainer
        from dispatch_amp.integrations.lightning import Trainer

        trainer = Trainer(accelerator="gpu", precision="16-mixed")
    """

    def __init__(self, *args: Any, precision: Any = None, plugins: Any = None, callbacks: Any = None,
                 amp_policy: Any = None, amp_scaler_options: Any = None, amp_fp8: Any = None,
                 amp_metrics: bool = True, **kwargs: Any) -> None:
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        try:
            ours = _MIXED.get(precision)
        except TypeError:  # an unhashable precision: Lightning's to judge
            ours = None
        if ours is not None:
            _check_strategy(kwargs.get("strategy", "auto"))
            device = _autocast_device(kwargs.get("accelerator", "auto"))
            plugins.append(MixedPrecision(ours, device, policy=amp_policy,
                                          scaler_options=amp_scaler_options, fp8=amp_fp8))
            precision = None
        elif any(v is not None for v in (amp_policy, amp_scaler_options, amp_fp8)):
            raise ValueError(
                f"amp_policy/amp_scaler_options/amp_fp8 apply to precision='16-mixed' or "
                f"'bf16-mixed', got precision={precision!r}"
            )
        if amp_metrics and not any(isinstance(c, AmpMetrics) for c in callbacks):
            callbacks.append(AmpMetrics())
        super().__init__(*args, precision=precision, plugins=plugins or None, callbacks=callbacks or None, **kwargs)
