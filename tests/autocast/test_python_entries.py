"""How often the engine's Python runs: only for calls the policy casts, never in compiled code.

Counted, never timed: ``PythonEntries`` (benchmarks/suites/host_cost.py) counts calls
into dispatch_amp's Python made from code that is not ours. Kernels are registered per
process for every policy used in it (an op another policy casts also enters our Python,
to be run as given), so the forward is measured in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dispatch_amp as amp
from benchmarks.models import GPT, GPTConfig, gpt_batch
from benchmarks.suites.host_cost import PythonEntries, entries_per_compiled_step, mlp24


def _small_gpt():
    cfg = GPTConfig(vocab=32, d_model=16, n_heads=2, n_blocks=2, max_len=8)
    model = GPT(cfg)
    return model, gpt_batch(cfg, 2, 8, generator=torch.Generator().manual_seed(0))


_FORWARD = """
import json, torch
import dispatch_amp as amp
from benchmarks.models import GPT, GPTConfig, gpt_batch
from benchmarks.suites.host_cost import PythonEntries
cfg = GPTConfig(vocab=32, d_model=16, n_heads=2, n_blocks=2, max_len=8)
model = GPT(cfg)
idx, targets = gpt_batch(cfg, 2, 8, generator=torch.Generator().manual_seed(0))
with amp.autocast("cpu"):
    model.loss(idx, targets)  # kernels registered, memos filled
    with PythonEntries() as entries:
        model.loss(idx, targets)
print(json.dumps({"count": entries.count, "functions": dict(entries.by_function),
                  "ops": dict(entries.kernel_ops)}))
"""


def _forward_entries(engine: str) -> dict:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DISPATCH_AMP_ENGINE": engine}
    out = subprocess.run([sys.executable, "-c", _FORWARD], cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_forward_enters_our_python_only_for_the_calls_the_policy_casts():
    """The Python engine: its kernels are Python, entered for the calls the policy casts."""
    entries = _forward_entries("python")
    policy = amp.Policy.for_device("cpu")
    assert entries["count"] > 0
    # Every entry is a kernel of ours, for an op the policy casts (linear, the attention's
    # matmuls, cross_entropy's pieces on CPU).
    assert set(entries["functions"]) == {"kernel"}
    for op in entries["ops"]:  # "aten.mm.default"
        namespace, name, overload = op.split(".")
        assert policy.kind_of(f"{namespace}::{name}.{overload}") is not None, op
    assert sum(entries["ops"].values()) == entries["count"]


@pytest.mark.needs_compiler
def test_under_the_compiled_engine_a_forward_never_enters_our_python():
    """The compiled engine executes every cast of a plain model's forward in C++."""
    entries = _forward_entries("compiled")
    assert entries["count"] == 0, entries


def test_calls_the_policy_leaves_alone_never_enter_our_python():
    x = torch.randn(4, 8)
    with amp.autocast("cpu"):
        x.add(x)  # warm
        with PythonEntries() as entries:
            for _ in range(10):
                x = torch.relu(x.add(x)).view(32).view(4, 8)
    assert entries.count == 0


def test_a_compiled_step_never_enters_our_python():
    model, batch = mlp24()
    assert entries_per_compiled_step(model, batch) == 0


def test_outside_regions_nothing_enters_our_python():
    model, (idx, targets) = _small_gpt()
    with amp.autocast("cpu"):
        model.loss(idx, targets)
    with PythonEntries() as entries:
        model.loss(idx, targets)
    assert entries.count == 0
