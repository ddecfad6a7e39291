"""GradScaler against torch.amp.GradScaler: trajectories, skipped steps, misuse, checkpoints, syncs."""

import copy
import os
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp import GradScaler, OptState
from dispatch_amp.kernels import unscale as unscale_mod

HAS_TRITON_CPU = unscale_mod.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
OUR_BACKENDS = ["torch", "triton"] if HAS_TRITON_CPU else ["torch"]
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def make_opts(model, kind, n_opts):
    params = list(model.parameters())
    if n_opts == 1:
        return [OPTIMIZERS[kind](params)]
    return [OPTIMIZERS[kind](params[:2]), OPTIMIZERS[kind](params[2:])]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0)) and torch.equal(a.isnan(), b.isnan())


def snapshot(model, opts):
    params = [p.detach().clone() for p in model.parameters()]
    states = [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for s in opt.state.values() for k, v in s.items()}
        for opt in opts
    ]
    state_tensors = [[v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)] for opt in opts]
    return params, states, state_tensors


def assert_same_snapshot(a, b):
    for x, y in zip(a[0], b[0]):
        assert bits_equal(x, y)
    for xs, ys in zip(a[2], b[2]):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert bits_equal(x, y)


# ------------------------------------------------------------------------------------------
# Trajectory parity
# ------------------------------------------------------------------------------------------

injections = st.sampled_from([None, None, None, (0, float("inf")), (0, float("nan")), (1, float("-inf")), ("both", float("inf"))])


def train(scaler, model, opts, schedule, seed, pre_unscale, accumulate):
    gen = torch.Generator().manual_seed(seed)
    scales, skipped = [], []
    for inject in schedule:
        for opt in opts:
            opt.zero_grad()
        for _ in range(2 if accumulate else 1):
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if inject is not None:
            target, value = inject
            targets = range(len(opts)) if target == "both" else [min(target, len(opts) - 1)]
            for t in targets:
                opts[t].param_groups[0]["params"][0].grad.view(-1)[1] = value
        if pre_unscale:
            for opt in opts:
                scaler.unscale_(opt)
        skipped.append([scaler.step(opt) is None for opt in opts])
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped


@settings(max_examples=30)
@given(
    kind=st.sampled_from(sorted(OPTIMIZERS)),
    n_opts=st.integers(1, 2),
    schedule=st.lists(injections, min_size=1, max_size=10),
    init_exp=st.integers(0, 20),
    growth_interval=st.integers(1, 3),
    pre_unscale=st.booleans(),
    accumulate=st.booleans(),
    backend=st.sampled_from(OUR_BACKENDS),
    seed=st.integers(0, 1000),
)
def test_trajectory_matches_torch(kind, n_opts, schedule, init_exp, growth_interval, pre_unscale, accumulate, backend, seed):
    kwargs = dict(init_scale=2.0**init_exp, growth_interval=growth_interval)
    ref_model, our_model = make_model(seed), make_model(seed)
    ref_opts, our_opts = make_opts(ref_model, kind, n_opts), make_opts(our_model, kind, n_opts)
    ref = train(torch.amp.GradScaler("cpu", **kwargs), ref_model, ref_opts, schedule, seed, pre_unscale, accumulate)
    ours = train(GradScaler("cpu", backend=backend, **kwargs), our_model, our_opts, schedule, seed, pre_unscale, accumulate)
    assert ours == ref  # scale sequence and which optimizer skipped when
    assert_same_snapshot(snapshot(our_model, our_opts), snapshot(ref_model, ref_opts))


def test_sparse_gradients_match_torch():
    results = []
    for Scaler in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = Scaler("cpu", init_scale=256.0)
        for step in range(3):
            opt.zero_grad()
            idx = torch.tensor([1, 1, 5, 7, 1])
            scaler.scale(emb(idx).sum()).backward()
            if step == 1:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        results.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert bits_equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == 128.0


# ------------------------------------------------------------------------------------------
# No data lost
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("backend", OUR_BACKENDS)
def test_skipped_step_leaves_params_and_state_bit_identical(kind, backend):
    model = make_model()
    (opt,) = make_opts(model, kind, 1)
    scaler = GradScaler("cpu", init_scale=1024.0, backend=backend)
    x = torch.randn(4, 6)
    for bad in (False, True):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        if bad:
            model[2].bias.grad[0] = float("nan")
            before = snapshot(model, [opt])
        result = scaler.step(opt)
        scaler.update()
    assert result is None or kind == "fused_adamw"  # fused optimizers skip on the device
    assert_same_snapshot(snapshot(model, [opt]), before)
    assert scaler.get_scale() == 512.0 and scaler.skipped_steps == 1


