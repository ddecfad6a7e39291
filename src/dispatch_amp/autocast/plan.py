"""``PrecisionPlan``: precision by module path, applied as nested autocast regions.

A plan maps module-name patterns to a setting (a dtype, float32, a ``Policy``, an fp8
recipe, or "no fp8"). ``plan.bind(model)`` resolves the patterns against
``model.named_modules()`` and makes each module whose setting differs from its parent's
run its forward inside that setting's region: what one writes by hand as nested
``torch.autocast`` regions, and nothing else, so native nesting rules hold (the innermost
region wins) and so does everything ``autocast`` promises. ``plan.unbind()`` restores the
model.

Example::

    import torch, dispatch_amp as amp

    plan = amp.PrecisionPlan({
        "head": torch.float32,           # the head: autocast off, its inputs made float32
        "blocks.0": "float32",           # the first block too
        "*.ln*": torch.float32,          # every layer norm
    }).bind(model)
    with amp.autocast("cpu"):            # everything else: the region's bfloat16
        loss = model.loss(x, y)
    loss.backward()
    print(plan.explain())                # which pattern set what, module by module

Which pattern wins: see :class:`PrecisionPlan`. The regions: ``_Region`` below.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from .. import _markdown
from ..fp8.recipes import Recipe
from .context import autocast, device_dtypes
from .policy import Policy

__all__ = ["PrecisionPlan", "PlanEntry", "NO_FP8", "bound_plan"]

#: The setting "this module runs in the enclosing region's dtype, without fp8".
NO_FP8 = "no_fp8"

_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_float32, _float64 = torch.float32, torch.float64

# Names a setting's dtype may be given by (a config file, a command line).
_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_SETTING_KEYS = ("dtype", "policy", "fp8")


# -- settings -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setting:
    """One module's precision. ``enabled=False``: float32 (autocast off, floating inputs
    made float32); ``dtype=None``: the enclosing region's dtype (with ``enabled``: no fp8;
    without: a disabled region that keeps torch's dtype, as ``torch.autocast(dev,
    enabled=False)`` does)."""

    enabled: bool
    dtype: torch.dtype | None = None
    policy: Policy | None = None
    fp8: Recipe | None = None
    # The form the user gave, for to_dict() and messages.
    given: object = None

    def __eq__(self, other):
        # fp8 recipes compare by identity: two recipes hold two states.
        return (isinstance(other, _Setting) and self.enabled == other.enabled and self.dtype == other.dtype
                and self.policy == other.policy and self.fp8 is other.fp8)

    def __hash__(self):
        return hash((self.enabled, self.dtype, self.policy, id(self.fp8)))

    def describe(self) -> str:
        if not self.enabled:
            return "float32 (autocast off)"
        if self.dtype is None:
            return "enclosing dtype, no fp8"
        parts = [str(self.dtype).replace("torch.", "")]
        if self.policy is not None:
            parts.append(f"policy {self.policy.name!r}")
        if self.fp8 is not None:
            parts.append(f"fp8 {type(self.fp8).__name__}")
        return ", ".join(parts)


def _dtype(value, where: str) -> torch.dtype:
    if isinstance(value, str):
        if value not in _DTYPE_NAMES:
            raise ValueError(
                f"{where}: unknown dtype {value!r}; use one of {sorted(_DTYPE_NAMES)} or a torch.dtype "
                f"(torch.float32, torch.bfloat16, torch.float16)"
            )
        return _DTYPE_NAMES[value]
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{where}: dtype {value} is not a setting: use torch.float32 (autocast off), "
                f"torch.bfloat16 or torch.float16 (fp8 is a recipe: dispatch_amp.fp8.CurrentScaling())"
            )
        return value
    raise TypeError(f"{where}: expected a dtype, got {type(value).__name__} {value!r}")


def _setting(value, where: str, dtype: torch.dtype) -> _Setting:
    """The setting ``value`` names; ``dtype``: the plan's dtype, for a bare policy or recipe."""
    if isinstance(value, _Setting):
        return value
    if isinstance(value, str) and value == NO_FP8:
        return _Setting(True, None, given=value)
    if isinstance(value, (str, torch.dtype)):
        d = _dtype(value, where)
        return _Setting(False, given=value) if d is torch.float32 else _Setting(True, d, given=value)
    if isinstance(value, Policy):
        return _Setting(True, dtype, policy=value, given=value)
    if isinstance(value, Recipe):
        return _Setting(True, dtype, fp8=value, given=value)
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in _SETTING_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; a setting's keys are {list(_SETTING_KEYS)}")
        d = _dtype(value.get("dtype", dtype), f"{where}, key 'dtype'")
        policy, fp8 = value.get("policy"), value.get("fp8")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"{where}, key 'policy': expected a dispatch_amp.Policy, got {type(policy).__name__}")
        if fp8 is not None and not isinstance(fp8, Recipe):
            raise TypeError(f"{where}, key 'fp8': expected a dispatch_amp.fp8 recipe, got {type(fp8).__name__}")
        if d is torch.float32:
            if policy is not None or fp8 is not None:
                raise ValueError(f"{where}: dtype float32 turns autocast off; a policy or an fp8 recipe "
                                 f"would never apply there (give dtype bfloat16 or float16)")
            return _Setting(False, given=dict(value))
        return _Setting(True, d, policy=policy, fp8=fp8, given=dict(value))
    raise TypeError(
        f"{where}: a setting is a dtype (torch.float32, torch.bfloat16, torch.float16 or its name), "
        f"{NO_FP8!r}, a dispatch_amp.Policy, a dispatch_amp.fp8 recipe, or a dict with keys "
        f"{list(_SETTING_KEYS)}; got {type(value).__name__}"
    )


