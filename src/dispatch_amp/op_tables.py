"""The op tables behind ``Policy.for_device``: which aten ops run in which precision.

Data only. Each table maps a cast kind to aten op names (an ``OpOverloadPacket`` name,
so every overload of the op follows the rule). ``policy.py`` resolves every name against
``torch.ops.aten`` when it is imported, so a typo fails loudly, and rejects a name that
appears under two kinds.

One table serves both levels of the engine (see the note "cast where native casts" in
``_engine.py``):

- the function level (above autograd) looks up the user-facing call by its aten name:
  ``torch.mm``, ``Tensor.mm`` and ``F.linear`` reach ``mm`` and ``linear``; composite
  ops such as ``linear``, ``conv2d`` or ``cross_entropy_loss`` are cast whole, where
  native autocast casts them;
- the dispatch level (below autograd) sees ops after decomposition (``_softmax``,
  ``native_layer_norm``, ``convolution``...), which is why those names are listed too.

Kinds:
    lower             run in the context's dtype (float16 / bfloat16)
    fp32              run in float32
    fp32_unless_dtype run in float32 unless the caller passed an explicit ``dtype=``
    promote           run in the widest floating dtype among the inputs
    banned            refuse, with an error naming the safe alternative
    fp8               run as scaled fp8 gemms under the region's fp8 recipe
                      (``autocast(..., fp8=recipe)``); only the ops in ``FP8_OPS``

The lists follow native autocast (the ops registered for the AutocastCUDA, AutocastCPU,
AutocastXPU and AutocastMPS dispatch keys), as the union over the supported torch versions.
Intel GPUs (``xpu``) get CUDA's lists less the entries only CUDA registers; Apple GPUs
(``mps``) have a table of their own, in which the ops CUDA runs in float32 unless the caller
passes ``dtype=`` (``softmax``, ``sum``...) are plain float32, as native registers them. Native's table changes
from version to version: CUDA ``rms_norm`` is registered from torch 2.12 on, and torch
2.14 removed ``cholesky`` and ``qr`` and added ``linalg_matrix_sqrth``. So the built-in policy is
built from the installed torch (``policy._builtin_table``): a name native autocast
registers is kept only where the installed torch registers it for the device's key. The
names native never registers are in ``CUDA_OWN``, ``CPU_OWN`` and ``MPS_OWN``, each with
the native entry it follows. ``tests/test_native_registrations.py`` walks the installed torch's
registrations and checks every entry against a user-facing call.
"""

from enum import Enum


class CastKind(str, Enum):
    """How autocast treats one op. A ``str`` enum: a member equals its name as a string
    (``CastKind.LOWER == "lower"``), so tables written with strings (from JSON, say) are
    turned into members when a policy is built, and the engine compares members by
    identity.

    Example::

        >>> CastKind("fp32") is CastKind.FP32
        True
    """

    LOWER = "lower"
    FP32 = "fp32"
    FP32_UNLESS_DTYPE = "fp32_unless_dtype"
    PROMOTE = "promote"
    BANNED = "banned"
    FP8 = "fp8"

    def __repr__(self) -> str:
        return repr(self.value)

    __str__ = str.__str__


LOWER = CastKind.LOWER
FP32 = CastKind.FP32
FP32_UNLESS_DTYPE = CastKind.FP32_UNLESS_DTYPE
PROMOTE = CastKind.PROMOTE
BANNED = CastKind.BANNED
FP8 = CastKind.FP8

KINDS = tuple(CastKind)

# The ops a policy may mark fp8: a gemm with a 2-D weight, whose three gemms (output,
# grad_input, grad_weight) the fp8 path implements.
FP8_OPS = ("linear",)

