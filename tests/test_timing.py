"""benchmarks/timing.py, the one timing loop of the benchmarks: rotation, warm-up, samples per
call, setup and regions off the clock, the two ratio estimators and their bootstrap
intervals. On a fake clock or synthetic samples: no test reads a real time."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import random
import statistics
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
    st = timing.ratio_stats([1.0, 3.0, 1.0], [1.0, 1.0, 2.0])
    assert (st["ratio"], st["ratio_min"], st["ratio_max"]) == (1.0, 0.5, 3.0)
    assert timing.ratio_stats([2.0, 6.0, 3.0], [1.0, 2.0, 1.0])["ratio"] == 3.0


def test_ratio_stats_give_both_estimators(timing):
    # per-round ratios 1.1, 0.5, 1.9: their median 1.1; the medians 1.1 and 1.05: 1.0476...
    st = timing.ratio_stats([1.1, 1.0, 2.0], [1.0, 2.0, 1.05])
    assert st["ratio"] == pytest.approx(1.1)
    assert st["ratio_of_medians"] == pytest.approx(1.1 / 1.05)
    assert set(st) == {"ratio", "ratio_lo", "ratio_hi", "ratio_min", "ratio_max", "ratio_of_medians",
                       "ratio_of_medians_lo", "ratio_of_medians_hi"}


def _noisy_rounds(n: int, seed: int, effect: float = 1.05) -> tuple[list[float], list[float]]:
    """Synthetic paired samples: a per-round machine slowdown shared by both sides, and
    independent right-skewed noise per sample (as a shared host gives)."""
    rng = random.Random(seed)
    num, den = [], []
    for _ in range(n):
        slow = rng.lognormvariate(0, 0.2)
        num.append(effect * slow * rng.lognormvariate(0, 0.05))
        den.append(slow * rng.lognormvariate(0, 0.05))
    return num, den


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rounds", [5, 21, 41])
def test_each_interval_holds_its_estimate(timing, seed, rounds):
    st = timing.ratio_stats(*_noisy_rounds(rounds, seed))
    assert st["ratio_lo"] <= st["ratio"] <= st["ratio_hi"]
    assert st["ratio_of_medians_lo"] <= st["ratio_of_medians"] <= st["ratio_of_medians_hi"]
    assert st["ratio_min"] <= st["ratio_lo"] and st["ratio_hi"] <= st["ratio_max"]


def test_intervals_shrink_with_more_rounds(timing):
    def widths(rounds):
        st = timing.ratio_stats(*_noisy_rounds(rounds, seed=1))
        return st["ratio_hi"] - st["ratio_lo"], st["ratio_of_medians_hi"] - st["ratio_of_medians_lo"]

    few, many, most = widths(11), widths(101), widths(401)
    assert many[0] < few[0] and many[1] < few[1]
    assert most[0] < many[0] and most[1] < many[1]
    # The shared slowdown cancels in each round's ratio, not in the ratio of medians.
    assert most[0] < most[1]


def test_the_interval_is_deterministic_and_its_seed_is_a_parameter(timing):
    num, den = _noisy_rounds(21, seed=3)
    assert timing.ratio_stats(num, den) == timing.ratio_stats(list(num), list(den))
    # The mean of a resample takes many values: another seed moves its quantiles.
    assert (timing.bootstrap_interval(num, statistics.fmean, seed=1)
            != timing.bootstrap_interval(num, statistics.fmean, seed=2))


def test_a_rounds_two_samples_are_resampled_together(timing):
    # Each round's ratio is exactly 1.25 while the rounds' times vary 100-fold: resampling
    # rounds (pairs) gives 1.25 every time for both estimators; resampling each side on its
    # own would not.
    den = [2.0 ** k for k in (0, 3, 1, 6, 2, 5, 4)]
    st = timing.ratio_stats([1.25 * d for d in den], den)
    for key in ("ratio", "ratio_of_medians"):
        assert st[key] == st[f"{key}_lo"] == st[f"{key}_hi"] == 1.25


def test_bootstrap_interval_is_the_percentile_interval_of_resampled_rounds(timing):
    # One round: every resample is that round.
    assert timing.bootstrap_interval([3.0], statistics.median) == (3.0, 3.0)
    # Two values, median of two draws: each resample is 1, 1.5 or 2 (1/4, 1/2, 1/4).
    lo, hi = timing.bootstrap_interval([1.0, 2.0], statistics.median, resamples=4000)
    assert (lo, hi) == (1.0, 2.0)
    lo, hi = timing.bootstrap_interval([1.0, 2.0], statistics.median, resamples=4000, confidence=0.4)
    assert (lo, hi) == (1.5, 1.5)


@pytest.mark.parametrize("kwargs, message", [({"resamples": 0}, "resamples >= 1"), ({"confidence": 1.0}, "confidence")])
def test_bootstrap_interval_names_bad_arguments(timing, kwargs, message):
    with pytest.raises(ValueError, match=message):
        timing.bootstrap_interval([1.0], statistics.median, **kwargs)
    with pytest.raises(ValueError, match="at least one round"):
        timing.bootstrap_interval([], statistics.median)


def test_prefixed_prefixes_every_key(timing):
    assert timing.prefixed({"ratio": 1.0, "ratio_lo": 0.9}, "step_") == {"step_ratio": 1.0, "step_ratio_lo": 0.9}


def test_a_sample_of_several_steps_is_their_mean_per_step(timing, monkeypatch):
    # steps of 1, 2, 3, 4 ... seconds: 3 steps per sample -> 2, 5, 8 per step
    clock = FakeClock({"step": 0.0})
    costs = iter(range(1, 100))

    def step():
        clock.now += next(costs)

    monkeypatch.setattr(timing, "clock", clock)
    assert timing.interleaved({"step": step}, rounds=3, warmup=0, calls=3) == {"step": [2.0, 5.0, 8.0]}


def test_ratio_stats_need_paired_samples(timing):
    with pytest.raises(ValueError, match="same number of samples"):
        timing.ratio_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same number of samples"):
        timing.ratio_stats([], [])
