"""Test-wide setup: Triton's interpreter on machines without a GPU, hypothesis profiles."""

import os

import torch

# The Triton kernels run through Triton's CPU interpreter when no GPU is present. The
# variable is read when triton.jit decorates a kernel, so it must be set before any
# kernel module is imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# Timing varies too much on shared machines for deadlines; CI replays the same examples.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
