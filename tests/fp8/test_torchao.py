"""Our rules against torchao's float8 training (tensorwise, dynamic, emulated on CPU).

Where they should agree, they do: the scale of a tensor (``fp8_max / amax``) and its fp8
bits are torchao's, bit for bit, in both formats; a linear's output and gradients agree to
the rounding of the high-precision arithmetic after the fp8 casts (torchao's emulation
dequantizes by division and multiplies in bfloat16, ours multiplies by the inverse scale and
accumulates in float32). Where the rules differ on purpose, that is checked too: an all-zero
tensor (ours: scale 1; torchao: amax clamped to 1e-12) still gives zeros, and a scale
rounded to a power of two never rounds up with us.
"""

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.fp8 import _rules

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # its GPU extensions do not load on a CPU, by design
    torchao_float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _theirs(t, fmt):
    q = hp_tensor_to_float8_dynamic(t, fmt, LinearMMConfig())
    return q._data, q._scale.reshape(())


@settings(max_examples=80)
@given(
    shape=st.tuples(st.integers(1, 33), st.integers(1, 33)),
    exponent=st.integers(-30, 30),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fmt=st.sampled_from(FORMATS),
    seed=st.integers(0, 2**31 - 1),
)
def test_scales_and_fp8_bits_are_torchaos(shape, exponent, dtype, fmt, seed):
    t = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent).to(dtype)
    # Where the rules differ (see the end). In float32: in float16, 1e-12 rounds to 0 and an
    # all-zero tensor would pass.
    if not (t.abs().amax().float() >= 1e-12) or not t.isfinite().all():
        return
    q_theirs, s_theirs = _theirs(t, fmt)
    s_ours = _rules.scale_from_amax(_rules.amax(t), fmt)
    q_ours, _ = _rules.cast(t, s_ours, fmt)
    assert s_ours.view(torch.int32).item() == s_theirs.float().view(torch.int32).item()
    assert torch.equal(q_ours.view(torch.uint8), q_theirs.view(torch.uint8))


def _linears(seed=0, layers=2):
    torch.manual_seed(seed)
    stack = [torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)]
    ours = torch.nn.Sequential(*stack[:1 if layers == 1 else 3])
    config = torchao_float8.Float8LinearConfig(emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torchao_float8.convert_to_float8_training(copy.deepcopy(ours), config=config)
    return ours, theirs


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# bf16 rounding of torchao's emulated products, measured (seeds 0-5): one linear 0.2-1.0%
# of the norm; two, where the first's rounding moves the second's fp8 inputs, 1.1-2.8%.
@pytest.mark.parametrize("layers, tolerance", [(1, 0.01), (2, 0.04)], ids=["one", "two"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linears_train_as_torchaos_do(seed, layers, tolerance):
    ours, theirs = _linears(seed, layers)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(10 + seed)) * 4
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        yo = ours(xo)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt = theirs(xt)
    dy = torch.randn(yo.shape, generator=torch.Generator().manual_seed(20 + seed))
    yo.float().backward(dy)
    yt.float().backward(dy)
    assert yo.dtype == yt.dtype == torch.bfloat16
    assert _rel(yo, yt) < tolerance and _rel(xo.grad, xt.grad) < tolerance
    for po, pt in zip(ours.parameters(), theirs.parameters()):
        assert _rel(po.grad, pt.grad) < tolerance


def test_where_the_rules_differ_on_purpose():
    z = torch.zeros(16, 32)
    q_theirs, s_theirs = _theirs(z, torch.float8_e4m3fn)
    assert s_theirs.item() > 1e14  # 448 / 1e-12
    assert _rules.scale_from_amax(_rules.amax(z), torch.float8_e4m3fn).item() == 1.0
    assert not q_theirs.float().any()  # both: zeros
    # A scale just below a power of two: torchao's exp2(floor(log2(s))) rounds it up to 8,
    # above the scale itself; ours clears the mantissa bits and gives 4.
    t = torch.full((16, 32), 448.0) / torch.tensor(8.0).nextafter(torch.tensor(0.0))
    q = hp_tensor_to_float8_dynamic(t, torch.float8_e4m3fn, LinearMMConfig(), round_scales_to_power_of_2=True)
    assert q._scale.item() == 8.0 > _rules.scale_from_amax(_rules.amax(t), torch.float8_e4m3fn).item()
    assert _rules.scale_from_amax(_rules.amax(t), torch.float8_e4m3fn, power_of_two=True).item() == 4.0
