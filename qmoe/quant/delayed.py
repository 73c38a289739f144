"""Delayed scaling state: an amax history and a scale per quantizer slot (NUMERICS.md).

A quantize call uses the current scale and records max|x| in the newest history entry; the
update (reduce over ranks, roll, new scale) runs when the outermost `qmoe.autocast` region
exits (forward slots) or after the backward pass (backward slots). Regions are tracked with
ContextVars that `qmoe.autocast` opens, so this layer never imports the one above it.
"""
from __future__ import annotations

import contextvars

import torch

from qmoe.dispatch import DELAYED_SCALING
from qmoe.quant.replay import active_log

# Slots that recorded an amax inside the current outermost autocast region (None outside one).
_PENDING_FORWARD: contextvars.ContextVar[list | None] = contextvars.ContextVar("qmoe_pending_forward",
                                                                               default=None)
# Backward slots waiting for the end of their backward pass, per autograd graph task: a reentrant
# checkpoint runs its backward as a task nested in the outer one, and a pass that raised never
# reaches its end (its slots keep the amaxes they recorded, folded into their next update).
_PENDING_BACKWARD: dict[int, list[tuple["DelayedScalingState", object]]] = {}
_MAX_PENDING_TASKS = 64  # more live tasks than any nesting needs: the oldest are passes that raised
# Watchers (qmoe.graph.capture) told about every state before it changes and every forward
# registration, so a capture can restore state after its warm-up and re-register at replay.
_OBSERVERS: list = []


def _observe(state: "DelayedScalingState", forward: bool = False) -> None:
    for obs in _OBSERVERS:
        obs.see(state.parent or state, forward)


class DelayedScalingState:
    """History [L] (or [L, G] for a grouped slot), scale [] (or [G]) and nonfinite_steps [] (or [G],
    int32: steps whose amax was inf or NaN, which the update leaves out) of one quantizer slot."""

    def __init__(self, fmt_max: float, history_len: int, margin: int, algo: str, reduce_amax: bool):
        self.fmt_max, self.history_len, self.margin = fmt_max, history_len, margin
        self.algo, self.reduce_amax = algo, reduce_amax
        self.scale: torch.Tensor | None = None
        self.amax_history: torch.Tensor | None = None
        self.nonfinite_steps: torch.Tensor | None = None
        # counts the updates: the update kernel rewrites `scale` in place without bumping its version
        # counter, so what reuses a result quantized with the scale (qmoe.quant.weight_cache) asks this
        self.updates = 0

    parent: "DelayedScalingState | None" = None

    def ensure(self, device: torch.device, num_groups: int | None) -> None:
        """Create fresh state (scale 1, zero history) or move it; the slot shape is fixed once made."""
        if self.parent is not None:
            if self.scale.device != device:
                raise ValueError(f"this group slot's state is on {self.scale.device}, the tensor on {device}")
            return
        shape = () if num_groups is None else (num_groups,)
        if self.scale is None:
            self.scale = torch.ones(shape, dtype=torch.float32, device=device)
            self.amax_history = torch.zeros((self.history_len, *shape), dtype=torch.float32, device=device)
            self.nonfinite_steps = torch.zeros(shape, dtype=torch.int32, device=device)
        elif tuple(self.scale.shape) != shape:
            have = "one tensor" if self.scale.dim() == 0 else f"{self.scale.shape[0]} groups"
            want = "one tensor" if num_groups is None else f"{num_groups} groups"
            raise ValueError(f"this delayed-scaling quantizer keeps state for {have} but was asked to quantize "
                             f"{want}; use one quantizer (recipe.quantizer(role)) per use")
        elif self.scale.device != device:
            self.scale = self.scale.to(device)
            self.amax_history = self.amax_history.to(device)
            self.nonfinite_steps = self.nonfinite_steps.to(device)

    def slot(self, g: int, num_groups: int) -> "DelayedScalingState":
        """Group g's slot of a grouped state, as a state whose tensors are views into this one.

        Lets the split path quantize each group on its own while recording into, and reading
        the scale of, the same per-group history the grouped path uses.
        """
        child = DelayedScalingState(self.fmt_max, self.history_len, self.margin, self.algo, self.reduce_amax)
        child.parent = self
        child.scale, child.amax_history = self.scale[g], self.amax_history[:, g]
        child.nonfinite_steps = self.nonfinite_steps[g]
        return child

    def scale_in_force(self) -> torch.Tensor:
        """A copy of the scale this quantize call uses; a checkpoint's recompute gets the first run's."""
        log = active_log()
        if log is None:
            return self.scale.clone()
        return log.keep(self.parent or self, self.scale.clone)

    def record(self, amax: torch.Tensor) -> None:
        """Fold this call's amax into the newest history entry (max over calls in one step; inf and
        NaN are kept, so the update knows the step was not finite)."""
        _observe(self)
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.to(self.amax_history.dtype))

    def update(self) -> None:
        """Roll the window and recompute the scale; slots whose newest amax is 0 stay as they are,
        slots whose newest amax is not finite only count it (NUMERICS.md "Delayed scaling")."""
        _observe(self)
        (self.parent or self).updates += 1
        DELAYED_SCALING.pick("update_amax_history", self.amax_history)(
            self.amax_history, self.scale, self.fmt_max, self.margin, self.algo, self.nonfinite_steps)


