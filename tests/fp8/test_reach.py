"""Linear-shaped matmuls run in fp8 as the linear they are (``fp8/_reach.py``).

``torch.addmm(bias, x, w)`` on an ``(in, out)`` parameter (transformers' Conv1D), and
``x @ w.t()``, ``torch.matmul``, ``torch.mm`` and ``torch.addmm`` on the transpose of an
``(out, in)`` parameter: bit-identical, outputs, gradients and recipe state, to the same
model written with ``nn.Linear``; sites named after the parameter; every ineligible call
exactly what the region did before (the fp8 policy of ``linear`` alone).
"""

import os

import pytest
import torch
import torch._dynamo.testing
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.autocast import _handlers
from dispatch_amp.autocast._routing import plan_for
from dispatch_amp.fp8._reach import linear_shaped

if os.environ.get("CI") == "true":  # CI installs the test extra: these must run there
    from transformers.pytorch_utils import Conv1D
    import transformers
else:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

RECIPES = {
    "current": fp8.CurrentScaling,
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "rowwise": fp8.RowwiseScaling,
}
# The policy every fp8 region applied before matmuls were reached: linear alone fp8.
LINEAR_ONLY = amp.Policy.for_device("cpu").with_ops(fp8=["linear"])


# -- the spellings of one linear --------------------------------------------------------
def _conv1d(x, w, b):  # transformers' Conv1D: w is (in, out)
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def _addmm_t(x, w, b):
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).reshape(*x.shape[:-1], w.shape[0])


def _mm_t(x, w, b):
    return torch.mm(x.reshape(-1, x.shape[-1]), w.t()).reshape(*x.shape[:-1], w.shape[0]) + b


def _matmul_op(x, w, b):  # N-D input, the @ operator
    return x @ w.T + b


def _matmul_fn(x, w, b):
    return torch.matmul(x, w.transpose(0, 1)) + b


def _method(x, w, b):
    return x.matmul(w.t()) + b


SPELLINGS = {"conv1d": _conv1d, "addmm_t": _addmm_t, "mm_t": _mm_t, "matmul_op": _matmul_op,
             "matmul_fn": _matmul_fn, "method": _method}


class Layer(nn.Module):
    """A linear written as ``spelling``, weight in Conv1D's layout for ``conv1d``."""

    def __init__(self, n_in, n_out, spelling):
        super().__init__()
        self.spelling = spelling
        shape = (n_in, n_out) if spelling == "conv1d" else (n_out, n_in)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return SPELLINGS[self.spelling](x, self.weight, self.bias)


class LinearLayer(nn.Linear):
    """The linear a ``Layer`` is, written with ``F.linear`` (the bias added after the gemm
    where the spelling adds it so)."""

    def __init__(self, n_in, n_out, spelling):
        super().__init__(n_in, n_out)
        self.bias_inside = spelling in ("conv1d", "addmm_t")

    def forward(self, x):
        if self.bias_inside:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight) + self.bias


def _models(spelling, seed=0):
    """(reach model, the same model of linears), equal weights."""
    torch.manual_seed(seed)
    ref = nn.Sequential(LinearLayer(32, 64, spelling), nn.GELU(), LinearLayer(64, 32, spelling))
    model = nn.Sequential(Layer(32, 64, spelling), nn.GELU(), Layer(64, 32, spelling))
    with torch.no_grad():
        for mine, lin in ((model[0], ref[0]), (model[2], ref[2])):
            mine.weight.copy_(lin.weight.t() if spelling == "conv1d" else lin.weight)
            mine.bias.copy_(lin.bias)
    return model, ref


def _batch(step, spelling):
    shape = (16, 32) if spelling in ("addmm_t", "mm_t") and step % 2 else (2, 8, 32)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(step)) * (1 + step)


