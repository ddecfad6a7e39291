"""``MixedPrecision``: the Lightning Trainer's AMP plugin, running dispatch_amp's autocast and GradScaler.

The one-line change from Lightning's own plugin is the import::

    # from lightning.pytorch.plugins import MixedPrecision
    from dispatch_amp.integrations.lightning import MixedPrecision

    trainer = L.Trainer(plugins=[MixedPrecision("bf16-mixed", "cpu")])

or, keeping ``Trainer(precision="16-mixed")`` as written::

    # from lightning.pytorch import Trainer
    from dispatch_amp.integrations.lightning import Trainer

:class:`HalfPrecision` does the same for ``"16-true"`` / ``"bf16-true"`` (weights in 16 bits),
with our opt levels' options: float32 batch norms, float32 master weights and a loss scale
(O2), a policy or fp8 recipe for the forward.

:class:`AmpMetrics` logs the loss scale and skipped steps through Lightning's loggers.

``MixedPrecision`` subclasses Lightning's ``MixedPrecision``, so everything Lightning does for that plugin
(unscaling before gradient clipping, skipping steps on overflow, strategy checks) applies
unchanged; only the autocast is ours, and for ``"16-mixed"`` the default scaler.

Checkpoints: Lightning files a plugin's state under the plugin class's name. This plugin
files and reads its scaler state under the name Lightning's own plugin uses, also from a
subclass, so a checkpoint moves between the two with its loss scale kept. An fp8 recipe's
state goes in the same checkpoint under ``"dispatch_amp_fp8"`` (both plugins), and a
resumed fit continues it.

Importing this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning.pytorch import Callback
from lightning.pytorch import Trainer as _LightningTrainer
from lightning.pytorch.plugins.precision import HalfPrecision as _LightningHalfPrecision
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision as _LightningPrecision

from ..autocast.context import autocast
from . import _fp8_state, _plan_state, _policy_state
from ._half import LevelPrecision, grads_to_masters, swap_masters_into
from ._modes import PolicyPrecision, precision_dtype
from ._precision_flags import as_list, refuse_missing_device, route
from .metrics import amp_metrics

__all__ = ["MixedPrecision", "HalfPrecision", "AmpMetrics", "Trainer"]

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

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Lightning's conversion (none for mixed precision); the plugin remembers the model,
        weakly, to file the precision plan bound to it in checkpoints.

        Example::

            >>> plugin = MixedPrecision("bf16-mixed", "cpu"); net = torch.nn.Linear(2, 2)
            >>> plugin.convert_module(net) is net
            True
        """
        module = super().convert_module(module)
        self._model_ref = _plan_state.ModelRef(module)
        return module

    def _converted(self) -> torch.nn.Module | None:
        ref = getattr(self, "_model_ref", None)
        return None if ref is None else ref()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Moves the scaler state from this class's name to the stock plugin's.

        Example::

            >>> ckpt = {"MyAmp": {"scale": 8.0}}
            >>> type("MyAmp", (MixedPrecision,), {})("16-mixed", "cpu").on_save_checkpoint(ckpt)
            >>> ckpt["MixedPrecision"], ckpt["dispatch_amp_policy"]["name"]
            ({'scale': 8.0}, 'cpu')

        The policy in force is filed too (key ``"dispatch_amp_policy"``), and the precision
        plan bound to the model with its fp8 recipes' states (key ``"dispatch_amp_plan"``), so
        a resume runs the same numerics (``on_load_checkpoint``).
        """
        super().on_save_checkpoint(checkpoint)
        own = type(self).__qualname__
        if own != STOCK_CHECKPOINT_KEY and own in checkpoint:
            checkpoint[STOCK_CHECKPOINT_KEY] = checkpoint.pop(own)
        _fp8_state.save_into(checkpoint, self.fp8)
        _policy_state.save_into(checkpoint, self.policy, self.device)
        _plan_state.save_into(checkpoint, self._converted())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Loads the scaler state filed under the stock plugin's name (Lightning reads only ours).

        Example::

            >>> plugin = type("MyAmp", (MixedPrecision,), {})("16-mixed", "cpu")
            >>> plugin.on_load_checkpoint({"MixedPrecision": MixedPrecision(
            ...     "16-mixed", "cpu", scaler_options={"init_scale": 8.0}).state_dict()})
            >>> plugin.scaler.get_scale()
            8.0
        """
        # Read first: a policy entry that does not validate raises before anything is loaded.
        policy = _policy_state.load_from(checkpoint, self.policy, self.device)
        # A filed precision plan replaces the bound one only once it validated against the model.
        _plan_state.load_from(checkpoint, self._converted())
        super().on_load_checkpoint(checkpoint)
        own = type(self).__qualname__
        if own != STOCK_CHECKPOINT_KEY and own not in checkpoint and STOCK_CHECKPOINT_KEY in checkpoint:
            self.load_state_dict(checkpoint[STOCK_CHECKPOINT_KEY])
        _fp8_state.load_from(checkpoint, self.fp8)
        self.policy = policy  # the one the run was trained with (_policy_state.load_from)


