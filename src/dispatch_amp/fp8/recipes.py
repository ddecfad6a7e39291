"""fp8 recipes: frozen descriptions of how each tensor of an fp8 gemm gets its scale.

A recipe is handed to ``amp.autocast(..., fp8=recipe)``. It is configuration, checked
once where it is made (formats as :class:`Format`, the scaling rule stated as a formula in
each recipe's docstring), and cannot be changed afterwards. What changes while training
(delayed scaling's amax histories, every site's statistics) lives in the recipe's state
object (``recipe.state``, ``_state.py``), never in modules, so fp8 works on plain modules,
custom ones and modules other tools swapped in. How a recipe's scales are chosen and
updated is its rule (``_scaling.py``), computed by ``kernels/fp8_scale.py``.

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
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _markdown, _torch_compat
from . import _state_dict
from ._rules import Format, gemm_shapes_ok
from ._scaling import BlockRule, CurrentRule, DelayedRule, RowwiseRule, ScalingRule
from ._sites import ROLES
from ._state import Fp8State, SiteReport

__all__ = ["Recipe", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockScaling", "SiteReport", "Format", "ROLES"]

# filter_fn(site name or None, input shape, weight shape) -> whether the call runs in fp8.
FilterFn = Callable[[Any, torch.Size, torch.Size], bool]

#: The longest amax history DelayedScaling takes (48 KiB of state per site).
MAX_HISTORY_LEN = 4096


def _flag(value, name: str) -> bool:
    # bool("false") is True: a flag given as a string (a config file, a command line)
    # would silently mean the opposite.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}); convert "
                        f"configuration strings first (e.g. value.lower() == 'true')")
    return value


class Recipe:
    """Base of the fp8 recipes: formats, the eligibility filter, the scaling rule, and the
    state (sites, statistics) the recipe's calls keep.

    Not used directly: pick :class:`CurrentScaling`, :class:`DelayedScaling` or
    :class:`RowwiseScaling`. A recipe is frozen: its configuration is checked where it
    is made, and setting an attribute afterwards raises (make a new recipe instead).
    Formats are given as :class:`Format` members or their torch dtypes;
    ``forward_format`` and ``grad_format`` hold the dtypes, ``rule`` (the scaling rule)
    the members. ``state`` is the state the recipe's calls keep.

    Example::

        >>> isinstance(CurrentScaling(), Recipe)
        True
        >>> CurrentScaling(forward_format=Format.E5M2).forward_format
        torch.float8_e5m2
    """

    #: One scale per row of each operand (along the contraction dimension) instead of one
    #: per tensor.
    rowwise = False
    #: Whether calls change state kept in the recipe (amax histories) that later calls use.
    stateful = False

    def __init__(self, forward_format, grad_format, filter_fn: FilterFn | None, power_of_two: bool) -> None:
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"filter_fn must be callable (name, input_shape, weight_shape) -> bool, got {filter_fn!r}")
        # Formats are checked as Format members and kept as their torch dtypes, as users
        # pass and read them (recipe.forward_format is what tensors are cast .to()).
        self._set(forward_format=Format.of(forward_format, "forward_format").dtype,
                  grad_format=Format.of(grad_format, "grad_format").dtype, filter_fn=filter_fn,
                  power_of_two=_flag(power_of_two, "power_of_two"))

    def _set(self, **fields) -> None:
        # The only way a field is set: in the constructors, once.
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _finish(self, rule: ScalingRule) -> None:
        """Ends construction: the rule, and a fresh state under it."""
        self._set(rule=rule, state=Fp8State(rule, type(self).__name__))

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"{type(self).__name__} is frozen: its {name!r} cannot be set after it is made (its sites' state "
            f"was made under its configuration); make a new recipe with the configuration you want")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: its {name!r} cannot be deleted")

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
        self.state.bind(model, prefix)
        return self

    def site_name(self, weight: torch.Tensor) -> str | None:
        """The name ``weight``'s site's state is filed under, or None (no module holds it).

        Example::

            >>> lin = torch.nn.Linear(16, 16)
            >>> CurrentScaling().bind(lin).site_name(lin.weight)
            '<root>'
        """
        site = self.state.site_now(weight)
        return None if site is None else site.name

    def site_names(self, weight: torch.Tensor) -> tuple[str, ...]:
        """Every name of ``weight``'s site (a tied weight has several), or ``()``."""
        site = self.state.site_now(weight)
        return () if site is None else tuple(site.names)

    def eligible(self, name: str | None, input_shape: torch.Size, weight_shape: torch.Size) -> bool:
        """Whether a ``linear`` call with these shapes runs in fp8 (else in the region's dtype).

        The gemms need every dimension a multiple of 16 (the rows of the flattened input,
        the input features and the output features), as cuBLAS's fp8 gemms do; then
        ``filter_fn``, if given, decides for ``name``.

        Example::

            >>> CurrentScaling().eligible("fc", torch.Size([16, 32]), torch.Size([16, 32]))
            True
        """
        if not gemm_shapes_ok(input_shape, weight_shape):
            return False
        return self.filter_fn is None or bool(self.filter_fn(name, input_shape, weight_shape))

    # -- state dict -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The recipe's state (empty for recipes that keep none besides statistics)."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restores ``state_dict()``; a recipe that keeps no state takes ``{}``."""
        self.state.load_state_dict(state_dict, strict)

    # -- reporting ------------------------------------------------------------------------
    def report(self) -> list[SiteReport]:
        """Per site: calls, the last amax and scale per role, saturated values so far.

        Reads the statistics from the device (one synchronization): call it between steps.
        """
        return self.state.report()

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
        return _rebuild_recipe, (type(self), self._config(), self.state.portable_state())

    def __deepcopy__(self, memo) -> Recipe:
        new = _rebuild_recipe(type(self), copy.deepcopy(self._config(), memo), self.state.portable_state())
        new.state.registry.roots = list(self.state.registry.roots)
        return new

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

    Rule (per operand ``t`` of every gemm, each call)::

        scale = fp8_max(format) / max|t|          # 1 when t is all zeros
        scale = floor_pow2(scale)                 # with power_of_two

    Stateless: a recomputation gives the same bits. The rule is ``_scaling.CurrentRule``.

    Example::

        with amp.autocast("cuda", dtype=torch.bfloat16, fp8=amp.fp8.CurrentScaling()):
            y = model(x)
    """

    def __init__(self, *, forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e5m2, power_of_two: bool = False,
                 filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        self._finish(CurrentRule(Format.of(self.forward_format), Format.of(self.grad_format), self.power_of_two))


class RowwiseScaling(Recipe):
    """One scale per row of each operand, along the contraction dimension.

    Rule (per row ``r`` of the layout in which an operand is contracted, each call)::

        scale[r] = fp8_max(format) / max_k |t[r, k]|     # 1 for an all-zero row
        scale[r] = floor_pow2(scale[r])                  # with power_of_two

    The forward scales the input's rows and the weight's rows; the backward re-quantizes
    ``grad_output``, the weight and the input along the dimension its gemm contracts, so
    the backward keeps the input and the weight in their own precision, not fp8 copies.
    ``weight_grad_high_precision`` runs the weight-gradient gemm in the region's dtype
    instead of fp8. Both formats default to e4m3: cuBLAS's row-wise fp8 gemm takes e4m3
    operands only. The rule is ``_scaling.RowwiseRule``.

    Example::

        recipe = amp.fp8.RowwiseScaling(weight_grad_high_precision=True)
    """

    rowwise = True

    def __init__(self, *, forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False,
                 weight_grad_high_precision: bool = False, filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        self._set(weight_grad_high_precision=_flag(weight_grad_high_precision, "weight_grad_high_precision"))
        self._finish(RowwiseRule(Format.of(self.forward_format), Format.of(self.grad_format), self.power_of_two))

    def _describe(self) -> str:
        return super()._describe() + (", weight_grad_high_precision=True" if self.weight_grad_high_precision else "")


class BlockScaling(Recipe):
    """DeepSeek-V3's block scaling: one scale per tile of 128 elements along the dimension
    each gemm contracts, one per 128 x 128 block of a weight.

    Rule (each call; ``T`` a 1 x 128 tile of an activation or output gradient, or a
    128 x 128 block of a weight)::

        scale[T] = fp8_max(format) / max|T|       # 1 when T is all zeros
        scale[T] = floor_pow2(scale[T])           # with power_of_two
        forward       y  = x @ w.T      x in 1 x 128 tiles along K,   w in 128 x 128 blocks
        grad_input    dx = dy @ w       dy in 1 x 128 tiles along N,  w.T: the same blocks
        grad_weight   dw = dy.T @ x     dy and x in 128 x 1 tiles along the tokens M

    Partial tiles at a ragged edge cover only their elements (as zero padding would). A
    linear with fewer than 128 in- or out-features runs in the region's dtype (one tile
    would cover it all). e4m3 throughout and plain float32 scales, as DeepSeek-V3 trains
    (Transformer Engine's ``Float8BlockScaling`` rounds its scales to powers of two:
    ``power_of_two=True``). Stateless: a recomputation gives the same bits. The rule is
    ``_scaling.BlockRule``, computed by ``kernels/fp8_block.py``; the gemm is
    ``torch.nn.functional.scaled_mm`` with block scales on CUDA (compute capability 9.x),
    its rule on the CPU (``fp8/_block_gemm.py``).

    Example::

        with amp.autocast("cuda", dtype=torch.bfloat16, fp8=amp.fp8.BlockScaling()):
            y = model(x)
    """

    #: The tile length (DeepSeek-V3's, and the one torch's block-scaled gemm takes).
    block = BlockRule.block

    def __init__(self, *, forward_format: torch.dtype = torch.float8_e4m3fn,
                 grad_format: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False,
                 filter_fn: FilterFn | None = None) -> None:
        super().__init__(forward_format, grad_format, filter_fn, power_of_two)
        self._finish(BlockRule(Format.of(self.forward_format), Format.of(self.grad_format), self.power_of_two))

    def eligible(self, name: str | None, input_shape: torch.Size, weight_shape: torch.Size) -> bool:
        """As every recipe's (:meth:`Recipe.eligible`), and at least 128 in- and
        out-features: a narrower linear would be one padded tile.

        Example::

            >>> BlockScaling().eligible("fc", torch.Size([16, 64]), torch.Size([256, 64]))
            False
        """
        if len(weight_shape) != 2 or weight_shape[0] < self.block or weight_shape[1] < self.block:
            return False
        return super().eligible(name, input_shape, weight_shape)


class DelayedScaling(Recipe):
    """Scales from the amax history of earlier calls at the same site (Transformer
    Engine's delayed scaling).

    Rule (per site and role; ``history`` the amaxes of the last ``amax_history_len``
    calls, newest first; a call quantizes with ``scale``, then records its amax ``a``)::

        history = [a] + history[:-1]
        ref     = max(history)                    # amax_compute_algo="max"
                  a                               # amax_compute_algo="most_recent"
        scale   = fp8_max(format) / ref / 2**margin, then floor_pow2 with power_of_two
                                                  # unchanged when ref is 0, inf or nan

    First calls: until a site and role has recorded a positive finite amax, a call scales
    from its own amax instead (the rule above with ``ref`` = that amax), so the first
    calls are as accurate as current scaling; a site that has seen only zeros stays that
    way. The device decides (no host read); the host learns it from a non-blocking copy
    and then stops computing the extra amax.

    Across ranks: with ``reduce_amax``, torch.distributed initialized and more than one
    rank in ``process_group`` (default: the world), a call's amax waits; after each
    optimizer step every rank reduces (max) the amaxes of all its named sites in one
    collective, and each history advances once by the reduced amax. Ranks thus keep the
    same scales whatever fp8 calls each made (a rank may skip a site in a step).

    A forward that activation checkpointing will recompute keeps its scales with torch's
    checkpoint; the recomputation replays them and records nothing, so it gives the same
    bits and the history advances once per real call. The rule is ``_scaling.DelayedRule``.

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
        self._set(amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo, margin=margin,
                  reduce_amax=_flag(reduce_amax, "reduce_amax"), process_group=process_group)
        self._finish(DelayedRule(Format.of(self.forward_format), Format.of(self.grad_format), self.power_of_two,
                                 amax_history_len,
                                 amax_compute_algo == "most_recent", margin, self.reduce_amax, process_group))

    def state_dict(self) -> dict:
        """``{"amax_history_len": n, "sites": {name: {"<role>_history": t, "<role>_scale": t,
        "<role>_initialized": t}}}`` for every named site (and the configuration the state
        was made under: ``_state_dict.CONFIG``).

        Sites are named by ``bind(model)`` or at their weight's first call; a weight that
        no module holds (made in the forward, still alive) has no name, and raises here.

        Example::

            torch.save({"model": model.state_dict(), "fp8": recipe.state_dict()}, path)
        """
        return self.state.state_dict()

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
        self.state.load_state_dict(state_dict, strict)

    def _describe(self) -> str:
        return (f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo!r}, "
                f"margin={self.margin}, " + super()._describe())

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



_torch_compat.keep_out_of_dynamo(globals(), __name__)
