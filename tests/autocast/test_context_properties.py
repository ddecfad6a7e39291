"""Property tests: random ops from the tables x random input dtypes and devices.

Under the CPU table the oracle is native CPU autocast (same dtype, same bits). Under the
CUDA table, applied to CPU tensors, the oracle is native's rule written out: cast the
eligible inputs (floating, on the context's device, not float64) to the kind's dtype and
run the op without autocast; ours must give the same dtype and bits, or fail alike.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp.autocast import op_tables

# name -> (callable, number of tensor inputs, shape of each input)
OPS = {
    "mm": (torch.mm, [(4, 4), (4, 4)]),
    "matmul": (torch.matmul, [(2, 4, 4), (4, 4)]),
    "addmm": (torch.addmm, [(4, 4), (4, 4), (4, 4)]),
    "linear": (F.linear, [(3, 4), (5, 4), (5,)]),
    "bmm": (torch.bmm, [(2, 3, 4), (2, 4, 3)]),
    "exp": (torch.exp, [(6,)]),
    "log_softmax": (lambda x: F.log_softmax(x, dim=-1), [(3, 5)]),
    "softmax": (lambda x: torch.softmax(x, -1), [(3, 5)]),
    "sum": (torch.sum, [(3, 5)]),
    "layer_norm": (lambda x: F.layer_norm(x, (5,)), [(3, 5)]),
    "pow": (lambda x: torch.pow(x, 2), [(6,)]),
    "mse_loss": (F.mse_loss, [(4, 3), (4, 3)]),
    "cat": (lambda a, b: torch.cat([a, b]), [(2, 3), (2, 3)]),
    "stack": (lambda a, b: torch.stack((a, b)), [(2, 3), (2, 3)]),
    "addcmul": (torch.addcmul, [(5,), (5,), (5,)]),
    "atan2": (torch.atan2, [(5,), (5,)]),
    "relu": (torch.relu, [(5,)]),
    "add": (torch.add, [(5,), (5,)]),
}

# The aten name each op's policy entry is under (None: not in any table).
POLICY_NAME = {
    "mm": "mm", "matmul": "matmul", "addmm": "addmm", "linear": "linear", "bmm": "bmm",
    "exp": "exp", "log_softmax": "log_softmax", "softmax": "softmax", "sum": "sum",
    "layer_norm": "layer_norm", "pow": "pow", "mse_loss": "mse_loss", "cat": "cat",
    "stack": "stack", "addcmul": "addcmul", "atan2": "atan2", "relu": None, "add": None,
}

INPUT_KINDS = ["fp64", "fp32", "fp16", "bf16", "meta-fp32"]


def make(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(shape, generator=g) + 0.5  # positive: log/pow/atan2 stay finite
    if kind == "meta-fp32":
        return torch.empty(shape, device="meta")
    return base.to({"fp64": torch.float64, "fp32": torch.float32,
                    "fp16": torch.float16, "bf16": torch.bfloat16}[kind])


def rule_cast(kind, ctx_dtype, tensors):
    def eligible(t):
        return t.is_floating_point() and t.device.type == "cpu" and t.dtype != torch.float64

    if kind is None:
        return tensors
    if kind == op_tables.LOWER:
        target = ctx_dtype
    elif kind in (op_tables.FP32, op_tables.FP32_UNLESS_DTYPE):
        target = torch.float32
    elif kind == op_tables.PROMOTE:
        # Native's rule (prioritize in ATen's autocast_mode.h): float32 wins; the region's
        # dtype stays; any other floating dtype raises.
        target = ctx_dtype
        for t in tensors:
            if not eligible(t):
                continue
            if target == torch.float32 or t.dtype == torch.float32:
                target = torch.float32
            elif t.dtype != target:
                raise RuntimeError(f"promote: {t.dtype} in a {ctx_dtype} region")
    else:
        raise AssertionError(kind)
    return [t.to(target) if eligible(t) else t for t in tensors]


def run(fn, tensors):
    try:
        return fn(*tensors), None
    except Exception as e:  # noqa: BLE001 - compared by type below
        return None, type(e)


def assert_same(expected, got, tensors):
    (e_out, e_err), (g_out, g_err) = expected, got
    assert (e_err is None) == (g_err is None), (e_err, g_err)
    if e_err is None:
        assert g_out.dtype == e_out.dtype
        assert g_out.device == e_out.device
        # torch lets some ops mix meta and CPU inputs; their values are meaningless.
        if not any(t.device.type == "meta" for t in tensors):
            assert torch.equal(g_out, e_out)


@given(
    op=st.sampled_from(sorted(OPS)),
    kinds=st.lists(st.sampled_from(INPUT_KINDS), min_size=3, max_size=3),
    ctx_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
@example(op="cat", kinds=["bf16", "fp16", "fp32"], ctx_dtype=torch.bfloat16, seed=0)  # raises, both
@example(op="addcmul", kinds=["fp32", "fp16", "bf16"], ctx_dtype=torch.bfloat16, seed=0)  # float32 first
def test_cpu_table_matches_native_cpu_autocast(op, kinds, ctx_dtype, seed):
    fn, shapes = OPS[op]
    tensors = [make(k, s, seed + i) for i, (k, s) in enumerate(zip(kinds, shapes))]
    # A float16/bfloat16 mix under promote raises in native and ours alike.
    with torch.autocast("cpu", dtype=ctx_dtype):
        native = run(fn, tensors)
    with amp.autocast("cpu", dtype=ctx_dtype):
        ours = run(fn, tensors)
    assert_same(native, ours, tensors)


@given(
    op=st.sampled_from(sorted(OPS)),
    kinds=st.lists(st.sampled_from(INPUT_KINDS), min_size=3, max_size=3),
    ctx_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
@example(op="addcmul", kinds=["fp64", "fp64", "fp16"], ctx_dtype=torch.bfloat16, seed=0)  # raises
def test_cuda_table_follows_natives_rule(op, kinds, ctx_dtype, seed):
    fn, shapes = OPS[op]
    tensors = [make(k, s, seed + i) for i, (k, s) in enumerate(zip(kinds, shapes))]
    policy = amp.Policy.for_device("cuda")
    name = POLICY_NAME[op]
    kind = policy.kind_of(name) if name else None
    expected = run(lambda *ts: fn(*rule_cast(kind, ctx_dtype, list(ts))), tensors)
    with amp.autocast("cpu", dtype=ctx_dtype, policy=policy):
        ours = run(fn, tensors)
    assert_same(expected, ours, tensors)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_casts_fp32_inputs_per_its_kind(op):
    # A deterministic floor under the random tests: plain float32 inputs, both tables.
    fn, shapes = OPS[op]
    tensors = [make("fp32", s, i) for i, s in enumerate(shapes)]
    for device in ("cpu", "cuda"):
        policy = amp.Policy.for_device(device)
        name = POLICY_NAME[op]
        kind = policy.kind_of(name) if name else None
        expected = run(fn, rule_cast(kind, torch.bfloat16, tensors))
        with amp.autocast("cpu", policy=policy):
            ours = run(fn, tensors)
        assert_same(expected, ours, tensors)
