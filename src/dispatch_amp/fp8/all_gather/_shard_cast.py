"""A weight's shard cast to fp8 before FSDP2 all-gathers it: each recipe's scale, chosen first.

"All-gather in high precision, then cast" and "cast each shard, then all-gather" give the
same bits when every element is cast with the scale the whole weight would get, and the
cast is elementwise. So each recipe's scale must be known before the cast, on every rank
alike:

* current scaling: ``fp8_max / max|w|`` of the whole weight. Each rank's shard amax is
  reduced (``all_reduce(MAX)``, one float per weight) first; a maximum is exact, so the
  scale is the one the whole weight gives.
* delayed scaling: the site's history scale, which every rank holds alike: no collective.
  Until the host knows the site is initialized (its first calls, where the recipe scales
  from the weight's own amax), the amax is reduced as for current scaling.
* block scaling: one scale per 128 x 128 block. With whole blocks on each shard (a shard's
  row count a multiple of 128; else refused) the shards' blocks are the weight's: no
  collective. Its row scales travel along.
* rowwise scaling, forward: one scale per row of the weight. FSDP2 shards dim 0, so each
  row is whole on one rank: no collective. Backward (the input gradient contracts the
  weight along its rows, so it takes one scale per column): the column amaxes are reduced
  (``all_reduce(MAX)``, one float per column).

Besides the fp8 shard, each rank sends small statistics along in the same all-gather: its
shard's amax (bits of a float32) and its count of saturated values, from which every rank
records the whole weight's amax (the maximum) and count (the sum) at the gemm, as a cast
of the whole weight records them. Rowwise also sends its rows' inverse scales.

A backward all-gather (FSDP2 gathers again for the backward when it resharded after the
forward) of a tensorwise recipe casts with the scale the forward used, kept on the
weight's plan: a recomputation under activation checkpointing then sees the forward's
bits, and current scaling needs no collective there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._rules import amax as _amax
from .._rules import cast as _cast
from ...kernels.fp8_quantize import quantize_blocked
from .._gathered import MODE_BLOCKS, MODE_COLUMNS, MODE_ROWS, MODE_TENSOR
from .._rules import scale_from_amax

__all__ = ["cast_shard", "gathered_stats"]

_float32, _int32 = torch.float32, torch.int32


def _reduced_max(a: torch.Tensor, group) -> torch.Tensor:
    a = a.clone()
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def _stats(a_local: torch.Tensor, saturated: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """One int32 vector: the shard's amax bits, its saturated count, then ``more`` (float32 bits)."""
    floats = [a_local.reshape(1).to(_float32)] + [m.reshape(1).to(_float32) for m in more]
    bits = torch.cat(floats).view(_int32)
    return torch.cat([bits[:1], saturated.reshape(1).to(_int32), bits[1:]])


def _tensor_scale(plan, a_local: torch.Tensor, group) -> torch.Tensor:
    """The scale the recipe's rule gives the whole weight now (its ``ScaleChoice``): one
    it knows (delayed scaling's history), else the rule applied to the reduced amax."""
    choice = plan.rule.choose(plan.site.roles["weight"], "weight")
    if choice.mode == "given":
        return choice.scale.clone()  # the history's, which later records update in place
    # The host must decide the same on every rank (the choice adds a collective): it
    # reads the initialized flag itself rather than trust the rule's probe, which arrives
    # at different times on different ranks; the flag is the same on every rank (the
    # weight records the whole weight's amax). Only until the first weight amax is in.
    if choice.mode == "first" and bool(choice.initialized > 0):
        return choice.scale.clone()
    return choice.of_amax(_reduced_max(a_local, group), plan.fmt)


def cast_shard(plan, src: torch.Tensor, group, backward: bool):
    """``(all-gather inputs, metadata)`` of one weight's 2-D shard ``src`` (already in the
    gather's dtype): the fp8 shard, then the statistics (and, rowwise, the row scales);
    ``metadata`` is ``(mode, sc)``: ``sc`` what the gemm takes for the whole weight where
    every rank knows it already (``[scale, 1 / scale]``; the column inverse scales), else
    None."""
    fmt = plan.fmt
    if plan.rule.granularity == "block":
        # Whole 128 x 128 blocks on each shard (_sharded.py checks): the shards' blocks are
        # the whole weight's, with no collective. Forward and backward alike (the same
        # blocks serve w and w.T); nothing saturates (each block's own scale).
        q, _, inv = quantize_blocked(src, fmt, write_qt=False, power_of_two=plan.rule.power_of_two)
        none = torch.zeros((), dtype=_int32, device=src.device)
        return [q, inv.reshape(-1), _stats(_amax(src), none)], (MODE_BLOCKS, None)
    if plan.rule.granularity == "row":
        if backward:
            col_amax = _reduced_max(_amax(src.t(), rowwise=True).reshape(1, -1), group)
            scale = scale_from_amax(col_amax, fmt, power_of_two=plan.rule.power_of_two)
            q, _ = _cast(src, scale, fmt)
            # FSDP2 fixes the all-gather's inputs (count, sizes, dtypes) at its first
            # gather: the forward's row scales and statistics have places here too.
            unused = [torch.zeros(src.shape[0], dtype=_float32, device=src.device),
                      torch.zeros(3, dtype=_int32, device=src.device)]
            return [q, *unused], (MODE_COLUMNS, scale.reciprocal())
        # As kernels/fp8_quantize.py's quantize_rows casts the whole weight, row by row.
        a_rows = _amax(src, rowwise=True)
        scale = scale_from_amax(a_rows, fmt, power_of_two=plan.rule.power_of_two)
        q, saturated = _cast(src, scale, fmt)
        stats = _stats(a_rows.max(), saturated, scale.min())
        return [q, scale.reciprocal().reshape(-1), stats], (MODE_ROWS, None)
    a_local = _amax(src)
    if backward and plan.last_scale is not None:
        scale = plan.last_scale
    else:
        scale = _tensor_scale(plan, a_local, group)
        plan.last_scale = scale
    q, saturated = _cast(src, scale, fmt)
    return [q, _stats(a_local, saturated)], (MODE_TENSOR, torch.stack([scale, scale.reciprocal()]))


def gathered_stats(stats: torch.Tensor):
    """``(amax, saturated, extra)`` of the whole weight from the ranks' statistics
    (``world x k`` int32): the largest amax, the summed count, and the smallest of each
    extra float (rowwise: the smallest row scale)."""
    amaxes = stats[:, 0].contiguous().view(_float32)
    saturated = stats[:, 1].to(torch.int64).sum()
    extra = stats[:, 2:].contiguous().view(_float32).amin(dim=0) if stats.shape[1] > 2 else None
    return amaxes.max(), saturated, extra
