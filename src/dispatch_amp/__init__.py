"""dispatch-amp: automatic mixed precision for PyTorch, in readable Python and Triton.

Switch from native AMP by changing one import::

    import dispatch_amp as amp

    with amp.autocast("cpu"):          # bf16 on CPU, fp16 on CUDA
        loss = loss_fn(model(x), y)
    loss.backward()
"""

__version__ = "0.1.0"

__all__ = [
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "clear_autocast_cache",
    "cast_cache",
    "CompileFallbackWarning",
    "Policy",
    "custom_fwd",
    "custom_bwd",
    "checkpoint",
    "GradScaler",
    "OptState",
    "PrecisionCensus",
    "NonFiniteTracer",
    "initialize",
    "scale_loss",
    "master_params",
    "loss_scalers",
    "state_dict",
    "load_state_dict",
    "OptLevelProperties",
    "AmpNumericsWarning",
    "OverflowReport",
    "NonFiniteGradient",
    "plot_training",
    "patch_torch",
    "fp8",
]

from .autocast import (  # noqa: E402
    CompileFallbackWarning,
    autocast,
    clear_autocast_cache,
    get_autocast_dtype,
    is_autocast_enabled,
)
from .policy import Policy  # noqa: E402
from ._cast_cache import cast_cache  # noqa: E402
from .checkpoint import checkpoint  # noqa: E402
from .custom_function import custom_bwd, custom_fwd  # noqa: E402
from .grad_scaler import GradScaler, OptState  # noqa: E402
from .scaler_diagnostics import AmpNumericsWarning, NonFiniteGradient, OverflowReport  # noqa: E402
from .plotting import plot_training  # noqa: E402
from .census import PrecisionCensus  # noqa: E402
from .tracing import NonFiniteTracer  # noqa: E402
from .opt_levels import (  # noqa: E402
    OptLevelProperties,
    initialize,
    load_state_dict,
    loss_scalers,
    master_params,
    scale_loss,
    state_dict,
)
from .torch_patch import patch_torch  # noqa: E402
from . import fp8  # noqa: E402
