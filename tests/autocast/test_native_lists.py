"""Differential tests against native autocast, driven by PyTorch's own autocast op lists.

``torch.testing._internal.autocast_test_lists`` holds the lists torch's test_autocast /
test_cuda run against native autocast. They are used here in two ways:

- CPU lists (``AutocastCPUTestLists``): every entry runs under native
  ``torch.autocast("cpu", dtype)`` and under ``dispatch_amp.autocast("cpu", dtype)``, for
  bfloat16 and float16; outputs must have the same dtypes and the same bits.
- CUDA lists (``AutocastTestLists`` built on CPU tensors): every entry runs under
  ``dispatch_amp.autocast("cpu", dtype, policy=Policy.for_device("cuda"))``; the output
  must have the list's dtype and equal the op run without autocast on inputs cast to that
  dtype (the "control" of torch's ``_run_autocast_outofplace``). Run for float16 and for
  bfloat16. Entries that cannot run on CPU at all are listed in ``CUDA_ONLY`` with their
  reason, and the test asserts that they do raise on CPU; nothing is skipped.
"""

from __future__ import annotations

import collections.abc

import pytest
import torch

import dispatch_amp
from dispatch_amp import Policy

# Every op in torch's autocast lists is called, deprecated ones included; torch's own
# warnings about those calls are expected here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*deprecated in favor of:UserWarning"),
    pytest.mark.filterwarnings("ignore:An output with one or more elements was resized:UserWarning"),
    pytest.mark.filterwarnings("ignore:A window was not provided:UserWarning"),
]


def _import_lists():
    import torch.backends

    # Importing torch's internal test utilities freezes torch.backends flags for the
    # whole process (common_utils calls disable_global_flags()); restore torch's default
    # so other test files in the same session can still set backend flags.
    globals_of_backends = torch.backends.flags_frozen.__globals__
    was = globals_of_backends["__allow_nonbracketed_mutation_flag"]
    from torch.testing._internal import autocast_test_lists

    globals_of_backends["__allow_nonbracketed_mutation_flag"] = was
    return autocast_test_lists


_lists = _import_lists()

_rng_state = torch.random.get_rng_state()
torch.manual_seed(0)
CPU_LISTS = _lists.AutocastCPUTestLists("cpu")
CUDA_LISTS = _lists.AutocastTestLists("cpu")
torch.random.set_rng_state(_rng_state)

CUDA_POLICY = Policy.for_device("cuda")
# Native's CPU table plus one op no list exercises (a custom op registered here), so the
# engine treats it as a policy of its own and native autocast never casts under it.
_LIBRARY = torch.library.Library("dispatch_amp_lists", "DEF")
_LIBRARY.define("unused(Tensor x) -> Tensor")
CPU_TABLE_AS_CUSTOM = Policy.for_device("cpu").with_ops(lower=["dispatch_amp_lists::unused"], name="cpu-as-custom")
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# -- helpers shared with torch's _run_autocast_outofplace ---------------------------------
def _cast(val, dtype):
    if isinstance(val, torch.Tensor):
        return val.to(dtype) if val.is_floating_point() else val
    if isinstance(val, str):
        return val
    if isinstance(val, collections.abc.Iterable):
        return type(val)(_cast(v, dtype) for v in val)
    return val


def _run_variants(op, args, kwargs, module):
    """Runs ``module.op`` and ``Tensor.op`` as torch's helper does; returns {variant: out}."""
    outs = {}
    if module is not None and hasattr(module, op):
        outs["module"] = getattr(module, op)(*args, **kwargs)
    if hasattr(torch.Tensor, op):
        outs["method"] = getattr(args[0], op)(*args[1:], **kwargs)
    assert outs, f"{op} is neither on {module} nor a Tensor method"
    return outs


def _run_control(op, args, kwargs, module, dtype):
    """The op without autocast on inputs cast to ``dtype`` (torch's "control")."""
    if module is not None and hasattr(module, op):
        return getattr(module, op)(*_cast(args, dtype), **kwargs)
    return getattr(args[0].to(dtype), op)(*_cast(args[1:], dtype), **kwargs)


