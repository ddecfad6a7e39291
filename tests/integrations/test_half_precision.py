"""Lightning's "16-true" / "bf16-true" through our opt levels, in the Trainer (plugin and our
Trainer) and in Fabric: O3 is Lightning's HalfPrecision bit for bit; O2 (float32 masters,
loss scale, float32 batch norms) is ``amp.initialize(opt_level="O2")`` bit for bit;
checkpoints resume exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import dispatch_amp as amp  # noqa: E402
from dispatch_amp.integrations.fabric import HalfPrecision as FabricHalfPrecision  # noqa: E402
from dispatch_amp.integrations.lightning import HalfPrecision, Trainer  # noqa: E402
from dispatch_amp.warning_types import AmpNumericsWarning  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import HalfPrecision as StockFabricHalfPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import HalfPrecision as StockHalfPrecision  # noqa: E402

PRECISIONS = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
INF_STEP = 2


def _data():
    g = torch.Generator().manual_seed(1)
    # Targets on a 1/4 grid: exact in both 16-bit dtypes, so casting the batch loses nothing.
    return torch.randn(8, 8, generator=g), torch.randint(-8, 8, (8, 4), generator=g) / 4


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class Net(pl.LightningModule):
    """Records per step the loss, the gradients the optimizer sees (after Lightning's unscale)
    and the loss scale."""

    def __init__(self, inf_step=None, manual=False):
        super().__init__()
        self.net = _net()
        self.inf_step = inf_step
        self.automatic_optimization = not manual
        self.losses, self.grads, self.scales = [], [], []

    def _loss(self, batch):
        x, y = batch
        if self.global_step == self.inf_step:
            x = x * float("inf")
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.detach().clone())
        return loss

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self._loss(batch))
        opt.step()

    def on_before_optimizer_step(self, optimizer):
        self.grads.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else scaler.get_scale())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=8)


def _trainer(cls=pl.Trainer, steps=5, **kwargs):
    kwargs.setdefault("logger", False)
    return cls(accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _fit(plugin=None, steps=5, inf_step=None, ckpt_path=None, manual=False, cls=pl.Trainer, **kwargs):
    model = Net(inf_step, manual)
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    trainer = _trainer(cls, steps, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|LitLogger).*")
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _reference_o2(dtype, steps=5, inf_step=None, clip=None):
    """The same training written with amp.initialize / scale_loss (model outputs left in 16 bits,
    as Lightning does)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, opt = amp.initialize(net, opt, opt_level="O2", dtype=dtype, cast_model_outputs=dtype)
    x, y = _data()
    losses = []
    for step in range(steps):
        xs = x * float("inf") if step == inf_step else x
        loss = torch.nn.functional.mse_loss(net(xs).float(), y.to(dtype).float())
        losses.append(loss.detach())
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
    return net, opt, losses


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o3_is_lightnings_half_precision_bit_for_bit(same, precision):
    stock, _ = _fit(StockHalfPrecision(precision))
    ours, trainer = _fit(HalfPrecision(precision, "cpu"))
    assert trainer.precision_plugin.scaler is None
    assert same(ours.losses, stock.losses) and same(ours.grads, stock.grads)
    assert same(list(ours.parameters()), list(stock.parameters()))
    assert same(list(ours.buffers()), list(stock.buffers()))
    assert {p.dtype for p in ours.parameters()} == {PRECISIONS[precision]}
    # The checkpoint is Lightning's too: 16-bit weights, no plugin state.
    assert same(ours.state_dict(), stock.state_dict())


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_equals_amp_initialize_bit_for_bit(same, precision, clip):
    dtype = PRECISIONS[precision]
    ref_net, ref_opt, ref_losses = _reference_o2(dtype, inf_step=INF_STEP, clip=clip)
    kwargs = {} if clip is None else {"gradient_clip_val": clip}
    ours, trainer = _fit(HalfPrecision(precision, "cpu", opt_level="O2"), inf_step=INF_STEP, **kwargs)
    assert same(ours.losses, ref_losses)
    assert same(list(ours.net.parameters()), list(ref_net.parameters()))
    assert same(list(ours.net.buffers()), list(ref_net.buffers()))
    masters = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    assert {p.dtype for p in masters} == {torch.float32}
    assert same(masters, list(amp.master_params(ref_opt)))
    assert trainer.precision_plugin.scaler.get_scale() == amp.loss_scalers(ref_opt)[0].get_scale() == 2.0**15
    # the 16-bit weights, float32 batch norm; the gradients seen before each step are float32
    assert [p.dtype for p in ours.net.parameters()] == [dtype, dtype, torch.float32, torch.float32, dtype, dtype]
    assert all(g.dtype is torch.float32 for step in ours.grads for g in step)
    assert not torch.isfinite(ours.grads[INF_STEP][0]).all()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_o2_skips_an_overflow_step_and_leaves_everything_unchanged(same, precision):
    before, t_before = _fit(HalfPrecision(precision, "cpu", opt_level="O2"), steps=2)
    after, t_after = _fit(HalfPrecision(precision, "cpu", opt_level="O2"), steps=3, inf_step=2)
    assert same(list(after.parameters()), list(before.parameters()))
    state = lambda t: [v for s in t.optimizers[0].state.values() for v in s.values()]  # noqa: E731
    assert same(state(t_after), state(t_before))
    assert after.scales[-1] == before.scales[-1] / 2


def test_manual_optimization_equals_automatic(same):
    auto, _ = _fit(HalfPrecision("16-true", "cpu", opt_level="O2"), inf_step=INF_STEP)
    manual, _ = _fit(HalfPrecision("16-true", "cpu", opt_level="O2"), inf_step=INF_STEP, manual=True)
    assert same(manual.losses, auto.losses) and same(manual.scales, auto.scales)
    assert same(list(manual.parameters()), list(auto.parameters()))


@pytest.mark.parametrize("first,second", [("ours", "ours"), ("stock", "ours"), ("ours", "stock")])
def test_o2_checkpoints_resume_exactly_and_move_to_and_from_stock(tmp_path, same, first, second):
    make = {"ours": lambda: HalfPrecision("16-true", "cpu", opt_level="O2"), "stock": lambda: StockHalfPrecision("16-true")}
    straight, _ = _fit(make["ours"](), steps=6, inf_step=4)
    head, trainer = _fit(make[first](), steps=3, inf_step=4)
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    if first == "ours":
        # the float32 masters and the loss scale, under the plugin's class name
        assert {v.dtype for k, v in saved["state_dict"].items() if "weight" in k} == {torch.float32}
        assert saved["HalfPrecision"]["scale"] == head.scales[-1]
    # Lightning's plugin has no loss scale: an inf step would wreck its weights, so none there.
    tail, trainer = _fit(make[second](), steps=6, inf_step=4 if second == "ours" else None, ckpt_path=path)
    if first == second == "ours":
        assert tail.scales == straight.scales[3:]
        assert same(tail.losses, straight.losses[3:])
        assert same(list(tail.parameters()), list(straight.parameters()))
    else:  # the other plugin trains on from the saved weights
        assert len(tail.losses) == 3 and all(torch.isfinite(v).all() for v in tail.parameters())


def test_keep_batchnorm_fp32_without_master_weights():
    model, trainer = _fit(HalfPrecision("bf16-true", "cpu", keep_batchnorm_fp32=True))
    assert trainer.precision_plugin.scaler is None
    assert [p.dtype for p in model.net.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    assert model.net[1].running_mean.dtype is torch.float32
    assert all(torch.isfinite(l) for l in model.losses)


class RegionProbe(Net):
    def training_step(self, batch, batch_idx):
        self.seen = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.get_default_dtype())
        return super().training_step(batch, batch_idx)


def test_a_policy_runs_the_forward_inside_our_autocast():
    plugin = HalfPrecision("bf16-true", "cpu", policy=amp.Policy.for_device("cpu"))
    assert plugin.props.patch_torch_functions
    model = RegionProbe()
    trainer = _trainer(steps=1, plugins=[plugin])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LitLogger).*")
        trainer.fit(model)
    assert model.seen == (True, torch.bfloat16, torch.bfloat16)
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm"])
    with HalfPrecision("bf16-true", "cpu", policy=policy).forward_context():  # the policy decides
        assert model.net[0](torch.ones(2, 8, dtype=torch.bfloat16)).dtype is torch.float32
    with HalfPrecision("bf16-true", "cpu").forward_context():
        assert not torch.is_autocast_enabled("cpu") and torch.get_default_dtype() is torch.bfloat16