def _train(model, recipe, spelling, steps=3, policy=None, compiled=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = compiled or model
    out = []
    for step in range(steps):
        x = _batch(step, spelling).requires_grad_(True)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe, policy=policy):
            y = run(x)
        y.float().pow(2).mean().backward()
        out.append((y.detach(), x.grad, [(p.grad.clone(), p.grad.stride()) for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def _same_as_linear(got, ref, spelling):
    for (y, dx, grads), (y_r, dx_r, grads_r) in zip(got, ref):
        assert torch.equal(y, y_r) and y.dtype == y_r.dtype
        assert torch.equal(dx, dx_r)
        for i, ((g, stride), (g_r, _)) in enumerate(zip(grads, grads_r)):
            if spelling == "conv1d" and g.dim() == 2:  # the parameter's own layout (in, out)
                assert g.shape == g_r.t().shape and stride == (g.shape[1], 1)
                g_r = g_r.t()
            assert torch.equal(g, g_r), i


def _reports(recipe):
    return [(r.name, r.calls, r.amax, r.scale, r.saturated) for r in recipe.report()]


# -- what a linear-shaped call is ----------------------------------------------------------
def test_linear_shaped_recognizes_each_spelling():
    p = nn.Parameter(torch.randn(16, 32))
    x, b = torch.randn(4, 32), torch.randn(16)
    call = linear_shaped("aten::addmm", (b, x, p.t()), {})
    assert call[1] is p and call[3] is p and call[2] is b
    x_, w, b_, holder = linear_shaped("aten::addmm", (b, torch.randn(4, 16), p), {"beta": 1, "alpha": 1.0})
    assert holder is p and w.shape == (32, 16) and w._base is p
    assert linear_shaped("aten::mm", (x,), {"mat2": p.T})[3] is p
    assert linear_shaped("aten::matmul", (torch.randn(2, 3, 32), p.transpose(1, 0)), {})[3] is p
    assert linear_shaped("aten::addmm", (), {"input": b, "mat1": x, "mat2": p.t()})[3] is p


@pytest.mark.parametrize("case", [
    "buffer", "computed", "view_not_transpose", "slice_of_transpose", "beta", "alpha", "bool_beta", "out",
    "out_dtype", "one_d_input", "three_d_right", "three_d_mm_input", "subclass", "sparse_input",
])
def test_linear_shaped_refuses_everything_else(case):
    p = nn.Parameter(torch.randn(32, 32))
    x, b = torch.randn(4, 32), torch.randn(32)
    calls = {
        "buffer": ("aten::mm", (x, torch.randn(32, 32).t()), {}),
        "computed": ("aten::mm", (x, (p * 2).t()), {}),
        "view_not_transpose": ("aten::mm", (x, p.view(32, 32)), {}),
        "slice_of_transpose": ("aten::mm", (x, p.t()[:, :16]), {}),
        "beta": ("aten::addmm", (b, x, p), {"beta": 0.5}),
        "alpha": ("aten::addmm", (b, x, p), {"alpha": 2}),
        "bool_beta": ("aten::addmm", (b, x, p), {"beta": True}),
        "out": ("aten::mm", (x, p.t()), {"out": torch.empty(4, 32)}),
        "out_dtype": ("aten::mm", (x, p.t(), torch.float32), {}),
        "one_d_input": ("aten::matmul", (torch.randn(32), p.t()), {}),
        "three_d_right": ("aten::matmul", (torch.randn(2, 4, 32), p.t().expand(2, 32, 32)), {}),
        "three_d_mm_input": ("aten::mm", (torch.randn(2, 4, 32), p.t()), {}),
        "subclass": ("aten::mm", (x, nn.parameter.Buffer(torch.randn(32, 32))), {}),
        "sparse_input": ("aten::mm", (x.to_sparse(), p.t()), {}),
    }
    assert linear_shaped(*calls[case]) is None


# -- numerics: the linear it is -------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_bit_identical_to_the_linear_model(spelling, recipe_name):
    model, ref = _models(spelling)
    recipe, ref_recipe = RECIPES[recipe_name](), RECIPES[recipe_name]()
    got = _train(model, recipe, spelling)
    _same_as_linear(got, _train(ref, ref_recipe, spelling), spelling)
    assert _reports(recipe) == _reports(ref_recipe)
    assert [r.name for r in recipe.report()] == ["0", "2"]
    state, ref_state = recipe.state_dict(), ref_recipe.state_dict()
    assert state.keys() == ref_state.keys()
    for name, entries in ref_state.get("sites", {}).items():
        assert all(torch.equal(v, state["sites"][name][k]) for k, v in entries.items()), name


def test_a_conv1d_checkpoint_of_delayed_scaling_resumes_a_linear_model_and_back():
    model, ref = _models("conv1d")
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    ref_recipe = fp8.DelayedScaling(amax_history_len=4).bind(ref)
    _train(model, recipe, "conv1d", steps=2)
    _train(ref, ref_recipe, "conv1d", steps=2)
    # Each recipe takes the other's checkpoint: the sites are the same names.
    recipe.load_state_dict(ref_recipe.state_dict())
    ref_recipe.load_state_dict(recipe.state_dict())
    _same_as_linear(_train(model, recipe, "conv1d", steps=2), _train(ref, ref_recipe, "conv1d", steps=2), "conv1d")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_calls_run_in_fp8(mode):
    model, ref = _models("conv1d")
    recipe, ref_recipe = fp8.CurrentScaling(), fp8.CurrentScaling()
    x = _batch(0, "conv1d")
    with getattr(torch, mode)():
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            y = model(x)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=ref_recipe):
            y_ref = ref(x)
    assert torch.equal(y, y_ref) and [r.calls for r in recipe.report()] == [1, 1]


def test_gradient_accumulation_reuses_the_weight_cache_bit_identically():
    model, ref = _models("conv1d")
    recipe, ref_recipe = fp8.DelayedScaling(amax_history_len=4), fp8.DelayedScaling(amax_history_len=4)
    for m, r in ((model, recipe), (ref, ref_recipe)):
        for step in range(3):  # micro-batches: the same weight version each time
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=r):
                m(_batch(step, "conv1d")).float().pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad.t() if p.dim() == 2 else q.grad)
    assert _reports(recipe) == _reports(ref_recipe)