def test_each_optimizer_skips_on_its_own_overflow():
    model = make_model()
    opts = make_opts(model, "sgd", 2)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    model[2].weight.grad[0, 0] = float("inf")  # belongs to the second optimizer
    before = model[0].weight.detach().clone()
    scaler.step(opts[0])
    assert not torch.equal(model[0].weight, before)  # the first optimizer stepped
    assert scaler.step(opts[1]) is None
    scaler.update()
    assert not torch.equal(model[0].weight, before)
    assert scaler.get_scale() == 2.0**15 and scaler.skipped_steps == 1


# ------------------------------------------------------------------------------------------
# Host syncs
# ------------------------------------------------------------------------------------------


def syncs_per_step(sync_counter, kind, n_opts, pre_unscale, steps=3):
    model = make_model()
    opts = make_opts(model, kind, n_opts)
    scaler = GradScaler("cpu")
    counts = []
    for _ in range(steps):
        for opt in opts:
            opt.zero_grad()
        loss = model(torch.randn(4, 6)).pow(2).mean()
        with sync_counter() as counter:
            scaler.scale(loss).backward()
            if pre_unscale:
                scaler.unscale_(*opts)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        counts.append(counter.count)
    return counts


@pytest.mark.parametrize(
    "kind, n_opts, pre_unscale, expected",
    [
        ("sgd", 1, False, 1),
        ("sgd", 2, True, 1),  # unscaled together: one sync serves both steps
        ("sgd", 2, False, 2),  # torch's lazy-unscale order: each step must see its own flag
        ("fused_adamw", 1, False, 0),
        ("fused_adamw", 2, False, 0),
    ],
)
def test_host_syncs_per_step(sync_counter, kind, n_opts, pre_unscale, expected):
    assert syncs_per_step(sync_counter, kind, n_opts, pre_unscale) == [expected] * 3


# ------------------------------------------------------------------------------------------
# Misuse
# ------------------------------------------------------------------------------------------


def fresh(**kw):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=64.0, **kw)
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    return model, opt, scaler


def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


def test_unscale_twice_raises_and_changes_nothing():
    model, opt, scaler = fresh()
    scaler.unscale_(opt)
    grads = grads_of(model)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)"):
        scaler.unscale_(opt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_of(model)))


def test_unscale_after_step_raises():
    model, opt, scaler = fresh()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"after step\(\).*STEPPED.*update\(\)"):
        scaler.unscale_(opt)


def test_step_twice_raises():
    model, opt, scaler = fresh()
    scaler.step(opt)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_calls_before_scale_raise():
    scaler = GradScaler("cpu")
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), lambda: scaler.update()):
        with pytest.raises(RuntimeError, match=r"before scale\(\)"):
            call()


def test_update_without_step_raises():
    _, _, scaler = fresh()
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    assert scaler.get_scale() == 64.0


def test_closure_is_refused():
    _, opt, scaler = fresh()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_fp16_params_are_refused_before_anything_changes():
    model = make_model()
    other = torch.nn.Linear(2, 2).half()
    opt_ok, opt_bad = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    other.weight.grad = torch.ones(2, 2, dtype=torch.float16)
    grads = grads_of(model)
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt_ok, opt_bad)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_of(model)))
    assert scaler._records.get(id(opt_ok)) is None or scaler._records[id(opt_ok)].stage is OptState.READY


