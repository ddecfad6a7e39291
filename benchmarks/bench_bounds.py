"""What bounds our speed on CPU: the parts of each cost that are not ours to remove.

    python benchmarks/bench_bounds.py [--quick]

Three measurements, each interleaved (A B C, rotating order), medians after warm-up:

1. **Per op** (``torch.mm`` 8x8, bf16 autocast): native autocast; the same with an empty
   ``TorchFunctionMode`` on top (what any Python-level mode costs); ours. Plus the two
   pieces ours cannot avoid on top of the mode: a cast issued from Python
   (``t.bfloat16()``) and the bf16 mm itself.
2. **Model forwards** (benchmarks.models.CNN, batch 32, and the overhead-bound
   ResidualMLP, 24 x Linear 64, batch 16; grad mode): native, native + empty
   ``TorchFunctionMode``, ours: how much of our overhead any Python mode pays, and the
   cost of the casts ours issues from Python (a weight: a Parameter that requires grad;
   an activation: a tensor that requires grad), which native makes inside C++.
3. **Read-only finite check on CPU**, 64 x 512K fp32 gradients: torch's fused
   unscale-and-check op (reads and writes) against read-only torch alternatives, to show
   why the fused-optimizer path keeps the fused op on CPU.
4. **Small ops right after a backward**: the scaler's per-step device ops (scale update,
   history row, trackers) timed first thing after a CNN backward and again warm; on CPU
   their count, not their work, is what an ``update()`` costs.

5. **The mode floor by kind of call**: a C function (``torch.mm``), a torch Python
   wrapper (``F.silu``) and a module (``BatchNorm2d``), with and without an empty
   ``TorchFunctionMode``: Python wrappers reach a mode through torch's Python
   ``handle_torch_function`` and then run again, so they pay more.
6. **Compiled step**: how many calls of a ``torch.compile``'d ResidualMLP step reach our
   function level while the compiled code runs (AOTAutograd's runtime checks, inductor's
   extern kernels); each pays the floor of any Python mode (part 1).

Prints Markdown tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import dispatch_amp as amp  # noqa: E402
from benchmarks.models import CNN, ResidualMLP  # noqa: E402
from dispatch_amp import _engine  # noqa: E402


class EmptyMode(TorchFunctionMode):
    """A TorchFunctionMode that only forwards: the floor of any Python-level mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def native_plus_empty_mode():
    with torch.autocast("cpu", dtype=torch.bfloat16), EmptyMode():
        yield


CONTEXTS = {
    "native": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "native + empty mode": native_plus_empty_mode,
    "ours": lambda: amp.autocast("cpu", dtype=torch.bfloat16),
}


