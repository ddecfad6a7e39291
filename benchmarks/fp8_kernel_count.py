"""Kernels per fp8 linear forward + backward on the CUDA path, counted on a CPU.

The CUDA path (the Triton kernels of ``kernels/``, the gemms through ``torch._scaled_mm``,
which the CPU path replaces by their rule) is forced and run on meta tensors at the GPU
benchmark's full size (4096 x 8192 x 16384, bf16 input, float32 weight and bias): the
torch operators are recorded with a dispatch mode (every operator that launches work on a
GPU: not views, not allocations), and the Triton launches are counted at the launcher
(``kernels/_launch.py``), which records them without running them. The counted call is a
training step's: a new version of the weight (an optimizer step came before), so the
weight is quantized again, after a warm-up call; delayed scaling once the host knows its
sites have scales (its steady state), and, separately, its first call.

    python -m benchmarks.fp8_kernel_count              # the table
    python -m benchmarks.fp8_kernel_count --check      # and the same sequence, really run
                                                       # at a small size in Triton's interpreter

``count_kernels(recipe_name)`` returns one recipe's counts (``RECIPES`` names them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os

if __name__ == "__main__":  # the interpreter reads this at import; on a GPU nothing needs it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch_amp import _markdown, fp8
from dispatch_amp.fp8 import _block_gemm, _gemms, fp8_linear
from dispatch_amp.kernels import fp8_quantize
from dispatch_amp.kernels._launch import counting_launches

__all__ = ["RECIPES", "FULL_SIZE", "TARGET", "count_kernels", "table", "main"]

RECIPES = {
    "current": fp8.CurrentScaling,
    "delayed": fp8.DelayedScaling,
    "delayed (first call)": fp8.DelayedScaling,
    "rowwise": fp8.RowwiseScaling,
    "block": fp8.BlockScaling,
}
FULL_SIZE = (4096, 8192, 16384)  # M x K x N
TARGET = 20
# Operators that launch nothing on a GPU: allocations and metadata.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh"}


class _Ops(TorchDispatchMode):
    """Records the operators that launch a kernel (and host reads, which should be none)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
        elif not (getattr(func, "is_view", False) or name in _NO_KERNEL):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _cuda_path(device: str = "meta"):
    previous = fp8_quantize.BACKEND, _gemms.BY_RULE_ON, _block_gemm.BY_RULE_ON
    fp8_quantize.BACKEND = "triton"  # what "auto" picks on CUDA
    _gemms.BY_RULE_ON = frozenset()  # and torch._scaled_mm, also for the real run on a CPU
    if device == "meta":  # and scaled_mm's block-scaled gemms, which torch's CPU kernel lacks
        _block_gemm.BY_RULE_ON = frozenset()
    try:
        yield
    finally:
        fp8_quantize.BACKEND, _gemms.BY_RULE_ON, _block_gemm.BY_RULE_ON = previous


def _optimizer_step(x, weight, bias) -> None:
    # New versions of the weight and the bias: they are quantized and cast again.
    with torch.no_grad():
        weight.add_(0.0)
        bias.add_(0.0)
    x.grad = weight.grad = bias.grad = None


def _linear_step(recipe, x, weight, bias, dy):
    # What the engine calls for an eligible F.linear in a bf16 region (native autocast off).
    y = fp8_linear(x, weight, bias, recipe, torch.bfloat16, recipe.state.site(weight), "forward")
    y.backward(dy)


def _tensors(m: int, k: int, n: int, device: str):
    g = torch.Generator().manual_seed(0)
    make = (lambda *shape: torch.empty(*shape, device="meta")) if device == "meta" else (
        lambda *shape: torch.randn(*shape, generator=g))
    x = make(m, k).to(torch.bfloat16).requires_grad_()
    weight = torch.nn.Parameter(make(n, k) / k ** 0.5)
    bias = torch.nn.Parameter(make(n))
    dy = make(m, n).to(torch.bfloat16)
    return x, weight, bias, dy


def count_kernels(recipe_name: str, size: tuple[int, int, int] = FULL_SIZE, device: str = "meta") -> dict:
    """``{"kernels": n, "triton": [launches], "torch": [operators], "host_reads": n}`` for
    one fp8 linear forward + backward of ``recipe_name`` (a key of ``RECIPES``) on the CUDA
    path. ``device="meta"``: recorded, the launches counted without running (any size);
    ``"cpu"``: run for real, the launches through Triton's interpreter (small sizes).

    Example::

        counts = count_kernels("delayed")
        counts["kernels"], counts["triton"]
    """
    recipe = RECIPES[recipe_name]()
    x, weight, bias, dy = _tensors(*size, device)
    with _cuda_path(device), counting_launches(dry=device == "meta"):
        if recipe_name == "delayed (first call)":
            recipe.state.prepare(recipe.state.site(weight), weight.device)  # the state bind would make
        else:
            _linear_step(recipe, x, weight, bias, dy)  # warm-up: the site's state is made
        if recipe_name == "delayed":
            for state in recipe.state.lookup(weight).roles.values():
                state.ready = True  # what the host learns from its copies after the first call
        _optimizer_step(x, weight, bias)
        ops = _Ops()
        with counting_launches(dry=device == "meta") as launches, ops:
            _linear_step(recipe, x, weight, bias, dy)
    return {"kernels": len(ops.ops) + len(launches), "triton": list(launches), "torch": ops.ops,
            "host_reads": ops.host_reads}


def table(counts: dict) -> str:
    """Markdown: per recipe the kernels in all, the Triton launches and torch operators by
    name, and the host reads."""
    def summary(names):
        return ", ".join(f"{op} x{k}" if k > 1 else op for op, k in collections.Counter(names).items())

    rows = [[name, c["kernels"], f"<= {TARGET}", summary(c["triton"]), summary(c["torch"]), c["host_reads"]]
            for name, c in counts.items()]
    return _markdown.table(["recipe", "kernels", "target", "Triton launches", "torch operators", "host reads"],
                           rows, align="lrrllr")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="also run each recipe at 64 x 128 x 256 in Triton's interpreter and compare the sequences")
    args = p.parse_args(argv)
    m, k, n = FULL_SIZE
    counts = {name: count_kernels(name) for name in RECIPES}
    print(f"fp8 linear forward + backward, CUDA path, {m} x {k} x {n} (M x K x N), bf16 input, fp32 weight "
          f"and bias, a training step (new weight version); meta tensors, Triton launches counted at the launcher")
    print()
    print(table(counts))
    if args.check:
        for name, full in counts.items():
            small = count_kernels(name, (64, 128, 256), device="cpu")
            same = small["triton"] == full["triton"] and small["torch"] == full["torch"]
            print(f"{name}: interpreted at 64 x 128 x 256: {small['kernels']} kernels, "
                  f"{'the same sequence' if same else 'A DIFFERENT SEQUENCE'}")


if __name__ == "__main__":
    main()
