"""``dispatch_amp.autocast("cuda")`` against ``torch.autocast("cuda")`` on real CUDA tensors.

On CPU-only machines the CUDA policy is checked on CPU tensors against the dtypes written
from native's lists; here native itself is the reference, bit for bit:

- every AutocastCUDA registration that ``tests/autocast/test_native_registrations.py``
  reaches with a call, in float16 and bfloat16, without and with gradients;
- every model, loss and composite case of ``tests/autocast/test_models.py`` (outputs, loss,
  every parameter gradient), in float16 and bfloat16;
- the Hugging Face models of ``tests/autocast/test_transformers_models.py``, plain and checkpointed;
- torch.compile with inductor under the built-in policy (against native compiled) and
  under a custom policy (against ours eager);
- the opt levels O1 to O3 in float16, and the fp8 linear (cuBLAS fp8 gemms, Triton casts).

Where a native kernel is itself nondeterministic on CUDA (two identical native calls
differ), ours is compared within that spread instead of bitwise; the test measures it.
The cases are taken from the CPU test files, loaded by path (tests are not a package),
and their CPU tensors are moved to the GPU by :class:`OnCuda` as they are used.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import dispatch_amp as amp
from dispatch_amp.kernels import fp8_quantize

TESTS = pathlib.Path(__file__).resolve().parents[1]
LOW = [torch.float16, torch.bfloat16]


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


REG = _load(TESTS / "autocast" / "test_native_registrations.py", "_cuda_lane_registrations")
MODELS = _load(TESTS / "autocast" / "test_models.py", "_cuda_lane_models")


def to_cuda(val):
    """``val`` with every tensor in it (tuples, lists, dicts) moved to the GPU, grad flags kept."""
    if isinstance(val, torch.Tensor):
        if val.device.type == "cuda":
            return val
        moved = val.detach().to("cuda")
        return moved.requires_grad_(val.requires_grad) if val.is_leaf else moved
    if isinstance(val, tuple) and hasattr(val, "_fields"):
        return type(val)(*(to_cuda(v) for v in val))
    if isinstance(val, (tuple, list)):
        return type(val)(to_cuda(v) for v in val)
    if isinstance(val, dict):
        return {k: to_cuda(v) for k, v in val.items()}
    return val


class OnCuda(TorchFunctionMode):
    """Moves CPU tensor arguments to the GPU at each torch call.

    The CPU test cases keep their inputs in closures; entered *inside* the autocast region
    (so above it on the mode stack), this hands both autocasts CUDA tensors only, moved
    once each (a moved copy is reused for the same CPU tensor).
    """

    def __init__(self):
        super().__init__()
        self._moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _move(self, val):
        if isinstance(val, torch.Tensor) and val.device.type == "cpu" and not isinstance(val, torch.nn.Parameter):
            hit = self._moved.get(id(val))
            if hit is None or hit[0] is not val:
                hit = (val, val.to("cuda"))
                self._moved[id(val)] = hit
            return hit[1]
        if isinstance(val, (tuple, list)) and not hasattr(val, "_fields"):
            return type(val)(self._move(v) for v in val)
        return val

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*self._move(tuple(args)), **{k: self._move(v) for k, v in (kwargs or {}).items()})


def _same_or_within_spread(got, want, again, where):
    """Bitwise equal to native, or (native differing from itself) within native's spread."""
    got_t = [t for t in REG._iter_tensors(got)]
    want_t = [t for t in REG._iter_tensors(want)]
    again_t = [t for t in REG._iter_tensors(again)]
    assert len(got_t) == len(want_t), where
    for i, (g, w, a) in enumerate(zip(got_t, want_t, again_t)):
        assert g.dtype == w.dtype, f"{where}[{i}]: dtype {g.dtype}, native {w.dtype}"
        if any(w.names):  # named tensors: same names, then compared without them
            assert g.names == w.names, f"{where}[{i}]: names {g.names}, native {w.names}"
            g, w, a = g.rename(None), w.rename(None), a.rename(None)
        if torch.equal(w.nan_to_num(), a.nan_to_num()):  # native deterministic here
            REG._assert_same(g, w, f"{where}[{i}]")
        else:
            spread = (w.double() - a.double()).abs().max().item()
            diff = (g.double() - w.double()).abs().max().item()
            assert diff <= 4 * spread, f"{where}[{i}]: |ours - native| {diff} over native's own spread {spread}"


