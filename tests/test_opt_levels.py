"""Apex-style optimization levels: the property table, casts, master weights, skipped steps,
schedulers, state_dict round trips, convergence per level, fp16 scaler path, lists, losses.

CPU only: bf16 where timing matters, fp16 only on tiny shapes (slow on CPU).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dispatch_amp
from dispatch_amp.opt_levels import OptLevelProperties, initialize, loss_scalers, master_params, scale_loss

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Seed 004's table, with float16 replaced by the chosen dtype (bf16: the CPU default).
TABLE = {
    "O0": (FP32, False, None, False, 1.0),
    "O1": (None, True, None, False, "dynamic"),
    "O2": (BF16, False, True, True, "dynamic"),
    "O3": (BF16, False, False, False, 1.0),
}


def mlp(d_in=8, hidden=16, d_out=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def setup(level="O2", opt_cls=torch.optim.Adam, lr=1e-2, seed=0, **kw):
    model = mlp(seed=seed)
    opt = opt_cls(model.parameters(), lr=lr)
    return initialize(model, opt, level, **kw)


def train_step(model, opt, x, y, loss_id=0):
    loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    with scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    return opt.step(), loss


def batch(n=16, d=8, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def snapshot(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        [p.detach().clone() for p in master_params(opt)],
        copy.deepcopy(opt.state_dict()["state"]),
    )


def assert_same(a, b):
    for xs, ys in zip(a[:2], b[:2]):
        for x, y in zip(xs, ys):
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        for name, v in a[2][k].items():
            assert torch.equal(v, b[2][k][name]), (k, name)


# -- the property table --------------------------------------------------------------------


@pytest.mark.parametrize("level", list(TABLE))
def test_property_table(level):
    p = OptLevelProperties.for_level(level, device_type="cpu")
    assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights, p.loss_scale) == TABLE[level]
    assert p.dtype is BF16


def test_dtype_defaults_and_choice():
    assert OptLevelProperties.for_level("O2", device_type="cuda").cast_model_type is FP16
    assert OptLevelProperties.for_level("O2", dtype=FP16).cast_model_type is FP16
    assert OptLevelProperties.for_level("O3", cast_model_type=FP16).dtype is FP16
    assert OptLevelProperties.for_level("O1", dtype=FP16).dtype is FP16


def test_overrides_apply():
    p = OptLevelProperties.for_level("O2", keep_batchnorm_fp32=False, loss_scale=128.0)
    assert p.keep_batchnorm_fp32 is False and p.loss_scale == 128.0 and p.master_weights
    p = OptLevelProperties.for_level("O3", keep_batchnorm_fp32=True, loss_scale="dynamic")  # bf16: allowed
    assert p.keep_batchnorm_fp32 and p.loss_scale == "dynamic"
    p = OptLevelProperties.for_level("O2", cast_model_type=False)  # no cast: no masters, no BN rule
    assert p.cast_model_type is None and not p.master_weights and p.keep_batchnorm_fp32 is None


@pytest.mark.parametrize(
    "level, kwargs, match",
    [
        ("O1", dict(master_weights=True), "master_weights=True makes no sense for opt_level 'O1'"),
        ("O1", dict(cast_model_type=BF16), "O1 keeps the model's weights fp32"),
        ("O1", dict(keep_batchnorm_fp32=True), "makes no sense for opt_level 'O1'"),
        ("O0", dict(master_weights=True), "master weights are fp32 copies"),
        ("O0", dict(keep_batchnorm_fp32=True), "It applies to O2/O3"),
        ("O4", {}, "valid levels: 'O0'"),
        ("02", {}, "the letter O, not the digit 0"),
        ("O2", dict(loss_scale=-1.0), "loss_scale must be 'dynamic' or a finite float > 0"),
        ("O2", dict(loss_scale="auto"), "loss_scale must be"),
        ("O3", dict(dtype=FP16, loss_scale="dynamic"), "refuses to unscale float16 gradients"),
        ("O2", dict(dtype=FP16, master_weights=False), "Use master_weights=True"),
        ("O2", dict(dtype=BF16, cast_model_type=FP16), "contradicts dtype"),
        ("O2", dict(dtype=torch.float64), "dtype must be one of"),
        ("O3", dict(min_loss_scale=1.0), "bound a dynamic loss scale"),
        ("O2", dict(cast_model_type=torch.int8), "cast_model_type must be"),
    ],
)
def test_invalid_overrides(level, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptLevelProperties.for_level(level, **kwargs)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, **kwargs)
    assert "_dispatch_amp" not in model.__dict__ and "forward" not in model.__dict__
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- what initialize does to the model -------------------------------------------------------


@pytest.mark.parametrize(
    "level, kwargs, linear, bn",
    [
        ("O0", {}, FP32, FP32),
        ("O1", {}, FP32, FP32),
        ("O2", {}, BF16, FP32),
        ("O2", dict(keep_batchnorm_fp32=False), BF16, BF16),
        ("O3", {}, BF16, BF16),
        ("O3", dict(keep_batchnorm_fp32=True), BF16, FP32),
    ],
)
def test_param_and_buffer_dtypes(level, kwargs, linear, bn):
    model, opt = setup(level, **kwargs)
    assert {p.dtype for p in model[0].parameters()} == {linear} == {p.dtype for p in model[3].parameters()}
    assert {p.dtype for p in model[1].parameters()} == {bn}
    assert model[1].running_mean.dtype is bn and model[1].running_var.dtype is bn
    assert model[1].num_batches_tracked.dtype is torch.int64


def test_forward_casts_inputs_and_outputs():
    seen = {}
    for level in ("O1", "O2", "O3"):
        model, _ = setup(level)
        model[0].register_forward_pre_hook(lambda m, args, level=level: seen.__setitem__(level, args[0].dtype))
        out = model(torch.randn(4, 8))
        assert out.dtype is (BF16 if level == "O1" else FP32)  # O1: autocast's output, as Apex
    assert seen == {"O1": FP32, "O2": BF16, "O3": BF16}
    model, _ = setup("O1", cast_model_outputs=FP32)
    assert model(torch.randn(4, 8)).dtype is FP32
    model, _ = setup("O2")
    x64 = torch.randn(4, 8, dtype=torch.float64)  # float64 is never cast
    with pytest.raises(RuntimeError):
        model(x64)


def test_o1_forward_runs_in_autocast_and_closes_on_error():
    model, _ = setup("O1")
    inside = []
    model[0].register_forward_pre_hook(lambda m, a: inside.append(dispatch_amp.is_autocast_enabled("cpu")))

    def boom(m, a, out):
        raise KeyError("boom")

    handle = model[2].register_forward_hook(boom)
    with pytest.raises(KeyError):
        model(torch.randn(4, 8))
    assert inside == [True] and not dispatch_amp.is_autocast_enabled("cpu")
    handle.remove()
    assert not dispatch_amp.is_autocast_enabled("cpu") and model(torch.randn(4, 8)).dtype is BF16
    del model.forward  # the wrapper is an instance attribute: removing it restores the class's
    assert model(torch.randn(4, 8)).dtype is FP32


# -- O2 master weights -----------------------------------------------------------------------


def test_o2_master_weights_fp32_updated_and_copied_back():
    model = mlp()
    originals = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, "O2")
    masters = list(master_params(opt))
    assert all(m.dtype is FP32 for m in masters)
    # Masters start from the exact fp32 values (not rounded through bf16); BN params are shared.
    for p, m, o in zip(model.parameters(), masters, originals):
        assert torch.equal(m, o)
        assert (m is p) == (p.dtype is FP32)
    train_step(model, opt, *batch())
    for p, m, o in zip(model.parameters(), masters, originals):
        assert not torch.equal(m, o)  # the optimizer updated the master
        assert torch.equal(p.detach(), m.detach().to(p.dtype))  # ... and it was copied into the model
        assert p.grad is None or p is m  # model gradients live only inside scale_loss
    # Optimizer state is keyed by the masters and fp32.
    assert set(opt.state) == set(masters)
    assert all(v.dtype is FP32 for st in opt.state.values() for k, v in st.items() if k != "step")
    assert isinstance(opt, torch.optim.Adam) and type(opt) is torch.optim.Adam


def test_existing_optimizer_state_moves_to_the_masters():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    old = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    ids = [id(p) for p in model.parameters()]
    model, opt = initialize(model, opt, "O2")
    assert set(opt.state) == set(master_params(opt))
    for i, m in zip(ids, master_params(opt)):
        assert all(torch.equal(v, old[i][k]) for k, v in opt.state[m].items())
    train_step(model, opt, x, y)


def test_o2_gradients_match_fp32_reference():
    # Master gradients are the unscaled fp32 copies of the bf16 model's gradients.
    model, opt = setup("O2")
    ref = copy.deepcopy(model)
    del ref.forward
    x, y = batch()
    loss = F.cross_entropy(model(x).float(), y)
    with scale_loss(loss, opt) as scaled:
        assert scaled.dtype is FP32 and scaled.item() == pytest.approx(loss.item() * 2.0**16)
        scaled.backward()
    F.cross_entropy(ref(x.to(BF16)).float(), y).backward()
    for m, r in zip(master_params(opt), ref.parameters()):
        torch.testing.assert_close(m.grad, r.grad.float(), rtol=1.6e-2, atol=1e-3)


def _force_overflow(model, opt, x, y):
    loss = F.cross_entropy(model(x).float(), y) * float("inf")
    opt.zero_grad()
    with scale_loss(loss, opt) as scaled:
        scaled.backward()
    return opt.step()


@pytest.mark.parametrize("level, kwargs", [("O1", {}), ("O2", {}), ("O2", dict(loss_scale=128.0)), ("O1", dict(loss_scale=8.0))])
def test_skipped_step_leaves_everything_bit_identical(level, kwargs):
    model, opt = setup(level, **kwargs)
    x, y = batch()
    train_step(model, opt, x, y)  # creates optimizer state
    scaler = loss_scalers(opt)[0]
    scale = scaler.get_scale()
    model.eval()  # BN running stats would change in the forward; the step is what is tested
    before = snapshot(model, opt)
    assert _force_overflow(model, opt, x, y) is None
    assert_same(before, snapshot(model, opt))
    assert scaler.skipped_steps == 1
    static = kwargs.get("loss_scale")
    assert scaler.get_scale() == (static if static else scale / 2)  # static: the scale stays
    model.train()
    train_step(model, opt, x, y)  # the next clean step runs
    assert not torch.equal(before[1][0], next(master_params(opt)))


def test_scheduler_counts_steps_without_warnings():
    model, opt = setup("O2", opt_cls=torch.optim.SGD, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _force_overflow(model, opt, x, y)  # a skipped first step still counts for the scheduler
        sched.step()
        for _ in range(2):
            train_step(model, opt, x, y)
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.125
    assert sched.state_dict()["_step_count"] == 4


def test_scheduler_created_before_initialize_is_refused():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(RuntimeError, match="Create LR schedulers after"):
        initialize(model, opt, "O2")


# -- state_dict ------------------------------------------------------------------------------


def test_o2_state_dict_round_trip():
    model, opt = setup("O2")
    x, y = batch()
    for _ in range(3):
        train_step(model, opt, x, y)
    sd, osd = model.state_dict(), copy.deepcopy(opt.state_dict())
    assert all(v.dtype is FP32 for k, v in sd.items() if k.endswith(("weight", "bias", "running_mean")))
    masters = dict(zip([n for n, _ in model.named_parameters()], master_params(opt)))
    assert all(torch.equal(sd[n], m) for n, m in masters.items())  # exact masters, not the rounded weights
    # The checkpoint loads into a plain fp32 model ...
    plain = mlp(seed=5)
    plain.load_state_dict(sd)
    # ... and into a fresh O2 model + optimizer, which then trains bit-identically.
    model2, opt2 = setup("O2", seed=7)
    model2.load_state_dict(sd)
    opt2.load_state_dict(osd)
    loss_scalers(opt2)[0].load_state_dict(loss_scalers(opt)[0].state_dict())
    for p2, p in zip(model2.parameters(), model.parameters()):
        assert torch.equal(p2, p)
    for m2, m in zip(master_params(opt2), master_params(opt)):
        assert torch.equal(m2, m)
    _, l1 = train_step(model, opt, x, y)
    _, l2 = train_step(model2, opt2, x, y)
    assert l1.item() == l2.item()
    for m2, m in zip(master_params(opt2), master_params(opt)):
        assert torch.equal(m2, m)


def test_loading_fp32_weights_updates_masters_exactly():
    model, opt = setup("O2")
    weights = mlp(seed=3).state_dict()
    model.load_state_dict(weights)
    for (name, p), m in zip(model.named_parameters(), master_params(opt)):
        assert torch.equal(m, weights[name])
        assert torch.equal(p.detach(), weights[name].to(p.dtype))


def test_o3_state_dict_is_fp32_and_deepcopy_keeps_working():
    model, opt = setup("O3")
    assert all(v.dtype in (FP32, torch.int64) for v in model.state_dict().values())
    clone = copy.deepcopy(model)
    assert clone.forward.module is clone
    assert clone(torch.randn(4, 8)).dtype is FP32


# -- convergence on a learnable task --------------------------------------------------------

# Tolerance: each level's final full-batch loss is within 0.05 + 10% of O0's, and training
# reduced the loss well below chance (ln 4 ~ 1.39).
TOL_ABS, TOL_REL = 0.05, 0.10


def _convergence_loss(level, steps=150):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)  # a linear teacher: learnable
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, level)
    for i in range(steps):
        sl = slice(i * 64 % 512, i * 64 % 512 + 64)
        loss = F.cross_entropy(model(x[sl]).float(), y[sl])
        opt.zero_grad()
        with scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x).float(), y).item()


def test_levels_reach_the_fp32_loss():
    losses = {level: _convergence_loss(level) for level in TABLE}
    base = losses["O0"]
    assert base < 0.2, losses
    for level, loss in losses.items():
        assert abs(loss - base) <= TOL_ABS + TOL_REL * base, losses


# -- fp16 scaler path (tiny shapes) --------------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_dynamic_scaler(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, level, dtype=FP16)
    if level == "O2":
        assert {p.dtype for p in model.parameters()} == {FP16}
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
    scaler = loss_scalers(opt)[0]
    # A loss whose scaled gradients overflow fp16: the step is skipped and the scale backs off.
    before = [m.detach().clone() for m in master_params(opt)]
    loss = F.cross_entropy(model(x).float(), y) * 1e4
    with scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert opt.step() is None
    assert scaler.get_scale() == 2.0**15 and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, master_params(opt)))
    opt.zero_grad()
    # Clean steps go through, with unscaled fp32 gradients on the masters.
    for _ in range(2):
        train_step(model, opt, x, y)
    assert all(m.grad.dtype is FP32 and torch.isfinite(m.grad).all() for m in master_params(opt))
    assert not all(torch.equal(a, b) for a, b in zip(before, master_params(opt)))


# -- lists, several losses, accumulation, errors ---------------------------------------------


def test_lists_of_models_and_optimizers():
    m1, m2 = mlp(seed=1), mlp(seed=2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    models, opts = initialize([m1, m2], [o1, o2], "O2")
    assert models == [m1, m2] and opts == [o1, o2]
    assert initialize(mlp(), None, "O1").__class__ is nn.Sequential  # no optimizers: models only
    x, y = batch()
    before = [next(master_params(o)).detach().clone() for o in opts]
    loss = F.cross_entropy(m1(x), y) + F.cross_entropy(m2(x), y)
    with scale_loss(loss, [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    assert all(not torch.equal(b, next(master_params(o))) for b, o in zip(before, opts))


def test_num_losses_have_their_own_scalers():
    model, opt = setup("O1", num_losses=2)
    s0, s1 = loss_scalers(opt)
    assert s0 is not s1
    x, y = batch()
    opt.zero_grad()
    with scale_loss(F.cross_entropy(model(x).float(), y), opt, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(F.cross_entropy(model(x).float(), y) * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    assert s0.get_scale() == 2.0**16 and s1.get_scale() == 2.0**15
    assert opt.step() is None  # one overflowing loss skips the step
    with pytest.raises(ValueError, match="loss_id must be"):
        with scale_loss(torch.ones(()), opt, loss_id=2):
            pass


def test_two_blocks_accumulate_unscaled_gradients():
    model, opt = setup("O2")
    model.eval()
    x, y = batch()

    def grads(*ids):
        opt.zero_grad()
        for i in ids:
            with scale_loss(F.cross_entropy(model(x[i::2]).float(), y[i::2]), opt) as scaled:
                scaled.backward()
        return [m.grad.clone() for m in master_params(opt)]

    g0, g1, both = grads(0), grads(1), grads(0, 1)
    for a, b, s in zip(g0, g1, both):
        assert torch.equal(a + b, s)


def test_clipping_master_params():
    model, opt = setup("O2")
    x, y = batch()
    loss = F.cross_entropy(model(x).float(), y)
    with scale_loss(loss, opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(master_params(opt), 1e-3)
    assert 0 < norm < 100  # unscaled: a scaled norm would be ~65536x larger
    opt.step()


def test_errors_name_the_state_and_the_fix():
    model, opt = setup("O2")
    with pytest.raises(RuntimeError, match="already called on this model"):
        initialize(model, torch.optim.SGD(mlp().parameters(), lr=0.1), "O2")
    with pytest.raises(RuntimeError, match="already called on this optimizer"):
        initialize(mlp(), opt, "O2")
    other = mlp()
    with pytest.raises(ValueError, match="belongs to none of the models"):
        initialize(mlp(), torch.optim.SGD(other.parameters(), lr=0.1), "O2")
    with pytest.raises(RuntimeError, match="amp.initialize\\(\\) has not"):
        with scale_loss(torch.ones(()), torch.optim.SGD(other.parameters(), lr=0.1)):
            pass
    x, y = batch()
    F.cross_entropy(model(x), y).backward()  # outside scale_loss
    with pytest.raises(RuntimeError, match="found gradients on the low-precision model parameters"):
        opt.step()
    with pytest.raises(RuntimeError, match="on entry"):
        with scale_loss(torch.ones(()), opt):
            pass
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: None)
    model0, opt0 = setup("O0", opt_cls=torch.optim.SGD)  # no scaler, no masters: closures work
    x, y = batch()
    opt0.step(lambda: F.cross_entropy(model0(x), y))


def test_exception_in_block_restores_gradients():
    model, opt = setup("O2")
    x, y = batch()
    with scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    kept = [m.grad.clone() for m in master_params(opt)]
    with pytest.raises(ZeroDivisionError):
        with scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()
            1 / 0
    assert all(torch.equal(k, m.grad) for k, m in zip(kept, master_params(opt)))
    assert all(p.grad is None for p in model.parameters() if p.dtype is BF16)
    opt.step()


def test_o0_and_o3_are_plain_training():
    # loss_scale=1.0 without master weights: no scaler, the loss passes through untouched.
    for level in ("O0", "O3"):
        model, opt = setup(level)
        assert loss_scalers(opt) == [None]
        loss = F.cross_entropy(model(batch()[0]).float(), batch()[1])
        with scale_loss(loss, opt) as scaled:
            assert scaled is loss
    ref, ref_opt = mlp(), None
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model, opt = setup("O0")
    x, y = batch()
    train_step(model, opt, x, y)
    ref_opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


# -- Apex's module-level dispatch_amp.state_dict() / dispatch_amp.load_state_dict() ------------------------
def _apex_style_run(steps, resume_from=None, inf_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = dispatch_amp.initialize(model, opt, opt_level="O1", dtype=torch.float16)
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        opt.load_state_dict(resume_from["opt"])
        dispatch_amp.load_state_dict(resume_from["amp"])
    gen = torch.Generator().manual_seed(1 if resume_from is None else 2)
    for step in range(steps):
        x = torch.randn(4, 8, generator=gen)
        if step == inf_at:
            x[0, 0] = float("inf")
        opt.zero_grad()
        with dispatch_amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


def test_module_state_dict_resumes_the_loss_scale_bit_identically():
    model, opt = _apex_style_run(3, inf_at=1)
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "amp": dispatch_amp.state_dict()}
    assert checkpoint["amp"]["loss_scaler0"]["scale"] == 2.0**15  # one backoff from 2**16
    resumed, resumed_opt = _apex_style_run(2, resume_from=checkpoint)
    assert dispatch_amp.state_dict()["loss_scaler0"]["scale"] == 2.0**15
    # Continuing in the same process from the same point gives the same weights.
    model2, opt2 = _apex_style_run(3, inf_at=1)
    dispatch_amp.load_state_dict(checkpoint["amp"])
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)
        opt2.zero_grad()
        with dispatch_amp.scale_loss(model2(x).float().pow(2).mean(), opt2) as scaled:
            scaled.backward()
        opt2.step()
    for a, b in zip(resumed.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_module_load_state_dict_takes_apex_entries_and_checks_before_changing():
    # Keep the result alive: the module functions serve the live initialize() result, and
    # a discarded one is gone whenever the garbage collector runs.
    model, opt = _apex_style_run(1)
    dispatch_amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 3}})
    sd = dispatch_amp.state_dict()["loss_scaler0"]
    assert sd["scale"] == 128.0 and sd["_growth_tracker"] == 3
    with pytest.raises(ValueError, match="loss_scaler1"):
        dispatch_amp.load_state_dict({"loss_scaler1": {"loss_scale": 2.0}})
    with pytest.raises(ValueError):
        dispatch_amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e-50}})
    assert dispatch_amp.state_dict()["loss_scaler0"]["scale"] == 128.0
