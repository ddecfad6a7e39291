"""The compiled engine's unboxed kernels (engine.cpp, "unboxed kernels for the overloads
models call most").

For the overloads in its table the engine registers a kernel typed by the overload's
signature instead of a boxed one: it executes the same rules through the same casts, and
hands every call it does not execute to the boxed kernel of the same overload. These tests
check that the overloads models call take it, that each rule it executes gives native's
bits (or, where native has no such rule, the Python engine's reference result: the op run
on inputs cast as the rule says), and that each kind of call it does not execute reaches
the boxed kernel and gives what it gave before. The native-list and model tests run every
overload of the table through it as well; these read its counters to show which path ran.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from dispatch_amp import Policy
from dispatch_amp.autocast import _compiled_engine

pytestmark = pytest.mark.needs_compiler

CUDA_POLICY = Policy.for_device("cuda")


@pytest.fixture(autouse=True)
def module():
    module = _compiled_engine.active()
    if module is None:
        pytest.skip("the Python engine runs this process (DISPATCH_AMP_ENGINE=python): no compiled kernels")
    return module


class _Counts:
    """This thread's unboxed calls made inside the ``with`` block: ``executed`` by the
    unboxed kernel, ``handed`` to the boxed one."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.before = self.module.unboxed_counts()
        return self

    def __exit__(self, *exc):
        after = self.module.unboxed_counts()
        self.executed = after[0] - self.before[0]
        self.handed = after[1] - self.before[1]


def _linear_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g, dtype=dtype)
    w = torch.nn.Parameter(torch.randn(5, 8, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g))
    return x, w, b


def test_every_candidate_is_an_overload_of_this_torch(module):
    candidates = module.unboxed_candidates()
    assert "aten::linear" in candidates and "aten::softmax.int" in candidates
    for name in candidates:
        ns, _, rest = name.partition("::")
        op, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), op)
        assert getattr(packet, overload or "default") is not None


def test_the_overloads_models_call_most_take_the_unboxed_kernel(module):
    x, w, b = _linear_args()
    with amp.autocast("cpu", dtype=torch.bfloat16):
        F.linear(x, w, b)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=CUDA_POLICY):
        torch.softmax(x, -1)
        F.layer_norm(x, (8,))
    registered = set(module.unboxed_overloads())
    assert {"aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::conv2d",
            "aten::softmax.int", "aten::layer_norm"} <= registered
    assert registered <= set(module.unboxed_candidates())


def test_lower_casts_as_native_through_the_unboxed_kernel(module):
    x, w, b = _linear_args()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, w, b)
    with amp.autocast("cpu", dtype=torch.bfloat16), _Counts(module) as counts:
        got = F.linear(x, w, b)
        again = F.linear(x, w, b)  # the weight-cast cache's hit
    assert (counts.executed, counts.handed) == (2, 0)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(again, want)


