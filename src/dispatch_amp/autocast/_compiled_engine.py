"""The compiled engine's Python half: what the C++ kernels read, written from the plans.

The compiled engine (``dispatch_amp/_compiled/csrc/engine.cpp``) executes the plans the
Python engine builds; it decides nothing. This module is where the two meet:

- the engine in use is chosen once per process, at the first kernel registration
  (``active()``: the C++ module, or None for the Python engine; ``dispatch_amp._compiled``
  builds or loads it and says why not);
- each kernel registered at our key is a C++ kernel holding the Python kernel of the
  same overload (``register``), which it calls for everything it does not execute;
- each plan gets a number (``prepare``), and for each (plan, registered overload) the rule
  its handler stands for is written into the kernel at the first call that needs it
  (``resolve_rule``): ``_handlers.lower``, ``fp32``,
  ``promote``, ``given`` and native's fp32-unless-dtype wrapper with its ``dtype``
  argument, and each of these inside ``_torch_checkpoint``'s refusal (a user's policy that
  casts an op otherwise than native's table), which the C++ side executes wherever torch's
  checkpoint cannot be running and hands to the refusal elsewhere; any other handler (fp8,
  cuDNN RNN, banned ops, native's fp32-append-dtype wrapper) stays Python;
- the thread's innermost context (``_engine._refresh``) is written to the C++ side's
  thread-local copy (its ``set_top``, with arguments made once per region:
  ``set_top_arguments``);
- the weight-cast stores get C++ twins (``_cast_cache.use_native``), so that one cache
  serves both halves;
- weight casts batched per region (``batching``): off unless ``DISPATCH_AMP_BATCH_CASTS=1``
  (on this project's CPU measurements it did not make a step cheaper, see
  docs/performance.md).

See "The compiled engine" in docs/design.md.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .. import _compiled, _torch_compat
from .._compiled.loader import user_stacklevel
from ..warning_types import CompiledEngineWarning
from . import _cast_cache, _handlers

__all__ = ["active", "batching", "set_batching", "BATCH_ENV", "register", "prepare", "resolve_rule", "set_top_arguments", "PYTHON", "GIVEN", "LOWER", "FP32", "PROMOTE", "FP32_OPT_DTYPE"]

# Rule kinds, as engine.cpp numbers them.
PYTHON, GIVEN, LOWER, FP32, PROMOTE, FP32_OPT_DTYPE = range(6)

# Batching the weight casts of a region (engine.cpp, "batched weight casts"): off unless
# this variable is "1" (read when the engine is chosen; ``set_batching`` switches it later).
BATCH_ENV = "DISPATCH_AMP_BATCH_CASTS"

_SIMPLE_RULES = {_handlers.lower: LOWER, _handlers.fp32: FP32, _handlers.promote: PROMOTE, _handlers.given: GIVEN}


class _Engine:
    """The process's choice, and what has been written into the C++ side."""

    def __init__(self):
        self.lock = threading.RLock()
        self.chosen = False
        self.module = None
        self.kernels: list = []  # kernel number -> OpOverload
        self.plans: dict = {}  # Plan -> plan number (None past the C++ side's maximum)
        self.numbered: list = []  # plan number -> Plan
        self.warned_full = False  # the table of plans filled up (said once per process)


ENGINE = _Engine()


def active():
    """The compiled module when the compiled engine runs in this process, else None.

    The first call chooses (building or loading the module, see ``dispatch_amp._compiled``);
    later calls return the choice.
    """
    engine = ENGINE
    if engine.chosen:
        return engine.module
    with engine.lock:
        if not engine.chosen:
            module = _compiled.compiled_module()
            if module is not None:
                module.init(
                    _torch_compat.CASTS_LAST_ARGUMENT_FIRST, _cast_cache.SCOPE,
                    torch.Tensor, torch.nn.Parameter, _cast_cache.lookup, resolve_rule,
                    _torch_compat.reentrant_checkpoint_function.forward.__code__,
                )
                _cast_cache.use_native(module)
                module.set_batching(_batching_setting())
            engine.module = module
            engine.chosen = True
    return engine.module


