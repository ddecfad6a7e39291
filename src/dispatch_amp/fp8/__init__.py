"""fp8 training as a kind of the policy: ``amp.autocast(..., fp8=recipe)`` on plain modules.

Inside ``amp.autocast(device_type, dtype=torch.bfloat16, fp8=recipe)`` every call the
policy marks ``fp8`` (by default ``F.linear``, which every ``nn.Linear`` and most custom
linear layers reach) runs as scaled fp8 gemms when its shapes are eligible; everything
else follows the region's policy and dtype, and fp8 gemm outputs are in the region's
dtype. No module is swapped: the recipe holds all fp8 state.

Recipes: :class:`CurrentScaling` (per tensor, from each tensor's own amax),
:class:`DelayedScaling` (per tensor, from an amax history per site),
:class:`RowwiseScaling` (one scale per row) and :class:`BlockScaling` (DeepSeek-V3's: one
scale per 1x128 tile of activations and gradients, per 128x128 block of weights).
docs/fp8.md, "Recipes" and "The rules", states every rule.

Example::

    recipe = amp.fp8.DelayedScaling().bind(model)
    with amp.autocast("cuda", dtype=torch.bfloat16, fp8=recipe):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    print(recipe.report_table())     # per site: amax, scale, saturated values
"""

from ._linear import fp8_linear
from .all_gather import Fp8AllGather, all_gather_in_fp8
from ._rules import fp8_max
from .recipes import BlockScaling, CurrentScaling, DelayedScaling, Format, Recipe, RowwiseScaling, SiteReport

__all__ = ["BlockScaling", "CurrentScaling", "DelayedScaling", "RowwiseScaling", "Recipe", "SiteReport", "Format",
           "fp8_linear", "fp8_max", "all_gather_in_fp8", "Fp8AllGather"]
