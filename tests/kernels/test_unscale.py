"""unscale_check_ / check_finite_: every backend bit for bit against torch's fused op."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_amp.kernels import check_finite_, clear_table_cache, unscale_check_, unscale_check_reference
from dispatch_amp.kernels import unscale as unscale_mod

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}
SPECIALS = [float("inf"), float("-inf"), float("nan")]
# Bounds the interpreted kernel's work per example (elements across all tensors).
MAX_TOTAL = 160_000

# The interpreter warns when a cast to fp16 overflows to inf: that inf is the expected result.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

needs_interpreter = pytest.mark.skipif(
    unscale_mod.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="Triton backend needs triton, and TRITON_INTERPRET=1 without a GPU",
)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical, except that any nan equals any nan (payloads are not part of the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), "nan positions differ"
    g, w = got.view(BITS[got.dtype])[~nan_got], want.view(BITS[want.dtype])[~nan_want]
    if not torch.equal(g, w):
        k = (g != w).nonzero()[0].item()
        raise AssertionError(f"{(g != w).sum().item()} elements differ, first: {got[~nan_got][k].item()} vs {want[~nan_want][k].item()}")


@st.composite
def grad_lists(draw):
    """A list of gradients with random odd sizes, dtypes, magnitudes and inf/nan positions."""
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    grads, total = [], 0
    for _ in range(n):
        size = draw(st.one_of(st.integers(1, 70_000), st.sampled_from([1, 4095, 4096, 4097, 8192])))
        size = max(1, min(size, MAX_TOTAL - total))
        total += size
        dtype = draw(st.sampled_from(DTYPES))
        magnitude = 2.0 ** draw(st.integers(-30, 30))
        g = (torch.randn(size, generator=gen) * magnitude).to(dtype)
        for _ in range(draw(st.integers(0, 2))):
            g[draw(st.integers(0, size - 1))] = draw(st.sampled_from(SPECIALS))
        grads.append(g)
        if total >= MAX_TOTAL:
            break
    # fp16-width floats include inf, nan, subnormals and huge finite values naturally.
    small = draw(st.lists(st.floats(width=16), min_size=1, max_size=40))
    grads.append(torch.tensor(np.array(small, dtype=np.float32)).to(draw(st.sampled_from(DTYPES))))
    return grads


scales = st.builds(lambda e, m: m * 2.0**e, st.integers(-24, 24), st.sampled_from([1.0, 1.5, 1.1, 1.9921875, 1.3333333]))


def inv_of(scale: float) -> torch.Tensor:
    # What GradScaler hands the kernel: reciprocal in fp64, then fp32.
    return torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()


def oracle(grads, inv, found_before=0.0):
    ref = [g.clone() for g in grads]
    found = torch.full((), found_before)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, found, inv)
    return ref, found


def run_backend(backend, grads, inv, found, programs=None):
    if backend == "reference":
        unscale_check_reference(grads, inv, found)
    else:
        unscale_mod._unscale_check(grads, inv, found, backend, num_programs=programs)


BACKENDS = ["torch", "reference", pytest.param("triton", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(grads=grad_lists(), scale=scales, programs=st.integers(1, 5))
def test_unscale_matches_torch_bit_for_bit(backend, grads, scale, programs):
    inv = inv_of(scale)
    ref, found_ref = oracle(grads, inv)
    found = torch.zeros(())
    run_backend(backend, grads, inv, found, programs)
    assert found.item() == found_ref.item()
    for got, want in zip(grads, ref):
        assert_bits_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@given(grads=grad_lists(), programs=st.integers(1, 5))
def test_check_finite_is_read_only(backend, grads, programs):
    before = [g.clone() for g in grads]
    _, found_ref = oracle([g.clone() for g in grads], torch.ones(()))
    found = torch.zeros(())
    if backend == "reference":
        unscale_check_reference(grads, None, found, store=False)
    else:
        unscale_mod._check_finite(grads, found, backend, num_programs=programs)
    assert found.item() == found_ref.item()
    for got, want in zip(grads, before):
        assert_bits_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_is_never_cleared(backend):
    grads = [torch.ones(5000), torch.ones(3, dtype=torch.bfloat16)]
    found = torch.ones(())
    run_backend(backend, grads, torch.tensor(0.5), found)
    assert found.item() == 1.0
    assert grads[0].eq(0.5).all() and grads[1].eq(0.5).all()


@needs_interpreter
def test_layouts_and_dtypes_outside_the_kernel_go_through_torch():
    base = torch.randn(70, 90)
    grads = [
        base.t(),  # dense but transposed: handled by the kernel as a flat run
        torch.randn(64, 3, 5, 5).to(memory_format=torch.channels_last),
        torch.randn(40, 40)[:, ::2],  # gappy: torch path
        torch.randn(33, dtype=torch.float64),  # fp64: torch path
        torch.empty(0),
        torch.randn(5001)[1:],  # 4 bytes past an allocation: not 16-byte aligned, torch path
    ]
    assert [unscale_mod._triton_can_take(g) for g in grads] == [True, True, False, False, False, False]
    grads[3][7] = float("nan")
    inv = inv_of(3.0)
    ref, found_ref = oracle(grads, inv)
    found = torch.zeros(())
    unscale_check_(grads, inv, found, backend="triton")
    assert found.item() == found_ref.item() == 1.0
    for got, want in zip(grads, ref):
        assert_bits_equal(got, want)


@needs_interpreter
def test_table_is_cached_and_rebuilt_only_when_the_gradient_set_changes():
    clear_table_cache()
    grads = [torch.randn(5000), torch.randn(7, dtype=torch.float16)]
    inv = torch.tensor(0.5)
    unscale_check_(grads, inv, torch.zeros(()), backend="triton")
    first = dict(unscale_mod._table_cache)
    assert len(first) == 1
    grads[0].mul_(3)  # same storage, new values: same table
    unscale_check_(grads, inv, torch.zeros(()), backend="triton")
    assert dict(unscale_mod._table_cache) == first
    grads2 = grads + [torch.randn(11)]  # new member: new table
    ref, _ = oracle(grads2, inv)
    unscale_check_(grads2, inv, torch.zeros(()), backend="triton")
    assert len(unscale_mod._table_cache) == 2
    for got, want in zip(grads2, ref):
        assert_bits_equal(got, want)


def test_empty_list_is_a_no_op():
    found = torch.zeros(())
    unscale_check_([], torch.tensor(0.5), found)
    check_finite_([], found)
    assert found.item() == 0.0


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: unscale_check_([torch.ones(2)], torch.tensor(0.5), torch.zeros(()), backend="cuda"), ValueError, "backend must be one of"),
        (lambda: unscale_check_(torch.ones(2), torch.tensor(0.5), torch.zeros(())), TypeError, "list or tuple"),
        (lambda: unscale_check_([torch.ones(2, dtype=torch.int32)], torch.tensor(0.5), torch.zeros(())), TypeError, "floating point"),
        (lambda: unscale_check_([torch.ones(2)], torch.tensor(0.5), torch.zeros((), dtype=torch.float64)), TypeError, "found_inf"),
        (lambda: unscale_check_([torch.ones(2)], torch.tensor(0.5, dtype=torch.float64), torch.zeros(())), TypeError, "inv_scale"),
        (lambda: unscale_check_([torch.ones(2), 3.0], torch.tensor(0.5), torch.zeros(())), TypeError, r"grads\[1\]"),
        (lambda: unscale_check_([torch.ones(2).to_sparse()], torch.tensor(0.5), torch.zeros(())), TypeError, "sparse"),
        (lambda: unscale_check_([torch.ones(2, device="meta")], torch.tensor(0.5), torch.zeros(())), ValueError, "group gradients by device"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _run_python(code: str, env_update: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_update}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = (
        "import torch\n"
        "from dispatch_amp.kernels import unscale_check_\n"
        "try:\n"
        "    unscale_check_([torch.ones(2)], torch.tensor(0.5), torch.zeros(()), backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run_python(code, {"TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and ("TRITON_INTERPRET=1" in out.stdout or "triton package" in out.stdout)


def test_kernels_import_and_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from dispatch_amp.kernels import unscale_check_, update_scale_, ScaleState\n"
        "g = [torch.tensor([2.0, float('inf')])]; f = torch.zeros(())\n"
        "unscale_check_(g, torch.tensor(0.5), f)\n"
        "st = ScaleState.create(torch.device('cpu'), 8.0); update_scale_(st, f, 2.0, 0.5, 10)\n"
        "print(g[0][0].item(), f.item(), st.scale.item())\n"
    )
    out = _run_python(code, {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1.0", "1.0", "4.0"]


# -- per-tensor flags (nonfinite=) ----------------------------------------------------------------

FLAG_BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def flags_oracle(grads, before):
    """What nonfinite must hold afterwards: ``before`` with 1 wherever a gradient held inf/nan."""
    want = before.clone()
    unscale_check_reference([g.clone() for g in grads], None, torch.zeros(()), store=False, nonfinite=want)
    return want


def odd_layout(kind: str, gen: torch.Generator) -> torch.Tensor:
    """A gradient the Triton launcher routes to the torch path, or an empty one."""
    if kind == "fp64":
        return torch.randn(33, generator=gen, dtype=torch.float64)
    if kind == "gappy":
        return torch.randn(40, 40, generator=gen)[:, ::2]
    if kind == "unaligned":
        return torch.randn(5001, generator=gen)[1:]  # 4 bytes past an allocation
    return torch.empty(0)


def poke(g: torch.Tensor, pos: int, value: float) -> None:
    """g.flatten()[pos] = value, also for non-contiguous views (flatten would copy them)."""
    g[tuple(int(i) for i in np.unravel_index(pos, g.shape))] = value


@st.composite
def flagged_grad_lists(draw):
    """grad_lists, plus gradients outside the kernel's reach mixed in at random positions."""
    grads = draw(grad_lists())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    for kind in draw(st.lists(st.sampled_from(["fp64", "gappy", "unaligned", "empty"]), max_size=3)):
        g = odd_layout(kind, gen)
        if g.numel() and draw(st.booleans()):
            poke(g, draw(st.integers(0, g.numel() - 1)), draw(st.sampled_from(SPECIALS)))
        grads.insert(draw(st.integers(0, len(grads))), g)
    return grads


