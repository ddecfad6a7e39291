"""What one training step costs the host and the device, from ``torch.profiler``.

``profile_step`` runs a step a few times under the profiler twice: once plain (host self
time per aten op, device kernels, device busy time against the step's wall time) and once
with Python stacks (host self time per Python function: the Python tracer slows the
step, so its times are only compared with another traced run). ``host_diff`` lines two
summaries up, ours against native, the names where ours spends the most extra host time
first: where a gap between the two goes.

Example::

    native = profile_step(native_step, device, steps=3)
    ours = profile_step(ours_step, device, steps=3)
    for row in host_diff(ours, native, "python")[:10]:
        print(row["name"], row["extra_us"])

Device busy time is the union of the device's activity intervals (kernels, copies, sets)
inside the steps' windows; each window is one step between two synchronizations, so
wall time - busy time is time the device waited for the host. On CPU there is no device
activity: busy time is None, and the "kernels" are the leaf aten ops (those that call no
other aten op), by self time.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "benchmarks.profiled_step"
_DEVICE_TYPES = {DeviceType.CUDA}


@dataclass
class StepProfile:
    """Per-step summary of ``steps`` profiled steps. Tallies map a name to
    ``[calls, microseconds]`` summed over all steps (the ``per_step`` helpers divide)."""

    device: str
    steps: int
    wall_us: float = 0.0
    busy_us: float | None = None
    aten: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    python: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    kernels: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    copies: int = 0  # device memcpy / memset activities

    def per_step(self, tally: dict) -> dict:
        """``tally`` (one of ``aten``, ``python``, ``kernels``) as name -> (calls, us) per step."""
        return {name: (calls / self.steps, us / self.steps) for name, (calls, us) in tally.items()}

    def total(self, tally: dict) -> tuple[float, float]:
        """(calls, us) per step over every name of ``tally``."""
        calls = sum(c for c, _ in tally.values())
        us = sum(u for _, u in tally.values())
        return calls / self.steps, us / self.steps

    def summary_row(self) -> dict:
        """One table row: wall and device busy time per step, calls and host self time."""
        aten_calls, aten_us = self.total(self.aten)
        py_calls, py_us = self.total(self.python)
        kernel_calls, kernel_us = self.total(self.kernels)
        row = {
            "wall_ms": self.wall_us / self.steps / 1e3,
            "aten_calls": aten_calls, "aten_self_ms": aten_us / 1e3,
            "python_calls": py_calls, "python_self_ms": py_us / 1e3,
            "kernels": kernel_calls,
        }
        if self.busy_us is None:
            row.update(busy_ms="n/a on CPU", busy_pct="n/a on CPU", copies="n/a on CPU")
        else:
            busy = self.busy_us / self.steps
            row.update(busy_ms=busy / 1e3, busy_pct=100 * self.busy_us / self.wall_us if self.wall_us else None,
                       copies=self.copies / self.steps, kernel_ms=kernel_us / 1e3)
        return row


def _activities(device: torch.device) -> list:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _profiled(step, device: torch.device, steps: int, with_stack: bool) -> profile:
    """The profiler after ``steps`` calls of ``step``, each in a ``STEP_RANGE`` window."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=_activities(device), with_stack=with_stack) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                sync()  # nothing pending: the window starts with an idle device
                step()
                sync()
    return prof


def _run(step, device: torch.device, steps: int) -> tuple[list, list]:
    """(events inside the steps' windows, the windows as (start, end) us)."""
    events = _profiled(step, device, steps, with_stack=False).events()
    windows = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_RANGE)
    inside = [e for e in events if e.name != STEP_RANGE
              and any(a <= e.time_range.start < b for a, b in windows)]
    return inside, windows


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_FX_MODULE = re.compile(r"<eval_with_key>\.\d+")
_PYBIND = re.compile(r"pybind11_builtins\.pybind11_detail_function_record\w*")


