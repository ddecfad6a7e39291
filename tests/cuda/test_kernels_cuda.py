"""The Triton kernels compiled for a CUDA GPU, bit for bit against torch's own CUDA ops.

What is compared, all on CUDA tensors:

* ``unscale_check_`` / ``check_finite_`` (kernels/unscale.py, Triton path) against
  ``torch._amp_foreach_non_finite_check_and_unscale_`` on CUDA for fp32, fp16 (and fp64,
  complex through their real views); bf16, which torch's CUDA op refuses, against torch's
  CPU fused op on a copy, against the module's plain-torch reference on CUDA and against
  an fp32 computation. Unscaled values bit for bit (any nan equals any nan), ``found_inf``
  exactly.
* ``update_scale_`` (kernels/scale_update.py, Triton path) against
  ``torch._amp_update_scale_`` on CUDA: scale bits and growth tracker after every step.
* ``amax_and_cast`` / ``cast_transpose`` (kernels/fp8_cast.py, Triton path) against the
  module's torch path on CUDA and its reference on CPU: fp8 bits, amax, saturation count.

Every test first makes sure that the Triton kernel really ran compiled for the GPU (not the
interpreter, not the torch fallback), so that no test can end up comparing torch with torch.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from dispatch_amp.kernels import (
    ScaleState,
    amax_and_cast,
    amax_and_cast_reference,
    cast_transpose,
    cast_transpose_reference,
    check_finite_,
    clear_table_cache,
    fp8_max,
    unscale_check_,
    unscale_check_reference,
    update_scale_,
    update_scale_reference,
)
from dispatch_amp.kernels import fp8_cast as fp8_mod
from dispatch_amp.kernels import scale_update as scale_update_mod
from dispatch_amp.kernels import unscale as unscale_mod

# Our kernels must run compiled on the GPU (tests/cuda/conftest.py).
pytestmark = pytest.mark.usefixtures("compiled_triton")

# A torch.device is a plain value: building it does not initialize CUDA, so collection
# works on machines without a GPU (tests/cuda/conftest.py then skips every test here).
CUDA = torch.device("cuda")
INF, NAN = float("inf"), float("nan")
SPECIALS = [INF, -INF, NAN]
POSITIONS = ["first", "last", "random"]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_INPUTS = [torch.float32, torch.bfloat16, torch.float16]
# Scales as GradScaler meets them: powers of two at both ends of the usual range, and
# scales whose reciprocal is not a power of two (so every product rounds).
SCALES = [2.0**-24, 2.0**24, 2.0**16, 1.0, 3.0, 0.7, 1.1 * 2.0**13, 65504.0]


@pytest.fixture
def unscale_spy(monkeypatch, launch_counter):
    """Counts Triton launches of the unscale kernel, and records which positions of the
    caller's list went to the torch path instead."""
    counter = launch_counter(unscale_mod._unscale_check_kernel)
    monkeypatch.setattr(unscale_mod, "_unscale_check_kernel", counter)
    torch_slots: list[int] = []
    real_torch_path = unscale_mod._torch_path

    def recording_torch_path(grads, slots, *args):
        torch_slots.extend(range(len(grads)) if slots is None else slots)
        return real_torch_path(grads, slots, *args)

    monkeypatch.setattr(unscale_mod, "_torch_path", recording_torch_path)
    counter.torch_slots = torch_slots
    return counter


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=CUDA).manual_seed(seed)


