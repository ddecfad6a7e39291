"""Lightning's precision strings, the scaler each one needs, and what the Trainer and Fabric
plugins share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..autocast.policy import Policy
from ..fp8.recipes import Recipe
from ..scaler.grad_scaler import GradScaler

PRECISIONS: dict[str, torch.dtype] = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The autocast dtype of a Lightning precision string.

    Example::

        >>> precision_dtype("bf16-mixed")
        torch.bfloat16
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not a mixed precision: use '16-mixed' (float16, with "
            "a GradScaler) or 'bf16-mixed' (bfloat16); other precisions need no autocast, so "
            "pass them to Lightning as precision=... instead of this plugin"
        )
    return PRECISIONS[precision]


def make_scaler(
    precision: str, device: str, scaler: Any, scaler_options: Mapping[str, Any] | None
) -> Any:
    """The scaler for ``precision``: the given one, or a new ``GradScaler(device, **scaler_options)``.

    float16 gets a scaler (ours unless one is passed); bfloat16 gets none, as in Lightning.

    Example::

        >>> make_scaler("16-mixed", "cpu", None, {"init_scale": 8.0}).get_scale()
        8.0
        >>> make_scaler("bf16-mixed", "cpu", None, None) is None
        True
    """
    dtype = precision_dtype(precision)
    if scaler is not None and scaler_options is not None:
        raise ValueError(
            "both scaler= and scaler_options= were given; pass a GradScaler, or the options "
            "to build one, not both"
        )
    if dtype is torch.bfloat16:
        if scaler is not None or scaler_options is not None:
            raise ValueError(
                "precision='bf16-mixed' uses no loss scaling (bfloat16 has float32's range); "
                "drop scaler=/scaler_options=, or use precision='16-mixed'"
            )
        return None
    if scaler is not None:
        return scaler
    return GradScaler(device, **dict(scaler_options or {}))


class PolicyPrecision:
    """The part the Trainer and Fabric plugins share; put it before Lightning's class.

    Takes Lightning's ``(precision, device, scaler)`` plus ``policy=``,
    ``scaler_options=`` and ``fp8=`` (an fp8 recipe for every forward); the subclass names its autocast in ``_region()``, built once here
    so a bad device or policy fails when the plugin is made, not at the first step.

    Example::

        class MixedPrecision(PolicyPrecision, lightning_MixedPrecision):
            def _region(self): ...
    """

    def __init__(
        self,
        precision: str,
        device: str | None = None,
        scaler: Any = None,
        *,
        policy: Policy | None = None,
        scaler_options: Mapping[str, Any] | None = None,
        fp8: Recipe | None = None,
    ) -> None:
        if device is None:
            # Lightning's plugin takes the device as a required argument too; say which.
            raise TypeError(
                f"{type(self).__name__}({precision!r}) needs the device type to autocast on as its "
                f"second argument: {type(self).__name__}({precision!r}, 'cuda') (or 'cpu', 'mps', 'xpu')"
            )
        super().__init__(precision, device, make_scaler(precision, device, scaler, scaler_options))
        self.policy = policy
        self.fp8 = fp8
        self._region()

    def _region(self):
        raise NotImplementedError

    def __repr__(self) -> str:
        fp8 = "" if self.fp8 is None else f", fp8={self.fp8!r}"
        return f"{type(self).__name__}({self.precision!r}, {self.device!r}, policy={self.policy and self.policy.name!r}{fp8})"
