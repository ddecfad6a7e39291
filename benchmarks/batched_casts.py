"""The compiled engine's batched weight casts against native: peak memory and gradient readiness.

    python -m benchmarks.batched_casts [--models gpt2,resnet50,mlp,gpt-d384]

For each model, native ``torch.autocast``, the compiled engine casting each weight at its
use (``set_batching(False)``) and the compiled engine batching its weight casts, in one
process:

- **peak memory**: the most bytes the CPU allocator held at once during one call, above
  what it held when the call began, from the profiler's allocation events (exact bytes,
  not RSS): a training step, a 4-micro-batch accumulation step (plain, and with ours
  inside ``cast_cache()``), and an eval loop of 4 forwards (ours inside ``cast_cache()``);
- **readiness**: for each weight, the share of the backward's nodes run when its gradient
  was accumulated (post-accumulate-grad hooks beside a pre-hook on every node: counts, not
  times), its median over the weights, and the largest shift from native's.

Needs the compiled engine (``DISPATCH_AMP_ENGINE`` unset or ``compiled``). On torch before
2.13 the engine batches nothing (docs/design.md, "Torch before 2.13"): the batched rows are
left out and a line under the table says why.
"""

from __future__ import annotations

import argparse
import statistics

MODELS = {"gpt2": "GPT-2 structure", "resnet50": "ResNet-50 structure", "mlp": "MLP 24 x 64",
          "gpt-d384": "GPT d384 x 4 blocks"}


def _gpt_d384():
    import torch

    from benchmarks.models import GPT, GPTConfig, gpt_batch

    cfg = GPTConfig(vocab=2048, d_model=384, n_heads=6, n_blocks=4, max_len=64)
    model = GPT(cfg)
    model.head.weight = model.tok.weight  # tied, as GPT-2's
    return model, gpt_batch(cfg, 2, 64, generator=torch.Generator().manual_seed(0))


def peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held during ``fn()`` above what it held at its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def readiness(model, batch, mode: str) -> dict[int, float]:
    """Per parameter index: the share of the backward's nodes run when its gradient was accumulated."""
    from benchmarks.suites import host_cost as hc

    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    ran, ready = [0], {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(index[id(p)], ran[0])) for p in params]
    with hc._region(mode):
        loss = hc._loss(model, batch)
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        hooks.append(node.register_prehook(lambda *_: ran.__setitem__(0, ran[0] + 1)))
        stack.extend(f for f, _ in node.next_functions)
    loss.backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return {i: step / ran[0] for i, step in ready.items()}


def measure(models: list[str]) -> list[dict]:
    import torch

    from benchmarks.suites import host_cost as hc
    from benchmarks.suites.common import batched_casts_unavailable
    from dispatch_amp.autocast import _compiled_engine

    if _compiled_engine.active() is None:
        raise SystemExit("benchmarks.batched_casts needs the compiled engine (DISPATCH_AMP_ENGINE is 'python', "
                         "or it could not be built): unset DISPATCH_AMP_ENGINE where a C++ toolchain is installed")
    torch.set_num_threads(1)
    makers = {**{MODELS[k]: hc.MODELS[MODELS[k]] for k in ("gpt2", "resnet50", "mlp")}, MODELS["gpt-d384"]: _gpt_d384}
    rows = []
    variants = [("native", "native", True), ("unbatched", "ours", False), ("batched", "ours", True)]
    if batched_casts_unavailable():  # the "batched" row would measure the unbatched path again
        variants.pop()
    before = _compiled_engine.set_batching(True)
    try:
        for key in models:
            model, batch = makers[MODELS[key]]()
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            row = {"model": MODELS[key]}
            for label, mode, batching in variants:
                _compiled_engine.set_batching(batching)
                ours = mode == "ours"
                calls = {"step": hc._step(model, batch, mode, opt),
                         "accumulate": hc._accumulate(model, [batch] * 4, mode, opt, False),
                         "accumulate_cast_cache": hc._accumulate(model, [batch] * 4, mode, opt, ours),
                         "eval_cast_cache": hc._eval_loop(model, [batch] * 4, mode, ours)}
                for fn in calls.values():  # warm: kernels registered, the plan made
                    fn()
                for name, fn in calls.items():
                    row[f"{label}_{name}"] = peak_bytes(fn)
                readiness(model, batch, mode)  # the plan, from a region like the measured one
                row[f"{label}_ready"] = readiness(model, batch, mode)
            rows.append(row)
    finally:
        _compiled_engine.set_batching(before)
    return rows


def table(rows: list[dict]) -> str:
    from benchmarks.suites.common import batched_casts_unavailable

    lines = ["### batched weight casts: peak memory (KiB above the call's start) and gradient readiness",
             "",
             "| model | | step | accumulation | accumulation, ours in cast_cache | eval loop, ours in cast_cache "
             "| readiness median | largest shift from native |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        native = r["native_ready"]
        for label in [k for k in ("native", "unbatched", "batched") if f"{k}_ready" in r]:
            ready = r[f"{label}_ready"]
            shift = max(abs(ready[i] - native[i]) for i in native) if set(ready) == set(native) else float("nan")
            cells = " | ".join(f"{r[f'{label}_{k}'] / 1024:.0f}"
                               for k in ("step", "accumulate", "accumulate_cast_cache", "eval_cast_cache"))
            lines.append(f"| {r['model']} | {label} | {cells} | {statistics.median(ready.values()):.3f} | {shift:.3f} |")
    if any("batched_ready" not in r for r in rows):
        lines += ["", f"batched: not measured: {batched_casts_unavailable()}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    print(table(measure(models)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
