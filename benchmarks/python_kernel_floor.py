"""What torch charges for a Python kernel at the autocast level, with no engine in it.

The engine's casts run in Python kernels that ``torch.library`` registers at the
``AutocastPrivateUse1`` dispatch key (docs/design.md). This script measures the part of
their cost that no change to the engine can remove: it registers, at that key, for every
overload native CPU autocast registers (the ops the engine's kernels cover under the
built-in CPU policy), a kernel that does the least any kernel must do: enter Python, then
hand the call on below the key (native autocast then casts in C++, as it does without us).
The added time per forward of that trivial kernel, against native alone, is the floor of
a Python kernel per cast call; ``python -m benchmarks --suite host-cost`` gives the
engine's own added time on the same models.

    python -m benchmarks.python_kernel_floor            # 41 interleaved rounds
    python -m benchmarks.python_kernel_floor --rounds 5 # a quick look

Rows: each host-cost model, with the kernel registered as the engine registers it (given
the call's dispatch keys, ``with_keyset=True``) and without them. Run it in a process of
its own: it takes the key for its trivial kernels, so no ``dispatch_amp.autocast`` region
may open in the same process (it refuses if one has).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch._C import DispatchKey, DispatchKeySet

from benchmarks.suites.common import Table
from benchmarks.suites.host_cost import MODELS, _loss
from benchmarks.timing import interleaved
from dispatch_amp import _torch_compat
from dispatch_amp.autocast import _dispatch_key

__all__ = ["floor_table", "main"]

_KEY = DispatchKey.AutocastPrivateUse1
_KEY_NAME = "AutocastPrivateUse1"
_OURS = DispatchKeySet(_KEY)
_ExcludeKeys = torch._C._ExcludeDispatchKeyGuard


class _TrivialKernels:
    """Trivial kernels at our key for native CPU autocast's overloads, counting their
    calls; ``on()`` switches the key on for this thread (as a region of ours does)."""

    def __init__(self, with_keyset: bool):
        if _dispatch_key.registered_count():
            raise RuntimeError(
                "dispatch_amp's engine has registered its kernels in this process, so the key is "
                "taken: run `python -m benchmarks.python_kernel_floor` in a process of its own."
            )
        self.calls = 0
        self._libraries = {}
        self._fallback = torch.library.Library("_", "IMPL")
        self._fallback.fallback(torch.library.fallthrough_kernel, _KEY_NAME)
        for name in _torch_compat.autocast_registration_overloads("AutocastCPU"):
            op = _torch_compat.overload_by_name(name)
            if op is None:
                continue
            library = self._libraries.get(op.namespace)
            if library is None:
                library = self._libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
            overload = name.split("::", 1)[1]
            library.impl(overload, self._kernel(op, with_keyset), _KEY_NAME, with_keyset=with_keyset)

    def _kernel(self, op, with_keyset: bool):
        counter = self

        if with_keyset:
            def kernel(keyset, *args, **kwargs):
                counter.calls += 1
                with _ExcludeKeys(_OURS):
                    return op._op(*args, **kwargs)
        else:
            def kernel(*args, **kwargs):
                counter.calls += 1
                with _ExcludeKeys(_OURS):
                    return op._op(*args, **kwargs)
        return kernel

    @staticmethod
    def switch(on: bool) -> None:
        _torch_compat.set_dispatch_key_excluded(_KEY, not on)
        _torch_compat.set_dispatch_key_included(_KEY, on)

    def close(self) -> None:
        self.switch(False)
        for library in (*self._libraries.values(), self._fallback):
            library._destroy()


class _KeyOn:
    def __enter__(self):
        _TrivialKernels.switch(True)

    def __exit__(self, *exc):
        _TrivialKernels.switch(False)


def _forward(model, batch):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(model, batch)
    return run


def floor_table(rounds: int = 41, calls: int = 5) -> Table:
    """The floor per model and registration form (see the module docstring)."""
    table = Table(
        f"python kernel floor: a trivial Python kernel at our key per call native CPU autocast "
        f"handles (ms per forward+loss, CPU bfloat16; {rounds} interleaved rounds of {calls} calls, medians)",
        [("model", "model", "{}"), ("form", "registered", "{}"), ("native_ms", "native", "{:.3f}"),
         ("floor_ms", "with trivial kernels", "{:.3f}"), ("added_ms", "added", "{:+.3f}"),
         ("kernel_calls", "kernel calls per fwd", "{}"), ("us_per_call", "added per call (us)", "{:.1f}")],
        note="added: median of per-round differences. A trivial kernel enters Python and hands the call on "
             "below our key; native autocast's casts run in C++ in both columns.",
    )
    for with_keyset in (True, False):
        kernels = _TrivialKernels(with_keyset)
        try:
            for name, make in MODELS.items():
                model, batch = make()
                fn = _forward(model, batch)
                samples = interleaved({"native": fn, "floor": fn}, rounds, calls=calls,
                                      inside=lambda n: _KeyOn() if n == "floor" else contextlib.nullcontext())
                kernels.calls = 0
                with _KeyOn():
                    fn()
                per_fwd = kernels.calls
                added = statistics.median(b - a for a, b in zip(samples["native"], samples["floor"])) * 1e3
                table.rows.append({
                    "model": name, "form": "with keyset (as the engine)" if with_keyset else "without keyset",
                    "native_ms": statistics.median(samples["native"]) * 1e3,
                    "floor_ms": statistics.median(samples["floor"]) * 1e3,
                    "added_ms": added, "kernel_calls": per_fwd,
                    "us_per_call": added / per_fwd * 1e3 if per_fwd else float("nan"),
                })
        finally:
            kernels.close()
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=5)
    opts = parser.parse_args(argv)
    print(floor_table(opts.rounds, opts.calls).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
