"""The weight-cast cache: native's lifetime by default, kept across regions in ``cast_cache``."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import weakref
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from dispatch_amp.autocast import _cast_cache


class _CastsOf(TorchDispatchMode):
    """Counts the dtype casts (``_to_copy``) of the given tensors."""

    def __init__(self, *tensors):
        super().__init__()
        self.ids, self.count = {id(t) for t in tensors}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _micro_batches(model, batches, keep: bool):
    with amp.cast_cache() if keep else _nothing():
        for x in batches:
            with amp.autocast("cpu"):
                loss = model(x).float().pow(2).mean()
            loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_by_default_each_region_casts_again_as_native():
    model = nn.Linear(8, 8)
    with _CastsOf(model.weight) as casts:
        _micro_batches(model, [torch.randn(4, 8)] * 3, keep=False)
    assert casts.count == 3
    assert not _cast_cache.REGION.entries


def test_inside_cast_cache_each_weight_is_cast_once_with_native_bits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    batches = [torch.randn(4, 8) for _ in range(4)]
    reference = [p.detach().clone() for p in model.parameters()]

    def grads(run):
        for p, r in zip(model.parameters(), reference):
            p.data.copy_(r)
            p.grad = None
        run()
        return [p.grad.clone() for p in model.parameters()]

    def native():
        for x in batches:
            with torch.autocast("cpu"):
                loss = model(x).float().pow(2).mean()
            loss.backward()

    want = grads(native)
    with _CastsOf(model[0].weight, model[2].weight) as casts:
        got = grads(lambda: _micro_batches(model, batches, keep=True))
    assert casts.count == 2  # one per weight, for four micro-batches
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert _cast_cache.SCOPE.get() is None and not _cast_cache.keeps_casts()  # dropped when the scope closes


@pytest.mark.parametrize("change", ["optimizer step", "in place", "data assigned", "load_state_dict"])
def test_a_changed_weight_is_cast_again_inside_cast_cache(change):
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 8)
    with amp.cast_cache():
        with amp.autocast("cpu"):
            first = model(x)
        first.float().sum().backward()
        if change == "optimizer step":
            optimizer.step()
        elif change == "in place":
            with torch.no_grad():
                model.weight.mul_(2)
        elif change == "data assigned":
            model.weight.data = model.weight.data * 2
        else:
            model.load_state_dict({"weight": model.weight.detach() * 2, "bias": model.bias.detach()})
        with amp.autocast("cpu"):
            second = model(x)
    with amp.autocast("cpu"):
        fresh = model(x)  # outside any scope: cast now
    assert torch.equal(second, fresh) and not torch.equal(second, first)


def test_a_write_through_data_is_invisible_and_clear_autocast_cache_drops_it():
    # Documented: p.data.copy_ changes neither the version counter nor the storage.
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with amp.cast_cache():
        with amp.autocast("cpu"):
            first = model(x)
        model.weight.data.mul_(2)
        with amp.autocast("cpu"):
            stale = model(x)
        amp.clear_autocast_cache()
        with amp.autocast("cpu"):
            fresh = model(x)
    assert torch.equal(stale, first) and not torch.equal(fresh, first)


def test_max_bytes_bounds_what_is_kept():
    layers = [nn.Linear(32, 32, bias=False) for _ in range(4)]
    x = torch.randn(2, 32)
    one = 32 * 32 * 2  # a bfloat16 cast of one weight
    with amp.cast_cache(max_bytes=2 * one):
        with amp.autocast("cpu"):
            for layer in layers:
                layer(x)
        store = _cast_cache.SCOPE.get()
        assert store.nbytes <= 2 * one
        assert len(store.entries) == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1MB"])
def test_bad_max_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        amp.cast_cache(max_bytes=bad)


def test_nested_scopes_keep_casts_until_the_outermost_closes():
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with amp.cast_cache():
        with amp.cast_cache():
            with amp.autocast("cpu"):
                model(x)
        store = _cast_cache.SCOPE.get()
        assert store.entries
        assert _cast_cache.STEPS.hook is not None
    assert not store.entries and not store.open and _cast_cache.STEPS.hook is None


@settings(deadline=None, max_examples=25)
@given(steps=st.lists(st.sampled_from(["forward", "step", "inplace"]), min_size=1, max_size=8))
def test_kept_casts_always_equal_fresh_ones(steps):
    """Whatever happens between regions inside the scope, a region's output equals the
    same linear on casts made now."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with amp.cast_cache():
        for step in steps:
            if step == "forward":
                with amp.autocast("cpu"):
                    out = model(x)
                out.float().sum().backward()
                with torch.no_grad():
                    fresh = torch.nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
                assert torch.equal(out, fresh)
            elif step == "step":
                if model.weight.grad is not None:
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                with torch.no_grad():
                    model.weight.add_(1)


