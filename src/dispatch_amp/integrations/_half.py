"""Lightning's true precisions (``"16-true"``, ``"bf16-true"``) carried by an opt level: what
the Trainer and Fabric plugins share.

With the opt level's defaults (O3: every weight in 16 bits, no loss scale) the plugins do
exactly what Lightning's ``HalfPrecision`` does. The level's options add what Lightning's
plugin lacks: ``keep_batchnorm_fp32``, fp32 master weights with a loss scale (O2), and the
forward inside ``dispatch_amp.autocast`` with a policy or an fp8 recipe.

Note: master weights under a framework
--------------------------------------
``amp.initialize`` sees the model and its optimizers together. A Lightning plugin casts the
model first (``convert_module``) and meets the optimizers later: the Trainer creates them
after the cast and hands them to ``connect``; Fabric's users create them before
``fabric.setup`` and the plugin never sees them until a step. So the cast here puts a *new*
16-bit ``Parameter`` into the module and keeps the original float32 ``Parameter`` object as
its master: an optimizer made before the cast (Fabric) already updates the masters, and its
state loads in float32; one made after it (the Trainer) holds the 16-bit parameters, which
:func:`swap_masters_into` replaces by their masters (state re-keyed) before its first step.
After the backward the 16-bit gradients move into the masters' float32 gradients, the
scaler unscales and checks those, the optimizer steps the masters, and the model gets their
rounded copies.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..autocast.context import autocast
from ..autocast.policy import Policy
from ..fp8.recipes import Recipe
from ..opt_levels import OptLevelProperties, _load_into_masters, _ModelAmp, _state_dict_fp32
from ..warning_types import AmpNumericsWarning

TRUE_PRECISIONS: dict[str, torch.dtype] = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
_BATCH_NORMS = nn.modules.batchnorm._BatchNorm


def true_precision_dtype(precision: str) -> torch.dtype:
    """The weight dtype of a Lightning true precision string.

    Example::

        >>> true_precision_dtype("bf16-true")
        torch.bfloat16
    """
    if precision not in TRUE_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not a true precision: use '16-true' (float16 weights) or "
            "'bf16-true' (bfloat16 weights); for float32 weights with autocast use '16-mixed' or "
            "'bf16-mixed' and dispatch_amp's MixedPrecision plugin"
        )
    return TRUE_PRECISIONS[precision]


def level_properties(precision: str, device: str, opt_level: str, **overrides: Any) -> OptLevelProperties:
    """The opt level behind a true precision: ``"O3"`` (Lightning's own behaviour) or ``"O2"``.

    Example::

        >>> p = level_properties("16-true", "cpu", "O2")
        >>> p.dtype, p.master_weights, p.keep_batchnorm_fp32, p.loss_scale
        (torch.float16, True, True, 'dynamic')
    """
    dtype = true_precision_dtype(precision)
    if opt_level not in ("O2", "O3"):
        raise ValueError(
            f"opt_level={opt_level!r} keeps the weights in float32, which precision={precision!r} "
            "casts: use opt_level='O3' (all weights in 16 bits) or 'O2' (16-bit weights, float32 "
            "master weights, dynamic loss scale), or precision='16-mixed'/'bf16-mixed' for "
            "float32 weights with autocast"
        )
    return OptLevelProperties.for_level(opt_level, device_type=device, dtype=dtype, **overrides)


class _HalfModel(_ModelAmp):
    """What the cast attached to the model (``model._dispatch_amp``): the level and the
    (16-bit parameter, float32 master) pairs."""

    def __init__(self, props: OptLevelProperties, masters_by_name: dict[str, nn.Parameter],
                 pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        super().__init__(props, masters_by_name)
        self.pairs = pairs


def _cast_tensors_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool,
                   master_weights: bool) -> dict[int, tuple[nn.Parameter, nn.Parameter]]:
    """Cast what ``module.to(dtype)`` casts (every floating parameter and buffer), batch norms
    left out when asked; ``id(16-bit parameter) -> (it, its float32 master)`` with masters."""
    pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    new_of: dict[int, nn.Parameter] = {}  # a tied parameter is replaced once, everywhere
    with torch.no_grad():
        for sub in module.modules():
            if keep_batchnorm_fp32 and isinstance(sub, _BATCH_NORMS):
                continue
            for name, p in sub._parameters.items():
                if p is None or not p.is_floating_point():
                    continue
                if not master_weights:
                    if p.dtype != dtype:
                        p.data = p.data.to(dtype)
                    continue
                low = new_of.get(id(p))
                if low is None:
                    if p.dtype == dtype:  # made in 16 bits (init_module): its master starts from it
                        low, master = p, nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    else:
                        low = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                        if p.dtype == torch.float32:
                            master = p
                            master.grad = None  # the masters' gradients come from grads_to_masters only
                        else:
                            master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    new_of[id(p)] = low
                    pairs[id(low)] = (low, master)
                sub._parameters[name] = low
            for name, b in sub._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    sub._buffers[name] = b.to(dtype)
    return pairs


def convert_module_(module: nn.Module, props: OptLevelProperties, stock_convert) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Cast ``module`` in place for the level; the (16-bit, master) pairs, empty without masters.

    With neither master weights nor float32 batch norms this is ``stock_convert(module)``
    (Lightning's ``module.to(dtype)``), so the default is Lightning's cast, bit for bit.
    Casting a module a second time (``trainer.validate`` after ``fit``) changes nothing.
    """
    seen = module.__dict__.get("_dispatch_amp")
    if seen is not None:
        if not isinstance(seen, _HalfModel):
            raise RuntimeError(
                f"this {type(module).__name__} was prepared by amp.initialize(); a precision plugin "
                "casts the model itself: pass the plain model"
            )
        if seen.props != props:
            raise RuntimeError(
                f"this {type(module).__name__} was cast for opt_level {seen.props.opt_level} "
                f"({seen.props.dtype}, master_weights={seen.props.master_weights}, "
                f"keep_batchnorm_fp32={seen.props.keep_batchnorm_fp32}); a plugin with other "
                "options cannot cast it again: build the model afresh, or use the same options"
            )
        return seen.pairs
    if not props.master_weights and not props.keep_batchnorm_fp32:
        stock_convert(module)
        return []
    by_id = _cast_tensors_(module, props.dtype, props.keep_batchnorm_fp32, props.master_weights)
    pairs = list(by_id.values())
    by_name = {name: by_id[id(p)][1] for name, p in module.named_parameters(remove_duplicate=False) if id(p) in by_id}
    module._dispatch_amp = _HalfModel(props, by_name, pairs)
    if pairs:
        # Checkpoints hold the float32 masters, and a load fills them unrounded.
        module.register_state_dict_post_hook(_state_dict_fp32)
        module.register_load_state_dict_pre_hook(_load_into_masters)
    return pairs


def swap_masters_into(optimizer: torch.optim.Optimizer, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Replace each 16-bit parameter in ``optimizer``'s groups by its master (state re-keyed, in float32).

    Example::

        >>> low = nn.Parameter(torch.ones(2, dtype=torch.float16)); master = nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([low], lr=0.1)
        >>> swap_masters_into(opt, [(low, master)])
        >>> opt.param_groups[0]["params"][0] is master
        True
    """
    master_of = {id(low): master for low, master in pairs}
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            master = master_of.get(id(p))
            if master is None:
                continue
            params[i] = master
            if p in optimizer.state:
                # Stepped or loaded before the swap: the state went through the 16-bit dtype.
                warnings.warn(
                    f"{type(optimizer).__name__} held state for a {p.dtype} parameter before its float32 "
                    "master took its place, so that state was stored in 16 bits; create the optimizer "
                    "before fabric.setup() (or load its state after the first step)",
                    AmpNumericsWarning, stacklevel=3,
                )
                state = optimizer.state.pop(p)
                optimizer.state[master] = {k: v.float() if torch.is_tensor(v) and v.dtype in TRUE_PRECISIONS.values() else v
                                           for k, v in state.items()}


def grads_to_masters(pairs: Iterable[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Move the 16-bit gradients into the masters' float32 gradients (added to any already there)."""
    for low, master in pairs:
        if low.grad is None:
            continue
        grad = low.grad.float()
        low.grad = None
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)


def masters_to_model(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Round the masters into the model's 16-bit parameters."""
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([low for low, _ in pairs], [master for _, master in pairs])


def default_device() -> str:
    """The device type a plugin made without ``device=`` uses: cuda, else mps, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


class LevelPrecision:
    """The part the Trainer and Fabric true-precision plugins share; put it before Lightning's class.

    Takes Lightning's ``precision`` plus the device and the opt level's options; the
    subclass supplies Lightning's own ``forward_context`` (the default dtype switch) and
    ``convert_module``, which this wraps.

    Example::

        class HalfPrecision(LevelPrecision, lightning_HalfPrecision): ...
    """

    def __init__(
        self,
        precision: str = "16-true",
        device: str | None = None,
        *,
        opt_level: str = "O3",
        keep_batchnorm_fp32: bool | None = None,
        master_weights: bool | None = None,
        loss_scale: float | str | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        patch_torch_functions: bool | None = None,
        policy: Policy | None = None,
        fp8: Recipe | None = None,
    ) -> None:
        true_precision_dtype(precision)
        super().__init__(precision)
        self.device = default_device() if device is None else device
        if (policy is not None or fp8 is not None) and patch_torch_functions is False:
            raise ValueError(
                "policy=/fp8= apply inside dispatch_amp.autocast, which patch_torch_functions=False "
                "turns off; drop one of them"
            )
        if patch_torch_functions is None and (policy is not None or fp8 is not None):
            patch_torch_functions = True
        self.props = level_properties(
            precision, self.device, opt_level, keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights, loss_scale=loss_scale, min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale, patch_torch_functions=patch_torch_functions,
        )
        self.policy = policy
        self.fp8 = fp8
        self.scaler = self.props.make_scaler()
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # of every module this plugin cast
        if self.props.patch_torch_functions:
            self._region()  # a bad device, policy or recipe fails here, not at the first step

    def _region(self) -> autocast:
        return autocast(self.device, self.props.dtype, policy=self.policy, fp8=self.fp8)

    @contextlib.contextmanager
    def _level_forward(self, stock_context):
        with stock_context:
            if self.props.patch_torch_functions:
                with self._region():
                    yield
            else:
                yield

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module for the level (Lightning's cast by default); see :func:`convert_module_`."""
        known = {id(low) for low, _ in self._pairs}
        self._pairs += [pair for pair in convert_module_(module, self.props, super().convert_module) if id(pair[0]) not in known]
        return module

    def _scaled_step(self, optimizer, **kwargs):
        """The scaler's step of the (master) parameters, skipped after inf/nan gradients; the
        scale updated; the model given the masters' rounded copies."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("a loss scale and the LBFGS optimizer are not compatible (its step re-runs the closure)")
        step_output = self.scaler.step(optimizer, **kwargs)
        if self.props.loss_scale == "dynamic":
            self.scaler.update()
        else:  # static: the scale stays, a step with inf/nan gradients is still skipped
            self.scaler.update(new_scale=self.props.loss_scale)
        masters_to_model(self._pairs)
        return step_output

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty without one)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` into the loss scaler."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        p = self.props
        extra = "" if self.policy is None else f", policy={self.policy.name!r}"
        extra += "" if self.fp8 is None else f", fp8={self.fp8!r}"
        return (f"{type(self).__name__}({self.precision!r}, {self.device!r}, opt_level={p.opt_level!r}, "
                f"master_weights={p.master_weights}, keep_batchnorm_fp32={p.keep_batchnorm_fp32}, "
                f"loss_scale={p.loss_scale!r}{extra})")
