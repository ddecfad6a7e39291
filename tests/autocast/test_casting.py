"""How one call's arguments are cast (autocast/_casting.py): which list arguments are
looked inside, that the tensors found there are cast by the same rule as the others, and
that arguments are cast in native's order."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import dispatch_amp as amp
from dispatch_amp import _torch_compat
from dispatch_amp.autocast._casting import arg_order, holds_tensors, map_tensors
from dispatch_amp.autocast._state import STATE

# The list types an aten schema can give an argument, as the dispatcher hands them to a
# Python kernel: numbers never hold a tensor, Tensor[] / Tensor?[] hold only tensors and None.
_numbers = st.one_of(st.lists(st.integers(-8, 8)), st.lists(st.floats(allow_nan=False)), st.lists(st.booleans()))
_optional_tensors = st.lists(st.one_of(st.none(), st.builds(torch.zeros, st.integers(0, 3))), min_size=1)


@given(_numbers)
def test_lists_of_numbers_are_not_looked_inside(values):
    assert not holds_tensors(values)
    assert not holds_tensors(tuple(values))


@given(_optional_tensors)
def test_tensor_lists_are_looked_inside_whatever_comes_first(values):
    assert holds_tensors(values)


def test_an_empty_list_holds_nothing():
    assert not holds_tensors([])


def test_tensors_after_a_leading_none_are_cast():
    t = torch.randn(3)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        ctx = STATE.primary
        (out,) = map_tensors(([None, t, None],), torch.bfloat16, ctx, STATE)
    assert out[0] is None and out[2] is None
    assert out[1].dtype == torch.bfloat16
    torch.testing.assert_close(out[1], t.bfloat16(), rtol=0, atol=0)


def test_a_convolutions_integer_lists_pass_through_unchanged():
    # stride, padding and dilation reach the kernel as lists of ints: the call is cast as
    # native casts it and the lists are handed on as they came.
    x = torch.randn(1, 2, 5, 5)
    conv = torch.nn.Conv2d(2, 3, 3, stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    with amp.autocast("cpu", dtype=torch.bfloat16):
        ours = conv(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = conv(x)
    assert ours.dtype == native.dtype == torch.bfloat16
    torch.testing.assert_close(ours, native, rtol=0, atol=0)


# -- the order of the casts ------------------------------------------------------------------
# Native casts an op's arguments inside one C++ call expression, in the order its compiler
# chose (last argument first in GCC builds): a dispatch mode sees that order, and so does
# torch.compile, whose caches key on the graph. Ours casts in the same order
# (_casting.arg_order), keyword-only arguments included, a list's elements first to last.
# The calls are recorded by conftest's aten_calls.


def _order_cases():
    g = torch.Generator().manual_seed(0)

    def f(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    x, w, b = f(3, 4), f(5, 4, grad=True), f(5, grad=True)
    low = torch.bfloat16
    spd = (lambda a: (a @ a.T + 4 * torch.eye(4)).to(low))(f(4, 4))
    return {
        # lower: input, weight, bias (weight and bias cached, as leaves requiring grad)
        "linear": lambda: F.linear(x, w, b),
        "addmm": lambda: torch.addmm(f(5), x, f(4, 5)),
        "baddbmm": lambda: torch.baddbmm(f(2, 3, 5), f(2, 3, 4), f(2, 4, 5)),
        "conv2d": lambda: F.conv2d(f(1, 2, 5, 5), f(3, 2, 3, 3), f(3)),
        # fp32: low-precision inputs cast up
        "layer_norm": lambda: F.layer_norm(f(3, 4, dtype=low), (4,), f(4, dtype=low), f(4, dtype=low)),
        "mse_loss": lambda: F.mse_loss(f(3, 4, dtype=low), f(3, 4, dtype=low)),
        # promote: a list argument, and two tensors
        "cat": lambda: torch.cat([f(2, 3, dtype=low), f(2, 3), f(2, 3, dtype=low)]),
        "index_copy": lambda: f(4, 3, dtype=low).index_copy(0, torch.tensor([0, 2]), f(2, 3)),
        # fp32 with keyword-only tensors (atol, rtol come after the input in the schema)
        "matrix_rank keyword-only": lambda: torch.linalg.matrix_rank(
            spd, atol=f((), dtype=low).abs(), rtol=f((), dtype=low).abs()),
    }


@pytest.mark.parametrize("name", list(_order_cases()))
def test_arguments_are_cast_in_natives_order(name, aten_calls):
    def inside(region, fn):
        def run():
            with region("cpu", dtype=torch.bfloat16):
                fn()
        return run

    native = aten_calls(inside(torch.autocast, _order_cases()[name]))
    ours = aten_calls(inside(amp.autocast, _order_cases()[name]))
    casts = [c for c in native if c[0] == "aten._to_copy.default"]
    assert len(casts) >= 2, f"the case must cast at least two arguments: {native}"
    assert ours == native


def test_arg_order_follows_torchs_own_order():
    # The build's order, read from torch at import (_torch_compat), drives arg_order.
    last_first = _torch_compat.CASTS_LAST_ARGUMENT_FIRST
    assert arg_order(3) == ((2, 1, 0) if last_first else (0, 1, 2))
    assert arg_order(70) == tuple(range(69, -1, -1)) if last_first else tuple(range(70))
    assert arg_order(0) == ()


# -- promote: native's rule, without an aten call ------------------------------------------------
@pytest.mark.parametrize("dtypes, want", [
    ((torch.bfloat16, torch.float32), torch.float32),
    ((torch.float32, torch.float16), torch.float32),   # float32 first: native promotes too
    ((torch.bfloat16, torch.float64), torch.float64),   # float64 left out, not cast: cat widens
    ((torch.float16, torch.float32), None),             # raises at float16, before float32
    ((torch.bfloat16, torch.float16), None),
], ids=["bf16-fp32", "fp32-fp16", "bf16-fp64", "fp16-fp32", "bf16-fp16"])
def test_promote_follows_natives_rule_and_raises_where_native_raises(dtypes, want):
    tensors = [torch.ones(2, dtype=d) for d in dtypes]
    results = {}
    for name, region in (("native", torch.autocast), ("ours", amp.autocast)):
        try:
            with region("cpu", dtype=torch.bfloat16):
                results[name] = torch.cat(tensors).dtype
        except RuntimeError as e:
            results[name] = e
    if want is None:
        assert isinstance(results["native"], RuntimeError)
        assert isinstance(results["ours"], RuntimeError)
        assert "aten::cat" in str(results["ours"]) and "Cast the torch.float16 input" in str(results["ours"])
    else:
        assert results["native"] == results["ours"] == want


def test_promote_makes_no_aten_call_of_its_own(aten_calls):
    # torch.promote_types is an aten op: a dispatch mode would see it (native makes none).
    def run():
        with amp.autocast("cpu", dtype=torch.bfloat16):
            torch.cat([torch.ones(2, dtype=torch.bfloat16), torch.ones(2)])

    calls = aten_calls(run)
    assert not [c for c in calls if "promote_types" in c[0]]
