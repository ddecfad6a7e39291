"""fp8: fp8 training (``dispatch_amp.autocast(..., fp8=recipe)``) against bfloat16, and against torchao.

Configurations: "bf16" (``dispatch_amp.autocast`` bfloat16 without fp8), "fp8 current",
"fp8 delayed", "fp8 rowwise" and "fp8 block" (the region with ``fp8.CurrentScaling()``,
``DelayedScaling()``, ``RowwiseScaling()``, ``BlockScaling()``; block scaling's gemm needs
compute capability 9.x on CUDA, and elsewhere its row reports the error), each eager and
compiled (``torch.compile``, inductor; aot_eager with ``--quick``; ``DelayedScaling``
bound to the model first); in the GPT's table rowwise and block eagerly only
(``GPT_EAGER_ONLY``: their compile time would not fit the GPU check's window).

1. Linear forward + backward, M x K x N = 4096 x 8192 x 16384: input (M, K) bfloat16
   requiring grad, weight (N, K) float32 parameter with a bias, ``y.backward(dy)`` with a
   fixed bfloat16 ``dy``. Reported: ms per forward + backward, speedup over bf16 in the same
   mode (median of per-round ratios bf16 time / fp8 time). Targets (eager): fp8 current
   >= 1.35x, fp8 delayed >= 1.5x. If torchao is importable (never required): its float8 training
   (``convert_to_float8_training`` on the same Linear wrapped in a module, tensorwise
   dynamic scaling, under ``torch.autocast`` bfloat16, compiled) against ours compiled
   with CurrentScaling, the same scaling; target ours / torchao <= 1.03.
2. A GPT training step, AdamW: vocab 32000, d_model 2048, 16 pre-norm blocks (16 heads,
   ``nn.Linear`` qkv / proj / MLP, causal ``F.scaled_dot_product_attention``), 8 x 2048
   tokens; bf16, fp8 current, fp8 delayed, eager and compiled. Reported: tokens/s and the
   fp8 / bf16 tokens/s ratio (median of per-round ratios), target >= 1.15 eager and
   >= 1.25 compiled. Peak memory
   (eager): one process per configuration (``run.py --child``), which resets
   ``torch.cuda.max_memory_allocated`` after a warm-up step and reads it after two steps,
   so the timings never share a process with it; target fp8 peak <= 0.97 x bf16 peak.
3. DelayedScaling's gradient error against bf16 for every parameter of the GPT at its
   calls 1, 2 and 3 (from the same weights, no optimizer step), beside CurrentScaling's;
   target: the worst within 0.02 of CurrentScaling's worst.
4. Kernels per linear forward + backward on the CUDA path, counted on CPU, from
   ``benchmarks/fp8_kernel_count.py`` where that module is present (target <= 20).

Method: the configurations of a table share one set of weights (for the GPT one model
and one optimizer: a copy per configuration, AdamW states included, would not fit beside
the activations), are interleaved in rotating order after warm-up (compilation included),
each sample a few calls between ``torch.cuda.synchronize()``; medians, and ratios as the
median of per-round ratios.

Correctness, on every device: before any timing each configuration runs once from the
same weights and inputs (no optimizer step); reported per configuration is the max
relative error of its output (the loss, for the GPT) and gradients against bf16 in the same
mode, ``max|fp8 - bf16| / max|bf16|`` per tensor (for gradients the worst tensor), and
whether all of them are finite. DelayedScaling is primed by two calls on the same inputs
first (``DELAYED_PRIMING_CALLS``): its first calls scale from a short history.

On CPU fp8 gemms have no speed advantage (no fp8 matrix units): the suite checks
correctness only, at small sizes, and its timing and memory columns say so. ``--quick`` uses tiny sizes everywhere (every gemm
dimension a multiple of 16): a smoke test, not a measurement.

Device: ``--device`` of the runner (cpu unless ``--device cuda``). The whole GPU run has a
time budget of about six minutes, compilation included, so on CUDA the GPT has 2 blocks
of the shape above (d_model 2048, 8 x 2048 tokens: every gemm as in the 16-block model;
``GPT_LAYERS_CUDA``), 9 rounds x 1 step, and the linear 11 rounds x 5 calls; the three
peak-memory processes run at the same time on a GPU of 40 GiB or more (each reads its own
``max_memory_allocated``).
"""

from __future__ import annotations

import copy
import importlib
import json
import statistics
import sys
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import dispatch_amp
from dispatch_amp import fp8

