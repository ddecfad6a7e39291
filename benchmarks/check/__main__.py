"""``python -m benchmarks.check PART --out DIR [--logs DIR] [--dry-run] [--quick] [--steps-per-sample N]``; see benchmarks/check/__init__.py.

Also ``python -m benchmarks.check targets DIR [PART ...]`` (the targets table of the parts
found in DIR) and ``python -m benchmarks.check environment`` (the report's machine lines).

Exit status of a part: 0 every section ran; 1 a section failed (its traceback is in the
output, the other sections still ran); 2 a usage error or no GPU without ``--dry-run``;
130 interrupted (SIGINT: the script's time budget), after writing what was finished.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.run import write_csv
from benchmarks.suites import common
from dispatch_amp._devices import device_available

from . import environment
from .settings import Settings
from .targets import Target, read_targets, targets_table, write_targets

PARTS = {"train": "train", "profile": "host_profile", "fp8": "fp8", "scaler": "scaler"}


def _release(s: Settings) -> None:
    """Between sections: compiled graphs and cached device memory are dropped."""
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _engine() -> str:
    """The engine that ran (``dispatch_amp.engine()``; "python" where there is no choice)."""
    import dispatch_amp

    engine = getattr(dispatch_amp, "engine", None)
    return engine() if callable(engine) else "python"


def run_part(name: str, s: Settings, out: Path) -> int:
    """Runs part ``name``'s sections in order, printing each table as it comes; writes
    ``out/NAME.csv`` and ``out/NAME.targets.csv`` with whatever finished. Returns the exit
    status (see the module's docstring)."""
    module = importlib.import_module(f"benchmarks.check.{PARTS[name]}")
    common.SMOKE_TEST = s.tiny
    if s.dry_run:  # a loaded 2-core machine: one thread avoids OpenMP's spinning threads
        torch.set_num_threads(1)
    tables, targets, failed = [], [], []
    status = 0
    t_part = time.perf_counter()
    current = "setup"
    try:
        for current, section in module.sections(s):
            t0 = time.perf_counter()
            try:
                for item in section():
                    if isinstance(item, Target):
                        targets.append(item)
                    else:
                        tables.append(item)
                        print(item.markdown() + "\n", flush=True)
            except Exception:  # noqa: BLE001 - the other sections still run; the exit status says it
                failed.append(current)
                print(f"### {name}: {current}: FAILED\n\n```\n{traceback.format_exc()}```\n", flush=True)
            finally:
                _release(s)
            print(f"({name}: {current} in {time.perf_counter() - t0:.1f} s)\n", flush=True)
    except KeyboardInterrupt:
        print(f"### {name}: interrupted during {current} (the time budget ran out); the tables above are "
              "those finished\n", flush=True)
        status = 130
    finally:
        meta = {"part": name, "device": s.device.type, "torch": torch.__version__, "dry_run": s.dry_run,
                "quick": s.quick, "steps_per_sample": s.steps_per_sample, "engine": _engine(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
        write_csv(out / f"{name}.csv", tables, meta)
        write_targets(out / f"{name}.targets.csv", targets)
    print(f"({name}: {time.perf_counter() - t_part:.1f} s in all)", flush=True)
    if status == 0 and failed:
        print(f"failed sections of {name}: {', '.join(failed)}", file=sys.stderr)
        status = 1
    return status


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["targets"]:
        ap = argparse.ArgumentParser(prog="python -m benchmarks.check targets")
        ap.add_argument("folder", type=Path)
        ap.add_argument("parts", nargs="*", default=list(PARTS))
        opts = ap.parse_args(argv[1:])
        rows = read_targets(opts.folder, opts.parts)
        print(targets_table(rows).markdown() if rows else "(no targets: the parts that ran measure none)")
        return 0
    if argv[:1] == ["environment"]:
        print("\n".join(environment.lines()))
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check", description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=list(PARTS))
    ap.add_argument("--out", type=Path, required=True, help="folder for PART.csv and PART.targets.csv")
    ap.add_argument("--logs", type=Path, help="folder for the part's longer logs (default: --out)")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, tiny sizes: the code paths, no measurement")
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the GPU: a smoke test")
    ap.add_argument("--steps-per-sample", type=int, metavar="N",
                    help="training steps per timed sample (default 5 on the GPU, 2 at tiny sizes)")
    opts = ap.parse_args(argv)
    if opts.steps_per_sample is not None and opts.steps_per_sample < 1:
        ap.error(f"--steps-per-sample must be at least 1; got {opts.steps_per_sample}")
    if not opts.dry_run and not device_available("cuda"):
        ap.error(f"no CUDA GPU is visible to torch here (torch {torch.__version__}); "
                 "run with --dry-run for the CPU rehearsal")
    opts.out.mkdir(parents=True, exist_ok=True)
    logs = opts.logs or opts.out
    logs.mkdir(parents=True, exist_ok=True)
    return run_part(opts.part, Settings(dry_run=opts.dry_run, quick=opts.quick, logs=logs,
                                            steps=opts.steps_per_sample), opts.out)


if __name__ == "__main__":
    sys.exit(main())
