"""_torch_compat: every private torch API is found once, or the import names what is missing."""

from __future__ import annotations

import importlib
import pathlib

import pytest
import torch

from dispatch_amp import _torch_compat


def test_every_private_api_resolves_on_a_supported_torch():
    assert torch.__version__ >= _torch_compat.OLDEST_TORCH
    for name in (
        "len_function_stack", "function_stack_at", "pop_function_stack", "push_function_stack",
        "top_saved_tensors_hooks", "reentrant_checkpoint_function", "tensor_is_view",
        "set_eval_frame", "skip_code",
    ):
        assert getattr(_torch_compat, name) is not None, name


def test_the_oldest_supported_torch_is_pyprojects_floor():
    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"torch>={_torch_compat.OLDEST_TORCH}"' in pyproject


def test_a_missing_api_fails_the_import_and_names_it(monkeypatch):
    monkeypatch.delattr(torch._C, "_dispatch_tls_set_dispatch_key_included")
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    try:
        pattern = (r"torch\._C\._autograd\._top_saved_tensors_default_hooks, .*"
                   r"torch\._C\._dispatch_tls_set_dispatch_key_included")
        with pytest.raises(ImportError, match=pattern) as info:
            importlib.reload(_torch_compat)
        assert (f"tested with torch {_torch_compat.OLDEST_TORCH} through "
                f"{_torch_compat.NEWEST_TESTED_TORCH}") in str(info.value)
    finally:
        monkeypatch.undo()
        importlib.reload(_torch_compat)


def _excluded_inside(guard) -> int:
    with guard:
        return torch._C._dispatch_tls_local_exclude_set().raw_repr()


@pytest.mark.parametrize("region", ["none", "ours", "native"])
def test_autocast_keys_are_the_keys_torch_disables_autocast_with(region):
    import dispatch_amp as amp

    opened = {"none": None, "ours": amp.autocast("cpu"), "native": torch.autocast("cpu")}[region]
    if opened is not None:
        opened.__enter__()
    try:
        ours = _excluded_inside(torch._C._ExcludeDispatchKeyGuard(_torch_compat.AUTOCAST_KEYS))
        torchs = _excluded_inside(torch._C._DisableAutocast())
    finally:
        if opened is not None:
            opened.__exit__(None, None, None)
    assert ours == torchs
    names = repr(_torch_compat.AUTOCAST_KEYS).removeprefix("DispatchKeySet(").removesuffix(")").split(", ")
    assert names and all(name.startswith("Autocast") for name in names), names


def test_the_cast_order_read_at_import_is_natives_for_three_arguments():
    # Read at import from mm's two arguments; checked here on addmm's three, on this thread.
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.addmm(torch.ones(5), torch.ones(2, 3), torch.ones(3, 5))
    left_to_right = [(5,), (2, 3), (3, 5)]
    assert shapes == (left_to_right[::-1] if _torch_compat.CASTS_LAST_ARGUMENT_FIRST else left_to_right)


def test_reading_the_cast_order_leaves_this_threads_state_alone():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    before = (torch.is_autocast_enabled("cpu"), torch._C._dispatch_tls_local_exclude_set().raw_repr())
    assert _torch_compat._casts_last_argument_first() is _torch_compat.CASTS_LAST_ARGUMENT_FIRST
    assert _get_current_dispatch_mode() is None
    assert (torch.is_autocast_enabled("cpu"), torch._C._dispatch_tls_local_exclude_set().raw_repr()) == before
