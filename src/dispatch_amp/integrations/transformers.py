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
Unlike the stock Trainer, ``fp16=True`` on CPU then trains in float16 with a GradScaler
(the stock one silently stays in float32 there).

Importing this module imports ``transformers`` and ``accelerate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import transformers

from ..fp8.recipes import Recipe
from ..policy import Policy
from .accelerate import install_amp

__all__ = ["AmpTrainerMixin", "Trainer"]


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
        super().__init__(*args, **kwargs)

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


class Trainer(AmpTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with dispatch_amp's autocast and GradScaler (see :class:`AmpTrainerMixin`).

    Example::

        >>> from transformers import TrainingArguments
        >>> args = TrainingArguments("out", use_cpu=True, bf16=True, report_to=[], save_strategy="no")
        >>> Trainer(model=torch.nn.Linear(2, 2), args=args).accelerator.scaler is None
        True
    """
