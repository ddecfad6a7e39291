"""Every integration example runs to the end (a few steps) and reports its training."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

EXAMPLES = {
    "lightning_trainer.py": ("lightning", [], "lightning Trainer + dispatch_amp: 3 steps"),
    "lightning_fabric.py": ("lightning", [], "lightning Fabric + dispatch_amp: 3 steps"),
    "hf_trainer.py": ("transformers", ["--fp16"], "transformers Trainer + dispatch_amp: 3 steps"),
    "accelerate_train.py": ("accelerate", [], "accelerate + dispatch_amp: 3 steps"),
    "timm_style_loop.py": (None, [], "timm-style loop + dispatch_amp: 3 steps"),
    "patch_torch_recipe.py": (None, [], "identical"),
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs(example):
    framework, args, expected = EXAMPLES[example]
    if framework:
        pytest.importorskip(framework)
    out = subprocess.run(
        [sys.executable, f"examples/{example}", "--steps", "3", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout, out.stdout


def test_the_fabric_example_skips_an_overflowing_step_instead_of_raising():
    # Fabric's clip_gradients raises on inf/nan gradients by default, on exactly the step
    # the scaler should skip.
    pytest.importorskip("lightning")
    out = subprocess.run(
        [sys.executable, "examples/lightning_fabric.py", "--steps", "4", "--inf-step", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 steps (1 skipped)" in out.stdout, out.stdout


def test_every_example_is_run_here():
    integration_examples = {
        p.name for p in (ROOT / "examples").glob("*.py")
        if "dispatch_amp.integrations" in p.read_text() or "patch_torch" in p.read_text()
    }
    assert integration_examples == set(EXAMPLES)
