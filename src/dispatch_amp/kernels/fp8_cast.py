"""fp8 quantization: fused cast kernels (flat, with a transpose, with a transpose and the bias
gradient) and their torch references.

Public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`amax_and_cast` casts a tensor to fp8 with a known scale and returns the tensor's
  amax and the count of saturated elements, all from one read of the tensor. That is the
  step of delayed scaling: the scale comes from earlier amaxes, and this step's amax goes
  into the history for the next ones.
* :func:`cast_transpose` does the same for a 2-D tensor and also writes the transposed fp8
  copy, for the backward gemms that need the operand in both layouts.
* :func:`quantize_`: what the fp8 linear launches: one read of ``t`` that takes its scale
  from where the recipe keeps it (below), writes the layouts asked for, accumulates amax
  and saturation into the recipe's accumulators, writes ``[scale, 1 / scale]`` for the
  gemm, and for ``grad_output`` also the bias gradient.
* :func:`amax_and_cast_reference`, :func:`cast_transpose_reference`,
  :func:`quantize_reference`, :func:`resolve_scale_reference` and
  :func:`bias_grad_reference`: the rules below in plain torch, the oracles the kernels are
  tested against bit for bit.
* :func:`fp8_max`: the largest finite value of an fp8 format.

Scale sources of :func:`quantize_` (``mode``): ``"given"``, a float32 value the caller
holds (delayed scaling's scale in force, or a replayed one); ``"amax"``, the scale of the
amax already accumulated (``fp8_scale.scale_from_amax_reference``: current scaling, after
``fp8_amax.amax_into_``); ``"first"``, the given scale where an initialized flag is set,
else the one of the accumulated amax (delayed scaling's first calls). Each program derives
the scale itself: no kernel of its own.

Bias gradient (``db`` of ``dy`` (M, N), float32): rows in blocks of 64 (the last padded
with zeros), each block summed as a pairwise tree (row r with row r + 32, then r + 16, ...,
then 1), the blocks' sums added in order from a zero start. A fixed order, so the kernel
and the torch rule agree bit for bit whatever the grid.

Rule (``t`` float32, bfloat16 or float16; ``scale`` a 0-d float32 tensor)::

    x = t.float()
    amax = x.abs().amax()          # nan if any element is nan, else inf if any is inf; 0 if t is empty
    y = x * scale                  # one fp32 multiply
    q = where(isfinite(x), y.clamp(-fp8_max, fp8_max), nan).to(fp8_dtype)
    saturated = (isfinite(x) & (y.abs() > saturates_above)).sum()

Every inf or nan of ``t`` becomes nan in ``q`` (e4m3fn has no inf; for e5m2 the same rule
keeps both formats alike), and a nan product (``0 * inf`` with an infinite scale, or a nan
scale) stays nan. Finite values beyond the range saturate to +-fp8_max. Those the clamp
moves to another fp8 value are counted: ``|y|`` beyond the midpoint between fp8_max and
the format's next step (``saturates_above``: 464 for e4m3fn, 61440 for e5m2), so a value
just above fp8_max that would round to it anyway (a current scale's own rounding,
``amax * (fp8_max / amax)``) is not. A caller sees that its scale was too large without a
host sync.

Note: the fp32 -> fp8 conversion is done by hand
------------------------------------------------
torch rounds fp32 to fp8 to nearest, ties to even, subnormals included. Triton's CPU
interpreter does not: its casts to ``tl.float8e4nv``/``tl.float8e5`` round ties away from
zero and turn nan into a finite e4m3 value (0x7C, which is 384). On GPUs the native cast
exists only from sm_89 on. So the kernels convert on the fp32 bit pattern with integer
operations and store the fp8 bits as uint8, one code path that is bit-exact against torch
interpreted and compiled, on every architecture. With E exponent bits, M mantissa bits
and bias B (e4m3fn: M=3, B=7; e5m2: M=2, B=15), for ``a = |bits(c)|`` of the clamped
value ``c``:

* fp8 normals (``|c| >= 2**(1-B)``): subtract ``(127 - B) << 23`` to rebias the exponent,
  then drop the low ``23 - M`` bits with round-to-nearest-even (add ``2**(22-M) - 1`` plus
  the lowest kept bit). A carry out of the mantissa moves into the exponent, which is the
  right result; the clamp guarantees that no carry goes past fp8_max.
* fp8 subnormals: the significand with its implicit bit, shifted right by the distance
  between the value's exponent and the subnormal step ``2**(1-B-M)``, again rounding to
  nearest even. Rounding up out of the subnormals gives ``2**M``, the smallest normal.
  fp32 subnormals and zero come out as zero.

The sign bit goes on top (so -0.0 and negative values that round to zero give 0x80, as in
torch), and nan is 0x7F. The arithmetic is all integer: a float "magic number" addition
would be shorter, but the compiler may fuse it with the scale multiply into an fma, which
rounds once instead of twice.

Note: amax across programs
--------------------------
Each program keeps the largest ``|x|`` of its tiles as the int32 bit pattern
``bits(x) & 0x7FFFFFFF``. For non-negative floats the integer order of the bit patterns
is the numeric order, and every nan pattern (0x7F800001 and up) lies above inf
(0x7F800000), so an integer max makes nan win without a separate flag. One
``atomic_max`` per program combines them into a zeroed int32, which is then viewed as
float32 (an empty tensor leaves the 0, i.e. 0.0). The saturation count is one
``atomic_add`` of each program's count into a zeroed int64.

Note: grid and tiles
--------------------
Both kernels run a persistent grid (a few programs per SM): program ``p`` takes tiles
``p, p + P, p + 2P, ...``, so the programs running at a time touch neighbouring memory, and
the two atomics are issued once per program instead of once per tile. The fused cast
works on flat ``BLOCK``-element tiles (unmasked but for the ragged last one). The
transpose works on ``TILE_M x TILE_N`` tiles of the row-major input: each tile is read
once and its fp8 bits are stored twice, at ``q[m, n]`` and at ``q_t[n, m]``; the compiler
routes the transposed store through shared memory so that both stores are coalesced.
Tiles that lie wholly inside the matrix skip the masks.

bf16 inputs are loaded as raw 16-bit words and widened by hand (a shift into the top half
of an fp32), the same as in the unscale kernel.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch paths below work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

from ._launch import launch, persistent_programs, use_triton
from .fp8_scale import scale_from_amax_reference
from .unscale import BACKENDS

__all__ = ["amax_and_cast", "cast_transpose", "quantize_", "bias_grad", "new_accumulators", "amax_and_cast_reference", "cast_transpose_reference",
           "quantize_reference", "resolve_scale_reference", "bias_grad_reference", "fp8_max", "MODES"]

# fp8 dtype -> (largest finite value, mantissa bits, exponent bias)
_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, 7),
    torch.float8_e5m2: (57344.0, 2, 15),
}
# fp8 dtype -> the |scaled value| beyond which it counts as saturated (see the rule above).
SATURATES_ABOVE = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Where quantize_ takes its scale from (see the module docstring).
MODES = {"given": 0, "amax": 1, "first": 2}
# The bias gradient's block of rows: part of its rule, whatever the tiles.
DB_ROWS = 64

_BLOCK = 4096
_NUM_WARPS = 8
_TILE_M = 64
_TILE_N = 64
_TRANSPOSE_WARPS = 8
# Programs per SM for the persistent grids: as many as fit at once, since more would only
# queue behind them as a second, partial wave. ptxas (triton 3.9, sm_80 and sm_90) gives the
# cast kernel 80-84 registers per thread and the transpose kernel 89-108, at 8 warps: three
# and two programs fill an SM's 64K registers.
_CAST_PROGRAMS_PER_SM = 3
_TRANSPOSE_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if triton is not None:
    from .fp8_scale import scale_of

    @triton.jit
    def _load_f32(ptrs, mask, IS_BF16: tl.constexpr, MASKED: tl.constexpr):
        # Masked-off lanes read 0: no amax, no saturation, no bias gradient, never stored.
        if MASKED:
            raw = tl.load(ptrs, mask=mask, other=0)
        else:
            raw = tl.load(ptrs)
        if IS_BF16:
            # raw holds int16 words; the mask drops the sign extension of the widening.
            x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            x = raw.to(tl.float32)
        return x

    @triton.jit
    def _fp8_bits(c, MANT: tl.constexpr, BIAS: tl.constexpr):
        # c is finite and within +-fp8_max; see "Note: the fp32 -> fp8 conversion is done by hand".
        u = c.to(tl.int32, bitcast=True)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF
        rebased = a - ((127 - BIAS) << 23)
        normal = (rebased + ((1 << (22 - MANT)) - 1) + ((rebased >> (23 - MANT)) & 1)) >> (23 - MANT)
        m = (a & 0x7FFFFF) | 0x800000
        # Clamped to [24 - MANT, 25]: normals would give shifts below the range (their lane
        # takes `normal`), and from 25 on the result is 0 whatever the shift.
        shift = tl.minimum(tl.maximum((151 - BIAS - MANT) - (a >> 23), 24 - MANT), 25)
        sub = m >> shift
        rem = m - (sub << shift)
        half = 1 << (shift - 1)
        sub += ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.int32)
        bits = tl.where(a < ((128 - BIAS) << 23), sub, normal)
        return bits | sign

    @triton.jit
    def _quantize(x, scale, FP8_MAX: tl.constexpr, SAT_ABOVE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
        """fp8 bits (int32), |x| as int32 bits, and 1 where a finite x saturated."""
        y = x * scale
        finite = tl.abs(x) < float("inf")
        saturated = (finite & (tl.abs(y) > SAT_ABOVE)).to(tl.int32)
        # min/max on a GPU return the other operand for a nan, so nan is decided here,
        # before the clamp, and the clamp only ever sees the lanes that stay finite.
        is_nan = (~finite) | (y != y)
        c = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        bits = tl.where(is_nan, 0x7F, _fp8_bits(c, MANT, BIAS))
        x_abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return bits, x_abs_bits, saturated

    @triton.jit
    def _scale_of_amax(amax_ptr, FP8_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr):
        return scale_of(tl.load(amax_ptr).to(tl.float32, bitcast=True), FP8_MAX, MARGIN_MUL, POW2)

    @triton.jit
    def _resolve_scale(scale_ptr, init_ptr, amax_ptr, MODE: tl.constexpr, FP8_MAX: tl.constexpr,
                       MARGIN_MUL: tl.constexpr, POW2: tl.constexpr):
        """The scale (a scalar): given, of the accumulated amax, or the given one where the
        initialized flag is set and else of the amax (MODES)."""
        if MODE == 0:
            s = tl.load(scale_ptr)
        elif MODE == 1:
            s = _scale_of_amax(amax_ptr, FP8_MAX, MARGIN_MUL, POW2)
        else:
            s = tl.where(tl.load(init_ptr) > 0, tl.load(scale_ptr), _scale_of_amax(amax_ptr, FP8_MAX, MARGIN_MUL, POW2))
        return s

    @triton.jit
    def _store_scales(sc_ptr, s, pid):
        # [scale, 1 / scale] for the gemm and the backward, once.
        if pid == 0:
            tl.store(sc_ptr, s)
            tl.store(sc_ptr + 1, tl.math.div_rn(tl.zeros_like(s) + 1.0, s))

    @triton.jit
    def _finish(amax_ptr, sat_ptr, amax, count, ACC_AMAX: tl.constexpr):
        if ACC_AMAX:
            tl.atomic_max(amax_ptr, tl.max(amax, axis=0))
        tl.atomic_add(sat_ptr, tl.sum(count.to(tl.int64), axis=0))

    @triton.jit
    def _cast_kernel(
        x_ptr,  # input: fp32, fp16, or int16 words of bf16
        q_ptr,  # uint8 fp8 bits, same numel
        scale_ptr, init_ptr,  # fp32 scalars (MODE 0 and 2: the given scale; 2: the initialized flag)
        amax_ptr,  # int32 scalar: bits of the amax, see "Note: amax across programs"
        sat_ptr,  # int64 scalar
        sc_ptr,  # fp32 [2]: the scale used and its inverse
        numel,
        BLOCK: tl.constexpr, IS_BF16: tl.constexpr, FP8_MAX: tl.constexpr, SAT_ABOVE: tl.constexpr,
        MANT: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr, ACC_AMAX: tl.constexpr,
        MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        scale = _resolve_scale(scale_ptr, init_ptr, amax_ptr, MODE, FP8_MAX, MARGIN_MUL, POW2)
        _store_scales(sc_ptr, scale, pid)
        offs = tl.arange(0, BLOCK)
        # Kept per lane across tiles and reduced once after the loop: a reduction per tile
        # would be a cross-warp exchange per tile.
        amax = tl.zeros([BLOCK], dtype=tl.int32)
        count = tl.zeros([BLOCK], dtype=tl.int32)
        n_full = numel // BLOCK
        # A while loop: the interpreter hands scalars over as 1-element arrays, which
        # range() cannot take under NumPy 2.4.
        j = pid
        while j < n_full:
            o = j.to(tl.int64) * BLOCK + offs
            x = _load_f32(x_ptr + o, None, IS_BF16, False)
            bits, x_abs, sat = _quantize(x, scale, FP8_MAX, SAT_ABOVE, MANT, BIAS)
            tl.store(q_ptr + o, bits.to(tl.uint8))
            amax = tl.maximum(amax, x_abs)
            count += sat
            j += programs
        # The ragged last tile goes to the program whose turn it would be.
        if (numel % BLOCK != 0) & (pid == n_full % programs):
            o = n_full.to(tl.int64) * BLOCK + offs
            mask = o < numel
            x = _load_f32(x_ptr + o, mask, IS_BF16, True)
            bits, x_abs, sat = _quantize(x, scale, FP8_MAX, SAT_ABOVE, MANT, BIAS)
            tl.store(q_ptr + o, bits.to(tl.uint8), mask=mask)
            amax = tl.maximum(amax, x_abs)
            count += sat
        _finish(amax_ptr, sat_ptr, amax, count, ACC_AMAX)

    @triton.jit
    def _cast_transpose_tile(
        x_ptr, q_ptr, qt_ptr,
        rows,  # [TILE_M] int64 row indices of the tile
        cols,  # [TILE_N] int64 column indices
        M, N,
        mask,  # [TILE_M, TILE_N], or None when MASKED is False
        scale,
        amax,  # [TILE_M] int32 running max of |x| bits
        count,  # [TILE_M] int32 running saturation count
        MASKED: tl.constexpr, IS_BF16: tl.constexpr, FP8_MAX: tl.constexpr, SAT_ABOVE: tl.constexpr,
        MANT: tl.constexpr, BIAS: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
    ):
        x = _load_f32(x_ptr + rows[:, None] * N + cols[None, :], mask, IS_BF16, MASKED)
        bits, x_abs, sat = _quantize(x, scale, FP8_MAX, SAT_ABOVE, MANT, BIAS)
        b8 = bits.to(tl.uint8)
        if MASKED:
            if WRITE_Q:
                tl.store(q_ptr + rows[:, None] * N + cols[None, :], b8, mask=mask)
            if WRITE_QT:
                tl.store(qt_ptr + cols[None, :] * M + rows[:, None], b8, mask=mask)
        else:
            if WRITE_Q:
                tl.store(q_ptr + rows[:, None] * N + cols[None, :], b8)
            if WRITE_QT:
                tl.store(qt_ptr + cols[None, :] * M + rows[:, None], b8)
        # Reduced along the rows of the tile right away: per-lane accumulators of a 2-D tile
        # would hold two more registers per element across the loop.
        return tl.maximum(amax, tl.max(x_abs, axis=1)), count + tl.sum(sat, axis=1)

    @triton.jit
    def _cast_transpose_kernel(
        x_ptr,  # (M, N) row-major input: fp32, fp16, or int16 words of bf16
        q_ptr,  # (M, N) uint8 fp8 bits
        qt_ptr,  # (N, M) uint8 fp8 bits
        scale_ptr, init_ptr, amax_ptr, sat_ptr, sc_ptr,  # as in _cast_kernel
        M, N,
        TILE_M: tl.constexpr, TILE_N: tl.constexpr, IS_BF16: tl.constexpr, FP8_MAX: tl.constexpr,
        SAT_ABOVE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr,
        ACC_AMAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
        WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        scale = _resolve_scale(scale_ptr, init_ptr, amax_ptr, MODE, FP8_MAX, MARGIN_MUL, POW2)
        _store_scales(sc_ptr, scale, pid)
        tiles_n = tl.cdiv(N, TILE_N)
        n_tiles = tl.cdiv(M, TILE_M) * tiles_n
        full_m = M // TILE_M
        full_n = N // TILE_N
        rm = tl.arange(0, TILE_M)
        rn = tl.arange(0, TILE_N)
        amax = tl.zeros([TILE_M], dtype=tl.int32)
        count = tl.zeros([TILE_M], dtype=tl.int32)
        j = pid
        while j < n_tiles:
            tm = j // tiles_n
            tn = j % tiles_n
            rows = tm.to(tl.int64) * TILE_M + rm
            cols = tn.to(tl.int64) * TILE_N + rn
            if (tm < full_m) & (tn < full_n):
                amax, count = _cast_transpose_tile(x_ptr, q_ptr, qt_ptr, rows, cols, M, N, None, scale, amax, count, False, IS_BF16, FP8_MAX, SAT_ABOVE, MANT, BIAS, WRITE_Q, WRITE_QT)
            else:
                mask = (rows < M)[:, None] & (cols < N)[None, :]
                amax, count = _cast_transpose_tile(x_ptr, q_ptr, qt_ptr, rows, cols, M, N, mask, scale, amax, count, True, IS_BF16, FP8_MAX, SAT_ABOVE, MANT, BIAS, WRITE_Q, WRITE_QT)
            j += programs
        _finish(amax_ptr, sat_ptr, amax, count, ACC_AMAX)

    @triton.jit
    def _halve(x, H: tl.constexpr, TILE_N: tl.constexpr):
        # Rows r and r + H of a [2H, TILE_N] block, added: one level of the bias gradient's tree.
        a, b = tl.split(tl.permute(tl.reshape(x, [2, H, TILE_N]), [1, 2, 0]))
        return a + b

    @triton.jit
    def _block_sum(x, TILE_N: tl.constexpr):
        # The column sums of a [64, TILE_N] block as the pairwise tree of the rule (DB_ROWS).
        x = _halve(x, 32, TILE_N)
        x = _halve(x, 16, TILE_N)
        x = _halve(x, 8, TILE_N)
        x = _halve(x, 4, TILE_N)
        x = _halve(x, 2, TILE_N)
        x = _halve(x, 1, TILE_N)
        return tl.reshape(x, [TILE_N])

    @triton.jit
    def _cast_transpose_dbias_kernel(
        x_ptr, q_ptr, qt_ptr,  # as in _cast_transpose_kernel
        db_ptr,  # (N,) fp32: the bias gradient, column sums of x
        scale_ptr, init_ptr, amax_ptr, sat_ptr, sc_ptr,
        M, N,
        TILE_N: tl.constexpr, IS_BF16: tl.constexpr, FP8_MAX: tl.constexpr, SAT_ABOVE: tl.constexpr,
        MANT: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr, ACC_AMAX: tl.constexpr,
        MARGIN_MUL: tl.constexpr, POW2: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
    ):
        # A program owns whole column blocks and walks their row blocks in order, so each
        # column's sum has the rule's order with no cross-program reduction.
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        scale = _resolve_scale(scale_ptr, init_ptr, amax_ptr, MODE, FP8_MAX, MARGIN_MUL, POW2)
        _store_scales(sc_ptr, scale, pid)
        rm = tl.arange(0, 64)
        rn = tl.arange(0, TILE_N)
        tiles_m = tl.cdiv(M, 64)
        tiles_n = tl.cdiv(N, TILE_N)
        amax = tl.zeros([TILE_N], dtype=tl.int32)
        count = tl.zeros([TILE_N], dtype=tl.int32)
        cb = pid
        while cb < tiles_n:
            cols = cb.to(tl.int64) * TILE_N + rn
            in_cols = cols < N
            db = tl.zeros([TILE_N], dtype=tl.float32)
            tm = cb * 0
            while tm < tiles_m:
                rows = tm.to(tl.int64) * 64 + rm
                mask = (rows < M)[:, None] & in_cols[None, :]
                x = _load_f32(x_ptr + rows[:, None] * N + cols[None, :], mask, IS_BF16, True)
                bits, x_abs, sat = _quantize(x, scale, FP8_MAX, SAT_ABOVE, MANT, BIAS)
                b8 = bits.to(tl.uint8)
                if WRITE_Q:
                    tl.store(q_ptr + rows[:, None] * N + cols[None, :], b8, mask=mask)
                if WRITE_QT:
                    tl.store(qt_ptr + cols[None, :] * M + rows[:, None], b8, mask=mask)
                amax = tl.maximum(amax, tl.max(x_abs, axis=0))
                count += tl.sum(sat, axis=0)
                db = db + _block_sum(x, TILE_N)
                tm += 1
            tl.store(db_ptr + cols, db, mask=in_cols)
            cb += programs
        _finish(amax_ptr, sat_ptr, amax, count, ACC_AMAX)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    # bf16 goes in as its raw words: see the module docstring.
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def new_accumulators(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed accumulators for :func:`quantize_`: ``(amax bits, int32 [1]; count, int64 [1])``,
    from one allocation (the amax in the low half of its first int64).

    Example::

        >>> [t.tolist() for t in new_accumulators(torch.device("cpu"))]
        [[0], [0]]
    """
    acc = torch.zeros(2, dtype=torch.int64, device=device)
    return acc.view(torch.int32)[:1], acc[1:]


