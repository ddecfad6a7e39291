"""record_: the statistics and history kernel bit for bit against record_reference; the scale rule."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_amp.kernels import fp8_scale as scale_mod
from dispatch_amp.kernels import record_, record_reference, scale_from_amax_reference

INF, NAN = float("inf"), float("nan")
needs_interpreter = pytest.mark.skipif(
    scale_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]
amaxes = st.one_of(st.floats(0, 2.0 ** 127, width=32), st.sampled_from([0.0, INF, NAN, 1e-45, 1e-38, 1.3e-36]))


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else t.dtype)


def _equal(a, b):
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return torch.equal(nan, b.isnan() if b.is_floating_point() else nan) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=80)
@given(
    history_len=st.integers(1, 40),
    history=st.lists(amaxes, min_size=40, max_size=40),
    a=amaxes,
    scale=st.floats(2.0 ** -100, 2.0 ** 100, width=32),
    init=st.sampled_from([0.0, 1.0]),
    pending=st.one_of(st.just(-1.0), amaxes),
    shown=st.floats(2.0 ** -100, 2.0 ** 100, width=32),
    saturated=st.integers(0, 1000),
    with_history=st.booleans(),
    defer=st.booleans(),
    most_recent=st.booleans(),
    fp8_max=st.sampled_from([448.0, 57344.0]),
    margin=st.integers(0, 3),
    pow2=st.booleans(),
    snapshot=st.booleans(),
)
def test_record_matches_the_reference(backend, history_len, history, a, scale, init, pending, shown, saturated,
                                      with_history, defer, most_recent, fp8_max, margin, pow2, snapshot):
    f = torch.tensor([scale, 7.0, 8.0, init, pending] + history[:history_len], dtype=torch.float32)
    i = torch.tensor([11, 12, saturated], dtype=torch.int64)
    acc = torch.tensor([a], dtype=torch.float32).view(torch.int32).clone()
    rule = dict(history=with_history, fp8_max=fp8_max, margin=margin, power_of_two=pow2, most_recent=most_recent,
                defer=defer)
    want_f, want_i = record_reference(f, i, torch.tensor(a), torch.tensor(shown), torch.tensor(saturated), **rule)
    snap = torch.full((2,), -5, dtype=torch.int64) if snapshot else None
    record_(f, i, acc, i[2:], torch.tensor([shown, 0.0]), snapshot=snap, backend=backend, **rule)
    assert _equal(f, want_f), (f, want_f)
    assert torch.equal(i, want_i) and acc.item() == 0
    if snapshot:
        assert snap.tolist() == [torch.tensor([a]).view(torch.int32).item(), saturated]


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_reset_the_accumulators_stay(backend):
    f = torch.tensor([1.0, 0, 0, 0, -1, 0, 0])
    i = torch.zeros(3, dtype=torch.int64)
    source = torch.tensor([2.0]).view(torch.int32).clone()
    count = torch.tensor([4], dtype=torch.int64)
    record_(f, i, source, count, torch.tensor([1.0]), history=True, reset=False, backend=backend)
    assert source.view(torch.float32).item() == 2.0 and count.item() == 4
    assert f.tolist() == [224.0, 2.0, 1.0, 1.0, -1.0, 2.0, 0.0] and i.tolist() == [4, 1, 0]


@given(amax=amaxes, margin=st.integers(0, 5), pow2=st.booleans())
def test_scales_are_finite_for_finite_amaxes_and_never_above_the_exact_one(amax, margin, pow2):
    a = torch.tensor(amax, dtype=torch.float32)
    s = scale_from_amax_reference(a, 448.0, margin, pow2)
    if torch.isfinite(a):
        assert torch.isfinite(s) and s > 0
        assert s <= scale_from_amax_reference(a, 448.0, margin)
    elif torch.isinf(a):
        assert s.item() == 0.0
    else:
        assert s.isnan()
