"""amax_and_cast / cast_transpose: every backend bit for bit against the torch reference."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dispatch_amp.kernels import amax_and_cast, amax_and_cast_reference, cast_transpose, cast_transpose_reference, fp8_max
from dispatch_amp.kernels import fp8_cast as fp8_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INF, NAN = float("inf"), float("nan")

# The interpreter runs on NumPy, which warns where a product overflows to inf or is 0 * inf:
# both are cases under test, and the rule decides their result.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]

needs_interpreter = pytest.mark.skipif(
    fp8_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical, except that any nan equals any nan (payloads are not part of the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.is_contiguous()
    nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_got, nan_want), "nan positions differ"
    ints = {1: torch.uint8, 4: torch.int32, 8: torch.int64}[got.element_size()]
    g, w = got.view(ints)[~nan_got], want.view(ints)[~nan_want]
    if not torch.equal(g, w):
        k = (g != w).nonzero()[0].item()
        raise AssertionError(f"{(g != w).sum().item()} elements differ, first: {got[~nan_got][k].item()} vs {want[~nan_want][k].item()}")


def assert_results_equal(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    amax, saturated = got[-2], got[-1]
    assert amax.shape == () and amax.dtype == torch.float32
    assert saturated.shape == () and saturated.dtype == torch.int64


def run(fn, backend, t, scale, fp8_dtype, **kwargs):
    if fn == "amax_and_cast":
        if backend == "reference":
            return amax_and_cast_reference(t, scale, fp8_dtype)
        return fp8_mod._amax_and_cast(t, scale, fp8_dtype, backend, **kwargs)
    if backend == "reference":
        return cast_transpose_reference(t, scale, fp8_dtype)
    return fp8_mod._cast_transpose(t, scale, fp8_dtype, backend, **kwargs)


def oracle(fn, t, scale, fp8_dtype):
    return run(fn, "reference", t, scale, fp8_dtype)


def grid_points(fp8_dtype: torch.dtype) -> torch.Tensor:
    """Every non-negative finite fp8 value, every midpoint between neighbours (the ties) and the
    fp32 values just either side of each midpoint, then 0, the specials, and values past fp8_max."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    values = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted, +0 once
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    below = torch.nextafter(mids, torch.zeros(()))
    above = torch.nextafter(mids, torch.full((), INF))
    limit = fp8_max(fp8_dtype)
    beyond = torch.tensor([limit * 1.0001, limit * 1.0625, limit * 1.1, limit * 2, 3e38, INF, NAN])
    # Below the smallest subnormal: its half (a tie with 0), and fp32's own subnormals.
    tiny = values[1] * torch.tensor([0.5, 0.25, 0.75, 1e-10]).float()
    tiny = torch.cat([tiny, torch.tensor([1e-45, 1e-40])])
    pos = torch.cat([values, mids, below, above, beyond, tiny])
    return torch.cat([pos, -pos])