def test_a_cast_made_under_no_grad_records_grad_and_leaves_no_grad_on():
    w = nn.Parameter(torch.randn(3, 3))
    with torch.no_grad():
        out = _cast_cache.lookup(w, torch.bfloat16, torch.Tensor.bfloat16)
        assert not torch.is_grad_enabled()
        assert out.requires_grad and out.grad_fn is not None  # made with grad mode on, as native makes it

        def failing(t):
            raise RuntimeError("out of memory")

        with pytest.raises(RuntimeError, match="out of memory"):
            _cast_cache.lookup(nn.Parameter(torch.randn(2)), torch.bfloat16, failing)
        assert not torch.is_grad_enabled()
    _cast_cache.clear()


@pytest.mark.parametrize("region", [amp.autocast, torch.autocast])
def test_a_weight_frozen_after_its_cast_is_cast_again_as_native_casts_it(region):
    # Native caches a cast only while the weight requires grad: frozen in the middle of a
    # region (requires_grad_(False) leaves its version alone), it is cast afresh and the
    # output records no grad.
    x = torch.randn(2, 4)
    w = nn.Parameter(torch.randn(3, 4))
    with region("cpu", dtype=torch.bfloat16):
        first = torch.nn.functional.linear(x, w)
        w.requires_grad_(False)
        second = torch.nn.functional.linear(x, w)
    assert first.requires_grad and not second.requires_grad
    torch.testing.assert_close(first.detach(), second, rtol=0, atol=0)


# -- every write form, against native ------------------------------------------------
# Each evaluation's reference is native autocast in a region of its own (a fresh cast):
# ours must give the same bits whether its cast was kept (cast_cache, or earlier in the
# same region) or made anew. Same aten calls on both sides: compared bit for bit.
def _evaluate(w, x):
    return F.linear(x[:, : w.shape[1]], w)


def _native(w, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _evaluate(w, x)


def _row_slice(w, i, opt):
    w.data = w.data[: w.shape[0] - 4]  # same storage, same data_ptr, fewer rows


_SHAPES = [(128, 32), (32, 128), (64, 64)]


def _reshape(w, i, opt):
    w.data = w.data.reshape(_SHAPES[i % 3])  # same storage and data_ptr, other shape


def _transpose(w, i, opt):
    w.data = w.data.t()  # square: same storage, data_ptr and shape, other strides


def _new_vector(w, i, opt):
    # A new parameter vector per iteration (evolution strategies, line search), two per
    # evaluation: the allocator hands the second the address the first one freed.
    for _ in range(2):
        torch.nn.utils.vector_to_parameters(torch.randn(w.numel()), [w])


_BUFFER = bytearray(64 * 64 * 4)


def _same_address(w, i, opt):
    # New storage over memory the weight's old storage used (a loader refilling one
    # buffer and wrapping it again): the address is the same, the storage object is not.
    numpy_view = torch.frombuffer(_BUFFER, dtype=torch.float32)
    numpy_view.copy_(torch.randn(w.numel()))
    w.data = torch.frombuffer(_BUFFER, dtype=torch.float32).view(64, 64)


def _in_place_no_grad(w, i, opt):
    with torch.no_grad():
        w -= 0.5 * torch.randn_like(w)


def _optimizer_step(w, i, opt):
    w.grad = torch.randn_like(w)
    opt.step()
    opt.zero_grad()


WRITES = {
    "data = row slice": _row_slice, "data = reshape": _reshape, "data = transpose": _transpose,
    "vector_to_parameters": _new_vector, "data = new storage, same address": _same_address, "no_grad in place": _in_place_no_grad, "optimizer.step": _optimizer_step,
}


@pytest.mark.parametrize("lifetime", ["cast_cache", "one region"])
@pytest.mark.parametrize("write", list(WRITES))
def test_every_write_form_is_seen_as_native_sees_it(write, lifetime):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([w], lr=0.5)
    x = torch.randn(4, 128)
    outer = amp.cast_cache() if lifetime == "cast_cache" else amp.autocast("cpu")
    outputs, weights = [], []
    with outer:
        for i in range(8):
            with amp.autocast("cpu"):  # nested in the outer region for "one region"
                outputs.append(_evaluate(w, x))
            # What the weight is now (clone keeps its strides), for native outside ours.
            weights.append(nn.Parameter(w.detach().clone()))
            WRITES[write](w, i, opt)
    for i, (ours, weight) in enumerate(zip(outputs, weights)):
        want = _native(weight, x)
        assert ours.shape == want.shape and torch.equal(ours, want), f"evaluation {i} after {write}"


# -- the scope belongs to its thread (and asyncio task) -------------------------------
def _plain_regions_across_data_writes(steps: int = 4) -> None:
    """Regions with writes through .data between them (invisible to every check): each
    region must cast afresh, as native's does."""
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16)
    for i in range(steps):
        with amp.autocast("cpu"):
            ours = _evaluate(w, x)
        assert torch.equal(ours, _native(w, x)), f"region {i}"
        w.data -= 0.5 * torch.randn_like(w)  # hand-written SGD: bumps no version


