"""The autocast part: the ``autocast`` context, its policies and the engine behind them.

``dispatch_amp.autocast`` is the context itself (the class in ``context.py``), not this
package: the top package's ``__init__`` rebinds that name once this package is imported.
Reach the modules with ``from dispatch_amp.autocast import context`` or ``from
dispatch_amp.autocast.policy import Policy``; ``import dispatch_amp.autocast.context as m``
walks attributes down from ``dispatch_amp``, finds the class and raises ImportError (see
"Layout" in docs/design.md).

Modules: ``context.py`` (the region), ``policy.py`` and ``op_tables.py`` (which op runs in
which precision), ``custom_function.py`` (``custom_fwd``/``custom_bwd``),
``checkpoint.py`` (recomputation under the forward's policy), ``plan.py`` (precision by
module path: ``PrecisionPlan``), and the engine: ``_engine.py``
(regions; its notes explain the design), ``_dispatch_key.py`` and ``_kernels.py`` (kernels
in the dispatcher), ``_routing.py`` and ``_handlers.py`` (one handler per cast kind),
``_casting.py``, ``_cast_cache.py``, ``_cudnn_rnn.py``, ``_fp8_handler.py``,
``_torch_checkpoint.py``, ``_tokens.py``, ``_state.py`` and ``_tracing_path.py`` (under
``torch.compile``).

Example::

    >>> import torch
    >>> from dispatch_amp.autocast import Policy, autocast
    >>> with autocast("cpu", policy=Policy.for_device("cpu").with_ops(fp32=["mm"])):
    ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
    torch.float32
"""

from ._cast_cache import cast_cache
from .checkpoint import checkpoint
from .context import (
    CompileFallbackWarning,
    autocast,
    clear_autocast_cache,
    get_autocast_dtype,
    is_autocast_enabled,
)
from .custom_function import custom_bwd, custom_fwd
from .plan import PrecisionPlan
from .policy import Policy

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
]
