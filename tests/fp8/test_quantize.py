"""The fp8 linear's quantization: the CUDA kernels (through Triton's interpreter) give the torch
path's bits, the weight cache keeps a weight's copies for one region (across regions only inside
``cast_cache``, and never past a write it cannot see), the backward keeps only the layouts its
gemms take, and a training step reads nothing back to the host."""

import contextlib
import copy
import os

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.kernels import fp8_quantize
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
    monkeypatch.setattr(fp8_quantize, "BACKEND", "triton")


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
    monkeypatch.setattr(fp8_quantize, "BACKEND", "triton")
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
def test_micro_batches_quantize_the_weight_once_per_region_or_once_per_version_in_cast_cache(kernels, recipe_name):
    layer = _layer()
    recipe = RECIPES[recipe_name]().bind(layer)
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))

    def micro_batches():
        with counting_launches() as launches:
            for _ in range(3):  # gradient accumulation: no step in between
                with _region(recipe):
                    layer(x).float().sum().backward()
        return _weight_casts(launches)

    # By default the weight's copy lives for one region, as native's casts do: three
    # inputs and three weight casts (grad_output: the dbias kernel).
    assert micro_batches() == 3 + 3
    with amp.cast_cache():  # kept across the scope's regions: one weight cast
        assert micro_batches() == 3 + 1
        with torch.no_grad():
            layer.weight.mul_(2)  # an in-place change: a new version
        with counting_launches() as launches, _region(recipe):
            layer(x)
        assert _weight_casts(launches) == 2