def random_grad(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values over many magnitudes: fp32/bf16 down into fp32's subnormals (a flushing
    multiply would show there), fp16 up to where a scale of 2**24 overflows it."""
    lo, hi = (-24, 12) if dtype == torch.float16 else (-135, 100)
    exps = torch.randint(lo, hi, (numel,), device=CUDA, generator=gen).float()
    return (torch.randn(numel, device=CUDA, generator=gen) * torch.exp2(exps)).to(dtype)


def inv_of(scale: float) -> torch.Tensor:
    """What GradScaler hands the kernel: the reciprocal in fp64, rounded once to fp32,
    as a 1-element CUDA tensor (the shape torch's fused op documents)."""
    return torch.tensor([scale], dtype=torch.float32, device=CUDA).double().reciprocal().float()


def poke(g: torch.Tensor, pos: int, value: float) -> None:
    """g.flatten()[pos] = value, also for non-contiguous views (flatten would copy them)."""
    g[tuple(int(i) for i in np.unravel_index(pos, g.shape))] = value


def place(g: torch.Tensor, where: str, value: float, rng: np.random.Generator) -> None:
    pos = {"first": 0, "last": g.numel() - 1, "random": int(rng.integers(0, g.numel()))}[where]
    poke(g, pos, value)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bit-identical, except that any nan equals any nan (payloads are not part of the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    want = want.to(got.device)
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), f"{what}: nan positions differ"
    g, w = got.view(BITS[got.dtype])[~nan_got], want.view(BITS[want.dtype])[~nan_want]
    if not torch.equal(g, w):
        k = (g != w).nonzero()[0].item()
        raise AssertionError(
            f"{what}: {(g != w).sum().item()} of {g.numel()} elements differ, first: "
            f"{got[~nan_got][k].item()!r} vs {want[~nan_want][k].item()!r}"
        )


def torch_oracle(grads, inv: torch.Tensor, found_before: float = 0.0):
    """Clones of ``grads`` unscaled by torch's fused ops, and the found_inf they set.

    fp32/fp16/fp64 through the CUDA op. bf16, which the CUDA op refuses, through the CPU op
    on a copy: an independent implementation with the same contract (fp32 math, one
    round-to-nearest-even to bf16)."""
    out = [g.clone() for g in grads]
    found = torch.full((1,), found_before, dtype=torch.float32, device=CUDA)
    on_cuda = [g for g in out if g.dtype != torch.bfloat16]
    if on_cuda:
        torch._amp_foreach_non_finite_check_and_unscale_(on_cuda, found, inv)
    bf16 = [g for g in out if g.dtype == torch.bfloat16]
    if bf16:
        cpu = [g.cpu() for g in bf16]
        found_cpu = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(cpu, found_cpu, inv.cpu())
        for g, c in zip(bf16, cpu):
            g.copy_(c)
        found = torch.maximum(found, found_cpu.to(CUDA))
    return out, found


def check_unscale(grads, inv, *, num_programs=None, found_before=0.0, what=""):
    ref, found_ref = torch_oracle(grads, inv, found_before)
    found = torch.full((1,), found_before, dtype=torch.float32, device=CUDA)
    unscale_mod._unscale_check(grads, inv, found, "auto", num_programs=num_programs)
    assert found.item() == found_ref.item(), f"{what}: found_inf {found.item()} vs torch {found_ref.item()}"
    for k, (got, want) in enumerate(zip(grads, ref)):
        assert_bits_equal(got, want, f"{what} grads[{k}] ({got.dtype}, {tuple(got.shape)})")
    return found.item()


# --------------------------------------------------------------------------------------
# unscale_check_ / check_finite_
# --------------------------------------------------------------------------------------


def test_the_triton_kernel_takes_every_dense_fp32_fp16_bf16_gradient_in_one_launch(unscale_spy):
    gen = cuda_gen(0)
    grads = [random_grad(5000, torch.float32, gen), random_grad(7, torch.float16, gen), random_grad(4097, torch.bfloat16, gen)]
    check_unscale(grads, inv_of(3.0))
    assert unscale_spy.launches == 1
    assert unscale_spy.torch_slots == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [1, 3, 1023, 4097, 1_000_003])
def test_unscale_odd_sizes_bit_for_bit(unscale_spy, dtype, numel):
    rng = np.random.default_rng(numel)
    cases = [None] + [(value, where) for value in SPECIALS for where in POSITIONS]
    for k, scale in enumerate(SCALES):
        for case in cases[k % 2 :: 2]:  # every case meets several scales, not all of them
            g = random_grad(numel, dtype, cuda_gen(k * 100 + numel))
            if case is not None:
                place(g, case[1], case[0], rng)
            found = check_unscale([g], inv_of(scale), what=f"scale={scale} case={case}")
            assert found == (0.0 if case is None else 1.0)
    assert unscale_spy.torch_slots == [] and unscale_spy.launches > 0


def test_unscale_random_inverse_scales_bit_for_bit(unscale_spy):
    # Not only reciprocals of "nice" scales: arbitrary fp32 multipliers over a wide range.
    gen = cuda_gen(7)
    invs = torch.exp2(torch.rand(24, device=CUDA, generator=gen) * 60 - 30) * (1 + torch.rand(24, device=CUDA, generator=gen))
    for k in range(invs.numel()):
        grads = [random_grad(n, dt, gen) for n, dt in [(4097, torch.float32), (30_001, torch.float16), (12_345, torch.bfloat16)]]
        check_unscale(grads, invs[k : k + 1].clone(), what=f"inv={invs[k].item()!r}")
    assert unscale_spy.torch_slots == []