def test_scale_rejects_non_tensors():
    with pytest.raises(TypeError, match="Tensor or an iterable"):
        GradScaler("cpu").scale([torch.ones(1), 3.0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "min_scale"),
        ({"init_scale": 1.0, "min_scale": 2.0}, "outside"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradScaler("cpu", **kwargs)


def test_setters_validate():
    scaler = GradScaler("cpu")
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 3.0


# ------------------------------------------------------------------------------------------
# Surface: scale, update(new_scale), disabled, extras
# ------------------------------------------------------------------------------------------


def test_scale_nested_outputs():
    scaler = GradScaler("cpu", init_scale=4.0)
    out = scaler.scale([torch.ones(2), (torch.ones(1), [torch.full((1,), 2.0)])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert out[0].tolist() == [4.0, 4.0] and out[1][1][0].item() == 8.0


def test_update_with_new_scale():
    _, opt, scaler = fresh()
    scaler.step(opt)
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0
    scaler.update(torch.tensor([2.0]))
    assert scaler.get_scale() == 2.0
    for bad, error in ((torch.ones(2), ValueError), (torch.ones(1, requires_grad=True), ValueError), (0.0, ValueError), ("2", TypeError)):
        with pytest.raises(error):
            scaler.update(bad)
    assert scaler.get_scale() == 2.0


NEW_SCALE_REFUSED = [
    (1e9, "max_scale"),
    (0.5, "min_scale"),
    (torch.tensor(1e9), "max_scale"),
    (torch.tensor([0.5]), "min_scale"),
    (torch.tensor(float("inf")), "float32"),
    (torch.tensor(float("nan")), "float32"),
    (torch.tensor(0.0), "float32"),
    (torch.tensor(-4.0), "float32"),
    (torch.tensor(1e-40, dtype=torch.float64), "float32"),
    (torch.tensor(1e39, dtype=torch.float64), "float32"),
    (float("-inf"), "float32"),
]


@pytest.mark.parametrize("bad, match", NEW_SCALE_REFUSED, ids=lambda v: repr(v) if not isinstance(v, str) else None)
def test_update_refuses_a_new_scale_init_scale_would_refuse_and_changes_nothing(bad, match):
    # The same value is refused as init_scale (and by load_state_dict), so update() may not
    # make it the scale either, float or tensor.
    model, opt, scaler = fresh(min_scale=1.0, max_scale=2.0**20)
    scaler.step(opt)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=match):
        scaler.update(new_scale=bad)
    with pytest.raises(ValueError):
        GradScaler("cpu", init_scale=float(bad), min_scale=1.0, max_scale=2.0**20)
    assert scaler.state_dict() == before
    # Nothing of the iteration was lost: it still ends normally.
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0 and scaler.metrics()["steps"] == before["_steps"] + 1


def test_disabled_scaler_passes_through():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.randn(2, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    assert scaler.step(opt) is None  # SGD.step returns None
    scaler.update()
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_cuda_scaler_without_cuda_disables_itself_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = amp.GradScaler()
    assert not scaler.is_enabled()


def test_hysteresis_and_min_scale_with_warning():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, hysteresis=2, min_scale=2.0)
    scales = []
    with pytest.warns(RuntimeWarning, match="min_scale"):
        for _ in range(6):
            opt.zero_grad()
            scaler.scale(model(torch.randn(2, 6)).sum()).backward()
            model[0].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    assert scales == [4.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert scaler.skipped_steps == 6


def test_max_scale_caps_growth():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=16.0)
    for _ in range(4):
        scaler.scale(model(torch.randn(2, 6)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 16.0 and scaler.skipped_steps == 0


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def stepped_scaler(Scaler, **kw):
    scaler = Scaler("cpu", init_scale=64.0, growth_interval=3, **kw)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        scaler.scale(model(torch.randn(2, 6)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def test_state_dict_round_trips_with_torch():
    ours = stepped_scaler(GradScaler)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == {k: ours.state_dict()[k] for k in TORCH_KEYS}
    back = GradScaler("cpu", hysteresis=3)
    back.load_state_dict(stepped_scaler(torch.amp.GradScaler).state_dict())
    sd = back.state_dict()
    assert {k: sd[k] for k in TORCH_KEYS} == stepped_scaler(torch.amp.GradScaler).state_dict()
    assert sd["hysteresis"] == 3 and sd["_hysteresis_tracker"] == 3 and sd["_skipped_steps"] == 0


def test_state_dict_restores_extras_into_a_live_scaler():
    src = stepped_scaler(GradScaler, hysteresis=2, min_scale=1.0)
    dst = stepped_scaler(GradScaler)
    dst.load_state_dict(src.state_dict())
    assert dst.state_dict() == src.state_dict()


CORRUPT = [
    (lambda d: d.pop("scale"), (ValueError, KeyError), "'scale'"),
    (lambda d: d.pop("_growth_tracker"), (ValueError, KeyError), "'_growth_tracker'"),
    (lambda d: d.update(scale="64"), TypeError, "'scale'"),
    (lambda d: d.update(scale=True), TypeError, "'scale'"),
    (lambda d: d.update(scale=-1.0), ValueError, "'scale'"),
    (lambda d: d.update(scale=0.0), ValueError, "'scale'"),
    (lambda d: d.update(scale=float("inf")), ValueError, "'scale'"),
    (lambda d: d.update(scale=float("nan")), ValueError, "'scale'"),
    (lambda d: d.update(growth_factor=0.5), ValueError, "growth_factor"),
    (lambda d: d.update(backoff_factor=1.5), ValueError, "backoff_factor"),
    (lambda d: d.update(growth_interval=0), ValueError, "growth_interval"),
    (lambda d: d.update(growth_interval=2.5), TypeError, "growth_interval"),
    (lambda d: d.update(_growth_tracker=-1), ValueError, "_growth_tracker"),
    (lambda d: d.update(hysteresis=0), ValueError, "hysteresis"),
    (lambda d: d.update(min_scale=8.0, max_scale=4.0), ValueError, "min_scale"),
    (lambda d: d.update(_hysteresis_tracker=9), ValueError, "_hysteresis_tracker"),
    (lambda d: d.update(_skipped_steps="x"), TypeError, "_skipped_steps"),
    (lambda d: d.update(scale=torch.tensor([8.0, 8.0])), TypeError, "'scale'"),
    (lambda d: d.update(_growth_tracker=torch.tensor(1.5)), TypeError, "_growth_tracker"),
    (lambda d: d.update(scale=torch.tensor(-1.0)), ValueError, "'scale'"),
    (lambda d: d.clear(), (ValueError, RuntimeError), "empty"),
]


@pytest.mark.parametrize("corrupt, errors, match", CORRUPT)
def test_corrupt_state_dict_is_refused_and_changes_nothing(corrupt, errors, match):
    scaler = stepped_scaler(GradScaler)
    before = scaler.state_dict()
    bad = copy.deepcopy(before)
    corrupt(bad)
    errors = errors if isinstance(errors, tuple) else (errors,)
    with pytest.raises(errors[0], match=match) as info:
        scaler.load_state_dict(bad)
    assert all(isinstance(info.value, e) for e in errors)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("corrupt", [
    lambda d: d.clear(),
    lambda d: d.pop("scale"),
    lambda d: d.pop("growth_factor"),
    lambda d: d.pop("_growth_tracker"),
    lambda d: d.update(scale=torch.tensor([8.0, 8.0])),
    lambda d: d.update(_growth_tracker=torch.tensor([1, 1])),
    lambda d: d.update(scale="64"),
    lambda d: d.update(scale=None),
], ids=["empty", "no-scale", "no-growth-factor", "no-tracker", "2-elt-scale", "2-elt-tracker", "str-scale", "none-scale"])
def test_a_refused_load_is_caught_by_what_catches_torchs_error(corrupt):
    # Code written for torch's scaler catches its error type; ours must be an instance of it
    # (and stay a ValueError/TypeError, as documented).
    sd = stepped_scaler(torch.amp.GradScaler).state_dict()
    corrupt(sd)
    native = stepped_scaler(torch.amp.GradScaler)  # initialized: fill_ runs, as after a step
    with pytest.raises(Exception) as theirs:
        native.load_state_dict(dict(sd))
    with pytest.raises((ValueError, TypeError)) as ours:
        stepped_scaler(GradScaler).load_state_dict(dict(sd))
    assert isinstance(ours.value, theirs.type), (type(ours.value).__mro__, theirs.type)


@pytest.mark.parametrize("change", [
    {"scale": torch.tensor(1024.0)},
    {"scale": torch.tensor(1024.0, dtype=torch.float64), "_growth_tracker": torch.tensor(3, dtype=torch.int32)},
    {"_growth_tracker": torch.tensor(3)},
    {"growth_interval": 3.0},
], ids=["tensor-scale", "tensor-scale-and-tracker", "tensor-tracker", "float-interval"])
def test_load_state_dict_takes_what_torchs_scaler_takes(change):
    # torch's scaler loads these (0-d tensors through fill_; an integral float interval,
    # which then breaks its update()); ours loads them as the numbers they hold.
    sd = dict(stepped_scaler(torch.amp.GradScaler).state_dict(), **change)
    native = torch.amp.GradScaler("cpu")
    native.load_state_dict(dict(sd))
    ours = GradScaler("cpu")
    ours.load_state_dict(dict(sd))
    assert ours.get_scale() == native.get_scale()
    assert ours.get_growth_interval() == int(sd["growth_interval"])
    assert ours.state_dict()["_growth_tracker"] == int(sd["_growth_tracker"])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours.scale(model(torch.randn(2, 6)).sum()).backward()
    ours.step(opt)
    ours.update()  # and it trains on


def test_pickle_between_iterations():
    scaler = stepped_scaler(GradScaler, hysteresis=2)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    _, opt, live = fresh()
    live.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled only between iterations"):
        pickle.dumps(live)


def test_unknown_optimizer_type_is_a_type_error():
    _, _, scaler = fresh()
    with pytest.raises(TypeError, match="Optimizer"):
        scaler.step(object())


def test_no_warnings_in_a_clean_run():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped_scaler(GradScaler)


# ------------------------------------------------------------------------------------------
# Cases found by probing: each failed (silently or by corrupting state) before its fix
# ------------------------------------------------------------------------------------------

complex_parts = st.one_of(
    st.floats(width=32, min_value=-1e6, max_value=1e6), st.sampled_from([float("inf"), float("-inf"), float("nan")])
)


@settings(max_examples=40)
@given(
    dtype=st.sampled_from([torch.complex64, torch.complex128]),
    values=st.lists(st.tuples(complex_parts, complex_parts), min_size=1, max_size=6),
    log2_scale=st.integers(-4, 20),
    backend=st.sampled_from(["torch", "triton"]),
)
def test_complex_gradients_unscale_both_parts_and_skip_on_inf_in_either(dtype, values, log2_scale, backend):
    scale = 2.0**log2_scale
    grad = torch.tensor([complex(re, im) for re, im in values], dtype=dtype)
    param = torch.nn.Parameter(torch.zeros_like(grad))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=scale, backend=backend)
    scaler.scale(torch.ones(()))
    param.grad = grad * scale
    scaler.unscale_(opt)
    finite = bool(torch.isfinite(torch.view_as_real(grad)).all())
    if finite:
        # Both parts divided by the scale (a power of two: exact).
        assert torch.equal(param.grad, grad)
    before = param.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert (scaler.skipped_steps == 1) != finite
    after = param.detach()
    if finite:
        assert torch.equal(after, before - grad)
    else:
        assert torch.equal(torch.view_as_real(after), torch.view_as_real(before))


def test_complex_parameter_trains_like_its_real_and_imaginary_halves():
    """The case that lost the imaginary part: [-1+0j, -3+0j] where the answer is [-1+4j, -3-6j]."""
    param = torch.nn.Parameter(torch.tensor([1 + 1j, 1 - 1j], dtype=torch.complex64))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=4.0)
    loss = (param * torch.tensor([2 + 3j, 4 - 5j])).real.sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.tensor([-1 + 4j, -3 - 6j], dtype=torch.complex64))
    # The read-only check of fused optimizers sees both parts too.
    param.grad = torch.tensor([1 + float("inf") * 1j, 0j], dtype=torch.complex64)
    scaler.scale(torch.ones(()))
    flags = scaler._check_inf_per_device(opt)
    assert sum(f.item() for f in flags.values()) > 0


@pytest.mark.parametrize("bad", [1e-50, 1e-40, 1e39, float("inf"), float("nan"), 0.0, -1.0])
def test_load_state_dict_refuses_a_scale_float32_cannot_hold_and_changes_nothing(bad):
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=2)
    scaler.scale(torch.ones(()))  # initialized: the scale tensor exists
    before = scaler.state_dict()
    sd = dict(before, scale=bad, growth_interval=3)
    with pytest.raises(ValueError, match="scale"):
        scaler.load_state_dict(sd)
    assert scaler.state_dict() == before and scaler.get_growth_interval() == 2
    with pytest.raises(ValueError, match="float32"):
        GradScaler("cpu", init_scale=bad)
    with pytest.raises(ValueError):
        scaler.update(new_scale=bad)


corrupt_values = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.just([1.0]),
)
state_keys = st.sampled_from([
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
    "hysteresis", "min_scale", "max_scale", "_hysteresis_tracker", "_skipped_steps",
])


@settings(max_examples=150)
@given(changes=st.dictionaries(state_keys, corrupt_values, min_size=1, max_size=4), drop=st.lists(state_keys, max_size=2))
def test_a_failed_load_state_dict_leaves_the_scaler_as_it_was(changes, drop):
    scaler = GradScaler("cpu", init_scale=64.0, growth_interval=5, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    scaler.scale(torch.ones(()))
    before = (scaler.state_dict(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(), scaler.hysteresis)
    sd = dict(before[0], **changes)
    for key in drop:
        sd.pop(key, None)
    try:
        scaler.load_state_dict(sd)
    except (ValueError, TypeError):
        after = (scaler.state_dict(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(), scaler.hysteresis)
        assert after == before
        return
    # Accepted: what was loaded is what the scaler now reports, and it still works.
    assert _usable_float32(scaler.get_scale())
    scaler.update(new_scale=4.0)


def _usable_float32(x):
    import math

    return math.isfinite(x) and x >= torch.finfo(torch.float32).tiny


def test_scale_of_a_meta_tensor_says_what_is_wrong():
    with pytest.raises(ValueError, match="meta device"):
        GradScaler("cpu").scale(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match="meta device"):
        GradScaler("cpu").scale([torch.ones(1), (torch.ones(2, device="meta"),)])


def test_state_dicts_cross_load_with_torch_without_warnings():
    ours = GradScaler("cpu", init_scale=16.0, hysteresis=3, min_scale=1.0)
    ours.scale(torch.ones(()))
    theirs = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 16.0
    theirs_sd = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7).state_dict()
    back = GradScaler("cpu", hysteresis=3)
    back.load_state_dict(theirs_sd)
    assert back.get_scale() == 32.0 and back.get_growth_interval() == 7 and back.hysteresis == 3


def test_endless_overflow_never_drives_the_scale_to_zero():
    """torch's scaler reaches 0 after ~150 overflows in a row and the next clean step writes
    nan into the weights; ours stops at the smallest normal float32."""
    results = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("ours", GradScaler)):
        param = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([param], lr=0.1)
        scaler = cls("cpu", **({} if name == "torch" else {"warn_consecutive_skips": None}))
        for _ in range(200):
            opt.zero_grad()
            scaler.scale((param * float("inf")).sum()).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
        results[name] = (scaler.get_scale(), param.detach().clone())
    assert results["torch"][0] == 0.0 and torch.isnan(results["torch"][1]).all()
    assert results["ours"][0] == torch.finfo(torch.float32).tiny
    assert torch.equal(results["ours"][1], torch.full((2,), 0.9))


def test_an_optimizer_without_gradients_does_not_wedge_the_scaler():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)  # no gradients yet
    with pytest.raises(RuntimeError, match="none of its parameters has a gradient"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="per-optimizer state was reset"):
        scaler.update()
    # The next iteration runs normally.
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0 and not torch.equal(model.weight, before)


# ------------------------------------------------------------------------------------------
# torch.amp.GradScaler's private members, read by code written for torch's scaler
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "ours"])
def test_private_members_behave_as_torchs(cls):
    scaler = cls("cpu", init_scale=8.0)
    assert scaler._scale is None and scaler._growth_tracker is None
    assert scaler._enabled and scaler._device == "cpu" and scaler._init_scale == 8.0
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._scale.dtype == torch.float32 and scaler._scale.shape == () and scaler._scale.item() == 8.0
    assert scaler._growth_tracker.dtype == torch.int32 and scaler._growth_tracker.item() == 0
    assert torch.equal(scaler._get_scale_async(), scaler._scale)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = torch.amp.grad_scaler.OptState
    assert scaler._per_optimizer_states[id(opt)]["stage"] is stage.READY
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is stage.UNSCALED
    found = scaler._found_inf_per_device(opt)
    assert [f.item() for f in found.values()] == [0.0]
    model.weight.grad[0, 0] = float("inf")
    assert sum(f.item() for f in scaler._check_inf_per_device(opt).values()) == 1.0


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "ours"])
def test_unscale_grads_takes_allow_fp16_positionally(cls):
    """torch's _unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16): with True,
    fp16 gradients are unscaled; with False, refused."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = cls("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker("cpu")
    param.grad = torch.full((4,), 8.0, dtype=torch.float16)
    found = torch.zeros(())
    scaler._unscale_grads_(opt, torch.tensor(0.25), found, True)
    assert torch.equal(param.grad, torch.full((4,), 2.0, dtype=torch.float16)) and found.item() == 0.0
    with pytest.raises(ValueError, match="FP16"):
        scaler._unscale_grads_(opt, torch.tensor(0.25), found, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_gradients_as_torch(dtype):
    results = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        param = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = cls("cpu", init_scale=2.0)
        scaler._lazy_init_scale_growth_tracker("cpu")
        # Duplicate indices: fp16 values that overflow only once summed (65504 + 65504).
        idx = torch.tensor([[1, 1, 3]])
        vals = torch.tensor([2.0, 6e4 if dtype is torch.float16 else 6.0, 4.0], dtype=dtype)
        param.grad = torch.sparse_coo_tensor(idx, vals, (4,))
        found = torch.zeros(())
        scaler._unscale_grads_(opt, torch.tensor(0.5), found, True)
        results[cls] = (found.item(), param.grad.coalesce().values().clone())
    assert results[GradScaler][0] == results[torch.amp.GradScaler][0]
    assert torch.equal(results[GradScaler][1], results[torch.amp.GradScaler][1])


def test_no_overflow_at_huge_scales_and_nested_iterables_as_torch():
    outs = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler = cls("cpu", init_scale=2.0**60)
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(model.weight, 1e-20)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        scaled = scaler.scale([torch.ones(2), (torch.ones(1), [torch.full((2,), 3.0)])])
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        outs[cls] = (scaled[1][1][0], scaler.get_scale(), model.bias.detach().clone())
    assert torch.equal(outs[GradScaler][0], outs[torch.amp.GradScaler][0])
    assert outs[GradScaler][1:2] == outs[torch.amp.GradScaler][1:2]
    assert torch.equal(outs[GradScaler][2], outs[torch.amp.GradScaler][2])


# ------------------------------------------------------------------------------------------
# metrics(): the numbers a training log shows, right after any history
# ------------------------------------------------------------------------------------------

METRIC_OPTIMIZERS = {
    "sgd": lambda ps: [torch.optim.SGD(ps, lr=0.05)],
    "fused_adamw": lambda ps: [torch.optim.AdamW(ps, lr=0.01, fused=True)],
    # One optimizer of each kind: the host reads the first's flag, the second skips on the device.
    "sgd+fused_adamw": lambda ps: [torch.optim.SGD(ps[:2], lr=0.05), torch.optim.AdamW(ps[2:], lr=0.01, fused=True)],
}


def metrics_step(model, opts, scaler, poison, gen, pre_unscale=False):
    """One iteration; the gradients of the parameters numbered in ``poison`` get an inf and a nan."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    params = list(model.parameters())
    for k in poison:
        params[k].grad.view(-1)[0] = float("inf")
        params[k].grad.view(-1)[-1] = float("nan")
    if pre_unscale:
        for opt in opts:
            scaler.unscale_(opt)
    for opt in opts:
        scaler.step(opt)
    scaler.update()


