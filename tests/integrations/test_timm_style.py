"""timm-style loop: our NativeScaler drives training exactly as timm's NativeScaler drives
torch's GradScaler.

timm itself is not imported: its PyPI wheels need torchvision, whose PyPI build does not
load against the CPU build of torch that CI uses (``operator torchvision::nms does not
exist``). The reference below is the sequence timm's ``NativeScaler.__call__`` runs, on
``torch.amp.GradScaler``: scale, backward, then unscale_ and clip when clipping, step, update.
"""

from __future__ import annotations

import csv

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
    with pytest.raises(ValueError, match="clip_mode='norm2' is not supported; use 'norm'"):
        loss_scaler(loss, opt, clip_grad=1.0, clip_mode="norm2", parameters=model.parameters())
    assert all(p.grad is None for p in model.parameters()), "refused before backward"


# -- adaptive gradient clipping ---------------------------------------------------------


def _reference_agc_(parameters, clip_factor, eps=1e-3):
    """Adaptive gradient clipping in plain torch, written from its definition: unit-wise
    L2 norms (over all dims but dim 0 for ndim > 1, over everything otherwise), each unit's
    gradient rescaled to clip_factor * max(weight norm, eps) where it is larger."""
    def unit_norm(t):
        if t.ndim <= 1:
            return t.norm(2.0)
        return t.norm(2.0, dim=tuple(range(1, t.ndim)), keepdim=True)

    with torch.no_grad():
        for p in parameters:
            if p.grad is None:
                continue
            max_norm = unit_norm(p).clamp_(min=eps) * clip_factor
            grad_norm = unit_norm(p.grad)
            clipped = p.grad * (max_norm / grad_norm.clamp(min=1e-6))
            p.grad.copy_(torch.where(grad_norm > max_norm, clipped, p.grad))


