"""Device detection: every answer comes from torch.accelerator, narrowed where a caller asks."""

from __future__ import annotations

import pytest
import torch

from dispatch_amp import _devices


def _machine(monkeypatch, device_type: str | None) -> None:
    """Make torch.accelerator report ``device_type`` as the available accelerator (None: none)."""

    def current_accelerator(check_available: bool = False):
        return None if device_type is None else torch.device(device_type)

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)


def test_this_machine_agrees_with_torch():
    found = torch.accelerator.current_accelerator(check_available=True)
    assert _devices.accelerator_type() == (None if found is None else found.type)
    assert _devices.default_device_type() == (found.type if found is not None else "cpu")
    assert _devices.device_available("cpu")


@pytest.mark.parametrize("device_type", [None, "cuda", "mps", "xpu"])
def test_the_default_is_the_accelerator_else_the_cpu(monkeypatch, device_type):
    _machine(monkeypatch, device_type)
    assert _devices.accelerator_type() == device_type
    assert _devices.default_device_type() == (device_type or "cpu")
    for other in ("cuda", "mps", "xpu"):
        assert _devices.device_available(other) == (other == device_type)
    assert _devices.device_available("cpu")


@pytest.mark.parametrize(("device_type", "expected"), [("cuda", "cuda"), ("mps", "mps"), ("xpu", "cpu"), (None, "cpu")])
def test_among_narrows_the_choice(monkeypatch, device_type, expected):
    _machine(monkeypatch, device_type)
    assert _devices.default_device_type(among=("cuda", "mps")) == expected


def test_a_built_but_unusable_accelerator_counts_as_none(monkeypatch):
    # A CUDA build on a machine without a GPU: the build has an accelerator, the runtime
    # check (check_available=True) finds none.
    def current_accelerator(check_available: bool = False):
        return None if check_available else torch.device("cuda")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)
    assert _devices.accelerator_type() is None
    assert _devices.default_device_type() == "cpu"
    assert not _devices.device_available("cuda")
