"""Compiling the engine into its cache directory, and importing a finished build.

A directory holds a finished build when its ``built.json`` exists: it is written last,
atomically, after the module imported. A cached build is imported directly from its
shared library, with no compiler, no ninja and no lock: a machine that got its cache
from ``python -m dispatch_amp.build`` (a CI image, a machine with no network) needs none.

Processes that start together (DDP ranks, dataloader workers) build once: the builder
holds an exclusive ``flock`` on ``.build-lock`` in the directory; the others wait on it,
then find ``built.json`` and import. The kernel releases a ``flock`` when its process
dies, so a build killed half way (Ctrl-C, out of memory) blocks no one. The same is not
true of ``torch.utils.cpp_extension``'s own lock, a file named ``lock`` that its
``FileBaton`` creates and deletes: a killed build leaves it, and every later build waits
on it forever. Holding our lock, no process of ours builds in the directory, so a ``lock``
found then is such a leftover and is removed. (Where ``fcntl`` does not exist, torch's
lock alone keeps builds apart.)

Example::

    key = cache.build_key()
    module, seconds = build(key.directory(), key)   # seconds is None: another process built it
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from . import cache

try:
    import fcntl
except ImportError:  # Windows: torch's lock file alone
    fcntl = None

__all__ = ["BuildFailure", "is_built", "import_built", "build"]

MARKER = "built.json"
LOCK = ".build-lock"


class BuildFailure(Exception):
    """Why the compiled engine cannot be had here: ``cause`` (one line), ``fix`` (what the
    user can do) and ``detail`` (the compiler's whole output, where there is one).

    Example::

        >>> str(BuildFailure("ninja is not found", "pip install ninja"))
        'ninja is not found (pip install ninja)'
    """

    def __init__(self, cause: str, fix: str, detail: str = ""):
        super().__init__(f"{cause} ({fix})")
        self.cause, self.fix, self.detail = cause, fix, detail


def _library(directory: Path, key: cache.BuildKey) -> Path:
    suffix = ".pyd" if sys.platform == "win32" else ".so"  # what cpp_extension names it
    return directory / f"{key.module_name}{suffix}"


def is_built(directory: Path, key: cache.BuildKey) -> bool:
    """Whether ``directory`` holds a finished build of ``key`` (nothing is built or imported).

    Example::

        >>> is_built(Path("/nonexistent"), cache.build_key())
        False
    """
    return (directory / MARKER).is_file() and _library(directory, key).is_file()


def import_built(directory: Path, key: cache.BuildKey):
    """The module of the finished build in ``directory``; BuildFailure if it does not load."""
    path = _library(directory, key)
    try:
        spec = importlib.util.spec_from_file_location(key.module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # a truncated or foreign file: say which, and how to rebuild
        raise BuildFailure(
            f"the cached build {path} does not load: {type(error).__name__}: {error}",
            f"delete {directory} and it is rebuilt",
        ) from error
    _check_torch(module, directory)
    return module


def _check_torch(module, directory: Path) -> None:
    # The key already keeps builds per torch; this guards against a directory copied by hand.
    built_against = getattr(module, "built_against", None)
    if built_against is not None and not str(torch.__version__).startswith(built_against()):
        raise BuildFailure(
            f"the build in {directory} was compiled against torch {built_against()}, this is torch {torch.__version__}",
            f"delete {directory} and it is rebuilt",
        )


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Holds the directory's build lock; creates the directory. BuildFailure if it cannot."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise BuildFailure(
            f"the cache directory {directory} cannot be written: {error.strerror or error}",
            f"set {cache.CACHE_ENV} to a writable directory",
        ) from error
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
            with contextlib.suppress(FileNotFoundError):
                (directory / "lock").unlink()  # torch's lock, left by a build that was killed
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _tools() -> None:
    """BuildFailure naming a missing compiler or ninja, before torch tries and fails less clearly."""
    try:
        from torch.utils import cpp_extension
    except ImportError as error:  # it imports setuptools, which a bare environment may lack
        raise BuildFailure(f"torch.utils.cpp_extension cannot be imported: {error}",
                           f"pip install {error.name or 'setuptools'}") from error

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        source = " (from CXX)" if os.environ.get("CXX") else ""
        raise BuildFailure(
            f"no C++ compiler: {compiler!r}{source} is not found",
            "install g++ or clang++, or set CXX to one; or run `python -m dispatch_amp.build` "
            "where there is one and copy its cache",
        )
    if not cpp_extension.is_ninja_available():
        raise BuildFailure("ninja is not found", "pip install ninja, or install your system's ninja package")


# Not the compiler's words: ninja's progress and verdict, torch's prefix, the command lines.
_NOISE = re.compile(r"^(FAILED:|ninja: |\[\d+/\d+\] )|-DTORCH_EXTENSION_NAME=")
_PREFIX = re.compile(r"^Error building extension '[^']*':\s*")


def first_error_lines(output: str, count: int = 3) -> str:
    """The compiler's first ``count`` error lines in a build's output (its last lines where
    none says ``error``), joined with `` | ``.

    Example::

        >>> first_error_lines("[1/2] c++ -c x.cpp\\nx.cpp:3:5: error: expected ';'\\nninja: build stopped")
        "x.cpp:3:5: error: expected ';'"
    """
    lines = [line.strip() for line in _PREFIX.sub("", output).splitlines()]
    lines = [line for line in lines if line and not _NOISE.search(line)]
    for pattern in (r": (fatal )?error:", r"\berror\b"):
        errors = [line for line in lines if re.search(pattern, line, re.IGNORECASE)]
        if errors:
            return " | ".join(errors[:count])
    return " | ".join(lines[-count:])


def _compile(directory: Path, key: cache.BuildKey, csrc: Path, sources, cflags):
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=key.module_name,
            sources=[str(csrc / name) for name in sources],
            extra_cflags=list(cflags),
            build_directory=str(directory),
            with_cuda=False,
            verbose=False,
        )
    except Exception as error:
        text = str(error)
        output = getattr(error, "output", None)
        if isinstance(output, bytes):
            text += "\n" + output.decode(errors="replace")
        raise BuildFailure(
            f"the build failed: {first_error_lines(text)}",
            f"`python -m dispatch_amp.build` prints the compiler's whole output; build directory {directory}",
            detail=text,
        ) from error


def build(directory: Path, key: cache.BuildKey, csrc: Path = cache.CSRC, sources=cache.SOURCES,
          cflags=cache.CFLAGS):
    """Builds ``key`` into ``directory`` unless a finished build is there, and imports it.

    Returns ``(module, seconds)``: the seconds this process spent compiling, or None where
    it compiled nothing (the build was cached, or another process made it meanwhile).
    Raises BuildFailure with the cause.
    """
    if is_built(directory, key):
        return import_built(directory, key), None
    with _exclusive(directory):
        if is_built(directory, key):  # another process built it while this one waited
            return import_built(directory, key), None
        _tools()
        start = time.perf_counter()
        module = _compile(directory, key, csrc, sources, cflags)
        seconds = time.perf_counter() - start
        _check_torch(module, directory)
        record = {
            "torch": key.torch_version, "torch_git": key.torch_git, "python": key.python_tag,
            "platform": key.platform, "sources": list(sources), "cflags": list(cflags),
            "seconds": round(seconds, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        partial = directory / f"{MARKER}.{os.getpid()}"
        partial.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(partial, directory / MARKER)  # atomic: readers see no marker or a whole one
    return module, seconds
