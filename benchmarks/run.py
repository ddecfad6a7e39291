"""Run the dispatch-amp benchmark suites: Markdown tables on stdout, CSV under benchmarks/results/.

Usage (from the repository root)::

    python -m benchmarks [--quick] [--device cpu|cuda] [--suite NAME ...] [--no-save | --out DIR]
    python benchmarks/run.py [same options]

Suites: train-step, dispatch-overhead, host-cost, scaler, kernels, compile, fp8 (see benchmarks/suites/). ``--quick``
runs every suite on tiny sizes in under a minute (CI runs it as a smoke test: it checks
that the suites run, never their numbers). Results go to
``benchmarks/results/<machine>/<suite>.csv`` (``<suite>.quick.csv`` with ``--quick``),
where ``<machine>`` is e.g. ``cpu-x86_64-2t`` (``cuda-nvidia-h100-80gb-hbm3`` with ``--device cuda``).

``--device cuda`` (default ``cpu``) measures on the GPU: float16 autocast (bfloat16 where a
suite is bf16-only), the scalers on "cuda", every timed sample between
``torch.cuda.synchronize()`` calls (CUDA events for the unscale kernel), peak memory from
``torch.cuda.max_memory_allocated``; sizes for an H100 (GPT-2 small, ResNet-50, ~1 GB of
gradients), the whole run in about six minutes there, compilation included. Each table is
printed as soon as it is measured, so a run cut short still leaves what it finished. A
suite that fails prints its traceback and the others still run; the exit status is then 1.

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
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.suites import common, compile, dispatch_overhead, fp8, host_cost, kernels_static, scaler, train_step  # noqa: E402
from dispatch_amp._devices import device_available  # noqa: E402

SUITES = {m.NAME: m for m in (train_step, dispatch_overhead, host_cost, scaler, kernels_static, compile, fp8)}
RESULTS = Path(__file__).resolve().parent / "results"


def machine_slug(device: str = "cpu") -> str:
    """``cpu-<arch>-<threads>t``, or ``cuda-<device name>`` for ``--device cuda``."""
    if device == "cuda":
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return f"cpu-{platform.machine().lower()}-{torch.get_num_threads()}t"


def describe_machine(device: str) -> str:
    """One line: the host (and with ``--device cuda`` the GPU, its CUDA and driver), torch, triton, python."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    host = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        try:  # the driver's CUDA API version, e.g. 13000 -> 13.0 (nvidia-smi gives the driver's own)
            v = torch._C._cuda_getDriverVersion()
            driver = f", driver API {v // 1000}.{v % 1000 // 10}"
        except Exception:  # noqa: BLE001 - information only
            driver = ""
        host = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
                f"CUDA {torch.version.cuda}{driver}; host {host}")
    return (f"machine: {machine_slug(device)} ({host}), torch {torch.__version__}, triton {triton_version}, "
            f"python {platform.python_version()}")


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
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where to measure (default cpu); cuda: float16 autocast on the GPU, sized for an H100")
    ap.add_argument("--suite", action="append", choices=list(SUITES), help="run only this suite (repeatable)")
    ap.add_argument("--no-save", action="store_true", help="print only, write no CSV")
    ap.add_argument("--out", type=Path, help="CSV folder (default benchmarks/results/<machine>)")
    ap.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)  # suite-internal subprocesses
    opts = ap.parse_args(argv)
    if opts.device == "cuda" and not device_available("cuda"):
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        ap.error(f"--device cuda: no CUDA GPU is available here (torch {torch.__version__}, {build}; "
                 "torch.accelerator finds no CUDA device). Run without --device (CPU) or on a machine with a GPU.")

    if opts.child:
        SUITES[opts.child[0]].child(opts.child[1:], opts)
        return

    common.SMOKE_TEST = opts.quick
    slug = machine_slug(opts.device)
    out = opts.out or RESULTS / slug
    names = opts.suite or list(SUITES)
    meta = {"machine": slug, "device": opts.device, "torch": torch.__version__, "quick": opts.quick,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
    print(f"# dispatch-amp benchmarks{' [quick]' if opts.quick else ''}{' on CUDA' if opts.device == 'cuda' else ''}\n")
    print(describe_machine(opts.device) + "\n", flush=True)
    t_all = time.perf_counter()
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"## {name}\n", flush=True)
        tables = []
        try:
            for t in SUITES[name].run(opts):  # each table printed as soon as the suite yields it
                tables.append(t)
                print(t.markdown() + "\n", flush=True)
        except Exception:  # noqa: BLE001 - the other suites still run; the exit status says it
            failed.append(name)
            print(f"### {name}: FAILED\n\n```\n{traceback.format_exc()}```\n", flush=True)
        finally:
            _release(opts.device)
        print(f"({name}: {time.perf_counter() - t0:.1f} s)\n", flush=True)
        if not opts.no_save:
            path = out / f"{name}{'.quick' if opts.quick else ''}.csv"
            write_csv(path, tables, meta)
            if tables:
                print(f"wrote {path}\n")
    print(f"(total {time.perf_counter() - t_all:.1f} s)", flush=True)
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def _release(device: str) -> None:
    """Between suites: compiled graphs and, on CUDA, cached GPU memory are dropped."""
    import gc

    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
