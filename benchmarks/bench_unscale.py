"""Benchmark the multi-tensor unscale + inf/nan check; prints a Markdown table.

    python benchmarks/bench_unscale.py [--quick] [--csv PATH]

Providers: ``ours-torch`` (dispatch_amp.kernels.unscale_check_ with backend="torch"),
``ours-fallback`` (the plain-torch fallback for devices without a fused op), ``torch``
(``torch._amp_foreach_non_finite_check_and_unscale_``) and, on a GPU, ``ours-triton``.
A large copy of the same byte count gives the memory-bandwidth reference. Bytes are 8 per
fp32 element and 4 per 16-bit element (one read + one write).

Timing: ``benchmarks/timing.py`` (docs/design.md, "Performance method"): providers
interleaved in rotating order over several rounds after a warm-up sample, medians, and
"speed vs torch" by both estimators (the median of per-round ratios, the ratio of
medians), each with a bootstrap 95% interval. On CPU on ``torch.utils.benchmark``'s
clock; on a GPU on CUDA events (the kernels' device time). Every provider is validated
against torch's op before it is timed.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from benchmarks.timing import interleaved, interleaved_events, once, prefixed, ratio_stats  # noqa: E402

try:
    from dispatch_amp import _markdown
    from dispatch_amp._devices import default_device_type
    from dispatch_amp.kernels import unscale_check_, unscale_check_reference
except ImportError:  # not installed: load the kernels folder and the two helpers from the checkout
    import importlib.util

    def _load(name: str, path: Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    _root = Path(__file__).resolve().parents[1]
    _k = _load("dispatch_amp_kernels", _root / "src" / "dispatch_amp" / "kernels" / "__init__.py")
    unscale_check_, unscale_check_reference = _k.unscale_check_, _k.unscale_check_reference
    _markdown = _load("dispatch_amp_markdown", _root / "src" / "dispatch_amp" / "_markdown.py")
    default_device_type = _load("dispatch_amp_devices", _root / "src" / "dispatch_amp" / "_devices.py").default_device_type

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


def timed(fns: dict, args: dict, device: str, rounds: int, min_run: float) -> dict[str, list[float]]:
    """Seconds per call of each provider, one sample per round (``benchmarks.timing``).

    A sample is as many calls as fill ``min_run / rounds`` seconds at the slowest
    provider's speed, measured by one call each after a first, warming one."""
    calls = {name: (lambda fn=fn, a=args[name]: fn(*a)) for name, fn in fns.items()}
    for call in calls.values():
        call()
    slowest = max(once(call) for call in calls.values())
    n = max(1, int(min_run / rounds / max(slowest, 1e-9)))
    timer = interleaved_events if device == "cuda" else interleaved
    return timer(calls, rounds, warmup=1, calls=n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller cases, fewer rounds")
    ap.add_argument("--csv", type=Path, help="also write rows to this CSV file")
    ap.add_argument("--device", default=default_device_type(among=("cuda",)), help="cpu or cuda "
                    "(default: cuda where there is one)")
    opts = ap.parse_args()
    device = opts.device
    rounds, min_run = (3, 0.1) if opts.quick else (9, 1.0)
    fills = ["all finite", "one inf (last tensor)", "all NaN"]

    # Bandwidth reference: a large copy (read + write) of 64M fp32 elements.
    n_copy = (256 << 20) if device == "cuda" else (8 << 20) if opts.quick else (64 << 20)
    src, dst = torch.ones(n_copy, device=device), torch.empty(n_copy, device=device)
    copy_s = statistics.median(timed({"copy": lambda: dst.copy_(src)}, {"copy": ()}, device, rounds, min_run)["copy"])
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
            samples = timed(fns, args, device, rounds, min_run)
            for name, s in samples.items():
                sec = statistics.median(s)
                st = ratio_stats(samples["torch"], s)
                rows.append({
                    "device": device, "case": case, "fill": fill, "provider": name,
                    "time_us": sec * 1e6, "gb_s": nbytes / sec / 1e9,
                    "vs_torch": st["ratio"], **prefixed(st, "vs_torch_"), "vs_copy": nbytes / sec / 1e9 / copy_gbs,
                })
            del args

    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"\nunscale + check, {device} ({name}); torch {torch.__version__}; large copy {copy_gbs:.1f} GB/s")
    print()
    print(_markdown.table(
        ["case", "fill", "provider", "time (us)", "GB/s", "speed vs torch, median of per-round ratios [95%]",
         "ratio of medians [95%]", "of copy bandwidth"],
        [[r["case"], r["fill"], r["provider"], f"{r['time_us']:.1f}", f"{r['gb_s']:.1f}",
          f"{r['vs_torch']:.2f}x [{r['vs_torch_ratio_lo']:.2f}, {r['vs_torch_ratio_hi']:.2f}]",
          f"{r['vs_torch_ratio_of_medians']:.2f}x [{r['vs_torch_ratio_of_medians_lo']:.2f}, "
          f"{r['vs_torch_ratio_of_medians_hi']:.2f}]", f"{100 * r['vs_copy']:.0f}%"] for r in rows],
        align="lllrrrrr",
    ))
    if opts.csv:
        opts.csv.parent.mkdir(parents=True, exist_ok=True)
        with opts.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
