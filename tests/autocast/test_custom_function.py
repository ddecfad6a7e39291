"""custom_fwd / custom_bwd against torch.amp's namesakes."""

import pytest
import torch

import dispatch_amp as amp


def make_function(fwd_decorator, bwd_decorator, record):
    class MatmulThenExp(torch.autograd.Function):
        @staticmethod
        @fwd_decorator
        def forward(ctx, x, w):
            record["fwd_in"] = (x.dtype, w.dtype)
            ctx.save_for_backward(x, w)
            return torch.mm(x, w)

        @staticmethod
        @bwd_decorator
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            record["bwd_mm"] = torch.mm(grad, w.t()).dtype
            return torch.mm(grad, w.t()), torch.mm(x.t(), grad)

    return MatmulThenExp


@pytest.mark.parametrize("cast_inputs", [None, torch.float32])
def test_matches_native_custom_fwd_and_bwd(cast_inputs):
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    runs = []
    for ctx_factory, fwd, bwd in (
        (lambda: torch.autocast("cpu"), torch.amp.custom_fwd, torch.amp.custom_bwd),
        (lambda: amp.autocast("cpu"), amp.custom_fwd, amp.custom_bwd),
    ):
        record = {}
        fn = make_function(
            fwd(device_type="cpu", cast_inputs=cast_inputs), bwd(device_type="cpu"), record
        )
        with ctx_factory():
            y = fn.apply(x, w)
        y.float().sum().backward()  # backward outside the context
        runs.append((y, x.grad.clone(), w.grad.clone(), record))
        x.grad = w.grad = None
    native, ours = runs
    assert ours[3] == native[3]
    for a, b in zip(native[:3], ours[:3]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    expected = torch.float32 if cast_inputs is not None else torch.bfloat16
    assert ours[0].dtype == expected
    assert ours[3]["bwd_mm"] == expected


def test_outside_autocast_is_a_no_op():
    record = {}
    fn = make_function(
        amp.custom_fwd(device_type="cpu", cast_inputs=torch.float16),
        amp.custom_bwd(device_type="cpu"),
        record,
    )
    x = torch.randn(3, 3, requires_grad=True)
    y = fn.apply(x, torch.randn(3, 3))
    assert y.dtype == torch.float32 and record["fwd_in"] == (torch.float32, torch.float32)
    y.sum().backward()
    assert record["bwd_mm"] == torch.float32


def test_cast_inputs_leaves_float64_and_integers():
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.bfloat16)
        def forward(ctx, a, b, c):
            seen["dtypes"] = (a.dtype, b.dtype, c.dtype)
            seen["enabled"] = amp.is_autocast_enabled("cpu")
            return a.clone()

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad, None, None

    with amp.autocast("cpu"):
        Probe.apply(torch.randn(2), torch.randn(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64))
    assert seen == {"dtypes": (torch.bfloat16, torch.float64, torch.int64), "enabled": False}


def test_misuse_is_reported():
    with pytest.raises(RuntimeError, match="supports"):
        amp.custom_fwd(device_type="tpu")
    with pytest.raises(TypeError, match="cast_inputs"):
        amp.custom_fwd(device_type="cpu", cast_inputs="float32")

    class OnlyBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad * 2

    x = torch.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="custom_fwd"):
        OnlyBwd.apply(x).sum().backward()
