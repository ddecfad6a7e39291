"""Run the dispatch-amp benchmark suites: Markdown tables on stdout, CSV under benchmarks/results/.

Usage (from the repository root)::

    python -m benchmarks [--quick] [--suite NAME ...] [--no-save | --out DIR]
    python benchmarks/run.py [same options]

Suites: train-step, dispatch-overhead, scaler, kernels, compile, fp8 (see benchmarks/suites/). ``--quick``
runs every suite on tiny sizes in under a minute (CI runs it as a smoke test: it checks
that the suites run, never their numbers). Results go to
``benchmarks/results/<machine>/<suite>.csv`` (``<suite>.quick.csv`` with ``--quick``),
where ``<machine>`` is e.g. ``cpu-x86_64-2t``.

Method (docs/design.md, "Performance method"): ours and native in the same process, interleaved
in rotating order after warm-up, medians and the median of per-round ratios; peak memory
in separate processes. Each table has a target column and a met/missed column, for
information: no number is asserted anywhere. With ``--quick`` the sizes are tiny and the
verdicts say "smoke test" instead: the quick run checks that the suites run, not numbers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.suites import common, compile, dispatch_overhead, fp8, kernels_static, scaler, train_step  # noqa: E402

SUITES = {m.NAME: m for m in (train_step, dispatch_overhead, scaler, kernels_static, compile, fp8)}
RESULTS = Path(__file__).resolve().parent / "results"


def machine_slug() -> str:
    """``cpu-<arch>-<threads>t``, or ``cuda-<device name>`` when a GPU is present."""
    if torch.cuda.is_available():
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return f"cpu-{platform.machine().lower()}-{torch.get_num_threads()}t"


def write_csv(path: Path, tables, meta: dict) -> None:
    rows = [{**meta, "table": t.title.split(":")[0] + ":" + str(i), **r} for i, t in enumerate(tables) for r in t.rows]
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: every suite in under a minute")
    ap.add_argument("--suite", action="append", choices=list(SUITES), help="run only this suite (repeatable)")
    ap.add_argument("--no-save", action="store_true", help="print only, write no CSV")
    ap.add_argument("--out", type=Path, help="CSV folder (default benchmarks/results/<machine>)")
    ap.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)  # suite-internal subprocesses
    opts = ap.parse_args(argv)

    if opts.child:
        SUITES[opts.child[0]].child(opts.child[1:], opts.quick)
        return

    common.SMOKE_TEST = opts.quick
    slug = machine_slug()
    out = opts.out or RESULTS / slug
    names = opts.suite or list(SUITES)
    meta = {"machine": slug, "torch": torch.__version__, "quick": opts.quick,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
    print(f"# dispatch-amp benchmarks{' [quick]' if opts.quick else ''}\n")
    print(f"machine: {slug} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, python {platform.python_version()}\n")
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        print(f"## {name}\n", flush=True)
        tables = SUITES[name].run(opts)
        for t in tables:
            print(t.markdown() + "\n", flush=True)
        print(f"({name}: {time.perf_counter() - t0:.1f} s)\n", flush=True)
        if not opts.no_save:
            path = out / f"{name}{'.quick' if opts.quick else ''}.csv"
            write_csv(path, tables, meta)
            print(f"wrote {path}\n")
    print(f"(total {time.perf_counter() - t_all:.1f} s)")


if __name__ == "__main__":
    main()
