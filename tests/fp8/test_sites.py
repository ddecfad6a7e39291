"""Sites follow the weight, names follow the model: bind, first-call names, filter_fn, copies."""

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dispatch_amp as amp
from dispatch_amp import fp8

X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _region(recipe):
    return amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe)


def _train(model, recipe, steps=3, scale=1.0):
    for step in range(steps):
        with _region(recipe):
            model(X * (step + scale)).float().pow(2).mean().backward()


class Tied(nn.Module):
    """A language model's tied embedding and head (GPT-2's wte / lm_head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(32, 32)
        self.lm_head = nn.Linear(32, 32, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.wte(idx))


# -- identity ------------------------------------------------------------------------------
def test_two_models_with_the_same_names_cannot_share_sites():
    student, teacher = _model(0), _model(1)
    recipe = fp8.DelayedScaling().bind(student)
    with pytest.raises(ValueError, match=r"prefix='teacher.'"):
        recipe.bind(teacher)
    assert [s.names for s in recipe.state.sites()] == [["0"], ["2"]]  # nothing changed


def test_with_prefixes_each_model_keeps_its_own_scales(oracle):
    student, teacher = _model(0), _model(1)
    shared = fp8.DelayedScaling(amax_history_len=4).bind(student, prefix="student.").bind(teacher, prefix="teacher.")
    alone = fp8.DelayedScaling(amax_history_len=4).bind(teacher)
    _train(student, shared, scale=10.0)  # large activations: other scales than the teacher's
    for step in range(3):
        with _region(shared):
            got = teacher(X * (step + 1))
        with _region(alone):
            want = teacher(X * (step + 1))
        assert torch.equal(got, want)
    assert sorted(shared.state_dict()["sites"]) == ["student.0", "student.2", "teacher.0", "teacher.2"]


def test_unbound_models_with_the_same_names_keep_separate_state_and_refuse_to_save_it():
    student, teacher = _model(0), _model(1)
    shared, alone = fp8.DelayedScaling(), fp8.DelayedScaling()
    _train(student, shared, scale=10.0)
    with _region(shared):
        got = teacher(X)
    with _region(alone):
        want = teacher(X)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="prefix"):
        shared.state_dict()


# -- names ---------------------------------------------------------------------------------
def test_a_weight_replaced_after_bind_keeps_its_name_and_filter():
    model = _model()
    seen = []
    recipe = fp8.CurrentScaling(filter_fn=lambda name, x, w: seen.append(name) or name != "2").bind(model)
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)  # new Parameter objects
    with _region(recipe):
        y = model(X)
    assert seen == ["0", "2"]
    assert [r.name for r in recipe.report()] == ["0"]
    with _region(recipe):
        hidden = model[1](model[0](X))
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(y, model[2](hidden))  # layer 2 ran in bfloat16


def test_a_replaced_weight_takes_over_the_state_of_its_name():
    model = _model()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    _train(model, recipe)
    before = recipe.state_dict()
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    with _region(recipe), torch.no_grad():
        model(X)
    after = recipe.state_dict()
    assert sorted(after["sites"]) == ["0", "2"]
    # One more call's amax in front of the same history: the state moved to the new weight.
    assert torch.equal(after["sites"]["0"]["input_history"][1:], before["sites"]["0"]["input_history"][:-1])


def test_a_tied_weight_has_all_its_names_and_filter_fn_must_accept_each():
    model = Tied()
    seen = []
    recipe = fp8.CurrentScaling(filter_fn=lambda name, x, w: seen.append(name) or name != "lm_head")
    idx = torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(0))
    with _region(recipe):
        y = model(idx)
    assert seen == ["wte", "lm_head"] and recipe.report() == []
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(y, model(idx))
    assert fp8.CurrentScaling().bind(model).site_names(model.wte.weight) == ("wte", "lm_head")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        return self.attn(h, h, h, need_weights=False)[0]


def test_names_at_the_first_call_match_bind():
    model = Attention()
    unbound, bound = fp8.DelayedScaling(), fp8.DelayedScaling().bind(model)
    for recipe in (unbound, bound):
        with _region(recipe):
            model(X.view(2, 8, 32)).float().sum().backward()
    called = {"inp", "attn.in_proj_weight", "attn.out_proj"}
    assert {r.name for r in unbound.report()} == {r.name for r in bound.report()} == called
    assert set(unbound.state_dict()["sites"]) == called


def test_names_look_through_wrappers():
    model = _model()
    recipe = fp8.CurrentScaling()
    with _region(recipe):
        nn.DataParallel(model)(X)  # on CPU DataParallel calls the module directly
    assert [r.name for r in recipe.report()] == ["0", "2"]


def test_a_weight_no_module_holds_has_no_name():
    recipe = fp8.DelayedScaling()
    w = torch.randn(16, 32)
    with _region(recipe):
        F.linear(torch.randn(16, 32), w)
    assert recipe.site_name(w) is None
    with pytest.raises(RuntimeError, match="no name"):
        recipe.state_dict()


# -- copies --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_trained_recipe_continues_without_bind(how):
    model = _model()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    _train(model, recipe)
    copied = copy.deepcopy(recipe) if how == "deepcopy" else pickle.loads(pickle.dumps(recipe))
    for r in (recipe, copied):
        _train(model, r, steps=1, scale=5.0)
    for name, entries in recipe.state_dict()["sites"].items():
        for key, value in entries.items():
            assert torch.equal(value, copied.state_dict()["sites"][name][key]), (name, key)


def _only_first(name, x_shape, w_shape):
    return name == "0"


def test_a_pickled_recipe_names_a_fresh_model_for_filter_fn():
    recipe = pickle.loads(pickle.dumps(fp8.CurrentScaling(filter_fn=_only_first)))
    with _region(recipe):
        _model()(X)
    assert [r.name for r in recipe.report()] == ["0"]


def test_bind_names_multihead_attentions_projections():
    model = Attention()
    recipe = fp8.DelayedScaling().bind(model)
    assert sorted(recipe.state_dict()["sites"]) == ["attn.in_proj_weight", "attn.out_proj", "inp"]


def _patched_steps(recipe, model, steps):
    # Code that knows nothing of dispatch_amp: torch.autocast, patched.
    losses = []
    with amp.patch_torch(fp8=recipe):
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(X.view(2, 8, 32) * (step + 1)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
    return losses


def test_under_patch_torch_a_recipe_without_bind_saves_and_resumes():
    model = Attention()
    recipe = fp8.DelayedScaling(amax_history_len=4)
    _patched_steps(recipe, model, 2)
    saved = copy.deepcopy(recipe.state_dict())
    assert sorted(saved["sites"]) == ["attn.in_proj_weight", "attn.out_proj", "inp"]
    straight = _patched_steps(recipe, model, 2)
    resumed = fp8.DelayedScaling(amax_history_len=4)
    resumed.load_state_dict(saved)
    again = _patched_steps(resumed, model, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight, again))
