"""unscale_check_ / check_finite_: every backend bit for bit against torch's fused op."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
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
        unscale_check_(grads, inv, found, backend=backend, _num_programs=programs)


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
        check_finite_(grads, found, backend=backend, _num_programs=programs)
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
