"""The compiled engine's batched weight casts (engine.cpp, "batched weight casts").

From the second region on, the weights a region used form the plan of the next: at a
region's first miss of a bucket, the bucket's weights are cast together, from their current
values, in one autograd node. These tests hold it to what native gives: the same bits
(losses, gradients, weights after steps), gradients ready at about native's point of the
backward, a weight changed in place mid-region cast again, and native's one ``_to_copy``
per weight wherever a user's tools look (dispatch modes, anomaly mode, torch.compile).
Run under the compiled engine with batching switched on (it is off by default; the Python
engine casts each weight at its use).
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.torch_version import TorchVersion
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from benchmarks.models import GPT, GPTConfig, ResNet, gpt_batch
from dispatch_amp import _torch_compat
from dispatch_amp.autocast import _compiled_engine

pytestmark = pytest.mark.needs_compiler

_BATCHED_NODE = "BatchedWeightCast"

# engine.cpp's batchable() batches nothing before torch 2.13 (docs/design.md, "Torch before
# 2.13"): there, batching on still casts each weight at its use. The tests of what a bucket
# does skip; the bits test runs everywhere and checks that buckets appear exactly here.
BATCHES = TorchVersion(torch.__version__) >= (2, 13)
needs_buckets = pytest.mark.skipif(
    not BATCHES, reason=f"torch {torch.__version__} batches no weight casts (docs/design.md, \"Torch before 2.13\")")


@pytest.fixture(autouse=True)
def compiled():
    """The compiled engine of this process, batching on; restored after."""
    module = _compiled_engine.active()
    if module is None:
        pytest.skip("the Python engine runs this process (DISPATCH_AMP_ENGINE=python): it casts each "
                    "weight at its use and batches nothing")
    before = _compiled_engine.set_batching(True)
    yield module
    _compiled_engine.set_batching(before)


def _gpt():
    cfg = GPTConfig(vocab=32, d_model=16, n_heads=2, n_blocks=3, max_len=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.head.weight = model.tok.weight  # tied, as GPT-2's
    return model, gpt_batch(cfg, 2, 8, generator=torch.Generator().manual_seed(1))


def _resnet():
    torch.manual_seed(0)
    model = ResNet(width=4, classes=10).to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=gen).to(memory_format=torch.channels_last)
    return model, (x, torch.randint(0, 10, (2,), generator=gen))


def _loss(model, batch):
    if isinstance(model, GPT):
        return model.loss(*batch)
    x, y = batch
    return F.cross_entropy(model(x), y)


def _region(native: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if native else amp.autocast("cpu", dtype=torch.bfloat16)


def _nodes(root) -> list:
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(f for f, _ in node.next_functions)
    return out


def _batched_nodes(tensor) -> int:
    return sum(_BATCHED_NODE in node.name() for node in _nodes(tensor.grad_fn))


def _train(model, batch, *, native=False, batching=True, steps=3, micro=1, keep=False):
    """Losses, last gradients and final weights of `steps` SGD steps, each of `micro`
    micro-batches (inside cast_cache() when `keep`), and how many batched nodes the last
    micro-batch's graph held."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _compiled_engine.set_batching(batching)
    losses, batched = [], 0
    try:
        for _ in range(steps):
            with amp.cast_cache() if keep else _Nothing():
                for _ in range(micro):
                    with _region(native):
                        loss = _loss(model, batch) / micro
                    batched = _batched_nodes(loss)
                    loss.backward()
                    losses.append(loss.detach())
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        _compiled_engine.set_batching(True)
    return losses, grads, [p.detach().clone() for p in model.parameters()], batched


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [_gpt, _resnet], ids=["gpt2-structure", "resnet-structure"])
@pytest.mark.parametrize("micro,keep", [(1, False), (4, False), (4, True)], ids=["step", "accumulate", "cast_cache"])
def test_batched_casts_give_native_bits(make, micro, keep):
    """Losses, every gradient and the weights after three steps: the same bits with
    batching on, off, and under native autocast (plain steps, 4-micro-batch accumulation,
    and accumulation inside cast_cache(), where the kept casts are left out of buckets)."""
    model, batch = make()
    on = _train(model, batch, micro=micro, keep=keep)
    off = _train(model, batch, batching=False, micro=micro, keep=keep)
    native = _train(model, batch, native=True, micro=micro, keep=keep)
    for ours in (on, off):
        assert _same(ours[0], native[0]) and _same(ours[1], native[1]) and _same(ours[2], native[2])
    # From 2.13 the steps after the first cast their weights in buckets; before, none, and
    # Python's mirror of that (which the benchmarks report by) agrees.
    assert (on[3] > 0) == BATCHES == _torch_compat.BATCHED_WEIGHT_CASTS, (on[3], torch.__version__)
    assert off[3] == 0


