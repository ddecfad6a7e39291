"""torch.compile with dispatch_amp.autocast: what compiles, guards, what warns.

Under a built-in policy a compiled model called inside ``amp.autocast`` compiles (with
``fullgraph=True`` too) into the same graph as under ``torch.autocast``: outputs and
gradients bit-identical to the compiled native run. Under a policy of its own our casts
are traced into the graph: outputs and gradients equal to the same policy run eagerly.
See "Note: torch.compile" in ``_engine.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import dispatch_amp as amp

KEEP_MM_FP32 = amp.Policy.for_device("cpu").with_ops(fp32=["mm", "linear", "addmm"], name="keep-mm-fp32")
CUDA_TABLE = amp.Policy.for_device("cuda")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """Matmuls, a float32 op (softmax), a norm, a residual and a loss; with ``mha``, a
    torch Python composite (F.multi_head_attention_forward) whose calls reach our kernels."""

    def __init__(self, mha=False):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True) if mha else None

    def forward(self, x, y):
        h = self.norm(F.gelu(self.proj(x)))
        attn = torch.softmax(h @ h.transpose(-1, -2), dim=-1)
        mixed = attn @ h + h
        if self.mha is not None:
            mixed = mixed + self.mha(h[None], h[None], h[None])[0][0]
        logits = self.head(mixed)
        return logits, F.cross_entropy(logits.float(), y)


def run(region, backend, fullgraph, grad=True):
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(6, 16)
    y = torch.randint(0, 5, (6,))
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=fullgraph)
    with torch.set_grad_enabled(grad), region("cpu"):
        logits, loss = compiled(x, y)
    grads = []
    if grad:
        loss.backward()
        grads = [p.grad for p in model.parameters()]
    return logits, loss, grads, counter


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graphs", "fullgraph"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_inside_ours_equals_compiled_native(backend, fullgraph):
    want = run(torch.autocast, backend, fullgraph)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp.CompileFallbackWarning)
        got = run(amp.autocast, backend, fullgraph)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w)
    # One graph, no break: nothing of ours stops Dynamo.
    assert got[3].frame_count == 1 and got[3].op_count > 0
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_inference_dtypes_and_values_as_native(mode):
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    results = {}
    for region in (torch.autocast, amp.autocast):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)).eval()
        x = torch.randn(2, 4, 10)
        model(x)  # materialize the lazy layer outside any region
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with context(), region("cpu"):
            results[region] = compiled(x)
    assert results[amp.autocast].dtype == results[torch.autocast].dtype == torch.bfloat16
    assert torch.equal(results[amp.autocast], results[torch.autocast])


def test_guards_recompile_or_reuse_the_right_graph():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda t: lin(t).relu(), backend=counter)
    with amp.autocast("cpu"):
        assert f(x).dtype == torch.bfloat16
    assert counter.frame_count == 1
    with amp.autocast("cpu", dtype=torch.float16):
        assert f(x).dtype == torch.float16
    with amp.autocast("cpu", enabled=False):
        assert f(x).dtype == torch.float32
    assert counter.frame_count == 3
    assert f(x).dtype == torch.float32  # outside: the disabled region's graph fits
    assert counter.frame_count == 3
    with torch.autocast("cpu"):  # native: no mode on the stack, a graph of its own
        assert f(x).dtype == torch.bfloat16
    with amp.autocast("cpu"):  # ours again: the first graph fits
        assert f(x).dtype == torch.bfloat16
    assert counter.frame_count == 4
    # A policy of our own is never served a graph made for native's table, nor the
    # reverse: it compiles its own graph, with its own casts (linear kept in float32).
    with amp.autocast("cpu", policy=KEEP_MM_FP32):
        assert f(x).dtype == torch.float32
    assert counter.frame_count == 5
    with amp.autocast("cpu"):
        assert f(x).dtype == torch.bfloat16
    with amp.autocast("cpu", policy=KEEP_MM_FP32):
        assert f(x).dtype == torch.float32
    assert counter.frame_count == 5
    # Another policy of our own (the CUDA table, linear lowered again) under float16: a
    # graph of its own.
    with amp.autocast("cpu", policy=CUDA_TABLE, dtype=torch.float16):
        assert f(x).dtype == torch.float16
    assert counter.frame_count == 6


def _mm_input_dtypes(graph_module):
    """The dtypes of the tensor inputs of every mm / addmm / bmm node of an aten graph."""
    found = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default
        ):
            found.append(frozenset(a.meta["val"].dtype for a in node.args if hasattr(a, "meta") and "val" in a.meta))
    return found


def _aten_forward_graph(model, args, region):
    """The forward aten graph AOTAutograd traces for ``model(*args)`` under ``region``: where
    our casts land (our kernels run while it traces)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep))
    with region:
        compiled(*args)
    return graphs[0]


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graphs", "fullgraph"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("policy", ["keep-mm-fp32", "cuda-table"])
def test_a_policy_of_our_own_compiles_into_the_graph(policy, backend, fullgraph):
    policy, dtype = {
        "keep-mm-fp32": (KEEP_MM_FP32, torch.bfloat16),
        "cuda-table": (CUDA_TABLE, torch.float16),
    }[policy]
    torch.manual_seed(0)
    model = Block(mha=True)
    x = torch.randn(6, 16)
    y = torch.randint(0, 5, (6,))
    with amp.autocast("cpu", dtype=dtype, policy=policy):
        want_logits, want_loss = model(x, y)
    want_loss.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=fullgraph)
    with amp.autocast("cpu", dtype=dtype, policy=policy):
        logits, loss = compiled(x, y)
    loss.backward()
    assert counter.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    assert logits.dtype == want_logits.dtype
    if policy is KEEP_MM_FP32:
        # The policy's float32 matmuls are float32 in the graph, the others lowered.
        torch._dynamo.reset()
        graph = _aten_forward_graph(model, (x, y), amp.autocast("cpu", dtype=dtype, policy=policy))
        dtypes = set(_mm_input_dtypes(graph))
        assert {frozenset({torch.float32}), frozenset({torch.bfloat16})} <= dtypes
    grads = [p.grad for p in model.parameters()]
    if backend == "aot_eager":  # the same aten ops in the same dtypes: the same bits
        assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
        for g, w in zip(grads, want_grads):
            assert torch.equal(g, w)
    else:  # inductor fuses: the policy's low precision's rounding
        tol = dict(rtol=1e-2, atol=1e-2) if dtype is torch.float16 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(logits, want_logits, **tol)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, **tol)