def bias_grad(t: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The bias gradient of a 2-D ``t`` (:func:`bias_grad_reference`'s rule) in one read
    where the kernel runs, for a backward that has no fp8 gemm to fuse it with.

    Example::

        >>> bias_grad(torch.ones(3, 2)).tolist()
        [3.0, 3.0]
    """
    _validate(t, None, torch.float8_e4m3fn, "bias_grad", backend, two_d=True)
    if use_triton(backend, t.device, "bias_grad"):
        acc, saturated = new_accumulators(t.device)
        sc = torch.empty(2, dtype=torch.float32, device=t.device)
        one = torch.ones((), dtype=torch.float32, device=t.device)
        return _launch_quantize(t, torch.float8_e4m3fn, "given", one, None, acc, saturated, sc, 0, False, False,
                                False, False, True)[2]
    return bias_grad_reference(t)


# --------------------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------------------


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """The largest finite value of ``fp8_dtype``: 448.0 for e4m3fn, 57344.0 for e5m2.

    Raises ``TypeError`` for any other dtype: those are the two formats the kernels know.

    Example::

        >>> fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)
        (448.0, 57344.0)
    """
    fmt = _FORMATS.get(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else None
    if fmt is None:
        raise TypeError(f"fp8_max: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}.")
    return fmt[0]


def amax_and_cast_reference(
    t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantization rule in plain torch: ``(q, amax, saturated)``, the oracle of :func:`amax_and_cast`.

    Reads ``t`` several times and makes fp32 temporaries of its size; the kernels give the
    same bits in one pass. Arguments are checked as in :func:`amax_and_cast`.

    Example::

        >>> t = torch.tensor([1.0, -600.0, float("inf"), 0.001])
        >>> q, amax, saturated = amax_and_cast_reference(t, torch.tensor(1.0), torch.float8_e4m3fn)
        >>> q.float().tolist(), amax.item(), saturated.item()
        ([1.0, -448.0, nan, 0.001953125], inf, 1)
    """
    _validate(t, scale, fp8_dtype, "amax_and_cast_reference")
    return _reference(t, scale, fp8_dtype)


def _reference(t, scale, fp8_dtype):
    limit = fp8_max(fp8_dtype)
    with torch.no_grad():
        x = t.float()
        # amax() rejects empty tensors; 0 is the max over no magnitudes.
        amax = x.abs().amax() if x.numel() else torch.zeros((), dtype=torch.float32, device=t.device)
        y = x * scale
        finite = torch.isfinite(x)
        q = torch.where(finite, y.clamp(-limit, limit), float("nan")).to(fp8_dtype)
        saturated = (finite & (y.abs() > SATURATES_ABOVE[fp8_dtype])).sum()
    return q, amax, saturated


def cast_transpose_reference(
    t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule of :func:`amax_and_cast_reference` plus ``q.t().contiguous()``: ``(q, q_t, amax, saturated)``.

    The oracle of :func:`cast_transpose`; ``t`` must be 2-D.

    Example::

        >>> t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> q, q_t, amax, saturated = cast_transpose_reference(t, torch.tensor(2.0), torch.float8_e5m2)
        >>> q_t.float().tolist(), amax.item(), saturated.item()
        ([[2.0, 8.0], [4.0, 10.0], [6.0, 12.0]], 6.0, 0)
    """
    _validate(t, scale, fp8_dtype, "cast_transpose_reference", two_d=True)
    q, amax, saturated = _reference(t, scale, fp8_dtype)
    return q, q.t().contiguous(), amax, saturated


def bias_grad_reference(dy: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a 2-D ``dy`` in float32, in the order of the module docstring.

    Example::

        >>> bias_grad_reference(torch.ones(100, 3, dtype=torch.bfloat16)).tolist()
        [100.0, 100.0, 100.0]
    """
    if not isinstance(dy, torch.Tensor) or dy.dim() != 2:
        raise ValueError("bias_grad_reference: dy must be a 2-D tensor (rows, features).")
    m, n = dy.shape
    x = dy.detach().to(torch.float32)
    pad = (-m) % DB_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, n)])
    blocks = x.reshape(x.shape[0] // DB_ROWS, DB_ROWS, n)
    rows = DB_ROWS
    while rows > 1:
        rows //= 2
        blocks = blocks[:, :rows] + blocks[:, rows:]
    total = torch.zeros(n, dtype=torch.float32, device=dy.device)
    for block in blocks[:, 0]:
        total = total + block
    return total


def resolve_scale_reference(mode: str, scale, initialized, amax: torch.Tensor, fp8_dtype: torch.dtype,
                            margin: int = 0, power_of_two: bool = False) -> torch.Tensor:
    """The scale :func:`quantize_` uses, by ``mode`` (see the module docstring), 0-d float32.

    Example::

        >>> resolve_scale_reference("first", torch.tensor(2.0), torch.tensor(0.0), torch.tensor(4.0),
        ...                         torch.float8_e4m3fn)
        tensor(112.)
    """
    if mode == "given":
        return scale.to(torch.float32).reshape(())
    own = scale_from_amax_reference(amax.reshape(()), fp8_max(fp8_dtype), margin, power_of_two)
    if mode == "amax":
        return own
    return torch.where(initialized.reshape(()) > 0, scale.to(torch.float32).reshape(()), own)


def quantize_reference(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, write_q: bool = True,
                       write_qt: bool = False, dbias: bool = False):
    """``(q or None, q_t or None, amax, saturated, db or None)`` of a 2-D ``t`` with a 0-d
    float32 ``scale``: the oracle of :func:`quantize_`.

    Example::

        >>> q, q_t, a, sat, db = quantize_reference(torch.ones(2, 2), torch.tensor(4.0), torch.float8_e4m3fn,
        ...                                         write_q=False, write_qt=True, dbias=True)
        >>> q_t.float().tolist(), a.item(), db.tolist()
        ([[4.0, 4.0], [4.0, 4.0]], 1.0, [2.0, 2.0])
    """
    _validate(t, scale, fp8_dtype, "quantize_reference", two_d=True)
    q, amax, saturated = _reference(t, scale, fp8_dtype)
    q_t = q.t().contiguous() if write_qt else None
    return (q if write_q else None), q_t, amax, saturated, (bias_grad_reference(t) if dbias else None)


# --------------------------------------------------------------------------------------
# Public launchers
# --------------------------------------------------------------------------------------


def _validate(t, scale, fp8_dtype, name: str, backend: str = "torch", two_d: bool = False) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}.")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: t must be a tensor, got {type(t).__name__}.")
    if t.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: t has dtype {t.dtype}; it must be torch.float32, torch.bfloat16 or torch.float16 (convert it with .float() first).")
    if not isinstance(fp8_dtype, torch.dtype) or fp8_dtype not in _FORMATS:
        raise TypeError(f"{name}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}.")
    if two_d and t.dim() != 2:
        raise ValueError(f"{name}: t must be 2-D (M, N), got shape {tuple(t.shape)}; reshape it to (-1, t.shape[-1]) first.")
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (its stride is {t.stride()}); pass t.contiguous().")
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0 or scale.dtype != torch.float32:
        what = f"a {scale.dim()}-d {scale.dtype} tensor" if isinstance(scale, torch.Tensor) else f"a {type(scale).__name__}"
        raise TypeError(f"{name}: scale must be a 0-d float32 tensor, got {what}; pass torch.tensor(value, dtype=torch.float32, device=t.device).")
    if scale.device != t.device:
        raise ValueError(f"{name}: scale is on {scale.device} but t is on {t.device}; move scale to t's device.")


