"""README's commands are the ones CI runs, and its example runs."""

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


def test_readme_example_script_runs():
    script = _readme_commands()[0].split("&&")[-1].split()
    assert script[:1] == ["python"]
    out = subprocess.run(
        [sys.executable, *script[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "dispatch_amp.autocast" in out.stdout


def test_readme_python_examples_run():
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:  # in order: later examples use names from earlier ones
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["scaler"].get_scale() > 0
