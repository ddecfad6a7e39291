"""Whole models and composite ops, ours against native ``torch.autocast("cpu")``.

Each case builds a module and inputs from a fixed seed, deep-copies the module, runs the
forward pass and the loss inside ``dispatch_amp.autocast("cpu")`` (bf16) for one copy and
inside ``torch.autocast("cpu")`` for the other, calls ``backward()`` OUTSIDE the context,
and compares: the dtype of every output the case reports, the loss, and every parameter
gradient (dtype equal to its parameter's, value equal to native's bit for bit).

The same cases also run under the CUDA policy on CPU tensors; there is no native
reference for that on a CPU-only machine, so those checks are: forward and backward run,
gradients are finite and have their parameter's dtype.

The models live in ``benchmarks/models.py`` (shared with the benchmark).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dispatch_amp

from benchmarks import models as M

BF16 = torch.bfloat16


def ours():
    return dispatch_amp.autocast("cpu")


def native():
    return torch.autocast("cpu")


def ours_cuda_policy():
    return dispatch_amp.autocast(
        "cpu", dtype=BF16, policy=dispatch_amp.Policy.for_device("cuda")
    )


# -- running and comparing ------------------------------------------------------------------
def run(module: nn.Module, step, ctx):
    """Forward + loss inside ``ctx``, backward outside. Returns (outputs, loss, grads)."""
    with ctx:
        outputs, loss = step(module)
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    return outputs, loss, grads


def run_pair(make):
    """Runs a case under ours and native on identical copies of one module."""
    module, step = make()
    a, b = copy.deepcopy(module), copy.deepcopy(module)
    return run(a, step, ours()), run(b, step, native()), a


# Per-dtype relative tolerance for values computed in that dtype (one rounding of the
# dtype's epsilon is 2**-8 = 3.9e-3 for bf16; 1.6e-2 leaves room for a few roundings).
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1.3e-6}


def assert_close_reduced(got, want, dtype, n_terms=1):
    """Within ``dtype`` tolerance, scaled for a reduction over ``n_terms`` rounded terms.

    Rounding errors of a sum of n terms grow like sqrt(n) relative to the largest term,
    so the absolute tolerance is rtol * sqrt(n) * max|want|.
    """
    assert got.dtype == want.dtype
    rtol = RTOL[dtype]
    scale = want.detach().abs().max().clamp_min(1e-12).item()
    torch.testing.assert_close(
        got, want, rtol=rtol, atol=rtol * max(1.0, n_terms**0.5) * scale
    )


def check_pair(make, *, exact=True, tol_dtype=BF16, n_terms=1):
    (out_a, loss_a, g_a), (out_b, loss_b, g_b), module = run_pair(make)
    # Output dtypes, one by one.
    dtypes_a, dtypes_b = [o.dtype for o in out_a], [o.dtype for o in out_b]
    assert dtypes_a == dtypes_b, f"output dtypes: ours {dtypes_a}, native {dtypes_b}"
    assert loss_a.dtype == loss_b.dtype, f"loss dtype: ours {loss_a.dtype}, native {loss_b.dtype}"
    # Every parameter got a gradient of its own dtype.
    params = dict(module.named_parameters())
    assert g_a.keys() == g_b.keys()
    for name, g in g_a.items():
        assert g is not None, name
        assert g_b[name] is not None, name
        assert g.dtype == params[name].dtype, name
    if exact:
        for o_a, o_b in zip(out_a, out_b):
            assert torch.equal(o_a, o_b)
        assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
        for name in g_a:
            assert torch.equal(g_a[name], g_b[name]), (
                name, (g_a[name] - g_b[name]).abs().max().item()
            )
    else:
        assert_close_reduced(loss_a, loss_b, tol_dtype, n_terms)
        for name in g_a:
            assert_close_reduced(g_a[name], g_b[name], tol_dtype, n_terms)


def check_cuda_policy(make):
    module, step = make()
    outputs, loss, grads = run(module, step, ours_cuda_policy())
    assert torch.isfinite(loss).all()
    for name, p in module.named_parameters():
        g = grads[name]
        assert g is not None, name
        assert g.dtype == p.dtype, name
        assert torch.isfinite(g).all(), name


# -- models ------------------------------------------------------------------------------------
def make_gpt(need_weights=False, batch=2, seq=16, seed=0):
    def make():
        torch.manual_seed(seed)
        cfg = M.GPTConfig(vocab=128, d_model=64, n_heads=4, n_blocks=2, need_weights=need_weights)
        model = M.GPT(cfg)
        idx, tgt = M.gpt_batch(cfg, batch, seq)

        def step(m):
            logits = m(idx)
            return (logits,), F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))

        return model, step

    return make


def make_cnn():
    torch.manual_seed(1)
    model = M.CNN(channels=3, classes=10, width=8, size=16)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))

    def step(m):
        out = m(x)
        return (out,), F.cross_entropy(out, y)

    return model, step


def make_tagger(cell):
    def make():
        torch.manual_seed(2)
        model = M.RNNTagger(vocab=50, emb=16, hidden=24, tags=7, cell=cell)
        idx, tags = torch.randint(0, 50, (3, 11)), torch.randint(0, 7, (3, 11))

        def step(m):
            h, state = m.rnn(m.emb(idx))
            states = state if isinstance(state, tuple) else (state,)
            out = m.out(h)
            return (h, *states, out), F.cross_entropy(out.reshape(-1, 7), tags.reshape(-1))

        return model, step

    return make


def make_encoder(norm_first):
    def make():
        torch.manual_seed(3)
        model = M.EncoderClassifier(d_in=12, d_model=32, heads=4, classes=5, norm_first=norm_first)
        model.train()
        x, y = torch.randn(3, 9, 12), torch.randint(0, 5, (3,))

        def step(m):
            out = m(x)
            return (out,), F.cross_entropy(out, y)

        return model, step

    return make


class SDPA(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x, is_causal):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return a, self.out(a.transpose(1, 2).reshape(b, t, d))


def make_sdpa(is_causal):
    def make():
        torch.manual_seed(4)
        model = SDPA()
        x = torch.randn(2, 10, 32)

        def step(m):
            a, out = m(x, is_causal)
            return (a, out), out.float().pow(2).mean()

        return model, step

    return make


MODEL_CASES = {
    "gpt": make_gpt(need_weights=False),
    "gpt_need_weights": make_gpt(need_weights=True),
    "cnn": make_cnn,
    "lstm_tagger": make_tagger("lstm"),
    "gru_tagger": make_tagger("gru"),
    "rnn_tanh_tagger": make_tagger("rnn"),
    "encoder_post_norm": make_encoder(False),
    "encoder_pre_norm": make_encoder(True),
    "sdpa": make_sdpa(False),
    "sdpa_causal": make_sdpa(True),
}


# -- composite losses on a Linear's output ----------------------------------------------------
N, C = 6, 8


def _loss_case(loss_fn, out_features=C, in_features=5, seed=5):
    """A Linear(in, out) inside the context feeding ``loss_fn(out) -> (outputs, loss)``."""

    def make():
        torch.manual_seed(seed)
        model = nn.Linear(in_features, out_features)
        x = torch.randn(N, in_features)

        def step(m):
            out = m(x)
            extra, loss = loss_fn(out)
            return (out, *extra), loss

        return model, step

    return make


def _targets():
    g = torch.Generator().manual_seed(11)
    real = torch.randn(N, C, generator=g)
    sign = torch.randint(0, 2, (N, C), generator=g).float() * 2 - 1
    sign_n = torch.randint(0, 2, (N,), generator=g).float() * 2 - 1
    prob = torch.rand(N, C, generator=g)
    dist = torch.softmax(torch.randn(N, C, generator=g), -1)
    cls = torch.randint(0, C, (N,), generator=g)
    counts = torch.poisson(torch.rand(N, C, generator=g) * 3)
    var = torch.rand(N, C, generator=g) + 0.1
    multilabel = torch.full((N, C), -1, dtype=torch.long)
    multilabel[:, 0] = cls
    multilabel[:, 1] = (cls + 3) % C
    return dict(real=real, sign=sign, sign_n=sign_n, prob=prob, dist=dist, cls=cls,
                counts=counts, var=var, multilabel=multilabel)


T = _targets()
H = C // 2


def _one(loss):
    return (), loss


LOSS_CASES = {
    "l1_loss": lambda o: _one(F.l1_loss(o, T["real"])),
    "mse_loss": lambda o: _one(F.mse_loss(o, T["real"])),
    "smooth_l1_loss": lambda o: _one(F.smooth_l1_loss(o, T["real"], beta=0.5)),
    "huber_loss": lambda o: _one(F.huber_loss(o, T["real"], delta=0.7)),
    "kl_div": lambda o: _one(F.kl_div(F.log_softmax(o, -1), T["dist"], reduction="batchmean")),
    "kl_div_log_target": lambda o: _one(
        F.kl_div(F.log_softmax(o, -1), T["dist"].log(), reduction="batchmean", log_target=True)
    ),
    "hinge_embedding_loss": lambda o: _one(F.hinge_embedding_loss(o, T["sign"], margin=0.5)),
    "margin_ranking_loss": lambda o: _one(
        F.margin_ranking_loss(o[:, 0], o[:, 1], T["sign_n"], margin=0.1)
    ),
    "triplet_margin_loss": lambda o: _one(
        F.triplet_margin_loss(o[:, :3], o[:, 3:6], o[:, 5:8], margin=0.5)
    ),
    "cosine_embedding_loss": lambda o: _one(
        F.cosine_embedding_loss(o[:, :H], o[:, H:], T["sign_n"], margin=0.1)
    ),
    "poisson_nll_loss": lambda o: _one(F.poisson_nll_loss(o, T["counts"])),
    "poisson_nll_loss_full": lambda o: _one(
        F.poisson_nll_loss(o.exp(), T["counts"], log_input=False, full=True)
    ),
    "soft_margin_loss": lambda o: _one(F.soft_margin_loss(o, T["sign"])),
    "multi_margin_loss": lambda o: _one(F.multi_margin_loss(o, T["cls"])),
    "multilabel_margin_loss": lambda o: _one(F.multilabel_margin_loss(o, T["multilabel"])),
    "bce_with_logits": lambda o: _one(F.binary_cross_entropy_with_logits(o, T["prob"])),
    "bce_with_logits_pos_weight": lambda o: _one(
        F.binary_cross_entropy_with_logits(o, T["prob"], pos_weight=torch.full((C,), 2.0))
    ),
    "binary_cross_entropy": lambda o: (
        (torch.sigmoid(o),), F.binary_cross_entropy(torch.sigmoid(o), T["prob"])
    ),
    "nll_loss": lambda o: _one(F.nll_loss(F.log_softmax(o, -1), T["cls"])),
    "cross_entropy": lambda o: _one(F.cross_entropy(o, T["cls"])),
    "cross_entropy_label_smoothing": lambda o: _one(
        F.cross_entropy(o, T["cls"], label_smoothing=0.1)
    ),
    "cross_entropy_probs": lambda o: _one(F.cross_entropy(o, T["dist"])),
    "gaussian_nll_loss": lambda o: _one(F.gaussian_nll_loss(o, T["real"], T["var"])),
}


def _ctc(o):
    # o: (N=6, C=8) reshaped as T=3 steps x batch 2 x 8 classes (class 0 = blank).
    log_probs = F.log_softmax(o.reshape(3, 2, C), -1)
    targets = torch.tensor([[1, 2], [3, 3]])
    loss = F.ctc_loss(log_probs, targets, torch.tensor([3, 3]), torch.tensor([2, 1]))
    return (log_probs,), loss


LOSS_CASES["ctc_loss"] = _ctc


# -- other composites -----------------------------------------------------------------------
class Bilinear(nn.Module):
    """nn.Bilinear on the (float32) inputs themselves, then a Linear."""

    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(5, 5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        y = self.bil(x, x.flip(0))
        z = self.out(y)
        return (y, z), z.float().pow(2).mean()


class BilinearAfterLinear(nn.Module):
    """nn.Bilinear on low-precision Linear outputs with float32 weights.

    Native CPU autocast raises here ("All tensors must have the same dtype"); under the
    CUDA table bilinear is a promote op, so it runs (in float32).
    """

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(5, 4)
        self.bil = nn.Bilinear(6, 4, 3)

    def forward(self, x):
        y = self.bil(self.a(x), self.b(x))
        return (y,), y.float().pow(2).mean()


class Tensordot(nn.Module):
    """torch.tensordot on (float32) inputs and a weight, then a Linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 7))
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        y = torch.tensordot(x, self.w, dims=([1], [0]))
        z = self.out(y)
        return (y, z), z.float().pow(2).mean()