def python_name(name: str) -> str:
    """A Python function event's name without what differs between two runs of the same code:
    object addresses, the numbers of FX-generated modules, pybind11's record type.

    Example::

        python_name("<built-in method view of Tensor object at 0x7f61>")  # '<built-in method view of Tensor object>'
    """
    return _PYBIND.sub("pybind11 function", _FX_MODULE.sub("<eval_with_key>", _ADDRESS.sub("", name)))


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def profile_step(step, device: torch.device, steps: int = 3, python: bool = True) -> StepProfile:
    """Profiles ``steps`` calls of ``step`` (warmed up by the caller: compiled, allocator and
    caches ready), plain and then (``python``) with Python stacks. See the module's docstring.

    Example::

        prof = profile_step(step, torch.device("cuda"), steps=3)
        prof.summary_row()["busy_pct"]
    """
    out = StepProfile(device=device.type, steps=steps)
    events, windows = _run(step, device, steps)
    out.wall_us = sum(b - a for a, b in windows)
    busy = []
    for e in events:
        if e.device_type in _DEVICE_TYPES:
            a, b = e.time_range.start, e.time_range.end
            busy.append((a, b))
            if _is_copy(e.name):
                out.copies += 1
            else:
                tally = out.kernels[e.name]
                tally[0] += 1
                tally[1] += b - a
        elif e.name.startswith("aten::"):
            tally = out.aten[e.name]
            tally[0] += 1
            tally[1] += e.self_cpu_time_total
            if device.type != "cuda" and not any(c.name.startswith("aten::") for c in e.cpu_children):
                leaf = out.kernels[e.name]  # CPU: the leaf aten ops stand in for kernels
                leaf[0] += 1
                leaf[1] += e.self_cpu_time_total
    if device.type == "cuda":
        out.busy_us = _union_us(busy)
    if not python:
        return out
    for name, self_us in _python_calls(step, device, steps):
        tally = out.python[python_name(name)]
        tally[0] += 1
        tally[1] += self_us
    return out


def _python_calls(step, device: torch.device, steps: int) -> list[tuple[str, float]]:
    """(name, self us) of each Python function call inside the steps' windows, from a run
    with Python stacks.

    Read from the trace the profiler exports: torch 2.13 and later also list Python calls
    among ``prof.events()``, torch 2.11 and 2.12 only in the trace. Self time is the
    call's duration less that of the events directly inside it on its thread (aten ops
    and Python calls alike), as torch computes an event's self time.
    """
    prof = _profiled(step, device, steps, with_stack=True)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    host = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
            and e.get("cat") in _HOST_CATEGORIES]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in host if e["name"] == STEP_RANGE)
    by_thread = defaultdict(list)
    for e in host:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    calls = []
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, duration of its direct children]
        done = []
        for e in events:
            while stack and stack[-1][1] <= e["ts"]:
                done.append(stack.pop())
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        done.extend(stack)
        for e, _, children in done:
            if e.get("cat") == "python_function" and any(a <= e["ts"] < b for a, b in windows):
                calls.append((e["name"], max(e["dur"] - children, 0.0)))
    return calls


# The trace's host-side categories: aten ops, Python calls, record_function ranges.
_HOST_CATEGORIES = {"cpu_op", "python_function", "user_annotation"}


def host_diff(ours: StepProfile, native: StepProfile, kind: str) -> list[dict]:
    """Rows name, native/ours calls and self us per step, extra us (ours - native), for
    ``kind`` "aten" or "python"; the largest extra first.

    Example::

        top = host_diff(ours, native, "aten")[:12]
    """
    a = ours.per_step(getattr(ours, kind))
    b = native.per_step(getattr(native, kind))
    rows = []
    for name in set(a) | set(b):
        oc, ou = a.get(name, (0, 0.0))
        nc, nu = b.get(name, (0, 0.0))
        rows.append({"name": name, "native_calls": nc, "ours_calls": oc, "native_us": nu, "ours_us": ou,
                     "extra_us": ou - nu, "extra_calls": oc - nc})
    rows.sort(key=lambda r: (-r["extra_us"], r["name"]))
    return rows


def kernel_rows(prof: StepProfile) -> list[dict]:
    """The step's kernels (device kernels on CUDA, leaf aten ops on CPU): name, launches and
    microseconds per step, the longest first.

    Example::

        for row in kernel_rows(prof)[:5]:
            print(row["kernel"], row["launches"], row["us"])
    """
    rows = [{"kernel": name, "launches": calls, "us": us} for name, (calls, us) in prof.per_step(prof.kernels).items()]
    rows.sort(key=lambda r: (-r["us"], r["kernel"]))
    return rows
