"""`qmoe.autocast`: which recipe quantizes the GEMMs inside a region, and per-module recipe state.

State lives in a ContextVar, so nesting restores the outer region and threads/tasks do not
leak into each other. Delayed-scaling forward slots are updated (reduced over
`amax_reduction_group`, rolled, rescaled) when the outermost region exits.

torch.compile cannot read a ContextVar, so every region also mirrors its state into a
thread-local that compiled code reads (and guards on: entering a region with another recipe
recompiles rather than reusing a graph built for the old one). The two agree except for
asyncio tasks interleaving regions on one thread, where compiled code sees the thread's
latest region.
"""
from __future__ import annotations

import contextvars
import dataclasses
import threading
from dataclasses import dataclass

import torch

from qmoe.contracts.validate import check_process_group
from qmoe.quant.delayed import close_forward_region, open_forward_region
from qmoe.recipes import DelayedScaling, Recipe
from qmoe.recipes.recipe import ROLES


@dataclass(frozen=True)
class AutocastState:
    recipe: Recipe | None = None
    enabled: bool = False
    amax_reduction_group: object = None
    depth: int = 0

    @property
    def active_recipe(self) -> Recipe | None:
        """The recipe to quantize with, or None for high precision."""
        return self.recipe if self.enabled else None


_OUTSIDE = AutocastState()
_STATE: contextvars.ContextVar[AutocastState] = contextvars.ContextVar("qmoe_autocast", default=_OUTSIDE)
_COMPILE_MIRROR = threading.local()  # .state: this thread's latest _STATE, for torch.compile


def autocast_state() -> AutocastState:
    """The autocast state in force here (recipe None / enabled False outside any region)."""
    if torch.compiler.is_compiling():
        return getattr(_COMPILE_MIRROR, "state", _OUTSIDE)
    return _STATE.get()


class autocast:  # noqa: N801 - named like torch.autocast
    """Quantize qmoe modules' GEMMs with `recipe` inside the region.

    >>> with qmoe.autocast(recipe=Float8CurrentScaling()):
    ...     y = linear(x)

    recipe: a qmoe.recipes recipe (default DelayedScaling(), as in TransformerEngine).
    enabled: False computes in high precision (an inner region can switch quantization off).
    amax_reduction_group: torch.distributed group over which delayed-scaling amaxes are
    all-reduced (MAX) at the exit of the outermost region, so every rank uses the same scales;
    current scaling all-reduces its weights' amaxes over it at each quantization. Expert-parallel
    experts (`MoELayer(ep_group=...)`) keep their amaxes local.
    """

    def __init__(self, recipe: Recipe | None = None, enabled: bool = True, amax_reduction_group=None):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a qmoe.recipes recipe, got {type(recipe).__name__}; "
                            f"use qmoe.recipes.recipe_from_config for dicts and files")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        check_process_group("amax_reduction_group", amax_reduction_group)
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self.enabled, self.group = enabled, amax_reduction_group
        self._tokens: list = []

    def __enter__(self):
        outer = _STATE.get()
        region = open_forward_region() if outer.depth == 0 else None
        group = self.group if self.group is not None else outer.amax_reduction_group
        state = AutocastState(self.recipe, self.enabled, group, outer.depth + 1)
        self._tokens.append((_STATE.set(state), region, group))
        _COMPILE_MIRROR.state = state
        return self

    def __exit__(self, *exc):
        token, region, group = self._tokens.pop()
        _STATE.reset(token)
        _COMPILE_MIRROR.state = _STATE.get()
        if region is not None:
            close_forward_region(region, group)
        return False


class RecipeState:
    """A module's quantizers for the active recipe; rebuilt whenever the recipe changes.

    Recipes are frozen dataclasses, so equality compares every field: a same-class recipe with
    different fields also rebuilds (and resets delayed-scaling histories).

    local_amax=True keeps every amax on its rank: no all-reduce over `amax_reduction_group`
    (delayed-scaling slots are built with reduce_amax=False, current-scaling weights are not
    reduced). Expert-parallel experts use it: slot g is a different expert on every rank.
    """

    def __init__(self, roles=ROLES, local_amax: bool = False):
        self.roles = tuple(roles)
        self.local_amax = local_amax
        self.recipe: Recipe | None = None
        self.quantizers: dict = {}

    def get(self, recipe: Recipe, group=None) -> dict:
        if torch.compiler.is_compiling():
            # Compiled code builds its quantizers while tracing and keeps none: quantizers kept here
            # would make the previous call's recipe part of every graph's guards (one graph per
            # recipe *and* predecessor). Only delayed scaling's quantizers hold state, and they
            # refuse torch.compile.
            quantizers = self._build(recipe)
        else:
            if recipe != self.recipe or type(recipe) is not type(self.recipe):
                self.recipe = recipe
                self.quantizers = self._build(recipe)
            quantizers = self.quantizers
        if self.local_amax:
            group = None
        for q in quantizers.values():
            if hasattr(q, "amax_reduction_group"):
                q.amax_reduction_group = group
        return quantizers

    def _build(self, recipe: Recipe) -> dict:
        if self.local_amax and getattr(recipe, "reduce_amax", False):
            recipe = dataclasses.replace(recipe, reduce_amax=False)
        return {role: recipe.quantizer(role) for role in self.roles}
