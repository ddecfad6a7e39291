"""The train part's eager step on the engines this process did not run: one child process each.

The engine is chosen once per process (``DISPATCH_AMP_ENGINE``, read at the first region)
and the compiled engine registers process-wide kernels, so the other engine's numbers come
from a child process of their own (the Python engine; the compiled engine with weight casts
batched per region): GPT-2 small and ResNet-50 (the train part's models, its
sizes and sampling), native against ours, the plain eager step only. The parent turns the
child's per-round samples into the same table as the train part's, both estimators and
bootstrap intervals, with no target: the targets are the default engine's. On torch before
2.13, which batches no weight casts, the batched variant is not run: its table says so.

    python -m benchmarks.check.engine_variants --dry-run --steps-per-sample 2   # the child

The child prints one JSON line per model: ``{"model", "engine", "native", "ours"}`` (seconds
per call, one per round) or ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.suites import train_step
from benchmarks.suites.common import batched_casts_unavailable, free_device_memory, no_tf32, ratio_columns
from benchmarks.suites.common import Table
from benchmarks.timing import interleaved, ratio_stats

from .settings import Settings

MODELS = ("gpt", "cnn")
SHORT = {"gpt": "GPT-2 small", "cnn": "ResNet-50"}
#: (label, environment): the engines the default one is measured against. Batched weight
#: casts are off by default until a GPU run shows they pay (docs/design.md).
VARIANTS = (("Python engine", {"DISPATCH_AMP_ENGINE": "python"}),
            ("compiled engine with weight casts batched", {"DISPATCH_AMP_ENGINE": "compiled",
                                                           "DISPATCH_AMP_BATCH_CASTS": "1"}))
CHILD_TIMEOUT_S = 240


def _child(s: Settings) -> None:
    import dispatch_amp

    if s.dry_run:  # as the parent (benchmarks.check): one thread on a loaded 2-core machine
        torch.set_num_threads(1)
    device = s.device
    benchmark_mode = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        for name in MODELS:
            with no_tf32():
                desc, base, batch = train_step.gpu_case(name, s.tiny, device)
                base.train()
                fns = {c: train_step.make_step(copy.deepcopy(base), batch, c, device) for c in ("native", "ours")}
                del base
                k = s.steps_per_sample
                samples = interleaved(fns, s.step_rounds, warmup=1 if k > 1 else 2, calls=k)
                del fns
                free_device_memory(device)
            print(json.dumps({"model": name, "desc": desc, "engine": dispatch_amp.engine(),
                              "native": samples["native"], "ours": samples["ours"]}), flush=True)
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode


def _run_child(s: Settings, env: dict) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "benchmarks.check.engine_variants", "--steps-per-sample", str(s.steps_per_sample)]
    cmd += ["--dry-run"] if s.dry_run else (["--quick"] if s.quick else [])
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(cmd, cwd=root, env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"the child ran past {CHILD_TIMEOUT_S} s"
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    error = "" if out.returncode == 0 else ((out.stderr.strip().splitlines() or ["failed"])[-1])
    return rows, error


def section(s: Settings):
    """Per variant: a table of GPT-2 small's and ResNet-50's eager step, native and ours,
    with ours on that variant's engine."""
    for label, env in VARIANTS:
        unavailable = batched_casts_unavailable() if env.get("DISPATCH_AMP_BATCH_CASTS") == "1" else None
        if unavailable:
            # The child would time the per-use casts under this label: say so instead of a row.
            yield Table(f"train: eager step with ours on the {label}: not measured", [("model", "model", "{}")],
                        note=f"Not measured: {unavailable}.")
            continue
        rows, error = _run_child(s, env)
        table = Table(
            f"train: eager step with ours on the {label} (a process of its own), ms per call"
            + (" (tiny sizes: a smoke test, not a measurement)" if s.tiny else ""),
            [("model", "model", "{}"), ("engine", "engine", "{}"), ("native_ms", "native", "{:.2f}"),
             ("ours_ms", "ours", "{:.2f}"), *ratio_columns()],
            note=f"Environment {env}; median of {s.step_rounds} interleaved rounds, each sample "
                 f"{s.steps_per_sample} calls. No target: the default engine's rows above carry them."
                 + (f" The child failed: {error}" if error else ""),
        )
        for r in rows:
            st = ratio_stats(r["ours"], r["native"])
            table.rows.append({"model": r["desc"], "engine": r["engine"],
                               "native_ms": statistics.median(r["native"]) * 1e3,
                               "ours_ms": statistics.median(r["ours"]) * 1e3, **st})
        yield table
        if error or len(rows) != len(MODELS):
            raise RuntimeError(f"the {label} child measured {len(rows)} of {len(MODELS)} models: "
                               f"{error or 'no error printed'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps-per-sample", type=int, default=None)
    args = p.parse_args(argv)
    _child(Settings(dry_run=args.dry_run, quick=args.quick, logs=Path("."), steps=args.steps_per_sample))
    return 0


if __name__ == "__main__":
    sys.exit(main())
