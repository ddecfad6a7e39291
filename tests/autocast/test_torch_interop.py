"""Code written for torch sees ``dispatch_amp.autocast`` exactly as it sees ``torch.autocast``.

A differential suite: each test runs the same code under native autocast and under ours
and compares dtypes, values and gradients (bit for bit where the casts are the same), and
errors. See "Note: torch sees our state as native state" in ``_engine.py``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp.autocast import _cast_cache, _engine

KEEP_MM_FP32 = amp.Policy.for_device("cpu").with_ops(fp32=["mm", "linear", "addmm"], name="keep-mm-fp32")


def native(**kwargs):
    return torch.autocast("cpu", **kwargs)


def ours(**kwargs):
    return amp.autocast("cpu", **kwargs)


BOTH = pytest.mark.parametrize("region", [native, ours], ids=["native", "ours"])


@pytest.fixture(autouse=True)
def no_state_leaks():
    yield
    assert _engine.STATE.regions == [] and _engine.STATE.fp8_level is None and not _engine.STATE.key_on
    assert not torch.is_autocast_enabled("privateuseone")
    assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.is_autocast_cache_enabled()


def queries():
    return (
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled(),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        torch._C._is_any_autocast_enabled(),
        amp.is_autocast_enabled("cpu"),
        amp.get_autocast_dtype("cpu"),
    )


def same(a, b):
    """Bit-identical tensors (nested in tuples/lists), dtypes included."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
        return
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.equal(a, b), (a - b).abs().max()


def grads(*modules_or_tensors):
    out = []
    for m in modules_or_tensors:
        if isinstance(m, torch.Tensor):
            out.append(m.grad.clone())
            m.grad = None
        else:
            for p in m.parameters():
                out.append(p.grad.clone())
                p.grad = None
    return out


# -- 1. torch's state queries ---------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"dtype": torch.float16}, {"cache_enabled": False}, {"enabled": False}, {"dtype": torch.float16, "enabled": False}],
    ids=["default", "fp16", "no-cache", "disabled", "disabled-fp16"],
)
def test_state_queries_answer_as_native(kwargs):
    with native(**kwargs):
        want = queries()
    with ours(**kwargs):
        got = queries()
    assert got == want


def test_native_never_casts_under_a_policy_that_differs():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    lin = nn.Linear(8, 8)
    with ours(policy=KEEP_MM_FP32):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.mm(a, b).dtype == torch.float32
        assert lin(a).dtype == torch.float32
        with torch.no_grad():
            assert lin(a).dtype == torch.float32 and torch.mm(a, b).dtype == torch.float32
        # Ops the policy still casts are cast, by us.
        assert torch.bmm(a[None], b[None]).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")


def _legacy(name, *args):
    """torch's deprecated per-device setters (they warn; what they do is current)."""
    def switch():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            getattr(torch, name)(*args)
    return switch


# torch's state switched by hand inside a region, as inference wrappers, export helpers
# and restore paths do.
HAND_SWITCHES = {
    "off": lambda: torch.set_autocast_enabled("cpu", False),
    "fp16": lambda: torch.set_autocast_dtype("cpu", torch.float16),
    "off-then-on": lambda: (torch.set_autocast_enabled("cpu", False), torch.set_autocast_enabled("cpu", True)),
    "legacy-off": _legacy("set_autocast_cpu_enabled", False),
    "legacy-fp16": _legacy("set_autocast_cpu_dtype", torch.float16),
    "off-and-fp16": lambda: (torch.set_autocast_enabled("cpu", False), torch.set_autocast_dtype("cpu", torch.float16)),
}


def _ops_and_queries():
    torch.manual_seed(0)
    a, w, b = torch.randn(8, 8), nn.Parameter(torch.randn(8, 8)), torch.randn(8)
    return [
        torch.mm(a, w), F.linear(a, w, b), torch.addmm(b, a, w), torch.softmax(a, 1),
        torch.cat([a, a]), torch.stack([a.double(), a]), F.conv1d(a[None], w[:, :, None]),
        # torch's queries for the device type (not _is_any_autocast_enabled, which reads
        # our key as "privateuseone" autocast: see "Note: torch sees our state as native
        # state" in _engine.py).
        *[torch.tensor(float(q)) if isinstance(q, bool) else torch.tensor(0, dtype=q) for q in (
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), amp.is_autocast_enabled("cpu"),
            amp.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())],
    ]


