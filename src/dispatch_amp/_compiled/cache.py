"""Where a build of the compiled engine lives, and the key that tells builds apart.

A build is C++ compiled against one torch's headers: the dispatcher and TensorImpl surface
it uses has no ABI across torch releases, so a build must never load into another torch
(docs/design.md, "The compiled engine: building and loading"). Every input that can change
the binary is in the key: torch's version (its local tag, ``+cpu`` / ``+cu128``, included)
and git commit, its CUDA version, CPython's cache tag and ABI flags, the platform, and a
hash of every file in ``csrc/``, the sources' names and the build flags. A build's
directory and its module's name both carry the key's digest: CPython cannot load two
extension modules of one name into a process, so two builds never share a name.

The cache root is ``$DISPATCH_AMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/dispatch_amp``,
else ``~/.cache/dispatch_amp``.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SOURCES", "CFLAGS", "CSRC", "BuildKey", "build_key", "cache_root"]

CSRC = Path(__file__).resolve().parent / "csrc"
# What is compiled, in order, relative to csrc/. Every other file there (headers) is
# hashed too, so that a change to one rebuilds.
SOURCES = ("engine.cpp",)
# Device-independent C++ calling the dispatcher: no CUDA sources, nothing per GPU arch.
CFLAGS = ("-O2",)
# Bumped when the layout of a build directory changes, so old builds are not read.
LAYOUT = 1

CACHE_ENV = "DISPATCH_AMP_CACHE_DIR"


def cache_root() -> Path:
    """The directory that holds every build, read from the environment on each call.

    Example::

        >>> cache_root().is_absolute()
        True
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(base)) / "dispatch_amp"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def sources_digest(csrc: Path = CSRC, sources: tuple[str, ...] = SOURCES, cflags: tuple[str, ...] = CFLAGS) -> str:
    """A hash of what is compiled and how: every file in ``csrc`` (name and bytes), the
    sources' list and the flags.

    Example::

        >>> len(sources_digest())
        64
    """
    h = hashlib.sha256()
    h.update(repr((LAYOUT, tuple(sources), tuple(cflags))).encode())
    for path in sorted(p for p in csrc.rglob("*") if p.is_file()):
        h.update(path.relative_to(csrc).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class BuildKey:
    """Everything a build depends on; two keys that differ never share a directory or a
    module name.

    Example::

        >>> key = build_key()
        >>> key.module_name.startswith("dispatch_amp_engine_") and key.digest in key.module_name
        True
    """

    torch_version: str
    torch_git: str
    torch_cuda: str
    python_tag: str
    platform: str
    sources: str

    @property
    def digest(self) -> str:
        fields = (self.torch_version, self.torch_git, self.torch_cuda, self.python_tag, self.platform, self.sources)
        return hashlib.sha256("\0".join(fields).encode()).hexdigest()[:16]

    @property
    def module_name(self) -> str:
        return f"dispatch_amp_engine_{self.digest}"

    def directory(self, root: Path | None = None) -> Path:
        """``root/torch-<version>-<python>-<platform>/engine-<digest>``: readable above,
        exact below."""
        root = cache_root() if root is None else Path(root)
        group = _safe(f"torch-{self.torch_version}-{self.python_tag}-{self.platform}")
        return root / group / f"engine-{self.digest}"


def build_key(csrc: Path = CSRC, sources: tuple[str, ...] = SOURCES, cflags: tuple[str, ...] = CFLAGS) -> BuildKey:
    """The key of a build of ``sources`` with ``cflags`` for this torch, CPython and platform.

    Example::

        >>> build_key().torch_version == torch.__version__
        True
    """
    return BuildKey(
        torch_version=str(torch.__version__),
        torch_git=str(getattr(torch.version, "git_version", "") or ""),
        torch_cuda=str(getattr(torch.version, "cuda", "") or ""),
        # Free-threaded and debug builds of one CPython share a cache tag, not ABI flags.
        python_tag=sys.implementation.cache_tag + getattr(sys, "abiflags", ""),
        platform=sysconfig.get_platform(),
        sources=sources_digest(csrc, sources, cflags),
    )
