"""Scaling rules: how each recipe's scales are chosen, recorded and updated.

A recipe (``recipes.py``) is a frozen description; the one thing it contributes to the
machinery is its rule, an object with three jobs:

1. **choose a scale** for an operand about to be quantized (:meth:`ScalingRule.choose`,
   a ``kernels.fp8_quantize.ScaleChoice``);
2. **record a call**: what the statistics kernel does with the call's amax
   (:meth:`ScalingRule.record_rule`, a ``RecordRule``) and what follows on the host
   (:meth:`ScalingRule.recorded`);
3. **act after the optimizer step** (:meth:`ScalingRule.after_optimizer_step`).

The state those act on (sites, per-role tensors with named fields, checkpoints,
reports, the cross-rank reduction) is ``_state.Fp8State``; the arithmetic is
``kernels/fp8_scale.py`` (scales, histories) and ``kernels/fp8_quantize.py`` (the cast,
torch or Triton). A new recipe adds a rule here and a description in ``recipes.py``.

``granularity`` tells the quantizer and the gemms which scales a rule's operands carry:
``"tensor"`` (one 0-d scale: the forward makes the backward's transposed fp8 copies, the
weight's copy is cached) or anything else, many scales along the contraction dimension
(``"row"``: one per row). Those are quantized again for each gemm from the saved input and
weight, through ``kernels.fp8_quantize.quantize_along_k``, whose ``ScaleChoice.mode``
(the rule's ``choose``) names the scales' layout; ``_gemms.mm`` takes the inverse scales
in that layout. A rule of another layout (block scaling's tiles) adds its rule here, its
mode to ``quantize_along_k`` and its scales to ``_gemms.mm``.

Code that casts a weight itself (an fp8 all-gather) asks the state for the scale first
(``Fp8State.weight_scale_choice``) and hands the gemm the result
(``fp8_linear(..., weight_q=QuantizedWeight(...))``), which records it as a cast would.
"""

from __future__ import annotations

import torch

from .. import _torch_compat
from ..kernels.fp8_quantize import RecordRule, ScaleChoice
from ..kernels.fp8_scale import scale_from_amax_reference
from ._rules import FORMATS, Format

__all__ = ["ScalingRule", "CurrentRule", "RowwiseRule", "BlockRule", "DelayedRule"]


class ScalingRule:
    """The rule of a recipe without state of its own (current scaling): every operand's
    scale comes from its own amax, ``scale = fp8_max / max|t|`` (1 for an all-zero
    tensor), optionally rounded down to a power of two; a call records statistics only.

    Example::

        >>> rule = ScalingRule(Format.E4M3, Format.E5M2, power_of_two=False)
        >>> rule.choose(None, "input").mode
        'amax'
    """

    #: ``"tensor"`` or ``"row"``: the scales an operand carries (module docstring).
    granularity = "tensor"
    #: Whether calls change state (amax histories) that later calls use.
    stateful = False
    #: Entries of each role's amax history (0: none).
    history_len = 0

    def __init__(self, forward_format: Format, grad_format: Format, power_of_two: bool) -> None:
        self.forward_format = forward_format
        self.grad_format = grad_format
        self.power_of_two = power_of_two
        # Plain torch dtypes for the hot path (what the kernels and torch.compile take).
        self.forward_dtype = forward_format.dtype
        self.grad_dtype = grad_format.dtype

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 dtype ``role``'s operand is quantized to."""
        return self.grad_dtype if role == "grad_output" else self.forward_dtype

    # -- 1. choose a scale ----------------------------------------------------------------
    def choose(self, state, role: str) -> ScaleChoice:
        """How the next call of ``role`` (its state ``state``, or None without a site)
        gets its scale."""
        return ScaleChoice("amax", power_of_two=self.power_of_two)

    def given(self, scale: torch.Tensor) -> ScaleChoice:
        """A scale fixed elsewhere (a recomputation's replay, a restored copy's, a gathered
        weight's)."""
        return ScaleChoice("given", scale, power_of_two=self.power_of_two)

    # -- 2. record a call -------------------------------------------------------------------
    def record_rule(self, role: str) -> RecordRule:
        """What recording a call of ``role`` does to its state."""
        return RecordRule()

    def recorded(self, owner, state) -> None:
        """Called on the host after a call was recorded on ``state`` (of ``owner``, the
        ``Fp8State``)."""

    # -- 3. after the optimizer step ------------------------------------------------------
    def after_optimizer_step(self, owner) -> None:
        """Called after an optimizer stepped while ``owner`` (the ``Fp8State``) is watched."""

    # -- reports ----------------------------------------------------------------------------
    def shown_scale(self, role: str, state) -> float:
        """The scale a report shows for ``role``'s last call (its state ``state``): the
        scale it recorded."""
        return float(state.shown)

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_config(self) -> dict | None:
        """What a checkpoint of this rule's state is made under, or None (no state to save)."""
        return None


class CurrentRule(ScalingRule):
    """:class:`ScalingRule` as it is: current scaling's rule."""


