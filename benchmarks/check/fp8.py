"""Part fp8: the fp8 suite on the GPU, with the kernels and device busy time behind its numbers.

Sections, in order (the first while this process holds no GPU memory):

1. memory: the fp8 suite's GPT peak memory per configuration, one process each;
2. linear: the suite's linear forward + backward per recipe (CurrentScaling,
   DelayedScaling, RowwiseScaling against bf16), eager and compiled, and torchao's float8
   training (``convert_to_float8_training``, tensorwise) compiled beside ours compiled
   when torchao imports; then every timed configuration profiled once
   (``benchmarks.profiling``): kernels per forward + backward, device time, and a kernel
   table (which kernels, launches, device time each);
3. DelayedScaling's gradient error against bf16 for every parameter at calls 1 to 3;
4. the kernel count per linear on the CUDA path counted on CPU
   (``fp8.cuda_path_kernel_counts``: ``benchmarks/fp8_kernel_count.py`` where present);
5. GPT: the suite's GPT training step per recipe, eager and compiled, then each step
   profiled once: wall time, device busy time and kernels per step.

Targets (H100): linear eager CurrentScaling >= 1.35x and DelayedScaling
>= 1.5x bf16; GPT eager >= 1.15x and compiled >= 1.25x tokens/s; peak memory <= 0.97x
bf16; compiled ours / torchao <= 1.03; <= 20 kernels per linear forward + backward;
DelayedScaling's worst gradient error within 0.02 of CurrentScaling's. On CPU (the dry
run) fp8 is timed at tiny sizes only to run the code; memory is not measured there.
"""

from __future__ import annotations

from benchmarks.profiling import StepProfile, kernel_rows, profile_step
from benchmarks.suites import fp8 as fp8_suite
from benchmarks.suites.common import Table, verdict

from .settings import Settings
from .targets import Target

NAME = "fp8"
KERNELS_PER_CONFIG = 10  # rows of the kernel table per configuration; one more row sums the rest
KERNEL_TARGET_CONFIGS = (("eager", "fp8 current"), ("eager", "fp8 delayed"))  # the recipes the target is for


def _label(key) -> str:
    return key if isinstance(key, str) else " ".join(key)


def _profile_all(steps: dict, s: Settings, into: dict) -> None:
    for key, step in steps.items():
        into[key] = profile_step(step, s.device, s.profile_steps, python=False)


def _busy_table(title: str, profiles: dict, s: Settings, kernel_target: bool) -> Table:
    cuda = s.device.type == "cuda"
    table = Table(title, [
        ("config", "configuration", "{}"), ("wall_ms", "wall ms", "{:.3f}"), ("busy_ms", "device busy ms", "{:.3f}"),
        ("busy_pct", "busy % of wall", "{:.0f}"), ("kernels", "kernels" if cuda else "leaf aten ops", "{:.0f}"),
        ("target", "target", "{}"), ("met", "met?", "{}")],
        note="Per call, from one profile of each timed configuration after the timings; wall = between two "
             "synchronizations" + ("." if cuda else "; CPU: no device activity, leaf aten ops for kernels."))
    for key, prof in profiles.items():
        row = prof.summary_row()
        out = {"config": _label(key), "wall_ms": row["wall_ms"], "busy_ms": row["busy_ms"],
               "busy_pct": row["busy_pct"], "kernels": row["kernels"]}
        if kernel_target and key in KERNEL_TARGET_CONFIGS:
            out.update(target=f"<= {fp8_suite.KERNEL_COUNT_TARGET}",
                       met=verdict(row["kernels"], fp8_suite.KERNEL_COUNT_TARGET) if cuda else "n/a on CPU")
        table.rows.append(out)
    return table


