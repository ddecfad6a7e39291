"""fp8 under torch.compile: the fp8 gemms in the graph (fullgraph), aot_eager bit-identical
to eager over several training steps (``nn.MultiheadAttention``'s projections in fp8
too), recompilation when the recipe changes."""

import pytest
import torch
import torch._dynamo.testing

import dispatch_amp as amp
from dispatch_amp import fp8

RECIPES = {
    "current": fp8.CurrentScaling,
    "rowwise": fp8.RowwiseScaling,
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "current-filtered": lambda: fp8.CurrentScaling(filter_fn=lambda name, x, w: name != "2"),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


class _Attention(torch.nn.Module):
    """Self-attention (one packed in-projection) and attention to a padded memory of
    another width (separate q/k/v projections), then a linear: every projection runs in
    fp8."""

    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
        self.cross = torch.nn.MultiheadAttention(32, 2, kdim=48, vdim=48, batch_first=True)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        x = x.view(2, 8, 32)
        memory = torch.cat([x, x[..., :16]], dim=-1)
        a, _ = self.self_attn(x, x, x, need_weights=False)
        padding = (torch.arange(8) >= 6).expand(2, 8)
        b, _ = self.cross(a, memory, memory, key_padding_mask=padding)
        return self.out(b).view(16, 32)


def _attention():
    torch.manual_seed(0)
    return _Attention()


MODELS = {"mlp": _model, "attention": _attention}


def _train(model, recipe, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("make", sorted(MODELS))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_aot_eager_is_bit_identical_to_eager_in_one_graph(name, make):
    # nn.MultiheadAttention: Dynamo keeps F.multi_head_attention_forward whole, and its
    # projections must still run in fp8 as they do eagerly (the reports compare them).
    eager_model = MODELS[make]()
    eager_recipe = RECIPES[name]().bind(eager_model)
    eager = _train(eager_model, eager_recipe)

    model = MODELS[make]()
    recipe = RECIPES[name]().bind(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = _train(compiled, recipe)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, got):
        assert torch.equal(loss_e, loss_c)
        assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c))
    # The graph holds the fp8 gemms (compiled once; delayed scaling's state is created by
    # the first call, which the second call's guards see once).
    assert 1 <= counter.frame_count <= 2
    assert eager_recipe.state_dict().keys() == recipe.state_dict().keys()
    for site, entries in eager_recipe.state_dict().get("sites", {}).items():
        for key, value in entries.items():
            assert torch.equal(value, recipe.state_dict()["sites"][site][key]), (site, key)
    assert [(r.name, r.calls, r.amax, r.scale, r.saturated) for r in eager_recipe.report()] == [
        (r.name, r.calls, r.amax, r.scale, r.saturated) for r in recipe.report()]


def test_attention_projections_run_in_fp8_compiled():
    model = _attention()
    recipe = fp8.CurrentScaling().bind(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        compiled(torch.randn(16, 32))
    ran = {r.name for r in recipe.report() if r.calls}
    assert {"self_attn.in_proj_weight", "self_attn.out_proj", "cross.q_proj_weight",
            "cross.k_proj_weight", "cross.v_proj_weight", "cross.out_proj", "out"} <= ran


def test_unflatten_traces_under_fp8_in_one_graph():
    # Tensor.unflatten ends in super().unflatten, which Dynamo cannot inline under a mode.
    model = torch.nn.Linear(32, 96)
    x = torch.randn(16, 32)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling()):
        want = model(x).unflatten(-1, (3, 32))
        split = torch.compile(lambda x: model(x).unflatten(-1, (3, 32)), backend="aot_eager", fullgraph=True)
        got = split(x)
    assert torch.equal(want, got)


def test_the_graph_contains_the_scaled_gemms():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _model()
    recipe = fp8.CurrentScaling()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        compiled(torch.randn(16, 32))
    # The autograd Function is a higher-order op of the graph; its forward is a subgraph.
    assert len(graphs) == 1
    code = "\n".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    # Two forward gemms; the backward's: grad_input of the second layer, grad_weight of both.
    # torch._scaled_mm on CUDA; on the CPU the same gemm by its rule, one op of ours (_gemms.py).
    gemms = code.count("torch._scaled_mm(") + code.count("torch.ops.dispatch_amp.scaled_mm.default(")
    assert gemms == 5 and "float8_e4m3fn" in code and "float8_e5m2" in code