def test_compiled_under_a_policy_of_our_own_never_poisons():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda t: torch.mm(t, lin.weight.t()).relu(), backend=counter)
    with amp.autocast("cpu", policy=KEEP_MM_FP32), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(x).dtype == torch.float32
    assert counter.frame_count == 1
    assert f(x).dtype == torch.float32 and counter.frame_count == 2  # outside: compiles
    with torch.autocast("cpu"):
        assert f(x).dtype == torch.bfloat16
    assert counter.frame_count == 3
    module = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), backend=counter)
    with amp.autocast("cpu", policy=KEEP_MM_FP32):
        module(x)
    module(x)
    assert counter.frame_count == 5


def test_native_region_inside_ours_rules_in_the_graph():
    # torch.autocast(enabled=False) inside a policy of our own: native rules there, as
    # eagerly (a Hugging Face float32 island, say), in and out of the compiled function.
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def f(t):
        with torch.autocast("cpu", enabled=False):
            island = lin(t)
        return island, lin(t)

    policy = CUDA_TABLE
    with amp.autocast("cpu", policy=policy, dtype=torch.float16):
        want = f(x)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32, torch.float16]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_compiled_inference_under_a_policy_of_our_own_equals_eager():
    # Ops inside C++ composites (pairwise_distance's norm: float32 under the CUDA table)
    # reach our kernels when AOTAutograd traces, so the compiled graph casts them as
    # eager does, under no_grad too.
    a = torch.randn(4, 8, dtype=torch.float16)
    policy = CUDA_TABLE.with_ops(name="cuda-table-for-this-test")
    f = torch.compile(lambda t: F.pairwise_distance(t, t + 1), backend="aot_eager")
    with torch.no_grad(), amp.autocast("cpu", dtype=torch.float16, policy=policy):
        want = F.pairwise_distance(a, a + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = f(a)
    assert want.dtype == got.dtype == torch.float32 and torch.equal(got, want)
    # Calls Dynamo traces follow the policy under no_grad too.
    lin = nn.Linear(8, 8)
    g = torch.compile(lambda t: torch.softmax(lin(t), -1), backend="aot_eager", fullgraph=True)
    with torch.no_grad(), amp.autocast("cpu", dtype=torch.float16, policy=policy):
        assert g(torch.randn(2, 8)).dtype == torch.float32


def test_a_compiled_graph_runs_without_our_handler_casting_again():
    # While a compiled graph runs, torch excludes the Autocast keys, ours too: the graph's
    # calls (inductor's extern kernels, aot_eager's aten ops) run as they are, here an
    # addmm the policy would otherwise keep in float32.
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["addmm"], name="addmm-fp32")
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with amp.autocast("cpu", policy=policy):
        want = lin(x)  # linear is lowered whole: bfloat16
        got = torch.compile(lin, backend="aot_eager", fullgraph=True)(x)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("form", ["with", "decorator"])
