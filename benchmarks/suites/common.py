"""Shared pieces of the suites: tables, targets, devices, child processes (timing: benchmarks/timing.py)."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dispatch_amp import _markdown
from dispatch_amp._devices import device_available

REPO = Path(__file__).resolve().parents[2]  # children run `python -m benchmarks.run` from here


@dataclass
class Table:
    """One printed Markdown table; every row also becomes a CSV row.

    ``columns`` is a list of (row key, header, format); rows are dicts that may hold more
    keys than are printed (all of them go to the CSV). A key may be a tuple of keys, whose
    values fill one format (an estimate and its interval in one cell: ``ratio_columns``).
    """

    title: str
    columns: list
    rows: list = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        """``### title``, the table (``dispatch_amp._markdown``) and the note.

        Example::

            Table("t: x", [("k", "key", "{:.1f}")], [{"k": 1.5}]).markdown()   # '### t: x\n\n| key |\n|---|\n| 1.5 |'
        """
        cells = [[_cell(r, key, fmt) for key, _, fmt in self.columns] for r in self.rows]
        out = [f"### {self.title}", "", _markdown.table([h for _, h, _ in self.columns], cells)]
        if self.note:
            out += ["", self.note]
        return "\n".join(out)


def _cell(row: dict, key, fmt: str) -> str:
    if isinstance(key, tuple):  # one format, several values: all numbers, else the first's text or "-"
        values = [row.get(k) for k in key]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return fmt.format(*values)
        return values[0] if isinstance(values[0], str) and values[0] else "-"
    value = row.get(key)
    if value is None or value == "":
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def batched_casts_unavailable() -> str | None:
    """Why the compiled engine batches no weight casts on the running torch, or None where
    it batches them: a benchmark prints this instead of a "batched" row, which would
    otherwise measure the per-use casts under the wrong name.

    Example::

        reason = batched_casts_unavailable()   # None on torch 2.13 and later
    """
    from dispatch_amp._torch_compat import BATCHED_WEIGHT_CASTS

    if BATCHED_WEIGHT_CASTS:
        return None
    return (f"torch {torch.__version__} batches no weight casts (the compiled engine batches them from "
            f"torch 2.13 on: docs/design.md, \"Torch before 2.13\")")


def ratio_columns(prefix: str = "", label: str = "ours/native") -> list:
    """The two columns of a ratio from ``timing.ratio_stats`` (keys prefixed as by
    ``timing.prefixed``): the median of per-round ratios and the ratio of medians, each
    with its bootstrap 95% interval in brackets.

    Example::

        Table("t", [("model", "model", "{}"), *ratio_columns()], [{"model": "m", **ratio_stats(ours, native)}])
    """
    p = prefix
    return [((f"{p}ratio", f"{p}ratio_lo", f"{p}ratio_hi"), f"{label}, median of per-round ratios [95%]",
             "{:.3f} [{:.3f}, {:.3f}]"),
            ((f"{p}ratio_of_medians", f"{p}ratio_of_medians_lo", f"{p}ratio_of_medians_hi"),
             f"{label}, ratio of medians [95%]", "{:.3f} [{:.3f}, {:.3f}]")]


ESTIMATORS_NOTE = ("Ratios: the median of per-round ratios and the ratio of medians, each with a percentile-bootstrap "
                   "95% interval over the rounds (2000 resamples, fixed seed).")


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


# -- devices --------------------------------------------------------------------------------
def device_of(opts) -> torch.device:
    """The device the suites measure on: ``--device`` (cpu unless asked)."""
    return torch.device(getattr(opts, "device", None) or "cpu")


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype the suites use: bfloat16 on CPU, float16 (the GPU default) on CUDA."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


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


@contextlib.contextmanager
def no_tf32():
    """``with no_tf32():`` float32 matmuls and convolutions in true fp32, no TF32 on the
    matrix units (the fp32 baseline of the headline tables), the settings before restored
    on exit. Through torch's switches: ``torch.set_float32_matmul_precision("highest")``
    (cuBLAS) and ``torch.backends.cudnn.allow_tf32`` (cuDNN, on by default).

    Example::

        with no_tf32():
            fp32_ms = time_step(model)
    """
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = conv


def run_children(cmds: dict, concurrent: bool = False, timeout: float = 600, env: dict | None = None) -> dict:
    """Runs each command (``name -> argv``) from the repository root; returns ``name ->
    (returncode, stdout, stderr)``. ``concurrent``: all at once (for CUDA peak-memory
    children: each reads its own ``max_memory_allocated``, which the others cannot change).
    ``env``: variables set for the children, over this process's environment."""
    environ = {**os.environ, **env} if env else None
    if not concurrent:
        out = {}
        for name, cmd in cmds.items():
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environ)
            out[name] = (res.returncode, res.stdout, res.stderr)
        return out
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                    env=environ)
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
    if not device_available("cuda"):
        return 0.0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
