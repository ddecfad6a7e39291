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
    "PrecisionPlan",
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
    "engine",
    "CompiledEngineWarning",
    "config",
    "policy_diff",
]

# Loading the subpackage ``autocast`` binds it here under that name; this import then
# rebinds ``autocast`` to the public context. That binding stays: a later import of one of
# the subpackage's modules finds the subpackage in sys.modules and binds nothing here.
from .autocast import (  # noqa: E402
    CompileFallbackWarning,
    Policy,
    PrecisionPlan,
    autocast,
    cast_cache,
    checkpoint,
    clear_autocast_cache,
    custom_bwd,
    custom_fwd,
    get_autocast_dtype,
    is_autocast_enabled,
)
from .scaler import AmpNumericsWarning, GradScaler, NonFiniteGradient, OptState, OverflowReport  # noqa: E402
from .diagnostics import NonFiniteTracer, PrecisionCensus, plot_training  # noqa: E402
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
from ._compiled import engine  # noqa: E402  (builds nothing at import: see _compiled/loader.py)
from .warning_types import CompiledEngineWarning  # noqa: E402
from . import config  # noqa: E402
from .config import policy_diff  # noqa: E402
from . import _pickled_paths  # noqa: E402

_pickled_paths.register(__name__)  # scalers and policies pickled before the parts existed
