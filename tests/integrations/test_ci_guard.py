"""With CI set, an integration test skipped for a missing framework fails instead."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_skip_for_a_missing_framework_fails_in_ci(tmp_path):
    # A stand-in 'lightning' that is not installed: importorskip skips on it.
    (tmp_path / "lightning.py").write_text(
        'raise ModuleNotFoundError("No module named \'lightning\'", name="lightning")\n'
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CI": "true"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "integrations.lightning",
         "tests/integrations/test_docstrings.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert "skipped in CI" in out.stdout and "'integrations' extra" in out.stdout