from benchmarks.timing import interleaved, ratio_stats

from .common import (ESTIMATORS_NOTE, Table, device_of, failure, free_device_memory, gpu_memory_gib, ratio_columns,
                     run_children, training_step, verdict)

NAME = "fp8"
LINEAR_TARGETS = {"fp8 current": 1.35, "fp8 delayed": 1.5}  # eager speedup over bf16
TORCHAO_TARGET = 1.03  # ours compiled / torchao compiled, time
GPT_TARGETS = {"eager": 1.15, "compiled": 1.25}  # fp8 / bf16 tokens/s
MEMORY_TARGET = 0.97  # fp8 / bf16 peak memory
DELAYED_ERROR_TARGET = 0.02  # DelayedScaling's worst gradient error over CurrentScaling's, calls 1 to 3
KERNEL_COUNT_TARGET = 20  # kernels per linear fwd+bwd on the CUDA path
DELAYED_PRIMING_CALLS = 2  # DelayedScaling calls before its error is read or it is timed
LINEAR_CONFIGS = ("bf16", "fp8 current", "fp8 delayed", "fp8 rowwise", "fp8 block")
GPT_CONFIGS = ("bf16", "fp8 current", "fp8 delayed", "fp8 rowwise", "fp8 block")
# Compiled, each configuration costs its compile time in the GPU check's window: the
# per-tensor recipes with targets compile, rowwise and block run eagerly only.
GPT_EAGER_ONLY = ("fp8 rowwise", "fp8 block")
NOT_COMPILED = "eager only (compile time: see GPT_EAGER_ONLY)"
MODES = ("eager", "compiled")
NOT_TIMED = "not timed on CPU (correctness only)"
NOT_MEASURED = "not measured on CPU (correctness only)"
# The GPT's blocks on CUDA: 16 gave ~0.94B parameters and several minutes of compilation
# per configuration; 2 keep every gemm shape and fit the GPU run's time budget (4 took
# 150 s for the whole suite on an H100, caches cold).
GPT_LAYERS_CUDA = 2


# -- configurations -------------------------------------------------------------------------
def _recipe(config: str, model: nn.Module):
    """The fp8 recipe of ``config`` (None for bf16). Delayed scaling is bound to ``model``:
    a compiled graph cannot create its per-site state."""
    if config == "bf16":
        return None
    if config == "fp8 current":
        return fp8.CurrentScaling()
    if config == "fp8 delayed":
        return fp8.DelayedScaling().bind(model)
    if config == "fp8 rowwise":
        return fp8.RowwiseScaling()
    if config == "fp8 block":
        return fp8.BlockScaling()
    raise ValueError(f"unknown configuration {config!r}")


def _region(device: torch.device, recipe):
    return lambda: dispatch_amp.autocast(device.type, dtype=torch.bfloat16, fp8=recipe)


def _timed(fns: dict, rounds: int, iters: int) -> dict:
    """Seconds per call of each fn: ``iters`` calls per sample (the device synchronized
    before and after each), configurations interleaved over ``rounds``. Every fn has run
    before (the correctness pass compiled the compiled ones), so one warm-up sample."""
    return interleaved(fns, rounds, warmup=1, calls=iters)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (the absolute error where ref is all zeros); nan if got is not finite."""
    ref = ref.detach().float()
    diff = (got.detach().float() - ref).abs().max()
    scale = ref.abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def _finite(tensors) -> str:
    return "yes" if all(bool(torch.isfinite(t).all()) for t in tensors) else "NO"


def _correctness(configs, run, collect, columns, skip=()) -> tuple[dict, dict]:
    """One forward + backward per (mode, configuration), bf16 first in each mode.

    ``run(key)`` runs it (DelayedScaling after its priming calls); ``collect(out)`` -> the
    output and gradients it left, by name, the output first; ``columns(errs)`` -> the
    row's error columns from the per-tensor relative errors against bf16. Returns
    (columns per key, failure per key): a configuration that raises is reported in its row
    and left out of the timings; the others still run. Keys in ``skip`` are not run.
    """
    errors, failed = {}, {}
    for mode in MODES:
        ref = None
        for config in configs:
            key = mode, config
            if key in skip:
                continue
            try:
                if config == "fp8 delayed":
                    for _ in range(DELAYED_PRIMING_CALLS):  # the history's first amaxes
                        run(key)
                got = collect(run(key))
            except Exception as e:  # noqa: BLE001
                failed[key] = failure(e)
                continue
            errors[key] = {"finite": _finite(got.values())}
            if config == "bf16":
                ref = {name: t.detach().clone() for name, t in got.items()}
            elif ref is not None:
                errors[key].update(columns({name: _rel_err(t, ref[name]) for name, t in got.items()}))
    return errors, failed


# -- 1. linear ----------------------------------------------------------------------------
def _linear_dims(device: torch.device, quick: bool) -> tuple[int, int, int]:
    if quick:
        return 32, 64, 128
    return (4096, 8192, 16384) if device.type == "cuda" else (256, 512, 1024)


def _torchao_module(lin: nn.Linear):
    """torchao's float8 training on a copy of ``lin``, or (None, why not)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None, "torchao not installed"
    return convert_to_float8_training(nn.Sequential(copy.deepcopy(lin))), None


