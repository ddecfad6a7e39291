"""accelerate: install_amp trains bit-identically to accelerate's own mixed precision,
clip_grad_norm_ sees unscaled gradients, and save_state/load_state keep the scale."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

import dispatch_amp as amp  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from dispatch_amp.integrations.accelerate import install_amp  # noqa: E402

INIT = {"init_scale": 2.0**8, "growth_interval": 2}


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    # accelerate keeps one process-wide state, fixed by the first Accelerator; these tests
    # create Accelerators of several precisions.
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _native(mixed_precision: str) -> Accelerator:
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    if mixed_precision == "fp16":
        # accelerate refuses fp16 on CPU and turns it off; on a GPU it sets exactly these two
        # attributes, so setting them here runs its own fp16 path on CPU.
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", **INIT)
    return accelerator


def _ours(mixed_precision: str) -> Accelerator:
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    install_amp(accelerator, scaler_options=INIT if mixed_precision == "fp16" else None)
    return accelerator


def _prepare(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return accelerator.prepare(model, optimizer)


def _train(accelerator, model, optimizer, steps, start=0, inf_step=None):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses, grads, norms, scales = [], [], [], []
    for step in range(start, steps):
        out = model(x * float("inf") if step == inf_step else x)
        loss = torch.nn.functional.mse_loss(out, y)
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        scales.append(accelerator.scaler.get_scale() if accelerator.scaler is not None else None)
    return losses, grads, norms, scales


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_training_is_bit_identical_to_accelerates_own_amp(same, mixed_precision):
    inf_step = 2 if mixed_precision == "fp16" else None
    native_acc = _native(mixed_precision)
    native_model, opt = _prepare(native_acc)
    native = _train(native_acc, native_model, opt, 5, inf_step=inf_step)
    AcceleratorState._reset_state(True)
    accelerator = _ours(mixed_precision)
    model, opt = _prepare(accelerator)
    ours = _train(accelerator, model, opt, 5, inf_step=inf_step)
    assert ours[3] == native[3]
    if inf_step is not None:
        assert isinstance(accelerator.scaler, amp.GradScaler)
        assert ours[3][inf_step] == ours[3][inf_step - 1] / 2 and opt.step_was_skipped is False
        assert accelerator.scaler.skipped_steps == 1
    # clip_grad_norm_ returned the norm of the unscaled gradients, as accelerate's own does.
    assert same(ours[2], native[2]) and ours[2][0] < 100
    assert same(ours[0], native[0]) and same(ours[1], native[1])
    assert same(list(model.parameters()), list(native_model.parameters()))


def test_fp16_on_cpu_unscales_before_clipping_where_accelerate_would_not():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    install_amp(accelerator, scaler_options={"init_scale": 2.0**10})
    model, opt = _prepare(accelerator)
    loss = model(torch.ones(2, 8)).float().pow(2).mean()
    accelerator.backward(loss)
    unscaled = [p.grad.clone() / 2.0**10 for p in model.parameters()]
    accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    assert all(torch.equal(p.grad, u) for p, u in zip(model.parameters(), unscaled))


@pytest.mark.parametrize("source", [_ours, _native], ids=["from-ours", "from-native"])
def test_save_and_load_state_continue_bit_identically(tmp_path, same, source):
    accelerator = _ours("fp16")
    model, opt = _prepare(accelerator)
    straight = _train(accelerator, model, opt, 6, inf_step=4)

    AcceleratorState._reset_state(True)
    head_acc = source("fp16")
    head_model, head_opt = _prepare(head_acc)
    _train(head_acc, head_model, head_opt, 3, inf_step=4)
    head_acc.save_state(tmp_path / "state", safe_serialization=False)

    AcceleratorState._reset_state(True)
    accelerator = _ours("fp16")
    tail_model, tail_opt = _prepare(accelerator)
    accelerator.load_state(tmp_path / "state")
    assert accelerator.scaler.get_scale() == straight[3][2] != INIT["init_scale"]
    tail = _train(accelerator, tail_model, tail_opt, 6, start=3, inf_step=4)
    assert tail[3] == straight[3][3:]
    assert same(tail[0], straight[0][3:]) and same(tail[1], straight[1][3:])
    assert same(list(tail_model.parameters()), list(model.parameters()))


def test_autocast_unwrap_and_policy():
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"])
    accelerator = Accelerator(cpu=True)
    install_amp(accelerator, dtype=torch.bfloat16, policy=policy)
    with accelerator.autocast():
        assert amp.is_autocast_enabled("cpu") and amp.get_autocast_dtype("cpu") is torch.bfloat16
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            seen.append((amp.is_autocast_enabled("cpu"), out.dtype))
            return out

    model = accelerator.prepare(Probe(2, 2))
    model(torch.ones(1, 2))
    assert seen == [(True, torch.float32)], "our autocast, with the policy's float32 linear"
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.ones(1, 2))
    assert seen[-1] == (False, torch.float32), "unwrap_model removed the autocast wrapper"


def test_install_amp_refuses_what_it_cannot_honour():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="mixed_precision='no' and no dtype"):
        install_amp(accelerator)
    with pytest.raises(ValueError, match="bfloat16 uses no loss scaling"):
        install_amp(accelerator, dtype="bf16", scaler=amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="use 'fp16', 'bf16'"):
        install_amp(accelerator, dtype="fp8")
    install_amp(accelerator, dtype="bf16")
    with pytest.raises(RuntimeError, match="already called"):
        install_amp(accelerator, dtype="bf16")

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="contradicts the Accelerator's mixed_precision='bf16'"):
        install_amp(accelerator, dtype=torch.float16)
    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="after accelerator.prepare"):
        install_amp(accelerator)


def test_install_amp_checks_every_argument_before_changing_the_accelerator():
    accelerator = Accelerator(cpu=True)
    before = {name: getattr(accelerator, name) for name in ("native_amp", "scaler", "autocast", "prepare_model")}
    with pytest.raises(TypeError, match="policy must be a dispatch_amp.Policy"):
        install_amp(accelerator, dtype="bf16", policy="cpu")
    assert {name: getattr(accelerator, name) for name in before} == before
    assert getattr(accelerator, "dispatch_amp", None) is None
    install_amp(accelerator, dtype="bf16", policy=amp.Policy.for_device("cpu"))  # still possible


def test_install_amp_takes_an_fp8_recipe():
    from dispatch_amp import fp8

    recipe = fp8.CurrentScaling()
    accelerator = Accelerator(cpu=True)
    hooks = install_amp(accelerator, dtype=torch.bfloat16, fp8=recipe)
    assert hooks.fp8 is recipe and "fp8=CurrentScaling(" in repr(hooks.make_autocast())
    model = accelerator.prepare(torch.nn.Linear(16, 16))
    model(torch.ones(16, 16)).float().sum().backward()
    assert [r.calls for r in recipe.report()] == [1]
    with pytest.raises(TypeError, match="fp8 must be a dispatch_amp.fp8 recipe"):
        install_amp(Accelerator(cpu=True), dtype=torch.bfloat16, fp8="e4m3")


def test_log_amp_metrics_reaches_the_accelerators_trackers():
    from accelerate.tracking import GeneralTracker

    from dispatch_amp.integrations.accelerate import log_amp_metrics

    class Recorder(GeneralTracker):  # stands for TensorBoard & co.
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values)))

    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=recorder)
    accelerator.init_trackers("amp")
    install_amp(accelerator, dtype="fp16", scaler_options={"init_scale": 2.0**8, "growth_interval": 2})
    model, optimizer = _prepare(accelerator)
    overflowing = []
    for step in range(4):
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("inf")
        with accelerator.autocast():
            loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        overflowing.append(sum(1 for p in model.parameters() if not torch.isfinite(p.grad).all()))
        optimizer.zero_grad()
        log_amp_metrics(accelerator, step=step)
    assert [step for step, _ in recorder.rows] == [0, 1, 2, 3]
    assert [row["amp/skipped_steps"] for _, row in recorder.rows] == [0, 0, 1, 1]
    assert [row["amp/loss_scale"] for _, row in recorder.rows] == [256.0, 512.0, 256.0, 256.0]
    # The same keys every step (fixed schema); the count is the skipped step's own.
    assert all(row.keys() == recorder.rows[0][1].keys() for _, row in recorder.rows)
    assert [row["amp/overflow_params"] for _, row in recorder.rows] == overflowing
    assert overflowing[2] > 0 and overflowing[:2] + overflowing[3:] == [0, 0, 0]


def test_a_precision_plan_bound_before_prepare_trains_as_with_our_region_by_hand(same):
    # The plan is bound to the model before prepare(); accelerate's forward wrapper opens
    # our region around the model, inside which the plan's regions open.
    def planned():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        plan = amp.PrecisionPlan({"2": torch.float32}).bind(model)
        return model, plan, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    accelerator = _ours("bf16")
    model, plan, opt = planned()
    model, opt = accelerator.prepare(model, opt)
    ours = _train(accelerator, model, opt, 3)

    by_hand, _, opt = planned()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses = []
    for _ in range(3):
        with amp.autocast("cpu", dtype=torch.bfloat16):
            out = by_hand(x)
        assert out.dtype is torch.float32  # the last linear ran in float32
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1.0)  # as _train does
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert same(ours[0], losses) and same(list(model.parameters()), list(by_hand.parameters()))
    plan.unbind()  # the plan's wrapper is on the inner module, which prepare() left alone
