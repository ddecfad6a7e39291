"""fp8 recipes: scaling edge cases, delayed scaling's history, state, report, arguments."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.fp8 import _rules

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _linear_call(recipe, x, w, b=None, dtype=torch.bfloat16):
    with amp.autocast("cpu", dtype=dtype, fp8=recipe):
        return F.linear(x, w, b)


# -- the rules ------------------------------------------------------------------------------
def test_scale_of_an_all_zero_tensor_is_one_and_the_result_zero():
    z = torch.zeros(16, 32)
    assert _rules.scale_from_amax(_rules.amax(z), E4M3).item() == 1.0
    y = _linear_call(fp8.CurrentScaling(), z, torch.randn(16, 32))
    assert torch.equal(y, torch.zeros(16, 16, dtype=torch.bfloat16))


def test_one_huge_value_saturates_and_is_counted_with_delayed_scaling():
    recipe = fp8.DelayedScaling(amax_history_len=2)
    w = torch.randn(16, 32) / 8
    x = torch.randn(16, 32)
    _linear_call(recipe, x, w)                  # scale 1 -> then 448 / max|x|
    x2 = x.clone()
    x2[3, 5] = 1e4                              # 1e4 * (448 / max|x|) is far beyond 448
    _linear_call(recipe, x2, w)
    report = recipe.report()[0]
    assert report.saturated["input"] == 1 and report.calls == 2
    assert report.amax["input"] == 1e4


def test_current_scaling_never_counts_its_own_rounding_as_saturation():
    recipe = fp8.CurrentScaling()
    w = torch.randn(16, 32)
    for seed in range(20):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 5)
        _linear_call(recipe, x, w)
    assert recipe.report()[0].saturated == {"input": 0, "weight": 0}


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(), fp8.RowwiseScaling()],
                         ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_in_activations_propagate_and_the_scaler_skips(recipe, special):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(16, 32)
    x[2, 7] = special
    with amp.autocast("cpu", dtype=torch.float16, fp8=recipe):
        y = model(x)
    assert not torch.isfinite(y).all()
    scaler.scale(y.float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**7  # the step was skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@given(
    scale=st.floats(1e-6, 1e6),
    values=st.lists(st.one_of(st.floats(-1e6, 1e6), st.sampled_from([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])),
                    min_size=1, max_size=64),
    fmt=st.sampled_from([E4M3, E5M2]),
)
def test_cast_keeps_non_finite_values_non_finite_and_counts_saturation(scale, values, fmt):
    t = torch.tensor(values, dtype=torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    q, saturated = _rules.cast(t, s, fmt)
    finite = torch.isfinite(t)
    assert torch.equal(q.float().isnan(), ~finite)
    assert torch.isfinite(q.float()[finite]).all()
    if finite.any():
        assert q.float()[finite].abs().max().item() <= _rules.fp8_max(fmt)
    y = t * s
    assert saturated.item() == int((finite & (y.abs() > _rules.SATURATES_ABOVE[fmt])).sum())


@given(amax=st.floats(0, 2.0 ** 100, width=32), margin=st.integers(0, 3), pow2=st.booleans())
def test_scale_rules(oracle, amax, margin, pow2):
    a = torch.tensor(amax, dtype=torch.float32)
    s = _rules.scale_from_amax(a, E4M3, margin=margin, power_of_two=pow2)
    assert s.dtype == torch.float32 and torch.isfinite(s)
    assert s.item() == oracle.scale_of(a, E4M3, margin, pow2).item()
    if a.item() == 0:
        assert s.item() == 1.0


@given(amax=st.floats(2.0 ** -100, 2.0 ** 100, width=32), margin=st.integers(0, 3))
def test_a_power_of_two_scale_is_never_above_the_exact_one(amax, margin):
    a = torch.tensor(amax, dtype=torch.float32)
    exact = _rules.scale_from_amax(a, E4M3, margin=margin)
    pow2 = _rules.scale_from_amax(a, E4M3, margin=margin, power_of_two=True)
    assert exact.item() / 2 < pow2.item() <= exact.item()
    assert torch.frexp(pow2)[0].item() == 0.5  # a power of two


def test_a_scale_just_below_a_power_of_two_rounds_down():
    # 448 / a is the float just below 8: exp2(floor(log2(.))) gives 8, above the scale.
    a = torch.tensor(448.0) / torch.tensor(8.0).nextafter(torch.tensor(0.0))
    exact = _rules.scale_from_amax(a, E4M3)
    assert exact.item() < 8.0
    assert _rules.scale_from_amax(a, E4M3, power_of_two=True).item() == 4.0


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(), fp8.RowwiseScaling()],
                         ids=lambda r: type(r).__name__)
def test_a_tiny_amax_gives_a_finite_scale_and_zeros_stay_zero(recipe):
    # An amax below fp8_max / float32's max used to give an inf scale, and 0 * inf = nan.
    x = torch.zeros(16, 32)
    x[0, 0] = 1e-38
    w = torch.randn(16, 32)
    for _ in range(2):
        y = _linear_call(recipe, x, w, dtype=torch.float16)
        assert not y.isnan().any()
        assert torch.equal(y[1:], torch.zeros_like(y[1:]))
    assert torch.isfinite(_rules.scale_from_amax(torch.tensor(1e-38), E4M3))


# -- delayed scaling ------------------------------------------------------------------------
def test_history_wraps_around(oracle):
    recipe = fp8.DelayedScaling(amax_history_len=3)
    site = oracle.DelayedSite(3)
    w = torch.randn(16, 32)
    maxima = [8.0, 1.0, 2.0, 0.5, 0.25, 4.0]
    for m in maxima:
        x = torch.full((16, 32), m)
        _linear_call(recipe, x, w)
        site.use("input", x, E4M3)
        site.use("weight", w, E4M3)
    history, scale = recipe.state.lookup(w).history["input"]
    assert history.tolist() == [4.0, 0.25, 0.5]          # the last three, newest first
    assert scale.item() == site.scale["input"].item() == 448.0 / 4.0
    # The report shows the scale the last call used: 8.0 had left the window before it.
    assert recipe.report()[0].scale["input"] == 448.0 / 2.0


def test_most_recent_and_margin():
    recipe = fp8.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=1)
    w = torch.randn(16, 32)
    for m in (8.0, 2.0):
        _linear_call(recipe, torch.full((16, 32), m), w)
    assert recipe.state.lookup(w).history["input"][1].item() == 448.0 / 2.0 / 2.0


def test_non_finite_amax_keeps_the_scale():
    recipe = fp8.DelayedScaling(amax_history_len=2)
    w = torch.randn(16, 32)
    _linear_call(recipe, torch.full((16, 32), 2.0), w)
    x = torch.full((16, 32), 2.0)
    x[0, 0] = float("nan")
    _linear_call(recipe, x, w)
    assert recipe.state.lookup(w).history["input"][1].item() == 224.0


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def _train(model, recipe, steps, data, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in data[:steps]:
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return opt, losses


def test_state_dict_resume_into_a_fresh_model_is_bit_identical():
    data = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    model = _tiny_model()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    opt, _ = _train(model, recipe, 4, data)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "fp8": recipe.state_dict()})
    _, straight = _train(model, recipe, 8, data[4:], opt)

    fresh = _tiny_model(seed=123)
    fresh.load_state_dict(checkpoint["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(checkpoint["opt"])
    resumed_recipe = fp8.DelayedScaling(amax_history_len=4).bind(fresh)
    resumed_recipe.load_state_dict(checkpoint["fp8"])
    _, resumed = _train(fresh, resumed_recipe, 8, data[4:], fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_state_dict_needs_named_sites():
    recipe = fp8.DelayedScaling()
    w = torch.randn(16, 32)
    _linear_call(recipe, torch.randn(16, 32), w)
    with pytest.raises(RuntimeError, match=r"bind\(model\)"):
        recipe.state_dict()


def test_a_failed_load_changes_nothing():
    model = _tiny_model()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    _train(model, recipe, 2, [torch.randn(16, 32)] * 2)
    good = recipe.state_dict()
    bad = copy.deepcopy(good)
    bad["sites"]["2"]["input_history"] = torch.zeros(5)
    with pytest.raises(ValueError, match="site '2', role 'input'"):
        recipe.load_state_dict(bad)
    with pytest.raises(ValueError, match="amax_history_len"):
        fp8.DelayedScaling(amax_history_len=8).load_state_dict(good)
    after = recipe.state_dict()
    for name in good["sites"]:
        for key in good["sites"][name]:
            assert torch.equal(good["sites"][name][key], after["sites"][name][key])


def test_stateless_recipes_round_trip_an_empty_state():
    for recipe in (fp8.CurrentScaling(), fp8.RowwiseScaling()):
        assert recipe.state_dict() == {}
        recipe.load_state_dict({})
        with pytest.raises(ValueError, match="keeps no state"):
            recipe.load_state_dict({"x": 1})


# -- arguments -----------------------------------------------------------------------------
def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="forward_format must be torch.float8_e4m3fn or torch.float8_e5m2"):
        fp8.CurrentScaling(forward_format=torch.bfloat16)
    with pytest.raises(ValueError, match="amax_history_len must be a positive int"):
        fp8.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        fp8.CurrentScaling(filter_fn=3)
    with pytest.raises(ValueError, match="fp8=dispatch_amp.fp8.CurrentScaling"):
        amp.autocast("cpu", dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8 must be a dispatch_amp.fp8 recipe"):
        amp.autocast("cpu", fp8="current")
    marked = amp.Policy.for_device("cpu").with_ops(fp8=["linear"])
    with pytest.raises(ValueError, match="marks \\['aten::linear'\\] as fp8, but no recipe"):
        amp.autocast("cpu", policy=marked)
    with pytest.raises(ValueError, match="aten::bmm cannot be fp8"):
        amp.Policy.for_device("cpu").with_ops(fp8=["bmm"])


@pytest.mark.parametrize("make, flag", [
    (fp8.CurrentScaling, "power_of_two"), (fp8.DelayedScaling, "power_of_two"), (fp8.DelayedScaling, "reduce_amax"),
    (fp8.RowwiseScaling, "power_of_two"), (fp8.RowwiseScaling, "weight_grad_high_precision"),
], ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("value", ["false", 0, None], ids=repr)
def test_flags_take_bools_only(make, flag, value):
    # bool("false") is True: the flag would silently mean the opposite.
    with pytest.raises(TypeError, match=rf"{flag} must be True or False, got {value!r}"):
        make(**{flag: value})
    assert getattr(make(**{flag: False}), flag) is False


def test_a_history_too_long_to_keep_is_refused_where_it_is_given():
    # 10**9 would allocate 12 GB per site at the first call.
    with pytest.raises(ValueError, match=r"amax_history_len must be at most 4096, got 1000000000: every site"):
        fp8.DelayedScaling(amax_history_len=10**9)
    assert fp8.DelayedScaling(amax_history_len=4096).amax_history_len == 4096


def test_report_table_lists_every_site_and_role():
    model = _tiny_model()
    recipe = fp8.CurrentScaling().bind(model)
    _train(model, recipe, 1, [torch.randn(16, 32)])
    table = recipe.report_table()
    assert table.count("\n") == 1 + 2 * 3  # header rule + 2 sites x 3 roles
    assert "| 0 | input | 1 |" in table and "| 2 | grad_output | 1 |" in table
