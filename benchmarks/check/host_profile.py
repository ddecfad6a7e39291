"""Part profile: where ours spends time that native does not, from ``torch.profiler``.

Two runs, each with native and with ours: an eager GPT-2 small step and a compiled
ResNet-50 step (the train part's models; one SGD step without a scaler, the loss function
compiled as in the compile suite). Each configuration is warmed up (compiled) and then
profiled over a few steps by ``benchmarks.profiling.profile_step``: wall and device-busy
time per step, kernels launched, host self time per aten op and, from a second run with
Python stacks, per Python function. The compiled runs capture Dynamo's recompile, guard
and graph-break logs while they compile and run (``DynamoLog``); the whole logs go to the
part's log folder.

Printed per run: a summary (one row each), then the ours-versus-native differences, the
names where ours spends the most extra first: aten ops (host self time), Python functions
(host self time under the Python tracer, which slows both alike) and kernels (launches,
device time). For the compiled run, a table of frames, graphs, recompiles, graph breaks,
guards and guard evaluation time. On CPU (the dry run) the profiler records CPU
activities only: no device busy time, and leaf aten ops stand in for kernels.
"""

from __future__ import annotations

import copy
import csv

import torch

from benchmarks.profiling import StepProfile, host_diff, profile_step
from benchmarks.suites import compile as compile_suite
from benchmarks.suites import train_step
from benchmarks.suites.common import Table, free_device_memory

from .dynamo_log import DynamoLog
from .settings import Settings

NAME = "profile"
RUNS = (("gpt", "eager"), ("cnn", "compiled"))
SHORT = {"gpt": "GPT-2 small", "cnn": "ResNet-50"}
TOP = 12  # rows of each difference table (the CSV logs hold them all)
WARMUP_STEPS = 3


def _step(model, batch, mode: str, amp: str, s: Settings):
    if mode == "eager":
        return train_step.make_step(model, batch, amp, s.device)
    return compile_suite.make_step(model, batch, f"{amp} compiled", s.backend, s.device)


def _warm_and_profile(step, s: Settings) -> StepProfile:
    for _ in range(WARMUP_STEPS):  # compiles (compiled runs), then allocator and caches settle
        step()
    s.sync()
    return profile_step(step, s.device, s.profile_steps)


def _summary_table(title: str, profiles: dict, logs: dict) -> Table:
    table = Table(title, [
        ("amp", "run", "{}"), ("wall_ms", "wall ms/step", "{:.2f}"), ("busy_ms", "device busy ms", "{:.2f}"),
        ("busy_pct", "busy % of wall", "{:.0f}"), ("kernels", "kernels/step", "{:.0f}"),
        ("copies", "copies/step", "{:.0f}"), ("aten_calls", "aten calls", "{:.0f}"),
        ("aten_self_ms", "aten self ms", "{:.2f}"), ("python_calls", "Python calls (traced)", "{:.0f}"),
        ("python_self_ms", "Python self ms (traced)", "{:.2f}")])
    for amp, prof in profiles.items():
        table.rows.append({"amp": amp, **prof.summary_row()})
    a, b = table.rows[1], table.rows[0]  # ours, native

    def delta(key):
        x, y = a.get(key), b.get(key)
        return x - y if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None

    parts = [f"wall {delta('wall_ms'):+.2f} ms/step"]
    if delta("busy_ms") is not None:
        parts.append(f"device busy {delta('busy_ms'):+.2f} ms (so {delta('wall_ms') - delta('busy_ms'):+.2f} ms "
                     "more device idle time, waiting for the host)")
    parts += [f"kernels {delta('kernels'):+.0f}/step", f"aten host self time {delta('aten_self_ms'):+.2f} ms",
              f"Python self time {delta('python_self_ms'):+.2f} ms (traced)",
              f"Python calls {delta('python_calls'):+.0f}"]
    if logs:
        o, n = logs["ours"].row(), logs["native"].row()
        parts.append(f"guards {o['guards']} vs {n['guards']}, recompiles {o['recompiles']} vs {n['recompiles']}, "
                     f"graph breaks {o['graph_breaks']} vs {n['graph_breaks']}")
    table.note = "ours - native: " + "; ".join(parts) + "."
    return table


