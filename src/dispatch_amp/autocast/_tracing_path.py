"""The fp8 level's handler while Dynamo traces: what it does becomes graph.

Dynamo inlines ``__torch_function__`` of a function mode on torch's stack for every call
it traces (see "Note: torch.compile" in ``_engine.py``). Casting needs nothing here: our
kernels run in the dispatcher when Dynamo and AOTAutograd trace. The fp8 path does: an
fp8 call's quantization, statistics and delayed scaling's history updates are Python
around ``torch._scaled_mm``, which Dynamo must trace to put them in the graph. So an
eligible ``F.linear``, or a linear-shaped ``torch.addmm``, ``torch.mm`` or ``matmul``
(``x @ w.t()``, ``fp8/_reach.py``) whose op the policy marks fp8, under a region with an
fp8 recipe, is traced as ``fp8_linear``, inside ``torch.autocast(device, enabled=False)``
(graph nodes too: no autocast inside the fp8 path, ours or native's); every other call is
traced as given, and our kernels cast it when AOTAutograd traces it.

Dynamo keeps ``F.multi_head_attention_forward`` whole, one graph node that the fp8 level
sees as one call and AOTAutograd takes apart below it, where no call can take the fp8
path (its tensors are AOTAutograd's, and state updates there would not be graph): its
projections would run in the region's dtype, where eagerly they run in fp8. Under fp8,
the fp8 level traces its body instead (``_composite_body``), with the level back on
torch's stack, so each of its ``linear`` calls comes here as eagerly it comes to our
kernel.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_compat
from ..fp8 import fp8_linear
from ..fp8._eligibility import fp8_eligible, linear_arguments
from ..fp8._reach import TRANSPOSES, linear_shaped, mark_transpose, weight_of
from ..warning_types import AmpNumericsWarning
from ._state import STATE, native_nesting
from .op_tables import FP8

__all__ = ["trace_call"]

# The torch functions (by name) that reach an op whose calls may be a linear, and that op.
_OPS = {"linear": "aten::linear", "addmm": "aten::addmm", "mm": "aten::mm", "matmul": "aten::matmul",
        "__matmul__": "aten::matmul", "linalg_matmul": "aten::matmul"}
# A function whose op is a composite of the op above: eagerly that op's kernel sees its
# call only where the policy has no rule for the composite (a rule would cast it and run
# it with autocast off inside).
_VIA = {"linalg_matmul": "aten::linalg_matmul"}
# Functions (by name) whose composite calls ``mm`` on operands of its own making: eagerly
# that ``mm`` may be a linear the fp8 path takes; the fp8 level cannot see it, and
# compiled it runs in the region's dtype. Traced with a weight, they warn.
_UNSEEN = {"tensordot": "aten::tensordot", "inner": "aten::inner",
           "chain_matmul": "aten::chain_matmul", "linalg_multi_dot": "aten::linalg_multi_dot"}
_SPELLED = {"linalg_multi_dot": "linalg.multi_dot", "matmul": "matmul (x @ w)",
            "__matmul__": "matmul (x @ w)", "linalg_matmul": "linalg.matmul"}


def _fp8_in_force(device_type: str | None, op_name: str, via: str | None = None) -> bool:
    """Whether the innermost region of ``device_type`` marks ``op_name``'s default overload
    fp8 under a recipe, with no native region inside it (run by Dynamo at trace time, its
    result baked into the graph; the guards on our token and on the fp8 level's recipe
    cover what it read). ``via``: the composite op the call is made inside, which the
    policy must leave as it is."""
    st = STATE
    ctx = st.primary
    if ctx is None:
        ctx = next((c for c in st.active if c.device_type == device_type), None)
    if ctx is None or ctx.fp8 is None or ctx.device_type != device_type:
        return False
    if native_nesting() > st.native_depth:
        return False
    if not torch.is_autocast_enabled(device_type):  # switched off by hand inside the region
        return False
    if via is not None and ctx.policy.kind_of(f"{via}.default") is not None:
        return False
    return ctx.policy.kind_of(f"{op_name}.default") is FP8


_fp8_in_force_constant = _torch_compat.assume_constant_result(_fp8_in_force)


def _no_torch_function(relevant_args) -> bool:
    return False


def _check_key_padding_mask(key_padding_mask, src_len: int, bsz: int) -> None:
    # torch's check passes torch._check_with a message closing over a tensor, which
    # Dynamo refuses to trace; the same check, with the same error, as Python.
    rows, cols = key_padding_mask.shape[0], key_padding_mask.shape[1]
    if rows != bsz:
        raise AssertionError(f"Expected key_padded_mask.shape[0] to be {bsz}, but got {rows}")
    if cols != src_len:
        raise AssertionError(f"Expected key_padded_mask.shape[1] to be {src_len}, but got {cols}")


# Helpers of the composites' module that Dynamo cannot trace, by name: the copies call ours.
_TRACEABLE = {"_check_key_padding_mask": _check_key_padding_mask}


def _composite_body(func):
    """A copy of torch's Python function ``func`` whose own ``__torch_function__`` check
    answers no (its callees keep theirs): called with the fp8 level on torch's stack, it
    runs its body, whose calls come to the level, instead of handing itself back to it.
    Its globals are a copy of its module's, taken at import, without ``__name__``: Dynamo
    then reads every global it loads from that copy, and guards there, not on the module.
    None where ``func`` asks no ``has_torch_function`` (a torch that spells its check
    otherwise): the copy would hand itself back to the level without end."""
    if "has_torch_function" not in func.__code__.co_names:
        return None
    scope = {k: v for k, v in func.__globals__.items() if k != "__name__"}
    scope["has_torch_function"] = _no_torch_function
    for name, replacement in _TRACEABLE.items():
        if name in scope:
            scope[name] = replacement
    body = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


# Python functions of torch that Dynamo puts in the graph whole and that call ``linear``.
_COMPOSITES = {f: body for f in (F.multi_head_attention_forward,) if (body := _composite_body(f))}


# ``Tensor.unflatten`` is Python that ends in ``super().unflatten``, which Dynamo cannot
# inline: handed to a function mode it fails to trace (fullgraph) or breaks the graph.
# ``torch.unflatten`` is the same op (the method's docstring says so) as one graph node.
_TENSOR_UNFLATTEN = torch.Tensor.unflatten


def trace_call(mode: TorchFunctionMode, func, args, kwargs):
    """The fp8 level's handler while Dynamo traces (its code becomes graph)."""
    if func is _TENSOR_UNFLATTEN:
        return torch.unflatten(*args, **kwargs)
    recipe = mode.fp8_recipe
    if recipe is None:
        return func(*args, **kwargs)
    body = _COMPOSITES.get(func)
    if body is not None:
        return _trace_composite(mode, func, body, args, kwargs)
    name = getattr(func, "__name__", None)
    if name == "wrapped":
        # torch 2.15's Dynamo hands the reflected operators (Tensor.__rmatmul__, ...) as
        # their wrapper's function, named after it; the operator is what it wraps.
        name = getattr(getattr(func, "__wrapped__", None), "__name__", name)
    if name == "__rmatmul__" and len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):
        # x @ w where x's type gave way to w's: Tensor.__rmatmul__ is Python calling
        # torch.matmul(x, w), which eagerly reaches matmul's kernel.
        func, args, name = torch.matmul, (args[1], args[0]), "matmul"
    op_name = _OPS.get(name)
    if op_name is None:
        if name in TRANSPOSES:  # x @ w.t(): the fp8 path needs to know w.t() is w's
            return mark_transpose(func, args, kwargs)
        if name in _UNSEEN:
            _warn_if_unseen(name, _UNSEEN[name], args)
        return func(*args, **kwargs)
    if op_name == "aten::linear":
        x, weight, bias = linear_arguments(args, kwargs)
        holder = weight
    else:
        call = linear_shaped(op_name, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        x, weight, bias, holder = call
    if not isinstance(x, torch.Tensor):
        return func(*args, **kwargs)
    device_type = x.device.type
    if not _fp8_in_force_constant(device_type, op_name, _VIA.get(name)):
        # Under a policy without a matmul rule, eagerly the mm inside matmul's own
        # implementation may take the fp8 path (when matmul folds x into a matrix).
        if (op_name == "aten::matmul" and _fp8_in_force_constant(device_type, "aten::mm", "aten::matmul")
                and fp8_eligible(recipe, device_type, x, weight, bias, holder=holder)):
            _warn_unseen(name)
        return func(*args, **kwargs)
    dtype = torch.get_autocast_dtype(device_type)
    if not fp8_eligible(recipe, device_type, x, weight, bias, holder=holder):
        return func(*args, **kwargs)
    # The weight (the parameter, for a linear-shaped matmul) carries its site
    # (fp8/recipes.py): the graph updates its statistics, and delayed scaling's history,
    # in place.
    site = recipe.state.lookup(holder)
    if site is None and recipe.stateful:
        _refuse_unbound_site(type(recipe).__name__)
    with torch.autocast(device_type, enabled=False):
        return fp8_linear(x, weight, bias, recipe, dtype, site)


def _trace_composite(mode, func, body, args, kwargs):
    """``func``'s body traced with the fp8 level on torch's stack, where a ``linear`` of
    it may run in fp8; else ``func`` whole."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or not _fp8_in_force_constant(tensors[0].device.type, "aten::linear"):
        return func(*args, **kwargs)
    # A tensor subclass keeps its own __torch_function__, which the body no longer asks.
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return func(*args, **kwargs)
    with mode:
        return body(*args, **kwargs)


def _warn_if_unseen(name: str, composite: str, args) -> None:
    """Warns when a call of ``name`` (an ``_UNSEEN`` function) has a weight (a 2-D
    parameter or a transpose of one) among its operands and its ``mm`` may be fp8."""
    operands = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if not tensors or not _fp8_in_force_constant(tensors[0].device.type, "aten::mm", composite):
        return
    if any(weight_of(t) is not None for t in tensors):
        _warn_unseen(name)


@_torch_compat.assume_constant_result
def _warn_unseen(name: str) -> bool:
    # Runs while Dynamo traces: once per compile of the call.
    warnings.warn(
        f"torch.{_SPELLED.get(name, name)} with a weight under fp8 and torch.compile: "
        f"eagerly the gemm inside it may run in fp8 (a call inside torch's composites "
        f"counts as a linear); compiled, the call stays whole until AOTAutograd takes it "
        f"apart, below the fp8 path, and its gemm runs in the region's dtype. Write it as "
        f"F.linear(x, w) or x @ w.t() to run it in fp8 both ways.",
        AmpNumericsWarning, stacklevel=2)
    return True


@_torch_compat.assume_constant_result
def _refuse_unbound_site(recipe_name: str) -> bool:
    # Runs while Dynamo traces: the error reaches the caller of the compiled function.
    raise RuntimeError(
        f"{recipe_name} under torch.compile met a weight it has no site for: a compiled graph "
        f"cannot create one. Call recipe.bind(model) before the first compiled call (or run "
        f"one step eagerly first)."
    )


_torch_compat.keep_out_of_dynamo(globals(), __name__)