def test_changing_the_recipe_recompiles():
    model = _model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(16, 32)
    outs = []
    for recipe in (fp8.CurrentScaling(), fp8.RowwiseScaling(), fp8.CurrentScaling(power_of_two=True)):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            outs.append(compiled(x))
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            assert torch.equal(model(x), outs[-1])
    assert counter.frame_count == 3


def test_delayed_scaling_needs_bound_sites_under_compile():
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.DelayedScaling()):
        with pytest.raises(Exception, match=r"recipe.bind\(model\) before the first compiled call"):
            compiled(torch.randn(16, 32))


@pytest.mark.parametrize("gemm", ["by-rule", "scaled_mm"])
@pytest.mark.parametrize("make", [fp8.CurrentScaling, fp8.RowwiseScaling], ids=lambda m: m.__name__)
def test_inductor_compiles_the_fp8_model_in_one_graph(monkeypatch, make, gemm):
    # Inductor lowers _scaled_mm with its own layout checks (the second operand
    # column-major), forward and backward: "scaled_mm" forces the gemm CUDA takes, which
    # the CPU replaces by its rule (_gemms.py).
    if gemm == "scaled_mm":
        monkeypatch.setattr(fp8._gemms, "BY_RULE_ON", frozenset())
    recipe = make()
    x = torch.randn(16, 32, requires_grad=True)
    out = {}
    for name, model in (("eager", _model()), ("inductor", torch.compile(_model(), backend="inductor", fullgraph=True))):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            y = model(x)
        y.float().sum().backward()
        out[name] = (y, x.grad)
        x.grad = None
    assert out["inductor"][0].dtype is torch.bfloat16
    # Inductor fuses the casts (a scale's division, say, may become a multiply by a
    # reciprocal): an element may land one fp8 step away from eager's, not bit for bit.
    for got, want in zip(out["inductor"], out["eager"]):
        assert (got.float() - want.float()).norm() <= 0.04 * want.float().norm()


class _Gemm(torch.nn.Module):
    def __init__(self, gemm):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(32, 32) * 0.1)
        self.gemm = gemm

    def forward(self, x):
        return self.gemm(x, self.weight)


@pytest.mark.parametrize("gemm", [
    lambda x, w: torch.linalg.matmul(x, w.t()),   # an alias of matmul
    lambda x, w: w.t().__rmatmul__(x),            # x @ w.t() where x's type gave way
], ids=["linalg.matmul", "rmatmul"])
def test_other_spellings_of_matmul_run_in_fp8_compiled_as_eagerly(gemm):
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = []
    for compiled in (False, True):
        model = _Gemm(gemm)
        recipe = fp8.CurrentScaling().bind(model)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            y = run(x)
        y.float().sum().backward()
        out.append((y, x.grad, model.weight.grad, [(r.name, r.calls) for r in recipe.report()]))
        x.grad = None
    (y_e, dx_e, dw_e, ran_e), (y_c, dx_c, dw_c, ran_c) = out
    assert ran_e == ran_c == [("<root>", 1)]
    assert torch.equal(y_e, y_c) and torch.equal(dx_e, dx_c) and torch.equal(dw_e, dw_c)


@pytest.mark.parametrize("gemm, policy", [
    (lambda x, w: torch.tensordot(x, w, dims=([1], [1])), None),
    (lambda x, w: torch.inner(x, w), None),
    (lambda x, w: torch.linalg.multi_dot([x, w.t()]), None),
    (lambda x, w: x @ w.t(), amp.Policy.for_device("cpu").without_ops("matmul")),
], ids=["tensordot", "inner", "multi_dot", "matmul-without-a-rule"])
def test_a_gemm_inside_a_composite_warns_compiled(gemm, policy):
    # Eagerly the mm inside these composites reaches the fp8 path; the fp8 level cannot see
    # it while Dynamo traces, so compiled it runs in the region's dtype: said, not silent.
    model = _Gemm(gemm)
    x = torch.randn(16, 32)
    region = dict(policy=policy) if policy is not None else {}
    eager_recipe = fp8.CurrentScaling().bind(model)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=eager_recipe, **region):
        model(x)
    assert [(r.name, r.calls) for r in eager_recipe.report()] == [("<root>", 1)]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.warns(amp.AmpNumericsWarning, match="eagerly the gemm inside it may run in fp8"):
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=fp8.CurrentScaling().bind(model), **region):
            compiled(x)
