"""Linear-shaped matmuls: the ``addmm``, ``mm`` and ``matmul`` calls that are a ``linear``.

Libraries write linears without ``F.linear``: transformers' GPT-2 family keeps its
weights as ``(in, out)`` parameters and calls ``torch.addmm(bias, x, w)`` (``Conv1D``),
and many models write ``x @ w.t()``. Such a call is ``linear(x, W, bias)`` for one
``(out, in)`` matrix ``W`` when its right operand is a 2-D parameter (``W`` is its
transpose) or the transpose of one (``W`` is the parameter): the fp8 path runs it as that
linear, with the parameter's site (its identity and its names), so a weight has the same
site whether a model calls ``linear`` or ``addmm`` on it.

The rules, per op (arguments as the dispatcher or torch's Python functions spell them):

* ``addmm(bias, x, w)``: ``x`` 2-D, ``beta`` and ``alpha`` 1, ``bias`` any tensor (the
  eligibility test wants it 1-D with ``out`` elements);
* ``mm(x, w)``: ``x`` 2-D;
* ``matmul(x, w)`` (``x @ w``): ``x`` 2-D or more (its leading dimensions are the rows).

``w`` is a plain 2-D ``nn.Parameter`` or a view of one with its shape and strides swapped
(``p.t()``, ``p.T``, ``p.transpose(0, 1)``). Anything else (``out=``, an ``out_dtype``, a
1-D or batched operand, a computed weight, a buffer) is no linear here: the call keeps
its op's cast.
"""

from __future__ import annotations

import torch

from .. import _torch_compat

