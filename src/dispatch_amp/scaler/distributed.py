"""torch.distributed support for GradScaler: which group to reduce over, local shards, the reduction.

Note: found_inf across ranks
----------------------------
Every rank must take the same decision each step (step or skip, back off or grow), or
the replicas silently diverge. Whether they already agree depends on where the
gradients come from:

* **Replicated gradients** (``DistributedDataParallel``): the gradients are all-reduced
  in the backward, before any unscale, so every rank sees the same values and computes
  the same flag. No communication is needed; torch's plain GradScaler does none.
* **Sharded gradients** (FSDP2 ``fully_shard``, any DTensor sharding, hand-made ZeRO):
  each rank checks only its own shard, so one rank can see an inf that the others do
  not. The per-optimizer flags are then reduced with ``MAX`` across the process group.

``GradScaler(process_group=...)`` chooses (see :func:`resolve_process_group`):

* ``None`` (default): reduce over the default (world) group when torch.distributed is
  initialized and one of the optimizer's *parameters* is a DTensor (FSDP2's are). The
  test looks at parameters, not gradients, because parameters are the same kind on every
  rank, so every rank takes the same branch (a collective only one rank joins hangs).
* a ``ProcessGroup``: always reduce over it (use this for sharding without DTensors).
* ``False``: never reduce.

The reduction is one asynchronous ``all_reduce(MAX)`` per ``unscale_()`` call (the flags
of all optimizers unscaled together travel in one tensor). Nothing waits for it until the
flags are consumed: ``step()`` waits right before its one packed host read, a fused
optimizer's ``step()`` and ``update()`` wait and then use the flag on the device. So the
number of host syncs per step does not change: ``work.wait()`` orders the reduction
before later work (on NCCL it makes the current CUDA stream wait; it does not read the
value on the host).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = [
    "local_tensor", "is_dtensor", "resolve_process_group", "all_reduce_max_async",
    "reduce_found_inf_async", "wait_reductions", "NO_REDUCTION",
]

# resolve_process_group's answer for "do not reduce" (None already means the default group
# to torch.distributed).
NO_REDUCTION = object()


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``; never imports the module.

    If ``torch.distributed.tensor`` was never imported, no DTensor can exist, so the
    common single-process case costs one dict lookup.

    Example::

        >>> is_dtensor(torch.ones(2))
        False
    """
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of ``t``: the local shard of a DTensor, else ``t`` itself.

    The returned tensor shares memory with ``t``, so in-place unscaling of it unscales
    the DTensor gradient. Call it under ``torch.no_grad()`` (``to_local()`` then returns
    the stored local tensor rather than an autograd view).

    Example::

        >>> g = torch.ones(3)
        >>> local_tensor(g) is g
        True
    """
    return t.to_local() if is_dtensor(t) else t


def resolve_process_group(process_group: Any, optimizer) -> Any:
    """The group to reduce ``optimizer``'s found_inf over, or :data:`NO_REDUCTION`.

    See "Note: found_inf across ranks" for the rule. Must give the same answer on every
    rank, which is why ``None`` looks at parameters.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> resolve_process_group(None, opt) is NO_REDUCTION   # not initialized, no DTensors
        True
    """
    if process_group is False:
        return NO_REDUCTION
    if process_group is not None:
        return process_group
    if not _initialized():
        return NO_REDUCTION
    for group in optimizer.param_groups:
        for param in group["params"]:
            if is_dtensor(param):
                return torch.distributed.group.WORLD
    return NO_REDUCTION


def check_process_group_arg(process_group: Any) -> None:
    """Raise TypeError unless ``process_group`` is None, False or a ProcessGroup."""
    if process_group is None or process_group is False:
        return
    if torch.distributed.is_available() and isinstance(process_group, torch.distributed.ProcessGroup):
        return
    raise TypeError(
        "process_group must be None (reduce over the world group when gradients are DTensors), "
        f"False (never reduce) or a torch.distributed.ProcessGroup, got {type(process_group).__name__}."
    )


def all_reduce_max_async(flags: list[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], Any]:
    """Start ``all_reduce(MAX)`` of 0-d fp32 flags (all on one device); no wait, no host read.

    Returns the tensors that will hold the reduced flags once the returned work handle is
    waited on, and the handle. Several flags travel in one stacked tensor: one collective
    however many optimizers.
    """
    if len(flags) == 1:
        out = [flags[0]]
        buf = flags[0]
    else:
        buf = torch.stack(flags)
        out = list(buf.unbind(0))
    work = torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX, group=group, async_op=True)
    return out, work


def reduce_found_inf_async(records, device: torch.device) -> None:
    """Start the cross-rank MAX of optimizers' found_inf flags; waits for nothing.

    ``records``: ``(process group or NO_REDUCTION, record)`` pairs, a record being
    GradScaler's per-optimizer state (``found_inf_per_device``, ``work``). Each reduced
    record's flags collapse to one flag on ``device``, the tensor the reduction writes,
    and its ``work`` is the handle :func:`wait_reductions` waits on. One collective per
    group for all records that share it.

    Example::

        reduce_found_inf_async([(group, rec1), (group, rec2)], scale.device)
        ...
        wait_reductions([rec1, rec2])   # before anything reads the flags
    """
    by_group: dict[int, tuple[Any, list]] = {}
    for group, rec in records:
        if group is not NO_REDUCTION:
            by_group.setdefault(id(group), (group, []))[1].append(rec)
    for group, recs in by_group.values():
        flags = []
        for rec in recs:
            per_dev = list(rec.found_inf_per_device.values())
            if len(per_dev) == 1 and per_dev[0].device == device:
                flags.append(per_dev[0])
            elif per_dev:  # several devices (e.g. offloaded shards): one flag for all
                flags.append(torch.stack([f.to(device, non_blocking=True) for f in per_dev]).sum())
            else:  # no gradients here: still join, so every rank runs the same collectives
                flags.append(torch.zeros((), dtype=torch.float32, device=device))
        reduced, work = all_reduce_max_async(flags, group)
        for rec, flag in zip(recs, reduced):
            rec.found_inf_per_device = {device: flag} if rec.found_inf_per_device else {}
            rec.work = work


def wait_reductions(records) -> None:
    """Order the records' pending reductions before what reads their flags (not a host read).

    Example::

        wait_reductions(records)   # a no-op for records without a pending reduction
    """
    waited: set[int] = set()
    for rec in records:
        if rec.work is not None:
            if id(rec.work) not in waited:
                rec.work.wait()
                waited.add(id(rec.work))
            rec.work = None


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
