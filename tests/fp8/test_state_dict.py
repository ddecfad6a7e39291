"""DelayedScaling's state dict: strict by default, checked whole before anything changes."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import dispatch_amp as amp
from dispatch_amp import fp8

X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _trained(steps=2):
    model = _model()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    for step in range(steps):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            model(X * (step + 1)).float().pow(2).mean().backward()
    return model, recipe


def _snapshot(recipe):
    return copy.deepcopy(recipe.state_dict())


def _assert_same_state(a, b):
    assert a.keys() == b.keys() and a["sites"].keys() == b["sites"].keys()
    for name in a["sites"]:
        for key, value in a["sites"][name].items():
            assert torch.equal(value, b["sites"][name][key]), (name, key)


def test_another_models_state_is_refused_by_default_and_nothing_changes():
    _, recipe = _trained()
    other = nn.Sequential()
    other.add_module("enc", nn.Linear(32, 32))
    other.add_module("dec", nn.Linear(32, 32))
    foreign = fp8.DelayedScaling(amax_history_len=4).bind(other).state_dict()
    before = _snapshot(recipe)
    with pytest.raises(ValueError, match=r"not in this recipe: \['dec', 'enc'\].*not in the checkpoint: \['0', '2'\]"):
        recipe.load_state_dict(foreign)
    _assert_same_state(before, recipe.state_dict())
    assert sorted(recipe.state_dict()["sites"]) == ["0", "2"]


def test_strict_false_loads_the_matching_sites():
    _, recipe = _trained()
    state = _snapshot(recipe)
    state["sites"]["0"]["input_scale"] = torch.tensor(8.0)
    state["sites"]["extra"] = copy.deepcopy(state["sites"]["2"])
    recipe.load_state_dict(state, strict=False)
    assert recipe.state_dict()["sites"]["0"]["input_scale"].item() == 8.0
    assert "extra" in recipe.state_dict()["sites"]  # kept for a weight of that name


@pytest.mark.parametrize("bad, match", [
    ({"amax_history_len": 4, "sites": None}, r"state_dict\['sites'\] must map site names"),
    ({"amax_history_len": 4}, "keys 'amax_history_len' and 'sites'"),
    ({"amax_history_len": 8, "sites": {}}, r"DelayedScaling\(amax_history_len=8\)"),
    ([], "takes what state_dict"),
], ids=["sites-None", "no-sites", "other-length", "not-a-dict"])
def test_malformed_states_are_refused_with_the_fix(bad, match):
    _, recipe = _trained()
    before = _snapshot(recipe)
    with pytest.raises((ValueError, TypeError), match=match):
        recipe.load_state_dict(bad)
    _assert_same_state(before, recipe.state_dict())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_scale_that_would_poison_the_next_forward_is_refused(value):
    _, recipe = _trained()
    before = _snapshot(recipe)
    bad = _snapshot(recipe)
    bad["sites"]["2"]["weight_scale"] = torch.tensor(value)
    with pytest.raises(ValueError, match="site '2', role 'weight'.*positive and finite"):
        recipe.load_state_dict(bad)
    _assert_same_state(before, recipe.state_dict())


def test_one_bad_entry_among_good_ones_changes_nothing():
    _, recipe = _trained()
    good = _snapshot(recipe)
    bad = copy.deepcopy(good)
    for entries in bad["sites"].values():
        entries["input_scale"] = torch.tensor(3.0)
    bad["sites"]["2"]["grad_output_history"] = -torch.ones(4)
    with pytest.raises(ValueError, match="negative"):
        recipe.load_state_dict(bad)
    _assert_same_state(good, recipe.state_dict())


def test_a_fresh_unbound_recipe_resumes_bit_identically():
    # patch_torch users: no bind anywhere; the state waits for the weights' names.
    model, recipe = _trained()
    checkpoint = copy.deepcopy({"model": model.state_dict(), "fp8": recipe.state_dict()})
    fresh = _model(seed=5)
    fresh.load_state_dict(checkpoint["model"])
    resumed = fp8.DelayedScaling(amax_history_len=4)
    resumed.load_state_dict(checkpoint["fp8"])
    for r, m in ((recipe, model), (resumed, fresh)):
        m.zero_grad()
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=r):
            m(X * 7).float().pow(2).mean().backward()
    assert torch.equal(model[0].weight.grad, fresh[0].weight.grad)
    _assert_same_state(recipe.state_dict(), resumed.state_dict())


def test_older_checkpoints_without_the_initialized_flag_or_the_configuration_load():
    _, recipe = _trained()
    state = _snapshot(recipe)
    for key in ("forward_format", "grad_format", "margin", "amax_compute_algo", "power_of_two"):
        del state[key]
    for entries in state["sites"].values():
        for role in ("input", "weight", "grad_output"):
            del entries[f"{role}_initialized"]
    fresh = fp8.DelayedScaling(amax_history_len=4).bind(_model())
    fresh.load_state_dict(state)
    _assert_same_state(recipe.state_dict(), fresh.state_dict())
    assert fresh.state_dict()["grad_format"] == "float8_e5m2"


# -- resuming in the middle of an accumulation window ------------------------------------------
class Conv1D(nn.Module):
    """transformers' Conv1D: ``addmm(b, x, w)`` on an ``(in, out)`` weight, which the fp8
    path quantizes as its transpose."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def _conv1d_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Conv1D(32, 64), nn.GELU(), Conv1D(64, 32))


