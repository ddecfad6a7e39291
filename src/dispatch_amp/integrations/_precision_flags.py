"""How our Lightning ``Trainer`` and ``Fabric`` read ``precision=``, ``accelerator=`` and
``plugins=``: which precisions become our plugins, on which device, and what is refused.

Shared by both; they pass in their own plugin classes, so this module imports no Lightning
(an accelerator object is read through Lightning's ``name()``/``is_available()``).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._devices import device_available
from ._half import TRUE_PRECISIONS, default_device

# Lightning's spellings of the mixed precisions, as its connectors unify them.
MIXED = {"16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed"}
# The autocast device types our plugins take.
_DEVICES = ("cpu", "cuda", "mps", "xpu")


def as_list(value: Any) -> list:
    """Lightning's ``plugins=``/``callbacks=`` argument as a list (None, one item, or a list/tuple).

    Example::

        >>> as_list(None), as_list("x"), as_list(("x", "y"))
        ([], ['x'], ['x', 'y'])
    """
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def our_precision(precision: Any) -> str | None:
    """The precision our plugins run for Lightning's ``precision`` argument, or None (Lightning's own).

    Example::

        >>> our_precision(16), our_precision("bf16-true"), our_precision("32-true")
        ('16-mixed', 'bf16-true', None)
    """
    try:
        if precision in MIXED:
            return MIXED[precision]
        return precision if precision in TRUE_PRECISIONS else None
    except TypeError:  # an unhashable precision: Lightning's to judge
        return None


def check_amp_keywords(precision: Any, ours: str | None, **amp: Any) -> None:
    """Refuse ``amp_*`` keywords (``amp_policy``, ``amp_fp8``, ``amp_scaler_options``,
    ``amp_opt_level``, ``amp_opt_overrides``) that the precision gives nothing to act on.

    Example::

        >>> check_amp_keywords("16-mixed", "16-mixed", amp_scaler_options={"init_scale": 8.0})
    """
    given = {k for k, v in amp.items() if v is not None}
    if ours not in MIXED.values() and "amp_scaler_options" in given:
        raise ValueError(f"amp_scaler_options applies to precision='16-mixed' or 'bf16-mixed', got precision={precision!r}")
    if ours not in TRUE_PRECISIONS and given & {"amp_opt_level", "amp_opt_overrides"}:
        raise ValueError(
            f"amp_opt_level/amp_opt_overrides apply to precision='16-true' or 'bf16-true' (weights "
            f"in 16 bits), got precision={precision!r}"
        )
    if ours is None and given & {"amp_policy", "amp_fp8"}:
        raise ValueError(
            f"amp_policy/amp_fp8 apply to precision='16-mixed', 'bf16-mixed', '16-true' or "
            f"'bf16-true', got precision={precision!r}"
        )


def autocast_device(owner: str, accelerator: Any) -> str | None:
    """The autocast device type of Lightning's ``accelerator`` argument (a name or an
    accelerator object), or None when this machine lacks that device: Lightning then
    raises its own error about the accelerator, before any plugin of ours exists.

    ``owner`` (``"Trainer"``, ``"Fabric"``) names the class in the error for an
    accelerator whose device cannot be told.

    Example::

        >>> autocast_device("Trainer", "cpu")
        'cpu'
    """
    if accelerator is None or (isinstance(accelerator, str) and accelerator == "auto"):
        return default_device()  # Lightning's choice: CUDA or MPS where there is one, else the CPU
    if isinstance(accelerator, str):
        name = accelerator.lower()
        if name == "gpu":  # Lightning takes MPS or CUDA for "gpu", never the CPU
            found = default_device()
            return None if found == "cpu" else found
        if name in _DEVICES:
            return name if device_available(name) else None
    elif callable(getattr(accelerator, "name", None)) and callable(getattr(accelerator, "is_available", None)):
        name = accelerator.name()  # a Lightning Accelerator object: CPUAccelerator() and so on
        if name in _DEVICES:
            return name if accelerator.is_available() else None
    raise ValueError(
        f"dispatch_amp's {owner} cannot tell the autocast device of accelerator={accelerator!r}: "
        f"pass accelerator='cpu', 'cuda', 'gpu', 'mps' or 'xpu' (or such an accelerator object), "
        f"or pass plugins=[MixedPrecision(precision, device)] to Lightning's own {owner}"
    )


def check_strategy(strategy: Any) -> None:
    """Refuse the strategies that take only Lightning's own precision plugins.

    Example::

        >>> check_strategy("ddp")
    """
    # Lightning's FSDP and DeepSpeed strategies take only their own precision plugins (the
    # FSDP strategy raises TypeError for any other): say so before Lightning does, with
    # the way out.
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    if name.lower().startswith(("fsdp", "deepspeed")):
        raise ValueError(
            f"strategy={strategy!r} runs only Lightning's own precision plugin for it, not "
            f"dispatch_amp's; use Lightning's own Trainer/Fabric with that strategy (Lightning's "
            f"AMP), or strategy='ddp' with this one"
        )


def precision_plugin_in(plugins: list, precision_base: type) -> Any:
    """The precision plugin among ``plugins`` (an instance of ``precision_base``), or None.

    Example::

        >>> precision_plugin_in([object()], int) is None
        True
    """
    return next((p for p in plugins if isinstance(p, precision_base)), None)


def reconcile(owner: str, precision: Any, plugin: Any, amp_keywords: list[str]) -> None:
    """``precision=`` given beside a precision plugin: accepted when both name the same
    precision (the plugin then runs), else a ``ValueError`` that says which to drop.

    ``amp_keywords``: the ``amp_*`` arguments given, which configure a plugin we build and
    so have nothing to act on beside the user's plugin.

    Example::

        >>> class Plugin: precision = "16-mixed"
        >>> reconcile("Trainer", 16, Plugin(), [])
    """
    named = getattr(plugin, "precision", None)
    if our_precision(precision) is None or our_precision(precision) != named:
        raise ValueError(
            f"{owner}(precision={precision!r}) was given together with plugins=[{plugin!r}], "
            f"which runs precision={named!r}: pass one of them (the plugin alone to keep its "
            f"options, or precision= alone)"
        )
    if amp_keywords:
        raise ValueError(
            f"{', '.join(amp_keywords)} configure the plugin this {owner} builds for precision=, but "
            f"plugins=[{plugin!r}] brings its own: set those options on that plugin instead"
        )


def warn_float16_on_cpu(owner: str, precision: Any) -> None:
    """Lightning turns ``"16-mixed"`` on CPU into bfloat16 with a warning; ours trains in float16: say so.

    Example::

        warn_float16_on_cpu("Trainer", "16-mixed")   # a UserWarning naming precision='bf16-mixed'
    """
    warnings.warn(
        f"{owner}(accelerator='cpu', precision={precision!r}): dispatch_amp trains in float16 with "
        f"its GradScaler on CPU, where Lightning's own {owner} would switch to precision='bf16-mixed' "
        f"(it has no float16 AMP on CPU). Pass precision='bf16-mixed' for bfloat16.",
        stacklevel=4,  # past route() and the Trainer's or Fabric's __init__: the user's call
    )


def route(owner: str, precision: Any, plugins: Any, options: dict[str, Any], precision_base: type,
          plugin_classes: tuple[type, type], amp: dict[str, Any]) -> tuple[Any, list, bool]:
    """What our ``owner`` hands Lightning's: ``(precision, plugins, device_missing)``.

    ``plugins``: Lightning's ``plugins=`` argument; ``options``: the other keywords of the
    call (``accelerator``, ``strategy``); ``precision_base``: Lightning's precision plugin
    class; ``plugin_classes``: our ``(MixedPrecision, HalfPrecision)`` for ``owner``;
    ``amp``: the ``amp_*`` keywords. ``device_missing``: the accelerator names a device
    this machine lacks, so no plugin was built and Lightning gets ``precision`` as given,
    to raise its own error about the accelerator.

    Example::

        >>> route("Trainer", "32-true", [], {}, object, (None, None), {})
        ('32-true', [], False)
    """
    ours = our_precision(precision)
    check_amp_keywords(precision, ours, **amp)
    plugins = as_list(plugins)
    given = precision_plugin_in(plugins, precision_base)
    if given is not None and precision is not None:
        reconcile(owner, precision, given, [k for k, v in amp.items() if v is not None])
        return None, plugins, False  # the plugin runs that precision
    if ours is None:
        return precision, plugins, False
    check_strategy(options.get("strategy", "auto"))
    device = autocast_device(owner, options.get("accelerator", "auto"))
    if device is None:
        return precision, plugins, True
    if ours == "16-mixed" and device == "cpu":
        warn_float16_on_cpu(owner, precision)
    mixed_cls, half_cls = plugin_classes
    if ours in MIXED.values():
        plugin = mixed_cls(ours, device, policy=amp.get("amp_policy"), scaler_options=amp.get("amp_scaler_options"),
                           fp8=amp.get("amp_fp8"))
    else:
        plugin = half_cls(ours, device, opt_level=amp.get("amp_opt_level") or "O3", policy=amp.get("amp_policy"),
                          fp8=amp.get("amp_fp8"), **dict(amp.get("amp_opt_overrides") or {}))
    return None, plugins + [plugin], False


def refuse_missing_device(owner: str, accelerator: Any) -> None:
    """Raised after Lightning accepted an accelerator :func:`route` found no device for
    (Lightning refuses those first; this keeps its precision from running in ours' place).

    Example::

        refuse_missing_device("Trainer", "gpu")   # RuntimeError
    """
    raise RuntimeError(
        f"{owner}(accelerator={accelerator!r}): dispatch_amp finds no such device here, yet Lightning "
        f"accepted it; pass plugins=[MixedPrecision(precision, device)] naming the device instead"
    )
