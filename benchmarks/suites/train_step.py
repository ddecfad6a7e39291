"""train-step: fp32 vs native autocast vs ours, a full training step, with and without a GradScaler.

Each step: ``zero_grad``, forward + loss inside the autocast context, backward and the
optimizer step outside (through the scaler in the "+ GradScaler" rows: torch's scaler with
native autocast, ours with ours). CPU, bfloat16, SGD. Times: configurations interleaved in
rotating order after warm-up, medians, and the median of the per-round ratio ours/native.

Peak memory: each (model, configuration) runs in its own process (``run.py --child``),
which resets the Linux high-water mark after setup and one warm-up step, runs three steps
and reports the peak RSS (``VmHWM``) and the growth over the RSS before the steps: one
process after the other, except at ``--quick`` sizes (a smoke test), where native's and
ours run at once.

Models: the overhead-bound MLP (24 small layers: per-call cost dominates), a GPT, a CNN,
an LSTM tagger and GPT-2 medium's structure (24 blocks, 16 heads; on CPU at d_model 64).
Targets: time ours/native <= 1.03 per model (1.10 for the MLP, where a Python-level
autocast pays the most); peak memory ours/native <= 1.00. Ratios are given by both
estimators of ``benchmarks.timing.ratio_stats`` with their bootstrap 95% intervals; the
verdict reads the median of per-round ratios.

With ``--device cuda``: float16 (the GPU's autocast default) and the scalers on "cuda";
the GPT is GPT-2 small's shape (124M parameters, head tied to the embedding, 8 x 1024
tokens), the CNN a ResNet-50 (channels_last, batch 128 at 224 x 224; cuDNN's heuristics,
benchmark mode off: its autotuning took half a minute of the GPU run's time budget), the
LSTM 2 layers of 1024; the MLP is the same overhead-bound model; GPT-2 medium (355M
parameters, 16 x 1024 tokens) is the GPU-bound one, where host time should hide behind
the device's. Each sample is several steps between ``torch.cuda.synchronize()`` calls
(``CUDA_STEPS_PER_SAMPLE``), 11 rounds; fp32 runs in true fp32
(TF32 off for matmuls and cuDNN). Peak memory is ``torch.cuda.max_memory_allocated`` over
3 steps after a warm-up step and ``reset_peak_memory_stats``, one process per
configuration and model, all at the same time on a GPU of 40 GiB or more (each process
reads its own ``max_memory_allocated``, which the others cannot change). A
further table, the headline, gives the fp32 / mixed-precision (with GradScaler) speedup
of the ResNet-50 and the GPT: the median of per-round ratios from the same samples.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import sys
import time
import traceback
import warnings

import torch

import dispatch_amp
from benchmarks import models as M
from benchmarks.timing import interleaved, prefixed, ratio_stats
from dispatch_amp._peak_rss import peak_rss_mb, reset_peak_rss

from .common import (ESTIMATORS_NOTE, Table, amp_dtype, device_of, failure, free_device_memory, gpu_memory_gib, no_tf32,
                     ratio_columns, run_children, verdict)

# The scaler rows time the scaler's bookkeeping on bf16, where no scaler is needed; ours
# says so once per scaler (AmpNumericsWarning), which is not news here.
warnings.filterwarnings("ignore", category=dispatch_amp.AmpNumericsWarning)
# cuDNN's LSTM under autocast (native and ours alike) gets cast weights, not the module's
# flattened buffer, and says so on every call site; not news here either.
warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")

NAME = "train-step"
TIME_TARGET = 1.03
TIME_TARGETS = {"mlp": 1.10}  # per model, where not TIME_TARGET
MEMORY_TARGET = 1.00
CONFIGS = ("fp32", "native", "ours", "native+scaler", "ours+scaler")


def case(model: str, quick: bool, device: torch.device | str = "cpu"):
    """(description, module, batch) for "mlp", "gpt", "cnn" or "lstm"; quick sizes are tiny.
    On CUDA the module and batch are on the GPU, sized for an H100 (``gpu_case``)."""
    if torch.device(device).type == "cuda":
        return gpu_case(model, quick)
    if model == "mlp":
        depth = 4 if quick else 24
        torch.manual_seed(3)
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        return f"MLP {depth} x (Linear 64 + SiLU + residual), batch 16", M.ResidualMLP(depth=depth), (x, y)
    if model == "gpt":
        if quick:
            cfg, b, t = M.GPTConfig(vocab=512, d_model=64, n_heads=2, n_blocks=2, max_len=32), 4, 32
        else:
            cfg, b, t = M.GPTConfig(vocab=4096, d_model=384, n_heads=6, n_blocks=2, max_len=128), 8, 128
        torch.manual_seed(0)
        desc = f"GPT vocab {cfg.vocab}, d {cfg.d_model}, {cfg.n_heads} heads, {cfg.n_blocks} blocks, {b}x{t} tok"
        return desc, M.GPT(cfg), M.gpt_batch(cfg, b, t, generator=torch.Generator().manual_seed(1))
    if model == "cnn":
        b = 4 if quick else 32
        torch.manual_seed(1)
        x, y = torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))
        return f"CNN Conv2d+BN+MaxPool x2, 32x32, batch {b}", M.CNN(width=8 if quick else 16), (x, y)
    if model == "lstm":
        vocab, emb, hidden, b, t = (500, 32, 64, 4, 16) if quick else (5000, 128, 256, 16, 64)
        torch.manual_seed(2)
        idx, tags = torch.randint(0, vocab, (b, t)), torch.randint(0, 20, (b, t))
        return f"LSTM tagger emb {emb}, hidden {hidden}, {b}x{t} tok", M.RNNTagger(vocab, emb, hidden, 20, "lstm"), (idx, tags)
    if model == "gpt-medium":
        return _gpt_medium(quick, torch.device("cpu"))
    raise ValueError(f"unknown model {model!r}")


def _gpt_medium(tiny: bool, dev: torch.device):
    """GPT-2 medium (24 blocks, 16 heads, d_model 1024, tied head) at 16 x 1024 tokens, the
    GPU-bound model; ``tiny``: its op structure at d_model 64, 4 x 32 tokens (CPU, dry runs)."""
    cfg, b, t = (M.tiny_width(M.GPT2_MEDIUM), 4, 32) if tiny else (M.GPT2_MEDIUM, 16, 1024)
    torch.manual_seed(4)
    gpt = M.gpt2(cfg)
    n = sum(p.numel() for p in gpt.parameters())
    desc = (f"GPT-2 medium{' structure' if tiny else ''} {n / 1e6:.3g}M params (vocab {cfg.vocab}, d {cfg.d_model}, "
            f"{cfg.n_heads} heads, {cfg.n_blocks} blocks, tied head), {b}x{t} tok")
    idx, tgt = M.gpt_batch(cfg, b, t, generator=torch.Generator().manual_seed(5))
    return desc, gpt.to(dev), (idx.to(dev), tgt.to(dev))


def gpu_case(model: str, quick: bool, device: torch.device | str = "cuda"):
    """(description, module, batch) of the GPU run, on ``device``: sized for an H100 (GPT-2
    small, ResNet-50 channels_last, ...); quick sizes are tiny. The GPU check's dry run
    builds the tiny ones on CPU, so that it runs the GPU run's code.

    Example::

        desc, net, (x, y) = gpu_case("cnn", quick=True, device="cpu")  # a tiny channels_last ResNet
    """
    dev = torch.device(device)
    if model == "mlp":  # the same overhead-bound model as on CPU: per-call cost dominates
        depth = 4 if quick else 24
        torch.manual_seed(3)
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        return (f"MLP {depth} x (Linear 64 + SiLU + residual), batch 16", M.ResidualMLP(depth=depth).to(dev),
                (x.to(dev), y.to(dev)))
    if model == "gpt":
        if quick:
            cfg, b, t = M.GPTConfig(vocab=512, d_model=64, n_heads=2, n_blocks=2, max_len=32), 4, 32
        else:
            cfg, b, t = M.GPT2_SMALL, 8, 1024
        torch.manual_seed(0)
        gpt = M.gpt2(cfg)
        n = sum(p.numel() for p in gpt.parameters())
        desc = (f"GPT{'' if quick else '-2 small'} {n / 1e6:.3g}M params (vocab {cfg.vocab}, d {cfg.d_model}, "
                f"{cfg.n_heads} heads, {cfg.n_blocks} blocks, tied head), {b}x{t} tok")
        idx, tgt = M.gpt_batch(cfg, b, t, generator=torch.Generator().manual_seed(1))
        return desc, gpt.to(dev), (idx.to(dev), tgt.to(dev))
    if model == "cnn":
        # quick: batch 8, so that a quarter of it (a micro-batch of the GPU check's
        # accumulation step) still gives BatchNorm's last 1x1 stage 2 values per channel
        b, size = (8, 32) if quick else (128, 224)
        torch.manual_seed(1)
        net = M.ResNet(blocks=(1, 1, 1, 1), width=8, classes=10) if quick else M.ResNet()
        x = torch.randn(b, 3, size, size).to(dev, memory_format=torch.channels_last)
        y = torch.randint(0, 10 if quick else 1000, (b,)).to(dev)
        name = "ResNet (1,1,1,1) width 8" if quick else "ResNet-50 25.6M params"
        return f"{name}, channels_last, batch {b} at {size}x{size}", net.to(dev, memory_format=torch.channels_last), (x, y)
    if model == "lstm":
        vocab, emb, hidden, layers, b, t = (500, 32, 64, 1, 4, 16) if quick else (10000, 512, 1024, 2, 64, 256)
        torch.manual_seed(2)
        idx, tags = torch.randint(0, vocab, (b, t)), torch.randint(0, 20, (b, t))
        net = M.RNNTagger(vocab, emb, hidden, 20, "lstm", layers=layers)
        return (f"LSTM tagger emb {emb}, hidden {hidden}, {layers} layer{'s' if layers > 1 else ''}, {b}x{t} tok",
                net.to(dev), (idx.to(dev), tags.to(dev)))
    if model == "gpt-medium":
        return _gpt_medium(quick, dev)
    raise ValueError(f"unknown model {model!r}")


MODELS = ("mlp", "gpt", "cnn", "lstm", "gpt-medium")
# CUDA: steps per timed sample. One synchronized step of GPT-2 small on a shared host
# varied per round by as much as ours/native itself (per-round ratios 0.94 to 1.26 on an
# H100), and a small model's one step is mostly launch latency and synchronization.
CUDA_STEPS_PER_SAMPLE = {"mlp": 10, "lstm": 5, "gpt": 5, "cnn": 5, "gpt-medium": 2}


def make_step(model, batch, config: str, device: torch.device | str = "cpu"):
    """A closure running one training step of ``model`` under ``config`` on ``device``
    (bfloat16 on CPU, float16 on CUDA)."""
    device = torch.device(device)
    dtype = amp_dtype(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp_mode, _, scaled = config.partition("+")
    if amp_mode == "native":
        ctx = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    elif amp_mode == "ours":
        ctx = lambda: dispatch_amp.autocast(device.type, dtype=dtype)  # noqa: E731
    else:
        ctx = contextlib.nullcontext
    scaler = None
    if scaled:
        scaler = torch.amp.GradScaler(device.type) if amp_mode == "native" else dispatch_amp.GradScaler(device.type)

    def step():
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = model.loss(*batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return step


def _time_model(name: str, quick: bool, rounds: int, device: torch.device | None = None) -> tuple[list[dict], dict | None]:
    """Timing rows of ``name`` (plain and GradScaler loops), and on CUDA its headline row
    (fp32 / mixed-precision speedups) for the ResNet-50 and the GPT, else None."""
    device = device or torch.device("cpu")
    desc, base, batch = case(name, quick, device)
    base.train()
    steps = {c: make_step(copy.deepcopy(base), batch, c, device) for c in CONFIGS}
    k = 1 if quick or device.type != "cuda" else CUDA_STEPS_PER_SAMPLE[name]
    s = interleaved(steps, rounds, warmup=2, calls=k)
    ms = {c: statistics.median(v) * 1e3 for c, v in s.items()}
    rows = []
    target = TIME_TARGETS.get(name, TIME_TARGET)
    for loop, nat, ours in (("plain", "native", "ours"), ("GradScaler", "native+scaler", "ours+scaler")):
        st = ratio_stats(s[ours], s[nat])
        rows.append({
            "model": desc, "loop": loop, "rounds": rounds, "steps_per_sample": k,
            "fp32_ms": ms["fp32"] if loop == "plain" else None, "native_ms": ms[nat], "ours_ms": ms[ours],
            **st, "target": f"<= {target:.2f}", "met": verdict(st["ratio"], target),
        })
    headline = None
    if device.type == "cuda" and name in HEADLINE_MODELS:
        nat, ours = ratio_stats(s["fp32"], s["native+scaler"]), ratio_stats(s["fp32"], s["ours+scaler"])
        headline = {
            "model": desc, "rounds": rounds, "steps_per_sample": k, "fp32_ms": ms["fp32"],
            "native_ms": ms["native+scaler"], "ours_ms": ms["ours+scaler"],
            **prefixed(nat, "native_speedup_"), **prefixed(ours, "ours_speedup_"),
            "native_speedup": nat["ratio"], "ours_speedup": ours["ratio"],
            **ratio_stats(s["ours+scaler"], s["native+scaler"]),
        }
    return rows, headline


HEADLINE_MODELS = ("cnn", "gpt")


def _memory_cmd(name: str, config: str, quick: bool, device: torch.device) -> list[str]:
    return ([sys.executable, "-m", "benchmarks.run", "--child", NAME, name, config]
            + (["--quick"] if quick else []) + (["--device", "cuda"] if device.type == "cuda" else []))


def _parse_child(cmd, rc: int, stdout: str, stderr: str) -> dict:
    if rc != 0:
        last = (stderr.strip().splitlines() or [f"exit status {rc}"])[-1]
        raise RuntimeError(f"{cmd[-1] if cmd[-1] != '--quick' else cmd[-2]} process: {last[:200]}\n"
                           f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _memory(name: str, quick: bool, device: torch.device | None = None) -> dict:
    """Peak memory of native and ours, each in its own process. On CUDA the two processes
    run at the same time (each reads its own ``max_memory_allocated``, which the other
    cannot change); on CPU too at quick sizes, which measure nothing (each reads its own
    RSS), and otherwise one after the other (a quiet machine)."""
    device = device or torch.device("cpu")
    cmds = {config: _memory_cmd(name, config, quick, device) for config in ("native", "ours")}
    results = run_children(cmds, concurrent=quick or (device.type == "cuda" and gpu_memory_gib() >= 40))
    return {config: _parse_child(cmds[config], *results[config]) for config in cmds}


def child(args: list[str], opts) -> None:
    """``run.py --child train-step MODEL CONFIG [--device cuda]``: print peak memory of three
    steps as JSON."""
    name, config = args
    quick = opts.quick
    device = device_of(opts)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False  # heuristics, not timings: both processes pick the same algorithms
        _, model, batch = case(name, quick, device)
        step = make_step(model.train(), batch, config, device)
        step()  # optimizer state, scaler state, caches, cuBLAS/cuDNN workspaces
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(json.dumps({"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "before_mb": before / 2**20,
                          "vmhwm_reset": None}))
        return
    _, model, batch = case(name, quick)
    step = make_step(model.train(), batch, config)
    step()  # optimizer state, scaler state, caches
    # The peak of the steps, not of the imports (Linux; elsewhere the process's whole peak).
    reset = reset_peak_rss()
    before = peak_rss_mb()  # right after the reset: the RSS before the steps
    for _ in range(3):
        step()
    print(json.dumps({"peak_mb": peak_rss_mb(), "before_mb": before, "vmhwm_reset": reset}))


def _timing_table(rounds: int, device: torch.device) -> Table:
    if device.type == "cuda":
        what = "CUDA fp16, SGD; fp32 = TF32 off"
    else:
        what = "CPU bf16, SGD"
    return Table(
        f"train-step: ms/step ({what}), median of {rounds} interleaved rounds",
        [("model", "model", "{}"), ("loop", "loop", "{}"), ("fp32_ms", "fp32", "{:.1f}"),
         ("native_ms", "native", "{:.1f}"), ("ours_ms", "ours", "{:.1f}"), *ratio_columns(),
         ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"), ("met", "met?", "{}")],
        note="GradScaler rows: native autocast + torch.amp.GradScaler vs ours + dispatch_amp.GradScaler. "
             "The verdict reads the median of per-round ratios. " + ESTIMATORS_NOTE
             + (" CUDA: each sample synchronized (torch.cuda.synchronize) before and after, and several steps, "
                "reported per step: " + ", ".join(f"{m} {k}" for m, k in CUDA_STEPS_PER_SAMPLE.items()) + "."
                if device.type == "cuda" else ""),
    )


def _memory_row(name: str, quick: bool, device: torch.device, desc: str) -> dict:
    return _memory_row_from(_memory(name, quick, device), desc)


def _memory_row_from(m: dict, desc: str) -> dict:
    ratio = m["ours"]["peak_mb"] / m["native"]["peak_mb"]
    return {
        "model": desc,
        "native_peak_mb": m["native"]["peak_mb"], "ours_peak_mb": m["ours"]["peak_mb"], "ratio": ratio,
        "native_step_mb": m["native"]["peak_mb"] - m["native"]["before_mb"],
        "ours_step_mb": m["ours"]["peak_mb"] - m["ours"]["before_mb"],
        "vmhwm_reset": m["ours"]["vmhwm_reset"],
        "target": f"<= {MEMORY_TARGET:.2f}", "met": verdict(ratio, MEMORY_TARGET),
    }


def _memory_table(device: torch.device) -> Table:
    if device.type == "cuda":
        title = ("train-step peak memory (CUDA fp16): one process per configuration, torch.cuda.max_memory_allocated "
                 "over 3 steps after a warm-up step (MiB)")
        note = "step growth = peak during the steps minus memory allocated before them (activations, casts)."
    else:
        title = "train-step peak memory: one process per configuration, peak RSS over 3 steps after warm-up (MB)"
        note = "step growth = peak during the steps minus RSS before them (activations, gradients, casts)."
    return Table(
        title,
        [("model", "model", "{}"), ("native_peak_mb", "native peak", "{:.0f}"), ("ours_peak_mb", "ours peak", "{:.0f}"),
         ("ratio", "ours/native", "{:.3f}"), ("native_step_mb", "native step growth", "{:.1f}"),
         ("ours_step_mb", "ours step growth", "{:.1f}"), ("target", "target", "{}"), ("met", "met?", "{}")],
        note=note,
    )


def run(opts):
    """Yields the timing table, on CUDA the headline table, then the memory table, each as
    soon as it is measured."""
    device = device_of(opts)
    if device.type == "cuda":
        yield from _run_cuda(opts, device)
        return
    # 41 rounds: with 21 the per-round ratios of a 2-core shared machine moved the median
    # by up to 0.03 between runs, as much as the margins being measured.
    rounds = 3 if opts.quick else 41
    timing = _timing_table(rounds, device)
    for name in MODELS:
        timing.rows += _time_model(name, opts.quick, rounds, device)[0]
    yield timing

    memory = _memory_table(device)
    for name in MODELS:
        memory.rows.append(_memory_row(name, opts.quick, device, case(name, opts.quick)[0]))
    yield memory


CUDA_DESCRIPTIONS = {}  # model -> description, filled as the CUDA models are built


def _run_cuda(opts, device: torch.device):
    # 11 rounds of several steps a sample: a GPT-2 / ResNet-50 round (fp32 and four fp16
    # configurations, 5 steps each) is about 2.5 s on an H100.
    rounds = 3 if opts.quick else 11  # each sample several steps (CUDA_STEPS_PER_SAMPLE)
    timing = _timing_table(rounds, device)
    headline = Table(
        "train-step headline: fp16 mixed precision with GradScaler vs fp32 (TF32 off: "
        'torch.set_float32_matmul_precision("highest"), torch.backends.cudnn.allow_tf32 = False), ms/step, SGD, '
        f"median of {rounds} interleaved rounds",
        [("model", "model", "{}"), ("fp32_ms", "fp32 (no TF32)", "{:.1f}"),
         ("native_ms", "native fp16 + torch GradScaler", "{:.1f}"), ("ours_ms", "ours fp16 + our GradScaler", "{:.1f}"),
         *ratio_columns("native_speedup_", "speedup native"), *ratio_columns("ours_speedup_", "speedup ours"),
         *ratio_columns()],
        note="speedup = fp32 time / mixed-precision time (the train-step table's samples). " + ESTIMATORS_NOTE,
    )
    if opts.quick:
        headline.title += " (quick sizes: a smoke test, not a measurement)"
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # heuristics: autotuning ResNet-50 cost ~30 s of the budget
    try:
        with no_tf32():
            for name in MODELS:
                t0 = time.perf_counter()
                try:
                    rows, head = _time_model(name, opts.quick, rounds, device)
                except Exception as e:  # noqa: BLE001 - one model failing leaves the others' rows
                    traceback.print_exc(file=sys.stdout)
                    rows, head = [{"model": name, "loop": "-", "native_ms": failure(e)}], None
                free_device_memory(device)
                timing.rows += rows
                if head is not None:
                    headline.rows.append(head)
                CUDA_DESCRIPTIONS[name] = rows[0]["model"]
                got = ", ".join(f"{r['loop']} ours/native {r['ratio']:.3f}" for r in rows if "ratio" in r)
                print(f"(train-step: {name} timed in {time.perf_counter() - t0:.1f} s: {got or rows[0]['native_ms']})",
                      flush=True)
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode
    yield timing
    yield headline

    # Every (model, configuration) process at once on a large GPU: GPT-2 small and
    # ResNet-50 peak under 8 GiB each, all eight under 30 GiB. GPT-2 medium's two after
    # them, one at a time unless the GPU holds both (16 x 1024 tokens: tens of GiB each).
    memory = _memory_table(device)
    cmds = {(name, config): _memory_cmd(name, config, opts.quick, device) for name in MODELS for config in ("native", "ours")}
    big = {key: cmd for key, cmd in cmds.items() if key[0] == "gpt-medium"}
    results = run_children({key: cmd for key, cmd in cmds.items() if key not in big}, concurrent=gpu_memory_gib() >= 40)
    results.update(run_children(big, concurrent=opts.quick or gpu_memory_gib() >= 120))
    for name in MODELS:
        desc = CUDA_DESCRIPTIONS.get(name, name)
        try:
            m = {config: _parse_child(cmds[name, config], *results[name, config]) for config in ("native", "ours")}
            memory.rows.append(_memory_row_from(m, desc))
        except Exception as e:  # noqa: BLE001
            print(f"(train-step memory, {name}: {e})", flush=True)
            memory.rows.append({"model": desc, "native_peak_mb": failure(e)})
    yield memory
