"""Part train: ours against native training steps on GPT-2 small and ResNet-50, eager and compiled, and GPT-2 medium eager.

The models are the GPU run's (``train_step.gpu_case``): GPT-2 small (124M parameters,
8 x 1024 tokens) and ResNet-50 (batch 128 at 224 x 224, channels_last), float16 autocast
(bfloat16 in the dry run), SGD. Per model, one interleaved run of eleven configurations
(11 rounds after a warm-up sample, each sample 5 calls between two synchronizations,
``--steps-per-sample``; at tiny sizes 3 rounds of 2):

- fp32 (TF32 off), and native / ours: the step (``train_step.make_step``), the step with
  a GradScaler (torch's with native, ours with ours);
- native / ours / ours inside ``dispatch_amp.cast_cache()``: a gradient-accumulation step
  of 4 micro-batches (the step's batch split in 4, each forward in its own region, then
  one scaler step): native's weight-cast cache ends with each region, so each micro-batch
  casts every weight again; inside ``cast_cache`` ours casts each once;
- native / ours / ours inside ``cast_cache``: an eval loop of 4 forwards (and losses)
  under ``torch.no_grad``, each in its own region (the model in eval mode).

Reported: medians per call, and per pair ours/native by both estimators (the median of
per-round ratios and the ratio of medians, each with a bootstrap 95% interval:
``timing.ratio_stats``); the headline fp32 step / mixed step (with GradScaler) for native
and ours. Then GPT-2 medium (355M parameters, 16 x 1024 tokens), native and ours eager:
the GPU-bound model, where host time should hide. Then each model compiled
(``compile.time_compiled``: the loss function compiled with inductor, each compiled
configuration's first call timed as its compile time, then the four eager/compiled
configurations interleaved), ResNet-50 first: its compiled gap is the open question.
Last, GPT-2 small's and ResNet-50's eager step with ours on the Python engine and on the
compiled engine with weight casts batched per region, each in a child process of its own
(``engine_variants``): reported beside the default engine's rows, without a target.

Targets (read on the median of per-round ratios): eager ours/native <= 1.03 (step, and
step with GradScaler), compiled <= 1.01, GPT-2 medium <= 1.01, accumulation with
``cast_cache`` <= 0.97, the headline speedup equal to native's (ours /
native speedup >= 1 / 1.03, the eager tolerance). The eval loop has no target: it shows
the cast cache.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

import torch

import dispatch_amp
from benchmarks.suites import compile as compile_suite
from benchmarks.suites import train_step
from benchmarks.suites.common import (ESTIMATORS_NOTE, Table, amp_dtype, dtype_name, free_device_memory, no_tf32,
                                      ratio_columns, verdict)
from benchmarks.timing import interleaved, prefixed, ratio_stats

from . import engine_variants
from .settings import Settings
from .targets import Target

NAME = "train"
MODELS = ("gpt", "cnn")
COMPILED_ORDER = ("cnn", "gpt")  # the open question first
MICRO_BATCHES = 4
EVAL_FORWARDS = 4
EAGER_TARGET = train_step.TIME_TARGET
COMPILED_TARGET = compile_suite.CUDA_COMPILED_TARGET
ACCUMULATION_TARGET = 0.97
SHORT = {"gpt": "GPT-2 small", "cnn": "ResNet-50", "gpt-medium": "GPT-2 medium"}
GPU_BOUND = "gpt-medium"
GPU_BOUND_TARGET = 1.01


def _region(amp: str, device: torch.device):
    dtype = amp_dtype(device)
    if amp == "native":
        return lambda: torch.autocast(device.type, dtype=dtype)
    return lambda: dispatch_amp.autocast(device.type, dtype=dtype)


def _scaler(amp: str, device: torch.device):
    return torch.amp.GradScaler(device.type) if amp == "native" else dispatch_amp.GradScaler(device.type)


def _kept(keep_casts: bool):
    return dispatch_amp.cast_cache() if keep_casts else contextlib.nullcontext()


def accumulation_step(model, batch, amp: str, device: torch.device, micro_batches: int = MICRO_BATCHES,
                      keep_casts: bool = False):
    """One SGD step over ``micro_batches`` micro-batches (``batch`` split along dim 0), each
    forward in its own ``amp`` region ("native" or "ours"), the loss divided by their
    number and scaled by that autocast's GradScaler; with ``keep_casts`` the micro-batches
    run inside ``dispatch_amp.cast_cache()``.

    Example::

        step = accumulation_step(net, (x, y), "ours", torch.device("cuda"))
        step()
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = _scaler(amp, device)
    region = _region(amp, device)
    chunks = list(zip(*(t.chunk(micro_batches) for t in batch)))
    if len(chunks) != micro_batches:
        raise ValueError(f"a batch of {len(batch[0])} cannot be split into {micro_batches} micro-batches; "
                         f"give a batch of at least {micro_batches}")

    def step():
        opt.zero_grad(set_to_none=True)
        with _kept(keep_casts):
            for micro in chunks:
                with region():
                    loss = model.loss(*micro) / micro_batches
                scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def eval_loop(model, batch, amp: str, device: torch.device, forwards: int = EVAL_FORWARDS,
              keep_casts: bool = False):
    """``forwards`` forward passes (with the loss) under ``torch.no_grad``, each in its own
    ``amp`` region (inside ``dispatch_amp.cast_cache()`` with ``keep_casts``); ``model`` is
    put in eval mode.

    Example::

        run = eval_loop(net, (x, y), "native", torch.device("cuda"))
        run()
    """
    model.eval()
    region = _region(amp, device)

    def run():
        with torch.no_grad(), _kept(keep_casts):
            for _ in range(forwards):
                with region():
                    model.loss(*batch)

    return run


