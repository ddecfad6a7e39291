"""Routes: how the engine handles each call under a policy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dispatch_amp import Policy
from dispatch_amp._routing import EXPAND, GETTER, routes_for
from dispatch_amp.composites import DECOMPOSITIONS
from dispatch_amp.op_tables import CastKind


def test_equal_policies_share_routes():
    a = Policy.for_device("cpu").with_ops(fp32=["mm"])
    b = Policy.for_device("cpu").with_ops(fp32=["mm"], name="other name")
    assert routes_for(a) is routes_for(b)
    assert routes_for(a) is not routes_for(Policy.for_device("cpu"))


def test_function_routes():
    routes = routes_for(Policy.for_device("cpu"))
    assert routes.function_route(torch.mm) is CastKind.LOWER
    assert routes.function_route(torch.Tensor.__matmul__) is CastKind.LOWER
    assert routes_for(Policy.for_device("cuda")).function_route(F.layer_norm) is CastKind.FP32
    assert routes.function_route(torch.Tensor.shape.__get__) is GETTER
    assert routes.function_route(F.multi_head_attention_forward) is EXPAND
    assert routes.function_route(torch.relu) is None
    assert routes.function_route(torch.lstm_cell) is DECOMPOSITIONS["lstm_cell"]
    # The CUDA table casts the cell whole, as cuDNN does.
    assert routes_for(Policy.for_device("cuda")).function_route(torch.lstm_cell) is CastKind.LOWER


def test_aten_routes_never_cast_out_or_inplace_overloads():
    routes = routes_for(Policy.for_device("cpu"))
    assert routes.aten_kind(torch.ops.aten.mm.default) is CastKind.LOWER
    assert routes.aten_kind(torch.ops.aten.mm.out) is None
    assert routes.aten_kind(torch.ops.aten.addmm_.default) is None


def test_rnn_layers_are_left_to_native_under_the_builtin_cuda_policy():
    # Native's _cudnn_rnn wrapper casts them (to float16, re-flattened) below us; a policy
    # of one's own casts them whole, and cross_entropy follows native's C++ composite.
    builtin = routes_for(Policy.for_device("cuda"))
    derived = routes_for(Policy.for_device("cuda").with_ops(fp32=["softmax"]))
    for fn in (torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu):
        assert builtin.function_route(fn) is None
        assert derived.function_route(fn) is CastKind.LOWER
    assert routes_for(Policy.for_device("xpu")).function_route(torch._VF.lstm) is CastKind.LOWER
    assert builtin.function_route(F.cross_entropy) is DECOMPOSITIONS["cross_entropy_loss"]
    assert routes_for(Policy.for_device("cpu")).function_route(F.cross_entropy) is CastKind.FP32
