"""``Policy``: an immutable table that says which ops run in which precision.

A policy maps aten ops (``OpOverloadPacket`` names such as ``"aten::mm"``, or custom ops
registered with ``torch.library``) to a cast kind; see ``op_tables.py`` for the kinds and
for the two built-in tables. Every name is resolved against ``torch.ops`` when the policy
is built, so a typo raises at once instead of silently never casting; so does a name
no rule could ever apply to (an ``out=`` or in-place overload, or an op that has only
those: autocast never casts them).

Example::

    import torch, dispatch_amp as amp

    policy = amp.Policy.for_device("cuda").with_ops(fp32=["mm"])   # keep matmuls in fp32
    with amp.autocast("cpu", policy=policy):
        ...
"""

from __future__ import annotations

import difflib
import types
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch._ops import OpOverload, OpOverloadPacket

from .. import _torch_compat
from .._config_error import ConfigError
from ..warning_types import AmpNumericsWarning
from . import op_tables, release_tables
from .op_tables import BANNED, FP8, FP8_OPS, FP32, FP32_UNLESS_DTYPE, KINDS, LOWER, PROMOTE, CastKind

__all__ = ["Policy", "CastKind", "LOWER", "FP32", "FP32_UNLESS_DTYPE", "PROMOTE", "BANNED", "FP8"]

OpLike = str | OpOverloadPacket | OpOverload


def _resolve(op: OpLike) -> tuple[str, str | None]:
    """``(namespace::name, overload or None)`` for an op given as a packet, an overload or
    a string (``"mm"``, ``"aten::mm"``, ``"aten::pow.Tensor_Scalar"``)."""
    if isinstance(op, OpOverload):
        return op.overloadpacket._qualified_op_name, op._overloadname
    if isinstance(op, OpOverloadPacket):
        return op._qualified_op_name, None
    if not isinstance(op, str):
        raise TypeError(
            f"an op must be a string such as 'aten::mm', a torch.ops packet or an overload, "
            f"got {type(op).__name__}"
        )
    namespace, sep, name = op.partition("::")
    if not sep:
        namespace, name = "aten", op
    name, _, overload = name.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, OpOverloadPacket):
        raise ValueError(
            f"unknown op {namespace}::{name}: no such operator is registered with torch.ops "
            f"(check the spelling, or register the custom op before building the policy)"
        )
    if overload and overload not in packet.overloads():
        raise ValueError(
            f"unknown overload {overload!r} of {packet._qualified_op_name}: it has "
            f"{sorted(packet.overloads())}"
        )
    return packet._qualified_op_name, overload or None


def _qualified_name(op: OpLike) -> str:
    """``namespace::name`` of the op (its packet) given as a packet, an overload or a string."""
    return _resolve(op)[0]


def castable(op: OpOverload) -> bool:
    """Whether a rule may cover overload ``op``: not ``out=``, not in-place (native
    autocast casts neither)."""
    if op._overloadname == "out" or op._overloadname.endswith("_out"):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def castable_overloads(name: str) -> list[OpOverload]:
    """The overloads of op ``namespace::name`` a rule may cover (see ``castable``)."""
    namespace, _, op_name = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op_name)
    return [op for op in (getattr(packet, o) for o in packet.overloads()) if castable(op)]


def _functional_name(name: str) -> str | None:
    """The op a rule for ``name`` (an op whose overloads are all out= or in-place) should
    name instead: ``aten::add`` for ``aten::add_``; None if there is none."""
    namespace, _, op_name = name.partition("::")
    for suffix in ("_", "_out"):
        if op_name.endswith(suffix):
            candidate = f"{namespace}::{op_name[: -len(suffix)]}"
            try:
                if castable_overloads(candidate):
                    return candidate
            except (AttributeError, RuntimeError):
                pass
    return None