def amax_and_cast(
    t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast ``t * scale`` to fp8 and return ``(q, amax, saturated)`` from one pass over ``t``.

    ``t``: contiguous float32, bfloat16 or float16, any shape (empty included). ``scale``:
    0-d float32 tensor on ``t``'s device. ``fp8_dtype``: ``torch.float8_e4m3fn`` or
    ``torch.float8_e5m2``. Returns ``q`` (``fp8_dtype``, ``t``'s shape), ``amax`` (0-d
    float32: the largest ``|t|``, nan if ``t`` holds a nan, 0 if ``t`` is empty) and
    ``saturated`` (0-d int64: finite elements clamped to +-fp8_max). inf and nan elements
    of ``t`` become nan in ``q``. The rule is spelled out in the module docstring; the
    result equals :func:`amax_and_cast_reference` bit for bit. Never synchronizes.

    ``backend``: ``"auto"`` (Triton for CUDA tensors when triton is installed, else torch),
    ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``) or ``"torch"`` (the reference).

    Example::

        >>> t = torch.tensor([0.5, -3.0, 100.0], dtype=torch.bfloat16)
        >>> q, amax, saturated = amax_and_cast(t, torch.tensor(8.0), torch.float8_e4m3fn)
        >>> q.float().tolist(), amax.item(), saturated.item()
        ([4.0, -24.0, 448.0], 100.0, 1)
    """
    return _amax_and_cast(t, scale, fp8_dtype, backend)


def cast_transpose(
    t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast a 2-D ``t * scale`` to fp8 in both layouts: ``(q, q_t, amax, saturated)``.

    As :func:`amax_and_cast` for a contiguous ``(M, N)`` tensor, plus ``q_t``, the ``(N, M)``
    contiguous transpose of ``q`` (equal to ``q.t().contiguous()`` bit for bit). The Triton
    kernel reads ``t`` once, tile by tile, and writes both layouts from each tile: the
    backward gemms need the fp8 operand both ways. Equals :func:`cast_transpose_reference`
    bit for bit. Never synchronizes.

    ``backend``: as in :func:`amax_and_cast`.

    Example::

        >>> t = torch.tensor([[1.0, -2.0], [0.25, 1000.0]])
        >>> q, q_t, amax, saturated = cast_transpose(t, torch.tensor(1.0), torch.float8_e4m3fn)
        >>> q_t.float().tolist(), amax.item(), saturated.item()
        ([[1.0, 0.25], [-2.0, 448.0]], 1000.0, 1)
    """
    return _cast_transpose(t, scale, fp8_dtype, backend)


