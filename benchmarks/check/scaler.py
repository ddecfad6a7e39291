"""Part scaler: the Triton unscale against a device copy and torch's op; scaler step + update.

1. ``scaler.unscale_vs_copy_table``: ours (``unscale_check_``, Triton on CUDA) against
   torch's ``_amp_foreach_non_finite_check_and_unscale_`` and a device-to-device copy of
   the same bytes, on ~1 GB of fp32 gradients in 200 tensors of mixed sizes, CUDA events;
2. ``scaler.step_table``: step + update with 1 SGD, 2 SGDs and fused AdamW, ours against
   ``torch.amp.GradScaler``, each sample synchronized, and the host syncs of one step
   (``aten._local_scalar_dense`` calls, counted by a TorchDispatchMode).

Targets: unscale >= 90% of the copy's bandwidth and faster than torch's op; host syncs 1
per step (1 SGD, 2 SGDs), 0 with fused AdamW; step + update ours/torch <= 1.00 (SGD),
<= 0.85 (fused AdamW).
"""

from __future__ import annotations

from benchmarks.suites import scaler as scaler_suite
from benchmarks.suites.common import verdict

from .settings import Settings
from .targets import Target

NAME = "scaler"
COPY_SHARE_TARGET = 0.90  # of a device copy's GB/s


def unscale(s: Settings):
    table = scaler_suite.unscale_vs_copy_table(s.tiny, s.rounds, s.device)
    yield table
    for row in table.rows:
        if row.get("target"):  # the suite's row has one verdict for both: one each here
            yield Target(NAME, f"unscale {row['provider']}: share of copy GB/s", row["of_copy"],
                         f">= {COPY_SHARE_TARGET:.2f}", verdict(row["of_copy"], COPY_SHARE_TARGET, at_most=False))
            faster = 0 if row["ratio"] < 1.0 else 1  # strictly faster than torch's op
            yield Target(NAME, f"unscale {row['provider']}: time / torch's op", row["ratio"], "< 1.00",
                         verdict(faster, 0))


def step(s: Settings):
    table = scaler_suite.step_table(s.tiny, s.rounds, s.device)
    yield table
    for row in table.rows:
        yield Target(NAME, f"host syncs per step, {row['optimizers']} (ours)", row["ours_syncs"],
                     f"<= {row['sync_target']}", row["sync_met"])
        yield Target(NAME, f"step + update {row['optimizers']}: ours/torch", row["ratio"], row["target"], row["met"])


def sections(s: Settings) -> list:
    """(name, generator function) in the order they run."""
    return [("unscale", lambda: unscale(s)), ("step + update", lambda: step(s))]