def test_a_weights_cast_is_shared_by_the_unboxed_and_boxed_kernels(module):
    # aten::linear takes the unboxed kernel, aten::addr (lower under the CUDA policy) the
    # boxed one: one store, so the weight is cast once and the second use is a hit.
    assert "aten::addr" not in module.unboxed_candidates()
    x, w, _ = _linear_args()
    v1, v2 = torch.randn(5), torch.randn(8)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=CUDA_POLICY), _Counts(module) as counts:
        y = F.linear(x, w)
        z = torch.addr(w, v1, v2)
        assert len(module.region_store()) == 1
    assert counts.executed == 1
    assert torch.equal(y, F.linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(z, torch.addr(w.bfloat16(), v1.bfloat16(), v2.bfloat16()))


@pytest.fixture
def cuda_rules_in_cpp():
    """A CUDA-table policy of its own whose rules the C++ side executes on CPU tensors.

    On a CPU region a CUDA-table rule that differs from native's CPU table is guarded (its
    Python handler refuses torch's checkpoint, ``_torch_checkpoint.py``): the C++ side
    executes it outside torch's checkpoint, which is where these tests call it. A policy
    built here has a fresh plan (``_in_fresh_process`` below builds one in a process of
    its own)."""
    return CUDA_POLICY.without_ops("vdot", name="cuda-rules-in-cpp")


# The C++ side numbers the first 64 plans of a process (engine.cpp, kMaxPlans); a later
# plan runs in Python. A whole test session makes more than that, so the checks below,
# which need their plan executed in C++, run in a fresh process of their own.
def _in_fresh_process(check: str) -> None:
    code = (f"import runpy; ns = runpy.run_path({__file__!r}); "
            f"from dispatch_amp.autocast import _compiled_engine; "
            f"policy = ns['CUDA_POLICY'].without_ops('vdot', name='cuda-rules-in-cpp'); "
            f"ns[{check!r}](_compiled_engine.active(), policy); "
            f"assert _compiled_engine.plan_number(_compiled_engine.ENGINE.numbered[-1]) >= 0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


def test_fp32_and_fp32_unless_dtype_give_the_reference_results():
    _in_fresh_process("_check_fp32_rules")


def test_promote_widens_as_native_and_hands_mixed_low_dtypes_to_the_boxed_kernel():
    _in_fresh_process("_check_promote")


def _check_fp32_rules(module, cuda_rules_in_cpp):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=cuda_rules_in_cpp), _Counts(module) as counts:
        norm = F.layer_norm(x, (8,))
        soft = torch.softmax(x, -1)
        soft_given = torch.softmax(x, -1, dtype=torch.float64)
        total = torch.sum(x)
    assert (counts.executed, counts.handed) == (4, 0)
    assert norm.dtype == soft.dtype == total.dtype == torch.float32 and soft_given.dtype == torch.float64
    assert torch.equal(norm, F.layer_norm(x.float(), (8,)))
    assert torch.equal(soft, torch.softmax(x, -1, dtype=torch.float32))
    assert torch.equal(soft_given, torch.softmax(x, -1, dtype=torch.float64))
    assert torch.equal(total, torch.sum(x, dtype=torch.float32))


def _check_promote(module, cuda_rules_in_cpp):
    a = torch.randn(4, dtype=torch.bfloat16)
    b, c = torch.randn(4), torch.randn(4)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=cuda_rules_in_cpp), _Counts(module) as counts:
        out = torch.addcmul(a, b, c)
        low = torch.addcmul(a, a, a)
    assert (counts.executed, counts.handed) == (2, 0)
    assert out.dtype == torch.float32 and torch.equal(out, torch.addcmul(a.float(), b, c))
    assert low.dtype == torch.bfloat16 and torch.equal(low, torch.addcmul(a, a, a))
    # bfloat16 beside float16: no dtype to promote to here; the boxed kernel hands the
    # call to Python, which raises the error native raises for it.
    half = torch.randn(4, dtype=torch.float16)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=cuda_rules_in_cpp), _Counts(module) as counts:
        with pytest.raises(RuntimeError, match="promote"):
            torch.addcmul(a, half, half)
    assert (counts.executed, counts.handed) == (0, 1)


def test_a_rule_that_differs_from_natives_runs_in_cpp_outside_torchs_checkpoint():
    _in_fresh_process("_check_guarded_rules")


def _check_guarded_rules(module, cuda_rules_in_cpp):
    """A user's policy that casts an op otherwise than native's table (here the CUDA table
    on CPU tensors: softmax to float32 through its dtype argument, unboxed; addr lowered,
    boxed): the C++ side executes it wherever torch's checkpoint cannot be running, and
    hands it to the Python handler, which refuses inside that checkpoint, everywhere else
    it might be."""
    from torch.utils import checkpoint as torch_checkpoint

    region = lambda: amp.autocast("cpu", dtype=torch.bfloat16, policy=cuda_rules_in_cpp)  # noqa: E731
    x = torch.randn(4, 8, requires_grad=True)
    v1, v2 = torch.randn(4), torch.randn(8)
    want_soft = torch.softmax(x.detach(), -1, dtype=torch.float32)
    want_addr = torch.addr(x.detach().bfloat16(), v1.bfloat16(), v2.bfloat16())
    store_size = []

    def calls(t):
        soft = torch.softmax(t, -1)
        out = torch.addr(t, v1, v2)
        store_size.append(len(module.region_store()))
        return soft, out

    def same(results):
        soft, out = results
        assert soft.dtype == torch.float32 and torch.equal(soft.detach(), want_soft)
        assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), want_addr)

    # No saved-tensor hooks, no checkpoint frame: executed here, with grad mode on or off
    # (addr's kernel is boxed: its calls are not counted).
    for grad in (True, False):
        with region(), torch.set_grad_enabled(grad), _Counts(module) as counts:
            same(calls(x))
        assert (counts.executed, counts.handed) == (1, 0)
        assert store_size[-1] == 1  # x, a leaf that requires grad: cast once, kept by the C++ store
    # Under saved-tensor hooks torch's checkpoint may be running: the Python handler
    # decides, finds none, and casts as the rule says.
    with region(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), _Counts(module) as counts:
        same(calls(x))
    assert (counts.executed, counts.handed) == (0, 1)
    # Inside torch's checkpoint, both variants, it refuses with the way out; also where the
    # checkpointed function turns grad mode back on inside the reentrant variant.
    def grad_back_on(t):
        with torch.enable_grad():
            return calls(t)

    for use_reentrant, fn in [(False, calls), (True, calls), (True, grad_back_on)]:
        with region(), pytest.raises(RuntimeError, match="Use dispatch_amp.checkpoint"):
            torch_checkpoint.checkpoint(fn, x, use_reentrant=use_reentrant)
    # Our checkpoint recomputes under the policy: same results, gradients through it.
    with region():
        soft, out = amp.checkpoint(calls, x, use_reentrant=False)
    same((soft, out))
    (soft.sum() + out.float().sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_an_overload_the_policy_does_not_cast_runs_as_given(module, cuda_rules_in_cpp):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=cuda_rules_in_cpp):
        F.layer_norm(x, (8,))  # its kernel is registered: float32 under that policy
    assert "aten::layer_norm" in module.unboxed_overloads()
    with amp.autocast("cpu", dtype=torch.bfloat16), _Counts(module) as counts:
        y = F.layer_norm(x, (8,))  # not in native's CPU table: as given
    # layer_norm, and the native_layer_norm it calls (registered too, as given)
    assert (counts.executed, counts.handed) == (2, 0)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.layer_norm(x, (8,)))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.name())
        return func(*args, **(kwargs or {}))