def test_unscale_noncontiguous_layouts(unscale_spy):
    gen = cuda_gen(1)
    big = random_grad(70 * 90 + 8, torch.float32, gen)
    grads = [
        random_grad(70 * 90, torch.float32, gen).view(70, 90).t(),  # transposed, dense: kernel
        random_grad(64 * 3 * 5 * 5, torch.float16, gen).view(64, 3, 5, 5).to(memory_format=torch.channels_last),  # kernel
        big[4 : 4 + 70 * 90].view(90, 70),  # 16 bytes into its allocation: aligned, kernel
        random_grad(40 * 40, torch.float32, gen).view(40, 40)[:, ::2],  # strided slice with gaps: torch path
        random_grad(33 * 64, torch.bfloat16, gen).view(33, 64)[::3, 1::2],  # gappy bf16: torch path (reference)
        random_grad(5001, torch.float32, gen)[1:],  # 4 bytes past its allocation: torch path
        random_grad(77, torch.float64, gen),  # fp64: torch path
        torch.empty(0, device=CUDA),
        random_grad(3 * 4099, torch.bfloat16, gen).view(3, -1).t(),  # transposed bf16: kernel
    ]
    assert [unscale_mod._triton_can_take(g) for g in grads] == [True, True, True, False, False, False, False, False, True]
    rng = np.random.default_rng(1)
    for round_, value in enumerate([None, INF, NAN, -INF]):
        for k, where in [(3, "last"), (0, "first"), (4, "random"), (8, "last"), (5, "random")][: 0 if value is None else 5]:
            place(grads[k], where, value, rng)
        found = check_unscale(grads, inv_of(SCALES[round_]), what=f"round {round_}")
        assert found == (0.0 if value is None else 1.0)
    # Exactly the gradients the kernel cannot take (the empty one included) went through
    # torch, in every round.
    assert sorted(set(unscale_spy.torch_slots)) == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("num_programs", [None, 1, 5, 1000])
def test_unscale_many_tensors_of_mixed_sizes_and_dtypes(unscale_spy, num_programs):
    rng = np.random.default_rng(2)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    sizes = [int(s) for s in rng.integers(1, 70_000, 300)]
    sizes[::37] = [1, 4095, 4096, 4097, 8192, 3, 1, 65_537, 2]  # tile edges among them
    plan = [(n, dtypes[int(rng.integers(0, 3))]) for n in sizes]
    cases = [None] + [(value, where) for value in SPECIALS for where in POSITIONS]
    for seed, case in enumerate(cases):
        gen = cuda_gen(1000 + seed)
        grads = [random_grad(n, dt, gen) for n, dt in plan]
        if case is not None:
            victim = int(rng.integers(0, len(grads)))
            place(grads[victim], case[1], case[0], rng)
        scale = SCALES[seed % len(SCALES)]
        found = check_unscale(grads, inv_of(scale), num_programs=num_programs, what=f"case={case}")
        assert found == (0.0 if case is None else 1.0)
    assert unscale_spy.torch_slots == []
    assert unscale_spy.launches == len(cases)


def test_unscale_leaves_a_raised_found_inf_raised(unscale_spy):
    grads = [torch.ones(5000, device=CUDA), torch.ones(3, dtype=torch.bfloat16, device=CUDA)]
    assert check_unscale(grads, inv_of(2.0), found_before=1.0) == 1.0
    assert grads[0].eq(0.5).all() and grads[1].eq(0.5).all()


def test_empty_list_and_empty_tensors_launch_nothing(unscale_spy):
    found = torch.zeros(1, device=CUDA)
    unscale_check_([], inv_of(2.0), found)
    check_finite_([], found)
    unscale_check_([torch.empty(0, device=CUDA), torch.empty(0, 3, dtype=torch.float16, device=CUDA)], inv_of(2.0), found)
    assert found.item() == 0.0
    assert unscale_spy.launches == 0


@pytest.mark.parametrize("numel", [1, 4097, 1_000_003])
def test_bf16_against_the_reference_and_an_fp32_computation(unscale_spy, numel):
    # torch's CUDA fused op refuses bf16 ("not implemented for 'BFloat16'"), so here the
    # oracles are the module's plain-torch reference on CUDA and the rule written out:
    # widen to fp32, one fp32 multiply, one round-to-nearest-even back to bf16.
    with pytest.raises(RuntimeError, match="BFloat16"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(2, dtype=torch.bfloat16, device=CUDA)], torch.zeros(1, device=CUDA), inv_of(2.0))
    rng = np.random.default_rng(numel)
    for k, scale in enumerate(SCALES):
        g = random_grad(numel, torch.bfloat16, cuda_gen(k))
        if k % 2:
            place(g, POSITIONS[k % 3], SPECIALS[k % 3], rng)
        inv = inv_of(scale)
        by_reference = g.clone()
        found_ref = torch.zeros(1, device=CUDA)
        unscale_check_reference([by_reference], inv, found_ref)
        by_fp32 = (g.float() * inv).to(torch.bfloat16)
        found = torch.zeros(1, device=CUDA)
        unscale_check_([g], inv, found)
        assert found.item() == found_ref.item() == float(k % 2)
        assert_bits_equal(g, by_reference, f"scale={scale} vs reference")
        assert_bits_equal(g, by_fp32, f"scale={scale} vs fp32")
    assert unscale_spy.torch_slots == []


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_gradients_unscale_both_parts(unscale_spy, dtype):
    # The module takes complex gradients through view_as_real (complex64 -> fp32 pairs in
    # the kernel, complex128 -> fp64 pairs on torch's path); torch's op gets the same views.
    gen = cuda_gen(3)
    rng = np.random.default_rng(3)
    for case in [None, (INF, "first"), (NAN, "last"), (-INF, "random")]:
        grad = torch.complex(torch.randn(10_001, device=CUDA, generator=gen), torch.randn(10_001, device=CUDA, generator=gen)).to(dtype)
        if case is not None:
            real = torch.view_as_real(grad)
            place(real, case[1], case[0], rng)  # a real or an imaginary part, wherever it lands
        want = torch.view_as_real(grad).clone()
        found_ref = torch.zeros(1, device=CUDA)
        torch._amp_foreach_non_finite_check_and_unscale_([want], found_ref, inv_of(3.0))
        found = torch.zeros(1, device=CUDA)
        unscale_check_([grad], inv_of(3.0), found)
        assert found.item() == found_ref.item() == (0.0 if case is None else 1.0)
        assert_bits_equal(torch.view_as_real(grad), want, f"{dtype} case={case}")
    if dtype == torch.complex64:
        assert unscale_spy.launches == 4 and unscale_spy.torch_slots == []
    else:
        assert unscale_spy.launches == 0


