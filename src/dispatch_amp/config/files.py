"""Configurations as TOML or JSON files, and in checkpoints.

A file holds one object: a table with ``kind`` (what it is: ``"policy"``,
``"precision_plan"``), ``format`` (the version of that kind's layout) and the object's own
keys. Each kind is a class and the two functions between its objects and that data
(``Policy.to_dict`` / ``Policy.from_dict``; a ``PrecisionPlan``'s are in ``plan_file``);
``register_kind`` adds one. Loading validates: a misspelt key, an unknown cast kind or op
fails with ``ConfigError``, naming the key and, from the file's text, its line.
"""

from __future__ import annotations

import json
import os
import pathlib
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

from .._config_error import ConfigError
from ..autocast.plan import PrecisionPlan
from ..autocast.policy import Policy
from . import _toml, plan_file

__all__ = ["dump", "load", "dumps", "loads", "to_dict", "from_dict", "register_kind", "state_dict",
           "load_state_dict", "CHECKPOINT_KEY", "ConfigError"]

# kind -> (the class of its objects, object -> data, data -> object).
_KINDS: dict[str, tuple[type, Callable[[Any], dict], Callable[[Mapping], Any]]] = {
    "policy": (Policy, Policy.to_dict, Policy.from_dict),
    plan_file.KIND: (PrecisionPlan, plan_file.plan_to_dict, plan_file.plan_from_dict),
}
_SUFFIXES = {".toml": "toml", ".json": "json"}
# The key a framework checkpoint files the policy under, next to the scaler's state.
CHECKPOINT_KEY = "dispatch_amp_policy"


def register_kind(kind: str, cls: type, *, to_dict: Callable[[Any], dict] | None = None,
                  from_dict: Callable[[Mapping], Any] | None = None) -> None:
    """Makes objects of ``cls`` readable and writable as files of ``kind``: ``to_dict(obj)``
    gives ``{"kind": kind, "format": ..., ...}`` (plain data) and ``from_dict(data)`` the
    object back; by default ``cls``'s own ``to_dict()`` method and ``from_dict`` classmethod.

    Example::

        register_kind("schedule", Schedule)
        register_kind("schedule", Schedule, to_dict=schedule_data, from_dict=schedule_from_data)
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a kind is a non-empty string, got {kind!r}")
    if kind in _KINDS and _KINDS[kind][0] is not cls:
        raise ValueError(f"kind {kind!r} is already {_KINDS[kind][0].__qualname__}'s")
    _KINDS[kind] = (cls, to_dict or cls.to_dict, from_dict or cls.from_dict)


def to_dict(obj: Any) -> dict:
    """``obj``'s data (``obj.to_dict()``) for an object of a registered kind.

    Example::

        >>> import dispatch_amp as amp
        >>> amp.config.to_dict(amp.Policy.for_device("cpu"))["kind"]
        'policy'
    """
    for cls, write, _ in _KINDS.values():
        if isinstance(obj, cls):
            return write(obj)
    raise TypeError(f"cannot write a {type(obj).__name__}: the kinds a file holds are "
                    f"{ {k: c[0].__name__ for k, c in _KINDS.items()} }")


def from_dict(data: Mapping) -> Any:
    """The object ``data`` describes, by its ``kind``. ``ConfigError`` naming the key if
    it does not validate.

    Example::

        >>> import dispatch_amp as amp
        >>> from_dict(amp.Policy.for_device("cpu").to_dict()) == amp.Policy.for_device("cpu")
        True
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a configuration is a table with a 'kind' key, got {type(data).__name__}")
    if "kind" not in data:
        raise ConfigError(f"kind: missing; a configuration says what it holds: kind = one of {sorted(_KINDS)}",
                          key="kind")
    kind = data["kind"]
    codec = _KINDS.get(kind) if isinstance(kind, str) else None
    if codec is None:
        raise ConfigError(f"kind = {kind!r}: unknown kind; known kinds: {sorted(_KINDS)}", key="kind", value=kind)
    return codec[2](data)


