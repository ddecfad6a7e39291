"""timm-style loop: our NativeScaler drives training exactly as timm's NativeScaler drives
torch's GradScaler.

timm itself is not imported: its PyPI wheels need torchvision, whose PyPI build does not
load against the CPU build of torch that CI uses (``operator torchvision::nms does not
exist``). The reference below is the sequence timm's ``NativeScaler.__call__`` runs, on
``torch.amp.GradScaler``: scale, backward, then unscale_ and clip when clipping, step, update.
"""

from __future__ import annotations

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.integrations.timm_scaler import NativeScaler

INIT = {"init_scale": 2.0**8, "growth_interval": 2}


class TorchReferenceScaler:
    """timm's NativeScaler protocol on torch's GradScaler (the 'native AMP' side)."""

    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu", **INIT)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model, optimizer, loss_scaler, autocast, steps, start=0, inf_step=None, accum=1):
    """timm's train_one_epoch in miniature: autocast forward, loss_scaler(...) per micro-batch."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    losses, scales = [], []
    for step in range(start, steps):
        for micro in range(accum):
            xb = x[micro::accum]
            if step == inf_step:
                xb = xb * float("inf")
            with autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(xb).float(), y[micro::accum])
            need_update = micro == accum - 1
            loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters(), need_update=need_update)
            if need_update:
                optimizer.zero_grad()
            losses.append(loss.detach().clone())
        scales.append(loss_scaler.state_dict()["scale"])
    return losses, scales


@pytest.mark.parametrize("accum", [1, 2], ids=["plain", "accumulating"])
def test_fp16_training_with_an_overflow_matches_the_torch_reference(same, accum):
    ref_model, ref_opt = _model_and_optimizer()
    ref = _train(ref_model, ref_opt, TorchReferenceScaler(), torch.autocast, 5, inf_step=2, accum=accum)
    model, opt = _model_and_optimizer()
    loss_scaler = NativeScaler(amp.GradScaler("cpu", **INIT))
    ours = _train(model, opt, loss_scaler, amp.autocast, 5, inf_step=2, accum=accum)
    assert ours[1] == ref[1] and ours[1][2] == ours[1][1] / 2, "same scales; the overflow step backs off"
    assert loss_scaler.scaler.skipped_steps == 1
    assert same(ours[0], ref[0]) and same(list(model.parameters()), list(ref_model.parameters()))


@pytest.mark.parametrize("source", [NativeScaler, TorchReferenceScaler], ids=["from-ours", "from-torch"])
def test_resume_from_a_checkpoint_continues_bit_identically(tmp_path, same, source):
    model, opt = _model_and_optimizer()
    straight = _train(model, opt, NativeScaler(amp.GradScaler("cpu", **INIT)), amp.autocast, 6, inf_step=4)

    head_model, head_opt = _model_and_optimizer()
    head_scaler = source(amp.GradScaler("cpu", **INIT)) if source is NativeScaler else source()
    autocast = amp.autocast if source is NativeScaler else torch.autocast
    _train(head_model, head_opt, head_scaler, autocast, 3, inf_step=4)
    torch.save({"model": head_model.state_dict(), "optimizer": head_opt.state_dict(),
                head_scaler.state_dict_key: head_scaler.state_dict()}, tmp_path / "ckpt.pt")

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    tail_model, tail_opt = _model_and_optimizer()
    tail_model.load_state_dict(checkpoint["model"])
    tail_opt.load_state_dict(checkpoint["optimizer"])
    loss_scaler = NativeScaler(amp.GradScaler("cpu", **INIT))
    loss_scaler.load_state_dict(checkpoint[NativeScaler.state_dict_key])
    assert loss_scaler.state_dict()["scale"] == straight[1][2] != INIT["init_scale"]
    tail = _train(tail_model, tail_opt, loss_scaler, amp.autocast, 6, start=3, inf_step=4)
    assert tail[1] == straight[1][3:]
    assert same(tail[0], straight[0][3:]) and same(list(tail_model.parameters()), list(model.parameters()))


def test_arguments_are_checked():
    model, opt = _model_and_optimizer()
    loss_scaler = NativeScaler(device="cpu")
    loss = model(torch.ones(1, 8)).sum()
    with pytest.raises(ValueError, match="without parameters"):
        loss_scaler(loss, opt, clip_grad=1.0)
    with pytest.raises(ValueError, match="clip_mode='agc' is not supported"):
        loss_scaler(loss, opt, clip_grad=1.0, clip_mode="agc", parameters=model.parameters())