def test_check_finite_reads_and_never_writes(unscale_spy):
    gen = cuda_gen(4)
    grads = [random_grad(n, dt, gen) for n, dt in [(9000, torch.float32), (4097, torch.float16), (3, torch.bfloat16), (1_000_003, torch.float32)]]
    # nan payloads that no arithmetic store would produce: a write of any kind would show.
    payload = {torch.float32: 0x7FC00001, torch.float16: 0x7E01, torch.bfloat16: 0x7FC1}
    for g in grads[:3]:
        g.view(BITS[g.dtype])[1] = payload[g.dtype]
    before = [g.clone() for g in grads]
    _, found_ref = torch_oracle([g.clone() for g in grads], torch.ones(1, device=CUDA))
    found = torch.zeros(1, device=CUDA)
    nonfinite = torch.zeros(len(grads), dtype=torch.int32, device=CUDA)
    check_finite_(grads, found, nonfinite=nonfinite)
    assert found.item() == found_ref.item() == 1.0
    assert nonfinite.tolist() == [1, 1, 1, 0]
    for got, want in zip(grads, before):
        assert torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))
    assert unscale_spy.launches == 1 and unscale_spy.torch_slots == []


def test_per_tensor_flags_from_the_compiled_kernel(unscale_spy):
    gen = cuda_gen(5)
    rng = np.random.default_rng(5)
    grads = [random_grad(n, dt, gen) for n, dt in [(4096 * 6 - 5, torch.float32), (100, torch.float16), (4096, torch.bfloat16), (1, torch.float32), (4097, torch.float16)]]
    bad = {0: (INF, "last"), 2: (NAN, "first"), 4: (-INF, "random")}
    for k, (value, where) in bad.items():
        place(grads[k], where, value, rng)
    for programs in (1, 3, 4, None):
        trial = [g.clone() for g in grads]
        ref, found_ref = torch_oracle(trial, inv_of(1024.0))
        found = torch.zeros(1, device=CUDA)
        nonfinite = torch.zeros(len(trial), dtype=torch.int32, device=CUDA)
        unscale_mod._unscale_check(trial, inv_of(1024.0), found, "auto", nonfinite=nonfinite, num_programs=programs)
        assert nonfinite.tolist() == [int(k in bad) for k in range(len(trial))], programs
        assert found.item() == found_ref.item() == 1.0
        for got, want in zip(trial, ref):
            assert_bits_equal(got, want, f"programs={programs}")


def test_cached_table_serves_new_values_and_a_changed_set(unscale_spy):
    clear_table_cache()
    gen = cuda_gen(6)
    grads = [random_grad(50_000, torch.float32, gen), random_grad(777, torch.float16, gen)]
    for step in range(3):  # same storage, new values: the cached table must still be right
        grads[0].copy_(random_grad(50_000, torch.float32, gen))
        grads[1].copy_(random_grad(777, torch.float16, gen))
        check_unscale(grads, inv_of(SCALES[step]))
    assert len(unscale_mod._table_cache) == 1
    grads.append(random_grad(4097, torch.bfloat16, gen))
    check_unscale(grads, inv_of(3.0))
    assert len(unscale_mod._table_cache) == 2
    # Freed and reallocated (the caching allocator may hand back the same addresses).
    del grads
    grads = [random_grad(50_000, torch.float32, gen), random_grad(777, torch.float16, gen)]
    poke(grads[1], 776, NAN)
    assert check_unscale(grads, inv_of(5.0)) == 1.0
    assert unscale_spy.torch_slots == []