__all__ = ["linear_shaped", "mark_transpose", "weight_of", "OPS", "TRANSPOSES"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_MISSING = object()
_is_compiling = torch.compiler.is_compiling
# The attribute a transpose of a parameter made while Dynamo traces carries (see
# _transposed_parameter).
_TRANSPOSE_OF = "_dispatch_amp_transpose_of"

# Per op: its positional arguments (each with the names a caller may give it by keyword:
# the dispatcher's, then torch's Python functions'), and the keyword arguments it may take.
_SIGNATURES = {
    "aten::addmm": ((("self", "input"), ("mat1",), ("mat2",)), ("beta", "alpha")),
    "aten::mm": ((("self", "input"), ("mat2",)), ()),
    "aten::matmul": ((("self", "input"), ("other",)), ()),
}
# The ops a linear-shaped call may be made with.
OPS = tuple(_SIGNATURES)


def _bind(args, kwargs, slots, extras):
    """``(positional values, extra keyword values)`` of a call, or None when it passes
    anything else (``out=``, ``out_dtype``) or misses an argument."""
    if len(args) > len(slots):
        return None
    values = list(args) + [_MISSING] * (len(slots) - len(args))
    rest = {}
    for key, value in kwargs.items():
        for i, names in enumerate(slots):
            if key in names:
                if values[i] is not _MISSING:
                    return None
                values[i] = value
                break
        else:
            if key not in extras:
                return None
            rest[key] = value
    if any(v is _MISSING for v in values):
        return None
    return values, rest


def _one(value) -> bool:
    # A plain 1 (int or float): beta/alpha of a linear. A bool or a tensor is not.
    return type(value) in (int, float) and value == 1


def _swapped(t, base) -> bool:
    """Whether 2-D ``t`` has the shape and strides of 2-D ``base``, swapped."""
    if base.dim() != 2 or t.dim() != 2:
        return False
    rows, cols = base.shape
    s0, s1 = base.stride()
    return t.shape == (cols, rows) and t.stride() == (s1, s0)


def _transposed_parameter(t) -> _Parameter | None:
    """The 2-D parameter ``t`` is the transpose of (a view of it with its shape and strides
    swapped), or None."""
    # While Dynamo traces, ``_base`` of a view made in the graph is a new graph value, not
    # the parameter (whose site it holds): the fp8 level marks the transposes it sees
    # being made of a parameter instead (mark_transpose).
    base = getattr(t, _TRANSPOSE_OF, None) if _is_compiling() else None
    if base is None:
        base = t._base
    if type(base) is not _Parameter or not _swapped(t, base):
        return None
    # Dynamo cannot read a storage offset; with the parameter's shape and strides
    # swapped, only as_strided into a storage larger than the parameter can move it.
    if not _is_compiling() and t.storage_offset() != base.storage_offset():
        return None
    return base


def weight_of(t) -> _Parameter | None:
    """The parameter ``t`` is or is the transpose of (2-D, as a linear-shaped call's right
    operand must be), else None. Example::

        >>> w = torch.nn.Parameter(torch.randn(4, 8))
        >>> weight_of(w.t()) is w, weight_of(torch.randn(4, 8))
        (True, None)
    """
    if not isinstance(t, _Tensor) or t.dim() != 2:
        return None
    return t if type(t) is _Parameter else _transposed_parameter(t)


def mark_transpose(func, args, kwargs):
    """``func(*args, **kwargs)``, marked as the transpose of its first argument when that is
    a 2-D parameter and ``func`` (``t``, ``transpose``, ``permute``, ``swapaxes``,
    ``swapdims``, ``adjoint``, the ``T``/``mT``/``H``/``mH`` properties) transposed it: what
    ``linear_shaped`` reads while Dynamo traces. Example::

        out = mark_transpose(torch.Tensor.t, (weight,), {})
    """
    out = func(*args, **kwargs)
    if args and type(args[0]) is _Parameter and isinstance(out, _Tensor) and _swapped(out, args[0]):
        setattr(out, _TRANSPOSE_OF, args[0])
    return out


# The names of the torch functions that may transpose a parameter; mark_transpose checks
# the shape and strides, so a name here never marks anything else. Up to torch 2.13 the
# fp8 level sees the ``T``/``mT``/``H``/``mH`` properties as getters named ``__get__``;
# from 2.14 on, Dynamo hands it the aten ops they are (``numpy_T``, ``mT``, ``matrix_H``,
# ``mH``); ``adjoint`` is a method on every release.
TRANSPOSES = frozenset({
    "t", "transpose", "permute", "swapaxes", "swapdims", "adjoint", "__get__",
    "numpy_T", "mT", "matrix_H", "mH",
})


def linear_shaped(op_name: str, args, kwargs):
    """``(x, weight, bias, parameter)`` when this call of ``op_name`` (``"aten::addmm"``,
    ``"aten::mm"``, ``"aten::matmul"``) is ``linear(x, weight, bias)`` with ``weight``
    (out, in) the parameter ``parameter`` or its transpose, else None.

    Example::

        >>> w = torch.nn.Parameter(torch.randn(32, 16))     # (in, out), as Conv1D keeps it
        >>> x, weight, bias, p = linear_shaped("aten::addmm", (torch.zeros(16), torch.randn(8, 32), w), {})
        >>> weight.shape, p is w
        (torch.Size([16, 32]), True)
    """
    bound = _bind(args, kwargs, *_SIGNATURES[op_name])
    if bound is None:
        return None
    values, rest = bound
    if op_name == "aten::addmm":
        bias, x, right = values
        if not (_one(rest.get("beta", 1)) and _one(rest.get("alpha", 1))):
            return None
    else:
        bias = None
        x, right = values
    if not isinstance(x, _Tensor) or not isinstance(right, _Tensor) or x.layout != _strided:
        return None
    if right.dim() != 2 or x.dim() < 2 or (x.dim() != 2 and op_name != "aten::matmul"):
        return None
    if type(right) is _Parameter:
        return x, right.t(), bias, right
    parameter = _transposed_parameter(right)
    if parameter is None:
        return None
    return x, parameter, bias, parameter


_torch_compat.keep_out_of_dynamo(globals(), __name__)
