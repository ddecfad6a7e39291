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
"""

from __future__ import annotations

import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp
from dispatch_amp.kernels import check_finite_, unscale_check_

from .common import Table, interleaved, ratio_stats, verdict

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


def _sizes(quick: bool):
    return (8, 64 * 1024) if quick else (64, 512 * 1024)


def _unscale_table(quick: bool, rounds: int) -> Table:
    n, numel = _sizes(quick)
    table = Table(
        f"scaler: unscale + check, {n} x {numel // 1024}K fp32 gradients (us per call, median of {rounds} interleaved rounds)",
        [("provider", "provider", "{}"), ("time_us", "time (us)", "{:.0f}"), ("gb_s", "GB/s", "{:.1f}"),
         ("ratio", "ours/torch", "{:.3f}"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}")],
        note="On CPU ours dispatches to torch's fused op (backend 'auto'); the read-only check moves half the bytes on a GPU.",
    )
    # One gradient list for all providers: the same memory, so placement cannot favour one.
    grads = [torch.ones(numel) for _ in range(n)]
    inv, found = torch.tensor(INV_SCALE), torch.zeros(())
    fns = {
        "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        "ours unscale_check_": lambda: unscale_check_(grads, inv, found),
        "ours check_finite_": lambda: check_finite_(grads, found),
    }
    reps = 2 if quick else 10  # calls per sample

    def repeat(fn):
        return lambda: [fn() for _ in range(reps)]

    s = interleaved({k: repeat(f) for k, f in fns.items()}, rounds, warmup=1)
    for name, v in s.items():
        sec = statistics.median(v) / reps
        table.rows.append({"provider": name, "n_tensors": n, "numel": numel, "time_us": sec * 1e6,
                           "gb_s": n * numel * 8 / sec / 1e9, **ratio_stats(v, s["torch"])})
    return table


def _setup(config: str, n: int, numel: int):
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    for p in params:
        p.grad = torch.ones(numel)
    if config == "1 SGD":
        opts = [torch.optim.SGD(params, lr=1e-9)]
    elif config == "2 SGDs":
        opts = [torch.optim.SGD(params[: n // 2], lr=1e-9), torch.optim.SGD(params[n // 2:], lr=1e-9)]
    else:
        opts = [torch.optim.AdamW(params, lr=1e-9, fused=True)]
    return params, opts


def _step_fn(kind: str, opts):
    scaler = torch.amp.GradScaler("cpu") if kind == "torch" else dispatch_amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # creates the scale lazily, as the first scaled loss would

    def step():
        if kind == "ours" and len(opts) > 1:
            scaler.unscale_(*opts)  # one found_inf read for all optimizers
        for o in opts:
            scaler.step(o)
        scaler.update()

    return step


def _step_table(quick: bool, rounds: int) -> Table:
    n, numel = _sizes(quick)
    table = Table(
        f"scaler: step + update, {n} x {numel // 1024}K fp32 params (ms per step, median of {rounds} interleaved rounds)",
        [("optimizers", "optimizers", "{}"), ("torch_ms", "torch", "{:.2f}"), ("ours_ms", "ours", "{:.2f}"),
         ("ratio", "ours/torch", "{:.3f}"), ("ratio_min", "min", "{:.3f}"), ("ratio_max", "max", "{:.3f}"),
         ("target", "target", "{}"), ("met", "met?", "{}"), ("torch_syncs", "host syncs torch", "{}"),
         ("ours_syncs", "host syncs ours", "{}"), ("sync_target", "target", "{}"), ("sync_met", "met?", "{}")],
        note="Timed: the optimizer step(s) and the scaler's unscale/check, step and update; gradients refilled untimed.",
    )
    for config in ("1 SGD", "2 SGDs", "fused AdamW"):
        params, opts = _setup(config, n, numel)
        steps = {k: _step_fn(k, opts) for k in ("torch", "ours")}

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
    return table


def run(opts) -> list[Table]:
    rounds = 3 if opts.quick else 21
    return [_unscale_table(opts.quick, rounds), _step_table(opts.quick, rounds)]
