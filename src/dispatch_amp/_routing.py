"""How the engine handles each call under one policy: the rules turned into routes.

A ``Policy`` holds rules only (op name -> ``CastKind``). The engine needs more per call:
whether a callable seen by the function level is an op with a kind, a tensor attribute
getter, a torch Python composite to expand, or an op to decompose (``composites.py``);
and the kind of each aten overload seen by the aten level. ``Routes`` works that out
once per callable and memoizes it; :func:`routes_for` keeps one ``Routes`` per distinct
policy, so the hot path is one dict read.
"""

from __future__ import annotations

import types
from enum import Enum

from torch._ops import OpOverload, OpOverloadPacket

from . import _torch_compat
from .composites import DECOMPOSITIONS
from .op_tables import CastKind
from .policy import BUILTIN_DEVICES, Policy

__all__ = ["Route", "Routes", "routes_for", "clone_without_dispatch_check"]


class Route(Enum):
    """Function-level routes that are not a cast kind."""

    # A tensor attribute getter/setter (t.shape, t.grad...): run as given, no bookkeeping.
    GETTER = "getter"
    # A Python composite from torch whose body must run with the function level still
    # active (see _engine._FunctionLevel._expand).
    EXPAND = "expand"


GETTER = Route.GETTER
EXPAND = Route.EXPAND

# The RNN layers that reach cuDNN's _cudnn_rnn on CUDA (see Routes.__init__).
_CUDNN_RNN_FUNCTIONS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})

# Python-level names whose aten op is spelled differently.
_FUNCTION_ALIASES = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__rpow__": "pow",
    "cross_entropy": "cross_entropy_loss",
}


def is_torch_python_function(obj) -> bool:
    """Whether ``obj`` is a plain Python function defined in torch (an empty closure
    cell, which raises on access, is not)."""
    try:
        return isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith("torch")
    except ValueError:
        return False


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and lambdas
            names |= _names_used(const)
    return names


class Routes:
    """The routes of one policy's rules, memoized per callable and per aten overload.

    ``function[func]`` / :meth:`function_route`: for the function level, a ``CastKind``,
    ``None`` (run as given), a :class:`Route`, or a decomposition from ``composites.py``.
    ``aten[func]`` / :meth:`aten_kind`: for the aten level, a ``CastKind`` or ``None``.

    Example::

        >>> import torch
        >>> routes = routes_for(Policy.for_device("cpu"))
        >>> routes.function_route(torch.mm), routes.aten_kind(torch.ops.aten.mm.out)
        ('lower', None)
    """

    __slots__ = ("rules", "function", "aten", "left_to_native")

    def __init__(self, policy: Policy):
        self.rules = policy.rules
        # Under the built-in CUDA policy native autocast stays on below us, and its
        # _cudnn_rnn wrapper casts an RNN's weights into a fresh float16 flat buffer (float16
        # whatever the region's dtype). Casting the call first would round the weights to
        # the region's dtype before that (bfloat16 then float16: not native's bits, measured
        # on an H100), so these calls are left to native whole.
        builtin_cuda = "cuda" in BUILTIN_DEVICES and policy._key == Policy.for_device("cuda")._key
        self.left_to_native = _CUDNN_RNN_FUNCTIONS if builtin_cuda else frozenset()
        # Filled on first sight of a callable / overload; the rules never change, so the
        # memos never need invalidating.
        self.function: dict = {}
        self.aten: dict = {}

    def function_route(self, func):
        """How the function level handles ``func`` (memoized when ``func`` is hashable)."""
        try:
            return self.function[func]
        except KeyError:
            pass
        except TypeError:  # unhashable callable: resolve every time
            return self._resolve_function(func)
        route = self.function[func] = self._resolve_function(func)
        return route

    def aten_kind(self, func: OpOverload) -> CastKind | None:
        """The cast kind of an aten overload seen by the aten level (memoized)."""
        try:
            return self.aten[func]
        except KeyError:
            kind = self.aten[func] = self._resolve_overload(func)
            return kind

    def _resolve_function(self, func):
        if isinstance(func, OpOverload):
            return self._resolve_overload(func)
        if isinstance(func, OpOverloadPacket):
            return self.rules.get(func._qualified_op_name)
        name = getattr(func, "__name__", None)
        if name == "__get__" or name == "__set__":
            return GETTER
        if isinstance(name, str):
            name = _FUNCTION_ALIASES.get(name, name)
            if name in self.left_to_native:
                return None
            kind = self.rules.get("aten::" + name)
            if kind is not None:
                return kind
            # An op in no table whose inside native casts: run our Python version of it
            # (a callable in place of a kind, see composites.py).
            decomposition = DECOMPOSITIONS.get(name)
            if decomposition is not None:
                return decomposition
        if is_torch_python_function(func) and self._may_reach_a_rule(func, set()):
            return EXPAND
        return None

    def _may_reach_a_rule(self, func: types.FunctionType, seen: set) -> bool:
        """Whether a torch Python function may call an op these rules cast.

        Expanding costs a mode re-entry per call, so thin wrappers (F.relu, F.dropout,
        F.batch_norm) whose code names no op of the policy run whole instead. The check
        reads every name the code uses (attribute names included), follows the torch
        Python functions it names or holds in its closure, and answers True whenever in
        doubt, so it can only err towards expanding.
        """
        if func in seen:
            return False
        seen.add(func)
        for name in _names_used(func.__code__):
            name = _FUNCTION_ALIASES.get(name, name)
            if "aten::" + name in self.rules or name in DECOMPOSITIONS:
                return True
            target = func.__globals__.get(name)
            if is_torch_python_function(target) and self._may_reach_a_rule(target, seen):
                return True
        for cell in func.__closure__ or ():
            try:
                target = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if is_torch_python_function(target) and self._may_reach_a_rule(target, seen):
                return True
            if callable(target) and not is_torch_python_function(target):
                return True  # an unknown callable: assume the worst
        return False

    def _resolve_overload(self, func: OpOverload) -> CastKind | None:
        # out= and in-place overloads share the packet of the functional op; native
        # autocast never casts them, so neither do we.
        schema = func._schema
        if func._overloadname == "out" or any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
        ):
            return None
        return self.rules.get(func.overloadpacket._qualified_op_name)


