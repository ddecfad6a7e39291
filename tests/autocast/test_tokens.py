"""Configuration tokens: torch.compile's guards tell policies apart, and no region is refused.

Each test runs on a fresh token table (the process's own is put back after), and drops
Dynamo's graphs at both ends: they guard on tokens of the table they were traced under.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo

import dispatch_amp as amp
from dispatch_amp.autocast import _engine, _tokens

BASE = amp.Policy.for_device("cpu")
# Ops native lowers (every policy of one's own has kernels for them already: these tests
# register no kernel the rest of the suite would then meet).
LOWERED = ["mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear"]


def new_policy(i: int) -> amp.Policy:
    """A policy of one's own, distinct for each i < 127: the ops of LOWERED picked by the
    bits of i + 1 kept in float32."""
    return BASE.with_ops(fp32=[op for j, op in enumerate(LOWERED) if (i + 1) >> j & 1], name=f"policy {i}")


def mm_dtype(i: int) -> torch.dtype:
    """What mm gives under new_policy(i)."""
    return torch.float32 if (i + 1) & 1 else torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_tokens(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(_tokens, "_TOKENS", _tokens._Tokens())
    yield
    torch._dynamo.reset()


def pin_every_token():
    """What compiling under as many configurations as there are tokens leaves: each token
    held by a graph (the compile-start callback pins the token in force)."""
    for i in range(len(_tokens._CANDIDATES)):
        with amp.autocast("cpu", policy=new_policy(i)):
            assert _tokens.pin_current()
    assert len(_tokens._TOKENS.pinned) == len(_tokens._CANDIDATES)


def test_an_eager_region_with_a_new_policy_runs_when_every_token_is_held_by_a_graph():
    pin_every_token()
    a = torch.randn(4, 4)
    for i in range(100, 103):  # several new configurations: each runs, with its own casts
        with amp.autocast("cpu", policy=new_policy(i)):
            assert torch.mm(a, a).dtype == mm_dtype(i)
            assert torch.bmm(a[None], a[None]).dtype == (torch.float32 if (i + 1) & 2 else torch.bfloat16)
            assert torch.get_autocast_dtype("privateuseone") is _tokens.OVERFLOW_TOKEN
    with amp.autocast("cpu", policy=new_policy(0)):  # an old one keeps its token
        assert torch.get_autocast_dtype("privateuseone") is not _tokens.OVERFLOW_TOKEN


def test_a_compile_under_a_configuration_past_the_last_token_raises_at_compile_time():
    pin_every_token()
    compiled = torch.compile(lambda x: torch.mm(x, x), backend="eager")
    a = torch.randn(4, 4)
    with amp.autocast("cpu", policy=new_policy(100)):
        assert torch.mm(a, a).dtype == mm_dtype(100)  # eagerly: runs
        with pytest.raises(Exception, match="tell apart") as raised:
            compiled(a)
    chain, error = [], raised.value
    while error is not None:
        chain.append(type(error))
        error = error.__cause__ or error.__context__
    assert _tokens.TokenExhausted in chain


def test_tokens_held_by_graphs_are_released_by_a_dynamo_reset():
    # A sweep compiling under a new policy each time: past the last token, a reset (which
    # drops every compiled graph) gives the next configurations tokens of their own, and
    # they compile; before, every later region with a new policy was refused, eager too.
    pin_every_token()
    torch._dynamo.reset()
    gc.collect()
    a = torch.randn(4, 4)
    for i in range(100, 103):
        compiled = torch.compile(lambda x: torch.mm(x, x).relu(), backend="eager")
        with amp.autocast("cpu", policy=new_policy(i)):
            token = torch.get_autocast_dtype("privateuseone")
            assert token is not _tokens.OVERFLOW_TOKEN
            assert compiled(a).dtype == mm_dtype(i)
            assert token in _tokens._TOKENS.pinned


def test_a_thread_torch_starts_under_the_overflow_token_raises_where_it_cannot_tell_the_policy():
    pin_every_token()
    for i in (100, 101):
        with amp.autocast("cpu", policy=new_policy(i)):
            pass
    with pytest.raises(_tokens.TokenExhausted, match="backward"):
        _tokens.contexts_for(_tokens.OVERFLOW_TOKEN)
    torch._dynamo.reset()
    _engine._compile_hooks.install()
    assert _tokens.contexts_for(_tokens.OVERFLOW_TOKEN) is not None  # one configuration again (or none)
