"""How every benchmark here times: the one implementation of docs/design.md, "Performance method".

The functions under comparison (ours, native, fp32, ...) run in the same process,
interleaved: each round runs every one once, in rotated order (A B C, then B C A, ...),
so none is always first or always after the same other one, and load on the machine
slows them alike. Each gets untimed warm-up samples first. A sample is ``calls`` calls
between two readings of ``torch.utils.benchmark``'s clock, which synchronizes the
accelerator (``torch.accelerator``) before each reading when there is one: a GPU's queued
work is inside the sample that queued it. On a GPU a sample should be several steps
(``calls``, the steps per sample): one synchronized step on a shared host is too noisy for
a few percent.

For a ratio ``ratio_stats`` reports two estimators, each with a bootstrap 95% interval
over the rounds: the median of per-round ratios (a round's samples ran under the same
conditions, so slow periods of the machine cancel within a round) and the ratio of the
medians (each side's typical time, whatever sample it was paired with). With quiet
samples the two agree; where they disagree beyond their intervals, the samples are too
noisy for the difference being measured (docs/performance.md, "Estimators").

``interleaved_events`` is the same loop on the device's own clock (CUDA events around the
calls), for kernels whose host time is not theirs; ``once`` times a single call on the
same clock as ``interleaved`` (a first, compiling call).

Example::

    samples = interleaved({"native": native_step, "ours": ours_step}, rounds=21, warmup=2)
    ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    st = ratio_stats(samples["ours"], samples["native"])
    st["ratio"], st["ratio_lo"], st["ratio_hi"]                  # median of per-round ours/native, 95% interval
    st["ratio_of_medians"], st["ratio_of_medians_lo"], st["ratio_of_medians_hi"]
"""

from __future__ import annotations

import contextlib
import random
import statistics
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.benchmark import timer as clock

__all__ = ["rotations", "interleaved", "interleaved_events", "once", "ratio_stats", "bootstrap_interval",
           "prefixed", "BOOTSTRAP_RESAMPLES"]

# Percentile bootstrap: resamples of the rounds, a fixed seed (the same samples always give
# the same interval), 95%.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def rotations(items: Iterable, rounds: int) -> Iterator[list]:
    """Per round, the items in rotated order (A B C, B C A, ...).

    Example::

        list(rotations("ABC", 4))   # [['A','B','C'], ['B','C','A'], ['C','A','B'], ['A','B','C']]
    """
    items = list(items)
    for r in range(rounds):
        k = r % len(items)
        yield items[k:] + items[:k]


def _check(fns: dict, rounds: int, warmup: int, calls: int) -> None:
    if not fns:
        raise ValueError("nothing to time: fns is empty")
    if rounds < 1 or warmup < 0 or calls < 1:
        raise ValueError(f"need rounds >= 1, warmup >= 0 and calls >= 1; got rounds={rounds}, warmup={warmup}, "
                         f"calls={calls}")


