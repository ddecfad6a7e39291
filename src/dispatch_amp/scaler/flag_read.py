"""Reading optimizers' inf/nan flags on the host: one sync for all of them.

``GradScaler.step()`` must know on the host whether an ordinary optimizer's gradients
overflowed (see "Note: host syncs" in ``grad_scaler.py``). :func:`read_flags` reads, in
one transfer, the flags of every optimizer unscaled and not yet read: packed as the bits
of one int64 on the device, with the scale-floor flag in the top bit and the Triton
kernel's per-gradient flags appended, so a skipped step knows which gradients to report
without another sync.
"""

from __future__ import annotations

import torch

__all__ = ["read_flags"]

# How many flags one packed read carries: bits of an int64, less one for the floor flag.
FLAGS_PER_READ = 62


def read_flags(pending, state, floor_hits_seen: int | None) -> bool:
    """Set ``found_inf_host`` (and ``nonfinite_host``) of each record in ``pending``.

    ``pending``: GradScaler's per-optimizer records (``found_inf_per_device``,
    ``checked_per_device``), already reduced across ranks. ``state``: the scale's
    ``ScaleState``. ``floor_hits_seen``: the floor hits already warned about, or None
    when there is no ``min_scale``. Returns whether the scale hit ``min_scale`` since.

    Example::

        read_flags([rec], scaler_state, None)   # rec.found_inf_host is now True/False
    """
    device = state.scale.device
    if len(pending) == 1 and floor_hits_seen is None and _read_one(pending[0], device):
        return False
    floor_hit = False
    for start in range(0, len(pending), FLAGS_PER_READ):
        chunk = pending[start : start + FLAGS_PER_READ]
        flags = []
        for rec in chunk:
            per_dev = [f.to(device, non_blocking=True) for f in rec.found_inf_per_device.values()]
            flags.append(torch.stack(per_dev).sum() if per_dev else torch.zeros((), device=device))
        # Bit k of the packed word is optimizer k's flag; the top bit says the scale hit
        # min_scale since we last looked, so that warning rides on the same sync.
        bits = (torch.stack(flags) != 0).to(torch.int64)
        weights = torch.pow(2, torch.arange(len(chunk), dtype=torch.int64, device=bits.device))
        word = (bits * weights).sum()
        if floor_hits_seen is not None:
            word = word + (state.floor_hits > floor_hits_seen).to(torch.int64) * (1 << FLAGS_PER_READ)
        extra = [
            (rec, dev, nonfinite)
            for rec in chunk
            for dev, (_, _, nonfinite) in rec.checked_per_device.items()
            if nonfinite is not None
        ]
        if extra:
            read = torch.cat([word.reshape(1)] + [nf.to(word.device, torch.int64, non_blocking=True) for _, _, nf in extra]).tolist()
            value, offset = read[0], 1
            for rec, dev, nonfinite in extra:
                rec.nonfinite_host[dev] = read[offset : offset + len(nonfinite)]
                offset += len(nonfinite)
        else:
            value = int(word.item())
        for k, rec in enumerate(chunk):
            rec.found_inf_host = bool((value >> k) & 1)
        floor_hit |= bool(value >> FLAGS_PER_READ)
    return floor_hit


def _read_one(rec, device: torch.device) -> bool:
    """The common case, one optimizer on one device: its flag read as it is, without
    packing (nan reads as True, like a nonzero flag), with the kernel's per-gradient flags
    in the same read when there are any. False when the record does not fit this case."""
    flags = list(rec.found_inf_per_device.values())
    if len(flags) != 1 or flags[0].device != device:
        return False
    kernel_flags = [(d, nf) for d, (_, _, nf) in rec.checked_per_device.items() if nf is not None]
    if not kernel_flags:
        rec.found_inf_host = bool(flags[0].item())
        return True
    if len(kernel_flags) == 1 and kernel_flags[0][1].device == flags[0].device:
        dev, nonfinite = kernel_flags[0]
        values = torch.cat([(flags[0] != 0).to(torch.int32).reshape(1), nonfinite]).tolist()
        rec.found_inf_host = bool(values[0])
        rec.nonfinite_host[dev] = values[1:]
        return True
    return False