def _assert_same(got, want, where=""):
    """Same type, dtypes and bits (NaN equal to NaN), recursing into tuples and lists."""
    assert type(got) is type(want), f"{where}: type {type(got)} != {type(want)}"
    if isinstance(got, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(got, (tuple, list)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _tensor_dtypes(out):
    if isinstance(out, torch.Tensor):
        return [out.dtype]
    if isinstance(out, (tuple, list)):
        return [d for o in out for d in _tensor_dtypes(o)]
    return []


def _ids(cases):
    """Readable unique ids: 'list:op:dtype', with '#k' for repeated ops in one list."""
    seen = collections.Counter()
    ids = []
    for c in cases:
        key = (c["list"], c["op"], c["dtype"])
        seen[key] += 1
        suffix = f"#{seen[key]}" if seen[key] > 1 else ""
        ids.append(f"{c['list']}:{c['op']}{suffix}:{_SHORT[c['dtype']]}")
    return ids


# -- CPU lists: ours against native torch.autocast("cpu") ---------------------------------
def _cpu_cases():
    L = CPU_LISTS
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        # (list name, module, run_as_type) as in torch's test_autocast.py (CPU part)
        for name, module, run_as in (
            ("torch_16", torch, dtype),
            ("nn_16", torch._C._nn, dtype),
            ("torch_fp32", torch, torch.float32),
            ("nn_fp32", torch._C._nn, torch.float32),
        ):
            for entry in getattr(L, name):
                op, args = entry[0], entry[1]
                kwargs = entry[2] if len(entry) > 2 else {}
                cases.append(dict(list=name, op=op, args=args, kwargs=kwargs, module=module,
                                  out_type=run_as, dtype=dtype))
        # (op, args_bf16, args_fp16): the fp16 run takes the second argument set.
        for op, args_bf16, args_fp16 in L.torch_need_autocast_promote:
            args = args_bf16 if dtype is torch.bfloat16 else args_fp16
            cases.append(dict(list="torch_need_autocast_promote", op=op, args=args, kwargs={},
                              module=torch, out_type=torch.float32, dtype=dtype))
        # (op, args_bf16, args_fp16, out_type)
        for name, module in (("torch_expect_builtin_promote", torch),
                             ("methods_expect_builtin_promote", None)):
            for op, args_bf16, args_fp16, out_type in getattr(L, name):
                args = args_bf16 if dtype is torch.bfloat16 else args_fp16
                cases.append(dict(list=name, op=op, args=args, kwargs={}, module=module,
                                  out_type=out_type, dtype=dtype))
    return cases


CPU_CASES = _cpu_cases()


def _requiring_grad(val):
    """Fresh leaf copies of the floating tensors in val, requiring grad."""
    if isinstance(val, torch.Tensor):
        return val.detach().clone().requires_grad_(True) if val.is_floating_point() else val
    if isinstance(val, (tuple, list)):
        return type(val)(_requiring_grad(v) for v in val)
    return val


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("case", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_list_matches_native(case, grad):
    """grad=True: inputs require grad, so autograd records the op and only our function
    level (above autograd) may cast, as native does."""
    op, args, kwargs, module, dtype = (case[k] for k in ("op", "args", "kwargs", "module", "dtype"))
    if grad:
        args = _requiring_grad(args)
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=dtype):
        native = _run_variants(op, args, kwargs, module)
    # The table as a policy of our own: native autocast is then switched off around every
    # call ("Note: torch sees our state as native state"), so the casts are ours alone.
    with dispatch_amp.autocast("cpu", dtype=dtype, policy=CPU_TABLE_AS_CUSTOM):
        assert torch.is_autocast_enabled("cpu")
        ours = _run_variants(op, args, kwargs, module)
    assert ours.keys() == native.keys()
    if grad:
        for variant, out in ours.items():
            assert getattr(out, "requires_grad", True) == getattr(native[variant], "requires_grad", True)
    for variant, want in native.items():
        # The list's expectation holds for native (guards the harness itself).
        for d in _tensor_dtypes(want):
            assert d == case["out_type"], f"native {variant} {op}: {d} != {case['out_type']}"
        _assert_same(ours[variant], want, f"{variant} {op}")


# -- CUDA lists: ours with the CUDA policy on CPU tensors, against the control -----------
# Entries that cannot run on a CPU at all. The test asserts each one raises on CPU
# without autocast, so the list stays honest if that ever changes.
CUDA_ONLY = {
    "cudnn_convolution": "cuDNN kernel: no CPU implementation",
    "cudnn_convolution_transpose": "cuDNN kernel: no CPU implementation",
}

# Entries whose arguments in torch's list are unusable as written, replaced here.
CUDA_ARGUMENT_FIXES = {
    # torch's entry is ("einsum", "bkhd,bqhd->bqkh", (mat0, mat1)): the equation wants
    # 4-D operands but the list gives 8x8 matrices, and test_cuda reads the third
    # element as its ROCm skip flag, so torch never runs it. Same matrices, 2-D equation.
    "einsum": lambda entry: ("ij,jk->ik",) + tuple(entry[2]),
}


def _cuda_cases():
    L = CUDA_LISTS
    cases = []
    for dtype in (torch.float16, torch.bfloat16):
        for name, module, run_as in (
            ("torch_fp16", torch, dtype),
            ("nn_fp16", torch._C._nn, dtype),
            ("linalg_fp16", torch._C._linalg, dtype),
            ("methods_fp16", None, dtype),
            ("torch_fp32", torch, torch.float32),
            ("nn_fp32", torch._C._nn, torch.float32),
            ("methods_fp32", None, torch.float32),
            ("torch_need_autocast_promote", torch, torch.float32),
        ):
            for entry in getattr(L, name):
                op = entry[0]
                if op in CUDA_ARGUMENT_FIXES:
                    args, kwargs = CUDA_ARGUMENT_FIXES[op](entry), {}
                else:
                    args = entry[1]
                    # a third element is kwargs (dict) or test_cuda's ROCm skip flag (bool)
                    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
                cases.append(dict(list=name, op=op, args=args, kwargs=kwargs, module=module,
                                  run_as=run_as, out_type=run_as, dtype=dtype))
        # (op, args, out_type): run as float32, output of out_type (bool for comparisons)
        for name, module in (("torch_expect_builtin_promote", torch),
                             ("methods_expect_builtin_promote", None)):
            for op, args, out_type in getattr(L, name):
                cases.append(dict(list=name, op=op, args=args, kwargs={}, module=module,
                                  run_as=torch.float32, out_type=out_type, dtype=dtype))
    return cases


CUDA_CASES = _cuda_cases()


def _native_promote_raises(args, low) -> bool:
    """Native's promote rule (``prioritize`` in ATen's autocast_mode.h), stated on its own:
    from the region's dtype, each floating argument in order (float64 skipped) gives
    float32 if either is float32, keeps the dtype if both are it, and raises otherwise."""
    current = low
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.dtype == torch.float64:
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif t.dtype != current:
                return True
    return False


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("case", CUDA_CASES, ids=_ids(CUDA_CASES))
def test_cuda_list_under_cuda_policy(case, grad):
    op, args, kwargs, module, dtype = (case[k] for k in ("op", "args", "kwargs", "module", "dtype"))
    if grad:
        args = _requiring_grad(args)
    if op in CUDA_ONLY:
        with pytest.raises((RuntimeError, NotImplementedError)):
            _run_variants(op, args, kwargs, module)
        return
    if case["list"] == "torch_need_autocast_promote" and _native_promote_raises(args, dtype):
        # torch's own tests run this list in float16 only: in a bfloat16 region its
        # float16 inputs make native's promote raise, and ours raises as native does.
        with dispatch_amp.autocast("cpu", dtype=dtype, policy=CUDA_POLICY):
            with pytest.raises(RuntimeError, match="promotes among the region's dtype"):
                _run_variants(op, args, kwargs, module)
        return
    with dispatch_amp.autocast("cpu", dtype=dtype, policy=CUDA_POLICY):
        ours = _run_variants(op, args, kwargs, module)
    control = _run_control(op, args, kwargs, module, case["run_as"])
    for variant, got in ours.items():
        for d in _tensor_dtypes(got):
            assert d == case["out_type"], f"{variant} {op}: dtype {d}, expected {case['out_type']}"
        _assert_same(got, control, f"{variant} {op}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("entry", CUDA_LISTS.banned, ids=[e[0] for e in CUDA_LISTS.banned])
def test_cuda_list_banned(entry, dtype):
    op, args, module = entry
    with dispatch_amp.autocast("cpu", dtype=dtype, policy=CUDA_POLICY):
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            getattr(module, op)(*args)
    # the same call is fine outside autocast and under the CPU policy
    getattr(module, op)(*args)


def test_cuda_only_table_is_current():
    """Every CUDA_ONLY / CUDA_ARGUMENT_FIXES name is still in torch's lists."""
    names = {e[0] for n in ("torch_fp16", "torch_fp32", "nn_fp16", "nn_fp32", "linalg_fp16",
                            "torch_need_autocast_promote") for e in getattr(CUDA_LISTS, n)}
    assert set(CUDA_ONLY) <= names
    assert set(CUDA_ARGUMENT_FIXES) <= names