def _diff_table(title: str, rows: list[dict], what: str) -> Table:
    unit = "us" if what != "kernels" else "device us"
    return Table(title, [
        ("name", what, "{}"), ("native_calls", "native calls", "{:.1f}"), ("ours_calls", "ours calls", "{:.1f}"),
        ("native_us", f"native {unit}", "{:.1f}"), ("ours_us", f"ours {unit}", "{:.1f}"),
        ("extra_us", f"extra {unit}", "{:+.1f}"), ("extra_calls", "extra calls", "{:+.1f}")],
        rows=rows[:TOP],
        note=f"Per step; the {TOP} largest extras of {len(rows)} names (all of them in the part's CSV logs); "
             f"total extra {sum(r['extra_us'] for r in rows):+.1f} {unit}.")


def _dynamo_table(title: str, logs: dict) -> Table:
    table = Table(title, [
        ("amp", "run", "{}"), ("frames", "frames compiled", "{}"), ("graphs", "graphs", "{}"),
        ("recompiles", "recompiles", "{}"), ("graph_breaks", "graph breaks", "{}"), ("guards", "guards", "{}"),
        ("guard_eval_us", "guard eval us", "{:.1f}"), ("top_guards", "most frequent guards", "{}"),
        ("reasons", "recompile reasons", "{}"), ("break_reasons", "graph break reasons", "{}")],
        note="From TORCH_LOGS-equivalent logging (recompiles, guards, graph_breaks) while compiling, warming up "
             "and profiling; guard eval us = Dynamo's own measurement of one guard check at compile time.")
    for amp, log in logs.items():
        table.rows.append({"amp": amp, **log.row()})
    return table


def _write_rows(path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def profile_run(name: str, mode: str, s: Settings):
    """One run (model ``name``, ``mode`` "eager" or "compiled"), ours and native: yields its
    tables."""
    desc, base, batch = train_step.gpu_case(name, s.tiny, s.device)
    base.train()
    profiles, logs = {}, {}
    stem = f"{NAME}.{name}-{mode}"
    for amp in ("native", "ours"):
        torch._dynamo.reset()
        step = _step(copy.deepcopy(base), batch, mode, amp, s)
        if mode == "compiled":
            with DynamoLog() as log:
                profiles[amp] = _warm_and_profile(step, s)
            logs[amp] = log
            (s.logs / f"{stem}.{amp}.dynamo.log").write_text(log.text + "\n")
        else:
            profiles[amp] = _warm_and_profile(step, s)
        del step
        free_device_memory(s.device)
    del base
    where = ("CPU activities only: no device time" if s.device.type != "cuda" else "CPU and CUDA activities")
    backend = f", torch.compile backend {s.backend}" if mode == "compiled" else ""
    head = f"profile: {SHORT[name]} {mode} step{backend}"
    yield _summary_table(f"{head}: {desc}; {s.profile_steps} profiled steps, {where}"
                         + (" (tiny sizes: a smoke test)" if s.tiny else ""), profiles, logs)
    for kind, what in (("aten", "aten op (host self time)"), ("python", "Python function (host self time)"),
                       ("kernels", "kernel" if s.device.type == "cuda" else "leaf aten op (CPU: no kernels)")):
        rows = host_diff(profiles["ours"], profiles["native"], kind)
        _write_rows(s.logs / f"{stem}.{kind}.csv", rows)
        yield _diff_table(f"{head}: where ours spends more, by {what}", rows, what.split(" (")[0])
    if logs:
        yield _dynamo_table(f"{head}: Dynamo recompiles, guards and graph breaks", logs)


def sections(s: Settings) -> list:
    """(name, generator function) in the order they run."""
    return [(f"{SHORT[name]} {mode}", lambda name=name, mode=mode: profile_run(name, mode, s)) for name, mode in RUNS]
