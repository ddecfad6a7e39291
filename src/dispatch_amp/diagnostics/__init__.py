"""The diagnostics part: looking at a run.

``census.py``: :class:`PrecisionCensus`, what ran in which precision and what the casts
cost. ``tracing.py``: :class:`NonFiniteTracer`, the first op that made an inf or a nan.
``plotting.py``: :func:`plot_training`, loss and loss scale over a run (needs matplotlib).

Example::

    >>> import torch
    >>> from dispatch_amp.diagnostics import PrecisionCensus
    >>> a = torch.ones(2, 2)
    >>> with PrecisionCensus() as census:
    ...     _ = torch.mm(a, a)
    >>> census.calls
    1
"""

from .census import PrecisionCensus
from .plotting import plot_training
from .tracing import NonFiniteTracer

__all__ = ["PrecisionCensus", "NonFiniteTracer", "plot_training"]
