"""Delayed scaling's checkpoint format: checked as a whole before anything changes.

``{"amax_history_len": n, "sites": {name: {"<role>_history": (n,) tensor, "<role>_scale":
0-d tensor, "<role>_initialized": 0-d tensor}}}`` for roles ``input``, ``weight`` and
``grad_output``; ``_initialized`` may be absent (checkpoints from before it existed: then
a history holding a positive finite amax means initialized). Pickles carry the same
content as Python floats (``portable``), so that a recipe passed to a spawned process
shares no tensor memory with its parent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..kernels.fp8_scale import NO_PENDING
from ._sites import ROLES

__all__ = ["parse", "portable", "from_portable", "entries"]

_KINDS = ("history", "scale", "initialized")


def _fail(msg: str):
    raise ValueError(f"DelayedScaling.load_state_dict(): {msg}")


def _role_f(name: str, role: str, history, scale, initialized, n: int) -> torch.Tensor:
    where = f"site {name!r}, role {role!r}"
    if not (isinstance(history, torch.Tensor) and history.is_floating_point() and tuple(history.shape) == (n,)):
        _fail(f"{where}: expected a floating history of shape ({n},), got "
              f"{type(history).__name__ if not isinstance(history, torch.Tensor) else tuple(history.shape)}")
    if not (isinstance(scale, torch.Tensor) and scale.is_floating_point() and scale.dim() == 0):
        _fail(f"{where}: expected a 0-d floating scale")
    history = history.detach().to("cpu", torch.float32)
    scale = scale.detach().to("cpu", torch.float32)
    if not (torch.isfinite(scale) and scale > 0):
        _fail(f"{where}: the scale is {scale.item()}; a scale must be positive and finite (a nan, inf or 0 "
              f"scale would make every later output nan or 0): this state is corrupt, load another checkpoint")
    if (history < 0).any():
        _fail(f"{where}: the history holds negative values; amaxes are never negative: this state is corrupt")
    if initialized is None:
        init = bool(((history > 0) & torch.isfinite(history)).any())
    elif isinstance(initialized, torch.Tensor) and initialized.dim() == 0 and initialized.item() in (0, 1):
        init = bool(initialized.item())
    else:
        _fail(f"{where}: expected a 0-d initialized flag of 0 or 1")
    head = torch.tensor([scale.item(), 0.0, 0.0, float(init), NO_PENDING])
    return torch.cat([head, history])


def parse(state_dict, amax_history_len: int) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {role: f}}`` (CPU, the ``RoleState.f`` layout) from a state dict, or a
    ValueError naming what is wrong; reads everything before returning anything."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"DelayedScaling.load_state_dict() takes what state_dict() returned (a dict), "
                        f"got {type(state_dict).__name__}")
    if set(state_dict) != {"amax_history_len", "sites"}:
        _fail(f"takes what state_dict() returned: keys 'amax_history_len' and 'sites', got {sorted(map(str, state_dict))}")
    n = state_dict["amax_history_len"]
    if n != amax_history_len:
        _fail(f"the checkpoint's amax_history_len is {n!r}, this recipe's {amax_history_len}; make the recipe "
              f"with DelayedScaling(amax_history_len={n!r})")
    sites = state_dict["sites"]
    if not isinstance(sites, Mapping):
        _fail(f"state_dict['sites'] must map site names to their entries, got {type(sites).__name__} "
              f"({sites!r}); pass the dict recipe.state_dict() returned")
    parsed = {}
    for name, entries in sites.items():
        if not isinstance(name, str):
            _fail(f"site names are strings, got {name!r}")
        if not isinstance(entries, Mapping):
            _fail(f"site {name!r}: expected a dict of '<role>_history'/'<role>_scale' tensors, got {type(entries).__name__}")
        by_role: dict[str, dict[str, object]] = {}
        for key, value in entries.items():
            role, _, kind = str(key).rpartition("_")
            if role not in ROLES or kind not in _KINDS:
                _fail(f"site {name!r}: unknown entry {key!r} (entries are '<role>_history', '<role>_scale' and "
                      f"'<role>_initialized' for roles {', '.join(ROLES)})")
            by_role.setdefault(role, {})[kind] = value
        roles = {}
        for role, kinds in by_role.items():
            if "history" not in kinds or "scale" not in kinds:
                _fail(f"site {name!r}, role {role!r}: needs both '{role}_history' and '{role}_scale'")
            roles[role] = _role_f(name, role, kinds["history"], kinds["scale"], kinds.get("initialized"), n)
        parsed[name] = roles
    return parsed


def entries(f: torch.Tensor, role: str) -> dict[str, torch.Tensor]:
    """One role's checkpoint entries from its ``RoleState.f``."""
    f = f.detach()
    return {f"{role}_history": f[5:].clone(), f"{role}_scale": f[0].clone(),
            f"{role}_initialized": (f[3] > 0).clone()}


def portable(state: dict) -> dict:
    """``state`` with every tensor as Python numbers (for pickles)."""
    return {"amax_history_len": state["amax_history_len"],
            "sites": {name: {k: v.tolist() for k, v in e.items()} for name, e in state["sites"].items()}}


def from_portable(state: dict) -> dict:
    """The inverse of :func:`portable`."""
    def tensor(key, value):
        return torch.tensor(value, dtype=torch.bool if key.endswith("_initialized") else torch.float32)

    return {"amax_history_len": state["amax_history_len"],
            "sites": {name: {k: tensor(k, v) for k, v in e.items()} for name, e in state["sites"].items()}}