@pytest.mark.parametrize("op", ["unscale_check_", "check_finite_"])
@pytest.mark.parametrize("backend", FLAG_BACKENDS)
@given(grads=flagged_grad_lists(), scale=scales, programs=st.integers(1, 5), data=st.data())
def test_per_tensor_flags_match_the_reference(op, backend, grads, scale, programs, data):
    inv = inv_of(scale)
    before = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=len(grads), max_size=len(grads))), dtype=torch.int32)
    want = flags_oracle(grads, before)
    if op == "unscale_check_":
        ref, found_ref = oracle(grads, inv)
    else:
        ref, found_ref = [g.clone() for g in grads], oracle([g.clone() for g in grads], torch.ones(()))[1]
    found, nonfinite = torch.zeros(()), before.clone()
    if op == "unscale_check_":
        unscale_mod._unscale_check(grads, inv, found, backend, nonfinite=nonfinite, num_programs=programs)
    else:
        unscale_mod._check_finite(grads, found, backend, nonfinite=nonfinite, num_programs=programs)
    assert nonfinite.tolist() == want.tolist()
    assert found.item() == found_ref.item()
    for got, expected in zip(grads, ref):
        assert_bits_equal(got, expected)


@pytest.mark.parametrize(
    "bad",
    [
        [],
        [(0, 5)],  # the big tensor, in program 0's tiles
        [(0, 6 * 4096 - 6)],  # the big tensor's ragged last tile, in program 1
        [(2, 4095)],  # the middle one of three small tensors sharing program 2
        [(1, 0), (3, 0)],  # first and last tensor of program 2
        [(4, 4096)],  # the ragged tile of the tensor that program 3 owns
        [(0, 0), (0, 6 * 4096 - 6), (1, 50), (2, 0), (3, 0), (4, 1)],
    ],
    ids=lambda bad: "+".join(f"{k}@{p}" for k, p in bad) or "finite",
)
@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_per_tensor_flags_across_program_tile_ranges(backend, bad):
    # 6 + 1 + 1 + 1 + 2 = 11 tiles on 4 programs: 3 tiles each, so program 0 and 1 split
    # the big fp32 tensor, program 2 holds three small tensors, program 3 the last one.
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(6 * 4096 - 5, generator=gen),
        torch.randn(100, generator=gen).half(),
        torch.randn(4096, generator=gen).bfloat16(),
        torch.randn(1, generator=gen),
        torch.randn(4097, generator=gen).half(),
    ]
    for (k, pos), value in zip(bad, SPECIALS * 3):
        grads[k][pos] = value
    inv = inv_of(1024.0)
    ref, found_ref = oracle(grads, inv)
    found, nonfinite = torch.zeros(()), torch.zeros(len(grads), dtype=torch.int32)
    unscale_mod._unscale_check(grads, inv, found, backend, nonfinite=nonfinite, num_programs=4)
    assert nonfinite.tolist() == [int(any(k == j for j, _ in bad)) for k in range(len(grads))]
    assert found.item() == found_ref.item() == float(bool(bad))
    for got, want in zip(grads, ref):
        assert_bits_equal(got, want)


