"""Where a weight lives in a model: the module paths that name an fp8 site.

A site is one weight (tensor identity); its names are every path under which a model holds
that tensor: ``"blocks.0.qkv"`` for a parameter called ``weight`` (the owning module's
path), the full parameter path otherwise (``"blocks.0.attn.in_proj_weight"``). A tied
weight has several names. Names are found in the models ``recipe.bind`` was given, or,
for a weight met before any bind, in the modules whose ``forward`` is running: the
outermost one on the Python stack that holds the weight, with the wrappers that frameworks
put around a model (DDP, DataParallel, ``torch.compile``'s ``OptimizedModule``, Lightning's
and Fabric's forward wrappers) looked through, so the names are the model's own.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["ROOT_NAME", "display_name", "parameter_paths", "stack_roots", "unwrap", "holds"]

# The name of a weight that is the model's own (a bare nn.Linear bound as the model).
ROOT_NAME = "<root>"


def display_name(path: str) -> str:
    """A site name from a parameter path: the module's path for ``weight``.

    Example::

        >>> display_name("blocks.0.qkv.weight"), display_name("attn.in_proj_weight"), display_name("weight")
        ('blocks.0.qkv', 'attn.in_proj_weight', '<root>')
    """
    module, _, attr = path.rpartition(".")
    if attr == "weight":
        return module or ROOT_NAME
    return path


def parameter_paths(root: torch.nn.Module, weight: torch.Tensor) -> list[str]:
    """Every path under which ``root`` holds ``weight`` (parameters, then buffers), tied
    copies included, in ``named_parameters`` order."""
    paths = [name for name, p in root.named_parameters(remove_duplicate=False) if p is weight]
    return paths + [name for name, b in root.named_buffers(remove_duplicate=False) if b is weight]


def holds(root: torch.nn.Module, path: str, weight: torch.Tensor) -> bool:
    """Whether ``root`` still holds ``weight`` at ``path`` (a weight replaced there, by
    ``load_state_dict(assign=True)`` say, is no longer held)."""
    module_path, _, attr = path.rpartition(".")
    try:
        module = root.get_submodule(module_path) if module_path else root
    except AttributeError:
        return False
    return module._parameters.get(attr, module._buffers.get(attr)) is weight


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside the wrappers frameworks put around it, so that names are the
    model's own whichever wrapper runs its forward.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(lin)) is lin
        True
    """
    while True:
        inner = None
        if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            inner = module.module
        else:  # torch.compile's OptimizedModule; Lightning's and Fabric's forward wrappers
            inner = getattr(module, "_orig_mod", None)
            if inner is None:
                inner = getattr(module, "_forward_module", None)
        if not isinstance(inner, torch.nn.Module) or inner is module:
            return module
        module = inner


def stack_roots(skip: int = 1) -> list[torch.nn.Module]:
    """The modules whose methods are running, outermost first, each unwrapped and listed
    once. Reads only frames whose first argument is ``self``."""
    found: dict[int, torch.nn.Module] = {}
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                obj = unwrap(obj)
                found.setdefault(id(obj), obj)
        frame = frame.f_back
    return list(reversed(found.values()))
