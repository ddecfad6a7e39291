"""What the kernel families share: which backend runs, how many programs a persistent
grid launches, and the launch itself (which a counter can watch: ``counting_launches``)."""

from __future__ import annotations

import contextlib
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
    if device.type == "meta" and _COUNTERS and _COUNTERS[-1].dry:
        return True  # counted, not run: see counting_launches
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


class _Counter:
    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.launches: list[str] = []


_COUNTERS: list[_Counter] = []


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted by every active ``counting_launches``;
    not run inside a dry one."""
    if not _COUNTERS:
        kernel[grid](*args, **kwargs)
        return
    for counter in _COUNTERS:
        counter.launches.append(getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel)))
    if _COUNTERS[-1].dry:
        return
    # The interpreter runs torch operators of its own: none of them is the caller's.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def counting_launches(dry: bool = False):
    """Lists the kernels launched inside (their names, in order). ``dry``: count without
    running them, and let ``backend="triton"`` take meta tensors (so that a launch
    sequence can be recorded at any size; the outputs stay unwritten).

    Example::

        >>> with counting_launches(dry=True) as names:
        ...     pass
        >>> names
        []
    """
    counter = _Counter(dry)
    _COUNTERS.append(counter)
    try:
        yield counter.launches
    finally:
        _COUNTERS.remove(counter)
