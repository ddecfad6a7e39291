"""amax_into_ / amax: the kernel bit for bit against the torch rule."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_amp.kernels import amax, amax_into_, amax_reference
from dispatch_amp.kernels import fp8_amax as amax_mod

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_interpreter = pytest.mark.skipif(
    amax_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.isnan() & b.isnan()) | (a == b)) and a.dtype == b.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60)
@given(
    numel=st.integers(0, 300),
    dtype=st.sampled_from(DTYPES),
    exponent=st.integers(-30, 30),
    specials=st.lists(st.sampled_from([INF, -INF, NAN, 0.0, -0.0, 65504.0, 1e-45]), max_size=3),
    programs=st.integers(1, 5),
    block=st.sampled_from([16, 32, 4096]),
    seed=st.integers(0, 2**31 - 1),
)
def test_amax_matches_the_rule(backend, numel, dtype, exponent, specials, programs, block, seed):
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent
    for k, value in enumerate(specials[:numel]):
        t[(k * 7919) % numel] = value
    t = t.to(dtype)
    acc = torch.zeros(1, dtype=torch.int32)
    amax_into_(t, acc, backend=backend, num_programs=programs, block=block)
    assert _same(acc.view(torch.float32).reshape(()), amax_reference(t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_amax_accumulates_the_max_with_what_is_there(backend):
    acc = torch.tensor([5.0]).view(torch.int32).clone()
    amax_into_(torch.tensor([1.0, -3.0]), acc, backend=backend)
    assert acc.view(torch.float32).item() == 5.0
    amax_into_(torch.tensor([7.0, NAN]), acc, backend=backend)
    assert acc.view(torch.float32).isnan().all()
    assert amax(torch.tensor([[1.0, -INF]]), backend=backend).item() == INF


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="one-element int32"):
        amax_into_(torch.ones(2), torch.zeros(1))
    with pytest.raises(ValueError, match="contiguous"):
        amax_into_(torch.ones(4, 4)[:, ::2], torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="float32, torch.bfloat16 or torch.float16"):
        amax(torch.ones(2, dtype=torch.float64))