def _free_cuda():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_multi_gib_gradients_with_an_inf_in_the_very_last_element(unscale_spy):
    # ~2.5 GiB of fp32 gradients in three tensors (plus the same again for torch's copy).
    sizes = [223_696_213, 223_696_211, 223_696_217]
    try:
        gen = cuda_gen(8)
        grads = [torch.randn(n, device=CUDA, generator=gen) for n in sizes]
        assert sum(g.numel() * 4 for g in grads) > 2.4 * 2**30
        grads[-1][-1] = INF
        inv = inv_of(1.1 * 2.0**13)
        ref = [g.clone() for g in grads]
        found_ref = torch.zeros(1, device=CUDA)
        torch._amp_foreach_non_finite_check_and_unscale_(ref, found_ref, inv)
        found = torch.zeros(1, device=CUDA)
        unscale_check_(grads, inv, found)
        assert found.item() == found_ref.item() == 1.0
        for got, want in zip(grads, ref):  # no nan anywhere: plain bit equality
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert torch.isinf(grads[-1][-1]) and torch.isfinite(grads[-1][:-1]).all()
        del ref
        # The same tensors, finite again: found_inf stays 0 over all 2.5 GiB.
        grads[-1][-1] = 1.0
        found = torch.zeros(1, device=CUDA)
        check_finite_(grads, found)
        assert found.item() == 0.0
        assert unscale_spy.launches == 2 and unscale_spy.torch_slots == []
    finally:
        grads = ref = None
        _free_cuda()


def test_element_offsets_past_2_to_the_31(unscale_spy):
    # One fp16 gradient of 2**31 + 4097 elements (4 GiB): tile and element indices past
    # int32 range, a nan in the ragged last tile and an inf just past the 2**31 boundary.
    n = 2**31 + 4097
    try:
        g = torch.randn(n, device=CUDA, dtype=torch.float16, generator=cuda_gen(9))
        g[n - 1] = NAN
        g[2**31 + 1] = INF
        inv = inv_of(4.0)
        ref = g.clone()
        found_ref = torch.zeros(1, device=CUDA)
        torch._amp_foreach_non_finite_check_and_unscale_([ref], found_ref, inv)
        found = torch.zeros(1, device=CUDA)
        unscale_check_([g], inv, found)
        assert found.item() == found_ref.item() == 1.0
        assert torch.equal(torch.isnan(g), torch.isnan(ref))
        assert torch.equal(torch.nan_to_num(g, nan=0.0).view(torch.int16), torch.nan_to_num(ref, nan=0.0).view(torch.int16))
        assert g[2**31 + 2].item() == ref[2**31 + 2].item() and g[0].item() == ref[0].item()
        assert unscale_spy.launches == 1
    finally:
        g = ref = None
        _free_cuda()


# --------------------------------------------------------------------------------------
# update_scale_
# --------------------------------------------------------------------------------------

FACTORS = [(2.0, 0.5), (1.5, 0.3), (4.0, 0.25), (1.0001, 0.999), (8.0, 0.01), (1.1, 0.7)]
FLAGS = [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, NAN, INF, -0.0]


def f32_bits(x: torch.Tensor) -> int:
    return x.view(torch.int32).item()


@pytest.mark.parametrize("growth_interval", [1, 2, 3, 2000])
@pytest.mark.parametrize("growth_factor, backoff_factor", FACTORS)
def test_update_scale_matches_torch_bit_for_bit(monkeypatch, launch_counter, growth_interval, growth_factor, backoff_factor):
    counter = launch_counter(scale_update_mod._update_scale_kernel)
    monkeypatch.setattr(scale_update_mod, "_update_scale_kernel", counter)
    rng = np.random.default_rng(growth_interval * 1000 + int(growth_factor * 100))
    # Near the top (growth must stop short of inf), the default, tiny (backoff into fp32
    # subnormals and to 0) and an odd value whose products all round.
    inits = [3.0e38, 2.0**16, 1.1 * 2.0**-120, 1.3333333]
    steps = 60
    for init in inits:
        # With an interval of 2000 the trackers start close to it, so growth happens too.
        tracker0 = growth_interval - 7 if growth_interval > 100 else 0
        ours = ScaleState.create(CUDA, init, growth_tracker=tracker0)
        scale = torch.full((1,), init, dtype=torch.float32, device=CUDA)
        tracker = torch.full((1,), tracker0, dtype=torch.int32, device=CUDA)
        schedule = [FLAGS[int(i)] for i in rng.integers(0, len(FLAGS), steps)]
        grew = backed = 0
        for k, flag in enumerate(schedule):
            found = torch.full((1,), flag, dtype=torch.float32, device=CUDA)
            before = scale.item()
            torch._amp_update_scale_(scale, tracker, found, growth_factor, backoff_factor, growth_interval)
            update_scale_(ours, found, growth_factor, backoff_factor, growth_interval)
            assert f32_bits(ours.scale) == f32_bits(scale), f"init={init} step {k} flag={flag}: {ours.scale.item()!r} vs torch {scale.item()!r}"
            assert ours.growth_tracker.item() == tracker.item(), f"init={init} step {k}"
            grew += scale.item() > before
            backed += scale.item() < before
        skipped = sum(1 for f in schedule if f != 0 or f != f)
        assert ours.skipped_steps.item() == skipped
        assert backed > 0 or init < 1e-30  # the tiny scale may reach 0 and stay there
    assert counter.launches == steps * len(inits)


