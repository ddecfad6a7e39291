"""The private PyTorch APIs the engine relies on, looked up once, in one place.

Each entry below is something torch does not promise to keep. They are resolved when
this module is imported; if any is missing (a torch version we do not test), the import
fails with one error that names every missing API and the torch versions the project is
tested with, instead of an AttributeError deep inside a forward pass.

What each is for:

- the function-mode stack (``_len_torch_function_stack``, ``_get_function_stack_at``,
  ``_pop_torch_function_stack``, ``_push_on_torch_function_stack``): a region takes the
  fp8 level off the stack from wherever it is, not from the top
  (``_take_off_function_stack`` in ``autocast/_engine.py``), and puts it back where torch
  emptied the stack (an autograd Function's backward);
- the thread's dispatch-key sets (``_dispatch_tls_set_dispatch_key_included`` and
  ``..._excluded``) and ``torch.library``'s fallthrough: our autocast key
  (``autocast/_dispatch_key.py``);
- Dynamo's frame hook (``set_eval_frame``) and ``skip_code``: our own frames are kept out
  of Dynamo (see ``keep_out_of_dynamo``); ``assume_constant_result``: the fp8 tracing path
  asks our thread state once, at trace time; Dynamo's compile-start and -end callbacks
  (``torch._dynamo.callback``): the engine's ``_CompileHooks``;
- ``_top_saved_tensors_default_hooks`` and ``torch.utils.checkpoint.CheckpointFunction``:
  telling whether torch's checkpoint is running, to refuse it under a custom policy;
- ``Tensor._is_view``: native's weight-cast cache skips views, and so does ours;
  ``_is_cached_tensor``: it skips the tensors CUDA graph trees keep, and so does ours;
- ``_set_grad_enabled``: a weight's cast is made with grad mode on, as native makes it,
  without ``torch.enable_grad``'s context-manager object (``autocast/_cast_cache.py``);
- ``_DisableAutocast`` and ``_ExcludeDispatchKeyGuard``: the set of every autocast key
  (``AUTOCAST_KEYS``), excluded around the ops the engine's handlers call;
- not an API but a behaviour: the order in which native casts an op's arguments, which
  its compiler chose (``CASTS_LAST_ARGUMENT_FIRST``), read from torch at import;
- ``_dispatch_get_registrations_for_dispatch_key``: the ops native autocast handles in
  the installed torch, which the built-in policies follow (``_builtin_table`` in
  ``autocast/policy.py``) and which get a kernel of ours under a policy of our own
  (``Plan`` in ``autocast/_routing.py``).
"""

from __future__ import annotations

import functools
import threading
import types

import torch
import torch.utils.checkpoint

# The torch releases the whole test suite passes on (docs/torch-releases.md); the
# oldest is pyproject.toml's floor.
OLDEST_TORCH = "2.11"
NEWEST_TESTED_TORCH = "2.15"

_missing: list[str] = []

# torch._scaled_mm on CPU takes one scale per row only from torch 2.12 on (2.11 asserts
# "only supports per-tensor scaling for CPU backend").
_release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
SCALED_MM_ROWWISE_ON_CPU = _release >= (2, 12)

# Whether the compiled engine can batch weight casts on this torch. engine.cpp's
# batchable() is the source of truth: before 2.13 the class test of a bucket's weights
# needs the GIL, so it batches nothing there (docs/design.md, "Torch before 2.13"), and
# DISPATCH_AMP_BATCH_CASTS=1 leaves every weight cast at its use. This mirrors it in Python
# so that what reports on batching (the benchmarks) can say so instead of measuring the
# per-use casts under a "batched" label; tests/compiled/test_engine.py holds the two equal.
BATCHED_WEIGHT_CASTS = _release >= (2, 13)