def test_a_cast_cache_open_in_another_thread_leaves_this_threads_regions_native():
    opened, done = threading.Event(), threading.Event()

    def serving():
        with amp.cast_cache():
            opened.set()
            done.wait(timeout=120)

    thread = threading.Thread(target=serving)
    thread.start()
    try:
        assert opened.wait(timeout=120)
        _plain_regions_across_data_writes()
    finally:
        done.set()
        thread.join()


@pytest.mark.skipif(bool(getattr(sys.flags, "thread_inherit_context", 0)), reason="threads inherit the context here")
def test_a_thread_started_inside_cast_cache_is_not_in_it():
    errors = []

    def worker():
        try:
            _plain_regions_across_data_writes()
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    with amp.cast_cache():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert not errors, errors


def test_a_cast_cache_open_in_one_asyncio_task_leaves_another_tasks_regions_native():
    async def holder(opened, done):
        with amp.cast_cache():
            opened.set()
            await done.wait()

    async def main():
        opened, done = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(holder(opened, done))
        await opened.wait()
        try:
            _plain_regions_across_data_writes()
        finally:
            done.set()
            await task

    asyncio.run(main())


def test_keeps_casts_says_whether_a_scope_is_open_here():
    assert not _cast_cache.keeps_casts()
    elsewhere = []
    with amp.cast_cache():
        assert _cast_cache.keeps_casts()
        with amp.cast_cache():
            assert _cast_cache.keeps_casts()
        assert _cast_cache.keeps_casts()
        thread = threading.Thread(target=lambda: elsewhere.append(_cast_cache.keeps_casts()))
        thread.start()
        thread.join()
    assert not _cast_cache.keeps_casts()
    if not getattr(sys.flags, "thread_inherit_context", 0):
        assert elsewhere == [False]  # another thread: not in this scope


# -- dropping the scope's casts --------------------------------------------------------
def test_clear_drops_the_scopes_casts_after_a_write_no_check_sees():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(2, 8)
    with amp.cast_cache() as casts:
        with amp.autocast("cpu"):
            first = _evaluate(w, x)
        w.data.mul_(2)  # in place through .data: invisible
        with amp.autocast("cpu"):
            stale = _evaluate(w, x)
        casts.clear()
        assert casts._entered and _cast_cache.keeps_casts()  # still open, only emptied
        with amp.autocast("cpu"):
            fresh = _evaluate(w, x)
    assert torch.equal(stale, first)  # documented: a write through .data is not seen
    assert torch.equal(fresh, _native(w, x)) and not torch.equal(fresh, first)


def test_clear_outside_the_scope_names_the_fix():
    casts = amp.cast_cache()
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        casts.clear()


def test_a_model_deleted_inside_the_scope_is_freed_by_clear():
    # Each kept cast holds its weight through grad_fn (documented): clear() lets it go.
    model = nn.Linear(8, 8)
    gone = weakref.ref(model.weight)
    with amp.cast_cache() as casts:
        with amp.autocast("cpu"):
            model(torch.randn(2, 8))
        del model
        gc.collect()
        assert gone() is not None
        casts.clear()
        gc.collect()
        assert gone() is None


# -- torch's test_cache_disabled, on CPU ---------------------------------------------
class _CastsToBf16(TorchDispatchMode):
    """torch's WeightDTypeCastCounterMode on CPU: counts the weight's bfloat16 casts with
    torch.clear_autocast_cache replaced by a no-op, so that the forward's casts would
    serve a backward run after the region."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0] is self.weight and kwargs.get("dtype") is torch.bfloat16:
            self.count += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._patch = mock.patch("torch.clear_autocast_cache", lambda: None)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.stop()
        return super().__exit__(*exc)


def _custom_linear(region):
    class CustomLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w_t):
            ctx.save_for_backward(x, w_t)
            return F.linear(x, w_t)

        @staticmethod
        def backward(ctx, grad_output):
            x, w_t = ctx.saved_tensors
            with region("cpu"):
                dx = torch.matmul(grad_output, w_t)
                dw = torch.matmul(x.transpose(0, 1), grad_output).transpose(0, 1)
            return dx, dw

    return CustomLinear


@pytest.mark.parametrize("region", [amp.autocast, torch.autocast], ids=["ours", "native"])
def test_cache_disabled_for_a_tensor_torch_keeps_itself(region):
    # torch's test_cache_disabled (test/test_cuda.py), forced onto CPU: a tensor registered
    # with torch._C._add_cached_tensor is never cached, so a backward that re-enters
    # autocast casts the weight again although the forward's cast cache was kept.
    data, weight = torch.randn(2, 3), nn.Parameter(torch.randn(4, 3))
    linear = _custom_linear(region)
    try:
        torch._C._set_cached_tensors_enabled(True)
        torch._C._add_cached_tensor(weight)
        with _CastsToBf16(weight) as mode:
            with region("cpu"):
                s = linear.apply(data, weight).sum()
            s.backward()
        assert mode.count == 2
    finally:
        torch._C._remove_cached_tensor(weight)
        torch._C._set_cached_tensors_enabled(False)