class HalfPrecision(LevelPrecision, _LightningHalfPrecision):
    """Lightning Trainer plugin for ``"16-true"`` / ``"bf16-true"``, carried by an opt level.

    Args:
        precision: ``"16-true"`` (float16 weights) or ``"bf16-true"`` (bfloat16 weights).
        device: the device type of the loss scaler and autocast; default: the machine's CUDA or MPS
            device, as Lightning picks it (``torch.accelerator``), else cpu.
        opt_level: ``"O3"`` (default: every weight in 16 bits, no loss scale: Lightning's own
            ``HalfPrecision``, bit for bit) or ``"O2"`` (batch norms float32, float32 master
            weights that the optimizer updates, dynamic loss scale).
        keep_batchnorm_fp32, master_weights, loss_scale, min_loss_scale, max_loss_scale,
        patch_torch_functions: the opt level's overrides, as in ``amp.initialize``
            (float16 weights with a loss scale need master weights).
        policy, fp8: a ``Policy`` or fp8 recipe for the forward, which then runs inside
            ``dispatch_amp.autocast`` (``patch_torch_functions`` defaults to True with them).

    Inputs are cast to the 16-bit dtype and the default dtype is switched during each step,
    as Lightning's plugin does. With master weights the model gets new 16-bit parameters,
    the optimizers (made after the cast) step the float32 masters, and checkpoints hold the
    masters (a stock checkpoint resumes into this plugin and back). Gradient clipping and
    ``on_before_optimizer_step`` see the unscaled float32 master gradients.

    Example::

        >>> plugin = HalfPrecision("16-true", "cpu", opt_level="O2")
        >>> plugin.scaler.get_scale(), plugin.props.master_weights
        (65536.0, True)

        trainer = L.Trainer(plugins=[HalfPrecision("bf16-true", "cuda", master_weights=True)])
    """

    def forward_context(self):
        """Lightning's default-dtype switch, inside ``dispatch_amp.autocast`` when the level patches."""
        return self._level_forward(super().forward_context())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Files the fp8 recipe's state in the checkpoint (``"dispatch_amp_fp8"``)."""
        super().on_save_checkpoint(checkpoint)
        _fp8_state.save_into(checkpoint, self.fp8)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restores the fp8 recipe's state, if the checkpoint has one."""
        super().on_load_checkpoint(checkpoint)
        _fp8_state.load_from(checkpoint, self.fp8)

    def connect(self, model, optimizers, lr_schedulers):
        """Puts the float32 masters into the optimizers (made after the model was cast)."""
        for optimizer in optimizers:
            swap_masters_into(optimizer, self._pairs)
        return super().connect(model, optimizers, lr_schedulers)

    def pre_backward(self, tensor, module):
        """Scales the loss when the level has a loss scale."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Masters' gradients filled and unscaled, clipping hooks, a step skipped on inf/nan, masters copied back."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # automatic optimization whose training_step returned None ran no backward
        skip = closure_result is None and model.automatic_optimization
        grads_to_masters(self._pairs)
        if not skip and not getattr(optimizer, "_step_supports_amp_scaling", False):
            self.scaler.unscale_(optimizer)  # before the clipping hooks, as Lightning's MixedPrecision
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        return self._scaled_step(optimizer, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
        """Refuses clipping with an optimizer that unscales inside its step (fused), as Lightning does."""
        if clip_val > 0 and self.scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales its gradients inside step() (fused), so they "
                "cannot be clipped first; use a non-fused optimizer or no gradient clipping"
            )
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        super().clip_gradients(optimizer, clip_val, **kwargs)


# -- the scaler's numbers in Lightning's logs -------------------------------------------------
class AmpMetrics(Callback):
    """Logs the loss scaler's numbers through ``self.log``, so every logger shows them.

    ``amp/loss_scale``, ``amp/skipped_steps`` and ``amp/overflow_params`` (how many
    gradients held inf/nan on that step, 0 when it was not skipped) every
    ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``): the
    same keys on every logged step, so Lightning, which keeps a step's value for the rest
    of the epoch, never shows one step's count on another. One host sync per logged step.
    Nothing is logged without a scaler (bf16). ``prog_bar=True`` also shows the scale in
    the progress bar. Our :class:`Trainer` adds it by itself.

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
class Trainer(_LightningTrainer):
    """``lightning.pytorch.Trainer`` whose 16-bit precisions run dispatch_amp.

    ``precision="16-mixed"`` / ``"bf16-mixed"`` (and ``16``, ``"16"``, ``"bf16"``) become
    ``plugins=[MixedPrecision(precision, device)]``, and ``"16-true"`` / ``"bf16-true"``
    ``plugins=[HalfPrecision(precision, device)]``, the device taken from ``accelerator``
    (a name or an accelerator object such as ``CPUAccelerator()``); every other precision
    is Lightning's own. :class:`AmpMetrics` is added to the callbacks (``amp_metrics=False``
    leaves it out). Extra keywords, all optional: ``amp_policy``, ``amp_fp8`` (both plugins'
    ``policy``, ``fp8``), ``amp_scaler_options`` (mixed: the scaler's), ``amp_opt_level``
    and ``amp_opt_overrides`` (true: ``opt_level`` and a dict of the level's overrides,
    e.g. ``{"master_weights": True}``).

    Where it differs from Lightning's Trainer, it says so: ``"16-mixed"`` on CPU trains in
    float16 with our GradScaler and warns that Lightning's would use bfloat16 there;
    ``precision=`` beside a precision plugin is taken when both name the same precision
    (else a ``ValueError`` says which to drop, where Lightning refuses both together). An
    accelerator this machine lacks gets Lightning's own error, with no plugin built first.

    Example::

        >>> trainer = Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)
        >>> type(trainer.precision_plugin).__module__, trainer.precision_plugin.precision
        ('dispatch_amp.integrations.lightning', 'bf16-mixed')
        >>> Trainer(accelerator="cpu", precision="16-true", amp_opt_level="O2", logger=False).precision_plugin
        HalfPrecision('16-true', 'cpu', opt_level='O2', master_weights=True, keep_batchnorm_fp32=True, loss_scale='dynamic')

        # from lightning.pytorch import Trainer
        from dispatch_amp.integrations.lightning import Trainer

        trainer = Trainer(accelerator="gpu", precision="16-mixed")
    """

    def __init__(self, *args: Any, precision: Any = None, plugins: Any = None, callbacks: Any = None,
                 amp_policy: Any = None, amp_scaler_options: Any = None, amp_fp8: Any = None,
                 amp_opt_level: str | None = None, amp_opt_overrides: dict[str, Any] | None = None,
                 amp_metrics: bool = True, **kwargs: Any) -> None:
        amp = {"amp_policy": amp_policy, "amp_fp8": amp_fp8, "amp_scaler_options": amp_scaler_options,
               "amp_opt_level": amp_opt_level, "amp_opt_overrides": amp_opt_overrides}

        precision, plugins, device_missing = route("Trainer", precision, plugins, kwargs, _LightningPrecision,
                                                       (MixedPrecision, HalfPrecision), amp)
        callbacks = as_list(callbacks)
        if amp_metrics and not any(isinstance(c, AmpMetrics) for c in callbacks):
            callbacks.append(AmpMetrics())
        super().__init__(*args, precision=precision, plugins=plugins or None, callbacks=callbacks or None, **kwargs)
        if device_missing:
            refuse_missing_device("Trainer", kwargs.get("accelerator"))
