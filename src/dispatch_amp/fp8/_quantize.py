"""Quantizing one operand: the one quantize of the fp8 path, and the weight cache.

:func:`quantize` asks the recipe's scaling rule (``_scaling.py``) how the scale is chosen
and what recording the call does, and hands both to ``kernels/fp8_quantize.py``, which
runs the torch rule or the Triton kernels (the choice is made there, bit for bit the
same).

The weight cache: an eager call inside an autocast region quantizes a weight once per
version of it, for the rest of the region (as native autocast casts a weight once per
region): a tied weight called twice reuses the first call's fp8 copies (and the layouts
made so far), and each reuse records the same statistics a new quantization would (the
same amax), with the scale of the first call. The copies (and the bias's cast) are
dropped when the thread's outermost region closes (``region_closed``, called by
``autocast/_cast_cache.py``), so a write between regions is never missed, whatever form it
takes (``p.data -= ...``, ``p.data.copy_``, fused optimizer kernels called directly,
collectives, ``.data =``). Inside ``amp.cast_cache()`` they are kept across the regions
of the scope, until it closes. Within that lifetime an entry is used only while the
weight is what it was quantized from, as far as a tensor can tell: the same storage
object (held, so its address cannot be reused behind the entry), storage offset, shape,
strides, dtype and version counter; a write through ``.data`` in place is invisible to
these checks, which is why nothing is kept across regions by default. The cache is also
emptied before every optimizer step (``_step_hooks.py``), so no copy outlives its
weight's version in memory. A call outside any region, a recomputation (which records
nothing) and a compiled graph quantize every call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .. import _torch_compat
from ..kernels import fp8_quantize as _kernels

__all__ = ["quantize", "quantize_weight", "quantize_bias", "record_quantized", "region_closed", "drop_all", "restored",
           "kept_scale"]

_float32 = torch.float32


@dataclass
class _Cached:
    """A weight's fp8 copies for one version of it, and what recording a call needs.

    ``key`` None: a scale restored from a checkpoint (``restored``), no copy made yet."""

    key: tuple | None
    q: torch.Tensor | None
    q_t: torch.Tensor | None
    sc: torch.Tensor
    stats: tuple  # torch path: (amax, saturated); kernel path: (int64 [amax bits, saturated],)
    storage: object = None  # held: its address cannot be reused while the entry lives
    owner: object = None  # the lifetime it belongs to (_Lifetime.owner)
    generation: int = 0
    # The site's weight's key when the copy was made (the copy may be of its transpose:
    # transformers' Conv1D), for kept_scale.
    holder_key: tuple | None = None


class _Lifetime(threading.local):
    """This thread's cache lifetime: the outermost region (or ``cast_cache`` scope) now
    open. ``owner`` is replaced when it ends; ``sites``: the sites holding its copies (a
    set: a region around a whole training loop re-quantizes after every step)."""

    def __init__(self) -> None:
        self.owner = object()
        self.sites: set = set()


_LIFE = _Lifetime()
# Whether a copy was ever kept in this process (any thread): until then no lifetime has a
# site, and the engine need not call region_closed at every region's close.
kept_any = False
# Bumped by drop_all: every thread's entries made before are stale.
_GENERATION = [0]
_nesting_up = torch.autocast_increment_nesting
_nesting_down = torch.autocast_decrement_nesting


def _note_kept() -> None:
    global kept_any
    kept_any = True


def region_closed() -> None:
    """Ends this thread's cache lifetime: its outermost autocast region closed (outside a
    ``cast_cache`` scope), or its ``cast_cache`` scope did. Its fp8 copies are freed."""
    life = _LIFE
    sites = life.sites
    if not sites:
        # No copy was made in this lifetime (a site is recorded before its copy is kept):
        # none holds its owner, which can serve the next lifetime as a new one would.
        return
    owner = life.owner
    life.owner, life.sites = object(), set()
    for site in sites:
        cached = site.cached
        if cached is not None and cached.owner is owner:
            site.cached = None
        bias = site.cached_bias
        if bias is not None and bias[2] is owner:
            site.cached_bias = None


def drop_all() -> None:
    """Makes every thread's fp8 copies stale (``clear_autocast_cache()``)."""
    _GENERATION[0] += 1
    region_closed()


def restored(site, scale: torch.Tensor) -> None:
    """The scale a checkpoint saved for the weight's copy (delayed scaling saved in the
    middle of a ``cast_cache`` scope): the weight's next quantization uses it, as the
    copy it stands for would have been reused."""
    sc = torch.stack([scale, scale.reciprocal()])
    site.cached = _Cached(None, None, None, sc, (), owner=None, generation=_GENERATION[0])


def kept_scale(site) -> torch.Tensor | None:
    """The scale of the weight's fp8 copy that later calls would reuse (for a checkpoint),
    or None: no copy, or one its weight no longer matches."""
    cached = site.cached
    if cached is None or cached.generation != _GENERATION[0]:
        return None
    if cached.key is not None:
        weight = site.alive()
        found = None if weight is None else _identity(weight)
        if found is None or found[0] is not cached.storage or found[1] != cached.holder_key:
            return None
    return cached.sc[0]


def _in_region() -> bool:
    # An autocast region (ours counts in torch's nesting counter) is open on this thread:
    # only there does a lifetime end (region_closed) for the copies made now.
    depth = _nesting_up()
    _nesting_down()
    return depth > 1


