"""Both engines against native, on this CPU: what each adds to a host-bound step.

    python -m benchmarks.engines [--rounds 15] [--models gpt2,resnet50,mlp] [--no-batched]

Each engine runs in a process of its own (``DISPATCH_AMP_ENGINE`` is read once per
process), against native ``torch.autocast`` in that same process, interleaved, on the
trivial-width models of the host-cost suite (``benchmarks/suites/host_cost.py``): the
added milliseconds per forward + loss, and ours/native for the forward, the training
step, the 4-micro-batch accumulation step (plain and inside ``cast_cache()``) and an eval
loop of 8 forwards inside ``cast_cache()``. Ratios are printed by both estimators with
their bootstrap intervals (``timing.ratio_stats``). The compiled engine's process
measures it twice, interleaved in the same rounds so that the two compare under the same
load: ``compiled, unbatched`` (each weight cast at its use, the default) and ``compiled,
batched`` (``DISPATCH_AMP_BATCH_CASTS=1``: weight casts batched per region; on torch
before 2.13, which batches nothing, its row says "not measured" and why).

The clock is this thread's CPU time (``time.thread_time``), with torch on one thread: on
CPU the whole step runs on the calling thread, and other processes on a shared machine
do not count, as they do on a wall clock. This measures host cost, what a host-bound GPU
step pays; it is not a GPU timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {"gpt2": "GPT-2 structure", "resnet50": "ResNet-50 structure", "mlp": "MLP 24 x 64"}


def _batching(on: bool):
    """A wrapper running ``fn`` with the compiled engine's weight casts batched (``on``) or
    one by one."""
    from dispatch_amp.autocast import _compiled_engine

    def wrap(fn):
        def run():
            before = _compiled_engine.set_batching(on)
            try:
                fn()
            finally:
                _compiled_engine.set_batching(before)
        return run
    return wrap


def _measure(models: list[str], rounds: int, both: bool) -> list[dict]:
    """Rows of ours against native; under the compiled engine with ``both``, one row with
    its weight casts batched and one without, interleaved in the same rounds (same
    process, same load)."""
    import torch

    import dispatch_amp
    from benchmarks.suites import host_cost as hc
    from benchmarks.suites.common import batched_casts_unavailable
    from benchmarks.timing import interleaved, ratio_stats

    torch.set_num_threads(1)
    engine = dispatch_amp.engine()
    variants = {"ours": (engine, lambda fn: fn)}
    rows = []
    if both and engine == "compiled":
        variants = {"ours": ("compiled, unbatched", _batching(False))}
        unavailable = batched_casts_unavailable()
        if unavailable:  # a "batched" row would time the per-use casts again under that name
            rows.append({"engine": "compiled, batched", "error": unavailable})
        else:
            variants["batched"] = ("compiled, batched", _batching(True))

    def ms(fns, calls):
        return {k: [t * 1e3 for t in v] for k, v in interleaved(fns, rounds, calls=calls, timer=time.thread_time).items()}

    def ours(make):
        return {v: wrap(make()) for v, (_, wrap) in variants.items()}

    for key in models:
        name = MODELS[key]
        model, batch = hc.MODELS[name]()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        f = ms({"native": hc._forward(model, batch, "native"), **ours(lambda: hc._forward(model, batch, "ours"))}, 5)
        s = ms({"native": hc._step(model, batch, "native", opt), **ours(lambda: hc._step(model, batch, "ours", opt))}, 3)
        if key == "gpt2":
            batches = [batch] * 4
            a = ms({"native": hc._accumulate(model, batches, "native", opt, False),
                    **ours(lambda: hc._accumulate(model, batches, "ours", opt, False)),
                    **{f"keep-{v}": t for v, t in ours(lambda: hc._accumulate(model, batches, "ours", opt, True)).items()}}, 1)
            e = ms({"native": hc._eval_loop(model, [batch] * 8, "native", False),
                    **{f"keep-{v}": t for v, t in ours(lambda: hc._eval_loop(model, [batch] * 8, "ours", True)).items()}}, 1)
        for v, (label, _) in variants.items():
            row = {"engine": label, "model": name, "native_forward_ms": statistics.median(f["native"]),
                   "added_ms": statistics.median([o - n for o, n in zip(f[v], f["native"])]),
                   "forward": ratio_stats(f[v], f["native"]), "step": ratio_stats(s[v], s["native"])}
            if key == "gpt2":
                row["accumulate"] = ratio_stats(a[v], a["native"])
                row["accumulate_cast_cache"] = ratio_stats(a[f"keep-{v}"], a["native"])
                row["eval_cast_cache"] = ratio_stats(e[f"keep-{v}"], e["native"])
            rows.append(row)
    return rows


def _cell(st: dict | None) -> str:
    if st is None:
        return ""
    return (f"{st['ratio']:.3f} [{st['ratio_lo']:.3f}, {st['ratio_hi']:.3f}] / "
            f"{st['ratio_of_medians']:.3f} [{st['ratio_of_medians_lo']:.3f}, {st['ratio_of_medians_hi']:.3f}]")


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows of both engines."""
    head = ("| engine | model | native fwd ms | added per fwd | forward | step | accumulation | "
            "accumulation, cast_cache | eval loop, cast_cache |\n|---|---|---:|---:|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | not measured: {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['engine']} | {r['model']} | {r['native_forward_ms']:.3f} | {r['added_ms']:+.3f} ms | "
            f"{_cell(r['forward'])} | {_cell(r['step'])} | {_cell(r.get('accumulate'))} | "
            f"{_cell(r.get('accumulate_cast_cache'))} | {_cell(r.get('eval_cast_cache'))} |")
    return "\n".join(lines) + ("\n\nRatios ours/native: median of per-round ratios [95%] / ratio of medians "
                               "[95%]; thread CPU time, torch on one thread.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--models", default="gpt2,resnet50,mlp", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--no-batched", action="store_true",
                   help="the compiled engine as configured only (no batched/unbatched pair)")
    p.add_argument("--child", choices=["python", "compiled"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    if args.child:
        print(json.dumps(_measure(models, args.rounds, not args.no_batched)))
        return 0
    rows = []
    for engine in ("compiled", "python"):
        env = {**os.environ, "DISPATCH_AMP_ENGINE": engine}
        cmd = [sys.executable, "-m", "benchmarks.engines", "--child", engine, "--rounds", str(args.rounds),
               "--models", ",".join(models)] + (["--no-batched"] if args.no_batched else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({"engine": engine, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]})
            continue
        rows.extend(json.loads(out.stdout.strip().splitlines()[-1]))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