def _configs(base, batch, device: torch.device) -> dict:
    fns = {c: train_step.make_step(copy.deepcopy(base), batch, c, device) for c in train_step.CONFIGS}
    for amp in ("native", "ours"):
        fns[f"{amp} accumulation"] = accumulation_step(copy.deepcopy(base), batch, amp, device)
    fns["ours+cast_cache accumulation"] = accumulation_step(copy.deepcopy(base), batch, "ours", device, keep_casts=True)
    for amp in ("native", "ours"):
        fns[f"{amp} eval"] = eval_loop(copy.deepcopy(base), batch, amp, device)
    fns["ours+cast_cache eval"] = eval_loop(copy.deepcopy(base), batch, "ours", device, keep_casts=True)
    return fns


PAIRS = (  # (row label, native config, ours config, target)
    ("step", "native", "ours", EAGER_TARGET),
    ("step + GradScaler", "native+scaler", "ours+scaler", EAGER_TARGET),
    (f"{MICRO_BATCHES}-micro-batch accumulation + GradScaler", "native accumulation", "ours accumulation", None),
    ("same, ours inside cast_cache()", "native accumulation", "ours+cast_cache accumulation", ACCUMULATION_TARGET),
    (f"eval loop: {EVAL_FORWARDS} forwards, no_grad, a region each", "native eval", "ours eval", None),
    ("same, ours inside cast_cache()", "native eval", "ours+cast_cache eval", None),
)


def _timed(fns: dict, s: Settings) -> dict[str, list[float]]:
    """Seconds per call, ``s.steps_per_sample`` calls a sample, ``s.step_rounds`` rounds
    after one warm-up sample (two when a sample is one call)."""
    k = s.steps_per_sample
    return interleaved(fns, s.step_rounds, warmup=1 if k > 1 else 2, calls=k)


def _sampling(s: Settings) -> str:
    return (f"median of {s.step_rounds} interleaved rounds, each sample {s.steps_per_sample} calls between two "
            "synchronizations, reported per call")


def _table(title: str, s: Settings, note: str) -> Table:
    return Table(
        title + (" (tiny sizes: a smoke test, not a measurement)" if s.tiny else ""),
        [("what", "what", "{}"), ("native_ms", "native", "{:.2f}"), ("ours_ms", "ours", "{:.2f}"), *ratio_columns(),
         ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"),
         ("met", "met?", "{}")],
        note=note + " The verdict reads the median of per-round ratios. " + ESTIMATORS_NOTE,
    )


