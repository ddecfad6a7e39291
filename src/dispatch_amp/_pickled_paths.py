"""The module paths that pickles made before the package had parts still name.

A pickle records each class (and each function its objects reduce to) by its module's
path: a ``GradScaler`` saved whole (``torch.save(scaler)``, or inside a precision plugin a
framework pickles) names ``dispatch_amp.grad_scaler``, ``dispatch_amp.scaler_config`` and
``dispatch_amp.scaler_diagnostics``, a ``Policy`` names ``dispatch_amp.policy``, a
``CastKind`` ``dispatch_amp.op_tables``, a ``PrecisionCensus`` ``dispatch_amp.census`` and
a ``NonFiniteTracer`` ``dispatch_amp.tracing``: where those modules were before they moved
into ``scaler/``, ``autocast/`` and ``diagnostics/``. Each old path is bound in
``sys.modules`` to the module that holds those names now, so such pickles still load (new
ones name the new paths). The other moved modules define no class a user's objects hold,
so they get no old path. Code imports the new paths; the old ones exist for pickles only.

The old ``dispatch_amp.autocast`` module needs no entry: its path is now the ``autocast``
subpackage, which exports the same public names.
"""

from __future__ import annotations

import sys
from types import ModuleType

from .autocast import op_tables, policy
from .diagnostics import census, tracing
from .scaler import config, diagnostics, grad_scaler

__all__ = ["OLD_PATHS", "register"]

# Old module name (under the package) -> the module that holds its picklable names now.
OLD_PATHS: dict[str, ModuleType] = {
    "grad_scaler": grad_scaler,
    "scaler_config": config,
    "scaler_diagnostics": diagnostics,
    "policy": policy,
    "op_tables": op_tables,
    "census": census,
    "tracing": tracing,
}


def register(package: str) -> None:
    """Binds each old path under ``package`` to its module, where nothing holds it yet.

    Example::

        >>> import sys
        >>> register("dispatch_amp")
        >>> sys.modules["dispatch_amp.scaler_config"] is sys.modules["dispatch_amp.scaler.config"]
        True
    """
    for old, module in OLD_PATHS.items():
        sys.modules.setdefault(f"{package}.{old}", module)
