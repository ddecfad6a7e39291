"""Configuration a team reviews: policies as TOML or JSON files, in checkpoints, and
compared op by op.

- ``dump(obj, path)`` / ``load(path)``: a ``Policy`` (``Policy.to_dict``) or a
  ``PrecisionPlan`` (``plan_file``) as a ``.toml`` or ``.json`` file, read back exactly; a
  file that does not validate fails at load with ``ConfigError``, naming the file, line
  and key.
- ``state_dict(obj)`` / ``load_state_dict(state)``: the same data, for a framework
  checkpoint (key ``CHECKPOINT_KEY``, next to the scaler's state).
- ``policy_diff(a, b)``: what differs per op between policies, torch releases or files.

A file says what it holds (``kind = "policy"``, ``"precision_plan"``) and in which layout
(``format = 1``); ``register_kind`` adds kinds.

Example::

    >>> import dispatch_amp as amp
    >>> text = amp.config.dumps(amp.Policy.for_device("cuda", numerics="2.11"))
    >>> amp.config.loads(text) == amp.Policy.for_device("cuda", numerics="2.11")
    True
"""

from .._config_error import ConfigError
from .diff import PolicyDiff, PolicyDiffRow, policy_diff
from .files import (
    CHECKPOINT_KEY,
    dump,
    dumps,
    from_dict,
    load,
    load_state_dict,
    loads,
    register_kind,
    state_dict,
    to_dict,
)

__all__ = [
    "dump", "load", "dumps", "loads", "to_dict", "from_dict", "register_kind", "state_dict", "load_state_dict",
    "CHECKPOINT_KEY", "ConfigError", "policy_diff", "PolicyDiff", "PolicyDiffRow",
]