def quantize_(t: torch.Tensor, fp8_dtype: torch.dtype, *, mode: str, scale: torch.Tensor | None,
              initialized: torch.Tensor | None, amax_acc: torch.Tensor, saturated_acc: torch.Tensor,
              sc_out: torch.Tensor, margin: int = 0, power_of_two: bool = False, accumulate_amax: bool = True,
              write_q: bool = True, write_qt: bool = False, dbias: bool = False, backend: str = "auto",
              num_programs: int | None = None, tile: tuple[int, int] | None = None):
    """One read of a 2-D ``t``: ``(q or None, q_t or None, db or None)``, the accumulators
    and ``sc_out`` updated in place; never synchronizes.

    ``mode`` (:data:`MODES`) picks the scale: ``"given"`` reads ``scale`` (a float32 element
    on ``t``'s device); ``"amax"`` derives it from ``amax_acc`` (float32 bits in a
    one-element int32 tensor, filled by ``fp8_amax.amax_into_``) by the rule of
    ``fp8_scale`` with ``margin`` and ``power_of_two``; ``"first"`` takes ``scale`` where
    ``initialized`` (a float32 element) is positive, else the ``"amax"`` one.
    ``sc_out`` (float32, 2 elements) gets ``[scale, 1 / scale]``; ``saturated_acc`` (int64,
    one element) grows by the saturated count; with ``accumulate_amax`` ``amax_acc`` takes
    ``max|t|``. ``write_q``/``write_qt`` choose the layouts; ``dbias`` also returns the
    bias gradient (float32, the rule of the module docstring). Equals the references bit
    for bit; ``backend`` as in :func:`amax_and_cast`.

    Example::

        >>> t = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
        >>> acc, sat, sc = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.empty(2)
        >>> acc.view(torch.float32).fill_(3.0)
        tensor([3.])
        >>> q, q_t, db = quantize_(t, torch.float8_e4m3fn, mode="amax", scale=None, initialized=None,
        ...                        amax_acc=acc, saturated_acc=sat, sc_out=sc, accumulate_amax=False, dbias=True)
        >>> sc.tolist(), q.float().tolist(), db.tolist()
        ([149.3333282470703, 0.0066964286379516125], [[144.0, -288.0], [448.0, 72.0]], [4.0, -1.5])
    """
    _validate(t, None, fp8_dtype, "quantize_", backend, two_d=True)
    if mode not in MODES:
        raise ValueError(f"quantize_: mode must be one of {sorted(MODES)}, got {mode!r}.")
    if use_triton(backend, t.device, "quantize_"):
        return _launch_quantize(t, fp8_dtype, mode, scale, initialized, amax_acc, saturated_acc, sc_out, margin,
                                power_of_two, accumulate_amax, write_q, write_qt, dbias, num_programs, tile)
    a_now = amax_acc.view(torch.float32).reshape(())
    s = resolve_scale_reference(mode, scale, initialized, a_now, fp8_dtype, margin, power_of_two)
    q, q_t, a, saturated, db = quantize_reference(t, s, fp8_dtype, write_q=write_q, write_qt=write_qt, dbias=dbias)
    with torch.no_grad():
        if accumulate_amax:
            amax_acc.copy_(torch.maximum(amax_acc, a.view(torch.int32).reshape(1)))
        saturated_acc.copy_(saturated_acc + saturated)
        sc_out.copy_(torch.stack([s, s.reciprocal()]))
    return q, q_t, db


