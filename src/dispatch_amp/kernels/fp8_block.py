"""fp8 block scaling: one scale per tile of 1 x 128, 128 x 1 or 128 x 128 elements, the
quantize kernels and their torch references (the oracles, bit for bit).

Public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`quantize_tiles`: a 2-D ``t`` (M, N) in tiles of one row by ``block`` columns
  (``rowwise``: ``q`` (M, N) with one scale per row and column block) and/or of ``block``
  rows by one column (``colwise``: written transposed, ``q_t`` (N, M), one scale per column
  and row block), both from one read of ``t``. Activations and output gradients: the
  forward and input-gradient gemms contract along ``t``'s last dimension (rowwise), the
  weight-gradient gemm along its first, the tokens (colwise).
* :func:`quantize_blocks`: ``block x block`` blocks with one scale each (weights), ``q``
  and/or its transpose ``q_t`` from one read: the same blocks serve ``w`` and ``w.T``.
* :func:`quantize_tiles_reference`, :func:`quantize_blocks_reference`: the rule below in
  plain torch.

Rule, per tile or block ``T`` of ``x = t.float()`` (``t`` float32, bfloat16 or float16)::

    amax  = max(|x| over T)          # nan if T holds a nan, else inf if it holds an inf
    scale = scale_from_amax(amax)    # fp8_max / amax; FLT_MAX for an amax so small the
                                     # quotient overflows; 1 for an amax of 0; optionally
                                     # rounded down to a power of two (fp8_scale's rule)
    q     = where(isfinite(x), (x * scale).clamp(-fp8_max, fp8_max), nan).to(fp8_dtype)
    inv   = 1 / scale                # float32, what the gemm multiplies back

The cast is ``fp8_cast``'s (one float32 multiply, round to nearest even, inf and nan to
nan) with the tile's scale in place of the tensor's. A tile that holds a nan quantizes to
nan throughout and its ``inv`` is nan; one that holds an inf gets the scale 0, so its
finite values become 0 and its infs nan: a non-finite value spoils its own tile, never a
neighbour. No finite value saturates (its tile's scale maps the amax to fp8_max at most),
so no saturation is counted.

Edges: where a dimension is not a multiple of ``block`` the last tiles are partial, and
their amax covers only their valid elements. That is the same as padding ``t`` with zeros
to whole tiles (a zero never raises an amax), which is exact for a matmul: the padded
products are zero. Nothing is written for the padding.

Layouts of the inverse scales, chosen for the gemm (``torch.nn.functional.scaled_mm``
wants the scales of a 1 x 128 operand outer-dimension-major): ``quantize_tiles`` returns
``q_inv`` of shape (M, ceil(N / block)) with strides (1, M), and ``qt_inv`` of shape
(N, ceil(M / block)) with strides (1, N); ``quantize_blocks`` returns ``inv`` of shape
(ceil(M / block), ceil(N / block)), contiguous (the scales of ``q_t`` are ``inv.T``).

The Triton kernel takes one ``block x block`` tile per program, masked at the edges, bf16
loaded as raw 16-bit words; it shares the cast and the scale with ``fp8_cast`` and
``fp8_scale`` (``_quantize``, ``scale_of``), which is why it agrees with the references
bit for bit interpreted and compiled. With ``amax_acc`` (a one-element int32 holding
float32 bits, as in ``fp8_amax``) it also accumulates the tensor's amax, for a report.

Note: passes
------------
A program reads its tile 16 rows at a time (a whole 128 x 128 float32 tile does not fit
in a thread's registers). 1 x 128 tiles lie within those rows: one pass. 128 x 1 tiles
and 128 x 128 blocks need the amax of all 128 rows before the first cast, so the program
reads its tile twice: the amaxes, then the casts (the second read comes from the cache:
the tile was read just before, 64 KiB at most).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch paths below work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

from ._launch import launch, use_triton
from .fp8_cast import _FORMATS, SATURATES_ABOVE, fp8_max
from .fp8_scale import scale_from_amax_reference
from .unscale import BACKENDS

__all__ = ["quantize_tiles", "quantize_blocks", "quantize_tiles_reference", "quantize_blocks_reference", "BLOCK"]

# DeepSeek-V3's tile: 128 elements along the reduction dimension, 128 x 128 for weights.
BLOCK = 128
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A program's tile is read _ROWS rows at a time (see "Note: passes"): 16 x 128 elements
# over 8 warps are 8 a thread. ptxas (triton 3.9, sm_90) gives the tiles kernel 128
# registers a thread and the blocks kernel 83, nothing spilled; whole 128 x 128 tiles in
# registers took 255 and spilled over a thousand words a thread.
_NUM_WARPS = 8
_ROWS = 16


if triton is not None:
    from .fp8_cast import _load_f32, _quantize
    from .fp8_scale import scale_of

    @triton.jit
    def _inverse(s):
        # div_rn: rounded as torch's division (a GPU's plain division may be approximate).
        return tl.math.div_rn(tl.zeros_like(s) + 1.0, s)

    @triton.jit
    def _block_kernel(
        x_ptr,  # (M, N) row-major input: fp32, fp16, or int16 words of bf16
        q_ptr,  # (M, N) uint8 fp8 bits (ROWWISE, or BLOCKS with WRITE_Q)
        qt_ptr,  # (N, M) uint8 fp8 bits (COLWISE, or BLOCKS with WRITE_QT)
        s_ptr,  # float32 inverse scales of q: [row, column block], or [row block, column block]
        st_ptr,  # float32 inverse scales of q_t: [column, row block]
        amax_ptr,  # int32 float32 bits of the tensor's amax (ACC_AMAX)
        M, N,
        s_stride0, s_stride1, st_stride0, st_stride1,
        B: tl.constexpr, R: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BLOCKS: tl.constexpr,
        WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr, ACC_AMAX: tl.constexpr, IS_BF16: tl.constexpr,
        FP8_MAX: tl.constexpr, SAT_ABOVE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
        POW2: tl.constexpr,
    ):
        # One B x B tile per program, read R rows at a time (see "Note: passes").
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, B)
        tm = pid // tiles_n
        tn = pid % tiles_n
        row0 = tm.to(tl.int64) * B
        cols = tn.to(tl.int64) * B + tl.arange(0, B)
        in_cols = cols < N
        amax = tl.zeros([B], dtype=tl.int32)  # per column of the tile: |x| bits, nan winning
        if COLWISE or BLOCKS:  # the first pass: the amaxes the scales need before any cast
            for r in range(0, B, R):
                rows = row0 + r + tl.arange(0, R)
                mask = (rows < M)[:, None] & in_cols[None, :]
                x = _load_f32(x_ptr + rows[:, None] * N + cols[None, :], mask, IS_BF16, True)
                amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
            a_col = amax.to(tl.float32, bitcast=True)
            s_col = scale_of(a_col, FP8_MAX, 1.0, POW2)
            s_blk = scale_of(tl.max(amax, axis=0).to(tl.float32, bitcast=True), FP8_MAX, 1.0, POW2)
            if COLWISE:
                tl.store(st_ptr + cols * st_stride0 + tm * st_stride1, _inverse(s_col), mask=in_cols)
            if BLOCKS:
                tl.store(s_ptr + tm * s_stride0 + tn * s_stride1, _inverse(s_blk))
        for r in range(0, B, R):
            rows = row0 + r + tl.arange(0, R)
            in_rows = rows < M
            mask = in_rows[:, None] & in_cols[None, :]
            x = _load_f32(x_ptr + rows[:, None] * N + cols[None, :], mask, IS_BF16, True)
            if ROWWISE:  # one scale per row of the tile: 1 x B
                x_abs = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                s_row = scale_of(tl.max(x_abs, axis=1).to(tl.float32, bitcast=True), FP8_MAX, 1.0, POW2)
                bits, _a, _s = _quantize(x, s_row[:, None], FP8_MAX, SAT_ABOVE, MANT, BIAS)
                tl.store(q_ptr + rows[:, None] * N + cols[None, :], bits.to(tl.uint8), mask=mask)
                tl.store(s_ptr + rows * s_stride0 + tn * s_stride1, _inverse(s_row), mask=in_rows)
                if not (COLWISE or BLOCKS):
                    amax = tl.maximum(amax, tl.max(x_abs, axis=0))
            if COLWISE:  # one scale per column of the tile: B x 1, stored transposed
                bits, _a, _s = _quantize(x, s_col[None, :], FP8_MAX, SAT_ABOVE, MANT, BIAS)
                tl.store(qt_ptr + cols[None, :] * M + rows[:, None], bits.to(tl.uint8), mask=mask)
            if BLOCKS:  # one scale for the whole B x B block
                bits, _a, _s = _quantize(x, s_blk, FP8_MAX, SAT_ABOVE, MANT, BIAS)
                b8 = bits.to(tl.uint8)
                if WRITE_Q:
                    tl.store(q_ptr + rows[:, None] * N + cols[None, :], b8, mask=mask)
                if WRITE_QT:
                    tl.store(qt_ptr + cols[None, :] * M + rows[:, None], b8, mask=mask)
        if ACC_AMAX:
            tl.atomic_max(amax_ptr, tl.max(amax, axis=0))


# --------------------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    # Zero padding to whole tiles: the rule of the edges (module docstring).
    m, n = x.shape
    return torch.nn.functional.pad(x, (0, (-n) % block, 0, (-m) % block))


def _cast(x: torch.Tensor, y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    # fp8_cast's rule, given y = x * (the element's tile's scale).
    limit = fp8_max(fp8_dtype)
    return torch.where(torch.isfinite(x), y.clamp(-limit, limit), float("nan")).to(fp8_dtype).contiguous()


def _times_tiles(xp: torch.Tensor, s: torch.Tensor, block: int, m: int, n: int) -> torch.Tensor:
    # xp (zero-padded, Mp x Np) times s (Mp x Np / block), one scale per 1 x block tile,
    # broadcast (not repeated), cut back to m x n.
    mp, np_ = xp.shape
    return (xp.view(mp, np_ // block, block) * s.view(mp, np_ // block, 1)).view(mp, np_)[:m, :n]


def _scales(amax: torch.Tensor, fp8_dtype: torch.dtype, power_of_two: bool):
    s = scale_from_amax_reference(amax, fp8_max(fp8_dtype), 0, power_of_two)
    return s, torch.ones_like(s) / s


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    # (rows, blocks) with strides (1, rows): the gemm's layout for 1 x 128 scales, made as
    # the launchers make it (so that a size-1 dimension gets the same stride too).
    return torch.empty((s.shape[1], s.shape[0]), dtype=s.dtype, device=s.device).t().copy_(s)


def quantize_tiles_reference(t: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                             colwise: bool = False, power_of_two: bool = False, block: int = BLOCK):
    """The tile rule in plain torch, the oracle of :func:`quantize_tiles`:
    ``(q, q_inv, q_t, qt_inv)``, ``None`` for the layouts not asked for.

    Example::

        >>> t = torch.tensor([[1.0, -2.0, 4.0, 8.0]])
        >>> q, q_inv, _, _ = quantize_tiles_reference(t, block=2)
        >>> q.float().tolist(), q_inv.tolist()
        ([[224.0, -448.0, 224.0, 448.0]], [[0.004464285913854837, 0.01785714365541935]])
    """
    _validate(t, fp8_dtype, block, "quantize_tiles_reference")
    m, n = t.shape
    with torch.no_grad():
        x = t.float()
        q = q_inv = q_t = qt_inv = None
        xp = _padded(x, block)
        mp, np_ = xp.shape
        if rowwise:
            s, inv = _scales(xp.abs().view(mp, np_ // block, block).amax(-1), fp8_dtype, power_of_two)  # (Mp, Nb)
            q = _cast(x, _times_tiles(xp, s, block, m, n), fp8_dtype)
            q_inv = _outer_major(inv[:m])
        if colwise:
            xpt = xp.t().contiguous()
            s, inv = _scales(xpt.abs().view(np_, mp // block, block).amax(-1), fp8_dtype, power_of_two)  # (Np, Mb)
            q_t = _cast(x.t(), _times_tiles(xpt, s, block, n, m), fp8_dtype)
            qt_inv = _outer_major(inv[:n])
    return q, q_inv, q_t, qt_inv


def quantize_blocks_reference(t: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, write_q: bool = True,
                              write_qt: bool = False, power_of_two: bool = False, block: int = BLOCK):
    """The block rule in plain torch, the oracle of :func:`quantize_blocks`:
    ``(q, q_t, inv)``, ``None`` for the layouts not asked for.

    Example::

        >>> q, q_t, inv = quantize_blocks_reference(torch.tensor([[1.0, 2.0], [-4.0, 0.5]]), write_qt=True, block=2)
        >>> q_t.float().tolist(), inv.tolist()
        ([[112.0, -448.0], [224.0, 56.0]], [[0.008928571827709675]])
    """
    _validate(t, fp8_dtype, block, "quantize_blocks_reference")
    m, n = t.shape
    with torch.no_grad():
        x = t.float()
        xp = _padded(x, block)
        mb, nb = xp.shape[0] // block, xp.shape[1] // block
        s, inv = _scales(xp.abs().view(mb, block, nb, block).amax((1, 3)), fp8_dtype, power_of_two)
        y = (xp.view(mb, block, nb, block) * s.view(mb, 1, nb, 1)).view(xp.shape)[:m, :n]
        q = _cast(x, y, fp8_dtype)
    return (q if write_q else None), (q.t().contiguous() if write_qt else None), inv


# --------------------------------------------------------------------------------------
# Public launchers
# --------------------------------------------------------------------------------------


def _validate(t, fp8_dtype, block, name: str, backend: str = "torch") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}.")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: t must be a tensor, got {type(t).__name__}.")
    if t.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: t has dtype {t.dtype}; it must be torch.float32, torch.bfloat16 or torch.float16 "
                        "(convert it with .float() first).")
    if not isinstance(fp8_dtype, torch.dtype) or fp8_dtype not in _FORMATS:
        raise TypeError(f"{name}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}.")
    if t.dim() != 2:
        raise ValueError(f"{name}: t must be 2-D (M, N), got shape {tuple(t.shape)}; reshape it to (-1, t.shape[-1]) first.")
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (its stride is {t.stride()}); pass t.contiguous().")
    if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block & (block - 1):
        raise ValueError(f"{name}: block must be a power of two of at least 2 (the tile's length), got {block!r}.")


def _check_acc(amax_acc, t, name: str) -> None:
    if amax_acc is None:
        return
    if not isinstance(amax_acc, torch.Tensor) or amax_acc.dtype != torch.int32 or amax_acc.numel() != 1:
        raise TypeError(f"{name}: amax_acc must be a one-element int32 tensor holding float32 bits (as fp8_amax's).")
    if amax_acc.device != t.device:
        raise ValueError(f"{name}: amax_acc is on {amax_acc.device} but t is on {t.device}; move it to t's device.")


def _accumulate(amax_acc, t) -> None:
    if amax_acc is None or t.numel() == 0:
        return
    bits = t.detach().abs().amax().float().view(torch.int32).reshape(1)
    amax_acc.copy_(torch.maximum(amax_acc.reshape(1), bits).reshape(amax_acc.shape))


def _rule_args(t, fp8_dtype, power_of_two, block) -> dict:
    limit, mant, bias = _FORMATS[fp8_dtype]
    return dict(B=block, R=min(block, _ROWS), IS_BF16=t.dtype == torch.bfloat16, FP8_MAX=limit, SAT_ABOVE=SATURATES_ABOVE[fp8_dtype],
                MANT=mant, BIAS=bias, POW2=bool(power_of_two), num_warps=_NUM_WARPS)


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    # bf16 goes in as its raw words (fp8_cast's note).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def quantize_tiles(t: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, rowwise: bool = True,
                   colwise: bool = False, power_of_two: bool = False, block: int = BLOCK,
                   amax_acc: torch.Tensor | None = None, backend: str = "auto"):
    """Quantize a 2-D ``t`` (M, N) in 1 x ``block`` tiles (``rowwise``) and/or ``block`` x 1
    tiles (``colwise``, written transposed), one read: ``(q, q_inv, q_t, qt_inv)``.

    ``q`` (M, N) and ``q_t`` (N, M) are ``fp8_dtype``; ``q_inv`` (M, ceil(N / block)) and
    ``qt_inv`` (N, ceil(M / block)) are the float32 inverse scales, outer-dimension-major
    (module docstring); ``None`` for what was not asked. ``power_of_two`` rounds each scale
    down to a power of two. ``amax_acc`` (optional) accumulates ``max|t|``. Equals
    :func:`quantize_tiles_reference` bit for bit; never synchronizes. ``backend``:
    ``"auto"`` (Triton for CUDA tensors when triton is installed, else torch), ``"triton"``
    (on CPU only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Example::

        >>> t = torch.tensor([[1.0, -2.0, 4.0, 8.0], [0.0, 0.0, 0.5, 0.25]])
        >>> q, q_inv, q_t, qt_inv = quantize_tiles(t, rowwise=False, colwise=True, block=16)
        >>> q_t.float().tolist()[3], qt_inv.tolist()[3]
        ([448.0, 14.0], [0.01785714365541935])
    """
    _validate(t, fp8_dtype, block, "quantize_tiles", backend)
    _check_acc(amax_acc, t, "quantize_tiles")
    if not (rowwise or colwise):
        raise ValueError("quantize_tiles: nothing to write; ask for rowwise=True and/or colwise=True.")
    if torch.compiler.is_compiling():  # one node of the graph (see "Note: torch.compile")
        q, q_inv, q_t, qt_inv = _tiles_op(t.detach(), fp8_dtype, rowwise, colwise, power_of_two, block)
        _accumulate(amax_acc, t)
        if not rowwise:
            q = q_inv = None
        if not colwise:
            q_t = qt_inv = None
        return q, q_inv, q_t, qt_inv
    if not use_triton(backend, t.device, "quantize_tiles"):
        with torch.no_grad():
            _accumulate(amax_acc, t)
        return quantize_tiles_reference(t, fp8_dtype, rowwise=rowwise, colwise=colwise, power_of_two=power_of_two,
                                        block=block)
    m, n = t.shape
    dev = t.device
    with torch.no_grad():
        q = torch.empty((m, n), dtype=fp8_dtype, device=dev) if rowwise else None
        q_t = torch.empty((n, m), dtype=fp8_dtype, device=dev) if colwise else None
        q_inv = torch.empty((_cdiv(n, block), m), dtype=torch.float32, device=dev).t() if rowwise else None
        qt_inv = torch.empty((_cdiv(m, block), n), dtype=torch.float32, device=dev).t() if colwise else None
        if m and n:
            spare = q_inv if q_inv is not None else qt_inv  # a tensor for the pointers not read
            s, st = (q_inv if rowwise else spare), (qt_inv if colwise else spare)
            launch(_block_kernel, (_cdiv(m, block) * _cdiv(n, block),), _kernel_input(t),
                   q.view(torch.uint8) if rowwise else spare, q_t.view(torch.uint8) if colwise else spare, s, st,
                   amax_acc if amax_acc is not None else spare, m, n, s.stride(0), s.stride(1), st.stride(0),
                   st.stride(1), ROWWISE=bool(rowwise), COLWISE=bool(colwise), BLOCKS=False, WRITE_Q=False,
                   WRITE_QT=False, ACC_AMAX=amax_acc is not None, **_rule_args(t, fp8_dtype, power_of_two, block))
    return q, q_inv, q_t, qt_inv


def quantize_blocks(t: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, write_q: bool = True,
                    write_qt: bool = False, power_of_two: bool = False, block: int = BLOCK,
                    amax_acc: torch.Tensor | None = None, backend: str = "auto"):
    """Quantize a 2-D ``t`` (M, N) in ``block x block`` blocks, one read: ``(q, q_t, inv)``.

    ``q`` (M, N) and ``q_t`` (N, M, the same bits transposed) are ``fp8_dtype`` or ``None``
    where not asked for; ``inv`` (ceil(M / block), ceil(N / block)) holds the float32
    inverse scales, contiguous (those of ``q_t`` are ``inv.T``). Other arguments as in
    :func:`quantize_tiles`. Equals :func:`quantize_blocks_reference` bit for bit.

    Example::

        >>> q, q_t, inv = quantize_blocks(torch.full((20, 20), 2.0), block=16)
        >>> inv.shape, q.float().unique().tolist(), inv[0, 0].item()
        (torch.Size([2, 2]), [448.0], 0.004464285913854837)
    """
    _validate(t, fp8_dtype, block, "quantize_blocks", backend)
    _check_acc(amax_acc, t, "quantize_blocks")
    if torch.compiler.is_compiling():  # one node of the graph (see "Note: torch.compile")
        q, q_t, inv = _blocks_op(t.detach(), fp8_dtype, write_q, write_qt, power_of_two, block)
        _accumulate(amax_acc, t)
        return (q if write_q else None), (q_t if write_qt else None), inv
    if not use_triton(backend, t.device, "quantize_blocks"):
        with torch.no_grad():
            _accumulate(amax_acc, t)
        return quantize_blocks_reference(t, fp8_dtype, write_q=write_q, write_qt=write_qt, power_of_two=power_of_two,
                                         block=block)
    m, n = t.shape
    dev = t.device
    with torch.no_grad():
        q = torch.empty((m, n), dtype=fp8_dtype, device=dev) if write_q else None
        q_t = torch.empty((n, m), dtype=fp8_dtype, device=dev) if write_qt else None
        inv = torch.empty((_cdiv(m, block), _cdiv(n, block)), dtype=torch.float32, device=dev)
        if m and n:
            launch(_block_kernel, (inv.numel(),), _kernel_input(t), q.view(torch.uint8) if write_q else inv,
                   q_t.view(torch.uint8) if write_qt else inv, inv, inv, amax_acc if amax_acc is not None else inv,
                   m, n, inv.stride(0), inv.stride(1), 0, 0, ROWWISE=False, COLWISE=False, BLOCKS=True,
                   WRITE_Q=bool(write_q), WRITE_QT=bool(write_qt), ACC_AMAX=amax_acc is not None,
                   **_rule_args(t, fp8_dtype, power_of_two, block))
    return q, q_t, inv


# --------------------------------------------------------------------------------------
# Under torch.compile
# --------------------------------------------------------------------------------------
# Each quantize is one custom op in a compiled graph, which runs what an eager call runs
# (the Triton kernel on CUDA, the torch rule elsewhere): inductor's CPU code generation
# fails on the rule's two tilings of one tensor fused together (an assertion in its loop
# split, torch 2.13), and on CUDA the kernel already reads each tile once for both
# layouts. Layouts not asked for come back as empty tensors (an op returns tensors only).


def _empty(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.new_empty(0, dtype=dtype)


@torch.library.custom_op("dispatch_amp::quantize_tiles", mutates_args=())
def _tiles_op(t: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, colwise: bool, power_of_two: bool,
              block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, q_inv, q_t, qt_inv = quantize_tiles(t, fp8_dtype, rowwise=rowwise, colwise=colwise,
                                           power_of_two=power_of_two, block=block)
    f32 = torch.float32
    return (q if rowwise else _empty(t, fp8_dtype), q_inv if rowwise else _empty(t, f32),
            q_t if colwise else _empty(t, fp8_dtype), qt_inv if colwise else _empty(t, f32))


@_tiles_op.register_fake
def _(t, fp8_dtype, rowwise, colwise, power_of_two, block):
    m, n = t.shape
    f32 = torch.float32
    if rowwise:
        q, q_inv = t.new_empty((m, n), dtype=fp8_dtype), t.new_empty((_cdiv(n, block), m), dtype=f32).t()
    else:
        q, q_inv = _empty(t, fp8_dtype), _empty(t, f32)
    if colwise:
        q_t, qt_inv = t.new_empty((n, m), dtype=fp8_dtype), t.new_empty((_cdiv(m, block), n), dtype=f32).t()
    else:
        q_t, qt_inv = _empty(t, fp8_dtype), _empty(t, f32)
    return q, q_inv, q_t, qt_inv


@torch.library.custom_op("dispatch_amp::quantize_blocks", mutates_args=())
def _blocks_op(t: torch.Tensor, fp8_dtype: torch.dtype, write_q: bool, write_qt: bool, power_of_two: bool,
               block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, q_t, inv = quantize_blocks(t, fp8_dtype, write_q=write_q, write_qt=write_qt, power_of_two=power_of_two,
                                  block=block)
    return (q if write_q else _empty(t, fp8_dtype)), (q_t if write_qt else _empty(t, fp8_dtype)), inv


@_blocks_op.register_fake
def _(t, fp8_dtype, write_q, write_qt, power_of_two, block):
    m, n = t.shape
    q = t.new_empty((m, n), dtype=fp8_dtype) if write_q else _empty(t, fp8_dtype)
    q_t = t.new_empty((n, m), dtype=fp8_dtype) if write_qt else _empty(t, fp8_dtype)
    return q, q_t, t.new_empty((_cdiv(m, block), _cdiv(n, block)), dtype=torch.float32)