def _plain(value):
    """A setting as plain data: dtypes by name (what ``to_dict`` and ``PlanEntry`` hold)."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, Mapping):
        return {k: _plain(x) for k, x in value.items()}
    return value


# -- patterns -----------------------------------------------------------------------------
class _Pattern:
    """A module-name pattern (``fnmatch`` style: ``*`` any characters, dots included, ``?``
    one character, ``[seq]`` one of seq) and how specific it is."""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise TypeError(f"a module pattern must be a str, got {type(text).__name__} {text!r}")
        if not text:
            raise ValueError("an empty pattern names the model itself: pass its setting as default= instead")
        self.text = text
        parts, self.wildcards, self.literal = [], 0, 0
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if c == "*":
                parts.append("(?:.*)")
                self.wildcards += 1
                i += 1
            elif c == "?":
                parts.append("(.)")
                self.wildcards += 1
                i += 1
            elif c == "[" and self._class_end(text, i) is not None:
                j = self._class_end(text, i)
                body = text[i + 1:j]
                negate = body.startswith("!")
                # Every character literal but a range's "-" (no nested sets, no escapes).
                body = "".join(c if c == "-" else re.escape(c) for c in (body[1:] if negate else body))
                parts.append("([" + ("^" if negate else "") + body + "])")
                self.wildcards += 1
                i = j + 1
            else:
                j = i + 1
                while j < n and text[j] not in "*?[":
                    j += 1
                parts.append(f"({re.escape(text[i:j])})")
                self.literal += j - i
                i = j
        try:
            self._regex = re.compile("".join(parts) + r"\Z", re.DOTALL)
        except re.error as error:  # a reversed range, "[z-a]"
            raise ValueError(f"pattern {text!r} is not a valid pattern: {error}") from None

    @staticmethod
    def _class_end(text: str, i: int) -> int | None:
        """The index of the ``]`` closing the ``[`` at ``i`` (as fnmatch reads it), or None:
        then the ``[`` is a literal character."""
        j = i + 1
        if j < len(text) and text[j] == "!":
            j += 1
        if j < len(text) and text[j] == "]":
            j += 1
        j = text.find("]", j)
        return None if j < 0 else j

    def reach(self, name: str) -> int | None:
        """Where in ``name`` the deepest character the pattern pins ends (a literal, ``?``
        or ``[seq]``: anything but ``*``), or None if it does not match. ``*`` matches
        greedily, so what follows it lies as deep as it can."""
        m = self._regex.match(name)
        if m is None:
            return None
        ends = [m.end(g) for g in range(1, (m.lastindex or 0) + 1) if m.group(g) is not None]
        return max(ends, default=0)

    def __repr__(self) -> str:
        return repr(self.text)


@dataclass(frozen=True)
class PlanEntry:
    """How a plan resolved one module: its setting (as given, dtypes by name), the
    pattern that set it (``None``: the plan's default, or nothing), the other patterns that
    applied and lost, and whether its forward opens a region (its setting differs from its
    parent's).

    Example::

        >>> entry = PlanEntry("blocks.0", "float32", "blocks.0", ("blocks.*",), True)
        >>> entry.overridden
        ('blocks.*',)
    """

    module: str
    setting: object
    pattern: str | None
    overridden: tuple[str, ...]
    opens_region: bool


# -- regions --------------------------------------------------------------------------------
def _to_float32(device_type: str):
    """``(args, kwargs) -> (args, kwargs)`` with the floating tensors of the device type
    (not float64) made float32, inside lists, tuples and dicts too, as ``custom_fwd``
    casts them. Plain tensor arguments, the common case, skip the tree walk."""
    def cast(v):
        if isinstance(v, _Tensor) and v.is_floating_point() and v.device.type == device_type \
                and v.dtype is not _float64:
            return v.to(_float32)
        return v

    def one(v):
        if isinstance(v, _Tensor):
            return cast(v)
        if isinstance(v, (list, tuple, dict)):
            return tree_map(cast, v)
        return v

    def cast_all(args, kwargs):
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    return cast_all


class _Region:
    """What a planned module's forward runs inside: one setting on one device type.

    - float32: as ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` and the hand-written
      ``with torch.autocast(dev, enabled=False): module(x.float())``: where autocast is
      on, floating inputs of the device type are made float32 and the forward runs in a
      region with ``enabled=False`` (torch's dtype stays the enclosing one); where it is
      off, the forward runs as it is.
    - a dtype, a policy, an fp8 recipe: the forward runs in ``autocast(dev, dtype,
      policy=..., fp8=...)``, whether or not a region encloses it (as a nested
      ``torch.autocast`` region would).
    - no fp8: where autocast is on, a region of the enclosing dtype under the device's
      built-in policy and no recipe; where it is off, the forward runs as it is.

    Eagerly one ``autocast`` object per dtype is kept, made at ``bind`` (regions are
    re-entrant, per thread). While Dynamo traces, the region is made in the traced code:
    Dynamo enters only context managers made inside the graph it traces. A built-in policy's region
    traces as ``torch.autocast`` (no graph break); a policy of one's own or an fp8 recipe
    cannot be traced there (``autocast`` warns, the function runs eagerly).
    """

    def __init__(self, setting: _Setting, device_type: str, cache_enabled: bool):
        self.setting = setting
        self.device_type = device_type
        self.cache_enabled = cache_enabled
        self._float32 = _to_float32(device_type)
        # Made now, eagerly: this checks them, and fills the caches (the policy's routing
        # plan) that a region made while Dynamo traces then only reads.
        s = setting
        dtypes = (s.dtype,) if s.dtype is not None else device_dtypes(device_type)[1]
        self._contexts = {d: autocast(device_type, d, s.enabled, cache_enabled, s.policy, s.fp8) for d in dtypes}

    def run(self, forward, args, kwargs):
        s = self.setting
        device_type = self.device_type
        if s.dtype is None:  # float32, or no fp8: the enclosing dtype, where autocast is on
            if not torch.is_autocast_enabled(device_type):
                return forward(*args, **kwargs)
            dtype = torch.get_autocast_dtype(device_type)
            if not s.enabled:
                args, kwargs = self._float32(args, kwargs)
        else:
            dtype = s.dtype
        ctx = None if _is_compiling() else self._contexts.get(dtype)
        if ctx is None:
            # Dynamo enters only context managers made in the code it traces (and a dtype
            # torch was set to by hand has no context made in advance).
            ctx = autocast(device_type, dtype, s.enabled, self.cache_enabled, s.policy, s.fp8)
        with ctx:
            return forward(*args, **kwargs)

    # A copy of a planned model shares its regions (a region is configuration; its
    # recipe's state belongs to the plan); a pickle holds the setting and remakes it.
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _Region, (self.setting, self.device_type, self.cache_enabled)


class _PlannedForward:
    """A module's ``forward`` run inside its region: set on the module as the instance
    attribute ``forward`` (what ``nn.Module.__call__`` calls), removed by ``unbind``.

    ``__wrapped__`` is the module's own forward, so ``inspect.signature(module.forward)``
    (transformers' Trainer reads it) gives that forward's parameters. A deep copy of the
    module rebinds the forward to the copy and keeps the region.
    """

    def __init__(self, region: _Region, forward, plan: PrecisionPlan | None = None):
        self.region = region
        self.__wrapped__ = forward
        # The plan that set it, for ``bound_plan`` (held here: a plan bound and dropped,
        # ``PrecisionPlan(...).bind(model)``, still describes the model). Copies and pickles
        # drop it: a copy of a planned module is bound by no plan that could unbind it.
        self.plan = plan

    def __getstate__(self):
        return {**self.__dict__, "plan": None}

    def __call__(self, *args, **kwargs):
        return self.region.run(self.__wrapped__, args, kwargs)

    def __repr__(self) -> str:
        return f"<forward of {self.__wrapped__!r} in {self.region.setting.describe()}>"


# -- the plan -------------------------------------------------------------------------------
class PrecisionPlan:
    """Precision by module path: module-name patterns mapped to settings, bound to a model.

    Args:
        modules: pattern -> setting. A pattern is matched against the names of
            ``model.named_modules()`` in ``fnmatch`` style (``*`` matches any characters,
            dots included; ``?`` one; ``[seq]`` one of seq), and applies to the modules it
            names and to everything they run. A setting is one of:

            - ``torch.float32`` (or ``"float32"``, ``"fp32"``): autocast off, floating
              inputs made float32, the hand-written ``with torch.autocast(dev,
              enabled=False): module(x.float())``;
            - ``torch.bfloat16`` / ``torch.float16`` (or ``"bf16"``, ``"fp16"``...): a
              region with that dtype under the device's built-in table;
            - a ``dispatch_amp.Policy``: a region with that table, in ``dtype``;
            - an fp8 recipe (``dispatch_amp.fp8.CurrentScaling()``...): a region with that
              recipe, in ``dtype``;
            - ``"no_fp8"``: the enclosing region's dtype under the built-in table, without
              fp8 (nothing where autocast is off);
            - a dict with keys ``dtype``, ``policy``, ``fp8``: those together.
        default: the model's own setting (its forward's region), or None: the model runs
            in whatever region its caller opened.
        device_type: the regions' device type; None: that of the model's first floating
            parameter or buffer at ``bind`` ("cpu" without one). Bind after moving the
            model to its device, or pass it.
        dtype: the dtype of a policy or recipe given alone; None: the device's default
            (bfloat16 on CPU, float16 elsewhere).
        cache_enabled: the regions' weight-cast cache flag, as ``autocast``'s.

    Which pattern wins, for each module: among the patterns that name it or one of the
    modules it sits in, the one that pins the deepest character of the module's name (its
    last character other than ``*``: ``"*.ln*"`` reaches into ``"blocks.1.ln1"`` further
    than ``"blocks.*"`` does, and ``"blocks.0"`` further than ``"blocks.*"``); then the one
    with fewer wildcards; then the one with more literal characters. Two patterns still tied that give one module
    different settings are an error naming both. A pattern that names no module is an
    error naming the nearest module names. ``explain()`` shows, module by module, which
    pattern won and which lost.

    Regions: a module whose setting differs from its parent's runs its forward inside
    that setting's region, opened inside whatever region encloses the call; a module with
    its parent's setting runs inside the parent's region. That is the same code as nested
    ``torch.autocast`` regions written by hand, with the same numbers
    (docs/autocast.md, "Precision by module path").

    Example::

        plan = amp.PrecisionPlan({"head": torch.float32, "blocks.*": amp.fp8.CurrentScaling()},
                                 dtype=torch.bfloat16).bind(model)
        with amp.autocast("cpu"):
            loss = model.loss(x, y)
        plan.unbind()                       # the model as it was
    """

    def __init__(self, modules: Mapping[str, object], *, default: object = None, device_type: str | None = None,
                 dtype: torch.dtype | str | None = None, cache_enabled: bool = True):
        if not isinstance(modules, Mapping):
            raise TypeError(f"modules must be a dict of pattern -> setting, got {type(modules).__name__}")
        if device_type is not None:
            device_dtypes(device_type)  # raises for a device type autocast does not support
        if not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be a bool, got {type(cache_enabled).__name__}")
        plan_dtype = None if dtype is None else _dtype(dtype, "dtype")
        if plan_dtype is torch.float32:
            raise ValueError("dtype is the lower precision of policy and recipe settings: torch.bfloat16 or torch.float16")
        self.device_type = device_type
        self.dtype = plan_dtype
        self.cache_enabled = cache_enabled
        self._patterns = [_Pattern(p) for p in modules]
        self._raw = dict(modules)
        self._default_raw = default
        self._settings: dict[str, _Setting] | None = None
        # (module, our forward, its forward attribute before, the marker of none)
        self._bound: list[tuple] = []
        self._model: torch.nn.Module | None = None
        # Check every setting now (with the device's dtype for a bare policy or recipe).
        self._resolve_settings("cpu" if device_type is None else device_type)

    def _resolve_settings(self, device_type: str) -> tuple[dict[str, _Setting], _Setting | None]:
        dtype = self.dtype if self.dtype is not None else device_dtypes(device_type)[0]
        settings = {p: _setting(v, f"pattern {p!r}", dtype) for p, v in self._raw.items()}
        default = None if self._default_raw is None else _setting(self._default_raw, "default", dtype)
        return settings, default

    # -- plain data -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as data: ``{"modules": {pattern: setting}, "default", "device_type",
        "dtype", "cache_enabled"}``, settings as given (dtypes as their names; a Policy or a
        recipe as the object). ``PrecisionPlan.from_dict`` takes it back;
        ``dispatch_amp.config.dump`` writes the plan as a TOML or JSON file.

        Example::

            >>> PrecisionPlan({"head": torch.float32}).to_dict()["modules"]
            {'head': 'float32'}
        """
        plain = _plain
        return {
            "modules": {p: plain(v) for p, v in self._raw.items()},
            "default": plain(self._default_raw),
            "device_type": self.device_type,
            "dtype": plain(self.dtype),
            "cache_enabled": self.cache_enabled,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> PrecisionPlan:
        """The plan ``to_dict()`` described; an unknown key raises, naming it.

        Example::

            >>> PrecisionPlan.from_dict({"modules": {"head": "float32"}}).to_dict()["modules"]
            {'head': 'float32'}
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"from_dict takes what to_dict() returned (a dict), got {type(data).__name__}")
        known = ("modules", "default", "device_type", "dtype", "cache_enabled")
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in a precision plan; its keys are {list(known)}")
        if "modules" not in data:
            raise ValueError("a precision plan needs the key 'modules' (pattern -> setting)")
        return cls(data["modules"], default=data.get("default"), device_type=data.get("device_type"),
                   dtype=data.get("dtype"), cache_enabled=data.get("cache_enabled", True))

    def __repr__(self) -> str:
        state = "bound" if self._model is not None else "unbound"
        return f"PrecisionPlan({self.to_dict()['modules']!r}, {state})"

    # -- resolving --------------------------------------------------------------------------
    def _device_type_for(self, model: torch.nn.Module) -> str:
        if self.device_type is not None:
            return self.device_type
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                device_dtypes(t.device.type)  # raises for a device type autocast does not support
                return t.device.type
        return "cpu"

    def resolve(self, model: torch.nn.Module) -> dict[str, PlanEntry]:
        """Module name -> how the plan resolves it on ``model`` (see :class:`PlanEntry`);
        raises as ``bind`` would (a pattern naming nothing, a tie), binding nothing.

        Example::

            entries = amp.PrecisionPlan({"head": torch.float32}).resolve(model)
            entries["head"].opens_region            # True
        """
        return {name: entry for name, (entry, _) in self._resolve(model, self._device_type_for(model)).items()}

    def _resolve(self, model: torch.nn.Module, device_type: str) -> dict[str, tuple[PlanEntry, _Setting | None]]:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"a plan resolves against an nn.Module, got {type(model).__name__}")
        settings, default = self._resolve_settings(device_type)
        named = list(model.named_modules(remove_duplicate=False))
        names = [n for n, _ in named]
        # pattern -> {module name: reach}, for the names it matches itself.
        reaches: list[tuple[_Pattern, dict[str, int]]] = []
        for pattern in self._patterns:
            hits = {}
            for name in names:
                r = pattern.reach(name)
                if r is not None:
                    hits[name] = r
            if not hits:
                near = difflib.get_close_matches(pattern.text, [n for n in names if n], n=5, cutoff=0.3)
                hint = f"nearest module names: {near}" if near else f"its modules start {names[1:6]}"
                raise ValueError(f"pattern {pattern.text!r} names no module of {type(model).__name__} ({hint})")
            reaches.append((pattern, hits))
        resolved: dict[str, tuple[PlanEntry, _Setting | None]] = {}
        module_setting: dict[int, tuple[str, _Setting | None]] = {}
        for name, module in named:
            # The patterns naming this module or one it sits in ("" and each dotted prefix).
            ancestors = [name[:i] for i, c in enumerate(name) if c == "."] + [name] if name else [""]
            candidates = []
            for pattern, hits in reaches:
                best = max((hits[a] for a in ancestors if a in hits), default=None)
                if best is not None:
                    candidates.append(((best, -pattern.wildcards, pattern.literal), pattern))
            setting, winner, lost = default, None, ()
            if candidates:
                candidates.sort(key=lambda c: c[0], reverse=True)
                top_key, winner = candidates[0]
                setting = settings[winner.text]
                for key, other in candidates[1:]:
                    if key == top_key and settings[other.text] != setting:
                        raise ValueError(
                            f"patterns {winner.text!r} and {other.text!r} both apply to module {name!r} "
                            f"with the same specificity and give it different settings "
                            f"({setting.describe()} and {settings[other.text].describe()}): make one more "
                            f"specific, or name {name!r} itself"
                        )
                lost = tuple(p.text for _, p in candidates[1:])
            parent = name.rpartition(".")[0] if name else None
            inherited = None if parent is None else resolved[parent][1]
            opens = setting is not None and setting != inherited
            entry = PlanEntry(name, None if setting is None else _plain(setting.given),
                              None if winner is None else winner.text, lost, opens)
            resolved[name] = (entry, setting)
            first = module_setting.setdefault(id(module), (name, setting))
            if first[1] != setting:
                raise ValueError(
                    f"module {first[0]!r} is also {name!r} (one module under two names), and the plan "
                    f"gives it different settings there: give both names the same setting"
                )
        return resolved

    # -- binding ----------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module) -> PrecisionPlan:
        """Resolves the patterns against ``model`` and makes each module whose setting
        differs from its parent's run its forward in that setting's region; binds each fp8
        recipe to ``model`` (``recipe.bind``: sites named after its weights). Returns the
        plan. Bind once, before wrapping the model (DDP, FSDP2, a framework) and before
        ``torch.compile``; any error leaves the model as it was.

        Example::

            plan = amp.PrecisionPlan({"head": torch.float32}).bind(model)
        """
        if self._model is not None:
            raise RuntimeError("this plan is bound already: call plan.unbind() first (a plan binds one model)")
        device_type = self._device_type_for(model)
        resolved = self._resolve(model, device_type)
        modules = dict(model.named_modules(remove_duplicate=False))
        to_wrap: list[tuple[str, torch.nn.Module, _Setting]] = []
        seen: set[int] = set()
        for name, (entry, setting) in resolved.items():
            module = modules[name]
            if not entry.opens_region or id(module) in seen:
                continue
            seen.add(id(module))
            if setting.fp8 is not None and not any(
                p.dim() == 2 and p.is_floating_point() for p in module.parameters()
            ):
                raise ValueError(
                    f"pattern {entry.pattern or 'default'!r} gives module {name or '<root>'!r} "
                    f"({type(module).__name__}) an fp8 recipe, but it holds no 2-D weight: no linear "
                    f"there can run in fp8. Name the modules that hold the linears, or give it a dtype"
                )
            if isinstance(module.__dict__.get("forward"), _PlannedForward):
                raise RuntimeError(
                    f"module {name or '<root>'!r} is bound to another PrecisionPlan: unbind that one first"
                )
            to_wrap.append((name, module, setting))
        # Everything that can fail comes before the first module changes.
        wrappers = [(module, _PlannedForward(_Region(setting, device_type, self.cache_enabled), module.forward, self))
                    for _, module, setting in to_wrap]
        recipes = []
        for _, _, setting in to_wrap:
            if setting.fp8 is not None and all(r is not setting.fp8 for r in recipes):
                recipes.append(setting.fp8)
        for recipe in recipes:
            recipe.bind(model)
        missing = object()
        for module, wrapper in wrappers:
            previous = module.__dict__.get("forward", missing)
            module.forward = wrapper
            self._bound.append((module, wrapper, previous, missing))
        self._model = model
        return self

    def unbind(self) -> None:
        """Restores the bound model's modules as they were before ``bind`` (their
        ``forward`` attributes); a plan never bound, or unbound, is left as it is. A
        module whose ``forward`` something else replaced after ``bind`` (a wrapper that
        keeps ours inside) raises, and nothing changes: undo that wrapper first.

        Example::

            plan.unbind()
        """
        for module, wrapper, _, _ in self._bound:
            if module.__dict__.get("forward") is not wrapper:
                raise RuntimeError(
                    f"the forward of {type(module).__name__} {module.__dict__.get('forward')!r} was replaced "
                    f"after the plan was bound, so unbinding would drop that replacement: undo it first "
                    f"(e.g. accelerate's unwrap_model(model, keep_fp32_wrapper=False)), or keep the plan bound"
                )
        for module, _, previous, missing in reversed(self._bound):
            if previous is missing:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
        self._bound.clear()
        self._model = None

    @property
    def model(self) -> torch.nn.Module | None:
        """The model the plan is bound to, or None."""
        return self._model

    def explain(self, model: torch.nn.Module | None = None, all_modules: bool = False) -> str:
        """A Markdown table, one row per module whose forward opens a region (every module
        with ``all_modules``): its setting, the pattern that won, the patterns that applied
        and lost, and whether it opens a region. ``model``: the bound one if None.

        Example::

            print(plan.explain())
        """
        model = model if model is not None else self._model
        if model is None:
            raise RuntimeError("explain() needs a model: pass one, or bind the plan first")
        rows = []
        for name, (e, s) in self._resolve(model, self._device_type_for(model)).items():
            if not all_modules and not e.opens_region:
                continue
            setting = "-" if s is None else s.describe()
            rows.append([name or "<root>", setting, e.pattern or ("default" if e.setting is not None else "-"),
                         ", ".join(e.overridden) or "", "yes" if e.opens_region else ""])
        return _markdown.table(["module", "setting", "set by", "also matched", "region"], rows)

    # -- helpers ----------------------------------------------------------------------------
    @classmethod
    def keep_ends(cls, model: torch.nn.Module, first: int = 1, last: int = 1, head: str | None = "lm_head",
                  ends: object = torch.float32, rest: object = None, blocks: str | None = None,
                  **plan_args) -> PrecisionPlan:
        """A plan keeping the first ``first`` and last ``last`` blocks and the ``head`` in
        ``ends`` (float32 by default), and the other blocks in ``rest`` (None: the
        enclosing region's precision). ``blocks``: the name of the block list; None: the
        longest ``nn.ModuleList`` or ``nn.Sequential`` whose children are all of one type.
        ``plan_args`` go to ``PrecisionPlan``. The plan is not bound yet.

        Example::

            plan = amp.PrecisionPlan.keep_ends(model, head="head").bind(model)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"keep_ends takes the model, got {type(model).__name__}")
        for value, what in ((first, "first"), (last, "last")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{what} must be an int >= 0, got {value!r}")
        name = blocks if blocks is not None else _find_blocks(model)
        block_list = dict(model.named_modules()).get(name)
        if not isinstance(block_list, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise ValueError(f"blocks={name!r} is not an nn.ModuleList or nn.Sequential of {type(model).__name__}")
        n = len(block_list)
        keep = sorted(set(range(min(first, n))) | set(range(max(n - last, 0), n)))
        modules: dict[str, object] = {}
        if rest is not None:
            modules[f"{name}.*"] = rest
        for i in keep:
            modules[f"{name}.{i}"] = ends
        if head is not None:
            modules[head] = ends
        return cls(modules, **plan_args)


def _find_blocks(model: torch.nn.Module) -> str:
    """The name of the longest ``ModuleList``/``Sequential`` whose children (two or more)
    are all of one type."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            kinds = {type(child) for child in module.children()}
            if len(module) >= 2 and len(kinds) == 1:
                found.append((len(module), name))
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks of one type: "
                         f"pass blocks='name.of.the.list'")
    found.sort(reverse=True)
    if len(found) > 1 and found[0][0] == found[1][0]:
        tied = [n for length, n in found if length == found[0][0]]
        raise ValueError(f"several block lists of {found[0][0]} blocks: {tied}; pass blocks= one of them")
    return found[0][1]


def bound_plan(model: torch.nn.Module) -> PrecisionPlan | None:
    """The ``PrecisionPlan`` bound to ``model`` (``plan.bind(model)``), or None.

    Where plans are bound to submodules instead, the one plan among them (several: None,
    as no single plan describes the model).

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = PrecisionPlan({"1": torch.float32}).bind(net)
        >>> bound_plan(net) is plan, bound_plan(torch.nn.Linear(4, 4))
        (True, None)
    """
    plans: list[PrecisionPlan] = []
    for module in model.modules():
        wrapper = module.__dict__.get("forward")
        plan = wrapper.plan if isinstance(wrapper, _PlannedForward) else None
        # A deep copy of a bound module keeps the wrapper, whose plan is bound elsewhere.
        if plan is not None and plan.model is not None and all(p is not plan for p in plans) \
                and any(plan.model is m for m in model.modules()):
            plans.append(plan)
    for plan in plans:
        if plan.model is model:
            return plan
    return plans[0] if len(plans) == 1 else None
