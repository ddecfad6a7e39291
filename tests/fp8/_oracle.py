"""An fp8 emulation written from README's rules alone, the oracle of the fp8 tests.

Quantize: ``q = clamp(t.float() * scale, -max, max).to(fmt)``, inf/nan -> nan; dequantize:
``q.float() * (1 / scale)``; every gemm is a float32 matmul of dequantized operands, cast
to the output dtype; the bias is added to the float32 result; bias grad is a float32 sum.
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


def current_scale(t, fmt, rowwise=False, power_of_two=False):
    a = t.float().abs()
    a = a.amax(dim=-1, keepdim=True) if rowwise else a.amax()
    s = torch.tensor(MAX[fmt]) / a
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return torch.where(a == 0, torch.ones_like(s), s)


def qdq(t, scale, fmt):
    return dequantize(quantize(t, scale, fmt), scale)


def linear_forward(x2, w, b, sx, sw, fmt, out_dtype):
    y = qdq(x2, sx, fmt) @ qdq(w, sw, fmt).t()
    if b is not None:
        y = y + b.float()
    return y.to(out_dtype)


class DelayedSite:
    """DelayedScaling's state for one site, per README: histories newest first, scales from 1."""

    def __init__(self, n=16, algo="max", margin=0):
        self.n, self.algo, self.margin = n, algo, margin
        self.history = {r: [0.0] * n for r in ("input", "weight", "grad_output")}
        self.scale = {r: torch.tensor(1.0) for r in ("input", "weight", "grad_output")}

    def use(self, role, t, fmt):
        s = self.scale[role].clone()
        a = t.float().abs().amax().item()
        h = self.history[role] = [a] + self.history[role][:-1]
        ref = max(h) if self.algo == "max" else h[0]
        if ref > 0 and ref != float("inf") and ref == ref:
            self.scale[role] = torch.tensor(MAX[fmt], dtype=torch.float32) / torch.tensor(ref, dtype=torch.float32)
            if self.margin:
                self.scale[role] = self.scale[role] / 2.0 ** self.margin
        return s