def _rule_args(fp8_dtype, mode, margin, power_of_two) -> dict:
    limit, mant, bias = _FORMATS[fp8_dtype]
    return dict(FP8_MAX=limit, SAT_ABOVE=SATURATES_ABOVE[fp8_dtype], MANT=mant, BIAS=bias, MODE=MODES[mode],
                MARGIN_MUL=2.0 ** -margin, POW2=bool(power_of_two))


def _launch_quantize(t, fp8_dtype, mode, scale, initialized, amax_acc, saturated_acc, sc_out, margin, power_of_two,
                     accumulate_amax, write_q, write_qt, dbias, num_programs=None, tile=None):
    M, N = t.shape
    q = torch.empty((M, N), dtype=fp8_dtype, device=t.device) if write_q else None
    q_t = torch.empty((N, M), dtype=fp8_dtype, device=t.device) if write_qt else None
    db = torch.empty(N, dtype=torch.float32, device=t.device) if dbias else None
    # Pointers the kernel does not read in this mode still need a tensor: sc_out serves.
    scale_arg = sc_out if scale is None else scale
    init_arg = sc_out if initialized is None else initialized
    common = dict(IS_BF16=t.dtype == torch.bfloat16, ACC_AMAX=bool(accumulate_amax),
                  **_rule_args(fp8_dtype, mode, margin, power_of_two))
    x = _kernel_input(t)
    q_bits = q.view(torch.uint8) if q is not None else sc_out
    qt_bits = q_t.view(torch.uint8) if q_t is not None else sc_out
    with torch.no_grad():
        if dbias and M and N:
            tile_n = (tile or (None, _dbias_tile_n(N, t.device)))[1]
            tiles = _cdiv(N, tile_n)
            programs = max(1, min(num_programs or persistent_programs(tiles, t.device, _TRANSPOSE_PROGRAMS_PER_SM), tiles))
            launch(_cast_transpose_dbias_kernel, (programs,), x, q_bits, qt_bits, db, scale_arg, init_arg,
                   amax_acc, saturated_acc, sc_out, M, N, TILE_N=tile_n, WRITE_Q=write_q, WRITE_QT=write_qt,
                   num_warps=_TRANSPOSE_WARPS, **common)
        elif write_qt and M and N:
            tile_m, tile_n = tile or (_TILE_M, _TILE_N)
            tiles = _cdiv(M, tile_m) * _cdiv(N, tile_n)
            programs = max(1, min(num_programs or persistent_programs(tiles, t.device, _TRANSPOSE_PROGRAMS_PER_SM), tiles))
            launch(_cast_transpose_kernel, (programs,), x, q_bits, qt_bits, scale_arg, init_arg, amax_acc,
                   saturated_acc, sc_out, M, N, TILE_M=tile_m, TILE_N=tile_n, WRITE_Q=write_q, WRITE_QT=True,
                   num_warps=_TRANSPOSE_WARPS, **common)
        else:  # also an empty t: one program still writes the scales
            numel = t.numel() if write_q else 0
            tiles = max(1, _cdiv(numel, _BLOCK))
            programs = max(1, min(num_programs or persistent_programs(tiles, t.device, _CAST_PROGRAMS_PER_SM), tiles))
            launch(_cast_kernel, (programs,), x, q_bits, scale_arg, init_arg, amax_acc, saturated_acc, sc_out,
                   numel, BLOCK=_BLOCK, num_warps=_NUM_WARPS, **common)
            if dbias:
                db.zero_()
    return q, q_t, db


