"""Shared pieces of the suites: tables, targets, interleaved timing, quantiles, devices."""

from __future__ import annotations

import gc
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]  # children run `python -m benchmarks.run` from here


@dataclass
class Table:
    """One printed Markdown table; every row also becomes a CSV row.

    ``columns`` is a list of (row key, header, format); rows are dicts that may hold more
    keys than are printed (all of them go to the CSV).
    """

    title: str
    columns: list
    rows: list = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        heads = [h for _, h, _ in self.columns]
        out = [f"### {self.title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for r in self.rows:
            cells = []
            for key, _, fmt in self.columns:
                v = r.get(key)
                if v is None or v == "":
                    cells.append("-")
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    cells.append(fmt.format(v))
                else:
                    cells.append(str(v))
            out.append("| " + " | ".join(cells) + " |")
        if self.note:
            out += ["", self.note]
        return "\n".join(out)


# Set by the runner for --quick: tiny sizes measure nothing worth a verdict.
SMOKE_TEST = False


def verdict(value, limit, *, at_most: bool = True) -> str:
    """'met' / 'missed' against a target (information only: never asserted); with
    ``--quick``, "smoke test"."""
    if value is None:
        return "-"
    if SMOKE_TEST:
        return "smoke test"
    ok = value <= limit if at_most else value >= limit
    return "met" if ok else "missed"


def quantile(values, q: float) -> float:
    """Linear-interpolated quantile, q in [0, 1]."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def rotations(items, rounds):
    """Per round, the items in rotated order (A B C, B C A, ...): interleaved, and none is
    always first or always after the same other one (docs/design.md, "Performance method")."""
    items = list(items)
    for r in range(rounds):
        k = r % len(items)
        yield items[k:] + items[:k]


def interleaved(fns: dict, rounds: int, warmup: int = 1, setup=None, sync=None) -> dict:
    """Seconds per call of each fn, interleaved over ``rounds``; ``setup(name)`` runs
    untimed before each call. Returns name -> list of samples (one per round).

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs untimed before each call's clock
    starts and, timed, after the call: asynchronous device work is then inside the sample."""
    for name, fn in fns.items():
        for _ in range(warmup):
            if setup:
                setup(name)
            fn()
            if sync:
                sync()
    samples = {name: [] for name in fns}
    for order in rotations(fns, rounds):
        for name in order:
            if setup:
                setup(name)
            if sync:
                sync()
            t0 = time.perf_counter()
            fns[name]()
            if sync:
                sync()
            samples[name].append(time.perf_counter() - t0)
    return samples


def interleaved_events(fns: dict, rounds: int, warmup: int = 1, calls: int = 1) -> dict:
    """CUDA only: device seconds per call of each fn (CUDA events around ``calls`` calls per
    sample), interleaved over ``rounds`` in rotating order after ``warmup`` samples each.
    Returns name -> list of per-call seconds (one per round)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(fn) -> float:
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    for fn in fns.values():
        for _ in range(warmup):
            sample(fn)
    samples = {name: [] for name in fns}
    for order in rotations(fns, rounds):
        for name in order:
            samples[name].append(sample(fns[name]))
    return samples


def ratio_stats(num: list, den: list) -> dict:
    """Median, min and max of the per-round ratios num/den."""
    r = [a / b for a, b in zip(num, den)]
    return {"ratio": statistics.median(r), "ratio_min": min(r), "ratio_max": max(r)}


def status_kb(field: str) -> int | None:
    """A ``/proc/self/status`` field in kB (e.g. ``"VmHWM"``: peak RSS), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# -- devices --------------------------------------------------------------------------------
def device_of(opts) -> torch.device:
    """The device the suites measure on: ``--device`` (cpu unless asked)."""
    return torch.device(getattr(opts, "device", None) or "cpu")


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype the suites use: bfloat16 on CPU, float16 (the GPU default) on CUDA."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def synchronizer(device: torch.device):
    """``torch.cuda.synchronize`` on CUDA, None (nothing to wait for) on CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    """After a model's tensors are dropped (``del``): collect cycles and, on CUDA, hand the
    caching allocator's free blocks back, so the next model starts from an empty cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def training_step(opt, loss_fn, region, batch):
    """One timed step as a closure: zero_grad, forward + loss inside ``region()``, backward
    and the optimizer step outside it."""

    def step():
        opt.zero_grad(set_to_none=True)
        with region():
            loss = loss_fn(*batch)
        loss.backward()
        opt.step()

    return step


def failure(e: BaseException) -> str:
    """A one-line ``failed: Type: first line`` for a table cell."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"failed: {type(e).__name__}: {first[:160]}"


class Tf32Off:
    """``with Tf32Off():`` float32 matmuls and convolutions in true fp32 (no TF32 on the
    matrix units): ``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32`` off,
    restored on exit."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
        return False


def run_children(cmds: dict, concurrent: bool = False, timeout: float = 600) -> dict:
    """Runs each command (``name -> argv``) from the repository root; returns ``name ->
    (returncode, stdout, stderr)``. ``concurrent``: all at once (for CUDA peak-memory
    children: each reads its own ``max_memory_allocated``, which the others cannot change)."""
    if not concurrent:
        out = {}
        for name, cmd in cmds.items():
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
            out[name] = (res.returncode, res.stdout, res.stderr)
        return out
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for name, cmd in cmds.items()}
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += f"\ntimed out after {timeout:.0f} s"
        out[name] = (p.returncode, stdout, stderr)
    return out


def gpu_memory_gib() -> float:
    """The current CUDA device's memory in GiB (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
