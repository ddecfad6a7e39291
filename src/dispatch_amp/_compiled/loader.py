"""The compiled engine, loaded once per process: built on first use, said once, never retried.

``load()`` gives the extension module, or None where it cannot be had. The first call
decides, under a lock (threads that enter regions together wait for one answer), and
every later call returns that answer:

- a cached build is imported and nothing is said;
- a build made by this process says so in one line on stderr: what, how long, that it
  happens once per torch release, where it is cached;
- a failure is one ``CompiledEngineWarning`` naming the cause and its fix, after which the
  Python engine runs; with ``required=True`` it raises ``CompiledEngineError`` instead.
  Nothing is retried in the process: a build that failed fails the same way again, and
  each try could cost the better part of a minute.

Nothing here runs at import: the package imports this module and builds nothing until
``load()`` is called.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

from ..warning_types import CompiledEngineWarning
from . import build as _build
from . import cache

__all__ = ["CompiledEngineError", "Loader", "load", "PROCESS_LOADER"]


class CompiledEngineError(RuntimeError):
    """The compiled engine was required (``DISPATCH_AMP_ENGINE=compiled``, or
    ``load(required=True)``) and cannot be had; the message names the cause and the fix.

    Example::

        >>> isinstance(CompiledEngineError("no compiler"), RuntimeError)
        True
    """


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside dispatch_amp
    (the user's ``with amp.autocast(...)`` or ``amp.engine()``), from the caller's frame."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


class Loader:
    """One process's answer to "is there a compiled engine?", asked once.

    ``root`` (default: ``cache.cache_root()`` when first asked) and ``csrc``/``sources``/
    ``cflags`` (default: the package's) say what is built where.

    Example::

        loader = Loader(root="/tmp/engines")
        module = loader.load()            # None, with a CompiledEngineWarning, if it cannot build
        loader.build_seconds              # seconds this process spent compiling, or None
    """

    def __init__(self, root=None, csrc: Path = cache.CSRC, sources=cache.SOURCES, cflags=cache.CFLAGS):
        self._root = None if root is None else Path(root)
        self._csrc, self._sources, self._cflags = Path(csrc), tuple(sources), tuple(cflags)
        self._lock = threading.Lock()
        self._module = None
        self._failure: _build.BuildFailure | None = None
        self._warned = False
        self.build_seconds: float | None = None
        self.directory: Path | None = None

    @property
    def decided(self) -> bool:
        """Whether the one attempt of this process has been made."""
        return self._module is not None or self._failure is not None

    @property
    def failure(self) -> _build.BuildFailure | None:
        """Why the attempt failed, or None."""
        return self._failure

    def key(self) -> cache.BuildKey:
        return cache.build_key(self._csrc, self._sources, self._cflags)

    def load(self, *, required: bool = False, quiet: bool = False):
        """The compiled module, or None (warned once) where it cannot be built or loaded;
        ``required=True`` raises ``CompiledEngineError`` instead. ``quiet`` leaves out the
        line a build prints (for a caller that reports the build itself)."""
        module = self._module
        if module is not None:  # the common case, without the lock
            return module
        with self._lock:
            if not self.decided:
                self._attempt(quiet)
        if self._module is not None:
            return self._module
        failure = self._failure
        if required:
            raise CompiledEngineError(f"the compiled engine cannot be built or loaded: {failure.cause}. "
                                      f"Fix: {failure.fix}.")
        with self._lock:
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(
                f"dispatch_amp: the compiled engine is not available, so the Python engine runs "
                f"(the same casts, more host time per op): {failure.cause}. Fix: {failure.fix}; "
                f"or set DISPATCH_AMP_ENGINE=python to skip the attempt.",
                CompiledEngineWarning, stacklevel=user_stacklevel(),
            )
        return None

    def _attempt(self, quiet: bool) -> None:
        try:
            key = self.key()
            self.directory = key.directory(self._root)
            module, seconds = _build.build(self.directory, key, self._csrc, self._sources, self._cflags)
        except _build.BuildFailure as failure:
            self._failure = failure
            return
        except Exception as error:  # anything unforeseen still falls back, named
            self._failure = _build.BuildFailure(f"{type(error).__name__}: {error}",
                                                "report it; DISPATCH_AMP_ENGINE=python avoids it")
            return
        self.build_seconds = seconds
        if seconds is not None and not quiet:
            print(f"dispatch_amp: built the compiled engine (C++ kernels for torch {key.torch_version}) "
                  f"in {_duration(seconds)}, once per torch release; cached in {self.directory}",
                  file=sys.stderr, flush=True)
        self._module = module


# The process's loader: what regions, engine() and the demo share.
PROCESS_LOADER = Loader()


def load(*, required: bool = False, quiet: bool = False):
    """The compiled engine's module for this process, built on first use, or None.

    Example::

        module = load()             # None (and one CompiledEngineWarning) without a compiler
        module = load(required=True)  # raises CompiledEngineError naming the cause instead
    """
    return PROCESS_LOADER.load(required=required, quiet=quiet)
