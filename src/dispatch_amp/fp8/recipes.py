"""fp8 recipes: how each tensor of an fp8 gemm gets its scale, and the state that needs.

A recipe is handed to ``amp.autocast(..., fp8=recipe)``. It holds its own state (delayed
scaling's amax histories, every site's statistics): nothing is stored in modules, so fp8
works on plain modules, custom ones and modules other tools swapped in.

A *site* is one weight: every fp8 call with the same weight tensor shares its history and
statistics. ``recipe.bind(model)`` names the sites after the modules that own the weights
(``"blocks.0.attn.qkv"``); names are what ``state_dict()`` and ``report()`` use, and what
the recipe's ``filter_fn`` is given.

Roles: each fp8 gemm call quantizes its ``input`` and ``weight`` in the forward and its
``grad_output`` in the backward.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _torch_compat

from ._rules import amax as _amax
from ._rules import cast as _cast
from ._rules import cast_transpose, cast_with_amax, check_format, kernels_in_use, scale_from_amax

__all__ = ["Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "SiteReport", "ROLES"]

ROLES = ("input", "weight", "grad_output")

# filter_fn(site name or None, input shape, weight shape) -> whether the call runs in fp8.
FilterFn = Callable[[Any, torch.Size, torch.Size], bool]

# Checkpointed forwards whose recomputation has not come yet, per site (see
# DelayedScaling): a bound, so that forwards whose backward never runs cannot pile up.
_MAX_PENDING_REPLAYS = 4096


class _RoleStats:
    """Per role: the last amax and scale, saturated values and calls so far.

    Device tensors, made by ``Recipe._prepare`` before a call and then updated in place:
    recording reads nothing back to the host, and a compiled graph (its backward too)
    updates them as it updates delayed scaling's histories.
    """

    __slots__ = ("amax", "scale", "saturated", "calls")

    def __init__(self) -> None:
        self.amax = self.scale = self.saturated = self.calls = None

    def allocated_on(self, device: torch.device) -> bool:
        return self.amax is not None and self.amax.device == device

    def allocate(self, device: torch.device) -> None:
        if not self.allocated_on(device):
            self.amax = torch.zeros((), device=device)
            self.scale = torch.ones((), device=device)
            self.saturated = torch.zeros((), dtype=torch.int64, device=device)
            self.calls = torch.zeros((), dtype=torch.int64, device=device)

    def record(self, amax: torch.Tensor, scale: torch.Tensor, saturated: torch.Tensor) -> None:
        self.amax.copy_(amax)
        self.scale.copy_(scale)
        # copy_ rather than add_: an AOTAutograd backward graph takes in-place copies into
        # tensors from outside it, not in-place arithmetic on them.
        self.saturated.copy_(self.saturated + saturated)
        self.calls.copy_(self.calls + 1)


class _Site:
    """A recipe's state for one weight."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.stats = {role: _RoleStats() for role in ROLES}
        # DelayedScaling: role -> (amax history, scale), float32 on the weight's device.
        self.history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # DelayedScaling: the (input, weight) scales of checkpointed forwards, oldest first.
        self.replay = collections.deque(maxlen=_MAX_PENDING_REPLAYS)
        # DelayedScaling's first calls: per role, a device flag (the history has recorded a
        # positive finite amax) and what the host knows of it (see DelayedScaling).
        self.initialized: dict[str, torch.Tensor] = {}
        self.ready = dict.fromkeys(ROLES, False)
        self.probes: dict[str, tuple[torch.Tensor, Any]] = {}


# The attribute under which a weight carries its sites, one per recipe that saw it. It is
# how a call finds its site, eagerly and inside a compiled graph alike (Dynamo reads a
# tensor's attributes; it cannot look a tensor up in a weak dictionary).
_SLOT = "_dispatch_amp_fp8_sites"
_TOKENS = itertools.count()


class _SiteSlot:
    """Recipe token -> site, attached to a weight. A copy or pickle of the weight
    (``copy.deepcopy(model)``, ``torch.save(model)``) gets an empty slot: fp8 state moves
    with ``recipe.state_dict()``, not with the model."""

    __slots__ = ("sites",)

    def __init__(self) -> None:
        self.sites: dict[str, _Site] = {}

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


