"""The fp8 gemms: on the CPU computed by their rule, never through ``torch._scaled_mm``
(orders of magnitude slower there on some x86 CPUs), and within the summation-order bound
of ``_scaled_mm``'s own result; the scales they are handed: aligned where cuBLAS reads
them, equal to the pair's inverse, and in compiled graphs a reciprocal of the scale (the
form inductor's scaled-gemm lowerings take from torch's own fp8 recipes)."""

import pytest
import torch
import torch.nn.functional as F

import dispatch_amp as amp
from dispatch_amp import _torch_compat, fp8
from dispatch_amp.fp8 import _gemms
from dispatch_amp.fp8._gemms import by_rule, inverse, mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (output dtype, bias dtype): the combinations the fp8 linear hands its gemms.
OUT_BIAS = [(torch.float32, None), (torch.float32, torch.float32), (torch.bfloat16, None),
            (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def _operands(rowwise, a_fmt, m=32, k=64, n=48):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 8).to(a_fmt)
    b_rows = (torch.randn(n, k, generator=g) * 8).to(E4M3)
    if rowwise:  # the shapes _scaled_mm takes: (M, 1) and (1, N)
        return a, b_rows, torch.rand(m, 1, generator=g) + 0.1, torch.rand(1, n, generator=g) + 0.1
    return a, b_rows, torch.tensor(0.37), torch.tensor(1.7)


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling, fp8.DelayedScaling, fp8.RowwiseScaling],
                         ids=lambda r: r.__name__)
def test_cpu_gemms_do_not_call_scaled_mm(monkeypatch, recipe):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU")

    monkeypatch.setattr(_gemms, "_scaled_mm", refuse)
    x = torch.randn(2, 16, 32, requires_grad=True)
    lin = torch.nn.Linear(32, 16)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe()) as region:
        y = lin(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == lin.weight.grad.dtype == torch.float32
    assert [r.calls for r in region.fp8.report()] == [1]  # it ran as fp8


@pytest.mark.parametrize("out_dtype,bias_dtype", OUT_BIAS, ids=str)
@pytest.mark.parametrize("a_fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_by_rule_agrees_with_scaled_mm(oracle, rowwise, a_fmt, out_dtype, bias_dtype):
    a, b_rows, a_inv, b_inv = _operands(rowwise, a_fmt)
    bias = None if bias_dtype is None else torch.randn(b_rows.shape[0]).to(bias_dtype)
    got = mm(a, b_rows, a_inv, b_inv, out_dtype, bias)
    assert torch.equal(got, by_rule(a, b_rows, a_inv, b_inv, out_dtype, bias))
    if rowwise and not _torch_compat.SCALED_MM_ROWWISE_ON_CPU:
        return  # torch 2.11's CPU _scaled_mm takes one scale per tensor only: no oracle here
    want = torch._scaled_mm(a, b_rows.t(), scale_a=a_inv, scale_b=b_inv, bias=bias, out_dtype=out_dtype)
    # The same products; only the float32 gemm's summation order may differ.
    bound = oracle.gemm_bound(a.float() * a_inv, (b_rows.float() * b_inv.t()).t(), out_dtype,
                              None if bias is None else bias.float())
    oracle.assert_within(got, want, bound, "by rule vs _scaled_mm")


def _pair(scale: float) -> torch.Tensor:
    s = torch.tensor(scale)
    return torch.stack([s, s.reciprocal()])


def test_eager_inverse_is_a_16_byte_aligned_copy_of_element_1():
    sc = _pair(3.0)
    inv = inverse(sc)
    assert inv.dim() == 0 and torch.equal(inv, sc[1])
    assert inv.storage_offset() % 4 == 0
    assert inv.data_ptr() % 16 == 0


def test_eager_inverse_already_aligned_is_not_copied():
    buf = torch.zeros(8)
    sc = buf[::4]  # [scale, 1 / scale] with the inverse 16 bytes in
    sc.copy_(_pair(5.0))
    assert inverse(sc).data_ptr() == sc[1].data_ptr()


def test_compiled_inverse_is_the_reciprocal_of_the_scale_bit_for_bit():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda sc: inverse(sc) * 1, backend=backend, fullgraph=True)
    for value in (3.0, 0.1, 448.0 / 3.7, 2.0 ** -20):
        sc = _pair(value)
        assert torch.equal(f(sc), sc[1])
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_method" or n.op == "call_function"]
    assert any("reciprocal" in str(op) for op in ops), ops
    torch._dynamo.reset()