def _refuse_uncastable(name: str, overload: str | None) -> None:
    """Raise ``ValueError`` if a rule on ``name`` (or on its ``overload``) could never
    apply: out= and in-place overloads are never cast (native autocast casts neither), so
    a rule naming only those would be kept and silently do nothing."""
    if (name, overload) in _CASTABLE_SEEN:
        return
    _check_castable(name, overload)
    # A name that passed keeps passing (an op gains overloads, never loses them; one that
    # is gone fails in _resolve first): policies are rebuilt by every with_ops().
    _CASTABLE_SEEN.add((name, overload))


_CASTABLE_SEEN: set[tuple[str, str | None]] = set()


def _check_castable(name: str, overload: str | None) -> None:
    never = "autocast never casts out= or in-place overloads (native autocast neither), so the rule would never apply"
    if overload is not None:
        namespace, _, op_name = name.partition("::")
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        if castable(op):
            return
        form = "an out=" if overload == "out" or overload.endswith("_out") else "an in-place"
        functional = name if castable_overloads(name) else _functional_name(name)
        fix = f"name the functional op {functional!r}" if functional else "name the op's functional form"
        raise ValueError(f"{name}.{overload} is {form} overload: {never}; {fix} instead.")
    if castable_overloads(name):
        return
    functional = _functional_name(name)
    fix = f"name the functional op {functional!r}" if functional else "name the op's functional form"
    raise ValueError(
        f"{name} has only out= and in-place overloads (each writes to an argument): {never}; "
        f"{fix} instead."
    )


def _cast_kind(kind) -> CastKind:
    """The ``CastKind`` member for a kind given as a member or as its string."""
    if kind.__class__ is CastKind:  # every region asks for its policy's fp8 ops by member
        return kind
    try:
        return CastKind(kind)
    except ValueError:
        raise ValueError(f"unknown cast kind {kind!r}; kinds are {[k.value for k in KINDS]}") from None