@pytest.mark.parametrize("switch", sorted(HAND_SWITCHES))
def test_state_switched_by_hand_inside_a_region_is_followed_as_native_follows_it(switch):
    # The casts follow torch's state, as torch's queries report it: inside the region, in
    # a region nested after the switch (which restores the switched state when it closes)
    # and after the region (which restores what it found, as torch.autocast's exit does).
    results = {}
    for region in (native, ours):
        seen = []
        with region():
            HAND_SWITCHES[switch]()
            seen.append(_ops_and_queries())
            with region(dtype=torch.bfloat16):
                seen.append(_ops_and_queries())
            seen.append(_ops_and_queries())
        seen.append(_ops_and_queries())
        results[region] = seen
    same(results[ours], results[native])


@pytest.mark.parametrize("switch", ["off", "fp16"])
def test_state_switched_by_hand_under_a_policy_of_ones_own_keeps_the_policy(switch):
    a = torch.randn(8, 8)
    with ours(policy=KEEP_MM_FP32):
        HAND_SWITCHES[switch]()
        want = torch.float32 if switch == "off" else torch.float16
        assert torch.bmm(a[None], a[None]).dtype == want       # the policy lowers it: to torch's dtype
        assert torch.mm(a, a).dtype == torch.float32           # the policy keeps it in float32


# -- 2. modules and functions that ask torch ------------------------------------------
@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
def test_recurrent_modules_with_bf16_weights_take_float32_input(cls, grad):
    torch.manual_seed(0)
    module = cls(8, 8, num_layers=2).to(torch.bfloat16)
    x = torch.randn(5, 3, 8, requires_grad=grad)
    outs = {}
    for region in (native, ours):
        with torch.set_grad_enabled(grad), region():
            out, _ = module(x)
        if grad:
            out.float().sum().backward()
            outs[region] = (out, *grads(module, x))
        else:
            outs[region] = (out,)
    same(outs[ours], outs[native])
    with pytest.raises(ValueError, match="does not match weight dtype"):
        module(x)  # outside autocast torch refuses, as it should


def third_party_matmul(cast_inputs):
    """A Function written for torch: decorated with torch.amp's custom_fwd/custom_bwd, not ours."""

    class Matmul(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad @ b.t().to(grad.dtype), a.t().to(grad.dtype) @ grad

    return Matmul


ThirdPartyMatmul = third_party_matmul(torch.float32)  # runs in float32 with autocast off
ThirdPartyFollowsAutocast = third_party_matmul(None)  # follows the region


@pytest.mark.parametrize("function", [ThirdPartyMatmul, ThirdPartyFollowsAutocast])
def test_torch_custom_fwd_in_a_third_party_function(function):
    torch.manual_seed(0)
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    results = {}
    for region in (native, ours):
        with region():
            out = function.apply(a.bfloat16(), b)
        out.float().sum().backward()
        results[region] = (out, *grads(a, b))
    same(results[ours], results[native])
    want = torch.float32 if function is ThirdPartyMatmul else torch.bfloat16
    assert results[ours][0].dtype == want


def float32_island(q, k):
    """The helper libraries (Hugging Face transformers among them) use to keep a part in
    float32: it opens a disabled region only when torch says autocast is on."""
    if torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            return torch.matmul(q.float(), k.float().transpose(-1, -2))
    return torch.matmul(q, k.transpose(-1, -2))


def test_library_float32_island_opens_under_ours():
    torch.manual_seed(0)
    proj = nn.Linear(16, 16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    results = {}
    for region in (native, ours):
        with region():
            q = proj(x)
            scores = float32_island(q, q)
            loss = scores.softmax(-1).sum()
        loss.backward()
        results[region] = (scores, loss, *grads(proj, x))
    same(results[ours], results[native])
    assert results[ours][0].dtype == torch.float32


# -- 3. activation checkpointing ------------------------------------------------------
def block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16), nn.Softmax(-1))