def test_update_scale_extensions_against_the_reference_on_cuda():
    # Hysteresis and bounds have no torch counterpart: the plain-Python rule is the oracle.
    rng = np.random.default_rng(11)
    for hysteresis, lo, hi in [(1, 1.0, 2.0**20), (2, None, 2.0**10), (3, 2.0**-10, None), (2, 3.0, 1e6)]:
        init = 64.0
        st = ScaleState.create(CUDA, init, hysteresis=hysteresis)
        scale, tracker, hyst, skipped, hits = init, 0, hysteresis, 0, 0
        for k in range(80):
            flag = FLAGS[int(rng.integers(0, len(FLAGS)))]
            update_scale_(st, torch.full((1,), flag, device=CUDA), 2.0, 0.5, 2, hysteresis=hysteresis, min_scale=lo, max_scale=hi)
            scale, tracker, hyst, skip, hit = update_scale_reference(
                scale, tracker, flag, 2.0, 0.5, 2, hysteresis=hysteresis, hysteresis_tracker=hyst, min_scale=lo, max_scale=hi
            )
            skipped, hits = skipped + skip, hits + hit
            got = (st.scale.item(), st.growth_tracker.item(), st.hysteresis_tracker.item(), st.skipped_steps.item(), st.floor_hits.item())
            assert got == (scale, tracker, hyst, skipped, hits), f"hysteresis={hysteresis} bounds=({lo}, {hi}) step {k}"


# --------------------------------------------------------------------------------------
# amax_and_cast / cast_transpose
# --------------------------------------------------------------------------------------


@pytest.fixture
def fp8_spy(monkeypatch):
    """Counts the calls of the fp8 kernels' public functions that take the Triton path
    (backend="auto" must reach it), by the name they pass to use_triton."""
    calls = {"amax_and_cast": 0, "cast_transpose": 0}
    real = fp8_mod.use_triton

    def counting(backend, device, name):
        taken = real(backend, device, name)
        if taken and name in calls:
            calls[name] += 1
        return taken

    monkeypatch.setattr(fp8_mod, "use_triton", counting)
    return calls


def assert_fp8_equal(got, want, what: str, *, any_nan: bool = False) -> None:
    """fp8 tensors bit for bit, amax bit for bit but for nan payloads, saturation counts
    exactly. ``any_nan``: a nan of either sign matches (see check_fp8)."""
    *qs_got, amax_got, sat_got = got
    *qs_want, amax_want, sat_want = want
    for q_got, q_want in zip(qs_got, qs_want):
        assert q_got.dtype == q_want.dtype and q_got.shape == q_want.shape and q_got.is_contiguous(), what
        a, b = q_got.view(torch.uint8), q_want.to(q_got.device).view(torch.uint8)
        if any_nan:
            a = torch.where(torch.isnan(q_got.float()), 0x7F, a)
            b = torch.where(torch.isnan(q_want.to(q_got.device).float()), 0x7F, b)
        if not torch.equal(a, b):
            k = (a != b).nonzero()[0]
            raise AssertionError(f"{what}: {(a != b).sum().item()} fp8 values differ, first at {k.tolist()}: {hex(a[tuple(k)].item())} vs {hex(b[tuple(k)].item())}")
    assert amax_got.shape == () and amax_got.dtype == torch.float32
    amax_want = amax_want.to(amax_got.device)
    if torch.isnan(amax_want):
        assert torch.isnan(amax_got), f"{what}: amax {amax_got.item()} vs nan"
    else:
        assert f32_bits(amax_got) == f32_bits(amax_want), f"{what}: amax {amax_got.item()!r} vs {amax_want.item()!r}"
    assert sat_got.dtype == torch.int64 and sat_got.item() == sat_want.item(), f"{what}: saturated {sat_got.item()} vs {sat_want.item()}"


def check_fp8(fn: str, t: torch.Tensor, scale: float, fp8_dtype, what: str, **kwargs):
    """Triton (backend "auto" on CUDA, or the internal entry with a grid/tile override)
    against the torch path on CUDA and the reference on CPU."""
    s = torch.tensor(scale, dtype=torch.float32, device=CUDA)
    if fn == "amax_and_cast":
        got = fp8_mod._amax_and_cast(t, s, fp8_dtype, "auto", **kwargs) if kwargs else amax_and_cast(t, s, fp8_dtype)
        on_cuda = amax_and_cast(t, s, fp8_dtype, backend="torch")
        on_cpu = amax_and_cast_reference(t.cpu(), s.cpu(), fp8_dtype)
    else:
        got = fp8_mod._cast_transpose(t, s, fp8_dtype, "auto", **kwargs) if kwargs else cast_transpose(t, s, fp8_dtype)
        on_cuda = cast_transpose(t, s, fp8_dtype, backend="torch")
        on_cpu = cast_transpose_reference(t.cpu(), s.cpu(), fp8_dtype)
        assert torch.equal(got[1].view(torch.uint8), got[0].t().contiguous().view(torch.uint8)), what
    assert all(x.device.type == "cuda" for x in got), what
    # Against torch on the GPU every bit, nan included (0x7F by the module's rule and by
    # torch's cast of the GPU's canonical nan). The CPU's nan from 0 * inf has the sign
    # bit set (x86's default nan), which its cast keeps (0xFF): there any nan matches.
    assert_fp8_equal(got, on_cuda, f"{what} vs torch on CUDA")
    assert_fp8_equal(got, on_cpu, f"{what} vs reference on CPU", any_nan=True)
    return got


