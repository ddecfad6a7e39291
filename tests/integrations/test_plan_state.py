"""A bound precision plan in a checkpoint: filed with its fp8 recipes' states, and a resume
runs the filed plan (the same plan: its recipes resume; another or none: the filed one is
bound in its place, with a warning), bit-identically to a run that never stopped."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.autocast.plan import bound_plan
from dispatch_amp.integrations import _plan_state

BF16 = torch.bfloat16


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _plan() -> amp.PrecisionPlan:
    # A stateful recipe in the middle (its amax histories are state a resume needs) and the
    # last linear in float32.
    return amp.PrecisionPlan({"0": amp.fp8.DelayedScaling(amax_history_len=4), "2": torch.float32})


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def _steps(model, opt, n):
    x, y = _data()
    losses = []
    for _ in range(n):
        with amp.autocast("cpu", dtype=BF16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _checkpoint(model, opt):
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}
    _plan_state.save_into(ckpt, model)
    # Through torch.save / torch.load(weights_only=True), as the frameworks store it.
    return _roundtrip(ckpt)


def _roundtrip(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(ckpt, plan=None):
    model = _model()
    if plan is not None:
        plan.bind(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return model, opt


@pytest.fixture(scope="module")
def straight_and_head():
    model = _model()
    _plan().bind(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    straight = _steps(model, opt, 5)
    model = _model()
    _plan().bind(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, 2)
    return straight, _checkpoint(model, opt)


def test_the_entry_holds_the_plan_as_data_and_its_recipes_states(straight_and_head):
    _, ckpt = straight_and_head
    filed = ckpt[_plan_state.CHECKPOINT_KEY]
    assert amp.config.load_state_dict(filed["plan"]).to_dict()["modules"]["2"] == "float32"
    (state,) = filed["fp8"]
    assert state["sites"]["0"]["weight_history"].shape[0] >= 4, "delayed scaling's history is filed"
    assert _plan_state.entry(torch.nn.Linear(2, 2)) is None, "no plan bound: no entry"


def test_the_same_plan_bound_resumes_its_recipes_bit_identically(straight_and_head):
    straight, ckpt = straight_and_head
    plan = _plan()
    model, opt = _resume(ckpt, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plan_state.load_from(ckpt, model) is plan
    assert bound_plan(model) is plan
    assert torch.equal(torch.stack(_steps(model, opt, 3)), torch.stack(straight[2:]))


@pytest.mark.parametrize("bound", ["none", "another"])
def test_another_plan_or_none_gives_way_to_the_filed_one_with_a_warning(straight_and_head, bound):
    straight, ckpt = straight_and_head
    other = amp.PrecisionPlan({"0": torch.float32}) if bound == "another" else None
    model, opt = _resume(ckpt, other)
    match = "no plan is bound" if bound == "none" else r"pattern '0'.*pattern '2'"
    with pytest.warns(amp.AmpNumericsWarning, match=match + r".*resumes with the checkpoint's"):
        plan = _plan_state.load_from(ckpt, model)
    assert bound_plan(model) is plan and plan is not other
    if other is not None:
        assert other.model is None, "the plan bound before is unbound"
    assert torch.equal(torch.stack(_steps(model, opt, 3)), torch.stack(straight[2:]))


def test_a_filed_plan_that_does_not_fit_the_model_fails_and_changes_nothing(straight_and_head):
    _, ckpt = straight_and_head
    other = amp.PrecisionPlan({"0": torch.float32})
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))   # no module "2"
    other.bind(model)
    with pytest.raises(ValueError, match="'2'"):
        _plan_state.load_from(ckpt, model)
    assert bound_plan(model) is other


@pytest.mark.parametrize("damage", ["not a dict", "states missing", "a state too many"])
def test_a_damaged_entry_fails_and_changes_nothing(straight_and_head, damage):
    _, ckpt = straight_and_head
    filed = copy.deepcopy(ckpt[_plan_state.CHECKPOINT_KEY])
    if damage == "not a dict":
        filed = [filed]
    elif damage == "states missing":
        del filed["fp8"]
    else:
        filed["fp8"].append({})
    other = amp.PrecisionPlan({"0": torch.float32})
    model = _model()
    other.bind(model)
    with pytest.raises(ValueError, match=_plan_state.CHECKPOINT_KEY):
        _plan_state.load_from({_plan_state.CHECKPOINT_KEY: filed}, model)
    assert bound_plan(model) is other


def test_a_plan_holding_code_files_its_recipes_states_only():
    recipe = amp.fp8.DelayedScaling(amax_history_len=4, filter_fn=lambda name, x_shape, w_shape: True)
    model = _model()
    plan = amp.PrecisionPlan({"0": recipe}).bind(model)
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    ckpt = _roundtrip({_plan_state.CHECKPOINT_KEY: _plan_state.entry(model)})
    assert ckpt[_plan_state.CHECKPOINT_KEY]["plan"] is None
    again = amp.fp8.DelayedScaling(amax_history_len=4, filter_fn=lambda name, x_shape, w_shape: True)
    resumed = _model()
    plan2 = amp.PrecisionPlan({"0": again}).bind(resumed)
    assert _plan_state.load_from(ckpt, resumed) is plan2
    a, b = recipe.state_dict()["sites"], again.state_dict()["sites"]
    assert a.keys() == b.keys() and all(torch.equal(a[s][k], b[s][k]) for s in a for k in a[s])
    assert plan.model is model


def test_bound_plan_ignores_copies_and_pickles_drop_the_reference():
    model = _model()
    plan = _plan().bind(model)
    assert bound_plan(model) is plan
    assert bound_plan(model[0]) is None, "a plan bound to the parent does not describe a child"
    assert bound_plan(copy.deepcopy(model)) is None, "a copy is bound by no plan that can unbind it"
    assert bound_plan(pickle.loads(pickle.dumps(model))) is None
    ref = _plan_state.ModelRef(model)
    assert ref() is model and copy.deepcopy(ref)() is None and pickle.loads(pickle.dumps(ref))() is None


def test_a_module_state_dict_carries_the_plan_for_fabric(straight_and_head):
    straight, _ = straight_and_head
    model = _model()
    _plan_state.carry_in_state_dict(model)
    assert _plan_state.CHECKPOINT_KEY not in model.state_dict(), "no plan bound: the state dict is the model's"
    _plan().bind(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, 2)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert _plan_state.CHECKPOINT_KEY in saved["model"]
    resumed = _model()
    _plan_state.carry_in_state_dict(resumed)
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    with pytest.warns(amp.AmpNumericsWarning, match="no plan is bound"):
        resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert bound_plan(resumed) is not None
    assert torch.equal(torch.stack(_steps(resumed, opt, 3)), torch.stack(straight[2:]))
