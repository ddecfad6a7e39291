"""DelayedScaling's state dict: strict by default, checked whole before anything changes."""

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


def test_older_checkpoints_without_the_initialized_flag_load():
    _, recipe = _trained()
    state = _snapshot(recipe)
    for entries in state["sites"].values():
        for role in ("input", "weight", "grad_output"):
            del entries[f"{role}_initialized"]
    fresh = fp8.DelayedScaling(amax_history_len=4).bind(_model())
    fresh.load_state_dict(state)
    _assert_same_state(recipe.state_dict(), fresh.state_dict())
