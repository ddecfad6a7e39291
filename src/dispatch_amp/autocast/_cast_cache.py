"""The weight-cast cache, and ``cast_cache``: keeping the casts across regions.

Native autocast caches the lower-precision cast of each float32 leaf that requires grad
(a weight) for the rest of the outermost region, in one cache for the whole process, and
drops it when a thread's outermost region closes. Ours does the same by default
(``lookup``/``region_closed``), with two checks native lacks: an entry is used only while
the weight's version counter (any in-place change: an optimizer step, ``copy_``,
``load_state_dict``) and its storage (a ``.data =`` assignment) are those it was cast
from. Native drops its cache by calling ``torch.clear_autocast_cache``; where that function
has been replaced (torch's tests of its global cache replace it to keep the casts for a
backward run after the region), ours is kept too.

Native re-casts every weight in each region, so each micro-batch of gradient accumulation
and each forward of an eval loop casts them all again. Inside ``cast_cache()`` the casts
are kept across the regions opened in it, and dropped when it closes, when any
optimizer steps (a global step hook, registered while a ``cast_cache`` is open) and,
per entry, when the weight changes as above.

Why it is a scope and not the default: a write through ``.data`` (``p.data.copy_(...)``,
``p.data.add_(...)``, common in hand-written optimizers, EMA and target-network updates)
changes a weight without touching its version counter or its storage, so no check can
see it; native's per-region cache sees it at the next region, a cache kept across regions
would not. So keeping casts is asked for where the code between regions is known:
an accumulation loop, an eval loop.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _torch_compat
from ..fp8 import _quantize as _fp8_copies

__all__ = ["cast_cache", "lookup", "region_closed", "clear", "keeps_casts"]

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = _torch_compat.set_grad_enabled


class _Cache:
    def __init__(self):
        # (id(src), dtype) -> (src, src._version, src.data_ptr(), generation, nbytes, cast)
        self.entries: dict = {}
        # Bumped by every optimizer step while a cast_cache is open: older entries are stale.
        self.generation = 0
        self.scopes = 0  # open cast_cache scopes, every thread
        self.max_bytes: int | None = None
        self.nbytes = 0
        self.hook = None
        self.lock = threading.Lock()


CACHE = _Cache()


def lookup(t: torch.Tensor, dtype: torch.dtype, to):
    """The cached cast of ``t`` to ``dtype`` (made now with ``to`` if there is none or it
    is stale). The cast is made with grad mode on, as native makes it, so one cached cast
    serves no_grad and grad mode alike.

    The engine calls it for every weight argument of every matmul and convolution, so the
    checks are written out here rather than in helpers (a Python call costs as much as
    two of them)."""
    cache = CACHE
    key = (id(t), dtype)
    hit = cache.entries.get(key)
    try:
        where = t.data_ptr()
    except RuntimeError:  # no storage of its own (torch.func's wrappers, fake tensors)
        where = None
    version = t._version
    if hit is not None and hit[0] is t and hit[1] == version and hit[2] == where and hit[3] == cache.generation:
        return hit[5]
    if _grad_enabled():  # the common case
        out = to(t) if to is not None else t.to(dtype)
    else:
        # torch.enable_grad() without its context-manager object (a fifth of the cost:
        # an eval loop casts every weight here, once per region).
        _set_grad_enabled(True)
        try:
            out = to(t) if to is not None else t.to(dtype)
        finally:
            _set_grad_enabled(False)
    nbytes = out.nbytes
    if hit is not None:
        cache.nbytes -= hit[4]
    cache.entries[key] = (t, version, where, cache.generation, nbytes, out)
    cache.nbytes += nbytes
    if cache.max_bytes is not None and cache.nbytes > cache.max_bytes:
        _evict_oldest(cache, keep=key)
    return out


def _evict_oldest(cache: _Cache, keep) -> None:
    for key in list(cache.entries):
        if cache.nbytes <= cache.max_bytes:
            return
        if key != keep:
            cache.nbytes -= cache.entries.pop(key)[4]


def clear() -> None:
    """Drops every cached cast, and every fp8 weight copy (``fp8/_quantize.py``)."""
    CACHE.entries.clear()
    CACHE.nbytes = 0
    _fp8_copies.drop_all()


def keeps_casts() -> bool:
    """Whether a ``cast_cache`` scope keeps casts across regions now."""
    return CACHE.scopes > 0


def region_closed() -> None:
    """A thread's outermost region closed: native drops its casts here, and so do we
    (and this thread's fp8 weight copies), unless a ``cast_cache`` keeps them."""
    if not keeps_casts():
        CACHE.entries.clear()
        CACHE.nbytes = 0
        _fp8_copies.region_closed()


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    CACHE.generation += 1


class cast_cache:
    """Keeps weight casts across the autocast regions opened inside it.

    Inside, the lower-precision cast of each weight (a float32 leaf that requires grad)
    made in one region serves the next ones too, until the weight changes in place (its
    version counter), gets new storage (``.data =``), an optimizer steps, or the scope
    closes. Use it around a gradient-accumulation loop or an eval loop: native autocast
    casts every weight again in each region. The results are the same bits (a cast is
    deterministic). Memory: the casts of the weights used inside are held until the scope
    closes (``max_bytes`` bounds it; the oldest casts are dropped first).

    A weight changed through ``.data`` (``p.data.copy_(...)``) is invisible to these
    checks: call ``dispatch_amp.clear_autocast_cache()`` after such a change, or keep the
    change outside the scope.

    Example::

        with amp.cast_cache():
            for x, y in micro_batches:                 # 4 micro-batches, one cast each
                with amp.autocast("cuda"):
                    loss = loss_fn(model(x), y) / 4
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    """

    def __init__(self, max_bytes: int | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._saved_max: list = []

    def __enter__(self) -> cast_cache:
        cache = CACHE
        with cache.lock:
            if cache.scopes == 0:
                cache.hook = register_optimizer_step_post_hook(_optimizer_stepped)
            cache.scopes += 1
            self._saved_max.append(cache.max_bytes)
            if self.max_bytes is not None:
                cache.max_bytes = self.max_bytes if cache.max_bytes is None else min(cache.max_bytes, self.max_bytes)
        return self

    def __exit__(self, *exc) -> None:
        cache = CACHE
        with cache.lock:
            cache.max_bytes = self._saved_max.pop()
            cache.scopes -= 1
            if cache.scopes == 0:
                cache.hook.remove()
                cache.hook = None
                clear()


_torch_compat.keep_out_of_dynamo(globals(), __name__)
