"""Lightning Trainer: our plugin trains bit-identically to Lightning's MixedPrecision, and
checkpoints move between the two with the loss scale kept; fp8 recipes as users meet them
(validate before fit, ddp_spawn, true precisions at O2)."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import dispatch_amp as amp  # noqa: E402
from dispatch_amp.integrations.lightning import HalfPrecision, MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as StockMixedPrecision  # noqa: E402

INF_STEP = 2


class Tiny(pl.LightningModule):
    """Records per step the loss, the gradients the optimizer sees, and the loss scale."""

    def __init__(self, inf_step: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.inf_step = inf_step
        self.losses, self.grads, self.scales = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.inf_step:
            x = x * float("inf")
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning unscales before this hook, so these are the true gradients.
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        # One batch per epoch: a resumed run sees the same data as an uninterrupted one.
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(plugin, steps: int, inf_step=INF_STEP, ckpt_path=None, plan=None, **trainer_kwargs) -> tuple[Tiny, pl.Trainer]:
    model = Tiny(inf_step)
    if plan is not None:
        plan.bind(model)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available).*")
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _stock_fp16():
    return StockMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2))


def _ours_fp16(cls=MixedPrecision):
    return cls("16-mixed", "cpu", scaler_options={"init_scale": 2.0**8, "growth_interval": 2})


def test_bf16_is_bit_identical_to_lightnings_plugin(same):
    stock, _ = _fit(StockMixedPrecision("bf16-mixed", "cpu"), 4)
    ours, _ = _fit(MixedPrecision("bf16-mixed", "cpu"), 4)
    assert same(ours.losses, stock.losses) and same(ours.grads, stock.grads)
    assert same(list(ours.parameters()), list(stock.parameters()))


def test_fp16_with_clipping_and_an_overflow_is_bit_identical(same):
    stock, _ = _fit(_stock_fp16(), 5, gradient_clip_val=1.0)
    ours, trainer = _fit(_ours_fp16(), 5, gradient_clip_val=1.0)
    assert isinstance(trainer.precision_plugin.scaler, amp.GradScaler)
    assert ours.scales == stock.scales
    assert ours.scales[INF_STEP] == ours.scales[INF_STEP - 1] / 2, "the overflow step backs off"
    assert not torch.isfinite(ours.grads[INF_STEP][0]).all()
    assert same(ours.losses, stock.losses) and same(ours.grads, stock.grads)
    assert same(list(ours.parameters()), list(stock.parameters()))


@pytest.mark.parametrize(
    "first,second",
    [(_ours_fp16, _ours_fp16), (_stock_fp16, _ours_fp16), (_ours_fp16, _stock_fp16)],
    ids=["ours-to-ours", "stock-to-ours", "ours-to-stock"],
)
def test_resume_continues_bit_identically_with_the_scale_kept(tmp_path, same, first, second):
    # The overflow falls after the resume, so the resumed run must also skip it the same way.
    straight, _ = _fit(_ours_fp16(), 6, inf_step=4)

    head, trainer = _fit(first(), 3, inf_step=4)
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved[StockMixedPrecision.__qualname__]["scale"] == head.scales[-1]
    assert head.scales[-1] != 2.0**8, "the scale moved, so a reset to init_scale would show"

    tail, trainer = _fit(second(), 6, inf_step=4, ckpt_path=path)
    assert trainer.precision_plugin.scaler.get_scale() == straight.scales[-1]
    assert tail.scales == straight.scales[3:]
    assert same(tail.losses, straight.losses[3:]) and same(tail.grads, straight.grads[3:])
    assert same(list(tail.parameters()), list(straight.parameters()))


def test_a_subclass_files_its_scaler_under_the_stock_key(tmp_path):
    class MyAmp(MixedPrecision):
        pass

    _, trainer = _fit(_ours_fp16(MyAmp), 3, inf_step=None)
    path = tmp_path / "sub.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert "MyAmp" not in saved and saved[StockMixedPrecision.__qualname__]["scale"] == 2.0**9

    for plugin in (_stock_fp16(), _ours_fp16(MyAmp)):
        _fit(plugin, 3, inf_step=None, ckpt_path=path)
        assert plugin.scaler.get_scale() == 2.0**9, f"{type(plugin).__name__} resumed with the saved scale"


def test_plugin_arguments_are_checked():
    with pytest.raises(ValueError, match="'16-mixed'.*'bf16-mixed'"):
        MixedPrecision("32-true", "cpu")
    with pytest.raises(ValueError, match="bf16-mixed' uses no loss scaling"):
        MixedPrecision("bf16-mixed", "cpu", scaler=amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="not both"):
        MixedPrecision("16-mixed", "cpu", scaler=amp.GradScaler("cpu"), scaler_options={})
    with pytest.raises(RuntimeError, match="unsupported device_type 'hpu'"):  # torch's type
        MixedPrecision("bf16-mixed", "hpu")
    for device in ("mps", "xpu"):
        plugin = MixedPrecision("16-mixed", device)
        assert plugin.autocast_context_manager().device_type == device
        assert plugin.policy is None or plugin.policy == amp.Policy.for_device(device)
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"])
    with MixedPrecision("bf16-mixed", "cpu", policy=policy).forward_context():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is torch.float32


class Fp8Tiny(pl.LightningModule):
    """Dimensions the fp8 gemms take (multiples of 16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.out_dtypes = []

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        self.out_dtypes.append(out.dtype)
        return out.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
        return torch.utils.data.DataLoader(data, batch_size=16)


def test_the_plugin_takes_an_fp8_recipe():
    from dispatch_amp import fp8

    plugin = MixedPrecision("bf16-mixed", "cpu", fp8=fp8.DelayedScaling(amax_history_len=4))
    model = Fp8Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available).*")
        trainer.fit(model)
    recipe = trainer.precision_plugin.fp8
    assert isinstance(recipe, fp8.DelayedScaling) and "fp8=DelayedScaling(" in repr(trainer.precision_plugin)
    assert model.out_dtypes == [torch.bfloat16] * 3
    assert sorted(r.calls for r in recipe.report()) == [3, 3]  # both linears, every step, in fp8


