"""Delayed scaling's checkpoint format: checked as a whole before anything changes.

``{"amax_history_len": n, "forward_format": "float8_e4m3fn", "grad_format":
"float8_e5m2", "margin": 0, "amax_compute_algo": "max", "power_of_two": False, "sites":
{name: {"<role>_history": (n,) tensor, "<role>_scale": 0-d tensor, "<role>_initialized":
0-d tensor}}}`` for roles ``input``, ``weight`` and ``grad_output``.

The configuration entries are what the histories and scales were made under (a scale is
``fp8_max / ref / 2**margin`` for its role's format, rounded or not): a checkpoint loads
only into a recipe with the same ones. Checkpoints from before they were saved lack them
(and ``_initialized``: then a history holding a positive finite amax means initialized);
they load as before.

``"weight_copy_scale"`` (0-d, present while ``cast_cache`` keeps the weight's fp8 copy):
the scale that copy was made with, which the rest of its accumulation window reuses; a
resumed run makes the copy again with it (``_quantize.restored``).

Pickles carry the same content as Python floats (``portable``), so that a recipe passed
to a spawned process shares no tensor memory with its parent; they carry no copy scale
(a copy of a recipe has no fp8 copies).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..kernels.fp8_scale import pack
from ._sites import ROLES

__all__ = ["parse", "portable", "from_portable", "entries", "CONFIG", "COPY_SCALE"]

_KINDS = ("history", "scale", "initialized")
# The configuration a checkpoint's state was made under, in the order errors name them.
CONFIG = ("amax_history_len", "forward_format", "grad_format", "margin", "amax_compute_algo", "power_of_two")
COPY_SCALE = "weight_copy_scale"


def _fail(msg: str):
    raise ValueError(f"DelayedScaling.load_state_dict(): {msg}")  # the one recipe whose state this is


def _not_meta(where: str, key: str, value) -> None:
    if isinstance(value, torch.Tensor) and value.is_meta:
        _fail(f"{where}: {key!r} is a meta tensor, which holds no values (the checkpoint was loaded with "
              f"map_location='meta', or made by a recipe whose state lived on the meta device); load it with "
              f"torch.load(path, map_location='cpu') and pass that to load_state_dict()")


def _role_f(name: str, role: str, history, scale, initialized, n: int) -> torch.Tensor:
    where = f"site {name!r}, role {role!r}"
    for kind, value in (("history", history), ("scale", scale), ("initialized", initialized)):
        _not_meta(where, f"{role}_{kind}", value)
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
    return pack(history, scale=scale.item(), initialized=float(init))


def _shown(key: str, value) -> str:
    """``value`` as the argument of the recipe that takes it."""
    return f"torch.{value}" if key.endswith("_format") else repr(value)


def parse(state_dict, config: Mapping) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``({name: {role: f}}, {name: weight copy scale})`` (CPU, ``f`` in the
    ``RoleState.f`` layout) from a state dict made under ``config`` (``CONFIG`` -> this
    recipe's value), or a ValueError naming what is wrong; reads everything before
    returning anything."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"DelayedScaling.load_state_dict() takes what state_dict() returned (a dict), "
                        f"got {type(state_dict).__name__}")
    keys = set(state_dict)
    if not {"amax_history_len", "sites"} <= keys or not keys <= {*CONFIG, "sites"}:
        _fail(f"takes what state_dict() returned: keys 'amax_history_len' and 'sites' (and the recipe's "
              f"{', '.join(map(repr, CONFIG[1:]))}), got {sorted(map(str, state_dict))}")
    for key in CONFIG:
        if key in state_dict and state_dict[key] != config[key]:
            theirs = state_dict[key]
            _fail(f"the checkpoint's {key} is {_shown(key, theirs)}, this recipe's {_shown(key, config[key])}: its "
                  f"histories and scales were made for its own; make the recipe with DelayedScaling("
                  f"{key}={_shown(key, theirs)}), or start this recipe's state afresh (do not load it)")
    sites = state_dict["sites"]
    if not isinstance(sites, Mapping):
        _fail(f"state_dict['sites'] must map site names to their entries, got {type(sites).__name__} "
              f"({sites!r}); pass the dict recipe.state_dict() returned")
    n = config["amax_history_len"]
    parsed, copy_scales = {}, {}
    for name, entries in sites.items():
        if not isinstance(name, str):
            _fail(f"site names are strings, got {name!r}")
        if not isinstance(entries, Mapping):
            _fail(f"site {name!r}: expected a dict of '<role>_history'/'<role>_scale' tensors, got {type(entries).__name__}")
        by_role: dict[str, dict[str, object]] = {}
        for key, value in entries.items():
            if key == COPY_SCALE:
                copy_scales[name] = _copy_scale(name, value)
                continue
            role, _, kind = str(key).rpartition("_")
            if role not in ROLES or kind not in _KINDS:
                _fail(f"site {name!r}: unknown entry {key!r} (entries are '<role>_history', '<role>_scale' and "
                      f"'<role>_initialized' for roles {', '.join(ROLES)}, and {COPY_SCALE!r})")
            by_role.setdefault(role, {})[kind] = value
        roles = {}
        for role, kinds in by_role.items():
            if "history" not in kinds or "scale" not in kinds:
                _fail(f"site {name!r}, role {role!r}: needs both '{role}_history' and '{role}_scale'")
            roles[role] = _role_f(name, role, kinds["history"], kinds["scale"], kinds.get("initialized"), n)
        parsed[name] = roles
    return parsed, copy_scales


def _copy_scale(name: str, value) -> torch.Tensor:
    where = f"site {name!r}"
    _not_meta(where, COPY_SCALE, value)
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 0):
        _fail(f"{where}: expected a 0-d floating {COPY_SCALE!r}")
    value = value.detach().to("cpu", torch.float32)
    if not (torch.isfinite(value) and value > 0):
        _fail(f"{where}: {COPY_SCALE!r} is {value.item()}; a scale must be positive and finite: this state is "
              f"corrupt, load another checkpoint")
    return value


def entries(state, role: str) -> dict[str, torch.Tensor]:
    """One role's checkpoint entries from its ``RoleState`` (named fields)."""
    return {f"{role}_history": state.history.detach().clone(), f"{role}_scale": state.scale.detach().clone(),
            f"{role}_initialized": (state.initialized.detach() > 0).clone()}


def portable(state: dict) -> dict:
    """``state`` with every tensor as Python numbers (for pickles), without copy scales."""
    config = {k: v for k, v in state.items() if k != "sites"}
    return {**config, "sites": {name: {k: v.tolist() for k, v in e.items() if k != COPY_SCALE}
                                for name, e in state["sites"].items()}}


def from_portable(state: dict) -> dict:
    """The inverse of :func:`portable`."""
    def tensor(key, value):
        return torch.tensor(value, dtype=torch.bool if key.endswith("_initialized") else torch.float32)

    config = {k: v for k, v in state.items() if k != "sites"}
    return {**config, "sites": {name: {k: tensor(k, v) for k, v in e.items()} for name, e in state["sites"].items()}}
