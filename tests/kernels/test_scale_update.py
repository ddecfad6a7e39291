"""update_scale_: torch's rule bit for bit, and the hysteresis/bounds extensions against the reference."""

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch_amp.kernels import ScaleState, update_scale_, update_scale_reference
from dispatch_amp.kernels import scale_update as scale_update_mod

# The interpreter warns when a cast to fp16 overflows to inf: that inf is the expected result.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

needs_interpreter = pytest.mark.skipif(
    scale_update_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]
CPU = torch.device("cpu")

flags = st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.0, float("nan"), float("inf")])
init_scales = st.builds(lambda e, m: m * 2.0**e, st.integers(-24, 24), st.sampled_from([1.0, 1.5, 1.1, 1.9921875]))
growth_factors = st.one_of(st.sampled_from([2.0, 1.5, 4.0]), st.floats(1.0001, 8.0))
backoff_factors = st.one_of(st.sampled_from([0.5, 0.25, 0.3]), st.floats(0.01, 0.999))


def f32_bits(x: torch.Tensor) -> int:
    return x.view(torch.int32).item()


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    init=init_scales,
    growth=growth_factors,
    backoff=backoff_factors,
    interval=st.integers(1, 5),
    schedule=st.lists(flags, min_size=1, max_size=30),
)
def test_default_rule_matches_torch_bit_for_bit(backend, init, growth, backoff, interval, schedule):
    ours = ScaleState.create(CPU, init)
    scale, tracker = torch.tensor(init), torch.zeros((), dtype=torch.int32)
    for k, flag in enumerate(schedule):
        found = torch.tensor(flag)
        torch._amp_update_scale_(scale, tracker, found, growth, backoff, interval)
        update_scale_(ours, found, growth, backoff, interval, backend=backend)
        assert f32_bits(ours.scale) == f32_bits(scale), f"step {k}: {ours.scale.item()} vs {scale.item()}"
        assert ours.growth_tracker.item() == tracker.item()
    assert ours.skipped_steps.item() == sum(1 for f in schedule if f != 0)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    init=init_scales,
    growth=growth_factors,
    backoff=backoff_factors,
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 4),
    bounds=st.tuples(st.one_of(st.none(), st.sampled_from([2.0**-10, 1.0, 3.0])), st.one_of(st.none(), st.sampled_from([2.0**10, 2.0**24, 1e6]))),
    schedule=st.lists(flags, min_size=1, max_size=30),
)
def test_extensions_match_the_reference(backend, init, growth, backoff, interval, hysteresis, bounds, schedule):
    lo, hi = bounds
    init = min(max(init, lo or 0.0), hi or math.inf)
    st_ = ScaleState.create(CPU, init, hysteresis=hysteresis)
    scale, tracker, hyst, skipped, hits = init, 0, hysteresis, 0, 0
    for k, flag in enumerate(schedule):
        update_scale_(st_, torch.tensor(flag), growth, backoff, interval, hysteresis=hysteresis, min_scale=lo, max_scale=hi, backend=backend)
        scale, tracker, hyst, skip, hit = update_scale_reference(
            scale, tracker, flag, growth, backoff, interval, hysteresis=hysteresis, hysteresis_tracker=hyst, min_scale=lo, max_scale=hi
        )
        skipped, hits = skipped + skip, hits + hit
        got = (st_.scale.item(), st_.growth_tracker.item(), st_.hysteresis_tracker.item(), st_.skipped_steps.item(), st_.floor_hits.item())
        assert got == (scale, tracker, hyst, skipped, hits), f"step {k}"
        if lo is not None:
            assert st_.scale.item() >= torch.tensor(lo).item() > 0
        if hi is not None:
            assert st_.scale.item() <= torch.tensor(hi).item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hysteresis_backs_off_after_n_consecutive_overflows(backend):
    st_ = ScaleState.create(CPU, 1024.0, hysteresis=3)
    seen = []
    for flag in [1, 1, 0, 1, 1, 1, 1]:
        update_scale_(st_, torch.tensor(float(flag)), 2.0, 0.5, 100, hysteresis=3, backend=backend)
        seen.append(st_.scale.item())
    # A clean step refills the budget; after 3 in a row every further overflow backs off.
    assert seen == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0]
    assert st_.skipped_steps.item() == 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_growth_never_reaches_inf(backend):
    big = torch.finfo(torch.float32).max / 1.5
    st_ = ScaleState.create(CPU, big)
    update_scale_(st_, torch.zeros(()), 2.0, 0.5, 1, backend=backend)
    assert st_.scale.item() == torch.tensor(big).item()
    st_ = ScaleState.create(CPU, big)
    update_scale_(st_, torch.zeros(()), 2.0, 0.5, 1, max_scale=2.0**100, backend=backend)
    assert st_.scale.item() == 2.0**100


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_scale_floor_is_sticky_and_counted(backend):
    st_ = ScaleState.create(CPU, 4.0)
    for _ in range(5):
        update_scale_(st_, torch.ones(()), 2.0, 0.5, 10, min_scale=1.0, backend=backend)
    assert st_.scale.item() == 1.0
    assert st_.floor_hits.item() == 3  # 4 -> 2 -> 1 are ordinary backoffs


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"hysteresis": 0}, ValueError, "hysteresis"),
        ({"min_scale": 0.0}, ValueError, "min_scale"),
        ({"max_scale": math.inf}, ValueError, "max_scale"),
        ({"backend": "cuda"}, ValueError, "backend"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    st_ = ScaleState.create(CPU, 4.0)
    with pytest.raises(error, match=match):
        update_scale_(st_, torch.zeros(()), 2.0, 0.5, 10, **kwargs)
    assert st_.scale.item() == 4.0


def test_found_inf_must_be_float32():
    st_ = ScaleState.create(CPU, 4.0)
    with pytest.raises(TypeError, match="found_inf"):
        update_scale_(st_, torch.zeros((), dtype=torch.int32), 2.0, 0.5, 10)