def _batching_setting() -> bool:
    raw = os.environ.get(BATCH_ENV, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        if not _torch_compat.BATCHED_WEIGHT_CASTS:
            # Said once, when the engine is chosen: the setting is read then and only then.
            warnings.warn(
                f"{BATCH_ENV}=1 has no effect on torch {torch.__version__}: the compiled engine batches "
                f"weight casts from torch 2.13 on (before it, the class test of a bucket's weights needs "
                f"the GIL), so each weight is cast at its use, as without it. Upgrade torch to batch, or "
                f"unset {BATCH_ENV}.", UserWarning, stacklevel=2)
        return True
    raise ValueError(f"{BATCH_ENV}={raw!r}: use {BATCH_ENV}=1 to batch each region's weight casts, "
                     f"or 0 (the default) to cast each weight at its use")


def batching() -> bool:
    """Whether the compiled engine batches each region's weight casts (False under the
    Python engine, which casts each weight at its use).

    Example::

        >>> isinstance(batching(), bool)
        True
    """
    module = ENGINE.module
    return module is not None and module.batching()


def set_batching(on: bool) -> bool:
    """Switches the compiled engine's batched weight casts for the whole process (from the
    next weight cast on); returns the previous setting. Results are the same bits either
    way; off, every weight is cast at its use with its own ``_to_copy``, as native does.
    Under the Python engine nothing changes and False is returned.

    Example::

        before = set_batching(True)    # weight casts in buckets
        try:
            ...
        finally:
            set_batching(before)
    """
    module = active()
    if module is None:
        return False
    return bool(module.set_batching(bool(on)))


def chosen_name() -> str | None:
    """``"compiled"`` or ``"python"`` once chosen, else None (nothing chosen yet)."""
    if not ENGINE.chosen:
        return None
    return "compiled" if ENGINE.module is not None else "python"


def register(module, op, python_kernel) -> None:
    """Registers the C++ kernel of ``op`` at our key, holding ``python_kernel``."""
    name = op._schema.name.split("::", 1)[1]
    if op._overloadname != "default":
        name = f"{name}.{op._overloadname}"
    with ENGINE.lock:
        number = module.register_kernel(op.namespace, name, python_kernel)
        assert number == len(ENGINE.kernels), "kernels are numbered in registration order"
        ENGINE.kernels.append(op)


def rule_of(handler) -> tuple[int, int, bool]:
    """The C++ rule ``handler`` stands for: (kind, position of the dtype argument or -1,
    guarded). Guarded: ``handler`` refuses torch's checkpoint around the rule (see
    ``_torch_checkpoint``); the C++ side executes the rule only where that checkpoint
    cannot be running, and calls ``handler`` elsewhere."""
    inner = getattr(handler, "refuses_torch_checkpoint", None)
    guarded = inner is not None
    if guarded:
        handler = inner
    kind = _SIMPLE_RULES.get(handler)
    if kind is not None:
        return kind, -1, guarded
    position = getattr(handler, "dtype_position", None)
    if position is not None:
        return FP32_OPT_DTYPE, position, guarded
    return PYTHON, -1, False


def prepare(plan) -> None:
    """Numbers ``plan`` for the C++ side. Its rules are written as its calls first need
    them (``resolve_rule``): a plan's first region costs no more than under the Python
    engine, which resolves its handlers on first use too."""
    module = ENGINE.module
    if module is None or plan in ENGINE.plans:
        return
    with ENGINE.lock:
        if plan not in ENGINE.plans:
            number = len(ENGINE.numbered)
            if number < module.max_plans():
                ENGINE.numbered.append(plan)
                ENGINE.plans[plan] = number
            else:  # past the C++ side's table: this plan's calls go to the Python kernels
                ENGINE.plans[plan] = None
                if not ENGINE.warned_full:
                    ENGINE.warned_full = True
                    _warn_table_full(plan, module.max_plans())


def _warn_table_full(plan, size: int) -> None:
    # Once per process: a silent slowdown would be the worst outcome, and the casts are
    # the same either way (the Python kernels are the reference).
    warnings.warn(
        f"dispatch_amp: this process has used {size} distinct policies, as many as the compiled "
        f"engine's table holds, so regions under a new one (here on {plan.device_type!r}) run on the "
        f"Python engine: the same casts, more host time per op. Equal policies share one entry: "
        f"build each policy once and reuse it (or an equal one), rather than a policy that differs "
        f"per region or per step.",
        CompiledEngineWarning, stacklevel=user_stacklevel())


def resolve_rule(kernel: int, number: int) -> None:
    """Writes the rule of kernel ``kernel`` under plan ``number`` (the C++ kernel asks,
    once, at the first call that needs it)."""
    op, plan = ENGINE.kernels[kernel], ENGINE.numbered[number]
    kind, position, guarded = rule_of(plan.handler(op))
    ENGINE.module.set_rule(kernel, number, kind, position, guarded)


def plan_number(plan) -> int:
    """The number the C++ side knows ``plan`` by; -1: none (its calls go to Python)."""
    number = ENGINE.plans.get(plan)
    return -1 if number is None else number


def set_top_arguments(top) -> tuple:
    """The arguments of the C++ side's ``set_top`` for ``top`` (``ThreadState.top``).

    A region's are made once, when it is entered (``_engine._view``): its contexts' plans
    were numbered then (``prepare``), and a plan's number never changes.
    """
    if top is None:
        return (False, -1, "cpu", None, -1)
    ctx, depth, _, device_type, dtype, _ = top
    return (True, -1 if depth is None else depth, device_type, dtype, plan_number(ctx.plan))


_torch_compat.keep_out_of_dynamo(globals(), __name__)