def expected_metrics(schedule, scale):
    return {"loss_scale": scale, "skipped_steps": sum(1 for p in schedule if p), "steps": len(schedule),
            "last_step_skipped": int(bool(schedule[-1])), "overflow_params": len(schedule[-1])}


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(METRIC_OPTIMIZERS)),
    schedule=st.lists(st.sets(st.integers(0, 3)), min_size=1, max_size=6),
    history_size=st.sampled_from([0, 1, 10_000]),
    pre_unscale=st.booleans(),
    backend=st.sampled_from(OUR_BACKENDS),
)
def test_metrics_report_each_step_truly_whatever_the_optimizer_and_history(kind, schedule, history_size, pre_unscale, backend):
    # The oracle for the scale and the skips is torch's scaler on the same run; the count of
    # overflowing gradients is the number poisoned (fused optimizers included).
    gen = {cls: torch.Generator().manual_seed(0) for cls in (GradScaler, torch.amp.GradScaler)}
    model, native_model = make_model(), make_model()
    opts, native_opts = METRIC_OPTIMIZERS[kind](list(model.parameters())), METRIC_OPTIMIZERS[kind](list(native_model.parameters()))
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, history_size=history_size, backend=backend)
    native = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for k, poison in enumerate(schedule):
        metrics_step(model, opts, scaler, poison, gen[GradScaler], pre_unscale)
        metrics_step(native_model, native_opts, native, poison, gen[torch.amp.GradScaler], pre_unscale)
        assert scaler.metrics() == expected_metrics(schedule[: k + 1], native.get_scale())


