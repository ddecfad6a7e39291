"""The handlers' way of calling an op (autocast/_handlers.py run_without_autocast): every
autocast key excluded inside the op, as native's wrappers do, and the thread's keys as
they were afterwards, also when the op raises or calls nest."""

from __future__ import annotations

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.autocast import _handlers

_LIB = torch.library.Library("dispatch_amp_handlers_test", "DEF")
_LIB.define("probe(Tensor x, bool fail) -> Tensor")
_SEEN: list = []


def _probe(x, fail):
    _SEEN.append(torch._C._dispatch_tls_local_exclude_set().raw_repr())
    if fail:
        raise ValueError("the op failed")
    return x.clone()


_LIB.impl("probe", _probe, "CompositeExplicitAutograd")
_PROBE = torch.ops.dispatch_amp_handlers_test.probe.default
_LIB.define("nest(Tensor x) -> Tensor")


def _nest(x):
    out = _handlers.run_without_autocast(_PROBE, (x, False), {})
    _SEEN.append(torch._C._dispatch_tls_local_exclude_set().raw_repr())
    return out


_LIB.impl("nest", _nest, "CompositeExplicitAutograd")
_NEST = torch.ops.dispatch_amp_handlers_test.nest.default


def _excluded() -> int:
    return torch._C._dispatch_tls_local_exclude_set().raw_repr()


@pytest.fixture(autouse=True)
def _fresh():
    _SEEN.clear()
    yield
    _SEEN.clear()


@pytest.mark.parametrize("region", [amp.autocast, torch.autocast])
def test_inside_the_op_every_autocast_key_is_excluded_as_torch_excludes_them(region):
    x = torch.randn(2)
    with region("cpu"):
        before = _excluded()
        with torch._C._DisableAutocast():
            expected = _excluded()
        _handlers.run_without_autocast(_PROBE, (x, False), {})
        assert _SEEN == [expected]
        assert _excluded() == before


def test_a_failing_op_leaves_the_threads_keys_as_they_were_and_the_guard_free():
    x = torch.randn(2)
    with amp.autocast("cpu"):
        before, idle = _excluded(), len(_handlers._idle_guards)
        with pytest.raises(ValueError, match="the op failed"):
            _handlers.run_without_autocast(_PROBE, (x, True), {})
        assert _excluded() == before
        assert len(_handlers._idle_guards) == max(idle, 1)


def test_nested_calls_each_take_a_guard_of_their_own():
    # An op run from inside another op's call (a Python kernel below ours, a hook) takes
    # a guard of its own: its exit must not end the outer call's exclusion.
    x = torch.randn(2)
    with amp.autocast("cpu"):
        with torch._C._DisableAutocast():
            inside = _excluded()
        before = _excluded()
        _handlers._idle_guards.clear()
        _handlers.run_without_autocast(_NEST, (x,), {})
        assert _SEEN == [inside, inside]  # the inner op's, then the outer's after it
        assert len(_handlers._idle_guards) == 2
        assert _excluded() == before