# -- every AutocastCUDA registration ----------------------------------------------------------
CUDA_CALLS = sorted(n for n in REG.CUDA_REGISTERED if n in REG.CALLS)


def _native_and_ours(fn, args, kwargs, dtype, grad):
    results = []
    for region in (lambda: torch.autocast("cuda", dtype=dtype), lambda: torch.autocast("cuda", dtype=dtype),
                   lambda: amp.autocast("cuda", dtype=dtype)):
        a, k = to_cuda(args), to_cuda(kwargs)
        with region():
            out = REG._run(fn, a, k)
        grads = None
        if grad:
            leaves = [t for t in REG._iter_tensors((a, k)) if t.requires_grad]
            first = next((t for t in REG._iter_tensors(out) if t.requires_grad), None)
            if first is not None and leaves:
                grads = torch.autograd.grad(first.float().sum(), leaves, allow_unused=True)
                grads = [g for g in grads if g is not None]
        results.append((out, grads))
    return results


@pytest.mark.parametrize("grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", CUDA_CALLS)
def test_registration_matches_native_cuda(name, dtype, grad):
    fn, args, kwargs = REG._make(name, dtype, grad)
    if REG.NATIVE_CUDA_KIND.get(name) == "banned":
        for region in (torch.autocast, amp.autocast):
            with region("cuda", dtype=dtype), pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
                REG._run(fn, to_cuda(args), to_cuda(kwargs))
        return
    (native, n_grads), (again, a_grads), (ours, o_grads) = _native_and_ours(fn, args, kwargs, dtype, grad)
    _same_or_within_spread(ours, native, again, name)
    if grad and n_grads is not None:
        _same_or_within_spread(o_grads, n_grads, a_grads, f"{name} grads")


# -- models, losses and composite ops ----------------------------------------------------------
def _run_case(make, region):
    module, step = make()
    module = module.cuda()
    with region, OnCuda():
        outputs, loss = step(module)
    loss.backward()
    return outputs, loss, {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(MODELS.ALL_CASES) + sorted(MODELS.CUDA_POLICY_ONLY_CASES))
def test_model_case_matches_native_cuda(name, dtype):
    make = {**MODELS.ALL_CASES, **MODELS.CUDA_POLICY_ONLY_CASES}[name]
    if name == "loss_binary_cross_entropy":  # banned on CUDA, natively and by ours
        for region in (torch.autocast, amp.autocast):
            with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
                _run_case(make, region("cuda", dtype=dtype))
        return
    want = _run_case(make, torch.autocast("cuda", dtype=dtype))
    again = _run_case(make, torch.autocast("cuda", dtype=dtype))
    got = _run_case(make, amp.autocast("cuda", dtype=dtype))
    assert [o.dtype for o in got[0]] == [o.dtype for o in want[0]]
    assert got[2].keys() == want[2].keys()
    for p_name in got[2]:
        assert got[2][p_name] is not None and got[2][p_name].dtype == want[2][p_name].dtype, p_name
    _same_or_within_spread(list(got[0]) + [got[1]], list(want[0]) + [want[1]], list(again[0]) + [again[1]], f"{name} outputs")
    _same_or_within_spread(list(got[2].values()), list(want[2].values()), list(again[2].values()), f"{name} grads")


