"""The op tables behind ``Policy.for_device``: which aten ops run in which precision.

Data only. Each table maps a cast kind to aten op names (an ``OpOverloadPacket`` name,
so every overload of the op follows the rule). ``policy.py`` resolves every name against
``torch.ops.aten`` when it is imported, so a typo fails loudly, and rejects a name that
appears under two kinds.

The engine registers a kernel of its own in the dispatcher for each op of the policy in
force (see "Note: the engine lives in the dispatcher" in ``_engine.py``), where native
autocast registers its own: at composite ops before they decompose (``linear``,
``conv2d``, ``layer_norm``) and at primitive ops called from anywhere, inside C++ kernels
and torch's Python composites too. So the tables hold native's names, and an op such as
``einsum`` that native leaves alone is left alone: the ``bmm`` inside it is cast.

Kinds:
    lower             run in the context's dtype (float16 / bfloat16)
    fp32              run in float32
    fp32_unless_dtype run in float32 unless the caller passed an explicit ``dtype=``
    promote           run in the widest floating dtype among the inputs
    banned            refuse, with an error naming the safe alternative
    fp8               run as scaled fp8 gemms under the region's fp8 recipe
                      (``autocast(..., fp8=recipe)``) where the call is a linear, else
                      as ``lower``; only the ops in ``FP8_OPS``

The lists follow native autocast (the ops registered for the AutocastCUDA, AutocastCPU,
AutocastXPU and AutocastMPS dispatch keys), as the union over the supported torch versions.
Intel GPUs (``xpu``) get CUDA's lists less the entries only CUDA registers; Apple GPUs
(``mps``) have a table of their own, in which the ops CUDA runs in float32 unless the caller
passes ``dtype=`` (``softmax``, ``sum``...) are plain float32, as native registers them. Native's table changes
from version to version: CUDA ``rms_norm`` is registered from torch 2.12 on, torch
2.14 removed ``cholesky`` and ``qr`` and added ``linalg_matrix_sqrth``, and only CUDA builds
register ``_cudnn_rnn``. So the built-in policy is built from the installed torch
(``policy._builtin_table``): a name is kept only where the installed torch registers it
for the device's key. ``tests/autocast/test_native_registrations.py`` walks the installed
torch's registrations and checks every entry against a user-facing call.
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
# grad_input, grad_weight) the fp8 path implements. linear, and the matmuls libraries
# write a linear with (transformers' Conv1D: addmm(bias, x, w); x @ w.t()): their calls
# whose right operand is a 2-D parameter or its transpose (fp8/_reach.py). The other
# calls of an fp8 op run as ``lower``.
FP8_OPS = ("linear", "addmm", "mm", "matmul")

CUDA_TABLE = {
    LOWER: (
        # convolutions
        "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
        # matrix products
        "linear", "matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr",
        "addbmm", "baddbmm", "einsum", "chain_matmul", "linalg_multi_dot", "linalg_vecdot",
        # recurrent cells
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
        # cuDNN's RNN (CUDA builds only): native casts its weights, input and states to
        # float16 whatever the region's dtype and lays the weights out in one flat buffer;
        # _cudnn_rnn.py does the same
        "_cudnn_rnn",
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
        "layer_norm", "native_layer_norm", "group_norm",
        "rms_norm", "frobenius_norm", "nuclear_norm",
        # distances and similarities
        "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp",
        # linear algebra (torch 2.14 and later)
        "linalg_matrix_sqrth",
        # losses
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits",
        # (cross_entropy_loss is in no list: native leaves it to its C++ composite, whose
        # log_softmax gets the input's dtype, then nll_loss runs in float32.)
        # resampling
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    FP32_UNLESS_DTYPE: (
        "softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum",
        # norm's overloads without a dtype argument get one appended (native's
        # fp32_append_dtype wrapper), the others keep their explicit dtype
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
        "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm",
        "_addmm_activation", "linalg_vecdot",
        "mkldnn_rnn_layer",
        "scaled_dot_product_attention", "_native_multi_head_attention",
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
        "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
        "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
        "multilabel_margin_loss", "multilabel_margin_loss_forward",
    ),
    FP32_UNLESS_DTYPE: (),
    PROMOTE: ("cat", "stack", "index_copy"),
    BANNED: (),
}

# Intel GPUs: native registers AutocastXPU from the same lists as AutocastCUDA, except the
# entries CUDA registers on their own: cuDNN's convolutions and linalg_matrix_sqrth.
_CUDA_ONLY = frozenset({"cudnn_convolution", "cudnn_convolution_transpose", "linalg_matrix_sqrth", "_cudnn_rnn"})
XPU_TABLE = {kind: tuple(n for n in names if n not in _CUDA_ONLY) for kind, names in CUDA_TABLE.items()}

# Apple GPUs (the AutocastMPS list of native autocast).
MPS_TABLE = {
    LOWER: (
        "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "convolution", "_convolution", "_mps_convolution",
        "linear", "matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr",
        "addbmm", "baddbmm", "einsum", "chain_matmul", "linalg_multi_dot",
        "lstm_cell", "scaled_dot_product_attention", "prelu",
    ),
    FP32: (
        # Metal has no half-precision 3-D transposed convolution.
        "conv_transpose3d",
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus",
        "layer_norm", "native_layer_norm", "group_norm", "batch_norm",
        "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits",
        # CUDA's fp32_unless_dtype ops; MPS casts their inputs to float32 and keeps the
        # caller's dtype= argument, so an explicit dtype still decides the output.
        "softmax", "log_softmax",
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


# device type -> (table, native autocast's dispatch key for it)
DEVICE_TABLES = {
    "cuda": (CUDA_TABLE, "AutocastCUDA"),
    "cpu": (CPU_TABLE, "AutocastCPU"),
    "xpu": (XPU_TABLE, "AutocastXPU"),
    "mps": (MPS_TABLE, "AutocastMPS"),
}