def _format_of(path: pathlib.Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in ("toml", "json"):
            raise ValueError(f"format {fmt!r}: files are 'toml' or 'json'")
        return fmt
    try:
        return _SUFFIXES[path.suffix.lower()]
    except KeyError:
        raise ValueError(f"{path}: a configuration file ends in .toml or .json (or pass fmt='toml'/'json')") from None


def dumps(obj: Any, fmt: str = "toml") -> str:
    """``obj`` as the text of a ``fmt`` (``"toml"`` or ``"json"``) file.

    Example::

        >>> import dispatch_amp as amp
        >>> print(dumps(amp.Policy({"fp32": ["mm"]}, name="mm in fp32")), end="")
        kind = "policy"
        format = 1
        name = "mm in fp32"
        <BLANKLINE>
        [rules]
        fp32 = [
            "aten::mm",
        ]
    """
    data = to_dict(obj)
    if fmt == "toml":
        return _toml.dumps(data)
    if fmt == "json":
        return json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    raise ValueError(f"format {fmt!r}: files are 'toml' or 'json'")


def loads(text: str, fmt: str = "toml", *, source: str = "<text>") -> Any:
    """The object in ``text``, a ``fmt`` file's content; ``source`` names it in errors.

    Example::

        >>> loads('kind = "policy"\\nformat = 1\\n[rules]\\nfp32 = ["mm"]\\n').kind_of("mm")
        'fp32'
    """
    try:
        if fmt == "toml":
            data = tomllib.loads(text)
        elif fmt == "json":
            data = json.loads(text)
        else:
            raise ValueError(f"format {fmt!r}: files are 'toml' or 'json'")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{source}: not valid {fmt.upper()}: {e}") from None
    try:
        return from_dict(data)
    except ConfigError as e:
        line = _toml.line_of(text, e.key, e.value)
        where = f"{source}:{line}" if line is not None else source
        raise ConfigError(f"{where}: {e.message}", key=e.key, value=e.value, line=line) from None


def dump(obj: Any, path: str | os.PathLike, fmt: str | None = None) -> pathlib.Path:
    """Writes ``obj`` (a ``Policy``, a ``PrecisionPlan``, or an object of a registered
    kind) to ``path``, as TOML or JSON by its suffix (``fmt`` overrides). Returns the path.

    Example::

        import dispatch_amp as amp
        amp.config.dump(amp.Policy.for_device("cuda", numerics="2.11"), "numerics.toml")
    """
    path = pathlib.Path(path)
    text = dumps(obj, _format_of(path, fmt))
    path.write_text(text, encoding="utf-8")
    return path


def load(path: str | os.PathLike, fmt: str | None = None) -> Any:
    """The object in the file ``path`` (TOML or JSON by its suffix), validated: a file
    that does not validate raises ``ConfigError`` naming the file, the line and the key.

    Example::

        policy = amp.config.load("numerics.toml")
    """
    path = pathlib.Path(path)
    fmt = _format_of(path, fmt)
    return loads(path.read_text(encoding="utf-8"), fmt, source=str(path))


def state_dict(obj: Any) -> dict:
    """``obj``'s entry for a checkpoint (``to_dict``: plain data, safe for
    ``torch.load(weights_only=True)``), to file next to the scaler's state so that a resume
    runs the same numerics.

    Example::

        >>> import dispatch_amp as amp
        >>> ckpt = {"scaler": amp.GradScaler("cpu").state_dict(),
        ...         CHECKPOINT_KEY: state_dict(amp.Policy.for_device("cpu"))}
        >>> load_state_dict(ckpt[CHECKPOINT_KEY]) == amp.Policy.for_device("cpu")
        True
    """
    return to_dict(obj)


def load_state_dict(state: Mapping) -> Any:
    """The object ``state_dict`` filed (validated as a file is)."""
    return from_dict(state)
