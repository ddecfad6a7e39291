"""``NativeScaler``: a loss scaler with the shape of timm's ``NativeScaler``, around our GradScaler.

timm's training loop hands the loss to a loss-scaler object that runs backward, optional
gradient clipping and the optimizer step (``loss_scaler(loss, optimizer, clip_grad=...)``)
and checkpoints it under ``loss_scaler.state_dict_key``. timm's own class always builds a
``torch.amp.GradScaler``; this one takes ours (or builds one), and is called the same way::

    loss_scaler = NativeScaler(GradScaler("cuda", hysteresis=2))   # instead of timm's
    with amp.autocast("cuda"):
        loss = loss_fn(model(x), y)
    loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())

It needs no timm: importing this module imports nothing beyond torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..grad_scaler import GradScaler

__all__ = ["NativeScaler"]


def _clip(parameters: Iterable[torch.nn.Parameter], value: float, mode: str) -> None:
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        raise ValueError(
            f"clip_mode={mode!r} is not supported; use 'norm' (clip_grad_norm_) or 'value' "
            "(clip_grad_value_)"
        )


class NativeScaler:
    """timm-style loss scaler: ``scaler(loss, optimizer, clip_grad=None, ...)`` does backward, clip, step.

    Args:
        scaler: the GradScaler to drive; default ``dispatch_amp.GradScaler(device)``.
        device: the device for the default GradScaler (timm's ``NativeScaler(device)``).

    ``state_dict_key`` (``"amp_scaler"``) is the checkpoint key timm's training script files
    the scaler's state under; ``state_dict``/``load_state_dict`` are the GradScaler's.

    Example::

        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_scaler = NativeScaler(GradScaler("cpu", init_scale=4.0))
        >>> loss_scaler(model(torch.ones(1, 2)).sum(), opt, clip_grad=1.0, parameters=model.parameters())
        >>> loss_scaler.state_dict()["scale"]
        4.0
    """

    state_dict_key = "amp_scaler"

    def __init__(self, scaler: Any = None, device: str = "cuda") -> None:
        self._scaler = GradScaler(device) if scaler is None else scaler

    @property
    def scaler(self) -> Any:
        """The GradScaler this loss scaler drives.

        Example::

            >>> NativeScaler(device="cpu").scaler.get_scale()
            65536.0
        """
        return self._scaler

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.nn.Parameter] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """Backward on the scaled loss; then, if ``need_update``, unscale and clip, step, update.

        ``need_update=False`` only accumulates gradients (gradient accumulation: call it
        with True on the last micro-batch). ``clip_grad`` needs ``parameters``.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> loss_scaler = NativeScaler(device="cpu")
            >>> loss_scaler(model(torch.ones(1, 2)).sum(), opt, need_update=False)
            >>> model.bias.grad.item()          # scaled, not yet stepped
            65536.0
        """
        if clip_grad is not None and parameters is None:
            raise ValueError("clip_grad was given without parameters; pass parameters=model.parameters()")
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            _clip(parameters, clip_grad, clip_mode)
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state (loads into timm's NativeScaler too).

        Example::

            >>> sorted(NativeScaler(device="cpu").state_dict())[:2]
            ['_growth_tracker', '_hysteresis_tracker']
        """
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()``, ours or timm's (torch's GradScaler format).

        Example::

            >>> a = NativeScaler(GradScaler("cpu", init_scale=8.0)); b = NativeScaler(device="cpu")
            >>> b.load_state_dict(a.state_dict()); b.scaler.get_scale()
            8.0
        """
        self._scaler.load_state_dict(state_dict)