def _kernel_table(title: str, profiles: dict[object, StepProfile]) -> Table:
    table = Table(title, [
        ("config", "configuration", "{}"), ("kernel", "kernel", "{}"), ("launches", "launches", "{:.0f}"),
        ("us", "device us" if any(p.device == "cuda" for p in profiles.values()) else "self us", "{:.1f}")],
        note=f"Per forward + backward; the {KERNELS_PER_CONFIG} longest per configuration, then the rest summed.")
    for key, prof in profiles.items():
        rows = kernel_rows(prof)
        for r in rows[:KERNELS_PER_CONFIG]:
            table.rows.append({"config": _label(key), **r})
        rest = rows[KERNELS_PER_CONFIG:]
        if rest:
            table.rows.append({"config": _label(key), "kernel": f"({len(rest)} others)",
                               "launches": sum(r["launches"] for r in rest), "us": sum(r["us"] for r in rest)})
    return table


def memory(s: Settings):
    table = fp8_suite.memory_table(s.device, s.tiny)
    yield table
    for row in table.rows:
        if row.get("target"):
            yield Target(NAME, f"GPT peak memory {row['config']}: fp8/bf16", row.get("ratio", row.get("peak_gb")),
                         row["target"], row.get("met") or "-")


def linear(s: Settings):
    profiles = {}
    table, vs = fp8_suite.linear_tables(s.device, s.tiny, s.backend, timed=True,
                                        observe=lambda steps: _profile_all(steps, s, profiles))
    yield table
    yield vs
    for row in table.rows:
        if row.get("target"):
            yield Target(NAME, f"linear {row['mode']} {row['config']}: speedup over bf16",
                         row.get("ratio", row.get("ms")), row["target"], row.get("met") or "-")
    row = vs.rows[0]
    yield Target(NAME, "linear compiled: ours (current) / torchao (tensorwise)", row.get("ratio", row.get("status")),
                 row["target"], row.get("met") or row.get("status"))
    busy = _busy_table("fp8: linear forward + backward, device time and kernels per call"
                       + (" (tiny sizes: a smoke test)" if s.tiny else ""), profiles, s, kernel_target=True)
    yield busy
    for row in busy.rows:
        if row.get("target"):  # on CPU the count is of leaf aten ops: no value for a CUDA target
            value = row["kernels"] if s.device.type == "cuda" else "n/a on CPU"
            yield Target(NAME, f"kernels per linear fwd+bwd, {row['config']} (profiled)", value,
                         row["target"], row["met"])
    yield _kernel_table("fp8: linear forward + backward, kernels per configuration"
                        + ("" if s.device.type == "cuda" else " (CPU: leaf aten ops by self time)"), profiles)


def delayed(s: Settings):
    table = fp8_suite.delayed_error_table(s.device, s.tiny)
    yield table
    worst = table.rows[-1]
    yield Target(NAME, "DelayedScaling worst grad error calls 1-3 minus CurrentScaling's", worst["excess"],
                 worst["target"], worst["met"])


def kernel_count(s: Settings):
    for table in fp8_suite.cuda_path_kernel_counts(s.suite_opts()):
        yield table


def gpt(s: Settings):
    profiles = {}
    table = fp8_suite.gpt_table(s.device, s.tiny, s.backend, timed=True,
                                observe=lambda steps: _profile_all(steps, s, profiles))
    yield table
    for row in table.rows:
        if row.get("target"):
            yield Target(NAME, f"GPT {row['mode']} {row['config']}: tokens/s over bf16",
                         row.get("ratio", row.get("ms")), row["target"], row.get("met") or "-")
    yield _busy_table("fp8: GPT training step, device busy time and kernels per step"
                      + (" (tiny sizes: a smoke test)" if s.tiny else ""), profiles, s, kernel_target=False)


def sections(s: Settings) -> list:
    """(name, generator function) in the order they run."""
    return [("memory", lambda: memory(s)), ("linear", lambda: linear(s)), ("delayed", lambda: delayed(s)),
            ("kernel count", lambda: kernel_count(s)), ("GPT", lambda: gpt(s))]
