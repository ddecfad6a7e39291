"""fp8 sites: a recipe's state for one weight, found by the weight's identity.

A site belongs to one weight tensor: every fp8 call with that weight shares its statistics
and (delayed scaling) its amax histories, whichever module made the call. The weight
carries a slot (an attribute) mapping recipe tokens to sites: that is how a call finds its
site, eagerly and inside a compiled graph alike (Dynamo reads a tensor's attributes; it
cannot look a tensor up in a weak dictionary). A copy or pickle of the weight gets an
empty slot.

Names (``_naming.py``) are for checkpoints, reports and ``filter_fn``: a site has every
path its weight is held under, the first being the name its state is filed under. A
weight that no module holds (computed in the forward) has none.

Per role the state is three small device tensors (``RoleState``, with named fields over
them), updated in place by ``copy_`` of a whole new value (the only mutation AOTAutograd
takes inside a backward) or by the Triton kernels on CUDA. ``_state.Fp8State`` owns a
recipe's sites.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterable

import torch

from ..kernels.fp8_scale import F_AMAX, F_HISTORY, F_INIT, F_PENDING, F_SCALE, F_SHOWN, I_CALLS, I_SATURATED, pack
from . import _naming

__all__ = ["ROLES", "RoleState", "Site", "SiteRegistry", "Origin"]

ROLES = ("input", "weight", "grad_output")

# (weak reference to a model, path of the weight in it, the site name it gives)
Origin = tuple[weakref.ReferenceType, str, str]

_TOKENS = itertools.count()
_SLOT = "_dispatch_amp_fp8_sites"


class RoleState:
    """One role's state on one device, as named fields over the packed tensors the kernels
    update in place: ``f`` (float32) and ``i`` (int64) in the layout of
    ``kernels/fp8_scale.py`` (where the offsets are defined, once), and ``acc`` (int32: the
    running call's amax as float32 bits, for the kernels).

    Named fields (views, so writing through them writes the state): ``scale`` (delayed
    scaling's scale), ``amax`` and ``shown`` (the last call's amax and scale used),
    ``initialized``, ``pending`` (an amax waiting for the cross-rank reduction),
    ``history`` (newest first), ``saturated`` and ``calls`` (so far).

    ``ready`` is what the host knows of the initialized flag; ``probe`` a copy of the flag
    on its way to the host.

    Example::

        >>> r = RoleState(4, torch.device("cpu"))
        >>> r.f.tolist()
        [1.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]
        >>> r.scale.item(), r.history.shape
        (1.0, torch.Size([4]))
    """

    __slots__ = ("f", "i", "acc", "ready", "probe")

    def __init__(self, history_len: int, device: torch.device, f: torch.Tensor | None = None) -> None:
        # Never inference tensors, whatever mode the first call runs in: training updates
        # them in place later (see "fp8" in docs/design.md).
        with torch.inference_mode(False):
            if f is None:
                f = pack(torch.zeros(history_len))
            self.f = f.to(device=device, dtype=torch.float32, copy=True)
            self.i = torch.zeros(3, dtype=torch.int64, device=device)
            self.acc = torch.zeros(1, dtype=torch.int32, device=device)
        self.ready = False
        self.probe = None

    @property
    def device(self) -> torch.device:
        return self.f.device

    @property
    def scale(self) -> torch.Tensor:
        return self.f[F_SCALE]

    @property
    def amax(self) -> torch.Tensor:
        return self.f[F_AMAX]

    @property
    def shown(self) -> torch.Tensor:
        return self.f[F_SHOWN]

    @property
    def initialized(self) -> torch.Tensor:
        return self.f[F_INIT]

    @property
    def pending(self) -> torch.Tensor:
        return self.f[F_PENDING]

    @property
    def history(self) -> torch.Tensor:
        return self.f[F_HISTORY:]

    @property
    def saturated(self) -> torch.Tensor:
        return self.i[I_SATURATED]

    @property
    def calls(self) -> torch.Tensor:
        return self.i[I_CALLS]

    def moved(self, device: torch.device) -> RoleState:
        """This state on ``device`` (itself if it is there); statistics restart."""
        if self.f.device == device:
            return self
        moved = RoleState(0, device, self.f)
        moved.ready = self.ready
        return moved


class Site:
    """A recipe's state for one weight: its names and its per-role state."""

    def __init__(self, weight: torch.Tensor | None, origins: list[Origin]) -> None:
        self.weight = None if weight is None else weakref.ref(weight)
        self.origins: list[Origin] = origins
        self.names: list[str] = _unique(name for _, _, name in origins)
        self.roles: dict[str, RoleState] = {}
        # The weight's and the bias's low-precision copies (fp8/_quantize.py).
        self.cached = None
        self.cached_bias = None

    @property
    def name(self) -> str | None:
        """The name the site's state is filed under (its first), or None."""
        return self.names[0] if self.names else None

    @property
    def history(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Role -> (amax history, scale): views of the delayed scaling state."""
        return {role: (r.history, r.scale) for role, r in self.roles.items()}

    def alive(self) -> torch.Tensor | None:
        return None if self.weight is None else self.weight()

    def vacant(self) -> bool:
        """Whether no weight holds this site any more: never had one (state loaded for a
        name), its weight is gone, or no model holds it where it was named."""
        weight = self.alive()
        if weight is None:
            return True
        if not self.origins:
            return False
        return not any(ref() is not None and _naming.holds(ref(), path, weight) for ref, path, _ in self.origins)

    def on(self, device: torch.device) -> bool:
        # len(), not bool(): Dynamo before torch 2.13 cannot trace bool() of a dict.
        return len(self.roles) > 0 and all(r.device == device for r in self.roles.values())


class _SiteSlot:
    """Recipe token -> site, attached to a weight. A copy or pickle of the weight
    (``copy.deepcopy(model)``, ``torch.save(model)``) gets an empty slot: fp8 state moves
    with ``recipe.state_dict()``, not with the model."""

    __slots__ = ("sites",)

    def __init__(self) -> None:
        self.sites: dict[str, Site] = {}

    def __deepcopy__(self, memo) -> _SiteSlot:
        return _SiteSlot()

    def __reduce__(self):
        return _SiteSlot, ()


def _slot(weight: torch.Tensor) -> _SiteSlot:
    slot = getattr(weight, _SLOT, None)
    if slot is None:
        slot = _SiteSlot()
        setattr(weight, _SLOT, slot)
    return slot


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


class SiteRegistry:
    """A recipe's sites: by weight (the weight's slot) and by name. It holds nothing of
    its recipe's, so a recipe no longer referenced is freed at once (its step hook and
    collectives with it), not when the garbage collector next runs."""

    def __init__(self) -> None:
        self.token = f"recipe-{next(_TOKENS)}"
        self.sites: list[Site] = []
        self.by_name: dict[str, Site] = {}
        # The models given to bind(), with their prefixes.
        self.roots: list[tuple[weakref.ReferenceType, str]] = []

    # -- finding --------------------------------------------------------------------------
    def lookup(self, weight: torch.Tensor) -> Site | None:
        """The weight's site, if it has one: a slot read, nothing else (safe to trace)."""
        slot = getattr(weight, _SLOT, None)
        return None if slot is None else slot.sites.get(self.token)

    def site(self, weight: torch.Tensor) -> Site:
        """The weight's site, made and named on its first call (eagerly only)."""
        site = self.lookup(weight)
        if site is None:
            site = self._attach(weight, self._origins(weight))
        return site

    def _origins(self, weight: torch.Tensor) -> list[Origin]:
        if weight.grad_fn is not None:
            return []  # computed in the forward: no module holds it
        out: list[Origin] = []
        for ref, prefix in self.roots:
            root = ref()
            if root is not None:
                out += [(ref, path, _prefixed(prefix, path)) for path in _naming.parameter_paths(root, weight)]
        if not out:
            for root in _naming.stack_roots():
                paths = _naming.parameter_paths(root, weight)
                if paths:
                    ref = weakref.ref(root)
                    out = [(ref, path, _naming.display_name(path)) for path in paths]
                    break
        return out

    def _attach(self, weight: torch.Tensor, origins: list[Origin], strict: bool = False) -> Site:
        """Gives ``weight`` its site: a vacant site holding one of its names (its weight
        was replaced, or its state was loaded before the weight existed), else a new one.
        ``strict``: a name another live weight holds raises (bind) instead of being noted."""
        names = _unique(name for _, _, name in origins)
        vacant = _unique(self.by_name[n] for n in names if n in self.by_name and self.by_name[n].vacant())
        if strict:
            self._check_free(weight, names)
        if len(vacant) > 1:
            raise ValueError(
                f"the names {names} of one weight (tied) hold {len(vacant)} separate states in this recipe "
                f"(loaded from a checkpoint of a model where they were separate weights); load a checkpoint "
                f"of this model, or drop all but one of {[s.name for s in vacant]} from the state first"
            )
        site = self.lookup(weight)
        if site is None:
            site = vacant[0] if vacant else Site(weight, origins)
            if site not in self.sites:
                self.sites.append(site)
            _slot(weight).sites[self.token] = site
        elif vacant and vacant[0] is not site:
            raise ValueError(
                f"{vacant[0].name!r} holds state loaded for a weight, and this weight has state of its own "
                f"under {site.name!r}; load the checkpoint before the first forward"
            )
        old = site.alive()
        if old is not None and old is not weight:  # adopted: the replaced weight loses it
            slot = getattr(old, _SLOT, None)
            if slot is not None and slot.sites.get(self.token) is site:
                del slot.sites[self.token]
        site.weight = weakref.ref(weight)
        self._rename(site, origins)
        self._prune()
        return site

    def _check_free(self, weight: torch.Tensor, names: list[str]) -> None:
        taken = [n for n in names if n in self.by_name and not self.by_name[n].vacant()
                 and self.by_name[n] is not self.lookup(weight)]
        if taken:
            raise ValueError(
                f"{', '.join(map(repr, taken))} already name(s) another weight under this recipe (a model bound "
                f"or run before with the same module names); bind each model with its own prefix, e.g. "
                f"recipe.bind(model, prefix='teacher.'), or give each model its own recipe"
            )

    def _rename(self, site: Site, origins: list[Origin]) -> None:
        for name in site.names:
            if self.by_name.get(name) is site:
                del self.by_name[name]
        site.origins = origins
        site.names = _unique(name for _, _, name in origins)
        for name in site.names:
            self.by_name.setdefault(name, site)

    def _prune(self) -> None:
        # Unnamed sites of weights that are gone hold nothing anyone can ask for.
        self.sites = [s for s in self.sites if s.names or s.alive() is not None]

    # -- bind -----------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module, prefix: str) -> list[tuple[torch.Tensor, Site]]:
        """Names every 2-D floating tensor of ``model`` (parameters and buffers, tied ones
        once with all their names). Checks every name before changing anything."""
        model = _naming.unwrap(model)
        ref = weakref.ref(model)
        found: dict[int, tuple[torch.Tensor, list[Origin]]] = {}
        for path, t in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            if t.dim() == 2 and t.is_floating_point():
                found.setdefault(id(t), (t, []))[1].append((ref, path, _prefixed(prefix, path)))
        for weight, origins in found.values():  # every name checked before any changes
            self._check_free(weight, _unique(name for _, _, name in origins))
        if not any(r() is model and p == prefix for r, p in self.roots):
            self.roots = [(r, p) for r, p in self.roots if r() is not None] + [(ref, prefix)]
        return [(weight, self._attach(weight, origins)) for weight, origins in found.values()]

    # -- state ----------------------------------------------------------------------------
    def named(self) -> dict[str, Site]:
        """Name -> site for every named site (by its first name), checking that no name is
        claimed twice."""
        claims = collections.Counter(n for s in self.sites if s.names and not s.vacant() for n in s.names)
        names = sorted(n for n, count in claims.items() if count > 1)
        if names:
            raise RuntimeError(
                f"two or more weights are named {', '.join(map(repr, names))} under this recipe (models with "
                f"the same module names run under one recipe), so their states cannot be saved by name; bind "
                f"each model with its own prefix before its first forward (recipe.bind(student, prefix="
                f"'student.'), recipe.bind(teacher, prefix='teacher.')), or give each model its own recipe"
            )
        return {s.name: s for s in self.sites if s.names}

    def unnamed_alive(self) -> list[Site]:
        return [s for s in self.sites if not s.names and s.alive() is not None]

    def vacant_site(self, name: str) -> Site:
        """A site holding state for ``name`` with no weight yet (loaded from a checkpoint):
        the weight that gets that name adopts it."""
        site = Site(None, [])
        site.names = [name]
        self.sites.append(site)
        self.by_name[name] = site
        return site

    def site_for_name(self, name: str) -> Site | None:
        return self.by_name.get(name)


def _prefixed(prefix: str, path: str) -> str:
    name = _naming.display_name(path)
    if not prefix:
        return name
    if name == _naming.ROOT_NAME:
        return prefix.rstrip(".")
    return prefix + name