def _eager_model(name: str, s: Settings):
    device = s.device
    desc, base, batch = train_step.gpu_case(name, s.tiny, device)
    base.train()
    fns = _configs(base, batch, device)
    del base
    samples = _timed(fns, s)
    del fns
    free_device_memory(device)
    ms = {c: statistics.median(v) * 1e3 for c, v in samples.items()}
    where = f"{device.type.upper()} {dtype_name(amp_dtype(device))}"
    table = _table(
        f"train: {desc}, eager ({where}, SGD), ms per call, {_sampling(s)}", s,
        note=f"Accumulation: the step's batch in {MICRO_BATCHES} micro-batches, each forward in its own region. "
             "Eval: the model in eval mode. fp32 (TF32 off): "
             f"{ms['fp32']:.2f} ms per step.",
    )
    targets = []
    for label, nat, ours, target in PAIRS:
        st = ratio_stats(samples[ours], samples[nat])
        row = {"model": desc, "what": label, "native_ms": ms[nat], "ours_ms": ms[ours], **st,
               "rounds": s.step_rounds, "steps_per_sample": s.steps_per_sample}
        if target is not None:
            row.update(target=f"<= {target:.2f}", met=verdict(st["ratio"], target))
            targets.append(Target(NAME, f"{SHORT[name]} eager {label}: ours/native", st["ratio"], row["target"],
                                  row["met"]))
        table.rows.append(row)

    native = ratio_stats(samples["fp32"], samples["native+scaler"])
    ours = ratio_stats(samples["fp32"], samples["ours+scaler"])
    # ours' speedup over native's, (fp32 / ours) / (fp32 / native) = native / ours per round
    relative_stats = ratio_stats(samples["native+scaler"], samples["ours+scaler"])
    relative = relative_stats["ratio"]
    limit = 1 / EAGER_TARGET
    headline = Table(
        f"train: {SHORT[name]} headline, mixed precision with GradScaler against fp32 (TF32 off), "
        f"{_sampling(s)}" + (" (tiny sizes: a smoke test)" if s.tiny else ""),
        [("model", "model", "{}"), ("fp32_ms", "fp32 ms", "{:.1f}"), ("native_ms", "native ms", "{:.1f}"),
         ("ours_ms", "ours ms", "{:.1f}"), *ratio_columns("native_speedup_", "speedup native"),
         *ratio_columns("ours_speedup_", "speedup ours"), *ratio_columns("relative_", "ours / native speedup"),
         ("target", "target", "{}"), ("met", "met?", "{}")],
        note="speedup = fp32 time / mixed-precision time; ours / native speedup = native time / ours per round. "
             "The target: equal to native's within the eager tolerance (read on the median of per-round ratios). "
             + ESTIMATORS_NOTE,
    )
    met = verdict(relative, limit, at_most=False)
    headline.rows.append({"model": desc, "fp32_ms": ms["fp32"], "native_ms": ms["native+scaler"],
                          "ours_ms": ms["ours+scaler"], "native_speedup": native["ratio"],
                          "ours_speedup": ours["ratio"], "relative": relative,
                          **prefixed(native, "native_speedup_"), **prefixed(ours, "ours_speedup_"),
                          **prefixed(relative_stats, "relative_"), "target": f">= {limit:.3f}", "met": met})
    targets.append(Target(NAME, f"{SHORT[name]} headline: ours fp32/mixed speedup over native's", relative,
                          f">= {limit:.3f}", met))
    return [table, headline], targets


def eager(s: Settings):
    """Per model: the eager table and the headline table, then their targets."""
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # heuristics, not autotuning: the suites' choice
    try:
        for name in MODELS:
            with no_tf32():
                tables, targets = _eager_model(name, s)
            yield from tables
            yield from targets
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode


def gpu_bound(s: Settings):
    """GPT-2 medium at 16 x 1024 tokens, eager: ours/native where the device, not the host,
    bounds the step (host time should hide); the tiny-width structure at tiny sizes."""
    device = s.device
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        desc, base, batch = train_step.gpu_case(GPU_BOUND, s.tiny, device)
        base.train()
        fns = {c: train_step.make_step(copy.deepcopy(base), batch, c, device) for c in ("native", "ours")}
        del base
        samples = _timed(fns, s)
        del fns
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode
    free_device_memory(device)
    where = f"{device.type.upper()} {dtype_name(amp_dtype(device))}"
    table = _table(f"train: {desc}, the GPU-bound model, eager ({where}, SGD), ms per step, {_sampling(s)}", s,
                   note="Host time ours adds should hide behind the device's here; on the host-bound models above "
                        "it shows.")
    st = ratio_stats(samples["ours"], samples["native"])
    row = {"model": desc, "what": "step", "native_ms": statistics.median(samples["native"]) * 1e3,
           "ours_ms": statistics.median(samples["ours"]) * 1e3, **st, "rounds": s.step_rounds,
           "steps_per_sample": s.steps_per_sample, "target": f"<= {GPU_BOUND_TARGET:.2f}",
           "met": verdict(st["ratio"], GPU_BOUND_TARGET)}
    table.rows.append(row)
    yield table
    yield Target(NAME, f"{SHORT[GPU_BOUND]} eager step: ours/native", st["ratio"], row["target"], row["met"])


def compiled(s: Settings):
    """Per model (ResNet-50 first): the compile suite's row, compiled with inductor."""
    device = s.device
    compile_suite.warm_up(s.backend, device)
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        for i, name in enumerate(COMPILED_ORDER):
            row = compile_suite.time_compiled(name, i, s.tiny, s.step_rounds, s.backend, device,
                                              steps_per_sample=s.steps_per_sample)
            torch._dynamo.reset()
            free_device_memory(device)
            table = compile_suite.gpu_table(s.step_rounds, s.backend, s.tiny, device)
            table.title = table.title.replace("compile:", f"train: {SHORT[name]} compiled,", 1)
            table.rows.append(row)
            yield table
            yield Target(NAME, f"{SHORT[name]} compiled ({s.backend}) step: ours/native",
                         row["ours/native compiled"], row["compiled_target"], row["compiled_met"])
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode


def sections(s: Settings) -> list:
    """(name, generator function) in the order they run."""
    return [("eager", lambda: eager(s)), ("gpu-bound", lambda: gpu_bound(s)), ("compiled", lambda: compiled(s)),
            ("other engines", lambda: engine_variants.section(s))]
