"""benchmarks/profiling.py: the step summaries count what the step ran, and the diff puts what
only ours runs first. Counts only: no time is asserted."""

from __future__ import annotations

import torch

from benchmarks import profiling


def test_union_of_device_intervals_counts_overlaps_once():
    assert profiling._union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert profiling._union_us([]) == 0


def test_python_names_lose_what_differs_between_two_runs():
    assert profiling.python_name("<built-in method view of Tensor object at 0x7f611a749130>") == \
        "<built-in method view of Tensor object>"
    assert profiling.python_name("<eval_with_key>.11(4): forward") == "<eval_with_key>(4): forward"
    assert profiling.python_name("src/x.py(3): f") == "src/x.py(3): f"


def _steps():
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def native():
        torch.mm(a, b)

    def extra_cast():
        return a.to(torch.bfloat16)

    def ours():
        extra_cast()
        torch.mm(a, b)

    return native, ours


def test_profile_step_counts_aten_calls_per_step_and_python_functions():
    native, ours = _steps()
    prof = profiling.profile_step(ours, torch.device("cpu"), steps=3)
    per_step = prof.per_step(prof.aten)
    assert per_step["aten::mm"][0] == 1
    assert per_step["aten::to"][0] == 1
    assert any(name.endswith("extra_cast") for name in prof.python)
    row = prof.summary_row()
    assert row["busy_ms"] == "n/a on CPU"  # no device activity on CPU
    assert row["kernels"] >= 2  # leaf aten ops stand in for kernels on CPU


def test_host_diff_puts_what_only_ours_calls_first():
    native, ours = _steps()
    n = profiling.profile_step(native, torch.device("cpu"), steps=2)
    o = profiling.profile_step(ours, torch.device("cpu"), steps=2)
    rows = profiling.host_diff(o, n, "python")
    extra = next(r for r in rows if r["name"].endswith("extra_cast"))
    assert extra["native_calls"] == 0 and extra["ours_calls"] == 1
    aten = {r["name"]: r for r in profiling.host_diff(o, n, "aten")}
    assert aten["aten::to"]["extra_calls"] == 1 and aten["aten::mm"]["extra_calls"] == 0
    assert [r["extra_us"] for r in rows] == sorted((r["extra_us"] for r in rows), reverse=True)
