"""Which engine runs the regions of this process: the one place that decides.

``DISPATCH_AMP_ENGINE`` (read on each call):

- unset or empty: the compiled engine where it builds, else the Python engine with one
  ``CompiledEngineWarning``;
- ``python``: the Python engine; nothing is built;
- ``compiled``: the compiled engine, and a failure to build or load raises.

The engine glue calls ``compiled_module()`` at the first region entry; ``engine()`` is
the public answer.
"""

from __future__ import annotations

import os

from . import loader

__all__ = ["ENV", "SETTINGS", "engine_setting", "compiled_module", "engine"]

ENV = "DISPATCH_AMP_ENGINE"
SETTINGS = ("python", "compiled")


def engine_setting() -> str:
    """``"python"``, ``"compiled"``, or ``"default"`` where ``DISPATCH_AMP_ENGINE`` is unset
    or empty; any other value raises ValueError naming the allowed ones.

    Example::

        >>> engine_setting() in ("default", "python", "compiled")
        True
    """
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if not value:
        return "default"
    if value not in SETTINGS:
        raise ValueError(
            f"{ENV}={raw!r} is not an engine: use {ENV}=python or {ENV}=compiled, or leave it unset "
            f"(the compiled engine where it builds, else the Python engine)"
        )
    return value


def compiled_module(*, quiet: bool = False):
    """The compiled engine's module when this process uses it, else None.

    Under the default setting the first call builds (or loads the cached build); a
    failure warns once and gives None from then on. Under ``compiled`` a failure raises
    ``CompiledEngineError``; under ``python`` nothing is built. ``quiet`` leaves out the
    line a build prints on stderr, for a caller that reports it (the demo).

    Example::

        module = compiled_module()   # at the first region entry
        if module is None:
            ...                      # the Python engine's kernels
    """
    setting = engine_setting()
    if setting == "python":
        return None
    if setting == "compiled":
        try:
            return loader.load(required=True, quiet=quiet)
        except loader.CompiledEngineError as error:
            raise loader.CompiledEngineError(
                f"{ENV}=compiled: {error} "
                f"Or unset {ENV} to run the Python engine with a warning."
            ) from None
    return loader.load(quiet=quiet)


def engine() -> str:
    """The engine that runs ``dispatch_amp.autocast`` regions in this process: ``"compiled"``
    (our C++ kernels at the dispatcher) or ``"python"`` (our Python kernels). Both cast
    alike; the compiled one costs less host time per op.

    ``DISPATCH_AMP_ENGINE=python`` or ``=compiled`` decides it outright. Unset, the first
    region decides: it loads the compiled engine, building it first where this torch has
    no cached build (about a minute, said in one line on stderr), and runs the Python
    engine where that fails (said in one ``CompiledEngineWarning``). Called before any
    region, ``engine()`` makes that same one-time decision then, so its answer is the
    engine the regions will use.

    Example::

        import dispatch_amp as amp
        print(amp.engine())          # "compiled", or "python" without a C++ compiler
    """
    return "python" if compiled_module() is None else "compiled"