class TensordotAfterLinear(nn.Module):
    """tensordot of a low-precision Linear output with a float32 weight.

    Native CPU autocast raises here ("both inputs should have same dtype"); under the
    CUDA table tensordot is a promote op, so it runs (in float32).
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 12)
        self.w = nn.Parameter(torch.randn(3, 4, 7))

    def forward(self, x):
        h = self.lin(x).reshape(-1, 3, 4)
        y = torch.tensordot(h, self.w, dims=([1, 2], [0, 1]))
        return (h, y), y.float().pow(2).mean()


class Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 12)
        self.w = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        h = self.lin(x).reshape(-1, 3, 4)
        y = torch.einsum("bij,jk->bik", h, self.w)
        z = torch.einsum("bik,bjk->bij", y, y)
        return (y, z), z.float().mean()


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        h = self.lin(x)
        y = F.rms_norm(h, (8,), self.w, eps=1e-6)
        y2 = nn.functional.rms_norm(h, (8,))
        return (h, y, y2), (y.float() * y2.float()).sum()


class Interpolate(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.mode = mode

    def forward(self, x):
        h = self.conv(x)
        kw = {} if self.mode == "nearest" else {"align_corners": False}
        y = F.interpolate(h, scale_factor=2, mode=self.mode, **kw)
        return (h, y), y.float().pow(2).mean()


class Cells(nn.Module):
    """Three steps of an rnn cell; ``project`` puts a Linear before the cell (its input
    is then low precision), otherwise the cell sees the float32 inputs directly."""

    def __init__(self, kind, project=True):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(5, 5) if project else nn.Identity()
        self.cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}[kind](5, 7)
        self.out = nn.Linear(7, 3)

    def forward(self, xs):
        h = c = None
        outs = []
        for x in xs:
            i = self.inp(x)
            if self.kind == "lstm":
                h, c = self.cell(i) if h is None else self.cell(i, (h, c))
            else:
                h = self.cell(i) if h is None else self.cell(i, h)
            outs.append(h)
        y = self.out(h)
        return (*outs, c if c is not None else h, y), y.float().pow(2).mean()


class Normalize(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(5, 8)

    def forward(self, x):
        u, v = self.a(x), self.b(x)
        n = F.normalize(u, dim=-1)
        s = F.cosine_similarity(u, v, dim=-1)
        return (n, s), n.float().sum() * 0.1 + s.float().sum()


def _module_case(factory, inputs, seed=6):
    def make():
        torch.manual_seed(seed)
        module = factory()
        x = inputs()

        def step(m):
            return m(x)

        return module, step

    return make


OP_CASES = {
    "bilinear": _module_case(Bilinear, lambda: torch.randn(N, 5)),
    "tensordot": _module_case(Tensordot, lambda: torch.randn(N, 5)),
    "einsum": _module_case(Einsum, lambda: torch.randn(N, 5)),
    "rms_norm": _module_case(RMSNorm, lambda: torch.randn(N, 5)),
    "interpolate_nearest": _module_case(lambda: Interpolate("nearest"), lambda: torch.randn(2, 2, 5, 5)),
    "interpolate_bilinear": _module_case(lambda: Interpolate("bilinear"), lambda: torch.randn(2, 2, 5, 5)),
    "lstm_cell": _module_case(lambda: Cells("lstm"), lambda: list(torch.randn(3, 4, 5))),
    "lstm_cell_fp32_input": _module_case(
        lambda: Cells("lstm", project=False), lambda: list(torch.randn(3, 4, 5))
    ),
    "gru_cell": _module_case(lambda: Cells("gru"), lambda: list(torch.randn(3, 4, 5))),
    "gru_cell_fp32_input": _module_case(
        lambda: Cells("gru", project=False), lambda: list(torch.randn(3, 4, 5))
    ),
    "rnn_cell": _module_case(lambda: Cells("rnn"), lambda: list(torch.randn(3, 4, 5))),
    "rnn_cell_fp32_input": _module_case(
        lambda: Cells("rnn", project=False), lambda: list(torch.randn(3, 4, 5))
    ),
    "normalize_cosine_similarity": _module_case(Normalize, lambda: torch.randn(N, 5)),
}

ALL_CASES = {
    **MODEL_CASES,
    **{f"loss_{k}": _loss_case(v) for k, v in LOSS_CASES.items()},
    **OP_CASES,
}

# Cases whose numbers are not bit-exact against native, with the reason; they are compared
# with the per-dtype tolerance of RTOL instead (dtypes must still match exactly). Every
# other case is bit-exact (same cast points, same kernels, same weight-cast cache). A case
# that differs must be added here with its reason, never silently loosened.
NOT_BIT_EXACT: dict[str, str] = {
    "bilinear": (
        "native CPU autocast casts the bmm that the _trilinear kernel calls from C++, below "
        "autograd and inside a kernel no mode can enter; ours runs that bmm in float32, so "
        "the result has native's dtype (float32) with higher-precision values"
    ),
}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_matches_native(name):
    make = ALL_CASES[name]
    if name in NOT_BIT_EXACT:
        check_pair(make, exact=False, n_terms=64)
    else:
        check_pair(make)


@pytest.mark.parametrize("name", sorted(n for n in ALL_CASES if n not in NOT_BIT_EXACT))
def test_forward_and_backward_make_natives_calls_in_order(name, aten_calls):
    # Call for call what native makes, the casts in native's argument order: what a
    # dispatch mode sees, and the graph torch.compile captures (test_compile.py).
    module, step = ALL_CASES[name]()
    seen = {}
    for who, region in (("native", native), ("ours", ours)):
        seen[who] = aten_calls(lambda: run(copy.deepcopy(module), step, region()))
    ours_calls, native_calls = seen["ours"], seen["native"]
    first = next((i for i, (a, b) in enumerate(zip(ours_calls, native_calls)) if a != b), None)
    assert ours_calls == native_calls, (
        f"call {first}: ours {ours_calls[first] if first is not None else None}, "
        f"native {native_calls[first] if first is not None else None}; "
        f"{len(ours_calls)} calls against {len(native_calls)}")


# Mixed-precision inputs to ops that the CUDA table promotes (native CPU autocast raises
# on these, so they have no CPU reference and run under the CUDA policy only).
CUDA_POLICY_ONLY_CASES = {
    "bilinear_after_linear": _module_case(BilinearAfterLinear, lambda: torch.randn(N, 5)),
    "tensordot_after_linear": _module_case(TensordotAfterLinear, lambda: torch.randn(N, 5)),
}


@pytest.mark.parametrize("name", sorted(ALL_CASES) + sorted(CUDA_POLICY_ONLY_CASES))
def test_cuda_policy_on_cpu_runs(name):
    if name == "loss_binary_cross_entropy":
        # Banned under the CUDA policy, as natively on CUDA.
        module, step = ALL_CASES[name]()
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            run(module, step, ours_cuda_policy())
        return
    check_cuda_policy({**ALL_CASES, **CUDA_POLICY_ONLY_CASES}[name])


@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 24),
    need_weights=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gpt_random_shapes_match_native(batch, seq, need_weights, seed):
    check_pair(make_gpt(need_weights=need_weights, batch=batch, seq=seq, seed=seed))