def markdown(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A titled Markdown table; the first column left-aligned, the others right-aligned."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def repeated(body, ctx=contextlib.nullcontext):
    """``run(n)``: seconds for ``n`` calls of ``body`` inside one ``ctx()``."""

    def run(n):
        with ctx():
            return timeit.timeit(body, number=n)

    return run


def interleaved_us(fns: dict, number: int, rounds: int) -> dict:
    """Median microseconds per call of each fn, rounds interleaved in rotating order."""
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            times[k].append(fns[k](number) / number * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def per_op(quick: bool) -> str:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ab, bb = a.bfloat16(), b.bfloat16()

    fns = {k: repeated(lambda: torch.mm(a, b), ctx) for k, ctx in CONTEXTS.items()}
    fns["t.bfloat16() (one cast from Python)"] = repeated(lambda: a.bfloat16())
    fns["bf16 mm, inputs already bf16"] = repeated(lambda: torch.mm(ab, bb))
    got = interleaved_us(fns, 2000 if quick else 20000, 3 if quick else 9)
    return markdown("per op: torch.mm 8x8 under bf16 autocast (us per call)", ["what", "us"], [[k, f"{v:.2f}"] for k, v in got.items()])


def _forward(title: str, model, x, y, quick: bool) -> str:
    def forward_in(ctx):  # a fresh context per forward, as in training
        def body():
            with ctx():
                model.loss(x, y)
        return body

    fns = {k: repeated(forward_in(ctx)) for k, ctx in CONTEXTS.items()}
    for f in fns.values():  # warm-up
        f(3)
    got = interleaved_us(fns, 1, 15 if quick else 90)
    base = got["native"]
    rows = [[k, f"{v / 1e3:.3f}", f"{(v - base) / 1e3:+.3f}"] for k, v in got.items()]
    return markdown(f"{title} forward + loss, grad mode (ms)", ["context", "ms", "minus native"], rows)


def cnn_forward(quick: bool) -> str:
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return _forward("CNN, batch 32", CNN(), x, y, quick)


def mlp_forward(quick: bool) -> str:
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    return _forward("ResidualMLP 24 x Linear 64, batch 16 (75 torch calls)", ResidualMLP(), x, y, quick)


def mode_floor(quick: bool) -> str:
    """What an empty TorchFunctionMode adds per call, by kind of call."""
    x, w = torch.randn(16, 64), torch.randn(64, 64)
    bn, image = torch.nn.BatchNorm2d(8), torch.randn(4, 8, 8, 8)
    calls = {
        "torch.mm (a C function)": lambda: torch.mm(x, w),
        "F.silu (a Python wrapper)": lambda: torch.nn.functional.silu(x),
        "BatchNorm2d, training (a module)": lambda: bn(image),
    }
    fns = {}
    for name, body in calls.items():
        fns[(name, "without")] = repeated(body)
        fns[(name, "with")] = repeated(body, EmptyMode)
    got = interleaved_us(fns, 300 if quick else 3000, 3 if quick else 9)
    rows = [
        [name, f"{got[(name, 'without')]:.2f}", f"{got[(name, 'with')]:.2f}", f"{got[(name, 'with')] - got[(name, 'without')]:+.2f}"]
        for name in calls
    ]
    return markdown("an empty TorchFunctionMode, per call (us)", ["call", "without", "with", "added"], rows)


def python_casts(quick: bool) -> str:
    """What one cast costs when issued from Python, by what is cast."""
    layer = torch.nn.Linear(64, 64)
    act = torch.randn(16, 64, requires_grad=True) * 1  # a non-leaf activation
    plain = torch.randn(16, 64)
    fns = {
        "weight (Parameter, requires grad).bfloat16()": repeated(lambda: layer.weight.bfloat16()),
        "activation (requires grad).bfloat16()": repeated(lambda: act.bfloat16()),
        "plain tensor.bfloat16()": repeated(lambda: plain.bfloat16()),
    }
    got = interleaved_us(fns, 2000 if quick else 20000, 3 if quick else 9)
    return markdown("one cast issued from Python (us per call)", ["cast", "us"], [[k, f"{v:.2f}"] for k, v in got.items()])


def compiled_calls(quick: bool) -> str:
    """Calls of a compiled ResidualMLP step that reach our function level at run time."""
    import torch._dynamo

    torch.manual_seed(0)
    model = ResidualMLP(depth=4 if quick else 24)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    loss = torch.compile(model.loss, backend="aot_eager" if quick else "inductor")
    with amp.autocast("cpu", dtype=torch.bfloat16):
        loss(x, y)  # compile
    seen: dict[str, int] = {}
    handler = _engine._FunctionLevel.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        seen[name] = seen.get(name, 0) + 1
        return handler(self, func, types, args, kwargs)

    _engine._FunctionLevel.__torch_function__ = counting
    try:
        with amp.autocast("cpu", dtype=torch.bfloat16):
            loss(x, y)
    finally:
        _engine._FunctionLevel.__torch_function__ = handler
        torch._dynamo.reset()
    rows = [[k, str(v)] for k, v in sorted(seen.items(), key=lambda kv: -kv[1])] + [["total", str(sum(seen.values()))]]
    return markdown("calls of one compiled ResidualMLP forward that reach our function level", ["call", "count"], rows)


def readonly_check(quick: bool) -> str:
    n_tensors, numel = (8, 64 * 1024) if quick else (64, 512 * 1024)
    torch.manual_seed(0)
    grads = [torch.randn(numel) for _ in range(n_tensors)]
    found, one = torch.zeros(()), torch.ones(())

    fns = {
        "torch._amp_foreach_non_finite_check_and_unscale_ (read + write)": repeated(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        ),
        "torch.aminmax per tensor (read only)": repeated(
            lambda: found.copy_(torch.stack([torch.stack(torch.aminmax(g)) for g in grads]).isfinite().all().logical_not())
        ),
        "torch._foreach_norm(inf) (read only)": repeated(
            lambda: found.copy_(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all().logical_not())
        ),
    }
    for f in fns.values():
        f(1)
    got = interleaved_us(fns, 1, 3 if quick else 9)
    rows = [[k, f"{v / 1e3:.2f}"] for k, v in got.items()]
    return markdown(f"finite check of {n_tensors} x {numel} fp32 gradients on CPU (ms)", ["method", "ms"], rows)


def cold_small_ops(quick: bool) -> str:
    """The scaler's per-step device ops, timed right after a CNN backward and again warm."""
    torch.manual_seed(0)
    model = CNN()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    history = torch.zeros(16, 2)
    scale, found = torch.tensor(65536.0), torch.tensor(0.0)
    tracker = torch.zeros((), dtype=torch.int32)
    growth = torch.zeros((), dtype=torch.int32)
    skipped = torch.zeros((), dtype=torch.int64)
    ops = {
        "torch._amp_update_scale_ (torch's whole update)": lambda: torch._amp_update_scale_(scale, growth, found, 2.0, 0.5, 2000),
        "history row: torch.stack(out=)": lambda: torch.stack((scale, found), out=history[3]),
        "hysteresis tracker: torch.eq(out=)": lambda: torch.eq(found, 0, out=tracker),
        "skip count: add_ + sub_": lambda: skipped.add_(1).sub_(tracker),
    }
    cold = {k: [] for k in ops}
    warm = {k: [] for k in ops}
    for step in range(10 if quick else 60):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(x, y)
        loss.backward()
        for times in (cold, warm):  # first pass right after the backward, second warm
            for name, op in ops.items():
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
    skip = 3 if quick else 10
    rows = [[k, f"{statistics.median(cold[k][skip:]) * 1e6:.1f}", f"{statistics.median(warm[k][skip:]) * 1e6:.1f}"] for k in ops]
    return markdown("small ops right after a backward vs warm (us)", ["op", "after backward", "warm"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke test)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for part in (per_op, cnn_forward, mlp_forward, mode_floor, python_casts, readonly_check, cold_small_ops, compiled_calls):
        print(part(args.quick), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
