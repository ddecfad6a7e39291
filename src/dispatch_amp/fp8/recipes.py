"""fp8 recipes: how each tensor of an fp8 gemm gets its scale, and the state that needs.

A recipe is handed to ``amp.autocast(..., fp8=recipe)``. It holds its own state (delayed
scaling's amax histories, every site's statistics): nothing is stored in modules, so fp8
works on plain modules, custom ones and modules other tools swapped in.

A *site* is one weight (``_sites.py``): every fp8 call with the same weight tensor shares
its history and statistics. Its names are the paths under which models hold the weight
(``"blocks.0.attn.qkv"``, ``"blocks.0.attn.in_proj_weight"``; all of them for a tied
weight), found by ``recipe.bind(model)`` or, without it, at the weight's first call.
Names are what ``state_dict()`` and ``report()`` use, and what ``filter_fn`` is given.

Roles: each fp8 gemm call quantizes its ``input`` and ``weight`` in the forward and its
``grad_output`` in the backward.
"""

from __future__ import annotations

import copy
import inspect
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _markdown, _torch_compat
from ..kernels.fp8_scale import F_AMAX, F_INIT, F_PENDING, F_SCALE, F_SHOWN, I_CALLS, I_SATURATED, NO_PENDING
from ..kernels.fp8_scale import advance_reference, record_, record_reference
from . import _quantize, _replay, _state_dict, _step_hooks
from ._rules import FORMATS, check_format, scale_from_amax
from ._rules import amax as _amax
from ._rules import cast as _cast
from ._sites import ROLES, RoleState, Site, SiteRegistry