# Policies are values: equal policies (equal rule keys) share their routes.
_ROUTES: dict[str, Routes] = {}


def routes_for(policy: Policy) -> Routes:
    """The (shared, memoized) routes of ``policy``.

    Kept on the policy after the first call: an ``autocast`` built inside a function
    torch.compile traces reads an attribute, and hashes nothing.

    Example::

        >>> routes_for(Policy.for_device("cpu")) is routes_for(Policy.for_device("cpu"))
        True
    """
    routes = policy._routes
    if routes is None:
        routes = _ROUTES.get(policy._key)
        if routes is None:
            routes = _ROUTES[policy._key] = Routes(policy)
        policy._routes = routes
    return routes


# The built-in policies' routes exist before any region is opened, traced ones included.
for _device_type in BUILTIN_DEVICES:
    routes_for(Policy.for_device(_device_type))
del _device_type


# -- running a composite with the function level active ------------------------------
def _never(*args, **kwargs) -> bool:
    return False


_CLONES: dict = {}
_CLONING: set = set()


def clone_without_dispatch_check(func: types.FunctionType) -> types.FunctionType:
    """A copy of a torch Python composite whose ``has_torch_function*`` checks say False.

    Torch's Python functions start with ``if has_torch_function(...): return
    handle_torch_function(...)``, which sends them to our mode instead of running their
    body. The copy shares the code and closure but reads those three names from a
    private globals dict, so its body runs with our mode active and every call inside it
    is seen. Nothing in torch is modified.
    """
    clone = _CLONES.get(func)
    if clone is None:
        scope = dict(func.__globals__)
        scope["has_torch_function"] = _never
        scope["has_torch_function_unary"] = _never
        scope["has_torch_function_variadic"] = _never
        closure = func.__closure__
        if closure:
            # Wrappers such as torch's boolean_dispatch (torch.lu, F.max_pool2d) hold the
            # real function in their closure; it checks again, so it is cloned too
            # (except a cell holding a function being cloned: wrappers refer to themselves).
            _CLONING.add(func)
            try:
                closure = tuple(
                    types.CellType(clone_without_dispatch_check(cell.cell_contents))
                    if is_torch_python_function(cell.cell_contents)
                    and cell.cell_contents not in _CLONING
                    else cell
                    for cell in closure
                )
            finally:
                _CLONING.discard(func)
        clone = types.FunctionType(
            func.__code__, scope, func.__name__, func.__defaults__, closure
        )
        clone.__kwdefaults__ = func.__kwdefaults__
        _CLONES[func] = clone
    return clone


_torch_compat.keep_out_of_dynamo(globals(), __name__)