CUDA_TABLE = {
    LOWER: (
        # convolutions (composite entry points and what they decompose into)
        "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
        # matrix products
        "linear", "matmul", "linalg_matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr",
        "addbmm", "baddbmm", "einsum", "chain_matmul", "linalg_multi_dot", "linalg_vecdot",
        # recurrent cells and layers (cuDNN's RNN casts its flattened weights itself)
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm", "gru", "rnn_tanh", "rnn_relu",
        # (CUDA builds also register _cudnn_rnn, which native casts to float16 and
        # re-flattens; it is not listed. Under the built-in CUDA policy the layers above it
        # are left to native whole (_routing.Routes); a policy of one's own casts them whole.)
        # attention
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        # misc
        "prelu",
    ),
    FP32: (
        # pointwise ops that need range or precision
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus",
        # normalizations (composite names and their decompositions)
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
        "rms_norm", "_fused_rms_norm", "frobenius_norm", "nuclear_norm",
        # distances and similarities
        "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp",
        # linear algebra (torch 2.14 and later)
        "linalg_matrix_sqrth",
        # losses
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss_forward",
        "nll_loss2d", "nll_loss2d_forward", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits",
        # (cross_entropy_loss is in no list: native leaves it to its C++ composite, whose
        # log_softmax keeps the input's dtype; composites.py rebuilds it from the same calls.)
        # resampling
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    FP32_UNLESS_DTYPE: (
        "softmax", "_softmax", "log_softmax", "_log_softmax",
        "cumprod", "cumsum", "prod", "sum",
        "norm", "linalg_vector_norm", "linalg_matrix_norm",
    ),
    PROMOTE: (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
        "grid_sampler", "index_put", "tensordot", "scatter_add",
    ),
    BANNED: ("binary_cross_entropy",),
}

CPU_TABLE = {
    LOWER: (
        "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        # Native CPU registers only _convolution.deprecated; a rule covers every overload,
        # so torch._convolution with the current signature is cast too (native: fp32).
        # `convolution` is not registered on CPU: torch.convolution runs as given there.
        "_convolution",
        "linear", "matmul", "linalg_matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm",
        "_addmm_activation", "linalg_vecdot",
        # CPU autocast has no entry for these composites, but each one reaches mm/bmm
        # inside C++ where native casts above autograd and nothing else in it changes the
        # result dtype; casting them whole is where our function level can do the same.
        # (gru, gru_cell and lstm_cell are not here: natively their gates mix the bf16
        # matmuls with the fp32 state and come out fp32; bilinear reaches _trilinear,
        # which native leaves alone.)
        "einsum", "tensordot", "chain_matmul", "linalg_multi_dot", "inner",
        "mkldnn_rnn_layer", "lstm", "rnn_tanh", "rnn_relu", "rnn_tanh_cell", "rnn_relu_cell",
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_native_multi_head_attention",
        "prelu",
    ),
    FP32: (
        # pooling and padding
        "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
        "max_unpool2d", "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d",
        "reflection_pad1d", "reflection_pad2d",
        "replication_pad1d", "replication_pad2d", "replication_pad3d",
        # sampling
        "grid_sampler", "grid_sampler_2d", "grid_sampler_3d", "_grid_sampler_2d_cpu_fallback",
        # reductions and statistics
        "prod", "quantile", "nanquantile", "trace", "cdist",
        # complex numbers and spectra
        "polar", "view_as_complex", "stft",
        "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn",
        "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn",
        "fft_hfft", "fft_ihfft",
        # linear algebra
        "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr",
        "ormqr", "pinverse", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
        "linalg_cholesky", "linalg_cholesky_ex", "linalg_cond", "linalg_eig", "linalg_eigh",
        "linalg_eigvals", "linalg_eigvalsh", "linalg_householder_product", "linalg_inv",
        "linalg_inv_ex", "linalg_lstsq", "linalg_matrix_rank", "linalg_qr", "linalg_solve",
        "linalg_svd", "linalg_svdvals", "linalg_tensorinv", "linalg_tensorsolve",
        "linalg_matrix_sqrth",
        # quantization
        "fake_quantize_per_tensor_affine",
        # losses
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "cross_entropy_loss",
        "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
        "nll_loss2d_forward", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
        "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
        "multilabel_margin_loss", "multilabel_margin_loss_forward",
    ),
    FP32_UNLESS_DTYPE: (),
    PROMOTE: ("cat", "stack", "index_copy"),
    BANNED: (),
}

# The names of each table that native autocast does not register for the device's key,
# mapped to the native entry each one follows. An aten op that a registered composite
# reaches after it decomposes (``_fused_rms_norm`` under ``rms_norm``) is cast only where
# that composite is registered: where native leaves the composite alone (torch 2.11 has
# no CUDA rms_norm), it leaves what the composite reaches alone too. ``None``: a
# composite cast whole on our own account (native casts the matmuls inside it), kept
# wherever torch has the op.
CUDA_OWN = {
    "linalg_matmul": "matmul",
    "lstm": None, "gru": None, "rnn_tanh": None, "rnn_relu": None,
    "native_group_norm": "group_norm",
    "_fused_rms_norm": "rms_norm",
    "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss2d",
    "_softmax": "softmax", "_log_softmax": "log_softmax",
}

CPU_OWN = {
    "linalg_matmul": "matmul",
    "einsum": None, "tensordot": None, "chain_matmul": None, "linalg_multi_dot": None,
    "inner": None, "lstm": None, "rnn_tanh": None, "rnn_relu": None,
    "rnn_tanh_cell": None, "rnn_relu_cell": None,
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss2d",
}

# Intel GPUs: native registers AutocastXPU from the same lists as AutocastCUDA, except the
# entries CUDA registers on their own: cuDNN's convolutions and linalg_matrix_sqrth.
_CUDA_ONLY = frozenset({"cudnn_convolution", "cudnn_convolution_transpose", "linalg_matrix_sqrth"})
XPU_TABLE = {kind: tuple(n for n in names if n not in _CUDA_ONLY) for kind, names in CUDA_TABLE.items()}
XPU_OWN = dict(CUDA_OWN)

# Apple GPUs (the AutocastMPS list of native autocast).
MPS_TABLE = {
    LOWER: (
        "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "convolution", "_convolution", "_mps_convolution",
        "linear", "matmul", "linalg_matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr",
        "addbmm", "baddbmm", "einsum", "chain_matmul", "linalg_multi_dot",
        "lstm_cell", "scaled_dot_product_attention", "prelu",
    ),
    FP32: (
        # Metal has no half-precision 3-D transposed convolution.
        "conv_transpose3d",
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus",
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
        "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss_forward",
        "nll_loss2d", "nll_loss2d_forward", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "cross_entropy_loss",
        # CUDA's fp32_unless_dtype ops; MPS casts their inputs to float32 and keeps the
        # caller's dtype= argument, so an explicit dtype still decides the output.
        "softmax", "_softmax", "log_softmax", "_log_softmax",
        "cumprod", "cumsum", "prod", "sum", "linalg_vector_norm", "linalg_matrix_norm",
    ),
    FP32_UNLESS_DTYPE: (),
    PROMOTE: (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
        "grid_sampler", "index_put", "tensordot", "scatter_add",
    ),
    # binary_cross_entropy is not banned on MPS: native leaves it alone there.
    BANNED: (),
}

MPS_OWN = {
    "linalg_matmul": "matmul",
    "native_group_norm": "group_norm",
    "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss2d",
    "cross_entropy_loss": None,
    "_softmax": "softmax", "_log_softmax": "log_softmax",
}

# device type -> (table, names of ours in it, native autocast's dispatch key for it)
DEVICE_TABLES = {
    "cuda": (CUDA_TABLE, CUDA_OWN, "AutocastCUDA"),
    "cpu": (CPU_TABLE, CPU_OWN, "AutocastCPU"),
    "xpu": (XPU_TABLE, XPU_OWN, "AutocastXPU"),
    "mps": (MPS_TABLE, MPS_OWN, "AutocastMPS"),
}
