"""A recipe's state object (``fp8/_state.py``) and the frozen recipe around it: named role
fields over the packed buffers, and the two points code that casts a weight itself (an fp8
all-gather) uses: the scale a weight will be cast with now, and a gemm handed an
already-quantized weight, which then gives the bits of the ordinary path."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from dispatch_amp import fp8
from dispatch_amp.fp8._linear import QuantizedWeight, fp8_linear
from dispatch_amp.fp8._rules import amax, cast
from dispatch_amp.kernels.fp8_scale import F_AMAX, F_HISTORY, F_INIT, F_PENDING, F_SCALE, F_SHOWN

RECIPES = {
    "current": lambda: fp8.CurrentScaling(),
    "current_pow2": lambda: fp8.CurrentScaling(power_of_two=True),
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "delayed_margin_recent": lambda: fp8.DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo="most_recent"),
}


def _setup(make):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 48, generator=g))
    b = torch.nn.Parameter(torch.randn(32, generator=g))
    return make(), w, b


def _step(recipe, w, b, k, weight_q=None):
    g = torch.Generator().manual_seed(10 + k)
    x = (torch.randn(16, 48, generator=g) * (k + 1)).requires_grad_()
    y = fp8_linear(x, w, b, recipe, torch.bfloat16, recipe.state.site(w), weight_q=weight_q)
    y.float().pow(2).mean().backward()
    out = (y.detach().clone(), x.grad.clone(), w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    return out


def _gathered(recipe, w):
    """What an fp8 all-gather hands the gemm: the weight cast with the scale the recipe
    says it will use now (its amax here the whole weight's, as one reduced across shards)."""
    choice = recipe.state.weight_scale_choice(w)
    dtype = recipe.rule.dtype("weight")
    a = amax(w)
    scale = choice.scale.clone() if choice.mode == "given" else choice.of_amax(a, dtype)
    q, saturated = cast(w, scale, dtype)
    return QuantizedWeight(q, torch.stack([scale, scale.reciprocal()]), a, saturated)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_weight_quantized_elsewhere_with_the_state_s_scale_gives_the_ordinary_bits(name):
    ours, w1, b1 = _setup(RECIPES[name])
    ref, w2, b2 = _setup(RECIPES[name])
    for k in range(4):  # delayed: the first call scales from its own amax, later ones from the history
        got = _step(ours, w1, b1, k, weight_q=_gathered(ours, w1))
        want = _step(ref, w2, b2, k)
        for g, r in zip(got, want):
            assert torch.equal(g, r), (k, (g.float() - r.float()).abs().max())
        for role in ("input", "weight", "grad_output"):
            assert torch.equal(ours.state.lookup(w1).roles[role].f, ref.state.lookup(w2).roles[role].f), (k, role)
            assert torch.equal(ours.state.lookup(w1).roles[role].i, ref.state.lookup(w2).roles[role].i), (k, role)


def test_the_weight_scale_choice_is_the_history_s_once_delayed_scaling_has_one():
    recipe, w, b = _setup(RECIPES["delayed"])
    assert recipe.state.weight_scale_choice(w).mode == "first"  # no amax recorded yet
    _step(recipe, w, b, 0)
    choice = recipe.state.weight_scale_choice(w)
    assert choice.mode == "given"
    assert torch.equal(choice.scale, torch.tensor(448.0) / amax(w))  # float32, as the rule computes it


def test_role_fields_name_the_packed_buffer_the_kernels_update():
    recipe, w, b = _setup(RECIPES["delayed"])
    _step(recipe, w, b, 0)
    state = recipe.state.lookup(w).roles["input"]
    f = state.f
    assert state.scale.item() == f[F_SCALE].item() and state.amax.item() == f[F_AMAX].item() > 0
    assert state.shown.item() == f[F_SHOWN].item() and state.initialized.item() == f[F_INIT].item() == 1.0
    assert state.pending.item() == f[F_PENDING].item() == -1.0
    assert torch.equal(state.history, f[F_HISTORY:]) and state.history[0].item() == state.amax.item()
    assert state.calls.item() == 1 and state.saturated.item() == 0
    state.scale.fill_(2.0)  # views: writing a field writes the buffer
    assert f[F_SCALE].item() == 2.0


def test_a_recipe_is_frozen_and_its_copies_are_recipes_of_their_own():
    recipe = fp8.DelayedScaling(amax_history_len=4, forward_format=fp8.Format.E4M3, grad_format=torch.float8_e5m2)
    with pytest.raises(AttributeError, match="DelayedScaling is frozen: its 'margin' cannot be set"):
        recipe.margin = 2
    with pytest.raises(AttributeError, match="frozen"):
        del recipe.margin
    assert recipe.margin == 0 and recipe.forward_format == torch.float8_e4m3fn
    for other in (copy.deepcopy(recipe), pickle.loads(pickle.dumps(recipe))):
        assert repr(other) == repr(recipe) and other.state is not recipe.state
        assert other.rule.history_len == 4


def test_formats_are_an_enum_that_takes_the_dtypes_and_refuses_the_rest():
    assert fp8.Format.of(torch.float8_e5m2) is fp8.Format.E5M2 and fp8.Format.E4M3 == torch.float8_e4m3fn
    assert (fp8.Format.E4M3.max, fp8.Format.E5M2.max) == (448.0, 57344.0)
    assert fp8.CurrentScaling(grad_format=fp8.Format.E4M3).grad_format == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="grad_format must be torch.float8_e4m3fn or torch.float8_e5m2"):
        fp8.CurrentScaling(grad_format=torch.float8_e4m3fnuz)
