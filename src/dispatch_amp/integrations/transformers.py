"""``AmpTrainerMixin`` / ``Trainer``: Hugging Face ``transformers.Trainer`` on dispatch_amp.

``Trainer`` (5.x) leaves AMP to the ``accelerate.Accelerator`` it creates in
``create_accelerator_and_postprocess``: the forward runs under the autocast that
``accelerator.prepare`` wraps around the model, the loss is scaled by
``accelerator.backward``, the optimizer steps through ``accelerator.scaler``, and the
scaler's state goes to ``scaler.pt`` in each checkpoint. So the smallest correct change is
to hand that Accelerator to :func:`~dispatch_amp.integrations.accelerate.install_amp` right
after it is created, which is all the mixin does. ``TrainingArguments`` keep choosing the
precision: ``bf16=True`` or ``fp16=True`` (without either, training stays float32).

The one-line change is the import::

    # from transformers import Trainer
    from dispatch_amp.integrations.transformers import Trainer

    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds)

or, for a Trainer subclass of your own, ``class MyTrainer(AmpTrainerMixin, MyBaseTrainer)``.
Unlike the stock Trainer, ``fp16=True`` on CPU then trains in float16 with a GradScaler,
and warns that the stock one stays in float32 there (it ignores fp16 without a word).

Checkpoints keep the scaler's state where the stock Trainer would keep its own: in
``scaler.pt`` whenever the stock Trainer would have a GradScaler too (float16 on a GPU), so
checkpoints resume in either direction with the scale kept. Only where the stock Trainer
has none, i.e. ``fp16=True`` on CPU, does the state go to ``AMP_SCALER_NAME``
(``dispatch_amp_scaler.pt``) instead: the stock Trainer loads ``scaler.pt`` into whatever
scaler its Accelerator has, so it would fail on that file, while it ignores this one and
resumes model, optimizer, scheduler and RNG state without the scale (in float32, as it
trains with ``fp16=True`` on CPU). Ours reads either file. An fp8 recipe's state goes to
``dispatch_amp_fp8.pt`` beside them, and a resume loads it. The autocast policy in force
goes to ``dispatch_amp_policy.json`` (a policy file, ``dispatch_amp.config``), and a
resume runs it (warning where it differs from the Trainer's ``amp_policy``). A precision
plan bound to the model goes to ``dispatch_amp_plan.pt`` with its fp8 recipes' states, and a
resume runs that plan (warning where it differs from the one bound).

Importing this module imports ``transformers`` and ``accelerate``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers.trainer import SCALER_NAME
from transformers.utils import check_torch_load_is_safe

from ..autocast.policy import Policy
from ..fp8.recipes import Recipe
from . import _fp8_state, _plan_state, _policy_state
from .accelerate import install_amp
from .metrics import amp_metrics

__all__ = ["AmpTrainerMixin", "Trainer", "AmpMetricsCallback"]

# Not scaler.pt, which the stock Trainer would load into the scaler it lacks on CPU.
AMP_SCALER_NAME = "dispatch_amp_scaler.pt"


class AmpTrainerMixin:
    """Mix in before ``transformers.Trainer`` (or a subclass) to train with dispatch_amp.

    Extra keyword arguments, all optional: ``amp_policy`` (a ``dispatch_amp.Policy``),
    ``amp_scaler`` (a GradScaler for ``fp16=True``) or ``amp_scaler_options`` (keyword
    arguments for the default ``dispatch_amp.GradScaler``), ``amp_fp8`` (an fp8 recipe
    from ``dispatch_amp.fp8``).

    Example::

        >>> from transformers import TrainingArguments, Trainer as HFTrainer
        >>> class MyTrainer(AmpTrainerMixin, HFTrainer):
        ...     pass
        >>> args = TrainingArguments("out", use_cpu=True, bf16=True, report_to=[], save_strategy="no")
        >>> trainer = MyTrainer(model=torch.nn.Linear(2, 2), args=args)
        >>> trainer.accelerator.dispatch_amp.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        *args: Any,
        amp_policy: Policy | None = None,
        amp_scaler: Any = None,
        amp_scaler_options: Mapping[str, Any] | None = None,
        amp_fp8: Recipe | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before Trainer.__init__, which creates the Accelerator.
        self.amp_policy = amp_policy
        self.amp_scaler = amp_scaler
        self.amp_scaler_options = amp_scaler_options
        self.amp_fp8 = amp_fp8
        self._amp_float16_where_stock_is_float32 = False
        super().__init__(*args, **kwargs)
        if self._amp_float16_where_stock_is_float32:
            # Here, not where the Accelerator is made: this frame's caller is the user's line.
            warnings.warn(
                f"TrainingArguments(fp16=True) on {self.accelerator.device.type}: dispatch_amp's Trainer "
                "trains in float16 with its GradScaler, where the stock transformers Trainer ignores fp16 "
                "here and trains in float32. For float32 leave fp16 off; bf16=True trains in bfloat16.",
                stacklevel=2,
            )

    def create_accelerator_and_postprocess(self) -> None:
        """Create the Accelerator as Trainer does, then install dispatch_amp into it.

        Example::

            >>> from transformers import TrainingArguments
            >>> args = TrainingArguments("out", use_cpu=True, fp16=True, report_to=[], save_strategy="no")
            >>> trainer = Trainer(model=torch.nn.Linear(2, 2), args=args,
            ...                   amp_scaler_options={"init_scale": 1024.0})
            >>> trainer.accelerator.scaler.get_scale()
            1024.0
        """
        super().create_accelerator_and_postprocess()
        # Read before install_amp replaces it: whether the stock Trainer would have a scaler
        # here decides whether it can load a scaler.pt from our checkpoints.
        stock_has_scaler = getattr(self.accelerator, "scaler", None) is not None
        self._amp_scaler_file = SCALER_NAME if stock_has_scaler else AMP_SCALER_NAME
        # Without native AMP the stock Trainer runs no autocast at all: float32.
        self._amp_float16_where_stock_is_float32 = (
            self.args.mixed_precision == "fp16" and not getattr(self.accelerator, "native_amp", False)
        )
        if self.args.mixed_precision in ("fp16", "bf16"):
            install_amp(
                self.accelerator,
                policy=self.amp_policy,
                scaler=self.amp_scaler,
                scaler_options=self.amp_scaler_options,
                fp8=self.amp_fp8,
            )
        elif any(v is not None for v in (self.amp_policy, self.amp_scaler, self.amp_scaler_options, self.amp_fp8)):
            raise ValueError(
                f"amp_policy/amp_scaler/amp_scaler_options/amp_fp8 were given, but TrainingArguments "
                f"select mixed_precision={self.args.mixed_precision!r}; set bf16=True or "
                "fp16=True in TrainingArguments"
            )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``, with the loss scaler's ``amp/`` numbers added to training logs.

        They reach ``state.log_history`` and every reporting callback (TensorBoard, W&B,
        ...) with the loss, one host sync per log.

        Example::

            >>> from transformers import TrainingArguments
            >>> args = TrainingArguments("out", use_cpu=True, fp16=True, report_to=[], save_strategy="no")
            >>> trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
            >>> trainer.log({"loss": 1.0}); trainer.state.log_history[-1]["amp/loss_scale"]
            65536.0
        """
        if "loss" in logs:
            logs.update(amp_metrics(getattr(self.accelerator, "scaler", None)))
        super().log(logs, *args, **kwargs)

    def _save_scaler(self, output_dir: str) -> None:
        # The stock Trainer loads scaler.pt into its Accelerator's scaler unconditionally, and
        # on CPU that scaler is None: a scaler.pt there would make the checkpoint unusable to it.
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or self._amp_scaler_file == SCALER_NAME:
            super()._save_scaler(output_dir)
        elif self.args.should_save:
            torch.save(scaler.state_dict(), os.path.join(output_dir, AMP_SCALER_NAME))
        if self.amp_fp8 is not None and self.args.should_save:
            torch.save(self.amp_fp8.state_dict(), os.path.join(output_dir, _fp8_state.FILE_NAME))
        if self.args.should_save:
            # The precision plan bound to the model, with its fp8 recipes' states.
            _plan_state.save_file(output_dir, self.model)
        hooks = getattr(self.accelerator, "dispatch_amp", None)
        if hooks is not None and self.args.should_save:
            # The policy in force, so that a resume runs the same numerics (a readable file).
            _policy_state.save_file(output_dir, hooks.policy, hooks.device_type)

    def _load_scaler(self, checkpoint: str | None) -> None:
        hooks = getattr(self.accelerator, "dispatch_amp", None)
        if hooks is None or checkpoint is None:
            self._load_amp_state(checkpoint)
            return
        # Read first: a policy file that does not validate raises before anything loads.
        # The prepared model's forward reads hooks.policy at each call (accelerate.AmpHooks).
        policy = _policy_state.load_file(checkpoint, hooks.policy, hooks.device_type)
        self._load_amp_state(checkpoint)
        hooks.policy = policy

    def _load_amp_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            # A filed precision plan replaces the bound one only once it validated against the model.
            _plan_state.load_file(checkpoint, self.model)
        fp8_path = os.path.join(checkpoint, _fp8_state.FILE_NAME) if checkpoint is not None else None
        if self.amp_fp8 is not None and fp8_path is not None and os.path.isfile(fp8_path):
            check_torch_load_is_safe()
            self.amp_fp8.load_state_dict(torch.load(fp8_path, weights_only=True))
        path = os.path.join(checkpoint, AMP_SCALER_NAME) if checkpoint is not None else None
        if path is None or not os.path.isfile(path):
            # scaler.pt: written by the stock Trainer, by ours wherever the stock one has a
            # scaler, and by earlier versions of ours also on CPU.
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None:
            # Resumed in bfloat16 or float32: no loss scaling, so the float16 scale has no use,
            # as for the stock Trainer, which ignores this file.
            return
        check_torch_load_is_safe()
        scaler.load_state_dict(torch.load(path, weights_only=True))


class Trainer(AmpTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with dispatch_amp's autocast and GradScaler (see :class:`AmpTrainerMixin`).

    Example::

        >>> from transformers import TrainingArguments
        >>> args = TrainingArguments("out", use_cpu=True, bf16=True, report_to=[], save_strategy="no")
        >>> Trainer(model=torch.nn.Linear(2, 2), args=args).accelerator.scaler is None
        True
    """


class AmpMetricsCallback(transformers.TrainerCallback):
    """For a Trainer that is not ours (``install_amp`` on its Accelerator): adds the loss
    scaler's ``amp/`` numbers to training logs in ``on_log``. Put it first, so that the
    reporting callbacks see them: ``trainer.callback_handler.callbacks.insert(0,
    AmpMetricsCallback(trainer.accelerator))``. Our :class:`Trainer` needs none.

    Example::

        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True); _ = install_amp(accelerator, dtype="fp16")
        >>> logs = {"loss": 1.0}
        >>> AmpMetricsCallback(accelerator).on_log(None, None, None, logs=logs); logs["amp/loss_scale"]
        65536.0
    """

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            logs.update(amp_metrics(getattr(self.accelerator, "scaler", None)))
