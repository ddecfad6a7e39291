"""plot_training: a PNG of loss and scale; a clear message when matplotlib is missing."""

import builtins

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.diagnostics.plotting import plot_training


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"dispatch-amp\[plot\]"):
        plot_training({"a": [1.0, 0.5]}, tmp_path / "x.png")


def test_plot_with_scale_history(tmp_path):
    path = plot_training(
        {"ours": [2.0, 1.5, 1.2]}, tmp_path / "p.png",
        scales={"ours": [(1, 65536.0, False), (2, 32768.0, True), (3, 32768.0, False)]},
    )
    assert (tmp_path / "p.png").stat().st_size > 0 and path.endswith("p.png")


def test_plot_from_a_real_scaler_history(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=4.0)
    losses = []
    for x in (torch.ones(1, 2), torch.full((1, 2), float("inf")), torch.ones(1, 2)):
        opt.zero_grad()
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    plot_training({"ours": losses}, tmp_path / "h.png", scales={"ours": scaler.scale_history()})
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
