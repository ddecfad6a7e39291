"""NonFiniteTracer finds a planted overflow, with its module and input ranges."""

import math

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.diagnostics.tracing import NonFiniteTracer


def model_with_planted_overflow():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4), torch.nn.Softmax(-1)
    )
    with torch.no_grad():
        model[2].weight[0].fill_(3e4)  # fine in fp32, overflows fp16's 65504 in the matmul
    return model


def test_finds_the_first_overflowing_op_and_its_module():
    model = model_with_planted_overflow()
    x = torch.rand(4, 8) + 1.0
    with NonFiniteTracer(model) as tracer, amp.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert not torch.isfinite(out).all()  # softmax spread it; the tracer names the origin
    event = tracer.first
    assert event is not None
    assert event.op == "aten.addmm" and event.module == "2"
    assert event.output.nonfinite > 0 and event.output.dtype == torch.float16
    weight = next(r for r in event.inputs if r.shape == (16, 4))  # W.t()
    assert weight.max == 3e4 and weight.nonfinite == 0
    assert "in module '2'" in str(event)


def test_all_finite_run_records_nothing():
    model = model_with_planted_overflow()
    x = torch.rand(4, 8) + 1.0
    with NonFiniteTracer(model) as tracer:  # fp32: no overflow
        model(x)
    assert tracer.first is None and tracer.ops_seen > 0


def test_raise_on_first():
    model = model_with_planted_overflow()
    with pytest.raises(FloatingPointError, match="aten.addmm"):
        with NonFiniteTracer(model, raise_on_first=True), amp.autocast("cpu", dtype=torch.float16):
            model(torch.rand(4, 8) + 1.0)


def test_hooks_are_removed_on_exit():
    model = model_with_planted_overflow()
    with NonFiniteTracer(model):
        pass
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_without_a_model_ops_are_unlabelled():
    a = torch.tensor([1e38, 1.0])
    with NonFiniteTracer() as tracer:
        b = a * 10
    assert math.isinf(b[0].item())
    assert tracer.first.op == "aten.mul" and tracer.first.module == ""
    with pytest.raises(TypeError, match="nn.Module"):
        NonFiniteTracer(model="not a module")
