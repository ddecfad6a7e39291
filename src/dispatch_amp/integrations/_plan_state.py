"""A bound ``PrecisionPlan`` in a framework checkpoint, so that a resume runs the same plan.

A plan is code the user runs before training (``plan.bind(model)``), so a resumed run binds
one again; what the checkpoint adds is (a) the plan the run was trained with, as data
(``dispatch_amp.config.state_dict``), and (b) the state of the fp8 recipes the plan holds
(delayed scaling's amax histories), which no other entry files: the plugin's own recipe is
filed by ``_fp8_state``, a plan's recipes are the plan's.

On load, the plan bound to the model now is compared with the filed one:

* the same plan: its recipes take the filed states, nothing else changes;
* another plan, or none: the filed plan is bound in its place (its recipes with the filed
  states), with an ``AmpNumericsWarning`` naming the patterns that differ, so the resume
  keeps its numerics, as a filed policy does (``_policy_state``). Everything that can fail
  (the filed plan does not validate, a pattern names no module of this model, the bound
  plan cannot be unbound) raises before the model changes.

A plan that cannot be written as data (an fp8 recipe with a ``filter_fn`` or a process
group) files its recipes' states only; the resume then keeps the plan its code binds, and
the states load into that plan's recipes when it holds as many.

Where each integration keeps the entry: the Lightning Trainer's checkpoint dict and a
Fabric module's state dict under :data:`CHECKPOINT_KEY`, the transformers Trainer's
checkpoint directory as :data:`FILE_NAME` (``torch.load(weights_only=True)`` reads all of
them).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..autocast.plan import PrecisionPlan, bound_plan
from ..config import load_state_dict, state_dict
from ..fp8.recipes import Recipe
from ..warning_types import AmpNumericsWarning

__all__ = ["CHECKPOINT_KEY", "FILE_NAME", "ModelRef", "entry", "save_into", "load_from", "save_file", "load_file",
           "carry_in_state_dict"]

CHECKPOINT_KEY = "dispatch_amp_plan"
FILE_NAME = "dispatch_amp_plan.pt"


class ModelRef:
    """A weak reference to the model a precision plugin converted, for its checkpoint hooks
    (Lightning's plugin hooks see the checkpoint, not the model). Copies and pickles of the
    plugin (Lightning makes both) hold no model: ``ref()`` is then None.

    Example::

        >>> net = torch.nn.Linear(2, 2); ref = ModelRef(net); ref() is net
        True
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._ref = None if model is None else weakref.ref(model)

    def __call__(self) -> torch.nn.Module | None:
        return None if self._ref is None else self._ref()

    def __getstate__(self):
        return {"_ref": None}


def _recipes_of(plan: PrecisionPlan) -> list[Recipe]:
    """The plan's distinct fp8 recipes, in the order its settings name them (the same for a
    plan and the plan its file gives back: files keep the patterns' order)."""
    found: list[Recipe] = []

    def walk(value: Any) -> None:
        if isinstance(value, Recipe):
            if all(r is not value for r in found):
                found.append(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)

    plain = plan.to_dict()
    walk(plain["modules"])
    walk(plain["default"])
    return found


def _data_of(plan: PrecisionPlan) -> dict | None:
    """The plan as file data, or None where it holds what a file cannot (code, a group)."""
    try:
        return state_dict(plan)
    except (TypeError, ValueError):
        return None


def entry(model: torch.nn.Module) -> dict | None:
    """The checkpoint entry for the plan bound to ``model`` (None: no plan is bound):
    ``{"plan": <file data or None>, "fp8": [recipe.state_dict(), ...]}``.

    Example::

        >>> import torch, dispatch_amp as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = amp.PrecisionPlan({"1": torch.float32}).bind(net)
        >>> entry(net)["plan"]["modules"]
        [{'pattern': '1', 'setting': 'float32'}]
    """
    plan = bound_plan(model)
    if plan is None:
        return None
    return {"plan": _data_of(plan), "fp8": [r.state_dict() for r in _recipes_of(plan)]}


def save_into(checkpoint: dict, model: torch.nn.Module | None) -> None:
    """Files the plan bound to ``model`` in ``checkpoint`` (no model or no plan: nothing).

    Example::

        >>> import torch, dispatch_amp as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = amp.PrecisionPlan({"1": torch.float32}).bind(net)
        >>> ckpt = {}; save_into(ckpt, net); sorted(ckpt[CHECKPOINT_KEY])
        ['fp8', 'plan']
    """
    filed = entry(model) if model is not None else None
    if filed is not None:
        checkpoint[CHECKPOINT_KEY] = filed


def _differences(filed: dict, bound: dict | None) -> list[str]:
    """The patterns (and plan keys) whose entries differ between two plans' file data."""
    if bound is None:
        return ["no plan is bound to the model"]

    def by_pattern(data: dict) -> dict:
        return {m["pattern"]: {k: v for k, v in m.items() if k != "pattern"} for m in data.get("modules", [])}

    a, b = by_pattern(filed), by_pattern(bound)
    out = [f"pattern {p!r}" for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]
    out += [f"{k!r}" for k in sorted(set(filed) | set(bound)) if k != "modules" and filed.get(k) != bound.get(k)]
    return out


def _load_states(recipes: list[Recipe], states: list) -> None:
    for recipe, state in zip(recipes, states):
        recipe.load_state_dict(state)


def load_from(checkpoint: Mapping, model: torch.nn.Module | None) -> PrecisionPlan | None:
    """Applies the filed plan to ``model`` (see the module's docstring); returns the plan
    bound afterwards (None: nothing filed, or no model).

    Example::

        >>> import torch, dispatch_amp as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = amp.PrecisionPlan({"1": torch.float32}).bind(net)
        >>> ckpt = {}; save_into(ckpt, net)
        >>> load_from(ckpt, net) is plan     # the same plan: it stays
        True
    """
    if model is None or CHECKPOINT_KEY not in checkpoint:
        return bound_plan(model) if model is not None else None
    filed = checkpoint[CHECKPOINT_KEY]
    if not isinstance(filed, Mapping) or not isinstance(filed.get("fp8"), list):
        raise ValueError(f"checkpoint[{CHECKPOINT_KEY!r}] is not a precision plan entry (a dict with 'plan' and "
                         f"a list 'fp8'): it was not written by dispatch_amp; remove it to resume without it")
    bound = bound_plan(model)
    data = filed.get("plan")
    bound_data = _data_of(bound) if bound is not None else None
    if data is None or (bound is not None and bound_data == data):
        # Nothing to compare (a plan holding code) or the same plan: its recipes resume.
        if bound is not None:
            recipes = _recipes_of(bound)
            if len(recipes) == len(filed["fp8"]):
                _load_states(recipes, filed["fp8"])
            elif filed["fp8"]:
                warnings.warn(
                    f"the checkpoint files the states of {len(filed['fp8'])} fp8 recipe(s) of a precision plan, "
                    f"the plan bound now holds {len(recipes)}: the states are not loaded, so its fp8 scales "
                    f"start afresh", AmpNumericsWarning, stacklevel=3)
        return bound
    # Another plan than the one bound: the filed one takes its place. Validate everything first.
    plan = load_state_dict(data)
    if not isinstance(plan, PrecisionPlan):
        raise ValueError(f"checkpoint[{CHECKPOINT_KEY!r}]['plan'] holds a {type(plan).__name__}, not a precision plan")
    plan.resolve(model)
    recipes = _recipes_of(plan)
    if len(recipes) != len(filed["fp8"]):
        raise ValueError(f"checkpoint[{CHECKPOINT_KEY!r}] files {len(filed['fp8'])} fp8 recipe state(s) for a plan "
                         f"holding {len(recipes)}: the entry is damaged; remove it to resume with the plan bound now")
    # The filed plan's recipes are new objects that nothing else holds: loading their states
    # first means a state that does not load raises before the model changes.
    _load_states(recipes, filed["fp8"])
    if bound is not None:
        bound.unbind()
    try:
        plan.bind(model)
    except BaseException:
        if bound is not None:
            bound.bind(model)
        raise
    warnings.warn(
        f"the checkpoint's precision plan differs from the one bound to the model "
        f"({', '.join(_differences(data, bound_data))}); the run resumes with the checkpoint's, so it keeps its "
        f"numerics (to run the other, remove checkpoint[{CHECKPOINT_KEY!r}] before loading)",
        AmpNumericsWarning, stacklevel=3)
    return plan


def save_file(directory: str | os.PathLike, model: torch.nn.Module | None) -> None:
    """Writes the plan bound to ``model`` to :data:`FILE_NAME` in a checkpoint directory
    (no plan bound: no file)."""
    filed = entry(model) if model is not None else None
    if filed is not None:
        torch.save(filed, os.path.join(directory, FILE_NAME))


def load_file(directory: str | os.PathLike, model: torch.nn.Module | None) -> PrecisionPlan | None:
    """``load_from`` for the file :func:`save_file` wrote (none there: nothing changes)."""
    path = os.path.join(directory, FILE_NAME)
    if model is None or not os.path.isfile(path):
        return bound_plan(model) if model is not None else None
    return load_from({CHECKPOINT_KEY: torch.load(path, weights_only=True)}, model)


def carry_in_state_dict(module: torch.nn.Module) -> None:
    """Makes ``module.state_dict()`` carry the plan bound to it (when one is, at save time) as
    :data:`CHECKPOINT_KEY`, and ``module.load_state_dict`` take the entry out and apply it
    (``load_from``). Once per module; for Fabric, whose ``save`` writes only the objects it
    is given.

    Example::

        >>> import dispatch_amp as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> carry_in_state_dict(net); CHECKPOINT_KEY in net.state_dict()
        False
        >>> plan = amp.PrecisionPlan({"1": torch.float32}).bind(net)
        >>> CHECKPOINT_KEY in net.state_dict()
        True
    """
    if getattr(module, "_dispatch_amp_plan_carried", False):
        return
    ref = ModelRef(module)

    def save(mod, state_dict, prefix, local_metadata):
        if prefix == "" and ref() is not None:
            save_into(state_dict, ref())

    def load(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if prefix == "" and CHECKPOINT_KEY in state_dict and ref() is not None:
            load_from({CHECKPOINT_KEY: state_dict.pop(CHECKPOINT_KEY)}, ref())

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
    module._dispatch_amp_plan_carried = True
