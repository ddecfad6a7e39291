"""The compiled engine: C++ kernels of ours at the autocast dispatch key, and their loader.

- ``csrc/``: the C++ sources (shipped in the package, compiled on the user's machine
  against the installed torch);
- ``cache.py``: the build's key (torch, CPython, platform, sources) and its directory;
- ``build.py``: compiling into that directory, once across processes, and importing;
- ``loader.py``: ``load()``, once per process: the module or None, said once;
- ``choice.py``: ``DISPATCH_AMP_ENGINE`` and ``engine()``: which engine runs.

Importing this package builds nothing. How builds are cached and why there is one per
torch release: docs/design.md, "The compiled engine: building and loading".

Example::

    from dispatch_amp._compiled import load
    module = load()      # built on first use, cached; None without a compiler
"""

from .choice import compiled_module, engine, engine_setting
from .loader import CompiledEngineError, load

__all__ = ["load", "compiled_module", "engine", "engine_setting", "CompiledEngineError"]
