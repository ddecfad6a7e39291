"""autocast: arguments, nesting, threads, native's casting rules, cache, autograd interplay."""

import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from dispatch_amp.autocast import _cast_cache, _compiled_engine, _engine, _tokens, context
from dispatch_amp.autocast.context import _DEVICES, device_dtypes
from dispatch_amp.autocast.policy import BUILTIN_DEVICES

CUDA_POLICY = amp.Policy.for_device("cuda")


def mm_dtype():
    a = torch.randn(4, 4)
    return torch.mm(a, a).dtype


class CountOps(TorchDispatchMode):
    """Counts aten calls by packet name (e.g. casts: '_to_copy')."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def no_state_leaks():
    yield
    assert _engine.STATE.regions == [] and _engine.STATE.fp8_level is None and not _engine.STATE.key_on
    assert not torch.is_autocast_enabled("privateuseone")
    assert not amp.is_autocast_enabled("cpu")


# -- arguments ----------------------------------------------------------------------
def test_defaults_per_device():
    assert amp.autocast("cpu").fast_dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert amp.autocast("cuda").fast_dtype == torch.float16
    assert amp.get_autocast_dtype("cpu") == torch.bfloat16
    assert amp.get_autocast_dtype("cuda") == torch.float16


# Exception types are torch.autocast's; the messages are ours, with torch's inside.
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device_type": "tpu"}, RuntimeError, r"supports \['cpu', 'cuda', 'mps', 'xpu'\]"),
        ({"device_type": torch.device("cpu")}, ValueError, "pass device.type"),
        ({"device_type": 0}, ValueError, "must be a string"),
        ({"device_type": "cpu", "dtype": "bfloat16"}, TypeError, "torch.dtype"),
        ({"device_type": "cpu", "enabled": 1}, TypeError, "enabled must be a bool"),
        ({"device_type": "cpu", "cache_enabled": 1}, TypeError, "cache_enabled"),
        ({"device_type": "cpu", "policy": "cuda"}, TypeError, "Policy.for_device"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        amp.autocast(**kwargs)
    if set(kwargs) == {"device_type"}:  # the cases torch.autocast also refuses
        with pytest.raises(error) as theirs:
            torch.autocast(**kwargs)
        with pytest.raises(error) as ours:
            amp.autocast(**kwargs)
        assert str(theirs.value) in str(ours.value)  # code matching torch's words still matches


@pytest.mark.parametrize("device_type", ["hpu", "xla", "mtia"])
def test_a_device_type_torch_autocasts_but_we_do_not_is_refused_with_the_way_out(device_type):
    # torch's exception type for a device type it does not autocast.
    with pytest.raises(RuntimeError, match=f"unsupported device_type '{device_type}'.*use torch.autocast there"):
        amp.autocast(device_type)


def test_every_device_type_with_a_builtin_policy_is_supported():
    assert set(_DEVICES) == set(BUILTIN_DEVICES)
    for device_type in BUILTIN_DEVICES:
        default, supported = device_dtypes(device_type)
        # torch's default outside any region, and the dtypes torch.autocast accepts there
        assert default is torch.get_autocast_dtype(device_type)
        assert set(supported) == {torch.float16, torch.bfloat16}


@pytest.mark.parametrize("device_type", ["xpu", "mps"])
def test_xpu_and_mps_regions_report_native_state_and_leave_cpu_tensors_alone(device_type):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.autocast has no availability warning for these
        region = amp.autocast(device_type, dtype=torch.bfloat16)
    with region:
        assert torch.is_autocast_enabled(device_type) and amp.is_autocast_enabled(device_type)
        assert torch.get_autocast_dtype(device_type) is torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")
        assert (x @ w).dtype is torch.float32  # only tensors on the region's device type
    assert not torch.is_autocast_enabled(device_type)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        native = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    assert native == (True, torch.bfloat16)


def test_state_queries_validate_device_type():
    with pytest.raises(RuntimeError, match="supports"):
        amp.is_autocast_enabled("xla")


# -- nesting and threads ------------------------------------------------------------
def test_nesting_inner_wins_and_outer_returns():
    assert mm_dtype() == torch.float32
    with amp.autocast("cpu"):
        assert amp.is_autocast_enabled("cpu") and not amp.is_autocast_enabled("cuda")
        assert mm_dtype() == torch.bfloat16
        with amp.autocast("cpu", enabled=False):
            assert not amp.is_autocast_enabled("cpu")
            assert mm_dtype() == torch.float32
        with amp.autocast("cpu", dtype=torch.float16):
            assert amp.get_autocast_dtype("cpu") == torch.float16
            assert mm_dtype() == torch.float16
        assert mm_dtype() == torch.bfloat16
    assert mm_dtype() == torch.float32


def test_state_restored_when_an_exception_escapes():
    with pytest.raises(KeyError):
        with amp.autocast("cpu"):
            with amp.autocast("cpu", enabled=False):
                raise KeyError("boom")
    assert mm_dtype() == torch.float32


def test_disabled_outer_then_enabled_inner():
    with amp.autocast("cpu", enabled=False):
        assert mm_dtype() == torch.float32
        with amp.autocast("cpu"):
            assert mm_dtype() == torch.bfloat16
        assert mm_dtype() == torch.float32


def test_same_instance_can_be_reentered():
    ctx = amp.autocast("cpu")
    with ctx:
        with ctx:
            assert mm_dtype() == torch.bfloat16
        assert mm_dtype() == torch.bfloat16


def test_decorator():
    @amp.autocast("cpu")
    def f(a):
        return torch.mm(a, a)

    assert f(torch.randn(2, 2)).dtype == torch.bfloat16
    assert mm_dtype() == torch.float32
    with pytest.raises(TypeError, match="generator"):

        @amp.autocast("cpu")
        def gen():
            yield


def test_state_is_per_thread():
    seen = {}

    def other():
        seen["enabled"] = amp.is_autocast_enabled("cpu")
        seen["dtype"] = mm_dtype()

    with amp.autocast("cpu"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert mm_dtype() == torch.bfloat16
    assert seen == {"enabled": False, "dtype": torch.float32}


def test_native_disabled_region_inside_ours_is_honoured():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with amp.autocast("cpu"):
        with torch.autocast("cpu", enabled=False):
            assert lin(x).dtype == torch.float32
            assert mm_dtype() == torch.float32
        assert lin(x).dtype == torch.bfloat16


@st.composite
def frame_programs(draw):
    n = draw(st.integers(1, 5))
    frames = [
        (draw(st.booleans()), draw(st.sampled_from([None, torch.bfloat16, torch.float16])))
        for _ in range(n)
    ]
    raise_at = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    return frames, raise_at


@given(frame_programs())
def test_random_nesting_with_exceptions_restores_state(program):
    frames, raise_at = program

    def expected(stack):
        # As torch.autocast: dtype=None means the dtype torch reports when the context is
        # made, which an enclosing region sets even when it is disabled.
        enabled, dtype = False, torch.bfloat16
        for on, d in stack:
            enabled, dtype = on, d or dtype
        return dtype if enabled else torch.float32

    def native(depth=0):
        if depth == len(frames):
            return mm_dtype()
        on, d = frames[depth]
        with torch.autocast("cpu", dtype=d, enabled=on):
            return native(depth + 1)

    assert native() == expected(frames)

    def enter(depth):
        if depth == len(frames):
            return
        on, d = frames[depth]
        with amp.autocast("cpu", dtype=d, enabled=on):
            assert mm_dtype() == expected(frames[: depth + 1])
            assert amp.is_autocast_enabled("cpu") == on
            if raise_at == depth:
                raise ValueError(depth)
            enter(depth + 1)
            assert mm_dtype() == expected(frames[: depth + 1])

    if raise_at is None:
        enter(0)
    else:
        with pytest.raises(ValueError):
            enter(0)
    assert mm_dtype() == torch.float32


# -- native's casting rules -----------------------------------------------------------
def test_float64_integers_and_other_devices_are_never_cast():
    d = torch.randn(3, 3, dtype=torch.float64)
    i = torch.ones(3, 3, dtype=torch.int64)
    meta = torch.randn(3, 3, device="meta")
    with amp.autocast("cpu"):
        assert torch.mm(d, d).dtype == torch.float64
        assert torch.mm(i, i).dtype == torch.int64
        assert torch.mm(meta, meta).dtype == torch.float32


def test_in_place_and_out_are_not_cast():
    a = torch.randn(4, 4)
    out = torch.empty(4, 4)
    with amp.autocast("cpu", policy=CUDA_POLICY):
        torch.mm(a, a, out=out)
        assert out.dtype == torch.float32
        h = torch.randn(4, dtype=torch.float16)
        h.exp_()  # exp is float32 under the CUDA table; the in-place form is left alone
        assert h.dtype == torch.float16
        assert torch.exp(h).dtype == torch.float32
    torch.testing.assert_close(out, a @ a)


def test_ops_outside_the_tables_run_as_given():
    a = torch.randn(4, dtype=torch.bfloat16)
    b = torch.randn(4)
    with amp.autocast("cpu"):
        assert (a + b).dtype == torch.float32  # ordinary type promotion
        assert torch.relu(a).dtype == torch.bfloat16


def test_promote_looks_inside_lists():
    lo = torch.randn(3, dtype=torch.bfloat16)
    hi = torch.randn(3)
    with amp.autocast("cpu"):
        assert torch.cat([lo, lo]).dtype == torch.bfloat16
        assert torch.cat([lo, hi]).dtype == torch.float32
        assert torch.stack((hi, lo)).dtype == torch.float32
    with amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        h = torch.randn(3, dtype=torch.float16)
        assert torch.addcmul(h, h, h).dtype == torch.float16
        assert torch.addcmul(hi, h, h).dtype == torch.float32


def test_binary_cross_entropy_is_refused_under_the_cuda_table():
    p = torch.rand(4)
    y = torch.rand(4)
    with amp.autocast("cpu", policy=CUDA_POLICY):
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, y)
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            torch.nn.BCELoss()(p, y)
        assert F.binary_cross_entropy_with_logits(p, y).dtype == torch.float32
    with amp.autocast("cpu"):  # the CPU table runs it in float32, as native does
        assert F.binary_cross_entropy(p, y).dtype == torch.float32


CROSS_ENTROPY_FORMS = {
    "plain": {},
    "label-smoothing": {"label_smoothing": 0.1},
    "weight": {"weight": True},
    "weight-label-smoothing": {"weight": True, "label_smoothing": 0.2},
    "ignore-index": {"ignore_index": 3, "label_smoothing": 0.1},
    "sum": {"reduction": "sum", "label_smoothing": 0.3},
    "none": {"reduction": "none", "label_smoothing": 0.1},
    "probabilities": {"probs": True, "label_smoothing": 0.1, "weight": True},
}


def _native_cuda_cross_entropy(x, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    # What native CUDA autocast computes (measured on an H100): LossNLL.cpp's composite with
    # log_softmax in the input's dtype (its dtype is given, so autocast leaves it), nll_loss
    # on a float32 cast, and sums given dtype=float32.
    f32 = torch.float32
    lp = torch.log_softmax(x, 1, dtype=x.dtype)
    n = lp.shape[1]
    if target.shape == x.shape:
        t = target * (1 - label_smoothing) + label_smoothing / n
        prod = lp * t * (weight.view(1, n) if weight is not None else 1)
        return -prod.sum(dtype=f32) / (lp.numel() // n)
    nll = F.nll_loss(lp.float(), target, None if weight is None else weight.float(), ignore_index=ignore_index, reduction=reduction)
    if label_smoothing == 0:
        return nll
    smooth = -(lp * weight.view(1, n)).sum(1, dtype=f32) if weight is not None else -lp.sum(1, dtype=f32)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        den = weight.gather(0, target.masked_select(~ignored)).sum(dtype=f32) if weight is not None else (~ignored).sum()
        smooth = smooth.sum(dtype=f32) / den
    elif reduction == "sum":
        smooth = smooth.sum(dtype=f32)
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n)


@pytest.mark.parametrize("form", sorted(CROSS_ENTROPY_FORMS))
def test_cross_entropy_under_the_cuda_table_is_natives_composite(form):
    opts = dict(CROSS_ENTROPY_FORMS[form])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, generator=g).half()
    target = torch.softmax(torch.randn(6, 10, generator=g), 1) if opts.pop("probs", False) else torch.randint(0, 10, (6,), generator=g)
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(10, generator=g)
    with amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        got = F.cross_entropy(x, target, **opts)
        module = torch.nn.CrossEntropyLoss(**opts)(x, target)
        aten = torch._C._nn.cross_entropy_loss(x, target, opts.get("weight"), {"none": 0, "mean": 1, "sum": 2}[opts.get("reduction", "mean")],
                                               opts.get("ignore_index", -100), opts.get("label_smoothing", 0.0))
    want = _native_cuda_cross_entropy(x, target, **opts)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(module, want) and torch.equal(aten, want)


@pytest.mark.parametrize("name", ["vector_norm", "softmax", "cumsum", "sum"])
def test_fp32_unless_dtype_ops_get_dtype_float32_as_native_passes_it(name):
    # Native appends dtype=float32 rather than casting the input: the op's own dtype path
    # runs, and its backward (for vector_norm it differs from a cast's in the last bit).
    fn = {"vector_norm": torch.linalg.vector_norm, "softmax": lambda t, **k: torch.softmax(t, 0, **k),
          "cumsum": lambda t, **k: t.cumsum(0, **k), "sum": torch.sum}[name]
    v = torch.randn(64, dtype=torch.float16, requires_grad=True)
    with amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        out = fn(v)
    grad, = torch.autograd.grad(out.float().sum(), v)
    want = fn(v, dtype=torch.float32)
    want_grad, = torch.autograd.grad(want.float().sum(), v)
    assert out.dtype == torch.float32 and grad.dtype == torch.float16
    assert torch.equal(out, want) and torch.equal(grad, want_grad)
    # the op's own dtype path, not a cast in front of it: the same autograd graph
    def graph(t):
        node, names = t.grad_fn, []
        while node is not None:
            names.append(type(node).__name__)
            node = node.next_functions[0][0] if node.next_functions else None
        return names

    assert graph(out) == graph(want)


def test_fp32_unless_dtype_leaves_ineligible_calls_as_given():
    with amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        assert torch.sum(torch.ones(3, dtype=torch.float64)).dtype == torch.float64
        assert torch.sum(torch.ones(3, dtype=torch.int64)).dtype == torch.int64
        out = torch.empty((), dtype=torch.float16)
        assert torch.sum(torch.ones(3, dtype=torch.float16), 0, out=out).dtype == torch.float16


def test_explicit_dtype_argument_is_respected_by_fp32_ops():
    x = torch.randn(8, dtype=torch.float16)
    with amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        assert torch.softmax(x, 0).dtype == torch.float32
        assert torch.softmax(x, 0, dtype=torch.float16).dtype == torch.float16
        assert x.sum(dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
def test_ops_inside_cpp_composites_follow_the_policy(grad):
    # pairwise_distance decomposes in C++ into a vector norm; the engine's kernel for it
    # runs it in float32, as native CUDA autocast does, with or without autograd.
    a = torch.randn(4, 8, dtype=torch.float16, requires_grad=grad)
    with torch.set_grad_enabled(grad), amp.autocast("cpu", dtype=torch.float16, policy=CUDA_POLICY):
        assert F.pairwise_distance(a, a).dtype == torch.float32


# -- weight-cast cache ----------------------------------------------------------------
def test_weight_used_several_times_is_cast_once():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    counter = CountOps()
    with amp.autocast("cpu"):
        with counter:
            for _ in range(3):
                lin(x)
    # weight and bias cast once each, the bf16 input needs no cast
    assert counter.counts.get("_to_copy", 0) == 2


def test_cache_disabled_casts_every_time():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    counter = CountOps()
    with amp.autocast("cpu", cache_enabled=False):
        with counter:
            for _ in range(3):
                lin(x)
    assert counter.counts.get("_to_copy", 0) == 6


def test_in_place_change_invalidates_the_cached_cast():
    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)
    with amp.autocast("cpu"):
        before = lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        after = lin(x)
    torch.testing.assert_close(after.float(), 2 * before.float(), rtol=2e-2, atol=1e-2)


def test_model_built_under_inference_mode_is_cast_without_the_cache():
    # Inference tensors have no version counter; native handles them, so must we.
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)
        with torch.autocast("cpu"):
            expected = lin(x)
        with amp.autocast("cpu"):
            got = lin(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_cache_is_dropped_at_exit_and_not_shared_across_grad_modes():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with amp.autocast("cpu"):
        with torch.no_grad():
            lin(x)
        # the cast made under no_grad has no history: the next op must get a fresh one
        lin(x).float().sum().backward()
        assert _cast_cache.REGION.entries
    assert not _cast_cache.REGION.entries
    assert lin.weight.grad is not None


# -- autograd -------------------------------------------------------------------------
def test_backward_outside_gives_native_gradients_in_parameter_dtype():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    grads = []
    for ctx in (torch.autocast("cpu"), amp.autocast("cpu")):
        with ctx:
            loss = torch.mm(x, w).exp().sum()
        (g,) = torch.autograd.grad(loss, w)
        grads.append(g)
    assert grads[1].dtype == torch.float32
    assert torch.equal(grads[0], grads[1])


def test_autograd_saves_the_low_precision_copies():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with amp.autocast("cpu"):
            torch.mm(x, w)
    assert saved == [torch.bfloat16, torch.bfloat16]


def test_in_place_modification_error_still_fires():
    a = torch.randn(4, 4, requires_grad=True)
    with amp.autocast("cpu"):
        e = torch.mm(a, a).exp()
        e.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


def test_in_place_op_after_a_cast_keeps_gradients_right():
    w = torch.randn(4, 4, requires_grad=True)
    grads = []
    for ctx in (torch.autocast("cpu"), amp.autocast("cpu")):
        with ctx:
            h = torch.mm(w, w)
            h.mul_(2)
            loss = h.float().sum()
        grads.append(torch.autograd.grad(loss, w)[0])
    assert torch.equal(*grads)


def test_no_grad_and_inference_mode():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with amp.autocast("cpu"):
        with torch.no_grad():
            assert lin(x).dtype == torch.bfloat16
        with torch.inference_mode():
            assert lin(x).dtype == torch.bfloat16
            assert F.layer_norm(x, (4,)).dtype == torch.float32


def test_double_backward_matches_native():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(6, 6)
    results = []
    for ctx in (torch.autocast("cpu"), amp.autocast("cpu")):
        with ctx:
            out = torch.mm(x, w).float().pow(2).sum()
        (g,) = torch.autograd.grad(out, w, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), w)
        results.append((g, gg))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


class _ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w) * 2

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.mm(grad, w.t().to(grad.dtype)) * 2, torch.mm(x.t().to(grad.dtype), grad) * 2


def test_custom_autograd_function_with_save_for_backward():
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    outs = []
    for ctx in (torch.autocast("cpu"), amp.autocast("cpu")):
        with ctx:
            y = _ScaledMatmul.apply(x, w)
        y.float().sum().backward()
        outs.append((y, x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    assert outs[1][0].dtype == torch.bfloat16
    for native, ours in zip(outs[0], outs[1]):
        assert torch.equal(native, ours)


# -- checkpointing and torch.compile ----------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_recomputes_under_our_state(use_reentrant):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def block(t):
        return lin(t).relu().sum(-1)

    grads = []
    for ctx, ckpt in (
        (torch.autocast("cpu"), torch.utils.checkpoint.checkpoint),
        (amp.autocast("cpu"), amp.checkpoint),
    ):
        lin.zero_grad()
        with ctx:
            y = ckpt(block, x, use_reentrant=use_reentrant)
        y.float().sum().backward()
        grads.append(lin.weight.grad.clone())
    assert y.dtype == torch.bfloat16
    assert torch.equal(*grads)


# -- regions left out of order (generators) -------------------------------------------
def _opens_and_yields(region):
    def gen():
        with region:
            yield
    g = gen()
    next(g)
    return g


def test_a_region_closed_under_a_mode_entered_later_leaves_that_mode_alone():
    # The generator's region ends inside the caller's torch.device("meta") block: only
    # our level leaves torch's function-mode stack, the device mode stays in force.
    g = _opens_and_yields(amp.autocast("cpu"))
    with torch.device("meta"):
        next(g, None)
        assert torch.empty(2).device.type == "meta"
        assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0
    assert torch.empty(2).device.type == "cpu"


def test_a_region_closed_out_of_order_closes_itself_not_the_callers():
    a = torch.ones(2, 2)
    g = _opens_and_yields(amp.autocast("cpu"))          # bfloat16, enabled
    with amp.autocast("cpu", enabled=False):             # the caller's region, innermost
        next(g, None)                                   # the generator's region closes
        # The caller's region is still in force, as under native autocast.
        assert not torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype == torch.float32
    # Both closed: autocast is off again. (Two torch.autocast regions left this way leave
    # it on: the caller's exit restores the generator's state.)
    assert not torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype == torch.float32
    assert torch._C._len_torch_function_stack() == 0


CUSTOM = amp.Policy.for_device("cpu").with_ops(fp32=["mm"], name="mm-fp32")


_REGIONS = st.lists(
    st.tuples(st.booleans(), st.sampled_from([torch.bfloat16, torch.float16]), st.booleans()),
    min_size=2, max_size=4,
)


# (regions, closing order), drawn together: nothing is drawn while regions are open.
@given(case=_REGIONS.flatmap(lambda rs: st.tuples(st.just(rs), st.permutations(range(len(rs))))))
def test_regions_closed_in_any_order_leave_the_innermost_in_force_and_nothing_behind(case):
    # Open regions one inside the other, close them in a random order; after each close,
    # torch's state and the casts are those of the innermost region still open, and after
    # the last nothing is left: no frame, no level, no mode, torch's state as it was.
    regions, order = case
    a = torch.ones(2, 2)
    before = (torch._functorch.config.backward_pass_autocast, torch.get_autocast_dtype("cpu"))
    opened = []
    for enabled, dtype, custom in regions:
        region = amp.autocast("cpu", dtype=dtype, enabled=enabled, policy=CUSTOM if custom else None)
        region.__enter__()
        opened.append((region, enabled, dtype, custom))
    still_open = list(range(len(opened)))
    try:
        for i in order:
            still_open.remove(i)
            opened[i][0].__exit__(None, None, None)
            if still_open:
                _, enabled, dtype, custom = opened[still_open[-1]]
                assert torch.is_autocast_enabled("cpu") == enabled
                if enabled:
                    assert torch.get_autocast_dtype("cpu") == dtype
                want = dtype if enabled and not custom else torch.float32
                assert torch.mm(a, a).dtype == want
    finally:  # a failed check above must not leave regions open for the next example
        for i in reversed(still_open):
            opened[i][0].__exit__(None, None, None)
    assert _engine.STATE.regions == []
    assert torch._C._len_torch_function_stack() == 0
    assert (torch._functorch.config.backward_pass_autocast, torch.get_autocast_dtype("cpu")) == before
    assert not torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype == torch.float32


# -- interrupts (Ctrl-C) ----------------------------------------------------------------
_PACKAGE = amp.__file__.rsplit("/", 1)[0]


def _torch_state():
    torch.autocast_increment_nesting()
    nesting = torch.autocast_decrement_nesting()
    st = _engine.STATE
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), nesting,
            torch._C._len_torch_function_stack(), len(st.regions),
            st.fp8_level is not None, st.key_on, torch.is_autocast_enabled("privateuseone"),
            torch.get_autocast_dtype("privateuseone"),
            torch._functorch.config.backward_pass_autocast)


def _interrupt_at(k, make):
    """Runs `with make(): pass`, raising KeyboardInterrupt at the k-th line of our code it
    runs (0: never); returns the number of lines and the function interrupted."""
    count, where = [0], [None]

    def tracer(frame, event, arg):
        if event == "call":
            return tracer if frame.f_code.co_filename.startswith(_PACKAGE) else None
        if event == "line":
            count[0] += 1
            if count[0] == k:
                where[0] = frame.f_code.co_name
                raise KeyboardInterrupt
        return tracer

    region = make()
    sys.settrace(tracer)
    try:
        with region:
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return count[0], where[0], region


@pytest.mark.parametrize("policy", [None, amp.Policy.for_device("cpu").with_ops(fp32=["mm"])],
                         ids=["built-in", "own"])
def test_an_interrupt_anywhere_in_enter_or_exit_leaves_the_region_fully_open_or_closed(policy):
    def make():
        return amp.autocast("cpu", policy=policy)

    closed = _torch_state()
    with make():
        opened = _torch_state()
    lines, _, _ = _interrupt_at(0, make)
    left_open = []
    for k in range(1, lines + 1):
        _, where, region = _interrupt_at(k, make)
        state = _torch_state()
        assert state in (closed, opened), f"interrupted at line {k} ({where}): partial state {state}"
        if state == opened:  # only before __exit__ changed anything: close it as `with` would
            left_open.append(where)
            region.__exit__(None, None, None)
            assert _torch_state() == closed
    assert set(left_open) <= {"__exit__"} and len(left_open) <= 2, left_open


# -- a region opened while another is being entered or left (a signal handler's) --------
def _nested_at(k, outer_policy, inner_policy, in_function):
    """Runs `with amp.autocast("cpu", policy=outer_policy): mm`, opening and closing a
    float16 region (a signal handler's) at the k-th line run in ``in_function`` while the
    region is entered or left (0: never);
    returns the number of such lines, the dtypes seen inside each region, and whether the
    inner region ran."""
    count, seen = [0], {}
    a = torch.ones(2, 2)

    def handler():
        with amp.autocast("cpu", dtype=torch.float16, policy=inner_policy):
            seen["inner"] = torch.mm(a, a).dtype

    def tracer(frame, event, arg):
        if event == "call":
            return tracer if frame.f_code.co_name == in_function and frame.f_code.co_filename.startswith(_PACKAGE) else None
        if event == "line":
            count[0] += 1
            if count[0] == k:
                handler()  # the trace function runs untraced: the handler's lines are not counted
        return tracer

    region = amp.autocast("cpu", dtype=torch.bfloat16, policy=outer_policy)
    sys.settrace(tracer)
    try:
        region.__enter__()
    finally:
        sys.settrace(None)
    try:
        seen["outer"] = torch.mm(a, a).dtype
    finally:
        sys.settrace(tracer)
        try:
            region.__exit__(None, None, None)
        finally:
            sys.settrace(None)
    return count[0], seen


@pytest.mark.parametrize("in_function", ["_push_frame", "enter", "_refresh", "leave", "_uninstall"])
@pytest.mark.parametrize("policy", [None, CUSTOM], ids=["built-in", "own"])
def test_a_region_opened_at_any_line_of_another_regions_entry_or_exit_leaves_both_whole(policy, in_function):
    # A handler that opens and closes a region of its own while ours is being pushed: both
    # regions see their own casts, and after ours closes no record, no level and no count
    # of torch's is left (a region half pushed left torch's nesting counter at 1 and the
    # region's parts out of step).
    closed = _torch_state()
    lines, _ = _nested_at(0, policy, None, in_function)
    assert lines > 0
    outer_dtype = torch.float32 if policy is CUSTOM else torch.bfloat16
    for k in range(1, lines + 1):
        _, seen = _nested_at(k, policy, None, in_function)
        assert seen == {"inner": torch.float16, "outer": outer_dtype}, f"line {k} of {in_function}: {seen}"
        assert _torch_state() == closed, f"line {k} of {in_function}: {_torch_state()} != {closed}"
        assert _engine.STATE.regions == []


@pytest.mark.parametrize("inner", [
    {"dtype": torch.bfloat16}, {"dtype": torch.float16}, {"enabled": False},
    {"dtype": torch.bfloat16, "cache_enabled": False},
], ids=["same dtype", "other dtype", "disabled", "cache off"])
def test_a_native_region_inside_ours_under_the_builtin_policy_casts_as_native_nesting(inner):
    # Under a built-in policy the kernels do not read torch's nesting counter (_engine's
    # fast path): a native region inside ours must still give what native inside native
    # gives, forward and backward, bit for bit.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    x = torch.randn(4, 8)

    def run(outer):
        model.zero_grad(set_to_none=True)
        with outer("cpu"):
            h = model[0](x)
            with torch.autocast("cpu", **inner):
                y = model[3](model[2](model[1](h.float())))
                inside = (y.dtype, torch.mm(x, x.t()).dtype)
            z = model[0](y.float()[:, :4].repeat(1, 2))
        (z.float().sum() + y.float().sum()).backward()
        return inside, y, z, [p.grad for p in model.parameters()]

    got, want = run(amp.autocast), run(torch.autocast)
    assert got[0] == want[0]
    for a, b in zip([got[1], got[2], *got[3]], [want[1], want[2], *want[3]]):
        assert a.dtype == b.dtype and torch.equal(a, b)


# -- a region's context is made once per arguments (context._CONTEXTS) ------------------
def _inside(region):
    """What a region sets, as torch, the kernels and the compiled side read it."""
    st_ = _engine.STATE
    with region:
        compiled = _compiled_engine.ENGINE.module
        top = st_.top
        return (
            _torch_state(), mm_dtype(), st_.native_depth, len(st_.active),
            None if top is None else (top[1], top[2], top[3], top[4], top[5], top[0].plan),
            None if compiled is None else compiled.top(),
        )


@pytest.mark.parametrize("kwargs", [
    {}, {"dtype": torch.float16}, {"enabled": False}, {"cache_enabled": False}, {"policy": CUSTOM},
    {"dtype": None, "cache_enabled": None},
], ids=["default", "float16", "disabled", "cache off", "own policy", "read from torch"])
def test_regions_made_from_the_same_arguments_share_a_context_equal_to_a_fresh_one(monkeypatch, kwargs):
    first, again = amp.autocast("cpu", **kwargs), amp.autocast("cpu", **kwargs)
    assert again._ctx is first._ctx
    monkeypatch.setattr(context, "_CONTEXTS", {})  # nothing kept: the context is made anew
    fresh = amp.autocast("cpu", **kwargs)
    assert fresh._ctx is not first._ctx and fresh._ctx == first._ctx
    for field in ("custom", "plan", "handlers", "native_key"):
        assert getattr(fresh._ctx, field) == getattr(first._ctx, field), field
    assert _inside(first) == _inside(again) == _inside(fresh)


def test_a_context_is_reused_only_for_the_same_policy_object():
    a = amp.Policy.for_device("cpu").with_ops(fp32=["mm"], name="a")
    b = amp.Policy.for_device("cpu").with_ops(fp32=["mm"], name="b")
    assert a == b and a is not b  # equal tables: each region still holds the policy it was given
    assert amp.autocast("cpu", policy=a)._ctx.policy is a
    assert amp.autocast("cpu", policy=b)._ctx.policy is b
    a.name = "renamed"  # the one thing a policy lets one change, between two regions
    assert amp.autocast("cpu", policy=a)._ctx.policy.name == "renamed"
    # A policy derived between two regions made from the same other arguments applies.
    c = a.with_ops(lower=["mm"])
    with amp.autocast("cpu", policy=a):
        assert mm_dtype() == torch.float32
    with amp.autocast("cpu", policy=c):
        assert mm_dtype() == torch.bfloat16
    # An entry found under another policy's id (ids are reused once an object is gone) is
    # not that policy's context.
    key = ("cpu", True, torch.bfloat16, True, id(c))
    context._CONTEXTS[key] = amp.autocast("cpu", policy=a)._ctx
    try:
        region = amp.autocast("cpu", policy=c)
        assert region._ctx.policy is c
        with region:
            assert mm_dtype() == torch.bfloat16
    finally:
        context._CONTEXTS.pop(key, None)


def test_the_kept_contexts_are_bounded_and_a_policy_made_per_region_applies(monkeypatch):
    monkeypatch.setattr(context, "_MAX_CONTEXTS", 4)
    monkeypatch.setattr(context, "_CONTEXTS", {})
    base = amp.Policy.for_device("cpu")
    for i in range(12):
        policy = base.with_ops(fp32=["mm"]) if i % 2 else base.with_ops(lower=["mm"])
        with amp.autocast("cpu", policy=policy):
            assert mm_dtype() == (torch.float32 if i % 2 else torch.bfloat16)
        assert len(context._CONTEXTS) <= 4


def test_whether_a_region_can_cast_is_asked_at_every_construction(monkeypatch):
    # Kept contexts skip no check: CUDA's availability and the dtype are asked each time.
    for available in (False, True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            region = amp.autocast("cuda")
        assert region.enabled == region._ctx.enabled == available
        assert any("CUDA is not available" in str(w.message) for w in caught) != available
    for _ in range(2):
        with pytest.warns(UserWarning, match="supports dtype"):
            region = amp.autocast("cpu", dtype=torch.float32)
        assert not region.enabled and not region._ctx.enabled
    with pytest.raises(ValueError, match="no recipe was given"):  # the fp8 check, every time
        amp.autocast("cpu", policy=base_fp8_policy())
    with pytest.raises(ValueError, match="no recipe was given"):
        amp.autocast("cpu", policy=base_fp8_policy())


def base_fp8_policy():
    return amp.Policy.for_device("cpu").with_ops(fp8=["linear"])


# -- what a region's view holds: what _refresh derived from the frame at every call ----
def _derived_from_the_frame():
    st_ = _engine.STATE
    top = st_.regions[-1] if st_.regions else None
    active = () if top is None else tuple(c for c in top.frame.values() if c.enabled)
    primary = active[0] if len(active) == 1 else None
    depth = -1 if top is None else top.depth
    kernels_top = None if primary is None else (
        primary, depth if primary.custom or primary.fp8 is not None else None,
        primary.native_key, primary.device_type, primary.dtype, primary.handlers,
    )
    recipe = next((c.fp8 for c in active if c.fp8 is not None), None)
    return active, primary, depth, kernels_top, recipe


def _check_view():
    st_ = _engine.STATE
    active, primary, depth, kernels_top, recipe = _derived_from_the_frame()
    assert st_.active == active and st_.primary is primary and st_.native_depth == depth
    assert st_.top == kernels_top
    assert (st_.fp8_mode.fp8_recipe if st_.fp8_mode is not None else None) is recipe
    if active:
        assert torch.get_autocast_dtype("privateuseone") is _tokens.token_for(active)
    compiled = _compiled_engine.ENGINE.module
    if compiled is not None:
        on, c_depth, _, _, plan = compiled.top()
        assert on == (primary is not None)
        if on:
            assert c_depth == (-1 if kernels_top[1] is None else kernels_top[1])
            assert plan == _compiled_engine.plan_number(primary.plan)


_VIEW_REGIONS = st.lists(
    st.tuples(st.sampled_from(["cpu", "xpu"]), st.booleans(), st.booleans(), st.booleans()),
    min_size=1, max_size=4,
)


@given(case=_VIEW_REGIONS.flatmap(lambda rs: st.tuples(st.just(rs), st.permutations(range(len(rs))))))
def test_the_state_a_region_sets_is_what_its_frame_says_after_every_entry_and_exit(case):
    # Regions of one or two device types (frames of one or two contexts), with and without
    # a policy of one's own or an fp8 recipe, closed in any order (out of order rebuilds
    # the frames above): after each step the thread's state is what the innermost frame
    # gives when derived afresh.
    regions, order = case
    recipe = amp.fp8.CurrentScaling()
    opened = []
    try:
        for device_type, enabled, custom, with_fp8 in regions:
            policy = (CUSTOM if device_type == "cpu" else CUDA_POLICY.with_ops(fp32=["mm"])) if custom else None
            region = amp.autocast(device_type, dtype=torch.bfloat16 if device_type == "cpu" else torch.float16,
                                  enabled=enabled, policy=policy, fp8=recipe if with_fp8 else None)
            region.__enter__()
            opened.append(region)
            _check_view()
        for i in order:
            region, opened[i] = opened[i], None
            region.__exit__(None, None, None)
            _check_view()
    finally:
        for region in reversed(opened):
            if region is not None:
                region.__exit__(None, None, None)
    assert _derived_from_the_frame() == ((), None, -1, None, None)


def test_a_region_keeps_nothing_of_its_fp8_recipe_or_policy_alive_once_closed():
    # Views are kept only by contexts autocast keeps (no recipe in them): a region's own
    # context (an fp8 recipe's, say) goes with its last reference, as it did before views,
    # without waiting for the cycle collector.
    import gc
    import weakref

    layer = torch.nn.Linear(16, 16)
    gc.collect()
    gc.disable()
    try:
        recipe = amp.fp8.CurrentScaling()
        policy = amp.Policy.for_device("cpu").with_ops(fp32=["mm"], name="per-region")
        refs = [weakref.ref(recipe)]
        with amp.autocast("cpu", fp8=recipe):
            with amp.autocast("xpu", policy=CUDA_POLICY):  # a frame of two contexts
                layer(torch.randn(4, 16))
        region = amp.autocast("cpu", policy=policy, fp8=amp.fp8.CurrentScaling())
        refs += [weakref.ref(region._ctx), weakref.ref(region.fp8)]
        with region:
            layer(torch.randn(4, 16))
        del recipe, region
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()
