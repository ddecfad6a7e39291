"""fp8 recipe state in each framework's own checkpoint: a run stopped, saved the framework's
way and resumed in fresh objects (model, optimizer, recipe) continues bit-identically to
one that never stopped, with no user code for the recipe, on a model with
MultiheadAttention (whose in-projection is a parameter, not a module's ``weight``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import dispatch_amp as amp
from dispatch_amp import fp8

STEPS, STOP = 6, 3
ATTENTION_SITES = {"attn.in_proj_weight", "attn.out_proj"}


class AttnNet(nn.Module):
    """A projection, self-attention and an output projection; every gemm fp8-eligible
    (2 x 8 tokens, widths multiples of 16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 8, 16, generator=g) * (1 + step), torch.randn(2, 8, 16, generator=g)


def _recipe():
    return fp8.DelayedScaling(amax_history_len=4)


def _loss(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _sites(state):
    return {name.rpartition("net.")[2] for name in state["sites"]}


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available|"
                                              "find_unused|save_safetensors|TF32).*")
    return ctx


# -- Lightning Trainer -----------------------------------------------------------------------
def _lightning_fit(tmp_path, steps, ckpt_path=None):
    pl = pytest.importorskip("lightning.pytorch")
    from dispatch_amp.integrations.lightning import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = AttnNet()
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = _batch(self.global_step)
            loss = _loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(1)), batch_size=1)

    module = Module()
    plugin = MixedPrecision("bf16-mixed", "cpu", fp8=_recipe())
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    ctx = _quiet()
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    finally:
        ctx.__exit__(None, None, None)
    return module, trainer


def test_lightning_trainer(tmp_path, same):
    straight, _ = _lightning_fit(tmp_path, STEPS)
    head, trainer = _lightning_fit(tmp_path, STOP)
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)  # what ModelCheckpoint calls
    saved = torch.load(path, weights_only=False)["dispatch_amp_fp8"]
    assert ATTENTION_SITES <= _sites(saved)
    tail, _ = _lightning_fit(tmp_path, STEPS, ckpt_path=path)
    assert same(tail.losses, straight.losses[STOP:])
    assert same(_params(tail), _params(straight))


# -- Lightning Fabric --------------------------------------------------------------------------
def _fabric_setup():
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric

    from dispatch_amp.integrations.fabric import MixedPrecision

    ctx = _quiet()
    try:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("bf16-mixed", "cpu", fp8=_recipe())])
    finally:
        ctx.__exit__(None, None, None)
    model = AttnNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _fabric_train(fabric, model, optimizer, start, stop):
    losses = []
    for step in range(start, stop):
        x, y = _batch(step)
        loss = _loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_lightning_fabric(tmp_path, same):
    fabric, model, optimizer = _fabric_setup()
    straight = _fabric_train(fabric, model, optimizer, 0, STEPS)
    straight_params = _params(model)

    fabric, model, optimizer = _fabric_setup()
    _fabric_train(fabric, model, optimizer, 0, STOP)
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(tmp_path / "state.ckpt", weights_only=False)["model"]["_dispatch_amp_fp8_state"]
    assert ATTENTION_SITES <= _sites(saved)

    fabric, model, optimizer = _fabric_setup()
    fabric.load(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    tail = _fabric_train(fabric, model, optimizer, STOP, STEPS)
    assert same(tail, straight[STOP:])
    assert same(_params(model), straight_params)


# -- transformers Trainer ------------------------------------------------------------------------
class _HFNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = AttnNet()

    def forward(self, x, labels):
        return {"loss": _loss(self.net(x), labels)}


def _hf_train(tmp_path, name, resume=None):
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState

    from dispatch_amp.integrations.transformers import Trainer

    AcceleratorState._reset_state(True)
    data = [{"x": x, "labels": y} for step in range(STEPS) for x, y in zip(*_batch(step))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-2, seed=0, report_to=[], save_strategy="steps", save_steps=STOP,
        logging_strategy="no", disable_tqdm=True, bf16=True,
    )
    trainer = Trainer(model=_HFNet(), args=args, train_dataset=data, amp_fp8=_recipe())
    ctx = _quiet()
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        ctx.__exit__(None, None, None)
    AcceleratorState._reset_state(True)
    return trainer


def test_transformers_trainer(tmp_path, same):
    from dispatch_amp.integrations._fp8_state import FILE_NAME

    straight = _hf_train(tmp_path, "straight")
    checkpoint = tmp_path / "straight" / f"checkpoint-{STOP}"
    assert ATTENTION_SITES <= _sites(torch.load(checkpoint / FILE_NAME, weights_only=True))
    tail = _hf_train(tmp_path, "tail", resume=str(checkpoint))
    assert same(_params(tail.model), _params(straight.model))


# -- accelerate ---------------------------------------------------------------------------------
def _accelerate_setup():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from dispatch_amp.integrations.accelerate import install_amp

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    install_amp(accelerator, fp8=_recipe())
    model = AttnNet()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _accelerate_train(accelerator, model, optimizer, start, stop):
    losses = []
    for step in range(start, stop):
        x, y = _batch(step)
        loss = _loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_accelerate(tmp_path, same):
    accelerator, model, optimizer = _accelerate_setup()
    straight = _accelerate_train(accelerator, model, optimizer, 0, STEPS)
    straight_params = _params(model)

    accelerator, model, optimizer = _accelerate_setup()
    _accelerate_train(accelerator, model, optimizer, 0, STOP)
    accelerator.save_state(tmp_path / "state", safe_serialization=False)

    accelerator, model, optimizer = _accelerate_setup()
    accelerator.load_state(tmp_path / "state")
    assert ATTENTION_SITES <= set(accelerator.dispatch_amp.fp8.state_dict()["sites"])
    tail = _accelerate_train(accelerator, model, optimizer, STOP, STEPS)
    assert same(tail, straight[STOP:])
    assert same(_params(model), straight_params)


# -- timm's loop ----------------------------------------------------------------------------------
def _timm_setup():
    from dispatch_amp.integrations.timm_scaler import NativeScaler

    model = AttnNet()
    recipe = _recipe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_scaler = NativeScaler(amp.GradScaler("cpu", init_scale=2.0**8), fp8=recipe)
    return model, recipe, optimizer, loss_scaler


def _timm_train(model, recipe, optimizer, loss_scaler, start, stop):
    losses = []
    for step in range(start, stop):
        x, y = _batch(step)
        with amp.autocast("cpu", dtype=torch.float16, fp8=recipe):
            loss = _loss(model(x), y)
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_timm_loop(tmp_path, same):
    model, recipe, optimizer, loss_scaler = _timm_setup()
    straight = _timm_train(model, recipe, optimizer, loss_scaler, 0, STEPS)
    straight_params = _params(model)

    model, recipe, optimizer, loss_scaler = _timm_setup()
    _timm_train(model, recipe, optimizer, loss_scaler, 0, STOP)
    # timm's CheckpointSaver: the model, the optimizer and the loss scaler's state_dict.
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                loss_scaler.state_dict_key: loss_scaler.state_dict()}, tmp_path / "checkpoint.pth.tar")

    model, recipe, optimizer, loss_scaler = _timm_setup()
    checkpoint = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    loss_scaler.load_state_dict(checkpoint[loss_scaler.state_dict_key])
    assert ATTENTION_SITES <= set(checkpoint["amp_scaler"]["dispatch_amp_fp8"]["sites"])
    tail = _timm_train(model, recipe, optimizer, loss_scaler, STOP, STEPS)
    assert same(tail, straight[STOP:])
    assert same(_params(model), straight_params)
