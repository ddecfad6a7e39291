"""Import a tool from this folder by path (the folder is not a package on sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def load(name: str):
    """The module ``tools/<name>.py``, imported once and cached in ``sys.modules``.

    Example::

        inspect_ptx = load("inspect_ptx")
    """
    key = f"dispatch_amp_tools.{name}"
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: dataclasses look their module up
        spec.loader.exec_module(module)
    return module
