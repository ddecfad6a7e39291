"""What recipes' states do when an optimizer steps: one global optimizer pre-step hook and
one post-step hook, installed while some recipe's state (``_state.Fp8State``) needs them
and removed by themselves when none does.

Before the step, the fp8 weight cache is emptied (the weights are about to change; the
quantized copies are freed before the optimizer allocates its own state). After the step,
delayed scaling reduces its amaxes across ranks: a point every rank reaches the same number
of times, whatever fp8 calls each one made, and one that follows the step's forward and
backward also where they run inside ``optimizer.step(closure)`` (Lightning's Trainer
without a loss scaler, LBFGS), so each step's amaxes are in the history, and in a
checkpoint, as soon as the step is done.
"""

from __future__ import annotations

import threading
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["watch", "watching"]

_lock = threading.Lock()
_watched: weakref.WeakSet = weakref.WeakSet()
_handles: list = []


def _before_step(optimizer, args, kwargs) -> None:
    for state in list(_watched):
        state.before_optimizer_step(optimizer)


def _after_step(optimizer, args, kwargs) -> None:
    for state in list(_watched):
        state.after_optimizer_step(optimizer)
    with _lock:
        if not _watched and _handles:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def watch(state) -> None:
    """Calls ``state.before_optimizer_step(optimizer)`` before and
    ``state.after_optimizer_step(optimizer)`` after every optimizer step while ``state``
    (a recipe's ``Fp8State``) exists."""
    with _lock:
        _watched.add(state)
        if not _handles:
            _handles.append(register_optimizer_step_pre_hook(_before_step))
            _handles.append(register_optimizer_step_post_hook(_after_step))


def watching(state) -> bool:
    """Whether ``state`` is watched."""
    return state in _watched
