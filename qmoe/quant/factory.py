"""The one switch from (recipe, role) to a quantizer (STYLE.md: nothing else asks which recipe)."""
from __future__ import annotations

from qmoe.contracts.formats import FP8_BLOCK
from qmoe.quant.quantizer import (Float8BlockQuantizer, Float8CurrentQuantizer, Float8DelayedQuantizer,
                                  MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from qmoe.recipes.recipe import check_role, register_quantizer_factory


def make_quantizer(recipe, role: str) -> Quantizer:
    """A fresh quantizer for `role` ("input", "weight", "grad_output") under `recipe`."""
    check_role(role)
    if isinstance(recipe, DelayedScaling):
        return Float8DelayedQuantizer(role, recipe.element_format(role), recipe.amax_history_len, recipe.margin,
                                      recipe.amax_compute_algo, recipe.reduce_amax)
    if isinstance(recipe, Float8CurrentScaling):
        return Float8CurrentQuantizer(role, recipe.element_format(role), recipe.power_2_scale, recipe.amax_epsilon)
    if isinstance(recipe, Float8BlockScaling):
        rows = FP8_BLOCK if role == "weight" else 1  # 128x128 weight tiles, 1x128 activation/gradient rows
        return Float8BlockQuantizer(role, recipe.element_format(role), rows, recipe.power_2_scale,
                                    recipe.amax_epsilon)
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(role, recipe.element_format(role), recipe.scale_mode)
    if isinstance(recipe, NVFP4BlockScaling):
        return NVFP4Quantizer(role,
                              block_2d=role == "weight" and not recipe.disable_2d_quantization,
                              rht=role != "weight" and not recipe.disable_rht,
                              stochastic=role == "grad_output" and not recipe.disable_stochastic_rounding)
    raise ValueError(f"not a qmoe recipe: {recipe!r}; use one of qmoe.recipes' recipe classes")


register_quantizer_factory(make_quantizer)
