"""A parameter's data that FSDP2 all-gathers in fp8, and is its high-precision self elsewhere.

``ShardedFp8Weight`` wraps the parameter's own tensor. Every op but FSDP2's two hooks sees
that tensor: the op runs on it and gives plain tensors (optimizer updates, its state,
``state_dict``, ``clip_grad_norm_``, any op of the model's), except the ops FSDP2 uses to
cut, pad and move the shard (views, ``new_zeros``, ``copy_``, ``.to``, ``clone``), which
keep the wrapper so that the shard FSDP2 holds is one (see "Note: subclass preserving ops").

FSDP2's extension points (``torch.distributed.fsdp``'s ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``, called on the local shard of each ``DTensor`` parameter):

* before the all-gather, the shard is cast to fp8 with the scale its recipe gives the
  whole weight (``_shard_cast.py``); the fp8 shard and a few bytes of statistics are what
  travel (in the gather's uint8 packing, alongside the other parameters);
* after it, the gathered fp8 weight and its scales become the unsharded parameter
  (``fp8/_gathered.py``), which the fp8 gemm takes as it is.

Note: subclass preserving ops. FSDP2 shards with ``chunk`` (``split``), pads with
``new_zeros`` and ``copy_`` then ``narrow``s, views the padded shard flat, and moves it
with ``.to``/``_to_copy``; torchao's float8 all-gather keeps the same list. In-place ops
(an optimizer's ``add_``) update the wrapped tensor and return the wrapper.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ... import _torch_compat
from .._gathered import MODE_BLOCKS, MODE_COLUMNS, MODE_ROWS, Gathered, GatheredFp8Weight
from ._shard_cast import cast_shard, gathered_stats

__all__ = ["ShardedFp8Weight", "Plan", "unwrap"]

_aten = torch.ops.aten
_PRESERVING = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
               _aten.as_strided.default, _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default,
               _aten.narrow.default, _aten.clone.default, _aten.empty_like.default, _aten.new_zeros.default,
               _aten.new_empty.default, _aten._to_copy.default, _aten._pin_memory.default}
_graph_task_id = torch._C._current_graph_task_id


class Plan:
    """What one weight's fp8 all-gather needs: its recipe and the recipe's scaling rule,
    its site (the recipe's state for it, found by name), its fp8 format, and the scale its
    last forward gather used (a backward gather of a tensorwise recipe reuses it)."""

    def __init__(self, recipe, site, name: str | None) -> None:
        self.recipe = recipe
        self.rule = recipe.state.rule
        self.site = site
        self.name = name
        self.fmt = self.rule.forward_dtype
        self.last_scale: torch.Tensor | None = None


class ShardedFp8Weight(torch.Tensor):
    """A parameter's tensor that FSDP2 all-gathers in fp8 under ``plan``'s recipe; for
    everything else, the tensor it wraps. Made by :func:`fp8.all_gather_in_fp8
    <dispatch_amp.fp8.all_gather_in_fp8>`, never by hand.

    Example::

        handle = amp.fp8.all_gather_in_fp8(model, recipe)
        type(model[0].weight.data).__name__     # 'ShardedFp8Weight'
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, plan: Plan):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, plan: Plan) -> None:
        self._data = data
        self._plan = plan

    def __repr__(self) -> str:
        return f"ShardedFp8Weight({self._data!r}, site={self._plan.name!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._plan

    @staticmethod
    def __tensor_unflatten__(inner, plan, outer_size, outer_stride):
        return ShardedFp8Weight(inner["_data"], plan)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedFp8Weight)]
        plain_args, plain_kwargs = pytree.tree_map_only(ShardedFp8Weight, lambda t: t._data, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable:
            # In place, out=, foreach and fused optimizer ops: a result that is a wrapped
            # tensor is its wrapper.
            own = {id(w._data): w for w in wrappers}
            return pytree.tree_map_only(torch.Tensor, lambda t: own.get(id(t), t), out)
        if func in _PRESERVING:
            plan = wrappers[0]._plan
            return pytree.tree_map_only(torch.Tensor, lambda t: ShardedFp8Weight(t, plan), out)
        return out

    # -- FSDP2's all-gather extension ------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The fp8 shard and its statistics, cast with the scale of the whole weight."""
        _check_layout(self, mesh, outer_size)
        src = self._data
        if mp_policy is not None and mp_policy.param_dtype is not None and src.dtype != mp_policy.param_dtype:
            # "All-gather in high precision" gathers in param_dtype: the cast starts there.
            src = src.to(mp_policy.param_dtype)
        plan = self._plan
        device = src.device
        plan.recipe.state.prepare(plan.site, device)
        # A gather started by autograd is the backward's (FSDP2 gathers again after
        # resharding, and prefetches there).
        backward = _graph_task_id() != -1
        inputs, (mode, sc) = cast_shard(plan, src, mesh.get_group(), backward)
        # The extras ride in the metadata too: on one rank FSDP2 gathers nothing and
        # copies only the first input across.
        return tuple(inputs), (mode, sc, tuple(outer_size), tuple(outer_stride), tuple(inputs[1:]))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered fp8 weight as the unsharded parameter (a ``GatheredFp8Weight``)."""
        mode, sc, size, stride, local_extras = metadata
        data = all_gather_outputs[0]
        if len(all_gather_outputs) == 1 and local_extras:  # one rank: its own are the whole weight's
            all_gather_outputs = (data, *local_extras)
        box = out._gathered if out is not None else Gathered(self._plan)
        box.data, box.mode = data, mode
        if mode == MODE_BLOCKS:
            block = self._plan.rule.block
            inv, stats = all_gather_outputs[1], all_gather_outputs[2]
            box.amax, box.saturated, _ = gathered_stats(stats.reshape(-1, 2))
            box.sc, box.shown = inv.reshape(data.shape[0] // block, -1), None
        elif mode == MODE_COLUMNS:
            box.sc, box.amax, box.shown, box.saturated = sc, None, None, None
        elif mode == MODE_ROWS:
            inv, stats = all_gather_outputs[1], all_gather_outputs[2]
            box.amax, box.saturated, smallest = gathered_stats(stats.reshape(-1, 3))
            box.sc, box.shown = inv.reshape(-1, 1), smallest[0]
        else:
            box.amax, box.saturated, _ = gathered_stats(all_gather_outputs[1].reshape(-1, 2))
            box.sc, box.shown = sc, sc[0]
        if out is not None:
            return None
        weight = GatheredFp8Weight(box, torch.Size(size), stride, param_dtype, data.device)
        return weight, tuple(all_gather_outputs)


def _check_layout(shard: ShardedFp8Weight, mesh, outer_size) -> None:
    name = shard._plan.name
    if shard._data.device != shard.device or shard._data.shape != shard.shape:
        # ``param.data = param.to(device)`` (fully_shard moving a model to its device)
        # replaces the wrapper's metadata, not the tensor it wraps.
        raise RuntimeError(
            f"fp8 all-gather of {name!r}: the weight was moved with .data = (to {shard.device}) after "
            f"all_gather_in_fp8 wrapped it; move the model to its device before all_gather_in_fp8")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fp8 all-gather of {name!r}: FSDP2 on a {mesh.ndim}-D mesh (HSDP, or tensor parallel) is not "
            f"supported; use a 1-D mesh, or turn fp8 all-gather off for this model")
    world = mesh.size()
    rows, cols = outer_size[0], outer_size[1]
    if rows % world:
        raise ValueError(
            f"fp8 all-gather of {name!r}: its {rows} rows do not split evenly over {world} ranks; FSDP2 would pad "
            f"the last shard, and the statistics sent along need equal shards. Keep this weight out "
            f"(all_gather_in_fp8(..., filter_fn=...)) or use a world size that divides {rows}")
    block = getattr(shard._plan.rule, "block", None) if shard._plan.rule.granularity == "block" else None
    if block is not None and (rows // world) % block:
        raise ValueError(
            f"fp8 all-gather of {name!r} under block scaling: each of the {world} ranks holds {rows // world} of its "
            f"{rows} rows, which cuts its {block} x {block} blocks between ranks (a block's scale needs all its "
            f"rows). Keep this weight out (all_gather_in_fp8(..., filter_fn=...)), or shard so that each rank holds "
            f"a multiple of {block} rows")
    if tuple(shard.shape) != (rows // world, cols):
        raise ValueError(
            f"fp8 all-gather of {name!r}: FSDP2 sharded it as {tuple(shard.shape)} of {tuple(outer_size)}; only "
            f"the default sharding along dim 0 (whole rows on each rank) is supported: drop shard_placement_fn "
            f"for this weight or keep it out of all_gather_in_fp8")


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The tensor a ``ShardedFp8Weight`` wraps (``t`` itself otherwise)."""
    return t._data if type(t) is ShardedFp8Weight else t


_torch_compat.keep_out_of_dynamo(globals(), __name__)
