"""fp8 with the rest of the library: checkpointing, accumulation, patch_torch, census, copies."""

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import dispatch_amp as amp
from dispatch_amp import fp8

RECIPES = {"current": fp8.CurrentScaling, "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
           "rowwise": fp8.RowwiseScaling}


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _steps(how, recipe_name, reentrant=False, steps=3):
    """Losses, gradients and fp8 state of `steps` forward/backward passes."""
    model = _model()
    recipe = RECIPES[recipe_name]().bind(model)
    x = X.clone().requires_grad_(True)
    patch = amp.patch_torch(fp8=recipe) if how == "torch-under-patch" else contextlib.nullcontext()
    out = []
    with patch:
        for _ in range(steps):
            region = (torch.autocast("cpu", dtype=torch.bfloat16) if how == "torch-under-patch"
                      else amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe))
            with region:
                if how == "plain":
                    y = model(x)
                elif how == "amp":
                    y = amp.checkpoint(model, x, use_reentrant=reentrant)
                else:
                    y = torch_checkpoint.checkpoint(model, x, use_reentrant=reentrant)
            y.float().pow(2).mean().backward()
            out.append((y.detach(), [p.grad.clone() for p in model.parameters()], x.grad.clone()))
            model.zero_grad()
            x.grad = None
    return out, recipe.state_dict()


def _same(a, b):
    (steps_a, state_a), (steps_b, state_b) = a, b
    for (ya, ga, xa), (yb, gb, xb) in zip(steps_a, steps_b):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
        assert all(torch.equal(p, q) for p, q in zip(ga, gb))
    assert state_a.keys() == state_b.keys()
    for name, entries in state_a.get("sites", {}).items():
        for key, value in entries.items():
            assert torch.equal(value, state_b["sites"][name][key]), (name, key)


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint ran under this patch")
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("how", ["amp", "torch-under-patch"])
def test_checkpoint_recomputes_bit_identically_and_advances_history_once(how, recipe_name, reentrant):
    # The delayed recipe's state after three steps equals the state without checkpointing:
    # a recomputation replays the forward's scales and records nothing.
    _same(_steps("plain", recipe_name), _steps(how, recipe_name, reentrant))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_torch_checkpoint_without_the_patch_is_refused(reentrant):
    model = _model()
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        with pytest.raises(RuntimeError, match="Use dispatch_amp.checkpoint"):
            torch_checkpoint.checkpoint(model, X.clone().requires_grad_(True), use_reentrant=reentrant)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_gradient_accumulation_sums_the_micro_batches(recipe_name):
    chunks = X.chunk(2)
    separate = []
    model = _model()
    recipe = RECIPES[recipe_name]().bind(model)
    for chunk in chunks:
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            model(torch.cat([chunk, chunk])).float().sum().backward()
        separate.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()

    model = _model()
    recipe = RECIPES[recipe_name]().bind(model)
    for chunk in chunks:  # no zero_grad in between: .grad accumulates
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            model(torch.cat([chunk, chunk])).float().sum().backward()
    for p, a, b in zip(model.parameters(), *separate):
        assert torch.equal(p.grad, a + b)


def test_patch_torch_takes_fp8_and_checks_it():
    recipe = fp8.CurrentScaling()
    w = torch.randn(16, 32)
    with amp.patch_torch(fp8=recipe) as patch:
        with torch.autocast("cpu", dtype=torch.bfloat16) as region:
            y = torch.nn.functional.linear(torch.randn(16, 32), w)
        assert region.fp8 is recipe and y.dtype is torch.bfloat16
        assert "fp8=CurrentScaling(" in repr(patch)
    assert [r.calls for r in recipe.report()] == [1]
    with pytest.raises(TypeError, match="fp8 must be a dispatch_amp.fp8 recipe"):
        amp.patch_torch(fp8="e4m3")


def test_census_counts_fp8_flops():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 30))
    with amp.PrecisionCensus() as census:
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
            y = model(torch.randn(16, 32))
        y.float().sum().backward()
    flops = census.flops_by_dtype()
    # forward 16x32x64 in e4m3; its weight gradient in e5m2 (the input needs no grad);
    # the 30-wide layer is not eligible and runs in bfloat16.
    assert flops[torch.float8_e4m3fn] == flops[torch.float8_e5m2] == 2 * 16 * 32 * 64
    assert flops[torch.bfloat16] == 3 * 2 * 16 * 64 * 30
    assert census.fp8_flops_fraction() == pytest.approx(2 * 65536 / (2 * 65536 + 184320))
    assert "in fp8)" in census.summary()


def test_copies_and_pickles_of_the_model_carry_no_fp8_state():
    model = _model()
    recipe = fp8.DelayedScaling().bind(model)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        model(X)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        assert recipe.site_name(other[0].weight) is None
        assert recipe.site_name(model[0].weight) == "0"


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_a_backward_inside_the_region_recomputes_through_the_fp8_path(recipe_name, reentrant):
    # torch recomputes a checkpointed block during the backward with its function-mode
    # stack emptied; amp.checkpoint reopens the region there, so the recomputed linears
    # take the fp8 path as the forward's did (and save the same tensors).
    outside = _steps("amp", recipe_name, reentrant)
    model = _model()
    recipe = RECIPES[recipe_name]().bind(model)
    x = X.clone().requires_grad_(True)
    inside = []
    for _ in range(3):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            y = amp.checkpoint(model, x, use_reentrant=reentrant)
            y.float().pow(2).mean().backward()
        inside.append((y.detach(), [p.grad.clone() for p in model.parameters()], x.grad.clone()))
        model.zero_grad()
        x.grad = None
    _same(outside, (inside, recipe.state_dict()))