# -- our Trainer(precision=...) and AmpMetrics ---------------------------------------------
def _fit_with(trainer_cls, steps, inf_step=INF_STEP, **kwargs):
    model = Tiny(inf_step)
    trainer = trainer_cls(
        accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available).*")
        trainer.fit(model)
    return model, trainer


def test_our_trainer_takes_precision_as_written_bit_identically(same):
    from dispatch_amp.integrations.lightning import Trainer

    stock, _ = _fit_with(pl.Trainer, 4, precision="bf16-mixed", logger=False)
    ours, trainer = _fit_with(Trainer, 4, precision="bf16-mixed", logger=False)
    assert isinstance(trainer.precision_plugin, MixedPrecision)
    assert same(ours.losses, stock.losses) and same(ours.grads, stock.grads)
    assert same(list(ours.parameters()), list(stock.parameters()))
    # 16-mixed: stock Lightning has no float16 on CPU; ours equals our plugin given explicitly.
    explicit, _ = _fit(_ours_fp16(), 5)
    written, trainer = _fit_with(Trainer, 5, precision="16-mixed", logger=False,
                                 amp_scaler_options={"init_scale": 2.0**8, "growth_interval": 2})
    assert isinstance(trainer.precision_plugin.scaler, amp.GradScaler)
    assert same(written.losses, explicit.losses) and written.scales == explicit.scales
    # Other precisions stay Lightning's; the amp_* keywords need a mixed precision.
    _, trainer = _fit_with(Trainer, 1, precision="32-true", logger=False)
    assert not isinstance(trainer.precision_plugin, MixedPrecision)
    with pytest.raises(ValueError, match="apply to precision='16-mixed', 'bf16-mixed', '16-true' or 'bf16-true'"):
        Trainer(accelerator="cpu", precision="32-true", amp_fp8=amp.fp8.CurrentScaling())
    for strategy in ("fsdp", "deepspeed_stage_2"):
        with pytest.raises(ValueError, match="runs only Lightning's own precision plugin"):
            Trainer(accelerator="cpu", precision="bf16-mixed", strategy=strategy)


def test_amp_metrics_reach_the_logger_and_show_the_skipped_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from dispatch_amp.integrations.lightning import Trainer

    logger = CSVLogger(str(tmp_path), name="run")
    model, trainer = _fit_with(Trainer, 5, precision="16-mixed", logger=logger, log_every_n_steps=1,
                               amp_scaler_options={"init_scale": 2.0**8, "growth_interval": 2})
    logger.save()
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("amp/loss_scale")]
    assert [float(r["amp/loss_scale"]) for r in rows] == model.scales
    assert [float(r["amp/skipped_steps"]) for r in rows] == [0, 0, 1, 1, 1]
    # Every logged step has every key (fixed schema); the count belongs to the skipped step.
    assert [float(r["amp/overflow_params"]) for r in rows] == [4.0 if k == INF_STEP else 0.0 for k in range(5)]