CHECKPOINTS = {
    "non-reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False),
    "reentrant": lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=True),
    "sequential": lambda f, x: torch_checkpoint.checkpoint_sequential(f, 2, x, use_reentrant=False),
    "sequential-reentrant": lambda f, x: torch_checkpoint.checkpoint_sequential(f, 2, x, use_reentrant=True),
}


@pytest.mark.parametrize("variant", sorted(CHECKPOINTS))
def test_torch_checkpoint_unchanged_inside_ours(variant):
    run = CHECKPOINTS[variant]
    results = {}
    for region in (native, ours):
        model = block()
        x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(1))
        with region():
            out = run(model, x)
        out.float().sum().backward()  # outside the context, as usual
        results[region] = (out, *grads(model, x))
    same(results[ours], results[native])


@pytest.mark.parametrize("variant", sorted(CHECKPOINTS))
def test_torch_checkpoint_under_a_differing_policy_raises_and_names_ours(variant):
    model = block()
    x = torch.randn(4, 16, requires_grad=True)
    with ours(policy=KEEP_MM_FP32), pytest.raises(RuntimeError, match="dispatch_amp.checkpoint"):
        CHECKPOINTS[variant](model, x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_our_checkpoint_recomputes_under_a_differing_policy(use_reentrant):
    results = {}
    for checkpointed in (False, True):
        model = block()
        x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(1))
        with ours(policy=KEEP_MM_FP32):
            out = amp.checkpoint(model, x, use_reentrant=use_reentrant) if checkpointed else model(x)
        out.sum().backward()
        results[checkpointed] = (out, *grads(model, x))
    same(results[True], results[False])


# -- 4. nesting, in any order ---------------------------------------------------------
REGION = st.tuples(
    st.sampled_from(["native", "ours"]),
    st.booleans(),
    st.sampled_from([None, torch.bfloat16, torch.float16]),
)


def _observe():
    a = torch.randn(4, 4)
    return (torch.mm(a, a).dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))


def _run_nested(stack, all_native):
    seen = []

    def enter(depth):
        if depth == len(stack):
            return
        kind, enabled, dtype = stack[depth]
        make = torch.autocast if all_native or kind == "native" else amp.autocast
        with make("cpu", dtype=dtype, enabled=enabled):
            seen.append(_observe())
            enter(depth + 1)
            seen.append(_observe())
        seen.append(_observe())

    enter(0)
    return seen


@given(st.lists(REGION, min_size=1, max_size=5))
def test_any_nesting_order_follows_natives_rule(stack):
    """The innermost region wins, ours or native, enabled or not, whatever its dtype."""
    assert _run_nested(stack, all_native=False) == _run_nested(stack, all_native=True)


def test_named_nesting_cases():
    a = torch.randn(4, 4)
    with native():
        with ours(enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
        with ours(dtype=torch.float16):
            assert torch.mm(a, a).dtype == torch.float16
    with ours():
        with native(enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
            with ours():
                assert torch.mm(a, a).dtype == torch.bfloat16
        with native(dtype=torch.float16):
            assert torch.mm(a, a).dtype == torch.float16


# -- 5. construction as torch.autocast --------------------------------------------------
@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("cpu",), {"dtype": torch.float32, "enabled": False}),
        (("cpu",), {"dtype": torch.float32}),
        (("cpu",), {"cache_enabled": None}),
        (("cuda",), {}),
    ],
    ids=["fp32-disabled", "fp32-enabled", "cache-none", "cuda-without-cuda"],
)
def test_construction_as_native(args, kwargs):
    a = torch.randn(4, 4)
    outcome = {}
    for make in (torch.autocast, amp.autocast):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with make(*args, **kwargs):
                outcome[make] = (queries(), torch.mm(a, a).dtype, bool(caught))
    assert outcome[amp.autocast] == outcome[torch.autocast]


def test_calling_a_context_on_a_tensor_is_a_type_error_in_torchs_words():
    with pytest.raises(TypeError, match=r"requires a callable, but got Tensor.*context manager"):
        amp.autocast("cpu")(torch.ones(1))


