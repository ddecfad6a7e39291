"""The demo runs end to end in a few seconds with --steps 3."""

import pytest
import torch

from dispatch_amp import demo


def test_demo_runs_with_three_steps(tmp_path, capsys):
    png = tmp_path / "demo.png"
    assert demo.main(["--steps", "3", "--batch", "4", "--seq", "32", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for run in ("fp32", "torch.autocast", "dispatch_amp"):
        assert f"| {run} |" in out
    assert "matmul FLOPs in bfloat16" in out
    assert png.stat().st_size > 0


def test_demo_float16_uses_the_scaler_and_reports_skips(tmp_path, capsys):
    png = tmp_path / "fp16.png"
    args = ["--steps", "2", "--batch", "2", "--seq", "16", "--dtype", "float16", "--plot", str(png)]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "matmul FLOPs in float16" in out and png.stat().st_size > 0


def test_demo_rejects_bad_options():
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        demo.main(["--device", "meta"])


def test_corpus_ships_with_the_package():
    text = demo.load_corpus()
    assert 100_000 < len(text) < 400_000 and text.isascii()


def test_char_gpt_shapes():
    model = demo.CharGPT(vocab=10, d=12, heads=2, layers=1, seq=8)
    assert model(torch.randint(0, 10, (2, 8))).shape == (2, 8, 10)