@needs_interpreter
@pytest.mark.parametrize("programs", [1, 3])
def test_per_tensor_flags_of_gradients_routed_to_torch_inside_a_triton_call(monkeypatch, programs):
    gen = torch.Generator().manual_seed(1)
    grads = [
        odd_layout("gappy", gen),  # slot 0: torch path, so kernel rows and slots differ
        torch.randn(5000, generator=gen),  # slot 1: kernel, inf
        odd_layout("fp64", gen),  # slot 2: torch path, nan
        torch.empty(0),  # slot 3: empty
        torch.randn(300, generator=gen).bfloat16(),  # slot 4: kernel, finite
        odd_layout("unaligned", gen),  # slot 5: torch path, -inf
        torch.randn(9000, generator=gen).half(),  # slot 6: kernel, nan in its ragged tile
        odd_layout("unaligned", gen),  # slot 7: torch path, finite
    ]
    assert [unscale_mod._triton_can_take(g) for g in grads] == [False, True, False, False, True, False, True, False]
    poke(grads[0], 3, float("inf"))
    grads[1][4999] = float("inf")
    grads[2][7] = float("nan")
    grads[5][0] = float("-inf")
    grads[6][8999] = float("nan")
    # The torch path sees exactly the gradients the kernel does not take.
    checked = []
    flagged = unscale_mod._flagged_torch_path
    monkeypatch.setattr(unscale_mod, "_flagged_torch_path", lambda g, slots, *a: (checked.extend(slots), flagged(g, slots, *a)))
    inv = inv_of(3.0)
    ref, found_ref = oracle(grads, inv)
    found, nonfinite = torch.zeros(()), torch.zeros(len(grads), dtype=torch.int32)
    unscale_mod._unscale_check(grads, inv, found, "triton", nonfinite=nonfinite, num_programs=programs)
    assert checked == [0, 2, 3, 5, 7]
    assert nonfinite.tolist() == [1, 1, 1, 0, 0, 1, 1, 0]
    assert found.item() == found_ref.item() == 1.0
    for got, want in zip(grads, ref):
        assert_bits_equal(got, want)


