"""An fp8 emulation written from the rules in docs/fp8.md alone, the oracle of the fp8 tests.

Quantize: ``q = clamp(t.float() * scale, -max, max).to(fmt)``, inf/nan -> nan; dequantize:
``q.float() * (1 / scale)``; every gemm is a float32 matmul of dequantized operands, cast
to the output dtype; the bias, rounded to the output dtype, is added to the float32
result; bias grad is a float32 sum in a fixed order (``bias_grad``).
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def quantize(t, scale, fmt):
    x = t.float()
    y = x * scale
    return torch.where(torch.isfinite(x), y.clamp(-MAX[fmt], MAX[fmt]), torch.tensor(float("nan"))).to(fmt)


def dequantize(q, scale):
    return q.float() * scale.reciprocal()


F32_MAX = torch.finfo(torch.float32).max


def scale_of(a, fmt, margin=0, power_of_two=False):
    """docs/fp8.md: max / amax / 2**margin, clamped to float32's largest value, rounded down to
    a power of two if asked; 1 where amax is 0."""
    s = torch.tensor(MAX[fmt]) / a
    if margin:
        s = s / 2.0 ** margin
    s = torch.where(s > F32_MAX, torch.tensor(F32_MAX), s)
    if power_of_two:
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
        s = torch.where((s > 0) & torch.isfinite(s), torch.ldexp(torch.ones_like(s), exponent - 1), s)
    return torch.where(a == 0, torch.ones_like(s), s)


def current_scale(t, fmt, rowwise=False, power_of_two=False):
    a = t.float().abs()
    a = a.amax(dim=-1, keepdim=True) if rowwise else a.amax()
    return scale_of(a, fmt, power_of_two=power_of_two)


def bias_grad(dy2):
    """docs/fp8.md: dy's column sums in float32, rows in blocks of 64 (the last padded with
    zeros), each block a pairwise tree (row r with row r + 32, then r + 16, ...), the
    blocks' sums added in order from zero."""
    x = dy2.float()
    rows = x.shape[0]
    x = torch.cat([x, torch.zeros(-rows % 64, x.shape[1])])
    total = torch.zeros(x.shape[1])
    for start in range(0, x.shape[0], 64):
        block = x[start:start + 64]
        while block.shape[0] > 1:
            half = block.shape[0] // 2
            block = block[:half] + block[half:]
        total = total + block[0]
    return total


def qdq(t, scale, fmt):
    return dequantize(quantize(t, scale, fmt), scale)


def linear_forward(x2, w, b, sx, sw, fmt, out_dtype):
    y = qdq(x2, sx, fmt) @ qdq(w, sw, fmt).t()
    if b is not None:
        y = y + b.to(out_dtype).float()
    return y.to(out_dtype)


class DelayedSite:
    """DelayedScaling's state for one site, per docs/fp8.md: histories newest first, scales from
    1; until a role has recorded a positive finite amax, a call scales from its own amax."""

    def __init__(self, n=16, algo="max", margin=0):
        self.n, self.algo, self.margin = n, algo, margin
        self.history = {r: [0.0] * n for r in ("input", "weight", "grad_output")}
        self.scale = {r: torch.tensor(1.0) for r in ("input", "weight", "grad_output")}

    def use(self, role, t, fmt):
        a = t.float().abs().amax()
        seen = any(0 < h < float("inf") for h in self.history[role])
        s = self.scale[role].clone() if seen else scale_of(a, fmt, self.margin)
        h = self.history[role] = [a.item()] + self.history[role][:-1]
        ref = max(h) if self.algo == "max" else h[0]
        if ref > 0 and ref != float("inf") and ref == ref:
            self.scale[role] = scale_of(torch.tensor(ref, dtype=torch.float32), fmt, self.margin)
        return s


# -- comparing with a gemm computed another way ------------------------------------------
#
# The oracle's gemms are float32 matmuls as written in docs/fp8.md; ours reach float32
# matmuls too (on the CPU), but with other operand layouts, and the CPU's gemm kernel picks
# its summation order by layout and by machine (AMD and Intel differ). Bits are compared
# only where both sides make the same call on the same operands (``gemm_nt``); elsewhere
# with ``gemm_bound``.

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def gemm_nt(a, b_rows):
    """``a @ b_rows.T`` in float32 as ours computes it on the CPU: both operands contiguous,
    laid out along K, the second one read transposed (``fp8/_gemms.by_rule``). The same
    call on the same operands gives the same bits on any machine."""
    return a.float().contiguous() @ b_rows.float().contiguous().t()


def gemm_bound(a, b, out_dtype, bias=None):
    """Elementwise bound on ``|ours - oracle|`` for ``(a @ b + bias).to(out_dtype)`` computed
    by two float32 gemms that sum in different orders (``a``, ``b``: the float32 operands).

    - Any order of summing n float32 terms (here the K products, and the bias) is within
      ``gamma_n * sum |term|`` of the exact sum, ``gamma_n = n u / (1 - n u)``, ``u =
      2**-24`` (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1;
      a fused multiply-add only drops roundings): two orders are within twice that, ``d``.
    - Rounding each to ``out_dtype`` (nearest, unit roundoff ``v``) adds at most ``v`` of
      each: ``|rd(x) - rd(y)| <= d + v (|x| + |y|) <= (1 + v) d + 2 v |y|``, and ``|y|``, a
      float32 sum, is at most ``(1 + gamma_n) sum |term|``. Gradual underflow adds at most
      the spacing of ``out_dtype``'s subnormals.

    The bound grows with K and with ``sum |term|``, not with ``|result|``: a result that
    cancels to near zero may differ by more than its own ulps, as it should.
    """
    n = a.shape[-1] + (bias is not None)
    u, v = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[out_dtype]
    terms = a.double().abs() @ b.double().abs()
    if bias is not None:
        terms = terms + bias.double().abs()
    gamma = n * u / (1 - n * u)
    d = 2 * gamma * terms
    finfo = torch.finfo(out_dtype)
    return (1 + v) * d + 2 * v * (1 + gamma) * terms + finfo.smallest_normal * finfo.eps


def assert_within(got, want, bound, what):
    """``got`` and ``want`` of the same dtype, nan at the same places, elsewhere
    ``|got - want| <= bound`` (a tensor broadcast to them; 0 asks for the same bits)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: nan positions differ"
    ok = ~got.isnan()
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    over = (diff > bound) & ok
    assert not over.any(), (f"{what}: {int(over.sum())} elements beyond the bound, max |diff| "
                            f"{diff[ok].max().item():.3g}, bound there {bound[over].max().item():.3g}")