def _dbias_tile_n(n: int, device: torch.device) -> int:
    # Columns per program: wide tiles where there are enough column blocks to fill the GPU,
    # narrower ones (more programs) where there are not. Any width gives the same bits.
    if device.type != "cuda":
        return 16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for width in (64, 32):
        if _cdiv(n, width) >= _TRANSPOSE_PROGRAMS_PER_SM * sms:
            return width
    return 16


# Internal entries: ``num_programs`` overrides the Triton grid and ``block``/``tile`` the tile
# size, so tests cover many tiles and programs on small tensors.
def _amax_and_cast(t, scale, fp8_dtype, backend="auto", *, num_programs=None, block=None):
    _validate(t, scale, fp8_dtype, "amax_and_cast", backend)
    if use_triton(backend, t.device, "amax_and_cast"):
        with torch.no_grad():
            q = torch.empty(t.shape, dtype=fp8_dtype, device=t.device)
            amax_bits, saturated = new_accumulators(t.device)
            sc = torch.empty(2, dtype=torch.float32, device=t.device)
            numel = t.numel()
            if numel:
                block = block or _BLOCK
                tiles = _cdiv(numel, block)
                programs = max(1, min(num_programs or persistent_programs(tiles, t.device, _CAST_PROGRAMS_PER_SM), tiles))
                launch(_cast_kernel, (programs,), _kernel_input(t), q.view(torch.uint8), scale, scale, amax_bits,
                       saturated, sc, numel, BLOCK=block, IS_BF16=t.dtype == torch.bfloat16, ACC_AMAX=True,
                       num_warps=_NUM_WARPS, **_rule_args(fp8_dtype, "given", 0, False))
        return q, amax_bits.view(torch.float32).reshape(()), saturated.reshape(())
    return _reference(t, scale, fp8_dtype)


def _cast_transpose(t, scale, fp8_dtype, backend="auto", *, num_programs=None, tile=None):
    _validate(t, scale, fp8_dtype, "cast_transpose", backend, two_d=True)
    if use_triton(backend, t.device, "cast_transpose"):
        amax_bits, saturated = new_accumulators(t.device)
        sc = torch.empty(2, dtype=torch.float32, device=t.device)
        q, q_t, _ = _launch_quantize(t, fp8_dtype, "given", scale, None, amax_bits, saturated, sc, 0, False, True,
                                     True, True, False, num_programs, tile)
        return q, q_t, amax_bits.view(torch.float32).reshape(()), saturated.reshape(())
    q, amax, saturated = _reference(t, scale, fp8_dtype)
    return q, q.t().contiguous(), amax, saturated