@pytest.mark.skipif(torch.__version__ < "2.12", reason="torch.autocast refuses a non-callable from torch 2.12 on")
def test_native_also_refuses_to_decorate_a_tensor():
    with pytest.raises(TypeError):
        torch.autocast("cpu")(torch.ones(1))


# -- 6. the weight-cast cache ---------------------------------------------------------
def _aten_trace(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    # Both regions are entered first, so the trace sees only the calls inside them.
    return names, Trace


@pytest.mark.parametrize("warm_under_grad", [False, True])
def test_cached_casts_behave_as_natives_under_no_grad(warm_under_grad):
    """A Linear on a non-contiguous 3-D input under no_grad: torch picks the matmul path
    by looking at requires_grad of the (cached) weight cast; the path must be native's."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(5, 4, 8).transpose(0, 1)
    from torch.profiler import ProfilerActivity, profile

    results = {}
    for region in (native, ours):
        with region():
            if warm_under_grad:
                lin(x.contiguous())
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                out = lin(x)
        ops = [e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::clone", "aten::contiguous")]
        results[region] = (out, ops, out.requires_grad)
    same(results[ours][0], results[native][0])
    assert results[ours][1:] == results[native][1:]


@pytest.mark.parametrize("order", ["nograd-grad", "inference-grad", "grad-nograd"])
def test_one_cached_cast_serves_every_grad_mode_as_natives(order):
    """Native makes cached casts with grad mode on: a weight first used under no_grad or
    inference_mode still gets its gradient when the same region later records."""
    results = {}
    for region in (native, ours):
        torch.manual_seed(0)
        lin = nn.Linear(8, 8)
        x = torch.randn(4, 8)
        first, second = order.split("-")
        modes = {"nograd": torch.no_grad, "inference": torch.inference_mode, "grad": torch.enable_grad}
        with region():
            with modes[first]():
                a = lin(x)
            with modes[second]():
                b = lin(x)
        recorded = b if second == "grad" else a
        flags = (a.requires_grad, b.requires_grad)
        if recorded.requires_grad:
            recorded.float().sum().backward()
            results[region] = (flags, (a, b, *grads(lin)))
        else:
            results[region] = (flags, (a, b))
    assert results[ours][0] == results[native][0]
    same(results[ours][1], results[native][1])


def test_cache_lives_for_the_outermost_region_as_natives():
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with ours():
        lin(x)
        assert _cast_cache.REGION.entries
        with native(enabled=False):
            pass
        assert _cast_cache.REGION.entries  # a nested region's exit does not clear it
    assert not _cast_cache.REGION.entries
    with ours():
        lin(x)
        torch.clear_autocast_cache()
        assert _cast_cache.REGION.entries  # torch's function cannot reach ours
        amp.clear_autocast_cache()
        assert not _cast_cache.REGION.entries
        lin.weight.data.mul_(2)  # invisible to the version counter
        torch.testing.assert_close(lin(x).float(), x @ lin.weight.t() + lin.bias, atol=0.1, rtol=0.02)
    with ours(cache_enabled=False):
        lin(x)
        assert not _cast_cache.REGION.entries


# -- 7. threads -----------------------------------------------------------------------
def test_exit_in_another_thread_is_refused_and_changes_nothing():
    region = ours()
    region.__enter__()
    errors = []

    def wrong_exit():
        try:
            region.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))
        errors.append(torch.is_autocast_enabled("cpu"))

    t = threading.Thread(target=wrong_exit)
    t.start()
    t.join()
    assert "without a matching __enter__ in that thread" in errors[0] and errors[1] is False
    a = torch.randn(4, 4)
    assert torch.mm(a, a).dtype == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    region.__exit__(None, None, None)
    assert torch.mm(a, a).dtype == torch.float32


def test_one_context_object_open_in_two_threads():
    region = ours()
    barrier = threading.Barrier(2)
    seen = []

    def worker():
        with region:
            barrier.wait()
            a = torch.randn(4, 4)
            seen.append(torch.mm(a, a).dtype)
            barrier.wait()
        seen.append(torch.is_autocast_enabled("cpu"))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, seen)) == sorted(map(str, [torch.bfloat16, torch.bfloat16, False, False]))


# -- 8. module fast paths -----------------------------------------------------------------
def test_transformer_fast_path_runs_under_ours_as_under_native():
    """nn.TransformerEncoderLayer takes its fused inference path (it checks that no torch
    function mode is active) and its fused kernel reaches our engine's kernels: the
    result is native's, bit for bit."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    src = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, -1] = True
    for kwargs in ({}, {"src_key_padding_mask": mask}):
        with torch.no_grad():
            with native():
                want = layer(src, **kwargs)
            with ours():
                got = layer(src, **kwargs)
        assert want.dtype == got.dtype == torch.bfloat16
        assert torch.equal(got, want)


@pytest.mark.parametrize("variant", sorted(CHECKPOINTS))
def test_torch_checkpoint_under_patch_torch_with_a_policy_recomputes_under_it(variant):
    # Unmodified code: torch.autocast (patched: ours with the policy) and torch's own
    # checkpoint, whose recomputation reopens torch.amp.autocast by name, ours while the
    # patch is active. Same outputs and gradients as without checkpointing.
    results = {}
    for checkpointed in (False, True):
        model = block()
        x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(1))
        with pytest.warns(amp.AmpNumericsWarning, match="backward inside the patch") if checkpointed \
                else contextlib.nullcontext():
            with amp.patch_torch(policy=KEEP_MM_FP32):
                with torch.autocast("cpu"):
                    out = CHECKPOINTS[variant](model, x) if checkpointed else model(x)
                out.float().sum().backward()
        results[checkpointed] = (out, *grads(model, x))
    same(results[True], results[False])


