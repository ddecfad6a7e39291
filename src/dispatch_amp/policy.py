"""``Policy``: an immutable table that says which ops run in which precision.

A policy maps aten ops (``OpOverloadPacket`` names such as ``"aten::mm"``, or custom ops
registered with ``torch.library``) to a cast kind; see ``op_tables.py`` for the kinds and
for the two built-in tables. Every name is resolved against ``torch.ops`` when the policy
is built, so a typo raises at once instead of silently never casting.

Example::

    import torch, dispatch_amp as amp

    policy = amp.Policy.for_device("cuda").with_ops(fp32=["mm"])   # keep matmuls in fp32
    with amp.autocast("cpu", policy=policy):
        ...
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping

import torch
from torch._ops import OpOverload, OpOverloadPacket

from . import _torch_compat, op_tables
from .op_tables import BANNED, FP8, FP8_OPS, FP32, FP32_UNLESS_DTYPE, KINDS, LOWER, PROMOTE, CastKind

__all__ = ["Policy", "CastKind", "LOWER", "FP32", "FP32_UNLESS_DTYPE", "PROMOTE", "BANNED", "FP8"]

OpLike = str | OpOverloadPacket | OpOverload


def _qualified_name(op: OpLike) -> str:
    """Returns ``namespace::name`` for an op given as a packet, an overload or a string."""
    if isinstance(op, OpOverload):
        return op.overloadpacket._qualified_op_name
    if isinstance(op, OpOverloadPacket):
        return op._qualified_op_name
    if not isinstance(op, str):
        raise TypeError(
            f"an op must be a string such as 'aten::mm', a torch.ops packet or an overload, "
            f"got {type(op).__name__}"
        )
    namespace, sep, name = op.partition("::")
    if not sep:
        namespace, name = "aten", op
    # An overload suffix ("pow.Tensor_Scalar") names the packet: rules apply per op.
    name = name.split(".", 1)[0]
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, OpOverloadPacket):
        raise ValueError(
            f"unknown op {namespace}::{name}: no such operator is registered with torch.ops "
            f"(check the spelling, or register the custom op before building the policy)"
        )
    return packet._qualified_op_name


def _cast_kind(kind) -> CastKind:
    """The ``CastKind`` member for a kind given as a member or as its string."""
    try:
        return CastKind(kind)
    except ValueError:
        raise ValueError(f"unknown cast kind {kind!r}; kinds are {[k.value for k in KINDS]}") from None


def _rules_from_table(table: Mapping[str, Iterable[OpLike]]) -> dict[str, CastKind]:
    unknown = sorted(str(k) for k in table if k not in KINDS)
    if unknown:
        raise ValueError(f"unknown cast kind(s) {unknown}; kinds are {[k.value for k in KINDS]}")
    rules: dict[str, CastKind] = {}
    for kind, ops in table.items():
        kind = _cast_kind(kind)
        if isinstance(ops, (str, OpOverload, OpOverloadPacket)):
            raise TypeError(f"the ops of kind {kind!r} must be a list of ops, not a single op")
        for op in ops:
            name = _qualified_name(op)
            if name in rules:
                raise ValueError(
                    f"{name} is registered twice, as {rules[name]!r} and as {kind!r}: "
                    f"an op has exactly one cast kind"
                )
            if kind is FP8 and name not in _FP8_NAMES:
                raise ValueError(
                    f"{name} cannot be fp8: the fp8 path implements {list(_FP8_NAMES)} "
                    f"(a gemm with a 2-D weight, forward and both gradients)"
                )
            rules[name] = kind
    return rules


_FP8_NAMES = tuple(f"aten::{op}" for op in FP8_OPS)


class Policy:
    """Which ops autocast runs in lower precision, in float32, promoted, or refuses.

    Build one from a device's built-in table with ``Policy.for_device("cuda")`` (also
    ``"cpu"``, ``"xpu"``, ``"mps"``) and derive variants with ``with_ops`` (add or move ops,
    custom ops included) and ``without_ops``. Policies are immutable and hashable.

    Example::

        p = Policy.for_device("cpu")
        p.kind_of("mm")                         # 'lower'
        p2 = p.with_ops(fp32=["aten::mm"]).without_ops("conv2d")
        p2.kind_of("mm"), p2.kind_of("conv2d")  # ('fp32', None)
    """

    __slots__ = ("name", "_rules", "_key", "_routes")

    def __init__(self, table: Mapping[str, Iterable[OpLike]], *, name: str = "custom"):
        self.name = name
        rules = _rules_from_table(table)
        self._rules: Mapping[str, CastKind] = types.MappingProxyType(rules)
        # The rules spelled as one string: equality and hashing compare it. The engine
        # compares keys rather than policies on paths torch.compile traces, where Dynamo
        # before torch 2.13 refuses to call a user class's __hash__.
        self._key = "\n".join(sorted(f"{op} {kind.value}" for op, kind in rules.items()))
        # The engine's routes for these rules (_routing.routes_for), made on first use.
        self._routes = None

    @classmethod
    def for_device(cls, device_type: str) -> Policy:
        """The built-in policy of ``"cuda"``, ``"cpu"``, ``"xpu"`` or ``"mps"``, matching
        native autocast's table for that device type in the installed torch.

        Example::

            Policy.for_device("cuda").kind_of("softmax")   # 'fp32_unless_dtype'
        """
        try:
            return _BUILTIN[device_type]
        except (KeyError, TypeError):
            raise ValueError(
                f"no built-in policy for device type {device_type!r}; "
                f"built-in policies: {sorted(_BUILTIN)}"
            ) from None

    # -- reading ------------------------------------------------------------------------
    @property
    def rules(self) -> Mapping[str, CastKind]:
        """Read-only mapping of qualified op name (``"aten::mm"``) to cast kind."""
        return self._rules

    def kind_of(self, op: OpLike) -> CastKind | None:
        """The cast kind of ``op`` (``"lower"``, ``"fp32"``...), or None if it runs as given."""
        return self._rules.get(_qualified_name(op))

    def ops(self, kind: str) -> frozenset[str]:
        """The qualified names of the ops of one kind."""
        kind = _cast_kind(kind)
        return frozenset(name for name, k in self._rules.items() if k is kind)

    def table(self) -> dict[str, tuple[str, ...]]:
        """The policy as a table ``{kind: (op names...)}``, the form the constructor takes."""
        return {kind: tuple(sorted(self.ops(kind))) for kind in KINDS}

    # -- deriving -----------------------------------------------------------------------
    def with_ops(
        self,
        *,
        lower: Iterable[OpLike] = (),
        fp32: Iterable[OpLike] = (),
        fp32_unless_dtype: Iterable[OpLike] = (),
        promote: Iterable[OpLike] = (),
        banned: Iterable[OpLike] = (),
        fp8: Iterable[OpLike] = (),
        name: str | None = None,
    ) -> Policy:
        """A copy with ops added, or moved to another kind if they were already listed.

        ``name`` defaults to ``"derived from '<this policy's name>'"``.

        Example::

            Policy.for_device("cuda").with_ops(lower=["torch_ext::fused_gelu"], fp32=["mm"])
        """
        changes = _rules_from_table(
            {LOWER: lower, FP32: fp32, FP32_UNLESS_DTYPE: fp32_unless_dtype,
             PROMOTE: promote, BANNED: banned, FP8: fp8}
        )
        rules = dict(self._rules)
        rules.update(changes)
        return Policy._from_rules(rules, name or _derived_name(self.name))

    def without_ops(self, *ops: OpLike, name: str | None = None) -> Policy:
        """A copy in which ``ops`` are no longer cast (they run with their inputs as given).

        Example::

            Policy.for_device("cpu").without_ops("cat", "stack")
        """
        rules = dict(self._rules)
        for op in ops:
            qualified = _qualified_name(op)
            if qualified not in rules:
                raise ValueError(f"{qualified} is not in policy {self.name!r}, nothing to remove")
            del rules[qualified]
        return Policy._from_rules(rules, name or _derived_name(self.name))

    @classmethod
    def _from_rules(cls, rules: Mapping[str, CastKind], name: str) -> Policy:
        table: dict[str, list[str]] = {kind: [] for kind in KINDS}
        for op_name, kind in rules.items():
            table[kind].append(op_name)
        return cls(table, name=name)

    # -- value semantics ----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self):
        # Pickled and deep-copied as its rules and name (Lightning deep-copies and pickles
        # the precision plugins that hold a policy); the routes are made again on use.
        return _policy_from_rules, (dict(self._rules), self.name)

    def __repr__(self) -> str:
        counts = ", ".join(f"{kind}={len(self.ops(kind))}" for kind in KINDS)
        return f"Policy(name={self.name!r}, {counts})"


def policy_with_fp8_ops(policy: Policy) -> Policy:
    """``policy`` with ``op_tables.FP8_OPS`` marked fp8: what a region given ``fp8=`` and a
    policy that names no fp8 op applies. Memoized (regions are made once per step).

    Example::

        >>> policy_with_fp8_ops(Policy.for_device("cpu")).kind_of("linear")
        'fp8'
    """
    name = f"{policy.name} with fp8 {', '.join(FP8_OPS)}"
    derived = _WITH_FP8.get((policy._key, name))
    if derived is None:
        derived = _WITH_FP8[(policy._key, name)] = policy.with_ops(fp8=FP8_OPS, name=name)
    return derived


_WITH_FP8: dict[tuple[str, str], Policy] = {}


def _derived_name(base: str) -> str:
    # A derived policy is not its base: errors and reprs must not call it by the base's
    # name ("policy 'cpu'" reads as the built-in table).
    return base if base.startswith("derived from ") else f"derived from {base!r}"


def _policy_from_rules(rules: Mapping[str, str], name: str) -> Policy:
    return Policy._from_rules({op: _cast_kind(kind) for op, kind in rules.items()}, name)


def _builtin_table(
    table: Mapping[str, Iterable[str]], own: Mapping[str, str | None], key: str
) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    """The part of a built-in table that applies to the installed torch, and the names left out.

    A name native autocast registers is kept where this torch registers it for ``key``;
    a name of ours (``own``) is kept where torch has the op and the native entry it
    follows is registered. The tables name the union over the supported torch versions,
    so a name may be left out without being a typo; ``tests/test_policy.py`` checks that
    every name left out is one known to differ between versions.
    """
    listed = {name for names in table.values() for name in names}
    strays = sorted(set(own) - listed)
    if strays:
        raise ValueError(f"op_tables: {strays} are marked as our own but are in no table of {key}")
    registered = _torch_compat.autocast_registrations(key)
    kept: dict[str, list[str]] = {}
    omitted: list[str] = []
    for kind, names in table.items():
        kept[kind] = []
        for name in names:
            if name in own:
                follows = own[name]
                keep = hasattr(torch.ops.aten, name) and (
                    follows is None or f"aten::{follows}" in registered
                )
            else:
                keep = f"aten::{name}" in registered
            (kept[kind] if keep else omitted).append(name)
    return kept, tuple(omitted)


def _builtin(device_type: str, table, own, key: str) -> Policy:
    kept, omitted = _builtin_table(table, own, key)
    OMITTED[device_type] = omitted
    return Policy(kept, name=device_type)


# Names of each built-in table that the installed torch does not register (see
# _builtin_table), by device type.
OMITTED: dict[str, tuple[str, ...]] = {}

_BUILTIN = {
    device_type: _builtin(device_type, table, own, key)
    for device_type, (table, own, key) in op_tables.DEVICE_TABLES.items()
}
# The device types with a built-in policy, in the order op_tables lists them.
BUILTIN_DEVICES = tuple(_BUILTIN)
