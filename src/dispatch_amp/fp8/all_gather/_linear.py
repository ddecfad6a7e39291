"""The fp8 ``linear`` of a weight that arrived in fp8: the input is quantized, the weight is not.

``fp8/_linear.py``'s ``fp8_linear`` with the gathered fp8 weight and its scales as its
``QuantizedWeight``: the same gemms, and the call records for the weight what a cast of
the whole high-precision weight would have recorded (its amax, the scale used, the
saturated values: ``_shard_cast.py`` gathered them), so the recipe's state is the same as
with a high-precision all-gather. Here: the checks that a call can take that weight.
"""

from __future__ import annotations

import torch

from ... import _torch_compat
from .._gathered import MODE_BLOCKS, MODE_ROWS, MODE_TENSOR, GatheredFp8Weight
from .._linear import QuantizedWeight, fp8_linear

__all__ = ["gathered_linear"]

_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _refuse(name, why: str, fix: str):
    raise RuntimeError(f"fp8 all-gathered weight {name!r}: {why}; {fix}")


def gathered_linear(x: torch.Tensor, weight: GatheredFp8Weight, bias: torch.Tensor | None, recipe,
                    out_dtype: torch.dtype, phase: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight FSDP2 all-gathered in fp8, as fp8 gemms
    under ``recipe`` (the one it was gathered for), output in ``out_dtype``.

    A call the fp8 path would run in high precision (shapes that are not multiples of 16,
    a ``filter_fn`` that declines it, an input that is not float32/bfloat16/float16)
    raises: the high-precision weight is not there.

    Example::

        # called by amp.autocast's fp8 handler for a GatheredFp8Weight; not by hand
        y = gathered_linear(x, model[0].weight, model[0].bias, recipe, torch.bfloat16, "forward")
    """
    box = weight._gathered
    plan = box.plan
    name = plan.name
    if plan.recipe is not recipe:
        _refuse(name, f"it was gathered for {plan.recipe!r}, and this region's recipe is another ({recipe!r})",
                "run the model under the recipe given to all_gather_in_fp8")
    if torch.compiler.is_compiling():
        _refuse(name, "torch.compile cannot trace a model whose weights are all-gathered in fp8 yet",
                "turn fp8 all-gather off (handle.remove()) to compile")
    if (x.dtype not in _SOURCE_DTYPES or x.device != box.data.device
            or (bias is not None and bias.shape != (weight.shape[0],))):
        _refuse(name, f"called with an input of {x.dtype} on {x.device}", "give it a floating input on the weight's device")
    names = plan.site.names or [None]
    if not all(recipe.eligible(n, x.shape, weight.shape) for n in names):
        _refuse(name, f"a call with input {tuple(x.shape)} is not an fp8 call under this recipe (every gemm dimension "
                      f"a multiple of 16, and the recipe's filter_fn), and its high-precision weight was never gathered",
                "pad the batch, or keep this weight out of all_gather_in_fp8 (its filter_fn)")
    layout = plan.rule.granularity
    rows = layout == "row"
    if box.mode != {"row": MODE_ROWS, "block": MODE_BLOCKS}.get(layout, MODE_TENSOR):
        _refuse(name, f"it holds the backward's layout ({box.mode}) in a forward call (a recomputation under "
                      f"activation checkpointing with RowwiseScaling)",
                "do not checkpoint the layers of fp8 all-gathered weights under RowwiseScaling")
    weight_q = QuantizedWeight(box.data, box.sc, box.amax, box.saturated, shown=box.shown if rows else None)
    return fp8_linear(x, weight, bias, recipe, out_dtype, plan.site, phase, weight_q=weight_q)


_torch_compat.keep_out_of_dynamo(globals(), __name__)