def linear_tables(device: torch.device, quick: bool, backend: str, timed: bool, observe=None) -> list[Table]:
    """The linear's table (per mode and configuration) and the torchao side by side.
    ``observe(steps)``, if given, is called after the timings with the timed closures
    (``(mode, config) -> fwd+bwd``, and ``"torchao"`` when it ran): the GPU check profiles
    them there.

    Example::

        table, vs_torchao = linear_tables(torch.device("cuda"), False, "inductor", timed=True)
    """
    m, k, n = _linear_dims(device, quick)
    rounds, iters = (3, 2) if quick else ((11, 5) if device.type == "cuda" else (21, 10))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    torch.manual_seed(0)
    lin = nn.Linear(k, n).to(device)  # float32 weight (N, K) and bias

    def make_step(fwd, region, params):
        def step():
            x.grad = None
            for p in params:
                p.grad = None
            with region():
                y = fwd(x)
            y.backward(dy)
            return y
        return step

    steps = {}
    for mode in MODES:
        for config in LINEAR_CONFIGS:
            fwd = torch.compile(lin, backend=backend) if mode == "compiled" else lin
            steps[mode, config] = make_step(fwd, _region(device, _recipe(config, lin)), list(lin.parameters()))

    # Correctness, before timing (it also compiles the compiled configurations).
    errors, failed = _correctness(
        LINEAR_CONFIGS, lambda key: steps[key](),
        lambda y: {"out": y, "dx": x.grad, "dw": lin.weight.grad, "db": lin.bias.grad},
        lambda errs: {f"{name}_err": e for name, e in errs.items()})
    for key in failed:
        del steps[key]

    torchao, torchao_status = _torchao_module(lin)
    if torchao is not None and not timed:
        torchao, torchao_status = None, NOT_TIMED
    if torchao is not None:
        torchao = torchao.to(device)
        torchao_step = make_step(torch.compile(torchao, backend=backend),
                                 lambda: torch.autocast(device.type, dtype=torch.bfloat16), list(torchao.parameters()))
        try:  # an optional comparison: a torchao that fails here is reported, not fatal
            torchao_step()
            steps["torchao"] = torchao_step
        except Exception as e:  # noqa: BLE001
            torchao, torchao_status = None, "torchao " + failure(e)

    s = _timed(steps, rounds, iters) if timed else None
    if observe is not None:
        observe(dict(steps))
    flops = 3 * 2 * m * k * n  # the forward gemm and the two backward gemms

    title = (f"fp8: linear forward + backward, {m} x {k} x {n} (M x K x N), bf16 input, fp32 weight + bias; "
             + (f"ms per fwd+bwd, median of {rounds} interleaved rounds x {iters} calls, torch.compile backend {backend}"
                if timed else "CPU: correctness only, not timed"))
    if quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    table = Table(title, [
        ("mode", "mode", "{}"), ("config", "config", "{}"), ("ms", "ms", "{:.3f}"), ("tflops", "TFLOP/s", "{:.1f}"),
        *ratio_columns(label="speedup vs bf16"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"),
        ("target", "target", "{}"), ("met", "met?", "{}"),
        ("out_err", "out err", "{:.2e}"), ("dx_err", "dx err", "{:.2e}"), ("dw_err", "dw err", "{:.2e}"),
        ("db_err", "db err", "{:.2e}"), ("finite", "finite", "{}"),
    ], note=ESTIMATORS_NOTE + " speedup = bf16 time / fp8 time, same mode. err = max|fp8 - bf16| / max|bf16| "
            "per tensor, against bf16 in the same mode (delayed: after its priming calls).")
    for mode in MODES:
        for config in LINEAR_CONFIGS:
            row = {"mode": mode, "config": config, "rounds": rounds if timed else 0, **errors.get((mode, config), {})}
            target = LINEAR_TARGETS.get(config) if mode == "eager" else None
            if target is not None:
                row["target"] = f">= {target:.2f}"
            if (mode, config) in failed:
                row["ms"] = failed[mode, config]
            elif mode == "compiled" and config in GPT_EAGER_ONLY:
                row["ms"] = NOT_COMPILED
            elif not timed:
                row["ms"] = NOT_TIMED
            else:
                ms = statistics.median(s[mode, config]) * 1e3
                row.update(ms=ms, tflops=flops / ms / 1e9)
                if config != "bf16" and (mode, "bf16") in s:
                    st = ratio_stats(s[mode, "bf16"], s[mode, config])
                    row.update(st)
                    if target is not None:
                        row["met"] = verdict(st["ratio"], target, at_most=False)
            table.rows.append(row)

    vs = Table(
        "fp8: ours vs torchao float8 training, linear forward + backward, compiled, tensorwise dynamic scaling "
        f"(ours: fp8 current), {m} x {k} x {n}" + (" (quick sizes: a smoke test, not a measurement)" if quick else ""),
        [("torchao_ms", "torchao ms", "{:.3f}"), ("ours_ms", "ours ms", "{:.3f}"), *ratio_columns(label="ours/torchao"),
         ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"),
         ("met", "met?", "{}"), ("status", "status", "{}")],
        note=ESTIMATORS_NOTE + " torchao under torch.autocast bfloat16 with its default Float8LinearConfig (whose forward gemm "
             "uses fast accumulation); interleaved with the table above.",
    )
    row = {"target": f"<= {TORCHAO_TARGET:.2f}"}
    if torchao is None:
        row["status"] = torchao_status
    elif ("compiled", "fp8 current") not in s:
        row["status"] = "ours " + failed["compiled", "fp8 current"]
    else:
        st = ratio_stats(s["compiled", "fp8 current"], s["torchao"])
        row.update(torchao_ms=statistics.median(s["torchao"]) * 1e3,
                   ours_ms=statistics.median(s["compiled", "fp8 current"]) * 1e3, **st,
                   met=verdict(st["ratio"], TORCHAO_TARGET), status="measured")
    vs.rows.append(row)
    return [table, vs]


# -- 2. GPT -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTSize:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int

    def describe(self) -> str:
        return (f"vocab {self.vocab}, d_model {self.d_model}, {self.layers} layers, {self.heads} heads, "
                f"{self.batch} x {self.seq} tokens")


def _gpt_size(device: torch.device, quick: bool) -> GPTSize:
    if quick:
        return GPTSize(vocab=256, d_model=64, layers=2, heads=4, seq=32, batch=2)
    if device.type == "cuda":  # 16 layers: ~0.94B parameters, with AdamW about half of an 80 GB GPU
        return GPTSize(vocab=32000, d_model=2048, layers=GPT_LAYERS_CUDA, heads=16, seq=2048, batch=8)
    return GPTSize(vocab=2048, d_model=256, layers=2, heads=4, seq=128, batch=4)


class Block(nn.Module):
    """Pre-norm decoder block: LayerNorm, causal attention (one qkv Linear, an output
    projection), LayerNorm, GELU MLP; residual connections around both."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, head_dim)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    """A plain GPT: token and position embeddings, pre-norm blocks, final LayerNorm, an
    untied output head."""

    def __init__(self, size: GPTSize):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Embedding(size.seq, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parameter_count(size: GPTSize) -> int:
    with torch.device("meta"):  # counted without allocating a billion parameters
        return sum(p.numel() for p in Decoder(size).parameters())


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _gpt_case(size: GPTSize, device: torch.device):
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: a billion parameters on the host are slow
        model = Decoder(size).train()
    idx = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(1))
    return model, (idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device))


def _optimizer(model: nn.Module, device: torch.device):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def gpt_table(device: torch.device, quick: bool, backend: str, timed: bool, observe=None) -> Table:
    """The GPT training step per mode and configuration. ``observe(steps)``, if given, is
    called after the timings with the timed closures (``(mode, config) -> step``).

    Example::

        table = gpt_table(torch.device("cuda"), False, "inductor", timed=True)
    """
    size = _gpt_size(device, quick)
    rounds, iters = (3, 1) if quick else ((9, 1) if device.type == "cuda" else (11, 2))
    model, batch = _gpt_case(size, device)
    opt = _optimizer(model, device)

    loss_fns, regions, steps = {}, {}, {}
    for mode in MODES:
        loss_fn = torch.compile(model.loss, backend=backend) if mode == "compiled" else model.loss
        for config in GPT_CONFIGS:
            if mode == "compiled" and config in GPT_EAGER_ONLY:
                continue
            regions[mode, config] = _region(device, _recipe(config, model))
            loss_fns[mode, config] = loss_fn
            steps[mode, config] = training_step(opt, loss_fn, regions[mode, config], batch)

    def loss_and_grads(key):
        opt.zero_grad(set_to_none=True)
        with regions[key]():
            loss = loss_fns[key](*batch)
        loss.backward()
        return loss.detach()

    # Correctness, before any optimizer step, so every configuration starts from the same
    # weights (it also compiles the compiled configurations).
    errors, failed = _correctness(
        GPT_CONFIGS, loss_and_grads,
        lambda loss: {"loss": loss, **{name: p.grad for name, p in model.named_parameters()}},
        lambda errs: {"loss_err": errs.pop("loss"), "grad_err": max(errs.values())},
        skip={("compiled", c) for c in GPT_EAGER_ONLY})
    for key in failed:
        del steps[key]
    opt.zero_grad(set_to_none=True)

    s = _timed(steps, rounds, iters) if timed else None
    if observe is not None:
        observe(dict(steps))
    tokens = size.batch * size.seq
    n_params = parameter_count(size)
    title = (f"fp8: GPT training step, {_count(n_params)} parameters ({n_params:,}), {size.describe()}, AdamW; "
             + (f"median of {rounds} interleaved rounds x {iters} steps, torch.compile backend {backend}"
                if timed else "CPU: correctness only, not timed"))
    if quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    table = Table(title, [
        ("mode", "mode", "{}"), ("config", "config", "{}"), ("ms", "ms/step", "{:.1f}"),
        ("tokens_s", "tokens/s", "{:.0f}"), *ratio_columns(label="fp8/bf16 tokens/s"),
        ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"),
        ("met", "met?", "{}"), ("loss_err", "loss err", "{:.2e}"), ("grad_err", "grad err", "{:.2e}"),
        ("finite", "finite", "{}"),
    ], note=ESTIMATORS_NOTE + " fp8/bf16 tokens/s = bf16 time / fp8 time, same mode. loss err = "
            "|fp8 - bf16| / |bf16|; grad err = the worst parameter's max|fp8 - bf16| / max|bf16|; one "
            "forward + backward from the same weights (delayed: after its priming calls).")
    for mode in MODES:
        for config in GPT_CONFIGS:
            row = {"mode": mode, "config": config, "rounds": rounds if timed else 0, **errors.get((mode, config), {})}
            if config != "bf16":
                row["target"] = f">= {GPT_TARGETS[mode]:.2f}"
            if (mode, config) in failed:
                row["ms"] = failed[mode, config]
            elif mode == "compiled" and config in GPT_EAGER_ONLY:
                row["ms"] = NOT_COMPILED
            elif not timed:
                row["ms"] = NOT_TIMED
            else:
                sec = statistics.median(s[mode, config])
                row.update(ms=sec * 1e3, tokens_s=tokens / sec)
                if config != "bf16" and (mode, "bf16") in s:
                    st = ratio_stats(s[mode, "bf16"], s[mode, config])
                    row.update(st, met=verdict(st["ratio"], GPT_TARGETS[mode], at_most=False))
            table.rows.append(row)
    return table


def memory_table(device: torch.device, quick: bool) -> Table:
    """The GPT's peak memory per configuration, each in its own process (CUDA only: on CPU
    the rows say "not measured").

    Example::

        table = memory_table(torch.device("cuda"), quick=False)
    """
    size = _gpt_size(device, quick)
    title = f"fp8: GPT peak memory, eager training step, {size.describe()}, AdamW; " + (
        "one process per configuration, torch.cuda.max_memory_allocated over 2 steps after a warm-up step"
        if device.type == "cuda" else "CPU: correctness only, not measured")
    if quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    table = Table(title, [
        ("config", "config", "{}"), ("peak_gb", "peak GB", "{:.2f}"), ("ratio", "fp8/bf16 peak", "{:.3f}"),
        ("target", "target", "{}"), ("met", "met?", "{}"),
    ], note="peak includes weights, gradients and AdamW states (GB = 2**30 bytes).")
    peaks = _child_peaks(quick) if device.type == "cuda" else None
    for config in GPT_CONFIGS:
        row = {"config": config}
        if config != "bf16":
            row["target"] = f"<= {MEMORY_TARGET:.2f}"
        if peaks is None:
            row["peak_gb"] = NOT_MEASURED
        elif isinstance(peaks[config], str):
            row["peak_gb"] = peaks[config]
        else:
            row["peak_gb"] = peaks[config] / 2**30
            if config != "bf16" and not isinstance(peaks["bf16"], str):
                row["ratio"] = peaks[config] / peaks["bf16"]
                row["met"] = verdict(row["ratio"], MEMORY_TARGET)
        table.rows.append(row)
    return table


def _child_peaks(quick: bool) -> dict:
    """Config -> peak bytes of that configuration in its own process, or why that process
    failed. At the same time on a GPU of 40 GiB or more (2-block GPT: ~11 GiB each on an H100)."""
    cmds = {c: [sys.executable, "-m", "benchmarks.run", "--child", NAME, "gpt-memory", c, "--device", "cuda"]
            + (["--quick"] if quick else []) for c in GPT_CONFIGS}
    concurrent = gpu_memory_gib() >= 40 and (quick or GPT_LAYERS_CUDA <= 4)
    out = {}
    for config, (rc, stdout, stderr) in run_children(cmds, concurrent=concurrent).items():
        if rc != 0:
            last = (stderr.strip().splitlines() or [f"exit status {rc}"])[-1]
            out[config] = f"failed: {last[:200]}"
        else:
            out[config] = json.loads(stdout.strip().splitlines()[-1])["peak_bytes"]
    return out


# -- 3. DelayedScaling's first calls ---------------------------------------------------------
def delayed_error_table(device: torch.device, quick: bool) -> Table:
    """Every parameter's gradient error against bf16 under DelayedScaling at its calls 1, 2
    and 3, beside CurrentScaling's, on the GPT (eager, the same weights and inputs, no
    optimizer step); the last row is the worst over all parameters, with the target.

    Example::

        table = delayed_error_table(torch.device("cuda"), quick=False)
        table.rows[-1]["met"]
    """
    size = _gpt_size(device, quick)
    model, batch = _gpt_case(size, device)
    names = [name for name, _ in model.named_parameters()]

    def grads(recipe) -> dict:
        model.zero_grad(set_to_none=True)
        with _region(device, recipe)():
            loss = model.loss(*batch)
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    ref = {name: g.detach().clone() for name, g in grads(None).items()}
    errors = {"current": {name: _rel_err(g, ref[name]) for name, g in grads(fp8.CurrentScaling()).items()}}
    delayed = fp8.DelayedScaling().bind(model)
    calls = (1, 2, 3)
    for call in calls:  # errors read as each call ends: only the reference grads are kept
        errors[call] = {name: _rel_err(g, ref[name]) for name, g in grads(delayed).items()}
    model.zero_grad(set_to_none=True)

    title = (f"fp8: DelayedScaling gradient error against bf16 at its calls 1 to 3, every parameter, GPT "
             f"{size.describe()}, eager; beside CurrentScaling's")
    if quick:
        title += " (quick sizes: a smoke test, not a measurement)"
    table = Table(title, [
        ("parameter", "parameter", "{}"), ("current", "current", "{:.2e}"), ("call_1", "delayed call 1", "{:.2e}"),
        ("call_2", "delayed call 2", "{:.2e}"), ("call_3", "delayed call 3", "{:.2e}"),
        ("excess", "worst delayed - current", "{:+.3f}"), ("target", "target", "{}"), ("met", "met?", "{}"),
    ], note="err = max|fp8 - bf16| / max|bf16| of the parameter's gradient (nan: not finite). Every call starts "
            "from the same weights and inputs; a zero gradient where bf16's is not gives 1.0.")
    for name in names:
        row = {"parameter": name, "current": errors["current"][name],
               **{f"call_{c}": errors[c][name] for c in calls}}
        row["excess"] = max(errors[c][name] for c in calls) - errors["current"][name]
        table.rows.append(row)
    worst = {key: max(errs.values()) for key, errs in errors.items()}
    excess = max(worst[c] for c in calls) - worst["current"]
    table.rows.append({"parameter": "worst of all parameters", "current": worst["current"],
                       **{f"call_{c}": worst[c] for c in calls}, "excess": excess,
                       "target": f"<= {DELAYED_ERROR_TARGET:+.2f}",
                       "met": verdict(excess, DELAYED_ERROR_TARGET)})
    del model, batch, ref
    free_device_memory(device)
    return table


# -- 4. kernels per linear on the CUDA path ---------------------------------------------------
KERNEL_COUNT_MODULE = "benchmarks.fp8_kernel_count"


def cuda_path_kernel_counts(opts) -> list[Table]:
    """Kernels per linear forward + backward on the CUDA path, counted on CPU by
    ``benchmarks/fp8_kernel_count.py`` (its ``count_kernels`` per recipe: recorded on meta
    tensors at the full size, Triton launches counted at the launcher), target <=
    ``KERNEL_COUNT_TARGET``. Without that module, one table row says so.

    Example::

        for table in cuda_path_kernel_counts(argparse.Namespace(quick=True, device="cpu")):
            print(table.markdown())
    """
    try:
        module = importlib.import_module(KERNEL_COUNT_MODULE)
    except ModuleNotFoundError as e:
        if e.name != KERNEL_COUNT_MODULE:  # the module is there but something it imports is not
            raise
        return [Table("fp8: kernels per linear forward + backward on the CUDA path, counted on CPU",
                      [("status", "status", "{}"), ("target", "target", "{}")],
                      rows=[{"status": "not measured: benchmarks/fp8_kernel_count.py is not in this checkout",
                             "target": f"<= {KERNEL_COUNT_TARGET}"}])]
    m, k, n = module.FULL_SIZE
    table = Table(f"fp8: kernels per linear forward + backward on the CUDA path, {m} x {k} x {n}, counted on CPU "
                  f"(meta tensors, Triton launches counted at the launcher)",
                  [("recipe", "recipe", "{}"), ("kernels", "kernels", "{}"), ("triton", "Triton launches", "{}"),
                   ("torch", "torch operators", "{}"), ("host_reads", "host reads", "{}"),
                   ("target", "target", "{}"), ("met", "met?", "{}")])
    for name in module.RECIPES:
        counts = module.count_kernels(name)
        targeted = not name.startswith("rowwise")  # the target is per-tensor scaling's
        table.rows.append({
            "recipe": name, "kernels": counts["kernels"], "triton": len(counts["triton"]),
            "torch": len(counts["torch"]), "host_reads": counts["host_reads"],
            "target": f"<= {KERNEL_COUNT_TARGET}" if targeted else "-",
            "met": verdict(counts["kernels"], KERNEL_COUNT_TARGET) if targeted else "-",
        })
    return [table]


def child(args: list[str], opts) -> None:
    """``run.py --child fp8 gpt-memory CONFIG``: print the peak CUDA memory of two eager
    GPT training steps (after a warm-up step) as JSON."""
    what, config = args
    if what != "gpt-memory":
        raise ValueError(f"unknown child task {what!r}")
    device = torch.device("cuda")
    size = _gpt_size(device, opts.quick)
    model, batch = _gpt_case(size, device)
    step = training_step(_optimizer(model, device), model.loss, _region(device, _recipe(config, model)), batch)
    step()  # AdamW states, allocator warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    print(json.dumps({"peak_bytes": torch.cuda.max_memory_allocated()}))


def run(opts):
    """Yields the linear tables, the GPT table, DelayedScaling's first calls, the CUDA path's
    kernel counts and the memory table (measured first, while this process holds no GPU
    memory: the children then have the whole GPU)."""
    device = device_of(opts)
    backend = "aot_eager" if opts.quick else "inductor"
    timed = device.type == "cuda"  # on CPU fp8 has nothing to gain: correctness only
    memory = memory_table(device, opts.quick)
    torch._dynamo.reset()
    yield from linear_tables(device, opts.quick, backend, timed)
    torch._dynamo.reset()
    free_device_memory(device)
    yield gpt_table(device, opts.quick, backend, timed)
    torch._dynamo.reset()
    free_device_memory(device)
    yield delayed_error_table(device, opts.quick)
    yield from cuda_path_kernel_counts(opts)
    yield memory
