"""GradScaler diagnostics: scale history, overflow attribution, numerics warnings, logging."""

from __future__ import annotations

import logging
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from dispatch_amp import AmpNumericsWarning, GradScaler
from dispatch_amp.scaler.diagnostics import (
    NonFiniteGradient,
    OverflowReport,
    ParameterNames,
    PendingOverflow,
    ScaleHistory,
    StepOutcome,
)

INF, NAN = float("inf"), float("nan")


class OpCounter(TorchDispatchMode):
    """Counts calls of the given aten overload packets (to prove a pass did or did not run)."""

    def __init__(self, *packets):
        super().__init__()
        self.packets = packets
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.packets:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def backward_with(model, scaler, poison=None, value=INF):
    """One scaled backward; then put `value` into the gradient of the parameter named `poison`."""
    loss = model(torch.ones(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    if poison is not None:
        grad = dict(model.named_parameters())[poison].grad
        grad.view(-1)[0] = value


def train_step(model, opt, scaler, poison=None, value=INF):
    opt.zero_grad(set_to_none=True)
    backward_with(model, scaler, poison, value)
    result = scaler.step(opt)
    scaler.update()
    return result


# --------------------------------------------------------------------------------------
# scale history
# --------------------------------------------------------------------------------------


def test_history_records_the_scale_each_step_ran_with_and_whether_it_was_skipped():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=2)
    for poison in (None, None, "0.weight", None, "2.bias", None):
        train_step(model, opt, scaler, poison)
    assert scaler.scale_history() == [
        (0, 8.0, False),
        (1, 8.0, False),  # second clean step: grows after it
        (2, 16.0, True),  # overflow: backs off after it
        (3, 8.0, False),
        (4, 8.0, True),
        (5, 4.0, False),
    ]
    assert scaler.scale_history(last=2) == [(4, 8.0, True), (5, 4.0, False)]
    assert scaler.skipped_steps == sum(skipped for _, _, skipped in scaler.scale_history())


def test_history_is_a_ring_buffer_of_history_size_steps():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**10, history_size=3)
    for k in range(7):
        train_step(model, opt, scaler, "0.bias" if k % 2 else None)
    assert [step for step, _, _ in scaler.scale_history()] == [4, 5, 6]
    assert [skipped for _, _, skipped in scaler.scale_history()] == [False, True, False]
    off = GradScaler("cpu", history_size=0)
    train_step(model, opt, off)
    assert off.scale_history() == []


def test_history_update_adds_no_host_sync_and_new_scale_is_recorded(sync_counter):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=4.0)
    opt.zero_grad()
    backward_with(model, scaler)
    scaler.step(opt)
    with sync_counter() as counter:
        scaler.update(new_scale=32.0)
    assert counter.count == 0
    train_step(model, opt, scaler)
    assert scaler.scale_history() == [(0, 4.0, False), (1, 32.0, False)]


def test_history_survives_pickling_and_disabled_scaler_has_none():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=4.0)
    train_step(model, opt, scaler, "2.weight")
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.scale_history() == scaler.scale_history() == [(0, 4.0, True)]
    assert copy.last_overflow().names == ["SGD.param_groups[0][2]"]
    train_step(model, opt, copy)
    assert copy.scale_history()[-1] == (1, 2.0, False)
    assert GradScaler("cpu", enabled=False).scale_history() == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_history_size_and_warn_threshold_are_refused(bad):
    with pytest.raises(ValueError, match="history_size"):
        GradScaler("cpu", history_size=bad)
    with pytest.raises(ValueError, match="warn_consecutive_skips"):
        GradScaler("cpu", warn_consecutive_skips=bad if bad != 1.5 else 0)


