"""``ConfigError``, on the ground floor of the package: a configuration that fails to
validate, naming the key at fault.

Every module that reads a configuration raises it (``Policy.from_dict``, the file layer in
``dispatch_amp.config``), and it imports nothing of ours, so no import circle can form.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration (a dict, or a TOML or JSON file) that does not validate.

    ``key``: the dotted path of the offending key (``"rules.fp32"``), or None for the
    whole document; ``line``: its line in the file where known. The message names both.

    Example::

        >>> import dispatch_amp as amp
        >>> try:
        ...     amp.Policy.from_dict({"kind": "policy", "format": 1, "rules": {"lowr": ["mm"]}})
        ... except amp.config.ConfigError as e:
        ...     e.key
        'rules.lowr'
    """

    def __init__(self, message: str, *, key: str | None = None, value: object = None, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.key = key
        self.value = value
        self.line = line
