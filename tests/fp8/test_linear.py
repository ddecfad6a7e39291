"""The fp8 linear against the oracle written from the rules in docs/fp8.md.

Every recipe; inputs in float32, bfloat16 and float16; eligible and ineligible shapes;
with and without bias; 2-D and 3-D inputs; under our regions of each dtype and inside
native regions; outputs and all three gradients. Bit for bit where the oracle makes the
gemm calls ours makes (``oracle.gemm_nt``), within ``oracle.gemm_bound`` where it
multiplies as the rules read: the CPU's gemm kernel sums in an order of its own, by
operand layout and by machine.
"""

import pytest
import torch
import torch.nn.functional as F

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.kernels import fp8_quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "current": lambda: fp8.CurrentScaling(),
    "current-pow2": lambda: fp8.CurrentScaling(power_of_two=True),
    "current-e5m2-grads-e4m3": lambda: fp8.CurrentScaling(grad_format=E4M3),
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "rowwise": lambda: fp8.RowwiseScaling(),
    "rowwise-hp-wgrad": lambda: fp8.RowwiseScaling(weight_grad_high_precision=True),
}
SOURCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(x_shape, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = (torch.randn(*x_shape, generator=g) * 3).to(dtype).requires_grad_(True)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(n, generator=g)).to(dtype).requires_grad_(True) if bias else None
    dy = torch.randn(*x_shape[:-1], n, generator=g)
    return x, w, b, dy


def _expected(oracle, recipe, x, w, b, dy, out_dtype, site=None, pinned=False):
    """Output and gradients per the rules in docs/fp8.md for one call, each with the bound
    on its distance from ours: ``(y, dx, dw, db), (by, bdx, bdw, bdb)``.

    The gemms are float32 matmuls of the dequantized operands, written as the rules read
    (``a @ b``): ours sums them in another order on some CPUs, within ``gemm_bound``.
    ``pinned=True`` writes each as ours calls it (``oracle.gemm_nt``): the same bits on
    any machine, every bound 0. The bias gradient is summed in the same order on both
    sides: bound 0.
    """
    k = w.shape[1]
    x2, dy2 = x.detach().reshape(-1, k), dy.reshape(-1, w.shape[0]).to(out_dtype)
    w_ = w.detach()
    ff, gf = recipe.forward_format, recipe.grad_format
    bounds = []

    def gemm(a, b, dtype, bias=None):
        bounds.append(0 if pinned else oracle.gemm_bound(a, b, dtype, bias))
        return oracle.gemm_nt(a, b.t()) if pinned else a @ b

    bias = None if b is None else b.detach().to(out_dtype).float()
    if isinstance(recipe, fp8.RowwiseScaling):
        sx, sw = oracle.current_scale(x2, ff, True), oracle.current_scale(w_, ff, True)
        y = gemm(oracle.qdq(x2, sx, ff), oracle.qdq(w_, sw, ff).t(), out_dtype, bias)
        sdy = oracle.current_scale(dy2, gf, True)
        wt = w_.t()
        dx = gemm(oracle.qdq(dy2, sdy, gf), oracle.qdq(wt, oracle.current_scale(wt, ff, True), ff).t(), x.dtype)
        if recipe.weight_grad_high_precision:
            dw = (dy2.t().to(out_dtype) @ x2.to(out_dtype)).float()  # the same call as ours
            bounds.append(0)
        else:
            dyt, xt = dy2.t(), x2.t()
            dw = gemm(oracle.qdq(dyt, oracle.current_scale(dyt, gf, True), gf),
                      oracle.qdq(xt, oracle.current_scale(xt, ff, True), ff).t(), w.dtype)
    else:
        if isinstance(recipe, fp8.DelayedScaling):
            sx, sw = site.use("input", x2, ff), site.use("weight", w_, ff)
            sdy = site.use("grad_output", dy2, gf)
        else:
            p2 = recipe.power_of_two
            sx, sw = oracle.current_scale(x2, ff, power_of_two=p2), oracle.current_scale(w_, ff, power_of_two=p2)
            sdy = oracle.current_scale(dy2, gf, power_of_two=p2)
        y = gemm(oracle.qdq(x2, sx, ff), oracle.qdq(w_, sw, ff).t(), out_dtype, bias)
        dyd = oracle.qdq(dy2, sdy, gf)
        dx = gemm(dyd, oracle.qdq(w_, sw, ff), x.dtype)
        dw = gemm(dyd.t(), oracle.qdq(x2, sx, ff), w.dtype)
    if bias is not None:  # the bias, in the output dtype, added to the float32 accumulator
        y = y + bias
    y = y.to(out_dtype).reshape(*x.shape[:-1], w.shape[0])
    db = None if b is None else oracle.bias_grad(dy2).to(b.dtype)
    by, bdx, bdw = bounds
    if not pinned:
        by, bdx = by.reshape(y.shape), bdx.reshape(x.shape)
    return (y, dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype), db), (by, bdx, bdw, 0)


