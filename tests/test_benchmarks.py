"""Smoke test of the benchmark runner: every suite runs in --quick mode (numbers are never checked)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

import dispatch_amp as amp

REPO = Path(__file__).resolve().parents[1]
# engine.cpp batches no weight casts before torch 2.13 (docs/design.md, "Torch before 2.13"):
# there the benchmarks leave the batched rows out and say why.
BATCHES = TorchVersion(torch.__version__) >= (2, 13)
# Only a guard against a hang: a loaded CI machine may take many times the usual minute.
HANG_GUARD_S = 1800

# The first line of each suite's tables: "### <suite>: ..." (see benchmarks/suites/).
HEADERS = [
    "## train-step", "### train-step: ms/step", "### train-step peak memory",
    "## dispatch-overhead", "### dispatch-overhead: us per tiny op",
    "## scaler", "### scaler: unscale + check", "### scaler: step + update",
    "## kernels", "### kernels: static PTX",
    "## compile", "### compile: ms per training step",
    "## fp8", "### fp8: linear forward + backward", "### fp8: ours vs torchao float8 training",
    "### fp8: GPT training step", "### fp8: DelayedScaling gradient error",
    "### fp8: kernels per linear forward + backward on the CUDA path", "### fp8: GPT peak memory",
]


@pytest.mark.parametrize("entry", [["benchmarks/run.py"], ["-m", "benchmarks"]], ids=["script", "module"])
def test_quick_run_prints_every_suite(tmp_path, entry):
    args = ["--quick", "--out", str(tmp_path)] if entry[0] == "-m" else ["--quick", "--no-save"]
    if entry[0] == "-m":  # the module form runs one suite only, to keep the test short
        args += ["--suite", "dispatch-overhead"]
    res = subprocess.run([sys.executable, *entry, *args], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stderr[-4000:]
    headers = HEADERS if entry[0] != "-m" else [h for h in HEADERS if "dispatch-overhead" in h]
    missing = [h for h in headers if h not in res.stdout]
    assert not missing, f"missing tables {missing}:\n{res.stdout[-4000:]}"
    if entry[0] == "-m":
        assert (tmp_path / "dispatch-overhead.quick.csv").read_text().startswith("machine,")


# The single-comparison scripts, each in its --quick form (tables printed, numbers unchecked).
SCRIPTS = {
    "bench_bounds.py": "### finite check of",
    "bench_opt_levels.py": "|",
    "bench_unscale.py": "|",
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_standalone_script_runs_quick(script):
    res = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stderr[-4000:]
    assert SCRIPTS[script] in res.stdout, res.stdout[-2000:]


def test_fp8_grad_errors_check_runs_at_a_small_size():
    # The full size (8 x 2048 tokens) is the module's default; tests/fp8/test_first_calls.py
    # checks the numbers at a size CI affords. Here: the options and the verdict line.
    args = ["--check", "--calls", "2", "--batch", "1", "--seq", "32", "--layers", "1", "--loss-tokens", "256"]
    res = subprocess.run([sys.executable, "-m", "benchmarks.fp8_grad_errors", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 x 32 tokens, loss over 256 tokens" in res.stdout and "check: passed" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error():
    res = subprocess.run([sys.executable, "-m", "benchmarks", "--device", "cuda", "--quick", "--no-save"], cwd=REPO,
                         capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--device cuda: no CUDA GPU is available here" in res.stderr
    assert "## train-step" not in res.stdout  # nothing ran


def test_no_tf32_turns_tf32_off_and_restores_the_settings_before():
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.suites.common import no_tf32
    finally:
        sys.path.remove(str(REPO))
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed in matmuls
        torch.backends.cudnn.allow_tf32 = True
        with no_tf32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32 is True
        with pytest.raises(RuntimeError, match="inside"), no_tf32():
            raise RuntimeError("inside")
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


_BREAKDOWN = """
import torch
import dispatch_amp as amp
from dispatch_amp.autocast import _handlers, _routing
from benchmarks.suites import host_cost

