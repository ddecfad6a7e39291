"""The report's first lines: date, commit, GPU, driver, torch, CUDA, Triton, torchao, Python."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import platform
import subprocess

import torch

from benchmarks.suites.common import REPO
from dispatch_amp._devices import device_available


def _run(cmd: list[str]) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - information only: say why it does not import
        return f"does not import ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def lines() -> list[str]:
    """Markdown list lines describing this machine and checkout.

    Example::

        print("\\n".join(lines()))   # - date: 2026-11-26T14:00Z ...
    """
    out = [f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%MZ')}"]
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    if _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with local changes)"
    out.append(f"- commit: {commit}")
    if device_available("cuda"):
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        out.append(f"- GPU: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
                   f"compute capability {p.major}.{p.minor}")
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        out.append(f"- driver: {smi.splitlines()[0] if smi else 'unknown (no nvidia-smi)'}")
    else:
        out.append("- GPU: none visible to torch (a dry run on CPU)")
    cuda = torch.version.cuda or "none (a CPU build)"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out.append(f"- torch {torch.__version__}, CUDA {cuda}" + (f", cuDNN {cudnn}" if cudnn else ""))
    out.append(f"- Triton: {_version('triton')}")
    out.append(f"- torchao: {_version('torchao')}")
    out.append(f"- Python {platform.python_version()} ({platform.machine()}), {os.cpu_count()} CPUs, "
               f"torch threads {torch.get_num_threads()}")
    return out
