"""compile: training steps under torch.compile, native autocast and ours.

Per model (the train-step suite's GPT, CNN and LSTM, and an overhead-bound MLP: 24
layers of 64-wide Linear + SiLU + residual, batch 16), four configurations run one SGD
training step each, interleaved in rotating order: native eager, native compiled, ours
eager, ours compiled (``torch.compile`` of the loss function; inductor, or ``aot_eager``
with ``--quick``). Reported: ms per step, ours-compiled / native-compiled (median of
per-round ratios) and compile time ours / native (the first compiled step of each, from a
reset Dynamo cache with inductor's caches off, each measured twice in the order A B B A). Targets: compiled ratio <= 1.02, compile time ratio <= 1.2.
``--quick`` sizes are a smoke test of the suite, not a measurement.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch._dynamo

import dispatch_amp

from . import train_step
from .common import Table, interleaved, ratio_stats, verdict

NAME = "compile"
COMPILED_TARGET = 1.02
COMPILE_TIME_TARGET = 1.2
CONFIGS = ("native eager", "native compiled", "ours eager", "ours compiled")


MODELS = train_step.MODELS


def _region(config: str):
    if config.startswith("native"):
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return lambda: dispatch_amp.autocast("cpu", dtype=torch.bfloat16)


def _make_step(model, batch, config: str, backend: str):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.compile(model.loss, backend=backend) if config.endswith("compiled") else model.loss
    region = _region(config)

    def step():
        opt.zero_grad(set_to_none=True)
        with region():
            loss = loss_fn(*batch)
        loss.backward()
        opt.step()

    return step


def _compile_seconds(base, batch, config: str, backend: str) -> float:
    """The first compiled step from a reset Dynamo, with inductor's caches off: ours
    compiles the graph native compiles, so a warm cache would time a cache hit."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    step = _make_step(copy.deepcopy(base), batch, config, backend)
    with inductor_config.patch(force_disable_caches=True):
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0


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
    steps = {c: _make_step(copy.deepcopy(base), batch, c, backend) for c in CONFIGS}
    s = interleaved(steps, rounds, warmup=2)
    ms = {c: statistics.median(v) * 1e3 for c, v in s.items()}
    compiled = ratio_stats(s["ours compiled"], s["native compiled"])
    eager = ratio_stats(s["ours eager"], s["native eager"])
    compile_ratio = compile_s["ours compiled"] / compile_s["native compiled"]
    return {
        "model": desc, "backend": backend, "rounds": rounds,
        **{f"{c.replace(' ', '_')}_ms": ms[c] for c in CONFIGS},
        "ours/native eager": eager["ratio"],
        "ours/native compiled": compiled["ratio"],
        "compiled_target": f"<= {COMPILED_TARGET:.2f}", "compiled_met": verdict(compiled["ratio"], COMPILED_TARGET),
        "native_compile_s": compile_s["native compiled"], "ours_compile_s": compile_s["ours compiled"],
        "compile_time_ratio": compile_ratio,
        "compile_time_target": f"<= {COMPILE_TIME_TARGET:.1f}",
        "compile_time_met": verdict(compile_ratio, COMPILE_TIME_TARGET),
    }


def _warm_up(backend: str) -> None:
    """One throwaway compilation: the first in a process also pays for loading the compiler."""
    torch._dynamo.reset()
    torch.compile(lambda x: (x * 2).sum(), backend=backend)(torch.ones(4))


def run(opts) -> list[Table]:
    rounds = 3 if opts.quick else 21
    backend = "aot_eager" if opts.quick else "inductor"
    _warm_up(backend)
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
        ("ours/native eager", "ours/native eager", "{:.3f}"),
        ("ours/native compiled", "ours/native compiled", "{:.3f}"),
        ("compiled_target", "target", "{}"),
        ("compiled_met", "met?", "{}"),
        ("native_compile_s", "native compile s", "{:.1f}"),
        ("ours_compile_s", "ours compile s", "{:.1f}"),
        ("compile_time_ratio", "compile time ours/native", "{:.2f}"),
        ("compile_time_target", "target", "{}"),
        ("compile_time_met", "met?", "{}"),
    ])
    for name in MODELS:
        table.rows.append(_time_model(name, opts.quick, rounds, backend))
    torch._dynamo.reset()
    return [table]
