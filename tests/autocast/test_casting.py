"""How one call's arguments are cast (autocast/_casting.py): which list arguments are
looked inside, and that the tensors found there are cast by the same rule as the others."""

import torch
from hypothesis import given, strategies as st

import dispatch_amp as amp
from dispatch_amp.autocast._casting import holds_tensors, map_tensors
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