def _readiness(model, batch, native: bool) -> dict[int, float]:
    """Per weight: the share of the backward's nodes run when its gradient was accumulated
    (post-accumulate-grad hooks beside a pre-hook on every node: counts, not times)."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    ran, ready = [0], {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(index[id(p)], ran[0])) for p in params]
    with _region(native):
        loss = _loss(model, batch)
    nodes = _nodes(loss.grad_fn)
    hooks += [node.register_prehook(lambda *_: ran.__setitem__(0, ran[0] + 1)) for node in nodes]
    loss.backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return {i: step / ran[0] for i, step in ready.items()}


@pytest.mark.parametrize("make", [_gpt, _resnet], ids=["gpt2-structure", "resnet-structure"])
def test_weight_gradients_become_ready_where_native_makes_them_ready(make):
    """One node for all weights would make every gradient ready at the end of the backward
    (DDP would lose its overlap). Buckets keep each weight's point within a bucket of
    native's: same weights, the order of readiness kept between buckets."""
    model, batch = make()
    native = _readiness(model, batch, native=True)
    _readiness(model, batch, native=False)  # the plan
    ours = _readiness(model, batch, native=False)
    assert set(ours) == set(native)
    # 16 buckets: a gradient is at most one bucket's share of the weights later.
    shift = max(abs(ours[i] - native[i]) for i in native)
    assert shift <= 0.15, shift
    assert abs(statistics.median(ours.values()) - statistics.median(native.values())) <= 0.05
    # The order: a weight ready clearly before another in native is not after it here.
    for i in native:
        for j in native:
            if native[i] + 0.15 < native[j]:
                assert ours[i] <= ours[j], (i, j)


class _Lin2(nn.Module):
    def __init__(self):
        super().__init__()
        # No biases: the plan is (a.weight, b.weight), one bucket of two.
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x, between=None):
        y = self.a(x)
        if between is not None:
            between()
        return self.b(y)


@needs_buckets
def test_a_weight_changed_in_place_after_its_bucket_was_cast_is_cast_again():
    """b's cast is made with a's (one bucket); b then changes in place before its use: the
    region uses the new values, as native (which casts b at its use) does."""
    torch.manual_seed(0)
    model, x = _Lin2(), torch.randn(4, 8)
    twin = copy.deepcopy(model)

    def bump(m):
        def between():
            with torch.no_grad():
                m.b.weight.mul_(2.0)
        return between

    with _region(False):
        model(x)  # the plan: a, b
    with _region(False):
        ours = model(x, bump(model))
    assert _batched_nodes(ours) == 1
    with _region(True):
        native = twin(x, bump(twin))
    assert torch.equal(ours, native)
    ours.float().sum().backward()
    native.float().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


@needs_buckets
def test_a_bucket_cast_never_used_reaches_no_weight():
    """A plan that predicted a weight the region does not use: its cast is cut off at the
    region's close, so it gets no gradient (None, as native leaves it) and is not kept."""
    torch.manual_seed(0)
    model, x = _Lin2(), torch.randn(4, 8)
    with _region(False):
        model(x)  # the plan: a, b
    with _region(False):
        out = model.a(x)  # b is cast with a's bucket, never used
    assert _batched_nodes(out) == 1
    (node,) = [n for n in _nodes(out.grad_fn) if _BATCHED_NODE in n.name()]
    assert [f is None for f, _ in node.next_functions] == [False, True]
    out.float().sum().backward()
    assert model.a.weight.grad is not None and model.b.weight.grad is None


