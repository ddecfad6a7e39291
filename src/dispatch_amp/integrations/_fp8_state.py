"""An fp8 recipe's state in each framework's own checkpoint, with no user code.

Where each integration keeps it (``recipe.state_dict()``: empty for the stateless
recipes, delayed scaling's histories by site name otherwise):

* Lightning Trainer: the checkpoint dict, key :data:`CHECKPOINT_KEY`, from the precision
  plugin's ``on_save_checkpoint`` / ``on_load_checkpoint``;
* Fabric: ``fabric.save`` writes only the objects it is given, so the recipe's state
  rides in the state dict of each module the plugin set up, as the entry
  :data:`MODULE_ENTRY` (loading it back takes it out before the module sees it);
* transformers Trainer: the file :data:`FILE_NAME` in each checkpoint directory;
* accelerate: ``save_state`` / ``load_state``, the recipe registered for checkpointing;
* timm's loop: the loss scaler's state dict, key :data:`CHECKPOINT_KEY`.

The recipe names its sites itself (``recipe.bind`` or the first forward), so a fresh
run's recipe takes the state before its first step, however the model is wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CHECKPOINT_KEY", "FILE_NAME", "MODULE_ENTRY", "save_into", "load_from", "carry_in_state_dict"]

CHECKPOINT_KEY = "dispatch_amp_fp8"
FILE_NAME = "dispatch_amp_fp8.pt"
MODULE_ENTRY = "_dispatch_amp_fp8_state"


def save_into(checkpoint: dict, recipe: Any) -> None:
    """Puts ``recipe``'s state into ``checkpoint`` under :data:`CHECKPOINT_KEY` (no recipe: nothing).

    Example::

        >>> from dispatch_amp import fp8
        >>> ckpt = {}; save_into(ckpt, fp8.CurrentScaling()); ckpt
        {'dispatch_amp_fp8': {}}
    """
    if recipe is not None:
        checkpoint[CHECKPOINT_KEY] = recipe.state_dict()


def load_from(checkpoint: Mapping, recipe: Any) -> None:
    """Loads the state :func:`save_into` filed, if both it and a recipe are there.

    Example::

        >>> from dispatch_amp import fp8
        >>> load_from({"dispatch_amp_fp8": {}}, fp8.CurrentScaling())
    """
    if recipe is not None and CHECKPOINT_KEY in checkpoint:
        recipe.load_state_dict(checkpoint[CHECKPOINT_KEY])


def carry_in_state_dict(module: torch.nn.Module, recipe: Any) -> None:
    """Makes ``module.state_dict()`` carry ``recipe``'s state as :data:`MODULE_ENTRY`, and
    ``module.load_state_dict`` take it out and load it into the recipe. Once per module.

    Example::

        >>> from dispatch_amp import fp8
        >>> net = torch.nn.Linear(16, 16); carry_in_state_dict(net, fp8.CurrentScaling())
        >>> sorted(net.state_dict())
        ['_dispatch_amp_fp8_state', 'bias', 'weight']
    """
    if recipe is None or getattr(module, "_dispatch_amp_fp8_carried", None) is recipe:
        return

    def save(mod, state_dict, prefix, local_metadata):
        state_dict[prefix + MODULE_ENTRY] = recipe.state_dict()

    def load(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        state = state_dict.pop(prefix + MODULE_ENTRY, None)
        if state is not None:
            recipe.load_state_dict(state)

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
    module._dispatch_amp_fp8_carried = recipe
