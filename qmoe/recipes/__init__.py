"""Quantization recipes (NUMERICS.md) and their config files."""
from qmoe.contracts.formats import ScaleMode
from qmoe.recipes.config import recipe_from_config, recipe_to_config
from qmoe.recipes.recipe import (ROLES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                                 MXFP8BlockScaling, NVFP4BlockScaling, Recipe)

__all__ = ["Format", "ScaleMode", "Recipe", "ROLES", "DelayedScaling", "Float8CurrentScaling",
           "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "recipe_from_config",
           "recipe_to_config"]