class KernelSpy:
    """Stands in for the Triton kernel object; records each launch's PER_TENSOR."""

    def __init__(self, kernel):
        self.kernel, self.per_tensor = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.per_tensor.append(kwargs["PER_TENSOR"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_interpreter
def test_triton_flags_come_from_the_same_pass(monkeypatch):
    # Only gradients the kernel takes: one launch, with PER_TENSOR, and no torch-path check.
    spy = KernelSpy(unscale_mod._unscale_check_kernel)
    monkeypatch.setattr(unscale_mod, "_unscale_check_kernel", spy)
    monkeypatch.setattr(unscale_mod, "_flagged_torch_path", lambda *a: pytest.fail("extra pass over kernel gradients"))
    grads = [torch.randn(5000), torch.tensor([1.0, float("nan")]).half()]
    nonfinite = torch.zeros(2, dtype=torch.int32)
    unscale_check_(grads, torch.tensor(0.5), torch.zeros(()), backend="triton", nonfinite=nonfinite)
    check_finite_(grads, torch.zeros(()), backend="triton")
    assert spy.per_tensor == [True, False]
    assert nonfinite.tolist() == [0, 1]


@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_nonfinite_none_is_the_old_behaviour(monkeypatch, backend):
    monkeypatch.setattr(unscale_mod, "_flagged_torch_path", lambda *a: pytest.fail("per-tensor check without nonfinite"))
    if backend == "triton":
        spy = KernelSpy(unscale_mod._unscale_check_kernel)
        monkeypatch.setattr(unscale_mod, "_unscale_check_kernel", spy)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(9000, generator=gen), torch.randn(77, generator=gen).bfloat16(), odd_layout("fp64", gen)]
    grads[1][5] = float("inf")
    inv = inv_of(8.0)
    ref, found_ref = oracle(grads, inv)
    found = torch.zeros(())
    unscale_mod._unscale_check(grads, inv, found, backend, num_programs=2)
    assert found.item() == found_ref.item() == 1.0
    for got, want in zip(grads, ref):
        assert_bits_equal(got, want)
    if backend == "triton":
        assert spy.per_tensor == [False]


@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_per_tensor_flags_are_never_cleared_and_finite_entries_untouched(backend):
    grads = [torch.ones(5000), torch.ones(3, dtype=torch.bfloat16), torch.ones(7, dtype=torch.float16), torch.ones(4, dtype=torch.float64)]
    grads[2][1] = float("inf")
    found = torch.ones(())
    # 7 is no flag value: it shows that entries of finite gradients are not written at all.
    nonfinite = torch.tensor([1, 7, 1, 0], dtype=torch.int32)
    unscale_check_(grads, torch.tensor(0.5), found, backend=backend, nonfinite=nonfinite)
    assert nonfinite.tolist() == [1, 7, 1, 0]
    assert found.item() == 1.0  # found_inf: still only raised, never cleared
    assert grads[0].eq(0.5).all() and grads[1].eq(0.5).all() and grads[3].eq(0.5).all()


@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_empty_tensors_are_never_flagged(backend):
    grads = [torch.empty(0), torch.tensor([float("nan")]), torch.empty(0, 3, dtype=torch.bfloat16)]
    found, nonfinite = torch.zeros(()), torch.zeros(3, dtype=torch.int32)
    unscale_check_(grads, torch.tensor(0.5), found, backend=backend, nonfinite=nonfinite)
    assert nonfinite.tolist() == [0, 1, 0] and found.item() == 1.0
    unscale_check_([], torch.tensor(0.5), found, backend=backend, nonfinite=torch.zeros(0, dtype=torch.int32))


def _nan_with_payload(dtype: torch.dtype) -> torch.Tensor:
    # Not the canonical nan that an arithmetic store would write (bf16 stores canonicalize).
    bits = {torch.float32: 0x7FC00001, torch.float16: 0x7E01, torch.bfloat16: 0x7FC1}[dtype]
    return torch.tensor([bits], dtype=BITS[dtype]).view(dtype)


@needs_interpreter
def test_check_finite_with_nonfinite_stores_nothing_into_gradients_on_triton():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(4096 * 2 + 3, generator=gen).to(dtype) for dtype in DTYPES] + [torch.randn(10, generator=gen)]
    for k, g in enumerate(grads[:3]):
        g[k * 1000] = _nan_with_payload(g.dtype)[0]
        g[-1] = float("inf")
    before = [g.clone() for g in grads]
    found, nonfinite = torch.zeros(()), torch.zeros(len(grads), dtype=torch.int32)
    unscale_mod._check_finite(grads, found, "triton", nonfinite=nonfinite, num_programs=3)
    assert nonfinite.tolist() == [1, 1, 1, 0] and found.item() == 1.0
    for got, want in zip(grads, before):  # raw bits, nan payloads included
        assert torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))