def test_ours_used_inside_a_compiled_function_is_traced(form):
    # Under a built-in policy a region opened inside the compiled function is native
    # autocast with the same dtype: traced, one graph, the eager numbers.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    if form == "with":

        def f(t):
            with amp.autocast("cpu", dtype=torch.float16):
                h = lin(t).relu()
            return h.float().sum(), h

    else:
        inner = amp.autocast("cpu", dtype=torch.float16)(lambda t: lin(t).relu())

        def f(t):
            h = inner(t)
            return h.float().sum(), h

    want = f(x)
    counter = CompileCounterWithBackend("aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp.CompileFallbackWarning)
        got = torch.compile(f, backend=counter, fullgraph=True)(x)
    assert got[1].dtype == want[1].dtype == torch.float16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    # Outside any region again after the compiled call, inside one again at the next.
    assert not torch.is_autocast_enabled("cpu") and _engine_is_idle()


def _engine_is_idle():
    from dispatch_amp.autocast import _engine

    return _engine.STATE.regions == [] and _engine.STATE.fp8_level is None and not _engine.STATE.key_on


def test_ours_inside_a_compiled_function_falls_back_where_it_cannot_be_traced():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def own_policy(t):  # the engine's state for a policy of our own is not graph
        with amp.autocast("cpu", policy=KEEP_MM_FP32):
            return lin(t).relu() @ lin.weight

    def breaks_inside(t):  # Dynamo cannot resume inside a context manager of ours
        with amp.autocast("cpu"):
            h = lin(t)
            torch._dynamo.graph_break()
            return lin(h.float())

    for f in (own_policy, breaks_inside):
        want = f(x)
        counter = CompileCounterWithBackend("aot_eager")
        with pytest.warns(amp.CompileFallbackWarning, match=f"compile'd {f.__name__}") as caught:
            got = torch.compile(f, backend=counter)(x)
        assert caught[0].filename == __file__  # points at the user's code
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert counter.frame_count == 0 and _engine_is_idle()


def test_no_fallback_warning_where_compiling_was_switched_off():
    # torch.compiler.disable (torch's checkpoint uses it too) means "run this eagerly":
    # opening our region there is what the user asked for, not a fallback.
    lin = nn.Linear(8, 8)

    @torch.compiler.disable
    def eager_part(t):
        with amp.autocast("cpu"):
            return lin(t)

    f = torch.compile(lambda t: eager_part(t).float().relu(), backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp.CompileFallbackWarning)
        assert f(torch.randn(4, 8)).dtype == torch.float32
    # A compiled module that opens the region in its forward is named by its forward.
    class Opens(nn.Module):
        def forward(self, t):
            with amp.autocast("cpu", policy=KEEP_MM_FP32):
                return lin(t)

    with pytest.warns(amp.CompileFallbackWarning, match="compile'd forward"):
        torch.compile(Opens(), backend="aot_eager")(torch.randn(4, 8))


def test_aotautograds_cache_is_off_while_compiling_under_a_policy_of_our_own_even_after_a_reset():
    # Its key cannot tell our policies apart (before torch 2.13 it holds no autocast
    # state but whether any is on), so a compile under one must not read or fill it;
    # torch._dynamo.reset() drops every compile callback, and the next region installs
    # ours again. Under native's table the cache stays as the user set it.
    seen = []

    def backend(gm, example_inputs):
        seen.append(torch._functorch.config.enable_autograd_cache)
        return gm

    before = torch._functorch.config.enable_autograd_cache
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    for policy in (KEEP_MM_FP32, None):
        torch._dynamo.reset()
        with amp.autocast("cpu", policy=policy):
            torch.compile(lin, backend=backend)(x)
    assert seen == [False, before]
    assert torch._functorch.config.enable_autograd_cache == before


def _aten_graphs(region, mha=True):
    """The forward and backward aten graphs (their code) AOTAutograd traces for Block's
    training step under ``region``."""
    from torch._dynamo.backends.common import aot_autograd

    codes = []

    def keep(gm, example_inputs):
        codes.append(gm.code)
        return gm

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(mha=mha)
    x, y = torch.randn(6, 16), torch.randint(0, 5, (6,))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    with region("cpu"):
        _, loss = compiled(x, y)
    loss.backward()
    return codes


def test_the_traced_graphs_are_natives_line_for_line():
    # Our casts are made in native's order (_casting.arg_order), so AOTAutograd traces the
    # graphs native's kernels give, node for node: inductor then compiles the same code,
    # and its cache serves ours what it compiled for native (next test).
    native = _aten_graphs(torch.autocast)
    ours = _aten_graphs(amp.autocast)
    assert len(native) == len(ours) == 2  # forward, backward
    assert ours == native


def test_inductors_cache_serves_ours_the_graphs_it_compiled_for_native():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_inductor_cache

    counters = torch._dynamo.utils.counters
    with fresh_inductor_cache(), inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        for region in (torch.autocast, amp.autocast):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            model = Block()
            x, y = torch.randn(6, 16), torch.randint(0, 5, (6,))
            compiled = torch.compile(model, backend="inductor", fullgraph=True)
            with region("cpu"):
                _, loss = compiled(x, y)
            loss.backward()
            if region is torch.autocast:
                assert counters["inductor"]["fxgraph_cache_miss"] == 2  # compiled: forward, backward
    assert counters["inductor"]["fxgraph_cache_hit"] == 2
    assert counters["inductor"]["fxgraph_cache_miss"] == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("switch", ["off", "fp16"])
def test_a_compiled_function_under_state_switched_by_hand_does_what_native_does(switch, backend):
    # Dynamo guards torch's autocast state: the switch recompiles, and the graph traced
    # through our kernels follows the switched state as native's does.
    a, w = torch.randn(8, 8), torch.randn(8, 8)

    def f(x):
        return torch.mm(x, w).relu() @ w

    results = {}
    for region in (torch.autocast, amp.autocast):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend)
        with region("cpu", dtype=torch.bfloat16):
            before = compiled(a)
            if switch == "off":
                torch.set_autocast_enabled("cpu", False)
            else:
                torch.set_autocast_dtype("cpu", torch.float16)
            after = compiled(a)
        results[region] = (before, after, compiled(a))
    for ours, native in zip(results[amp.autocast], results[torch.autocast]):
        assert ours.dtype == native.dtype and torch.equal(ours, native)
