"""Test-wide setup: Triton's interpreter on machines without a GPU, hypothesis profiles."""

import os

import torch

# The Triton kernels run through Triton's CPU interpreter when no GPU is present. The
# variable is read when triton.jit decorates a kernel, so it must be set before any
# kernel module is imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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


class SyncCounter(TorchDispatchMode):
    """Counts host reads: every .item()/bool() on a tensor reaches aten._local_scalar_dense,
    and every Tensor.tolist() (which reads memory directly, below the dispatcher) is counted
    by a wrapper installed while the counter is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(t):
            counter.count += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sync_counter():
    """The SyncCounter class: ``with sync_counter() as c: ...`` then ``c.count``."""
    return SyncCounter


@pytest.fixture
def triton_interpreter_available() -> bool:
    """Whether Triton kernels can run here (installed, and interpreted when there is no GPU)."""
    from dispatch_amp.kernels import unscale

    return unscale.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


class AtenCalls(TorchDispatchMode):
    """Every aten call below the autocast keys (casts included), as (op, the dtype and
    shape of each tensor argument), in order: what ours and native must agree on call for
    call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        self.calls.append((str(func), tuple((t.dtype, tuple(t.shape)) for t in leaves if isinstance(t, torch.Tensor))))
        return func(*args, **kwargs)


@pytest.fixture
def aten_calls():
    """``aten_calls(fn)``: the aten calls ``fn()`` makes (``AtenCalls``), in order."""

    def record(fn):
        with AtenCalls() as rec:
            fn()
        return rec.calls

    return record
