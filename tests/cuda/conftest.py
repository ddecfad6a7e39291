"""The CUDA lane: tests that need a CUDA GPU, run by ``scripts/gpu_check.sh``.

On a machine without CUDA (CI) every test collected from this folder is reported as
skipped, with the reason. With CUDA present the root conftest leaves ``TRITON_INTERPRET``
unset, so the Triton kernels here run compiled for the GPU.
"""

import pathlib

import pytest
import torch

from dispatch_amp.kernels import _launch, unscale

_HERE = pathlib.Path(__file__).resolve().parent
_SKIP = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA lane: scripts/gpu_check.sh runs it)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if _HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(_SKIP)


@pytest.fixture(autouse=True)
def _fresh_cuda_state():
    """Each test starts on a synchronized device with torch's sync-debug mode off."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0)
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


@pytest.fixture
def compiled_triton():
    """Fails the test unless our kernels run compiled on the GPU: with the interpreter on
    (TRITON_INTERPRET set) or without triton a comparison would be torch against torch."""
    assert unscale.triton is not None, "triton is not installed: the CUDA lane needs it"
    assert not _launch.interpreting(), "TRITON_INTERPRET is set: the kernels would run interpreted, not compiled"
    assert unscale.uses_triton("cuda") and not unscale.uses_triton("cuda", "torch")


class LaunchCounter:
    """Stands in for a Triton kernel object and counts its launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            self.launches += 1
            return launch(*args, **kwargs)

        return counted


@pytest.fixture
def launch_counter():
    """The :class:`LaunchCounter` class (tests are not a package: fixtures hand it out)."""
    return LaunchCounter