class ManyBatches(Tiny):
    """Six steps in one epoch: Lightning keeps a step-logged value for the whole epoch."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=1)


def test_overflow_params_is_logged_only_for_the_step_it_belongs_to(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from dispatch_amp.integrations.lightning import AmpMetrics

    logger = CSVLogger(str(tmp_path), name="run")
    model = ManyBatches(INF_STEP)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, plugins=[_ours_fp16()], logger=logger, log_every_n_steps=1,
        callbacks=[AmpMetrics()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available).*")
        trainer.fit(model)
    logger.save()
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("amp/loss_scale")]
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert [float(r["amp/overflow_params"]) for r in rows] == [4.0 if k == INF_STEP else 0.0 for k in range(6)]
    assert [float(r["amp/skipped_steps"]) for r in rows] == [float(k >= INF_STEP) for k in range(6)]


# -- our Trainer behaves as Lightning's, or says why not --------------------------------------
def _quiet_trainer(**kwargs):
    return dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_16_mixed_on_cpu_trains_float16_and_says_lightning_would_use_bfloat16():
    from dispatch_amp.integrations.lightning import Trainer

    with pytest.warns(UserWarning, match=r"Lightning's own Trainer would switch to precision='bf16-mixed'") as caught:
        trainer = Trainer(accelerator="cpu", precision="16-mixed", **_quiet_trainer())
    ours = [w for w in caught if "dispatch_amp trains in float16" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, "the warning points at the user's line"
    assert trainer.precision_plugin.precision == "16-mixed" and isinstance(trainer.precision_plugin.scaler, amp.GradScaler)
    # Lightning's own Trainer there: bfloat16, with a warning of its own.
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        assert pl.Trainer(accelerator="cpu", precision="16-mixed", **_quiet_trainer()).precision_plugin.precision == "bf16-mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bfloat16, or float16 off the CPU: nothing to say
        Trainer(accelerator="cpu", precision="bf16-mixed", **_quiet_trainer())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_missing_accelerator_gets_lightnings_error_and_no_warning_of_ours(accelerator):
    from dispatch_amp.integrations.lightning import Trainer

    with pytest.raises(Exception) as stock:
        pl.Trainer(accelerator=accelerator, precision="16-mixed", **_quiet_trainer())
    with warnings.catch_warnings(record=True) as caught, pytest.raises(type(stock.value)) as ours:
        warnings.simplefilter("always")
        Trainer(accelerator=accelerator, precision="16-mixed", **_quiet_trainer())
    assert str(ours.value) == str(stock.value)
    assert [str(w.message) for w in caught if "dispatch_amp" in w.filename] == []


def test_an_accelerator_lightning_accepts_but_we_find_no_device_for_is_refused(monkeypatch):
    from dispatch_amp.integrations import _precision_flags
    from dispatch_amp.integrations.lightning import Trainer

    monkeypatch.setattr(_precision_flags, "device_available", lambda device: False)
    with pytest.raises(RuntimeError, match="finds no such device here, yet Lightning accepted it"):
        Trainer(accelerator="cpu", precision="bf16-mixed", **_quiet_trainer())


def test_precision_beside_a_plugin_is_taken_when_they_agree_and_refused_clearly_when_not():
    from dispatch_amp.integrations.lightning import Trainer

    plugin = MixedPrecision("bf16-mixed", "cpu")
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[plugin], **_quiet_trainer())
    assert trainer.precision_plugin is plugin
    assert Trainer(accelerator="cpu", precision="bf16", plugins=plugin, **_quiet_trainer()).precision_plugin is plugin
    half = HalfPrecision("bf16-true", "cpu")
    assert Trainer(accelerator="cpu", precision="bf16-true", plugins=[half], **_quiet_trainer()).precision_plugin is half
    for precision in ("16-mixed", "32-true"):
        with pytest.raises(ValueError, match=rf"precision={precision!r}\) was given together with plugins=.*pass one of them"):
            Trainer(accelerator="cpu", precision=precision, plugins=[plugin], **_quiet_trainer())
    with pytest.raises(ValueError, match="amp_scaler_options configure the plugin this Trainer builds"):
        Trainer(accelerator="cpu", precision="16-mixed", plugins=[_ours_fp16()], amp_scaler_options={"init_scale": 2.0},
                **_quiet_trainer())
    # Lightning's plugin beside precision= is the same case.
    stock = StockMixedPrecision("bf16-mixed", "cpu")
    assert Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[stock], **_quiet_trainer()).precision_plugin is stock


def test_an_accelerator_object_is_taken_as_lightning_takes_it(same):
    from lightning.pytorch.accelerators import CPUAccelerator

    from dispatch_amp.integrations.lightning import Trainer

    by_name, _ = _fit_with(Trainer, 3, precision="bf16-mixed", logger=False)
    model = Tiny(INF_STEP)
    trainer = Trainer(accelerator=CPUAccelerator(), devices=1, max_steps=3, precision="bf16-mixed", num_sanity_val_steps=0,
                      **_quiet_trainer())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available).*")
        trainer.fit(model)
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.device == "cpu"
    assert same(model.losses, by_name.losses)
    with pytest.raises(ValueError, match="cannot tell the autocast device of accelerator=<object"):
        Trainer(accelerator=object(), precision="bf16-mixed", **_quiet_trainer())


def test_a_plugin_without_a_device_names_the_plugin_and_the_fix():
    with pytest.raises(TypeError, match=r"MixedPrecision\('16-mixed'\) needs the device type .* MixedPrecision\('16-mixed', 'cuda'\)") as err:
        MixedPrecision("16-mixed")
    assert "PolicyPrecision" not in str(err.value)


# -- fp8 recipes as users meet them: validate first, ddp_spawn, true precisions ----------------
def _quiet_fit(trainer, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|bfloat16|GPU available|val_dataloader"
                                                  "|Skipping val loop|process group).*")
        return trainer.fit(*args, **kwargs)


class Fp8Eval(Fp8Tiny):
    """Fp8Tiny with an evaluation: the losses it trains on, and a validation set given to
    ``trainer.validate`` only (so ``fit`` runs no validation of its own)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()


