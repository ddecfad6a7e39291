"""The device our Lightning plugins take when none is named: Lightning's own choice, found
through torch.accelerator (no Lightning needed: the helpers import none)."""

from __future__ import annotations

import pytest
import torch

from dispatch_amp.integrations._half import default_device
from dispatch_amp.integrations._precision_flags import autocast_device


def _machine(monkeypatch, device_type: str | None) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if device_type is None else torch.device(device_type))


# Lightning's accelerator="auto" takes CUDA or MPS, else the CPU; it never picks XPU itself.
@pytest.mark.parametrize(("machine", "auto"), [(None, "cpu"), ("cuda", "cuda"), ("mps", "mps"), ("xpu", "cpu")])
def test_auto_and_the_plugins_default_follow_lightnings_choice(monkeypatch, machine, auto):
    _machine(monkeypatch, machine)
    assert default_device() == auto
    assert autocast_device("Trainer", "auto") == auto
    assert autocast_device("Trainer", None) == auto


@pytest.mark.parametrize(("machine", "gpu"), [(None, None), ("cuda", "cuda"), ("mps", "mps"), ("xpu", None)])
def test_gpu_is_cuda_or_mps_or_no_device(monkeypatch, machine, gpu):
    _machine(monkeypatch, machine)
    assert autocast_device("Fabric", "gpu") == gpu


@pytest.mark.parametrize("machine", [None, "cuda", "mps", "xpu"])
def test_a_named_device_is_taken_only_where_the_machine_has_it(monkeypatch, machine):
    _machine(monkeypatch, machine)
    assert autocast_device("Trainer", "cpu") == "cpu"
    for name in ("cuda", "mps", "xpu"):
        assert autocast_device("Trainer", name) == (name if name == machine else None)
        assert autocast_device("Trainer", name.upper()) == (name if name == machine else None)
