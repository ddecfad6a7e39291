"""Our autocast dispatch key: which one, its kernels, and switching it on per thread.

The engine's kernels are Python functions registered with ``torch.library`` at
``AutocastPrivateUse1`` (see "Note: the engine lives in the dispatcher" in ``_engine.py``).
That key is one of the dispatcher's autocast keys, and the one of highest priority: it
runs before native's ``AutocastCPU``/``AutocastCUDA``/``AutocastXPU``/``AutocastMPS``,
above autograd. Stock torch registers nothing at it (it belongs to out-of-tree
"PrivateUse1" accelerators), so:

- a fallthrough is registered as its fallback: every op without a kernel of ours passes
  it in C++, at no Python cost;
- a kernel of ours is registered for each op some policy in use needs (``ensure_kernels``);
- the key is switched on for a thread by adding it to the thread's included dispatch
  keys (and taking it off the excluded ones, where torch puts it by default); only the
  threads inside our regions have it on.

A process where a real PrivateUse1 backend is loaded owns that key: it renames the
"privateuseone" device or registers kernels there. Then our regions raise at entry with
the backend's name and the way out (``KeyTaken``), rather than mixing our kernels with
the backend's.
"""

from __future__ import annotations

import threading

import torch
from torch._C import DispatchKey, DispatchKeySet

from .. import _torch_compat
from . import _compiled_engine
from ._kernels import make_kernel

__all__ = ["KEY", "KeyTaken", "ensure_kernels", "switch", "registered_count"]

KEY = DispatchKey.AutocastPrivateUse1
_KEY_NAME = "AutocastPrivateUse1"
_include = _torch_compat.set_dispatch_key_included
_exclude = _torch_compat.set_dispatch_key_excluded


class KeyTaken(RuntimeError):
    """A PrivateUse1 backend owns the dispatch key dispatch_amp's engine needs."""


class _Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.fallback = None  # the Library holding the fallthrough
        self.libraries: dict[str, torch.library.Library] = {}  # namespace -> Library
        self.kernels: set = set()  # OpOverloads with a kernel of ours
        self.checked = False


_REGISTRY = _Registry()


def _check_key_free() -> None:
    """Raises ``KeyTaken`` if a PrivateUse1 backend uses the key (before we first do)."""
    backend = torch._C._get_privateuse1_backend_name()
    theirs = [
        name for name in torch._C._dispatch_get_registrations_for_dispatch_key(_KEY_NAME)
    ]
    has_fallback = torch._C._dispatch_has_backend_fallback(KEY)
    if backend != "privateuseone" or theirs or has_fallback:
        who = f"the {backend!r} backend" if backend != "privateuseone" else "a PrivateUse1 backend"
        raise KeyTaken(
            f"dispatch_amp.autocast needs the dispatcher's AutocastPrivateUse1 key for its "
            f"casting engine, and {who} loaded in this process uses it"
            + (f" ({len(theirs)} kernels registered there)" if theirs else "")
            + ". Use torch.autocast in this process (dispatch_amp.GradScaler and the other "
            "parts work with it), or run dispatch_amp.autocast in a process without that "
            "backend."
        )


def _install() -> None:
    if _REGISTRY.fallback is None:
        if not _REGISTRY.checked:
            _check_key_free()
            _REGISTRY.checked = True
        library = torch.library.Library("_", "IMPL")
        library.fallback(torch.library.fallthrough_kernel, _KEY_NAME)
        _REGISTRY.fallback = library


def ensure_kernels(ops) -> None:
    """Registers a kernel of ours at the key for each overload in ``ops`` without one.

    Registration is global (the dispatcher's tables are per process) and kept for the
    life of the process; a kernel only acts on threads that have the key on.

    On the main thread the registering runs on a thread of its own, which the main
    thread waits for: Python runs signal handlers on the main thread only, between any
    two lines, so a handler that opens a region while the main thread registered there
    itself would re-enter the registering half done (two fallbacks, a kernel registered
    twice) or wait for ever on the lock its own thread holds. While the main thread
    waits, a handler runs as usual; a region it opens waits for the registering under
    way to finish, then registers what it needs in the same way.
    """
    registry = _REGISTRY
    missing = [op for op in ops if op not in registry.kernels]
    if not missing and registry.fallback is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        _register(missing)
        return
    failure = []

    def register():
        try:
            _register(missing)
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(error)

    worker = threading.Thread(target=register, name="dispatch_amp-register-kernels", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no new threads (the interpreter is shutting down): here, then
        _register(missing)
        return
    worker.join()
    if failure:
        raise failure[0]


def _register(missing) -> None:
    registry = _REGISTRY
    compiled = _compiled_engine.active()  # chosen at the first registration, built if need be
    with registry.lock:
        _install()
        for op in missing:
            if op in registry.kernels:
                continue
            if compiled is not None:  # a C++ kernel holding the Python one (_compiled_engine)
                _compiled_engine.register(compiled, op, make_kernel(op))
                registry.kernels.add(op)
                continue
            namespace = op.namespace
            library = registry.libraries.get(namespace)
            if library is None:
                library = registry.libraries[namespace] = torch.library.Library(namespace, "IMPL")
            name = op._schema.name.split("::", 1)[1]
            if op._overloadname != "default":
                name = f"{name}.{op._overloadname}"
            library.impl(name, make_kernel(op), _KEY_NAME, with_keyset=True)
            registry.kernels.add(op)


def registered_count() -> int:
    """How many overloads have a kernel of ours (for diagnostics and tests)."""
    return len(_REGISTRY.kernels)


def switch(on: bool) -> None:
    """Switches our key on or off for this thread."""
    if on:
        _exclude(KEY, False)
        _include(KEY, True)
    else:
        _include(KEY, False)
        _exclude(KEY, True)


def is_on() -> bool:
    """Whether this thread has our key on (torch reports it as "privateuseone" autocast)."""
    return not _torch_compat.dispatch_key_excluded(KEY) and _torch_compat.dispatch_key_included(KEY)


OURS = DispatchKeySet(KEY)

_torch_compat.keep_out_of_dynamo(globals(), __name__)