class _Net(torch.nn.Module):
    """Parameters of ndim 4 (conv weight), 2 (linear weight), 1 (biases, a gain) and 0."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Parameter(torch.randn(4, 2, 3, 3, generator=g).to(dtype))
        self.conv_bias = torch.nn.Parameter(torch.zeros(4, dtype=dtype))  # zero: eps decides
        self.linear = torch.nn.Parameter((torch.randn(3, 4, generator=g) * 0.1).to(dtype))
        self.gain = torch.nn.Parameter(torch.full((3,), 0.5).to(dtype))
        self.scalar = torch.nn.Parameter(torch.tensor(2.0, dtype=dtype))
        self.unused = torch.nn.Parameter(torch.ones(2, dtype=dtype))  # grad stays None

    def forward(self, x):
        h = torch.nn.functional.conv2d(x, self.conv, self.conv_bias).mean(dim=(2, 3))
        return (torch.nn.functional.linear(h, self.linear) * self.gain * self.scalar).float()


class _ReferenceAgcScaler(TorchReferenceScaler):
    """timm's NativeScaler sequence with agc: unscale_, clip, step, update on torch's scaler."""

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        self._scaler.unscale_(optimizer)
        _reference_agc_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


def _agc_run(loss_scaler, dtype, inf_step, clip_factor):
    model = _Net(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 2, 5, 5, generator=g) * 3).to(dtype)
    history = []
    for step in range(4):
        xb = x * float("inf") if step == inf_step else x
        loss = model(xb).pow(2).sum() * 100   # large gradients: most units are clipped
        before = [p.detach().clone() for p in model.parameters()]
        loss_scaler(loss, opt, clip_grad=clip_factor, clip_mode="agc", parameters=model.parameters())
        history.append(([p.grad.clone() if p.grad is not None else None for p in model.parameters()],
                        [p.detach().clone() for p in model.parameters()], before))
        opt.zero_grad()
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("clip_factor", [0.01, 0.5])
def test_agc_clips_the_unscaled_gradients_bit_for_bit_as_the_reference(same, dtype, clip_factor):
    ours_scaler = NativeScaler(amp.GradScaler("cpu", **INIT, warn_bf16=False))
    ours = _agc_run(ours_scaler, dtype, inf_step=2, clip_factor=clip_factor)
    ref = _agc_run(_ReferenceAgcScaler(), dtype, inf_step=2, clip_factor=clip_factor)
    assert same(ours, ref)
    grads, _, _ = ours[0]
    assert all(g is None or g.dtype is dtype for g in grads)
    assert grads[-1] is None, "a parameter without a gradient is skipped"
    unclipped = _agc_run(NativeScaler(amp.GradScaler("cpu", **INIT, warn_bf16=False)), dtype,
                         inf_step=2, clip_factor=1e6)
    assert not same(ours[0][0], unclipped[0][0]), "clipping changed the gradients"
    # The inf step is skipped: the parameters are those before it, bit for bit.
    _, after, before = ours[2]
    assert same(after, before) and ours_scaler.scaler.skipped_steps == 1
    _, after, before = ours[3]
    assert not same(after, before), "the next step trains again"


def test_fp16_parameters_are_refused_as_torchs_scaler_refuses_them():
    # unscale_ refuses float16 gradients (they are the parameters' own: unscaling in place
    # loses what the scale protected), so agc never sees them through a scaler; torch's too.
    for loss_scaler in (NativeScaler(amp.GradScaler("cpu", **INIT)), _ReferenceAgcScaler()):
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            _agc_run(loss_scaler, torch.float16, inf_step=None, clip_factor=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_agc_kernel_matches_the_reference_bit_for_bit_in_every_dtype(same, dtype):
    # The clipping itself, without a scaler: float16 gradients too (a caller that unscales
    # them some other way, or none, as timm's dispatch_clip_grad does).
    from dispatch_amp.integrations.timm_scaler import _clip

    def clipped(clip):
        model = _Net(dtype)
        g = torch.Generator().manual_seed(2)
        model(torch.randn(2, 2, 5, 5, generator=g).to(dtype)).pow(2).sum().mul(100).backward()
        clip(model.parameters())
        return [p.grad for p in model.parameters()], [p.detach() for p in model.parameters()]

    ours = clipped(lambda params: _clip(params, 0.01, "agc"))
    ref = clipped(lambda params: _reference_agc_(params, 0.01))
    assert same(ours, ref) and ours[0][0].dtype is dtype
    assert not same(ours[0][:5], clipped(lambda params: None)[0][:5]), "the gradients were clipped"


def test_agc_caps_each_unit_at_the_clip_factor_times_its_weight_norm():
    # One linear layer: row 0 has weight norm 5, row 1 zero weights (eps = 1e-3 applies),
    # row 2 a gradient already under its cap.
    weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]]))
    weight.grad = torch.tensor([[30.0, 40.0], [1.0, 0.0], [0.3, 0.4]])
    opt = torch.optim.SGD([weight], lr=1.0)
    loss = (weight * 0).sum()  # contributes a zero gradient; the grads above are what is clipped
    loss_scaler = NativeScaler(amp.GradScaler("cpu", init_scale=1.0))
    loss_scaler(loss, opt, clip_grad=0.1, clip_mode="agc", parameters=[weight])
    # Row 0: norm 50 capped at 0.1 * 5 = 0.5; row 1: norm 1 capped at 0.1 * 1e-3; row 2 kept.
    torch.testing.assert_close(weight.detach(), torch.tensor(
        [[3.0 - 0.3, 4.0 - 0.4], [-1e-4, 0.0], [6.0 - 0.3, 8.0 - 0.4]]))


def test_agc_takes_a_single_tensor_as_timm_does(same):
    def run(parameters_of):
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        loss = layer(torch.full((4, 3), 50.0)).sum()
        NativeScaler(amp.GradScaler("cpu", init_scale=1.0))(
            loss, opt, clip_grad=0.01, clip_mode="agc", parameters=parameters_of(layer))
        return [p.detach().clone() for p in layer.parameters()]

    only_weight = run(lambda layer: layer.weight)
    listed = run(lambda layer: [layer.weight])
    assert same(only_weight, listed)


# -- the default device -------------------------------------------------------------------


@pytest.mark.parametrize(("accelerator", "expected"), [(None, "cpu"), ("cuda", "cuda"), ("mps", "mps")])
def test_the_default_device_is_the_machines_accelerator_else_cpu(monkeypatch, accelerator, expected):
    import warnings

    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if accelerator is None else torch.device(accelerator))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: accelerator == "cuda")  # what GradScaler checks
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a working default: no "CUDA is not available"
        for loss_scaler in (NativeScaler(), NativeScaler(device=None)):
            assert loss_scaler.scaler._device == expected and loss_scaler.scaler.is_enabled()


def test_timms_call_shapes_choose_the_device():
    assert NativeScaler(device="cpu").scaler._device == "cpu"
    assert NativeScaler("cpu").scaler._device == "cpu", "timm's positional device"
    assert NativeScaler(device=torch.device("cpu")).scaler._device == "cpu"
    ours = amp.GradScaler("cpu", init_scale=4.0)
    assert NativeScaler(ours).scaler is ours


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_explicit_cuda_without_cuda_is_torchs_disabled_scaler():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        loss_scaler = NativeScaler(device="cuda")
    assert not loss_scaler.scaler.is_enabled()


def test_conflicting_device_arguments_are_refused():
    with pytest.raises(TypeError, match="both scaler= and device="):
        NativeScaler(amp.GradScaler("cpu"), device="cpu")
    with pytest.raises(TypeError, match="device twice"):
        NativeScaler("cpu", device="cpu")


def _update_summary(epoch, train_metrics, filename, write_header):
    """The CSV part of timm's ``utils.update_summary``: a ``DictWriter`` per row whose fields
    are that row's keys, and the header written with the first row only."""
    row = {"epoch": epoch, **{"train_" + k: v for k, v in train_metrics.items()}}
    with open(filename, mode="a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=row.keys())
        if write_header:
            writer.writeheader()
        writer.writerow(row)


def test_amp_metrics_keep_timms_summary_csv_whole(tmp_path):
    # Each epoch's train metrics carry the scaler's numbers; the middle epoch ends on a
    # skipped step, the others on clean ones: every row must still fit the header.
    from dispatch_amp.integrations.metrics import amp_metrics

    model, opt = _model_and_optimizer()
    loss_scaler = NativeScaler(amp.GradScaler("cpu", **INIT))
    path = tmp_path / "summary.csv"
    for epoch, inf_step in enumerate([None, 1, None]):
        losses, _ = _train(model, opt, loss_scaler, amp.autocast, 2, inf_step=inf_step)
        metrics = {"loss": float(losses[-1]), **amp_metrics(loss_scaler.scaler)}
        _update_summary(epoch, metrics, path, write_header=epoch == 0)
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    assert [len(r) for r in rows] == [len(header)] * 3
    overflow = header.index("train_amp/overflow_params")
    assert [int(r[overflow]) for r in rows] == [0, 4, 0]
