"""compile: training steps under torch.compile, native autocast and ours.

Per model (the train-step suite's GPT, CNN and LSTM, and an overhead-bound MLP: 24
layers of 64-wide Linear + SiLU + residual, batch 16), four configurations run one SGD
training step each, interleaved in rotating order: native eager, native compiled, ours
eager, ours compiled (``torch.compile`` of the loss function; inductor, or ``aot_eager``
with ``--quick``). Reported: ms per step, ours-compiled / native-compiled (median of
per-round ratios) and compile time ours / native (the first compiled step of each, from a
reset Dynamo cache with inductor's caches off, each measured twice in the order A B B A). Targets: compiled ratio <= 1.02, compile time ratio <= 1.2.
``--quick`` sizes are a smoke test of the suite, not a measurement.

With ``--device cuda``: the train-step suite's CUDA models (GPT-2 small, ResNet-50
channels_last, the 2-layer LSTM, the same MLP), float16, each sample synchronized (MLP 10,
LSTM 2 steps per sample), cuDNN benchmark mode off. To fit the GPU run's time budget each
compiled configuration compiles once: its first call, timed, is the compile time, and that
same compiled step is then timed interleaved with the others (no Dynamo reset between).
Inductor's caches stay on, so whichever of the two compiles second may reuse what the
first wrote (the graphs can be the same); the "first" column says which went first (it
alternates between models), and there is no compile-time verdict on CUDA. Target on CUDA:
compiled ratio <= 1.01, eager ratio <= 1.03 (1.10 for the MLP), as the train-step suite.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import traceback

import torch
import torch._dynamo

import dispatch_amp
from benchmarks.timing import interleaved, once, prefixed, ratio_stats

from . import train_step
from .common import (ESTIMATORS_NOTE, Table, amp_dtype, device_of, dtype_name, failure, free_device_memory, ratio_columns,
                     training_step, verdict)

NAME = "compile"
COMPILED_TARGET = 1.02
CUDA_COMPILED_TARGET = 1.01
COMPILE_TIME_TARGET = 1.2
CONFIGS = ("native eager", "native compiled", "ours eager", "ours compiled")


# The train-step suite's models but GPT-2 medium: it is there to show host time hiding
# behind a busy device in eager steps; compiling its 24 blocks would cost the run minutes.
MODELS = tuple(m for m in train_step.MODELS if m != "gpt-medium")


def _region(config: str, device: torch.device = torch.device("cpu")):
    dtype = amp_dtype(device)
    if config.startswith("native"):
        return lambda: torch.autocast(device.type, dtype=dtype)
    return lambda: dispatch_amp.autocast(device.type, dtype=dtype)


def make_step(model, batch, config: str, backend: str, device: torch.device = torch.device("cpu")):
    """One SGD training step of ``model`` under ``config`` (one of ``CONFIGS``): the loss
    function compiled with ``backend`` for the "compiled" ones, backward and SGD eager.

    Example::

        step = make_step(net, (x, y), "ours compiled", "inductor", torch.device("cuda"))
        step()  # the first call compiles
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.compile(model.loss, backend=backend) if config.endswith("compiled") else model.loss
    return training_step(opt, loss_fn, _region(config, device), batch)