def test_an_evaluation_region_quantizes_each_weight_once_and_agrees_with_fresh_quantization():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    site = recipe.state.lookup(layer.weight)
    xs = [torch.randn(16, 48, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad(), _region(recipe):
        cached = [layer(x) for x in xs]
        assert site.cached is not None and site.cached.q_t is None  # no backward: no transposed copy
    assert site.cached is None and site.cached_bias is None  # freed with the region
    for x, y in zip(xs, cached):
        with torch.no_grad(), _region(recipe):
            assert torch.equal(layer(x), y)
    assert recipe.report()[0].calls == 6


def test_regions_that_make_no_copy_between_fp8_regions_leave_each_fp8_region_its_own_copies(monkeypatch):
    # A lifetime without copies is kept across its region's close (nothing to free), and
    # before any copy was kept in the process the engine does not ask; one with copies
    # ends there: the next fp8 region quantizes the weight anew.
    from dispatch_amp.fp8 import _quantize

    monkeypatch.setattr(_quantize, "kept_any", False)  # as in a process that kept none yet
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    site = recipe.state.lookup(layer.weight)
    x = torch.randn(16, 48)
    made = []
    for _ in range(3):
        with amp.autocast("cpu"):  # an autocast region without fp8: no copy made
            pass
        with torch.no_grad(), _region(recipe):
            layer(x)
            layer(x)  # the same copy serves the region's second call
            made.append(site.cached)
        assert site.cached is None and site.cached_bias is None
    assert all(copy is not None for copy in made)
    assert made[0] is not made[1] and made[1] is not made[2]


def test_an_optimizer_step_frees_the_cached_copies():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with amp.cast_cache():
        with _region(recipe):
            layer(torch.randn(16, 48)).float().sum().backward()
        site = recipe.state.lookup(layer.weight)
        assert site.cached is not None and site.cached_bias is not None
        opt.step()
        assert site.cached is None and site.cached_bias is None


def test_clear_autocast_cache_drops_the_copies_a_cast_cache_keeps():
    layer = _layer()
    recipe = fp8.CurrentScaling().bind(layer)
    x = torch.randn(16, 48)
    with amp.cast_cache():
        with torch.no_grad(), _region(recipe):
            layer(x)
        layer.weight.data.mul_(2)  # invisible to the cache: the documented way out follows
        amp.clear_autocast_cache()
        with torch.no_grad(), _region(recipe):
            y = layer(x)
    with torch.no_grad(), _region(fp8.CurrentScaling()):
        assert torch.equal(y, layer(x))


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


# -- writes the cache cannot see: nothing is kept past the region --------------------------------
WRITE_RECIPES = {
    "current": fp8.CurrentScaling,
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "rowwise": fp8.RowwiseScaling,
}


def _sgd_data(lin, step):  # a hand-written SGD step through .data: bumps no version counter
    for p in lin.parameters():
        p.data -= 0.5 * p.grad


def _broadcast_like(lin, step):  # what dist.broadcast into a parameter does to it
    g = torch.Generator().manual_seed(100 + step)
    for p in lin.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 8)


def _fused_sgd(lin, step):  # a functional optimizer calls the fused kernel directly
    params = list(lin.parameters())
    torch._fused_sgd_(params, [p.grad for p in params], [], weight_decay=0.0, momentum=0.0, lr=0.5,
                      dampening=0.0, nesterov=False, maximize=False, is_first_step=False)


def _new_vector(lin, step):
    # Evolution strategies, line search: a new parameter vector per iteration, each at the
    # address of the one before (the allocator reuses a freed block of the same size; a
    # buffer wrapped again makes that certain): a new storage, the same data_ptr().
    params = list(lin.parameters())
    vec = torch.nn.utils.parameters_to_vector(params)
    if not hasattr(lin, "vector_memory"):
        lin.vector_memory = bytearray(vec.nbytes)
    g = torch.Generator().manual_seed(200 + step)
    new = vec + torch.randn(vec.shape, generator=g) / 8
    wrapped = torch.frombuffer(lin.vector_memory, dtype=vec.dtype)
    wrapped.copy_(new)
    torch.nn.utils.vector_to_parameters(wrapped, params)


def _prune(lin, step):  # structured pruning: the first rows, the same storage and address
    rows = max(16, lin.weight.shape[0] // 2)
    lin.weight.data = lin.weight.data[:rows]
    lin.bias.data = lin.bias.data[:rows]


WRITES = {"data-sub": _sgd_data, "broadcast-like": _broadcast_like, "fused-sgd": _fused_sgd,
          "vector-to-parameters": _new_vector, "prune": _prune}
# Inside cast_cache the copies are kept across regions: what the entry's key must see.
SEEN_IN_CAST_CACHE = ("vector-to-parameters", "prune")


def _evaluations(recipe_name, write, scope):
    """Four forward-backward evaluations of one layer under one recipe, each against a fresh
    copy of the recipe (its state, none of its fp8 copies), with ``write`` between them."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    recipe = WRITE_RECIPES[recipe_name]().bind(lin)
    x_all = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with scope():
        for step in range(4):
            fresh = copy.deepcopy(recipe)
            results = []
            for r in (recipe, fresh):
                x = x_all.clone().requires_grad_(True)
                with _region(r):
                    y = lin(x)
                y.float().pow(2).mean().backward()
                results.append((y, x.grad, lin.weight.grad, lin.bias.grad))
                if r is recipe:
                    lin.zero_grad(set_to_none=True)
            for got, want in zip(*results):
                assert torch.equal(got, want), (step, (got - want).abs().max())
            # Free the graphs: a live one keeps the parameters' gradient accumulators, and
            # with them the shapes they had (pruning changes them).
            del results, y, x
            write(lin, step)  # the gradients it may take are the reference's (the same bits)
            lin.zero_grad(set_to_none=True)


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("recipe_name", sorted(WRITE_RECIPES))
def test_every_write_between_regions_is_seen(recipe_name, write):
    _evaluations(recipe_name, WRITES[write], contextlib.nullcontext)


@pytest.mark.parametrize("write", SEEN_IN_CAST_CACHE)
@pytest.mark.parametrize("recipe_name", sorted(WRITE_RECIPES))
def test_inside_cast_cache_new_storage_shapes_and_reused_addresses_are_seen(recipe_name, write):
    _evaluations(recipe_name, WRITES[write], amp.cast_cache)


@pytest.mark.parametrize("recipe_name", sorted(WRITE_RECIPES))
def test_a_hand_written_sgd_step_through_data_trains_as_the_no_grad_form(recipe_name):
    def losses(update):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 64)
        x, y = torch.randn(32, 64), torch.randn(32, 64)
        recipe, out = WRITE_RECIPES[recipe_name](), []
        for _ in range(4):
            with amp.autocast("cpu", fp8=recipe):
                loss = (lin(x).float() - y).pow(2).mean()
            loss.backward()
            out.append(loss.item())
            update(lin)
        return out

    def through_data(lin):
        for p in lin.parameters():
            p.data -= 0.5 * p.grad
            p.grad = None

    def no_grad(lin):
        with torch.no_grad():
            for p in lin.parameters():
                p -= 0.5 * p.grad
                p.grad = None

    got = losses(through_data)
    assert got == losses(no_grad)
    # It trains as native bf16 does (1.418, 1.316, 1.223, 1.140): fp8 is a few thousandths off.
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    native = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (lin(x).float() - y).pow(2).mean()
        loss.backward()
        native.append(loss.item())
        through_data(lin)
    assert got == pytest.approx(native, abs=0.02)
    assert got[-1] < got[0] - 0.2


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
    states = recipe.state.lookup(layer.weight).roles
    assert not any(s.ready for s in states.values())  # the first call: nothing known yet
    with _region(recipe):
        layer(torch.randn(16, 48)).float().sum().backward()
    assert all(s.ready for s in states.values())
