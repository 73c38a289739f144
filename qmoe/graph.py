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

Gradient accumulation: with `keep_weights=True` (modules built with `cache_quantized_weights`)
the step is captured twice (`qmoe.quant.capture_weights`): a graph that quantizes the weights
and keeps them, replayed for the first call after the weights change (an optimizer step, a
load, `qmoe.quant.clear_weight_caches`) or a delayed-scaling scale does (the exit of the
outermost `qmoe.autocast` region), and one that reuses them, replayed for the calls after.
Delayed scaling thus reuses the weights when one region spans the micro-batches of a step.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from qmoe.quant import delayed
from qmoe.quant.weight_cache import capture_weights, weight_caches


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


class _Target(nn.Module):
    """What is captured: the module's call, plus its auxiliary loss as a graph output with a
    gradient path. A wrapper of its own, so the module itself is never modified (torch's capture
    replaces the forward of the module it is given)."""

    def __init__(self, layer: nn.Module, has_aux: bool):
        super().__init__()
        self.layer, self.has_aux = layer, has_aux

    def forward(self, *args):
        y = self.layer(*args)
        return (y, self.layer.aux_loss) if self.has_aux else y


class GraphedModule:
    """Callable replaying the captured graphs; see `capture`."""

    def __init__(self, graphed, module: nn.Module, forward_states, has_aux: bool, reuse=None):
        self._graphed, self.module, self._forward_states, self._has_aux = graphed, module, forward_states, has_aux
        self._reuse = reuse  # keep_weights: the graph reading the weights `_graphed` keeps
        self._kept_at = None  # what the weights were known by when `_graphed` last ran
        # the graphs hold these parameters' storage: the same tensors at every call
        self._params, self._caches = list(module.parameters()), weight_caches(module)
        self._own_grads: list = [None] * len(self._params)  # weak refs to the gradients copied by _keep_grads

    def _keep_grads(self) -> None:
        """Give each parameter a gradient of its own before the next replay can overwrite it.

        A backward replay hands each parameter's gradient over in the graph's static buffer, and
        autograd keeps that very buffer as `.grad` when there was none: the next backward replay
        would overwrite it, and accumulating into it would double the new gradient. So a
        gradient not copied here yet (the first micro-batch's, or one set by the caller) is
        copied once; accumulation then adds into the copy.
        """
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None or (self._own_grads[i] is not None and self._own_grads[i]() is g):
                continue
            p.grad = g.clone()
            self._own_grads[i] = weakref.ref(p.grad)

    def _weights_now(self) -> tuple:
        """What the kept weights are known by on the host: the parameters' versions and addresses,
        the caches' clears and their quantizers' stamps (a delayed-scaling update)."""
        return (tuple((p._version, p.data_ptr()) for p in self._params)
                + tuple((cache.clears, cache.graph_stamp()) for cache in self._caches))

    def __call__(self, *args):
        self._keep_grads()
        graphed = self._graphed
        if self._reuse is not None:
            now = self._weights_now()
            if now == self._kept_at:
                graphed = self._reuse
            self._kept_at = now
        out = graphed(*args)
        for state in self._forward_states:  # the replay recorded their amaxes: update at region exit
            delayed.register_forward(state)
        if self._has_aux:
            y, aux = out
            self.module.aux_loss = aux
            return y
        return out


def capture(module: nn.Module, sample_args: tuple, num_warmup_iters: int = 3,
            keep_weights: bool = False) -> GraphedModule:
    """Capture `module`'s forward and backward as CUDA graphs; returns a callable replaying them.

    module: a qmoe module on a CUDA device (MoELayer, GroupedMLP, Linear, ...), in train mode.
    sample_args: tuple of CUDA tensors with the shapes, dtypes and requires_grad of later calls.
    keep_weights: capture twice, so calls between two changes of the weights quantize them once
    (see the module docstring); needs modules built with `cache_quantized_weights=True`. Run
    each call's backward before the next call, as one graph needs anyway (its outputs and saved
    tensors are the graph's own buffers, rewritten by the next replay). Gradients accumulate
    over calls as in eager: a call first copies any parameter gradient that still lives in a
    graph's buffer (`GraphedModule._keep_grads`: one copy per optimizer step when accumulating).
    Call inside the `qmoe.autocast` region (recipe) the replays will use.
    """
    if not isinstance(sample_args, tuple) or not sample_args:
        raise TypeError("sample_args must be a non-empty tuple of tensors, e.g. (x,)")
    if keep_weights and not any(getattr(m, "cache_quantized_weights", False) for m in module.modules()):
        raise ValueError("capture(keep_weights=True) keeps the weights of modules built with "
                         "cache_quantized_weights=True, and this module has none: build it with that option "
                         "or capture with keep_weights=False")
    devices = {a.device.type for a in sample_args if isinstance(a, torch.Tensor)}
    if devices != {"cuda"}:
        raise ValueError(f"CUDA graphs need CUDA tensors; sample_args are on {sorted(devices)}")
    params = list(module.parameters())
    if any(p.device.type != "cuda" for p in params):
        raise ValueError("move the module to the GPU (module.cuda()) before capturing it")
    has_aux = hasattr(module, "aux_loss")
    buffers = {name: b.clone() for name, b in module.named_buffers()}  # e.g. the router's expert bias
    # keep_weights: one pool for both graphs, as a call's backward runs before the next call
    pool = torch.cuda.graph_pool_handle() if keep_weights else None
    graphs = []
    with _Observer() as observer:
        for role in ("keep", "reuse") if keep_weights else (None,):
            with capture_weights(role) if role else contextlib.nullcontext():
                graphs.append(torch.cuda.make_graphed_callables(_Target(module, has_aux), sample_args,
                                                                num_warmup_iters=num_warmup_iters, pool=pool))
    observer.restore()
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    return GraphedModule(graphs[0], module, list(observer.forward_states.values()), has_aux,
                         graphs[1] if keep_weights else None)
