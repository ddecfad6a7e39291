"""torch.compile with dispatch_amp.autocast: what compiles, what falls back, guards.

Under a built-in policy a compiled model called inside ``amp.autocast`` compiles (with
``fullgraph=True`` too) into the same graph as under ``torch.autocast``: outputs and
gradients bit-identical to the compiled native run. Under a policy of its own it runs
eagerly with ``CompileFallbackWarning`` and compiles again outside. See "Note:
torch.compile" in ``_engine.py``.
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


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """Matmuls, a float32 op (softmax), a norm, a residual and a loss."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x, y):
        h = self.norm(F.gelu(self.proj(x)))
        attn = torch.softmax(h @ h.transpose(-1, -2), dim=-1)
        logits = self.head(attn @ h + h)
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
    # A policy of our own is never served a graph made for native's table: it runs
    # eagerly (and says so), with its own casts.
    with amp.autocast("cpu", policy=KEEP_MM_FP32), pytest.warns(amp.CompileFallbackWarning):
        assert f(x).dtype == torch.float32
    with amp.autocast("cpu"):
        assert f(x).dtype == torch.bfloat16
    assert counter.frame_count == 4


def test_a_policy_of_our_own_runs_eagerly_then_compiles_outside():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda t: torch.mm(t, lin.weight.t()).relu(), backend=counter)
    with amp.autocast("cpu", policy=KEEP_MM_FP32), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x)
        f(x)
    assert [w.category for w in caught] == [amp.CompileFallbackWarning]  # once per function
    assert "ran eagerly" in str(caught[0].message) and caught[0].filename == __file__
    assert out.dtype == torch.float32 and counter.frame_count == 0
    with amp.autocast("cpu", policy=KEEP_MM_FP32, dtype=torch.float16):
        assert torch.bmm(x[None], x.t()[None]).dtype == torch.float16  # our region is live
    assert f(x).dtype == torch.float32 and counter.frame_count == 1  # not poisoned
    with torch.autocast("cpu"):
        assert f(x).dtype == torch.bfloat16
    assert counter.frame_count == 2
    # A compiled module too, named by its forward.
    module = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), backend=counter)
    with amp.autocast("cpu", policy=KEEP_MM_FP32), pytest.warns(amp.CompileFallbackWarning, match="forward"):
        module(x)
    module(x)
    assert counter.frame_count == 3
    strict = torch.compile(lambda t: lin(t), backend="eager", fullgraph=True)
    with amp.autocast("cpu", policy=KEEP_MM_FP32), pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.CompileFallbackWarning)
        strict(x)


@pytest.mark.parametrize("form", ["with", "decorator"])
def test_ours_used_inside_a_compiled_function(form):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    if form == "with":

        def f(t):
            with amp.autocast("cpu"):
                h = lin(t).relu()
            return h.float().sum()

    else:
        inner = amp.autocast("cpu")(lambda t: lin(t).relu())

        def f(t):
            return inner(t).float().sum()

    want = f(x)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(f, backend=counter)(x)
    # Entering the region is a graph break Dynamo cannot resume from inside a `with` of a
    # context manager it does not know: the function runs eagerly, with our casts.
    assert torch.equal(got, want) and got.dtype == torch.float32
    if form == "with":
        assert counter.frame_count == 0