def test_an_fp8_recipe_runs_the_linears_in_fp8():
    from dispatch_amp import fp8

    recipe = fp8.CurrentScaling()
    plugin = HalfPrecision("bf16-true", "cpu", fp8=recipe)
    with plugin.forward_context():
        y = torch.nn.Linear(16, 32, dtype=torch.bfloat16)(torch.randn(16, 16, dtype=torch.bfloat16))
    assert y.dtype is torch.bfloat16 and [r.calls for r in recipe.report()] == [1]


def test_our_trainer_takes_true_precisions_as_written(same):
    stock, _ = _fit(precision="bf16-true")
    ours, trainer = _fit(precision="bf16-true", cls=Trainer)
    assert isinstance(trainer.precision_plugin, HalfPrecision)
    assert same(ours.losses, stock.losses) and same(list(ours.parameters()), list(stock.parameters()))

    explicit, _ = _fit(HalfPrecision("16-true", "cpu", opt_level="O2", loss_scale=128.0), inf_step=INF_STEP)
    written, trainer = _fit(precision="16-true", cls=Trainer, amp_opt_level="O2",
                            amp_opt_overrides={"loss_scale": 128.0}, inf_step=INF_STEP)
    assert trainer.precision_plugin.props.loss_scale == 128.0
    assert written.scales == explicit.scales == [128.0] * 5, "a static scale stays, also after the skipped step"
    assert same(written.losses, explicit.losses) and same(list(written.parameters()), list(explicit.parameters()))


