"""fp8 weight all-gather under FSDP2: weights travel in fp8, cast with their recipe's scale.

``all_gather_in_fp8(model, recipe)``, called before ``fully_shard``, wraps the data of
each eligible weight (``nn.Linear`` weights whose shape the recipe runs in fp8) in a
tensor that FSDP2 all-gathers in fp8 through its extension points (``_sharded.py``): each
rank casts its shard with the scale its recipe gives the whole weight (``_shard_cast.py``),
the fp8 shards travel, and the fp8 gemm takes the gathered fp8 weight as it is
(``_linear.py``). The bits are those of "all-gather in high precision, then cast": the
fp8 weight, the scales, the recipe's state, the training run.

Everywhere else the wrapped weight is the high-precision tensor it wraps (the optimizer
and its state, ``state_dict``, which gives plain tensors). ``handle.remove()`` puts the
plain tensors back, before or after ``fully_shard``. docs/distributed.md, "fp8 weight
all-gather", gives the bytes moved and what is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import _torch_compat
from .._gathered import GatheredFp8Weight
from ._linear import gathered_linear
from ._sharded import Plan, ShardedFp8Weight, unwrap

__all__ = ["all_gather_in_fp8", "Fp8AllGather", "GatheredFp8Weight", "ShardedFp8Weight", "gathered_linear"]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


class Fp8AllGather:
    """The weights ``all_gather_in_fp8`` wrapped; ``remove()`` puts the plain ones back.

    Example::

        handle = amp.fp8.all_gather_in_fp8(model, recipe)
        print(handle.names)        # the sites whose weights travel in fp8
        ...
        handle.remove()            # FSDP2 gathers them in high precision again
    """

    def __init__(self, model: torch.nn.Module, entries: list, hooks: list) -> None:
        self._model = model
        self._entries = entries  # (module, attribute, plan)
        self._hooks = hooks
        self.removed = False

    @property
    def names(self) -> list[str]:
        """The site names of the weights all-gathered in fp8."""
        return [plan.name for _, _, plan in self._entries]

    def remove(self) -> None:
        """Puts the plain parameters back: before ``fully_shard``, new plain parameters with
        the same data (make the optimizer after); after it, the same sharded parameters
        with plain local shards, and FSDP2 gathers them in high precision from the next
        all-gather on. Call it between steps (every FSDP2 module resharded)."""
        if self.removed:
            return
        dtensor = _dtensor_type()
        fsdp_params = None
        for module, attr, _ in self._entries:
            param = module._parameters[attr]
            if dtensor is not None and isinstance(param, dtensor):
                if fsdp_params is None:
                    fsdp_params = _fsdp_params(self._model)
                _plain_shard(fsdp_params, module, attr, param)
            elif type(param) is ShardedFp8Weight:
                module._parameters[attr] = torch.nn.Parameter(unwrap(param), requires_grad=param.requires_grad)
        for hook in self._hooks:
            hook.remove()
        self.removed = True

    def __repr__(self) -> str:
        return f"Fp8AllGather({len(self._entries)} weights{', removed' if self.removed else ''})"


def all_gather_in_fp8(model: torch.nn.Module, recipe, *, prefix: str = "",
                      filter_fn: Callable[[str], bool] | None = None) -> Fp8AllGather:
    """Makes FSDP2 all-gather ``model``'s linear weights in fp8 under ``recipe``; call it
    before ``fully_shard``, with the model on its device (the wrapper cannot follow a move
    by ``.data =``, which ``fully_shard`` makes). Binds ``recipe`` to ``model``
    (``recipe.bind(model, prefix)``).

    Taken: the ``weight`` of every ``nn.Linear`` (and subclass) whose shape the recipe
    runs in fp8 (dimensions multiples of 16; block scaling: at least 128), held by that
    module alone (a tied weight is read by other ops, and
    stays in high precision), and accepted by ``filter_fn(site name)`` if given. The
    parameters are replaced by parameters of the same data (make the optimizer after).
    Such a weight then runs only in the fp8 gemms of ``amp.autocast(..., fp8=recipe)``:
    any other use of the gathered weight raises, saying so. Returns the handle whose
    ``remove()`` undoes it.

    Example::

        recipe = amp.fp8.CurrentScaling()
        handle = amp.fp8.all_gather_in_fp8(model, recipe)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with amp.autocast("cuda", dtype=torch.bfloat16, fp8=recipe):
            loss = model(x).float().pow(2).mean()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"all_gather_in_fp8() takes the nn.Module to shard, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable (site name) -> bool, got {filter_fn!r}")
    layout = recipe.state.rule.granularity
    if layout not in ("tensor", "row", "block"):
        raise NotImplementedError(
            f"all_gather_in_fp8(): {type(recipe).__name__} scales its weights by {layout!r}, which the fp8 "
            f"all-gather does not cast (it casts one scale per tensor, per row or per 128 x 128 block); "
            f"all-gather in high precision (do not call all_gather_in_fp8) with this recipe")
    dtensor = _dtensor_type()
    holders: dict[int, list] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            if dtensor is not None and isinstance(param, dtensor):
                raise RuntimeError(
                    "all_gather_in_fp8() must run before fully_shard(): the model's parameters are sharded already "
                    "(DTensors); call it on the unsharded model, then fully_shard")
            if type(param) is ShardedFp8Weight:
                raise RuntimeError("all_gather_in_fp8(): this model's weights are all-gathered in fp8 already; "
                                   "remove() the first handle before making another")
            holders.setdefault(id(param), []).append((module, attr, param))
    # Named before the parameters are wrapped, so that the sites hold no reference to the
    # wrappers (a weak reference would stop Module._apply, which swaps wrapper subclasses
    # in place, from converting them: model.to(dtype)); the wrapped weights find their
    # sites by those names.
    recipe.bind(model, prefix)
    kept = []
    for places in holders.values():
        module, attr, param = places[0]
        if not (len(places) == 1 and attr == "weight" and isinstance(module, torch.nn.Linear) and param.dim() == 2
                and param.dtype in (torch.float32, torch.bfloat16, torch.float16)):
            continue
        site = recipe.state.lookup(param)
        # The recipe's own rule (shapes, block scaling's 128 features at least, its
        # filter_fn for every name), for a batch of 16 rows.
        rows16 = torch.Size([16, param.shape[1]])
        if not all(recipe.eligible(name, rows16, param.shape) for name in site.names or [None]):
            continue
        if param.is_meta:
            raise RuntimeError(
                f"all_gather_in_fp8(): {type(module).__name__}.{attr} is on the meta device; materialize the model "
                f"on its device first (fully_shard on a meta model, then to_empty, is not supported with it)")
        if filter_fn is not None and not all(bool(filter_fn(name)) for name in site.names):
            continue
        kept.append((module, attr, param, Plan(recipe, site, site.name)))
    for module, attr, param, plan in kept:
        module._parameters[attr] = torch.nn.Parameter(ShardedFp8Weight(param.detach(), plan),
                                                      requires_grad=param.requires_grad)
    kept = [(module, attr, plan) for module, attr, _, plan in kept]
    hooks = [module.register_state_dict_post_hook(_plain_state(attr)) for module, attr, _ in kept]
    return Fp8AllGather(model, kept, hooks)