def _world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """MAX all-reduce of `amax` over `group` in place (a no-op without a group of > 1 rank); returns it.

    Every rank of `group` must call it, in the same order, with a tensor of the same shape.
    """
    if group is not None and _world_size(group) > 1:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def update_delayed_scaling(states: list[DelayedScalingState], group=None) -> None:
    """Reduce the newest amaxes (MAX over `group`, one collective for all slots) and update every slot."""
    states = list(dict.fromkeys(s for s in states if s.scale is not None))  # dedupe, keep order
    if not states:
        return
    reduce = [s for s in states if s.reduce_amax]
    if reduce and group is not None and _world_size(group) > 1:
        import torch.distributed as dist

        flat = torch.cat([s.amax_history[0].reshape(-1) for s in reduce])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        i = 0
        for s in reduce:
            n = s.amax_history[0].numel()
            s.amax_history[0] = flat[i:i + n].reshape(s.amax_history[0].shape)
            i += n
    for s in states:
        s.update()


def register_forward(state: DelayedScalingState) -> None:
    state = state.parent or state
    _observe(state, forward=True)
    pending = _PENDING_FORWARD.get()
    if pending is not None:
        pending.append(state)


def open_forward_region() -> contextvars.Token:
    return _PENDING_FORWARD.set([])


def close_forward_region(token: contextvars.Token, group=None) -> None:
    pending = _PENDING_FORWARD.get()
    _PENDING_FORWARD.reset(token)
    update_delayed_scaling(pending or [], group)


def in_forward_region() -> bool:
    return _PENDING_FORWARD.get() is not None


def register_backward(state: DelayedScalingState, group=None) -> None:
    """Schedule a backward slot's update for the end of the running backward pass.

    Outside a backward pass (a direct quantize call) the slot is updated at once.
    """
    state = state.parent or state
    task = torch._C._current_graph_task_id()
    pending = _PENDING_BACKWARD.get(task)
    if pending is not None:
        pending.append((state, group))
        return
    while len(_PENDING_BACKWARD) >= _MAX_PENDING_TASKS:
        del _PENDING_BACKWARD[min(_PENDING_BACKWARD)]
    _PENDING_BACKWARD[task] = [(state, group)]
    try:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: flush_backward(task))
    except RuntimeError:
        flush_backward(task)


def flush_backward(task: int) -> None:
    pending = _PENDING_BACKWARD.pop(task, [])
    by_group: dict[int, tuple[object, list]] = {}
    for state, group in pending:
        by_group.setdefault(id(group), (group, []))[1].append(state)
    for group, states in by_group.values():
        update_delayed_scaling(states, group)
