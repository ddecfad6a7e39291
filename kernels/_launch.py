"""What the kernel families share: which backend runs, and how many programs a
persistent grid launches."""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # the torch paths still work
    triton = None

# The interpreter runs programs one after another, so more programs only cost time.
INTERPRETED_PROGRAMS = 4


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET``, read at import by triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: str, device: torch.device, name: str) -> bool:
    """Whether ``backend`` ("auto", "triton", "torch") launches the Triton kernel for
    tensors on ``device``; an impossible "triton" raises, naming ``name`` and the fix."""
    if backend == "torch":
        return False
    if backend == "auto":
        return triton is not None and device.type == "cuda"
    if triton is None:
        raise RuntimeError(f"{name}: backend='triton' needs the triton package; install it or use backend='torch'.")
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            f"{name}: backend='triton' on CPU tensors runs only under Triton's interpreter; set "
            "TRITON_INTERPRET=1 before dispatch_amp.kernels is imported, or use backend='torch'."
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{name}: backend='triton' does not support {device.type} tensors; use backend='torch'.")
    return True


def persistent_programs(tiles: int, device: torch.device, per_sm: int) -> int:
    """Programs of a persistent grid: ``per_sm`` per SM (as many as fit at once: more
    would queue as a second, partial wave), never more than there are tiles."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles, sms * per_sm))
    return max(1, min(tiles, INTERPRETED_PROGRAMS))
