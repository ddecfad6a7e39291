"""scaler: the unscale + inf/nan check, and a full scaler step + update, ours vs torch (CPU).

1. unscale + check: ``dispatch_amp.kernels.unscale_check_`` and the read-only
   ``check_finite_`` against ``torch._amp_foreach_non_finite_check_and_unscale_`` on
   64 x 512K fp32 gradients; GB/s at 8 bytes per element (read + write; 4 for the
   read-only check).
2. step + update: ``scaler.step(opt)`` for each optimizer, then ``scaler.update()``, with
   ``dispatch_amp.GradScaler`` vs ``torch.amp.GradScaler`` on the same gradients: plain
   SGD, two SGDs over halves of the parameters, and fused AdamW (which unscales inside its
   own step: ours only checks, read-only; torch unscales by 1.0, read + write). Gradients
   are refilled before every timed call, outside the timed region. Ours unscales the two
   SGDs together (``scaler.unscale_(opt1, opt2)``), which reads found_inf once.
3. host syncs per step: ``aten._local_scalar_dense`` calls (``.item()``, ``bool()``, ...)
   during one step + update, counted with a TorchDispatchMode.

Targets: step+update ours/torch <= 1.00 with SGD, <= 0.85 with fused AdamW; host
syncs 1 / 1 / 0 for 1 SGD / 2 SGDs / fused AdamW.

With ``--device cuda``: table 1 is the Triton kernel (``unscale_check_``, backend "auto",
which is Triton on CUDA) on ~1 GB of fp32 gradients in 200 tensors of mixed sizes (ragged
ones included, in shuffled order), against torch's fused op and a device-to-device copy of
the same bytes (``copy_`` of one flat tensor: the bandwidth reference); CUDA events around
5 calls per sample, providers interleaved in rotating order after warm-up, medians;
"of copy" is the median per-round ratio of the provider's GB/s to the copy's. Targets:
ours >= 90% of the copy's bandwidth and faster than torch. Every provider is first checked
against torch's op on random gradients with an inf. Table 2 runs on the GPU with the
scalers on "cuda" and 64 x 2M parameters, each sample synchronized.
"""

from __future__ import annotations

import random
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp
from dispatch_amp.kernels import check_finite_, unscale_check_, uses_triton

from benchmarks.timing import interleaved, interleaved_events, ratio_stats

from .common import ESTIMATORS_NOTE, Table, device_of, free_device_memory, ratio_columns, verdict

NAME = "scaler"
INV_SCALE = 1.0 + 2.0**-20  # not 1.0 (torch may skip the multiply); values neither under- nor overflow
SYNC_TARGETS = {"1 SGD": 1, "2 SGDs": 1, "fused AdamW": 0}
TIME_TARGETS = {"1 SGD": 1.00, "2 SGDs": 1.00, "fused AdamW": 0.85}


