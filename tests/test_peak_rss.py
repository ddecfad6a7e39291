"""Peak RSS: the one reader, restarted by a reset on Linux so a peak is that of the work since."""

from __future__ import annotations

import math
import sys

import pytest

from dispatch_amp import _peak_rss

MiB = 2**20


def _current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reset is Linux's clear_refs")
def test_a_reset_restarts_the_peak_at_the_current_rss():
    big = bytearray(256 * MiB)  # written (zeroed): resident
    before_free = _peak_rss.peak_rss_mb()
    del big
    assert _peak_rss.reset_peak_rss() is True
    after = _peak_rss.peak_rss_mb()
    # The 256 MiB peak is gone: the new peak is about the current RSS.
    assert after < before_free - 200
    assert abs(after - _current_rss_mb()) < 32


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reset is Linux's clear_refs")
def test_the_peak_after_a_reset_sees_the_work_since():
    _peak_rss.reset_peak_rss()
    start = _peak_rss.peak_rss_mb()
    block = bytearray(128 * MiB)
    del block
    assert _peak_rss.peak_rss_mb() - start >= 120


def test_without_proc_the_peak_is_ru_maxrss(monkeypatch):
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(_peak_rss, "_STATUS", "/nonexistent/status")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expected = peak / MiB if sys.platform == "darwin" else peak / 1024
    assert _peak_rss.peak_rss_mb() == pytest.approx(expected, rel=0.05)


def test_without_proc_or_resource_the_peak_is_nan(monkeypatch):
    monkeypatch.setattr(_peak_rss, "_STATUS", "/nonexistent/status")
    monkeypatch.setitem(sys.modules, "resource", None)  # import resource raises ImportError, as on Windows
    assert math.isnan(_peak_rss.peak_rss_mb())


def test_a_reset_that_cannot_be_done_says_so(monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only /proc")

    monkeypatch.setattr("builtins.open", refuse)
    assert _peak_rss.reset_peak_rss() is False
