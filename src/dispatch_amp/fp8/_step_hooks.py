"""What recipes do when an optimizer steps: one global optimizer pre-step hook, installed
while some recipe needs it and removed by itself when none does.

Two things wait for the step: delayed scaling's amaxes across ranks (each rank reduces
them there, at a point every rank reaches the same number of times, whatever fp8 calls
each one made), and the fp8 weight cache (the weights are about to change; the quantized
copies are freed before the optimizer allocates its own state).
"""

from __future__ import annotations

import threading
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["watch", "watching"]

_lock = threading.Lock()
_recipes: weakref.WeakSet = weakref.WeakSet()
_handle = None


def _before_step(optimizer, args, kwargs) -> None:
    global _handle
    for recipe in list(_recipes):
        recipe._before_optimizer_step(optimizer)
    with _lock:
        if not _recipes and _handle is not None:
            _handle.remove()
            _handle = None


def watch(recipe) -> None:
    """Calls ``recipe._before_optimizer_step(optimizer)`` before every optimizer step
    while ``recipe`` exists."""
    global _handle
    with _lock:
        _recipes.add(recipe)
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_before_step)


def watching(recipe) -> bool:
    """Whether ``recipe`` is watched."""
    return recipe in _recipes
