"""The block-scaled gemm: ``out = (a_q * a_inv) @ (b_q * b_inv).T`` for fp8 operands with one
inverse scale per 1 x 128 tile or 128 x 128 block along the reduction dimension K.

Operands come as in ``_gemms.mm``: ``a`` (M, K) and ``b_rows`` (N, K), both laid out along
K. Each carries a kind, the tile its scales cover:

* ``"1x128"``: one scale per row and 128 columns of K: ``inv`` (rows, ceil(K / 128));
* ``"128x128"``: one scale per 128 x 128 block: ``inv`` (ceil(rows / 128), ceil(K / 128)).

(``kernels.fp8_block`` makes both.) The three gemms of a linear pair them as 1x128 x 128x128
(forward: input x weight; input gradient: output gradient x weight transposed) and
1x128 x 1x128 (weight gradient: both operands tiled along the tokens).

Where it runs:

* CPU: by rule (the reference the tests hold): each operand dequantized in float32 (its
  fp8 values times its tile's inverse scale), a float32 matmul, the bias added in float32,
  the cast to the output dtype. One custom op (``dispatch_amp::block_scaled_mm``), so that
  the census and torch's FlopCounterMode count one fp8 gemm and a compiled graph holds one
  node.
* CUDA: ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` /
  ``BlockWise128x128``. torch runs these on cuBLASLt >= 12.9 for compute capability 9.x
  (Hopper) only, both operands e4m3, float32 scales, and reads the scales in its own
  layouts: a 1x128 operand's as (rows, K blocks) outer-dimension-major (strides
  (1, rows)); a 128x128 operand's as (K blocks rounded up to a multiple of 4, row blocks)
  with strides (1, that multiple of 4). The scales are brought to those layouts here (a
  copy only where they are not already: the weight's, a few floats per 16K elements).
  cuBLASLt accumulates each K block in float32 and applies the scales per block, so its
  result differs from the rule by float32 rounding only. Where torch, the device or the
  operands cannot take this gemm, :func:`block_mm` raises, naming the device, its
  capability and the torch version: it never falls back to other numbers.
* Meta tensors: the CUDA path's shapes, checked by torch's own meta function of the gemm
  (how the kernel counts and the tests of the layouts run without a GPU).
* Other devices: an error saying so.

A K that is not a multiple of 128 (or the outer dimension of a 128x128 operand) is
zero-padded to one on the CUDA path, since torch counts those blocks as ``dim // 128``;
the rule needs no padding (its scales already cover the partial tiles, as zero padding).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["block_mm", "block_mm_by_rule", "dequantize", "block_gemm_unsupported", "KINDS"]

KINDS = ("1x128", "128x128")
_float32 = torch.float32
_F = torch.nn.functional
# torch.nn.functional.scaled_mm with block scaling: torch 2.10 and later spell it so.
_HAS_BLOCK_SCALED_MM = hasattr(_F, "scaled_mm") and hasattr(getattr(_F, "ScalingType", None), "BlockWise128x128")
# The device types whose block gemms are computed by rule.
BY_RULE_ON = frozenset({"cpu"})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _scale_shape(kind: str, rows: int, k: int, block: int) -> tuple[int, int]:
    return (rows if kind == "1x128" else _cdiv(rows, block)), _cdiv(k, block)


_VALUES: dict = {}


def _to_float(q: torch.Tensor) -> torch.Tensor:
    # An fp8 tensor's float32 values looked up by its bytes: the same values as q.float(),
    # several times faster on CPUs (torch's fp8 conversion there is elementwise scalar code).
    table = _VALUES.get((q.dtype, q.device))
    if table is None:
        table = _VALUES[(q.dtype, q.device)] = torch.arange(256, dtype=torch.uint8, device=q.device).view(q.dtype).float()
    return torch.take(table, q.contiguous().view(torch.uint8).long())


def dequantize(q: torch.Tensor, inv: torch.Tensor, kind: str, block: int = 128) -> torch.Tensor:
    """``q`` (rows, K) in float32, each element times its tile's inverse scale.

    Example::

        >>> q = torch.tensor([[2.0, 4.0, 8.0]]).to(torch.float8_e4m3fn)
        >>> dequantize(q, torch.tensor([[0.5, 0.25]]), "1x128", block=2).tolist()
        [[1.0, 2.0, 2.0]]
    """
    rows, k = q.shape
    x = _to_float(q)
    kp = _round_up(k, block)
    rp = _round_up(rows, block) if kind == "128x128" else rows
    if (rp, kp) != (rows, k):  # partial tiles: padded to whole ones, cut back below
        x = torch.nn.functional.pad(x, (0, kp - k, 0, rp - rows))
    if kind == "1x128":
        x = (x.view(rp, kp // block, block) * inv.reshape(rp, kp // block, 1)).view(rp, kp)
    else:
        x = (x.view(rp // block, block, kp // block, block) * inv.reshape(rp // block, 1, kp // block, 1)).view(rp, kp)
    return x if (rp, kp) == (rows, k) else x[:rows, :k].contiguous()


def block_mm_by_rule(a: torch.Tensor, a_inv: torch.Tensor, a_kind: str, b_rows: torch.Tensor, b_inv: torch.Tensor,
                     b_kind: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     block: int = 128) -> torch.Tensor:
    """:func:`block_mm` by its rule: ``dequantize(a) @ dequantize(b_rows).T`` in float32,
    plus the bias in float32, cast to ``out_dtype``.

    Example::

        >>> a = torch.ones(2, 4).to(torch.float8_e4m3fn)
        >>> y = block_mm_by_rule(a, torch.full((2, 2), 0.5), "1x128", a, torch.full((1, 2), 2.0), "128x128",
        ...                      torch.float32, block=2)
        >>> y.tolist()
        [[4.0, 4.0], [4.0, 4.0]]
    """
    y = dequantize(a, a_inv, a_kind, block) @ dequantize(b_rows, b_inv, b_kind, block).t()
    if bias is not None:
        y = y + bias.to(_float32)
    return y.to(out_dtype)


# One op for the rule: counted as one fp8 gemm (census, FlopCounterMode), one graph node.
@torch.library.custom_op("dispatch_amp::block_scaled_mm", mutates_args=())
def _block_mm_op(a: torch.Tensor, a_inv: torch.Tensor, a_kind: str, b_rows: torch.Tensor, b_inv: torch.Tensor,
                 b_kind: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    # The rule's matmul is float32 whatever region calls it: native autocast (a backward
    # run inside torch.autocast, say) would cast it again. Off here, inside the op, where
    # no tracer sees the switch.
    with torch.autocast(a.device.type, enabled=False):
        return block_mm_by_rule(a, a_inv, a_kind, b_rows, b_inv, b_kind, out_dtype, bias, block)


@_block_mm_op.register_fake
def _(a, a_inv, a_kind, b_rows, b_inv, b_kind, out_dtype, bias=None, block=128):
    return a.new_empty((a.shape[0], b_rows.shape[0]), dtype=out_dtype)


@register_flop_formula(torch.ops.dispatch_amp.block_scaled_mm)
def _block_mm_flops(a_shape, a_inv_shape, a_kind, b_rows_shape, *args, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_rows_shape[0]


def block_gemm_unsupported(device: torch.device, fp8_dtypes=(torch.float8_e4m3fn,)) -> str | None:
    """Why the block-scaled gemm cannot run on ``device`` here (``None`` where it can): the
    torch, the device type, its compute capability, or an operand format.

    Example::

        >>> block_gemm_unsupported(torch.device("cpu")) is None
        True
    """
    device = torch.device(device)
    if device.type in BY_RULE_ON:
        return None
    where = f"torch {torch.__version__}, device {device}"
    if device.type != "cuda":
        return f"block-scaled fp8 gemms run on CUDA (Hopper) and, by rule, on the CPU, not on {device.type} ({where})"
    if not _HAS_BLOCK_SCALED_MM:
        return (f"{where}: this torch has no torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128/"
                "BlockWise128x128; upgrade torch (2.13 or later)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if major != 9:
        return (f"{where} ({name}, compute capability {major}.{minor}): torch runs 1x128/128x128 block-scaled "
                "gemms on compute capability 9.x (Hopper) only")
    bad = [str(d) for d in fp8_dtypes if d != torch.float8_e4m3fn]
    if bad:
        return (f"{where} ({name}, compute capability {major}.{minor}): the block-scaled gemm takes "
                f"torch.float8_e4m3fn operands only, got {', '.join(bad)}")
    return None


def _outer_major(inv: torch.Tensor) -> torch.Tensor:
    # 1x128: (rows, K blocks) with strides (1, rows), as kernels.fp8_block makes them.
    if inv.stride(0) == 1 and inv.stride(1) == inv.shape[0]:
        return inv
    return torch.empty((inv.shape[1], inv.shape[0]), dtype=_float32, device=inv.device).t().copy_(inv)


def _padded_blocks(inv: torch.Tensor) -> torch.Tensor:
    # 128x128: (K blocks rounded up to 4, row blocks) with strides (1, that multiple of 4).
    rows, kb = inv.shape
    kb4 = _round_up(kb, 4)
    out = inv.new_zeros((rows, kb4)) if kb4 != kb else inv.new_empty((rows, kb4))
    out[:, :kb] = inv
    return out.t()


def _pad(q: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # fp8 zeros are zero bits: padded through a uint8 view (F.pad has no fp8 kernels).
    if q.shape == (rows, cols):
        return q.contiguous()
    out = torch.nn.functional.pad(q.contiguous().view(torch.uint8), (0, cols - q.shape[1], 0, rows - q.shape[0]))
    return out.view(q.dtype)


def _scaled_mm(a, a_inv, a_kind, b_rows, b_inv, b_kind, out_dtype, bias):
    """The CUDA path (and meta tensors' shapes). torch counts a 128x128 operand's blocks and
    every operand's K blocks as ``dim // 128``: a K, or the outer dimension of a 128x128
    operand, that is not a multiple of 128 is zero-padded to one (a copy of that operand;
    exact, as in the rule, whose scales already count the partial tiles), and the result
    is cut back."""
    st = _F.ScalingType
    kinds = {"1x128": (st.BlockWise1x128, _outer_major), "128x128": (st.BlockWise128x128, _padded_blocks)}
    (ra, fa), (rb, fb) = kinds[a_kind], kinds[b_kind]
    m, k = a.shape
    n = b_rows.shape[0]
    kp = _round_up(k, 128)
    mp = _round_up(m, 128) if a_kind == "128x128" else m
    np_ = _round_up(n, 128) if b_kind == "128x128" else n
    a, b_rows = _pad(a, mp, kp), _pad(b_rows, np_, kp)
    add_after = bias is not None and out_dtype == _float32  # the epilogue takes a bias in bf16/fp16 only
    if bias is not None and not add_after and np_ != n:
        bias = torch.nn.functional.pad(bias, (0, np_ - n))
    y = _F.scaled_mm(a, b_rows.t(), fa(a_inv), ra, fb(b_inv), rb, bias=None if add_after else bias,
                     output_dtype=out_dtype)
    if (mp, np_) != (m, n):
        y = y[:m, :n]
    return y + bias.to(_float32) if add_after else y


def block_mm(a: torch.Tensor, a_inv: torch.Tensor, a_kind: str, b_rows: torch.Tensor, b_inv: torch.Tensor,
             b_kind: str, out_dtype: torch.dtype, bias: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    """``(a * a_inv) @ (b_rows * b_inv).T (+ bias)`` for block-scaled fp8 ``a`` (M, K) and
    ``b_rows`` (N, K), result in ``out_dtype``; kinds and placement in the module docstring.

    Example::

        >>> a = torch.ones(4, 8).to(torch.float8_e4m3fn)
        >>> inv = torch.ones(4, 1)
        >>> block_mm(a, inv, "1x128", a, inv, "1x128", torch.float32).tolist()[0]
        [8.0, 8.0, 8.0, 8.0]
    """
    if a_kind not in KINDS or b_kind not in KINDS:
        raise ValueError(f"block_mm: kinds must be in {KINDS}, got {a_kind!r} and {b_kind!r}.")
    if a.dim() != 2 or b_rows.dim() != 2 or a.shape[1] != b_rows.shape[1]:
        raise ValueError(f"block_mm: a (M, K) and b_rows (N, K) must share K; got {tuple(a.shape)} and {tuple(b_rows.shape)}.")
    k = a.shape[1]
    for name, q, inv, kind in (("a", a, a_inv, a_kind), ("b_rows", b_rows, b_inv, b_kind)):
        want = _scale_shape(kind, q.shape[0], k, block)
        if tuple(inv.shape) != want or inv.dtype != _float32:
            raise ValueError(f"block_mm: {name}'s inverse scales must be float32 of shape {want} for {kind} tiles of "
                             f"{block}; got {inv.dtype} {tuple(inv.shape)}.")
    if a.device.type in BY_RULE_ON:
        return _block_mm_op(a, a_inv, a_kind, b_rows, b_inv, b_kind, out_dtype, bias, block)
    # Meta tensors take the CUDA path's shapes (torch checks the scale layouts there too).
    why = None if a.device.type == "meta" else block_gemm_unsupported(a.device, (a.dtype, b_rows.dtype))
    if why is None and block != 128:
        why = f"torch {torch.__version__}, device {a.device}: the gemm's tiles are 128 long, got block={block}"
    if why is not None:
        raise RuntimeError(f"block_mm: {why}. Use CurrentScaling, DelayedScaling or RowwiseScaling there instead.")
    return _scaled_mm(a, a_inv, a_kind, b_rows, b_inv, b_kind, out_dtype, bias)