class TiedBothWays(nn.Module):
    """One parameter as an encoder (``x @ w.t()``) and, transposed, as a decoder
    (``addmm(b, h, w)``): one site, two linears with different weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(64, 32) / 8)
        self.b = nn.Parameter(torch.zeros(32))

    def forward(self, x):
        return torch.addmm(self.b, F.gelu(x @ self.w.t()), self.w)

    def reference(self, x):  # the same as linears; the transposed weight is no parameter
        return F.linear(F.gelu(F.linear(x, self.w)), self.w.t().contiguous(), self.b)


def test_a_parameter_used_both_ways_is_quantized_in_each_layout():
    model = TiedBothWays()
    # x requires grad: both calls keep the transposed layouts, so the second finds the
    # first's in the weight cache unless the layouts tell them apart.
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    recipe = fp8.CurrentScaling()
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        y = model(x)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        y_ref = model.reference(x)
    assert torch.equal(y, y_ref)
    assert recipe.site_names(model.w) == ("w",) and recipe.report()[0].calls == 2


# -- sites and names --------------------------------------------------------------------------
class TiedHead(nn.Module):
    """GPT-2's tied embedding and head, the head written ``h @ wte.weight.t()``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(32, 32)
        self.lm_head = nn.Linear(32, 32, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.wte(idx) @ self.lm_head.weight.t()


def test_a_tied_weight_keeps_all_its_names_and_filter_fn_sees_each():
    model = TiedHead()
    idx = torch.arange(16)
    seen = []
    recipe = fp8.CurrentScaling(filter_fn=lambda name, x, w: seen.append((name, tuple(x), tuple(w))) or True)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        model(idx)
    assert recipe.site_names(model.wte.weight) == ("wte", "lm_head")
    assert seen == [("wte", (16, 32), (32, 32)), ("lm_head", (16, 32), (32, 32))]
    # filter_fn must accept every name: refusing one runs the call as before.
    refusing = fp8.CurrentScaling(filter_fn=lambda name, x, w: name != "lm_head")
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=refusing):
        y = model(idx)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling(), policy=LINEAR_ONLY):
        y_old = model(idx)
    assert torch.equal(y, y_old) and refusing.report() == []


