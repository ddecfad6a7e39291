"""The fp8 linear's quantization: the CUDA kernels (through Triton's interpreter) give the torch
path's bits, the weight cache quantizes each version of a weight once, the backward keeps
only the layouts its gemms take, and a training step reads nothing back to the host."""

import os

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.kernels._launch import counting_launches

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "current": fp8.CurrentScaling,
    "current-pow2-e4m3-grads": lambda: fp8.CurrentScaling(power_of_two=True, grad_format=E4M3),
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "delayed-margin-most-recent": lambda: fp8.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent",
                                                             margin=1, power_of_two=True),
}
needs_interpreter = pytest.mark.skipif(
    fp8._rules._kernels.triton is None
    or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the Triton path needs triton, and TRITON_INTERPRET=1 without a GPU",
)


@pytest.fixture
def kernels(monkeypatch):
    """The CUDA path (the Triton kernels), run by the interpreter on CPU tensors."""
    monkeypatch.setattr(fp8._rules, "_BACKEND", "triton")


def _region(recipe):
    return amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe)


def _layer(seed=0, dtype=torch.float32, bias=True):
    torch.manual_seed(seed)
    return torch.nn.Linear(48, 32, bias=bias).to(dtype)


def _steps(recipe_name, x_dtype, bias, frozen):
    """Three training steps (the weight changes), then an evaluation call: outputs,
    gradients and the recipe's report."""
    layer = _layer(bias=bias)
    if frozen:
        layer.weight.requires_grad_(False)
    recipe = RECIPES[recipe_name]().bind(layer)
    trained = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.5) if trained else None
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(3):
        x = (torch.randn(2, 40, 48, generator=g) * (step + 1)).to(x_dtype).requires_grad_(True)
        with _region(recipe):
            y = layer(x)
        y.float().pow(2).mean().backward()
        out.append((y, x.grad, *[p.grad for p in trained]))
        if opt is not None:
            opt.step()
            opt.zero_grad()
    with torch.no_grad(), _region(recipe):
        out.append((layer(x),))
    stats = [(r.name, r.calls, r.amax, r.scale, r.saturated) for r in recipe.report()]
    return out, stats


def _assert_same(got, want):
    for g_step, w_step in zip(got, want):
        for g, w in zip(g_step, w_step):
            assert g.dtype == w.dtype and torch.equal(g.isnan(), w.isnan())
            assert torch.equal(g[~g.isnan()], w[~w.isnan()]), (g - w).abs().max()


@needs_interpreter
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-weight"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_the_kernels_give_the_torch_paths_bits(monkeypatch, recipe_name, x_dtype, bias, frozen):
    want, want_stats = _steps(recipe_name, x_dtype, bias, frozen)
    monkeypatch.setattr(fp8._rules, "_BACKEND", "triton")
    with counting_launches() as launches:
        got, got_stats = _steps(recipe_name, x_dtype, bias, frozen)
    assert "_cast_transpose_dbias_kernel" in launches or not bias or frozen  # the kernels ran
    assert launches
    _assert_same(got, want)
    assert got_stats == want_stats


# -- the weight cache ---------------------------------------------------------------------------
def _weight_casts(launches):
    return sum(name in ("_cast_kernel", "_cast_transpose_kernel") for name in launches)


@needs_interpreter
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_micro_batches_quantize_the_weight_once_per_version(kernels, recipe_name):
    layer = _layer()
    recipe = RECIPES[recipe_name]().bind(layer)
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    with counting_launches() as launches:
        for _ in range(3):  # gradient accumulation: no step in between
            with _region(recipe):
                layer(x).float().sum().backward()
    # Three inputs and one weight cast in the forwards (grad_output: the dbias kernel).
    assert _weight_casts(launches) == 3 + 1
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place change: a new version
    with counting_launches() as launches, _region(recipe):
        layer(x)
    assert _weight_casts(launches) == 2


def test_an_evaluation_loop_quantizes_each_weight_once_and_agrees_with_fresh_quantization():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    xs = [torch.randn(16, 48, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad(), _region(recipe):
        cached = [layer(x) for x in xs]
    site = recipe._lookup(layer.weight)
    assert site.cached is not None and site.cached.q_t is None  # no backward: no transposed copy
    for x, y in zip(xs, cached):
        site.cached = None
        with torch.no_grad(), _region(recipe):
            assert torch.equal(layer(x), y)
    assert recipe.report()[0].calls == 6


def test_an_optimizer_step_frees_the_cached_copies():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with _region(recipe):
        layer(torch.randn(16, 48)).float().sum().backward()
    site = recipe._lookup(layer.weight)
    assert site.cached is not None and site.cached_bias is not None
    opt.step()
    assert site.cached is None and site.cached_bias is None


def test_a_weight_cached_under_inference_mode_is_not_used_for_training():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    x = torch.randn(16, 48)
    with torch.inference_mode(), _region(recipe):
        layer(x)
    with _region(recipe):
        y = layer(x)
    y.float().sum().backward()  # an inference tensor saved for backward would raise here
    assert layer.weight.grad is not None


# -- what the backward keeps --------------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_the_backward_keeps_only_the_transposed_fp8_layouts(recipe_name):
    layer = _layer(bias=False)
    x = torch.randn(64, 48, requires_grad=True)
    with _region(RECIPES[recipe_name]()):
        y = layer(x)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    fp8_saved = sorted(tuple(t.shape) for t in saved if t.dtype in (E4M3, E5M2))
    assert fp8_saved == [(48, 32), (48, 64)]  # w.T and x.T: the layouts dw and dx take


def test_nothing_is_kept_for_a_gradient_no_one_asks_for():
    layer = _layer(bias=False).requires_grad_(False)
    x = torch.randn(64, 48, requires_grad=True)
    with _region(fp8.CurrentScaling()):
        y = layer(x)
    fp8_saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.dtype == E4M3]
    assert [tuple(t.shape) for t in fp8_saved] == [(48, 32)]  # no x.T: no weight gradient


# -- host reads ---------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_a_training_step_reads_nothing_back(kernels, sync_counter, recipe_name):
    layer = _layer()
    recipe = RECIPES[recipe_name]().bind(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(32, 48)

    def step():
        with _region(recipe):
            layer(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # delayed scaling's host learns its flags from the first calls
        step()
    with sync_counter() as counter:
        step()
    assert counter.count == 0


def test_the_first_calls_of_delayed_scaling_learn_the_flag_without_blocking():
    layer = _layer()
    recipe = fp8.DelayedScaling().bind(layer)
    with _region(recipe):
        layer(torch.randn(16, 48)).float().sum().backward()
    states = recipe._lookup(layer.weight).roles
    assert not any(s.ready for s in states.values())  # the first call: nothing known yet
    with _region(recipe):
        layer(torch.randn(16, 48)).float().sum().backward()
    assert states["input"].ready and states["grad_output"].ready  # the weight's was cached
