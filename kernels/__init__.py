"""Triton kernels of dispatch-amp, one file per kernel family, each with a torch reference.

Public:

* :func:`unscale_check_` ``(grads, inv_scale, found_inf, backend="auto", *, nonfinite=None)``:
  unscale in place and flag inf/nan, one launch for every gradient; ``nonfinite`` also
  flags each gradient.
* :func:`check_finite_` ``(grads, found_inf, backend="auto", *, nonfinite=None)``: the
  read-only check.
* :func:`uses_triton` ``(device, backend="auto")``: whether those two launch the Triton
  kernel there (where per-tensor flags cost no extra pass).
* :func:`update_scale_` ``(state, found_inf, growth_factor, backoff_factor,
  growth_interval, *, hysteresis=1, min_scale=None, max_scale=None, backend="auto")``:
  the device-side loss-scale update, with :class:`ScaleState` holding its tensors.

Example::

    >>> import torch
    >>> from dispatch_amp.kernels import unscale_check_
    >>> found_inf = torch.zeros(())
    >>> unscale_check_([torch.ones(4)], torch.tensor(0.5), found_inf)
"""

from .scale_update import ScaleState, update_scale_, update_scale_reference
from .unscale import check_finite_, clear_table_cache, unscale_check_, unscale_check_reference, uses_triton

__all__ = [
    "ScaleState",
    "check_finite_",
    "clear_table_cache",
    "unscale_check_",
    "unscale_check_reference",
    "update_scale_",
    "update_scale_reference",
    "uses_triton",
]