def _rules_from_table(table: Mapping[str, Iterable[OpLike]]) -> tuple[dict[str, CastKind], dict[str, frozenset]]:
    """``(rules, overloads)``: op name -> kind, and op name -> the overloads a rule is
    limited to, for the ops named by overload (``"aten::mm.default"``)."""
    unknown = sorted(str(k) for k in table if k not in KINDS)
    if unknown:
        raise ValueError(f"unknown cast kind(s) {unknown}; kinds are {[k.value for k in KINDS]}")
    rules: dict[str, CastKind] = {}
    overloads: dict[str, set] = {}
    whole: set = set()
    for kind, ops in table.items():
        kind = _cast_kind(kind)
        if isinstance(ops, (str, OpOverload, OpOverloadPacket)):
            raise TypeError(f"the ops of kind {kind!r} must be a list of ops, not a single op")
        for op in ops:
            name, overload = _resolve(op)
            _refuse_uncastable(name, overload)
            if name in rules and (rules[name] is not kind or overload is None or name in whole):
                raise ValueError(
                    f"{name} is registered twice, as {rules[name]!r} and as {kind!r}: "
                    f"an op has exactly one cast kind"
                )
            if kind is FP8 and name not in _FP8_NAMES:
                raise ValueError(
                    f"{name} cannot be fp8: the fp8 path implements {list(_FP8_NAMES)} "
                    f"(a linear: a gemm with a 2-D weight, forward and both gradients); "
                    f"give {name} another kind"
                )
            rules[name] = kind
            if overload is None:
                whole.add(name)
            else:
                overloads.setdefault(name, set()).add(overload)
    return rules, {name: frozenset(names) for name, names in overloads.items()}


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

    __slots__ = ("name", "_rules", "_overloads", "_key", "_by_kind")

    def __init__(self, table: Mapping[str, Iterable[OpLike]], *, name: str = "custom"):
        self.name = name
        rules, overloads = _rules_from_table(table)
        self._rules: Mapping[str, CastKind] = types.MappingProxyType(rules)
        # op name -> the overloads its rule is limited to (ops named by overload only).
        self._overloads: Mapping[str, frozenset] = types.MappingProxyType(overloads)
        # The rules spelled as one string: equality and hashing compare it. The engine
        # compares keys rather than policies on paths torch.compile traces, where Dynamo
        # before torch 2.13 refuses to call a user class's __hash__.
        self._key = "\n".join(sorted(f"{entry} {kind.value}" for entry, kind in self._entries()))
        # kind -> its ops, made once: every region asks for the fp8 ones when it is made.
        by_kind: dict = {}
        for op_name, kind in rules.items():
            by_kind.setdefault(kind, set()).add(op_name)
        self._by_kind = {kind: frozenset(names) for kind, names in by_kind.items()}

    @classmethod
    def for_device(cls, device_type: str, numerics: str | None = None) -> Policy:
        """The built-in policy of ``"cuda"``, ``"cpu"``, ``"xpu"`` or ``"mps"``.

        ``numerics=None`` (default): native autocast's table for that device type in the
        installed torch. ``numerics="2.11"`` (any release in
        ``release_tables.RELEASES``): that release's native table, whatever torch is
        installed, so an upgrade of torch keeps a model's casts. An op the release cast
        that the installed torch no longer has is reported once (an
        ``AmpNumericsWarning`` naming it); no call can reach it here.

        A pinned policy is an ordinary ``Policy``: equal to the default one where the
        tables agree (the installed release, say), and otherwise applied by the engine
        as any policy of one's own.

        Example::

            Policy.for_device("cuda").kind_of("softmax")                   # 'fp32_unless_dtype'
            Policy.for_device("cuda", numerics="2.11").kind_of("rms_norm")  # None: 2.11 left it alone
        """
        try:
            builtin = _BUILTIN[device_type]
        except (KeyError, TypeError):
            raise ValueError(
                f"no built-in policy for device type {device_type!r}; "
                f"built-in policies: {sorted(_BUILTIN)}"
            ) from None
        if numerics is None:
            return builtin
        return _pinned(device_type, numerics)

    # -- reading ------------------------------------------------------------------------
    @property
    def rules(self) -> Mapping[str, CastKind]:
        """Read-only mapping of qualified op name (``"aten::mm"``) to cast kind.

        A rule covers every overload of its op except ``out=`` and in-place ones, or only
        those named when the op was given by overload (``"aten::mm.default"``): the built-in
        policies name overloads where native autocast registers some of an op's and not
        others. ``overloads_of`` tells which.
        """
        return self._rules

    def overloads_of(self, op: OpLike) -> frozenset[str] | None:
        """The overload names ``op``'s rule is limited to, or None (every overload it may
        cover, or no rule).

        Example::

            Policy.for_device("cpu").overloads_of("_convolution")   # frozenset({'deprecated'})
        """
        return self._overloads.get(_qualified_name(op))

    def kind_of(self, op: OpLike) -> CastKind | None:
        """The cast kind of ``op`` (``"lower"``, ``"fp32"``...), or None if it runs as given.

        An overload (``torch.ops.aten.mm.dtype``, ``"mm.dtype"``) gets its op's kind if the
        rule covers it; an op gets its rule's kind."""
        name, overload = _resolve(op)
        kind = self._rules.get(name)
        if kind is None or overload is None:
            return kind
        limited = self._overloads.get(name)
        return kind if limited is None or overload in limited else None

    def ops(self, kind: str) -> frozenset[str]:
        """The qualified names of the ops of one kind."""
        return self._by_kind.get(_cast_kind(kind), frozenset())

    def table(self) -> dict[str, tuple[str, ...]]:
        """The policy as a table ``{kind: (op names...)}``, the form the constructor takes
        (ops whose rule is limited to some overloads are listed by overload)."""
        table: dict[str, list[str]] = {kind: [] for kind in KINDS}
        for entry, kind in self._entries():
            table[kind].append(entry)
        return {kind: tuple(sorted(names)) for kind, names in table.items()}

    def _entries(self):
        """``(name, kind)`` per rule, ``name`` an op or, for limited rules, an overload."""
        for name, kind in self._rules.items():
            limited = self._overloads.get(name)
            if limited is None:
                yield name, kind
            else:
                for overload in limited:
                    yield f"{name}.{overload}", kind

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
        changes = Policy(
            {LOWER: lower, FP32: fp32, FP32_UNLESS_DTYPE: fp32_unless_dtype,
             PROMOTE: promote, BANNED: banned, FP8: fp8}
        )
        # A changed op takes its new rule whole (its entries here are replaced).
        entries = [(e, k) for e, k in self._entries() if e.split(".", 1)[0] not in changes._rules]
        entries += list(changes._entries())
        return Policy._from_entries(entries, name or _derived_name(self.name))

    def without_ops(self, *ops: OpLike, name: str | None = None) -> Policy:
        """A copy in which ``ops`` are no longer cast (they run with their inputs as given).

        Example::

            Policy.for_device("cpu").without_ops("cat", "stack")
        """
        removed = set()
        for op in ops:
            qualified = _qualified_name(op)
            if qualified not in self._rules:
                raise ValueError(f"{qualified} is not in policy {self.name!r}, nothing to remove")
            removed.add(qualified)
        entries = [(e, k) for e, k in self._entries() if e.split(".", 1)[0] not in removed]
        return Policy._from_entries(entries, name or _derived_name(self.name))

    @classmethod
    def _from_entries(cls, entries, name: str) -> Policy:
        table: dict[str, list[str]] = {kind: [] for kind in KINDS}
        for entry, kind in entries:
            table[kind].append(entry)
        return cls(table, name=name)

    # -- as data ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The policy as JSON- and TOML-ready data: ``{"kind": "policy", "format": 1,
        "name": ..., "rules": {kind: [op or overload names]}}``; ``Policy.from_dict`` reads
        it back to an equal policy of the same name. ``dispatch_amp.config.dump`` writes
        it to a file.

        Example::

            >>> d = Policy.for_device("cpu").with_ops(fp32=["mm"]).to_dict()
            >>> d["kind"], d["format"], "aten::mm" in d["rules"]["fp32"]
            ('policy', 1, True)
            >>> Policy.from_dict(d) == Policy.for_device("cpu").with_ops(fp32=["mm"])
            True
        """
        return {
            "kind": "policy",
            "format": POLICY_FORMAT,
            "name": self.name,
            "rules": {kind.value: list(names) for kind, names in self.table().items() if names},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Policy:
        """The policy ``to_dict`` wrote. Validated: a wrong or misspelt key, an unknown cast
        kind, an unknown op raise ``dispatch_amp.config.ConfigError`` naming the key
        (``e.key``, e.g. ``"rules.fp32"``).

        Example::

            >>> Policy.from_dict({"kind": "policy", "format": 1, "rules": {"fp32": ["aten::mm"]}}).kind_of("mm")
            'fp32'
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a policy is a table of keys {sorted(_POLICY_KEYS)}, got {type(data).__name__}")
        _check_keys(data, _POLICY_KEYS, required=("kind", "format", "rules"), where="")
        if data["kind"] != "policy":
            raise ConfigError(f"kind = {data['kind']!r}: Policy.from_dict reads kind 'policy'", key="kind",
                              value=data["kind"])
        fmt = data["format"]
        if type(fmt) is not int or not 1 <= fmt <= POLICY_FORMAT:
            raise ConfigError(
                f"format = {fmt!r}: this dispatch_amp reads policy formats 1 to {POLICY_FORMAT}"
                + (" (a newer dispatch_amp wrote it: upgrade)" if type(fmt) is int and fmt > POLICY_FORMAT else ""),
                key="format", value=fmt)
        name = data.get("name", "custom")
        if not isinstance(name, str):
            raise ConfigError(f"name = {name!r}: a policy's name is a string", key="name", value=name)
        rules = data["rules"]
        if not isinstance(rules, Mapping):
            raise ConfigError(f"rules: a table of cast kind -> ops, got {type(rules).__name__}", key="rules")
        kinds = [k.value for k in KINDS]
        _check_keys(rules, kinds, required=(), where="rules.", what="cast kind")
        for kind, ops in rules.items():
            if not isinstance(ops, (list, tuple)) or not all(isinstance(op, str) for op in ops):
                raise ConfigError(f"rules.{kind}: a list of op names (strings), got {ops!r}", key=f"rules.{kind}")
            for op in ops:
                try:
                    name_, overload = _resolve(op)
                    _refuse_uncastable(name_, overload)
                    if kind == FP8.value and name_ not in _FP8_NAMES:
                        raise ValueError(f"{name_} cannot be fp8: the fp8 path implements {list(_FP8_NAMES)}")
                except ValueError as e:
                    raise ConfigError(f"rules.{kind}: {op!r}: {e}", key=f"rules.{kind}", value=op) from None
        try:
            return cls(rules, name=name)
        except ValueError as e:  # an op under two kinds
            raise ConfigError(f"rules: {e}", key="rules") from None

    # -- value semantics ----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __reduce__(self):
        # Pickled and deep-copied as its table and name (Lightning deep-copies and pickles
        # the precision plugins that hold a policy); the engine's plans are made on use.
        return _policy_from_table, ({str(k.value): v for k, v in self.table().items()}, self.name)

    def __repr__(self) -> str:
        counts = ", ".join(f"{kind}={len(self.ops(kind))}" for kind in KINDS)
        return f"Policy(name={self.name!r}, {counts})"