VAL_X = torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) * 3  # other amaxes than training's


def _val_loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(VAL_X), batch_size=16)


def _fp8_trainer(recipe, steps, **kwargs):
    from dispatch_amp.integrations.lightning import Trainer

    return Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="bf16-mixed", amp_fp8=recipe,
                   num_sanity_val_steps=0, **_quiet_trainer(**kwargs))


def _fit_fp8_eval(recipe, steps, validate_first):
    model = Fp8Eval()
    trainer = _fp8_trainer(recipe, steps)
    if validate_first:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            trainer.validate(model, dataloaders=_val_loader(), verbose=False)
    _quiet_fit(trainer, model)
    return model


@pytest.mark.parametrize("make", [amp.fp8.CurrentScaling, amp.fp8.RowwiseScaling], ids=["current", "rowwise"])
def test_validate_before_fit_leaves_a_stateless_recipe_training_as_without(same, make):
    # trainer.validate runs under torch.inference_mode: the fp8 path's first call there
    # must leave nothing (an inference tensor) that training later updates in place.
    straight = _fit_fp8_eval(make(), 3, validate_first=False)
    after = _fit_fp8_eval(make(), 3, validate_first=True)
    assert after.out_dtypes == [torch.bfloat16] * 3
    assert same(after.losses, straight.losses)
    assert same(list(after.parameters()), list(straight.parameters()))


