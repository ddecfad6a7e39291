"""scripts/gpu_check.sh and its parts (benchmarks/check/): the CPU rehearsal runs whole, the
real check refuses a machine without CUDA, and the parts' pieces do what the report says.

No number is checked: the dry run measures nothing (tiny sizes on a CPU), it runs the code.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import torch._dynamo

from benchmarks.check import train
from benchmarks.check.dynamo_log import DynamoLog, _Capture
from benchmarks.check.targets import Target, read_targets, targets_table, write_targets
from benchmarks.suites import train_step

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
HANG_GUARD_S = 1800  # a loaded CI machine may be many times slower than the usual minute
PARTS = ("train", "profile", "fp8", "scaler", "tests")
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _script(args, tmp_path, **env):
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


@needs_bash
def test_dry_run_writes_every_part_the_summary_and_the_csvs(tmp_path):
    out = tmp_path / "out"
    res = _script(["--dry-run"], tmp_path, OUT=str(out))
    report = (out / "gpu_report.md").read_text()
    assert res.returncode == 0, report[-6000:] + res.stderr[-3000:]
    for line in ("- date: ", "- commit: ", "- GPU: ", "- torch ", "- Triton: ", "- torchao: ", "- mode: --dry-run",
                 "- train steps per timed sample: the default (2)"):
        assert line in report, line
    for part in PARTS:
        assert f"## Part: {part}" in report, part
    for heading in ("### train: GPT", "headline, mixed precision with GradScaler", "### train: ResNet-50 compiled",
                    "### train: GPT-2 medium structure", "the GPU-bound model, eager",
                    "each sample 2 calls between two synchronizations, reported per call",
                    "median of per-round ratios [95%]", "ratio of medians [95%]",
                    "### profile: GPT-2 small eager step:", "### profile: ResNet-50 compiled step",
                    "where ours spends more, by Python function", "Dynamo recompiles, guards and graph breaks",
                    "### fp8: linear forward + backward", "### fp8: ours vs torchao", "kernels per configuration",
                    "### fp8: DelayedScaling gradient error", "### fp8: GPT training step",
                    "GPT training step, device busy time", "### scaler: unscale + check on CPU",
                    "### scaler: step + update", "## Summary", "### Targets"):
        assert heading in report, heading
    assert "lstm_tagger-torch.bfloat16]" in report  # the cuDNN RNN cases are collected, to run first
    assert "TIMED OUT" not in report and "FAILED" not in report
    assert "gpu_check.sh: exit status 0" in report
    with tarfile.open(out / "gpu_report.csv.tar.gz") as tar:
        names = set(tar.getnames())
    for part in PARTS[:-1]:
        assert f"csv/{part}.csv" in names and f"csv/{part}.targets.csv" in names, (part, sorted(names))
    with tarfile.open(out / "gpu_report.logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/profile.cnn-compiled.ours.dynamo.log", "logs/pytest.collect.log"} <= names, sorted(names)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_report.csv.tar.gz", "gpu_report.logs.tar.gz",
                                                      "gpu_report.md"]


@needs_bash
def test_a_part_out_of_time_is_reported_the_next_part_runs_and_a_second_call_keeps_the_first_report(tmp_path):
    # One test for both behaviours: each call of the script costs CI several imports of torch.
    out = tmp_path / "out"
    # 3 s: less than the train part needs anywhere (it imports torch, builds and times models)
    res = _script(["--dry-run", "--part", "scaler", "--part", "train=3"], tmp_path, OUT=str(out))
    report = (out / "gpu_report.md").read_text()
    assert res.returncode == 1, report[-4000:]
    assert report.index("## Part: train") < report.index("## Part: scaler")  # the check's order, not the asked one
    assert "train: TIMED OUT after 3 s" in report
    assert "| train | TIMED OUT after 3 s |" in report and "| scaler | passed |" in report
    assert "### scaler: step + update" in report
    assert "gpu_check.sh: exit status 1" in report

    # A second call in the same OUT writes beside the first report, not over it.
    res = _script(["--dry-run", "--part", "train=3"], tmp_path, OUT=str(out))
    assert res.returncode == 1, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_report.2.csv.tar.gz", "gpu_report.2.logs.tar.gz", "gpu_report.2.md",
        "gpu_report.csv.tar.gz", "gpu_report.logs.tar.gz", "gpu_report.md",
    ]
    assert (out / "gpu_report.md").read_text() == report
    second = (out / "gpu_report.2.md").read_text()
    assert "train: TIMED OUT after 3 s" in second and "## Part: scaler" not in second
    assert "files: gpu_report.2.md, gpu_report.2.csv.tar.gz" in second


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the whole GPU check")
def test_the_real_check_refuses_a_machine_without_cuda(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    res = _script(["--part", "scaler"], tmp_path, REPORT=str(tmp_path / "report.md"), OUT="")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "no CUDA GPU is visible to torch here" in res.stderr
    assert "--dry-run" in res.stderr  # says what to run instead
    assert not (tmp_path / "report.md").exists()


@needs_bash
@pytest.mark.parametrize("args, message", [
    (["--part", "nope"], "unknown part 'nope'"),
    (["--part", "train=soon"], "whole number of seconds"),
    (["--budget", "-5"], "--budget needs a whole number of seconds"),
    (["--part"], "--part needs a NAME"),
    (["--fast"], "unknown option '--fast'"),
    (["--steps-per-sample", "0"], "--steps-per-sample needs a whole number of steps"),
    (["--steps-per-sample"], "--steps-per-sample needs a whole number of steps"),
])
def test_usage_errors_exit_2_before_anything_runs(tmp_path, args, message):
    res = _script(["--dry-run", *args], tmp_path, REPORT=str(tmp_path / "report.md"), OUT="")
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert not (tmp_path / "report.md").exists()


def test_a_part_without_cuda_and_without_dry_run_is_a_usage_error(tmp_path, capsys):
    from benchmarks.check.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("checks the error of a machine without CUDA")
    with pytest.raises(SystemExit) as e:
        main(["scaler", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--dry-run" in capsys.readouterr().err


# -- the pieces -------------------------------------------------------------------------------
def test_targets_round_trip_in_part_order(tmp_path):
    write_targets(tmp_path / "scaler.targets.csv", [Target("scaler", "syncs", 1, "<= 1", "met")])
    write_targets(tmp_path / "train.targets.csv", [Target("train", "eager", 1.25, "<= 1.03", "missed"),
                                                   Target("train", "memory", "not measured", "<= 0.97", "-")])
    rows = read_targets(tmp_path, ["train", "profile", "scaler"])  # profile wrote none
    assert [(r["part"], r["measure"]) for r in rows] == [("train", "eager"), ("train", "memory"), ("scaler", "syncs")]
    table = targets_table(rows)
    assert [r["value"] for r in table.rows] == [1.25, "not measured", 1.0]
    assert "| train | eager | 1.250 | <= 1.03 | missed |" in table.markdown()


def test_dynamo_log_counts_a_recompile_and_its_reason_and_lets_go_of_logging():
    logger = logging.getLogger("torch._dynamo")
    torch._dynamo.reset()

    def f(x, n):
        return x * n

    cf = torch.compile(f, backend="eager")
    with DynamoLog() as log:
        cf(torch.ones(3), 2)
        cf(torch.ones(3), 3)  # the int is guarded: one recompile
    row = log.row()
    assert row["recompiles"] == 1
    assert "n == 2" in row["reasons"]
    assert row["guards"] > 0 and row["frames"] == 2
    assert "TREE_GUARD_MANAGER" in log.text
    assert not any(isinstance(h, _Capture) for h in logger.handlers)
    text = log.text
    cf(torch.ones(3), 4)  # a recompile after the context: not captured
    assert log.text == text
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::dispatch_amp.AmpNumericsWarning")  # a scaler with bfloat16: CPU's dtype
def test_accumulation_step_runs_one_forward_per_micro_batch_and_one_update():
    _, net, batch = train_step.gpu_case("cnn", quick=True, device="cpu")
    calls = []
    net.register_forward_hook(lambda *_: calls.append(1))
    before = [p.detach().clone() for p in net.parameters()]
    train.accumulation_step(net, batch, "ours", torch.device("cpu"))()
    assert len(calls) == train.MICRO_BATCHES
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_accumulation_step_refuses_a_batch_too_small_to_split():
    _, net, (x, y) = train_step.gpu_case("cnn", quick=True, device="cpu")
    with pytest.raises(ValueError, match="cannot be split into 4 micro-batches"):
        train.accumulation_step(net, (x[:2], y[:2]), "native", torch.device("cpu"))


def test_eval_loop_runs_its_forwards_in_eval_mode_without_gradients():
    _, net, batch = train_step.gpu_case("gpt", quick=True, device="cpu")
    modes = []
    net.register_forward_hook(lambda m, *_: modes.append((m.training, torch.is_grad_enabled())))
    train.eval_loop(net, batch, "ours", torch.device("cpu"))()
    assert modes == [(False, False)] * train.EVAL_FORWARDS
    assert all(p.grad is None for p in net.parameters())


def test_a_training_steps_sample_is_several_steps_and_the_count_can_be_asked_for(tmp_path):
    from benchmarks.check.settings import Settings

    assert Settings(dry_run=False, quick=False, logs=tmp_path).steps_per_sample == 5  # on the GPU
    assert Settings(dry_run=True, quick=False, logs=tmp_path).steps_per_sample == 2  # dry run: the path, cheaply
    assert Settings(dry_run=False, quick=False, logs=tmp_path, steps=8).steps_per_sample == 8


def test_the_part_takes_the_steps_per_sample(tmp_path, capsys):
    from benchmarks.check.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--dry-run", "--out", str(tmp_path), "--steps-per-sample", "0"])
    assert e.value.code == 2
    assert "--steps-per-sample must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("batches", [True, False], ids=["torch-batches", "torch-batches-nothing"])
def test_the_batched_engine_variant_runs_only_where_torch_batches(tmp_path, monkeypatch, batches):
    # Before torch 2.13 the compiled engine batches no weight casts: a child run with
    # DISPATCH_AMP_BATCH_CASTS=1 would time the per-use casts under the batched label.
    from benchmarks.check import engine_variants
    from benchmarks.check.settings import Settings

    reason = None if batches else "torch 2.11.0 batches no weight casts (before 2.13)"
    monkeypatch.setattr(engine_variants, "batched_casts_unavailable", lambda: reason)
    ran = []

    def child(s, env):
        ran.append(env)
        return [{"model": m, "desc": m, "engine": "e", "native": [1.0, 1.1, 1.2], "ours": [1.1, 1.2, 1.3]}
                for m in engine_variants.MODELS], ""

    monkeypatch.setattr(engine_variants, "_run_child", child)
    tables = list(engine_variants.section(Settings(dry_run=True, quick=False, logs=tmp_path)))
    assert ran == [env for _, env in engine_variants.VARIANTS][:2 if batches else 1]
    assert len(tables) == 2 and len(tables[1].rows) == (len(engine_variants.MODELS) if batches else 0)
    assert ("Not measured: " + str(reason) in tables[1].markdown()) == (not batches)