# The version of ``Policy.to_dict``'s layout; ``from_dict`` reads this one and older.
POLICY_FORMAT = 1
_POLICY_KEYS = ("kind", "format", "name", "rules")


def _check_keys(data: Mapping, allowed, *, required, where: str, what: str = "key") -> None:
    """ConfigError naming the first key of ``data`` not in ``allowed`` (with the nearest
    allowed one), or the first ``required`` key missing."""
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{where}{key}: unknown {what} {key!r}{hint}; known: {list(allowed)}",
                              key=f"{where}{key}", value=key)
    for key in required:
        if key not in data:
            raise ConfigError(f"{where}{key}: missing (a policy has keys {list(allowed)})", key=f"{where}{key}")


def policy_with_fp8_ops(policy: Policy) -> Policy:
    """``policy`` with ``op_tables.FP8_OPS`` marked fp8: what a region given ``fp8=`` and a
    policy that names no fp8 op applies. Memoized (regions are made once per step).

    ``linear`` always; ``addmm``, ``mm`` and ``matmul`` (whose linear-shaped calls the fp8
    path takes) where ``policy`` lowers them, limited to the overloads it lowers: their
    other calls then run exactly as before, as ``lower``. An op the policy gives another
    kind keeps it.

    Example::

        >>> p = policy_with_fp8_ops(Policy.for_device("cpu"))
        >>> p.kind_of("linear"), p.kind_of("addmm"), p.kind_of("addmm.dtype")
        ('fp8', 'fp8', None)
    """
    name = f"{policy.name} with fp8 {', '.join(FP8_OPS)}"
    derived = _WITH_FP8.get((policy._key, name))
    if derived is None:
        reach = {f"aten::{op}" for op in FP8_OPS if op != "linear"}
        marked = ["linear"] + [entry for entry, kind in policy._entries()
                               if kind is LOWER and entry.split(".", 1)[0] in reach]
        derived = _WITH_FP8[(policy._key, name)] = policy.with_ops(fp8=marked, name=name)
    return derived