def test_the_refusal_names_a_derived_policy_as_derived():
    model = block()
    derived = amp.Policy.for_device("cpu").with_ops(fp32=["mm", "linear", "addmm"])
    with ours(policy=derived), pytest.raises(RuntimeError, match="policy \"derived from 'cpu'\""):
        torch_checkpoint.checkpoint(model, torch.randn(4, 16, requires_grad=True), use_reentrant=False)


# -- a backward that re-enters autocast -------------------------------------------------
# torch runs an autograd Function's backward with the function-mode stack emptied; a
# region opened there must still be ours.
class _Linear(torch.autograd.Function):
    region = None  # set by each test: the region the backward re-enters

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with _Linear.region():
            dx = torch.mm(grad, w)
            dw = torch.mm(x.transpose(0, 1), grad).transpose(0, 1)
        _Linear.seen = (dx.dtype, dw.dtype)
        return dx, dw


class _WeightCasts(TorchDispatchMode):
    def __init__(self, weight):
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0] is self.weight:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _weight_casts(region, backward_inside: bool, keep_native_cache: bool = False) -> int:
    """How often the weight is cast when ``_Linear``'s backward re-enters ``region``,
    the backward run inside the region or after it (with ``torch.clear_autocast_cache``
    replaced by a no-op where ``keep_native_cache``, as torch's own test does)."""
    _Linear.region = region
    x, w = torch.randn(2, 3), nn.Parameter(torch.randn(4, 3))
    with mock.patch("torch.clear_autocast_cache") if keep_native_cache else contextlib.nullcontext():
        with _WeightCasts(w) as casts:
            with region():
                s = _Linear.apply(x, w).sum()
                if backward_inside:
                    s.backward()
            if not backward_inside:
                s.backward()
    return casts.count


def test_a_backward_that_reenters_autocast_reuses_the_forwards_weight_cast():
    assert _weight_casts(ours, backward_inside=True) == _weight_casts(native, backward_inside=True) == 1


def test_a_backward_after_the_region_reuses_its_weight_cast_while_torch_keeps_its_cache():
    # torch's own test of its global cache: with torch.clear_autocast_cache replaced by a
    # no-op, a backward run after the region closes re-enters autocast and finds the
    # forward's weight cast. Our cache follows the same function.
    counts = [_weight_casts(r, backward_inside=False, keep_native_cache=True) for r in (ours, native)]
    assert counts == [1, 1]