def test_metrics_are_one_host_read_and_a_clean_fused_step_counts_nothing(sync_counter):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.isinf, torch.ops.aten.isnan, torch.ops.aten.isfinite, torch.ops.aten.aminmax):
                self.count += 1
            return func(*args, **(kwargs or {}))

    model = make_model()
    opts = METRIC_OPTIMIZERS["fused_adamw"](list(model.parameters()))
    scaler, gen = GradScaler("cpu"), torch.Generator().manual_seed(0)
    with sync_counter() as syncs, Counts() as passes:
        metrics_step(model, opts, scaler, set(), gen)
    assert syncs.count == 0 and passes.count == 0, "a clean fused step: no sync, no counting pass"
    metrics_step(model, opts, scaler, {1, 2}, gen)
    with sync_counter() as syncs:
        assert scaler.metrics()["overflow_params"] == 2
    assert syncs.count == 1


@pytest.mark.parametrize("kind", sorted(METRIC_OPTIMIZERS))
def test_metrics_after_load_state_dict_into_a_fresh_scaler_keep_steps_with_skipped_steps(kind):
    model = make_model()
    opts = METRIC_OPTIMIZERS[kind](list(model.parameters()))
    src, gen = GradScaler("cpu", init_scale=2.0**10), torch.Generator().manual_seed(0)
    for poison in ({0}, set(), {3}, set(), set()):
        metrics_step(model, opts, src, poison, gen)
    dst = GradScaler("cpu")
    dst.load_state_dict(src.state_dict())
    m = dst.metrics()
    assert (m["steps"], m["skipped_steps"], m["loss_scale"]) == (5, 2, src.get_scale())
    # A live scaler that loads the state counts on from it too, history included.
    live = GradScaler("cpu", history_size=4)
    metrics_step(model, opts, live, set(), gen)
    live.load_state_dict(src.state_dict())
    metrics_step(model, opts, live, {2}, gen)
    assert live.metrics() == {"loss_scale": live.get_scale(), "skipped_steps": 3, "steps": 6,
                              "last_step_skipped": 1, "overflow_params": 1}
    assert [(s, skipped) for s, _, skipped in live.scale_history()] == [(5, True)]
    # torch's state dict has neither count: both start at 0.
    from_torch = GradScaler("cpu")
    from_torch.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert (from_torch.metrics()["steps"], from_torch.metrics()["skipped_steps"]) == (0, 0)


