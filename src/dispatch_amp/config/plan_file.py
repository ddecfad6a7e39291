"""A ``PrecisionPlan`` as file data: kind ``"precision_plan"``, read back exactly.

The layout (TOML shown; JSON holds the same data)::

    kind = "precision_plan"
    format = 1
    dtype = "bfloat16"          # device_type, dtype: only where the plan sets them
    cache_enabled = true

    [[modules]]                 # one per pattern, in the plan's order
    pattern = "lm_head"
    setting = "float32"         # a dtype name as given, or "no_fp8"

    [[modules]]
    pattern = "layers.*"
    fp8 = "current_scaling"     # a recipe given alone: its name under [fp8]

    [[modules]]
    pattern = "layers.0"
    policy = "mine"             # a Policy given alone: its name under [policies]

    [[modules]]
    pattern = "*.norm*"
    [modules.setting]           # a setting given as a dict: its keys, by name
    dtype = "float16"
    policy = "mine"

    [policies.mine]             # Policy.to_dict()
    ...

    [fp8.current_scaling]       # the recipe's class and its constructor's arguments
    recipe = "CurrentScaling"
    forward_format = "float8_e4m3fn"
    ...

``default`` is a table like a ``[[modules]]`` entry without ``pattern``. A recipe that
several patterns share is written once and shared again when read, as its state is. A
recipe's configuration is its constructor's arguments (formats by name, as its checkpoint
names them), never its runtime state (amax histories: ``recipe.state_dict()``); a recipe
with a ``filter_fn`` (code) or a ``process_group`` (this process's object) cannot be
written.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch

from .._config_error import ConfigError
from ..autocast.plan import _DTYPE_NAMES, NO_FP8, PrecisionPlan, _Pattern, _setting
from ..autocast.policy import Policy
from ..fp8.recipes import CurrentScaling, DelayedScaling, Recipe, RowwiseScaling

__all__ = ["KIND", "PLAN_FORMAT", "plan_to_dict", "plan_from_dict"]

#: The ``kind`` of a plan file.
KIND = "precision_plan"
#: The newest layout of a plan file this version writes and reads.
PLAN_FORMAT = 1

_RECIPES: dict[str, type[Recipe]] = {c.__name__: c for c in (CurrentScaling, DelayedScaling, RowwiseScaling)}
# Constructor arguments that are runtime objects, not configuration.
_NOT_CONFIG = ("self", "filter_fn", "process_group")
_KEYS = ("kind", "format", "device_type", "dtype", "cache_enabled", "default", "modules", "policies", "fp8")
_SETTING_FORMS = ("setting", "policy", "fp8")
_SETTING_KEYS = ("dtype", "policy", "fp8")
_SETTING_NAMES = (*_DTYPE_NAMES, NO_FP8)


# -- writing --------------------------------------------------------------------------------
def _ref_name(text: str, taken: dict, fallback: str) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or fallback
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


class _Writer:
    def __init__(self):
        self.policies: dict[str, Policy] = {}
        self.recipes: dict[str, Recipe] = {}

    def policy(self, policy: Policy) -> str:
        # Equal policies of one name are one entry (Policy's == ignores the name).
        for ref, p in self.policies.items():
            if p == policy and p.name == policy.name:
                return ref
        ref = _ref_name(policy.name, self.policies, "policy")
        self.policies[ref] = policy
        return ref

    def recipe(self, recipe: Recipe, where: str) -> str:
        for ref, r in self.recipes.items():
            if r is recipe:  # one object, one state: shared again when read
                return ref
        _recipe_data(recipe, where)  # raises for what a file cannot hold
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", type(recipe).__name__).lower()
        ref = _ref_name(snake, self.recipes, "recipe")
        self.recipes[ref] = recipe
        return ref

    def setting(self, value: Any, where: str) -> dict:
        if isinstance(value, str):
            return {"setting": value}
        if isinstance(value, Policy):
            return {"policy": self.policy(value)}
        if isinstance(value, Recipe):
            return {"fp8": self.recipe(value, where)}
        if isinstance(value, Mapping):
            out = {}
            for key, v in value.items():
                if v is None:  # "not set": a file has no null
                    continue
                if key == "policy":
                    out[key] = self.policy(v)
                elif key == "fp8":
                    out[key] = self.recipe(v, f"{where}, key 'fp8'")
                else:
                    out[key] = v
            return {"setting": out}
        raise TypeError(f"{where}: cannot write a setting of type {type(value).__name__} to a file")


def _recipe_data(recipe: Recipe, where: str) -> dict:
    cls = type(recipe)
    if _RECIPES.get(cls.__name__) is not cls:
        raise TypeError(f"{where}: a plan file holds the recipes {list(_RECIPES)}; {cls.__qualname__} is not one")
    if recipe.filter_fn is not None:
        raise ValueError(f"{where}: the {cls.__name__} has a filter_fn, which is code, not configuration: a file "
                         f"cannot hold it. Name the modules to run in fp8 by the plan's patterns instead "
                         f"(and 'no_fp8' for those not to)")
    if getattr(recipe, "process_group", None) is not None:
        raise ValueError(f"{where}: the {cls.__name__} reduces amaxes over a process group, an object of this "
                         f"process that a file cannot hold: give the plan that recipe in code, or write it with a "
                         f"recipe that reduces over the world group (process_group=None)")
    data = {"recipe": cls.__name__}
    for name in inspect.signature(cls.__init__).parameters:
        if name in _NOT_CONFIG:
            continue
        value = getattr(recipe, name)
        # Formats by name, as the recipe's checkpoint writes them ("float8_e4m3fn").
        data[name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return data


def plan_to_dict(plan: PrecisionPlan) -> dict:
    """``plan`` as plain data for a file (``dispatch_amp.config.dump`` writes it):
    ``kind``, ``format``, the plan's keys, ``modules`` as a list of ``{"pattern": ...,
    <setting>}`` in order, and the policies and fp8 recipes it uses by name.

    Example::

        >>> import torch, dispatch_amp as amp
        >>> data = plan_to_dict(amp.PrecisionPlan({"head": torch.float32}))
        >>> data["kind"], data["modules"]
        ('precision_plan', [{'pattern': 'head', 'setting': 'float32'}])
    """
    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"plan_to_dict takes a PrecisionPlan, got {type(plan).__name__}")
    plain = plan.to_dict()
    writer = _Writer()
    out: dict[str, Any] = {"kind": KIND, "format": PLAN_FORMAT}
    for key in ("device_type", "dtype"):
        if plain[key] is not None:
            out[key] = plain[key]
    out["cache_enabled"] = plain["cache_enabled"]
    if plain["default"] is not None:
        out["default"] = writer.setting(plain["default"], "default")
    out["modules"] = [{"pattern": p, **writer.setting(v, f"pattern {p!r}")} for p, v in plain["modules"].items()]
    if writer.policies:
        out["policies"] = {ref: p.to_dict() for ref, p in writer.policies.items()}
    if writer.recipes:
        out["fp8"] = {ref: _recipe_data(r, f"fp8 recipe {ref!r}") for ref, r in writer.recipes.items()}
    return out


# -- reading --------------------------------------------------------------------------------
def _unknown(key: Any, allowed, where: str, what: str = "key") -> ConfigError:
    near = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{where}{key}: unknown {what} {key!r}{hint}; known: {list(allowed)}", key=f"{where}{key}",
                       value=key)


def _table(value: Any, where: str, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {what}, got {type(value).__name__} {value!r}", key=where)
    return value


def _recipe(data: Any, where: str) -> Recipe:
    data = _table(data, where, "a table with 'recipe' (the class) and its arguments")
    if "recipe" not in data:
        raise ConfigError(f"{where}.recipe: missing; one of {list(_RECIPES)}", key=f"{where}.recipe")
    name = data["recipe"]
    cls = _RECIPES.get(name) if isinstance(name, str) else None
    if cls is None:
        near = difflib.get_close_matches(str(name), list(_RECIPES), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{where}.recipe = {name!r}: unknown recipe{hint}; known: {list(_RECIPES)}",
                          key=f"{where}.recipe", value=name if isinstance(name, str) else None)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in _NOT_CONFIG]
    kwargs = {}
    for key, value in data.items():
        if key == "recipe":
            continue
        if key not in params:
            raise _unknown(key, ["recipe", *params], f"{where}.", f"argument of {name}")
        if key.endswith("_format"):
            fmt = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(fmt, torch.dtype):
                raise ConfigError(f"{where}.{key} = {value!r}: not a torch dtype name (e.g. 'float8_e4m3fn')",
                                  key=f"{where}.{key}", value=value)
            value = fmt
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        # The constructor's message names its argument: the key at fault.
        key = next((k for k in kwargs if k in str(e)), None)
        full = where if key is None else f"{where}.{key}"
        value = data.get(key) if key is not None else None
        raise ConfigError(f"{full}: {e}", key=full, value=value if isinstance(value, str) else None) from None


def _policy(data: Any, where: str) -> Policy:
    try:
        return Policy.from_dict(_table(data, where, "a policy's table (Policy.to_dict())"))
    except ConfigError as e:
        key = where if e.key is None else f"{where}.{e.key}"
        raise ConfigError(f"{where}.{e.message}" if e.key else f"{where}: {e.message}", key=key,
                          value=e.value) from None


class _Reader:
    def __init__(self, policies: dict[str, Policy], recipes: dict[str, Recipe]):
        self.policies, self.recipes = policies, recipes
        self.used: set[tuple[str, str]] = set()

    def ref(self, section: str, value: Any, where: str):
        table = self.policies if section == "policies" else self.recipes
        if not isinstance(value, str) or value not in table:
            near = difflib.get_close_matches(str(value), list(table), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where} = {value!r}: no [{section}.{value}] in this file{hint}; it defines "
                              f"{list(table)}", key=where, value=value if isinstance(value, str) else None)
        self.used.add((section, value))
        return table[value]

    def dtype(self, value: Any, where: str, names=tuple(_DTYPE_NAMES)) -> str:
        if not isinstance(value, str) or value not in names:
            near = difflib.get_close_matches(str(value), list(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where} = {value!r}: unknown dtype{hint}; use one of {sorted(names)}", key=where,
                              value=value if isinstance(value, str) else None)
        return value

    def setting(self, entry: Mapping, where: str, allowed: tuple[str, ...]) -> Any:
        for key in entry:
            if key not in allowed:
                raise _unknown(key, allowed, f"{where}.")
        forms = [k for k in _SETTING_FORMS if k in entry]
        if len(forms) != 1:
            raise ConfigError(f"{where}: give one of {list(_SETTING_FORMS)}, got {forms or 'none'}", key=where)
        form, value = forms[0], entry[forms[0]]
        if form == "policy":
            return self.ref("policies", value, f"{where}.policy")
        if form == "fp8":
            return self.ref("fp8", value, f"{where}.fp8")
        if isinstance(value, str):
            return self.dtype(value, f"{where}.setting", _SETTING_NAMES)
        table = _table(value, f"{where}.setting", f"a dtype name, {NO_FP8!r}, or a table of {list(_SETTING_KEYS)}")
        out = {}
        for key, v in table.items():
            if key not in _SETTING_KEYS:
                raise _unknown(key, _SETTING_KEYS, f"{where}.setting.")
            here = f"{where}.setting.{key}"
            out[key] = self.dtype(v, here) if key == "dtype" else self.ref(
                "policies" if key == "policy" else "fp8", v, here)
        return out


def plan_from_dict(data: Mapping) -> PrecisionPlan:
    """The plan ``plan_to_dict`` described, validated: an unknown key, dtype name, recipe
    or reference, or a bad pattern raises ``ConfigError`` naming the key
    (``"modules[2].setting"``).

    Example::

        >>> plan = plan_from_dict({"kind": "precision_plan", "format": 1,
        ...                        "modules": [{"pattern": "head", "setting": "float32"}]})
        >>> plan.to_dict()["modules"]
        {'head': 'float32'}
    """
    data = _table(data, "precision_plan", f"a table of keys {list(_KEYS)}")
    for key in data:
        if key not in _KEYS:
            raise _unknown(key, _KEYS, "")
    for key in ("kind", "format", "modules"):
        if key not in data:
            raise ConfigError(f"{key}: missing (a precision plan has keys {list(_KEYS)})", key=key)
    if data["kind"] != KIND:
        raise ConfigError(f"kind = {data['kind']!r}: a precision plan's kind is {KIND!r}", key="kind",
                          value=data["kind"])
    fmt = data["format"]
    if type(fmt) is not int or not 1 <= fmt <= PLAN_FORMAT:
        raise ConfigError(f"format = {fmt!r}: this dispatch_amp reads precision plan formats 1 to {PLAN_FORMAT}"
                          + (" (a newer dispatch_amp wrote it: upgrade)" if type(fmt) is int and fmt > PLAN_FORMAT
                             else ""), key="format", value=fmt)
    policies = {str(ref): _policy(p, f"policies.{ref}")
                for ref, p in _table(data.get("policies", {}), "policies", "a table of named policies").items()}
    recipes = {str(ref): _recipe(r, f"fp8.{ref}")
               for ref, r in _table(data.get("fp8", {}), "fp8", "a table of named fp8 recipes").items()}
    reader = _Reader(policies, recipes)

    kwargs: dict[str, Any] = {}
    if "dtype" in data:
        kwargs["dtype"] = reader.dtype(data["dtype"], "dtype")
    if "device_type" in data:
        device_type = data["device_type"]
        if not isinstance(device_type, str):
            raise ConfigError(f"device_type = {device_type!r}: a device type name ('cuda', 'cpu'...)",
                              key="device_type")
        kwargs["device_type"] = device_type
    if "cache_enabled" in data:
        if not isinstance(data["cache_enabled"], bool):
            raise ConfigError(f"cache_enabled = {data['cache_enabled']!r}: true or false", key="cache_enabled")
        kwargs["cache_enabled"] = data["cache_enabled"]
    if "default" in data:
        kwargs["default"] = reader.setting(_table(data["default"], "default", "a table like a modules entry"),
                                           "default", _SETTING_FORMS)

    entries = data["modules"]
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(f"modules: a list of tables ([[modules]] in TOML), got {type(entries).__name__}",
                          key="modules")
    modules: dict[str, Any] = {}
    check_dtype = torch.bfloat16 if "dtype" not in kwargs else _DTYPE_NAMES[kwargs["dtype"]]
    for i, entry in enumerate(entries):
        where = f"modules[{i}]"
        entry = _table(entry, where, "a table with 'pattern' and a setting")
        pattern = entry.get("pattern")
        if pattern is None:
            raise ConfigError(f"{where}.pattern: missing (each entry names its modules' pattern)",
                              key=f"{where}.pattern")
        try:
            _Pattern(pattern)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}.pattern: {e}", key=f"{where}.pattern",
                              value=pattern if isinstance(pattern, str) else None) from None
        if pattern in modules:
            raise ConfigError(f"{where}.pattern = {pattern!r}: a second entry for this pattern (one entry a "
                              f"pattern: merge them)", key=f"{where}.pattern", value=pattern)
        value = reader.setting(entry, where, ("pattern", *_SETTING_FORMS))
        try:
            _setting(value, f"pattern {pattern!r}", check_dtype)  # e.g. float32 with a policy
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}", key=where, value=pattern) from None
        modules[pattern] = value

    unused = [f"{section}.{ref}" for section, table in (("policies", policies), ("fp8", recipes))
              for ref in table if (section, ref) not in reader.used]
    if unused:
        raise ConfigError(f"{unused[0]}: defined, but no setting names it (a misspelt reference?); use it or "
                          f"remove it", key=unused[0])
    try:
        return PrecisionPlan(modules, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        key = next((k for k in ("device_type", "dtype", "default") if k in str(e)), None)
        raise ConfigError(f"{key or 'precision_plan'}: {e}", key=key,
                          value=kwargs.get(key) if key in ("device_type", "dtype") else None) from None
