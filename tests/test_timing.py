"""benchmarks/timing.py, the one timing loop of the benchmarks: rotation, warm-up, samples per
call, setup and regions off the clock, per-round ratios. On a fake clock: no test reads a
real time."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def timing():
    root = str(pathlib.Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)
    try:
        return importlib.import_module("benchmarks.timing")
    finally:
        sys.path.remove(root)


class FakeClock:
    """A clock that only the timed functions advance: each call of fn ``name`` costs
    ``cost[name]`` seconds; everything else (setup, regions) costs nothing."""

    def __init__(self, cost: dict[str, float]):
        self.now, self.cost, self.log = 0.0, cost, []

    def __call__(self) -> float:
        return self.now

    def fns(self) -> dict:
        def fn(name):
            def call():
                self.log.append(name)
                self.now += self.cost[name]
            return call
        return {name: fn(name) for name in self.cost}


def test_rotations_rotate_the_order_each_round(timing):
    assert list(timing.rotations("ABC", 4)) == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 6), st.integers(1, 10))
def test_over_whole_cycles_each_item_takes_each_place_equally_often(timing, n, cycles):
    items = list(range(n))
    orders = list(timing.rotations(items, n * cycles))
    assert all(sorted(order) == items for order in orders)
    for place in range(n):
        assert Counter(order[place] for order in orders) == {i: cycles for i in items}


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=5), st.integers(1, 5), st.integers(0, 2), st.integers(1, 5))
def test_every_sample_is_its_fns_cost_per_call(timing, costs, rounds, warmup, calls):
    clock = FakeClock({f"f{i}": c / 1024 for i, c in enumerate(costs)})  # exact in binary: no rounding
    with pytest.MonkeyPatch.context() as m:
        m.setattr(timing, "clock", clock)
        samples = timing.interleaved(clock.fns(), rounds, warmup=warmup, calls=calls)
    assert samples == {name: [cost] * rounds for name, cost in clock.cost.items()}
    assert Counter(clock.log) == {name: (warmup + rounds) * calls for name in clock.cost}


def test_interleaved_gives_seconds_per_call_per_round_in_rotated_order(timing, monkeypatch):
    clock = FakeClock({"native": 0.002, "ours": 0.003, "fp32": 0.005})
    monkeypatch.setattr(timing, "clock", clock)
    samples = timing.interleaved(clock.fns(), rounds=3, warmup=2, calls=4)
    assert samples == {"native": [pytest.approx(0.002)] * 3, "ours": [pytest.approx(0.003)] * 3,
                       "fp32": [pytest.approx(0.005)] * 3}
    warm, timed = clock.log[:24], clock.log[24:]
    assert warm == ["native"] * 8 + ["ours"] * 8 + ["fp32"] * 8  # 2 warm-up samples of 4 calls each
    per_sample = timed[::4]
    assert per_sample == ["native", "ours", "fp32", "ours", "fp32", "native", "fp32", "native", "ours"]


def test_setup_and_the_region_run_off_the_clock(timing, monkeypatch):
    clock = FakeClock({"a": 1.0, "b": 2.0})
    monkeypatch.setattr(timing, "clock", clock)
    events = []

    def setup(name):
        events.append(("setup", name))
        clock.now += 100.0  # would show in the sample if it were timed

    @contextlib.contextmanager
    def inside(name):
        events.append(("enter", name))
        clock.now += 100.0
        yield
        clock.now += 100.0
        events.append(("exit", name))

    samples = timing.interleaved(clock.fns(), rounds=2, warmup=0, setup=setup, inside=inside)
    assert samples == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert events == [("setup", "a"), ("enter", "a"), ("exit", "a"), ("setup", "b"), ("enter", "b"), ("exit", "b"),
                      ("setup", "b"), ("enter", "b"), ("exit", "b"), ("setup", "a"), ("enter", "a"), ("exit", "a")]


def test_once_times_one_call(timing, monkeypatch):
    clock = FakeClock({"compile": 7.5})
    monkeypatch.setattr(timing, "clock", clock)
    assert timing.once(clock.fns()["compile"]) == 7.5
    assert clock.log == ["compile"]


def test_the_real_clock_is_torch_utils_benchmarks(timing):
    import torch.utils.benchmark

    assert timing.clock is torch.utils.benchmark.timer


@pytest.mark.parametrize("kwargs", [{"rounds": 0}, {"rounds": 1, "warmup": -1}, {"rounds": 1, "calls": 0}])
def test_bad_counts_are_named(timing, kwargs):
    with pytest.raises(ValueError, match="need rounds >= 1, warmup >= 0 and calls >= 1"):
        timing.interleaved({"a": lambda: None}, **kwargs)


def test_nothing_to_time_is_an_error(timing):
    with pytest.raises(ValueError, match="nothing to time"):
        timing.interleaved({}, rounds=3)


def test_ratio_stats_are_median_min_and_max_of_per_round_ratios(timing):
    # The median of per-round ratios, not the ratio of medians (1.0 / 1.0 here).
    assert timing.ratio_stats([1.0, 3.0, 1.0], [1.0, 1.0, 2.0]) == {"ratio": 1.0, "ratio_min": 0.5, "ratio_max": 3.0}
    assert timing.ratio_stats([2.0, 6.0, 3.0], [1.0, 2.0, 1.0])["ratio"] == 3.0


def test_ratio_stats_need_paired_samples(timing):
    with pytest.raises(ValueError, match="same number of samples"):
        timing.ratio_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same number of samples"):
        timing.ratio_stats([], [])
