"""amax in one read: ``max|t|`` of a whole tensor, no float32 copy, no host read.

Public entry points (re-exported by ``dispatch_amp.kernels``):

* :func:`amax_into_` accumulates ``max|t|`` into an int32 accumulator holding float32
  bits (the form the fp8 cast kernels and the statistics kernel read).
* :func:`amax_reference`: the rule in plain torch.

Rule (``t`` float32, bfloat16 or float16)::

    amax = t.abs().amax().float()        # nan if any element is nan, else inf if any is inf; 0 if empty

``|t|`` is exact in any float dtype, so the maximum needs no wider copy. The kernel keeps
per lane the largest ``bits(x) & 0x7FFFFFFF`` as an int32 (for non-negative floats the
integer order of the bit patterns is the numeric order, and every nan pattern lies above
inf's, so nan wins without a flag; see "Note: amax across programs" in ``fp8_cast.py``),
reduces once per program, and combines programs with one ``atomic_max`` into the
accumulator, which must start at 0 (the statistics kernel puts it back to 0). A persistent
grid, loads unmasked but for the ragged last tile, bf16 loaded as raw 16-bit words.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch rule works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

from ._launch import launch, persistent_programs, use_triton
from .unscale import BACKENDS

__all__ = ["amax_into_", "amax_reference", "amax"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 4096
_NUM_WARPS = 8
# A load and a max per element: as many programs as fit (see fp8_cast's counts).
_PROGRAMS_PER_SM = 4


if triton is not None:

    @triton.jit
    def _abs_bits(ptrs, mask, IS_BF16: tl.constexpr, MASKED: tl.constexpr):
        if MASKED:
            raw = tl.load(ptrs, mask=mask, other=0)
        else:
            raw = tl.load(ptrs)
        if IS_BF16:
            # The 16 bits of a bf16 are the top half of its float32: shift them there.
            return ((raw.to(tl.int32) & 0xFFFF) << 16) & 0x7FFFFFFF
        return raw.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _amax_kernel(x_ptr, acc_ptr, numel, BLOCK: tl.constexpr, IS_BF16: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        best = tl.zeros([BLOCK], dtype=tl.int32)
        n_full = numel // BLOCK
        j = pid
        while j < n_full:  # a while loop: see "Kernels" in docs/design.md
            best = tl.maximum(best, _abs_bits(x_ptr + j.to(tl.int64) * BLOCK + offs, None, IS_BF16, False))
            j += programs
        if (numel % BLOCK != 0) & (pid == n_full % programs):
            o = n_full.to(tl.int64) * BLOCK + offs
            best = tl.maximum(best, _abs_bits(x_ptr + o, o < numel, IS_BF16, True))
        tl.atomic_max(acc_ptr, tl.max(best, axis=0))


def _validate(t, name, backend="torch"):
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}.")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: t must be a tensor, got {type(t).__name__}.")
    if t.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: t has dtype {t.dtype}; it must be torch.float32, torch.bfloat16 or torch.float16.")
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (its stride is {t.stride()}); pass t.contiguous().")


def amax_reference(t: torch.Tensor) -> torch.Tensor:
    """``max|t|`` as a 0-d float32 tensor by the rule in the module docstring.

    Example::

        >>> amax_reference(torch.tensor([1.0, -3.0, 2.0], dtype=torch.bfloat16))
        tensor(3.)
    """
    _validate(t, "amax_reference")
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def amax_into_(t: torch.Tensor, acc: torch.Tensor, *, backend: str = "auto", num_programs=None, block=None) -> None:
    """``acc = max(acc, bits(max|t|))`` for an int32 ``acc`` (one element) holding float32
    bits, from one read of ``t``; never synchronizes.

    Example::

        >>> acc = torch.zeros(1, dtype=torch.int32)
        >>> amax_into_(torch.tensor([0.5, -2.0]), acc); acc.view(torch.float32).item()
        2.0
    """
    _validate(t, "amax_into_", backend)
    if not (isinstance(acc, torch.Tensor) and acc.dtype == torch.int32 and acc.numel() == 1):
        raise TypeError("amax_into_: acc must be a one-element int32 tensor (float32 bits, starting at 0).")
    if use_triton(backend, t.device, "amax_into_"):
        numel = t.numel()
        if numel:
            block = block or _BLOCK
            tiles = -(-numel // block)
            programs = max(1, min(num_programs or persistent_programs(tiles, t.device, _PROGRAMS_PER_SM), tiles))
            with torch.no_grad():
                launch(_amax_kernel, (programs,), t.view(torch.int16) if t.dtype == torch.bfloat16 else t, acc,
                       numel, BLOCK=block, IS_BF16=t.dtype == torch.bfloat16, num_warps=_NUM_WARPS)
        return
    bits = amax_reference(t).view(torch.int32).reshape(1)
    acc.copy_(torch.maximum(acc, bits))


def amax(t: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``max|t|`` as a 0-d float32 tensor, from one read of ``t`` where the kernel runs.

    Example::

        >>> amax(torch.tensor([[1.0, -4.0], [float("inf"), 0.0]]))
        tensor(inf)
    """
    acc = torch.zeros(1, dtype=torch.int32, device=t.device)
    amax_into_(t, acc, backend=backend)
    return acc.view(torch.float32).reshape(())