def _assert_bits(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: nan positions differ"
    ok = got.isnan()
    assert torch.equal(got[~ok], want[~ok]), f"{what}: max |diff| {(got.float() - want.float()).abs().max()}"


def _run(region, x, w, b, dy):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    with region:
        y = F.linear(x, w, b)
    y.backward(dy.to(y.dtype))
    return y, x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("x_shape", [(32, 48), (2, 16, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("source", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_matches_the_oracle(oracle, recipe_name, source, x_shape, bias):
    # Within the gemms' bound: the oracle multiplies as the rules read, ours in the layouts
    # its gemms take (another summation order on some CPUs). Everything else bit for bit.
    recipe = RECIPES[recipe_name]()
    site = oracle.DelayedSite(4) if isinstance(recipe, fp8.DelayedScaling) else None
    x, w, b, dy = _inputs(x_shape, 32, source, bias)
    # Three calls: delayed scaling's scales change from call to call.
    for step in range(3 if site else 1):
        got = _run(amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy * (step + 1))
        want, bounds = _expected(oracle, recipe, x, w, b, dy * (step + 1), torch.bfloat16, site)
        for name, g, e, bound in zip(("y", "dx", "dw", "db"), got, want, bounds):
            if e is not None:
                oracle.assert_within(g, e, bound, f"{recipe_name} step {step} {name}")


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_bit_exact_against_the_oracle_in_our_gemm_layouts(oracle, recipe_name):
    # The oracle's quantization, scales and bias rules, and each gemm the call ours makes
    # (oracle.gemm_nt): the same bits on every machine.
    recipe = RECIPES[recipe_name]()
    site = oracle.DelayedSite(4) if isinstance(recipe, fp8.DelayedScaling) else None
    x, w, b, dy = _inputs((2, 16, 48), 32, torch.bfloat16, True)
    for step in range(3 if site else 1):
        got = _run(amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy * (step + 1))
        want, _ = _expected(oracle, recipe, x, w, b, dy * (step + 1), torch.bfloat16, site, pinned=True)
        for name, g, e in zip(("y", "dx", "dw", "db"), got, want):
            _assert_bits(g, e, f"{recipe_name} step {step} {name}")


@pytest.mark.parametrize("region_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("recipe_name", ["current", "rowwise"])
def test_output_is_in_the_region_dtype(oracle, recipe_name, region_dtype):
    recipe = RECIPES[recipe_name]()
    x, w, b, dy = _inputs((16, 32), 16, torch.float32, True)
    got = _run(amp.autocast("cpu", dtype=region_dtype, fp8=recipe), x, w, b, dy)
    want, _ = _expected(oracle, recipe, x, w, b, dy, region_dtype, pinned=True)
    for name, g, e in zip(("y", "dx", "dw", "db"), got, want):
        _assert_bits(g, e, name)
    assert got[0].dtype == region_dtype and got[1].dtype == got[2].dtype == torch.float32


@pytest.mark.parametrize("shape", [(15, 32, 16), (16, 24, 16), (16, 32, 20), (3, 5, 32, 16)],
                         ids=["rows", "in", "out", "rows-3d"])
def test_ineligible_shapes_run_in_the_region_dtype(shape):
    *lead, k, n = shape
    x, w = torch.randn(*lead, k), torch.randn(n, k)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()) as region:
        got = F.linear(x, w)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, w)
    assert torch.equal(got, want) and got.dtype == torch.bfloat16
    assert region.fp8.report() == []  # no fp8 call was made


def test_filter_fn_sees_names_and_shapes():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    seen = []

    def only_first(name, x_shape, w_shape):
        seen.append((name, tuple(x_shape), tuple(w_shape)))
        return name == "0"

    recipe = fp8.CurrentScaling(filter_fn=only_first).bind(model)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        model(torch.randn(16, 32))
    assert seen == [("0", (16, 32), (32, 32)), ("1", (16, 32), (16, 32))]
    assert [r.name for r in recipe.report()] == ["0"]


def test_inside_a_native_region_native_rules(oracle):
    x, w, b, dy = _inputs((16, 32), 16, torch.float32, True)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = F.linear(x, w, b)
        with torch.autocast("cpu", enabled=False):
            off = F.linear(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, w, b)
    assert torch.equal(got, want)
    assert off.dtype == torch.float32 and torch.equal(off, F.linear(x, w, b))


def test_our_region_inside_a_native_region_of_another_dtype(oracle):
    recipe = fp8.CurrentScaling()
    x, w, b, dy = _inputs((16, 32), 16, torch.float32, False)
    with torch.autocast("cpu", dtype=torch.float16):
        got = _run(amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy)
    want, _ = _expected(oracle, recipe, x, w, b, dy, torch.bfloat16, pinned=True)
    for name, g, e in zip(("y", "dx", "dw"), got, want):
        _assert_bits(g, e, name)


def test_calls_the_policy_does_not_mark_follow_the_region():
    x, w = torch.randn(16, 32), torch.randn(16, 32)

    def calls():
        return [x @ w.t(), torch.softmax(x.bfloat16(), -1), torch.cat([x, x.bfloat16()]),
                F.layer_norm(x, (32,)), torch.addmm(x[:, :16], x, w.t())]

    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16 and torch.is_autocast_enabled("cpu")
        got = calls()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = calls()
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_frozen_weight_and_input_without_grad_skip_their_gemms(oracle):
    recipe = fp8.CurrentScaling()
    x, w, b, dy = _inputs((16, 32), 16, torch.float32, True)
    x.requires_grad_(False)
    w.requires_grad_(False)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        y = F.linear(x, w, b)
    y.backward(dy.bfloat16())
    assert x.grad is None and w.grad is None
    _assert_bits(b.grad, oracle.bias_grad(dy.bfloat16()), "db")


needs_interpreter = pytest.mark.skipif(
    fp8._rules._kernels.triton is None
    or (not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1"),
    reason="the Triton path needs triton, and TRITON_INTERPRET=1 without a GPU",
)


@needs_interpreter
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_the_triton_cast_kernels_give_the_same_bits(monkeypatch, recipe_name):
    # The kernels (fused amax-and-cast, cast-and-transpose) run on CUDA; here through
    # Triton's interpreter, against the torch path.
    def run():
        recipe = RECIPES[recipe_name]()
        x, w, b, dy = _inputs((2, 16, 48), 32, torch.bfloat16, True)
        out = []
        for step in range(2):
            out.append(_run(amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy * (step + 1)))
        return out

    torch_path = run()
    monkeypatch.setattr(fp8_quantize, "BACKEND", "triton")
    assert fp8._rules.kernels_in_use(torch.zeros(1))
    kernel_path = run()
    for got_step, want_step in zip(kernel_path, torch_path):
        for name, g, e in zip(("y", "dx", "dw", "db"), got_step, want_step):
            _assert_bits(g, e, name)