def test_torch_path_flags_do_not_sync(sync_counter):
    grads = [torch.tensor([1.0, float("inf")]), torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)]
    nonfinite = torch.zeros(3, dtype=torch.int32)
    with sync_counter() as counter:
        unscale_check_(grads, torch.tensor(0.5), torch.zeros(()), backend="torch", nonfinite=nonfinite)
    assert counter.count == 0
    assert nonfinite.tolist() == [1, 0, 0]


def test_reference_flags():
    grads = [torch.ones(3), torch.tensor([float("-inf")], dtype=torch.float16), torch.empty(0)]
    found, nonfinite = torch.zeros(()), torch.tensor([0, 0, 1], dtype=torch.int32)
    unscale_check_reference(grads, torch.tensor(2.0), found, nonfinite=nonfinite)
    assert nonfinite.tolist() == [0, 1, 1] and found.item() == 1.0
    assert grads[0].eq(2.0).all()


@pytest.mark.parametrize(
    "nonfinite, error, match",
    [
        ([0, 0], TypeError, "nonfinite must be a tensor or None"),
        (torch.zeros(2, dtype=torch.int64), TypeError, "nonfinite has dtype torch.int64, it must be torch.int32"),
        (torch.zeros(2), TypeError, "torch.int32"),
        (torch.zeros(1, 2, dtype=torch.int32), ValueError, r"shape \(1, 2\), it must be \(2,\)"),
        (torch.zeros(3, dtype=torch.int32), ValueError, r"shape \(3,\), it must be \(2,\): one flag per gradient"),
        (torch.zeros((), dtype=torch.int32), ValueError, r"it must be \(2,\)"),
        (torch.zeros(2, dtype=torch.int32, device="meta"), ValueError, "nonfinite is on meta but found_inf is on cpu"),
        (torch.zeros(4, dtype=torch.int32)[::2], ValueError, "nonfinite must be contiguous"),
    ],
    ids=["list", "int64", "float32", "2-d", "too-long", "0-d", "device", "strided"],
)
@pytest.mark.parametrize("op", ["unscale_check_", "check_finite_"])
@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_bad_nonfinite_raises_and_changes_nothing(backend, op, nonfinite, error, match):
    grads = [torch.ones(5000), torch.tensor([1.0, float("inf")])]
    before = [g.clone() for g in grads]
    found = torch.zeros(())
    flags_before = nonfinite.clone() if isinstance(nonfinite, torch.Tensor) and nonfinite.device.type == "cpu" else None
    with pytest.raises(error, match=match) as info:
        if op == "unscale_check_":
            unscale_check_(grads, torch.tensor(0.5), found, backend=backend, nonfinite=nonfinite)
        else:
            check_finite_(grads, found, backend=backend, nonfinite=nonfinite)
    assert str(info.value).startswith(f"{op}: ") and "torch.zeros(2, dtype=torch.int32" in str(info.value)
    assert found.item() == 0.0
    for got, want in zip(grads, before):
        assert_bits_equal(got, want)
    if flags_before is not None:
        assert torch.equal(nonfinite, flags_before)