class RowwiseRule(ScalingRule):
    """Row-wise scaling: per row ``r`` of the layout an operand is contracted in,
    ``scale[r] = fp8_max / max_k |t[r, k]|``; a call records the largest amax and the
    smallest scale of its rows.

    Example::

        >>> RowwiseRule(Format.E4M3, Format.E4M3, power_of_two=False).granularity
        'row'
    """

    granularity = "row"

    def choose(self, state, role: str) -> ScaleChoice:
        return ScaleChoice("rows", power_of_two=self.power_of_two)


class BlockRule(ScalingRule):
    """Block scaling (DeepSeek-V3's): per tile ``T`` of 1 x 128 elements of an activation or
    output gradient along the dimension its gemm contracts, and per 128 x 128 block of a
    weight, ``scale[T] = fp8_max / max|T|`` (1 for an all-zero tile, rounded down to a
    power of two with ``power_of_two``; ``kernels/fp8_block.py``). A call records the
    operand's amax; a report shows the scale of the tile that holds it, the smallest.

    Example::

        >>> BlockRule(Format.E4M3, Format.E4M3, power_of_two=False).granularity
        'block'
    """

    granularity = "block"
    #: The tile length: DeepSeek-V3's, and the one torch's block-scaled gemm takes.
    block = 128

    def shown_scale(self, role: str, state) -> float:
        a = state.amax.detach().to("cpu", torch.float32).reshape(())
        return float(scale_from_amax_reference(a, FORMATS[self.dtype(role)], 0, self.power_of_two))


class DelayedRule(ScalingRule):
    """Delayed scaling: ``scale = fp8_max / ref / 2**margin`` with ``ref`` the max (or the
    newest entry) of the role's amax history, updated as each call records its amax.

    Before the host knows a role has recorded a positive finite amax (``state.ready``,
    from a non-blocking copy of the initialized flag), the device chooses between the
    history's scale and the call's own amax's (mode ``"first"``); so does every call
    while torch.compile traces (a graph has no host flag to read).

    Example::

        >>> DelayedRule(Format.E4M3, Format.E5M2, False, 4, False, 0, False, None).record_rule("input").history
        True
    """

    stateful = True

    def __init__(self, forward_format: Format, grad_format: Format, power_of_two: bool, history_len: int,
                 most_recent: bool, margin: int, reduce_amax: bool, process_group) -> None:
        super().__init__(forward_format, grad_format, power_of_two)
        self.history_len = history_len
        self.most_recent = most_recent
        self.margin = margin
        self.reduce_amax = reduce_amax
        self.process_group = process_group

    def choose(self, state, role: str) -> ScaleChoice:
        compiling = torch.compiler.is_compiling()
        if not compiling and not state.ready:
            state.ready = _probed(state)
        if state.ready and not compiling:
            return ScaleChoice("given", state.scale, margin=self.margin, power_of_two=self.power_of_two)
        return ScaleChoice("first", state.scale, state.initialized, self.margin, self.power_of_two)

    def given(self, scale: torch.Tensor) -> ScaleChoice:
        return ScaleChoice("given", scale, margin=self.margin, power_of_two=self.power_of_two)

    def record_rule(self, role: str) -> RecordRule:
        return RecordRule(history=True, defer=self.deferring() is not None, fp8_max=FORMATS[self.dtype(role)],
                          margin=self.margin, power_of_two=self.power_of_two, most_recent=self.most_recent)

    def recorded(self, owner, state) -> None:
        if self.deferring() is not None:
            owner.watch()  # the reduction after each optimizer step
        elif not state.ready and not torch.compiler.is_compiling():
            _send_probe(state)

    def after_optimizer_step(self, owner) -> None:
        # After the step, not before: where the forward and backward run inside
        # optimizer.step(closure) (Lightning's Trainer without a loss scaler), a reduction
        # before the step would leave each step's amaxes waiting for the next one, and out
        # of a checkpoint saved in between.
        group = self.deferring()
        if group is not None:
            for state in owner.reduce_amaxes(group):
                if not state.ready:
                    _send_probe(state)

    def deferring(self):
        """The process group amaxes are reduced over, or None (a single rank, or no reduction)."""
        if not self.reduce_amax:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def checkpoint_config(self) -> dict:
        return {"amax_history_len": self.history_len, "forward_format": self.forward_format.value,
                "grad_format": self.grad_format.value, "margin": self.margin,
                "amax_compute_algo": "most_recent" if self.most_recent else "max",
                "power_of_two": self.power_of_two}


def _probed(state) -> bool:
    """Whether the last copy of the role's initialized flag has arrived and says True."""
    probe = state.probe
    if probe is None:
        return False
    host, event = probe
    if event is not None and not event.query():
        return False  # still on its way: ask again at the next call
    state.probe = None
    # On the CPU the "copy" is the state itself; elsewhere a 0-d copy of the flag.
    return bool(state.initialized > 0) if host.dim() else bool(host > 0)


def _send_probe(state) -> None:
    """Starts copying the role's initialized flag to the host, without waiting for it."""
    if state.device.type == "cpu":
        state.probe = (state.f, None)  # already on the host
    elif state.device.type == "cuda":
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(state.initialized, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        state.probe = (host, event)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
