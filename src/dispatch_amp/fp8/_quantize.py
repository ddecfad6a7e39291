"""Quantizing one operand with one scale: the torch rule, the CUDA kernels, the weight cache.

Both paths follow the same rules (``kernels/fp8_cast.py``, ``kernels/fp8_scale.py``) bit
for bit; the recipe decides the scale (its ``_scale``) and what a call records (its
``_record``). On the kernel path (CUDA, or Triton's interpreter in tests) a quantize is:

* current scaling: the amax kernel, then the cast kernel (which derives the scale from
  that amax itself), then the statistics kernel;
* delayed scaling: the cast kernel with the scale in force (computing the amax in the same
  read), then the statistics kernel, which also advances the history; before the host
  knows the site has a scale of its own, the amax kernel first and the cast kernel choosing
  on the device (see ``DelayedScaling``).

The weight cache: an eager call quantizes a weight once per version of it (its in-place
version counter and storage): gradient-accumulation micro-batches and evaluation loops
reuse the fp8 copies (and the layouts made so far), and each reuse records the same
statistics a new quantization would (the same amax), with the scale of the first call of
that version. An in-place change (an optimizer step) makes a new version; the cache is
also emptied before every optimizer step (``_step_hooks.py``), so no copy outlives its
weight's version in memory. A compiled graph quantizes every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat
from ..kernels import fp8_amax, fp8_cast
from ..kernels.fp8_scale import F_INIT, F_SCALE, I_ACC_SATURATED
from . import _step_hooks
from ._rules import amax as _amax
from ._rules import cast as _cast
from ._rules import kernels_in_use

__all__ = ["quantize", "quantize_weight", "quantize_bias"]

_float32 = torch.float32


@dataclass
class _Cached:
    """A weight's fp8 copies for one version of it, and what recording a call needs."""

    key: tuple
    q: torch.Tensor
    q_t: torch.Tensor | None
    sc: torch.Tensor
    stats: tuple  # torch path: (amax, saturated); kernel path: (int64 [amax bits, saturated],)


def quantize(recipe, t2: torch.Tensor, role: str, fmt: torch.dtype, site, record: bool,
             scale: torch.Tensor | None = None, need_q: bool = True, need_qt: bool = False,
             dbias: bool = False, snapshot: list | None = None):
    """``(q, q_t, sc, db)`` of a 2-D operand: the layouts asked for (else None), ``sc =
    [scale, 1 / scale]``, and the bias gradient of ``t2`` when ``dbias``. Records the call
    on ``site`` when ``record``; ``snapshot`` (a list) receives what recording took."""
    if kernels_in_use(t2):
        return _with_kernels(recipe, t2.contiguous(), role, fmt, site, record, scale, need_q, need_qt, dbias, snapshot)
    a = None
    if scale is None:
        scale, a = recipe._scale(t2, role, fmt, site)
    q, saturated = _cast(t2, scale, fmt)
    if a is None:
        a = _amax(t2)
    q_t = q.t().contiguous() if need_qt else None
    sc = torch.stack([scale, scale.reciprocal()])
    if record and site is not None:
        recipe._record(site, role, a, sc[0], saturated, fmt)
        if snapshot is not None:
            snapshot.extend([a, saturated])
    db = fp8_cast.bias_grad_reference(t2) if dbias else None
    return (q if need_q else None), q_t, sc, db


def _with_kernels(recipe, t2, role, fmt, site, record, scale, need_q, need_qt, dbias, snapshot):
    state = site.roles[role] if site is not None else None
    recording = record and state is not None
    if recording:
        acc, saturated = state.acc, state.i[I_ACC_SATURATED:]
    else:  # a replay or a call without a site: accumulators of its own
        acc, saturated = fp8_cast.new_accumulators(t2.device)
    sc = torch.empty(2, dtype=_float32, device=t2.device)
    given, initialized, mode = scale, None, "given"
    if scale is None:
        if recipe.stateful and recipe._scale_known(state):
            given = state.f[F_SCALE]
        else:
            fp8_amax.amax_into_(t2, acc, backend="triton")
            mode = "first" if recipe.stateful else "amax"
            if recipe.stateful:
                given, initialized = state.f[F_SCALE], state.f[F_INIT]
    q, q_t, db = fp8_cast.quantize_(
        t2, fmt, mode=mode, scale=given, initialized=initialized, amax_acc=acc, saturated_acc=saturated, sc_out=sc,
        margin=getattr(recipe, "margin", 0), power_of_two=recipe.power_of_two, accumulate_amax=mode == "given",
        write_q=need_q, write_qt=need_qt, dbias=dbias, backend="triton")
    if recording:
        snap = None
        if snapshot is not None:
            snap = torch.empty(2, dtype=torch.int64, device=t2.device)
            snapshot.append(snap)
        recipe._record_accumulated(state, acc, saturated, sc, fmt, snap)
    return q, q_t, sc, db


def quantize_weight(recipe, weight: torch.Tensor, fmt: torch.dtype, site, record: bool,
                    scale: torch.Tensor | None, need_qt: bool):
    """``(q, q_t, sc)`` of the weight, from the cache when this version of it was
    quantized already (with the transposed layout, if asked for)."""
    if site is None or torch.compiler.is_compiling() or weight.is_inference():  # no version counter there
        q, q_t, sc, _ = quantize(recipe, weight, "weight", fmt, site, record, scale, need_qt=need_qt)
        return q, q_t, sc
    # The strides tell a parameter from its transpose (one site, two linears: a tied
    # weight called as linear(x, p) and as addmm(b, x, p), see _reach.py).
    key = (weight._version, weight.data_ptr(), weight.stride(), weight.device, fmt, torch.is_inference_mode_enabled())
    cached = site.cached
    if (cached is not None and cached.key == key and (cached.q_t is not None or not need_qt)
            and (scale is None or scale.data_ptr() == cached.sc.data_ptr())):
        if record:
            recipe._record_cached(site, cached, fmt)
        return cached.q, (cached.q_t if need_qt else None), cached.sc
    if scale is not None:  # a replay of another version's scale: nothing to keep
        q, q_t, sc, _ = quantize(recipe, weight, "weight", fmt, site, record, scale, need_qt=need_qt)
        return q, q_t, sc
    snapshot: list = []
    q, q_t, sc, _ = quantize(recipe, weight, "weight", fmt, site, True, None, need_qt=need_qt, snapshot=snapshot)
    if snapshot:
        site.cached = _Cached(key, q, q_t, sc, tuple(snapshot))
        _step_hooks.watch(recipe)
    return q, q_t, sc


def quantize_bias(site, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the gemm's output dtype, cast once per version of it."""
    if bias is None or bias.dtype == out_dtype:
        return bias
    if site is None or torch.compiler.is_compiling() or bias.is_inference():
        return bias.detach().to(out_dtype)
    key = (bias._version, bias.data_ptr(), out_dtype, torch.is_inference_mode_enabled())
    cached = site.cached_bias
    if cached is not None and cached[0] == key:
        return cached[1]
    low = bias.detach().to(out_dtype)
    site.cached_bias = (key, low)
    return low


_torch_compat.keep_out_of_dynamo(globals(), __name__)
