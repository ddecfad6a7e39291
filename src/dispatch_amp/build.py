"""``python -m dispatch_amp.build``: build the compiled engine ahead of its first use.

For a machine with no network or no compiler at run time, or a CI image: the build lands
in the cache a region would use (``DISPATCH_AMP_CACHE_DIR``, else ``~/.cache/dispatch_amp``,
``XDG_CACHE_HOME`` respected), keyed by torch, CPython, platform and sources, so any
process with the same torch and CPython loads it without compiling.

- ``python -m dispatch_amp.build``: builds (or finds the cached build), prints what, where
  and how long; exit status 0. Where it cannot, it prints the cause, the fix and the
  compiler's whole output, and exits with status 1.
- ``python -m dispatch_amp.build --check``: says whether a cached build exists for this
  torch and CPython, building nothing; exit status 0 if it does, 1 if not.

It builds whatever ``DISPATCH_AMP_ENGINE`` says: that setting picks the engine when regions
run, and ``python`` there only means a process does not load the build.

Example::

    $ python -m dispatch_amp.build --check || python -m dispatch_amp.build
"""

from __future__ import annotations

import argparse
import sys
import time

from ._compiled import build as _build
from ._compiled.loader import Loader

__all__ = ["main"]


def _what(key) -> str:
    return f"for torch {key.torch_version}, {key.python_tag}, {key.platform}"


def main(argv: list[str] | None = None) -> int:
    """Builds or checks the compiled engine; returns the exit status.

    Example::

        status = main(["--check"])   # 0: a cached build exists for this torch and CPython
    """
    parser = argparse.ArgumentParser(prog="python -m dispatch_amp.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="report whether a cached build exists for this torch and CPython; build nothing")
    args = parser.parse_args(argv)
    loader = Loader()
    key = loader.key()
    directory = key.directory()
    if args.check:
        if _build.is_built(directory, key):
            print(f"compiled engine: built {_what(key)}, cached in {directory}")
            return 0
        print(f"compiled engine: no build {_what(key)} (it would be in {directory}); "
              f"`python -m dispatch_amp.build` builds it")
        return 1
    was_built = _build.is_built(directory, key)
    start = time.perf_counter()
    try:
        loader.load(required=True, quiet=True)
    except Exception as error:
        print(f"compiled engine: not built {_what(key)}: {error}", file=sys.stderr)
        failure = loader.failure
        if failure is not None and failure.detail:
            print("\nthe build's output:\n" + failure.detail, file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    if loader.build_seconds is None:
        how = "already built" if was_built else "built by another process meanwhile"
        print(f"compiled engine: {how} {_what(key)}, cached in {loader.directory} (loaded in {seconds * 1e3:.1f} ms)")
    else:
        print(f"compiled engine: built {_what(key)} in {loader.build_seconds:.1f} s, cached in {loader.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