def _identity(t: torch.Tensor):
    """``(storage, key)`` for a cache entry of ``t``, or None (no storage of its own:
    torch.func's wrappers, fake tensors)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage, (t._version, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device)


def quantize(owner, t2: torch.Tensor, role: str, site, record: bool, scale: torch.Tensor | None = None,
             need_q: bool = True, need_qt: bool = False, dbias: bool = False, snapshot: list | None = None):
    """``(q, q_t, sc, db)`` of a 2-D operand of ``role`` under ``owner`` (an ``Fp8State``):
    the layouts asked for (else None), its scales and the bias gradient of ``t2`` when
    ``dbias``. ``sc`` is ``[scale, 1 / scale]`` with one scale per tensor, and the
    inverse scales (``(rows, 1)`` for one per row) for a rule with many scales along the
    contraction dimension (no ``q_t``, ``db``). ``scale``: one
    fixed elsewhere (a replay), else the rule's choice. Records the call on ``site`` when
    ``record``; ``snapshot`` (a list) receives what recording took.

    The one quantize of the fp8 path: the rule chooses the scale and says what recording
    does; ``kernels/fp8_quantize.py`` runs it, with torch or the Triton kernels.
    """
    rule = owner.rule
    state = site.roles[role] if site is not None else None
    recording = record and state is not None
    fmt = rule.dtype(role)
    how = rule.record_rule(role) if recording else None
    if rule.granularity != "tensor":  # many scales along the contraction dimension
        q, inv = _kernels.quantize_along_k(t2, fmt, rule.choose(state, role), state=state if recording else None,
                                           record=how)
        out = q, None, inv, None
    else:
        choice = rule.given(scale) if scale is not None else rule.choose(state, role)
        out = _kernels.quantize(t2, fmt, choice, state=state if recording else None, record=how, need_q=need_q,
                                need_qt=need_qt, dbias=dbias, snapshot=snapshot)
    if recording:
        rule.recorded(owner, state)
    return out


def quantize_weight(owner, weight: torch.Tensor, site, record: bool,
                    scale: torch.Tensor | None, need_qt: bool):
    """``(q, q_t, sc)`` of the weight, from the cache when this version of it was
    quantized already in this lifetime (with the transposed layout, if asked for)."""
    if site is None or not record or torch.compiler.is_compiling() or weight.is_inference():
        # No version counter (inference tensors); a recomputation, which records nothing:
        # quantized afresh, with the scales it replays.
        q, q_t, sc, _ = quantize(owner, weight, "weight", site, record, scale, need_qt=need_qt)
        return q, q_t, sc
    found = _identity(weight)
    if found is None or not _in_region():
        q, q_t, sc, _ = quantize(owner, weight, "weight", site, record, scale, need_qt=need_qt)
        return q, q_t, sc
    storage, key = found
    key = (*key, owner.rule.forward_dtype, torch.is_inference_mode_enabled())
    life, generation = _LIFE, _GENERATION[0]
    cached = site.cached
    if cached is not None and cached.generation == generation:
        if cached.key is None:  # a restored scale: the copy it stands for is made now
            if scale is None:
                scale = cached.sc[0].to(weight.device)
        elif (cached.owner is life.owner and cached.storage is storage and cached.key == key
              and (cached.q_t is not None or not need_qt)
              and (scale is None or scale.data_ptr() == cached.sc.data_ptr())):
            _record_cached(owner, site, cached)
            return cached.q, (cached.q_t if need_qt else None), cached.sc
    if scale is not None and (cached is None or cached.key is not None):
        # A replay of another copy's scale: nothing to keep.
        q, q_t, sc, _ = quantize(owner, weight, "weight", site, True, scale, need_qt=need_qt)
        return q, q_t, sc
    snapshot: list = []
    q, q_t, sc, _ = quantize(owner, weight, "weight", site, True, scale, need_qt=need_qt, snapshot=snapshot)
    if snapshot:
        holder = site.alive()
        held = found if holder is weight else (None if holder is None else _identity(holder))
        _note_kept()
        life.sites.add(site)  # first: no copy of this lifetime is kept unrecorded (region_closed)
        site.cached = _Cached(key, q, q_t, sc, tuple(snapshot), storage, life.owner, generation,
                              None if held is None else held[1])
        owner.watch()  # the copy is dropped before the next optimizer step
    return q, q_t, sc


def _record_cached(owner, site, cached) -> None:
    """Records a call that reused the weight's fp8 copy: the statistics of its quantization."""
    state = site.roles["weight"]
    _kernels.record_stats(state, cached.stats, cached.sc, owner.rule.record_rule("weight"))
    owner.rule.recorded(owner, state)


def record_quantized(owner, site, role: str, amax: torch.Tensor, saturated: torch.Tensor, sc: torch.Tensor) -> None:
    """Records a call whose operand was quantized elsewhere (an fp8 all-gather's weight):
    ``amax`` and ``saturated`` of the whole operand, ``sc`` the scales it was cast with."""
    state = site.roles[role]
    _kernels.record_stats(state, (amax, saturated), sc, owner.rule.record_rule(role))
    owner.rule.recorded(owner, state)


def quantize_bias(site, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the gemm's output dtype, cast once per version of it in the weight
    cache's lifetime."""
    if bias is None or bias.dtype == out_dtype:
        return bias
    if site is None or torch.compiler.is_compiling() or bias.is_inference():
        return bias.detach().to(out_dtype)
    found = _identity(bias)
    if found is None or not _in_region():
        return bias.detach().to(out_dtype)
    storage, key = found
    key = (*key, out_dtype, torch.is_inference_mode_enabled(), _GENERATION[0])
    life = _LIFE
    cached = site.cached_bias
    if cached is not None and cached[2] is life.owner and cached[1] is storage and cached[0] == key:
        return cached[3]
    low = bias.detach().to(out_dtype)
    _note_kept()
    life.sites.add(site)  # first, as in quantize_weight
    site.cached_bias = (key, storage, life.owner, low)
    return low


_torch_compat.keep_out_of_dynamo(globals(), __name__)