class SyncCounter(TorchDispatchMode):
    """Counts device-to-host reads of a scalar (every host sync goes through _local_scalar_dense)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _sizes(quick: bool, device: torch.device = torch.device("cpu")):
    if device.type == "cuda":
        return (8, 64 * 1024) if quick else (64, 2 * 1024 * 1024)
    return (8, 64 * 1024) if quick else (64, 512 * 1024)


def _unscale_table(quick: bool, rounds: int) -> Table:
    n, numel = _sizes(quick)
    table = Table(
        f"scaler: unscale + check, {n} x {numel // 1024}K fp32 gradients (us per call, median of {rounds} interleaved rounds)",
        [("provider", "provider", "{}"), ("time_us", "time (us)", "{:.0f}"), ("gb_s", "GB/s", "{:.1f}"),
         *ratio_columns(label="ours/torch"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}")],
        note=ESTIMATORS_NOTE + " On CPU ours dispatches to torch's fused op (backend 'auto'); the read-only check moves half the bytes on a GPU.",
    )
    # One gradient list for all providers: the same memory, so placement cannot favour one.
    grads = [torch.ones(numel) for _ in range(n)]
    inv, found = torch.tensor(INV_SCALE), torch.zeros(())
    fns = {
        "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        "ours unscale_check_": lambda: unscale_check_(grads, inv, found),
        "ours check_finite_": lambda: check_finite_(grads, found),
    }
    s = interleaved(fns, rounds, warmup=1, calls=2 if quick else 10)
    for name, v in s.items():
        sec = statistics.median(v)
        table.rows.append({"provider": name, "n_tensors": n, "numel": numel, "time_us": sec * 1e6,
                           "gb_s": n * numel * 8 / sec / 1e9, **ratio_stats(v, s["torch"])})
    return table


def _setup(config: str, n: int, numel: int, device: torch.device = torch.device("cpu")):
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.ones(numel, device=device)
    if config == "1 SGD":
        opts = [torch.optim.SGD(params, lr=1e-9)]
    elif config == "2 SGDs":
        opts = [torch.optim.SGD(params[: n // 2], lr=1e-9), torch.optim.SGD(params[n // 2:], lr=1e-9)]
    else:
        opts = [torch.optim.AdamW(params, lr=1e-9, fused=True)]
    return params, opts


def _step_fn(kind: str, opts, device: torch.device = torch.device("cpu")):
    scaler = torch.amp.GradScaler(device.type) if kind == "torch" else dispatch_amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))  # creates the scale lazily, as the first scaled loss would

    def step():
        if kind == "ours" and len(opts) > 1:
            scaler.unscale_(*opts)  # one found_inf read for all optimizers
        for o in opts:
            scaler.step(o)
        scaler.update()

    return step


def step_table(quick: bool, rounds: int, device: torch.device = torch.device("cpu")) -> Table:
    """Scaler step + update, ours against ``torch.amp.GradScaler``, with 1 SGD, 2 SGDs and
    fused AdamW, and the host syncs of one step of each (``SyncCounter``).

    Example::

        table = step_table(quick=True, rounds=3)
    """
    n, numel = _sizes(quick, device)
    where = ", CUDA, each sample synchronized" if device.type == "cuda" else ""
    table = Table(
        f"scaler: step + update, {n} x {numel // 1024}K fp32 params (ms per step, median of {rounds} interleaved rounds{where})",
        [("optimizers", "optimizers", "{}"), ("torch_ms", "torch", "{:.2f}"), ("ours_ms", "ours", "{:.2f}"),
         *ratio_columns(label="ours/torch"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"),
         ("target", "target", "{}"), ("met", "met?", "{}"), ("torch_syncs", "host syncs torch", "{}"),
         ("ours_syncs", "host syncs ours", "{}"), ("sync_target", "target", "{}"), ("sync_met", "met?", "{}")],
        note=ESTIMATORS_NOTE + " Timed: the optimizer step(s) and the scaler's unscale/check, step and update; gradients refilled untimed.",
    )
    for config in ("1 SGD", "2 SGDs", "fused AdamW"):
        params, opts = _setup(config, n, numel, device)
        steps = {k: _step_fn(k, opts, device) for k in ("torch", "ours")}

        def refill(_name):
            with torch.no_grad():
                for p in params:
                    p.grad.fill_(1.0)

        s = interleaved(steps, rounds, warmup=2, setup=refill)
        syncs = {}
        for k, fn in steps.items():
            refill(k)
            with SyncCounter() as c:
                fn()
            syncs[k] = c.count
        st = ratio_stats(s["ours"], s["torch"])
        table.rows.append({
            "optimizers": config, "n_tensors": n, "numel": numel,
            "torch_ms": statistics.median(s["torch"]) * 1e3, "ours_ms": statistics.median(s["ours"]) * 1e3, **st,
            "target": f"<= {TIME_TARGETS[config]:.2f}", "met": verdict(st["ratio"], TIME_TARGETS[config]),
            "torch_syncs": syncs["torch"], "ours_syncs": syncs["ours"], "sync_target": SYNC_TARGETS[config],
            "sync_met": verdict(syncs["ours"], SYNC_TARGETS[config]),
        })
        del params, opts, steps
        free_device_memory(device)
    return table


# -- CUDA: the Triton kernel against torch's op and a copy ----------------------------------
def cuda_grad_sizes(quick: bool) -> list[int]:
    """200 gradient sizes (40 with --quick), ~1 GB of fp32 (64 MB), shuffled: large
    matrices, middle ones, and small ragged ones whose last tile is partial."""
    k = 1 << 20
    if quick:
        groups = [(8, 512 * 1024), (8, 128 * 1024), (8, 32 * 1024 + 17), (8, 1024 + 5), (8, 771)]
    else:
        groups = [(24, 8 * k), (24, 2 * k), (40, 512 * 1024 + 17), (56, 16 * 1024 + 5), (56, 771)]
    sizes = [n for count, n in groups for _ in range(count)]
    random.Random(0).shuffle(sizes)
    return sizes


def _check_against_torch(sizes, device) -> str:
    """'yes' when ours (unscale and read-only check) matches torch's op on random gradients
    with one inf, else what differs."""
    gen = torch.Generator(device=device).manual_seed(0)
    want = [torch.randn(n, device=device, generator=gen) for n in sizes]
    want[-1][-1] = float("inf")
    got = [g.clone() for g in want]
    inv = torch.tensor(0.5, device=device)
    f_want, f_got, f_check = (torch.zeros((), device=device) for _ in range(3))
    torch._amp_foreach_non_finite_check_and_unscale_(want, f_want, inv)
    unscale_check_(got, inv, f_got)
    check_finite_(got, f_check)
    if f_got.item() != f_want.item() or f_check.item() != 1.0:
        return f"NO (found_inf {f_got.item()} / check {f_check.item()}, torch {f_want.item()})"
    bad = sum(not torch.equal(a, b) for a, b in zip(got, want))
    return "yes" if bad == 0 else f"NO ({bad} tensors differ)"


def unscale_vs_copy_table(quick: bool, rounds: int, device: torch.device = torch.device("cuda")) -> Table:
    """Ours (Triton on CUDA) against torch's fused op and a device copy of the same bytes, on
    ``cuda_grad_sizes(quick)`` gradients. On CUDA, CUDA events around the calls; elsewhere
    (the GPU check's dry run) the host clock, and ours is torch's op there.

    Example::

        table = unscale_vs_copy_table(quick=False, rounds=21)  # ~1 GB of gradients on the GPU
    """
    sizes = cuda_grad_sizes(quick)
    total = sum(sizes)
    calls = 2 if quick else 5
    gb = total * 4 / 1e9
    clock = "CUDA events" if device.type == "cuda" else "the host clock"
    table = Table(
        f"scaler: unscale + check on {device.type.upper()}, {len(sizes)} fp32 gradients of mixed sizes, {gb:.2f} GB "
        f"(us per call: {clock} around {calls} calls, median of {rounds} interleaved rounds)"
        + (" (quick sizes: a smoke test, not a measurement)" if quick else ""),
        [("provider", "provider", "{}"), ("time_us", "time (us)", "{:.0f}"), ("gb_moved", "GB moved", "{:.2f}"),
         ("gb_s", "GB/s", "{:.0f}"), ("of_copy", "of copy GB/s", "{:.1%}"), *ratio_columns(label="time / torch"),
         ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"), ("target", "target", "{}"),
         ("met", "met?", "{}"), ("matches", "matches torch", "{}")],
        note=ESTIMATORS_NOTE + " GB moved = bytes read + bytes written (copy and unscale: 2 x 4 bytes per element; the read-only check: 4). "
             "'of copy GB/s' = median per-round (provider GB/s) / (copy GB/s). Targets for ours unscale_check_: "
             ">= 90% of the copy's GB/s and time / torch < 1.00.",
    )
    matches = _check_against_torch(cuda_grad_sizes(True), device)
    grads = [torch.ones(n, device=device) for n in sizes]
    src = torch.ones(total, device=device)
    dst = torch.empty_like(src)
    inv, found = torch.tensor(INV_SCALE, device=device), torch.zeros((), device=device)
    triton_path = uses_triton(device)
    if triton_path:
        path = "Triton"
    else:  # off CUDA backend "auto" is torch's fused op by design; on CUDA only without triton
        path = "torch fallback: no triton" if device.type == "cuda" else f"torch's op on {device.type}"
    ours = f"ours unscale_check_ ({path})"
    fns = {
        "copy (same bytes, device to device)": lambda: dst.copy_(src),
        "torch _amp_foreach_non_finite_check_and_unscale_": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        ours: lambda: unscale_check_(grads, inv, found),
        "ours check_finite_ (read-only)": lambda: check_finite_(grads, found),
    }
    moved = {name: total * (4 if "read-only" in name else 8) for name in fns}
    timer = interleaved_events if device.type == "cuda" else interleaved
    s = timer(fns, rounds, warmup=2, calls=calls)
    copy_name, torch_name = list(fns)[:2]
    if found.item() != 0.0:
        matches = "NO (found_inf raised on finite gradients)"
    for name, v in s.items():
        sec = statistics.median(v)
        of_copy = statistics.median((moved[name] / t) / (moved[copy_name] / c) for t, c in zip(v, s[copy_name]))
        row = {"provider": name, "n_tensors": len(sizes), "numel": total, "time_us": sec * 1e6,
               "gb_moved": moved[name] / 1e9, "gb_s": moved[name] / sec / 1e9, "of_copy": of_copy, "rounds": rounds,
               "calls_per_sample": calls}
        if name != copy_name:
            row.update(ratio_stats(v, s[torch_name]))
        if name == ours:
            row.update(target=">= 90% of copy, < 1.00 x torch", matches=matches,
                       met=verdict(0 if of_copy >= 0.90 and row["ratio"] < 1.0 else 1, 0))
        elif name.startswith("ours"):
            row["matches"] = matches
        table.rows.append(row)
    del grads, src, dst
    free_device_memory(device)
    return table


def run(opts):
    device = device_of(opts)
    rounds = 3 if opts.quick else 21
    if device.type == "cuda":
        yield unscale_vs_copy_table(opts.quick, rounds, device)
    else:
        yield _unscale_table(opts.quick, rounds)
    yield step_table(opts.quick, rounds, device)
