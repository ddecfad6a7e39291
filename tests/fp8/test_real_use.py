"""fp8 recipes in the setups users meet: evaluation first, gradient penalties, activation
checkpointing with evaluations and dropped losses, other default dtypes, spawned processes."""

import contextlib
import copy
import pathlib

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

import dispatch_amp as amp
from dispatch_amp import fp8

RECIPES = {"current": fp8.CurrentScaling, "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
           "rowwise": fp8.RowwiseScaling}
X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))


def _region(recipe):
    return amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe)


# -- evaluation before training ----------------------------------------------------------
@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_first_call_under_inference_mode_does_not_break_training(name, bound):
    model = _model()
    recipe = RECIPES[name]()
    if bound:
        recipe.bind(model)
    with torch.inference_mode(), _region(recipe):
        model(X)
    for _ in range(2):
        with _region(recipe):
            model(X).float().pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert recipe.report()[0].calls == 3


# -- double backward -----------------------------------------------------------------------
def _penalized_grads(recipe, weight):
    """Gradients of loss + weight * |d loss / d x|^2 (a gradient penalty)."""
    model = _model()
    x = X.clone().requires_grad_(True)
    with _region(recipe) if recipe is not None else contextlib.nullcontext():
        loss = model(x).float().pow(2).mean()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + weight * g.pow(2).sum()).backward()
    return [p.grad for p in model.parameters()]


E4M3 = torch.float8_e4m3fn
# e4m3 gradients (rowwise's default): half e5m2's rounding, so the comparison with
# float32 below can be tight enough to mean something.
PENALTY_RECIPES = {"current": lambda: fp8.CurrentScaling(grad_format=E4M3),
                   "delayed": lambda: fp8.DelayedScaling(amax_history_len=4, grad_format=E4M3),
                   "rowwise": fp8.RowwiseScaling}


@pytest.mark.parametrize("name", sorted(PENALTY_RECIPES))
def test_a_gradient_penalty_reaches_the_weights(name):
    # The penalty's share of each gradient, in fp8 and in float32; dropped, it would be 0
    # (relative error 1). Measured: 0.03-0.28 (the penalty's gradient goes through the
    # fp8 gemms twice).
    make = PENALTY_RECIPES[name]
    got = [a - b for a, b in zip(_penalized_grads(make(), 100.0), _penalized_grads(make(), 0.0))]
    want = [a - b for a, b in zip(_penalized_grads(None, 100.0), _penalized_grads(None, 0.0))]
    for g, w in zip(got, want):
        assert w.norm() > 1e-3  # the penalty matters
        assert (g - w).norm() <= 0.35 * w.norm()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_backward_of_the_backward_is_the_float32_derivative(oracle, name):
    # y = x @ w.T, loss = sum(y * a): dy = a for any w, so a penalty sum(dx * c) on
    # dx = dy @ w has the weight gradient a.T @ c exactly, whatever fp8 did to dx.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    a, c = torch.randn(16, 16, generator=g), torch.randn(16, 32, generator=g)
    with _region(RECIPES[name]()):
        y = torch.nn.functional.linear(x, w)
    (dx,) = torch.autograd.grad((y.float() * a).sum(), x, create_graph=True)
    (dx * c).sum().backward()
    dy = a.bfloat16().float()  # the gradient reached y in y's dtype
    # A float32 gemm of ours against one written here: equal up to their summation orders.
    oracle.assert_within(w.grad, dy.t() @ c, oracle.gemm_bound(dy.t(), c, torch.float32), "w.grad")


