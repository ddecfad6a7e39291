"""Part train: ours against native training steps on GPT-2 small and ResNet-50, eager and compiled.

The models are the GPU run's (``train_step.gpu_case``): GPT-2 small (124M parameters,
8 x 1024 tokens) and ResNet-50 (batch 128 at 224 x 224, channels_last), float16 autocast
(bfloat16 in the dry run), SGD. Per model, one interleaved run of nine configurations
(21 rounds after 2 warm-up samples, each sample between two synchronizations):

- fp32 (TF32 off), and native / ours: the step (``train_step.make_step``), the step with
  a GradScaler (torch's with native, ours with ours);
- native / ours / ours inside ``dispatch_amp.cast_cache()``: a gradient-accumulation step
  of 4 micro-batches (the step's batch split in 4, each forward in its own region, then
  one scaler step): native's weight-cast cache ends with each region, so each micro-batch
  casts every weight again; inside ``cast_cache`` ours casts each once;
- native / ours / ours inside ``cast_cache``: an eval loop of 4 forwards (and losses)
  under ``torch.no_grad``, each in its own region (the model in eval mode).

Reported: medians, and per pair the median of per-round ratios ours/native; the headline
fp32 step / mixed step (with GradScaler) for native and ours. Then each model compiled
(``compile.time_compiled``: the loss function compiled with inductor, each compiled
configuration's first call timed as its compile time, then the four eager/compiled
configurations interleaved), ResNet-50 first: its compiled gap is the open question.

Targets: eager ours/native <= 1.03 (step, and step with GradScaler), compiled <= 1.01,
accumulation with ``cast_cache`` <= 0.97, the headline speedup equal to native's (ours /
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
from benchmarks.suites.common import Table, amp_dtype, dtype_name, free_device_memory, no_tf32, verdict
from benchmarks.timing import interleaved, ratio_stats

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
SHORT = {"gpt": "GPT-2 small", "cnn": "ResNet-50"}


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


def _eager_model(name: str, s: Settings):
    device = s.device
    desc, base, batch = train_step.gpu_case(name, s.tiny, device)
    base.train()
    fns = _configs(base, batch, device)
    del base
    samples = interleaved(fns, s.rounds, warmup=2)
    del fns
    free_device_memory(device)
    ms = {c: statistics.median(v) * 1e3 for c, v in samples.items()}
    where = f"{device.type.upper()} {dtype_name(amp_dtype(device))}"
    table = Table(
        f"train: {desc}, eager ({where}, SGD), ms per call, median of {s.rounds} interleaved rounds, "
        "each sample synchronized; ratio = median per-round ours/native"
        + (" (tiny sizes: a smoke test, not a measurement)" if s.tiny else ""),
        [("what", "what", "{}"), ("native_ms", "native", "{:.2f}"), ("ours_ms", "ours", "{:.2f}"),
         ("ratio", "ours/native", "{:.3f}"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"),
         ("target", "target", "{}"), ("met", "met?", "{}")],
        note=f"Accumulation: the step's batch in {MICRO_BATCHES} micro-batches, each forward in its own region. "
             "Eval: the model in eval mode. fp32 (TF32 off): "
             f"{ms['fp32']:.2f} ms per step.",
    )
    targets = []
    for label, nat, ours, target in PAIRS:
        st = ratio_stats(samples[ours], samples[nat])
        row = {"model": desc, "what": label, "native_ms": ms[nat], "ours_ms": ms[ours], **st, "rounds": s.rounds}
        if target is not None:
            row.update(target=f"<= {target:.2f}", met=verdict(st["ratio"], target))
            targets.append(Target(NAME, f"{SHORT[name]} eager {label}: ours/native", st["ratio"], row["target"],
                                  row["met"]))
        table.rows.append(row)

    native = ratio_stats(samples["fp32"], samples["native+scaler"])
    ours = ratio_stats(samples["fp32"], samples["ours+scaler"])
    relative = statistics.median(
        (f / o) / (f / n) for f, n, o in zip(samples["fp32"], samples["native+scaler"], samples["ours+scaler"]))
    limit = 1 / EAGER_TARGET
    headline = Table(
        f"train: {SHORT[name]} headline, mixed precision with GradScaler against fp32 (TF32 off), "
        f"median of {s.rounds} interleaved rounds" + (" (tiny sizes: a smoke test)" if s.tiny else ""),
        [("model", "model", "{}"), ("fp32_ms", "fp32 ms", "{:.1f}"), ("native_ms", "native ms", "{:.1f}"),
         ("ours_ms", "ours ms", "{:.1f}"), ("native_speedup", "speedup native", "{:.2f}x"),
         ("ours_speedup", "speedup ours", "{:.2f}x"), ("relative", "ours / native speedup", "{:.3f}"),
         ("target", "target", "{}"), ("met", "met?", "{}")],
        note="speedup = median of per-round fp32 time / mixed-precision time; the target: equal to native's "
             "within the eager tolerance.",
    )
    met = verdict(relative, limit, at_most=False)
    headline.rows.append({"model": desc, "fp32_ms": ms["fp32"], "native_ms": ms["native+scaler"],
                          "ours_ms": ms["ours+scaler"], "native_speedup": native["ratio"],
                          "ours_speedup": ours["ratio"], "relative": relative, "target": f">= {limit:.3f}",
                          "met": met})
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


def compiled(s: Settings):
    """Per model (ResNet-50 first): the compile suite's row, compiled with inductor."""
    device = s.device
    compile_suite.warm_up(s.backend, device)
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        for i, name in enumerate(COMPILED_ORDER):
            row = compile_suite.time_compiled(name, i, s.tiny, s.rounds, s.backend, device)
            torch._dynamo.reset()
            free_device_memory(device)
            table = compile_suite.gpu_table(s.rounds, s.backend, s.tiny, device)
            table.title = table.title.replace("compile:", f"train: {SHORT[name]} compiled,", 1)
            table.rows.append(row)
            yield table
            yield Target(NAME, f"{SHORT[name]} compiled ({s.backend}) step: ours/native",
                         row["ours/native compiled"], row["compiled_target"], row["compiled_met"])
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode


def sections(s: Settings) -> list:
    """(name, generator function) in the order they run."""
    return [("eager", lambda: eager(s)), ("compiled", lambda: compiled(s))]