@settings(max_examples=25)
@given(
    flags=st.lists(st.sampled_from(["clean", "inf", "nan"]), min_size=1, max_size=12),
    growth_interval=st.integers(1, 3),
    capacity=st.integers(1, 15),
)
def test_history_matches_torch_scaler_scales(flags, growth_interval, capacity):
    """Property: the history's scale column is torch's scale before each update()."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ours = GradScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval, history_size=capacity, warn_consecutive_skips=None)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval)
    expected = []
    for k, flag in enumerate(flags):
        poison = None if flag == "clean" else "0.weight"
        value = INF if flag == "inf" else NAN
        for scaler in (ours, theirs):
            opt.zero_grad()
            backward_with(model, scaler, poison, value)
            scaler.step(opt)
        expected.append((k, theirs.get_scale(), flag != "clean"))
        ours.update()
        theirs.update()
    assert ours.scale_history() == expected[-capacity:]


def test_scale_history_unit_read_and_validation():
    h = ScaleHistory(4)
    assert h.read() == []
    h.record(torch.tensor(2.0), torch.tensor(NAN))  # nan counts as an overflow
    assert h.read() == [(0, 2.0, True)]
    with pytest.raises(ValueError, match="last"):
        h.read(last=-1)


def test_history_restarted_at_a_loaded_step_numbers_on_from_it():
    h = ScaleHistory(3)
    for _ in range(5):
        h.record(torch.tensor(8.0), torch.tensor(0.0))
    h.restart_at(40)
    assert h.read() == [] and h.steps == 40  # the old records are of another state
    h.record(torch.tensor(4.0), torch.tensor(1.0))
    assert h.read() == [(40, 4.0, True)]
    assert pickle.loads(pickle.dumps(h.to_host())).read() == [(40, 4.0, True)]


def test_step_outcome_counts_fused_flags_and_host_skips_and_is_read_once(sync_counter):
    p = torch.nn.Parameter(torch.zeros(3))
    pending = PendingOverflow(step=0, scale=torch.tensor(8.0))
    pending.add(p, "a", torch.tensor([1.0, INF, 2.0]))
    pending.add(p, "b", torch.ones(3))  # a candidate without inf/nan is not counted
    fused = torch.tensor([1, 0, 1], dtype=torch.int32)
    outcome = StepOutcome(torch.tensor(NAN), [fused], pending)  # a nan flag is a skip too
    assert not outcome.is_read
    with sync_counter() as syncs:
        assert outcome.read() == (True, 3)
        assert outcome.read() == (True, 3)
    assert syncs.count == 1 and outcome.is_read
    assert StepOutcome(torch.tensor(0.0), [torch.zeros(2, dtype=torch.int32)], None).read() == (False, 0)


# --------------------------------------------------------------------------------------
# overflow attribution
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attribution_names_the_poisoned_parameter(backend, triton_interpreter_available):
    if backend == "triton" and not triton_interpreter_available:
        pytest.skip("needs triton")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", backend=backend)
    train_step(model, opt, scaler)
    assert scaler.skipped_steps == 0 and scaler.last_overflow() is None
    opt.zero_grad()
    backward_with(model, scaler)
    grad = model[2].weight.grad
    grad[0, 0], grad[1, 3], grad[1, 4] = INF, -INF, NAN
    assert scaler.step(opt) is None
    scaler.update()
    report = scaler.last_overflow(model)
    assert report.step == 1 and report.scale == 2.0**16
    assert report.gradients == (NonFiniteGradient("2.weight", (2, 8), torch.float32, num_inf=2, num_nan=1),)
    # Without a model: the parameter's place in the optimizer; after name_parameters: its name.
    assert scaler.last_overflow().names == ["SGD.param_groups[0][2]"]
    # A clean step keeps the last report.
    train_step(model, opt, scaler)
    assert scaler.last_overflow().step == 1
    scaler.name_parameters(model.named_parameters())
    train_step(model, opt, scaler, "0.bias", NAN)
    assert str(scaler.last_overflow()) == (
        "step 3 skipped at scale 32768.0: 1 gradient(s) held inf/nan\n  0.bias: 0 inf, 1 nan of 8 values (torch.float32, shape (8,))"
    )


def test_attribution_with_two_optimizers_reports_each_overflowing_one():
    model = make_model()
    params = list(model.parameters())
    opt1, opt2 = torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=0.1)
    scaler = GradScaler("cpu")
    scaler.name_parameters(model)
    for o in (opt1, opt2):
        o.zero_grad()
    backward_with(model, scaler, "0.weight")
    model[2].bias.grad[0] = NAN
    scaler.unscale_(opt1, opt2)
    assert scaler.step(opt1) is None and scaler.step(opt2) is None
    scaler.update()
    assert scaler.last_overflow().names == ["0.weight", "2.bias"]
    assert scaler.last_overflow().summary(limit=1) == "0.weight and 1 more"


def test_clean_steps_run_no_counting_pass_and_skipped_steps_no_extra_sync(sync_counter):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    opt.zero_grad()
    backward_with(model, scaler)
    with OpCounter(torch.ops.aten.isinf, torch.ops.aten.isnan) as ops, sync_counter() as syncs:
        scaler.step(opt)
        scaler.update()
    assert ops.count == 0 and syncs.count == 1
    opt.zero_grad()
    backward_with(model, scaler, "2.weight")
    with sync_counter() as syncs:
        assert scaler.step(opt) is None
        scaler.update()
    assert syncs.count == 1  # the step's own read; the counts wait on the device
    with sync_counter() as syncs:
        assert scaler.last_overflow().names == ["SGD.param_groups[0][2]"]
    assert syncs.count == 1


def test_triton_flags_limit_the_count_to_the_flagged_gradients(sync_counter, triton_interpreter_available):
    if not triton_interpreter_available:
        pytest.skip("needs triton")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", backend="triton")
    opt.zero_grad()
    backward_with(model, scaler, "2.bias")
    with OpCounter(torch.ops.aten.isinf) as ops, sync_counter() as syncs:
        assert scaler.step(opt) is None
        scaler.update()
    assert ops.count == 1  # one flagged gradient of four is counted
    assert syncs.count == 1  # the flags came with the step's one read
    assert scaler.last_overflow().names == ["SGD.param_groups[0][3]"]


def test_fused_optimizer_overflow_is_skipped_on_device_and_not_reported(sync_counter):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = GradScaler("cpu")
    with sync_counter() as syncs:
        train_step(model, opt, scaler, "0.weight")
    assert syncs.count == 0
    assert scaler.last_overflow() is None
    assert scaler.scale_history() == [(0, 2.0**16, True)]


def test_parameter_names_validation():
    with pytest.raises(TypeError, match="named_parameters"):
        ParameterNames.of(torch.ones(2))
    with pytest.raises(TypeError, match="pairs"):
        ParameterNames.of([("w", 3)])
    p = torch.nn.Parameter(torch.ones(1))
    names = ParameterNames.of([("w", p)])
    assert names.get(p) == "w" and names.get(torch.nn.Parameter(torch.ones(1))) is None


def test_overflow_report_formats():
    r = OverflowReport(2, 8.0, tuple(NonFiniteGradient(f"p{k}", (1,), torch.float16, 1, 0) for k in range(5)))
    assert r.summary() == "p0, p1, p2 and 2 more"
    assert r.names == ["p0", "p1", "p2", "p3", "p4"]


# --------------------------------------------------------------------------------------
# warnings and logging
# --------------------------------------------------------------------------------------


def test_consecutive_skips_warn_at_the_threshold_then_at_doublings():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", warn_consecutive_skips=2)
    scaler.name_parameters(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(model, opt, scaler, "0.weight")
        assert not caught
        train_step(model, opt, scaler, "0.weight")
        assert len(caught) == 1 and caught[0].category is AmpNumericsWarning
        assert caught[0].filename == __file__  # points at the caller's update(), not at us
        message = str(caught[0].message)
        assert "2 steps in a row" in message and "0.weight" in message and "scale now 16384.0" in message
        train_step(model, opt, scaler, "0.weight")  # 3: quiet
        train_step(model, opt, scaler, "0.weight")  # 4: 2x the threshold
        assert len(caught) == 2 and "4 steps in a row" in str(caught[1].message)
        train_step(model, opt, scaler)  # a clean step ends the run
        train_step(model, opt, scaler, "2.bias")
        assert len(caught) == 2
        train_step(model, opt, scaler, "2.bias")
        assert len(caught) == 3 and "2.bias" in str(caught[2].message)


def test_consecutive_skip_warning_can_be_turned_off():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", warn_consecutive_skips=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpNumericsWarning)
        for _ in range(12):
            train_step(model, opt, scaler, "0.bias")


def test_scaler_with_bf16_autocast_warns_once():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    with pytest.warns(AmpNumericsWarning, match="bfloat16 autocast, which does not need loss scaling"):
        for _ in range(2):
            opt.zero_grad()
            with amp.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpNumericsWarning)
        scaler.scale(loss)  # once per scaler
        fp16 = GradScaler("cpu")
        with amp.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(3, 4)).float().sum()
        fp16.scale(loss)


def test_bf16_autocast_before_the_scaler_existed_does_not_warn():
    with amp.autocast("cpu", dtype=torch.bfloat16):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpNumericsWarning)
        GradScaler("cpu").scale(torch.ones(()))


def test_scaler_inside_native_bf16_autocast_warns():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(AmpNumericsWarning, match="bfloat16") as caught:
            GradScaler("cpu").scale(torch.ones(()))
    assert caught[0].filename == __file__  # points at the caller's scale()


def test_apex_levels_with_bf16_do_not_warn():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpNumericsWarning)
        loss = model(torch.ones(3, 4)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def test_fp16_gradients_are_refused_with_a_clear_error():
    model = torch.nn.Linear(2, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt)


def test_skipped_steps_are_logged_at_info(caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu")
    scaler.name_parameters(model)
    with caplog.at_level(logging.INFO, logger="dispatch_amp"):
        train_step(model, opt, scaler)
        assert not caplog.records
        train_step(model, opt, scaler, "2.weight")
    assert len(caplog.records) == 1
    assert "step 1 skipped (SGD) at scale 65536.0: inf/nan gradients in 2.weight" in caplog.records[0].getMessage()
