"""Integrations: dispatch_amp's autocast and GradScaler inside training frameworks.

Each submodule imports its framework when it is imported itself, never before: importing
``dispatch_amp`` or this package loads none of them.

* ``dispatch_amp.integrations.lightning``: ``MixedPrecision``, a Lightning Trainer plugin.
* ``dispatch_amp.integrations.fabric``: ``MixedPrecision``, a Lightning Fabric plugin.
* ``dispatch_amp.integrations.accelerate``: ``install_amp(accelerator, ...)``.
* ``dispatch_amp.integrations.transformers``: ``AmpTrainerMixin`` and ``Trainer``.
* ``dispatch_amp.integrations.timm_scaler``: ``NativeScaler``, timm's loss-scaler shape.
* ``dispatch_amp.integrations.metrics``: ``amp_metrics(scaler)``, the numbers every
  integration logs (``amp/loss_scale``, ``amp/skipped_steps``, ``amp/overflow_params``).

Example::

    >>> from dispatch_amp.integrations.timm_scaler import NativeScaler   # needs no timm
    >>> NativeScaler(device="cpu").state_dict()["scale"]
    65536.0
"""
