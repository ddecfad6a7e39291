"""fp8 quantization of one gemm operand, with its statistics: one call, torch or Triton inside.

This is the one place the fp8 path chooses between the torch rule and the Triton kernels
(as ``unscale.py`` is for the scaler): ``fp8/_quantize.py`` calls :func:`quantize` or
:func:`quantize_rows` and never asks which ran. Both follow the rules of
``fp8_scale.py`` (scales, statistics) and ``fp8_cast.py`` (the saturating cast) bit for
bit; the torch branch here is the oracle of the Triton one.

How the scale is chosen is a :class:`ScaleChoice` (the scaling rule's answer, see
``fp8/_scaling.py``); what a call records into its role's state, a :class:`RecordRule`.
On the Triton branch a per-tensor quantize is:

* ``"amax"`` (current scaling): the amax kernel, then the cast kernel (which derives the
  scale from that amax itself), then the statistics kernel;
* ``"given"`` (delayed scaling once the host knows the site has a scale, or a scale
  replayed or restored): the cast kernel with that scale (computing the amax in the same
  read), then the statistics kernel, which also advances the history;
* ``"first"`` (delayed scaling before that): the amax kernel first and the cast kernel
  choosing on the device between the history's scale and the amax's.

Block scaling's operands (:func:`quantize_tiled`, :func:`quantize_blocked`, called by
``fp8/_block_linear.py``) are one ``fp8_block`` kernel each, which also accumulates the
operand's amax, then the statistics kernel; the torch branch is ``fp8_block``'s rule.

:data:`BACKEND` picks: ``"auto"`` is the Triton kernels on CUDA and torch elsewhere;
tests set ``"triton"`` to run the kernels through Triton's interpreter on CPU tensors.
While torch.compile traces, always the torch rule (the compiler fuses it itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_compat
from . import fp8_amax, fp8_block, fp8_cast
from .fp8_scale import F_SHOWN, I_ACC_SATURATED, record_, record_reference, scale_from_amax_reference

__all__ = ["BACKEND", "ScaleChoice", "RecordRule", "kernels_in_use", "amax_reference", "cast_reference",
           "quantize", "quantize_along_k", "quantize_rows", "quantize_tiled", "quantize_blocked", "record_stats",
           "bias_grad"]

#: ``"auto"``, ``"torch"`` or ``"triton"``: which implementation the fp8 path runs.
BACKEND = "auto"

_float32 = torch.float32


@dataclass(frozen=True)
class ScaleChoice:
    """How one quantize gets its scale.

    ``mode``: ``"given"`` (``scale`` as it is), ``"amax"`` (from the operand's own amax:
    ``fp8_max / amax / 2**margin``, rounded down to a power of two with ``power_of_two``)
    or ``"first"`` (``scale`` where ``initialized > 0``, else the ``"amax"`` one).

    Example::

        >>> ScaleChoice("amax").mode
        'amax'
    """

    mode: str
    scale: torch.Tensor | None = None
    initialized: torch.Tensor | None = None
    margin: int = 0
    power_of_two: bool = False

    def of_amax(self, amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        """The scale this choice gives an operand whose amax is ``amax`` (0-d float32): what
        a caller that computes the amax itself (across shards, say) casts with.

        Example::

            >>> ScaleChoice("amax").of_amax(torch.tensor(2.0), torch.float8_e4m3fn)
            tensor(224.)
        """
        if self.mode == "given":
            return self.scale
        return fp8_cast.resolve_scale_reference(self.mode, self.scale, self.initialized, amax, fp8_dtype,
                                                self.margin, self.power_of_two)


@dataclass(frozen=True)
class RecordRule:
    """What recording a call does to its role's state (``fp8_scale.record_reference``):
    statistics only, or also the history (``history``), advanced now or kept pending for
    a cross-rank reduction (``defer``) with the scale rule's ``fp8_max``, ``margin``,
    ``power_of_two`` and ``most_recent``.

    Example::

        >>> RecordRule().kwargs()
        {'history': False}
    """

    history: bool = False
    defer: bool = False
    fp8_max: float = 448.0
    margin: int = 0
    power_of_two: bool = False
    most_recent: bool = False

    def kwargs(self) -> dict:
        if not self.history:
            return {"history": False}
        return {"history": True, "defer": self.defer, "fp8_max": self.fp8_max, "margin": self.margin,
                "power_of_two": self.power_of_two, "most_recent": self.most_recent}


def _backend() -> str:
    return "torch" if torch.compiler.is_compiling() else BACKEND


def kernels_in_use(t: torch.Tensor) -> bool:
    """Whether the per-tensor quantize of ``t`` runs the Triton kernels.

    Example::

        >>> kernels_in_use(torch.ones(2))
        False
    """
    backend = _backend()
    return backend == "triton" or (backend == "auto" and t.is_cuda and fp8_cast.triton is not None)


def amax_reference(t: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
    """``max|t|`` in float32: a 0-d tensor, or one per row (shape ``(rows, 1)``) with
    ``rowwise``. A nan anywhere gives nan (torch's amax propagates it).

    ``|t|`` is exact in ``t``'s own dtype, so the maximum is taken there and only the
    result is widened: no float32 copy of ``t`` is made.

    Example::

        >>> amax_reference(torch.tensor([[1.0, -3.0]]))
        tensor(3.)
    """
    a = t.detach().abs()
    a = a.amax(dim=-1, keepdim=True) if rowwise else a.amax()
    return a.to(_float32)


def cast_reference(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype):
    """The saturating cast: ``(q, saturated)``.

    ``q = clamp(t.float() * scale, -fp8_max, fp8_max).to(fp8_dtype)`` for finite elements
    of ``t``; every inf or nan element becomes nan (torch's own cast would saturate inf to
    fp8_max and hide it). ``saturated`` (int64, 0-d) counts the finite elements with
    ``|t * scale|`` above ``fp8_cast.SATURATES_ABOVE`` (464 for e4m3fn, 61440 for e5m2).
    ``scale`` is 0-d or broadcasts along rows (``(rows, 1)``).

    Example::

        >>> q, sat = cast_reference(torch.tensor([1.0, 500.0]), torch.tensor(1.0), torch.float8_e4m3fn)
        >>> q.float().tolist(), sat.item()
        ([1.0, 448.0], 1)
    """
    limit = fp8_cast.fp8_max(fp8_dtype)
    x = t.detach().to(_float32)
    y = x * scale
    finite = torch.isfinite(x)
    saturated = (finite & (y.abs() > fp8_cast.SATURATES_ABOVE[fp8_dtype])).sum()
    q = torch.where(finite, y.clamp(-limit, limit), torch.full_like(y, float("nan"))).to(fp8_dtype)
    return q, saturated


def bias_grad(dy2: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a linear from its 2-D ``grad_output``: column sums in float32,
    in the fixed order of ``fp8_cast.py``, by the kernel or by the torch rule.

    Example::

        >>> bias_grad(torch.ones(3, 2)).tolist()
        [3.0, 3.0]
    """
    if kernels_in_use(dy2):
        return fp8_cast.bias_grad(dy2.contiguous(), backend="triton")
    return fp8_cast.bias_grad_reference(dy2)


def quantize(t2: torch.Tensor, fp8_dtype: torch.dtype, choice: ScaleChoice, *, state=None,
             record: RecordRule | None = None, need_q: bool = True, need_qt: bool = False, dbias: bool = False,
             snapshot: list | None = None):
    """``(q, q_t, sc, db)`` of a 2-D operand with one scale: the layouts asked for (else
    None), ``sc = [scale, 1 / scale]`` (float32) and the bias gradient of ``t2`` when
    ``dbias``. With ``state`` (one role's: ``f``, ``i`` and ``acc``, see ``fp8_scale``)
    and ``record``, the call is recorded there; ``snapshot`` (a list) then receives what
    recording took (for :func:`record_stats`).

    Example::

        >>> q, _, sc, _ = quantize(torch.tensor([[2.0, 1.0]]), torch.float8_e4m3fn, ScaleChoice("amax"))
        >>> q.float().tolist(), sc.tolist()
        ([[448.0, 224.0]], [224.0, 0.004464285913854837])
    """
    recording = state is not None and record is not None
    if kernels_in_use(t2):
        return _with_kernels(t2.contiguous(), fp8_dtype, choice, state if recording else None, record, need_q,
                             need_qt, dbias, snapshot)
    a = None
    if choice.mode == "given":
        scale = choice.scale
    else:
        a = amax_reference(t2)
        own = scale_from_amax_reference(a, fp8_cast.fp8_max(fp8_dtype), choice.margin, choice.power_of_two)
        scale = own if choice.mode == "amax" else torch.where(choice.initialized > 0, choice.scale, own)
    q, saturated = cast_reference(t2, scale, fp8_dtype)
    if a is None:
        a = amax_reference(t2)
    q_t = q.t().contiguous() if need_qt else None
    sc = torch.stack([scale, scale.reciprocal()])
    if recording:
        _record_torch(state, a, sc[0], saturated, record)
        if snapshot is not None:
            snapshot.extend([a, saturated])
    db = fp8_cast.bias_grad_reference(t2) if dbias else None
    return (q if need_q else None), q_t, sc, db


def _record_torch(state, a, shown, saturated, record: RecordRule) -> None:
    f, i = record_reference(state.f, state.i, a, shown, saturated, **record.kwargs())
    state.f.copy_(f)
    state.i.copy_(i)


def _with_kernels(t2, fp8_dtype, choice, state, record, need_q, need_qt, dbias, snapshot):
    if state is not None:
        acc, saturated = state.acc, state.i[I_ACC_SATURATED:]
    else:  # a replay or a call without a site: accumulators of its own
        acc, saturated = fp8_cast.new_accumulators(t2.device)
    sc = torch.empty(2, dtype=_float32, device=t2.device)
    if choice.mode != "given":
        fp8_amax.amax_into_(t2, acc, backend="triton")
    q, q_t, db = fp8_cast.quantize_(
        t2, fp8_dtype, mode=choice.mode, scale=choice.scale, initialized=choice.initialized, amax_acc=acc,
        saturated_acc=saturated, sc_out=sc, margin=choice.margin, power_of_two=choice.power_of_two,
        accumulate_amax=choice.mode == "given", write_q=need_q, write_qt=need_qt, dbias=dbias, backend="triton")
    if state is not None:
        snap = None
        if snapshot is not None:
            snap = torch.empty(2, dtype=torch.int64, device=t2.device)
            snapshot.append(snap)
        record_(state.f, state.i, acc, saturated, sc, snapshot=snap, backend="triton", **record.kwargs())
    return q, q_t, sc, db


def record_stats(state, stats: tuple, sc: torch.Tensor, record: RecordRule) -> None:
    """Records on ``state`` a call that reuses an earlier quantization: ``stats`` is what
    :func:`quantize` put in its ``snapshot`` (the same amax and saturated count), ``sc``
    its scales.

    Example::

        record_stats(state, snapshot, sc, RecordRule())
    """
    if len(stats) == 2:  # the torch branch's (amax, saturated)
        _record_torch(state, stats[0], sc[0], stats[1], record)
    else:  # the kernels' int64 [amax bits, saturated]
        snap = stats[0]
        record_(state.f, state.i, snap.view(torch.int32)[:1], snap[1:], sc, reset=False, backend="triton",
                **record.kwargs())


def quantize_along_k(t2: torch.Tensor, fp8_dtype: torch.dtype, choice: ScaleChoice, *, state=None,
                     record: RecordRule | None = None):
    """``(q, 1 / scales)`` of a 2-D operand laid out along the gemm's contraction
    dimension, with many scales (``choice.mode`` names their layout): ``"rows"`` is one
    scale per row (:func:`quantize_rows`). Scale layouts that tile rows further (block
    scaling) add their mode here. Recorded on ``state`` when given.

    Example::

        >>> q, inv = quantize_along_k(torch.tensor([[2.0], [4.0]]), torch.float8_e4m3fn, ScaleChoice("rows"))
        >>> inv.flatten().tolist()
        [0.004464285913854837, 0.008928571827709675]
    """
    if choice.mode == "rows":
        return quantize_rows(t2, fp8_dtype, power_of_two=choice.power_of_two, state=state, record=record)
    raise ValueError(f"quantize_along_k: no quantizer for scale layout {choice.mode!r}; the layouts are 'rows'")


def quantize_rows(t2: torch.Tensor, fp8_dtype: torch.dtype, *, power_of_two: bool = False, state=None,
                  record: RecordRule | None = None):
    """``(q, 1 / scales)`` of a 2-D operand with one scale per row (``(rows, 1)``), each
    from its row's amax (``fp8_max / amax``). Recorded on ``state`` when given: the
    largest amax and the smallest scale of the rows, and the saturated count. The torch
    rule on every device (no kernel of its own).

    Example::

        >>> q, inv = quantize_rows(torch.tensor([[2.0], [4.0]]), torch.float8_e4m3fn)
        >>> q.float().flatten().tolist()
        [448.0, 448.0]
    """
    a = amax_reference(t2, rowwise=True)
    scale = scale_from_amax_reference(a, fp8_cast.fp8_max(fp8_dtype), 0, power_of_two)
    q, saturated = cast_reference(t2, scale, fp8_dtype)
    if state is not None and record is not None:
        _record_torch(state, a.max(), scale.min(), saturated, record)
    return q, scale.reciprocal()


def quantize_tiled(t2: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool, colwise: bool,
                   power_of_two: bool = False, state=None, record: RecordRule | None = None):
    """Block scaling's activations and output gradients: ``(q, q_inv, q_t, qt_inv)`` of a
    2-D operand in 1 x 128 tiles (``rowwise``) and/or 128 x 1 tiles (``colwise``, written
    transposed), one read (``fp8_block.quantize_tiles``). Recorded on ``state`` when given:
    the amax of the whole operand; nothing saturates (each tile's own scale).

    Example::

        >>> q, q_inv, _, _ = quantize_tiled(torch.ones(2, 4), torch.float8_e4m3fn, rowwise=True, colwise=False)
        >>> q_inv.tolist()
        [[0.0022321429569274187], [0.0022321429569274187]]
    """
    return _blockwise(fp8_block.quantize_tiles, t2, fp8_dtype, state, record, rowwise=rowwise, colwise=colwise,
                      power_of_two=power_of_two)


def quantize_blocked(w: torch.Tensor, fp8_dtype: torch.dtype, *, write_qt: bool, power_of_two: bool = False,
                     state=None, record: RecordRule | None = None):
    """Block scaling's weights: ``(q, q_t, inv)`` of a 2-D weight in 128 x 128 blocks, ``q_t``
    when ``write_qt`` (``fp8_block.quantize_blocks``), recorded as :func:`quantize_tiled`.

    Example::

        >>> q, q_t, inv = quantize_blocked(torch.ones(2, 4), torch.float8_e4m3fn, write_qt=True)
        >>> q_t.shape, inv.shape
        (torch.Size([4, 2]), torch.Size([1, 1]))
    """
    return _blockwise(fp8_block.quantize_blocks, w, fp8_dtype, state, record, write_qt=write_qt,
                      power_of_two=power_of_two)


def _blockwise(fn, t2, fp8_dtype, state, record, **kwargs):
    recording = state is not None and record is not None
    if kernels_in_use(t2):
        out = fn(t2, fp8_dtype, amax_acc=state.acc if recording else None, backend="triton", **kwargs)
        if recording:  # the amax the kernel accumulated; the scale field keeps its value
            record_(state.f, state.i, state.acc, state.i[I_ACC_SATURATED:], state.f[F_SHOWN:F_SHOWN + 1],
                    backend="triton", **record.kwargs())
        return out
    out = fn(t2, fp8_dtype, backend="torch", **kwargs)
    if recording:
        _record_torch(state, amax_reference(t2), state.f[F_SHOWN], state.i[I_ACC_SATURATED], record)
    return out


# The fp8 path's frames: Dynamo inlines them where it traces a call under the fp8 level,
# and never compiles them as frames of their own (see _torch_compat.keep_out_of_dynamo).
_torch_compat.keep_out_of_dynamo(globals(), __name__)
