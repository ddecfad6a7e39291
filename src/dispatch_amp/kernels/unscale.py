"""Multi-tensor unscale + inf/nan check: the Triton kernel, its launchers, and the torch paths.

Two public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`unscale_check_` multiplies every gradient by ``inv_scale`` in place and sets
  ``found_inf`` to 1.0 when any element was inf or nan (the contract of
  ``torch._amp_foreach_non_finite_check_and_unscale_``).
* :func:`check_finite_` only looks: it sets ``found_inf`` and never writes a gradient. It
  serves optimizers that unscale inside their own fused step.

Note: how one launch covers every gradient
-----------------------------------------
The launcher describes the gradients in one int64 table that lives on the device, laid
out as five columns back to back::

    [ addr_0 .. addr_{n-1} | numel_0 .. | first_tile_0 .. first_tile_{n-1}, total_tiles | dtype_0 .. | slot_0 .. ]

``first_tile`` is the running count of ``BLOCK``-element tiles, so tile ``t`` of the whole
set belongs to the tensor ``i`` with ``first_tile[i] <= t < first_tile[i + 1]``. The grid
is persistent: program ``p`` owns the contiguous tile range ``[p * T, (p + 1) * T)``, finds
the tensor holding its first tile by binary search in the table, then walks forward. A
program therefore touches only the tensors its tiles lie in, whatever the tensor count,
and the kernel takes seven arguments however many gradients there are.

``slot`` is the row's index in the caller's ``grads`` list. The launcher hands the kernel
only the gradients it can take (the rest go to the torch path), so row ``i`` is not
necessarily ``grads[i]``; the optional per-tensor flags are written to ``nonfinite[slot]``.

The table is rebuilt and re-uploaded only when the gradient set changes: it is cached
under the key (device, and data_ptr, numel, dtype and slot of every row). Optimizers keep
their ``.grad`` tensors across steps (``zero_grad(set_to_none=False)``, or the caching
allocator handing back the same blocks), so in steady state the launch costs one table
lookup on the host.

Note: per-tensor flags
----------------------
With ``nonfinite`` given, entry ``k`` is raised to 1 when ``grads[k]`` held an inf or nan.
The Triton kernel gets them from the same pass: each program keeps its hits per tensor
segment while it walks that tensor's tiles and, after the segment, stores 1 into
``nonfinite[slot]`` if there was a hit (a program whose range splits a tensor stores for
its part; two programs storing the same 1 is harmless). The ``PER_TENSOR`` constexpr
compiles that in only when asked, so without flags the kernel is the same as before.
torch's fused op has only the one ``found_inf``, so the torch path gives each gradient a
call of its own, with its own flag: still one read of each gradient, but one call per
gradient instead of one per dtype (:func:`uses_triton` tells callers which path they get).

Mixed dtypes share the launch: the dtype column selects the pointer type at run time, and
all math is fp32 (16-bit values are widened right after the load). bf16 is loaded and
stored as raw 16-bit words and converted by hand with round-to-nearest-even, because
Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding; doing it by hand keeps
one code path that is bit-exact against torch both interpreted and compiled.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ._launch import interpreting, persistent_programs, use_triton

try:  # Triton is optional: the torch paths below work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["unscale_check_", "check_finite_", "unscale_check_reference", "uses_triton", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")

# dtype -> code in the table's dtype column; everything else goes to the torch path.
_TRITON_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_BLOCK = 4096
_NUM_WARPS = 8
# Programs per SM for the persistent grid. ptxas gives the unscale kernel ~125 registers
# per thread at 8 warps (benchmarks kernels suite, sm_80), so two programs fill an SM's
# 64K registers; more would only queue behind them as a second, partial wave.
_PROGRAMS_PER_SM = 2
_TABLE_CACHE_SIZE = 16


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _nonfinite(x):
        # abs(x) < inf is False exactly for inf, -inf and nan.
        return (~(tl.abs(x) < float("inf"))).to(tl.int32)

    @triton.jit
    def _bf16_bits_to_f32(bits):
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _f32_to_bf16_bits(y):
        # Round to nearest even on the raw bits; nan maps to the canonical quiet nan that
        # torch produces (0x7FC0), because adding the rounding bias could turn a nan into inf.
        u = y.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(y != y, 0x7FC0, rounded).to(tl.uint16)

    @triton.jit
    def _load_f32(ptrs, mask, IS_BF16: tl.constexpr, MASKED: tl.constexpr):
        if MASKED:
            raw = tl.load(ptrs, mask=mask, other=0)
        else:
            raw = tl.load(ptrs)
        if IS_BF16:
            x = _bf16_bits_to_f32(raw)
        else:
            x = raw.to(tl.float32)
        return x

    @triton.jit
    def _store_f32(ptrs, y, mask, IS_BF16: tl.constexpr, MASKED: tl.constexpr):
        if IS_BF16:
            out = _f32_to_bf16_bits(y)
        else:
            out = y.to(ptrs.dtype.element_ty)
        if MASKED:
            tl.store(ptrs, out, mask=mask)
        else:
            tl.store(ptrs, out)

    @triton.jit
    def _tiles(
        base,  # typed pointer to the tensor's first element
        numel,  # elements in the tensor
        a,  # first local tile this program handles
        b,  # one past the last local tile this program handles
        inv,  # fp32 multiplier
        offs,  # tl.arange(0, BLOCK)
        bad,  # [BLOCK] int32 accumulator of non-finite hits
        BLOCK: tl.constexpr,
        STORE: tl.constexpr,  # False: read-only check
        IS_BF16: tl.constexpr,  # base points at raw bf16 words (uint16)
    ):
        n_full = numel // BLOCK
        # Full tiles: no mask, so loads and stores vectorize. (While loops here and in the
        # kernel below: Triton 3.6's interpreter hands scalars over as 1-element arrays,
        # which range() cannot take under NumPy 2.4.)
        j = a
        end = tl.minimum(b, n_full)
        while j < end:
            ptrs = base + (j * BLOCK + offs)
            x = _load_f32(ptrs, None, IS_BF16, False)
            bad = bad | _nonfinite(x)
            if STORE:
                _store_f32(ptrs, x * inv, None, IS_BF16, False)
            j += 1
        # The ragged last tile, if this program owns it.
        if b > n_full:
            o = n_full * BLOCK + offs
            mask = o < numel
            x = _load_f32(base + o, mask, IS_BF16, True)
            bad = bad | _nonfinite(x)
            if STORE:
                _store_f32(base + o, x * inv, mask, IS_BF16, True)
        return bad

    @triton.jit
    def _unscale_check_kernel(
        table_ptr,  # int64 table, see "Note: how one launch covers every gradient"
        n_tensors,  # rows in the table
        tiles_per_program,  # contiguous tiles owned by each program
        search_steps,  # ceil(log2(n_tensors)) + 1 binary-search iterations
        inv_scale_ptr,  # fp32 scalar multiplier (ignored when STORE is False)
        found_inf_ptr,  # fp32 scalar flag, set to 1.0 on any inf/nan, never cleared
        nonfinite_ptr,  # int32 per-tensor flags indexed by slot (ignored when PER_TENSOR is False)
        BLOCK: tl.constexpr,
        STORE: tl.constexpr,
        PER_TENSOR: tl.constexpr,  # also flag each tensor, see "Note: per-tensor flags"
    ):
        pid = tl.program_id(0).to(tl.int64)
        addr_col = table_ptr
        numel_col = table_ptr + n_tensors
        first_col = table_ptr + 2 * n_tensors  # n_tensors + 1 entries
        dtype_col = table_ptr + 3 * n_tensors + 1
        slot_col = table_ptr + 4 * n_tensors + 1

        total_tiles = tl.load(first_col + n_tensors)
        t0 = pid * tiles_per_program
        t1 = tl.minimum(t0 + tiles_per_program, total_tiles)

        # Largest i with first_tile[i] <= t0; invariant first[lo] <= t0 < first[hi].
        lo = tl.zeros((), dtype=tl.int64)
        hi = tl.zeros((), dtype=tl.int64) + n_tensors
        step = 0
        while step < search_steps:
            mid = (lo + hi) // 2
            right = tl.load(first_col + mid) <= t0
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
            step += 1

        if STORE:
            inv = tl.load(inv_scale_ptr).to(tl.float32)
        else:
            inv = 1.0
        offs = tl.arange(0, BLOCK)
        # Hits are kept as a [BLOCK] vector across tiles and reduced only after the tile
        # loops: a reduction per tile would be a cross-warp exchange per tile.
        bad = tl.zeros([BLOCK], dtype=tl.int32)  # without PER_TENSOR: the whole program's hits
        any_bad = tl.zeros((), dtype=tl.int32)  # with PER_TENSOR: the segments' reduced hits
        i = lo
        t = t0
        while t < t1:
            first = tl.load(first_col + i)
            end = tl.load(first_col + i + 1)
            numel = tl.load(numel_col + i)
            addr = tl.load(addr_col + i)
            code = tl.load(dtype_col + i)
            a = t - first
            b = tl.minimum(t1, end) - first
            if PER_TENSOR:
                # A fresh accumulator per tensor segment takes the place of the program-wide
                # one, so the tile loops carry no more registers than without flags.
                hits = tl.zeros([BLOCK], dtype=tl.int32)
            else:
                hits = bad
            # The launcher sends only 16-byte-aligned gradients; saying so on the typed pointer
            # (an address loaded from the table is otherwise of unknown alignment) lets full
            # tiles use 16-byte accesses. It must be stated here: a hint on a helper's argument is lost.
            if code == 0:
                hits = _tiles(tl.multiple_of(addr.to(tl.pointer_type(tl.float32)), 16), numel, a, b, inv, offs, hits, BLOCK, STORE, False)
            elif code == 1:
                hits = _tiles(tl.multiple_of(addr.to(tl.pointer_type(tl.float16)), 16), numel, a, b, inv, offs, hits, BLOCK, STORE, False)
            else:
                hits = _tiles(tl.multiple_of(addr.to(tl.pointer_type(tl.uint16)), 16), numel, a, b, inv, offs, hits, BLOCK, STORE, True)
            if PER_TENSOR:
                # One reduction and at most one store per (program, tensor), only on a hit,
                # so a flag raised earlier is never cleared. A masked store rather than an
                # `if`: around a branch, ptxas (triton 3.9) spilled for check_finite_ on sm_90.
                seg_bad = tl.max(hits, axis=0)
                tl.store(nonfinite_ptr + tl.load(slot_col + i), 1, mask=seg_bad > 0)
                any_bad = any_bad | seg_bad
            else:
                bad = hits
            t = first + b
            i += 1
        if PER_TENSOR:
            prog_bad = any_bad
        else:
            prog_bad = tl.max(bad, axis=0)
        # One store per program, and only on a hit, so an earlier 1.0 is never cleared.
        if prog_bad > 0:
            tl.store(found_inf_ptr, 1.0)


class _Table:
    """A device-side gradient table plus the launch geometry derived from it."""

    __slots__ = ("table", "host", "n_tensors", "total_tiles", "search_steps")

    def __init__(self, grads: Sequence[torch.Tensor], slots: Sequence[int], device: torch.device) -> None:
        n = len(grads)
        addrs, numels, firsts, codes = [], [], [], []
        tiles = 0
        for g in grads:
            addrs.append(g.data_ptr())
            numels.append(g.numel())
            codes.append(_TRITON_DTYPE_CODES[g.dtype])
            firsts.append(tiles)
            tiles += -(-g.numel() // _BLOCK)
        firsts.append(tiles)
        host = torch.tensor(addrs + numels + firsts + codes + list(slots), dtype=torch.int64)
        if device.type == "cpu":
            self.table = host
        else:
            # Pinned + non_blocking: the upload does not stall the host. The pinned copy
            # is kept alive with the table, so it cannot be freed before the copy ran.
            host = host.pin_memory()
            self.table = host.to(device, non_blocking=True)
        self.host = host
        self.n_tensors = n
        self.total_tiles = tiles
        self.search_steps = max(1, math.ceil(math.log2(n)) + 1) if n > 1 else 1


_table_cache: OrderedDict[tuple, _Table] = OrderedDict()


def _get_table(grads: Sequence[torch.Tensor], slots: Sequence[int], device: torch.device) -> _Table:
    # The slot is part of the key: the same tensors at other positions of the caller's list
    # (another gradient moved to the torch path, say) need another slot column.
    key = (device, tuple((g.data_ptr(), g.numel(), g.dtype, k) for g, k in zip(grads, slots)))
    entry = _table_cache.get(key)
    if entry is None:
        entry = _Table(grads, slots, device)
        _table_cache[key] = entry
        if len(_table_cache) > _TABLE_CACHE_SIZE:
            _table_cache.popitem(last=False)
    else:
        _table_cache.move_to_end(key)
    return entry


def clear_table_cache() -> None:
    """Drop every cached gradient table (tests use it; tables rebuild on the next call).

    Example::

        >>> clear_table_cache()
    """
    _table_cache.clear()


def _num_programs(total_tiles: int, device: torch.device) -> int:
    return persistent_programs(total_tiles, device, _PROGRAMS_PER_SM)


def _is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one gap-free block of memory starting at data_ptr().

    The kernel treats each gradient as a flat run of numel elements; elementwise work does
    not care about the order, so channels_last or transposed gradients qualify too.
    """
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _triton_can_take(g: torch.Tensor) -> bool:
    # 16-byte alignment: the kernel promises it to the compiler (tl.multiple_of), which is
    # what turns full tiles into 16-byte loads and stores. Allocations are aligned; a view
    # into a flat buffer at an odd offset is not, and goes to the torch path.
    return g.dtype in _TRITON_DTYPE_CODES and g.numel() > 0 and _is_dense(g) and g.data_ptr() % 16 == 0