def test_uses_triton():
    from dispatch_amp.kernels import uses_triton

    assert uses_triton(torch.device("cpu")) is False  # auto: Triton only for CUDA tensors
    assert uses_triton("cpu", "torch") is False
    with pytest.raises(ValueError, match="backend must be one of"):
        uses_triton("cpu", "cuda")
    if unscale_mod.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
        assert uses_triton("cpu", "triton") is True
    if unscale_mod.triton is not None:
        assert uses_triton("cuda", "auto") is True and uses_triton("cuda", "torch") is False


def test_uses_triton_raises_like_the_launchers_without_the_interpreter():
    code = (
        "import torch\n"
        "from dispatch_amp.kernels import uses_triton, check_finite_\n"
        "for call in (lambda: uses_triton('cpu', 'triton'), lambda: check_finite_([torch.ones(2)], torch.zeros(()), 'triton')):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print('ERR', str(e).split(': ', 1)[1])\n"
    )
    out = _run_python(code, {"TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0].startswith("ERR backend='triton'"), lines


@pytest.mark.parametrize("backend", FLAG_BACKENDS)
def test_flags_look_at_values_before_scaling(backend):
    # 60000 * 2 overflows fp16 to inf; like found_inf, the flags see the incoming values.
    grads = [torch.full((5,), 60000.0, dtype=torch.float16), torch.full((5,), 60000.0, dtype=torch.float64)]
    found, nonfinite = torch.zeros(()), torch.zeros(2, dtype=torch.int32)
    unscale_check_(grads, torch.tensor(2.0), found, backend=backend, nonfinite=nonfinite)
    assert torch.isinf(grads[0]).all()
    assert nonfinite.tolist() == [0, 0] and found.item() == 0.0


@needs_interpreter
def test_table_cache_key_includes_slots():
    # The same kernel gradient at another position of the list needs another slot column.
    clear_table_cache()
    a, x = torch.tensor([1.0, float("inf")]), torch.ones(3, dtype=torch.float64)
    first = torch.zeros(2, dtype=torch.int32)
    check_finite_([a, x], torch.zeros(()), backend="triton", nonfinite=first)
    second = torch.zeros(2, dtype=torch.int32)
    check_finite_([x, a], torch.zeros(()), backend="triton", nonfinite=second)
    assert first.tolist() == [1, 0] and second.tolist() == [0, 1]
    assert len(unscale_mod._table_cache) == 2


finite_or_special = st.one_of(
    st.floats(width=32, min_value=-1e6, max_value=1e6), st.sampled_from([float("inf"), float("-inf"), float("nan")])
)


@settings(max_examples=30)
@given(
    parts=st.lists(st.tuples(finite_or_special, finite_or_special), min_size=1, max_size=9),
    dtype=st.sampled_from([torch.complex64, torch.complex128]),
    backend=st.sampled_from(["torch", "triton"]),
)
def test_public_entries_take_complex_gradients_as_real_and_imaginary_parts(parts, dtype, backend):
    grad = torch.tensor([complex(re, im) for re, im in parts], dtype=dtype)
    want = torch.view_as_real(grad).clone()
    want_found = torch.zeros(())
    unscale_check_reference([want], torch.tensor(0.5), want_found)
    found = torch.zeros(())
    unscale_check_([grad], torch.tensor(0.5), found, backend=backend)
    assert found.item() == want_found.item()
    if not want_found.item():
        assert torch.equal(torch.view_as_real(grad), want)


@pytest.mark.parametrize("store", [True, False], ids=["unscale_check_", "check_finite_"])
def test_torch_path_flags_come_from_the_pass_that_checks(monkeypatch, store):
    # Each gradient is read once: by the call that checks (and unscales) it, with its own
    # flag; no separate inf/nan pass runs.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fused, self.other = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_:
                self.fused.append(len(args[0]))
            elif func.overloadpacket in (torch.ops.aten.isinf, torch.ops.aten.isnan, torch.ops.aten.aminmax):
                self.other += 1
            return func(*args, **(kwargs or {}))

    grads = [torch.ones(50), torch.tensor([1.0, float("inf")]).half(), torch.ones(3, dtype=torch.bfloat16)]
    found, nonfinite = torch.zeros(()), torch.zeros(3, dtype=torch.int32)
    with Reads() as reads:
        if store:
            unscale_mod._unscale_check(grads, torch.tensor(0.5), found, "torch", nonfinite=nonfinite)
        else:
            unscale_mod._check_finite(grads, found, "torch", nonfinite=nonfinite)
    assert reads.fused == [1, 1, 1] and reads.other == 0
    assert nonfinite.tolist() == [0, 1, 0] and found.item() == 1.0
