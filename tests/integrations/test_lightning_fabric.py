"""Lightning Fabric: our plugin trains bit-identically to Fabric's MixedPrecision, and its
state saved with fabric.save loads into either plugin with the loss scale kept."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("lightning.fabric")

import dispatch_amp as amp  # noqa: E402
from dispatch_amp.integrations.fabric import MixedPrecision  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision as StockMixedPrecision  # noqa: E402

INIT = {"init_scale": 2.0**8, "growth_interval": 2}


def _stock(precision):
    scaler = torch.amp.GradScaler("cpu", **INIT) if precision == "16-mixed" else None
    return StockMixedPrecision(precision, "cpu", scaler=scaler)


def _ours(precision):
    return MixedPrecision(precision, "cpu", scaler_options=INIT if precision == "16-mixed" else None)


def _setup(plugin, plan=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(GPU available|bfloat16).*")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if plan is not None:
        plan.bind(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def _train(fabric, model, optimizer, steps, start=0, inf_step=None):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    scaler = fabric.strategy.precision.scaler
    losses, grads, scales = [], [], []
    for step in range(start, steps):
        optimizer.zero_grad()
        out = model(x * float("inf") if step == inf_step else x)   # Fabric's forward autocasts
        loss = torch.nn.functional.mse_loss(out, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)  # unscales first
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale() if scaler is not None else None)
    return losses, grads, scales


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_training_is_bit_identical_to_fabrics_plugin(same, precision):
    inf_step = 2 if precision == "16-mixed" else None
    fabric, stock_model, opt = _setup(_stock(precision))
    stock = _train(fabric, stock_model, opt, 5, inf_step=inf_step)
    fabric, model, opt = _setup(_ours(precision))
    ours = _train(fabric, model, opt, 5, inf_step=inf_step)
    assert isinstance(fabric.strategy.precision, MixedPrecision)
    assert ours[2] == stock[2]
    if inf_step is not None:
        assert ours[2][inf_step] == ours[2][inf_step - 1] / 2, "the overflow step backs off"
        assert fabric.strategy.precision.scaler.skipped_steps == 1
    assert same(ours[0], stock[0]) and same(ours[1], stock[1])
    assert same(list(model.parameters()), list(stock_model.parameters()))


@pytest.mark.parametrize("source", [_ours, _stock], ids=["from-ours", "from-stock"])
def test_resume_continues_bit_identically_with_the_scale_kept(tmp_path, same, source):
    fabric, model, opt = _setup(_ours("16-mixed"))
    straight = _train(fabric, model, opt, 6, inf_step=4)

    fabric, head_model, head_opt = _setup(source("16-mixed"))
    _train(fabric, head_model, head_opt, 3, inf_step=4)
    fabric.save(tmp_path / "ckpt.pt", {"model": head_model, "optimizer": head_opt,
                                       "amp": fabric.strategy.precision.state_dict()})

    fabric, tail_model, tail_opt = _setup(_ours("16-mixed"))
    rest = fabric.load(tmp_path / "ckpt.pt", {"model": tail_model, "optimizer": tail_opt})
    fabric.strategy.precision.load_state_dict(rest["amp"])
    assert fabric.strategy.precision.scaler.get_scale() == straight[2][2] != INIT["init_scale"]
    tail = _train(fabric, tail_model, tail_opt, 6, start=3, inf_step=4)
    assert tail[2] == straight[2][3:]
    assert same(tail[0], straight[0][3:]) and same(tail[1], straight[1][3:])
    assert same(list(tail_model.parameters()), list(model.parameters()))


def test_a_precision_plan_rides_in_the_model_state_and_a_resume_runs_it(tmp_path, same):
    # The last linear in float32 by a plan; fabric.save files it in the model's state dict,
    # and fabric.load into a model with no plan bound binds it (warning), so the resumed
    # steps match the uninterrupted run's.
    from dispatch_amp.autocast.plan import bound_plan

    def plan():
        return amp.PrecisionPlan({"2": torch.float32})

    fabric, model, opt = _setup(_ours("bf16-mixed"), plan())
    straight = _train(fabric, model, opt, 5)
    fabric, head_model, head_opt = _setup(_ours("bf16-mixed"), plan())
    _train(fabric, head_model, head_opt, 2)
    fabric.save(tmp_path / "ckpt.pt", {"model": head_model, "optimizer": head_opt})
    assert "dispatch_amp_plan" in torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]

    fabric, tail_model, tail_opt = _setup(_ours("bf16-mixed"))
    with pytest.warns(amp.AmpNumericsWarning, match="no plan is bound.*resumes with the checkpoint's"):
        fabric.load(tmp_path / "ckpt.pt", {"model": tail_model, "optimizer": tail_opt})
    assert bound_plan(tail_model.module) is not None
    tail = _train(fabric, tail_model, tail_opt, 5, start=2)
    assert same(tail[0], straight[0][2:]) and same(list(tail_model.parameters()), list(model.parameters()))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_fabric_made_inside_a_framework_is_reached_by_patch_torch(same, precision):
    # Frameworks that call Fabric(...) in their own setup (litgpt) cannot import ours:
    # docs/integrations.md sends them to patch_torch(), started before their Fabric is
    # made. Its plugin's scaler and every forward's autocast are then ours, and it trains
    # as our plugin does.
    inf_step = 2 if precision == "16-mixed" else None
    fabric, model, opt = _setup(_ours(precision))
    ours = _train(fabric, model, opt, 4, inf_step=inf_step)
    with amp.patch_torch():
        fabric, patched_model, opt = _setup(_stock(precision))   # Lightning's own plugin
        assert type(fabric.strategy.precision.forward_context()).__module__ == "dispatch_amp.torch_patch"
        patched = _train(fabric, patched_model, opt, 4, inf_step=inf_step)
    scaler = fabric.strategy.precision.scaler
    assert (scaler is None) == (precision == "bf16-mixed")
    if scaler is not None:
        assert isinstance(scaler, amp.GradScaler) and scaler.skipped_steps == 1
    assert patched[2] == ours[2]
    assert same(patched[0], ours[0]) and same(patched[1], ours[1])
    assert same(list(patched_model.parameters()), list(model.parameters()))


def test_fabric_autocast_is_ours_with_the_policy():
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"])
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("bf16-mixed", "cpu", policy=policy)])
    with fabric.autocast():
        assert amp.is_autocast_enabled("cpu")
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is torch.float32


def test_the_plugin_with_a_policy_pickles_and_deep_copies():
    # Lightning deep-copies and pickles precision plugins (the Trainer's strategy, spawn).
    import copy
    import pickle

    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"], name="fp32-linear")
    plugin = MixedPrecision("bf16-mixed", "cpu", policy=policy)
    for again in (copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))):
        assert again.policy == policy and again.policy.name == "fp32-linear"
        with again.forward_context():
            assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is torch.float32


def test_fabric_autocast_applies_the_plugins_fp8_recipe_and_copies_keep_it():
    import copy
    import pickle

    from dispatch_amp import fp8

    plugin = MixedPrecision("bf16-mixed", "cpu", fp8=fp8.CurrentScaling())
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    layer = torch.nn.Linear(16, 16)
    with fabric.autocast():
        assert layer(torch.ones(16, 16)).dtype is torch.bfloat16
    assert [r.calls for r in plugin.fp8.report()] == [1]
    for again in (copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))):
        assert isinstance(again.fp8, fp8.CurrentScaling) and again.fp8 is not plugin.fp8
        with again.forward_context():
            layer(torch.ones(16, 16))
        assert [r.calls for r in again.fp8.report()] == [1]


# -- Fabric(precision=...): our Fabric, as our Trainer --------------------------------------------
def _setup_fabric(fabric):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def test_our_fabric_takes_precision_as_written(same):
    from dispatch_amp.integrations.fabric import Fabric as OurFabric
    from dispatch_amp.integrations.fabric import HalfPrecision

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(GPU available|bfloat16).*")
        stock = _train(*_setup_fabric(Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")), 4)
        fabric = OurFabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, MixedPrecision)
    ours = _train(*_setup_fabric(fabric), 4)
    assert same(ours[0], stock[0]) and same(ours[1], stock[1])
    # 16-mixed on CPU: float16 with our scaler, as the plugin given explicitly (and a warning).
    explicit = _train(*_setup(_ours("16-mixed")), 5, inf_step=2)
    with pytest.warns(UserWarning, match="Lightning's own Fabric would switch to precision='bf16-mixed'"):
        fabric = OurFabric(accelerator="cpu", devices=1, precision="16-mixed", amp_scaler_options=INIT)
    written = _train(*_setup_fabric(fabric), 5, inf_step=2)
    assert same(written[0], explicit[0]) and written[2] == explicit[2]
    true = OurFabric(accelerator="cpu", devices=1, precision="16-true", amp_opt_level="O2").strategy.precision
    assert isinstance(true, HalfPrecision) and true.props.master_weights
    assert not isinstance(OurFabric(accelerator="cpu", devices=1, precision="32-true").strategy.precision, MixedPrecision)
    with pytest.raises(ValueError, match="apply to precision='16-mixed', 'bf16-mixed', '16-true' or 'bf16-true'"):
        OurFabric(accelerator="cpu", precision="32-true", amp_policy=amp.Policy.for_device("cpu"))


def test_our_fabric_with_precision_beside_a_plugin_and_with_an_accelerator_object():
    from lightning.fabric.accelerators import CPUAccelerator

    from dispatch_amp.integrations.fabric import Fabric as OurFabric

    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert OurFabric(accelerator="cpu", precision="bf16-mixed", plugins=[plugin]).strategy.precision is plugin
    with pytest.raises(ValueError, match=r"Fabric\(precision='16-mixed'\) was given together with plugins=.*pass one of them"):
        OurFabric(accelerator="cpu", precision="16-mixed", plugins=[plugin])
    precision = OurFabric(accelerator=CPUAccelerator(), precision="bf16-mixed").strategy.precision
    assert isinstance(precision, MixedPrecision) and precision.device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_our_fabric_on_a_missing_accelerator_gets_lightnings_error_and_no_warning_of_ours():
    from dispatch_amp.integrations.fabric import Fabric as OurFabric

    with pytest.raises(Exception) as stock:
        Fabric(accelerator="gpu", precision="16-mixed")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(type(stock.value)) as ours:
        warnings.simplefilter("always")
        OurFabric(accelerator="gpu", precision="16-mixed")
    assert str(ours.value) == str(stock.value)
    assert [str(w.message) for w in caught if "dispatch_amp" in w.filename] == []


def test_a_fabric_plugin_without_a_device_names_the_plugin_and_the_fix():
    with pytest.raises(TypeError, match=r"MixedPrecision\('bf16-mixed'\) needs the device type") as err:
        MixedPrecision("bf16-mixed")
    assert "PolicyPrecision" not in str(err.value)