def test_validate_before_fit_records_into_a_delayed_recipe_as_documented(same):
    # docs/fp8.md: every call records, evaluation calls included. So the fit after the
    # validate is the same model trained by hand after the same evaluation forwards, and
    # the validation's amaxes are in the histories.
    steps = 3
    recipe = amp.fp8.DelayedScaling(amax_history_len=8)
    model = _fit_fp8_eval(recipe, steps, validate_first=True)

    by_hand = Fp8Eval()
    mine = amp.fp8.DelayedScaling(amax_history_len=8)
    region = amp.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, fp8=mine)
    with torch.inference_mode(), region:
        for (x,) in _val_loader():
            by_hand.validation_step((x,), 0)
    optimizer = by_hand.configure_optimizers()
    for (x,) in list(by_hand.train_dataloader()) * steps:
        with amp.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, fp8=mine):
            loss = by_hand.training_step((x,), 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert same(model.losses, by_hand.losses)
    assert same(list(model.parameters()), list(by_hand.parameters()))
    assert same(recipe.state_dict(), mine.state_dict())

    # The oldest input amax of the first layer is the first validation batch's.
    history = recipe.state_dict()["sites"]["net.0"]["input_history"]
    assert history.dtype == torch.float32
    amaxes = [x.abs().max() for (x,) in _val_loader()]
    want_tail = torch.stack(amaxes[::-1]).float()  # newest first: the second batch, then the first
    assert torch.equal(history[steps:steps + 2], want_tail)


# Names the filter was asked for, in this process (each spawned process has its own).
_ASKED: list = []


def _fp8_but_the_head(name, input_shape, weight_shape):
    _ASKED.append(name)
    return name != "net.2"


class SpawnFp8(Fp8Tiny):
    """Two ranks, one batch of 16 rows each per step (DistributedSampler: rank r gets rows
    r, r+2, ...); rank 1's rows are three times larger, so its amaxes are the larger ones.
    Each process files what its recipe saw at the end of training."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def train_dataloader(self):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
        x[1::2] *= 3
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)

    def on_train_end(self):
        recipe = self.trainer.precision_plugin.fp8
        torch.save({"asked": sorted(set(_ASKED), key=str), "calls": {r.name: r.calls for r in recipe.report()},
                    "state": recipe.state_dict(), "rows": self.trainer.train_dataloader.dataset.tensors[0].shape[0]},
                   f"{self.out_dir}/rank{self.global_rank}.pt")


def test_ddp_spawn_trains_a_bound_delayed_recipe_with_a_filter_by_name(tmp_path, same):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dispatch_amp.integrations.lightning import Trainer

    steps = 2
    model = SpawnFp8(str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    recipe = amp.fp8.DelayedScaling(amax_history_len=4, filter_fn=_fp8_but_the_head).bind(model)
    sent = recipe.state_dict()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=steps, precision="bf16-mixed",
                      amp_fp8=recipe, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))],
                      logger=False, enable_progress_bar=False, enable_model_summary=False, amp_metrics=False)
    _quiet_fit(trainer, model)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for got in ranks:
        assert got["asked"] == ["net.0", "net.2"], "the filter is asked by the bound names in every process"
        assert got["calls"] == {"net.0": steps}, "the head, which the filter refuses, never ran in fp8"
    # One reduced history on both ranks, and in rank 0's: rank 1's (larger) input amaxes.
    assert same(ranks[0]["state"], ranks[1]["state"])
    x = model.train_dataloader().dataset.tensors[0]
    history = ranks[0]["state"]["sites"]["net.0"]["input_history"]
    assert history.dtype == torch.float32
    assert torch.equal(history, torch.stack([x.abs().max()] * steps + [torch.tensor(0.0)] * 2))
    assert x[1::2].abs().max() > x[0::2].abs().max()
    # The head's site was never used: its state is as sent.
    assert same(ranks[0]["state"]["sites"]["net.2"], sent["sites"]["net.2"])

    # Lightning sends back rank 0's weights, and the checkpoint holds rank 0's recipe state;
    # the parent's recipe is the one it had before fit (a pickled recipe is a recipe of its own).
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    assert same(saved["dispatch_amp_fp8"], ranks[0]["state"])
    assert same(recipe.state_dict(), sent)


@pytest.mark.parametrize("precision,dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_precisions_at_o2_train_a_bound_delayed_recipe(same, precision, dtype):
    # Lightning's HalfPrecision switches the default dtype to 16 bits around each step;
    # the recipe's scales and histories must stay float32 (torch._scaled_mm takes no other).
    from dispatch_amp.integrations.lightning import Trainer

    steps = 3
    model = Fp8Eval()
    recipe = amp.fp8.DelayedScaling(amax_history_len=4).bind(model)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, precision=precision, amp_opt_level="O2",
                      amp_fp8=recipe, num_sanity_val_steps=0, **_quiet_trainer())
    _quiet_fit(trainer, model)

    assert trainer.precision_plugin.props.master_weights and len(model.losses) == steps
    assert all(torch.isfinite(loss) for loss in model.losses) and model.out_dtypes == [dtype] * steps
    assert all(p.dtype == dtype for p in model.parameters())
    # The 16-bit weights that replaced the bound float32 ones took over their sites.
    assert sorted((r.name, r.calls) for r in recipe.report()) == [("net.0", steps), ("net.2", steps)]
    state = recipe.state_dict()
    assert sorted(state["sites"]) == ["net.0", "net.2"]
    assert all(t.dtype == torch.float32 for site in state["sites"].values() for t in site.values()
               if t.is_floating_point())
    assert all(s.roles[role].f.dtype == torch.float32 for s in recipe.state.sites() for role in s.roles)
    # The first layer's input is the batch, cast to 16 bits by the plugin: every step's amax.
    x = model.train_dataloader().dataset.tensors[0]
    want = x.to(dtype).abs().max().float()
    assert torch.equal(state["sites"]["net.0"]["input_history"], torch.stack([want] * steps + [torch.tensor(0.0)]))
    scales = [s[f"{role}_scale"] for s in state["sites"].values() for role in ("input", "weight")]
    assert all(torch.isfinite(t).all() and (t > 0).all() for t in scales)


def test_a_resume_runs_the_policy_the_checkpoint_was_trained_with(tmp_path, same):
    # Trained under a policy of its own (linear in float32); resumed by a plugin given
    # none: the checkpoint's policy is applied (with a warning naming the ops), so the
    # resumed steps match the uninterrupted run's.
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm"], name="linear in fp32")

    def ours(p):
        return MixedPrecision("bf16-mixed", "cpu", policy=p)

    straight, _ = _fit(ours(policy), 5, inf_step=None)
    head, trainer = _fit(ours(policy), 2, inf_step=None)
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert amp.config.load_state_dict(saved[amp.config.CHECKPOINT_KEY]) == policy

    plugin = ours(None)
    with pytest.warns(amp.AmpNumericsWarning, match=r"'linear in fp32' differs.*aten::addmm.*resumes with the checkpoint's"):
        tail, _ = _fit(plugin, 5, inf_step=None, ckpt_path=path)
    assert plugin.policy == policy
    assert same(tail.losses, straight.losses[2:]) and same(list(tail.parameters()), list(straight.parameters()))


def test_a_resume_runs_the_precision_plan_the_checkpoint_was_trained_with(tmp_path, same):
    # Trained with the last linear in float32 by a plan; resumed with no plan bound: the
    # checkpoint's plan is bound (with a warning), so the resumed steps match the
    # uninterrupted run's, which they would not in bfloat16.
    from dispatch_amp.autocast.plan import bound_plan

    def plan():
        return amp.PrecisionPlan({"net.2": torch.float32})

    def ours():
        return MixedPrecision("bf16-mixed", "cpu")

    straight, _ = _fit(ours(), 5, inf_step=None, plan=plan())
    head, trainer = _fit(ours(), 2, inf_step=None, plan=plan())
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["dispatch_amp_plan"]["plan"]["modules"] == [{"pattern": "net.2", "setting": "float32"}]

    with pytest.warns(amp.AmpNumericsWarning, match="no plan is bound.*resumes with the checkpoint's"):
        tail, _ = _fit(ours(), 5, inf_step=None, ckpt_path=path)
    assert bound_plan(tail) is not None
    assert same(tail.losses, straight.losses[2:]) and same(list(tail.parameters()), list(straight.parameters()))
    unplanned, _ = _fit(ours(), 5, inf_step=None)
    assert not same(unplanned.losses, straight.losses), "the plan changes the numbers (else this proves nothing)"


def test_a_bad_policy_in_a_checkpoint_fails_and_changes_nothing():
    plugin = MixedPrecision("16-mixed", "cpu", scaler_options={"init_scale": 8.0})
    ckpt = {}
    MixedPrecision("16-mixed", "cpu", scaler_options={"init_scale": 2.0}).on_save_checkpoint(ckpt)
    ckpt[amp.config.CHECKPOINT_KEY]["rules"]["lowr"] = ckpt[amp.config.CHECKPOINT_KEY]["rules"].pop("lower")
    with pytest.raises(amp.config.ConfigError, match="rules.lowr: unknown cast kind 'lowr'"):
        plugin.on_load_checkpoint(ckpt)
    assert plugin.scaler.get_scale() == 8.0 and plugin.policy is None
