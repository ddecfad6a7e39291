"""Plans: what the engine's kernels do with each op under a policy."""

from __future__ import annotations

import torch

from dispatch_amp import Policy
from dispatch_amp.autocast import _handlers
from dispatch_amp.autocast._cudnn_rnn import cudnn_rnn
from dispatch_amp.autocast._routing import plan_for
from dispatch_amp.autocast.policy import castable_overloads

aten = torch.ops.aten


def test_equal_policies_on_one_device_type_share_a_plan():
    a = Policy.for_device("cpu").with_ops(fp32=["mm"])
    b = Policy.for_device("cpu").with_ops(fp32=["mm"], name="other name")
    assert plan_for(a, "cpu") is plan_for(b, "cpu")
    assert plan_for(a, "cpu") is not plan_for(Policy.for_device("cpu"), "cpu")
    assert plan_for(a, "cpu") is not plan_for(a, "cuda")


def test_handlers_follow_the_kind():
    plan = plan_for(Policy.for_device("cpu"), "cpu")
    assert plan.handler(aten.mm.default) is _handlers.lower
    assert plan.handler(aten.cat.default) is _handlers.promote
    assert plan.handler(aten.mse_loss.default) is _handlers.fp32
    assert plan.handler(aten.relu.default) is _handlers.given
    cuda = plan_for(Policy.for_device("cuda"), "cuda")
    assert cuda.handler(aten.binary_cross_entropy.default) is _handlers.banned
    # fp32-unless-dtype: an optional dtype argument is set (softmax: positional, sum:
    # keyword-only); norm's overloads without one get the sibling that takes one.
    assert cuda.handler(aten.softmax.int).__qualname__.startswith("fp32_set_opt_dtype")
    assert cuda.handler(aten.sum.default).__qualname__.startswith("fp32_set_opt_dtype")
    assert cuda.handler(aten.norm.Scalar).__qualname__.startswith("fp32_append_dtype")
    assert cuda.handler(aten.norm.ScalarOpt_dtype) is _handlers.given


def test_out_and_in_place_overloads_are_never_cast():
    plan = plan_for(Policy.for_device("cpu"), "cpu")
    assert plan.kind(aten.mm.default) == "lower"
    assert plan.kind(aten.mm.out) is None
    assert plan.kind(aten.addmm_.default) is None
    names = {op._overloadname for op in castable_overloads("aten::mm")}
    assert "default" in names and "out" not in names


def test_cudnn_rnn_follows_natives_own_wrapper():
    # Native's float16 cast-and-reflatten, under the CUDA table's `lower` for the op (which
    # only CUDA builds register).
    assert ("aten::_cudnn_rnn" in Policy.for_device("cuda").rules) == (torch.version.cuda is not None)
    own = Policy({"lower": ["_cudnn_rnn", "mm"]})
    handler = plan_for(own, "cuda").handler(aten._cudnn_rnn.default)
    assert getattr(handler, "__wrapped__", handler) is cudnn_rnn


def test_builtin_rules_cover_the_overloads_native_registers():
    # Native CPU registers _convolution's deprecated overload only: the other one (what
    # vmap's convolution rule calls) runs as given, as natively.
    plan = plan_for(Policy.for_device("cpu"), "cpu")
    assert plan.kind(aten._convolution.deprecated) == "lower"
    assert plan.kind(aten._convolution.default) is None
    assert aten._convolution.default not in plan.registered
    # A rule given by op covers every overload a rule may cover.
    mine = plan_for(Policy({"lower": ["_convolution"]}), "cpu")
    assert mine.kind(aten._convolution.default) == mine.kind(aten._convolution.deprecated) == "lower"


def test_a_policy_of_our_own_also_takes_the_ops_native_registers():
    # So native's kernels never cast a call in our region: an op native casts and the
    # policy does not gets a kernel that runs it as given.
    own = Policy.for_device("cpu").without_ops("mm")
    plan = plan_for(own, "cpu")
    assert aten.mm.default in plan.registered
    assert plan.kind(aten.mm.default) is None
    builtin = plan_for(Policy.for_device("cpu"), "cpu")
    assert aten.relu.default not in builtin.registered