def grid_points(fp8_dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours (the exact ties), the fp32
    values either side of each midpoint, values past fp8_max, tiny values and specials."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    values = values[torch.isfinite(values) & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    below = torch.nextafter(mids, torch.zeros(()))
    above = torch.nextafter(mids, torch.full((), INF))
    limit = fp8_max(fp8_dtype)
    beyond = torch.tensor([limit * 1.0001, limit * 1.0625, limit * 1.1, limit * 2, 3e38, INF, NAN])
    tiny = torch.cat([values[1] * torch.tensor([0.5, 0.25, 0.75, 1.5, 2.5]), torch.tensor([1e-45, 1e-40])])
    pos = torch.cat([values, mids, below, above, beyond, tiny])
    return torch.cat([pos, -pos])


def special_tensor(numel: int, dtype, fp8_dtype, seed: int) -> torch.Tensor:
    """Random values over many magnitudes with specials, saturating values and values in
    the fp8 subnormal range scattered through them."""
    gen = cuda_gen(seed)
    t = torch.randn(numel, device=CUDA, generator=gen) * torch.exp2(torch.randint(-20, 20, (numel,), device=CUDA, generator=gen).float())
    limit = fp8_max(fp8_dtype)
    step = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[fp8_dtype]
    extras = [INF, -INF, NAN, 0.0, -0.0, limit, -limit, limit * 1.5, -3e38, step, 0.5 * step, 1.5 * step, -2.5 * step]
    picks = torch.randint(0, numel, (min(numel, 3 * len(extras)),), device=CUDA, generator=gen).tolist()
    for k, p in enumerate(picks):
        t[p] = extras[k % len(extras)]
    return t.to(dtype)


def as_2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    flat = t.flatten()
    return torch.cat([flat, flat.new_zeros((-flat.numel()) % cols)]).view(-1, cols)


@pytest.mark.parametrize("dtype", FP8_INPUTS, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_every_fp8_value_tie_and_neighbour(fp8_spy, fp8_dtype, dtype):
    t = grid_points(fp8_dtype).to(dtype).to(CUDA)
    for scale in (1.0, 2.0, 0.5):  # powers of two keep the ties ties
        got = check_fp8("amax_and_cast", t, scale, fp8_dtype, f"grid scale={scale}")
        assert torch.isnan(got[1])  # the grid holds a nan, and nan wins the amax
        check_fp8("amax_and_cast", t, scale, fp8_dtype, f"grid scale={scale} block=256", num_programs=3, block=256)
        check_fp8("cast_transpose", as_2d(t, 61), scale, fp8_dtype, f"grid 2-d scale={scale}")
        check_fp8("cast_transpose", as_2d(t, 37), scale, fp8_dtype, f"grid 2-d scale={scale} tile", num_programs=2, tile=(16, 32))
    assert fp8_spy["amax_and_cast"] == 6 and fp8_spy["cast_transpose"] == 6


FP8_SCALES = [1.0, 0.75, 3.0, 2.0**-20, 2.0**20, 1e30, 0.0, -2.5, INF, NAN]


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_scales_saturation_and_specials(fp8_spy, fp8_dtype):
    for dtype in FP8_INPUTS:
        t = special_tensor(100_003, dtype, fp8_dtype, seed=FP8_INPUTS.index(dtype))
        for scale in FP8_SCALES:
            got = check_fp8("amax_and_cast", t, scale, fp8_dtype, f"{dtype} scale={scale}")
            # Saturation as the rule states it: finite inputs whose product lies beyond the
            # midpoint past fp8_max.
            y = t.float() * torch.tensor(scale, device=CUDA)
            want = int(((y.abs() > fp8_mod.SATURATES_ABOVE[fp8_dtype]) & torch.isfinite(t.float())).sum())
            assert got[2].item() == want
            check_fp8("cast_transpose", t[:100_000].view(250, 400), scale, fp8_dtype, f"{dtype} 2-d scale={scale}")
    # Values far beyond fp8_max at an ordinary scale: every one saturates to +-fp8_max.
    big = torch.tensor([1e5, -1e6, 3e38, -3e38, 6e4, -7e4], device=CUDA)
    q, amax, saturated = check_fp8("amax_and_cast", big, 1.0, fp8_dtype, "beyond fp8_max")
    limit = fp8_max(fp8_dtype)
    assert q.float().abs().tolist() == [min(abs(v), limit) for v in big.tolist()]
    assert saturated.item() == int((big.abs() > fp8_mod.SATURATES_ABOVE[fp8_dtype]).sum())


SHAPES_1D = [(1,), (0,), (4095,), (4096,), (4097,), (1_000_003,), (3, 5, 7), (2, 4099), ()]
SHAPES_2D = [(1, 1), (1, 200), (200, 1), (63, 65), (64, 64), (65, 63), (129, 191), (1000, 1537), (1031, 4100), (0, 5), (5, 0)]


@pytest.mark.parametrize("shape", SHAPES_1D, ids=str)
def test_amax_and_cast_shapes(fp8_spy, shape):
    numel = int(np.prod(shape))
    for dtype in FP8_INPUTS:
        for fp8_dtype in FP8:
            t = special_tensor(max(numel, 1), dtype, fp8_dtype, seed=numel)[:numel].reshape(shape)
            got = check_fp8("amax_and_cast", t, 16.0, fp8_dtype, f"{dtype} {fp8_dtype}")
            if numel == 0:
                assert got[1].item() == 0.0 and got[2].item() == 0
    assert fp8_spy["amax_and_cast"] == 6


@pytest.mark.parametrize("shape", SHAPES_2D, ids=str)
def test_cast_transpose_shapes(fp8_spy, shape):
    numel = shape[0] * shape[1]
    for dtype in FP8_INPUTS:
        for fp8_dtype in FP8:
            t = special_tensor(max(numel, 1), dtype, fp8_dtype, seed=numel)[:numel].reshape(shape)
            q, q_t, amax, saturated = check_fp8("cast_transpose", t, 0.125, fp8_dtype, f"{dtype} {fp8_dtype}")
            assert q_t.shape == (shape[1], shape[0]) and q_t.is_contiguous()
            # The two kernels agree with each other as well.
            assert_fp8_equal(amax_and_cast(t, torch.tensor(0.125, device=CUDA), fp8_dtype), (q, amax, saturated), f"{shape} kernels")
    assert fp8_spy["cast_transpose"] == 6 and fp8_spy["amax_and_cast"] == 6


@pytest.mark.parametrize("fn", ["amax_and_cast", "cast_transpose"])
def test_grids_and_tiles_other_than_the_defaults(fp8_spy, fn):
    # Many tiles per program and programs that split the ragged edges differently.
    for k, (programs, geometry) in enumerate([(1, None), (2, None), (7, None), (1000, None), (3, "small"), (5, "large")]):
        dtype, fp8_dtype = FP8_INPUTS[k % 3], FP8[k % 2]
        t = special_tensor(300 * 517, dtype, fp8_dtype, seed=k)
        if fn == "amax_and_cast":
            kwargs = {"block": {None: None, "small": 256, "large": 8192}[geometry]}
            check_fp8(fn, t, 4.0, fp8_dtype, f"programs={programs} {geometry}", num_programs=programs, **kwargs)
        else:
            kwargs = {"tile": {None: None, "small": (16, 32), "large": (128, 64)}[geometry]}
            check_fp8(fn, t.view(300, 517), 4.0, fp8_dtype, f"programs={programs} {geometry}", num_programs=programs, **kwargs)
    assert fp8_spy[fn] == 6


@pytest.mark.parametrize("fn", ["amax_and_cast", "cast_transpose"])
def test_nan_and_inf_win_the_amax_in_any_program(fp8_spy, fn):
    base = torch.linspace(-5, 5, 512 * 512, device=CUDA)
    cases = [([], 5.0), ([(200_000, INF)], INF), ([(3, -INF), (100_000, 1e30)], INF), ([(10, NAN), (250_000, INF)], NAN), ([(512 * 512 - 1, NAN)], NAN), ([(0, -7.0)], 7.0)]
    for pokes, want in cases:
        t = base.clone()
        for pos, value in pokes:
            t[pos] = value
        t = t.view(512, 512) if fn == "cast_transpose" else t
        got = check_fp8(fn, t, 100.0, torch.float8_e4m3fn, f"pokes={pokes}")
        amax = got[-2].item()
        assert (np.isnan(amax) and np.isnan(want)) or amax == want


def test_unaligned_contiguous_views_go_through_the_kernel(fp8_spy):
    buf = special_tensor(1 + 500 * 333, torch.bfloat16, torch.float8_e4m3fn, seed=5)
    t = buf[1:].view(500, 333)  # 2 bytes past its allocation
    check_fp8("cast_transpose", t, 4.0, torch.float8_e4m3fn, "unaligned 2-d")
    check_fp8("amax_and_cast", t.view(-1), 4.0, torch.float8_e4m3fn, "unaligned 1-d")
    assert fp8_spy == {"amax_and_cast": 1, "cast_transpose": 1}