plan = _routing.plan_for(amp.Policy.for_device("cpu"), "cpu")
a = torch.ones(2, 2)
with amp.autocast("cpu"):
    torch.mm(a, a)  # the plan now has mm's handler
before = dict(plan.handlers)
seen = []

def recording(ctx, st, op, keyset, args, kwargs):
    seen.append(str(op))
    return host_cost._bare_casts(ctx, st, op, keyset, args, kwargs)

with host_cost._lower_calls_as(recording), amp.autocast("cpu"):
    out = torch.mm(a, a)
assert seen == ["aten.mm.default"] and out.dtype == torch.bfloat16, seen
assert plan.handlers == before and _handlers.lower in before.values()
with amp.autocast("cpu"):
    torch.mm(a, a)
assert seen == ["aten.mm.default"], seen
print("ok")
"""


def test_host_cost_breakdown_swaps_the_lower_calls_and_restores_them():
    # The breakdown swaps the Python engine's handlers: it runs on that engine (host-cost
    # runs it in the Python engine's process), here in a process of its own.
    env = {**os.environ, "DISPATCH_AMP_ENGINE": "python"}
    out = subprocess.run([sys.executable, "-c", _BREAKDOWN], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_ratio_cell_holds_the_estimate_and_its_interval():
    from benchmarks.suites.common import Table, ratio_columns
    from benchmarks.timing import prefixed, ratio_stats

    st = ratio_stats([1.1, 1.0, 2.0], [1.0, 2.0, 1.05])
    table = Table("t: x", [("model", "model", "{}"), *ratio_columns("step_", "step ours/native")],
                  [{"model": "m", **prefixed(st, "step_")}, {"model": "n", "step_ratio": "failed: no build"}, {}])
    lines = table.markdown().splitlines()
    assert lines[2] == ("| model | step ours/native, median of per-round ratios [95%] "
                        "| step ours/native, ratio of medians [95%] |")
    assert lines[4] == (f"| m | 1.100 [{st['ratio_lo']:.3f}, {st['ratio_hi']:.3f}] | 1.048 "
                        f"[{st['ratio_of_medians_lo']:.3f}, {st['ratio_of_medians_hi']:.3f}] |")
    assert lines[5] == "| n | failed: no build | - |"  # a text in the estimate's place is printed as it is
    assert lines[6] == "| - | - | - |"


def test_gpt2_medium_is_the_gpu_bound_model_and_its_tiny_width_keeps_its_structure():
    from benchmarks import models as M
    from benchmarks.suites import train_step

    assert (M.GPT2_MEDIUM.n_blocks, M.GPT2_MEDIUM.d_model, M.GPT2_MEDIUM.n_heads) == (24, 1024, 16)
    with torch.device("meta"):  # the real size, without its memory
        full = M.gpt2(M.GPT2_MEDIUM)
    assert 350e6 < sum(p.numel() for p in full.parameters()) < 360e6  # GPT-2 medium's 355M (tied head)
    for case in (train_step.case, train_step.gpu_case):
        desc, net, (idx, tgt) = case("gpt-medium", True, "cpu")
        assert "GPT-2 medium structure" in desc and "24 blocks" in desc and "16 heads" in desc
        assert len(net.blocks) == 24 and net.blocks[0].attn.num_heads == 16
        assert net.head.weight is net.tok.weight  # tied, as GPT-2's
        assert idx.shape == tgt.shape == (4, 32)
        net.loss(idx, tgt).backward()
    assert "gpt-medium" in train_step.MODELS


def _host_cost_child_rows(engine):
    row = {"model": "MLP 24 x 64", "engine": engine}
    return json.dumps({"forward": [dict(row)], "where": [], "compiled": [dict(row, entries=0)], "repeated": []})


def test_host_cost_runs_each_engine_in_its_own_process_and_names_it(monkeypatch):
    from benchmarks.suites import common, host_cost

    calls = []

    def fake_children(cmds, concurrent=False, timeout=600, env=None):
        (name, cmd), = cmds.items()
        calls.append((cmd[cmd.index("--child") + 2], env))
        if env["DISPATCH_AMP_ENGINE"] == "compiled":
            return {name: (1, "", "Traceback ...\nRuntimeError: the compiled engine needs a C++ compiler")}
        return {name: (0, "a line the child printed\n" + _host_cost_child_rows("python"), "")}

    monkeypatch.setattr(common, "run_children", fake_children)
    forward, where, compiled, repeated = host_cost.run(argparse.Namespace(quick=True))
    assert calls == [("python", {"DISPATCH_AMP_ENGINE": "python"}), ("compiled", {"DISPATCH_AMP_ENGINE": "compiled"})]
    assert forward.columns[0][0] == "engine" and [r["engine"] for r in forward.rows][0] == "python"
    failed = forward.rows[1]["engine"]
    assert failed.startswith("compiled: not measured") and "needs a C++ compiler" in failed
    assert "| compiled: not measured" in forward.markdown()  # a row that says why, not a failed suite
    assert [r["engine"] for r in compiled.rows][0] == "python" and len(compiled.rows) == 2
    assert where.rows == []


def test_host_cost_names_an_engine_that_ran_instead_of_the_one_asked_for(monkeypatch):
    from benchmarks.suites import common, host_cost

    monkeypatch.setattr(common, "run_children", lambda cmds, **kw: {
        name: (0, _host_cost_child_rows("python"), "") for name in cmds})
    forward = host_cost.run(argparse.Namespace(quick=True))[0]
    assert [r["engine"] for r in forward.rows] == ["python", "python (asked for compiled)"]


def test_host_cost_reads_the_engine_from_dispatch_amp_where_it_can(monkeypatch):
    from benchmarks.suites import host_cost

    monkeypatch.setattr(amp, "engine", lambda: "compiled", raising=False)
    assert host_cost.engine_name() == "compiled"
    monkeypatch.delattr(amp, "engine")
    assert host_cost.engine_name() == "python"  # a package without a choice of engine


@pytest.mark.needs_compiler
def test_engines_measures_both_engines_against_native():
    out = subprocess.run([sys.executable, "-m", "benchmarks.engines", "--rounds", "1", "--models", "mlp"],
                         cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "MLP 24 x 64" in line]
    batched = ["compiled, batched"] if BATCHES else []
    assert [row.split("|")[1].strip() for row in rows] == ["compiled, unbatched", *batched, "python"], out.stdout
    not_measured = [line for line in out.stdout.splitlines() if line.startswith("| compiled, batched | not measured")]
    assert len(not_measured) == (0 if BATCHES else 1) and all("before 2.13" in line for line in not_measured), out.stdout


@pytest.mark.needs_compiler
def test_batched_casts_reports_native_unbatched_and_batched():
    out = subprocess.run([sys.executable, "-m", "benchmarks.batched_casts", "--models", "mlp"],
                         cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         env={k: v for k, v in os.environ.items() if k != "DISPATCH_AMP_ENGINE"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| MLP 24 x 64")]
    assert [row[2].strip() for row in rows] == ["native", "unbatched", *(["batched"] if BATCHES else [])], out.stdout
    assert ("batched: not measured: torch" in out.stdout) == (not BATCHES), out.stdout
    assert float(rows[0][-2]) == 0.0  # native against itself
    assert all(int(row[3]) > 0 for row in rows)  # a step allocates


@pytest.mark.needs_compiler
def test_custom_policy_reports_the_built_in_and_the_custom_policy_against_native():
    out = subprocess.run([sys.executable, "-m", "benchmarks.custom_policy", "--rounds", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert [row[1].strip() for row in rows] == ["built-in", "custom"], out.stdout
    assert out.stdout.startswith(f"engine: {amp.engine()};"), out.stdout