_WITH_FP8: dict[tuple[str, str], Policy] = {}


def _derived_name(base: str) -> str:
    # A derived policy is not its base: errors and reprs must not call it by the base's
    # name ("policy 'cpu'" reads as the built-in table).
    return base if base.startswith("derived from ") else f"derived from {base!r}"


def _policy_from_table(table: Mapping[str, Iterable[str]], name: str) -> Policy:
    return Policy(table, name=name)


def _table_of_registrations(by_kind: Mapping[str, Iterable[str]]) -> tuple[dict[str, list[str]], list[str]]:
    """A policy table, and the entries this torch lacks, from native's registrations by
    kind (``{"fp32": ["aten::pow.Tensor_Scalar", ...]}``: this torch's, or a release's).

    An op is kept as the op where the registrations cover every overload of it that takes
    a tensor and a rule may cover, else as the overloads registered (``_convolution.deprecated``
    on CPU: a call of ``_convolution``'s other overload, as vmap's convolution rules make,
    is native's to leave alone). An entry whose op or overload this torch does not have
    (a release's named-tensor overloads on a later torch, an op added later) is returned
    apart: no call can reach it here.
    """
    kept: dict[str, list[str]] = {}
    missing: list[str] = []
    for kind, entries in by_kind.items():
        registered: dict[str, set] = {}
        for entry in entries:
            op, _, overload = entry.partition(".")
            registered.setdefault(op, set()).add(overload or "default")
        kept[kind] = []
        for op, overloads in registered.items():
            namespace, _, op_name = op.partition("::")
            packet = getattr(getattr(torch.ops, namespace), op_name, None)
            if not isinstance(packet, OpOverloadPacket):
                missing.extend(f"{op}.{o}" if o != "default" else op for o in sorted(overloads))
                continue
            present = overloads & set(packet.overloads())
            missing.extend(f"{op}.{o}" for o in sorted(overloads - present))
            castable = {
                o._overloadname for o in castable_overloads(op)
                if any(isinstance(a.type, torch._C.TensorType) or "Tensor" in str(a.type) for a in o._schema.arguments)
            }
            if castable <= present:
                kept[kind].append(op)
            else:
                kept[kind].extend(f"{op}.{overload}" for overload in sorted(present & castable))
    return kept, missing


