"""The warning categories dispatch_amp raises, on the ground floor of the package.

Every module may import this one, and it imports nothing of ours, so a warning can be
raised from any level of the engine without an import circle.
"""

from __future__ import annotations

__all__ = ["AmpNumericsWarning", "CompileFallbackWarning", "CompiledEngineWarning"]


class AmpNumericsWarning(RuntimeWarning):
    """Category of the numerics warnings dispatch_amp raises (scale floor, repeated skips, ...).

    Filter them like any warning category.

    Example::

        >>> import warnings
        >>> warnings.simplefilter("error", AmpNumericsWarning)   # make them fatal in CI
    """


class CompileFallbackWarning(UserWarning):
    """``dispatch_amp.autocast`` with a policy of its own was entered inside a
    ``torch.compile``'d function, where Dynamo cannot trace it: the graph breaks there,
    and a function that opens the region in a ``with`` block runs eagerly (with our
    casts, so the numbers are right). Open the region around the compiled call instead;
    there everything compiles. (Under a built-in policy the region is traced.)

    Example::

        warnings.simplefilter("error", amp.CompileFallbackWarning)   # make it fatal
    """


class CompiledEngineWarning(UserWarning):
    """The compiled (C++) engine could not be built or loaded in this process, so the
    Python engine runs: the same casts, more host time per op. The message names the
    cause (no C++ compiler, no ninja, the compiler's first error lines, a cache directory
    that cannot be written) and its fix. It is issued once per process; nothing is
    retried until the next one. ``DISPATCH_AMP_ENGINE=python`` skips the attempt.

    Also issued, once, where a process has used more distinct policies than the compiled
    engine's table holds (64): regions under the later ones run on the Python engine.
    Equal policies share one entry, so a policy built once and reused never fills it.

    Example::

        warnings.simplefilter("error", amp.CompiledEngineWarning)   # require the compiled engine
    """