__all__ = ["Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "SiteReport", "ROLES"]

# filter_fn(site name or None, input shape, weight shape) -> whether the call runs in fp8.
FilterFn = Callable[[Any, torch.Size, torch.Size], bool]

_float32 = torch.float32

#: The longest amax history DelayedScaling takes (48 KiB of state per site).
MAX_HISTORY_LEN = 4096


def _flag(value, name: str) -> bool:
    # bool("false") is True: a flag given as a string (a config file, a command line)
    # would silently mean the opposite.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}); convert "
                        f"configuration strings first (e.g. value.lower() == 'true')")
    return value


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
        self.power_of_two = _flag(power_of_two, "power_of_two")
        self._registry = SiteRegistry()

    # -- sites --------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module, prefix: str = "") -> Recipe:
        """Names the sites after ``model``'s weights: every 2-D floating parameter or buffer,
        by the path of the module that holds it (``"blocks.0.qkv"``) or, for a parameter
        not called ``weight``, by its own path (``"attn.in_proj_weight"``); a tied weight
        by all its paths. ``prefix`` goes in front of every name (two models under one
        recipe need different ones). Makes the sites' state on the weights' devices.

        Optional: a weight met without bind is named at its first call after the modules
        running it. Bind before compiling a model with ``DelayedScaling`` (a compiled graph
        cannot make state), and when the model runs inside a larger one that is not its
        own (the names are then the larger model's). A name another weight of this recipe
        holds raises, and nothing changes. Returns the recipe.

        Example::

            recipe = amp.fp8.DelayedScaling().bind(model)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"bind() takes the nn.Module whose weights the recipe will see, got {type(model).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        for weight, site in self._registry.bind(model, prefix):
            self._prepare(site, weight.device)
        return self

    def site_name(self, weight: torch.Tensor) -> str | None:
        """The name ``weight``'s site's state is filed under, or None (no module holds it).

        Example::

            >>> lin = torch.nn.Linear(16, 16)
            >>> CurrentScaling().bind(lin).site_name(lin.weight)
            '<root>'
        """
        site = self._site_now(weight)
        return None if site is None else site.name

    def site_names(self, weight: torch.Tensor) -> tuple[str, ...]:
        """Every name of ``weight``'s site (a tied weight has several), or ``()``."""
        site = self._site_now(weight)
        return () if site is None else tuple(site.names)

    def _site_now(self, weight: torch.Tensor) -> Site | None:
        # Eagerly a weight's first call names it; a graph being traced only reads slots.
        if torch.compiler.is_compiling():
            return self._registry.lookup(weight)
        return self._registry.site(weight)

    def _lookup(self, weight: torch.Tensor) -> Site | None:
        """The weight's site if it has one (reads the weight's slot only)."""
        return self._registry.lookup(weight)

    def _site(self, weight: torch.Tensor) -> Site:
        """The weight's site, made and named on its first call."""
        return self._registry.site(weight)

    def _sites(self) -> list[Site]:
        return list(self._registry.sites)

    def eligible(self, name: str | None, input_shape: torch.Size, weight_shape: torch.Size) -> bool:
        """Whether a ``linear`` call with these shapes runs in fp8 (else in the region's dtype).

        The gemms need every dimension a multiple of 16 (the rows of the flattened input,
        the input features and the output features), as cuBLAS's fp8 gemms do; then
        ``filter_fn``, if given, decides for ``name``.

        Example::

            >>> CurrentScaling().eligible("fc", torch.Size([16, 32]), torch.Size([16, 32]))
            True
        """
        if not self._shapes_ok(input_shape, weight_shape):
            return False
        return self.filter_fn is None or bool(self.filter_fn(name, input_shape, weight_shape))

    @staticmethod
    def _shapes_ok(input_shape, weight_shape) -> bool:
        if len(weight_shape) != 2 or len(input_shape) < 1 or input_shape[-1] != weight_shape[1]:
            return False
        rows = 1
        for d in input_shape[:-1]:
            rows *= d
        return not (rows == 0 or rows % 16 or weight_shape[0] % 16 or weight_shape[1] % 16)

    def _accepts(self, weight: torch.Tensor, input_shape: torch.Size, weight_shape: torch.Size) -> bool:
        """``eligible`` for a call with ``weight`` (the tensor that holds the site; its
        transpose for a linear-shaped matmul on an ``(in, out)`` parameter, whose
        ``weight_shape`` is that of the linear, ``(out, in)``): ``filter_fn`` is asked for
        every name of its site (a tied weight's each) and must accept them all."""
        if not self._shapes_ok(input_shape, weight_shape):
            return False
        if self.filter_fn is None:
            return True
        site = self._site_now(weight)
        names = tuple(site.names) if site is not None and site.names else (None,)
        return all(bool(self.filter_fn(name, input_shape, weight_shape)) for name in names)

    # -- state ----------------------------------------------------------------------------
    def _history_len(self) -> int:
        return 0

    def _make_roles(self, device: torch.device) -> dict[str, RoleState]:
        return {role: RoleState(self._history_len(), device) for role in ROLES}

    def _prepare(self, site: Site, device: torch.device) -> None:
        """Makes the site's tensors on ``device`` before a call (never inside the autograd
        Function, whose backward only updates them in place). A compiled graph cannot make
        them (its backward could not update tensors its forward made): ``bind`` does."""
        if site.on(device):
            return
        if torch.compiler.is_compiling():
            _refuse_unprepared_site(site.name or "<unnamed>", str(device))
        fresh = self._make_roles(device)
        site.roles = {role: site.roles[role].moved(device) if role in site.roles else fresh[role] for role in ROLES}

    # -- quantizing (called by the fp8 gemm) ----------------------------------------------
    def _forward_scales(self, site: Site | None, phase: str):
        """``((input scale, weight scale), record, key)`` of a forward: scales of None are
        the recipe's own (a recomputation's are the forward's it replays); ``record``:
        whether the call records statistics (a recomputation does not); ``key``: where to
        keep the scales the forward uses, for its recomputation (``_replay.py``)."""
        return (None, None), phase != "recompute", None

    def _scale(self, t2: torch.Tensor, role: str, fmt: torch.dtype, site: Site | None):
        """``(scale, amax or None)`` of an operand: here, from its own amax (current scaling)."""
        a = _amax(t2)
        return scale_from_amax(a, fmt, power_of_two=self.power_of_two), a

    def _record(self, site: Site, role: str, a: torch.Tensor, shown: torch.Tensor, saturated: torch.Tensor,
                fmt: torch.dtype) -> None:
        """A call's statistics (and what it changes for later calls, in subclasses)."""
        state = site.roles[role]
        f, i = record_reference(state.f, state.i, a, shown, saturated, **self._record_rule(fmt))
        state.f.copy_(f)
        state.i.copy_(i)

    def _record_rule(self, fmt: torch.dtype) -> dict:
        """What ``record_reference`` / ``record_`` do for this recipe."""
        return {"history": False}

    def _record_accumulated(self, state: RoleState, acc: torch.Tensor, saturated: torch.Tensor, sc: torch.Tensor,
                            fmt: torch.dtype, snapshot: torch.Tensor | None) -> None:
        """``_record`` on the kernel path: the call's amax and count are in the accumulators."""
        record_(state.f, state.i, acc, saturated, sc, snapshot=snapshot, backend="triton", **self._record_rule(fmt))

    def _record_cached(self, site: Site, cached, fmt: torch.dtype) -> None:
        """Records a call that reused the weight cache: the statistics of its quantization."""
        state = site.roles["weight"]
        if len(cached.stats) == 2:
            self._record(site, "weight", cached.stats[0], cached.sc[0], cached.stats[1], fmt)
        else:
            snap = cached.stats[0]
            record_(state.f, state.i, snap.view(torch.int32)[:1], snap[1:], cached.sc, reset=False,
                    backend="triton", **self._record_rule(fmt))

    def _scale_known(self, state: RoleState) -> bool:
        """Whether the kernels can take the recipe's scale as it is (delayed scaling, once
        the host knows the site has one)."""
        return False

    def _before_optimizer_step(self, optimizer) -> None:
        """Called before an optimizer steps while the recipe is watched (``_step_hooks``):
        the weights are about to change, and their fp8 copies are freed."""
        for site in self._registry.sites:
            site.cached = site.cached_bias = None

    def _after_optimizer_step(self, optimizer) -> None:
        """Called after an optimizer stepped while the recipe is watched (``_step_hooks``)."""

    # -- state dict -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The recipe's state (empty for recipes that keep none besides statistics)."""
        return {}

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restores ``state_dict()``; a recipe that keeps no state takes ``{}``."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{type(self).__name__}.load_state_dict() takes what state_dict() returned (a dict), "
                            f"got {type(state_dict).__name__}")
        if dict(state_dict):
            raise ValueError(f"{type(self).__name__} keeps no state; got keys {sorted(map(str, state_dict))} "
                             f"(a DelayedScaling checkpoint?): load it into DelayedScaling")

    # -- reporting ------------------------------------------------------------------------
    def report(self) -> list[SiteReport]:
        """Per site: calls, the last amax and scale per role, saturated values so far.

        Reads the statistics from the device (one synchronization): call it between steps.
        """
        out = []
        for i, site in enumerate(self._sites()):
            if not site.roles:
                continue
            calls = int(site.roles["input"].i[I_CALLS])
            if not calls:
                continue
            amax, scale, sat = {}, {}, {}
            for role, st in site.roles.items():
                if int(st.i[I_CALLS]):
                    amax[role] = float(st.f[F_AMAX])
                    scale[role] = float(st.f[F_SHOWN])
                    sat[role] = int(st.i[I_SATURATED])
            out.append(SiteReport(site.name or f"<unnamed {i}>", calls, amax, scale, sat))
        return out

    def report_table(self) -> str:
        """``report()`` as a Markdown table, one row per site and role.

        Example::

            print(recipe.report_table())
        """
        rows = [[r.name, role, r.calls, f"{r.amax[role]:.4g}", f"{r.scale[role]:.4g}", r.saturated[role]]
                for r in self.report() for role in ROLES if role in r.amax]
        return _markdown.table(["site", "role", "calls", "amax", "scale", "saturated"], rows, align="llrrrr")

    # -- copies ---------------------------------------------------------------------------
    # Pickled as configuration plus the state of named sites, as Python numbers (Lightning
    # deep-copies and pickles precision plugins, which may hold a recipe; a spawned process
    # gets its arguments pickled). A copy is a recipe of its own; its state waits, by name,
    # for weights of those names, and a deep copy also knows the models bound to the
    # original, so that it names their weights as the original did.
    def _config(self) -> dict:
        params = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name in params if name != "self"}

    def __reduce__(self):
        return _rebuild_recipe, (type(self), self._config(), self._portable_state())

    def __deepcopy__(self, memo) -> Recipe:
        new = _rebuild_recipe(type(self), copy.deepcopy(self._config(), memo), self._portable_state())
        new._registry.roots = list(self._registry.roots)
        return new

    def _portable_state(self) -> dict:
        return {}

    def _describe(self) -> str:
        return (f"forward_format={self.forward_format}, grad_format={self.grad_format}"
                + (", power_of_two=True" if self.power_of_two else "")
                + (", filter_fn=..." if self.filter_fn is not None else ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"


def _rebuild_recipe(cls, config: dict, state: dict) -> Recipe:
    recipe = cls(**config)
    if state:
        recipe.load_state_dict(_state_dict.from_portable(state), strict=False)
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
        self.weight_grad_high_precision = _flag(weight_grad_high_precision, "weight_grad_high_precision")

    def _quantize_rows(self, t2: torch.Tensor, role: str, fmt: torch.dtype, site: Site | None, record: bool):
        """``(q, 1 / scales)`` of a 2-D operand, one scale per row, recording statistics
        (the largest amax and smallest scale of the rows) when ``record``."""
        a = _amax(t2, rowwise=True)
        scale = scale_from_amax(a, fmt, power_of_two=self.power_of_two)
        q, saturated = _cast(t2, scale, fmt)
        if record and site is not None:
            self._record(site, role, a.max(), scale.min(), saturated, fmt)
        return q, scale.reciprocal()

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
    and then stops computing the extra amax.

    Across ranks: with ``reduce_amax``, torch.distributed initialized and more than one
    rank in ``process_group`` (default: the world), a call's amax waits; before each
    optimizer step every rank reduces (max) the amaxes of all its named sites in one
    collective, and each history advances once by the reduced amax. Ranks thus keep the
    same scales whatever fp8 calls each made (a rank may skip a site in a step).

    A forward that activation checkpointing will recompute keeps its scales with torch's
    checkpoint; the recomputation replays them and records nothing, so it gives the same
    bits and the history advances once per real call.

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
        if not isinstance(amax_history_len, int) or isinstance(amax_history_len, bool) or amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {amax_history_len!r}")
        if amax_history_len > MAX_HISTORY_LEN:
            raise ValueError(
                f"amax_history_len must be at most {MAX_HISTORY_LEN}, got {amax_history_len}: every site keeps a "
                f"history per role on the weight's device ({3 * 4 * amax_history_len:,} bytes per site at this "
                f"length) and every call shifts its whole history (Transformer Engine's default is 1024)")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {margin!r}")
        _check_process_group(process_group)
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        self.amax_history_len = amax_history_len
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.reduce_amax = _flag(reduce_amax, "reduce_amax")
        self.process_group = process_group

    def _describe(self) -> str:
        return (f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo!r}, "
                f"margin={self.margin}, " + super()._describe())

    def _history_len(self) -> int:
        return self.amax_history_len

    def _rule(self, fmt: torch.dtype) -> dict:
        return {"fp8_max": FORMATS[fmt], "margin": self.margin, "power_of_two": self.power_of_two,
                "most_recent": self.amax_compute_algo == "most_recent"}

    # -- scales ---------------------------------------------------------------------------
    def _forward_scales(self, site, phase):
        key = _replay.checkpoint_key() if phase != "forward" and site is not None else None
        if phase == "recompute" and key is not None:
            scales = _replay.replayed(key, site)
            if scales is not None:
                return scales, False, None
        return (None, None), True, (key if phase == "checkpointed" else None)

    def _scale(self, t2, role, fmt, site):
        return self._current(site, role, t2, fmt)

    def _scale_known(self, state: RoleState) -> bool:
        if not state.ready:
            state.ready = _probed(state)
        return state.ready

    def _current(self, site: Site, role: str, t: torch.Tensor, fmt: torch.dtype):
        """``(scale, amax or None)`` a call of ``role`` uses now.

        Once the host knows the role has recorded a positive finite amax (``ready``), the
        history's scale. Before, the device chooses between that and the scale from
        ``t``'s own amax (which the call then records instead of computing it again).
        While torch.compile traces, always the latter: a graph has no host flag to read.
        """
        state = site.roles[role]
        scale = state.f[F_SCALE]
        compiling = torch.compiler.is_compiling()
        if not compiling and not state.ready:
            state.ready = _probed(state)
        if state.ready and not compiling:
            return scale.clone(), None
        a = _amax(t)
        own = scale_from_amax(a, fmt, margin=self.margin, power_of_two=self.power_of_two)
        return torch.where(state.f[F_INIT] > 0, scale, own), a

    def _record_rule(self, fmt):
        defer = self._deferring() is not None
        if defer and not _step_hooks.watching(self):
            _step_hooks.watch(self)
        return {"history": True, "defer": defer, **self._rule(fmt)}

    def _record(self, site, role, a, shown, saturated, fmt):
        super()._record(site, role, a, shown, saturated, fmt)
        self._after_record(site.roles[role])

    def _record_accumulated(self, state, acc, saturated, sc, fmt, snapshot):
        super()._record_accumulated(state, acc, saturated, sc, fmt, snapshot)
        self._after_record(state)

    def _after_record(self, state: RoleState) -> None:
        if not state.ready and not torch.compiler.is_compiling() and self._deferring() is None:
            _send_probe(state)

    def _after_optimizer_step(self, optimizer) -> None:
        # After the step, not before: where the forward and backward run inside
        # optimizer.step(closure) (Lightning's Trainer without a loss scaler), a reduction
        # before the step would leave each step's amaxes waiting for the next one, and out
        # of a checkpoint saved in between.
        super()._after_optimizer_step(optimizer)
        group = self._deferring()
        if group is not None:
            self._reduce_amaxes(group)

    # -- across ranks ---------------------------------------------------------------------
    def _deferring(self):
        """The process group amaxes are reduced over, or None (a single rank, or no reduction)."""
        if not self.reduce_amax:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _reduce_amaxes(self, group) -> None:
        """One all_reduce(max) of every named site's pending amaxes, then each history
        advances by its reduced amax (where some rank recorded one)."""
        import torch.distributed as dist

        named = self._registry.named()
        device = _collective_device(named.values(), group)
        names = sorted(named)
        # Every rank must reduce the same sites in the same order: compare the layouts
        # first (count and checksum, max and -max in one collective); on a mismatch take
        # the union, the missing sites getting state that no call has touched.
        digest = zlib.crc32("\0".join(names).encode()) & 0x7FFFFFFF
        probe = torch.tensor([len(names), -len(names), digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        if probe[0] != -probe[1] or probe[2] != -probe[3]:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, names, group=group)
            for name in sorted(set().union(*gathered)):
                if name not in named:
                    named[name] = self._registry.vacant_site(name)
            names = sorted(named)
        states = []
        for name in names:
            site = named[name]
            self._prepare(site, device)
            states += [site.roles[role] for role in ROLES]
        if not states:
            return
        pending = torch.stack([s.f[F_PENDING] for s in states])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
        f = torch.stack([s.f for s in states])
        maxes = torch.tensor([FORMATS[self.grad_format if k % len(ROLES) == 2 else self.forward_format]
                              for k in range(len(states))], device=device)
        rule = self._rule(self.forward_format)
        advanced = advance_reference(f, pending.clamp_min(0), maxes, self.margin, self.power_of_two,
                                     rule["most_recent"])
        called = ~(pending < 0)  # nan counts as called: it is recorded, as on one rank
        new = torch.where(called.unsqueeze(-1), advanced, f)
        new[:, F_PENDING] = NO_PENDING
        torch._foreach_copy_([s.f for s in states], list(new.unbind(0)))
        for s in states:
            if not s.ready:
                _send_probe(s)

    # -- state dict -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"amax_history_len": n, "sites": {name: {"<role>_history": t, "<role>_scale": t,
        "<role>_initialized": t}}}`` for every named site.

        Sites are named by ``bind(model)`` or at their weight's first call; a weight that
        no module holds (made in the forward, still alive) has no name, and raises here.

        Example::

            torch.save({"model": model.state_dict(), "fp8": recipe.state_dict()}, path)
        """
        unnamed = self._registry.unnamed_alive()
        if any(s.roles and int(s.roles["input"].i[I_CALLS]) for s in unnamed):
            raise RuntimeError(
                f"DelayedScaling.state_dict(): {len(unnamed)} site(s) have no name: their weights belong to no "
                f"module (made in the forward, or called outside any module), so a fresh run could not find "
                f"them; call recipe.bind(model) on the model holding them, or keep such weights in a module"
            )
        return self._named_state()

    def _named_state(self) -> dict:
        sites = {}
        for name, site in sorted(self._registry.named().items()):
            entries = {}
            for role in ROLES:
                state = site.roles.get(role)
                f = state.f if state is not None else RoleState(self.amax_history_len, torch.device("cpu")).f
                entries.update(_state_dict.entries(f, role))
            kept = _quantize.kept_scale(site)
            if kept is not None:  # the rest of the accumulation window reuses it
                entries[_state_dict.COPY_SCALE] = kept.detach().clone()
            sites[name] = entries
        return {**self._checkpoint_config(), "sites": sites}

    def _checkpoint_config(self) -> dict:
        """What the state is made under (``_state_dict.CONFIG``), as a checkpoint holds it."""
        return {"amax_history_len": self.amax_history_len, "forward_format": str(self.forward_format)[6:],
                "grad_format": str(self.grad_format)[6:], "margin": self.margin,
                "amax_compute_algo": self.amax_compute_algo, "power_of_two": self.power_of_two}

    def _portable_state(self) -> dict:
        return _state_dict.portable(self._named_state())

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restores ``state_dict()``, all or nothing: everything is checked (format, shapes,
        positive finite scales, the names) before anything changes.

        ``strict`` (default): the checkpoint's sites and this recipe's named sites must be
        the same, as ``nn.Module.load_state_dict`` requires of parameters. A recipe that
        has no site yet (not bound, no call) takes any names: their state waits for the
        weights that get those names. ``strict=False`` loads the sites that match and
        keeps the others waiting the same way.

        Example::

            recipe = amp.fp8.DelayedScaling().bind(fresh_model)
            recipe.load_state_dict(checkpoint["fp8"])
        """
        parsed, copy_scales = _state_dict.parse(state_dict, self._checkpoint_config())
        registry = self._registry
        known = registry.named() if registry.sites else {}
        targets: dict[str, Site | None] = {}
        for name in parsed:
            site = registry.site_for_name(name)
            if site is not None and site in targets.values():
                other = next(n for n, s in targets.items() if s is site)
                raise ValueError(
                    f"DelayedScaling.load_state_dict(): {other!r} and {name!r} both name one weight here (tied), "
                    f"but the checkpoint holds a state for each; load a checkpoint of this model")
            targets[name] = site
        if strict and known:
            unexpected = sorted(n for n, s in targets.items() if s is None)
            missing = sorted(n for n, s in known.items() if not any(t is s for t in targets.values()))
            if unexpected or missing:
                raise ValueError(
                    "DelayedScaling.load_state_dict(): the checkpoint's sites are not this recipe's"
                    + (f"; not in this recipe: {unexpected}" if unexpected else "")
                    + (f"; not in the checkpoint: {missing}" if missing else "")
                    + ". Load a checkpoint of this model, bound the same way (same module names, same "
                      "prefix), or pass strict=False to load the sites that match (the others wait for "
                      "weights of their names)")
        for name, roles in parsed.items():
            site = targets[name] or registry.vacant_site(name)
            for role, f in roles.items():
                state = site.roles.get(role)
                if state is None:
                    state = site.roles[role] = RoleState(0, torch.device("cpu"), f)
                else:
                    state.f.copy_(f.to(state.device))
                state.ready = bool(f[F_INIT] > 0)  # read on the host: a checkpoint is there
                state.probe = None
            if site.roles and len(site.roles) < len(ROLES):
                device = next(iter(site.roles.values())).device
                for role in ROLES:
                    site.roles.setdefault(role, RoleState(self.amax_history_len, device))
            # The loaded state replaces the fp8 copy's too: the copy a checkpoint saved in
            # the middle of an accumulation window is made again with its scale.
            site.cached = None
            if name in copy_scales:
                _quantize.restored(site, copy_scales[name])
                _step_hooks.watch(self)

    def __repr__(self) -> str:
        return f"DelayedScaling({self._describe()})"

    def _config(self) -> dict:
        config = super()._config()
        # A process group is this process's own object: a copy elsewhere reduces over the
        # world group, as GradScaler's pickles do.
        if config.get("process_group") is not None:
            config["process_group"] = None
        return config