def _builtin_table(table: Mapping[str, Iterable[str]], registered: Mapping[str, Iterable[str]]
                   ) -> tuple[dict[str, list[str]], tuple[str, ...]]:
    """The part of a built-in table that applies to the installed torch, and the names left out.

    ``registered``: the installed torch's registrations for the device, by kind
    (``release_tables.record``); see ``_table_of_registrations``. The tables name the
    union over the supported torch versions and builds, so a name may be left out without
    being a typo; ``tests/autocast/test_policy.py`` checks that every name left out is one
    known to differ between versions or builds.
    """
    kept, _ = _table_of_registrations(registered)
    ops = {entry.partition(".")[0] for entries in registered.values() for entry in entries}
    omitted = [name for names in table.values() for name in names if f"aten::{name}" not in ops]
    return kept, tuple(omitted)


def _builtin(device_type: str, table, registered) -> Policy:
    kept, omitted = _builtin_table(table, registered)
    OMITTED[device_type] = omitted
    return Policy(kept, name=device_type)


def _pinned(device_type: str, release) -> Policy:
    """``Policy.for_device(device_type, numerics=release)`` (memoized: the warning about
    ops this torch lacks is given once)."""
    if not isinstance(release, str) or release_tables.release_of(release) not in release_tables.RELEASES:
        raise ValueError(
            f"numerics={release!r} names no shipped torch release; shipped releases: "
            f"{list(release_tables.RELEASES)} (or numerics=None: the installed torch's table)"
        )
    release = release_tables.release_of(release)
    policy = _PINNED.get((device_type, release))
    if policy is None:
        kept, missing = _table_of_registrations(release_tables.registrations(release, device_type))
        policy = Policy(kept, name=f"{device_type}, torch {release} numerics")
        if policy == _BUILTIN[device_type]:
            policy = _BUILTIN[device_type]  # the same table: the same object
        _PINNED[(device_type, release)] = policy
        if missing:
            warnings.warn(
                f"torch {release}'s {device_type} autocast table casts {missing}, which torch "
                f"{torch.__version__} does not have: no call can reach them here, and the rest of "
                f"torch {release}'s table applies",
                AmpNumericsWarning, stacklevel=3,
            )
    return policy


_PINNED: dict[tuple[str, str], Policy] = {}


# Names of each built-in table that the installed torch does not register (see
# _builtin_table), by device type.
OMITTED: dict[str, tuple[str, ...]] = {}

_REGISTERED = release_tables.record(strict=False)
_BUILTIN = {
    device_type: _builtin(device_type, table, _REGISTERED[device_type])
    for device_type, (table, _key) in op_tables.DEVICE_TABLES.items()
}
# The device types with a built-in policy, in the order op_tables lists them.
BUILTIN_DEVICES = tuple(_BUILTIN)
