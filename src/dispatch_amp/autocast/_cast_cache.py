"""The weight-cast cache, and ``cast_cache``: keeping the casts across regions.

Native autocast caches the lower-precision cast of each float32 leaf that requires grad
(a weight) for the rest of the outermost region, in one cache for the whole process, and
drops it when a thread's outermost region closes. Ours does the same by default
(``REGION``, ``lookup``/``region_closed``): one cache for the process, so a backward that
torch runs on its own device threads (CUDA) and that re-enters autocast finds the
forward's casts there as native's does; native drops its cache by calling
``torch.clear_autocast_cache``, and where that function has been replaced (torch's tests
of its global cache replace it to keep the casts for a backward run after the region),
ours is kept too.

An entry is used only while its weight is what it was cast from, as far as anything
short of reading the values can tell (``_fresh``): the same version counter (any
in-place change through the weight: an optimizer step, ``copy_``, ``load_state_dict``),
the same storage object (held by the entry, so that its memory cannot be freed and
handed to a new tensor behind the check), the same address within it (offset), shape,
strides and dtype (a ``.data =`` assignment of a slice, reshape or transpose of the same
storage, or of new storage), and no optimizer step since (a global step hook, registered
while a ``cast_cache`` is open anywhere). An entry also holds the weight itself, so that
its ``id`` cannot be reused.

Native re-casts every weight in each region, so each micro-batch of gradient accumulation
and each forward of an eval loop casts them all again. Inside ``cast_cache()`` the casts
are kept across the regions opened in it, in a store of the scope's own, and dropped when
it closes. The scope belongs to the context that opened it (a ``contextvars`` variable):
its thread, or its asyncio task and the tasks that task starts; other threads' regions,
torch's autograd device threads included, keep native's per-region lifetime.

Why it is a scope and not the default: some writes change a weight's values while
keeping every property above: a write in place through ``.data`` (``p.data.copy_(...)``,
``p.data -= lr * p.grad``, common in hand-written optimizers, EMA and target-network
updates), fused optimizer kernels called directly (``torch._fused_adam_``) and
collectives writing into the weight (``dist.broadcast``). Native's per-region cache sees
them at the next region, a cache kept across regions cannot. So keeping casts is asked
for where the code between regions is known: an accumulation loop, an eval loop.
"""

from __future__ import annotations

import contextvars
import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _torch_compat
from ..fp8 import _quantize as _fp8_copies

__all__ = ["cast_cache", "keeps_casts", "lookup", "insert", "region_closed", "clear"]

_grad_enabled = torch.is_grad_enabled
_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_set_grad_enabled = _torch_compat.set_grad_enabled
_float32 = torch.float32
# The cast each dtype's Tensor method makes (what the engine passes as ``to``): the C++
# twin makes the same cast itself (``Tensor.to(dtype)``) without calling back.
_CAST_METHOD = {torch.float32: torch.Tensor.float, torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}

# An entry, keyed by id(weight): a list, read by index on the engine's hot path
# (_handlers.lower inlines _fresh's test). SHAPE and STRIDE are None until the entry's
# first use when the weight was contiguous: they are then its cast's (a cast of a
# contiguous tensor has its shape and strides), read once rather than at every cast (a
# training forward's casts are mostly never used again).
WEIGHT, DTYPE, VERSION, STORAGE, ADDRESS, SHAPE, STRIDE, GENERATION, CAST = range(9)


