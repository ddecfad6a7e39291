"""benchmarks/fp8_kernel_count.py: kernels per fp8 linear forward + backward on the CUDA path,
within the target at the GPU benchmark's size, and the recorded sequence is the one that
really runs (through Triton's interpreter at a small size)."""

import contextlib
import importlib
import os
import pathlib
import sys

import pytest
import torch

from dispatch_amp import _torch_compat
from dispatch_amp.kernels import fp8_cast


@contextlib.contextmanager
def _repo_on_path():
    root = str(pathlib.Path(__file__).resolve().parents[1])
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        yield
    finally:
        if added:
            sys.path.remove(root)


@pytest.fixture(scope="module")
def counter():
    with _repo_on_path():
        return importlib.import_module("benchmarks.fp8_kernel_count")


@pytest.mark.parametrize("recipe", ["current", "delayed", "delayed (first call)"])
def test_per_tensor_recipes_are_within_the_target_at_full_size(counter, recipe):
    counts = counter.count_kernels(recipe)
    assert counts["kernels"] <= counter.TARGET, counts
    assert counts["host_reads"] == 0
    assert counts["torch"].count("_scaled_mm") == 3  # the forward gemm and the two gradients
    assert "_cast_transpose_dbias_kernel" in counts["triton"]  # the bias gradient: no pass of its own


def test_block_scaling_is_within_the_target_at_full_size(counter):
    counts = counter.count_kernels("block")
    assert counts["kernels"] <= counter.TARGET, counts
    assert counts["host_reads"] == 0
    assert counts["torch"].count("_scaled_mm_v2") == 3  # scaled_mm with block scales: the three gemms
    # One read each of x (both layouts), of the weight (w and w.T) and of dy (both layouts).
    assert counts["triton"].count("_block_kernel") == 3


needs_triton = pytest.mark.skipif(
    fp8_cast.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton, and TRITON_INTERPRET=1 without a GPU")


@needs_triton
def test_block_scalings_recorded_launches_are_the_ones_that_run(counter):
    # torch's CPU scaled_mm has no block scales: on a CPU the gemms run by their rule, so
    # the Triton launches are compared, not the torch operators around the gemms.
    full = counter.count_kernels("block")
    small = counter.count_kernels("block", (128, 256, 384), device="cpu")
    assert small["triton"] == full["triton"]


@needs_triton
@pytest.mark.parametrize("recipe", [
    "current", "delayed", "delayed (first call)",
    # torch 2.11's CPU _scaled_mm takes per-tensor scales only: there rowwise's gemms run by
    # their rule on CPU (docs/torch-releases.md), not the sequence the CUDA path records.
    pytest.param("rowwise", marks=pytest.mark.skipif(
        not _torch_compat.SCALED_MM_ROWWISE_ON_CPU,
        reason="this torch's CPU _scaled_mm has no row-wise scales: rowwise runs its gemms by rule on CPU")),
])
def test_the_recorded_sequence_is_the_one_that_runs(counter, recipe):
    full = counter.count_kernels(recipe)
    small = counter.count_kernels(recipe, (64, 128, 256), device="cpu")
    assert (small["triton"], small["torch"]) == (full["triton"], full["torch"])


def test_the_table_lists_every_recipe(counter):
    counts = {name: counter.count_kernels(name, (64, 128, 256)) for name in counter.RECIPES}
    table = counter.table(counts)
    assert table.count("\n") == 1 + len(counter.RECIPES)
    assert all(f"| {name} | {c['kernels']} |" in table for name, c in counts.items())