def _check_process_group(process_group) -> None:
    if process_group is None:
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(process_group, dist.ProcessGroup):
        return
    raise TypeError(
        f"process_group must be None (the world group) or a torch.distributed.ProcessGroup, got "
        f"{process_group!r}; pass torch.distributed.group.WORLD or a group from dist.new_group(), or "
        f"reduce_amax=False not to reduce amaxes across ranks"
    )


def _collective_device(sites, group) -> torch.device:
    import torch.distributed as dist

    for site in sites:
        for state in site.roles.values():
            if state.device.type != "cpu" or dist.get_backend(group) == "gloo":
                return state.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probed(state: RoleState) -> bool:
    """Whether the last copy of the role's initialized flag has arrived and says True."""
    probe = state.probe
    if probe is None:
        return False
    host, event = probe
    if event is not None and not event.query():
        return False  # still on its way: ask again at the next call
    state.probe = None
    return bool(host[F_INIT] > 0) if host.dim() else bool(host > 0)


def _send_probe(state: RoleState) -> None:
    """Starts copying the role's initialized flag to the host, without waiting for it."""
    if state.device.type == "cpu":
        state.probe = (state.f, None)  # already on the host
    elif state.device.type == "cuda":
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(state.f[F_INIT], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        state.probe = (host, event)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