class _Store:
    """One cache: the process's per-region cache, or one ``cast_cache`` scope's.

    Under the compiled engine a store's entries live in its C++ twin (``native``, see
    ``use_native``): the same entries and tests, in one place for both halves of the
    engine. ``entries`` then answers what Python asks of it (how many; never a hit:
    lookups and inserts go to the twin).
    """

    def __init__(self):
        self.entries: dict = {}  # id(weight) -> entry (see WEIGHT...CAST)
        self.max_bytes: int | None = None
        self.nbytes = 0  # the casts' bytes, counted only while max_bytes is set
        self.depth = 0  # cast_cache scopes nested on this store
        self.open = True  # a scope's store closes with its outermost scope
        self.native = None  # the C++ twin under the compiled engine
        if _NATIVE is not None:
            self._attach(_NATIVE.Store())

    def _attach(self, native) -> None:
        self.native = native
        self.entries = _NativeEntries(native)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Bounds the store (None: unbounded), dropping its oldest casts to fit."""
        self.max_bytes = max_bytes
        if self.native is not None:
            self.native.set_max_bytes(-1 if max_bytes is None else max_bytes)
            return
        if max_bytes is not None:
            self.nbytes = sum(entry[CAST].nbytes for entry in self.entries.values())
            if self.nbytes > max_bytes:
                _evict_oldest(self, keep=None)

    def close(self) -> None:
        self.open = False
        if self.native is not None:
            self.native.close()
        self.clear()


class _NativeEntries:
    """A store's entries while they live in its C++ twin: their number, and no hit
    (Python's lookups and inserts call the twin, which tests and makes the casts)."""

    __slots__ = ("native",)

    def __init__(self, native):
        self.native = native

    def get(self, key, default=None):
        return default

    def __len__(self) -> int:
        return len(self.native)

    def __bool__(self) -> bool:
        return len(self.native) > 0

    def clear(self) -> None:
        self.native.clear()


class _Steps:
    """Optimizer steps, counted while a ``cast_cache`` is open anywhere: an entry made
    before the latest step is stale."""

    def __init__(self):
        self.generation = 0
        self.scopes = 0  # open cast_cache scopes, every thread
        self.hook = None
        self.lock = threading.Lock()


# The compiled engine's module once it runs in this process (use_native), else None.
_NATIVE = None
# The per-region cache: one for the process, as native's (see the module docstring).
# Its dict is cleared in place, never replaced (the engine's hot path holds it).
REGION = _Store()
# The store of the cast_cache scope open in this context, or None.
SCOPE: contextvars.ContextVar = contextvars.ContextVar("dispatch_amp_cast_cache", default=None)
STEPS = _Steps()


def use_native(module) -> None:
    """The compiled engine runs in this process: the stores' entries live in C++ twins
    (the per-region cache's is the module's own, which its kernels use directly), so that
    the Python kernels, where the C++ ones hand a call to them, use the same casts.
    Chosen before any cast is made (at the first kernel registration): the stores are
    empty. A store made earlier and still without a twin (another thread's scope) is
    reached through ``lookup`` by the C++ kernels."""
    global _NATIVE
    REGION._attach(module.region_store())
    with STEPS.lock:
        module.set_scopes_open(STEPS.scopes)
    store = SCOPE.get()
    if store is not None and store.native is None and not store.entries:
        store._attach(module.Store())
    _NATIVE = module


def keeps_casts() -> bool:
    """Whether a ``cast_cache`` scope is open in this context (this thread, or this
    asyncio task): casts of weights made here may outlive the region they are made in.

    Example::

        with amp.cast_cache():
            assert keeps_casts()
        assert not keeps_casts()
    """
    store = SCOPE.get()
    return store is not None and store.open


def _store() -> _Store:
    """The store lookups of this context use."""
    store = SCOPE.get()
    if store is None:
        return REGION
    if not store.open:  # closed from another context (a generator finished elsewhere)
        SCOPE.set(None)
        return REGION
    return store


def _fresh(hit, t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the entry ``hit`` still holds the cast of ``t`` to ``dtype``. The engine's
    ``lower`` writes the same test out inline."""
    if hit[DTYPE] is not dtype or hit[VERSION] != t._version or t.dtype is not _float32:
        return False
    try:
        same_storage = t.untyped_storage() is hit[STORAGE]
    except RuntimeError:  # no storage of its own (torch.func's wrappers, fake tensors)
        return False
    if not (same_storage and hit[ADDRESS] == t.data_ptr() and hit[GENERATION] == STEPS.generation):
        return False
    if hit[SHAPE] is None:  # first use: the weight was contiguous, so its cast tells
        cast = hit[CAST]
        hit[SHAPE], hit[STRIDE] = cast.shape, cast.stride()
    return t.shape == hit[SHAPE] and t.stride() == hit[STRIDE]


def lookup(t: torch.Tensor, dtype: torch.dtype, to):
    """The cached cast of ``t`` to ``dtype`` (made now with ``to`` if there is none or it
    is stale). The cast is made with grad mode on, as native makes it, so one cached cast
    serves no_grad and grad mode alike."""
    store = SCOPE.get()
    if store is None:
        store = REGION
    elif not store.open:
        store = _store()
    if store.native is not None:
        return store.native.cast(t, dtype, None if _CAST_METHOD.get(dtype) is to else to)
    hit = store.entries.get(id(t))
    if hit is not None and _fresh(hit, t, dtype):
        return hit[CAST]
    hit = None  # see insert: nothing may hold the stale entry while the new cast is made
    return insert(store, t, dtype, to)


def insert(store: _Store, t: torch.Tensor, dtype: torch.dtype, to):
    """Casts ``t`` to ``dtype`` (with ``to``) and keeps the cast in ``store`` (the one
    ``SCOPE`` gives, or ``REGION``), replacing its stale entry. The engine's ``lower``
    calls it for a weight it found no fresh entry for.

    The stale entry is dropped before the new cast is made, and callers hold no reference
    to it: its cast's ``grad_fn`` holds the weight's gradient accumulator, which records
    the weight's shape when it is made. Alive while the new cast is made (a ``.data =``
    row slice or reshape since), it would be the new cast's too, and the backward would
    refuse the gradient of the new shape."""
    if not store.open:  # a scope closed from another context since the caller read it
        store = _store()
    if store.native is not None:  # the twin tests its entry and makes the cast (C++)
        return store.native.cast(t, dtype, None if _CAST_METHOD.get(dtype) is to else to)
    stale = store.entries.pop(id(t), None)
    if stale is not None and store.max_bytes is not None:
        store.nbytes -= stale[CAST].nbytes
    stale = None
    # Read before the cast: what the cast is made from.
    version, generation = t._version, STEPS.generation
    try:
        storage, where = t.untyped_storage(), t.data_ptr()
    except RuntimeError:
        storage = None
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
    key = id(t)
    bounded = store.max_bytes is not None
    if storage is None:  # nothing to check a later use against: not kept
        return out
    if t.is_contiguous():  # shape and strides: the cast's, read at the first use
        store.entries[key] = [t, dtype, version, storage, where, None, None, generation, out]
    else:
        store.entries[key] = [t, dtype, version, storage, where, t.shape, t.stride(), generation, out]
    if bounded:
        store.nbytes += out.nbytes
        if store.nbytes > store.max_bytes:
            _evict_oldest(store, keep=key)
    return out


def _evict_oldest(store: _Store, keep) -> None:
    for key in list(store.entries):
        if store.nbytes <= store.max_bytes:
            return
        if key != keep:
            entry = store.entries.pop(key, None)
            if entry is not None:
                store.nbytes -= entry[CAST].nbytes


def clear() -> None:
    """Drops the cached casts this context can use: the per-region cache's (every
    thread's, as ``torch.clear_autocast_cache`` drops native's), those of the
    ``cast_cache`` open here, and every thread's fp8 weight copies (``fp8/_quantize.py``)."""
    REGION.clear()
    store = SCOPE.get()
    if store is not None:
        store.clear()
    _fp8_copies.drop_all()


