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

import contextlib
import contextvars
import dataclasses
import threading
import warnings
from dataclasses import dataclass

import torch

from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.validate import check_process_group
from qmoe.quant.delayed import close_forward_region, open_forward_region
from qmoe.quant.replay import recomputing, register_region
from qmoe.recipes import DelayedScaling, Recipe, recipe_from_config, recipe_to_config
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


@contextlib.contextmanager
def restored_region(state: AutocastState):
    """Run under `state` (a region's recipe, enabled flag and group) as it was when captured.

    Opens no forward region: `qmoe.checkpoint`'s recompute records no amax, so nothing would be
    left to update at its exit.
    """
    token = _STATE.set(state)
    _COMPILE_MIRROR.state = state
    try:
        yield
    finally:
        _STATE.reset(token)
        _COMPILE_MIRROR.state = _STATE.get()


register_region(autocast_state, restored_region)  # qmoe.checkpoint's recompute re-enters the forward's region


def refuse_foreign_recompute(module: str) -> None:
    """Raise when a qmoe module's forward runs inside a backward pass other than qmoe.checkpoint's.

    That is torch.utils.checkpoint recomputing it: without the forward's recipe region, its
    delayed-scaling scales and its expert bias, the recompute would quantize differently (or not
    at all) and the gradients would silently differ from the step's.
    """
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1 or recomputing():
        return
    raise UnsupportedError(
        f"recomputing {module} in the backward pass (torch.utils.checkpoint)",
        why="torch.utils.checkpoint reruns the forward without the first run's qmoe.autocast recipe, "
            "delayed-scaling scales and expert bias, so its gradients would differ from the step's",
        fix="checkpoint with qmoe.checkpoint(function, *args, use_reentrant=...), which takes "
            "torch.utils.checkpoint.checkpoint's arguments and recomputes the same bits")


class RecipeState:
    """A module's quantizers, one set per recipe the module has run under.

    Recipes are frozen dataclasses, so equality compares every field: a same-class recipe with
    different fields is another recipe, with its own quantizers (and fresh delayed-scaling
    histories). Switching recipe for a while (an evaluation pass under another one) and back
    finds the first recipe's quantizers, histories and scales as they were.

    local_amax=True keeps every amax on its rank: no all-reduce over `amax_reduction_group`
    (delayed-scaling slots are built with reduce_amax=False, current-scaling weights are not
    reduced). Expert-parallel experts use it: slot g is a different expert on every rank.

    `state_dict()` / `load_state_dict()` carry what the quantizers keep from step to step (the
    delayed-scaling amax histories and scales), per recipe; modules put it in their own
    `state_dict()` through `get_extra_state`.
    """

    def __init__(self, roles=ROLES, local_amax: bool = False):
        self.roles = tuple(roles)
        self.local_amax = local_amax
        self.recipe: Recipe | None = None  # the last recipe `get` was asked for
        self._sets: list[tuple[Recipe, dict]] = []  # (recipe, its quantizers), first use first

    @property
    def quantizers(self) -> dict:
        """The last recipe's quantizers ({} before any)."""
        return self._find(self.recipe) or {} if self.recipe is not None else {}

    def _find(self, recipe: Recipe) -> dict | None:
        for known, quantizers in self._sets:
            if known is recipe or (type(known) is type(recipe) and known == recipe):
                return quantizers
        return None

    def get(self, recipe: Recipe, group=None) -> dict:
        if torch.compiler.is_compiling():
            # Compiled code builds its quantizers while tracing and keeps none: quantizers kept here
            # would make the previous call's recipe part of every graph's guards (one graph per
            # recipe *and* predecessor). Only delayed scaling's quantizers hold state, and they
            # refuse torch.compile.
            quantizers = self._build(recipe)
        else:
            quantizers = self._find(recipe)
            if quantizers is None:
                quantizers = self._build(recipe)
                self._sets.append((recipe, quantizers))
            self.recipe = recipe
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

    # ---- checkpoints
    def state_dict(self) -> dict:
        """{"version": 1, "recipes": [{"recipe": config dict, "quantizers": {role: tensors}}]}.

        Lists the recipes whose quantizers keep state (delayed scaling once it has quantized);
        stateless recipes rebuild identically from nothing and are left out.
        """
        entries = []
        for recipe, quantizers in self._sets:
            states = {role: q.state_dict() for role, q in quantizers.items()}
            if any(states.values()):
                entries.append({"recipe": recipe_to_config(recipe), "quantizers": states})
        return {"version": _STATE_VERSION, "recipes": entries}

    def load_state_dict(self, state: dict | None) -> list[Recipe]:
        """Restore `state_dict()`'s output (None: fresh state for every recipe).

        Returns the recipes whose state this module held and `state` lacks: they start fresh.
        """
        if state is not None and (not isinstance(state, dict) or state.get("version") != _STATE_VERSION
                                  or not isinstance(state.get("recipes"), list)):
            raise ValueError(f"not a qmoe recipe state (version {_STATE_VERSION}): {type(state).__name__} "
                             f"{sorted(state) if isinstance(state, dict) else ''}")
        held = [r for r, qs in self._sets if any(q.state_dict() for q in qs.values())]
        self._sets, self.recipe = [], None
        for entry in (state or {}).get("recipes", []):
            recipe = recipe_from_config(entry["recipe"])
            quantizers = self._build(recipe)
            for role, q in quantizers.items():
                q.load_state_dict(entry["quantizers"].get(role, {}))
            self._sets.append((recipe, quantizers))
        return [r for r in held if self._find(r) is None]


_STATE_VERSION = 1


def recipe_state_pre_hook(module, state_dict, prefix, *args, **kwargs) -> None:
    """load_state_dict pre-hook: a state_dict without the module's recipe state loads with a warning.

    Older checkpoints have no `_extra_state` entry; without this, strict loading would call it missing.
    """
    key = prefix + "_extra_state"
    if key not in state_dict:
        warnings.warn("qmoe: this state_dict has no recipe state (an older checkpoint?): delayed-scaling amax "
                      "histories and scales start fresh", UserWarning, stacklevel=4)
        state_dict[key] = None


def load_recipe_state(recipe_state: RecipeState, state) -> None:
    """A module's set_extra_state: restore, warning about recipes whose state starts fresh."""
    dropped = recipe_state.load_state_dict(state)
    if dropped and state is not None:  # (None: recipe_state_pre_hook has warned)
        names = ", ".join(recipe_to_config(r)["name"] for r in dropped)
        warnings.warn(f"qmoe: the loaded state_dict has no recipe state for {names}: its delayed-scaling amax "
                      f"histories and scales start fresh", UserWarning, stacklevel=3)
