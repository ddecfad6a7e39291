"""The scaler part: dynamic loss scaling, a drop-in for ``torch.amp.GradScaler``.

Modules: ``grad_scaler.py`` (``GradScaler`` and its per-optimizer state machine),
``config.py`` (its settings and state-dict parsing), ``diagnostics.py`` (scale history,
overflow reports, the numerics warnings), ``collection.py`` (gradients per device),
``flag_read.py`` (the one packed host read per step) and ``distributed.py`` (flags across
ranks). The Triton kernels it launches are in ``dispatch_amp.kernels``.

Example::

    >>> import torch
    >>> from dispatch_amp.scaler import GradScaler
    >>> scaler = GradScaler("cpu", init_scale=8.0)
    >>> scaler.scale(torch.ones(())).item()
    8.0
"""

from .diagnostics import AmpNumericsWarning, NonFiniteGradient, OverflowReport
from .grad_scaler import GradScaler, OptState

__all__ = ["GradScaler", "OptState", "AmpNumericsWarning", "NonFiniteGradient", "OverflowReport"]
