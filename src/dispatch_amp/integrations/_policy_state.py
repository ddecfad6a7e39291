"""The autocast policy in a framework checkpoint, next to the scaler's state.

A resume runs the policy the run was trained with: its table is filed as data
(``dispatch_amp.config.state_dict``) under :data:`CHECKPOINT_KEY`, so a checkpoint made
on one torch release and resumed on another keeps the first release's casts. Wired in
the Lightning Trainer's ``MixedPrecision`` plugin (``on_save_checkpoint`` /
``on_load_checkpoint``: the checkpoint dict, key :data:`CHECKPOINT_KEY`) and the
transformers Trainer (the file :data:`FILE_NAME` in each checkpoint directory, a policy
file as ``dispatch_amp.config.dump`` writes it).
"""

from __future__ import annotations

import warnings
import os
from collections.abc import Mapping

from ..autocast.policy import Policy
from ..config import CHECKPOINT_KEY, dump, load, load_state_dict, policy_diff, state_dict
from ..warning_types import AmpNumericsWarning

__all__ = ["CHECKPOINT_KEY", "FILE_NAME", "save_into", "load_from", "save_file", "load_file"]

FILE_NAME = "dispatch_amp_policy.json"


def save_into(checkpoint: dict, policy: Policy | None, device_type: str) -> None:
    """Files the policy in force (``policy``, or the device's default) in ``checkpoint``.

    Example::

        >>> ckpt = {}; save_into(ckpt, None, "cpu"); ckpt[CHECKPOINT_KEY]["kind"]
        'policy'
    """
    checkpoint[CHECKPOINT_KEY] = state_dict(policy if policy is not None else Policy.for_device(device_type))


def load_from(checkpoint: Mapping, policy: Policy | None, device_type: str) -> Policy | None:
    """The policy to resume with: the checkpoint's where it has one, else ``policy``.

    Where the checkpoint's differs from the one in force (another torch release's default
    table, another policy given to the plugin) the checkpoint's is kept and an
    ``AmpNumericsWarning`` names the ops that differ. A filed policy that does not
    validate raises ``ConfigError`` and changes nothing.

    Example::

        >>> ckpt = {}; save_into(ckpt, None, "cpu")
        >>> load_from(ckpt, None, "cpu") is None     # the same table: nothing changes
        True
    """
    if CHECKPOINT_KEY not in checkpoint:
        return policy
    stored = load_state_dict(checkpoint[CHECKPOINT_KEY])
    in_force = policy if policy is not None else Policy.for_device(device_type)
    if stored == in_force:
        return policy
    diff = policy_diff(stored, in_force)
    warnings.warn(
        f"the checkpoint's autocast policy {stored.name!r} differs from the one in force ({in_force.name!r}) "
        f"in {len(diff)} op(s): {[r.op for r in diff]}; the run resumes with the checkpoint's, so it keeps "
        f"its numerics (to run the other, remove checkpoint[{CHECKPOINT_KEY!r}] before loading)",
        AmpNumericsWarning, stacklevel=3,
    )
    return stored


def save_file(directory: str | os.PathLike, policy: Policy | None, device_type: str) -> None:
    """Writes the policy in force to :data:`FILE_NAME` in a checkpoint directory.

    Example::

        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> save_file(folder, None, "cpu"); load_file(folder, None, "cpu") is None
        True
    """
    dump(policy if policy is not None else Policy.for_device(device_type), os.path.join(directory, FILE_NAME))


def load_file(directory: str | os.PathLike, policy: Policy | None, device_type: str) -> Policy | None:
    """``load_from`` for the file :func:`save_file` wrote (none there: ``policy``)."""
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        return policy
    return load_from({CHECKPOINT_KEY: load(path).to_dict()}, policy, device_type)
