"""The block-scaled fp8 linear: each of its three gemms bit for bit against the rule composed
by hand from the kernels' references, and the whole against a float32 linear."""

import pytest
import torch

from dispatch_amp.fp8._block_linear import BlockOptions, block_fp8_linear
from dispatch_amp.kernels import bias_grad_reference, quantize_blocks_reference, quantize_tiles_reference

E4M3 = torch.float8_e4m3fn


def _deq(q, inv, tile, block):
    rows, cols = q.shape
    s = inv.repeat_interleave(block, 1)[:, :cols]
    if tile == "block":
        s = s.repeat_interleave(block, 0)[:rows]
    return q.float() * s


def _inputs(shape, n, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).requires_grad_()
    w = (torch.randn(n, shape[-1], generator=gen) / shape[-1] ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(n, generator=gen).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(*shape[:-1], n, generator=gen).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("shape,n,block", [((2, 70, 300), 200, 128), ((64, 256), 128, 128), ((5, 40), 24, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_each_gemm_is_the_rule_composed_by_hand(shape, n, block, dtype, pow2):
    x, w, b, dy = _inputs(shape, n, dtype, seed=n)
    options = BlockOptions(power_of_two=pow2, block=block)
    y = block_fp8_linear(x, w, b, dtype, options)
    y.backward(dy)

    k = shape[-1]
    x2, dy2 = x.detach().reshape(-1, k), dy.reshape(-1, n)
    xq, x_inv, xq_t, xt_inv = quantize_tiles_reference(x2, rowwise=True, colwise=True, power_of_two=pow2, block=block)
    wq, wq_t, w_inv = quantize_blocks_reference(w.detach(), write_qt=True, power_of_two=pow2, block=block)
    dyq, dy_inv, dyq_t, dyt_inv = quantize_tiles_reference(dy2, rowwise=True, colwise=True, power_of_two=pow2,
                                                           block=block)
    # forward: x in 1 x block tiles against the weight's blocks; the bias in the output dtype
    y_want = (_deq(xq, x_inv, "tile", block) @ _deq(wq, w_inv, "block", block).t() + b.detach().float()).to(dtype)
    # grad_input: dy in 1 x block tiles along N against the weight's blocks transposed
    dx_want = (_deq(dyq, dy_inv, "tile", block) @ _deq(wq_t, w_inv.t(), "block", block).t()).to(dtype)
    # grad_weight: dy.T and x.T, both in 1 x block tiles along the tokens
    dw_want = (_deq(dyq_t, dyt_inv, "tile", block) @ _deq(xq_t, xt_inv, "tile", block).t()).to(dtype)
    assert torch.equal(y.reshape(-1, n), y_want)
    assert torch.equal(x.grad.reshape(-1, k), dx_want)
    assert torch.equal(w.grad, dw_want)
    assert torch.equal(b.grad, bias_grad_reference(dy2).to(dtype))
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype


@pytest.mark.parametrize("shape,n", [((4, 64, 256), 384), ((130, 300), 200)])
def test_close_to_the_float32_linear(shape, n):
    x, w, b, dy = _inputs(shape, n, torch.float32, seed=7)
    y = block_fp8_linear(x, w, b, torch.float32)
    y.backward(dy)
    got = (y.detach(), x.grad, w.grad, b.grad)
    x.grad = w.grad = b.grad = None
    y_ref = torch.nn.functional.linear(x, w, b)
    y_ref.backward(dy)
    want = (y_ref.detach(), x.grad, w.grad, b.grad)
    # e4m3 rounds each operand by up to 2**-4 relative (about 0.036 rms): a product of two
    # such operands comes out within 0.06 in the norm; the bias gradient is not quantized.
    for name, g, r, tol in zip(("y", "dx", "dw", "db"), got, want, (0.06, 0.06, 0.06, 1e-6)):
        err = ((g - r).norm() / r.norm()).item()
        assert err < tol, (name, err)


def test_only_the_gradients_asked_for():
    x, w, b, dy = _inputs((32, 128), 64, torch.float32, seed=8, bias=False)
    w.requires_grad_(False)
    block_fp8_linear(x, w, None, torch.float32).backward(dy)
    assert x.grad is not None and w.grad is None
    x2 = x.detach()
    w.requires_grad_(True)
    block_fp8_linear(x2, w, None, torch.float32).backward(dy)
    assert w.grad is not None


def test_a_differentiable_backward_is_refused_with_the_fix():
    x, w, b, dy = _inputs((16, 32), 16, torch.float32, seed=9)
    y = block_fp8_linear(x, w, b, torch.float32)
    with pytest.raises(RuntimeError, match="create_graph=True.*CurrentScaling"):
        torch.autograd.grad(y, x, dy, create_graph=True)


def test_native_autocast_around_it_changes_no_bit():
    # A backward run inside torch.autocast (or a forward under it) must not cast the rule's
    # float32 matmuls to bfloat16.
    results = []
    for region in (False, True):
        x, w, b, dy = _inputs((64, 256), 128, torch.float32, seed=10)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
            y = block_fp8_linear(x, w, b, torch.float32)
            y.backward(dy)
        results.append((y.detach(), x.grad, w.grad, b.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