def test_a_backward_after_the_region_casts_again_when_torch_clears_its_cache():
    counts = [_weight_casts(r, backward_inside=False) for r in (ours, native)]
    assert counts == [2, 2]


def test_a_backward_that_reenters_our_region_follows_its_policy():
    _Linear.region = lambda: ours(policy=KEEP_MM_FP32)
    x, w = torch.randn(2, 3), nn.Parameter(torch.randn(4, 3))
    with ours():
        _Linear.apply(x, w).float().sum().backward()  # backward inside the outer region
    assert _Linear.seen == (torch.float32, torch.float32)  # mm kept in float32 by the policy


# -- torch.func transforms ------------------------------------------------------------
def _func_cases():
    from torch.func import grad, jacrev, vmap

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x, w, b = r(5, 3, 4), r(6, 4), r(6)
    m1, m2, acc = r(5, 3, 4), r(4, 6), r(5, 3, 6)
    cw, c8 = r(2, 3, 2), r(5, 3, 8)
    b1, b2, b0 = r(2, 3, 4), r(2, 4, 6), r(5, 2, 3, 6)
    return {
        "vmap-linear-bias": lambda: vmap(lambda t: F.linear(t, w, b))(x),
        "vmap-linear": lambda: vmap(lambda t: F.linear(t, w))(x),
        "vmap-mm": lambda: vmap(lambda t: t @ m2)(m1),
        "vmap-addmm": lambda: vmap(lambda a, m: torch.addmm(a, m, m2))(acc, m1),
        "vmap-conv1d": lambda: vmap(lambda t: F.conv1d(t, cw))(c8),
        "vmap-baddbmm": lambda: vmap(lambda a: torch.baddbmm(a, b1, b2))(b0),
        "per-sample-grads": lambda: vmap(
            grad(lambda wt, bt, t: F.linear(t, wt, bt).float().pow(2).sum(), argnums=(0, 1)),
            in_dims=(None, None, 0))(w, b, x),
        "jacrev": lambda: jacrev(lambda t: F.linear(t, w, b))(x[0]),
    }


@pytest.mark.parametrize("case", sorted(_func_cases()))
def test_torch_func_transforms_inside_ours_equal_native(case):
    # Native autocast casts some calls under torch.func transforms and not others (under
    # vmap, linear with a bias, addmm, conv1d and baddbmm stay float32): the same here.
    results = {}
    for region in (native, ours):
        with region():
            results[region] = _func_cases()[case]()
    same(results[ours], results[native])


# -- threads torch starts with our state ----------------------------------------------------
def _run_as_torchs_worker(fn, region_state):
    """Runs ``fn`` in a new thread that holds the dispatch-key and autocast state of a
    region, and none of our Python state: what torch's autograd engine gives the device
    threads it runs a backward on (it copies the caller's thread-local state)."""
    key = torch._C.DispatchKey.AutocastPrivateUse1
    enabled, dtype, token = region_state
    out = {}

    def worker():
        torch.set_autocast_enabled("cpu", enabled)
        torch.set_autocast_dtype("cpu", dtype)
        torch.set_autocast_dtype("privateuseone", token)
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        torch._C._dispatch_tls_set_dispatch_key_included(key, True)
        try:
            out["value"] = fn()
        except Exception as error:  # noqa: BLE001 - re-raised below
            out["error"] = error

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("policy", [None, KEEP_MM_FP32], ids=["built-in", "own"])
def test_a_thread_torch_starts_with_our_state_casts_under_our_policy(policy):
    a, w = torch.randn(4, 4), nn.Parameter(torch.randn(4, 4))
    with ours(policy=policy):
        want = (torch.mm(a, w), F.linear(a, w))
        state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                 torch.get_autocast_dtype("privateuseone"))
        got = _run_as_torchs_worker(lambda: (torch.mm(a, w), F.linear(a, w)), state)
    for g, x in zip(got, want):
        assert g.dtype == x.dtype and torch.equal(g, x)
    assert got[0].dtype == (torch.float32 if policy is not None else torch.bfloat16)
