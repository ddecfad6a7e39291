"""Triton kernels of dispatch-amp, one file per kernel family, each with a torch reference.

Public:

* :func:`unscale_check_` ``(grads, inv_scale, found_inf, backend="auto", *, nonfinite=None)``:
  unscale in place and flag inf/nan, one launch for every gradient; ``nonfinite`` also
  flags each gradient.
* :func:`check_finite_` ``(grads, found_inf, backend="auto", *, nonfinite=None)``: the
  read-only check.
* :func:`uses_triton` ``(device, backend="auto")``: whether those two launch the Triton
  kernel there (where per-tensor flags come with the one launch).
* :func:`update_scale_` ``(state, found_inf, growth_factor, backoff_factor,
  growth_interval, *, hysteresis=1, min_scale=None, max_scale=None, backend="auto")``:
  the device-side loss-scale update, with :class:`ScaleState` holding its tensors.
* :func:`amax_and_cast` ``(t, scale, fp8_dtype, *, backend="auto")``: fp8 cast with a known
  scale, returning ``(q, amax, saturated)`` from one pass over ``t``.
* :func:`cast_transpose` ``(t, scale, fp8_dtype, *, backend="auto")``: the same for a 2-D
  ``t``, also writing the transposed fp8 copy: ``(q, q_t, amax, saturated)``.
* :func:`quantize_` ``(t, fp8_dtype, *, mode, scale, initialized, amax_acc, saturated_acc,
  sc_out, ...)``: the fp8 linear's cast: one read, the scale taken from where the recipe
  keeps it, the layouts asked for, the bias gradient for ``grad_output``.
* :func:`bias_grad` ``(t)``: a bias gradient in the fixed order :func:`quantize_` uses.
* :func:`amax_into_` ``(t, acc)`` / :func:`amax` ``(t)``: ``max|t|`` in one read.
* :func:`record_` ``(f, i, amax_acc, saturated_acc, scale_used, *, history, ...)``: a call's
  statistics and delayed scaling's history update, one launch.
* :func:`fp8_max` ``(fp8_dtype)``: the largest finite value of an fp8 format.
* :func:`quantize_tiles` ``(t, fp8_dtype, *, rowwise, colwise, power_of_two, block)``: block
  scaling's 1 x 128 tiles (rowwise) and 128 x 1 tiles (colwise, written transposed) from
  one read, with their float32 inverse scales.
* :func:`quantize_blocks` ``(t, fp8_dtype, *, write_q, write_qt, power_of_two, block)``:
  128 x 128 blocks (weights), the fp8 copy and/or its transpose from one read.

Example::

    >>> import torch
    >>> from dispatch_amp.kernels import unscale_check_
    >>> found_inf = torch.zeros(())
    >>> unscale_check_([torch.ones(4)], torch.tensor(0.5), found_inf)
"""

from .fp8_amax import amax, amax_into_, amax_reference
from .fp8_block import quantize_blocks, quantize_blocks_reference, quantize_tiles, quantize_tiles_reference
from .fp8_cast import (amax_and_cast, amax_and_cast_reference, bias_grad, bias_grad_reference, cast_transpose,
                       cast_transpose_reference, fp8_max, quantize_, quantize_reference, resolve_scale_reference)
from .fp8_scale import record_, record_reference, scale_from_amax_reference
from .scale_update import ScaleState, update_scale_, update_scale_reference
from .unscale import check_finite_, clear_table_cache, unscale_check_, unscale_check_reference, uses_triton

__all__ = [
    "ScaleState",
    "amax",
    "amax_into_",
    "amax_reference",
    "amax_and_cast",
    "amax_and_cast_reference",
    "bias_grad",
    "bias_grad_reference",
    "cast_transpose",
    "cast_transpose_reference",
    "check_finite_",
    "clear_table_cache",
    "fp8_max",
    "quantize_",
    "quantize_reference",
    "quantize_blocks",
    "quantize_blocks_reference",
    "quantize_tiles",
    "quantize_tiles_reference",
    "record_",
    "record_reference",
    "resolve_scale_reference",
    "scale_from_amax_reference",
    "unscale_check_",
    "unscale_check_reference",
    "update_scale_",
    "update_scale_reference",
    "uses_triton",
]
