"""What bounds our speed on CPU: the parts of each cost that are not ours to remove.

    python benchmarks/bench_bounds.py [--quick]

Each measurement interleaved (A B C, rotating order), medians after warm-up:

1. **Per op** (``torch.mm`` 8x8, bf16 autocast): native autocast; ours; ours on an op
   whose kernel runs it as given (a policy without ``mm``: the floor of any kernel of
   ours, the dispatcher calling into Python and back); a cast issued from Python
   (``t.bfloat16()``); the bf16 mm itself.
2. **Model forwards** (benchmarks.models.CNN, batch 32, and the overhead-bound
   ResidualMLP, 24 x Linear 64, batch 16; grad mode): native and ours.
3. **One cast issued from Python**, by what is cast (a weight: a Parameter that requires
   grad; an activation: a tensor that requires grad; a plain tensor), which native makes
   inside C++.
4. **Read-only finite check on CPU**, 64 x 512K fp32 gradients: torch's fused
   unscale-and-check op (reads and writes) against read-only torch alternatives, to show
   why the fused-optimizer path keeps the fused op on CPU.
5. **Small ops right after a backward**: the scaler's per-step device ops (scale update,
   history row, trackers) timed first thing after a CNN backward and again warm; on CPU
   their count, not their work, is what an ``update()`` costs.
6. **Compiled step**: calls into our Python while a ``torch.compile``'d ResidualMLP step
   runs (0: the compiled code never calls back).

Prints Markdown tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import dispatch_amp as amp  # noqa: E402
from benchmarks.models import CNN, ResidualMLP  # noqa: E402
from benchmarks.suites.common import Table  # noqa: E402
from benchmarks.suites.host_cost import PythonEntries  # noqa: E402
from benchmarks.timing import interleaved, once  # noqa: E402

CONTEXTS = {
    "native": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "ours": lambda: amp.autocast("cpu", dtype=torch.bfloat16),
}
# A policy of our own without mm: mm keeps a kernel of ours (native registers it), which
# runs it as given.
_WITHOUT_MM = amp.Policy.for_device("cpu").without_ops("mm", name="cpu without mm")


def markdown(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A titled Markdown table (``benchmarks.suites.common.Table``) of preformatted cells."""
    return Table(title, [(i, h, "{}") for i, h in enumerate(header)], [dict(enumerate(r)) for r in rows]).markdown()


def interleaved_us(fns: dict, number: int, rounds: int, regions: dict | None = None) -> dict:
    """Median microseconds per call of each fn: ``number`` calls per sample, inside one
    ``regions[name]()`` where given, rounds interleaved in rotating order after a warm-up
    sample (``benchmarks.timing``)."""
    regions = regions or {}

    def inside(name):
        return regions[name]() if name in regions else contextlib.nullcontext()

    s = interleaved(fns, rounds, calls=number, inside=inside)
    return {k: statistics.median(v) * 1e6 for k, v in s.items()}


def per_op(quick: bool) -> str:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ab, bb = a.bfloat16(), b.bfloat16()

    fns = {k: (lambda: torch.mm(a, b)) for k in CONTEXTS}
    fns["ours, mm run as given (a kernel's floor)"] = lambda: torch.mm(a, b)
    fns["no autocast, fp32 mm"] = lambda: torch.mm(a, b)
    fns["t.bfloat16() (one cast from Python)"] = lambda: a.bfloat16()
    fns["bf16 mm, inputs already bf16"] = lambda: torch.mm(ab, bb)
    regions = {**CONTEXTS, "ours, mm run as given (a kernel's floor)":
               lambda: amp.autocast("cpu", dtype=torch.bfloat16, policy=_WITHOUT_MM)}
    got = interleaved_us(fns, 2000 if quick else 20000, 3 if quick else 9, regions)
    return markdown("per op: torch.mm 8x8 under bf16 autocast (us per call)", ["what", "us"], [[k, f"{v:.2f}"] for k, v in got.items()])


def _forward(title: str, model, x, y, quick: bool) -> str:
    def forward_in(ctx):  # a fresh context per forward, as in training
        def body():
            with ctx():
                model.loss(x, y)
        return body

    fns = {k: forward_in(ctx) for k, ctx in CONTEXTS.items()}
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


def python_casts(quick: bool) -> str:
    """What one cast costs when issued from Python, by what is cast."""
    layer = torch.nn.Linear(64, 64)
    act = torch.randn(16, 64, requires_grad=True) * 1  # a non-leaf activation
    plain = torch.randn(16, 64)
    fns = {
        "weight (Parameter, requires grad).bfloat16()": lambda: layer.weight.bfloat16(),
        "activation (requires grad).bfloat16()": lambda: act.bfloat16(),
        "plain tensor.bfloat16()": lambda: plain.bfloat16(),
    }
    got = interleaved_us(fns, 2000 if quick else 20000, 3 if quick else 9)
    return markdown("one cast issued from Python (us per call)", ["cast", "us"], [[k, f"{v:.2f}"] for k, v in got.items()])


def compiled_calls(quick: bool) -> str:
    """Calls into our Python while a compiled ResidualMLP forward + loss runs."""
    import torch._dynamo

    torch.manual_seed(0)
    model = ResidualMLP(depth=4 if quick else 24)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    loss = torch.compile(model.loss, backend="aot_eager" if quick else "inductor")
    with amp.autocast("cpu", dtype=torch.bfloat16):
        loss(x, y)  # compile
    try:
        with amp.autocast("cpu", dtype=torch.bfloat16):
            with PythonEntries() as entries:
                loss(x, y)
    finally:
        torch._dynamo.reset()
    rows = [[k, str(v)] for k, v in entries.by_function.most_common()] + [["total", str(entries.count)]]
    return markdown("calls into our Python while one compiled ResidualMLP forward runs", ["function", "count"], rows)


def readonly_check(quick: bool) -> str:
    n_tensors, numel = (8, 64 * 1024) if quick else (64, 512 * 1024)
    torch.manual_seed(0)
    grads = [torch.randn(numel) for _ in range(n_tensors)]
    found, one = torch.zeros(()), torch.ones(())

    fns = {
        "torch._amp_foreach_non_finite_check_and_unscale_ (read + write)":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
        "torch.aminmax per tensor (read only)":
            lambda: found.copy_(torch.stack([torch.stack(torch.aminmax(g)) for g in grads]).isfinite().all().logical_not()),
        "torch._foreach_norm(inf) (read only)":
            lambda: found.copy_(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all().logical_not()),
    }
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
                times[name].append(once(op))
    skip = 3 if quick else 10
    rows = [[k, f"{statistics.median(cold[k][skip:]) * 1e6:.1f}", f"{statistics.median(warm[k][skip:]) * 1e6:.1f}"] for k in ops]
    return markdown("small ops right after a backward vs warm (us)", ["op", "after backward", "warm"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke test)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    for part in (per_op, cnn_forward, mlp_forward, python_casts, readonly_check, cold_small_ops, compiled_calls):
        print(part(args.quick), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
