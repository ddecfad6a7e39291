"""How a part of the GPU check runs: device, sizes, rounds, compiler backend."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Settings:
    """One run's settings. ``dry_run``: CPU, tiny sizes; ``quick``: tiny sizes on the GPU.

    Example::

        s = Settings(dry_run=True, quick=False, logs=Path("/tmp/logs"))
        s.device, s.rounds, s.backend, s.steps_per_sample   # cpu, 3, "aot_eager", 2
    """

    dry_run: bool
    quick: bool
    logs: Path
    steps: int | None = None  # steps per timed sample of a training step; None: the mode's default

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda")

    @property
    def tiny(self) -> bool:
        """Tiny sizes: a smoke test of the code, no measurement."""
        return self.dry_run or self.quick

    @property
    def rounds(self) -> int:
        """Interleaved rounds per timing (21 on the GPU: its per-round ratios vary little)."""
        return 3 if self.tiny else 21

    @property
    def steps_per_sample(self) -> int:
        """Training steps per timed sample (``steps``, else 5 on the GPU, 2 at tiny sizes):
        one synchronized step on a shared host is too noisy for a few percent (the H100's
        one-step samples of GPT-2 small gave per-round ratios from 0.94 to 1.26)."""
        return self.steps or (2 if self.tiny else 5)

    @property
    def step_rounds(self) -> int:
        """Interleaved rounds of the training steps' timings: fewer than ``rounds``, as each
        sample is ``steps_per_sample`` steps."""
        return 3 if self.tiny else 11

    @property
    def backend(self) -> str:
        """torch.compile's backend: inductor on the GPU, aot_eager for tiny sizes (the
        same Dynamo and AOTAutograd path, without inductor's compile time)."""
        return "aot_eager" if self.tiny else "inductor"

    @property
    def profile_steps(self) -> int:
        """Steps per profile: the counts per step are exact, and processing a traced step's
        events (Python stacks included) costs seconds of the part's budget."""
        return 2 if self.tiny else 3

    def sync(self) -> None:
        """Waits for the device (nothing to wait for on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def suite_opts(self) -> argparse.Namespace:
        """The options the benchmark suites read (``opts.quick``, ``opts.device``)."""
        return argparse.Namespace(quick=self.tiny, device=self.device.type, no_save=True, out=None)