def test_a_state_dict_with_more_skipped_steps_than_steps_is_refused_and_changes_nothing():
    scaler = stepped_scaler(GradScaler)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="_skipped_steps"):
        scaler.load_state_dict(dict(before, _steps=1, _skipped_steps=2))
    assert scaler.state_dict() == before


@pytest.mark.parametrize("kind", sorted(METRIC_OPTIMIZERS))
@pytest.mark.parametrize("copier", [lambda s: pickle.loads(pickle.dumps(s)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_metrics_survive_pickling_right_after_a_skip(kind, copier):
    model = make_model()
    opts = METRIC_OPTIMIZERS[kind](list(model.parameters()))
    scaler, gen = GradScaler("cpu", init_scale=2.0**10), torch.Generator().manual_seed(0)
    for poison in (set(), {0, 3}):
        metrics_step(model, opts, scaler, poison, gen)
    want = scaler.metrics()
    assert want["last_step_skipped"] == 1 and want["overflow_params"] == 2
    assert copier(scaler).metrics() == want


def test_metrics_with_no_history_and_a_fused_optimizer_see_the_skip():
    model = make_model()
    opts = METRIC_OPTIMIZERS["fused_adamw"](list(model.parameters()))
    scaler, gen = GradScaler("cpu", history_size=0), torch.Generator().manual_seed(0)
    metrics_step(model, opts, scaler, {0}, gen)
    m = scaler.metrics()
    assert (m["last_step_skipped"], m["skipped_steps"], m["overflow_params"]) == (1, 1, 1)


# ------------------------------------------------------------------------------------------
# init_scale as a 0-d tensor, as torch's scaler takes it
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", [torch.tensor(1024.0), torch.tensor(1024), torch.tensor(1024.0, dtype=torch.float64)],
                         ids=["float32", "int64", "float64"])
def test_init_scale_takes_a_0d_tensor_as_torchs_scaler_does(init):
    ours, native = GradScaler("cpu", init_scale=init), torch.amp.GradScaler("cpu", init_scale=init)
    # Before the first scale() torch hands back the tensor itself; ours the number it holds.
    assert ours.get_scale() == 1024.0 and isinstance(ours.get_scale(), float) and native.get_scale() == 1024.0
    assert ours.state_dict()["scale"] == 1024.0 and isinstance(ours.state_dict()["scale"], float)
    for scaler in (ours, native):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.randn(2, 6)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert ours.scale_tensor().dtype == native._scale.dtype == torch.float32
    assert ours.get_scale() == native.get_scale() and ours.state_dict()["scale"] == native.state_dict()["scale"]


@pytest.mark.parametrize("init, error", [
    (torch.tensor([1024.0]), TypeError), (torch.tensor(True), TypeError), (torch.tensor(0.0), ValueError),
    (torch.tensor(float("inf")), ValueError), (torch.tensor(1 + 1j), TypeError),
], ids=["1-d", "bool", "zero", "inf", "complex"])
def test_init_scale_tensors_that_hold_no_usable_scale_are_refused_up_front(init, error):
    with pytest.raises(error, match="init_scale"):
        GradScaler("cpu", init_scale=init)