def _compile_seconds(base, batch, config: str, backend: str) -> float:
    """The first compiled step from a reset Dynamo, with inductor's caches off: ours
    compiles the graph native compiles, so a warm cache would time a cache hit."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    step = make_step(copy.deepcopy(base), batch, config, backend)
    with inductor_config.patch(force_disable_caches=True):
        return once(step)


def _time_model(name: str, quick: bool, rounds: int, backend: str) -> dict:
    desc, base, batch = train_step.case(name, quick)
    base.train()
    # Each measured twice, in the order A B B A, so neither always compiles first (once
    # each with --quick, a smoke test).
    compile_s = {"native compiled": [], "ours compiled": []}
    order = ("native compiled", "ours compiled")
    for config in order if quick else order + order[::-1]:
        compile_s[config].append(_compile_seconds(base, batch, config, backend))
    compile_s = {c: statistics.mean(v) for c, v in compile_s.items()}
    torch._dynamo.reset()
    steps = {c: make_step(copy.deepcopy(base), batch, c, backend) for c in CONFIGS}
    s = interleaved(steps, rounds, warmup=2)
    ms = {c: statistics.median(v) * 1e3 for c, v in s.items()}
    compiled = ratio_stats(s["ours compiled"], s["native compiled"])
    eager = ratio_stats(s["ours eager"], s["native eager"])
    compile_ratio = compile_s["ours compiled"] / compile_s["native compiled"]
    return {
        "model": desc, "backend": backend, "rounds": rounds,
        **{f"{c.replace(' ', '_')}_ms": ms[c] for c in CONFIGS},
        **prefixed(eager, "eager_"), **prefixed(compiled, "compiled_"),
        "ours/native eager": eager["ratio"],
        "ours/native compiled": compiled["ratio"],
        "compiled_target": f"<= {COMPILED_TARGET:.2f}", "compiled_met": verdict(compiled["ratio"], COMPILED_TARGET),
        "native_compile_s": compile_s["native compiled"], "ours_compile_s": compile_s["ours compiled"],
        "compile_time_ratio": compile_ratio,
        "compile_time_target": f"<= {COMPILE_TIME_TARGET:.1f}",
        "compile_time_met": verdict(compile_ratio, COMPILE_TIME_TARGET),
    }


def time_compiled(name: str, index: int, quick: bool, rounds: int, backend: str,
                  device: torch.device = torch.device("cuda"), steps_per_sample: int | None = None) -> dict:
    """The GPU run's row for model ``name`` (``train_step.gpu_case`` on ``device``): each
    compiled configuration compiles once, in its first (timed) call, and that compiled step
    is then timed with the eager ones, each sample synchronized and ``steps_per_sample``
    steps (default ``train_step.CUDA_STEPS_PER_SAMPLE``, 1 with ``quick``). ``index``
    alternates which of native and ours compiles first.

    Example::

        row = time_compiled("cnn", 0, quick=True, rounds=3, backend="aot_eager", device=torch.device("cpu"))
        row["ours/native compiled"]
    """
    desc, base, batch = train_step.gpu_case(name, quick, device)
    base.train()
    torch._dynamo.reset()
    steps = {c: make_step(copy.deepcopy(base), batch, c, backend, device) for c in CONFIGS}
    del base
    order = ("native compiled", "ours compiled")
    if index % 2:
        order = order[::-1]
    compile_s = {config: once(steps[config]) for config in order}
    k = steps_per_sample or (1 if quick else train_step.CUDA_STEPS_PER_SAMPLE[name])
    s = interleaved(steps, rounds, warmup=2 if k == 1 else 1, calls=k)
    ms = {c: statistics.median(v) * 1e3 for c, v in s.items()}
    compiled = ratio_stats(s["ours compiled"], s["native compiled"])
    eager = ratio_stats(s["ours eager"], s["native eager"])
    eager_target = train_step.TIME_TARGETS.get(name, train_step.TIME_TARGET)
    del steps
    return {
        "model": desc, "backend": backend, "rounds": rounds, "steps_per_sample": k,
        **{f"{c.replace(' ', '_')}_ms": ms[c] for c in CONFIGS},
        **prefixed(eager, "eager_"), **prefixed(compiled, "compiled_"),
        "ours/native eager": eager["ratio"], "eager_target": f"<= {eager_target:.2f}",
        "eager_met": verdict(eager["ratio"], eager_target),
        "ours/native compiled": compiled["ratio"],
        "compiled_min": compiled["ratio_min"], "compiled_max": compiled["ratio_max"],
        "compiled_target": f"<= {CUDA_COMPILED_TARGET:.2f}",
        "compiled_met": verdict(compiled["ratio"], CUDA_COMPILED_TARGET),
        "native_compile_s": compile_s["native compiled"], "ours_compile_s": compile_s["ours compiled"],
        "compile_time_ratio": compile_s["ours compiled"] / compile_s["native compiled"],
        "first": order[0].split()[0],
    }


def gpu_table(rounds: int, backend: str, quick: bool, device: torch.device = torch.device("cuda")) -> Table:
    """The empty table that ``time_compiled`` rows go into.

    Example::

        table = gpu_table(21, "inductor", quick=False)
        table.rows.append(time_compiled("cnn", 0, False, 21, "inductor"))
    """
    where = "CUDA fp16" if device.type == "cuda" else f"{device.type.upper()} {dtype_name(amp_dtype(device))}"
    title = (f"compile: ms per training step ({where}, SGD), torch.compile backend {backend}, "
             f"{rounds} interleaved rounds, each sample synchronized and several steps")
    if quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    return Table(title, [
        ("model", "model", "{}"),
        ("native_eager_ms", "native eager", "{:.2f}"),
        ("ours_eager_ms", "ours eager", "{:.2f}"),
        *ratio_columns("eager_", "ours/native eager"),
        ("eager_target", "target", "{}"),
        ("eager_met", "met?", "{}"),
        ("native_compiled_ms", "native compiled", "{:.2f}"),
        ("ours_compiled_ms", "ours compiled", "{:.2f}"),
        *ratio_columns("compiled_", "ours/native compiled"),
        ("compiled_min", "min", "{:.3f}"),
        ("compiled_max", "max", "{:.3f}"),
        ("compiled_target", "target", "{}"),
        ("compiled_met", "met?", "{}"),
        ("native_compile_s", "native first call s", "{:.1f}"),
        ("ours_compile_s", "ours first call s", "{:.1f}"),
        ("first", "compiled first", "{}"),
    ], note="First call = compilation (caches on: the second of the two may reuse the first's cached graph, "
            "so no compile-time verdict). Compiled: torch.compile of the loss function; backward and SGD eager. "
            "Steps per sample: the row's steps_per_sample (CSV). Verdicts read the median of per-round ratios. "
            + ESTIMATORS_NOTE)


def _run_cuda(opts):
    device = torch.device("cuda")
    rounds = 3 if opts.quick else 11
    backend = "aot_eager" if opts.quick else "inductor"
    warm_up(backend, device)
    table = gpu_table(rounds, backend, opts.quick, device)
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # as the train-step suite: heuristics, no autotuning time
    try:
        for i, name in enumerate(MODELS):
            t0 = time.perf_counter()
            try:
                row = time_compiled(name, i, opts.quick, rounds, backend, device)
            except Exception as e:  # noqa: BLE001 - one model failing leaves the others' rows
                traceback.print_exc(file=sys.stdout)
                row = {"model": train_step.CUDA_DESCRIPTIONS.get(name, name), "native_eager_ms": failure(e)}
            torch._dynamo.reset()
            free_device_memory(device)
            table.rows.append(row)
            got = row.get("ours/native compiled")
            print(f"(compile: {name} in {time.perf_counter() - t0:.1f} s"
                  + (f": ours/native eager {row['ours/native eager']:.3f}, compiled {got:.3f})" if got else ")"),
                  flush=True)
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode
    return [table]


def warm_up(backend: str, device: torch.device = torch.device("cpu")) -> None:
    """One throwaway compilation: the first in a process also pays for loading the compiler.

    Example::

        warm_up("inductor", torch.device("cuda"))  # before timing any first call
    """
    torch._dynamo.reset()
    torch.compile(lambda x: (x * 2).sum(), backend=backend)(torch.ones(4, device=device))


def run(opts) -> list[Table]:
    if device_of(opts).type == "cuda":
        return _run_cuda(opts)
    rounds = 3 if opts.quick else 21
    backend = "aot_eager" if opts.quick else "inductor"
    warm_up(backend)
    title = (
        f"compile: ms per training step (CPU bf16, SGD), torch.compile backend {backend}, "
        f"{rounds} interleaved rounds"
    )
    if opts.quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    table = Table(title, [
        ("model", "model", "{}"),
        ("native_eager_ms", "native eager", "{:.2f}"),
        ("native_compiled_ms", "native compiled", "{:.2f}"),
        ("ours_eager_ms", "ours eager", "{:.2f}"),
        ("ours_compiled_ms", "ours compiled", "{:.2f}"),
        *ratio_columns("eager_", "ours/native eager"),
        *ratio_columns("compiled_", "ours/native compiled"),
        ("compiled_target", "target", "{}"),
        ("compiled_met", "met?", "{}"),
        ("native_compile_s", "native compile s", "{:.1f}"),
        ("ours_compile_s", "ours compile s", "{:.1f}"),
        ("compile_time_ratio", "compile time ours/native", "{:.2f}"),
        ("compile_time_target", "target", "{}"),
        ("compile_time_met", "met?", "{}"),
    ], note="The verdict reads the median of per-round ratios. " + ESTIMATORS_NOTE)
    for name in MODELS:
        table.rows.append(_time_model(name, opts.quick, rounds, backend))
    torch._dynamo.reset()
    return [table]
