"""Benchmark: dispatch_amp.autocast against native torch.autocast, on CPU.

Usage::

    python benchmarks/bench_autocast.py [--quick] [--csv PATH]

Suites (docs/design.md, "Performance method": same process, interleaved, warm-up first,
median over pairs; no timing is ever asserted anywhere):

1. dispatch overhead: a loop of tiny ops (``x.add(y)``, ``torch.mm`` on 8x8,
   ``x.view(64)``) in microseconds per op with no autocast, native autocast and ours;
   the extra cost of ours is reported as the distribution of ``ours - native`` per op
   over the repeats (median, p20, p80).
2. training step: ms/step for a GPT-style model, a CNN and an LSTM tagger in float32,
   native autocast and ours (forward + loss in the context, backward and an SGD step
   outside), with the median of the per-round ratio ours/native.

Prints Markdown tables; ``--csv`` also writes every measurement as CSV rows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import dispatch_amp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks import models as M  # noqa: E402
from benchmarks.suites.common import quantile, rotations  # noqa: E402

MODES = ("fp32", "native", "ours")


def context(mode: str):
    if mode == "fp32":
        return contextlib.nullcontext()
    if mode == "native":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if mode == "ours":
        return dispatch_amp.autocast("cpu", dtype=torch.bfloat16)
    raise ValueError(mode)


# -- suite 1: dispatch overhead ------------------------------------------------------------
def _tiny_ops():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return {
        "x.add(y)": lambda: x.add(y),
        "torch.mm 8x8": lambda: torch.mm(x, y),
        "x.view(64)": lambda: x.view(64),
    }


def _time_loop(fn, mode, iters):
    with context(mode):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
    return (t1 - t0) / iters * 1e6  # microseconds per op


def bench_overhead(quick: bool):
    iters = 2000 if quick else 10000
    repeats = 5 if quick else 15
    rows = []
    for name, fn in _tiny_ops().items():
        for mode in MODES:  # warm-up: first calls fill memos and caches
            _time_loop(fn, mode, iters // 10)
        samples = {m: [] for m in MODES}
        for order in rotations(MODES, repeats):
            for mode in order:
                samples[mode].append(_time_loop(fn, mode, iters))
        extra = [o - n for o, n in zip(samples["ours"], samples["native"])]
        rows.append({
            "op": name,
            "iters": iters,
            "repeats": repeats,
            **{f"{m}_us": statistics.median(samples[m]) for m in MODES},
            "extra_median_us": statistics.median(extra),
            "extra_p20_us": quantile(extra, 0.2),
            "extra_p80_us": quantile(extra, 0.8),
        })
    return rows


# -- suite 2: training steps ------------------------------------------------------------------
def _gpt_case(quick):
    if quick:
        cfg, batch, seq = M.GPTConfig(vocab=1024, d_model=128, n_heads=4, n_blocks=2, max_len=64), 4, 64
    else:
        cfg, batch, seq = M.GPTConfig(vocab=4096, d_model=384, n_heads=6, n_blocks=2, max_len=128), 8, 128
    torch.manual_seed(0)
    model = M.GPT(cfg)
    idx, tgt = M.gpt_batch(cfg, batch, seq)
    desc = f"GPT vocab {cfg.vocab}, d {cfg.d_model}, {cfg.n_heads} heads, {cfg.n_blocks} blocks, {batch}x{seq} tok"
    return desc, model, (idx, tgt)


def _cnn_case(quick):
    batch = 8 if quick else 32
    torch.manual_seed(1)
    model = M.CNN(channels=3, classes=10, width=16, size=32)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return f"CNN 2x(Conv2d+BN+ReLU+MaxPool), 32x32, batch {batch}", model, (x, y)


def _lstm_case(quick):
    if quick:
        vocab, emb, hidden, batch, seq = 1000, 64, 128, 8, 32
    else:
        vocab, emb, hidden, batch, seq = 5000, 128, 256, 16, 64
    torch.manual_seed(2)
    model = M.RNNTagger(vocab=vocab, emb=emb, hidden=hidden, tags=20, cell="lstm")
    idx, tags = torch.randint(0, vocab, (batch, seq)), torch.randint(0, 20, (batch, seq))
    return f"LSTM tagger emb {emb}, hidden {hidden}, {batch}x{seq} tok", model, (idx, tags)


def _train_step(model, opt, batch, mode):
    opt.zero_grad(set_to_none=True)
    with context(mode):
        loss = model.loss(*batch)
    loss.backward()
    opt.step()
    return loss


def bench_training(quick: bool):
    pairs = 3 if quick else 9
    warmup = 2
    rows = []
    for make in (_gpt_case, _cnn_case, _lstm_case):
        desc, base, batch = make(quick)
        base.train()
        models = {m: copy.deepcopy(base) for m in MODES}
        opts = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in MODES}
        for mode in MODES:
            for _ in range(warmup):
                _train_step(models[mode], opts[mode], batch, mode)
        samples = {m: [] for m in MODES}
        for order in rotations(MODES, pairs):
            for mode in order:
                t0 = time.perf_counter()
                _train_step(models[mode], opts[mode], batch, mode)
                samples[mode].append((time.perf_counter() - t0) * 1e3)
        ratios = [o / n for o, n in zip(samples["ours"], samples["native"])]
        rows.append({
            "model": desc,
            "pairs": pairs,
            **{f"{m}_ms": statistics.median(samples[m]) for m in MODES},
            "ours_over_native": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        })
    return rows


# -- output --------------------------------------------------------------------------------
def markdown(rows, columns, headers):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        cells = []
        for c, fmt in columns:
            v = r[c]
            cells.append(fmt.format(v) if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer repeats")
    parser.add_argument("--csv", metavar="PATH", help="also write all rows as CSV")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    print(f"# dispatch_amp.autocast vs torch.autocast (CPU, bfloat16){' [quick]' if args.quick else ''}\n")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, python {platform.python_version()}\n")

    overhead = bench_overhead(args.quick)
    print("## Dispatch overhead (us per op; ours - native: median [p20, p80] over repeats)\n")
    print(markdown(
        overhead,
        [("op", "{}"), ("fp32_us", "{:.2f}"), ("native_us", "{:.2f}"), ("ours_us", "{:.2f}"),
         ("extra_median_us", "{:+.2f}"), ("extra_p20_us", "{:+.2f}"), ("extra_p80_us", "{:+.2f}")],
        ["op", "no autocast", "native", "ours", "ours-native median", "p20", "p80"],
    ))
    print()

    training = bench_training(args.quick)
    print("## Training step (ms/step, median; ratio = median of per-round ours/native)\n")
    print(markdown(
        training,
        [("model", "{}"), ("fp32_ms", "{:.1f}"), ("native_ms", "{:.1f}"), ("ours_ms", "{:.1f}"),
         ("ours_over_native", "{:.3f}"), ("ratio_min", "{:.3f}"), ("ratio_max", "{:.3f}")],
        ["model", "fp32", "native", "ours", "ours/native", "min", "max"],
    ))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; pairs per model: {training[0]['pairs']})")

    if args.csv:
        fields = sorted({k for r in overhead + training for k in r} | {"suite"})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for r in overhead:
                w.writerow({"suite": "overhead", **r})
            for r in training:
                w.writerow({"suite": "training", **r})
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
