"""Benchmark: Apex-style opt levels (ours O1/O2/O3) against fp32 and native torch.autocast, CPU bf16.

Usage::

    python benchmarks/bench_opt_levels.py [--quick] [--csv PATH]

One GPT-style model (benchmarks/models.py), AdamW, one full train step per sample
(forward, loss, backward, optimizer step; zero_grad included). Configurations:

* ``fp32``: no mixed precision.
* ``native``: ``torch.autocast("cpu", bfloat16)`` around forward + loss, no loss scaling
  (the usual bf16 recipe).
* ``native+scaler``: the same with ``torch.amp.GradScaler("cpu")``, to compare with the
  dynamic loss scale that O1/O2 carry by default.
* ``O1``/``O2``/``O3``: ``dispatch_amp.opt_levels.initialize`` at that level, table
  defaults (O1/O2 dynamic loss scale, O3 none), ``scale_loss`` + ``optimizer.step()``.

Time (docs/design.md, "Performance method"; ``benchmarks/timing.py``): same process,
interleaved in rotating order, warm-up first, medians, plus the median of the per-round
ratio against ``native``. Memory: each configuration in its own subprocess, which reports
the RSS after setup (model, optimizer, data, one warm-up step: optimizer state and master
weights exist) and the peak RSS during three more steps (``dispatch_amp._peak_rss``: on
Linux ``VmHWM``, restarted after setup); the difference is the per-step working set
(activations, gradients, weight casts). Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch

from dispatch_amp import _markdown
from dispatch_amp._peak_rss import peak_rss_mb, reset_peak_rss
from dispatch_amp.opt_levels import initialize, scale_loss

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks import models as M  # noqa: E402
from benchmarks.timing import interleaved, prefixed, ratio_stats  # noqa: E402

CONFIGS = ("fp32", "native", "native+scaler", "O1", "O2", "O3")


def _case(quick: bool):
    if quick:
        cfg, batch, seq = M.GPTConfig(vocab=1024, d_model=128, n_heads=4, n_blocks=2, max_len=64), 4, 64
    else:
        cfg, batch, seq = M.GPTConfig(vocab=4096, d_model=384, n_heads=6, n_blocks=2, max_len=128), 8, 128
    desc = f"GPT vocab {cfg.vocab}, d {cfg.d_model}, {cfg.n_heads} heads, {cfg.n_blocks} blocks, {batch}x{seq} tok, AdamW"
    return desc, cfg, batch, seq


def make(config: str, quick: bool):
    """(step function, description) for one configuration, on a fresh model seeded alike."""
    desc, cfg, batch, seq = _case(quick)
    torch.manual_seed(0)
    model = M.GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, tgt = M.gpt_batch(cfg, batch, seq, generator=torch.Generator().manual_seed(1))

    if config == "fp32":
        def step():
            opt.zero_grad(set_to_none=True)
            model.loss(idx, tgt).backward()
            opt.step()
    elif config == "native":
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(idx, tgt)
            loss.backward()
            opt.step()
    elif config == "native+scaler":
        scaler = torch.amp.GradScaler("cpu")

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(idx, tgt)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    elif config in ("O1", "O2", "O3"):
        model, opt = initialize(model, opt, config, dtype=torch.bfloat16)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model.loss(idx, tgt)
            with scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
    else:
        raise ValueError(f"unknown config {config!r}; one of {CONFIGS}")
    return step, desc


def bench_time(quick: bool):
    rounds = 5 if quick else 11
    steps = {}
    desc = ""
    for c in CONFIGS:
        steps[c], desc = make(c, quick)
    samples = interleaved(steps, rounds, warmup=2)
    rows = []
    for c in CONFIGS:
        st = ratio_stats(samples[c], samples["native"])
        rows.append({
            "config": c,
            "ms": statistics.median(samples[c]) * 1e3,
            "ms_min": min(samples[c]) * 1e3,
            "over_native": st["ratio"],
            **prefixed(st, "over_native_"),
            "rounds": rounds,
        })
    return desc, rows


def _memory_child(config: str, quick: bool) -> None:
    step, _ = make(config, quick)
    step()  # first step: lazily created optimizer state, scaler, caches
    # Imports (torch, triton) set a high-water mark above a small model's training: the
    # peak restarts here (Linux), so that of the steps alone is seen.
    reset_peak_rss()
    setup_mb = peak_rss_mb()  # right after the reset: the RSS after setup
    for _ in range(3):
        step()
    print(json.dumps({"setup_mb": setup_mb, "peak_mb": peak_rss_mb()}))


def bench_memory(quick: bool):
    rows = []
    for c in CONFIGS:
        cmd = [sys.executable, __file__, "--memory-child", c] + (["--quick"] if quick else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"config": c, **r, "train_mb": r["peak_mb"] - r["setup_mb"]})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")
    parser.add_argument("--memory-child", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child, args.quick)
        return

    t_start = time.perf_counter()
    print(f"# Opt levels vs native autocast (CPU, bfloat16){' [quick]' if args.quick else ''}\n")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, python {platform.python_version()}\n")
    desc, timing = bench_time(args.quick)
    memory = {r["config"]: r for r in bench_memory(args.quick)}
    rows = [{**t, **memory[t["config"]]} for t in timing]
    print(f"model: {desc}\n")
    print("train step: median ms over rounds (interleaved, rotating order); x native: the median of "
          "per-round ratios and the ratio of medians, each with a bootstrap 95% interval. Memory (separate process per config): RSS after setup + one step, and the "
          "peak RSS during three more steps minus it.\n")
    interval = "{:.3f} [{:.3f}, {:.3f}]"
    columns = [(("config",), "{}"), (("ms",), "{:.1f}"), (("ms_min",), "{:.1f}"),
               (("over_native_ratio", "over_native_ratio_lo", "over_native_ratio_hi"), interval),
               (("over_native_ratio_of_medians", "over_native_ratio_of_medians_lo", "over_native_ratio_of_medians_hi"),
                interval),
               (("peak_mb",), "{:.0f}"), (("train_mb",), "{:.0f}")]
    print(_markdown.table(["config", "ms/step", "min ms", "x native, median of per-round ratios [95%]",
                           "x native, ratio of medians [95%]", "peak RSS MB", "step working set MB"],
                          [[fmt.format(*(r[k] for k in keys)) for keys, fmt in columns] for r in rows]))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; rounds: {timing[0]['rounds']})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
