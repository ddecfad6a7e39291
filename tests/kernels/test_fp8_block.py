"""quantize_tiles / quantize_blocks: the kernel bit for bit against the torch rule, and the
rule itself against what it promises (per-tile scales, zero-padded edges, specials)."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_amp.kernels import (fp8_max, quantize_blocks, quantize_blocks_reference, quantize_tiles,
                                  quantize_tiles_reference)
from dispatch_amp.kernels import fp8_block as block_mod

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
E4M3 = torch.float8_e4m3fn

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]
needs_interpreter = pytest.mark.skipif(
    block_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def assert_bits_equal(got, want) -> None:
    """Bit-identical (any nan equals any nan), same shape; the same layout where not empty."""
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.numel():  # strides of size-1 dimensions say nothing about the layout
        strides = lambda t: [st for st, d in zip(t.stride(), t.shape) if d > 1]  # noqa: E731
        assert strides(got) == strides(want), (got.stride(), want.stride())
    nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_got, nan_want), "nan positions differ"
    ints = {1: torch.uint8, 4: torch.int32}[got.element_size()]
    g, w = got.contiguous().view(ints)[~nan_got], want.contiguous().view(ints)[~nan_want]
    assert torch.equal(g, w), f"{(g != w).sum().item()} elements differ"


@st.composite
def matrices(draw, max_side=300):
    """A matrix of random magnitudes (ragged against every tile size), specials poked in."""
    m, n = draw(st.integers(0, max_side)), draw(st.integers(0, max_side))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = torch.randn(m, n, generator=gen) * 2.0 ** draw(st.integers(-20, 20))
    if draw(st.booleans()):  # outliers: magnitudes that differ across tiles
        t = t * 2.0 ** torch.randint(-12, 12, (m, n), generator=gen).float()
    if m and n:
        for value in draw(st.lists(st.sampled_from([INF, -INF, NAN, 0.0, -0.0, 3e38, 1e-40, 65504.0]), max_size=4)):
            t[draw(st.integers(0, m - 1)), draw(st.integers(0, n - 1))] = value
    return t.to(draw(st.sampled_from(DTYPES)))


@needs_interpreter
@settings(max_examples=40)
@given(t=matrices(), fp8_dtype=st.sampled_from(FP8), pow2=st.booleans(), block=st.sampled_from([16, 32, 128]),
       ways=st.sampled_from([(True, False), (False, True), (True, True)]))
def test_tiles_kernel_matches_the_reference(t, fp8_dtype, pow2, block, ways):
    rowwise, colwise = ways
    acc = torch.zeros(1, dtype=torch.int32)
    got = quantize_tiles(t, fp8_dtype, rowwise=rowwise, colwise=colwise, power_of_two=pow2, block=block,
                         amax_acc=acc, backend="triton")
    want = quantize_tiles_reference(t, fp8_dtype, rowwise=rowwise, colwise=colwise, power_of_two=pow2, block=block)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    amax = t.float().abs().amax() if t.numel() else torch.tensor(0.0)
    assert_bits_equal(acc.view(torch.float32).reshape(()), amax)


@needs_interpreter
@settings(max_examples=40)
@given(t=matrices(), fp8_dtype=st.sampled_from(FP8), pow2=st.booleans(), block=st.sampled_from([16, 32, 128]),
       ways=st.sampled_from([(True, False), (False, True), (True, True)]))
def test_blocks_kernel_matches_the_reference(t, fp8_dtype, pow2, block, ways):
    write_q, write_qt = ways
    got = quantize_blocks(t, fp8_dtype, write_q=write_q, write_qt=write_qt, power_of_two=pow2, block=block,
                          backend="triton")
    want = quantize_blocks_reference(t, fp8_dtype, write_q=write_q, write_qt=write_qt, power_of_two=pow2, block=block)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)


# -- the rule -----------------------------------------------------------------------------


def _expand(inv: torch.Tensor, rows: int, cols: int, tile: tuple[int, int]) -> torch.Tensor:
    return inv.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 128), (128, 3), (130, 257), (256, 256), (7, 300)], ids=str)
def test_each_tile_scales_its_own_amax_to_fp8_max(shape, backend):
    # Independent of the kernel's arithmetic: dequantized values are within e4m3's rounding
    # (a relative 2**-4) of the input, and each tile's largest |value| lands on fp8_max.
    gen = torch.Generator().manual_seed(sum(shape))
    m, n = shape
    t = torch.randn(m, n, generator=gen) * 2.0 ** torch.randint(-8, 8, (m, n), generator=gen).float()
    q, q_inv, q_t, qt_inv = quantize_tiles(t, rowwise=True, colwise=True, backend=backend)
    w, _, w_inv = quantize_blocks(t, backend=backend)
    assert q_inv.shape == (m, -(-n // 128)) and qt_inv.shape == (n, -(-m // 128)) and w_inv.shape == (-(-m // 128), -(-n // 128))
    for got, want in [(q.float() * _expand(q_inv, m, n, (1, 128)), t), (q_t.float() * _expand(qt_inv, n, m, (1, 128)), t.t()),
                      (w.float() * _expand(w_inv, m, n, (128, 128)), t)]:
        err = (got - want).abs()
        assert (err <= want.abs() * 2.0**-4 + 2.0**-9 * want.abs().amax()).all()
    for r in range(m):
        for c0 in range(0, n, 128):
            assert q[r, c0:c0 + 128].float().abs().amax().item() == 448.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_edges_equal_zero_padding(backend):
    t = torch.randn(130, 200, generator=torch.Generator().manual_seed(1))
    padded = torch.nn.functional.pad(t, (0, 56, 0, 126))  # to 256 x 256
    q, q_inv, q_t, qt_inv = quantize_tiles(t, rowwise=True, colwise=True, backend=backend)
    pq, pq_inv, pq_t, pqt_inv = quantize_tiles(padded, rowwise=True, colwise=True, backend=backend)
    assert torch.equal(q.view(torch.uint8), pq[:130, :200].view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), pq_t[:200, :130].view(torch.uint8))
    assert torch.equal(q_inv, pq_inv[:130]) and torch.equal(qt_inv, pqt_inv[:200])
    w, w_t, w_inv = quantize_blocks(t, write_qt=True, backend=backend)
    pw, _, pw_inv = quantize_blocks(padded, backend=backend)
    assert torch.equal(w.view(torch.uint8), pw[:130, :200].view(torch.uint8)) and torch.equal(w_inv, pw_inv)
    assert torch.equal(w_t.view(torch.uint8), w.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_specials_spoil_only_their_own_tile(backend):
    t = torch.ones(4, 256)
    t[0, 5] = NAN
    t[1, 200] = INF
    t[2, :128] = 0.0
    q, q_inv, _, _ = quantize_tiles(t, backend=backend)
    qf = q.float()
    assert qf[0, :128].isnan().all() and q_inv[0, 0].isnan() and (qf[0, 128:] == 448).all()
    # inf: the tile's scale is 0, its finite values 0 and the inf itself nan
    assert (qf[1, 128:200] == 0).all() and qf[1, 200].isnan() and q_inv[1, 1].item() == INF
    assert (qf[1, :128] == 448).all()
    # an all-zero tile keeps the scale 1
    assert (qf[2, :128] == 0).all() and q_inv[2, 0].item() == 1.0
    w, _, w_inv = quantize_blocks(t, backend=backend)
    assert w.float()[:, :128].isnan().all() and w_inv[0, 0].isnan() and w_inv[0, 1].item() == INF


@pytest.mark.parametrize("backend", BACKENDS)
def test_power_of_two_scales_round_down(backend):
    t = torch.randn(64, 300, generator=torch.Generator().manual_seed(2)) * 3.0
    _, q_inv, _, qt_inv = quantize_tiles(t, rowwise=True, colwise=True, power_of_two=True, backend=backend)
    _, _, w_inv = quantize_blocks(t, power_of_two=True, backend=backend)
    _, exact_inv, _, _ = quantize_tiles(t, backend=backend)
    for inv in (q_inv, qt_inv, w_inv):
        mantissa, _ = torch.frexp(inv)
        assert (mantissa == 0.5).all()
    # a smaller scale: a larger inverse, never saturating
    assert (q_inv >= exact_inv).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_layouts_are_what_the_gemm_reads(backend):
    t = torch.randn(200, 300)
    _, q_inv, _, qt_inv = quantize_tiles(t, rowwise=True, colwise=True, backend=backend)
    assert q_inv.stride() == (1, 200) and qt_inv.stride() == (1, 300)
    _, _, w_inv = quantize_blocks(t, backend=backend)
    assert w_inv.is_contiguous()


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="2-D"):
        quantize_tiles(torch.ones(4))
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize_blocks(torch.ones(4, 4), torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        quantize_tiles(torch.ones(4, 4), block=100)
    with pytest.raises(ValueError, match="rowwise=True and/or colwise=True"):
        quantize_tiles(torch.ones(4, 4), rowwise=False)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_blocks(torch.ones(4, 8).t())
    with pytest.raises(TypeError, match="one-element int32"):
        quantize_tiles(torch.ones(4, 4), amax_acc=torch.zeros(1))
    assert fp8_max(E4M3) == 448.0