def test_amp_metrics_show_the_skipped_step_of_a_true_precision(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="run")
    model, _ = _fit(precision="16-true", cls=Trainer, amp_opt_level="O2", inf_step=INF_STEP,
                    logger=logger, log_every_n_steps=1)
    logger.save()
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("amp/loss_scale")]
    assert [float(r["amp/loss_scale"]) for r in rows] == model.scales
    assert [float(r["amp/skipped_steps"]) for r in rows] == [0, 0, 1, 1, 1]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="not a true precision"):
        HalfPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match="keeps the weights in float32"):
        HalfPrecision("bf16-true", "cpu", opt_level="O1")
    with pytest.raises(ValueError, match="no master weights"):  # float16 gradients cannot be unscaled
        HalfPrecision("16-true", "cpu", loss_scale="dynamic")
    with pytest.raises(ValueError, match="patch_torch_functions=False"):
        HalfPrecision("bf16-true", "cpu", policy=amp.Policy.for_device("cpu"), patch_torch_functions=False)
    with pytest.raises(ValueError, match="unsupported device type 'hpu'"):
        HalfPrecision("bf16-true", "hpu")
    with pytest.raises(ValueError, match="amp_opt_level/amp_opt_overrides apply to precision='16-true'"):
        Trainer(accelerator="cpu", precision="bf16-mixed", amp_opt_level="O2")
    with pytest.raises(ValueError, match="amp_scaler_options applies to precision='16-mixed'"):
        Trainer(accelerator="cpu", precision="16-true", amp_scaler_options={})
    with pytest.raises(ValueError, match="runs only Lightning's own precision plugin"):
        Trainer(accelerator="cpu", precision="bf16-true", strategy="fsdp")


