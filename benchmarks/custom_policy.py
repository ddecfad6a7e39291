"""A policy of the user's own against the built-in one, on this CPU: the host cost of rules
that differ from native's table.

    python -m benchmarks.custom_policy [--rounds 30]

Under a policy that casts an op otherwise than native's table, torch's checkpoint would
recompute that op differently, so its handler refuses inside that checkpoint; the compiled
engine executes such a rule in C++ wherever that checkpoint cannot be running (see "A
user's policy runs in C++ too" in docs/design.md). This measures what that costs on the
GPT-2 structure of the host-cost suite (``benchmarks/suites/host_cost.py``), forward and
loss, against native ``torch.autocast`` in the same process, interleaved:

- ``built-in``: ``dispatch_amp.autocast`` under the CPU policy (native's table);
- ``custom``: the same with ``layer_norm`` in float32 and ``gelu`` lowered. Both differ
  from native's CPU table (which leaves them as given) and change no number here: the
  layer norms already take float32 and the GELUs bfloat16, so the forward computes the
  same as native's (checked, bit for bit, before timing), and the difference is host time.

The clock is this thread's CPU time with torch on one thread, as in ``benchmarks.engines``.
"""

from __future__ import annotations

import argparse
import statistics
import time

POLICY_CHANGES = {"fp32": ["layer_norm"], "lower": ["gelu"]}


def measure(rounds: int) -> dict[str, dict[str, float]]:
    """Added milliseconds per forward (median of per-round differences) and ours/native
    (``timing.ratio_stats``), for the built-in and the custom policy."""
    import torch

    import dispatch_amp
    from benchmarks.suites import host_cost as hc
    from benchmarks.timing import interleaved, ratio_stats
    from dispatch_amp import Policy

    torch.set_num_threads(1)
    model, batch = hc.MODELS["GPT-2 structure"]()
    custom = Policy.for_device("cpu").with_ops(**POLICY_CHANGES, name="layer_norm fp32, gelu lowered")

    def forward(region):
        def run():
            with region():
                return hc._loss(model, batch)
        return run

    fns = {
        "native": forward(lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "built-in": forward(lambda: dispatch_amp.autocast("cpu", dtype=torch.bfloat16)),
        "custom": forward(lambda: dispatch_amp.autocast("cpu", dtype=torch.bfloat16, policy=custom)),
    }
    with torch.no_grad():
        want = fns["native"]()
        for name in ("built-in", "custom"):
            got = fns[name]()
            if not torch.equal(got, want):
                raise RuntimeError(f"{name}: the loss differs from native's ({got} against {want}): "
                                   f"the custom policy must change no number for this comparison")
    samples = interleaved(fns, rounds, warmup=5, calls=5, timer=time.thread_time)
    out = {}
    for name in ("built-in", "custom"):
        added = statistics.median(o - n for o, n in zip(samples[name], samples["native"])) * 1e3
        out[name] = {"added_ms": added, **ratio_stats(samples[name], samples["native"])}
    out["native_ms"] = statistics.median(samples["native"]) * 1e3
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    import dispatch_amp

    result = measure(args.rounds)
    print(f"engine: {dispatch_amp.engine()}; GPT-2 structure, native forward + loss {result['native_ms']:.3f} ms")
    print("| policy | added per forward | ours/native (median of ratios [95%]) |")
    print("|---|---:|---|")
    for name in ("built-in", "custom"):
        r = result[name]
        print(f"| {name} | {r['added_ms']:+.3f} ms | {r['ratio']:.3f} [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}] |")


if __name__ == "__main__":
    main()
