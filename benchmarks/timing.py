"""How every benchmark here times: the one implementation of docs/design.md, "Performance method".

The functions under comparison (ours, native, fp32, ...) run in the same process,
interleaved: each round runs every one once, in rotated order (A B C, then B C A, ...),
so none is always first or always after the same other one, and load on the machine
slows them alike. Each gets untimed warm-up samples first. A sample is ``calls`` calls
between two readings of ``torch.utils.benchmark``'s clock, which synchronizes the
accelerator (``torch.accelerator``) before each reading when there is one: a GPU's queued
work is inside the sample that queued it. Reported are medians and, for ratios, the median
of per-round ratios (``ratio_stats``): a round's samples ran under the same conditions.

``interleaved_events`` is the same loop on the device's own clock (CUDA events around the
calls), for kernels whose host time is not theirs; ``once`` times a single call on the
same clock as ``interleaved`` (a first, compiling call).

Example::

    samples = interleaved({"native": native_step, "ours": ours_step}, rounds=21, warmup=2)
    ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    ratio_stats(samples["ours"], samples["native"])["ratio"]   # median of per-round ours/native
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.benchmark import timer as clock

__all__ = ["rotations", "interleaved", "interleaved_events", "once", "ratio_stats"]


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
                inside: Callable[[str], contextlib.AbstractContextManager] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn: one sample per fn per round, the fns in rotated order,
    after ``warmup`` untimed samples of each. A sample is ``calls`` calls in a row.

    ``setup(name)`` runs untimed before each sample (e.g. refilling gradients);
    ``inside(name)`` gives a context each sample runs in, entered and left off the clock
    (e.g. an autocast region around a loop of tiny ops). Returns name -> one sample per
    round.

    Example::

        s = interleaved({"native": lambda: x.add(y), "ours": lambda: x.mul(y)}, rounds=5, calls=1000)
        statistics.median(s["ours"]) * 1e6   # microseconds per call
    """
    _check(fns, rounds, warmup, calls)

    def sample(name: str) -> float:
        fn = fns[name]
        if setup is not None:
            setup(name)
        with inside(name) if inside is not None else contextlib.nullcontext():
            start = clock()
            for _ in range(calls):
                fn()
            return (clock() - start) / calls

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


def ratio_stats(num: list[float], den: list[float]) -> dict[str, float]:
    """Median, min and max of the per-round ratios ``num / den`` (samples of one round side
    by side).

    Example::

        ratio_stats([1.1, 1.2, 1.0], [1.0, 1.0, 1.0])   # {'ratio': 1.1, 'ratio_min': 1.0, 'ratio_max': 1.2}
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"need the same number of samples on both sides, at least one; got {len(num)} and {len(den)}")
    r = [a / b for a, b in zip(num, den)]
    return {"ratio": statistics.median(r), "ratio_min": min(r), "ratio_max": max(r)}