def test_a_model_cast_by_other_options_or_by_initialize_is_refused():
    plugin = HalfPrecision("16-true", "cpu", opt_level="O2")
    model = _net()
    plugin.convert_module(model)
    plugin.convert_module(model)  # again (validate after fit): nothing changes
    assert len(plugin._pairs) == 4
    with pytest.raises(RuntimeError, match="cast for opt_level O2"):
        HalfPrecision("16-true", "cpu", opt_level="O2", keep_batchnorm_fp32=False).convert_module(model)
    initialized = amp.initialize(_net(), opt_level="O2")
    with pytest.raises(RuntimeError, match="prepared by amp.initialize"):
        plugin.convert_module(initialized)


def test_an_optimizer_with_16_bit_state_warns_when_its_masters_arrive():
    from dispatch_amp.integrations._half import swap_masters_into

    low = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    master = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([low], lr=0.1, momentum=0.9)
    low.grad = torch.ones_like(low)
    opt.step()
    with pytest.warns(AmpNumericsWarning, match="stored in 16 bits"):
        swap_masters_into(opt, [(low, master)])
    assert opt.param_groups[0]["params"] == [master]
    assert opt.state[master]["momentum_buffer"].dtype is torch.float32


DDP_SCRIPT = '''
import sys, warnings, torch, lightning.pytorch as pl
warnings.filterwarnings("ignore")
from dispatch_amp.integrations.lightning import HalfPrecision

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 2 and self.global_rank == 1:  # one rank overflows
            x = x * float("inf")
        return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=g), torch.randint(-8, 8, (8, 4), generator=g) / 4)
        return torch.utils.data.DataLoader(data, batch_size=4)

    def on_train_end(self):
        opt = self.trainer.optimizers[0]
        torch.save({"masters": [p.detach() for g in opt.param_groups for p in g["params"]],
                    "params": [p.detach() for p in self.parameters()],
                    "scale": self.trainer.precision_plugin.scaler.get_scale()},
                   f"{sys.argv[1]}/rank{self.global_rank}.pt")

if __name__ == "__main__":
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, logger=False,
               plugins=[HalfPrecision("16-true", "cpu", opt_level="O2")], enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Net())
'''


def test_o2_under_ddp_keeps_the_ranks_in_step(tmp_path, same):
    import subprocess
    import sys

    script = tmp_path / "ddp_half.py"
    script.write_text(DDP_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert same(ranks[0]["masters"], ranks[1]["masters"]) and same(ranks[0]["params"], ranks[1]["params"])
    assert {p.dtype for p in ranks[0]["masters"]} == {torch.float32}
    assert {p.dtype for p in ranks[0]["params"]} == {torch.float16}
    # rank 1's overflow reached rank 0 through the all-reduced gradients: both skipped and backed off
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0**15
    assert all(torch.isfinite(p).all() for p in ranks[0]["masters"])


# -- Fabric ----------------------------------------------------------------------------------
def _fabric(plugin):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GPU available.*")
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def _fabric_setup(plugin, optimizer_after_setup=False):
    fabric = _fabric(plugin)
    model = _net()
    if optimizer_after_setup:  # the order sharded strategies ask for
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _fabric_train(fabric, model, optimizer, steps, start=0, inf_step=None, clip=None):
    x, y = _data()
    losses = []
    for step in range(start, steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x * float("inf") if step == inf_step else x), y)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip, error_if_nonfinite=False)
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def _fabric_reference_o2(dtype, steps, inf_step, clip):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, opt = amp.initialize(net, opt, opt_level="O2", dtype=dtype)  # float32 outputs, as Fabric's
    x, y = _data()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x * float("inf") if step == inf_step else x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        losses.append(loss.detach())
    return net, opt, losses


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_o3_is_fabrics_half_precision_bit_for_bit(same, precision):
    fabric, stock_model, opt = _fabric_setup(StockFabricHalfPrecision(precision))
    stock = _fabric_train(fabric, stock_model, opt, 5)
    fabric, model, opt = _fabric_setup(FabricHalfPrecision(precision, "cpu"))
    ours = _fabric_train(fabric, model, opt, 5)
    assert fabric.strategy.precision.scaler is None
    assert same(ours, stock) and same(list(model.parameters()), list(stock_model.parameters()))
    assert same(model.state_dict(), stock_model.state_dict())


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_o2_equals_amp_initialize_bit_for_bit(same, precision, clip):
    dtype = PRECISIONS[precision]
    ref_net, ref_opt, ref_losses = _fabric_reference_o2(dtype, 5, INF_STEP, clip)
    fabric, model, opt = _fabric_setup(FabricHalfPrecision(precision, "cpu", opt_level="O2"))
    losses = _fabric_train(fabric, model, opt, 5, inf_step=INF_STEP, clip=clip)
    assert same(losses, ref_losses)
    assert same(list(model.parameters()), list(ref_net.parameters()))
    assert same(list(model.buffers()), list(ref_net.buffers()))
    masters = list(fabric.strategy.precision.main_params(opt.optimizer))
    assert {p.dtype for p in masters} == {torch.float32} and same(masters, list(amp.master_params(ref_opt)))
    scaler = fabric.strategy.precision.scaler
    assert scaler.get_scale() == amp.loss_scalers(ref_opt)[0].get_scale() and scaler.skipped_steps == 1
    assert same(model.state_dict(), ref_net.state_dict()), "both save the float32 masters"