class _ToCopies(TorchDispatchMode):
    """Counts ``_to_copy`` calls and multi-tensor copies."""

    def __init__(self):
        super().__init__()
        self.to_copy = self.foreach = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.to_copy += 1
        if func.__name__.startswith("_foreach_copy"):
            self.foreach += 1
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_each_weight_is_cast_at_its_use_as_native():
    model, batch = _gpt()
    with _region(False):
        _loss(model, batch)  # the plan
    counts = []
    for native in (True, False):
        with _ToCopies() as mode, _region(native):
            loss = _loss(model, batch)
        counts.append((mode.to_copy, mode.foreach))
        assert _batched_nodes(loss) == 0
    assert counts[0] == counts[1] and counts[0][1] == 0


def test_a_dispatch_mode_opened_mid_region_never_sees_a_cast_made_ahead():
    """a's use casts the bucket (a, b) in C++; b's use under a dispatch mode goes to the
    Python kernel, which takes no cast made ahead of its use: the mode sees b's
    ``_to_copy``, as under native autocast."""
    torch.manual_seed(0)
    model, x = _Lin2(), torch.randn(4, 8)
    with _region(False):
        model(x)
    with _region(False):
        y = model.a(x)
        with _ToCopies() as mode:
            model.b(y)
    assert mode.to_copy == 1  # b's weight (y is bf16 already)


@needs_buckets
def test_anomaly_mode_turns_batching_off():
    model, batch = _gpt()
    with _region(False):
        _loss(model, batch)
    with torch.autograd.detect_anomaly(check_nan=False):
        with _region(False):
            loss = _loss(model, batch)
    assert _batched_nodes(loss) == 0
    with _region(False):
        assert _batched_nodes(_loss(model, batch)) > 0


def test_under_torch_compile_the_same_bits_and_no_batched_node():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), torch.randn(4, 8)
    results = []
    for batching in (True, False):
        torch._dynamo.reset()
        _compiled_engine.set_batching(batching)
        m = copy.deepcopy(model)
        compiled = torch.compile(m, backend="aot_eager")
        for _ in range(2):
            with _region(False):
                loss = compiled(x).float().pow(2).mean()
            assert _batched_nodes(loss) == 0
            loss.backward()
        results.append([loss.detach()] + [p.grad for p in m.parameters()])
    _compiled_engine.set_batching(True)
    assert _same(results[0], results[1])


def _gradients(native: bool, model, x, backward):
    """The weights' gradients of a fresh copy of `model` after its third region (the first
    makes the plan), and how many batched nodes that region's output held."""
    model = copy.deepcopy(model)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with _region(native):
            out = model(x).float().pow(2).mean()
        backward(model, out)
    return [p.grad for p in model.parameters()], _batched_nodes(out)