# -- cross entropy, every form -------------------------------------------------------------------
CROSS_ENTROPY = {
    "plain": {},
    "label-smoothing": {"label_smoothing": 0.1},
    "weight": {"weight": True},
    "weight-label-smoothing": {"weight": True, "label_smoothing": 0.2},
    "ignore-index-label-smoothing": {"ignore_index": 3, "label_smoothing": 0.1},
    "sum": {"reduction": "sum"},
    "none-label-smoothing": {"reduction": "none", "label_smoothing": 0.1},
    "probabilities": {"probs": True},
    "probabilities-label-smoothing-weight": {"probs": True, "label_smoothing": 0.1, "weight": True},
    "4d": {"spatial": True},
    "3d-label-smoothing": {"spatial1d": True, "label_smoothing": 0.1},
}


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("form", sorted(CROSS_ENTROPY))
def test_cross_entropy_matches_native_cuda(form, dtype):
    # Native leaves cross_entropy to its C++ composite (log_softmax keeps the low dtype,
    # nll_loss and the sums run in float32); ours rebuilds it from the same calls.
    opts = dict(CROSS_ENTROPY[form])
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (6, 10, 3, 4) if opts.pop("spatial", False) else (6, 10, 5) if opts.pop("spatial1d", False) else (6, 10)
    lin = torch.nn.Linear(shape[1], shape[1]).cuda()
    x = torch.randn(*shape, device="cuda", generator=g)
    if opts.pop("probs", False):
        target = torch.softmax(torch.randn(*shape, device="cuda", generator=g), 1)
    else:
        target = torch.randint(0, shape[1], (shape[0], *shape[2:]), device="cuda", generator=g)
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(shape[1], device="cuda", generator=g)

    def run(region):
        lin.zero_grad()
        with region:
            logits = lin(x.movedim(1, -1)).movedim(-1, 1)
            loss = F.cross_entropy(logits, target, **opts)
        loss.float().sum().backward()
        return [loss, lin.weight.grad.clone(), lin.bias.grad.clone()]

    want, again = run(torch.autocast("cuda", dtype=dtype)), run(torch.autocast("cuda", dtype=dtype))
    got = run(amp.autocast("cuda", dtype=dtype))
    _same_or_within_spread(got, want, again, f"cross_entropy {form}")


# -- Hugging Face models ------------------------------------------------------------------------
def _hf_models():
    pytest.importorskip("transformers")
    # loaded once: the module defines a torch.library namespace, which may exist only once
    module = sys.modules.get("_cuda_lane_hf") or _load(TESTS / "autocast" / "test_transformers_models.py", "_cuda_lane_hf")
    return module.MODELS


def _hf_step(build, region, checkpointing):
    torch.manual_seed(0)
    model = build().train().cuda()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    with region:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits, out.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("model", ["gpt2-upcast-attn", "llama", "bert", "ernie4_5-moe"])
def test_hugging_face_training_step_matches_native_cuda(model, checkpointing):
    build = _hf_models()[model]
    want = _hf_step(build, torch.autocast("cuda"), checkpointing)
    again = _hf_step(build, torch.autocast("cuda"), checkpointing)
    got = _hf_step(build, amp.autocast("cuda"), checkpointing)
    assert got[0].dtype == want[0].dtype and got[2].keys() == want[2].keys() and got[2]
    _same_or_within_spread([got[0], got[1]], [want[0], want[1]], [again[0], again[1]], f"{model} logits/loss")
    _same_or_within_spread(list(got[2].values()), list(want[2].values()), list(again[2].values()), f"{model} grads")


# -- torch.compile (inductor) ---------------------------------------------------------------------
def _gpt():
    torch.manual_seed(0)
    cfg = MODELS.M.GPTConfig(vocab=512, d_model=128, n_heads=4, n_blocks=2)
    model = MODELS.M.GPT(cfg).cuda()
    idx, tgt = MODELS.M.gpt_batch(cfg, 4, 64)
    return model, idx.cuda(), tgt.cuda(), cfg


def _compiled_step(model, idx, tgt, cfg, region):
    def step(idx, tgt):
        with region():
            logits = model(idx)
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1)), logits

    compiled = torch.compile(step, backend="inductor")
    loss, logits = compiled(idx, tgt)
    loss.backward()
    return loss, logits, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_compiled_under_the_builtin_policy_matches_native_compiled(dtype):
    model, idx, tgt, cfg = _gpt()
    runs = []
    for region in (lambda: torch.autocast("cuda", dtype=dtype), lambda: torch.autocast("cuda", dtype=dtype),
                   lambda: amp.autocast("cuda", dtype=dtype)):
        torch._dynamo.reset()
        runs.append(_compiled_step(copy.deepcopy(model), idx, tgt, cfg, region))
    (want, again, got) = runs
    assert got[1].dtype == want[1].dtype == dtype
    # The forward is bitwise native's; the backward's index_put into the embedding adds
    # with atomics, so there native differs from itself and ours is held to that spread.
    _same_or_within_spread([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], [again[0], again[1], *again[2]], "compiled")


def test_compiled_under_a_custom_policy_matches_ours_eager():
    policy = amp.Policy.for_device("cuda").with_ops(fp32=["linear", "addmm", "mm"], lower=["softmax"])
    torch._dynamo.reset()
    model, idx, tgt, cfg = _gpt()
    twin = copy.deepcopy(model)
    got = _compiled_step(model, idx, tgt, cfg, lambda: amp.autocast("cuda", policy=policy))
    with amp.autocast("cuda", policy=policy):
        logits = twin(idx)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))
    loss.backward()
    assert got[1].dtype == logits.dtype == torch.float32  # the policy's float32 linears
    torch.testing.assert_close(got[0], loss, rtol=1e-4, atol=1e-4)
    for a, p in zip(got[2], twin.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=2e-3, atol=2e-4)