def _launch_triton(grads, slots, inv_scale, found_inf, nonfinite, store: bool, num_programs: int | None) -> None:
    device = found_inf.device
    entry = _get_table(grads, slots, device)
    if entry.total_tiles == 0:
        return
    programs = num_programs or _num_programs(entry.total_tiles, device)
    programs = max(1, min(programs, entry.total_tiles))
    per_program = -(-entry.total_tiles // programs)
    programs = -(-entry.total_tiles // per_program)
    _unscale_check_kernel[(programs,)](
        entry.table,
        entry.n_tensors,
        per_program,
        entry.search_steps,
        inv_scale if store else found_inf,
        found_inf,
        found_inf if nonfinite is None else nonfinite,  # a pointer the kernel ignores without PER_TENSOR
        BLOCK=_BLOCK,
        STORE=store,
        PER_TENSOR=nonfinite is not None,
        num_warps=_NUM_WARPS,
    )


# --------------------------------------------------------------------------------------
# torch paths
# --------------------------------------------------------------------------------------


def _has_fused_op(device: torch.device, dtype: torch.dtype) -> bool:
    # Measured (torch 2.13): the CPU op takes fp64/fp32/fp16/bf16; the CUDA op rejects bf16.
    if device.type == "cpu":
        return dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    if device.type == "cuda":
        return dtype in (torch.float64, torch.float32, torch.float16)
    return False


def unscale_check_reference(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    store: bool = True,
    *,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """Plain-torch unscale + check: runs on any device, and is the fallback where no fused op exists.

    Multiplies in fp32 (fp64 for fp64 gradients) and rounds once, like the fused op,
    and never reads a value back to the host. ``nonfinite`` (optional, int32, one entry per
    gradient) gets 1 where that gradient held an inf or nan, as in :func:`unscale_check_`;
    it is not validated here.

    Example::

        >>> g = [torch.tensor([2.0, float("inf")]), torch.ones(2)]
        >>> found, per = torch.zeros(()), torch.zeros(2, dtype=torch.int32)
        >>> unscale_check_reference(g, torch.tensor(0.5), found, nonfinite=per)
        >>> g[0].tolist(), found.item(), per.tolist()
        ([1.0, inf], 1.0, [1, 0])
    """
    if not grads:
        return
    with torch.no_grad():
        # Checked before the multiply: a finite value can overflow to inf when scaled up.
        per_tensor = torch.stack([torch.isfinite(g).logical_not().any() for g in grads])
        flags = per_tensor.any()
        if store:
            for g in grads:
                if g.dtype == torch.float64:
                    g.mul_(inv_scale.to(torch.float64))
                elif g.dtype == torch.float32:
                    g.mul_(inv_scale)
                else:
                    # A 0-d fp32 operand would be rounded to g's 16-bit dtype first;
                    # widen explicitly so the product is rounded once, as the fused op does.
                    g.copy_(g.float() * inv_scale)
        found_inf.masked_fill_(flags.to(found_inf.device), 1.0)
        if nonfinite is not None:
            nonfinite.masked_fill_(per_tensor.to(nonfinite.device), 1)


def _torch_path(grads, slots, inv_scale, found_inf, nonfinite, store: bool) -> None:
    if nonfinite is not None:
        _flagged_torch_path(grads, slots, inv_scale, found_inf, nonfinite, store)
        return
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    for dtype, group in groups.items():
        if _has_fused_op(found_inf.device, dtype):
            # Without stores we still use the fused op with a multiplier of exactly 1: it
            # writes back every value unchanged and is far faster than a separate check.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale if store else _one_like(found_inf))
        else:
            unscale_check_reference(group, inv_scale, found_inf, store=store)


def _flagged_torch_path(grads, slots, inv_scale, found_inf, nonfinite, store: bool) -> None:
    """The torch path with per-tensor flags: ``nonfinite[slots[j]]`` raised where ``grads[j]``
    held an inf or nan (``slots`` None: ``grads`` is the caller's whole list, in order).

    torch's fused op has one flag for all the tensors it is given, so here each gradient
    gets its own call with its own flag: every gradient is still read once, in the pass
    that unscales (or checks) it, and the flags cost one call per gradient instead of one
    per dtype (on CPU the op loops over its tensors anyway; on a GPU it is a launch each,
    where the Triton kernel is the usual path). No host sync.
    """
    device = found_inf.device
    hits = torch.zeros(len(grads), dtype=torch.float32, device=device)
    multiplier = inv_scale if store else _one_like(found_inf)
    for g, hit in zip(grads, hits.unbind()):
        if _has_fused_op(device, g.dtype):
            torch._amp_foreach_non_finite_check_and_unscale_([g], hit, multiplier)
        else:
            unscale_check_reference([g], inv_scale, hit, store=store)
    hit = hits != 0
    found_inf.masked_fill_(hit.any(), 1.0)
    if slots is None:
        nonfinite.masked_fill_(hit, 1)
    else:  # the few gradients the Triton kernel could not take: one small write each
        for j, k in enumerate(slots):
            nonfinite[k : k + 1].masked_fill_(hit[j : j + 1], 1)


_ones: dict[torch.device, torch.Tensor] = {}


def _one_like(found_inf: torch.Tensor) -> torch.Tensor:
    one = _ones.get(found_inf.device)
    if one is None:
        one = _ones[found_inf.device] = torch.ones((), dtype=torch.float32, device=found_inf.device)
    return one


# --------------------------------------------------------------------------------------
# Public launchers
# --------------------------------------------------------------------------------------


def _validate(grads, inv_scale, found_inf, nonfinite, backend: str, name: str, per_grad: bool = True) -> list[torch.Tensor]:
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}.")
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 or found_inf.dtype != torch.float32:
        raise TypeError(f"{name}: found_inf must be a 1-element float32 tensor.")
    if inv_scale is not None:
        if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1 or inv_scale.dtype != torch.float32:
            raise TypeError(f"{name}: inv_scale must be a 1-element float32 tensor.")
        if inv_scale.device != found_inf.device:
            raise ValueError(f"{name}: inv_scale is on {inv_scale.device} but found_inf is on {found_inf.device}; put them on the gradients' device.")
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(f"{name}: grads must be a list or tuple of tensors, got {type(grads).__name__}.")
    grads = list(grads)
    for k, g in enumerate(grads if per_grad else ()):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{name}: grads[{k}] is a {type(g).__name__}, not a tensor.")
        if g.is_complex() and not g.is_sparse:
            # Real and imaginary parts, through a real view of the same memory.
            grads[k] = g = torch.view_as_real(g)
        if not g.is_floating_point():
            raise TypeError(f"{name}: grads[{k}] has dtype {g.dtype}; gradients must be floating point.")
        if g.device != found_inf.device:
            raise ValueError(f"{name}: grads[{k}] is on {g.device} but found_inf is on {found_inf.device}; group gradients by device.")
        if g.is_sparse:
            raise TypeError(f"{name}: grads[{k}] is sparse; pass its coalesced ._values() instead.")
    if nonfinite is not None:
        _validate_nonfinite(nonfinite, len(grads), found_inf.device, name)
    return grads


def _validate_nonfinite(nonfinite, n: int, device: torch.device, name: str) -> None:
    fix = f"allocate it as torch.zeros({n}, dtype=torch.int32, device=found_inf.device)"
    if not isinstance(nonfinite, torch.Tensor):
        raise TypeError(f"{name}: nonfinite must be a tensor or None, got {type(nonfinite).__name__}; {fix}.")
    if nonfinite.dtype != torch.int32:
        raise TypeError(f"{name}: nonfinite has dtype {nonfinite.dtype}, it must be torch.int32; {fix}.")
    if nonfinite.dim() != 1 or nonfinite.shape[0] != n:
        raise ValueError(f"{name}: nonfinite has shape {tuple(nonfinite.shape)}, it must be ({n},): one flag per gradient; {fix}.")
    if nonfinite.device != device:
        raise ValueError(f"{name}: nonfinite is on {nonfinite.device} but found_inf is on {device}; {fix}.")
    if not nonfinite.is_contiguous():
        # The kernel writes nonfinite_ptr + k; a strided view would get the flags in the wrong places.
        raise ValueError(f"{name}: nonfinite must be contiguous (its stride is {nonfinite.stride()}); {fix}.")


def uses_triton(device: torch.device | str, backend: str = "auto") -> bool:
    """True when :func:`unscale_check_` and :func:`check_finite_` launch the Triton kernel for
    gradients on ``device`` with ``backend``.

    Callers use it to decide whether to ask for per-tensor flags (``nonfinite=``): the
    kernel gets them in its one launch, while the torch path then checks each gradient in
    a call of its own (one read of each still, but a call per gradient; on a GPU a launch
    each). Gradients the kernel cannot take (fp64, gappy layouts, views not 16-byte
    aligned) take that torch path also on the Triton path. Raises, like the launchers,
    for ``backend="triton"`` where it cannot run.

    Example::

        >>> uses_triton(torch.device("cpu"))  # "auto" keeps CPU gradients on torch's fused op
        False
    """
    if backend not in BACKENDS:
        raise ValueError(f"uses_triton: backend must be one of {BACKENDS}, got {backend!r}.")
    return use_triton(backend, torch.device(device), "uses_triton")


def _dispatch(grads, inv_scale, found_inf, nonfinite, backend, store, name, num_programs, validated=False) -> None:
    grads = _validate(grads, inv_scale, found_inf, nonfinite, backend, name, per_grad=not validated)
    if not grads:
        return
    if store and inv_scale is None:
        raise TypeError(f"{name}: inv_scale is required.")
    with torch.no_grad():
        if use_triton(backend, found_inf.device, name):
            # Slots: positions in the caller's list, where each gradient's flag goes.
            fast, rest = [], []
            for k, g in enumerate(grads):
                (fast if _triton_can_take(g) else rest).append(k)
            if fast:
                _launch_triton([grads[k] for k in fast], fast, inv_scale, found_inf, nonfinite, store, num_programs)
            if rest:  # fp64, gappy layouts, views not 16-byte aligned
                _torch_path([grads[k] for k in rest], rest, inv_scale, found_inf, nonfinite, store)
        else:
            _torch_path(grads, None, inv_scale, found_inf, nonfinite, store)


def unscale_check_(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    backend: str = "auto",
    *,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """Multiply every gradient by ``inv_scale`` in place; set ``found_inf`` to 1.0 on any inf/nan.

    Same contract as ``torch._amp_foreach_non_finite_check_and_unscale_`` (the check looks
    at the values before scaling; ``found_inf`` is only ever raised, never cleared), with
    argument order ``(grads, inv_scale, found_inf)``. Gradients may mix fp32, fp16 and bf16
    and have any sizes; all must be on ``found_inf``'s device. Complex gradients are
    unscaled and checked as their real and imaginary parts. Never synchronizes.

    ``backend``: ``"auto"`` (Triton for CUDA tensors when triton is installed, else torch),
    ``"triton"`` (one launch for all fp32/fp16/bf16 gradients; on CPU only under
    ``TRITON_INTERPRET=1``) or ``"torch"`` (torch's fused op where the device has it for the
    dtype, else a plain-torch fallback).

    ``nonfinite``: optional int32 tensor of shape ``(len(grads),)`` on ``found_inf``'s
    device. Entry ``k`` is set to 1 when ``grads[k]`` held an inf or nan (before scaling,
    like ``found_inf``); other entries are left as they are, none is ever cleared. The
    Triton kernel gets these flags in the same pass; the torch path then checks each
    gradient in a call of its own (still one read of each, but a call per gradient), so
    pass it there only when needed (see :func:`uses_triton`).

    Example::

        >>> grads = [torch.full((3,), 4.0), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)]
        >>> found_inf, per_tensor = torch.zeros(()), torch.zeros(2, dtype=torch.int32)
        >>> unscale_check_(grads, torch.tensor(0.25), found_inf, nonfinite=per_tensor)
        >>> grads[0].tolist(), found_inf.item(), per_tensor.tolist()
        ([1.0, 1.0, 1.0], 1.0, [0, 1])
    """
    _unscale_check(grads, inv_scale, found_inf, backend, nonfinite=nonfinite)


def check_finite_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    backend: str = "auto",
    *,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """Set ``found_inf`` to 1.0 if any gradient holds an inf or nan; gradients are not modified.

    The read-only sibling of :func:`unscale_check_`, for optimizers that unscale inside their
    own fused step (those with ``_step_supports_amp_scaling``). The Triton backend issues no
    stores to the gradients at all; torch's fused op, used by the torch backend where
    available, rewrites each value unchanged. Never synchronizes.

    ``nonfinite``: optional per-tensor flags, as in :func:`unscale_check_`.

    Example::

        >>> found_inf, per_tensor = torch.zeros(()), torch.zeros(2, dtype=torch.int32)
        >>> check_finite_([torch.ones(3), torch.tensor([1.0, float("-inf")])], found_inf, nonfinite=per_tensor)
        >>> found_inf.item(), per_tensor.tolist()
        (1.0, [0, 1])
    """
    _check_finite(grads, found_inf, backend, nonfinite=nonfinite)


# Internal entries. ``trusted``: the caller (GradScaler) guarantees real dense floating
# tensors on found_inf's device, so the per-gradient checks (about 1 us each on CPU) are
# skipped; the cheap checks of the other arguments still run. ``num_programs`` overrides
# the Triton grid (tests cover grids smaller and larger than the tile count).
def _unscale_check(grads, inv_scale, found_inf, backend="auto", *, nonfinite=None, trusted=False, num_programs=None) -> None:
    _dispatch(grads, inv_scale, found_inf, nonfinite, backend, True, "unscale_check_", num_programs, trusted)


def _check_finite(grads, found_inf, backend="auto", *, nonfinite=None, trusted=False, num_programs=None) -> None:
    _dispatch(grads, None, found_inf, nonfinite, backend, False, "check_finite_", num_programs, trusted)