@dataclass(frozen=True)
class SiteReport:
    """What one site's fp8 calls saw: per role, the last amax and scale, and how many
    values were clamped to the format's largest value (saturated) over all calls.

    Example::

        >>> SiteReport("fc", 3, {"input": 2.0}, {"input": 224.0}, {"input": 0}).saturated
        {'input': 0}
    """

    name: str
    calls: int
    amax: dict[str, float]
    scale: dict[str, float]
    saturated: dict[str, int]


@_torch_compat.assume_constant_result
def _refuse_unprepared_site(name: str, device: str) -> bool:
    # Runs while Dynamo traces: the error reaches the caller of the compiled function.
    raise RuntimeError(
        f"fp8 site {name!r} has no state on {device} yet, and a compiled graph cannot make it: "
        f"call recipe.bind(model) after moving the model to its device and before the first "
        f"compiled call (or run one step eagerly first)"
    )


class Recipe:
    """Base of the fp8 recipes: formats, the eligibility filter, sites and their report.

    Not used directly: pick :class:`CurrentScaling`, :class:`DelayedScaling` or
    :class:`RowwiseScaling`.

    Example::

        >>> isinstance(CurrentScaling(), Recipe)
        True
    """

    #: One scale per row of each operand (along the contraction dimension) instead of one
    #: per tensor.
    rowwise = False
    #: Whether calls change state kept in the recipe (amax histories) that later calls use.
    stateful = False

    def __init__(self, forward_format: torch.dtype, grad_format: torch.dtype,
                 filter_fn: FilterFn | None, power_of_two: bool) -> None:
        self.forward_format = check_format(forward_format, "forward_format")
        self.grad_format = check_format(grad_format, "grad_format")
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"filter_fn must be callable (name, input_shape, weight_shape) -> bool, got {filter_fn!r}")
        self.filter_fn = filter_fn
        self.power_of_two = bool(power_of_two)
        # This recipe's key in the weights' site slots (a copy of the recipe gets its own).
        self._token = f"recipe-{next(_TOKENS)}"
        self._named: dict[str, _Site] = {}
        self._unnamed: list[tuple[weakref.ref, _Site]] = []

    # -- sites --------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module) -> Recipe:
        """Names the sites after ``model``'s modules (the module owning each ``weight``).

        Call it before ``load_state_dict`` when resuming, and before compiling a model
        with ``DelayedScaling``; returns the recipe.

        Example::

            recipe = amp.fp8.DelayedScaling().bind(model)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"bind() takes the nn.Module whose weights the recipe will see, got {type(model).__name__}")
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor):
                continue
            name = name or "<root>"
            slot = _slot(weight)
            site = slot.sites.get(self._token)
            if site is None:
                site = self._named.get(name) or _Site(name)
                slot.sites[self._token] = site
            elif site.name is None:  # seen before bind: it keeps its state, gains a name
                site.name = name
                self._unnamed = [(ref, s) for ref, s in self._unnamed if s is not site]
            self._named.setdefault(site.name, site)
            self._allocate(site, weight.device)
        return self

    def site_name(self, weight: torch.Tensor) -> str | None:
        """The name ``bind`` gave ``weight``'s site, or None."""
        site = self._lookup(weight)
        return None if site is None else site.name

    def _lookup(self, weight: torch.Tensor) -> _Site | None:
        slot = getattr(weight, _SLOT, None)
        return None if slot is None else slot.sites.get(self._token)

    def _site(self, weight: torch.Tensor) -> _Site:
        site = self._lookup(weight)
        if site is None:
            site = _slot(weight).sites[self._token] = _Site(None)
            self._unnamed = [entry for entry in self._unnamed if entry[0]() is not None]
            self._unnamed.append((weakref.ref(weight), site))
        return site

    def _sites(self) -> list[_Site]:
        return list(self._named.values()) + [site for ref, site in self._unnamed if ref() is not None]

    def eligible(self, name: str | None, input_shape: torch.Size, weight_shape: torch.Size) -> bool:
        """Whether a ``linear`` call with these shapes runs in fp8 (else in the region's dtype).

        The gemms need every dimension a multiple of 16 (the rows of the flattened input,
        the input features and the output features), as cuBLAS's fp8 gemms do; then
        ``filter_fn``, if given, decides.
        """
        if len(weight_shape) != 2 or len(input_shape) < 1 or input_shape[-1] != weight_shape[1]:
            return False
        rows = 1
        for d in input_shape[:-1]:
            rows *= d
        if rows == 0 or rows % 16 or weight_shape[0] % 16 or weight_shape[1] % 16:
            return False
        return self.filter_fn is None or bool(self.filter_fn(name, input_shape, weight_shape))

    # -- quantizing (called by the fp8 gemm) ----------------------------------------------
    def _quantize(self, t2: torch.Tensor, role: str, fmt: torch.dtype, site: _Site | None, record: bool,
                  scale: torch.Tensor | None = None, transpose: bool = False, known_amax: torch.Tensor | None = None):
        """``(q, 1/scale, q_t)`` of a 2-D operand, recording statistics when ``record``.

        ``scale``: the one to use (a forward's, chosen by ``_forward_scales``), else the
        recipe's; ``known_amax``: ``amax(t2)`` if it was computed already. ``q_t`` is
        ``q.t().contiguous()`` when ``transpose`` and the kernels make it in the same
        pass, else None (the backward transposes then).
        """
        q_t = None
        if self.rowwise:
            a = _amax(t2, rowwise=True)
            scale = scale_from_amax(a, fmt, power_of_two=self.power_of_two)
            q, saturated = _cast(t2, scale, fmt)
            a, shown = a.max(), scale.min()
        else:
            a = known_amax
            if scale is None:
                scale, a = self._scale(t2, role, fmt, site)
            kernels = kernels_in_use(t2)
            if transpose and kernels:
                q, q_t, a, saturated = cast_transpose(t2, scale, fmt)
            elif kernels or a is None:
                q, a, saturated = cast_with_amax(t2, scale, fmt)
            else:  # the amax is known already: the torch path would read t2 again for it
                q, saturated = _cast(t2, scale, fmt)
            shown = scale
        if record and site is not None:
            a = self._observed(a)
            site.stats[role].record(a, shown, saturated)
            self._advance(site, role, a, fmt)
        return q, scale.reciprocal(), q_t

    def _scale(self, t2: torch.Tensor, role: str, fmt: torch.dtype, site: _Site | None):
        """``(scale, amax or None)`` of an operand: here, from its own amax (current scaling)."""
        a = _amax(t2)
        return scale_from_amax(a, fmt, power_of_two=self.power_of_two), a

    def _observed(self, a: torch.Tensor) -> torch.Tensor:
        """The amax a call records (delayed scaling reduces it across ranks)."""
        return a

    def _advance(self, site: _Site, role: str, a: torch.Tensor, fmt: torch.dtype) -> None:
        """What a recorded amax changes for later calls (nothing, without a history)."""

    def _forward_scales(self, site, x2, weight, phase):
        """``((input scale, weight scale), (input amax, weight amax))`` of a forward; a
        scale of None: from the tensor itself; an amax of None: not computed yet."""
        return (None, None), (None, None)

    def _prepare(self, site: _Site, device: torch.device) -> None:
        """Makes the site's tensors on ``device`` before a call (never inside the autograd
        Function, whose backward only updates them in place). A compiled graph cannot make
        them (its backward could not update tensors its forward made): ``bind`` does."""
        if self._prepared(site, device):
            return
        if torch.compiler.is_compiling():
            _refuse_unprepared_site(site.name or "<unnamed>", str(device))
        self._allocate(site, device)

    def _prepared(self, site: _Site, device: torch.device) -> bool:
        return all(stats.allocated_on(device) for stats in site.stats.values())

    def _allocate(self, site: _Site, device: torch.device) -> None:
        for stats in site.stats.values():
            stats.allocate(device)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The recipe's state (empty for recipes that keep none besides statistics)."""
        return {}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores ``state_dict()``; a recipe that keeps no state takes ``{}``."""
        if dict(state_dict):
            raise ValueError(f"{type(self).__name__} keeps no state; got keys {sorted(state_dict)}")

    # -- reporting ------------------------------------------------------------------------
    def report(self) -> list[SiteReport]:
        """Per site: calls, the last amax and scale per role, saturated values so far.

        Reads the statistics from the device (one synchronization): call it between steps.
        """
        out = []
        for i, site in enumerate(self._sites()):
            amax, scale, sat = {}, {}, {}
            for role, st in site.stats.items():
                if st.calls is not None and int(st.calls):
                    amax[role] = float(st.amax)
                    scale[role] = float(st.scale)
                    sat[role] = int(st.saturated)
            counted = site.stats["input"].calls
            if counted is not None and int(counted):
                out.append(SiteReport(site.name or f"<unnamed {i}>", int(counted), amax, scale, sat))
        return out

    def report_table(self) -> str:
        """``report()`` as a Markdown table, one row per site and role.

        Example::

            print(recipe.report_table())
        """
        lines = ["| site | role | calls | amax | scale | saturated |", "|---|---|---:|---:|---:|---:|"]
        for r in self.report():
            for role in ROLES:
                if role in r.amax:
                    lines.append(f"| {r.name} | {role} | {r.calls} | {r.amax[role]:.4g} | "
                                 f"{r.scale[role]:.4g} | {r.saturated[role]} |")
        return "\n".join(lines)

    # -- copies ---------------------------------------------------------------------------
    # Pickled and deep-copied as configuration plus the state of named sites (Lightning
    # deep-copies and pickles precision plugins, which may hold a recipe). A copy is a
    # recipe of its own: no weight knows it until it is bound.
    def __reduce__(self):
        params = inspect.signature(type(self).__init__).parameters
        config = {name: getattr(self, name) for name in params if name != "self"}
        return _rebuild_recipe, (type(self), config, self._named_state())

    def _named_state(self) -> dict:
        return {}

    def _describe(self) -> str:
        return (f"forward_format={self.forward_format}, grad_format={self.grad_format}"
                + (", power_of_two=True" if self.power_of_two else "")
                + (", filter_fn=..." if self.filter_fn is not None else ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"


def _seen_positive(history: torch.Tensor) -> torch.Tensor:
    """Whether a history holds a positive finite amax: the site has a scale of its own."""
    return ((history > 0) & torch.isfinite(history)).any()


def _rebuild_recipe(cls, config: dict, state: dict) -> Recipe:
    recipe = cls(**config)
    if state:
        recipe.load_state_dict(state)
    return recipe


class CurrentScaling(Recipe):
    """One scale per tensor, from that tensor's own amax at each call.

    ``scale = fp8_max / max|t|`` (1 when the tensor is all zeros), optionally rounded down
    to a power of two. Stateless: a recomputation gives the same bits.

    Example::

        with amp.autocast("cuda", dtype=torch.bfloat16, fp8=amp.fp8.CurrentScaling()):
            y = model(x)
    """

    def __init__(self, *, forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e5m2, power_of_two: bool = False,
                 filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)


class RowwiseScaling(Recipe):
    """One scale per row of each operand, along the contraction dimension.

    Each operand of each gemm is scaled per row of the layout in which it is contracted
    (the forward scales the input's rows and the weight's rows; the backward re-quantizes
    ``grad_output``, the weight and the input along the dimension its gemm contracts), so
    the backward keeps the input and the weight in their own precision, not fp8 copies.
    ``weight_grad_high_precision`` runs the weight-gradient gemm in the region's dtype
    instead of fp8. Both formats default to e4m3: cuBLAS's row-wise fp8 gemm takes e4m3
    operands only.

    Example::

        recipe = amp.fp8.RowwiseScaling(weight_grad_high_precision=True)
    """

    rowwise = True

    def __init__(self, *, forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False,
                 weight_grad_high_precision: bool = False, filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        self.weight_grad_high_precision = bool(weight_grad_high_precision)

    def _describe(self) -> str:
        return super()._describe() + (", weight_grad_high_precision=True" if self.weight_grad_high_precision else "")


class DelayedScaling(Recipe):
    """Scales from the amax history of earlier calls at the same site (Transformer
    Engine's delayed scaling).

    Per site and role the recipe keeps the amaxes of the last ``amax_history_len`` calls
    (newest first) and a scale. A call quantizes with the current scale, then records its
    own amax: the history shifts by one, the new amax goes in front, and the scale becomes
    ``fp8_max / ref / 2**margin`` where ``ref`` is the history's max
    (``amax_compute_algo="max"``) or its newest entry (``"most_recent"``); when ``ref`` is
    0, inf or nan the scale stays as it was.

    First calls: until a site and role has recorded a positive finite amax, a call scales
    from its own amax instead (the rule above with ``ref`` = that amax), so the first
    calls are as accurate as current scaling; a site that has seen only zeros stays that
    way. The device decides (no host read); the host learns it from a non-blocking copy
    and then stops computing the extra amax. With ``reduce_amax`` and
    torch.distributed initialized, each new amax is first reduced (max) across the ranks of
    ``process_group``, so every rank uses the same scales.

    A forward that activation checkpointing will recompute remembers its scales; the
    recomputation replays them and records nothing, so it gives the same bits and the
    history advances once per real call.

    Example::

        recipe = amp.fp8.DelayedScaling(amax_history_len=16).bind(model)
        ...
        torch.save({"model": model.state_dict(), "fp8": recipe.state_dict()}, path)
    """

    stateful = True

    def __init__(self, amax_history_len: int = 16, amax_compute_algo: str = "max", margin: int = 0, *,
                 forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e5m2, power_of_two: bool = False,
                 reduce_amax: bool = True, process_group: Any = None,
                 filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        if not isinstance(amax_history_len, int) or isinstance(amax_history_len, bool) or amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {amax_history_len!r}")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {margin!r}")
        self.amax_history_len = amax_history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.reduce_amax = bool(reduce_amax)
        self.process_group = process_group

    def _describe(self) -> str:
        return (f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo!r}, "
                f"margin={self.margin}, " + super()._describe())

    def _prepared(self, site: _Site, device: torch.device) -> bool:
        return super()._prepared(site, device) and all(
            role in site.history and site.history[role][0].device == device
            and site.initialized[role].device == device for role in ROLES)

    def _allocate(self, site: _Site, device: torch.device) -> None:
        super()._allocate(site, device)
        for role in ROLES:
            entry = site.history.get(role)
            if entry is None:
                site.history[role] = (torch.zeros(self.amax_history_len, device=device), torch.ones((), device=device))
            elif entry[0].device != device:  # loaded from a checkpoint on another device
                site.history[role] = (entry[0].to(device), entry[1].to(device))
            flag = site.initialized.get(role)
            if flag is None or flag.device != device:
                site.initialized[role] = _seen_positive(site.history[role][0])
                site.probes.pop(role, None)

    def _forward_scales(self, site, x2, weight, phase):
        """``((input scale, weight scale), (input amax, weight amax))``: the amaxes where
        a first call computed them to choose its scale, else None."""
        if phase == "recompute" and site.replay:
            return site.replay.popleft(), (None, None)
        fmt = self.forward_format
        (xs, xa), (ws, wa) = self._current(site, "input", x2, fmt), self._current(site, "weight", weight, fmt)
        if phase == "checkpointed":
            site.replay.append((xs, ws))
        return (xs, ws), (xa, wa)

    def _scale(self, t2, role, fmt, site):
        # The backward's grad_output: the scale in force now (the forward's come from
        # _forward_scales).
        return self._current(site, role, t2, fmt)

    def _current(self, site: _Site, role: str, t: torch.Tensor, fmt: torch.dtype):
        """``(scale, amax or None)`` a call of ``role`` uses now.

        Once the host knows the role has recorded a positive finite amax (``ready``), the
        history's scale. Before, the device chooses between that and the scale from
        ``t``'s own amax (which the call then records instead of computing it again).
        While torch.compile traces, always the latter: a graph has no host flag to read.
        """
        scale = site.history[role][1]
        compiling = torch.compiler.is_compiling()
        if not compiling and not site.ready[role]:
            site.ready[role] = self._probed(site, role)
        if site.ready[role] and not compiling:
            return scale.clone(), None
        a = _amax(t)
        own = scale_from_amax(a, fmt, margin=self.margin, power_of_two=self.power_of_two)
        return torch.where(site.initialized[role], scale, own), a

    @staticmethod
    def _probed(site: _Site, role: str) -> bool:
        """Whether the last copy of the role's device flag has arrived and says True."""
        probe = site.probes.get(role)
        if probe is None:
            return False
        host, event = probe
        if event is not None and not event.query():
            return False  # still on its way: ask again at the next call
        site.probes.pop(role)
        return bool(host.item())

    @staticmethod
    def _send_probe(site: _Site, role: str) -> None:
        """Starts copying the role's device flag to the host, without waiting for it."""
        flag = site.initialized[role]
        if flag.device.type == "cpu":
            site.probes[role] = (flag, None)
        elif flag.device.type == "cuda":
            host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            site.probes[role] = (host, event)

    def _observed(self, a: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if (self.reduce_amax and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1):
            a = a.clone()
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.process_group)
        return a

    def _advance(self, site: _Site, role: str, a: torch.Tensor, fmt: torch.dtype) -> None:
        # In place, on the device: no host read per call.
        history, scale = site.history[role]
        history.copy_(torch.roll(history, 1))
        history[0] = a
        ref = history.max() if self.amax_compute_algo == "max" else history[0]
        new = scale_from_amax(ref, fmt, margin=self.margin, power_of_two=self.power_of_two)
        keep = (ref == 0) | ~torch.isfinite(ref)
        scale.copy_(torch.where(keep, scale, new))
        if not site.ready[role]:
            flag = site.initialized[role]
            flag.copy_(flag | ((a > 0) & torch.isfinite(a)))
            if not torch.compiler.is_compiling():
                self._send_probe(site, role)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"amax_history_len": n, "sites": {name: {"<role>_history": t, "<role>_scale": t}}}``.

        Needs named sites (``bind(model)``): a fresh model's weights are other tensors, and
        names are what connects them.
        """
        unnamed = len(self._sites()) - len(self._named)
        if unnamed:
            raise RuntimeError(
                f"DelayedScaling.state_dict(): {unnamed} site(s) have no name; call "
                "recipe.bind(model) before the first forward so that the state can be saved by "
                "module name and loaded into a fresh model"
            )
        return self._named_state()

    def _named_state(self) -> dict:
        sites = {}
        for name, site in self._named.items():
            sites[name] = {}
            for role, (history, scale) in site.history.items():
                sites[name][f"{role}_history"] = history.detach().clone()
                sites[name][f"{role}_scale"] = scale.detach().clone()
        return {"amax_history_len": self.amax_history_len, "sites": sites}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores ``state_dict()`` (all or nothing: a bad entry changes nothing).

        Example::

            recipe = amp.fp8.DelayedScaling().bind(fresh_model)
            recipe.load_state_dict(checkpoint["fp8"])
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"amax_history_len", "sites"}:
            raise ValueError("DelayedScaling.load_state_dict() takes what state_dict() returned: "
                             "keys 'amax_history_len' and 'sites'")
        if state_dict["amax_history_len"] != self.amax_history_len:
            raise ValueError(f"the checkpoint's amax_history_len is {state_dict['amax_history_len']}, "
                             f"this recipe's {self.amax_history_len}")
        loaded: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, entries in dict(state_dict["sites"]).items():
            roles = {}
            for key in entries:
                role, _, what = key.rpartition("_")
                if role not in ROLES or what not in ("history", "scale"):
                    raise ValueError(f"site {name!r}: unknown entry {key!r}")
            for role in {k.rpartition("_")[0] for k in entries}:
                history, scale = entries.get(f"{role}_history"), entries.get(f"{role}_scale")
                if not (isinstance(history, torch.Tensor) and history.shape == (self.amax_history_len,)
                        and isinstance(scale, torch.Tensor) and scale.shape == ()):
                    raise ValueError(f"site {name!r}, role {role!r}: expected a history of shape "
                                     f"({self.amax_history_len},) and a 0-d scale")
                roles[role] = (history.detach().to(torch.float32).clone(), scale.detach().to(torch.float32).clone())
            loaded[name] = roles
        for name, roles in loaded.items():
            site = self._named.get(name)
            if site is None:
                site = self._named[name] = _Site(name)
            site.history.update(roles)
            site.replay.clear()
            for role, (history, _) in roles.items():
                flag = site.initialized[role] = _seen_positive(history)
                site.ready[role] = bool(flag)  # a checkpoint is read on the host anyway
                site.probes.pop(role, None)

    def __repr__(self) -> str:
        return f"DelayedScaling({self._describe()})"


_torch_compat.keep_out_of_dynamo(globals(), __name__)
