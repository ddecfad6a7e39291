"""Integration tests: helpers, and the rule that CI skips none of them.

``pytest.importorskip`` in these tests only protects users who run the suite without the
``integrations`` extra. CI installs the extra (it is part of ``test``), so a skip there
means a framework failed to install or import; with ``CI`` set it is turned into a failure.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def _fail_skip_in_ci(report, path) -> None:
    if _in_ci() and report.skipped and str(path).startswith(_HERE):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in CI ({reason}): CI installs the 'integrations' extra, so every "
            "integration test must run; check that `pip install -e .[test]` installed it"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), item.path)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), collector.path)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one process-wide ``AcceleratorState``: the first ``Accelerator``
    (transformers' Trainer makes one) fixes its mixed precision for the process, and a
    later one asking for another raises. Each test here starts and ends without one, so
    no test (nor the docs' examples run after these) depends on which ran before it."""
    _reset_accelerate_state()
    yield
    _reset_accelerate_state()


def _reset_accelerate_state() -> None:
    state = sys.modules.get("accelerate.state")  # never imported here for tests without it
    if state is not None:
        state.AcceleratorState._reset_state(True)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        # NaN != NaN: compare where the NaNs are, then everything else bit for bit.
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def same():
    """``same(a, b)``: nested tensors equal bit for bit (NaNs in the same places), other values ==."""
    return _same
