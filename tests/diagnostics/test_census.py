"""PrecisionCensus: counts match a hand count on a tiny model."""

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.diagnostics.census import PrecisionCensus


def tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_counts_match_a_hand_count_on_a_tiny_model():
    model = tiny()
    x = torch.randn(5, 8)
    with PrecisionCensus() as census:
        with amp.autocast("cpu"):
            model(x)
    counts = census.as_dict()
    # Two linears: addmm (5x8 @ 8x16) and (5x16 @ 16x4), 2*M*N*K FLOPs each, in bf16.
    assert census.flops_by_dtype() == {torch.bfloat16: 2 * 5 * 8 * 16 + 2 * 5 * 16 * 4}
    assert census.matmul_flops_fraction(torch.bfloat16) == 1.0
    addmm = [op for op in counts["ops"] if op["op"] == "addmm"]
    assert addmm == [{"op": "addmm", "dtype": "torch.bfloat16", "calls": 2,
                      "flops": 2 * 5 * 8 * 16 + 2 * 5 * 16 * 4, "cast_bytes": 0}]
    # Casts to bf16: x (5x8), W1 (16x8), b1 (16), W2 (4x16), b2 (4); 2 bytes per element.
    elements = 5 * 8 + 16 * 8 + 16 + 4 * 16 + 4
    assert census.cast_bytes == 2 * elements
    assert "100.0% of matmul FLOPs ran in torch.bfloat16" in census.summary()


def test_fp32_run_is_reported_as_fp32_and_without_casts():
    model = tiny()
    with PrecisionCensus() as census:
        model(torch.randn(3, 8))
    assert census.matmul_flops_fraction(torch.float32) == 1.0
    assert census.cast_bytes == 0


def test_backward_and_table():
    model = tiny()
    with PrecisionCensus() as census:
        with amp.autocast("cpu"):
            loss = model(torch.randn(3, 8)).float().sum()
        loss.backward()
    table = census.table()
    assert table.splitlines()[0] == "| op | dtype | calls | FLOPs | cast bytes |"
    # backward matmuls run in bf16 too, and their grads are cast back to fp32 weights
    assert census.matmul_flops_fraction(torch.bfloat16) == 1.0
    assert any(op["op"] == "_to_copy" and op["dtype"] == "torch.bfloat16" and op["cast_bytes"]
               for op in census.as_dict()["ops"])


def test_census_does_not_change_results():
    model = tiny()
    x = torch.randn(4, 8)
    with amp.autocast("cpu"):
        expected = model(x)
    with amp.autocast("cpu"), PrecisionCensus():
        got = model(x)
    assert torch.equal(expected, got)


def test_reentering_an_active_census_is_an_error():
    census = PrecisionCensus()
    with census:
        with pytest.raises(RuntimeError, match="already active"):
            census.__enter__()
