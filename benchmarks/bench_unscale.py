"""Benchmark the multi-tensor unscale + inf/nan check; prints a Markdown table.

    python benchmarks/bench_unscale.py [--quick] [--csv PATH]

Providers: ``ours-torch`` (dispatch_amp.kernels.unscale_check_ with backend="torch"),
``ours-fallback`` (the plain-torch fallback for devices without a fused op), ``torch``
(``torch._amp_foreach_non_finite_check_and_unscale_``) and, on a GPU, ``ours-triton``.
A large copy of the same byte count gives the memory-bandwidth reference. Bytes are 8 per
fp32 element and 4 per 16-bit element (one read + one write).

On CPU: ``torch.utils.benchmark`` timers, providers interleaved A B A B over several
rounds, median reported. On a GPU: ``triton.testing.do_bench`` (median, 20th and 80th
percentiles). Every provider is validated against torch's op before it is timed.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tbench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
try:
    from dispatch_amp.kernels import unscale_check_, unscale_check_reference
except ImportError:  # not installed: load the kernels folder as a package directly
    import importlib.util

    spec = importlib.util.spec_from_file_location("dispatch_amp_kernels", Path(__file__).resolve().parents[1] / "kernels" / "__init__.py")
    _k = importlib.util.module_from_spec(spec)
    sys.modules["dispatch_amp_kernels"] = _k
    spec.loader.exec_module(_k)
    unscale_check_, unscale_check_reference = _k.unscale_check_, _k.unscale_check_reference

# Slightly above 1: the multiply is real (torch skips it for exactly 1.0), and repeated
# in-place unscaling neither underflows into slow subnormals nor overflows.
INV_SCALE = 1.0 + 2.0**-20


def cases(device: str, quick: bool):
    """(name, [(count, numel, dtype)]) tensor-list specifications."""
    big = 1 << 20
    if device == "cuda":
        layers = [(300, 4096, torch.float32), (100, 65536, torch.float32), (24, 4 * big, torch.float32), (4, 16 * big, torch.float32)]
        out = [
            ("128 x 1M fp32", [(128, big, torch.float32)]),
            ("128 x 1M bf16", [(128, big, torch.bfloat16)]),
            ("layers (428 tensors, fp32)", layers),
            ("1 x 1B + 1000 x 1K fp32", [(1, 1 << 30, torch.float32), (1000, 1024, torch.float32)]),
        ]
        if quick:
            out = out[:3]
        return out
    # CPU: the same shapes, scaled to fit a small machine.
    if quick:  # the same kinds of list, small enough for a smoke run on a loaded machine
        return [
            ("8 x 1M fp32", [(8, big, torch.float32)]),
            ("8 x 1M fp16", [(8, big, torch.float16)]),
            ("layers (164 tensors, fp32)", [(100, 4096, torch.float32), (60, 16384, torch.float32), (4, big, torch.float32)]),
            ("1 x 8M + 1000 x 1K fp32", [(1, 8 * big, torch.float32), (1000, 1024, torch.float32)]),
        ]
    return [
        ("128 x 1M fp32", [(128, big, torch.float32)]),
        ("128 x 1M bf16", [(128, big, torch.bfloat16)]),
        ("layers (428 tensors, fp32)", [(300, 4096, torch.float32), (100, 65536, torch.float32), (24, 2 * big, torch.float32), (4, 8 * big, torch.float32)]),
        ("1 x 256M + 1000 x 1K fp32", [(1, 256 * big, torch.float32), (1000, 1024, torch.float32)]),
    ]


def build(spec, device, fill: str):
    grads = [torch.ones(n, dtype=dt, device=device) for count, n, dt in spec for _ in range(count)]
    if fill == "one inf (last tensor)":
        grads[-1].view(-1)[-1] = float("inf")
    elif fill == "all NaN":
        for g in grads:
            g.fill_(float("nan"))
    nbytes = sum(g.numel() * (8 if g.dtype == torch.float32 else 4) for g in grads)
    return grads, nbytes


def providers(device: str):
    p = {
        "torch": lambda g, inv, f: torch._amp_foreach_non_finite_check_and_unscale_(g, f, inv),
        "ours-torch": lambda g, inv, f: unscale_check_(g, inv, f, backend="torch"),
    }
    if device == "cuda":
        p["ours-triton"] = lambda g, inv, f: unscale_check_(g, inv, f, backend="triton")
    else:
        p["ours-fallback"] = lambda g, inv, f: unscale_check_reference(g, inv, f)
    return p


def validate(fn, spec, device, fill) -> None:
    got, _ = build(spec, device, fill)
    want, _ = build(spec, device, fill)
    fg, fw = torch.zeros((), device=device), torch.zeros((), device=device)
    inv = torch.tensor(0.5, device=device)
    fn(got, inv, fg)
    torch._amp_foreach_non_finite_check_and_unscale_(want, fw, inv)
    assert fg.item() == fw.item(), "found_inf differs from torch"
    for a, b in zip(got, want):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), "values differ from torch"


def time_cpu(fns: dict, args: dict, rounds: int, min_run: float) -> dict:
    """Median seconds per call, providers interleaved A B A B ... over `rounds` rounds."""
    timers = {
        name: tbench.Timer(stmt="fn(*a)", globals={"fn": fn, "a": args[name]}, num_threads=torch.get_num_threads())
        for name, fn in fns.items()
    }
    # Calibrate once (also the warm-up), then time each round with a fixed call count.
    number = {}
    for name, t in timers.items():
        per_call = t.blocked_autorange(min_run_time=min_run / 4).median
        number[name] = max(1, int(min_run / rounds / max(per_call, 1e-9)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, t in timers.items():
            samples[name].append(t.timeit(number[name]).mean)
    return {name: statistics.median(v) for name, v in samples.items()}


def time_gpu(fns: dict, args: dict) -> dict:
    from triton.testing import do_bench

    out = {}
    for name, fn in fns.items():
        med, lo, hi = do_bench(lambda: fn(*args[name]), quantiles=[0.5, 0.2, 0.8])
        out[name] = med / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller cases, fewer rounds")
    ap.add_argument("--csv", type=Path, help="also write rows to this CSV file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = ap.parse_args()
    device = opts.device
    rounds, min_run = (3, 0.1) if opts.quick else (9, 1.0)
    fills = ["all finite", "one inf (last tensor)", "all NaN"]

    # Bandwidth reference: a large copy (read + write) of 64M fp32 elements.
    n_copy = (256 << 20) if device == "cuda" else (8 << 20) if opts.quick else (64 << 20)
    src, dst = torch.ones(n_copy, device=device), torch.empty(n_copy, device=device)
    copy_fn = {"copy": lambda: dst.copy_(src)}
    if device == "cuda":
        copy_s = time_gpu({"copy": lambda: dst.copy_(src)}, {"copy": ()})["copy"]
    else:
        copy_s = time_cpu(copy_fn, {"copy": ()}, rounds, min_run)["copy"]
    copy_gbs = 8 * n_copy / copy_s / 1e9
    del src, dst

    rows = []
    for case, spec in cases(device, opts.quick):
        for fill in fills:
            fns = providers(device)
            for fn in fns.values():
                validate(fn, spec, device, fill)
            args, nbytes = {}, 0
            for name in fns:  # each provider works on its own copy
                grads, nbytes = build(spec, device, fill)
                args[name] = (grads, torch.tensor(INV_SCALE, device=device), torch.zeros((), device=device))
            times = time_gpu(fns, args) if device == "cuda" else time_cpu(fns, args, rounds, min_run)
            for name, sec in times.items():
                rows.append({
                    "device": device, "case": case, "fill": fill, "provider": name,
                    "time_us": sec * 1e6, "gb_s": nbytes / sec / 1e9,
                    "vs_torch": times["torch"] / sec, "vs_copy": nbytes / sec / 1e9 / copy_gbs,
                })
            del args

    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"\nunscale + check, {device} ({name}); torch {torch.__version__}; large copy {copy_gbs:.1f} GB/s")
    print("\n| case | fill | provider | time (us) | GB/s | speed vs torch | of copy bandwidth |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['fill']} | {r['provider']} | {r['time_us']:.1f} | {r['gb_s']:.1f} | {r['vs_torch']:.2f}x | {100 * r['vs_copy']:.0f}% |")
    if opts.csv:
        opts.csv.parent.mkdir(parents=True, exist_ok=True)
        with opts.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
