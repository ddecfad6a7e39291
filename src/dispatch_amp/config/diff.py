"""``policy_diff``: what differs, op by op, between two policies, two torch releases'
tables, or two configuration files.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Any

from .. import _markdown
from ..autocast import release_tables
from ..autocast.policy import Policy
from . import files

__all__ = ["policy_diff", "PolicyDiff", "PolicyDiffRow"]

_RELEASE = re.compile(r"^\d+\.\d+(\.\d+)?$")


@dataclasses.dataclass(frozen=True)
class PolicyDiffRow:
    """One op that differs: its kind in ``a`` and in ``b`` (None: not cast), each with the
    overloads the rule is limited to where those differ too (``"fp32 [Scalar]"``)."""

    op: str
    a: str | None
    b: str | None


@dataclasses.dataclass(frozen=True)
class PolicyDiff:
    """The rows of ``policy_diff``, sorted by op; ``str()`` is a table. Empty (falsy) when
    the two agree.

    Example::

        >>> import dispatch_amp as amp
        >>> d = amp.policy_diff("2.11", "2.12", device_type="cuda")
        >>> [(r.op, r.a, r.b) for r in d.rows]
        [('aten::rms_norm', None, 'fp32')]
    """

    a: str
    b: str
    rows: tuple[PolicyDiffRow, ...]

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __str__(self) -> str:
        if not self.rows:
            return f"{self.a} and {self.b} cast every op alike"
        return _markdown.table(["op", self.a, self.b], [[r.op, r.a or "-", r.b or "-"] for r in self.rows])


def _rules_of(policy: Policy) -> dict[str, tuple[str, frozenset | None]]:
    return {op: (kind.value, policy._overloads.get(op)) for op, kind in policy.rules.items()}


def _rules_of_release(release: str, device_type: str) -> dict[str, tuple[str, frozenset | None]]:
    rules: dict[str, tuple[str, set]] = {}
    for kind, entries in release_tables.registrations(release, device_type).items():
        for entry in entries:
            op, _, overload = entry.partition(".")
            rules.setdefault(op, (kind, set()))[1].add(overload or "default")
    return {op: (kind, frozenset(overloads)) for op, (kind, overloads) in rules.items()}


def _side(x: Any, device_type: str | None, both_releases: bool):
    """(label, rules) of one side."""
    if isinstance(x, Policy):
        return f"policy {x.name!r}", _rules_of(x)
    if isinstance(x, str) and _RELEASE.match(x):
        if device_type is None:
            raise ValueError(f"comparing torch release {x!r} needs its device: policy_diff(..., device_type='cuda')")
        release = release_tables.release_of(x)
        if both_releases:
            # Two releases: their recorded tables, overload by overload, whatever torch runs here.
            release_tables.load(release)  # a release no table ships for: its error
            return f"torch {release} ({device_type})", _rules_of_release(release, device_type)
        return f"torch {release} ({device_type})", _rules_of(Policy.for_device(device_type, numerics=release))
    if isinstance(x, (str, os.PathLike)):
        obj = files.load(x)
        if not isinstance(obj, Policy):
            raise TypeError(f"{x}: holds a {type(obj).__name__}, not a policy")
        return pathlib.Path(x).name, _rules_of(obj)
    raise TypeError(
        f"policy_diff compares policies, torch releases ('2.11', with device_type=) and policy files, "
        f"got {type(x).__name__}"
    )


def _text(rule, overloads_differ: bool) -> str | None:
    if rule is None:
        return None
    kind, overloads = rule
    return f"{kind} [{', '.join(sorted(overloads))}]" if overloads_differ and overloads is not None else kind


def policy_diff(a: Any, b: Any, *, device_type: str | None = None) -> PolicyDiff:
    """Per op, what differs between ``a`` and ``b``: each a ``Policy``, a torch release
    (``"2.11"``, with ``device_type``: that release's native table) or the path of a
    policy file (``.toml``/``.json``).

    Two releases are compared as their shipped tables, overload by overload (named-tensor
    overloads included); a release against a policy as ``Policy.for_device(device_type,
    numerics=release)``, the table it pins on the installed torch.

    Example::

        >>> import dispatch_amp as amp
        >>> print(amp.policy_diff("2.11", "2.12", device_type="cuda"))
        | op | torch 2.11 (cuda) | torch 2.12 (cuda) |
        |---|---|---|
        | aten::rms_norm | - | fp32 |
    """
    both = all(isinstance(x, str) and _RELEASE.match(x) for x in (a, b))
    label_a, rules_a = _side(a, device_type, both)
    label_b, rules_b = _side(b, device_type, both)
    if label_a == label_b:
        label_a, label_b = f"a: {label_a}", f"b: {label_b}"
    rows = []
    for op in sorted(set(rules_a) | set(rules_b)):
        ra, rb = rules_a.get(op), rules_b.get(op)
        if ra == rb:
            continue
        overloads_differ = ra is not None and rb is not None and ra[1] != rb[1]
        rows.append(PolicyDiffRow(op, _text(ra, overloads_differ), _text(rb, overloads_differ)))
    return PolicyDiff(label_a, label_b, tuple(rows))
