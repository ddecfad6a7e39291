"""Which gradients GradScaler unscales and checks, and as which tensors.

:func:`collect_grads` walks an optimizer's parameters and returns, per device, the
parameters with gradients and the dense real tensors to unscale in place: a DTensor
gradient (FSDP2) through its local shard, a sparse one through its values (coalesced
first in fp16: duplicate indices could overflow only once summed, as torch does), a
complex one through a real view of the same memory (both parts unscaled and checked).
It reads no gradient values, so a refusal it raises changes nothing.
"""

from __future__ import annotations

import torch

from . import distributed as _dist

__all__ = ["collect_grads"]


def collect_grads(optimizer, refuse_fp16: bool) -> dict[torch.device, tuple[list, list]]:
    """The optimizer's gradients to check, as ``device -> (parameters, gradient tensors)``.

    ``refuse_fp16``: raise ``ValueError`` on fp16 gradients (the parameters themselves
    are fp16: unscaling them in place would lose what the scale protected).

    Example::

        >>> p = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
        >>> p.grad = torch.ones(2, dtype=torch.complex64)
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> [g.dtype for g in collect_grads(opt, refuse_fp16=True)[torch.device("cpu")][1]]
        [torch.float32]
    """
    grads: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if refuse_fp16 and grad.dtype in (torch.float16, torch.complex32):
                raise ValueError(
                    "Attempting to unscale FP16 gradients: the parameters themselves are fp16. "
                    "Keep fp32 master parameters (autocast casts inside the forward) for GradScaler."
                )
            if type(grad) is not torch.Tensor or grad.is_sparse:  # noqa: E721 - subclasses (DTensor) take the slow path
                grad = _checkable_values(param, grad)
            if grad.is_complex():
                grad = torch.view_as_real(grad)
            grads.append(grad)
            params.append(param)
    if not grads:
        return {}
    first = grads[0].device
    if all(g.device == first for g in grads):
        return {first: (params, grads)}
    per_device: dict[torch.device, tuple[list, list]] = {}
    for param, grad in zip(params, grads):
        ps, gs = per_device.setdefault(grad.device, ([], []))
        ps.append(param)
        gs.append(grad)
    return per_device


def _checkable_values(param, grad: torch.Tensor) -> torch.Tensor:
    """The dense tensor to unscale in place for a DTensor or sparse gradient."""
    # A DTensor gradient is unscaled through its local shard, in place; ranks agree
    # through the found_inf reduction (distributed.py).
    grad = _dist.local_tensor(grad)
    if grad.is_sparse:
        if grad.dtype is torch.float16:
            param.grad = grad = grad.coalesce()
        grad = grad._values()
    return grad
