"""Capture a qmoe module's forward and backward in CUDA graphs (`qmoe.graph.capture`).

qmoe's grouped path has static shapes and no host synchronisation, so a whole dropless MoE
layer can be captured once and replayed with new inputs (and so new routing). What a plain
`torch.cuda.make_graphed_callables` would miss, this handles:
- `MoELayer.aux_loss` becomes a graph output (and gets its gradient through the graph);
- delayed scaling: the forward slots a replay records into are registered with the enclosing
  `qmoe.autocast` region at every call, so their scales still update when the region exits
  (backward slots update inside the backward graph, as in eager);
- the warm-up iterations that capture needs leave no trace: delayed-scaling histories and
  scales, and a router's expert bias, are restored afterwards.

    layer = qmoe.nn.MoELayer(...).cuda()
    with qmoe.autocast(recipe=Float8BlockScaling()):
        graphed = qmoe.graph.capture(layer, (torch.randn(T, H, device="cuda", requires_grad=True),))
    for x in batches:
        with qmoe.autocast(recipe=Float8BlockScaling()):
            y = graphed(x)
        (y.float().square().mean() + layer.aux_loss).backward()

Capture and call inside the same recipe; inputs keep the sample's shapes and dtypes.
"""
from __future__ import annotations

import torch
from torch import nn

from qmoe.quant import delayed


class _Observer:
    """Snapshots every delayed-scaling state before it first changes; notes forward registrations."""

    def __init__(self):
        self.snapshots: dict[int, tuple] = {}
        self.forward_states: dict[int, delayed.DelayedScalingState] = {}

    def see(self, state, forward: bool) -> None:
        if id(state) not in self.snapshots and state.scale is not None:
            self.snapshots[id(state)] = (state, state.scale.clone(), state.amax_history.clone(),
                                         state.nonfinite_steps.clone())
        if forward:
            self.forward_states[id(state)] = state

    def __enter__(self):
        delayed._OBSERVERS.append(self)
        return self

    def __exit__(self, *exc):
        delayed._OBSERVERS.remove(self)
        return False

    def restore(self) -> None:
        for state, scale, hist, nonfinite in self.snapshots.values():
            state.scale.copy_(scale)
            state.amax_history.copy_(hist)
            state.nonfinite_steps.copy_(nonfinite)


class _WithAuxLoss(nn.Module):
    """Returns (y, aux_loss) so the auxiliary loss is a graph output with a gradient path."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        y = self.layer(*args)
        return y, self.layer.aux_loss


class GraphedModule:
    """Callable replaying the captured graphs; see `capture`."""

    def __init__(self, graphed, module: nn.Module, forward_states, has_aux: bool):
        self._graphed, self.module, self._forward_states, self._has_aux = graphed, module, forward_states, has_aux

    def __call__(self, *args):
        out = self._graphed(*args)
        for state in self._forward_states:  # the replay recorded their amaxes: update at region exit
            delayed.register_forward(state)
        if self._has_aux:
            y, aux = out
            self.module.aux_loss = aux
            return y
        return out


def capture(module: nn.Module, sample_args: tuple, num_warmup_iters: int = 3) -> GraphedModule:
    """Capture `module`'s forward and backward as CUDA graphs; returns a callable replaying them.

    module: a qmoe module on a CUDA device (MoELayer, GroupedMLP, Linear, ...), in train mode.
    sample_args: tuple of CUDA tensors with the shapes, dtypes and requires_grad of later calls.
    Call inside the `qmoe.autocast` region (recipe) the replays will use.
    """
    if not isinstance(sample_args, tuple) or not sample_args:
        raise TypeError("sample_args must be a non-empty tuple of tensors, e.g. (x,)")
    devices = {a.device.type for a in sample_args if isinstance(a, torch.Tensor)}
    if devices != {"cuda"}:
        raise ValueError(f"CUDA graphs need CUDA tensors; sample_args are on {sorted(devices)}")
    params = list(module.parameters())
    if any(p.device.type != "cuda" for p in params):
        raise ValueError("move the module to the GPU (module.cuda()) before capturing it")
    has_aux = hasattr(module, "aux_loss")
    target = _WithAuxLoss(module) if has_aux else module
    buffers = {name: b.clone() for name, b in module.named_buffers()}  # e.g. the router's expert bias
    with _Observer() as observer:
        graphed = torch.cuda.make_graphed_callables(target, sample_args, num_warmup_iters=num_warmup_iters)
    observer.restore()
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    return GraphedModule(graphed, module, list(observer.forward_states.values()), has_aux)
