"""Scalers, policies and diagnostics pickled before the package had parts still load.

Pickles name classes by module path, and ``grad_scaler``, ``scaler_config``,
``scaler_diagnostics``, ``policy``, ``op_tables``, ``census`` and ``tracing`` moved into
``scaler/``, ``autocast/`` and ``diagnostics/``.
``torch.save`` pickles with protocol 2, which writes each class as ``module\\nname\\n``:
so a pickle from before the move is this one with the old paths written in.
"""

from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys

import torch

import dispatch_amp as amp
from dispatch_amp import _pickled_paths

# Where the modules whose objects pickles name lived before they moved.
MOVED = {
    "dispatch_amp.scaler.grad_scaler": "dispatch_amp.grad_scaler",
    "dispatch_amp.scaler.config": "dispatch_amp.scaler_config",
    "dispatch_amp.scaler.diagnostics": "dispatch_amp.scaler_diagnostics",
    "dispatch_amp.autocast.policy": "dispatch_amp.policy",
    "dispatch_amp.autocast.op_tables": "dispatch_amp.op_tables",
    "dispatch_amp.diagnostics.census": "dispatch_amp.census",
    "dispatch_amp.diagnostics.tracing": "dispatch_amp.tracing",
}


def _used_scaler() -> amp.GradScaler:
    # Three steps, the second overflowing: the diagnostics then hold a history and a report.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scaler.name_parameters(model)
    for step in range(3):
        with amp.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().sum()
        scaler.scale(loss * (float("inf") if step == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def _modules_named(data: bytes) -> set[str]:
    return {arg.split(" ")[0] for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def _as_before_the_move(data: bytes) -> bytes:
    for new, old in MOVED.items():
        data = data.replace(f"c{new}\n".encode(), f"c{old}\n".encode())
    return data


def _census() -> amp.PrecisionCensus:
    a = torch.ones(2, 2)
    with amp.PrecisionCensus() as census, amp.autocast("cpu"):
        torch.mm(a, a)
    return census


def _objects() -> dict:
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["mm"], name="keep-mm")
    return {
        "scaler": _used_scaler(),
        "policy": policy,
        "kind": policy.kind_of("mm"),
        "census": _census(),
        "tracer": amp.NonFiniteTracer(torch.nn.Linear(2, 2)),
    }


def _old_pickle(objects: dict) -> bytes:
    old = _as_before_the_move(pickle.dumps(objects, protocol=2))
    assert not set(MOVED) & _modules_named(old), "a new path is left in the old pickle"
    return old


def test_every_old_path_is_bound_to_its_new_module():
    assert {f"dispatch_amp.{old}" for old in _pickled_paths.OLD_PATHS} == set(MOVED.values())
    for new, old in MOVED.items():
        assert sys.modules[old] is sys.modules[new]


def test_a_scaler_and_a_policy_pickled_under_the_old_paths_load():
    objects = _objects()
    scaler, policy = objects["scaler"], objects["policy"]
    old = _old_pickle(objects)
    assert set(MOVED.values()) <= _modules_named(old)  # every old path is exercised
    loaded = pickle.loads(old)
    again = loaded["scaler"]
    assert type(again) is amp.GradScaler
    assert again.state_dict() == scaler.state_dict() and again.metrics() == scaler.metrics()
    assert again.scale_history() == scaler.scale_history()
    assert str(again.last_overflow()) == str(scaler.last_overflow())
    assert loaded["policy"] == policy and loaded["policy"].name == "keep-mm"
    assert loaded["kind"] is policy.kind_of("mm")
    assert loaded["census"].as_dict() == objects["census"].as_dict()
    assert type(loaded["tracer"]) is amp.NonFiniteTracer


def test_an_old_pickle_loads_in_a_process_that_never_imported_the_package(tmp_path):
    # pickle imports dispatch_amp.grad_scaler: the parent package runs first and binds it.
    path = tmp_path / "old.pkl"
    path.write_bytes(_old_pickle({"scaler": _used_scaler(), "policy": amp.Policy.for_device("cpu")}))
    script = (
        "import pickle, sys\n"
        f"loaded = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "print(type(loaded['scaler']).__module__, loaded['policy'].name)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dispatch_amp.scaler.grad_scaler", amp.Policy.for_device("cpu").name]


def test_new_pickles_name_the_new_paths():
    named = _modules_named(pickle.dumps(_objects(), protocol=2))
    assert set(MOVED) <= named and not set(MOVED.values()) & named