def region_closed() -> None:
    """A thread's outermost region closed: native drops its casts here, and so do we. A
    ``cast_cache``'s casts are in its own store, which stays; so do this thread's fp8
    weight copies while a ``cast_cache`` is open here."""
    region = REGION
    native = region.native
    if native is not None:  # region.clear(), without two calls on every region's exit
        native.clear()
        region.nbytes = 0
    else:
        region.clear()
    store = SCOPE.get()
    # not keeps_casts(); and without a copy kept in the process, no lifetime has one to end.
    if (store is None or not store.open) and _fp8_copies.kept_any:
        _fp8_copies.region_closed()


def _native_nesting() -> int:
    """torch's autocast nesting counter on this thread (ours count in it): 0 outside
    every region. torch exposes it only through increment/decrement."""
    _increment_nesting()
    return _decrement_nesting()


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    STEPS.generation += 1
    if _NATIVE is not None:
        _NATIVE.bump_generation()


class cast_cache:
    """Keeps weight casts across the autocast regions opened inside it, in this thread
    (or this asyncio task).

    Inside, the lower-precision cast of each weight (a float32 leaf that requires grad)
    made in one region serves the next ones too, until the weight changes in place (its
    version counter), is given other data (``.data =`` new storage, or a slice, reshape
    or transpose of its own), an optimizer steps, or the scope closes. Use it around a
    gradient-accumulation loop or an eval loop: native autocast casts every weight again
    in each region. The results are the same bits (a cast is deterministic). Other
    threads' regions keep native's per-region lifetime.

    Memory: the casts of the weights used inside are held until the scope closes
    (``max_bytes`` bounds it; the oldest casts are dropped first), and each cast holds its
    weight (through its ``grad_fn``): a model deleted inside the scope is freed when the
    scope closes or ``clear()`` is called.

    Writes no check can see: in place through ``.data`` (``p.data.copy_(...)``,
    ``p.data -= ...``), fused optimizer kernels called directly (``torch._fused_adam_``),
    collectives writing into a weight (``dist.broadcast``). After one, call ``clear()``
    (or ``dispatch_amp.clear_autocast_cache()``), or keep the write outside the scope.

    Example::

        with amp.cast_cache() as casts:
            for x, y in micro_batches:                 # 4 micro-batches, one cast each
                with amp.autocast("cuda"):
                    loss = loss_fn(model(x), y) / 4
                scaler.scale(loss).backward()
            ema.data.mul_(0.99).add_(0.01 * model.weight.data)   # invisible to the checks
            casts.clear()                              # so drop the kept casts
        scaler.step(optimizer)
        scaler.update()
    """

    def __init__(self, max_bytes: int | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        # (store, max_bytes before this entry) per entry of this object, innermost last.
        self._entered: list = []

    def __enter__(self) -> cast_cache:
        store = SCOPE.get()
        if store is None or not store.open:
            store = _Store()
            SCOPE.set(store)
        self._entered.append((store, store.max_bytes))
        store.depth += 1
        if self.max_bytes is not None:  # from now on counted: what it holds already too
            store.set_max_bytes(self.max_bytes if store.max_bytes is None else min(store.max_bytes, self.max_bytes))
        with STEPS.lock:
            if STEPS.scopes == 0:
                STEPS.hook = register_optimizer_step_post_hook(_optimizer_stepped)
            STEPS.scopes += 1
            if _NATIVE is not None:  # the compiled kernels read the scope only while one is open
                _NATIVE.set_scopes_open(STEPS.scopes)
        return self

    def __exit__(self, *exc) -> None:
        store, saved_max = self._entered.pop()
        if store.max_bytes != saved_max:
            store.set_max_bytes(saved_max)
        store.depth -= 1
        if store.depth == 0:
            store.close()
            if SCOPE.get() is store:
                SCOPE.set(None)
            # This thread's fp8 weight copies were kept past their regions by the scope:
            # they go now, or when the region the scope closed inside of closes.
            if _native_nesting() == 0:
                _fp8_copies.region_closed()
        with STEPS.lock:
            STEPS.scopes -= 1
            if _NATIVE is not None:
                _NATIVE.set_scopes_open(STEPS.scopes)
            if STEPS.scopes == 0:
                STEPS.hook.remove()
                STEPS.hook = None

    def clear(self) -> None:
        """Drops the casts this scope keeps (the next region casts each weight again):
        after a write the checks cannot see, or to free the memory early.

        Example::

            with amp.cast_cache() as casts:
                ...
                target.weight.data.copy_(online.weight.data)   # a write through .data
                casts.clear()
        """
        if not self._entered:
            raise RuntimeError(
                "this cast_cache is not open: call clear() inside its `with` block "
                "(dispatch_amp.clear_autocast_cache() drops the casts of any region)"
            )
        self._entered[-1][0].clear()
        _fp8_copies.region_closed()  # this thread's fp8 weight copies too


_torch_compat.keep_out_of_dynamo(globals(), __name__)
