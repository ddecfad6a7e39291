"""The scales the fp8 gemms are handed: aligned where cuBLAS reads them, equal to the pair's
inverse, and in compiled graphs a reciprocal of the scale (the form inductor's scaled-gemm
lowerings take from torch's own fp8 recipes)."""

import torch

from dispatch_amp.fp8._gemms import inverse


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