def test_filter_fn_sees_the_linear_weight_shape_of_a_conv1d():
    seen = []
    recipe = fp8.CurrentScaling(filter_fn=lambda name, x, w: seen.append((name, tuple(w))) or True)
    conv = Conv1D(48, 32)  # 32 in, 48 out
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        conv(torch.randn(16, 32))
    assert seen == [("<root>", (48, 32))]


# -- everything else runs as before ------------------------------------------------------------
class Ineligible(nn.Module):
    """Matmuls the fp8 path leaves alone, next to each other."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(32, 32) / 6)
        self.odd = nn.Parameter(torch.randn(24, 32) / 6)  # 24 outputs: not a multiple of 16
        self.b = nn.Parameter(torch.randn(32))
        self.register_buffer("buf", torch.randn(32, 32) / 6)

    def forward(self, x, case):
        w, b = self.w, self.b
        if case == "buffer":
            return x @ self.buf.t()
        if case == "computed":
            return x @ (w * 2).t()
        if case == "odd":
            return x @ self.odd.t()
        if case == "beta":
            return torch.addmm(b, x, w, beta=0.5)
        if case == "alpha":
            return torch.addmm(b, x, w.t(), alpha=2.0)
        if case == "bias_2d":
            return torch.addmm(b.expand(x.shape[0], 32), x, w)
        if case == "out":
            out = torch.empty(x.shape[0], 32)
            with torch.no_grad():  # out= takes no gradients
                torch.mm(x, w.t(), out=out)
            return out
        if case == "one_d":
            return x[0] @ w.t()
        if case == "batched_right":
            return x.reshape(2, -1, 32) @ w.t().expand(2, 32, 32)
        if case == "left":
            return w.t() @ x.t()
        if case == "rows_not_16":
            return x[:12] @ w.t()
        if case == "filtered":
            return x @ w.t()
        raise AssertionError(case)


INELIGIBLE = ["buffer", "computed", "odd", "beta", "alpha", "bias_2d", "out", "one_d", "batched_right", "left",
              "rows_not_16", "filtered"]


@pytest.mark.parametrize("case", INELIGIBLE)
def test_ineligible_calls_run_exactly_as_before(case):
    model = Ineligible()
    filter_fn = (lambda name, x, w: name != "w") if case == "filtered" else None
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    results = []
    for recipe, policy in ((fp8.CurrentScaling(filter_fn=filter_fn), None),
                           (fp8.CurrentScaling(filter_fn=filter_fn), LINEAR_ONLY), (None, None)):
        xx = x.clone().requires_grad_(True)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe, policy=policy):
            y = model(xx, case)
        if y.requires_grad:
            y.float().sum().backward()
        results.append((y, xx.grad, [p.grad for p in model.parameters()]))
        model.zero_grad()
        assert recipe is None or recipe.report() == []
    (y, dx, grads), (y_old, dx_old, grads_old), (y_lower, _, _) = results
    assert torch.equal(y, y_old) and torch.equal(y, y_lower)
    assert (dx is None and dx_old is None) or torch.equal(dx, dx_old)
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(grads, grads_old))


@settings(deadline=None, max_examples=25)
@given(spelling=st.sampled_from(sorted(SPELLINGS)), rows=st.sampled_from([8, 16, 32, 40]),
       n_in=st.sampled_from([16, 24, 32]), n_out=st.sampled_from([16, 40, 48]), seed=st.integers(0, 2**16))
def test_each_call_is_the_linear_if_eligible_else_as_before(spelling, rows, n_in, n_out, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g)
    layer = Layer(n_in, n_out, spelling)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
        layer.bias.copy_(torch.randn(n_out, generator=g))
    w = (layer.weight.t() if spelling == "conv1d" else layer.weight).detach().contiguous()
    recipe = fp8.CurrentScaling()
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        y = layer(x)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        if spelling in ("conv1d", "addmm_t"):  # the bias is the linear's
            y_linear = F.linear(x, w, layer.bias)
        else:  # the bias is added to the gemm's output
            y_linear = F.linear(x, w) + layer.bias
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling(), policy=LINEAR_ONLY):
        y_old = layer(x)
    eligible = rows % 16 == 0 and n_in % 16 == 0 and n_out % 16 == 0
    assert torch.equal(y, y_linear if eligible else y_old)
    assert [(r.name, r.calls) for r in recipe.report()] == ([("<root>", 1)] if eligible else [])


# -- where calls come from ----------------------------------------------------------------------
def test_a_matmul_inside_torchs_composite_reaches_the_fp8_path():
    # Without a rule for matmul, matmul's own C++ composite calls mm(x.view(-1, k), w.t()):
    # the mm rule takes it there.
    policy = amp.Policy.for_device("cpu").without_ops("matmul")
    model, ref = _models("matmul_op")
    recipe, ref_recipe = fp8.CurrentScaling(), fp8.CurrentScaling()
    _same_as_linear(_train(model, recipe, "matmul_op", steps=2, policy=policy),
                    _train(ref, ref_recipe, "matmul_op", steps=2), "matmul_op")
    assert [r.calls for r in recipe.report()] == [2, 2]


def test_an_explicit_policy_of_linear_alone_leaves_matmuls_in_the_regions_dtype():
    model, _ = _models("conv1d")
    recipe = fp8.CurrentScaling()
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe, policy=LINEAR_ONLY):
        y = model(_batch(0, "conv1d"))
    with amp.autocast("cpu", dtype=torch.bfloat16):
        y_lower = model(_batch(0, "conv1d"))
    assert recipe.report() == [] and torch.equal(y, y_lower)


def test_policies_without_fp8_keep_lower_for_the_matmuls():
    plan = plan_for(amp.Policy.for_device("cpu"), "cpu")
    for op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
        assert plan.handler(op) is _handlers.lower


def test_torch_checkpoint_refuses_a_linear_shaped_matmul_and_amp_checkpoint_replays_it():
    model, ref = _models("conv1d")
    x = _batch(0, "conv1d")
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        with pytest.raises(RuntimeError, match="dispatch_amp.checkpoint"):
            torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    results = []
    for m in (model, ref):
        recipe = fp8.DelayedScaling(amax_history_len=4)
        for step in range(2):
            xx = _batch(step, "conv1d").requires_grad_(True)
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                y = amp.checkpoint(m, xx, use_reentrant=False)
            y.float().pow(2).mean().backward()
        results.append(([p.grad for p in m.parameters()], _reports(recipe)))
    (grads, report), (grads_ref, report_ref) = results
    assert report == report_ref
    assert all(torch.equal(g, h.t() if g.dim() == 2 else h) for g, h in zip(grads, grads_ref))


@pytest.mark.parametrize("spelling", ["attention matmul", "bmm", "linear with odd sizes"])
def test_calls_that_are_not_fp8_run_inside_torch_checkpoint_as_native_runs_them(spelling):
    # Only the calls the fp8 path takes are refused inside torch.utils.checkpoint (its
    # recomputation runs under native autocast); the others are cast as native casts them,
    # so torch's checkpoint recomputes them exactly, as under native autocast.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 4, 16, 16, generator=g)
    odd = nn.Linear(10, 6)
    fns = {
        "attention matmul": lambda a: a @ k.transpose(-2, -1),
        "bmm": lambda a: torch.bmm(a.flatten(0, 1), k.flatten(0, 1).transpose(-2, -1)),
        "linear with odd sizes": lambda a: odd(a[..., :10]),
    }
    fn = fns[spelling]
    outs, grads = [], []
    for region in (lambda: amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()),
                   lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        a = q.clone().requires_grad_(True)
        with region():
            y = torch.utils.checkpoint.checkpoint(fn, a, use_reentrant=False)
        y.float().sum().backward()
        outs.append(y)
        grads.append(a.grad)
    assert outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


# -- transformers' GPT-2 -------------------------------------------------------------------------
def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("bound", [False, True])
def test_every_gpt2_conv1d_runs_in_fp8_named_by_its_module_path(bound):
    model = _gpt2()
    recipe = fp8.DelayedScaling()
    if bound:
        recipe.bind(model)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        loss = model(idx, labels=idx).loss
    loss.backward()
    conv1ds = sorted(name for name, m in model.named_modules() if isinstance(m, Conv1D))
    assert len(conv1ds) == 8
    report = {r.name: r for r in recipe.report()}
    assert sorted(report) == sorted(conv1ds + ["transformer.wte"])
    for name in conv1ds:
        assert report[name].calls == 1 and set(report[name].amax) == {"input", "weight", "grad_output"}
    assert recipe.site_names(model.lm_head.weight) == ("transformer.wte", "lm_head")
    # bind names every 2-D weight, the position embedding's too (no fp8 call).
    bound_only = ["transformer.wpe"] if bound else []
    assert sorted(recipe.state_dict()["sites"]) == sorted(conv1ds + ["transformer.wte"] + bound_only)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# -- torch.compile ----------------------------------------------------------------------------------
@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("spelling", ["conv1d", "matmul_op", "mm_t"])
def test_compiled_is_bit_identical_to_eager_in_one_graph(spelling, recipe_name):
    model, _ = _models(spelling)
    recipe = RECIPES[recipe_name]().bind(model)
    eager = _train(model, recipe, spelling)
    model_c, _ = _models(spelling)
    recipe_c = RECIPES[recipe_name]().bind(model_c)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model_c, backend=counter, fullgraph=True)
    got = _train(model_c, recipe_c, spelling, compiled=compiled)
    _same_as_linear(got, eager, spelling="same layout")
    assert 1 <= counter.frame_count <= 3  # the batch shapes of mm_t alternate
    assert _reports(recipe) == _reports(recipe_c)
    state, state_c = recipe.state_dict(), recipe_c.state_dict()
    for name, entries in state.get("sites", {}).items():
        assert all(torch.equal(v, state_c["sites"][name][k]) for k, v in entries.items()), name


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("spelling", ["conv1d", "matmul_op"])
def test_the_compiled_graph_contains_the_scaled_gemms(spelling):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, _ = _models(spelling)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        compiled(_batch(0, spelling))
    # The autograd Function is a higher-order op of the graph; its forward is a subgraph.
    assert len(graphs) == 1
    code = "\n".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    # Two forward gemms; the backward's: grad_input of the second layer, grad_weight of both.
    # torch._scaled_mm on CUDA; on the CPU the same gemm by its rule, one op of ours (_gemms.py).
    gemms = code.count("torch._scaled_mm(") + code.count("torch.ops.dispatch_amp.scaled_mm.default(")
    assert gemms == 5 and "float8_e4m3fn" in code and "float8_e5m2" in code


TRANSPOSES = {
    "T": lambda x, w: x @ w.T, "t": lambda x, w: x @ w.t(), "transpose": lambda x, w: x @ w.transpose(0, 1),
    "mT": lambda x, w: x @ w.mT, "torch.t": lambda x, w: torch.matmul(x, torch.t(w)),
    "permute": lambda x, w: torch.mm(x, w.permute(1, 0)), "swapaxes": lambda x, w: x @ w.swapaxes(0, 1),
    # Each property reaches the fp8 level under its own name from torch 2.14 on (numpy_T,
    # mT, matrix_H, mH), as a getter before: every spelling on every release.
    "H": lambda x, w: x @ w.H, "mH": lambda x, w: x @ w.mH, "adjoint": lambda x, w: x @ w.adjoint(),
    "swapdims": lambda x, w: x @ w.swapdims(0, 1),
}


class Transposed(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(48, 32))

    def forward(self, x):
        return TRANSPOSES[self.how](x, self.weight)


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("how", sorted(TRANSPOSES))
def test_each_transpose_of_a_parameter_is_its_site_compiled_as_eagerly(how):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    results = []
    for compile_it in (False, True):
        model = Transposed(how)
        recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compile_it else model
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            y = run(x)
        results.append((y, _reports(recipe)))
    (y, report), (y_c, report_c) = results
    assert torch.equal(y, y_c) and report == report_c and [r[:2] for r in report] == [("<root>", 1)]
