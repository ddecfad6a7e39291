"""benchmarks/python_kernel_floor.py: its trivial kernels see exactly the calls the engine's
kernels see under the built-in CPU policy (so its floor is the floor of the engine's own
entries), and it leaves the dispatcher as it found it. Run in a process of its own: it
takes the engine's dispatch key. The engine compared is the Python one: the floor is the
floor of Python kernels, and the compiled engine enters no Python for these forwards."""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from benchmarks import python_kernel_floor as floor
    from benchmarks.suites import host_cost
    table = floor.floor_table(rounds=1, calls=1)
    seen = {{(r["model"], r["form"]): r["kernel_calls"] for r in table.rows}}
    name = "AutocastPrivateUse1"
    left = torch._C._dispatch_get_registrations_for_dispatch_key(name)
    fallback = torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.AutocastPrivateUse1)
    # The engine's entries, counted after the trivial kernels are gone.
    for model, make in host_cost.MODELS.items():
        entries, cast, _ = host_cost.entries_per_forward(*make())
        print(model, entries, seen[(model, "with keyset (as the engine)")], seen[(model, "without keyset")])
    print("left", len(left), fallback)
""")


def test_the_floor_sees_the_engines_calls_and_cleans_up():
    env = {**os.environ, "DISPATCH_AMP_ENGINE": "python"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=str(ROOT))], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = [line.rsplit(" ", 3) for line in lines[:-1]]
    assert [r[0] for r in rows] == ["GPT-2 structure", "ResNet-50 structure", "MLP 24 x 64"]
    for model, engine, with_keyset, without in rows:
        assert int(engine) > 0, model
        assert int(with_keyset) == int(without) == int(engine), (model, engine, with_keyset, without)
    assert lines[-1] == "left 0 False", lines[-1]