def test_fabric_optimizer_made_after_setup_module_gets_the_masters(same):
    fabric, usual_model, opt = _fabric_setup(FabricHalfPrecision("16-true", "cpu", opt_level="O2"))
    usual = _fabric_train(fabric, usual_model, opt, 4, inf_step=INF_STEP)
    fabric, model, opt = _fabric_setup(FabricHalfPrecision("16-true", "cpu", opt_level="O2"), optimizer_after_setup=True)
    later = _fabric_train(fabric, model, opt, 4, inf_step=INF_STEP)
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}
    assert same(later, usual) and same(list(model.parameters()), list(usual_model.parameters()))


def test_fabric_resume_from_fabric_save_continues_bit_identically(tmp_path, same):
    plugin = lambda: FabricHalfPrecision("16-true", "cpu", opt_level="O2")  # noqa: E731
    fabric, model, opt = _fabric_setup(plugin())
    straight = _fabric_train(fabric, model, opt, 6, inf_step=4)

    fabric, head, head_opt = _fabric_setup(plugin())
    _fabric_train(fabric, head, head_opt, 3, inf_step=4)
    fabric.save(tmp_path / "ckpt.pt", {"model": head, "optimizer": head_opt, "amp": fabric.strategy.precision.state_dict()})

    fabric, tail, tail_opt = _fabric_setup(plugin())
    rest = fabric.load(tmp_path / "ckpt.pt", {"model": tail, "optimizer": tail_opt})
    fabric.strategy.precision.load_state_dict(rest["amp"])
    assert same(list(fabric.strategy.precision.main_params(tail_opt.optimizer)),
                list(fabric.strategy.precision.main_params(head_opt.optimizer))), "masters loaded unrounded"
    rest_losses = _fabric_train(fabric, tail, tail_opt, 6, start=3, inf_step=4)
    assert same(rest_losses, straight[3:]) and same(list(tail.parameters()), list(model.parameters()))


def test_fabric_forward_runs_in_our_autocast_with_a_policy():
    plugin = FabricHalfPrecision("bf16-true", "cpu", policy=amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm"]))
    fabric = _fabric(plugin)
    model = fabric.setup(torch.nn.Linear(4, 4))
    assert model.weight.dtype is torch.bfloat16
    with fabric.autocast():  # the forward's context
        assert torch.is_autocast_enabled("cpu") and torch.get_default_dtype() is torch.bfloat16
        assert model.module(torch.ones(2, 4, dtype=torch.bfloat16)).dtype is torch.float32  # the policy's linear
    with _fabric(FabricHalfPrecision("bf16-true", "cpu")).autocast():
        assert not torch.is_autocast_enabled("cpu")
