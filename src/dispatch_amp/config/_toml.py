"""A small TOML writer (the standard library reads TOML, ``tomllib``, but writes none),
and where a key stands in a file's text, for errors that give a line.

It writes what configurations hold: tables of strings, integers, floats, booleans and
lists of those, nested tables, and lists of tables (as ``[[name]]`` sections, which keep
their order). Lists are written one item a line, so a changed entry is a one-line diff in
review.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["dumps", "line_of"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _key(k) -> str:
    if not isinstance(k, str):
        raise TypeError(f"a TOML key is a string, got {k!r}")
    return k if _BARE_KEY.fullmatch(k) else _string(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        if not v:
            return "[]"
        return "[\n" + "".join(f"    {_value(item)},\n" for item in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} to TOML")


def dumps(data: Mapping) -> str:
    """``data`` as TOML text: its plain values first, then one ``[table]`` per nested mapping.

    Example::

        >>> print(dumps({"kind": "policy", "rules": {"fp32": ["aten::mm"]}}), end="")
        kind = "policy"
        <BLANKLINE>
        [rules]
        fp32 = [
            "aten::mm",
        ]
    """
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _tables(v) -> bool:
    """Whether ``v`` is a list of tables (written as ``[[name]]`` sections)."""
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(item, Mapping) for item in v)


def _table(data: Mapping, path: list[str], lines: list[str], header: str | None = None) -> None:
    # A section's plain values come before any section below it: a header ends the table.
    plain = [(k, v) for k, v in data.items() if not isinstance(v, Mapping) and not _tables(v)]
    nested = [(k, v) for k, v in data.items() if isinstance(v, Mapping) or _tables(v)]
    if header is not None or (path and (plain or not nested)):
        lines.append("")
        lines.append(header or "[" + ".".join(_key(p) for p in path) + "]")
    for k, v in plain:
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in nested:
        if isinstance(v, Mapping):
            _table(v, [*path, k], lines)
        else:
            # Each ``[[a.b]]`` opens the list's next item; its subtables follow it.
            for item in v:
                _table(item, [*path, k], lines, header="[[" + ".".join(_key(p) for p in [*path, k]) + "]]")


def line_of(text: str, key: str | None, value: object = None) -> int | None:
    """The 1-based line of ``text`` where the offending ``value`` (a string, quoted in the
    file) or else ``key``'s last part (``"fp32"`` of ``"rules.fp32"``) stands; None if
    neither is found. Works for TOML and JSON alike.

    Example::

        >>> line_of('kind = "policy"\\n[rules]\\nfp32 = ["mmm"]\\n', "rules.fp32", "mmm")
        3
    """
    lines = text.splitlines()
    needles = []
    if isinstance(value, str):
        needles += [f'"{value}"', f"'{value}'"]
    if key:
        last = key.rsplit(".", 1)[-1]
        needles += [re.compile(rf'^\s*"?{re.escape(last)}"?\s*[=:]'), re.compile(rf'"{re.escape(last)}"\s*:'),
                    re.compile(rf"^\s*\[+\s*{re.escape(key)}\s*\]+")]
    for needle in needles:
        for number, line in enumerate(lines, 1):
            if (needle in line) if isinstance(needle, str) else needle.search(line):
                return number
    return None
