"""Peak resident memory (RSS) of this process since a reset: the one place it is read, for
the demo's table and the benchmarks' memory processes.

On Linux, writing ``5`` to ``/proc/self/clear_refs`` restarts the kernel's high-water mark
(``VmHWM`` in ``/proc/self/status``) at the current RSS, so the peak read afterwards is
that of the work since, not of the imports before it. ``resource.getrusage``'s
``ru_maxrss`` is not that number on Linux: the kernel folds into it the peak of the
process that started this one (taken over at ``exec``) and of threads that have exited,
and no reset restarts either. A child started by a parent holding 1.5 GB reports an
``ru_maxrss`` of 1.5 GB and a ``VmHWM`` of 13 MB. So on Linux the peak comes from
``/proc/self/status``; elsewhere (macOS) from ``ru_maxrss``, which cannot be reset, and
where neither exists (Windows) it is NaN.

Example::

    >>> import gc
    >>> _ = gc.collect()                  # garbage freed now would lower RSS in the middle
    >>> reset = reset_peak_rss()          # True on Linux
    >>> before = peak_rss_mb()            # right after a reset: the current RSS
    >>> block = b"x" * (64 * 2**20)      # 64 MiB, written
    >>> peak_rss_mb() - before > 48 or not reset
    True

RSS counts the pages of loaded libraries too, which the kernel may drop from a process
under memory pressure: the 64 MiB block shows in full, less what was dropped since the
reset (hence the example's margin).
"""

from __future__ import annotations

import math
import sys

__all__ = ["reset_peak_rss", "peak_rss_mb"]

_STATUS = "/proc/self/status"


def reset_peak_rss() -> bool:
    """Restarts the peak at the current RSS (Linux); False where that is not possible, the
    peak then stays the whole process's.

    Example::

        >>> isinstance(reset_peak_rss(), bool)
        True
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """The peak RSS in MiB since the last ``reset_peak_rss`` (or the process start), NaN
    where the system reports none.

    Example::

        >>> peak_rss_mb() > 0
        True
    """
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB elsewhere
