"""dispatch-overhead: extra time per tiny op of dispatch_amp.autocast over native autocast.

A loop of one tiny op (``x.add(y)``, ``torch.mm`` on 8x8, ``x.view(64)``) is timed with
no autocast, with native ``torch.autocast`` and with ours, interleaved; the extra cost per
op is the distribution over repeats of (ours - native) per round, in microseconds.
Target: median extra <= 5 us per op.

With ``--device cuda`` the tensors are on the GPU and the regions float16 on "cuda"; each
repeat ends with ``torch.cuda.synchronize()`` inside its clock, so the time per op is the
rate at which the host issues and the GPU completes them (host-bound for these sizes).
"""

from __future__ import annotations

import contextlib
import statistics

import torch

import dispatch_amp
from benchmarks.timing import interleaved

from .common import Table, amp_dtype, device_of, dtype_name, verdict

NAME = "dispatch-overhead"
TARGET_US = 5.0
MODES = ("fp32", "native", "ours")


def _context(mode: str, device: torch.device = torch.device("cpu")):
    if mode == "native":
        return torch.autocast(device.type, dtype=amp_dtype(device))
    if mode == "ours":
        return dispatch_amp.autocast(device.type, dtype=amp_dtype(device))
    return contextlib.nullcontext()


def _ops(device: torch.device = torch.device("cpu")):
    x, y = torch.randn(8, 8).to(device), torch.randn(8, 8).to(device)
    return {"x.add(y)": lambda: x.add(y), "torch.mm 8x8": lambda: torch.mm(x, y), "x.view(64)": lambda: x.view(64)}


def run(opts) -> list[Table]:
    device = device_of(opts)
    iters, repeats = (1000, 5) if opts.quick else ((2000, 21) if device.type == "cuda" else (5000, 21))
    where = f"{'CUDA' if device.type == 'cuda' else 'CPU'} {dtype_name(amp_dtype(device))}"
    table = Table(
        f"dispatch-overhead: us per tiny op ({where}); ours - native over {repeats} interleaved repeats of {iters} ops",
        [("op", "op", "{}"), ("fp32_us", "no autocast", "{:.2f}"), ("native_us", "native", "{:.2f}"),
         ("ours_us", "ours", "{:.2f}"), ("extra_median_us", "ours-native median", "{:+.2f}"),
         ("extra_p10_us", "p10", "{:+.2f}"), ("extra_p90_us", "p90", "{:+.2f}"),
         ("target", "target", "{}"), ("met", "met?", "{}")],
    )
    for name, fn in _ops(device).items():
        # Each sample: `iters` calls of the op inside one region, entered off the clock.
        seconds = interleaved({m: fn for m in MODES}, repeats, calls=iters,
                              inside=lambda mode: _context(mode, device))
        samples = {m: [t * 1e6 for t in v] for m, v in seconds.items()}
        extra = [o - n for o, n in zip(samples["ours"], samples["native"])]
        med = statistics.median(extra)
        deciles = statistics.quantiles(extra, n=10, method="inclusive")  # linear between order statistics
        table.rows.append({
            "op": name, "iters": iters, "repeats": repeats,
            **{f"{m}_us": statistics.median(samples[m]) for m in MODES},
            "extra_median_us": med, "extra_p10_us": deciles[0], "extra_p90_us": deciles[-1],
            "extra_min_us": min(extra), "extra_max_us": max(extra),
            "target": f"<= {TARGET_US:g} us", "met": verdict(med, TARGET_US),
        })
    return [table]
