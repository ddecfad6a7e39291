"""train-step: fp32 vs native autocast vs ours, a full training step, with and without a GradScaler.

Each step: ``zero_grad``, forward + loss inside the autocast context, backward and the
optimizer step outside (through the scaler in the "+ GradScaler" rows: torch's scaler with
native autocast, ours with ours). CPU, bfloat16, SGD. Times: configurations interleaved in
rotating order after warm-up, medians, and the median of the per-round ratio ours/native.

Peak memory: each (model, configuration) runs in its own process (``run.py --child``),
which resets the Linux high-water mark after setup and one warm-up step, runs three steps
and reports the peak RSS (``VmHWM``) and the growth over the RSS before the steps.

Models: the overhead-bound MLP (24 small layers: per-call cost dominates), a GPT, a CNN
and an LSTM tagger. Targets: time ours/native <= 1.03 per model (1.10 for the MLP, where
a Python-level autocast pays the most); peak memory ours/native <= 1.00.
"""

from __future__ import annotations

import contextlib
import copy
import json
import resource
import statistics
import subprocess
import sys
import warnings

import torch

import dispatch_amp
from benchmarks import models as M

from .common import REPO, Table, interleaved, ratio_stats, status_kb, verdict

# The scaler rows time the scaler's bookkeeping on bf16, where no scaler is needed; ours
# says so once per scaler (AmpNumericsWarning), which is not news here.
warnings.filterwarnings("ignore", category=dispatch_amp.AmpNumericsWarning)

NAME = "train-step"
TIME_TARGET = 1.03
TIME_TARGETS = {"mlp": 1.10}  # per model, where not TIME_TARGET
MEMORY_TARGET = 1.00
CONFIGS = ("fp32", "native", "ours", "native+scaler", "ours+scaler")


def case(model: str, quick: bool):
    """(description, module, batch) for "mlp", "gpt", "cnn" or "lstm"; quick sizes are tiny."""
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
    raise ValueError(f"unknown model {model!r}")


MODELS = ("mlp", "gpt", "cnn", "lstm")


def make_step(model, batch, config: str):
    """A closure running one training step of ``model`` under ``config``."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp_mode, _, scaled = config.partition("+")
    if amp_mode == "native":
        ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif amp_mode == "ours":
        ctx = lambda: dispatch_amp.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    else:
        ctx = contextlib.nullcontext
    scaler = None
    if scaled:
        scaler = torch.amp.GradScaler("cpu") if amp_mode == "native" else dispatch_amp.GradScaler("cpu")

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


def _time_model(name: str, quick: bool, rounds: int) -> list[dict]:
    desc, base, batch = case(name, quick)
    base.train()
    steps = {c: make_step(copy.deepcopy(base), batch, c) for c in CONFIGS}
    s = interleaved(steps, rounds, warmup=2)
    ms = {c: statistics.median(v) * 1e3 for c, v in s.items()}
    rows = []
    target = TIME_TARGETS.get(name, TIME_TARGET)
    for loop, nat, ours in (("plain", "native", "ours"), ("GradScaler", "native+scaler", "ours+scaler")):
        st = ratio_stats(s[ours], s[nat])
        rows.append({
            "model": desc, "loop": loop, "rounds": rounds,
            "fp32_ms": ms["fp32"] if loop == "plain" else None, "native_ms": ms[nat], "ours_ms": ms[ours],
            **st, "target": f"<= {target:.2f}", "met": verdict(st["ratio"], target),
        })
    return rows


def _memory(name: str, quick: bool) -> dict:
    out = {}
    for config in ("native", "ours"):
        cmd = [sys.executable, "-m", "benchmarks.run", "--child", NAME, name, config] + (["--quick"] if quick else [])
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        out[config] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def child(args: list[str], quick: bool) -> None:
    """``run.py --child train-step MODEL CONFIG``: print peak memory of three steps as JSON."""
    name, config = args
    _, model, batch = case(name, quick)
    step = make_step(model.train(), batch, config)
    step()  # optimizer state, scaler state, caches
    before_kb = status_kb("VmRSS")
    try:  # Linux: reset VmHWM, so the peak is that of the steps, not of the imports
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    for _ in range(3):
        step()
    peak_kb = status_kb("VmHWM") if reset else None
    if peak_kb is None:  # no reset possible: ru_maxrss, which may still be the import peak
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": peak_kb / 1024, "before_mb": (before_kb or 0) / 1024,
                      "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "vmhwm_reset": reset}))


def run(opts) -> list[Table]:
    # 41 rounds: with 21 the per-round ratios of a 2-core shared machine moved the median
    # by up to 0.03 between runs, as much as the margins being measured.
    rounds = 3 if opts.quick else 41
    timing = Table(
        f"train-step: ms/step (CPU bf16, SGD), median of {rounds} interleaved rounds; ratio = median per-round ours/native",
        [("model", "model", "{}"), ("loop", "loop", "{}"), ("fp32_ms", "fp32", "{:.1f}"),
         ("native_ms", "native", "{:.1f}"), ("ours_ms", "ours", "{:.1f}"), ("ratio", "ours/native", "{:.3f}"),
         ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"), ("met", "met?", "{}")],
        note="GradScaler rows: native autocast + torch.amp.GradScaler vs ours + dispatch_amp.GradScaler.",
    )
    for name in MODELS:
        timing.rows += _time_model(name, opts.quick, rounds)

    memory = Table(
        "train-step peak memory: one process per configuration, peak RSS over 3 steps after warm-up (MB)",
        [("model", "model", "{}"), ("native_peak_mb", "native peak", "{:.0f}"), ("ours_peak_mb", "ours peak", "{:.0f}"),
         ("ratio", "ours/native", "{:.3f}"), ("native_step_mb", "native step growth", "{:.1f}"),
         ("ours_step_mb", "ours step growth", "{:.1f}"), ("target", "target", "{}"), ("met", "met?", "{}")],
        note="step growth = peak during the steps minus RSS before them (activations, gradients, casts).",
    )
    for name in MODELS:
        m = _memory(name, opts.quick)
        ratio = m["ours"]["peak_mb"] / m["native"]["peak_mb"]
        memory.rows.append({
            "model": case(name, opts.quick)[0],
            "native_peak_mb": m["native"]["peak_mb"], "ours_peak_mb": m["ours"]["peak_mb"], "ratio": ratio,
            "native_step_mb": m["native"]["peak_mb"] - m["native"]["before_mb"],
            "ours_step_mb": m["ours"]["peak_mb"] - m["ours"]["before_mb"],
            "vmhwm_reset": m["ours"]["vmhwm_reset"],
            "target": f"<= {MEMORY_TARGET:.2f}", "met": verdict(ratio, MEMORY_TARGET),
        })
    return [timing, memory]
