"""The compiled engine's table of plans (``_compiled_engine.prepare``): one entry per
distinct policy and device type, up to the C++ side's ``max_plans()``. Past it, regions
run on the Python engine with the same casts, and the process is told once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dispatch_amp.autocast import _compiled_engine

pytestmark = pytest.mark.needs_compiler

# A fresh process: the table is per process, and this one's already holds the plans of
# the tests before. 70 distinct policies (the CPU table less one of its fp32 ops each),
# then the first one again; each region's bfloat16 matmul against native's.
_FILL = """
import warnings, torch, dispatch_amp as amp
from dispatch_amp import CompiledEngineWarning
from dispatch_amp.autocast import _compiled_engine as ce, _routing
assert amp.engine() == "compiled"
base = amp.Policy.for_device("cpu")
policies = [base.without_ops(op) for op in sorted(base.ops("fp32"))[:70]]
a, b = torch.randn(8, 8), torch.randn(8, 8)
with torch.autocast("cpu"):
    want = torch.mm(a, b)
numbers = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for policy in policies + policies[:1]:
        with amp.autocast("cpu", policy=policy):
            got = torch.mm(a, b)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        numbers.append(ce.plan_number(_routing.plan_for(policy, "cpu")))
said = [w for w in caught if issubclass(w.category, CompiledEngineWarning)]
print(ce.ENGINE.module.max_plans(), numbers.count(-1), len(set(numbers) - {-1}), numbers[-1])
for w in said:
    print("WARNING", w.filename, w.lineno, str(w.message))
"""


def test_past_the_last_entry_regions_run_on_python_with_the_same_casts_said_once():
    if _compiled_engine.active() is None:
        pytest.skip("the Python engine runs this process (DISPATCH_AMP_ENGINE=python): it has no table of plans")
    out = subprocess.run([sys.executable, "-c", _FILL], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DISPATCH_AMP_ENGINE": "compiled"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    size, past, numbered, first_again = map(int, lines[0].split())
    # The built-in CPU policy of `with torch.autocast` is not ours: ours numbered only the 70.
    assert size == 64 and numbered == size and past == 70 - size
    assert first_again == 0  # an equal policy finds its entry again
    warned = lines[1:]
    assert len(warned) == 1, warned  # once per process, not once per policy or region
    _, filename, lineno, message = warned[0].split(" ", 3)
    # Pointed at the user's `with` line, not at dispatch_amp's code.
    assert filename == "<string>" and int(lineno) == _FILL.splitlines().index(
        '        with amp.autocast("cpu", policy=policy):') + 1
    assert "64 distinct policies" in message and "Python engine" in message and "reuse it" in message