def _lookup(owner, dotted: str, name: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        _missing.append(f"{dotted}.{name}")
        return None


top_saved_tensors_hooks = _lookup(
    torch._C._autograd, "torch._C._autograd", "_top_saved_tensors_default_hooks"
)
reentrant_checkpoint_function = _lookup(
    torch.utils.checkpoint, "torch.utils.checkpoint", "CheckpointFunction"
)
tensor_is_view = _lookup(torch.Tensor, "torch.Tensor", "_is_view")
is_cached_tensor = _lookup(torch._C, "torch._C", "_is_cached_tensor")
set_grad_enabled = _lookup(torch._C, "torch._C", "_set_grad_enabled")
dispatch_key_excluded = _lookup(torch._C, "torch._C", "_dispatch_tls_is_dispatch_key_excluded")
dispatch_key_included = _lookup(torch._C, "torch._C", "_dispatch_tls_is_dispatch_key_included")
set_dispatch_key_included = _lookup(torch._C, "torch._C", "_dispatch_tls_set_dispatch_key_included")
set_dispatch_key_excluded = _lookup(torch._C, "torch._C", "_dispatch_tls_set_dispatch_key_excluded")
_lookup(torch._C, "torch._C", "_DisableAutocast")
_lookup(torch._C, "torch._C", "_ExcludeDispatchKeyGuard")
len_function_stack = _lookup(torch._C, "torch._C", "_len_torch_function_stack")
function_stack_at = _lookup(torch._C, "torch._C", "_get_function_stack_at")
pop_function_stack = _lookup(torch._C, "torch._C", "_pop_torch_function_stack")
push_function_stack = _lookup(torch._C, "torch._C", "_push_on_torch_function_stack")
_registrations_for_key = _lookup(
    torch._C, "torch._C", "_dispatch_get_registrations_for_dispatch_key"
)

try:
    from torch._dynamo.callback import callback_handler as _callbacks
except ImportError:
    _missing.append("torch._dynamo.callback.callback_handler")
    _callbacks = None

try:
    from torch._C._dynamo.eval_frame import set_eval_frame
    from torch._dynamo import assume_constant_result
    from torch._dynamo.eval_frame import skip_code

    # The file of torch.compile's wrapper around a compiled function.
    DYNAMO_EVAL_FRAME_FILE = torch._dynamo.eval_frame.__file__
except ImportError:
    _missing.append(
        "torch._C._dynamo.eval_frame.set_eval_frame, torch._dynamo.eval_frame.skip_code, "
        "torch._dynamo.assume_constant_result"
    )
    set_eval_frame = skip_code = assume_constant_result = None

# Dynamo's frame hook off and back on around code of ours (two C calls, what
# torch._dynamo.disable does; see "Note: Dynamo and our frames" in autocast/_engine.py):
# ``hook = disarm_dynamo()`` ... ``rearm_dynamo(hook)``. A partial is called from C:
# cheaper than a lambda on a path that runs for every call it covers.
disarm_dynamo = functools.partial(set_eval_frame, None) if set_eval_frame is not None else None
rearm_dynamo = set_eval_frame

# The name of native autocast's dispatch key for each device type we know by name.
AUTOCAST_KEY_NAMES = {
    name.removeprefix("Autocast").lower(): name
    for name in dir(torch._C.DispatchKey)
    if name.startswith("Autocast") and name != "Autocast"
}

def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


if _missing:
    raise ImportError(
        f"dispatch_amp needs private PyTorch APIs that torch {torch.__version__} does not "
        f"have: {', '.join(_missing)}. dispatch_amp is tested with torch {OLDEST_TORCH} "
        f"through {NEWEST_TESTED_TORCH}; install one of those (pip install "
        f"'torch>={OLDEST_TORCH},<{_next_minor(NEWEST_TESTED_TORCH)}')."
    )


def _autocast_keys() -> torch._C.DispatchKeySet:
    """Every autocast dispatch key: the set ``torch._C._DisableAutocast`` excludes.

    torch's Python ``DispatchKey`` names only some of them (not AutocastMTIA, AutocastXLA,
    ...), so the set is read from torch: the keys excluded inside ``_DisableAutocast`` on
    a thread of its own (whose excluded keys are torch's defaults, which only add to it),
    kept to the range the autocast keys occupy (``AutocastCPU`` through
    ``AutocastPrivateUse1``; the range carries backend bits, which the intersection drops).
    """
    from torch._C import DispatchKey

    found = {}

    def probe():
        with torch._C._DisableAutocast():
            found["excluded"] = torch._C._dispatch_tls_local_exclude_set()

    thread = threading.Thread(target=probe, name="dispatch_amp-autocast-keys")
    thread.start()
    thread.join()
    after = torch._C._dispatch_keyset_full_after
    span = (after(DispatchKey.AutocastPrivateUse1) - after(DispatchKey.AutocastCPU)).add(
        DispatchKey.AutocastCPU
    ).add(DispatchKey.AutocastPrivateUse1)
    keys = torch._C.DispatchKeySet.from_raw_repr(found["excluded"].raw_repr() & span.raw_repr())
    named = [k for name, k in DispatchKey.__members__.items() if name.startswith("Autocast")]
    if not all(keys.has(k) for k in named):
        raise ImportError(
            f"dispatch_amp could not read the autocast dispatch keys of torch {torch.__version__} "
            f"(read {keys}); it is tested with torch {OLDEST_TORCH} through {NEWEST_TESTED_TORCH}"
        )
    return keys


# Every autocast key (ours and native's): what native's wrappers exclude around the ops
# they call, and the engine's handlers too (autocast/_handlers.py).
AUTOCAST_KEYS = _autocast_keys()


def _casts_last_argument_first() -> bool:
    """Whether native autocast casts an op's last argument first.

    Native's wrappers cast every argument inside one C++ call expression
    (``redispatch(cached_cast(args)...)``), whose evaluation order the compiler picks:
    GCC builds (torch's Linux wheels) cast the last argument first, Clang builds the
    first. The order shows in the aten calls a ``TorchDispatchMode`` sees and in the
    graphs torch.compile captures, whose cache keys (inductor's FX graph cache,
    AOTAutograd's) differ when it does, so the engine casts in the order this torch
    does. Read from torch: ``mm`` under CPU autocast, on a thread of its own (the mode
    and the region touch only that thread's state).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list = []

    class _Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                seen.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    def probe():
        with _Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.mm(torch.ones(2, 3), torch.ones(3, 4))

    thread = threading.Thread(target=probe, name="dispatch_amp-cast-order")
    thread.start()
    thread.join()
    if sorted(seen) != [(2, 3), (3, 4)]:
        raise ImportError(
            f"dispatch_amp could not read the order in which torch {torch.__version__}'s "
            f"autocast casts an op's arguments (mm under CPU autocast cast {seen}); it is "
            f"tested with torch {OLDEST_TORCH} through {NEWEST_TESTED_TORCH}"
        )
    return seen[0] == (3, 4)


# Native casts an op's arguments last to first (GCC builds) or first to last (Clang
# builds): the engine's handlers follow it (autocast/_casting.py, autocast/_handlers.py).
CASTS_LAST_ARGUMENT_FIRST = _casts_last_argument_first()


def autocast_registration_overloads(key: str) -> tuple[str, ...]:
    """The overloads (``"aten::pow.Tensor_Scalar"``, ``"aten::mm"`` for a default one)
    native autocast registers for dispatch key ``key`` in this torch."""
    return tuple(_registrations_for_key(key))


def overload_by_name(name: str):
    """The ``OpOverload`` named ``"namespace::op"`` or ``"namespace::op.overload"``, or
    None where this torch has no such op."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def on_compile_start(callback) -> None:
    """Calls ``callback(*args)`` when Dynamo starts compiling a frame (its arguments differ
    between torch releases)."""
    _callbacks.register_start_callback(callback)


def compile_callback_registered(callback) -> bool:
    """Whether ``callback`` is among Dynamo's compile-start callbacks."""
    return callback in _callbacks.start_callbacks  # `is`, then `==` (a bound method's), in C


def on_compile_end(callback) -> None:
    """Calls ``callback(*args)`` when Dynamo has finished compiling a frame."""
    _callbacks.register_end_callback(callback)


def autocast_registrations(key: str) -> frozenset[str]:
    """The ops (``"aten::mm"``, overloads folded into their op) that native autocast
    registers for dispatch key ``key`` ("AutocastCPU", "AutocastCUDA") in this torch."""
    return frozenset(
        name.split(".", 1)[0] for name in _registrations_for_key(key)
    )


def keep_out_of_dynamo(namespace: dict, module_name: str) -> None:
    """Marks every function of a module (and of its classes) as a frame Dynamo never
    compiles.

    Code after a graph break in a compiled function runs eagerly with Dynamo's frame hook
    armed, and the engine's frames would be compiled as user frames: specialized for
    tracing, broken at every C call. Dynamo still inlines them when it traces a call
    under the fp8 level (see "Note: torch.compile" in ``autocast/_engine.py``).
    """
    for value in list(namespace.values()):
        functions = [value]
        if isinstance(value, type) and value.__module__ == module_name:
            functions = [getattr(f, "__func__", f) for f in vars(value).values()]
        for f in functions:
            if isinstance(f, types.FunctionType) and f.__module__ == module_name:
                _skip_with_nested(f.__code__)


def _skip_with_nested(code: types.CodeType) -> None:
    # Closures made at run time (a kernel per op, a handler per schema) share the code
    # objects nested in their maker's: those are marked too.
    skip_code(code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _skip_with_nested(const)