def _rounds(sample: Callable[[str], float], names: Iterable[str], rounds: int, warmup: int) -> dict[str, list[float]]:
    """``warmup`` untimed samples of each name, then one sample per name per round, in
    rotated order: the loop both clocks share."""
    names = list(names)
    for name in names:
        for _ in range(warmup):
            sample(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for order in rotations(names, rounds):
        for name in order:
            samples[name].append(sample(name))
    return samples


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, *, warmup: int = 1, calls: int = 1,
                setup: Callable[[str], object] | None = None,
                inside: Callable[[str], contextlib.AbstractContextManager] | None = None,
                timer: Callable[[], float] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn: one sample per fn per round, the fns in rotated order,
    after ``warmup`` untimed samples of each. A sample is ``calls`` calls in a row (the
    steps per sample: a sample's time divided by ``calls``, so every sample is per call
    whatever ``calls`` is).

    ``setup(name)`` runs untimed before each sample (e.g. refilling gradients);
    ``inside(name)`` gives a context each sample runs in, entered and left off the clock
    (e.g. an autocast region around a loop of tiny ops). ``timer``: the clock (default
    wall time, ``time.perf_counter``; ``time.thread_time`` counts this thread's CPU time
    only, what host overhead is on a shared machine). Returns name -> one sample per round.

    Example::

        s = interleaved({"native": lambda: x.add(y), "ours": lambda: x.mul(y)}, rounds=5, calls=1000)
        statistics.median(s["ours"]) * 1e6   # microseconds per call
    """
    _check(fns, rounds, warmup, calls)
    now = clock if timer is None else timer

    def sample(name: str) -> float:
        fn = fns[name]
        if setup is not None:
            setup(name)
        with inside(name) if inside is not None else contextlib.nullcontext():
            start = now()
            for _ in range(calls):
                fn()
            return (now() - start) / calls

    return _rounds(sample, fns, rounds, warmup)


def interleaved_events(fns: dict[str, Callable[[], object]], rounds: int, *, warmup: int = 1,
                       calls: int = 1) -> dict[str, list[float]]:
    """CUDA only: device seconds per call of each fn, from CUDA events around ``calls`` calls
    per sample, in the same rotation as ``interleaved``.

    Example::

        s = interleaved_events({"copy": lambda: dst.copy_(src), "ours": unscale}, rounds=21, calls=5)
    """
    _check(fns, rounds, warmup, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(name: str) -> float:
        fn = fns[name]
        torch.cuda.synchronize()  # nothing queued before the start event
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    return _rounds(sample, fns, rounds, warmup)


def once(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn``, on ``interleaved``'s clock (the accelerator
    synchronized before and after): a first call that compiles, an op right after a backward.

    Example::

        compile_s = once(compiled_step)
    """
    start = clock()
    fn()
    return clock() - start


def bootstrap_interval(rounds: list, statistic: Callable[[list], float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over ``rounds``: ``resamples`` times,
    as many rounds drawn with replacement as there are, ``statistic`` of the draw; the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those values. A
    round is one item, whatever it holds (a pair of samples stays a pair). Deterministic:
    ``random.Random(seed)``.

    Example::

        bootstrap_interval([1.0, 1.2, 0.9, 1.1, 1.0], statistics.median)   # (0.9, 1.2)
    """
    if not rounds:
        raise ValueError("need at least one round to bootstrap; got none")
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"need resamples >= 1 and 0 < confidence < 1; got resamples={resamples}, "
                         f"confidence={confidence}")
    rng = random.Random(seed)
    n = len(rounds)
    values = sorted(statistic(rng.choices(rounds, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2

    def quantile(q: float) -> float:  # linear interpolation between order statistics
        pos = q * (len(values) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    return quantile(tail), quantile(1 - tail)


def _median_of_ratios(pairs: list) -> float:
    return statistics.median(a / b for a, b in pairs)


def _ratio_of_medians(pairs: list) -> float:
    return statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)


def ratio_stats(num: list[float], den: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """Both estimators of ``num / den`` from paired samples (round i of each side ran in
    the same round), each with its percentile-bootstrap 95% interval over the rounds
    (a round's two samples resampled together):

    - ``ratio`` (``ratio_lo``, ``ratio_hi``): the median of the per-round ratios;
      ``ratio_min`` and ``ratio_max`` their range;
    - ``ratio_of_medians`` (``ratio_of_medians_lo``, ``ratio_of_medians_hi``): median of
      ``num`` over median of ``den``.

    Example::

        st = ratio_stats([1.1, 1.2, 1.0], [1.0, 1.0, 1.0])
        st["ratio"], st["ratio_min"], st["ratio_max"]   # 1.1, 1.0, 1.2
        st["ratio_of_medians"]                          # 1.1
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"need the same number of samples on both sides, at least one; got {len(num)} and {len(den)}")
    pairs = list(zip(num, den))
    r = [a / b for a, b in pairs]
    lo, hi = bootstrap_interval(pairs, _median_of_ratios, resamples=resamples, seed=seed)
    rom_lo, rom_hi = bootstrap_interval(pairs, _ratio_of_medians, resamples=resamples, seed=seed)
    return {"ratio": statistics.median(r), "ratio_lo": lo, "ratio_hi": hi, "ratio_min": min(r), "ratio_max": max(r),
            "ratio_of_medians": _ratio_of_medians(pairs), "ratio_of_medians_lo": rom_lo, "ratio_of_medians_hi": rom_hi}


def prefixed(stats: dict, prefix: str) -> dict:
    """``stats`` with every key prefixed, for several ratios in one row.

    Example::

        row.update(prefixed(ratio_stats(ours, native), "step_"))   # step_ratio, step_ratio_lo, ...
    """
    return {prefix + k: v for k, v in stats.items()}
