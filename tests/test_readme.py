"""README's commands are the ones CI runs, its demo and example run, and its timm row swaps
both parts. Its python code blocks (and the docs pages') run in tests/test_docs.py."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "pytest" in commands[1]


def test_ci_runs_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def test_readme_run_command_runs(tmp_path):
    # The demo, shortened: the full run takes about a minute.
    command = _readme_commands()[0].split("&&")[-1].split()
    assert command[:1] == ["python"]
    out = subprocess.run(
        [sys.executable, *command[1:], "--steps", "3", "--batch", "4", "--seq", "32",
         "--plot", str(tmp_path / "demo.png"), "--table", str(tmp_path / "demo.md")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "| dispatch_amp |" in out.stdout
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_quickstart_example_runs():
    out = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "dispatch_amp.autocast" in out.stdout


def test_readme_timm_row_swaps_both_the_autocast_and_the_scaler():
    # timm's train.py builds amp_autocast and loss_scaler and hands both to train_one_epoch,
    # which runs `with amp_autocast(): output = model(input)`: swapping only the scaler
    # would leave the forward on torch's autocast.
    import functools
    import re

    import torch

    import dispatch_amp as amp
    from dispatch_amp.integrations.timm_scaler import NativeScaler

    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| timm-style loops |"))
    spans = re.findall(r"`([^`]*)`", row)
    lines = [next(s for s in spans if s.startswith(name + " = ")) for name in ("amp_autocast", "loss_scaler")]
    namespace = {"functools": functools, "amp": amp, "NativeScaler": NativeScaler, "torch": torch,
                 "device": torch.device("cpu"), "amp_dtype": torch.bfloat16}
    for line in lines:
        exec(line, namespace)
    region = namespace["amp_autocast"]()
    assert isinstance(region, amp.autocast) and region.fast_dtype is torch.bfloat16
    with namespace["amp_autocast"]():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype is torch.bfloat16
    assert isinstance(namespace["loss_scaler"].scaler, amp.GradScaler)
