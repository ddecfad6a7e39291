"""``NativeScaler``: a loss scaler with the shape of timm's ``NativeScaler``, around our GradScaler.

timm's training loop hands the loss to a loss-scaler object that runs backward, optional
gradient clipping and the optimizer step (``loss_scaler(loss, optimizer, clip_grad=...)``)
and checkpoints it under ``loss_scaler.state_dict_key``. timm's own class always builds a
``torch.amp.GradScaler``; this one takes ours (or builds one), and is called the same way::

    loss_scaler = NativeScaler()        # instead of timm's; or NativeScaler(GradScaler("cuda", hysteresis=2))
    with amp.autocast("cuda"):
        loss = loss_fn(model(x), y)
    loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="agc", parameters=model.parameters())

``NativeScaler()`` without a device builds a GradScaler for ``"cuda"`` where CUDA is
available and for ``"cpu"`` elsewhere. Clip modes are timm's: ``"norm"``, ``"value"`` and
``"agc"`` (adaptive gradient clipping).

It needs no timm: importing this module imports nothing beyond torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..scaler.grad_scaler import GradScaler
from . import _fp8_state

__all__ = ["NativeScaler"]


_CLIP_MODES = ("norm", "value", "agc")

# Adaptive clipping's floor on a unit's weight norm: a unit whose weights are (near) zero,
# as at zero initialisation, may still move by clip_factor * this much.
_AGC_EPS = 1e-3
# Floor on a unit's gradient norm in the ratio: keeps it finite for a zero gradient, which
# is then kept as it is (its norm is under any positive cap).
_AGC_GRAD_FLOOR = 1e-6


def _unit_norms(t: torch.Tensor) -> torch.Tensor:
    """L2 norm per output unit (over every dim but dim 0, kept for broadcasting); of the
    whole tensor for biases, gains and scalars."""
    if t.ndim <= 1:
        return torch.linalg.vector_norm(t, 2.0)
    return torch.linalg.vector_norm(t, 2.0, dim=tuple(range(1, t.ndim)), keepdim=True)


@torch.no_grad()
def _adaptive_clip_(parameters: Iterable[torch.Tensor], clip_factor: float) -> None:
    """Adaptive gradient clipping (Brock et al. 2021): each unit's gradient norm is capped
    at ``clip_factor`` times that unit's weight norm, a cap relative to the weights rather
    than one global threshold. Gradients are rescaled in place, weights are only read."""
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        limit = _unit_norms(p).clamp_(min=_AGC_EPS).mul_(clip_factor)
        norm = _unit_norms(grad)
        shrunk = grad * (limit / norm.clamp(min=_AGC_GRAD_FLOOR))
        grad.copy_(torch.where(norm > limit, shrunk, grad))


def _clip(parameters: Iterable[torch.nn.Parameter] | torch.Tensor, value: float, mode: str) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
    else:
        _adaptive_clip_(parameters, value)


def _default_device() -> str:
    # torch's GradScaler defaults to "cuda", which on a machine without CUDA is a disabled
    # scaler and a warning: a loop that then trains in float16 without loss scaling.
    return "cuda" if torch.cuda.is_available() else "cpu"


class NativeScaler:
    """timm-style loss scaler: ``scaler(loss, optimizer, clip_grad=None, ...)`` does backward, clip, step.

    Args:
        scaler: the GradScaler to drive; default ``dispatch_amp.GradScaler(device)``.
        device: the device type of the default GradScaler (timm's ``NativeScaler(device=...)``;
            a string or ``torch.device``). ``None`` (the default): ``"cuda"`` if
            ``torch.cuda.is_available()``, else ``"cpu"``. An explicit ``"cuda"`` without
            CUDA gives torch's reaction: a warning and a disabled scaler. timm's positional
            ``NativeScaler("cpu")`` is read as ``device="cpu"``.
        fp8: the fp8 recipe the loop's autocast uses, if any: its state then travels in this
            scaler's state dict (timm's script saves and resumes it with no change).

    ``state_dict_key`` (``"amp_scaler"``) is the checkpoint key timm's training script files
    the scaler's state under; ``state_dict``/``load_state_dict`` are the GradScaler's, plus
    the fp8 recipe's under ``"dispatch_amp_fp8"`` when there is one.

    Example::

        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_scaler = NativeScaler(GradScaler("cpu", init_scale=4.0))
        >>> loss_scaler(model(torch.ones(1, 2)).sum(), opt, clip_grad=1.0, parameters=model.parameters())
        >>> loss_scaler.state_dict()["scale"]
        4.0
        >>> NativeScaler().scaler.is_enabled()      # "cuda" where available, else "cpu"
        True
    """

    state_dict_key = "amp_scaler"

    def __init__(self, scaler: Any = None, device: str | torch.device | None = None, *, fp8: Any = None) -> None:
        if isinstance(scaler, (str, torch.device)):
            # timm's signature is NativeScaler(device="cuda"): its first positional argument
            # is the device, ours the scaler.
            if device is not None:
                raise TypeError(
                    f"NativeScaler got a device twice ({scaler!r} positionally and device={device!r}); "
                    "pass it once, as device=..."
                )
            scaler, device = None, scaler
        if scaler is not None and device is not None:
            raise TypeError(
                f"NativeScaler got both scaler= and device={device!r}; device= only chooses the "
                "device of the GradScaler built when none is given: build yours on that device "
                "(GradScaler(device, ...)) and pass it alone"
            )
        if scaler is None:
            device = _default_device() if device is None else torch.device(device).type
            scaler = GradScaler(device)
        self._scaler = scaler
        self.fp8 = fp8

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
        with True on the last micro-batch). ``clip_grad`` needs ``parameters``; clipping
        runs on the unscaled gradients, before the step. ``clip_mode``: ``"norm"``
        (``clip_grad_norm_``), ``"value"`` (``clip_grad_value_``) or ``"agc"`` (adaptive
        gradient clipping, ``clip_grad`` the clip factor: each output unit's gradient norm
        is capped at ``clip_grad * max(weight norm, 1e-3)``). A step the scaler skips for
        inf/nan gradients leaves the parameters untouched in every mode.

        Example::

            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> loss_scaler = NativeScaler(device="cpu")
            >>> loss_scaler(model(torch.ones(1, 2)).sum(), opt, need_update=False)
            >>> model.bias.grad.item()          # scaled, not yet stepped
            65536.0
        """
        if clip_grad is not None and parameters is None:
            raise ValueError("clip_grad was given without parameters; pass parameters=model.parameters()")
        if clip_grad is not None and clip_mode not in _CLIP_MODES:
            # Checked before backward: a refused mode then leaves no scaled gradients behind.
            raise ValueError(
                f"clip_mode={clip_mode!r} is not supported; use 'norm' (clip_grad_norm_), 'value' "
                "(clip_grad_value_) or 'agc' (adaptive gradient clipping)"
            )
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            _clip(parameters, clip_grad, clip_mode)
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state (loads into timm's NativeScaler too), and the fp8 recipe's.

        Example::

            >>> sorted(NativeScaler(device="cpu").state_dict())[:2]
            ['_growth_tracker', '_hysteresis_tracker']
        """
        state = self._scaler.state_dict()
        _fp8_state.save_into(state, self.fp8)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()``, ours or timm's (torch's GradScaler format).

        Example::

            >>> a = NativeScaler(GradScaler("cpu", init_scale=8.0)); b = NativeScaler(device="cpu")
            >>> b.load_state_dict(a.state_dict()); b.scaler.get_scale()
            8.0
        """
        state_dict = dict(state_dict)
        fp8_state = state_dict.pop(_fp8_state.CHECKPOINT_KEY, None)
        if fp8_state is not None and self.fp8 is not None:
            self.fp8.load_state_dict(fp8_state)  # first: a bad recipe state leaves the scaler as it was
        self._scaler.load_state_dict(state_dict)
