"""Importing dispatch_amp loads no framework; each integration loads only its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "timm")


def _loaded_after(statement: str) -> set[str]:
    code = (
        f"import sys\n{statement}\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_dispatch_amp_and_the_integrations_package_load_no_framework():
    assert _loaded_after(
        "import dispatch_amp, dispatch_amp.integrations, dispatch_amp.integrations.timm_scaler, "
        "dispatch_amp.integrations._precision_flags"
    ) == set()


def test_an_integration_loads_only_its_framework():
    for framework in ("lightning", "transformers", "accelerate"):
        pytest.importorskip(framework)
    # Frameworks import each other on their own (lightning pulls in transformers when it is
    # installed), so each integration is imported after its framework, in one interpreter,
    # and may add only what its docstring says it imports.
    code = f"""
import sys
FRAMEWORKS = set({FRAMEWORKS!r})
def loaded():
    return {{m.split('.')[0] for m in sys.modules}} & FRAMEWORKS
for framework, module, adds in [
    ("lightning.pytorch", "lightning", set()),
    ("lightning.fabric", "fabric", set()),
    ("accelerate", "accelerate", set()),
    ("transformers", "transformers", {{"accelerate"}}),
]:
    __import__(framework)
    before = loaded()
    __import__("dispatch_amp.integrations." + module)
    extra = loaded() - before - adds
    assert not extra, (module, extra)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
