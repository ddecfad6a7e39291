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


# -- per module ------------------------------------------------------------------------------
def _gpt_models():
    from benchmarks import models

    return models


def test_per_module_view_counts_each_forward_own_ops():
    model = tiny()
    x = torch.randn(5, 8)
    with PrecisionCensus(model=model) as census:
        with amp.autocast("cpu"):
            loss = model(x).float().sum()
        loss.backward()
    rows = census.by_module()
    assert list(rows) == ["<root>", "0", "1", "2", amp.diagnostics.census.NO_MODULE]
    assert rows["0"].compute_dtype is torch.bfloat16 and rows["0"].flops == {torch.bfloat16: 2 * 5 * 8 * 16}
    assert rows["2"].flops == {torch.bfloat16: 2 * 5 * 16 * 4}
    # Linear 0 casts x, W1 and b1 to bf16 (three casts), linear 2 casts W2 and b2.
    assert (rows["0"].casts, rows["0"].cast_bytes) == (3, 2 * (5 * 8 + 16 * 8 + 16))
    assert (rows["2"].casts, rows["2"].cast_bytes) == (2, 2 * (4 * 16 + 4))
    assert not any(m.fp8 for m in rows.values())
    # Each module's backward is its own: linear 2's input and weight gradients, linear 0's
    # weight gradient only (x needs none), each gradient cast back to float32 there; the
    # loss's backward outside every module.
    assert rows["2"].backward_flops == {torch.bfloat16: 2 * (2 * 5 * 16 * 4)}
    assert rows["0"].backward_flops == {torch.bfloat16: 2 * 5 * 8 * 16}
    assert rows["0"].backward_cast_bytes == 4 * (16 * 8 + 16) and rows["2"].backward_cast_bytes == 4 * (4 * 16 + 4)
    assert not rows["<root>"].backward_calls and not rows["1"].backward_flops and rows["1"].backward_calls
    no_module = rows[amp.diagnostics.census.NO_MODULE]
    assert not no_module.flops and not no_module.backward_flops and no_module.backward_calls
    # The totals are the per-op view's.
    assert sum(m.cast_bytes + m.backward_cast_bytes for m in rows.values()) == census.cast_bytes
    assert sum(sum(m.flops.values()) + sum(m.backward_flops.values()) for m in rows.values()) \
        == sum(census.flops_by_dtype().values())
    assert sum(sum(m.calls.values()) + sum(m.backward_calls.values()) for m in rows.values()) == census.calls
    assert census.as_dict()["modules"][1]["module"] == "0"
    assert census.as_dict()["modules"][1]["backward_flops"] == {"torch.bfloat16": 2 * 5 * 8 * 16}


def test_a_backward_with_nested_modules_and_recomputation_is_filed_under_the_innermost():
    # A block (a Sequential inside the model) whose last child shares its output: the
    # child's backward is the child's. Activation checkpointing recomputes a forward inside
    # the backward: those ops are that forward's again (they ran twice).
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model = torch.nn.Sequential(inner, torch.nn.Linear(8, 4))
    x = torch.randn(3, 8, requires_grad=True)
    for checkpointed in (False, True):
        with PrecisionCensus(model=model) as census:
            with amp.autocast("cpu"):
                h = (torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False) if checkpointed
                     else inner(x))
                out = model[1](h)
            out.float().sum().backward()
        rows = census.by_module()
        mm = 2 * 3 * 8 * 8
        assert rows["0.1"].backward_flops == {torch.bfloat16: 2 * mm}, checkpointed
        assert rows["0.0"].backward_flops == {torch.bfloat16: 2 * mm}, "x needs a gradient: both gemms"
        assert not rows["0"].backward_flops
        assert rows["1"].backward_flops == {torch.bfloat16: 2 * (2 * 3 * 8 * 4)}
        # (torch's checkpoint recomputes only up to the last tensor the backward needs: the
        # first linear's forward.)
        assert rows["0.0"].flops == {torch.bfloat16: mm * (2 if checkpointed else 1)}
    # The census leaves no hook behind, on the modules or on the tensors.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_census_of_a_planned_model_shows_the_plan(tmp_path):
    import csv

    M = _gpt_models()
    torch.manual_seed(0)
    cfg = M.GPTConfig(vocab=64, d_model=32, n_heads=2, n_blocks=4, max_len=16)
    model = M.GPT(cfg)
    amp.PrecisionPlan.keep_ends(model, head="head", rest=amp.fp8.CurrentScaling(), dtype=torch.bfloat16).bind(model)
    x, y = M.gpt_batch(cfg, 2, 8)
    with PrecisionCensus(model=model) as census:
        with amp.autocast("cpu"):
            loss = model.loss(x, y)
        loss.backward()
    rows = census.by_module()
    assert rows["head"].compute_dtype is torch.float32 and not rows["head"].fp8
    for i in (0, 3):
        assert rows[f"blocks.{i}.fc"].compute_dtype is torch.float32 and not rows[f"blocks.{i}.fc"].fp8
    for i in (1, 2):
        assert rows[f"blocks.{i}.fc"].fp8 and rows[f"blocks.{i}.proj"].fp8
        assert rows[f"blocks.{i}.attn"].fp8  # the in-projection's linear
    table = census.module_table()
    assert table.splitlines()[0] == ("| module | compute dtype | calls | FLOPs by dtype | casts | cast bytes | fp8 gemms "
                                     "| backward calls | backward FLOPs by dtype | backward cast bytes |")
    assert "| head | float32 |" in table
    path = tmp_path / "modules.csv"
    census.module_csv(path)
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    by_name = {r["module"]: r for r in read}
    assert by_name["head"]["compute dtype"] == "float32" and by_name["blocks.1.fc"]["fp8 gemms"] == "1"
    assert by_name["blocks.1.fc"]["FLOPs by dtype"].startswith("float8_e4m3fn:")
    # The fp8 middle's backward gemms ran in fp8 too (e5m2 output gradients), the head's in float32.
    assert "float8_e5m2:" in by_name["blocks.1.fc"]["backward FLOPs by dtype"]
    assert set(rows["head"].backward_flops) == {torch.float32}

    # The same model with the middle in bfloat16: the middle blocks' linears in bfloat16.
    torch.manual_seed(0)
    model = M.GPT(cfg)
    amp.PrecisionPlan.keep_ends(model, head="head", rest=torch.bfloat16).bind(model)
    with PrecisionCensus(model=model) as census, amp.autocast("cpu"):
        model.loss(x, y)
    rows = census.by_module()
    assert rows["head"].compute_dtype is torch.float32
    assert rows["blocks.1.fc"].compute_dtype is torch.bfloat16 and rows["blocks.0.fc"].compute_dtype is torch.float32


def test_per_module_view_needs_the_model_and_unhooks():
    model = tiny()
    with PrecisionCensus() as census:
        model(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="model=model"):
        census.by_module()
    with pytest.raises(TypeError, match="nn.Module"):
        PrecisionCensus(model="model")
    census = PrecisionCensus(model=model)
    with census:
        model(torch.randn(2, 8))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(TypeError, match="path or an open text file"):
        census.module_csv(3)
