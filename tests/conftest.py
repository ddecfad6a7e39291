"""Test-wide setup: Triton's interpreter on machines without a GPU, hypothesis profiles."""

import os
import re

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


# torch.utils.cpp_extension logs this once at import on a CUDA build of torch with no GPU
# (and nvcc on PATH). It is torch's line, not ours, so the tests that hold our stderr to
# nothing at all drop exactly it, and would still catch any other line.
_TORCH_NO_CUDA_RUNTIME_LINE = re.compile(
    r"^W\d{4} [\d:.]+ \d+ \S*torch/utils/cpp_extension\.py:\d+\] "
    r"No CUDA runtime is found, using CUDA_HOME='[^'\n]*'\n?",
    re.MULTILINE,
)


@pytest.fixture
def without_torch_cuda_notice():
    """A function: a process's stderr, less torch's "No CUDA runtime is found" log line."""
    return lambda stderr: _TORCH_NO_CUDA_RUNTIME_LINE.sub("", stderr)


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


# -- tests that need the compiled engine built ------------------------------------------------
# README's test command must pass on a machine without a C++ toolchain too, where the Python
# engine runs (with one warning). There the tests that need a build (those using the
# session's build, or marked `needs_compiler`) are skipped, saying why; where the compiled
# engine is required (DISPATCH_AMP_ENGINE=compiled, as CI sets it) they run, and a missing
# toolchain fails them.
def _missing_toolchain() -> str | None:
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    if not is_ninja_available():
        return "no ninja"
    return None


# README's test command runs the test files on one worker per physical core (pytest-xdist's
# `-n auto --dist loadfile`: a file's tests on one worker, so its module fixtures are made
# once), at most four: each worker imports torch and runs torch's own threads, so more
# workers than cores only compete for them.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except ImportError:  # not a test requirement; logical CPUs instead
        cores = None
    return max(1, min(4, cores or os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_compiler: the test builds or runs the compiled engine")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DISPATCH_AMP_ENGINE", "").strip().lower() == "compiled":
        return
    why = _missing_toolchain()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"the compiled engine cannot be built here: {why} "
                                   "(with DISPATCH_AMP_ENGINE=compiled, as CI runs, these fail instead)")
    for item in items:
        if "compiled_build" in getattr(item, "fixturenames", ()) or item.get_closest_marker("needs_compiler"):
            item.add_marker(skip)


# -- the compiled engine, built once per test session ------------------------------------------
# Two processes started together on an empty cache directory, as DDP ranks or dataloader
# workers would: both must load, and only one may compile. The cache it leaves is what the
# tests of cached loads and of `python -m dispatch_amp.build` read (tests/compiled,
# tests/test_build.py). Half a minute to a minute and a half on a busy 2-core machine.
_TOGETHER = r"""
import json, pathlib, sys, time
here, me = pathlib.Path(sys.argv[1]), sys.argv[2]
from dispatch_amp._compiled import loader  # torch imported before the start line, not in the race
(here / f"ready-{me}").touch()
while not (here / "go").exists():
    time.sleep(0.005)
module = loader.load(required=True)
print(json.dumps({"built_against": module.built_against(), "build_seconds": loader.PROCESS_LOADER.build_seconds,
                  "directory": str(loader.PROCESS_LOADER.directory)}))
"""


class CompiledBuild:
    """What the session's build left: the cache root, and each process's (rc, stdout, stderr)."""

    def __init__(self, root, runs, seconds):
        import json
        import pathlib

        self.root, self.runs, self.seconds = pathlib.Path(root), runs, seconds
        self.results = [json.loads(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None
                        for rc, out, _ in runs]

    def env(self, **extra):
        """The environment of a process that uses this cache."""
        return {**os.environ, "DISPATCH_AMP_CACHE_DIR": str(self.root), **extra}


@pytest.fixture(scope="session")
def compiled_build(tmp_path_factory):
    """The session's build. Under pytest-xdist the first worker to ask makes it and the
    others read what it left (a session fixture is otherwise made once per worker, and
    this one compiles the engine from nothing)."""
    import json

    try:
        import fcntl
    except ImportError:  # no file lock to share one build by (Windows): each worker builds
        fcntl = None
    if "PYTEST_XDIST_WORKER" not in os.environ or fcntl is None:
        return CompiledBuild(*_build_together(tmp_path_factory))
    shared = tmp_path_factory.getbasetemp().parent  # every worker's base lies in it
    record = shared / "compiled-build.json"
    with open(shared / "compiled-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.exists():
            record.write_text(json.dumps(_build_together(tmp_path_factory)))
    return CompiledBuild(*json.loads(record.read_text()))


def _build_together(tmp_path_factory) -> tuple:
    """(cache root, each process's (rc, stdout, stderr), seconds): two processes started
    together on an empty cache directory."""
    import subprocess
    import sys
    import time

    sync = tmp_path_factory.mktemp("start-line")
    root = tmp_path_factory.mktemp("engine-cache")
    env = {**os.environ, "DISPATCH_AMP_CACHE_DIR": str(root)}
    env.pop("DISPATCH_AMP_ENGINE", None)
    procs = [subprocess.Popen([sys.executable, "-c", _TOGETHER, str(sync), str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    deadline = time.monotonic() + 300
    while not all((sync / f"ready-{i}").exists() for i in range(2)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    start = time.perf_counter()
    (sync / "go").touch()
    runs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        runs.append((p.returncode, out, err))
    return str(root), runs, time.perf_counter() - start