def _plain_state(attr: str):
    """A state_dict post-hook giving the plain tensor for the wrapped ``attr``: checkpoints
    never hold the wrapper, and load into a model without fp8 all-gather."""

    def hook(module, state_dict, prefix, local_metadata):
        key = prefix + attr
        value = state_dict.get(key)
        if value is None or isinstance(value, torch.nn.Parameter):  # keep_vars: the parameter itself
            return
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(value, dtensor):
            local = value._local_tensor
            if type(local) is ShardedFp8Weight:
                state_dict[key] = dtensor.from_local(unwrap(local), value.device_mesh, value.placements,
                                                     run_check=False, shape=value.shape, stride=value.stride())
        elif type(value) is ShardedFp8Weight:
            state_dict[key] = unwrap(value)

    return hook


def _fsdp_params(model: torch.nn.Module) -> list:
    # FSDP2 keeps one FSDPParam per sharded parameter in the param groups of the state of
    # the module fully_shard was given: a private structure, reached in this one place.
    # A list of groups (`_fsdp_param_groups`) on torch 2.12 and later; one group or None
    # (`_fsdp_param_group`) on 2.11.
    found = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = () if group is None else (group,)
        for group in groups:
            found.extend(group.fsdp_params)
    return found


def _plain_shard(fsdp_params: list, module, attr: str, param) -> None:
    """Gives FSDP2's sharded parameter a plain local shard and forgets its fp8 unsharded
    parameter, so that its next all-gather is FSDP2's own, in high precision."""
    for fp in fsdp_params:
        info = fp._module_info
        if info.module is module and info.param_name == attr:
            break
    else:
        raise RuntimeError(f"remove(): no FSDP2 state holds {type(module).__name__}.{attr}; was the model sharded "
                           f"with torch.distributed.fsdp.fully_shard?")
    if getattr(fp.sharded_state, "name", None) != "SHARDED":
        raise RuntimeError(f"remove(): {type(module).__name__}.{attr} is unsharded now (inside a forward or "
                           f"backward); call remove() between steps")
    param._local_tensor = unwrap(param._local_tensor)
    fp._sharded_param_data = unwrap(fp._sharded_param_data)
    fp.all_gather_outputs = []
    fp._unsharded_inner_tensors = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param


_torch_compat.keep_out_of_dynamo(globals(), __name__)