def _accumulating_run(scope, make_model, resume_at=None, micro_batches=3, steps=3):
    """``steps`` optimizer steps of ``micro_batches`` micro-batches each, inside ``scope``;
    at micro-batch number ``resume_at`` everything is saved and loaded into a fresh model,
    recipe and optimizer (a new process), and the run goes on there."""

    def fresh(seed):
        model = make_model(seed)
        # The newest amax sets the scale: a weight changed by the step gets a new scale
        # after its first call of the window, which the window's later calls then differ by.
        recipe = fp8.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent").bind(model)
        return model, recipe, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, recipe, opt = fresh(0)
    open_scope = scope()
    open_scope.__enter__()
    k = 0
    for step in range(steps):
        for micro in range(micro_batches):
            if k == resume_at:
                saved = copy.deepcopy({"model": model.state_dict(), "grads": [p.grad for p in model.parameters()],
                                       "optimizer": opt.state_dict(), "fp8": recipe.state_dict()})
                open_scope.__exit__(None, None, None)
                model, recipe, opt = fresh(5)
                model.load_state_dict(saved["model"])
                for p, g in zip(model.parameters(), saved["grads"]):
                    p.grad = g
                opt.load_state_dict(saved["optimizer"])
                recipe.load_state_dict(saved["fp8"])
                open_scope = scope()
                open_scope.__enter__()
            x = X * (1 + (3 * step + micro) % 5)
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                model(x).float().pow(2).mean().backward()
            k += 1
        opt.step()
        opt.zero_grad()
    open_scope.__exit__(None, None, None)
    return [p.detach().clone() for p in model.parameters()], recipe.state_dict()


@pytest.mark.parametrize("make_model", [_model, _conv1d_model], ids=["linear", "conv1d"])
@pytest.mark.parametrize("scope", [contextlib.nullcontext, amp.cast_cache], ids=["default", "cast_cache"])
@pytest.mark.parametrize("resume_at", [4, 5])  # the second and third of three micro-batches
def test_a_resume_in_the_middle_of_an_accumulation_window_is_bit_identical(scope, resume_at, make_model):
    want, want_state = _accumulating_run(scope, make_model)
    got, got_state = _accumulating_run(scope, make_model, resume_at)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    _assert_same_state(got_state, want_state)


# -- what a checkpoint's state was made under ---------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("grad_format", torch.float8_e4m3fn), ("forward_format", torch.float8_e5m2), ("margin", 1),
    ("amax_compute_algo", "most_recent"), ("power_of_two", True),
], ids=lambda v: str(v))
def test_a_checkpoint_made_under_another_configuration_is_refused_naming_the_field(field, value):
    _, recipe = _trained()
    checkpoint = _snapshot(recipe)
    other_model = _model()
    other = fp8.DelayedScaling(amax_history_len=4, **{field: value}).bind(other_model)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=other):
        other_model(X).float().pow(2).mean().backward()
    before = _snapshot(other)
    with pytest.raises(ValueError, match=rf"the checkpoint's {field} is .*DelayedScaling\({field}="):
        other.load_state_dict(checkpoint)
    _assert_same_state(before, other.state_dict())


def test_a_checkpoint_mapped_to_the_meta_device_names_the_entry_and_the_fix():
    _, recipe = _trained()
    before = _snapshot(recipe)
    meta = _snapshot(recipe)
    meta["sites"] = {name: {k: v.to("meta") for k, v in e.items()} for name, e in meta["sites"].items()}
    with pytest.raises(ValueError, match=r"site '0', role 'input': 'input_history' is a meta tensor.*"
                                         r"map_location='cpu'"):
        recipe.load_state_dict(meta)
    _assert_same_state(before, recipe.state_dict())