def test_calls_under_a_dispatch_mode_go_to_the_boxed_kernel_and_match_native(module):
    x, w, b = _linear_args()
    with torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as native_mode:
        want = F.linear(x, w, b)
    with amp.autocast("cpu", dtype=torch.bfloat16), _Ops() as mode, _Counts(module) as counts:
        got = F.linear(x, w, b)
    assert counts.executed == 0 and counts.handed >= 1
    assert mode.seen == native_mode.seen
    assert torch.equal(got, want)


def test_a_native_region_inside_a_custom_one_goes_to_the_boxed_kernel(module):
    x, w, b = _linear_args()
    custom = Policy.for_device("cpu").with_ops(fp32=["linear"], name="linear-fp32")
    with amp.autocast("cpu", dtype=torch.bfloat16, policy=custom):
        with torch.autocast("cpu", dtype=torch.bfloat16), _Counts(module) as counts:
            inner = F.linear(x, w, b)
        outer = F.linear(x, w, b)
    assert counts.handed == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_inner = F.linear(x, w, b)
    assert inner.dtype == torch.bfloat16 and torch.equal(inner, want_inner)
    assert outer.dtype == torch.float32 and torch.equal(outer, F.linear(x, w, b))


def test_meta_tensors_go_to_the_boxed_kernel(module):
    x, w = torch.randn(3, 8, device="meta"), torch.randn(5, 8, device="meta")
    with amp.autocast("cpu", dtype=torch.bfloat16), _Counts(module) as counts:
        y = F.linear(x, w)
    assert counts.handed == 1 and counts.executed == 0
    assert y.device.type == "meta" and y.shape == (3, 5)


def test_calls_from_python_through_the_boxed_convention_take_the_unboxed_kernel(module):
    # torch.ops calls reach a kernel through the dispatcher's boxed entry; an unboxed
    # kernel is reached through its boxed wrapper, with the same result.
    x, w, b = _linear_args()
    with amp.autocast("cpu", dtype=torch.bfloat16), _Counts(module) as counts:
        got = torch.ops.aten.linear.default(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.ops.aten.linear.default(x, w, b)
    assert counts.executed == 1
    assert torch.equal(got, want)


def _cast_order(region) -> list[tuple]:
    """The shapes cast (``aten::_to_copy``) by one linear call, in order. The profiler
    records calls without changing how they dispatch (a dispatch mode would send them
    to the Python kernels)."""
    x, w, b = _linear_args()
    with torch.profiler.profile(record_shapes=True) as prof:
        with region:
            F.linear(x, w, b)
    return [tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::_to_copy"]


def test_the_unboxed_kernel_casts_in_natives_order(module):
    before = module.unboxed_counts()[0]
    ours = _cast_order(amp.autocast("cpu", dtype=torch.bfloat16))
    assert module.unboxed_counts()[0] == before + 1
    assert len(ours) == 3
    assert ours == _cast_order(torch.autocast("cpu", dtype=torch.bfloat16))
