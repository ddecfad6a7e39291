"""Integration tests: helpers, and the rule that CI skips none of them.

``pytest.importorskip`` in these tests only protects users who run the suite without the
``integrations`` extra. CI installs the extra (it is part of ``test``), so a skip there
means a framework failed to install or import; with ``CI`` set it is turned into a failure.
"""

from __future__ import annotations

import os

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