# -- opt levels in float16 ------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10)).cuda()


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_opt_levels_train_in_float16(opt_level):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16)
    g = torch.Generator(device="cuda").manual_seed(1)
    x, y = torch.randn(256, 64, device="cuda", generator=g), torch.randint(0, 10, (256,), device="cuda", generator=g)
    losses = []
    for step in range(30):
        overflow = step == 5 and opt_level != "O3"  # O3 has no loss scale to skip a step
        xs = x * float("inf") if overflow else x
        before = [p.detach().clone() for p in amp.master_params(opt)] if overflow else None
        loss = F.cross_entropy(model(xs).float(), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        if before is not None:  # the overflow step changed nothing
            assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
        else:
            losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0], losses
    low = {p.dtype for p in model.parameters()}
    assert low == ({torch.float32} if opt_level == "O1" else {torch.float16, torch.float32} if opt_level == "O2" else {torch.float16})


# -- fp8 (cuBLAS fp8 gemms, Triton casts) ------------------------------------------------------------
FP8_RECIPES = {
    "current": lambda fp8: fp8.CurrentScaling(),
    "delayed": lambda fp8: fp8.DelayedScaling(amax_history_len=4),
    "rowwise": lambda fp8: fp8.RowwiseScaling(),
}


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("recipe_name", sorted(FP8_RECIPES))
def test_fp8_linear_on_cuda_against_the_oracle(recipe_name, bias):
    if not _fp8_capable():
        pytest.skip("fp8 gemms need compute capability 8.9 or newer")
    from dispatch_amp import fp8

    oracle = _load(TESTS / "fp8" / "_oracle.py", "_cuda_lane_fp8_oracle")
    linear_tests = _load(TESTS / "fp8" / "test_linear.py", "_cuda_lane_fp8_linear")
    recipe = FP8_RECIPES[recipe_name](fp8)
    site = oracle.DelayedSite(4) if isinstance(recipe, fp8.DelayedScaling) else None
    x, w, b, dy = (None if t is None else to_cuda(t) for t in linear_tests._inputs((4, 64, 128), 256, torch.bfloat16, bias))
    assert fp8._rules.kernels_in_use(x), "the Triton cast kernels run on CUDA"
    for step in range(3 if site else 1):
        got = linear_tests._run(amp.autocast("cuda", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy * (step + 1))
        want = linear_tests._expected(oracle, recipe, x, w, b, dy * (step + 1), torch.bfloat16, site)
        for name, g, e in zip(("y", "dx", "dw", "db"), got, want):
            if e is None:
                continue
            assert g.dtype == e.dtype, name
            # cuBLAS accumulates in float32 in its own order: one bfloat16 rounding apart at most
            torch.testing.assert_close(g.float(), e.float(), rtol=2**-7, atol=1e-3 * e.float().abs().max().item(),
                                       msg=lambda m: f"{recipe_name} step {step} {name}: {m}")


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_fp8_triton_casts_equal_the_torch_casts_on_cuda(monkeypatch, recipe_name):
    if not _fp8_capable():
        pytest.skip("fp8 gemms need compute capability 8.9 or newer")
    from dispatch_amp import fp8

    linear_tests = _load(TESTS / "fp8" / "test_linear.py", "_cuda_lane_fp8_linear")

    def run(backend):
        monkeypatch.setattr(fp8_quantize, "BACKEND", backend)
        recipe = FP8_RECIPES[recipe_name](fp8)
        x, w, b, dy = (to_cuda(t) for t in linear_tests._inputs((4, 64, 128), 256, torch.bfloat16, True))
        return [linear_tests._run(amp.autocast("cuda", dtype=torch.bfloat16, fp8=recipe), x, w, b, dy * (s + 1)) for s in range(2)]

    torch_path, triton_path = run("torch"), run("triton")
    for got_step, want_step in zip(triton_path, torch_path):
        for name, g, e in zip(("y", "dx", "dw", "db"), got_step, want_step):
            linear_tests._assert_bits(g, e, name)