def _weight_gradient_penalty(recipe):
    model = _model()
    x = X.clone().requires_grad_(True)
    with _region(recipe):
        loss = model(x).float().pow(2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()
    return x.grad


def test_a_penalty_on_weight_gradients_needs_the_input_and_says_so():
    with pytest.raises(RuntimeError, match="RowwiseScaling"):
        _weight_gradient_penalty(fp8.CurrentScaling())
    assert torch.isfinite(_weight_gradient_penalty(fp8.RowwiseScaling())).all()


# -- checkpointing: evaluations and dropped losses between steps ------------------------------
def _sequence(recipe_name, how, reentrant=False):
    """Train, evaluate under no_grad, train, drop a loss, train: the gradients and the
    recipe's state after each training step."""
    model = _model()
    recipe = RECIPES[recipe_name]().bind(model)

    def forward(x):
        if how == "plain":
            return model(x)
        return amp.checkpoint(model, x, use_reentrant=reentrant)

    out = []
    for step, action in enumerate(["train", "eval", "train", "drop", "train"]):
        x = (X * (step + 1)).requires_grad_(True)
        if action == "eval":
            with torch.no_grad(), _region(recipe):
                forward(x)
            continue
        with _region(recipe):
            y = forward(x)
        if action == "drop":
            del y
            continue
        y.float().pow(2).mean().backward()
        out.append(([p.grad.clone() for p in model.parameters()], copy.deepcopy(recipe.state_dict())))
        model.zero_grad()
    return out


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_evaluations_and_dropped_losses_under_checkpoint_leave_training_as_without(reentrant):
    for (grads_a, state_a), (grads_b, state_b) in zip(_sequence("delayed", "plain"),
                                                      _sequence("delayed", "checkpoint", reentrant)):
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        for name, entries in state_a["sites"].items():
            for key, value in entries.items():
                assert torch.equal(value, state_b["sites"][name][key]), (name, key)


class _TwiceCheckpointed(nn.Module):
    """One block applied twice, each time under its own checkpoint: recomputations come in
    the reverse order of the forwards."""

    def __init__(self, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.checkpointed = checkpointed

    def forward(self, x):
        for _ in range(2):
            x = amp.checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return x


def test_a_site_checkpointed_twice_replays_each_forward_its_own_scales():
    out = []
    for checkpointed in (False, True):
        model = _TwiceCheckpointed(checkpointed)
        recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
        grads = []
        for step in range(3):
            with _region(recipe):
                y = model(X * (step + 1))
            y.float().pow(2).mean().backward()
            grads.append(model.block[0].weight.grad.clone())
        out.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


# -- default dtypes --------------------------------------------------------------------------
@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_any_default_dtype(name, default):
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        model = _model().float()  # the scales must not follow the default dtype
        recipe = RECIPES[name]().bind(model)
        for _ in range(2):
            with _region(recipe):
                model(X).float().pow(2).mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert recipe.report()[0].calls == 2
    finally:
        torch.set_default_dtype(before)


# -- arguments ---------------------------------------------------------------------------------
def test_a_process_group_that_is_not_one_is_refused_up_front():
    with pytest.raises(TypeError, match="process_group must be None .* or a torch.distributed.ProcessGroup"):
        fp8.DelayedScaling(process_group="world")


# -- spawned processes ------------------------------------------------------------------------
_SEEN: list = []  # the names the filter was asked about, in this process


def _skip_second_layer(name, x_shape, w_shape):
    _SEEN.append(name)
    return name != "2"


def _spawned(rank, recipe, out_dir):
    model = _model()
    _SEEN.clear()  # recipes are frozen: the filter itself keeps what it was asked
    with _region(recipe):
        model(X).float().sum().backward()
    torch.save({"seen": list(_SEEN), "state": recipe.state_dict()}, pathlib.Path(out_dir) / "out.pt")


def test_a_bound_trained_recipe_goes_to_a_spawned_process(tmp_path):
    model = _model()
    recipe = fp8.DelayedScaling(amax_history_len=4, filter_fn=_skip_second_layer).bind(model)
    with _region(recipe):
        model(X).float().sum().backward()
    sent = copy.deepcopy(recipe.state_dict())
    mp.start_processes(_spawned, args=(recipe, str(tmp_path)), nprocs=1, start_method="spawn")
    got = torch.load(tmp_path / "out.pt")
    assert got["seen"] == ["0", "2"]
    # The child's one call advanced the history it received: the parent's amaxes behind its own.
    assert torch.equal(got["state"]["sites"]["0"]["weight_history"][1:], sent["sites"]["0"]["weight_history"][:-1])
    assert torch.equal(got["state"]["sites"]["2"]["input_history"], sent["sites"]["2"]["input_history"])
