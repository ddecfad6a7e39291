"""Checkpoints written by earlier code (tests/fp8/data, scripts/make_fp8_checkpoint_fixtures.py)
load into today's recipes, and the step after the resume gives the bits that code's own
run gave when it never stopped: the output, the loss, every gradient, the parameters after
the optimizer step and the recipe's new state."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = pathlib.Path(__file__).with_name("data")

_spec = importlib.util.spec_from_file_location("fp8_fixtures", ROOT / "scripts" / "make_fp8_checkpoint_fixtures.py")
FIXTURES = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FIXTURES)

NAMES = sorted(FIXTURES.VARIANTS)


def _load(name: str) -> dict:
    path = DATA / f"{name}.pt"
    assert path.exists(), f"{path} is missing: run scripts/make_fp8_checkpoint_fixtures.py --only {name}"
    return torch.load(path, weights_only=True)


def _assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if key != "sites":
            assert got[key] == want[key], key
    if "sites" in want:
        assert got["sites"].keys() == want["sites"].keys()
        for name, entries in want["sites"].items():
            assert got["sites"][name].keys() == entries.keys(), name
            for k, v in entries.items():
                assert torch.equal(got["sites"][name][k], v), (name, k)


def test_every_variant_has_its_file():
    assert sorted(p.stem for p in DATA.glob("*.pt")) == NAMES


@pytest.mark.parametrize("form", ["recipe_state", "module_state"])
@pytest.mark.parametrize("name", NAMES)
def test_a_saved_run_resumes_bit_identically(name, form):
    saved = _load(name)
    assert saved["written_by"] and saved["steps"] == FIXTURES.STOP
    with FIXTURES.kernels(saved["kernels"]):
        model, recipe, optimizer = FIXTURES.new_run(saved["recipe_class"], saved["recipe_kwargs"])
        if form == "recipe_state":
            model.load_state_dict(saved["model"])
            recipe.load_state_dict(saved["recipe_state"])
        else:  # Fabric's form: the module's state dict carries the recipe's
            FIXTURES._fp8_state.carry_in_state_dict(model, recipe)
            model.load_state_dict(saved["module_state"])
        optimizer.load_state_dict(saved["optimizer"])
        _assert_state_equal(recipe.state_dict(), saved["recipe_state"])
        got = FIXTURES.step(model, recipe, optimizer, FIXTURES.STOP)
        want = saved["expected"]
        assert torch.equal(got["out"], want["out"]), (got["out"] - want["out"]).abs().max()
        assert torch.equal(got["loss"], want["loss"])
        for kind in ("grads", "params"):
            assert got[kind].keys() == want[kind].keys()
            for k in want[kind]:
                assert torch.equal(got[kind][k], want[kind][k]), (kind, k)
        _assert_state_equal(recipe.state_dict(), want["recipe_state"])


def test_a_delayed_checkpoint_refuses_a_recipe_of_another_configuration_and_keeps_its_state():
    saved = _load("delayed_h4")
    model, recipe, _ = FIXTURES.new_run("DelayedScaling", {"amax_history_len": 4, "margin": 2})
    before = recipe.state_dict()
    with pytest.raises(ValueError, match="margin"):
        recipe.load_state_dict(saved["recipe_state"])
    _assert_state_equal(recipe.state_dict(), before)