@needs_buckets
def test_under_compiled_autograd_a_bucket_node_gives_natives_gradients():
    """Compiled autograd traces the bucket node's backward (its ops) into its graph."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), torch.randn(4, 8)

    def compiled_backward(_, out):
        torch._dynamo.reset()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            out.backward()

    ours, batched = _gradients(False, model, x, compiled_backward)
    native, _ = _gradients(True, model, x, lambda _, out: out.backward())
    assert batched > 0
    assert _same(ours, native)


@needs_buckets
def test_a_second_order_gradient_through_a_bucket_is_natives():
    """create_graph: the bucket node's backward casts each gradient with a differentiable
    cast, so a gradient penalty's gradient reaches the weights as through native's casts."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), torch.randn(4, 8)

    def penalty(m, out):
        grads = torch.autograd.grad(out, list(m.parameters()), create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()

    ours, batched = _gradients(False, model, x, penalty)
    native, _ = _gradients(True, model, x, penalty)
    assert batched > 0
    assert _same(ours, native)


class _InOrder(nn.Module):
    """Four bias-free linears, applied in the order the call asks for."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x, order):
        for i in order:
            x = self.layers[i](x)
        return x


def _buckets(model, out) -> list[list[int]]:
    """Which layers' weights each bucket node of `out`'s graph casts, by layer index."""
    index = {id(layer.weight): i for i, layer in enumerate(model.layers)}
    found = []
    for node in _nodes(out.grad_fn):
        if _BATCHED_NODE in node.name():
            found.append(sorted(index[id(f.variable)] for f, _ in node.next_functions if f is not None))
    return sorted(found)


@needs_buckets
def test_a_region_out_of_its_plans_order_makes_the_next_plan():
    """Plan (0, 1) (2, 3); a region using 0, 2, 1, 3 departs from it at 2 and is cast as
    the old plan says (the bucket of 2 is (2, 3)); its order is the next region's plan."""
    torch.manual_seed(0)
    model, x = _InOrder(), torch.randn(4, 8)
    with _region(False):
        model(x, [0, 1, 2, 3])
    with _region(False):
        out = model(x, [0, 2, 1, 3])
    assert _buckets(model, out) == [[0, 1], [2, 3]]
    with _region(False):
        out = model(x, [0, 2, 1, 3])
    assert _buckets(model, out) == [[0, 2], [1, 3]]
    with _region(False):
        again = model(x, [0, 2, 1, 3])  # followed: the plan stays
    assert _buckets(model, again) == [[0, 2], [1, 3]]
    with _region(True):
        native = model(x, [0, 2, 1, 3])
    assert torch.equal(again, native)


@needs_buckets
def test_a_region_that_uses_part_of_its_plan_leaves_that_part_as_the_next_plan():
    torch.manual_seed(0)
    model, x = _InOrder(), torch.randn(4, 8)
    with _region(False):
        model(x, [0, 1, 2, 3])
    with _region(False):
        out = model(x, [0, 1, 0])  # a prefix of the plan, 0 used twice
    assert _buckets(model, out) == [[0, 1]]
    with _region(False):
        out = model(x, [0, 1, 2, 3])  # the plan is (0, 1) now: 2 and 3 are cast at their use
    assert _buckets(model, out) == [[0, 1]]
    with _region(False):
        out = model(x, [0, 1, 2, 3])
    assert _buckets(model, out) == [[0, 1], [2, 3]]


@needs_buckets
def test_a_weight_whose_requires_grad_changed_since_the_plan_is_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])
    x, twin = torch.randn(4, 8), copy.deepcopy(model)
    with _region(False):
        model(x)  # the plan: buckets (0, 1) and (2, 3)
    model[1].weight.requires_grad_(False)
    twin[1].weight.requires_grad_(False)
    with _region(False):
        ours = model(x)
    assert _batched_nodes(ours) == 1  # (2, 3); 0 is cast alone
    with _region(True):
        native = twin(x)
    assert torch.equal(ours, native)
    ours.float().sum().backward()
    native.float().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("1", True)])
def test_the_environment_switch_turns_batching_on(value, on):
    code = ("import dispatch_amp as amp, torch\n"
            "from dispatch_amp.autocast import _compiled_engine as ce\n"
            "with amp.autocast('cpu'):\n    pass\n"
            "print(amp.engine(), ce.batching())\n")
    env = {k: v for k, v in os.environ.items() if k != _compiled_engine.BATCH_ENV}
    if value is not None:
        env[_compiled_engine.BATCH_ENV] = value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "DISPATCH_AMP_ENGINE": "compiled"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["compiled", str(on)]
    # Before torch 2.13 nothing is batched, and asking for it says so.
    assert ("has no effect on torch" in out.stderr) == (value == "1" and not _torch_compat.BATCHED_WEIGHT_CASTS)


def test_asking_for_batching_where_torch_cannot_batch_says_so(monkeypatch):
    monkeypatch.setenv(_compiled_engine.BATCH_ENV, "1")
    monkeypatch.setattr(_torch_compat, "BATCHED_WEIGHT_CASTS", False)
    with pytest.warns(UserWarning, match=r"DISPATCH_AMP_BATCH_CASTS=1 has no effect on torch .* unset"):
        assert _compiled_engine._batching_setting()
    monkeypatch.setattr(_torch_compat, "BATCHED_WEIGHT_CASTS", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compiled_engine._batching_setting()


def test_an_unknown_switch_value_is_refused():
    code = "import dispatch_amp as amp\nwith amp.autocast('cpu'):\n    pass\n"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DISPATCH_AMP_ENGINE": "compiled", _compiled_engine.BATCH_ENV: "yes"})
    assert bad.returncode != 0 and _compiled_engine.BATCH_ENV in bad.stderr