def as_2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t flattened and zero-padded to a (rows, cols) matrix."""
    flat = t.flatten()
    pad = (-flat.numel()) % cols
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, cols)


# -- the whole fp8 grid, every dtype and format ----------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_every_fp8_value_tie_and_neighbour_matches_the_reference(fp8_dtype, dtype, backend):
    # At scale 1 the product is the input, so every rounding case of the format is hit
    # (for bf16/fp16 inputs, after their own rounding of the grid points).
    t = grid_points(fp8_dtype).to(dtype)
    scale = torch.tensor(1.0)
    got = run("amax_and_cast", backend, t, scale, fp8_dtype, num_programs=3, block=256)
    want = oracle("amax_and_cast", t, scale, fp8_dtype)
    assert_results_equal(got, want)
    assert torch.isnan(got[1])  # the grid holds a nan, and nan wins the amax
    m = as_2d(t, 37)
    assert_results_equal(run("cast_transpose", backend, m, scale, fp8_dtype, num_programs=3, tile=(16, 32)), oracle("cast_transpose", m, scale, fp8_dtype))


def test_reference_conversion_is_torchs_round_to_nearest_even():
    # The oracle is torch's own cast: pin down the facts the hand conversion reproduces.
    # Near 1 the spacing is 1/8 (e4m3fn) or 1/4 (e5m2): the first tie rounds down to 1.0,
    # the second up, each to the neighbour with an even mantissa.
    for fp8_dtype, ulp in [(torch.float8_e4m3fn, 0.125), (torch.float8_e5m2, 0.25)]:
        q = amax_and_cast_reference(torch.tensor([1 + ulp / 2, 1 + 1.5 * ulp, -0.0]), torch.tensor(1.0), fp8_dtype)[0]
        assert q.float().tolist()[:2] == [1.0, 1 + 2 * ulp]
        assert q.view(torch.uint8)[2].item() == 0x80  # -0.0 keeps its sign
    # Ties in the subnormals: 0.5 and 2.5 steps round to even (0 and 2 steps), 1.5 up to 2.
    for fp8_dtype, step in [(torch.float8_e4m3fn, 2.0**-9), (torch.float8_e5m2, 2.0**-16)]:
        q = amax_and_cast_reference(torch.tensor([0.5, 1.5, 2.5, -0.5]) * step, torch.tensor(1.0), fp8_dtype)[0]
        assert q.view(torch.uint8).tolist() == [0, 2, 2, 0x80]


# -- scales, specials and shapes --------------------------------------------------------------------

SCALES = [0.0, -0.0, 1.0, 0.75, 3.0, 2.0**-20, 1e-30, 1e-45, 2.0**20, 1e30, 3.4e38, INF, -2.5, NAN]
SPECIALS = [INF, -INF, NAN, 0.0, -0.0]


def special_tensor(numel: int, dtype: torch.dtype, fp8_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values over many magnitudes, with specials, saturating values and subnormal-range
    values scattered through them."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=gen) * 2.0 ** torch.randint(-20, 20, (numel,), generator=gen).float()
    limit, step = fp8_max(fp8_dtype), {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[fp8_dtype]
    extras = SPECIALS + [limit, -limit, limit * 1.5, -3e38, step, 0.5 * step, 1.5 * step, -2.5 * step]
    picks = torch.randint(0, numel, (min(numel, 3 * len(extras)),), generator=gen)
    for k, p in enumerate(picks.tolist()):
        t[p] = extras[k % len(extras)]
    return t.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", SCALES, ids=repr)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_scales_including_zero_tiny_huge_and_nonfinite(fp8_dtype, scale, backend):
    for dtype in DTYPES:
        t = special_tensor(700, dtype, fp8_dtype, seed=DTYPES.index(dtype))
        s = torch.tensor(scale)
        assert_results_equal(run("amax_and_cast", backend, t, s, fp8_dtype, num_programs=2, block=128), oracle("amax_and_cast", t, s, fp8_dtype))
        m = t.view(28, 25)
        assert_results_equal(run("cast_transpose", backend, m, s, fp8_dtype, num_programs=2, tile=(16, 16)), oracle("cast_transpose", m, s, fp8_dtype))


SHAPES = [(), (1,), (0,), (4095,), (4096,), (4097,), (3, 5, 7), (2, 4096 + 3), (0, 3), (8193,)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_amax_and_cast_shapes_at_the_default_block(shape, backend):
    numel = int(np.prod(shape))
    for dtype, fp8_dtype in [(torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2), (torch.float16, torch.float8_e4m3fn)]:
        t = special_tensor(max(numel, 1), dtype, fp8_dtype, seed=numel)[:numel].reshape(shape)
        s = torch.tensor(16.0)
        got = amax_and_cast(t, s, fp8_dtype, backend=backend)
        assert_results_equal(got, oracle("amax_and_cast", t, s, fp8_dtype))
        if numel == 0:
            assert got[1].item() == 0.0 and got[2].item() == 0


TRANSPOSE_SHAPES = [(1, 1), (1, 200), (200, 1), (64, 64), (65, 63), (128, 192), (130, 70), (0, 5), (5, 0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=str)
def test_cast_transpose_shapes_at_the_default_tile(shape, backend):
    numel = shape[0] * shape[1]
    for dtype, fp8_dtype in [(torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2)]:
        t = special_tensor(max(numel, 1), dtype, fp8_dtype, seed=numel)[:numel].reshape(shape)
        s = torch.tensor(0.125)
        q, q_t, amax, saturated = got = cast_transpose(t, s, fp8_dtype, backend=backend)
        assert_results_equal(got, oracle("cast_transpose", t, s, fp8_dtype))
        assert q_t.shape == (shape[1], shape[0]) and q_t.is_contiguous()
        assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        # The two kernels agree with each other too.
        assert_results_equal(amax_and_cast(t, s, fp8_dtype, backend=backend), (q, amax, saturated))


# -- property tests ---------------------------------------------------------------------------------

finite_or_special = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(width=16),  # fp16-width floats bring subnormals, huge values, inf and nan
    st.sampled_from(SPECIALS + [448.0, 57344.0, 464.0, 61440.0, 2.0**-10, 3 * 2.0**-10, 2.0**-17, 3 * 2.0**-17]),
)
scales = st.one_of(
    st.builds(lambda e, m: m * 2.0**e, st.integers(-30, 30), st.sampled_from([1.0, 1.5, 1.1, 1.9921875, -1.0])),
    st.floats(width=32),
)


@st.composite
def tensors(draw, two_d: bool):
    """A small tensor of random magnitudes with drawn values (specials included) poked in."""
    if two_d:
        shape = (draw(st.integers(0, 40)), draw(st.integers(0, 40)))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    numel = int(np.prod(shape))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = torch.randn(numel, generator=gen) * 2.0 ** draw(st.integers(-20, 20))
    if numel:
        for value in draw(st.lists(finite_or_special, max_size=8)):
            t[draw(st.integers(0, numel - 1))] = value
    return t.to(draw(st.sampled_from(DTYPES))).reshape(shape)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60)
@given(t=tensors(two_d=False), scale=scales, fp8_dtype=st.sampled_from(FP8), programs=st.integers(1, 5), block=st.sampled_from([16, 32, 64, 4096]))
def test_amax_and_cast_matches_the_reference(backend, t, scale, fp8_dtype, programs, block):
    s = torch.tensor(scale, dtype=torch.float32)
    got = run("amax_and_cast", backend, t, s, fp8_dtype, num_programs=programs, block=block)
    assert_results_equal(got, oracle("amax_and_cast", t, s, fp8_dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60)
@given(
    t=tensors(two_d=True),
    scale=scales,
    fp8_dtype=st.sampled_from(FP8),
    programs=st.integers(1, 5),
    tile=st.sampled_from([(8, 8), (8, 16), (16, 8), (32, 16), (64, 64)]),
)
def test_cast_transpose_matches_the_reference(backend, t, scale, fp8_dtype, programs, tile):
    s = torch.tensor(scale, dtype=torch.float32)
    got = run("cast_transpose", backend, t, s, fp8_dtype, num_programs=programs, tile=tile)
    assert_results_equal(got, oracle("cast_transpose", t, s, fp8_dtype))
    assert torch.equal(got[1].view(torch.uint8), got[0].t().contiguous().view(torch.uint8))


# -- amax and saturation across programs ------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("fn", ["amax_and_cast", "cast_transpose"])
@pytest.mark.parametrize("programs", [1, 2, 3, 7])
def test_nan_wins_the_amax_and_inf_beats_finite_in_any_program(fn, programs):
    # 8 x 8 tiles of a 32 x 32 matrix (16 tiles), or 64-element blocks of the same 1024
    # elements: the specials land in different programs' tiles whatever the grid.
    base = torch.linspace(-5, 5, 1024)
    cases = [([], 5.0), ([(1000, INF)], INF), ([(3, -INF), (700, 1e30)], INF), ([(10, NAN), (900, INF)], NAN), ([(1023, NAN)], NAN), ([(0, -7.0)], 7.0)]
    for pokes, want in cases:
        t = base.clone()
        for pos, value in pokes:
            t[pos] = value
        t = t.view(32, 32) if fn == "cast_transpose" else t
        kwargs = {"tile": (8, 8)} if fn == "cast_transpose" else {"block": 64}
        got = run(fn, "triton", t, torch.tensor(100.0), torch.float8_e4m3fn, num_programs=programs, **kwargs)
        assert_results_equal(got, oracle(fn, t, torch.tensor(100.0), torch.float8_e4m3fn))
        amax = got[-2].item()
        assert (np.isnan(amax) and np.isnan(want)) or amax == want
        # Saturated: |x| * 100 beyond 464 (the midpoint between 448 and e4m3's next step);
        # inf and nan are never counted.
        assert got[-1].item() == int(((t.abs() * 100 > 464) & torch.isfinite(t)).sum())


@needs_interpreter
def test_unaligned_contiguous_views_go_through_the_kernel():
    buf = special_tensor(1 + 50 * 33, torch.bfloat16, torch.float8_e4m3fn, seed=5)
    t = buf[1:].view(50, 33)  # 2 bytes past the allocation
    s = torch.tensor(4.0)
    assert_results_equal(run("cast_transpose", "triton", t, s, torch.float8_e4m3fn, tile=(16, 16)), oracle("cast_transpose", t, s, torch.float8_e4m3fn))
    flat = t.view(-1)
    assert_results_equal(run("amax_and_cast", "triton", flat, s, torch.float8_e4m3fn, block=64), oracle("amax_and_cast", flat, s, torch.float8_e4m3fn))


def test_auto_backend_uses_torch_for_cpu_tensors(monkeypatch):
    def fail(*args, **kwargs):
        pytest.fail("the Triton launcher ran for CPU tensors under backend='auto'")

    monkeypatch.setattr(fp8_mod, "launch", fail)
    t = torch.tensor([[1.0, NAN], [-1000.0, 2.0**-12]])
    s = torch.tensor(1.0)
    assert_results_equal(amax_and_cast(t, s, torch.float8_e4m3fn), oracle("amax_and_cast", t, s, torch.float8_e4m3fn))
    assert_results_equal(cast_transpose(t, s, torch.float8_e5m2), oracle("cast_transpose", t, s, torch.float8_e5m2))


def test_torch_backend_does_not_sync(sync_counter):
    t = torch.tensor([[1.0, INF], [-1000.0, 3.0]])
    with sync_counter() as counter:
        amax_and_cast(t, torch.tensor(2.0), torch.float8_e4m3fn, backend="torch")
        cast_transpose(t, torch.tensor(2.0), torch.float8_e5m2, backend="torch")
    assert counter.count == 0


def test_fp8_max():
    assert fp8_max(torch.float8_e4m3fn) == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert fp8_max(torch.float8_e5m2) == 57344.0 == torch.finfo(torch.float8_e5m2).max
    for bad in (torch.float16, torch.float8_e4m3fnuz, "float8_e4m3fn"):
        with pytest.raises(TypeError, match="torch.float8_e4m3fn or torch.float8_e5m2"):
            fp8_max(bad)


# -- argument checks --------------------------------------------------------------------------------

E4 = torch.float8_e4m3fn
ONE = torch.tensor(1.0)
BAD_ARGUMENTS = [
    ((torch.ones(4), ONE, E4), {"backend": "cuda"}, ValueError, "backend must be one of"),
    ((torch.ones(4, dtype=torch.float64), ONE, E4), {}, TypeError, r"t has dtype torch.float64; it must be torch.float32, torch.bfloat16 or torch.float16"),
    ((torch.ones(4, dtype=torch.int32), ONE, E4), {}, TypeError, "it must be torch.float32"),
    (([1.0, 2.0], ONE, E4), {}, TypeError, "t must be a tensor, got list"),
    ((torch.ones(4), ONE, torch.float16), {}, TypeError, "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
    ((torch.ones(4), ONE, torch.float8_e5m2fnuz), {}, TypeError, "fp8_dtype must be"),
    ((torch.ones(4, 6)[:, ::2], ONE, E4), {}, ValueError, r"t must be contiguous .*pass t.contiguous\(\)"),
    ((torch.ones(4), torch.ones(1), E4), {}, TypeError, "scale must be a 0-d float32 tensor, got a 1-d torch.float32 tensor"),
    ((torch.ones(4), torch.tensor(1.0, dtype=torch.float64), E4), {}, TypeError, "scale must be a 0-d float32 tensor, got a 0-d torch.float64"),
    ((torch.ones(4), 1.0, E4), {}, TypeError, "scale must be a 0-d float32 tensor, got a float"),
    ((torch.ones(4), torch.tensor(1.0, device="meta"), E4), {}, ValueError, "scale is on meta but t is on cpu; move scale to t's device"),
]


@pytest.mark.parametrize("fn", ["amax_and_cast", "cast_transpose"])
@pytest.mark.parametrize("args, kwargs, error, match", BAD_ARGUMENTS, ids=range(len(BAD_ARGUMENTS)))
def test_bad_arguments_raise_a_clear_error(fn, args, kwargs, error, match):
    t = args[0]
    if fn == "cast_transpose" and isinstance(t, torch.Tensor) and t.dim() == 1:
        args = (t.view(2, 2),) + args[1:]
    public = {"amax_and_cast": amax_and_cast, "cast_transpose": cast_transpose}[fn]
    with pytest.raises(error, match=match) as info:
        public(*args, **kwargs)
    assert str(info.value).startswith(f"{fn}: ")
    if not kwargs:  # the references check the same things
        reference = {"amax_and_cast": amax_and_cast_reference, "cast_transpose": cast_transpose_reference}[fn]
        with pytest.raises(error, match=match):
            reference(*args)


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()], ids=str)
def test_cast_transpose_needs_a_2d_tensor(shape):
    for call in (cast_transpose, cast_transpose_reference):
        with pytest.raises(ValueError, match=r"t must be 2-D \(M, N\), got shape .*reshape it to \(-1, t.shape\[-1\]\) first"):
            call(torch.ones(shape), ONE, E4)


def test_triton_backend_without_triton_or_interpreter_is_a_clear_error():
    # One child without the interpreter, one without triton at all; both still cast on torch.
    code = (
        "import sys, torch\n"
        "if sys.argv[1] == 'no-triton': sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from dispatch_amp.kernels import amax_and_cast, cast_transpose\n"
        "for call in (amax_and_cast, cast_transpose):\n"
        "    try:\n"
        "        call(torch.ones(2, 2), torch.tensor(1.0), torch.float8_e4m3fn, backend='triton')\n"
        "    except RuntimeError as e:\n"
        "        print('ERR', e)\n"
        "q, amax, saturated = amax_and_cast(torch.tensor([2.0, 500.0]), torch.tensor(1.0), torch.float8_e4m3fn)\n"
        "print('OK', q.float().tolist(), amax.item(), saturated.item())\n"
    )
    for mode, needle in [("no-interpreter", "TRITON_INTERPRET=1"), ("no-triton", "needs the triton package")]:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[:2]] == ["ERR amax_and_cast", "ERR cast_transpose"], lines
        assert all(needle in line for line in lines[:2]), lines
        assert lines[2] == "OK [2.0, 448.0] 500.0 1", lines


# -- quantize_: scale sources, layouts, the bias gradient -------------------------------------------

from dispatch_amp.kernels import bias_grad, bias_grad_reference, quantize_, quantize_reference  # noqa: E402
from dispatch_amp.kernels import resolve_scale_reference  # noqa: E402


def _quantize_both(t, fp8_dtype, mode, given, init, acc_value, margin, pow2, accumulate, write_q, write_qt, dbias,
                   backend, **kwargs):
    """quantize_ on ``backend`` and the references; both as (q, q_t, db, amax acc, count, sc)."""
    out = []
    for which in (backend, "reference"):
        acc = torch.tensor([acc_value], dtype=torch.float32).view(torch.int32).clone()
        sat = torch.tensor([3], dtype=torch.int64)
        sc = torch.empty(2)
        scale = torch.tensor(given)
        initialized = torch.tensor(init)
        if which == "reference":
            s = resolve_scale_reference(mode, scale, initialized, acc.view(torch.float32), fp8_dtype, margin, pow2)
            q, q_t, a, n, db = quantize_reference(t, s, fp8_dtype, write_q=write_q, write_qt=write_qt, dbias=dbias)
            if accumulate:
                acc = torch.maximum(acc, a.view(torch.int32).reshape(1))
            out.append((q, q_t, db, acc, sat + n, torch.stack([s, s.reciprocal()])))
        else:
            q, q_t, db = quantize_(t, fp8_dtype, mode=mode, scale=scale, initialized=initialized, amax_acc=acc,
                                   saturated_acc=sat, sc_out=sc, margin=margin, power_of_two=pow2,
                                   accumulate_amax=accumulate, write_q=write_q, write_qt=write_qt, dbias=dbias,
                                   backend=which, **kwargs)
            out.append((q, q_t, db, acc, sat, sc))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60)
@given(
    t=tensors(two_d=True),
    fp8_dtype=st.sampled_from(FP8),
    mode=st.sampled_from(["given", "amax", "first"]),
    given_scale=scales,
    init=st.sampled_from([0.0, 1.0]),
    acc_value=st.one_of(st.floats(0, 2.0 ** 100, width=32), st.sampled_from([0.0, 1e-40, 1e-38, INF, NAN])),
    margin=st.integers(0, 3),
    pow2=st.booleans(),
    layouts=st.sampled_from([(True, False), (True, True), (False, True)]),
    dbias=st.booleans(),
    programs=st.integers(1, 5),
)
# A nan in a bf16 input under a scale of 0: the kernel's amax bits are bf16's nan widened.
@example(t=torch.tensor([[0.0, float("nan")]], dtype=torch.bfloat16), fp8_dtype=torch.float8_e4m3fn, mode="given",
         given_scale=0.0, init=0.0, acc_value=0.0, margin=0, pow2=False, layouts=(True, False), dbias=False,
         programs=1)
def test_quantize_matches_the_references(backend, t, fp8_dtype, mode, given_scale, init, acc_value, margin, pow2,
                                         layouts, dbias, programs):
    write_q, write_qt = layouts
    accumulate = mode == "given"
    got, want = _quantize_both(t, fp8_dtype, mode, given_scale, init, acc_value, margin, pow2, accumulate, write_q,
                               write_qt, dbias, backend, num_programs=programs)
    for name, g, w in zip(("q", "q_t", "db", "amax", "count", "sc"), got, want):
        if w is None:
            assert g is None, name
        elif name == "amax":
            # The accumulator holds a float32's bits (an int max is a float max on
            # non-negative floats): compared as the float it is, so a nan's payload (the
            # kernel widens bf16's nan, the reference writes the canonical one) is not
            # part of the contract, as everywhere else here.
            assert_bits_equal(g.view(torch.float32), w.view(torch.float32))
        else:
            assert_bits_equal(g, w)


@needs_interpreter
@pytest.mark.parametrize("tile_n", [16, 32, 64])
@pytest.mark.parametrize("shape", [(1, 3), (63, 17), (64, 64), (65, 40), (200, 33), (512, 16)], ids=str)
def test_the_bias_gradient_has_the_same_bits_whatever_the_grid(shape, tile_n):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(*shape, generator=g) * torch.logspace(-6, 6, shape[1])).to(torch.bfloat16)
    t[0, 0] = -0.0
    want = bias_grad_reference(t)
    for programs in (1, 3):
        acc, sat = fp8_mod.new_accumulators(t.device)
        _, _, db = quantize_(t, torch.float8_e5m2, mode="amax", scale=None, initialized=None, amax_acc=acc,
                             saturated_acc=sat, sc_out=torch.empty(2), accumulate_amax=False, write_q=False,
                             dbias=True, backend="triton", num_programs=programs, tile=(64, tile_n))
        assert_bits_equal(db, want)
    assert_bits_equal(bias_grad(t, backend="triton"), want)


def test_the_bias_gradient_rule_sums_64_row_blocks_as_trees_then_in_order():
    # Values whose sum depends on the order: the rule's order gives this exact result.
    t = torch.zeros(130, 1)
    t[0], t[32], t[64], t[128] = 1.0, 2.0**24, 1.0, -(2.0**24)
    # block 0: 1 + 2**24 rounds to 2**24; block 1: 1; block 2: -2**24 -> 2**24 + 1 rounds, then - 2**24
    assert bias_grad_reference(t).item() == 0.0
    assert bias_grad_reference(torch.ones(100, 3, dtype=torch.float16)).tolist() == [100.0] * 3
    assert bias_grad_reference(torch.zeros(0, 2)).tolist() == [0.0, 0.0]
