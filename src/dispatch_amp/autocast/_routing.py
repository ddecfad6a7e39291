"""What the engine does with each op under one policy: the rules turned into handlers.

A ``Policy`` holds rules only (op name -> ``CastKind``). The kernels need, per aten
overload, the function that applies the rule (``_handlers.py``), with what it needs from
the op's schema read once. ``Plan`` works that out per overload on first use and
memoizes it; :func:`plan_for` keeps one plan per (policy, device type), so the hot path is
one dict read.

Which overloads a rule covers: every overload of the op except ``out=`` and in-place
ones (native autocast casts neither), or the ones the policy names (``Policy.overloads_of``).
Which overloads get a kernel at all
(``Plan.registered``): those the policy names, and under a policy of our own also those
native autocast registers for the device type, so that native's kernels never cast a
call under our region (see "Note: the engine lives in the dispatcher" in ``_engine.py``).
"""

from __future__ import annotations

from torch._ops import OpOverload

import torch

from .. import _torch_compat
from . import _handlers
from ._cudnn_rnn import cudnn_rnn
from ._fp8_handler import fp8 as fp8_handler
from ._torch_checkpoint import refusing_torch_checkpoint
from .op_tables import BANNED, FP8, FP32, FP32_UNLESS_DTYPE, LOWER, PROMOTE, CastKind
from .policy import Policy, castable, castable_overloads

__all__ = ["Plan", "plan_for"]

# Kinds whose handler does not depend on the op's schema (fp8: only linear may be, its
# handler takes an eligible call to the fp8 path and casts the others as lower does).
_SIMPLE = {LOWER: _handlers.lower, FP8: fp8_handler, FP32: _handlers.fp32,
           PROMOTE: _handlers.promote, BANNED: _handlers.banned}

# Ops native autocast handles with a wrapper of their own rather than its kind's.
_SPECIAL = {"aten::_cudnn_rnn": cudnn_rnn}


def _native_overloads(device_type: str) -> list[OpOverload]:
    """The overloads native autocast registers for ``device_type``'s key in this torch."""
    key = _torch_compat.AUTOCAST_KEY_NAMES.get(device_type)
    found = []
    for name in _torch_compat.autocast_registration_overloads(key) if key else ():
        op = _torch_compat.overload_by_name(name)
        if op is not None:
            found.append(op)
    return found


def _fp32_unless_dtype(op: OpOverload):
    """The handler of an fp32-unless-dtype rule for this overload, from its schema."""
    arguments = op._schema.arguments
    for i, a in enumerate(arguments):
        if a.name == "dtype":
            if not isinstance(a.type, torch._C.OptionalType):
                return _handlers.given  # a required dtype already decides: not native's
            handler = _handlers.fp32_set_opt_dtype(None if a.kwarg_only else i)
            handler.dtype_position = i  # where the compiled engine finds it (every argument is positional there)
            return handler
    # No dtype argument: native redispatches to the overload that takes one (norm).
    names = tuple(a.name for a in arguments)
    for overload in op.overloadpacket.overloads():
        sibling = getattr(op.overloadpacket, overload)
        sibling_names = tuple(a.name for a in sibling._schema.arguments)
        if castable(sibling) and sibling_names == names + ("dtype",):
            defaults = tuple(a.default_value for a in arguments)
            return _handlers.fp32_append_dtype(sibling, names, defaults)
    return _handlers.fp32  # neither: the input cast to float32, the nearest native rule


class Plan:
    """The handlers of one policy on one device type, memoized per aten overload.

    ``handlers[id(op)]``: the handler the kernel of ``op`` calls (``_handlers.given`` for
    an op the policy does not cast; keyed by ``id``, which hashes in C, and overloads live
    as long as torch). ``registered``: the overloads that need a kernel.

    Example::

        >>> import torch
        >>> plan = plan_for(Policy.for_device("cpu"), "cpu")
        >>> plan.handler(torch.ops.aten.mm.default).__name__
        'lower'
    """

    __slots__ = ("policy", "device_type", "handlers", "registered", "_native")

    def __init__(self, policy: Policy, device_type: str):
        self.policy = policy
        self.device_type = device_type
        # Filled on first sight of an overload; the rules never change, so the memo
        # never needs invalidating.
        self.handlers: dict = {}
        native = Policy.for_device(device_type)
        self._native = native
        ops = [op for name in policy.rules for op in castable_overloads(name) if _kind(policy, op) is not None]
        if policy._key != native._key:
            ops += _native_overloads(device_type)
        self.registered = tuple(dict.fromkeys(ops))

    def handler(self, op: OpOverload):
        """The handler of ``op`` (memoized)."""
        try:
            return self.handlers[id(op)]
        except KeyError:
            handler = self.handlers[id(op)] = self._resolve(op)
            return handler

    def kind(self, op: OpOverload) -> CastKind | None:
        """The cast kind the policy gives ``op`` (None: run as given)."""
        return _kind(self.policy, op)

    def _resolve(self, op: OpOverload):
        kind = self.kind(op)
        if kind is None:
            handler = _handlers.given
        elif kind is LOWER and op.overloadpacket._qualified_op_name in _SPECIAL:
            handler = _SPECIAL[op.overloadpacket._qualified_op_name]
        elif kind is FP32_UNLESS_DTYPE:
            handler = _fp32_unless_dtype(op)
        else:
            handler = _SIMPLE[kind]
        if self.policy._key != self._native._key:
            native_kind = _kind(self._native, op)
            # fp8's handler refuses torch's checkpoint itself, for the calls it takes to
            # the fp8 path only: its other calls are cast as native casts them.
            if native_kind is not kind and kind is not FP8:
                handler = refusing_torch_checkpoint(handler, kind, native_kind)
        return handler


def _kind(policy: Policy, op: OpOverload) -> CastKind | None:
    """The kind ``policy``'s rules give overload ``op`` (None: none covers it)."""
    if not castable(op):
        return None
    name = op.overloadpacket._qualified_op_name
    kind = policy.rules.get(name)
    if kind is None:
        return None
    limited = policy._overloads.get(name)
    return kind if limited is None or op._overloadname in limited else None


# Policies are values: equal policies (equal rule keys) share their plans.
_PLANS: dict[tuple[str, str], Plan] = {}


def plan_for(policy: Policy, device_type: str) -> Plan:
    """The (shared, memoized) plan of ``policy`` on ``device_type``.

    Example::

        >>> plan_for(Policy.for_device("cpu"), "cpu") is plan_for(Policy.for_device("cpu"), "cpu")
        True
    """
    key = (policy._key, device_type)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = Plan(policy, device_type)
    return plan


_torch_compat.keep_out_of_dynamo(globals(), __name__)
